"""shmloaderd: the per-node shmloader daemon (see daemon/README or docs/architecture.md)."""

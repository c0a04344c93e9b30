"""Adapters for the training stacks people use: DCP (``dcp``) and accelerate (``accelerate``).

Each is a small object over a :class:`~shmloader.ShmLoader` that puts every
rank's own state where the framework keeps one copy per key (NOTE [per-rank
state in frameworks] in ``shmloader.integrations.dcp``). Importing this package
imports neither framework.
"""

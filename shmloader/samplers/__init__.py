"""The samplers: ``ShardedSampler`` / ``ShardedBatchSampler`` (one shard per data-parallel
replica) and ``BalancedBatchSampler`` (token-balanced batches); ``shmloader`` exports them."""

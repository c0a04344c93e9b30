"""shmloader: one DataLoader per sequence-parallel group, batches shared once per node.

Public API: :class:`ShmLoader`, :class:`Config`, :class:`ShardedSampler` (with
:class:`ShardedBatchSampler` and :func:`dp_topology_from_group`) and the
exceptions in :mod:`shmloader.errors`.
"""

from .config import Config
from .errors import (
    ConfigError,
    LeaderError,
    PeerLostError,
    ShmCapacityError,
    ShmLoaderError,
    TopologyMismatchError,
    UnsupportedBatchError,
)
from .loader import ShmLoader
from .sampler import ShardedBatchSampler, ShardedSampler, dp_topology_from_group

__all__ = [
    "Config",
    "ConfigError",
    "LeaderError",
    "PeerLostError",
    "ShardedBatchSampler",
    "ShardedSampler",
    "ShmCapacityError",
    "ShmLoader",
    "ShmLoaderError",
    "TopologyMismatchError",
    "UnsupportedBatchError",
    "dp_topology_from_group",
]

__version__ = "0.1.0"

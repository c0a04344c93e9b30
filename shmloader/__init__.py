"""shmloader: one DataLoader per sequence-parallel group, batches shared once per node.

Public API: :class:`ShmLoader`, :class:`Config`, :class:`ShardedSampler` and the
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

__all__ = [
    "Config",
    "ConfigError",
    "LeaderError",
    "PeerLostError",
    "ShmCapacityError",
    "ShmLoader",
    "ShmLoaderError",
    "TopologyMismatchError",
    "UnsupportedBatchError",
]

__version__ = "0.1.0"

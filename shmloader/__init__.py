"""shmloader: one DataLoader per sequence-parallel group, batches shared once per node.

Public API: :class:`ShmLoader`, :class:`Config`, :class:`ShardedSampler` (with
:class:`ShardedBatchSampler` and :func:`dp_topology_from_group`) and the
exceptions in :mod:`shmloader.errors`.

Names that need torch are imported lazily (PEP 562), so the light modules
(``segment``, ``admin``, the daemon's client) start fast without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import Config
from .errors import (
    ConfigError,
    LeaderError,
    LoaderStateError,
    PeerLostError,
    ProtocolError,
    ShmCapacityError,
    ShmLoaderError,
    TopologyMismatchError,
    UnsupportedBatchError,
)

if TYPE_CHECKING:
    from .loader import ShmLoader
    from .sampler import ShardedBatchSampler, ShardedSampler, dp_topology_from_group

_LAZY = {
    "ShmLoader": "loader",
    "ShardedSampler": "sampler",
    "ShardedBatchSampler": "sampler",
    "dp_topology_from_group": "sampler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Config",
    "ConfigError",
    "LeaderError",
    "LoaderStateError",
    "PeerLostError",
    "ProtocolError",
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

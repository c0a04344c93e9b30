"""shmloader: one DataLoader per sequence-parallel group, batches shared once per node.

It owns the public API (``__all__``: :class:`ShmLoader`, :class:`Config`,
:class:`ShardedSampler` with :class:`ShardedBatchSampler`,
:func:`dp_topology_from_group` and :func:`dp_topology`,
:class:`BalancedBatchSampler`, and the exceptions of :mod:`shmloader.errors`).
Names that need torch are imported on first use (PEP 562), so ``import
shmloader`` loads only ``config`` and ``errors`` and the light modules start
fast without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import Config
from .errors import (
    ConfigError,
    ConfigMismatchError,
    DivergenceError,
    LeaderError,
    LeaderStoppedError,
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
    from .mesh import dp_topology
    from .samplers.balanced import BalancedBatchSampler
    from .samplers.sharded import ShardedBatchSampler, ShardedSampler, dp_topology_from_group

_LAZY = {
    "BalancedBatchSampler": "samplers.balanced",
    "ShmLoader": "loader",
    "ShardedSampler": "samplers.sharded",
    "ShardedBatchSampler": "samplers.sharded",
    "dp_topology_from_group": "samplers.sharded",
    "dp_topology": "mesh",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BalancedBatchSampler",
    "Config",
    "ConfigError",
    "ConfigMismatchError",
    "DivergenceError",
    "LeaderError",
    "LeaderStoppedError",
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
    "dp_topology",
    "dp_topology_from_group",
]

__version__ = "0.1.0"

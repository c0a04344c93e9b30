"""The roles behind ``ShmLoader``: their contract, what they share, and the map.

``ShmLoader`` (``loader``) is the public façade; ``startup.build`` makes
one role object from the topology, and the façade holds it by composition::

    role          object      module     holds (by composition)
    ----          ------      ------     ----------------------
    local         Local       local      Source (the user's loader)
    leader        Leader      leader     Source, Writer, WorkerPool?, CrossNode?
    node leader   Relay       relay      Reader, Writer, CrossNode
    follower      Follower    follower   Reader, RingReader, Spoke (_Releaser)

    Writer (writer): what the leader and a node leader do as their node's writer
    Reader (reader): what a node leader and a follower do as readers

Every role has the same small contract (``Role``): ``iterate(it, cursor,
skip)`` returns the iterator of one ``iter()`` (``ready()`` first says
whether one can start); ``set_epoch(epoch)`` passes
the epoch on (to the loader, to the writer's stamps); ``close()`` is the orderly
part of closing (a follower's BYE, a writer's STOP); ``closers()`` the
resources to free, in order (also run by the finalizer at exit);
``stats()`` what the role adds to ``ShmLoader.stats()``. What several
roles share is one ``Context`` passed in: the config, the ``Cursor`` and
``Boundary`` (``cursor``), the ``RankStats`` and the report hook
(``report``); each of its fields has one writer (``cursor`` draws the table).

This module also holds what several roles use: the error bodies carried by
ERROR messages, the payload CRC (``SHMLOADER_VERIFY``) and owned copies
(``SHMLOADER_COPY``). Role modules never import ``loader`` nor each other's
roles (``leader`` builds on ``local``'s ``Source``, the writer and reader on
nothing of a role).

NOTE [no batch in the frame]
    A generator keeps its locals alive while it is suspended at ``yield``. A
    batch stored in a local would stay referenced one step after the user
    dropped it: its slot would not be released and the ring would grow by one
    slot. The loops therefore yield straight from an expression (``box.pop()``,
    a call) and keep no batch, payload or view in a local across a ``yield``.

NOTE [small leaves]
    Tensors and arrays of at most ``Config.small_copy_bytes`` (64 KiB) are
    decoded as owned copies, not views of the slot, on every rank: keeping
    ``batch["labels"]`` for an epoch-level metric then keeps nothing of the
    slot, which is released as soon as the large leaves die. A batch made
    only of small leaves is released right at delivery.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import json
import logging
import traceback
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from . import codec
from .config import Config
from .cursor import Boundary, Cursor
from .errors import LeaderError, PeerLostError, ProtocolError, ShmLoaderError
from .report import RankStats

#: Every role logs as the loader: one logger name for users' filters.
log = logging.getLogger("shmloader.loader")

#: Longest a writer waits, on close or on an error, for readers it must reach.
CLOSE_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Context:
    """What every role of one ``ShmLoader`` shares (each field has one owner)."""

    config: Config
    cursor: Cursor
    boundary: Boundary
    stats: RankStats
    #: Report progress for ``stat`` (at most once a second; a no-op without a group).
    report: Callable[[], None]
    #: Raise ``ShmLoaderError`` once ``close()`` ran (every loop checks it per batch).
    check_open: Callable[[], None]


class Role(Protocol):
    """The contract of a role object (``local``, ``leader``, ``relay``, ``follower``)."""

    name: str

    def ready(self) -> None:
        """Raise if no iteration can start (a follower whose writer closed)."""
        ...

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        """The batches of iteration ``it``, starting at position ``cursor`` of the epoch.

        ``skip``: the leader's loader must be fast-forwarded by ``cursor``
        (a resume); False when it restored its own position.
        """
        ...

    def set_epoch(self, epoch: int) -> None:
        """``ShmLoader.set_epoch`` reached the role (the loader's ``set_epoch``, stamps)."""
        ...

    def close(self) -> None:
        """The orderly part of closing: say goodbye to the peers (never raises)."""
        ...

    def closers(self) -> list[Callable[[], None]]:
        """What to free at close or at exit, in order."""
        ...

    def stats(self) -> dict[str, Any]:
        """What the role adds to ``ShmLoader.stats()``."""
        ...


def _owned_copy(batch: Any) -> Any:
    """Replace shared views by owned copies (``SHMLOADER_COPY=1``).

    A module-level recursion with an explicit memo, not a nested closure: a
    closure that refers to itself is a reference cycle, which would keep the
    copies (and through them nothing else, but still memory) alive until the
    cycle collector runs.
    """
    return _clone(batch, {})


def _clone(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor | np.ndarray):
        if id(obj) not in memo:  # aliases stay aliases
            memo[id(obj)] = obj.clone() if isinstance(obj, torch.Tensor) else obj.copy()
        return memo[id(obj)]
    if isinstance(obj, list):
        return [_clone(v, memo) for v in obj]
    if type(obj) is tuple:
        return tuple(_clone(v, memo) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_clone(v, memo) for v in obj))
    if type(obj) is dict:
        return {k: _clone(v, memo) for k, v in obj.items()}
    if isinstance(obj, collections.abc.Mapping) and codec.rebuildable(obj):
        # as the codec rebuilt it (NOTE [mappings]); one it could not came unpickled, owned
        items = {k: _clone(v, memo) for k, v in obj.items()}
        return codec.rebuild_mapping(type(obj), items, getattr(obj, "default_factory", None))
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        new = copy.copy(obj)
        for name in obj.__dataclass_fields__:
            object.__setattr__(new, name, _clone(getattr(obj, name), memo))
        return new
    return obj


def _crc(payload: np.ndarray) -> int:
    return zlib.crc32(payload)


def _check_crc(payload: np.ndarray, expected: int, seq: int) -> None:
    got = _crc(payload)
    if got != expected:
        raise ProtocolError(
            f"batch {seq}: payload CRC-32 {got:08x} != {expected:08x} announced by the writer; "
            "the shared memory was modified or corrupted between write and read"
        )


def _json_body(meta: bytes) -> dict:
    try:
        body = json.loads(meta)
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    if isinstance(body, dict):
        return body
    return {"type": "ProtocolError", "message": repr(meta[:200])}


def _error_body(it: int, exc: BaseException) -> dict[str, Any]:
    return {
        "it": it,
        "type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def _error_fields(body: dict) -> dict:
    return {
        "it": int(body.get("it", 0)) if isinstance(body.get("it", 0), int) else 0,
        "type": str(body.get("type", "Exception")),
        "message": str(body.get("message", "")),
        "traceback": str(body.get("traceback", "")),
    }


def _leader_error(body: dict, leader: int | None) -> ShmLoaderError:
    """The error a reader raises for the leader's ERROR message.

    A peer lost by the leader is a peer lost by the whole group: readers raise
    ``PeerLostError`` with the leader's account. Anything else the leader's
    loader raised becomes ``LeaderError`` carrying type, message and traceback.
    """
    f = _error_fields(body)
    if f["type"] == "PeerLostError":
        return PeerLostError(None, "peer", f"the leader (rank {leader}) reported: {f['message']}")
    return LeaderError(f["type"], f["message"], f["traceback"], leader_rank=leader)

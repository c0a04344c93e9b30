"""The four roles behind ``ShmLoader``, and what several of them share.

``ShmLoader`` (``loader``) keeps the public API, set-up, epochs,
checkpoints, stats and close; each role's pipeline lives in a mixin of its
own module, and ``class ShmLoader(_Leader, _Relay, _Follower)`` shares one
``self`` among them::

    role          iteration                   module (mixin)
    ----          ---------                   --------------
    local         _local_iteration            local    (_Local)
    leader        _leader_iteration           leader   (_Leader: _Local + _Writer)
    node leader   _relay_iteration            relay    (_Relay: _Writer + _Reader)
    follower      _follower_iteration         follower (_Follower: _Reader; _Releaser)

    writer (leader, node leader): readers' messages, announcing, waits  writer  (_Writer)
    reader (node leader, follower): stamps checked, batches delivered   reader  (_Reader)

This module holds only what several roles use: the error bodies carried by
ERROR messages, the payload CRC (``SHMLOADER_VERIFY``) and owned copies
(``SHMLOADER_COPY``). Role modules never import ``loader``.
"""

from __future__ import annotations

import copy
import json
import logging
import traceback
import zlib
from typing import Any

import numpy as np
import torch

from .errors import LeaderError, PeerLostError, ProtocolError, ShmLoaderError

#: Every role logs as the loader: one logger name for users' filters.
log = logging.getLogger("shmloader.loader")

#: Longest a writer waits, on close or on an error, for readers it must reach.
CLOSE_WAIT_S = 10.0


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
    if isinstance(obj, dict):
        return {k: _clone(v, memo) for k, v in obj.items()}
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

"""The roles behind ``ShmLoader``: their contract, what they share, and what several of them use.

It owns ``Role`` (``ready``, ``iterate``, ``set_epoch``, ``close``, ``closers``,
``stats``), the ``Context`` every role of one loader shares (config, cursor and
boundary, counters, the report hook: each field with one owner), the ``Gate``
that lets one thread at a time into a role's code (NOTE [close from any
thread]), ERROR bodies, the payload CRC and owned copies. It imports ``codec``,
``cursor``, ``stats``, ``config`` and ``errors``, never ``loader`` nor a role;
the map of roles is in docs/architecture.md.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import json
import logging
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from .._proto import codec
from ..config import Config
from ..errors import LeaderError, PeerLostError, ProtocolError, ShmLoaderError
from .cursor import Boundary, Cursor
from .stats import RankStats

#: Every role logs as the loader: one logger name for users' filters.
log = logging.getLogger("shmloader.loader")

#: Longest a writer waits, on close or on an error, for readers it must reach.
CLOSE_WAIT_S = 10.0


CLOSED_MESSAGE = "this ShmLoader is closed; make a new one"


class Gate:
    """Whether a ``ShmLoader`` is open, and the one thread inside its roles' code.

    NOTE [close from any thread]
        A ``ShmLoader`` is iterated by one thread at a time and may be closed
        by any thread. Everything a role's loop does with its ZeroMQ
        sockets, its ring and its cross-node link runs *inside* the gate: the
        iterating thread holds it from the moment a ``next()`` enters the
        loop (``guard``, around the outermost iterator ``ShmLoader.__iter__``
        returns) until it yields, returns or raises. A loop steps *outside*
        (``outside``) only around what uses none of those: the user's loader
        (the leader's and a local rank's ``next()`` of it) and a node
        leader's gloo receive of the leader's next header. A cross-node send
        stays inside (gloo reads the slot): ``close()`` waits for it, as for
        any wait, at most the gate's ``limit`` (a role's timeout and then
        some), then warns and closes anyway; the thread then stops at the
        next check.

        ``close()`` (and the finalizer) first marks the loader closed, then
        takes the gate (``stop``): an iterating thread in one of its waits
        sees the mark within one slice (``channel.SLICE_S``: every wait calls
        the gate as its ``idle``) and leaves with ``ShmLoaderError("this
        ShmLoader is closed")``; one that is outside comes back in only
        after ``close()`` is done and gets the same error. Only then does
        ``close()`` say goodbye (a follower's BYE, a writer's STOP) and free
        sockets and ring, so no socket is ever used by two threads at once
        (the follower's own rule, NOTE [one thread per socket] in
        ``follower``). A loop that ends because the loader closed sends no
        ERROR: ``close()`` tells the peers (STOP, closed), exactly as for a
        loader closed between iterations. Anything else that runs a role's
        socket work on its own thread (a background publisher) enters the
        gate the same way and is stopped by the same ``stop``.
    """

    def __init__(self, limit: float) -> None:
        #: longest a thread waits to enter, and ``close()`` for the thread inside
        #: to leave: a role's longest wait (``Config.timeout``) and then some
        self.limit = limit
        self.closed = False
        self._marking = threading.Lock()  # two close() at once: one closes
        self._lock = threading.Lock()
        self._holder = 0  # the thread inside, 0 when none
        self._closer = 0  # the thread running close(): its own waits go on
        self._held_by_close = False

    def __call__(self) -> None:
        """Raise ``ShmLoaderError`` once ``close()`` began (in every thread but the closer)."""
        if self.closed and threading.get_ident() != self._closer:
            raise ShmLoaderError(CLOSED_MESSAGE)

    def _enter(self) -> None:
        limit = self.limit
        if not self._lock.acquire(timeout=limit):
            raise ShmLoaderError(
                f"another thread stayed inside this ShmLoader's iteration for {limit:.0f} s: "
                "iterate one ShmLoader from one thread at a time (a prefetch thread is fine)"
            )
        self._holder = threading.get_ident()

    def _leave(self) -> None:
        self._holder = 0
        self._lock.release()

    def inside(self) -> bool:
        """Whether the calling thread is inside the gate."""
        return self._holder == threading.get_ident()

    def guard(self, inner: Iterator[Any]) -> Iterator[Any]:
        """``inner``'s batches, each ``next()`` of it run inside the gate."""
        while True:
            box = []  # NOTE [no batch in the frame]
            self._enter()
            try:
                self()
                try:
                    box.append(next(inner))
                except StopIteration:
                    return
            finally:
                if self.inside():
                    self._leave()
            yield box.pop()

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Run the body outside the gate; raise ``ShmLoaderError`` if closed meanwhile."""
        if not self.inside():  # a role driven without the façade's guard
            yield
            return
        self._leave()
        try:
            yield
        finally:
            self._enter()
            self()  # whatever the body raised, the loader closed: that is the error

    def stop(self) -> bool:
        """Mark the loader closed and wait (bounded) until no thread is inside.

        False if it was closed already. The caller then closes what the
        roles hold, and calls ``done()``.
        """
        me = threading.get_ident()
        with self._marking:
            if self.closed:
                return False
            self.closed = True
            self._closer = me
        limit = self.limit
        if self._holder == me:  # closed from inside (a finalizer on the iterating thread)
            return True
        t0 = time.monotonic()
        self._held_by_close = self._lock.acquire(timeout=limit)
        if not self._held_by_close:
            log.warning(
                "shmloader: close(): the iterating thread did not leave the loader's "
                "iteration within %.0f s (%.1f s waited); closing anyway",
                limit,
                time.monotonic() - t0,
            )
        return True

    def done(self) -> None:
        """``close()`` is over: every thread now gets the closed error, the gate is free."""
        self._closer = 0
        if self._held_by_close:
            self._held_by_close = False
            self._lock.release()


@dataclasses.dataclass(frozen=True)
class Context:
    """What every role of one ``ShmLoader`` shares (each field has one owner)."""

    config: Config
    cursor: Cursor
    boundary: Boundary
    stats: RankStats
    #: Report progress for ``stat`` (at most once a second; a no-op without a group).
    report: Callable[[], None]
    #: Raise ``ShmLoaderError`` once ``close()`` ran (every loop checks it per batch,
    #: every wait once per slice): the loader's ``Gate`` (NOTE [close from any thread]).
    check_open: Gate


class Role(Protocol):
    """The contract of a role object (``local``, ``leader``, ``relay``, ``follower``)."""

    name: str

    def ready(self) -> None:
        """Raise if no iteration can start (a follower whose writer closed)."""
        ...

    # NOTE [no batch in the frame]
    #     A generator keeps its locals alive while it is suspended at ``yield``. A
    #     batch stored in a local would stay referenced one step after the user
    #     dropped it: its slot would not be released and the ring would grow by one
    #     slot. The loops therefore yield straight from an expression (``box.pop()``,
    #     a call) and keep no batch, payload or view in a local across a ``yield``.
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


# NOTE [small leaves]
#     Tensors and arrays of at most ``Config.small_copy_bytes`` (64 KiB) are
#     decoded as owned copies, not views of the slot, on every rank: keeping
#     ``batch["labels"]`` for an epoch-level metric then keeps nothing of the
#     slot, which is released as soon as the large leaves die. A batch made
#     only of small leaves is released right at delivery.
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
    return zlib.crc32(payload)  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12


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

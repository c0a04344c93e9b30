"""The roles behind ``ShmLoader``: their contract and what they share.

It owns ``Role`` (``ready``, ``iterate``, ``set_epoch``, ``close``, ``closers``,
``stats``), the ``Context`` every role of one loader shares (config, cursor and
boundary, counters, the report hook: each field with one owner), the ``Gate``
that lets one thread at a time into a role's code (NOTE [close from any
thread]) and the rules every role's loop keeps (NOTE [no batch in the frame],
NOTE [small leaves]). ERROR bodies are ``_proto.bodies``'s, the payload CRC
``_proto.checksum``'s, owned copies ``codec.owned_copy``. It imports
``cursor``, ``stats``, ``config`` and ``errors``, never ``loader`` nor a role;
the map of roles is in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..config import Config
from ..errors import ShmLoaderError
from .cursor import Boundary, Cursor
from .stats import RankStats

#: Every role logs as the loader: one logger name for users' filters.
log = logging.getLogger("shmloader.loader")

#: Longest a writer waits, on close or on an error, for readers it must reach.
CLOSE_WAIT_S = 10.0


CLOSED_MESSAGE = "this ShmLoader is closed; make a new one"


class Halted(ShmLoaderError):
    """A background thread's iteration was halted (NOTE [running ahead] in ``ahead``).

    Never reaches a user: the thread that raises it is the one that was
    told to stop, and it ends quietly (no ERROR to the peers).
    """


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
        (the leader's and a local rank's ``next()`` of it) and the
        cross-node waits gloo cannot cut short (``parked``: a node leader's
        receive of the leader's next header, the leader's wait for its sends
        to be received; NOTE [closing across nodes] in ``_transport.xnode``):
        ``close()`` never waits for those; the thread stops once it is back.

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
        loader closed between iterations. A role's loop that runs ahead on
        its own thread (NOTE [running ahead] in ``ahead``) holds the gate for
        its whole loop (``hold``), steps outside the same way, and is stopped
        by the same ``stop``; the thread that hands its batches to the user
        then never enters the gate.
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
        #: per thread: the event that halts the work it does now (``halted_by``)
        self._local = threading.local()
        #: threads outside in a wait gloo cannot cut short (``parked``)
        self.parked_threads: set[threading.Thread] = set()

    def __call__(self) -> None:
        """Raise ``ShmLoaderError`` once ``close()`` began (in every thread but the closer),
        ``Halted`` in a thread that was told to stop."""
        if self.closed and threading.get_ident() != self._closer:
            raise ShmLoaderError(CLOSED_MESSAGE)
        if self._halted():
            raise Halted("this iteration was halted")

    def _halted(self) -> bool:
        halt = getattr(self._local, "halt", None)
        return halt is not None and halt.is_set()

    @contextlib.contextmanager
    def halted_by(self, halt: threading.Event) -> Iterator[None]:
        """In the body, the calling thread's checks raise ``Halted`` once ``halt`` is set:
        the producer's work for one iteration (NOTE [running ahead] in ``ahead``)."""
        self._local.halt = halt
        try:
            yield
        finally:
            self._local.halt = None

    def quiet(self) -> bool:
        """Whether a loop that fails now must tell no peer: the loader closed (``close()``
        tells them) or this thread's iteration was halted (its user left it)."""
        return self.closed or self._halted()

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

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Run the body inside the gate (a background thread's whole loop)."""
        self._enter()
        try:
            self()
            yield
        finally:
            if self.inside():
                self._leave()

    @contextlib.contextmanager
    def attempt(self) -> Iterator[bool]:
        """Inside the gate if it is free now and open (True), else nothing waited (False)."""
        if self.closed or not self._lock.acquire(blocking=False):
            yield False
            return
        self._holder = threading.get_ident()
        try:
            yield not self.closed
        finally:
            self._leave()

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

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """``outside``, around a cross-node wait that nothing can cut short (gloo has no
        cancel): ``Ahead.settle`` does not wait for a thread parked here, whose every
        step after it is a check (NOTE [closing across nodes] in ``_transport.xnode``)."""
        me = threading.current_thread()
        self.parked_threads.add(me)
        try:
            with self.outside():
                yield
        finally:
            self.parked_threads.discard(me)

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
    #: Replay a received batch's (or END's) default-generator draws: at once
    #: (``rng.mirror_draws``) or, for a loop that runs ahead, at the batch's hand-over
    #: (``Ahead.defer``, NOTE [running ahead] in ``ahead``).
    mirror: Callable[[int], None]
    #: Whether a wait past its timeout may go on: a loop that runs ahead waits while
    #: its user is not waiting for it (``Ahead.patient``); False for every other loop.
    patient: Callable[[], bool] = lambda: False


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

"""The roles behind ``ShmLoader``: their contract and what they share.

It owns ``Role`` (``ready``, ``iterate``, ``supply``, ``set_epoch``, ``close``,
``closers``, ``stats``), the ``Context`` every role of one loader shares (config,
cursor and boundary, counters, the report hook: each field with one owner), the
``Owner`` that says which thread owns a loader's resources (NOTE [one owner]) and
the rules every role's loop keeps (NOTE [no batch in the frame], NOTE [small
leaves]). ERROR bodies are ``_proto.bodies``'s, the payload CRC
``_proto.checksum``'s, owned copies ``codec.owned_copy``. It imports ``cursor``,
``stats``, ``config`` and ``errors``, never ``loader`` nor a role; the map of
roles is in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
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
    """A background thread's iteration was halted (NOTE [running ahead] in ``producer``).

    Never reaches a user: the thread that raises it is the one that was
    told to stop, and it ends quietly (no ERROR to the peers).
    """


class Owner:
    """Whether a ``ShmLoader`` is open, and which thread owns its resources now.

    NOTE [one owner]
        Each resource of a sharing rank has one owner thread: the loader's
        producer (NOTE [one path] in ``producer``) owns its ring, its ZeroMQ
        sockets, its cross-node link, the worker pool's main-process side and
        the device copies it issues; the user's thread owns the hand-over and,
        in step, the leader's loader. Other threads reach the producer only
        through its queues and its doorbell: the user's thread takes batches
        and asks for them, and a finalizer of a dropped batch only queues its
        RELEASE. No socket is ever used by two threads, and no lock is handed
        between threads per batch.

        ``close()`` from any thread marks the loader closed (``close``) and
        stops the producer, which sees the mark at its next check (every wait
        checks once a slice, ``channel.SLICE_S``), leaves its iteration
        without an ERROR (``close()`` tells the peers: STOP, closed), says its
        goodbyes (a follower's BYE, a writer's STOP, the leader's closing STOP
        across nodes) and frees what it owns, in ``ShmLoader``'s one closing
        sequence, then ends; ``close()`` waits for that, bounded. A gloo
        call, which nothing can cut short, is not the producer's to make: the
        loader's link thread makes it, and the producer waits for it with a
        check per slice (NOTE [the link owns gloo] in ``_transport.xnode``).
        One place the producer cannot leave at a check: the user's code (a
        leader's ``next()`` of its loader when it runs ahead: ``outside``).
        There it touches nothing it owns, so ``close()`` does not wait for
        it: it takes the resources over (``take``) and closes them itself,
        and the producer, once back, finds them taken and touches nothing.
        That is the one moment ownership moves, and it moves once.

        A rank with sharing off has no producer and nothing to own: its loop
        on the user's thread checks the mark at each batch.
    """

    def __init__(self, limit: float) -> None:
        #: longest ``close()`` waits for the producer to say its goodbyes and free what it
        #: owns: a role's longest wait (``Config.timeout``) and then some
        self.limit = limit
        self.closed = False
        self._lock = threading.Lock()  # ``closed``, ``_away`` and ``taken`` change together
        self._closing = 0  # the thread that runs the closing sequence: its waits go on
        #: the producer thread, once it runs (``outside`` is a no-op elsewhere)
        self.producer: threading.Thread | None = None
        self._away: set[threading.Thread] = set()  # in the user's code
        #: ``close()`` took the resources from a producer that was away
        self.taken = False
        #: per thread: the event that halts the work it does now (``halted_by``)
        self._local = threading.local()

    def __call__(self) -> None:
        """Raise ``ShmLoaderError`` once ``close()`` began (but in the thread that closes),
        ``Halted`` in a producer whose iteration was halted."""
        if self.closed and threading.get_ident() != self._closing:
            raise ShmLoaderError(CLOSED_MESSAGE)
        if self._halted():
            raise Halted("this iteration was halted")

    def _halted(self) -> bool:
        halt = getattr(self._local, "halt", None)
        return halt is not None and halt.is_set()

    @contextlib.contextmanager
    def halted_by(self, halt: threading.Event) -> Iterator[None]:
        """In the body, the calling thread's checks raise ``Halted`` once ``halt`` is set:
        the producer's work for one iteration (NOTE [running ahead] in ``producer``)."""
        self._local.halt = halt
        try:
            yield
        finally:
            self._local.halt = None

    def quiet(self) -> bool:
        """Whether a loop that fails now must tell no peer: the loader closed (``close()``
        tells them) or this thread's iteration was halted (its user left it)."""
        return self.closed or self._halted()

    def close(self) -> bool:
        """Mark the loader closed; False if it was already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """The body runs the closing sequence: its own waits are not ended by the mark."""
        self._closing = threading.get_ident()
        try:
            yield
        finally:
            self._closing = 0

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """The producer steps away from what it owns for the body (the user's code); once
        back it raises ``ShmLoaderError`` if ``close()`` took its resources meanwhile, or
        closed the loader (NOTE [one owner])."""
        me = threading.current_thread()
        if me is not self.producer:  # the user's thread, or a role driven by a test
            yield
            return
        with self._lock:
            self._away.add(me)
        try:
            yield
        finally:
            with self._lock:
                self._away.discard(me)
            self()  # whatever the body raised, the loader closed: that is the error

    def take(self) -> bool:
        """``close()``: take the resources from a producer that is away now (it touches
        nothing when it is back); whether they were taken."""
        with self._lock:
            if self.producer is not None and self.producer in self._away:
                self.taken = True
            return self.taken


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
    #: every wait once per slice): the loader's ``Owner`` (NOTE [one owner]).
    check_open: Owner
    #: Replay a received batch's (or END's) default-generator draws: at once
    #: (``rng.mirror_draws``) or, for a loop that runs ahead, at the batch's hand-over
    #: (``Producer.defer``, NOTE [running ahead] in ``producer``).
    mirror: Callable[[int], None]
    #: Whether a wait past its timeout may go on: a loop that runs ahead waits while
    #: its user is not waiting for it (``Producer.patient``); False for every other loop.
    patient: Callable[[], bool] = lambda: False


class Role(Protocol):
    """The contract of a role object (``local``, ``leader``, ``node leader``, ``follower``)."""

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

    def supply(self, it: int, cursor: int, skip: bool) -> tuple[Iterator[Any], Any] | None:
        """In step, what the user's thread draws for ``iterate``'s loop on the producer,
        and the feed it goes to: the leader's loader (NOTE [one path] in ``producer``); None
        for every other role."""
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

"""A follower: maps what its node's writer published.

It owns ``Follower`` (the loop over its ``Spoke``: BATCH mapped copy-on-write
and delivered through its ``Reader``, RETIRE, END, ERROR, STOP; HELLO and BYE;
``stash``, a message of the writer's next iteration, and ``writer_closed``) and
``_Releaser``, the spoke's outgoing side and the RELEASEs queued the moment a
batch dies (NOTE [prompt release]); both run on the loader's producer (NOTE
[one owner] in ``base``).
It touches its node's ring only through a ``RingReader`` and the release words;
its way through one batch is in docs/internals/flow.md.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._node.release import announced_words
from .._node.ring import RingReader
from .._proto import wire
from .._proto.bodies import leader_error
from .._proto.checksum import check_payload_crc
from .._proto.wire import Kind
from .._topology import GroupTopology
from .._transport.channel import SLICE_S, Spoke
from .._transport.doorbell import Doorbell
from ..errors import PeerLostError, ProtocolError, ShmLoaderError
from .base import Context, log
from .receiver import Receiver, Sorted


class _Releaser:
    """A reader's outgoing messages, and the RELEASEs of its dropped batches.

    NOTE [prompt release]
        A reader's batch dies (``weakref.finalize`` on its mapping) when the
        user drops it, typically when ``batch`` is rebound at the top of the
        next step. Sending RELEASE right then, instead of with the reader's
        next request, lets the writer reuse that slot for the very next
        batch, so a lockstep job needs two slots, not three.

    The socket is the producer's (NOTE [one owner] in ``base``); a finalizer
    runs on whichever thread drops the last reference (the user's, or a
    garbage collection anywhere, even inside one of the producer's own socket
    calls). So a finalizer only appends to ``pending`` (a deque: atomic
    appends) and rings the producer's doorbell; the producer sends what is
    pending before each message of its own (``send``) and whenever the
    doorbell ends a slice of one of its waits (``flush``, its ``idle``), so
    the RELEASE leaves at once.
    """

    def __init__(self, spoke: Spoke, rank: int) -> None:
        self.spoke = spoke
        self.rank = rank
        self.pending: collections.deque = collections.deque()
        self.closed = False  # after close(): batches that die later release nothing
        #: the producer's: rung when a RELEASE is queued
        self.doorbell: Doorbell | None = None

    def queue_release(self, item: tuple[int, int, int]) -> None:
        """The finalizer callback, on any thread: queue, and wake the producer."""
        if self.closed:
            return
        self.pending.append(item)
        if self.doorbell is not None:
            self.doorbell.ring()

    def send(self, parts: list) -> None:
        """On the owner: send ``parts`` (if any) after every queued RELEASE."""
        self.flush()
        if parts:
            self.spoke.send(parts)

    def flush(self) -> None:
        """On the owner: send the RELEASEs queued so far."""
        while self.pending and not self.closed:
            try:
                index, gen, seq = self.pending.popleft()
            except IndexError:
                return
            self.spoke.send(wire.frames(Kind.RELEASE, seq, rank=self.rank, slot=index, gen=gen))

    def close(self) -> None:
        """Close the socket; batches that die later release nothing (NOTE [held past close])."""
        self.closed = True
        self.pending.clear()
        self.spoke.close()


class Follower:
    """The follower's loop: BATCH messages of its node's writer, mapped."""

    name = "follower"

    def __init__(
        self, ctx: Context, topo: GroupTopology, receiver: Receiver, ring: RingReader, spoke: Spoke
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.topo = topo
        self.receiver = receiver
        self.ring = ring
        self.spoke = spoke
        self.out = _Releaser(spoke, topo.me)
        self.stash: wire.Message | None = None
        self.writer_closed = False  # the writer told us it closed: fail fast
        me = topo.fact(topo.me)
        self.out.send(wire.frames(Kind.HELLO, rank=topo.me, pid=me.pid, start=me.start))

    def ready(self) -> None:
        if self.writer_closed:
            raise PeerLostError(
                self.topo.writer, "writer", "it closed its ShmLoader: no more batches will come"
            )

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        return self._loop(it)

    def supply(self, it: int, cursor: int, skip: bool) -> None:
        return None

    def set_epoch(self, epoch: int) -> None:
        pass

    def close(self) -> None:
        self.ring.own_views()  # NOTE [held past close] (ring): before BYE drops the holds
        with contextlib.suppress(Exception):
            self.out.send(wire.frames(Kind.BYE, rank=self.topo.me))
        self.out.closed = True

    def closers(self) -> list[Callable[[], None]]:
        # A loader closed at exit (its finalizer, once the main thread ended) owns
        # the user's held batches first, too: its socket goes without a BYE, and a
        # writer that carries on without it may rewrite those slots (NOTE [held past
        # close]); one dropped while the program runs says BYE (``Closing.dropped``).
        # The socket closes through the _Releaser, so that a batch dying after the
        # close (even in the finalizer's order at exit) releases nothing.
        return [self.ring.own_views, self.out.close, self.ring.close]  # type: ignore[list-item]

    def stats(self) -> dict[str, Any]:
        return {}

    def _next_event(self, it: int) -> wire.Message:
        """The next message that matters to iteration ``it`` (NOTE [iteration numbers], cursor).

        That is a message of iteration ``it``, the writer's last word (ERROR,
        STOP) or a message of a later iteration (then also kept in
        ``stash`` for the next one). Leftovers of earlier iterations are
        ACKed and released right here, inside the receive path: the writer
        may be waiting for exactly those.
        """
        spoke, topo = self.spoke, self.topo
        if self.stash is not None:
            msg, self.stash = self.stash, None
            if self._sort(msg, it):
                return msg
        found: list[wire.Message] = []

        def handle(msg: wire.Message, _rank: int | None) -> bool:
            if self._sort(msg, it):
                found.append(msg)
                return True
            return False

        peer = topo.peer(topo.writer)
        check_open = self.ctx.check_open

        def idle() -> None:
            self.out.flush()  # NOTE [prompt release]: rung by a finalizer, or once a slice
            check_open()  # close() from another thread ends the wait (NOTE [one owner])

        t0 = time.perf_counter()
        spoke.wait(
            handle,
            lambda: [peer],
            timeout=self.config.timeout,  # type: ignore[arg-type]  # resolved at set-up
            doing=f"waiting for batch {self.ctx.cursor.delivered} of iteration {it}",
            idle=idle,
            patient=self.ctx.patient,
        )
        self.ctx.stats.note_wait(t0)
        return found[0]

    def _sort(self, msg: wire.Message, it: int) -> bool:
        """Whether ``msg`` ends the wait for iteration ``it``; drop an earlier one's leftovers."""
        if msg.kind == Kind.RETIRE:  # in any iteration: NOTE [retired slots] (ring)
            self.ring.retire(msg["seg"])
            return False
        terminal = msg.kind in (Kind.ERROR, Kind.STOP)
        if terminal:  # the writer waits (bounded) until it knows we have it: Writer.tell_last
            self.out.send(wire.frames(Kind.ACK, msg.seq, rank=self.topo.me))
        msg_it = msg.body.get("it", it)
        closing = msg.kind == Kind.STOP and bool(msg["closed"])
        verdict = self.receiver.sort(msg.kind, msg_it, it, closing=closing)  # NOTE [one inbox]
        if verdict is Sorted.TAKE:
            return True
        if verdict is Sorted.PAST:  # NOTE [running ahead]: no user reached it; ACKed
            return False
        if verdict is Sorted.LATER:  # the writer moved on: keep it for the next iteration
            self.stash = msg
            return True
        self._drop(msg)
        if msg.kind in (Kind.BATCH, Kind.END):
            self.receiver.left_behind(msg_it, msg["pos"], msg.kind == Kind.END)
        return False

    def _drop(self, msg: wire.Message) -> None:
        """ACK and RELEASE a batch this rank will not use (its iteration is over)."""
        if msg.kind != Kind.BATCH:
            return
        self.out.send(wire.frames(Kind.ACK, msg.seq, rank=self.topo.me))
        if msg["slot"] >= 0:
            self._attach(msg["seg"])
            words = announced_words(msg.body)
            if words is not None:  # never mapped: nothing of it can change under us
                self.ring.release_now(words)
            self.out.pending.append((msg["slot"], msg["gen"], msg.seq))
            self.out.send([])

    def _attach(self, seg: str) -> None:
        try:
            opened = self.ring.open(seg)
        except ProtocolError as exc:
            writer = self.topo.peer(self.topo.writer)
            if not writer.alive():
                raise PeerLostError(
                    writer.rank, writer.role, f"it died before we mapped {seg}"
                ) from None
            if self._closed_behind():
                self.writer_closed = True
                raise PeerLostError(
                    writer.rank,
                    writer.role,
                    "it closed its ShmLoader while this rank was still iterating",
                ) from None
            raise ShmLoaderError(
                f"cannot map the batch in {seg}: {exc}. The writer may have closed its ShmLoader "
                "while this rank was still iterating: close() every rank's loader only after "
                "every rank finished iterating"
            ) from None
        if opened:
            self.out.send(wire.frames(Kind.ATTACHED, rank=self.topo.me, seg=seg))

    def _closed_behind(self) -> bool:
        """Whether the writer's STOP (closed) is queued: it unlinked what it announced.

        A writer that closes waits (bounded) for its readers to open what it
        announced, then says STOP and unlinks; a reader busy elsewhere that
        long finds the name gone, and the STOP right behind the batch.
        """
        timeout = SLICE_S
        while (got := self.spoke.receive(timeout)) is not None:
            timeout = 0
            msg = got[0]
            if msg.kind == Kind.STOP and msg["closed"]:
                return True
        return False

    def _loop(self, it: int) -> Iterator[Any]:
        ctx, receiver, topo = self.ctx, self.receiver, self.topo
        while True:
            ctx.check_open()
            msg = self._next_event(it)
            mine = ctx.cursor.mine(it)
            theirs = (msg.body.get("it", it), msg.body.get("epoch", -1), msg.body.get("pos", -1))
            if msg is self.stash:  # a later iteration started while we still iterate
                raise receiver.diverged("left", theirs, mine)
            if msg.kind == Kind.END:
                if theirs[1:] != mine[1:]:
                    raise receiver.diverged("ended", theirs, mine)
                # the writer's last word of the iteration, taken: a close without BYE
                # after it (a loader dropped with its iterator) is no loss (settle_left)
                self.out.send(wire.frames(Kind.ACK, msg.seq, rank=topo.me))
                ctx.mirror(msg["draws"])
                ctx.cursor.finish()
                return
            if msg.kind == Kind.STOP:
                if msg["closed"]:
                    self.writer_closed = True
                    raise PeerLostError(
                        topo.writer,
                        topo.role(topo.writer),
                        "it closed its ShmLoader while this rank was still iterating",
                    )
                raise receiver.stopped(msg["reason"], theirs, mine)
            if msg.kind == Kind.ERROR:
                raise leader_error(msg.body, topo.leader)
            if msg.kind != Kind.BATCH:
                log.warning("shmloader: unexpected %s from the writer; ignored", msg.kind.name)
                continue
            if theirs[1:] != mine[1:]:
                self._drop(msg)
                raise receiver.diverged("batch", theirs, mine)
            t0 = time.perf_counter_ns()
            self.out.send(wire.frames(Kind.ACK, msg.seq, rank=topo.me))
            yield receiver.deliver(msg.blob, self._map(msg), msg["draws"], t0)

    def _map(self, msg: wire.Message) -> np.ndarray:
        """A private view of the payload a BATCH announced (empty without payload)."""
        nbytes = msg["nbytes"]
        if not nbytes:
            return np.empty(0, np.uint8)
        self._attach(msg["seg"])
        release = functools.partial(self.out.queue_release, (msg["slot"], msg["gen"], msg.seq))
        payload = self.ring.view(msg["seg"], nbytes, release, announced_words(msg.body))
        if msg["crc"] >= 0:
            check_payload_crc(payload, msg["crc"], msg.seq)
        return payload

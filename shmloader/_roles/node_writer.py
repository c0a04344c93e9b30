"""The node writer (``NodeWriter``): what the leader and each node leader do as the writer
of their node's ring. It owns the one publish sequence (``publish``: wait for readers,
a slot, the payload, its checksum, the cross-node send where the writer is the leader,
the announcement, the counters, the writer's own view), the stamps (``seq``, batches
announced; ``pos``, the position on the next message, from ``begin``), the readers'
HELLOs, ACKs and BYEs, its own releases and, through ``RingWriter`` and the
``WorkerPool``, every slot's bookkeeping; it reads the ``Cursor``'s epoch and touches
neither the loader nor the user's batches. The exchange with the readers, drawn:
``docs/internals/datapath.md``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import numpy as np

from .._node.ring import RingWriter, Slot, SlotState
from .._node.views import private_view
from .._proto import codec, wire
from .._proto.bodies import error_body
from .._proto.checksum import check_payload_crc, payload_crc
from .._proto.wire import Kind
from .._topology import GroupTopology
from .._transport.channel import BYE_GRACE_S, Hub
from .._transport.xnode import CrossNode, Event
from .._workers.pool import SlotRef, WorkerPool
from ..errors import PeerLostError, ProtocolError, human_bytes
from .base import CLOSE_WAIT_S, Context, log

#: What ``NodeWriter.publish`` puts in a slot: a batch the leader's main process encoded,
#: one a DataLoader worker wrote into a pool slot, or one a node leader receives.
Publishable = codec.Encoded | SlotRef | Event


class Filled(NamedTuple):
    """A slot that holds one batch's payload, ready to be announced (``NodeWriter.publish``)."""

    slot: Slot | None  # None: the batch has no payload
    crc: int  # its CRC-32 as announced, -1: none
    write_ns: int  # what this process spent putting the payload there
    origin: Literal["encoded", "pooled", "received"]  # who wrote it; who counts it


class NodeWriter:
    """This node's writer: the ring, the hub and the readers' state (leader and node leader)."""

    def __init__(
        self,
        ctx: Context,
        topo: GroupTopology,
        ring: RingWriter,
        hub: Hub,
        xnode: CrossNode | None,
        pool: WorkerPool | None = None,
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.topo = topo
        self.ring = ring
        self.hub = hub
        self.xnode = xnode  # the leader's sends to node leaders, a node leader's receives
        #: the group leader's writer sends every event on to the node leaders first
        self.sends = xnode is not None and topo.is_leader
        self.pool = pool  # the leader's: release words of pooled slots (NOTE [release words])
        self.hello: set[int] = set()
        self.acked = dict.fromkeys(topo.readers, 0)
        self.gone: set[int] = set()
        self.self_releases: collections.deque = collections.deque()
        self.seq = 0  # batches announced by this writer
        self.pos = 0  # position stamped on the next message of this epoch
        self.ring_warned = 0  # age of a held batch last warned about (NOTE [ring growth])
        self.began_ns = 0  # when the latest publish, done waiting for readers, took its slot
        #: its own views fault their pages in as they are made (NOTE [running ahead])
        self.prefault = False
        #: its own dropped views are unmapped on the unmap thread (NOTE [unmapped off the step])
        self.later = False

    def begin(self, cursor: int) -> None:
        """A new iteration starts at position ``cursor`` of the epoch."""
        self.pos = cursor

    def at(self) -> tuple[int, int]:
        """(epoch, position) stamped on the next message, on this node or across nodes."""
        return self.ctx.cursor.epoch, self.pos

    def describe(self, description: dict) -> None:
        """Rewrite the ring's description for ``stat`` (``stats.Reporter``)."""
        self.ring.describe(description)

    def stats(self) -> dict[str, Any]:
        """What the writer adds to ``ShmLoader.stats()``: its ring, the bytes sent across nodes."""
        out = {"ring_slots": len(self.ring.slots), "ring_bytes": self.ring.total_bytes}
        if self.xnode is not None:
            out["cross_node_bytes_sent"] = self.xnode.bytes_sent
        return out

    def closers(self) -> list[Callable[[], None]]:
        return [self.hub.close, self.ring.close]

    # -- the publish sequence ------------------------------------------------

    @overload
    def publish(
        self, it: int, batch: Publishable, draws: int, *, view: Literal[True] = ...
    ) -> np.ndarray: ...
    @overload
    def publish(self, it: int, batch: Publishable, draws: int, *, view: Literal[False]) -> None: ...
    def publish(
        self, it: int, batch: Publishable, draws: int, *, view: bool = True
    ) -> np.ndarray | None:
        """Put ``batch`` in a slot, tell every rank of the group; the writer's own view of it.

        The one sequence for every batch of the group: wait for the readers;
        fill a slot, one of three ways (``_fill``: the encoded batch written,
        the pool slot a DataLoader worker wrote, the leader's payload received
        straight into it), each with its CRC-32 (``SHMLOADER_VERIFY``: computed,
        or the leader's checked); on the leader, the send to every node leader,
        done *before* this node's readers hear of the batch; the announcement;
        the counters. Returns a
        copy-on-write view of the payload that releases the writer's hold when
        it dies. ``view=False`` (the leader under ``SHMLOADER_COPY``, which
        hands out the loader's own batch): the hold ends at once, and None.
        """
        self.await_readers()
        t0 = self.began_ns = time.perf_counter_ns()
        filled = self._fill(batch)
        slot, crc = filled.slot, filled.crc
        payload = slot.payload[: batch.nbytes] if slot is not None else None
        if self.sends:
            assert self.xnode is not None
            # NOTE [the link owns gloo] (xnode): close() never waits for this send
            self.xnode.send(Kind.BATCH, it, batch.meta, payload, at=self.at(), draws=draws, crc=crc)
            self.ctx.check_open()  # a close meanwhile announces nothing
        self.announce(it, batch.meta, batch.nbytes, slot, draws, filled.write_ns, crc)
        self._count(batch.nbytes, filled, t0)
        if view:
            return self.own_view(slot, batch.nbytes)
        if slot is not None:
            self.ring.release(self.topo.me, slot.index, slot.gen)
        return None

    # The three ways a slot gets its payload; each returns it ``Filled``. ``_fill`` is the
    # one place that tells them apart.

    def _fill(self, batch: Publishable) -> Filled:
        if isinstance(batch, SlotRef):
            return self._fill_pooled(batch)
        if isinstance(batch, Event):
            return self._fill_received(batch)
        return self._fill_encoded(batch)

    def _fill_encoded(self, enc: codec.Encoded) -> Filled:
        """The leader's main process writes the encoded batch into a slot it acquires; its
        CRC-32 computed (``SHMLOADER_VERIFY``)."""
        t0 = time.perf_counter_ns()
        if self.xnode is not None:
            self.xnode.sent()  # NOTE [a slot in flight] (xnode)
        slot = self.ring.acquire(enc.nbytes) if enc.nbytes else None
        if slot is not None:
            codec.write_payload(enc, slot.payload)
        return Filled(slot, self._crc(slot, enc.nbytes), time.perf_counter_ns() - t0, "encoded")

    def _fill_pooled(self, ref: SlotRef) -> Filled:
        """A DataLoader worker wrote the batch into a pool slot already (``WorkerPool.accept``):
        this process writes nothing."""
        assert self.pool is not None
        slot = self.pool.accept(ref) if ref.nbytes else None
        return Filled(slot, self._crc(slot, ref.nbytes), 0, "pooled")

    def _fill_received(self, event: Event) -> Filled:
        """A node leader receives the leader's payload straight into a slot it acquires and
        checks the leader's CRC-32 against it, before any of its readers may map it."""
        assert self.xnode is not None
        t0 = time.perf_counter_ns()
        slot = self.ring.acquire(event.nbytes) if event.nbytes else None
        if slot is not None:
            payload = slot.payload[: event.nbytes]
            self.xnode.receive_payload(payload)
            if event.crc >= 0:
                check_payload_crc(payload, event.crc, self.seq)
        return Filled(slot, event.crc, time.perf_counter_ns() - t0, "received")

    def _crc(self, slot: Slot | None, nbytes: int) -> int:
        """The CRC-32 the leader announces with a payload, -1: none (``SHMLOADER_VERIFY``)."""
        if not self.config.verify or slot is None:
            return -1
        return payload_crc(slot.payload[:nbytes])

    def _count(self, nbytes: int, filled: Filled, t0: int) -> None:
        """The leader's counters of a batch it published (a node leader counts what it
        receives: ``Receiver.deliver``)."""
        if filled.origin == "received":
            return
        pooled = filled.origin == "pooled"
        counts = self.ctx.stats.counts
        counts["published"] += 1
        counts["bytes_published"] += nbytes
        counts["publish_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
        # 0 for a worker's: the main process wrote none
        counts["write_ms_last"] = filled.write_ns / 1e6
        if pooled:
            assert self.pool is not None
            counts["worker_written"] += 1
            counts["worker_write_ms_last"] = self.pool.last_write_ns / 1e6
            counts["bytes_collated_in_place"] += self.pool.last_placed

    def free_released(self) -> None:
        """Pool slots every holder released go back to the workers (before the leader blocks
        on them): readers' messages and the writer's own releases first."""
        if self.pool is None:
            return
        self.pump()
        if self.xnode is not None and self.xnode.sending():
            return  # NOTE [a slot in flight] (xnode): the send still reads its pool slot
        self.pool.sync()

    def end(self, it: int, draws: int) -> None:
        """The iteration ended: END to the node leaders (the leader's), then to this node."""
        if self.sends:
            assert self.xnode is not None
            self.xnode.send(Kind.END, it, b"", at=self.at(), draws=draws)
        self.await_readers(window=False)
        self.tell_readers(self.stamped(Kind.END, it, draws=draws))

    def own_view(self, slot: Slot | None, nbytes: int) -> np.ndarray:
        """The writer's private view of a slot it just published; releases itself."""
        if slot is None:
            return np.empty(0, np.uint8)
        release = functools.partial(self.self_releases.append, (slot.index, slot.gen, slot.seq))
        word = self.pool.own_release(slot) if self.pool is not None else None
        return private_view(
            slot.segment, nbytes, release, word, prefault=self.prefault, later=self.later
        )

    def fail(self, it: int, exc: BaseException) -> None:
        """Tell every reader (and the leader's writer, every node leader first) that this
        iteration failed.

        Readers that have not said HELLO yet are waited for (bounded): a
        message sent before their connection is up would be lost, and they
        would report the leader lost instead of its error.
        """
        try:
            stop = isinstance(exc, KeyboardInterrupt | SystemExit)
            if stop:
                kind = Kind.STOP
                body: dict[str, Any] = {"reason": f"{type(exc).__name__} on the leader"}
                parts = self.stamped(Kind.STOP, it, closed=0, reason=body["reason"])
            else:
                kind, body = Kind.ERROR, error_body(it, exc)
                parts = wire.frames(Kind.ERROR, self.seq, **body)
            if self.sends and self.xnode is not None and not self.xnode.broken:
                self.xnode.send_json(kind, it, body, at=self.at())
            with contextlib.suppress(PeerLostError):
                self.await_readers(window=False, timeout=min(self.config.timeout, CLOSE_WAIT_S))  # type: ignore[type-var]
            self.tell_last(parts)
        except Exception as notify_error:  # the original error matters more
            log.warning("shmloader: could not tell followers about %r: %s", exc, notify_error)

    def announce(
        self, it: int, meta: bytes, nbytes: int, slot: Slot | None, draws: int, ns: int, crc: int
    ) -> None:
        """Tell this node's readers that batch ``seq`` is in ``slot``."""
        ring = self.ring
        assert ring is not None
        seq = self.seq
        self.seq += 1
        if slot is not None:
            ring.hold_for_readers(slot, seq, nbytes, ns)
        parts = self.stamped(
            Kind.BATCH,
            it,
            seq,
            meta,
            slot=-1 if slot is None else slot.index,
            gen=0 if slot is None else slot.gen,
            seg="" if slot is None else slot.segment.name,
            nbytes=nbytes,
            draws=draws,
            crc=crc,
            # a pooled slot: where each reader writes its release word (NOTE [release words])
            **(self.pool.announce_fields(slot) if self.pool is not None else {}),
        )
        self.pos += 1
        self.tell_readers(parts)
        self.warn_growth()
        self.ctx.report()

    def stamped(
        self, kind: Kind, it: int, seq: int | None = None, blob: bytes | None = None, **body: Any
    ) -> list:
        """A writer message stamped with (iteration, epoch, position).

        NOTE [iteration numbers] in ``cursor``. ERROR and STOP carry the next
        batch number as ``seq``: readers ACK it (``tell_last``).
        """
        return wire.frames(
            kind,
            self.seq if seq is None else seq,
            blob,
            it=it,
            epoch=self.ctx.cursor.epoch,
            pos=self.pos,
            **body,
        )

    def tell_last(self, parts: list) -> None:
        """Send a writer's last word (ERROR, STOP) and wait, bounded, until each reader has it.

        The process may exit right after (the error propagates): a message
        still in ZeroMQ's queue would be lost, and readers would report the
        writer dead instead of its error. Readers ACK it with its ``seq``.
        """
        self.tell_readers(parts, best_effort=True)
        seq = wire.parse(parts).seq
        try:
            self.wait_for(
                lambda: [
                    r for r in self.topo.readers if r not in self.gone and self.acked[r] <= seq
                ],
                min(self.config.timeout, CLOSE_WAIT_S),  # type: ignore[type-var, arg-type]
                "making sure followers received the leader's error",
            )
        except PeerLostError as exc:
            log.warning("shmloader: not every follower confirmed the error: %s", exc)

    def warn_growth(self) -> None:
        """Say what is held when a rank keeps batches past its depth.

        NOTE [ring growth]
            A rank's depth is ``SHMLOADER_SLOTS + 2`` batches: its window of batches
            taken ahead, the one in use, and the one it just dropped whose RELEASE is
            on its way (a loop drops a batch only once it holds the next). What the
            writer watches is each held batch's *age*: how many newer batches its
            holder has taken since (the reader's ACK; for the writer's own view, its
            publications). An age past the depth means the rank keeps old batches
            (or parts of them) alive; the writer warns, naming each such batch and
            its holders, at the first time and each doubling of the age after.
            Counting ring slots instead would blame a background prefetch queue
            (each queued batch is taken, so acknowledged, and still held: the ring
            holds ``SHMLOADER_SLOTS`` plus the queue) for growth that no setting
            could silence; by age, ``SHMLOADER_SLOTS`` at least the queue's depth
            plus the batch its thread is putting keeps it quiet, as the warning
            advises, while a kept batch ages without bound and is always named.
            A loop that runs ahead (NOTE [running ahead] in ``producer``) takes, so
            acknowledges, up to ``SHMLOADER_SLOTS`` more batches than its user
            holds: with ``Config.ahead`` the depth is that much larger.
        """
        ring = self.ring
        assert ring is not None
        # How far each holder has moved on: the newest batch it took (a reader's
        # ACK; the writer's own view is taken when published).
        newest = {r: acked - 1 for r, acked in self.acked.items()}
        if ring.self_rank is not None:
            newest[ring.self_rank] = self.seq - 1
        held = [s for s in ring.slots if s.state == SlotState.HELD]

        def age(slot: Slot) -> int:
            return max((newest.get(r, -1) - slot.seq for r in slot.holders), default=0)

        oldest = max((age(s) for s in held), default=0)
        depth = self.config.slots + 2 + (self.config.slots if self.config.ahead else 0)
        if oldest < max(depth, 2 * self.ring_warned):
            return
        self.ring_warned = oldest
        live = [
            s
            for s in ring.slots
            if s.state != SlotState.RETIRED and (not s.pooled or s.state == SlotState.HELD)
        ]
        held_text = [
            f"batch {s.seq} by rank(s) {sorted(s.holders)}"
            for s in sorted(held, key=lambda s: s.seq)
            if age(s) >= depth
        ]
        log.warning(
            "shmloader: the ring of group %s on this node grew to %d slots (%s): a rank holds a "
            "batch %d batches older than the newest it took, past its depth of "
            "%d (SHMLOADER_SLOTS=%d + the batch in use + one being released): still held: %s. "
            "A rank keeps parts of "
            "old batches alive (a metric keeping a tensor, a prefetch queue): keep .clone() "
            "copies of what you keep (leaves of at most %d bytes already are copies), or raise "
            "SHMLOADER_SLOTS to the batches a rank keeps in flight",
            list(self.topo.ranks) if self.topo else "?",
            len(live),
            human_bytes(ring.total_bytes),
            oldest,
            depth,
            self.config.slots,
            "; ".join(held_text),
            self.config.small_copy_bytes,
        )

    def tell_readers(self, parts: list, *, best_effort: bool = False) -> None:
        """Publish to every reader at once; a reader gone without BYE raises after.

        NOTE [one announcement] (``channel``): one send whatever the group's
        size; a reader whose socket closed shows in ``hub.left``. Slots the
        ring retired since the last message are announced first (RETIRE,
        NOTE [retired slots] in ``ring``).
        """
        for name in self.ring.take_retired():
            self.hub.broadcast(wire.frames(Kind.RETIRE, seg=name))
        self.hub.broadcast(parts)
        lost = self.settle_left()
        if lost is not None and not best_effort:
            raise lost

    def settle_left(self) -> PeerLostError | None:
        """Readers whose socket closed: a goodbye, or lost (then dropped and returned).

        A reader that said BYE and left is not lost: its BYE travels on the
        other socket and may trail the unsubscription that shows it left, so
        each is given ``BYE_GRACE_S`` for it. Nor is one that ACKed the
        writer's last word (END, ERROR or STOP: stamped with ``seq``, the next
        batch number) and left without BYE: a loader dropped with its iterator
        right after its epoch closes in its finalizer, which says no BYE, and
        the writer, still in its END, saw it gone. Either way it is dropped,
        and the slots it held are free again.
        """
        lost: PeerLostError | None = None
        for rank in sorted(self.hub.left - self.gone):
            deadline = time.monotonic() + BYE_GRACE_S
            self.pump()
            while rank not in self.gone and time.monotonic() < deadline:
                if (got := self.hub.receive(0.02)) is not None:
                    self.handle(*got)
            if rank not in self.gone:
                took_last_word = self.acked.get(rank, 0) > self.seq
                self.drop_reader(rank)
                if not took_last_word:
                    lost = lost or PeerLostError(
                        rank, self.topo.role(rank), "its socket closed without a BYE"
                    )
        return lost

    def drop_reader(self, rank: int) -> None:
        """``rank`` said BYE or is unreachable: stop waiting for it and sending to it."""
        self.gone.add(rank)
        assert self.ring is not None
        self.ring.drop_reader(rank)

    def handle(self, msg: wire.Message | None, rank: int | None) -> bool:
        """Apply one reader message to the writer's state; never raises on bad input."""
        ring = self.ring
        assert ring is not None
        if msg is None:  # a reader's subscription came or went: the hub tracks it
            return False
        if rank not in self.acked:
            log.warning("shmloader: message from rank %s, which is not a reader here", rank)
            return False
        try:
            if msg.kind == Kind.HELLO:
                self.hello.add(rank)
            elif msg.kind == Kind.ACK:
                self.acked[rank] = max(self.acked[rank], msg.seq + 1)
            elif msg.kind == Kind.RELEASE:
                ring.release(rank, msg["slot"], msg["gen"], msg.seq)
            elif msg.kind == Kind.ATTACHED:
                ring.attached(rank, msg["seg"])
            elif msg.kind == Kind.BYE:
                self.drop_reader(rank)
            else:
                raise ProtocolError(f"{msg.kind.name} is not a reader's message")
        except ProtocolError as exc:
            log.warning("shmloader: dropped a message from rank %d: %s", rank, exc)
        return False

    def pump(self) -> None:
        """Apply every message already waiting, and our own releases (node leader)."""
        assert self.hub is not None and self.ring is not None
        while (got := self.hub.receive(0)) is not None:
            self.handle(*got)
        while self.self_releases:
            index, gen, seq = self.self_releases.popleft()
            with contextlib.suppress(ProtocolError):
                self.ring.release(self.topo.me, index, gen, seq)

    def wait_for(self, waiting: Callable[[], list[int]], timeout: float, doing: str) -> None:
        """Handle reader messages until ``waiting()`` is empty (NOTE [bounded waits], channel)."""
        hub = self.hub
        assert hub is not None
        self.pump()
        if not waiting():
            return

        def handle(msg: wire.Message, rank: int | None) -> bool:
            self.handle(msg, rank)
            return not waiting()

        t0 = time.perf_counter()
        peers = self.topo.peer
        # once a slice: close() from another thread ends the wait (NOTE [one owner] in
        # base); a test's bare context has no owner
        idle = getattr(self.ctx, "check_open", None)
        hub.wait(
            handle,
            lambda: [peers(r) for r in waiting()],
            timeout=timeout,
            doing=doing,
            idle=idle,
            patient=getattr(self.ctx, "patient", None),
        )
        self.ctx.stats.counts["wait_readers_ms_total"] += (time.perf_counter() - t0) * 1e3

    def await_readers(self, *, window: bool = True, timeout: float | None = None) -> None:
        """Wait until every reader said HELLO and (``window``) none lags ``slots`` behind."""
        topo = self.topo
        assert topo is not None
        slots = self.config.slots

        def waiting() -> list[int]:
            # A reader whose socket closed is not waited for (it will take no batch):
            # settle_left takes its trailing BYE, or names it lost, right after.
            live = [r for r in topo.readers if r not in self.gone and r not in self.hub.left]
            # NOTE [one announcement] (channel): arrived = HELLO and subscribed
            late = [r for r in live if r not in self.hello or r not in self.hub.subscribed]
            if late or not window:
                return late
            return [r for r in live if self.seq - self.acked[r] >= slots]

        self.wait_for(
            waiting,
            self.config.timeout if timeout is None else timeout,  # type: ignore[arg-type]
            f"waiting for followers to take batch {self.seq}",
        )
        lost = self.settle_left()  # before anything is acquired: a goodbye frees its slots
        if lost is not None:
            raise lost

    def await_attach(self) -> None:
        """Before unlinking at close: let readers open the segments they were told about.

        A reader maps a slot by name, so a name unlinked before a lagging
        reader opened it would make that reader fail. Bounded by
        ``CLOSE_WAIT_S``; readers that said BYE or died are not waited for.
        """
        ring = self.ring
        assert ring is not None
        try:
            self.wait_for(
                lambda: sorted(ring.unattached() - self.gone - self.hub.left),
                min(self.config.timeout, CLOSE_WAIT_S),  # type: ignore[type-var, arg-type]
                "closing: waiting for followers to map the last batches",
            )
        except PeerLostError as exc:
            log.warning("shmloader: closing without every follower's last batch: %s", exc)

    def say_closed(self, it: int) -> None:
        """At close: let readers map what they were told about, then STOP (closed); the
        leader's closing STOP to node leaders (NOTE [closing across nodes] in ``xnode``);
        never raises."""
        with contextlib.suppress(Exception):
            self.await_attach()
            stop = self.stamped(Kind.STOP, it, reason="the writer closed", closed=1)
            self.tell_readers(stop, best_effort=True)
        if self.sends and self.xnode is not None:
            self.xnode.say_closed(it, at=self.at())

"""The workers' slot pool, the leader's main process's side: ``WorkerPool``.

Ring slots the leader's DataLoader workers write themselves. It owns making the
pool (its control segment and generation 0 of every slot, admitted by the daemon
first: NOTE [pool admission]), the pool's moves of the main process (``accept``
FILLED -> PUBLISHED, ``sync`` PUBLISHED -> EMPTY once every holder released,
``abandon``, the reclaiming of dead workers' slots at ``iter()``), installing a
generation a worker grew in the ring, the once-only warning of a shrunk pool and
unlinking every name at close; and ``SlotRef``, what a worker returns in a batch's
place, which frees its slot if it dies unpublished here. It drives the ring's pooled
slots and never reads or writes a payload. The control segment's layout, the state
machine and the names are ``control``'s; a worker's side is ``partition``. It
imports ``control``, the node layer (``segment``, ``ring``, ``release``) and
``errors``; the daemon's client only as a type.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._node import segment as _segment
from .._node.release import AREA_AT, HOLDER_COUNT, MAX_HOLDERS, NOBODY, ReleaseWords, area_words
from .._node.ring import GRANULE, RingWriter, Slot, SlotState, parse_slot_name, slot_stem
from .._node.segment import (
    HEADER_SIZE,
    KIND_DATA,
    Segment,
    list_segments,
    process_alive,
    read_header,
    unlink_name,
)
from ..errors import ProtocolError, human_bytes
from .control import (
    LEAVING,
    POOL_VERSION,
    RECORD_WORDS,
    RECORDS_AT,
    USE,
    PoolSpec,
    PoolState,
    Record,
    SlotRecord,
    name_suffix,
    per_worker_slots,
    pool_slot_name,
    pool_stem,
    records,
    state_name,
)

if TYPE_CHECKING:
    from .._transport.daemon_client import DaemonClient

log = logging.getLogger(__name__)

#: Pools of this process by ring token, for SlotRef.__del__ (abandon).
_POOLS: weakref.WeakValueDictionary[str, WorkerPool] = weakref.WeakValueDictionary()


class SlotRef:
    """What a worker returns in place of a batch: where it is and how to decode it.

    A SlotRef that dies in the leader's main process without being published
    (the DataLoader dropped it: a resume fast-forward, a persistent iterator's
    reset) frees its slot (FILLED -> EMPTY).
    """

    __slots__ = ("accepted", "gen", "index", "meta", "nbytes", "owner_pid", "ticket", "token")

    def __init__(
        self, token: str, index: int, gen: int, ticket: int, nbytes: int, meta: bytes, owner: int
    ) -> None:
        self.token, self.index, self.gen, self.ticket = token, index, gen, ticket
        self.nbytes, self.meta, self.owner_pid = nbytes, meta, owner
        self.accepted = False

    def __reduce__(self) -> tuple:
        args = (self.token, self.index, self.gen, self.ticket, self.nbytes, self.meta)
        return (SlotRef, (*args, self.owner_pid))

    def __repr__(self) -> str:
        return f"SlotRef(slot {self.index}.{self.gen}, ticket {self.ticket}, {self.nbytes} bytes)"

    def __del__(self) -> None:
        if self.accepted or os.getpid() != self.owner_pid:
            return
        pool = _POOLS.get(self.token)
        if pool is not None:
            pool.abandon(self)


class WorkerPool:
    """The main process's side: creates the pool, accepts SlotRefs, frees slots.

    Drives the ring's pooled slots; never writes or reads a payload.
    """

    def __init__(
        self,
        ring: RingWriter,
        *,
        num_workers: int,
        prefetch_factor: int,
        ring_slots: int,
        timeout: float,
        allow_pickle: bool,
        collate_in_slot: bool = True,
        daemon: DaemonClient | None = None,
        peers: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        self.ring = ring
        self.daemon = daemon
        per_worker = per_worker_slots(prefetch_factor, ring_slots, num_workers)
        total = num_workers * per_worker
        # NOTE [release words]: holder 0 is this process's own view, then each reader
        me = NOBODY if ring.self_rank is None else ring.self_rank
        holders = [me, *sorted(ring.readers)]
        release_at = RECORDS_AT + total * RECORD_WORDS
        words = release_at
        if len(holders) <= MAX_HOLDERS:
            words += area_words(total, len(holders))
        self.control = Segment.create_unique(
            pool_stem(ring.token), KIND_DATA, ring.token, words * 8
        )
        self.spec = PoolSpec(
            ring.token,
            self.control.name,
            num_workers,
            per_worker,
            prefetch_factor,
            os.getpid(),
            _segment.MY_START,  # read now: a forked leader's own (refreshed at fork)
            timeout,
            allow_pickle,
            collate_in_slot,
            daemon.admitter() if daemon is not None else None,
            _segment.SHM_DIR,
        )
        self.base = len(ring.slots)  # pool slot i is ring slot base + i
        if self.base != 0:
            raise AssertionError("the worker pool must be the ring's first slots")
        self._closed = False
        self._mm = self.control.map_shared()
        self.words = np.frombuffer(self._mm, np.uint64, count=words, offset=HEADER_SIZE)
        self.words[:4] = (POOL_VERSION, num_workers, per_worker, per_worker)
        self.release: ReleaseWords | None = None
        self._holder_index = {rank: j for j, rank in enumerate(holders)}
        if words > release_at:
            self.words[[AREA_AT, HOLDER_COUNT]] = (release_at, len(holders))
            self.release = ReleaseWords(self.words, release_at, len(holders), total)
            known = peers or {}
            own = (os.getpid(), _segment.MY_START, _segment.MY_PIDNS)
            self.release.init(
                (rank, *(own if j == 0 else known.get(rank, (0, 0, 0))))
                for j, rank in enumerate(holders)
            )
            ring.on_drop(self.release.drop)  # a reader's BYE or loss ends its holds
        self._warned_size = False
        #: iterations opened (``reclaim`` at each ``iter()``): whose end ``leaving`` is
        self.iteration = 0
        self._iteration_lock = threading.Lock()  # an old iterator ends on another thread
        self.last_write_ns = 0  # the accepted batch's write into its slot, in its worker
        self.last_placed = 0  # bytes of it that its collate made in place
        self._finalizer = weakref.finalize(
            self, _unlink_all, self.control, ring.token, num_workers * per_worker, os.getpid()
        )
        self._on_close: list[Callable[[], None]] = []
        self.records = records(self.words, total)
        try:
            for i in range(self.spec.total):
                slot = ring.add_pooled(self._new_segment(i, GRANULE))
                self._record(i).reset(
                    SlotRecord(
                        PoolState.EMPTY,
                        slot.gen,
                        slot.capacity,
                        0,
                        0,
                        0,
                        name_suffix(slot.segment),
                        0,
                        0,
                    )
                )
        except BaseException:
            self.close()
            raise
        _POOLS[ring.token] = self

    def _new_segment(self, i: int, capacity: int) -> Segment:
        """Generation 0 of slot ``i``, admitted by the daemon first.

        NOTE [pool admission]
            With the node daemon, every byte of the pool goes through its admission
            before it exists: the leader's main process asks for generation 0 of
            each slot (``WorkerPool._new_segment``), and a worker asks for each
            generation it grows (``WorkerSlots._grow``) through the ``admit`` of its
            ``PoolSpec`` (``daemon_client.Admitter``: the daemon's socket path,
            connected once per worker process). A refusal is a
            :class:`ShmCapacityError` in the worker, re-raised on the leader
            (``WorkerFailure``) before the segment is made.
        """
        if self.daemon is not None:
            self.daemon.admit(self.ring.token, capacity + HEADER_SIZE)
        stem = slot_stem(self.ring.token, i, 0)
        segment = Segment.create_unique(stem, KIND_DATA, self.ring.token, capacity)
        if self.daemon is not None:
            self.daemon.add_segment(self.ring.token, segment.name, HEADER_SIZE + segment.capacity)
        return segment

    def _record(self, i: int) -> Record:
        return self.records[i]

    def state(self, i: int) -> str:
        return state_name(self._record(i).state)

    # -- per batch ---------------------------------------------------------

    def accept(self, ref: SlotRef) -> Slot:
        """The ring slot ``ref`` names, ready for ``ring.hold_for_readers``
        (FILLED -> PUBLISHED)."""
        i = ref.index
        if not 0 <= i < self.spec.total or ref.token != self.ring.token:
            raise ProtocolError(f"{ref!r} does not belong to pool {self.ring.token}")
        rec = self._record(i)
        if rec.state != PoolState.FILLED or rec.ticket != ref.ticket or rec.gen != ref.gen:
            raise ProtocolError(
                f"{ref!r} is stale: slot {i} is {self.state(i)} with ticket {rec.ticket}"
            )
        # A worker claims a slot its holders released by their words, maybe before
        # this process handled their RELEASEs: the ring's record follows here.
        self.ring.settle_pooled(self.base + i)
        slot = self.ring.slots[self.base + i]
        if slot.gen != ref.gen:
            slot = self._install(i, ref.gen)
        if ref.nbytes > slot.capacity:
            raise ProtocolError(f"{ref!r} overruns slot {i} of {slot.capacity} bytes")
        if self.release is not None:  # before PUBLISHED: NOTE [release words]
            holders = set(self.ring.readers)
            if self.ring.self_rank is not None:
                holders.add(self.ring.self_rank)
            self.release.hold(i, holders)
        rec.state = PoolState.PUBLISHED
        ref.accepted = True
        if not self._warned_size and int(self.words[USE]) < self.spec.per_worker:
            self._warn_size(slot.capacity)
        self.last_write_ns = rec.write_ns
        self.last_placed = rec.placed
        return slot

    def _warn_size(self, capacity: int) -> None:
        """Once: the workers shrank the pool to fit /dev/shm (NOTE [pool size])."""
        self._warned_size = True
        spec, use = self.spec, int(self.words[USE])
        log.warning(
            "shmloader: /dev/shm cannot hold the DataLoader workers' full slot pool "
            "(%d workers x %d slots of %s = %s); each worker uses %d slots instead (%s in "
            "all), so it prepares at most %d batch(es) ahead of the slowest rank instead of "
            "prefetch_factor=%d: data loading can stall when it is the bottleneck. Give "
            "/dev/shm more space (docker run --shm-size=...) to get the full pool back",
            spec.num_workers,
            spec.per_worker,
            human_bytes(capacity),
            human_bytes(spec.total * capacity),
            use,
            human_bytes(spec.num_workers * use * capacity),
            use - 1,
            spec.prefetch_factor,
        )

    def _install(self, i: int, gen: int) -> Slot:
        """Generation ``gen`` of slot ``i``, grown by a worker, replaces the ring's older one."""
        name = pool_slot_name(self.ring.token, i, gen, self._record(i).name)
        segment = Segment.attach(name, kind=KIND_DATA, token=self.ring.token)
        try:  # admitted by the worker before it made the segment (NOTE [pool admission])
            slot = self.ring.replace_pooled(self.base + i, segment)
        except BaseException:
            segment.close()
            raise
        if self.daemon is not None:
            self.daemon.add_segment(self.ring.token, name, HEADER_SIZE + segment.capacity)
        log.debug("pool %s: slot %d.%d holds %d bytes", self.ring.token, i, gen, slot.capacity)
        return slot

    def sync(self) -> None:
        """PUBLISHED -> EMPTY for every pool slot every holder released (words or RELEASEs).

        The ring's record of who holds a slot follows the release words too
        (NOTE [release words]), so that NOTE [ring growth] names only real holders.
        """
        slots = self.ring.slots
        for i in range(self.spec.total):
            rec = self._record(i)
            if rec.state != PoolState.PUBLISHED:
                continue
            ticket, slot = rec.ticket, slots[self.base + i]
            released = slot.state == SlotState.FREE
            if self.release is not None:
                self._follow_words(slot, i, ticket)
                released = released or self.release.released(i, ticket)
            if released:
                self._free_held(i, ticket)

    def _follow_words(self, slot: Slot, i: int, ticket: int) -> None:
        """Drop from the ring's holders of slot ``i`` those whose word says released."""
        assert self.release is not None
        blocking = self.release.blocking(i, ticket)
        for rank in list(slot.holders):
            j = self._holder_index.get(rank)
            if j is not None and not blocking >> j & 1:
                self.ring.release(rank, slot.index, slot.gen, slot.seq)

    def _free_held(self, i: int, ticket: int) -> None:
        """PUBLISHED -> EMPTY unless a worker claimed the slot meanwhile (its partition's lock)."""
        offset = i // self.spec.per_worker
        fcntl.lockf(self.control.fd, fcntl.LOCK_EX, 1, offset)
        try:
            rec = self._record(i)
            if rec.state == PoolState.PUBLISHED and rec.ticket == ticket:
                rec.state = PoolState.EMPTY
        finally:
            fcntl.lockf(self.control.fd, fcntl.LOCK_UN, 1, offset)

    # -- release words (NOTE [release words]) ------------------------------

    def announce_fields(self, slot: Slot | None) -> dict[str, Any]:
        """What a BATCH of ``slot`` tells readers about their release word, if any."""
        if self.release is None or slot is None or not slot.pooled:
            return {}
        i = slot.index - self.base
        return {"rel": self.control.name, "tk": self._record(i).ticket}

    def own_release(self, slot: Slot | None) -> Callable[[], None] | None:
        """For this process's own view of ``slot``'s batch: store its word when it is gone."""
        if self.release is None or slot is None or not slot.pooled:
            return None
        i = slot.index - self.base
        return functools.partial(self.release.release, i, 0, self._record(i).ticket)

    def abandon(self, ref: SlotRef) -> None:
        """A SlotRef died unpublished: FILLED -> EMPTY (from ``SlotRef.__del__``)."""
        if self._closed or not 0 <= ref.index < self.spec.total:
            return
        rec = self._record(ref.index)
        if rec.state == PoolState.FILLED and rec.ticket == ref.ticket:
            rec.state = PoolState.EMPTY

    def leaving(self, iteration: int) -> None:
        """This process ends the DataLoader iterator it opened at ``iteration`` (``reclaim``'s
        count when it did): its workers' waits for a slot end at once (``LEAVING``), until
        the next ``iter()``'s ``reclaim``. An iterator of an earlier iteration, ended late
        (an error's traceback kept its frame), says nothing to the workers of this one."""
        with self._iteration_lock:  # not between ``reclaim``'s reset and its count
            if iteration == self.iteration:
                self.words[LEAVING] = 1

    def reclaim(self) -> list[int]:
        """At ``iter()``: empty the slots whose worker died while WRITING or FILLED (the
        workers the last iteration's end stopped, too: ``leaving``).

        The half-written batch of a killed worker is never announced (its
        SlotRef was never sent, or died with the iterator) and its slot
        returns to the pool here. Returns the indices reclaimed.
        """
        with self._iteration_lock:
            left, self.words[LEAVING] = bool(self.words[LEAVING]), 0
            self.iteration += 1
        done = []
        for i in range(self.spec.total):
            rec = self._record(i)
            if rec.state in (PoolState.WRITING, PoolState.FILLED) and not process_alive(rec.pid, 0):
                self.ring.settle_pooled(self.base + i)
                slot = self.ring.slots[self.base + i]
                if rec.gen != slot.gen:
                    self._keep_orphan(i, rec.gen)
                rec.state = PoolState.EMPTY
                done.append(i)
        if done:  # workers the last iteration's end stopped are no news
            (log.debug if left else log.warning)(
                "shmloader: reclaimed pool slots %s of dead DataLoader workers", done
            )
        return done

    def _keep_orphan(self, i: int, gen: int) -> None:
        """A dead worker grew slot ``i`` to ``gen``: keep that segment, or roll back."""
        try:
            self._install(i, gen)
        except (ProtocolError, OSError):
            unlink_name(pool_slot_name(self.ring.token, i, gen, self._record(i).name))
            slot = self.ring.slots[self.base + i]
            rec = self._record(i)
            rec.gen, rec.capacity, rec.name = slot.gen, slot.capacity, name_suffix(slot.segment)

    @property
    def total_bytes(self) -> int:
        return sum(s.capacity for s in self.ring.slots[self.base : self.base + self.spec.total])

    def close(self) -> None:
        """Unlink the pool's names (the ring closes its slots). Idempotent."""
        if self._closed:
            return
        self._closed = True
        # the workers of a loop not ended yet (NOTE [goodbyes first] in ``_roles.producer``)
        # stop waiting for a slot now, rather than grow one once the names are gone
        self.words[LEAVING] = 1
        _POOLS.pop(self.ring.token, None)
        try:
            for callback in self._on_close:
                callback()
        finally:
            self._finalizer()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the pool closes (``collate.uninstall`` of its DataLoader)."""
        self._on_close.append(callback)


def _unlink_all(control: Segment, token: str, total: int, creator: int) -> None:
    """Unlink every generation of the pool's slots left in ``/dev/shm``, and the control.

    Found by what was made, not by what the control segment says (its words
    are writable by every worker, and garbage there must not hide a name):
    every segment whose name is a slot ``0 .. total-1`` of this ring and whose
    header carries this ring's token (random per job, written only by this
    job's processes) is unlinked, whichever process created it. Only in the
    process that made the pool: a forked child never unlinks it.
    """
    if os.getpid() != creator:
        return
    prefix = pool_stem(token)[: -len("pool")]  # "/shml-<token>-"
    for name in list_segments():
        if not name.startswith(prefix):
            continue
        with contextlib.suppress(ProtocolError, OSError):
            index, _gen = parse_slot_name(token, name)
            if index < total and read_header(name).token == token:
                unlink_name(name)
    control.unlink()
    control.close()


__all__ = ["SlotRef", "WorkerPool"]

"""The workers' slot pool: ring slots the leader's DataLoader workers write themselves. It
owns the pool's control segment (its header words, one ``SlotRecord`` per slot, where
the release words start), the pool state machine (``PoolState``, beside the ring's own
``SlotState`` of the same slots), the partition of the slots among workers, a worker's
growth of a slot, the fit of the whole pool in ``/dev/shm``, the reclaiming of dead
workers' slots and the copying of a collate's kept outputs out of a slot before it is
rewritten; the main process's side (``WorkerPool``) drives the ring's pooled slots and
never reads or writes a payload, a worker's side (``WorkerSlots``) touches only its own
partition's records and segments. The control segment's layout, the state machine
drawn and why the pool is sized as it is: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno
import fcntl
import functools
import itertools
import logging
import math
import mmap
import os
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._node import segment as _segment
from .._node.release import AREA_AT, HOLDER_COUNT, MAX_HOLDERS, NOBODY, ReleaseWords, area_words
from .._node.ring import (
    GRANULE,
    RingWriter,
    Slot,
    SlotState,
    parse_slot_name,
    slot_capacity_for,
    slot_stem,
)
from .._node.segment import (
    HEADER_SIZE,
    KIND_DATA,
    LIBC_MMAP,
    PREFIX,
    Segment,
    list_segments,
    process_alive,
    read_header,
    shm_free_bytes,
    touch,
    unlink_name,
)
from ..errors import PeerLostError, ProtocolError, ShmCapacityError, ShmLoaderError, human_bytes

if TYPE_CHECKING:
    from .._transport.daemon_client import DaemonClient

log = logging.getLogger(__name__)

POOL_VERSION = 2


class PoolState(enum.IntEnum):
    """A pool slot's ``state`` word (zero is invalid), and who may move it where.

    Its own names: the ring's ``SlotState`` (FREE, HELD) runs beside it for the
    same slot, in the main process only::

        EMPTY -> WRITING      worker only, under its partition's lock; ticket += 1,
                              pid = the worker
        PUBLISHED -> WRITING  worker only, the same, once every holder released the
                              current ticket (NOTE [release words] in ``release``): the
                              main process need not have seen the releases yet
        WRITING -> FILLED     worker only: encoded and written, its SlotRef sent
        WRITING -> EMPTY      worker only: the encode or the write failed
        FILLED -> PUBLISHED   main only, when it publishes the SlotRef (``accept``,
                              ticket checked); the slot's HOLDERS word first
        PUBLISHED -> EMPTY    main only, at its next ``next()`` (``sync``), when every
                              holder released (words, or the ring slot FREE by
                              RELEASEs), under the partition's lock and only if the
                              ticket is unchanged
        FILLED -> EMPTY       main only: a SlotRef the DataLoader dropped (``abandon``)
        WRITING/FILLED -> EMPTY   main only, at ``iter()``: the worker is dead (``reclaim``)

    PUBLISHED is the one state two processes may leave (a worker claiming the
    slot, the main process emptying it): it is left only under the lock.
    """

    INVALID = 0
    EMPTY = 1
    WRITING = 2
    FILLED = 3
    PUBLISHED = 4


def state_name(value: int) -> str:
    """``PoolState`` name of a state word (garbage in a word shows as ``?``)."""
    try:
        return PoolState(value).name
    except ValueError:
        return "?"


class SlotRecord(NamedTuple):
    """A pool slot's record in the control segment: ``_RECORD``'s fields, in this order."""

    state: int  # PoolState
    gen: int  # the slot segment's current generation
    capacity: int  # its payload bytes
    pid: int  # the worker that claimed the slot last
    ticket: int  # claims so far: names the batch in it (NOTE [release words] in ``release``)
    write_ns: int  # that worker's encode + write of it, for stats
    name: int  # the random part of the generation's segment name (NOTE [pool names])
    placed: int  # bytes of the batch its collate made in the slot (NOTE [collate into the slot])
    kept: int  # the worker whose collate still references this generation, or 0
    # (NOTE [kept collate outputs])


#: One slot's record: u64 words, little-endian; each record has ``_RECORD_BYTES``.
_RECORD = struct.Struct("<" + "Q" * len(SlotRecord._fields))
_RECORD_BYTES = 128  # two cache lines per slot
_RECORD_WORDS = _RECORD_BYTES // 8
_RECORDS_AT = 8  # in words: the records start at payload offset 64, after the header words
assert _RECORD.size <= _RECORD_BYTES


class _Word:
    """A ``SlotRecord`` field of a ``Record``: one aligned 8-byte load or store."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.index = SlotRecord._fields.index(name)

    def __get__(self, rec: Record, owner: type | None = None) -> int:
        return int(rec.words[self.index])

    def __set__(self, rec: Record, value: int) -> None:
        rec.words[self.index] = value


class Record:
    """One slot's record in a process's mapping of the control segment, by field name.

    The main process and workers write one record concurrently, so each field
    is loaded and stored on its own (an aligned 8-byte word: never torn); only
    ``reset`` (before any worker exists) and ``snapshot`` (what to show) take
    the record whole.
    """

    __slots__ = ("words",)
    state, gen, capacity, pid, ticket = _Word(), _Word(), _Word(), _Word(), _Word()
    write_ns, name, placed, kept = _Word(), _Word(), _Word(), _Word()

    def __init__(self, words: np.ndarray) -> None:
        self.words = words  # _RECORD_WORDS u64 of the control mapping

    def snapshot(self) -> SlotRecord:
        return SlotRecord._make(_RECORD.unpack_from(self.words.data))

    def reset(self, record: SlotRecord) -> None:
        _RECORD.pack_into(self.words.data, 0, *record)


def _records(words: np.ndarray, total: int) -> list[Record]:
    at = _RECORDS_AT
    return [
        Record(words[at + i * _RECORD_WORDS : at + (i + 1) * _RECORD_WORDS]) for i in range(total)
    ]


#: A worker's wait for an EMPTY slot polls with this backoff (seconds).
POLL_FIRST_S, POLL_MAX_S = 50e-6, 2e-3
#: ... and checks this often that the leader's main process is alive (seconds).
OWNER_CHECK_S = 0.2
#: The fewest slots a worker runs with (NOTE [pool size]); word 3 holds how many are in use.
MIN_PER_WORKER = 2
USE = 3
#: How long a worker waits for a slot that fits to be released before it grows
#: another one (NOTE [pool size]): a lockstep job's ranks drop their previous
#: batch within one delivery; a job that keeps more pays this once per slot.
GROW_GRACE_S = 2.0

#: Pools of this process by ring token, for SlotRef.__del__ (abandon).
_POOLS: weakref.WeakValueDictionary[str, WorkerPool] = weakref.WeakValueDictionary()


def pool_stem(token: str) -> str:
    """The pool control segment's name without its random part."""
    return f"/{PREFIX}{token}-pool"


def pool_slot_name(token: str, i: int, gen: int, suffix: int) -> str:
    """Generation ``gen`` of pool slot ``i``: ``slot_stem`` plus its recorded random part.

    NOTE [pool names]
        Pool slot segments (and the pool's control segment) stay named in
        ``/dev/shm`` for the life of the pool, unlike ring slots (NOTE [names in
        /dev/shm]): a worker started later (every epoch without persistent
        workers, any multiprocessing context) opens its slots by name. Their
        headers name the leader's main process as owner, so a killed leader's
        segments are reaped by ``shmloader gc`` or the daemon like the rest of
        its ring. ``close`` unlinks every generation left in ``/dev/shm``, found by
        name and header token (``_unlink_all``), never by the control words.

        The names are still unpredictable (NOTE [unpredictable names] in
        ``segment``): ``<stem>.<random>``. The control segment's name travels to
        the workers in the pickled ``PoolSpec``; each slot's random part lives in
        its record (``NAME``), written by whoever creates that generation (the
        main process for generation 0, the growing worker after), so every
        process derives the current name from the control segment.
    """
    return f"{slot_stem(token, i, gen)}.{suffix:016x}"


def _suffix(segment: Segment) -> int:
    """The random part of a name made by ``Segment.create_unique``."""
    return int(segment.name.rsplit(".", 1)[1], 16)


def per_worker_slots(prefetch_factor: int, ring_slots: int, num_workers: int) -> int:
    """Slots in one worker's partition: ``prefetch_factor`` batches in flight, the worker's
    share of what ranks hold (``SHMLOADER_SLOTS + 2``), and one more.

    NOTE [pool size]
        ``per_worker`` slots per worker let every worker run ``prefetch_factor``
        batches ahead while ranks hold theirs; but the fewest a worker can run
        with is ``MIN_PER_WORKER`` = 2: one the ranks hold (the batch the user is
        on), one it writes next.

        How many a job really uses (each grown once, to the batch size): a
        worker takes the smallest free slot that fits, a PUBLISHED one every holder
        released counting as free (NOTE [release words]). When none fits but
        one that fits is PUBLISHED, held by ranks about to drop it (a batch older than the
        one this worker wrote last: ranks drop it as they take that one), the
        worker waits for it, up to ``GROW_GRACE_S``, before it grows another.
        A worker gets its next task the moment the main process takes a batch,
        while every rank still holds the one before; without that wait, a
        lockstep job would grow a third slot per worker. With it, a lockstep
        job cycles through ``prefetch_factor + 1`` slots per worker (two for
        one worker with ``prefetch_factor=1``: base PyTorch's ``num_workers x
        prefetch_factor`` in flight plus the one the loop holds); a job whose
        ranks keep more (a prefetch queue, device copies in flight) pays the
        grace once per extra slot it grows, never more than ``per_worker``.

        Fitting /dev/shm: A rank that lags behind holds more, yet it only
        moves forward through batches already announced, releasing them, so the
        worker's wait always ends. When a worker first learns the batch size
        (``check_capacity``) and the whole pool at that size does not fit
        ``/dev/shm``, the pool shrinks to the most slots per worker that fit,
        down to 2, for every worker (the *in use* word; slots past it are never
        claimed nor grown), and the leader's main process warns once with what
        it costs (fewer batches prepared ahead). Only when 2 per worker do not fit
        is it a :class:`ShmCapacityError`. Base PyTorch holds up to
        ``num_workers x prefetch_factor`` batches in shared memory (plus the one
        the loop holds); the pool's least, ``2 x num_workers`` slots (each
        ``slot_capacity_for`` a batch: 1/8 headroom, 64 KiB granules), is within
        that for ``prefetch_factor >= 2`` up to the headroom; with
        ``prefetch_factor=1`` it can be up to 2.25 times as much. The one-copy path
        (the leader's main process copies each batch into the ring) needs torch's
        in-flight batches *plus* ring slots, never less than this minimum, so it
        is not a fallback for space.
    """
    return prefetch_factor + math.ceil((ring_slots + 2) / num_workers) + 1


@dataclass(frozen=True)
class PoolSpec:
    """What a worker needs to find and use its partition (pickled to every worker)."""

    token: str
    control: str  # the pool control segment's name (random: NOTE [pool names])
    num_workers: int
    per_worker: int
    prefetch_factor: int
    owner_pid: int  # the leader's main process: owner in every pool segment's header
    owner_start: int
    timeout: float
    allow_pickle: bool
    collate_in_slot: bool = True  # NOTE [collate into the slot] in ``collate``
    # the daemon's admission for bytes a worker adds, or None (NOTE [pool admission])
    admit: Callable[[str, int], None] | None = None
    # the ring directory: a spawned worker does not inherit the leader's (``ringdir``)
    shm_dir: str = ""

    @property
    def total(self) -> int:
        return self.num_workers * self.per_worker


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
        release_at = _RECORDS_AT + total * _RECORD_WORDS
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
        self.last_write_ns = 0  # the accepted batch's write into its slot, in its worker
        self.last_placed = 0  # bytes of it that its collate made in place
        self._finalizer = weakref.finalize(
            self, _unlink_all, self.control, ring.token, num_workers * per_worker, os.getpid()
        )
        self._on_close: list[Callable[[], None]] = []
        self.records = _records(self.words, total)
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
                        _suffix(slot.segment),
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
        """The ring slot ``ref`` names, ready for ``ring.publish`` (FILLED -> PUBLISHED)."""
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

    def reclaim(self) -> list[int]:
        """At ``iter()``: empty the slots whose worker died while WRITING or FILLED.

        The half-written batch of a killed worker is never announced (its
        SlotRef was never sent, or died with the iterator) and its slot
        returns to the pool here. Returns the indices reclaimed.
        """
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
        if done:
            log.warning("shmloader: reclaimed pool slots %s of dead DataLoader workers", done)
        return done

    def _keep_orphan(self, i: int, gen: int) -> None:
        """A dead worker grew slot ``i`` to ``gen``: keep that segment, or roll back."""
        try:
            self._install(i, gen)
        except (ProtocolError, OSError):
            unlink_name(pool_slot_name(self.ring.token, i, gen, self._record(i).name))
            slot = self.ring.slots[self.base + i]
            rec = self._record(i)
            rec.gen, rec.capacity, rec.name = slot.gen, slot.capacity, _suffix(slot.segment)

    @property
    def total_bytes(self) -> int:
        return sum(s.capacity for s in self.ring.slots[self.base : self.base + self.spec.total])

    def close(self) -> None:
        """Unlink the pool's names (the ring closes its slots). Idempotent."""
        if self._closed:
            return
        self._closed = True
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


# --------------------------------------------------------------------- worker side


class WorkerSlots:
    """One DataLoader worker's view of its partition: claim, grow, fill.

    Lives only in the worker process that made it (``pid``); holds a shared
    mapping of each of its slots for as long as the generation lives.
    """

    def __init__(self, spec: PoolSpec, worker_id: int) -> None:
        if not 0 <= worker_id < spec.num_workers:
            raise ShmLoaderError(
                f"DataLoader worker id {worker_id} is outside the pool made for "
                f"{spec.num_workers} workers; set num_workers before ShmLoader is built"
            )
        self.spec = spec
        self.worker_id = worker_id
        self.pid = os.getpid()
        if spec.shm_dir:
            _segment.use_dir(spec.shm_dir)
        self.control = Segment.attach(spec.control, kind=KIND_DATA, token=spec.token)
        mm = self.control.map_shared()
        self.words = np.frombuffer(mm, np.uint64, offset=HEADER_SIZE)
        self.records = _records(self.words, spec.total)
        self.release = ReleaseWords.of(self.words, spec.total)  # NOTE [release words]
        self.dead = 0  # holders this worker saw dead (mask of release-word columns)
        self.last_filled = -1  # the slot of this worker's newest batch
        self.patient = True  # wait for a slot about to be released before growing one
        self.took_released = False  # the last claim took a slot its holders released
        self.maps: dict[int, tuple[int, Segment, mmap.mmap, np.ndarray]] = {}
        self.grown = False  # has this worker checked /dev/shm for the pool's size yet
        self.last_nbytes = 0  # this worker's last batch: the size to claim for the next
        self.unsent: dict[int, int] = {}  # slot -> a generation grown since its claim
        # (slot, gen) -> {key: (address, nbytes)} of pieces a collate still references
        # (NOTE [kept collate outputs])
        self.live: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._keys = itertools.count()
        self.detached = 0  # pieces copied out of a slot before it was rewritten

    def _record(self, i: int) -> Record:
        return self.records[i]

    def _in_use(self) -> int:
        """Slots per worker in use (NOTE [pool size])."""
        return max(MIN_PER_WORKER, min(int(self.words[USE]), self.spec.per_worker))

    @property
    def partition(self) -> range:
        """The slots this worker claims: the first ``_in_use()`` of its own."""
        start = self.worker_id * self.spec.per_worker
        return range(start, start + self._in_use())

    def claim(self, nbytes: int) -> tuple[int, int]:
        """A slot of this partition for ``nbytes``: (index, ticket), state WRITING.

        Waits, polling with backoff, at most ``spec.timeout`` seconds for a
        claimable slot (NOTE [bounded waits] in ``channel``), and raises
        :class:`PeerLostError` within ``OWNER_CHECK_S`` of the leader's main
        process dying (its own view holds every batch, and it frees what
        readers left): the DataLoader worker then ends as its own parent
        watchdog sees the parent gone, instead of holding the pool's memory
        for the rest of the timeout. Every ``OWNER_CHECK_S`` it also looks
        for holders that died (NOTE [release words]).

        Waits up to ``GROW_GRACE_S`` for a slot ranks are about to drop
        before it grows another (NOTE [pool size]); once such a wait ran
        out (ranks keep batches), it grows at once until a claim finds a
        slot released again.
        """
        now = time.monotonic()
        deadline, check = now + self.spec.timeout, now + OWNER_CHECK_S
        patient_until = now + GROW_GRACE_S if self.patient else now
        delay = POLL_FIRST_S
        while True:
            got = self._try_claim(nbytes, patient=now < patient_until)
            if got is not None:
                if self.took_released:
                    self.patient = True  # ranks release as they go: worth waiting for
                elif self.patient and now >= patient_until:
                    self.patient = False  # they kept it past the grace: grow without waiting
                return got
            now = time.monotonic()
            if now >= check:
                check = now + OWNER_CHECK_S
                self._check_holders()
                if not process_alive(self.spec.owner_pid, self.spec.owner_start):
                    raise PeerLostError(
                        None,
                        f"leader's main process (pid {self.spec.owner_pid})",
                        f"it died while DataLoader worker {self.worker_id} waited for a free "
                        "pool slot",
                    )
            if now > deadline:
                states = [state_name(self._record(i).state) for i in self.partition]
                raise ShmLoaderError(
                    f"DataLoader worker {self.worker_id} waited {self.spec.timeout:.0f} s for a "
                    f"free slot of its {len(states)} pool slots (states {states}): ranks "
                    "still hold every batch written there. Keep fewer delivered batches alive, "
                    "or raise SHMLOADER_TIMEOUT if a rank is just slow"
                )
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _try_claim(self, nbytes: int, *, patient: bool = False) -> tuple[int, int] | None:
        """Claim the smallest free slot that fits, else grow the largest free one.

        A PUBLISHED slot whose every holder released its batch (NOTE [release
        words]) is empty. ``patient``: rather than grow another slot, wait
        while a slot that fits is PUBLISHED, held by ranks about to drop it (a
        batch older than this worker's newest: ranks take that one next).
        """
        offset = self.worker_id  # one byte of the control file per partition
        fcntl.lockf(self.control.fd, fcntl.LOCK_EX, 1, offset)
        try:
            best = None
            coming = False  # a slot that fits will be released soon
            for i in self.partition:
                rec = self._record(i)
                state = rec.state
                if state == PoolState.PUBLISHED and self._released(i, rec.ticket):
                    state = PoolState.EMPTY
                if state != PoolState.EMPTY or self._kept_elsewhere(rec.kept):
                    fits = rec.capacity >= nbytes
                    published = state == PoolState.PUBLISHED
                    coming |= patient and published and fits and i != self.last_filled
                    continue
                cap = rec.capacity
                if best is None:
                    best = i
                    continue
                best_cap = self._record(best).capacity
                if (cap >= nbytes) and (best_cap < nbytes or cap < best_cap):
                    best = i  # the smallest that fits
                elif cap < nbytes and best_cap < nbytes and cap > best_cap:
                    best = i  # none fits yet: grow the largest
            if best is None:
                return None
            if coming and self._record(best).capacity < nbytes:
                return None  # NOTE [pool size]: wait for it rather than grow another slot
            rec = self._record(best)
            self.took_released = rec.state == PoolState.PUBLISHED
            ticket = rec.ticket + 1
            rec.ticket = ticket
            rec.pid = self.pid
            rec.state = PoolState.WRITING
            return best, ticket
        finally:
            fcntl.lockf(self.control.fd, fcntl.LOCK_UN, 1, offset)

    def _released(self, i: int, ticket: int) -> bool:
        """Every holder of slot ``i``'s batch ``ticket`` dropped it (NOTE [release words])."""
        return self.release is not None and self.release.released(i, ticket, self.dead)

    def _check_holders(self) -> None:
        """Count as released the holds of readers whose process died (liveness)."""
        if self.release is None:
            return
        waiting = 0
        for i in self.partition:
            rec = self._record(i)
            if rec.state == PoolState.PUBLISHED:
                waiting |= self.release.blocking(i, rec.ticket, self.dead)
        if waiting:
            self.dead |= self.release.dead_among(waiting)

    def _kept_elsewhere(self, keeper: int) -> bool:
        """A live worker other than this one still references the slot's memory."""
        return keeper not in (0, self.pid) and process_alive(keeper, 0)

    def payload(self, i: int, nbytes: int) -> tuple[np.ndarray, int]:
        """Slot ``i`` (claimed) as a writable uint8 array of at least ``nbytes``; and its gen.

        Pieces of this generation a collate still references are copied out
        first (NOTE [kept collate outputs]): the array returned is safe to write.
        """
        rec = self._record(i)
        gen, cap = rec.gen, rec.capacity
        if cap < nbytes:
            gen = self._grow(i, gen, cap, nbytes)
        elif self.live.get((i, gen)):
            self._detach(i, gen)
        held = self.maps.get(i)
        if held is None or held[0] != gen:
            self._forget(i)
            name = pool_slot_name(self.spec.token, i, gen, rec.name)
            segment = Segment.attach(name, kind=KIND_DATA, token=self.spec.token)
            mm = segment.map_shared()
            touch(mm)  # populate this process's page tables once, not per batch
            view = np.frombuffer(mm, np.uint8, count=segment.capacity, offset=HEADER_SIZE)
            self.maps[i] = held = (gen, segment, mm, view)
        return held[3], gen

    def check_capacity(self, nbytes: int, what: str) -> None:
        """Fit the pool at ``nbytes`` per slot into /dev/shm: shrink it, or raise.

        The most slots per worker (down to ``MIN_PER_WORKER``) whose growth to
        this size fits the free space become the pool's *in use* count, for
        every worker (NOTE [pool size]); :class:`ShmCapacityError` when not
        even that fits. Decided under a pool-wide lock (the control file's
        byte past the partitions' bytes).
        """
        capacity = slot_capacity_for(nbytes)
        spec = self.spec

        def need(k: int) -> int:
            have = (
                self._record(w * spec.per_worker + j).capacity
                for w in range(spec.num_workers)
                for j in range(k)
            )
            return sum(max(0, capacity - cap) for cap in have)

        free = shm_free_bytes()
        if free is None or need(self._in_use()) <= free:
            return
        offset = spec.num_workers
        fcntl.lockf(self.control.fd, fcntl.LOCK_EX, 1, offset)
        try:
            use = self._in_use()
            while use > MIN_PER_WORKER and need(use) > free:
                use -= 1
            if need(use) > free:
                raise ShmCapacityError(
                    need(use),
                    free,
                    f"the DataLoader workers' slot pool for {what} ({spec.num_workers} workers "
                    f"x {MIN_PER_WORKER} slots of {human_bytes(capacity)}, the fewest it runs "
                    f"with: one a rank holds, one the worker writes)",
                    fix="lower the DataLoader's num_workers, make the batches smaller, or give "
                    "/dev/shm more space (docker run --shm-size=..., or a larger tmpfs)",
                )
            self.words[USE] = min(use, int(self.words[USE]))
        finally:
            fcntl.lockf(self.control.fd, fcntl.LOCK_UN, 1, offset)

    def _grow(self, i: int, gen: int, cap: int, nbytes: int) -> int:
        """Make generation ``gen + 1`` of slot ``i``, big enough for ``nbytes``."""
        if not self.grown:
            self.check_capacity(nbytes, f"{nbytes}-byte batches")
            self.grown = True
        capacity = slot_capacity_for(max(nbytes, int(cap * 1.5)))
        new = gen + 1
        rec = self._record(i)
        old_name = rec.name
        # Grown twice within one claim (a batch that outgrew the slot it was
        # collated into): no SlotRef ever named the generation in between, so
        # nobody else will install it, and its name would be lost below.
        stale = (
            pool_slot_name(self.spec.token, i, gen, old_name) if self.unsent.get(i) == gen else None
        )
        if self.spec.admit is not None:  # NOTE [pool admission]: before a byte exists
            self.spec.admit(self.spec.token, HEADER_SIZE + capacity)
        stem = slot_stem(self.spec.token, i, new)
        segment = Segment.create_unique(stem, KIND_DATA, self.spec.token, capacity)
        # Recorded at once, while the header still names this worker: if it dies
        # before this, gc reaps the segment (dead owner); after, close() and
        # reclaim() find it from here.
        rec.name = _suffix(segment)
        rec.gen = new
        try:
            # the job's owner is the leader's main process, not this short-lived worker
            header = dataclasses.replace(
                segment.header, pid=self.spec.owner_pid, start=self.spec.owner_start
            )
            header.write(segment.fd)
            segment.header = header
            mm = segment.map_shared()
            touch(mm)
        except BaseException:
            segment.unlink()
            segment.close()
            rec.gen, rec.name = gen, old_name
            raise
        self._forget(i)
        if stale is not None:
            unlink_name(stale)
        view = np.frombuffer(mm, np.uint8, count=segment.capacity, offset=HEADER_SIZE)
        self.maps[i] = (new, segment, mm, view)
        rec.capacity = segment.capacity
        self.unsent[i] = new
        return new

    def track(self, i: int, gen: int, piece: np.ndarray) -> None:
        """Count ``piece`` (of slot ``i``, handed to a collate) as live until it dies.

        ``piece`` must be the object a storage was made from (``torch.frombuffer``
        holds it for exactly the storage's life).

        NOTE [kept collate outputs]
            A collate's shared-memory outputs are made in the worker's claimed slot
            (NOTE [collate into the slot] in ``collate``), and a collate may keep them
            past the call: a memory bank that returns its output from K calls back, a
            packing carry, a view of one leaf. Plain PyTorch keeps such outputs
            intact (each is fresh shared memory), so a slot must never be rewritten
            under them. The worker tracks every piece of a slot it hands to a
            collate (``WorkerSlots.track``: a finalizer on the array a storage was
            made from, which lives exactly as long as that storage) and records
            itself in the slot's ``KEPT`` word while any is alive. Before it writes
            into a generation that still has live pieces (the next claim of that
            slot), it *detaches* them (``_detach``): the pages under each piece are
            copied into private anonymous memory mapped at the very same addresses
            (``mremap`` over them, one atomic step per range), so every tensor that
            references them keeps its bytes, and the slot is mapped afresh for the
            new batch. The cost is one copy of what is kept, when it is kept; a
            collate that keeps nothing pays a finalizer per storage. Another process
            (a second worker with the same id: two DataLoader iterators alive at
            once) never claims a slot whose ``KEPT`` names a live worker other than
            itself.
        """
        key = next(self._keys)
        self.live.setdefault((i, gen), {})[key] = (piece.ctypes.data, piece.nbytes)
        self._record(i).kept = self.pid
        weakref.finalize(piece, self._untrack, i, gen, key)

    def _untrack(self, i: int, gen: int, key: int) -> None:
        if os.getpid() != self.pid:  # a forked child's copy of the tracking: not ours
            return
        live = self.live.get((i, gen))
        if live is None or live.pop(key, None) is None or live:
            return
        del self.live[(i, gen)]
        rec = self._record(i)
        if rec.kept == self.pid and not any(slot == i for slot, _gen in self.live):
            rec.kept = 0

    def _detach(self, i: int, gen: int) -> None:
        """Copy the live pieces of slot ``i`` out of it, at their addresses; remap the slot."""
        pieces = self.live.pop((i, gen))
        _privatise(pieces.values())
        self.detached += len(pieces)
        self._forget(i)  # the old mapping now holds private pages: map the slot afresh
        if not any(slot == i for slot, _gen in self.live):
            self._record(i).kept = 0
        log.debug("pool slot %d.%d: %d kept collate outputs copied out", i, gen, len(pieces))

    def filled(self, i: int, write_ns: int, placed: int = 0) -> None:
        self.unsent.pop(i, None)
        self.last_filled = i
        rec = self._record(i)
        rec.write_ns = write_ns
        rec.placed = placed
        rec.state = PoolState.FILLED

    def free(self, i: int) -> None:
        """Give a claimed slot back unwritten (the encode or write failed)."""
        self.unsent.pop(i, None)  # its generation stays recorded: the main process installs it
        self._record(i).state = PoolState.EMPTY

    def _forget(self, i: int) -> None:
        held = self.maps.pop(i, None)
        if held is not None:
            _gen, segment, mm, _view = held
            del _view
            with contextlib.suppress(BufferError):
                mm.close()
            segment.close()


_LIBC = ctypes.CDLL(None, use_errno=True)  # mremap and munmap; mmap is segment's LIBC_MMAP
_LIBC.mremap.restype = ctypes.c_void_p
_LIBC.mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


def _page_ranges(pieces: Any) -> list[tuple[int, int]]:
    """The page-aligned, merged ``(start, end)`` address ranges under ``pieces``."""
    page = mmap.PAGESIZE
    spans = sorted(
        (addr // page * page, -(-(addr + n) // page) * page) for addr, n in pieces if n > 0
    )
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _privatise(pieces: Any) -> None:
    """Replace the pages under ``pieces`` by private anonymous copies, at the same addresses.

    For each range: a fresh anonymous mapping gets a copy of the bytes, then
    ``mremap(MREMAP_FIXED)`` moves it over the range in one step, so whoever
    holds a pointer into it reads the same bytes before and after, and the
    shared pages behind it are no longer referenced (NOTE [kept collate outputs]).
    """
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    for start, end in _page_ranges(pieces):
        n = end - start
        if LIBC_MMAP is None:
            raise OSError(errno.ENOSYS, "no libc mmap to copy a kept collate output with")
        new = LIBC_MMAP(None, n, prot, flags, -1, 0)
        if new in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(
                err, f"mmap of {n} bytes to copy a kept collate output: {os.strerror(err)}"
            )
        ctypes.memmove(new, start, n)
        moved = _LIBC.mremap(
            ctypes.c_void_p(new), n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, ctypes.c_void_p(start)
        )
        if moved != start:
            err = ctypes.get_errno()
            _LIBC.munmap(ctypes.c_void_p(new), n)
            raise OSError(err, f"mremap of a kept collate output: {os.strerror(err)}")


def estimate_bytes(obj: Any, depth: int = 0) -> int:
    """Bytes of the tensors and arrays in ``obj`` (the samples a collate will stack)."""
    if depth > 6:
        return 0
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int) and hasattr(obj, "shape"):
        return nbytes
    if isinstance(obj, dict):
        return sum(estimate_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(estimate_bytes(v, depth + 1) for v in obj)
    return 0


__all__ = ["PoolSpec", "SlotRef", "WorkerPool", "WorkerSlots", "estimate_bytes"]

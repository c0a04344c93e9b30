"""The workers' slot pool as both sides see it: its control segment and what travels.

It owns the control segment's layout (its header words, one ``SlotRecord`` per
slot read and written field by field through ``Record``, where the release words
start), the pool state machine (``PoolState``, beside the ring's own ``SlotState``
of the same slots), the pool's segment names (NOTE [pool names]), its size per
worker (NOTE [pool size]) and the ``PoolSpec`` pickled to every worker. The main
process's side is ``pool``, a worker's is ``partition``; the layout drawn and why
the pool is sized as it is: ``docs/internals/datapath.md``. It touches no segment
and imports only ``segment``'s and ``ring``'s names.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._node.ring import slot_stem
from .._node.segment import PREFIX, Segment

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
RECORD_WORDS = _RECORD_BYTES // 8
RECORDS_AT = 8  # in words: the records start at payload offset 64, after the header words
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
        self.words = words  # RECORD_WORDS u64 of the control mapping

    def snapshot(self) -> SlotRecord:
        return SlotRecord._make(_RECORD.unpack_from(self.words.data))

    def reset(self, record: SlotRecord) -> None:
        _RECORD.pack_into(self.words.data, 0, *record)


def records(words: np.ndarray, total: int) -> list[Record]:
    """The ``total`` slot records of a mapping of the control segment's words."""
    at = RECORDS_AT
    return [
        Record(words[at + i * RECORD_WORDS : at + (i + 1) * RECORD_WORDS]) for i in range(total)
    ]


#: The fewest slots a worker runs with (NOTE [pool size]); word 3 holds how many are in use.
MIN_PER_WORKER = 2
USE = 3
#: Word 6: nonzero while the leader's main process ends its DataLoader iterator (the user
#: left the iteration, or the loader closed): a worker waiting for a slot stops waiting
#: (NOTE [pool size]), so the iterator's shutdown does not wait out ``GROW_GRACE_S``.
LEAVING = 6


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
        its ring. ``WorkerPool.close`` unlinks every generation left in
        ``/dev/shm``, found by name and header token (``_unlink_all``), never by
        the control words.

        The names are still unpredictable (NOTE [unpredictable names] in
        ``segment``): ``<stem>.<random>``. The control segment's name travels to
        the workers in the pickled ``PoolSpec``; each slot's random part lives in
        its record (``NAME``), written by whoever creates that generation (the
        main process for generation 0, the growing worker after), so every
        process derives the current name from the control segment.
    """
    return f"{slot_stem(token, i, gen)}.{suffix:016x}"


def name_suffix(segment: Segment) -> int:
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

"""The shared-memory ring of one SP group on one node.

It owns the writer's side (``RingWriter``: the control segment and its counters,
the slots, each its own data segment touched once and rewritten after, the slot
state machine, growth and shrinking, retirement: NOTE [ring shrink], NOTE
[retired slots]) and the reader's (``RingReader``: a descriptor per slot, one
copy-on-write mapping per delivered batch, made by ``views``: NOTE [slot
lifetime]). It touches only its own segments (through ``segment``) and their
release words; what it asks of the daemon comes from above as a ``NodeDaemon``
(NOTE [layers]).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import functools
import json
import logging
import mmap
import os
import secrets
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import ProtocolError, ShmCapacityError
from . import cleanup, forks, ringdir, unmap
from .mapping import touch, touch_range
from .release import ReaderWords
from .segment import (
    HEADER_SIZE,
    KIND_CONTROL,
    KIND_DATA,
    PAGE,
    PREFIX,
    Segment,
    huge_ring,
    ring_dir,
    shm_free_bytes,
)
from .views import private_view

log = logging.getLogger(__name__)

#: Headroom given to a new slot over the batch that made it: variable-size
#: batches then rarely force a regrow.
HEADROOM = 1.125
#: Slot capacities are multiples of this.
GRANULE = 64 << 10
#: A FREE slot larger than this many times what each of the last
#: ``SHRINK_WINDOW`` batches needed is retired (NOTE [ring shrink]).
SHRINK_RATIO = 4
SHRINK_WINDOW = 8

# Control segment counters, at offset 64 of the header page.
_COUNTERS = struct.Struct("<QQQQQQQQ")
COUNTER_FIELDS = (
    "published",
    "bytes_published",
    "publish_ns_total",
    "last_publish_unix_ns",
    "slots",
    "ring_bytes",
    "readers",
    "closed",
)
_COUNTERS_AT = 64
_DESCR_LEN = struct.Struct("<I")
CONTROL_CAPACITY = 4 * PAGE


class NodeDaemon(Protocol):
    """What a ring writer asks of the node daemon (``daemon_client.DaemonClient``).

    Given to the writer from above, so this layer never imports the daemon's
    client (NOTE [layers] in ``cleanup``).
    """

    def admit(self, token: str, nbytes: int) -> None: ...
    def check_ring_dir(self, directory: str) -> None: ...
    def adopt(self, token: str, name: str, nbytes: int) -> int | None: ...
    def add_segment(self, token: str, name: str, nbytes: int) -> None: ...
    def remove_segment(self, token: str, name: str) -> None: ...


# The slot state machine (zero is invalid), and how a pooled slot's runs beside the
# pool's: docs/internals/state-machines.md.
class SlotState(enum.IntEnum):
    INVALID = 0
    FREE = 1
    HELD = 2
    RETIRED = 3


@dataclass(eq=False)
class Slot:
    index: int
    gen: int
    segment: Segment
    mm: mmap.mmap
    payload: np.ndarray
    state: SlotState = SlotState.FREE
    seq: int = -1
    holders: set[int] = field(default_factory=set)
    attached: set[int] = field(default_factory=set)
    pooled: bool = False  # written by DataLoader workers (``pool``): never acquired here

    @property
    def capacity(self) -> int:
        return self.segment.capacity


def new_token() -> str:
    """A per-ring random token: 16 hex characters."""
    return secrets.token_hex(8)


def control_stem(token: str) -> str:
    """The control segment's name without its random part (NOTE [unpredictable names])."""
    return f"/{PREFIX}{token}-ctl"


def slot_stem(token: str, index: int, gen: int) -> str:
    """A slot segment's name without its random part: ``<stem>.<random>``."""
    return f"/{PREFIX}{token}-{index}.{gen}"


def parse_slot_name(token: str, name: str) -> tuple[int, int]:
    """(index, gen) of a slot name of ring ``token``; :class:`ProtocolError` otherwise."""
    prefix = f"/{PREFIX}{token}-"
    parts = name.removeprefix(prefix).split(".")
    if not name.startswith(prefix) or len(parts) != 3 or not all(p.isalnum() for p in parts):
        raise ProtocolError(f"segment {name} does not belong to ring {token}")
    if not (parts[0].isdigit() and parts[1].isdigit()):
        raise ProtocolError(f"segment {name} does not belong to ring {token}")
    return int(parts[0]), int(parts[1])


def slot_capacity_for(nbytes: int) -> int:
    """A new slot's payload capacity for a batch of ``nbytes``.

    In a huge-page ring the whole segment (header and payload) is a multiple
    of 2 MiB (NOTE [huge-page ring] in ``ringdir``).
    """
    cap = max(int(nbytes * HEADROOM), GRANULE)
    if huge_ring():
        return _round_up(HEADER_SIZE + cap, ringdir.HUGE) - HEADER_SIZE
    return (cap + GRANULE - 1) // GRANULE * GRANULE


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class RingWriter:
    """The writer's side: owns the control segment and every slot.

    ``readers`` are the ranks that map slots on this node; each must ATTACH a
    new segment before its name is unlinked and RELEASE every batch it was
    given. ``self_rank`` (a node leader) also holds every batch it publishes,
    through its own private mapping. Not thread-safe: the loader drives it
    from one thread.
    """

    def __init__(
        self,
        token: str,
        readers: frozenset[int],
        description: dict,
        *,
        self_rank: int | None = None,
        daemon: NodeDaemon | None = None,
    ) -> None:
        self.token = token
        self.readers = set(readers)  # live readers: drop_reader() removes one
        self.self_rank = self_rank
        self.slots: list[Slot] = []
        self._daemon = daemon
        self._retired: set[str] = set()  # names of replaced segments (late ATTACHED is fine)
        self._unannounced: list[str] = []  # retired, readers not yet told (NOTE [retired slots])
        self._recent: collections.deque[int] = collections.deque(maxlen=SHRINK_WINDOW)
        self._counters = dict.fromkeys(COUNTER_FIELDS, 0)
        self._counters["readers"] = len(self.readers)
        self._on_drop: list[Callable[[int], None]] = []
        if daemon is not None:  # refused before anything is made there: nothing to reap
            daemon.check_ring_dir(ring_dir())
        self.control = Segment.create_unique(
            control_stem(token), KIND_CONTROL, token, CONTROL_CAPACITY
        )
        # The finalizer must not hold ``self`` (a bound method would): it would
        # keep a dropped, unclosed writer alive until interpreter exit. It
        # shares the control segment and the slot list, mutated in place.
        # Registered before describe() so a failing __init__ leaks nothing.
        # It runs only in this process, never in a forked child
        # (NOTE [creator-only cleanup]).
        self._finalizer = weakref.finalize(
            self,
            _emergency_unlink,
            os.getpid(),
            functools.partial(_linked_names, self.control, self.slots),
        )
        # Forked DataLoader workers make pool slots in our name: SIGTERM removes
        # those too (NOTE [SIGTERM] in ``cleanup``).
        cleanup.own(token=token)
        self._ctl = self.control.map_shared()
        self.describe(description)
        self._closed = False

    # -- control segment -------------------------------------------------

    def describe(self, description: dict) -> None:
        """Write the JSON description (job, group, pids) read by ``shmloader stat``."""
        blob = json.dumps(description, separators=(",", ":")).encode()
        if len(blob) + _DESCR_LEN.size > CONTROL_CAPACITY:
            blob = json.dumps({"truncated": True, "token": self.token}).encode()
        self._ctl[HEADER_SIZE : HEADER_SIZE + _DESCR_LEN.size] = _DESCR_LEN.pack(len(blob))
        start = HEADER_SIZE + _DESCR_LEN.size
        self._ctl[start : start + len(blob)] = blob

    def _store_counters(self) -> None:
        c = self._counters
        c["slots"] = sum(s.state != SlotState.RETIRED for s in self.slots)
        c["ring_bytes"] = sum(s.capacity for s in self.slots if s.state != SlotState.RETIRED)
        packed = _COUNTERS.pack(*(c[k] for k in COUNTER_FIELDS))
        self._ctl[_COUNTERS_AT : _COUNTERS_AT + _COUNTERS.size] = packed

    # -- slots -----------------------------------------------------------

    def acquire(self, nbytes: int) -> Slot:
        """A FREE slot that holds ``nbytes``: reuse, regrow a free one, or add one."""
        self._recent.append(nbytes)
        self._shrink()
        best = None
        for slot in self.slots:
            fits = slot.state == SlotState.FREE and slot.capacity >= nbytes and not slot.pooled
            if fits and (best is None or slot.capacity < best.capacity):
                best = slot
        if best is not None:
            return best
        for i, slot in enumerate(self.slots):
            if slot.state == SlotState.FREE and not slot.pooled:  # too small: replace it
                grown = self._create(i, slot.gen + 1, max(nbytes, int(slot.capacity * 1.5)))
                self._retire(slot)
                self.slots[i] = grown
                return grown
        for i, slot in enumerate(self.slots):
            if slot.state == SlotState.RETIRED and not slot.pooled:  # NOTE [ring shrink]
                self.slots[i] = self._create(i, slot.gen + 1, nbytes)
                return self.slots[i]
        slot = self._create(len(self.slots), 0, nbytes)
        self.slots.append(slot)
        return slot

    # NOTE [ring shrink]
    #     A slot grows for the largest batch it had to hold and would keep that
    #     size until ``close()``: one 512 MiB batch among 8 MiB ones would pin
    #     1 GiB of a 2-slot ring for the rest of the job. So ``acquire`` retires
    #     every FREE slot (never a HELD one) more than ``SHRINK_RATIO`` times the
    #     capacity that the largest of the last ``SHRINK_WINDOW`` batches needs;
    #     the ring then grows again, right-sized, as batches need slots. Batches
    #     that vary within that ratio never cause a retire, and a run of fewer
    #     than ``SHRINK_WINDOW`` small batches after a large one keeps it (a
    #     large batch every few steps is not worth re-touching pages for). Pooled
    #     slots (written by DataLoader workers) are sized by their pool.
    def _shrink(self) -> None:
        """NOTE [ring shrink]: retire FREE slots far larger than the recent batches need."""
        if len(self._recent) < SHRINK_WINDOW:
            return
        limit = SHRINK_RATIO * slot_capacity_for(max(self._recent))
        oversized = [
            s
            for s in self.slots
            if s.state == SlotState.FREE and not s.pooled and s.capacity > limit
        ]
        for slot in oversized:
            log.info(
                "shmloader: ring %s: slot %d (%d bytes) retired: the last %d batches needed "
                "at most %d bytes",
                self.token,
                slot.index,
                slot.capacity,
                len(self._recent),
                max(self._recent),
            )
            self._retire(slot)
        if oversized:
            self._store_counters()

    def _create(self, index: int, gen: int, nbytes: int) -> Slot:
        capacity = slot_capacity_for(nbytes)
        stem = slot_stem(self.token, index, gen)
        t0 = time.perf_counter()
        segment = self._adopt(f"{stem}.{secrets.token_hex(8)}", capacity)
        adopted = segment is not None
        if segment is None:
            free = shm_free_bytes()
            if free is not None and free < capacity + HEADER_SIZE:
                raise ShmCapacityError(
                    capacity + HEADER_SIZE, free, f"a ring slot for a {nbytes}-byte batch"
                )
            if self._daemon is not None:
                self._daemon.admit(self.token, capacity + HEADER_SIZE)  # may refuse
            segment = Segment.create_unique(stem, KIND_DATA, self.token, capacity)
        name = segment.name
        capacity = segment.capacity
        try:
            mm = segment.map_shared()
            # Adopted pages are allocated and zeroed already; populating our page
            # tables for them is the cheap part of a first touch.
            touch(mm)
        except BaseException:
            segment.unlink()
            segment.close()
            raise
        if self._daemon is not None:
            self._daemon.add_segment(self.token, name, HEADER_SIZE + capacity)
        payload = np.frombuffer(mm, dtype=np.uint8, count=capacity, offset=HEADER_SIZE)
        log.debug(
            "ring %s: slot %d.%d of %d bytes ready in %.1f ms (%s)",
            self.token,
            index,
            gen,
            capacity,
            (time.perf_counter() - t0) * 1e3,
            "adopted from the daemon's warm segments" if adopted else "created and touched",
        )
        slot = Slot(index, gen, segment, mm, payload)
        if not self.readers:
            segment.unlink()  # nobody will attach: nothing needs the name
        self._store_counters()
        return slot

    def add_pooled(self, segment: Segment) -> Slot:
        """Append a slot that DataLoader workers write (``pool``): touched here, never acquired.

        Its name stays linked while the pool lives (NOTE [pool names] in ``_workers.control``).
        """
        slot = self._pooled_slot(len(self.slots), 0, segment, populate=True)
        self.slots.append(slot)
        self._store_counters()
        return slot

    def replace_pooled(self, index: int, segment: Segment) -> Slot:
        """Install a worker-grown generation of pooled slot ``index``, retiring the old one."""
        old = self.slots[index]
        if not old.pooled or old.state != SlotState.FREE:
            raise ProtocolError(f"slot {index} is not a FREE pooled slot ({old.state.name})")
        _index, gen = parse_slot_name(self.token, segment.name)
        slot = self._pooled_slot(index, gen, segment, populate=False)
        self._retire(old)
        self.slots[index] = slot
        self._store_counters()
        return slot

    def _pooled_slot(self, index: int, gen: int, segment: Segment, *, populate: bool) -> Slot:
        try:
            mm = segment.map_shared()
            if populate:
                touch(mm)
        except BaseException:
            segment.unlink()
            segment.close()
            raise
        payload = np.frombuffer(mm, dtype=np.uint8, count=segment.capacity, offset=HEADER_SIZE)
        return Slot(index, gen, segment, mm, payload, pooled=True)

    def _adopt(self, name: str, capacity: int) -> Segment | None:
        """A pre-touched segment of the daemon's warm ones, renamed to ``name``, or None."""
        if self._daemon is None or self._daemon.adopt(self.token, name, capacity) is None:
            return None
        try:
            segment = Segment.attach(name, kind=KIND_DATA, token=self.token)
        except ProtocolError as exc:
            log.warning("shmloader: adopted segment %s failed validation (%s); creating", name, exc)
            return None
        cleanup.own(segment=name)  # ours now: removed on SIGTERM like the ones we create
        return segment

    def hold_for_readers(self, slot: Slot, seq: int, nbytes: int, publish_ns: int) -> None:
        """Mark ``slot`` HELD by every reader for batch ``seq`` (the ring's half of a
        publish: ``NodeWriter.announce``) and count it published."""
        if slot.state != SlotState.FREE:
            raise AssertionError(f"holding slot {slot.index} in state {slot.state.name}")
        slot.seq = seq
        slot.holders = set(self.readers)
        if self.self_rank is not None:
            slot.holders.add(self.self_rank)
        slot.state = SlotState.HELD if slot.holders else SlotState.FREE
        c = self._counters
        c["published"] += 1
        c["bytes_published"] += nbytes
        c["publish_ns_total"] += publish_ns
        c["last_publish_unix_ns"] = time.time_ns()
        self._store_counters()

    def release(self, rank: int, index: int, gen: int, seq: int | None = None) -> None:
        """``rank`` dropped the batch it had from slot ``index`` generation ``gen``.

        With ``seq`` (the batch's number), a release of an earlier batch of a
        pooled slot is ignored: its holders' release words freed the slot and
        it carries a newer batch now (NOTE [release words] in ``release``).
        """
        slot = self._slot(index, gen)
        stale = slot is not None and seq is not None and seq != slot.seq
        if slot is not None and slot.pooled and (stale or rank not in slot.holders):
            return  # an earlier batch's: settled from the release words already
        if slot is None or rank not in slot.holders:
            raise ProtocolError(f"rank {rank} released slot {index}.{gen}, which it does not hold")
        slot.holders.discard(rank)
        if not slot.holders and slot.state == SlotState.HELD:
            slot.state = SlotState.FREE

    def settle_pooled(self, index: int) -> None:
        """Pooled slot ``index`` is free by its release words: forget who held it.

        Called by the pool when a worker has claimed the slot again (only
        once every holder's word released its batch, or the holder is gone),
        before this process handled all their RELEASEs.
        """
        slot = self.slots[index]
        if slot.pooled and slot.state == SlotState.HELD:
            slot.holders.clear()
            slot.state = SlotState.FREE

    def on_drop(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(rank)`` whenever a reader is dropped (the pool's GONE bits)."""
        self._on_drop.append(callback)

    # NOTE [names in /dev/shm]
    #     Data segments are unlinked as soon as every local reader has opened them
    #     (ATTACHED), so a crash of anyone leaves no data segment named in
    #     /dev/shm: the kernel frees the memory with the last descriptor. Only the
    #     small control segment stays named for the life of the ring, so that
    #     ``shmloader stat`` and ``gc`` can find the job; its header carries the
    #     owner (pid, start time) for reaping.
    def attached(self, rank: int, name: str) -> None:
        """``rank`` opened segment ``name``; unlink it once every reader has."""
        for slot in self.slots:
            if slot.segment.name == name:
                slot.attached.add(rank)
                if self.readers <= slot.attached and not slot.pooled:
                    slot.segment.unlink()
                return
        if name not in self._retired:
            raise ProtocolError(f"rank {rank} attached unknown segment {name}")

    def unattached(self) -> set[int]:
        """Readers that have not yet opened a published segment whose name is still needed."""
        waiting: set[int] = set()
        for slot in self.slots:
            if slot.seq >= 0 and slot.segment.linked and slot.state != SlotState.RETIRED:
                waiting |= self.readers - slot.attached
        return waiting

    def drop_reader(self, rank: int) -> None:
        """Forget ``rank`` (it closed or died): its holds end, and no later batch waits for it."""
        self.readers.discard(rank)
        self._counters["readers"] = len(self.readers)
        for callback in self._on_drop:
            callback(rank)
        for slot in self.slots:
            slot.holders.discard(rank)
            if not slot.holders and slot.state == SlotState.HELD:
                slot.state = SlotState.FREE
            unused = slot.seq >= 0 and self.readers <= slot.attached and not slot.pooled
            if slot.segment.linked and unused:
                slot.segment.unlink()

    def _slot(self, index: int, gen: int) -> Slot | None:
        if 0 <= index < len(self.slots) and self.slots[index].gen == gen:
            return self.slots[index]
        return None

    # NOTE [retired slots]
    #     A reader keeps a descriptor of every slot segment it opened (it maps
    #     the slot afresh for each batch), and a descriptor keeps the segment's
    #     memory alive after its name is gone; on a CUDA reader the device stage
    #     also keeps a registered (page-locked) mapping of it while the
    #     descriptor is open (NOTE [registration] in ``registrar``). So a reader must
    #     learn when the writer retires a slot, whether it was grown (gen + 1),
    #     shrunk away (NOTE [ring shrink]) or replaced by a worker (``pool``):
    #     ``_retire`` queues the name of every retired segment a batch was
    #     announced in, and the writer announces the queue (``take_retired``) as
    #     RETIRE messages before its next message (``Writer.tell_readers``), so
    #     they reach every reader before anything that follows the retirement.
    #     The reader then closes that descriptor (``RingReader.retire``). Only a
    #     FREE slot is ever retired (every holder released its batch) and a
    #     retired name is never announced again, so nothing a reader still
    #     needs is lost; a batch the user still holds keeps its own private
    #     mapping, which needs no descriptor, until it dies.
    def take_retired(self) -> list[str]:
        """Names retired since the last call that readers may hold open (NOTE [retired slots])."""
        names, self._unannounced = self._unannounced, []
        return names

    def _retire(self, slot: Slot) -> None:
        # Remembered so that a late ATTACHED for it is ignored, not an error.
        self._retired.add(slot.segment.name)
        if slot.seq >= 0 and self.readers and not self._closed:  # announced: readers opened it
            self._unannounced.append(slot.segment.name)
        slot.state = SlotState.RETIRED
        slot.payload = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            slot.mm.close()
        slot.segment.unlink()
        slot.segment.close()
        if self._daemon is not None:
            self._daemon.remove_segment(self.token, slot.segment.name)

    @property
    def total_bytes(self) -> int:
        return sum(s.capacity for s in self.slots if s.state != SlotState.RETIRED)

    def close(self) -> None:
        """Unlink and unmap everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in self.slots:
            if slot.state != SlotState.RETIRED:
                self._retire(slot)
        self._counters["closed"] = 1
        with contextlib.suppress(ValueError, BufferError):
            self._store_counters()
            self._ctl.close()
        self.control.unlink()
        self.control.close()
        self._finalizer.detach()
        cleanup.disown(token=self.token)


def _linked_names(control: Segment, slots: list[Slot]) -> list[str]:
    names = [control.name] if control.linked else []
    return names + [s.segment.name for s in slots if s.segment.linked]


def _emergency_unlink(creator: int, names: Callable[[], list[str]]) -> None:
    """At interpreter exit (or if a writer is dropped unclosed): unlink names.

    Only in the process that made the writer (NOTE [creator-only cleanup]).
    """
    from .segment import unlink_name

    if os.getpid() != creator:
        return
    for name in names():
        unlink_name(name)


def open_slot_for_worker(name: str, token: str) -> tuple[Segment, mmap.mmap]:
    """Open slot ``name`` of ring ``token`` in this process and map it shared, writable.

    For a forked DataLoader worker that writes a batch into a slot: the
    writer's own mappings are ``MADV_DONTFORK`` (NOTE [creator-only
    cleanup]), so the worker maps the slot itself, validated like any attach.
    The caller closes the mapping, then the segment; neither unlinks anything.
    """
    parse_slot_name(token, name)
    segment = Segment.attach(name, kind=KIND_DATA, token=token)
    try:
        return segment, segment.map_shared(inherit=True)
    except BaseException:
        segment.close()
        raise


class RingReader:
    """A reader's side: open slot segments, one private mapping per batch."""

    def __init__(self, token: str, rank: int | None = None) -> None:
        self.token = token
        self.rank = rank
        self.segments: dict[str, Segment] = {}
        #: views fault their pages in as they are made (a reader that runs ahead)
        self.prefault = False
        #: dropped views are unmapped on the unmap thread (NOTE [unmapped off the step])
        self.later = False
        self._mappings: list[weakref.ref] = []  # of every view handed out: own_views()
        # the writer's pool control segments by name: this reader's release words
        self._words: dict[str, ReaderWords | None] = {}

    def open(self, name: str) -> bool:
        """Open and validate ``name`` if not yet open; True when newly opened.

        Opening generation ``g`` of a slot closes the descriptors of its older
        generations: the writer replaced them while FREE, so they are never
        announced again, and mappings still alive stay valid without them.
        """
        if name in self.segments:
            return False
        index, gen = parse_slot_name(self.token, name)
        self.segments[name] = Segment.attach(name, kind=KIND_DATA, token=self.token)
        for other in list(self.segments):
            i, g = parse_slot_name(self.token, other)
            if i == index and g < gen:
                self.forget(other)
        return True

    def view(
        self,
        name: str,
        nbytes: int,
        on_release: Callable[[], None],
        words: tuple[str, int, int] | None = None,
    ) -> np.ndarray:
        """A private uint8 view of the first ``nbytes`` of slot ``name``.

        ``on_release`` runs once when the last object referring to the mapping
        is gone (NOTE [slot lifetime]); it must be thread-safe and cheap.
        ``words``: (pool control, slot, ticket) of a pooled slot's batch, whose
        release word this reader stores once the mapping is gone (NOTE
        [release words] in ``release``).
        """
        segment = self.segments.get(name)
        if segment is None:
            raise ProtocolError(f"segment {name} was never opened")
        board = self._board(words[0]) if words is not None else None
        unmapped = None
        if board is not None and words is not None:
            unmapped = functools.partial(board.release, words[1], words[2])
        view = private_view(
            segment, nbytes, on_release, unmapped, prefault=self.prefault, later=self.later
        )
        holder = unmap.holder_of(view)
        if holder is not None:
            self._mappings = [r for r in self._mappings if r() is not None]
            self._mappings.append(weakref.ref(holder))
        return view

    def own_views(self) -> int:
        """Give every view still alive its own copy of its pages; how many there were.

        NOTE [held past close]
            A reader's batch is a private (copy-on-write) mapping of a slot,
            and its unwritten pages show whatever the slot holds now: the
            reader's hold (NOTE [slot lifetime]) is what keeps the writer from
            rewriting it. A reader that closes gives up its holds (BYE), and
            the writer may go on without it (other ranks, another epoch), so
            before it says BYE it makes each page of every batch the user
            still holds its own copy (a write fault per page, ``touch``; of
            the batch's range where it is lent from a standing mapping):
            held batches keep their bytes for as long as the user keeps them,
            at the cost of one copy of what is held. The releases of those
            batches are dropped quietly from then on.
        """
        unmap.settle()  # what the user dropped is unmapped (and released) first
        owned = 0
        for ref in self._mappings:
            holder = ref()
            if holder is None:
                continue
            with forks.no_fork():  # a mapping the unmap thread retired is no batch held
                if forks.registered(holder):
                    # on a MAP_PRIVATE mapping each write fault copies the page
                    if isinstance(holder, mmap.mmap):
                        touch(holder)
                    else:  # a lease of a standing mapping (NOTE [a standing mapping])
                        touch_range(ctypes.addressof(holder), ctypes.sizeof(holder))
                    owned += 1
        self._mappings = []
        return owned

    def release_now(self, words: tuple[str, int, int]) -> None:
        """Store the release word of a batch this reader never mapped (a leftover)."""
        board = self._board(words[0])
        if board is not None:
            board.release(words[1], words[2])

    def _board(self, name: str) -> ReaderWords | None:
        """This reader's release words in pool control ``name`` (None: releases by message only)."""
        if name in self._words:
            return self._words[name]
        board = None
        if self.rank is not None:
            try:
                board = ReaderWords(name, self.token, self.rank)
            except (ProtocolError, OSError) as exc:
                log.warning("shmloader: no release words in %s (%s): RELEASE only", name, exc)
        self._words[name] = board
        return board

    def retire(self, name: str) -> None:
        """The writer retired ``name`` (RETIRE): close its descriptor (NOTE [retired slots]).

        A view of it still alive keeps its own mapping; the device stage
        drops its registered mapping once no copy reads it (``segment.fd < 0``).
        """
        self.forget(name)

    def forget(self, name: str) -> None:
        """Close the descriptor of a replaced segment (live mappings stay valid)."""
        segment = self.segments.pop(name, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        for name in list(self.segments):
            self.forget(name)
        for board in self._words.values():
            if board is not None:
                board.close()
        self._words.clear()

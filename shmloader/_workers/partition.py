"""The workers' slot pool, a DataLoader worker's side: ``WorkerSlots``.

It owns what a worker does with its partition of the pool: claiming a slot for a
batch (the smallest free one that fits, a wait for one about to be released
before growing another: NOTE [pool size]; bounded, and ended by the leader's
death), growing a slot into a new generation in the leader's name (admitted by the
daemon first: NOTE [pool admission]), fitting the whole pool into ``/dev/shm``,
marking it FILLED or giving it back, and the pieces of a slot a collate keeps
(NOTE [kept collate outputs]), copied out at their addresses before the slot is
rewritten (``_privatise``: libc's ``mremap``). It touches only its own partition's
records and slot segments, and the release words it reads. The control segment's
layout, the state machine and the names are ``control``'s; the main process's side
is ``pool``. It imports ``control``, the node layer (``segment``, ``ring``,
``release``) and ``errors``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import itertools
import logging
import mmap
import os
import time
import weakref
from typing import Any

import numpy as np

from .._node import segment as _segment
from .._node.mapping import LIBC_MMAP, touch
from .._node.release import ReleaseWords
from .._node.ring import slot_capacity_for, slot_stem
from .._node.segment import (
    HEADER_SIZE,
    KIND_DATA,
    Segment,
    process_alive,
    shm_free_bytes,
    unlink_name,
)
from ..errors import PeerLostError, ShmCapacityError, ShmLoaderError, human_bytes
from .control import (
    LEAVING,
    MIN_PER_WORKER,
    USE,
    PoolSpec,
    PoolState,
    Record,
    name_suffix,
    pool_slot_name,
    records,
    state_name,
)

log = logging.getLogger(__name__)

#: A worker's wait for an EMPTY slot polls with this backoff (seconds).
POLL_FIRST_S, POLL_MAX_S = 50e-6, 2e-3
#: ... and checks this often that the leader's main process is alive (seconds).
OWNER_CHECK_S = 0.2
#: How long a worker waits for a slot that fits to be released before it grows
#: another one (NOTE [pool size]): a lockstep job's ranks drop their previous
#: batch within one delivery; a job that keeps more pays this once per slot.
GROW_GRACE_S = 2.0


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
        self.records = records(self.words, spec.total)
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
                if self.words[LEAVING]:
                    raise ShmLoaderError(
                        f"DataLoader worker {self.worker_id} stopped waiting for a pool slot: "
                        "the leader left the iteration (this batch is never delivered)"
                    )
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
        rec.name = name_suffix(segment)
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


_LIBC = ctypes.CDLL(None, use_errno=True)  # mremap and munmap; mmap is mapping's LIBC_MMAP
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


__all__ = ["WorkerSlots", "estimate_bytes"]

"""A slot's standing mapping: one private mapping of a slot that its batches share in turn.

It owns ``Standing`` (a slot's copy-on-write mapping kept for as long as the slot's
segment is open in this process, lent to one batch at a time), ``take`` (the
segment's standing mapping for the next batch, or None where a batch maps its own)
and ``written_pages`` (which pages of a range this process wrote, from
``/proc/self/pagemap``). NOTE [a standing mapping]. It imports ``forks``,
``mapping`` and ``segment``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable

import numpy as np

from . import forks
from .mapping import LIBC_MADVISE, populate_range
from .segment import PAGE, Segment

log = logging.getLogger(__name__)


# NOTE [a standing mapping]
#     On 4 KiB pages a batch's own private view costs more than its
#     reading: 33 ms to fault 256 MiB in and 18 ms to unmap it again
#     (``benchmarks/results/step_gap/pagetables.md``), per batch and rank, on
#     threads that share the node's cores with the step. The page-table
#     entries that cost are the same ones every batch of that slot needs:
#     the writer's next batch lands in the same tmpfs pages, and a mapping
#     of them shows it without a fault. So where a view is leased (NOTE
#     [unmapped off the step] in ``unmap``) on a ring of 4 KiB pages, each
#     slot's segment keeps one private (copy-on-write) mapping of its whole
#     payload for as long as the segment is open, and each of the slot's
#     batches is a view of it in turn:
#
#       segment opened --take--> IDLE --take--> BUSY (a batch's lease lives)
#                                  ^                 | lease dies
#                                  +---- recycle ----+   (unmap thread)
#       segment closed: IDLE -> unmapped; BUSY -> unmapped by its recycle
#
#     What a private mapping does not show again is a page written through
#     it: its copy-on-write copy stays. So when a batch's lease dies, the
#     unmap thread reads the range's entries in ``/proc/self/pagemap`` and
#     drops (``MADV_DONTNEED``) every page that is no longer the file's (an
#     anonymous page, present or swapped); the range shows the slot's pages
#     again, and only then is the slot released (NOTE [slot lifetime] in
#     ``views``): a slot's next batch is never seen through a page written
#     for the one before. That costs 4-5 ms per 256 MiB where the batch's
#     own view cost 30-51 ms. Where pagemap cannot be read or a drop fails the
#     standing mapping is unmapped instead (the next batch maps a new one),
#     and after a failure to read pagemap this process stops making them.
#
#     One batch at a time: ``take`` lends the mapping only while IDLE (the
#     writer rewrites a slot only after every reader's release, which
#     follows the recycle; a batch that still finds it BUSY maps its own
#     view, as everywhere else). A forked child never gets a standing
#     mapping (``MADV_DONTFORK``: its range is reserved in the child), only
#     the ranges of batches its user code holds, passed down to that fork alone
#     and copied in the child like any view (NOTE [batches cross a fork] in
#     ``forks``). Huge-page rings keep a view per batch: there both costs
#     together are 0.2 ms.
class Standing:
    """A slot's standing private mapping (NOTE [a standing mapping])."""

    def __init__(self, segment: Segment) -> None:
        self.pid = os.getpid()
        self.mm = segment.map_standing()
        self.base = forks.address(self.mm)
        self.size = len(self.mm)
        self.busy = False
        self.closed = False
        self.faulted = 0  # bytes from the start whose pages were faulted in once

    def fault_in(self, nbytes: int) -> None:
        """Map the pages of a batch of ``nbytes`` in, those no batch had before."""
        end = min(_round_up(nbytes), self.size)
        if end > self.faulted:
            populate_range(self.base + self.faulted, end - self.faulted)
            self.faulted = end

    def recycle(self, nbytes: int, done: Callable[[], None]) -> None:
        """The batch's lease died: drop what it wrote, become IDLE, then run ``done``.

        ``done`` (the slot's release) runs last and always; never in a forked child.
        """
        if os.getpid() != self.pid:
            return
        try:
            clean = not self.closed and _drop_written(self.base, min(_round_up(nbytes), self.size))
            if not clean:
                self._unmap()
        finally:
            self.busy = False
            if self.closed:  # closed while BUSY: ``drop`` left the unmap to us
                self._unmap()
            done()

    def drop(self) -> None:
        """The segment closes: unmap now if IDLE, else at the recycle of its batch."""
        self.closed = True
        if not self.busy:  # recycle sets busy before it reads closed: one of us unmaps
            self._unmap()

    def _unmap(self) -> None:
        if os.getpid() != self.pid:
            return
        self.closed = True
        with contextlib.suppress(BufferError):
            self.mm.close()


def take(segment: Segment, nbytes: int, *, prefault: bool) -> Standing | None:
    """``segment``'s standing mapping, lent to a batch of ``nbytes``; None: map a view.

    Call inside ``forks.no_fork``. None on a huge-page ring, in a process that
    could not read its pagemap, for a closed segment or where the mapping is
    still BUSY (NOTE [a standing mapping]).
    """
    global _enabled
    if not _enabled or segment.pages.huge or segment.fd < 0 or nbytes > segment.capacity:
        return None
    stand: Standing | None = getattr(segment, "standing", None)
    if stand is not None and (stand.closed or stand.pid != os.getpid()):
        stand = None
    if stand is None:
        if _pagemap() is None:
            _enabled = False
            return None
        try:
            stand = Standing(segment)
        except OSError as exc:  # no address space for it: views of their own
            log.debug("shmloader: no standing mapping of %s (%s)", segment.name, exc)
            return None
        segment.standing = stand
    if stand.busy:
        return None
    stand.busy = True
    if prefault:
        stand.fault_in(nbytes)
    return stand


#: False once this process could not read its pagemap: views of their own from then on.
_enabled = True

#: ``/proc/self/pagemap``: 8 bytes a page; bit 63 present, 62 swapped, 61 a file page.
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_pagemap_fd: tuple[int, int] | None = None  # (pid, descriptor): a child opens its own
_pagemap_lock = threading.RLock()  # a recycle run inline (a finalizer) may nest in it


def _pagemap() -> int | None:
    """This process's pagemap descriptor (opened once per process), None where unreadable."""
    global _pagemap_fd
    with _pagemap_lock:
        if _pagemap_fd is not None and _pagemap_fd[0] == os.getpid():
            return _pagemap_fd[1]
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("shmloader: /proc/self/pagemap unreadable (%s): no standing mappings", exc)
            return None
        _pagemap_fd = (os.getpid(), fd)
        return fd


def written_pages(addr: int, length: int) -> np.ndarray | None:
    """Indices of the pages of ``[addr, addr + length)`` that are no longer the file's.

    A page of a private file mapping is the file's until written; a write
    makes it anonymous (present, or swapped out). None where pagemap cannot
    be read.
    """
    fd = _pagemap()
    if fd is None:
        return None
    count = length // PAGE
    try:
        raw = os.pread(fd, count * 8, addr // PAGE * 8)
    except OSError:
        return None
    if len(raw) != count * 8:
        return None
    entries = np.frombuffer(raw, dtype=np.uint64)
    there = (entries & np.uint64(_PRESENT | _SWAPPED)) != 0
    return np.flatnonzero(there & ((entries & np.uint64(_FILE)) == 0))


def _drop_written(addr: int, length: int) -> bool:
    """Drop the written pages of ``[addr, addr + length)`` (fault the file's back in).

    False where it could not: the caller unmaps the whole mapping.
    """
    pages = written_pages(addr, length)
    if pages is None or LIBC_MADVISE is None:
        return False
    if not len(pages):
        return True
    # runs of consecutive pages: one madvise each
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    for run in np.split(pages, breaks):
        start, n = addr + int(run[0]) * PAGE, len(run) * PAGE
        if LIBC_MADVISE(start, n, MADV_DONTNEED) != 0:
            return False
        populate_range(start, n)  # the file's pages again, off the step
    return True


def _round_up(n: int) -> int:
    return -(-max(n, 1) // PAGE) * PAGE

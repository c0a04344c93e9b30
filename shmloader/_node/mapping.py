"""Mappings of a segment's descriptor that keep no descriptor, and faulting pages in.

It owns ``map_fd``, the one way a segment is mapped: Python's ``mmap.mmap`` made
over an anonymous placeholder and libc's ``mmap`` put over it, so the object holds
no duplicate of the descriptor (NOTE [no inherited descriptors] in ``segment``), on
a huge-page ring at an address where file offset 0 falls on a 2 MiB boundary
(``_placeholder``: NOTE [huge-page ring] in ``ringdir``); and faulting a mapping's
pages in off the GIL, for writing once (``touch``: NOTE [touch off the GIL]) or for
reading (``populate``). It touches only the mappings it is given or makes, and
imports only ``forks`` and ``ringdir`` (for libc).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
from collections.abc import Callable

from . import forks, ringdir

log = logging.getLogger(__name__)

#: libc's ``mmap`` and ``munmap``, prototyped and resolved at import in ``ringdir`` (a
#: forked child must not ``dlopen``/``dlsym``: another thread of the parent may have held
#: the loader's lock at the fork); the pool uses them too.
LIBC_MMAP: Callable[..., int] | None = forks.LIBC_MMAP
LIBC_MUNMAP: Callable[..., int] | None = forks.LIBC_MUNMAP


def map_fd(
    fd: int,
    length: int,
    flags: int,
    prot: int | None = None,
    offset: int = 0,
    *,
    pages: ringdir.Facts | None = None,
) -> mmap.mmap:
    """``mmap.mmap`` of ``fd`` that holds no duplicate of it (NOTE [no inherited descriptors]).

    The object is made over an anonymous placeholder (no descriptor at all),
    and libc's ``mmap`` with ``MAP_FIXED`` puts the segment's pages at the
    same address: the object unmaps, advises and exports that range as
    usual. Without a libc ``mmap`` it is a plain ``mmap.mmap`` (with its
    duplicate). In a huge-page ring (``pages.huge``) the placeholder puts file
    offset 0 on a 2 MiB boundary, and the mapping is advised ``MADV_HUGEPAGE``
    where the directory needs it (NOTE [huge-page ring] in ``ringdir``).
    """
    if prot is None:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
    if LIBC_MMAP is None:
        return mmap.mmap(fd, length, flags=flags, prot=prot, offset=offset)
    huge = pages is not None and pages.huge
    mm = _placeholder(length, prot, offset % ringdir.HUGE if huge else None)
    addr = forks.address(mm)
    got = LIBC_MMAP(addr, length, prot, flags | forks.MAP_FIXED, fd, offset)
    if got != addr:
        err = ctypes.get_errno()
        mm.close()
        raise OSError(err, f"mmap of a shared memory segment failed: {os.strerror(err)}")
    if huge and pages is not None and pages.advise:
        with contextlib.suppress(OSError):
            mm.madvise(ringdir.MADV_HUGEPAGE)
    return mm


def _placeholder(length: int, prot: int, phase: int | None) -> mmap.mmap:
    """An anonymous ``mmap.mmap`` of ``length``; at an address ``phase`` past a 2 MiB
    boundary when ``phase`` is not None (NOTE [huge-page ring] in ``ringdir``).

    ``mmap.mmap`` takes no address, so a hole of exactly ``length`` is made
    at the wanted address inside a larger ``PROT_NONE`` reservation and
    objects are mapped until one lands in it: the kernel's top-down search
    takes the highest gap that fits, and a gap above ours (a batch's view
    unmapped since) takes the first tries, which are kept until the end so
    that the next one looks further down. Then the reservation's rest and the
    misses are given back. After ``PLACE_TRIES`` misses (another thread
    mapping at the same time) the object lies elsewhere: correct, only not
    aligned (4 KiB page-table entries over the huge pages).
    """
    if phase is None or LIBC_MUNMAP is None or LIBC_MMAP is None:
        return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE, prot=prot)
    span = length + ringdir.HUGE
    anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | forks.MAP_NORESERVE
    base = LIBC_MMAP(None, span, 0, anon, -1, 0)  # PROT_NONE
    if base is None or base == forks.MAP_FAILED:
        return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE, prot=prot)
    at = base + (phase - base) % ringdir.HUGE
    LIBC_MUNMAP(at, length)
    misses: list[mmap.mmap] = []
    try:
        for _ in range(PLACE_TRIES):
            mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE, prot=prot)
            if forks.address(mm) == at:
                return mm
            misses.append(mm)
        log.debug("shmloader: a mapping missed its 2 MiB alignment (other threads mapping)")
        return misses.pop()
    finally:
        for miss in misses:
            miss.close()
        if at > base:
            LIBC_MUNMAP(base, at - base)
        LIBC_MUNMAP(at + length, base + span - at - length)


#: Placeholders mapped at most while looking for an aligned hole (``_placeholder``).
PLACE_TRIES = 16


#: ``madvise`` advice that faults every page of a range in for writing (Linux 5.14+).
MADV_POPULATE_WRITE = 23
#: libc's ``madvise`` (``ringdir.LIBC``, prototyped at import): a ``ctypes`` call
#: releases the GIL for its duration (NOTE [touch off the GIL]).
LIBC_MADVISE: Callable[..., int] | None = ringdir.LIBC.madvise


def touch(mm: mmap.mmap) -> None:
    """Fault every page of a fresh mapping in, once, without holding the GIL.

    Writing into fresh tmpfs pages costs about ten times a rewrite of touched
    ones; the ring pays it once at slot creation instead of on every batch.
    On a MAP_PRIVATE mapping each write fault copies the page (``own_views``).

    NOTE [touch off the GIL]
        Faulting in a slot takes as long as its pages take to allocate and
        zero: hundreds of ms per GiB, seconds on a loaded node (2 GiB froze
        every other thread for 16.7 s). ``mmap.madvise`` holds the GIL for
        the whole call, so the touch calls libc's
        ``madvise(MADV_POPULATE_WRITE)`` through ``ctypes``, which releases
        it, as the daemon's warm segments do (NOTE [pool off the loop] in
        ``shmloaderd.warm``). Where the kernel refuses it (before 5.14) a
        write per page does the same in bytecode, which yields the GIL
        between pages.
    """
    if len(mm) > 0:
        touch_range(forks.address(mm), len(mm))


def touch_range(addr: int, length: int) -> None:
    """``touch`` of the pages of ``[addr, addr + length)`` (a batch's range of a mapping)."""
    if LIBC_MADVISE is not None and LIBC_MADVISE(addr, length, MADV_POPULATE_WRITE) == 0:
        return
    view = (ctypes.c_uint8 * length).from_address(addr)
    for off in range(0, length, mmap.PAGESIZE):
        view[off] = view[off]  # a write fault that keeps the header (and data) intact


#: ``madvise`` advice that maps every page of a range in for reading (Linux 5.14+).
MADV_POPULATE_READ = 22


def populate(mm: mmap.mmap) -> None:
    """Map every page of ``mm`` in for reading, off the GIL; nothing where the kernel refuses.

    A batch's pages faulted in on the thread that runs ahead (NOTE [running
    ahead] in ``_roles.producer``) cost the user's step nothing when it reads
    them. On a private (copy-on-write) mapping the pages stay the slot's own,
    read-only, until written. Best effort: before Linux 5.14 the user's reads
    fault them in, as without it.
    """
    if len(mm) > 0:
        populate_range(forks.address(mm), len(mm))


def populate_range(addr: int, length: int) -> None:
    """``populate`` of the pages of ``[addr, addr + length)``."""
    if LIBC_MADVISE is not None and length > 0:
        LIBC_MADVISE(addr, length, MADV_POPULATE_READ)

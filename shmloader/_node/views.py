"""A batch's private view of a slot, and the registry of live views the device stage reads.

It owns ``private_view``: a copy-on-write mapping of a slot's first bytes for one
batch, whose death releases the slot (NOTE [slot lifetime]), faulted in ahead when a
loop runs ahead, unmapped on the unmap thread when asked (``unmap``), and a release
word stored once the pages are gone; the address registry of every live view
(``view_source``: which slot an address lies in) and the read-only shared mapping a
CUDA consumer registers (``map_shared_readonly``: NOTE [device reads]). The writer's
own views and every reader's (``ring.RingReader``) are made here. It touches only the
segments it is given, and imports only ``forks``, ``mapping``, ``segment``, ``standing``
and ``unmap``.
"""

from __future__ import annotations

import functools
import mmap
import os
import weakref
from collections.abc import Callable

import numpy as np

from . import forks, standing, unmap
from .mapping import populate
from .segment import HEADER_SIZE, Segment


def _in_creator(creator: int, fn: Callable[[], None]) -> None:
    if os.getpid() == creator:
        fn()


# NOTE [slot lifetime]
#     A reader maps the slot MAP_PRIVATE for each batch and drops the mapping
#     with the batch: its in-place writes stay its own, and it never sees a
#     later batch through an old private page. The slot is RELEASEd when the
#     mapping dies (``weakref.finalize`` on the mmap, i.e. when the last tensor
#     of that batch is garbage), so a batch never changes under a reader that
#     still holds any part of it (where a loop runs ahead, the mapping dies
#     on the unmap thread, after its unmap: NOTE [unmapped off the step] in
#     ``unmap``; where the batch is lent from the slot's standing mapping,
#     after the pages its user wrote are dropped from it: NOTE [a standing
#     mapping] in ``standing``). The writer therefore never rewrites a HELD
#     slot: it takes a FREE one or grows the ring by one slot. Growth is
#     bounded by the window rule in ``node_writer`` (a writer runs at most
#     ``slots`` batches ahead of its slowest reader) plus what readers
#     deliberately keep alive.
def private_view(
    segment: Segment,
    nbytes: int,
    on_release: Callable[[], None],
    unmapped: Callable[[], None] | None = None,
    *,
    prefault: bool = False,
    later: bool = False,
) -> np.ndarray:
    """A copy-on-write uint8 view of ``segment``'s first ``nbytes`` of payload.

    ``prefault``: its pages are mapped in now (``mapping.populate``), by a loop
    that runs ahead of the user (NOTE [running ahead] in ``_roles.producer``).
    ``later``: once dropped, it is unmapped (and released) on the unmap thread,
    not on the thread that dropped it (NOTE [unmapped off the step] in ``unmap``).

    ``on_release`` runs once when the last object referring to the mapping
    (the array, any tensor viewing it) is gone: NOTE [slot lifetime]. It
    never runs in a forked child, which does not have the mapping either
    (NOTE [creator-only cleanup]). While the view lives, ``view_source``
    finds its segment from an address inside it (NOTE [device reads]).
    ``unmapped`` (a release word's store, NOTE [release words] in
    ``release``) runs then too, but only once the pages are unmapped: never
    at interpreter exit, when the mapping is still there.
    """
    entry = (segment, nbytes)
    release = functools.partial(_in_creator, os.getpid(), on_release)
    if later and nbytes >= unmap.LEASE_MIN_BYTES:
        view = _standing_view(segment, nbytes, entry, release, unmapped, prefault)
        if view is not None:
            return view
    mm, at = segment.map_view(nbytes)  # in a huge-page ring from the header on: whole pages
    if prefault:
        populate(mm)
    if later and nbytes >= unmap.LEASE_MIN_BYTES:
        view = unmap.lease(mm, at, nbytes)
    else:
        view = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=at)
    address = view.__array_interface__["data"][0]
    _VIEWS[address] = entry
    weakref.finalize(mm, _view_died, address, entry, release)
    if unmapped is not None:
        # CPython's mmap runs munmap before it calls its weak references back
        weakref.finalize(mm, _in_creator, os.getpid(), unmapped).atexit = False
    return view


def _standing_view(
    segment: Segment,
    nbytes: int,
    entry: tuple[Segment, int],
    release: Callable[[], None],
    unmapped: Callable[[], None] | None,
    prefault: bool,
) -> np.ndarray | None:
    """A batch's view lent from the slot's standing mapping; None where it has none.

    Released as any view, after its recycle dropped what the batch wrote
    (NOTE [a standing mapping] in ``standing``).
    """
    with forks.no_fork():  # a child gets the view registered: NOTE [batches cross a fork]
        stand = standing.take(segment, nbytes, prefault=prefault)
        if stand is None:
            return None
        address = stand.base

        def done() -> None:
            _view_died(address, entry, release)
            if unmapped is not None:
                unmapped()  # recycle runs it only in the creator

        recycle = functools.partial(stand.recycle, nbytes, done)
        view, lease = unmap.lease_standing(stand.mm, nbytes, recycle)
        _VIEWS[address] = entry
        forks.copy_at_fork(lease, address, nbytes)
    forks.let_go()  # views held for children that are gone since
    return view


# NOTE [device reads]
#     A CUDA consumer (``shmloader.device.stage``) copies a batch to the GPU from its
#     own long-lived, read-only MAP_SHARED mapping of the slot, registered with
#     CUDA once, instead of from the private view: registering a private
#     mapping would break copy-on-write or cost 5-10x more. The private view
#     still holds the slot (NOTE [slot lifetime]) until that copy completed,
#     so the bytes the copy reads are exactly the view's. ``_VIEWS`` maps the
#     address of every live private view to its segment, so the device stage
#     finds, for any tensor of a delivered batch, the slot and offset it lies
#     in without the roles' loops passing anything along.
_VIEWS: dict[int, tuple[Segment, int]] = {}


def _view_died(address: int, entry: tuple[Segment, int], on_release: Callable[[], None]) -> None:
    # The address may already belong to a newer view (munmap precedes this
    # callback, and another thread may map in between): remove only our entry.
    if _VIEWS.get(address) is entry:
        del _VIEWS[address]
    on_release()


def view_source(address: int) -> tuple[Segment, int] | None:
    """``(segment, payload offset)`` of ``address`` inside a live private view, else None."""
    # A copy first: a garbage collection triggered while iterating could run a
    # view's finalizer, which removes its entry.
    for base, (segment, nbytes) in _VIEWS.copy().items():
        if base <= address < base + nbytes:
            return segment, address - base
    return None


def map_shared_readonly(segment: Segment) -> tuple[mmap.mmap, int]:
    """A read-only MAP_SHARED mapping of the whole of ``segment`` and its payload offset.

    What a CUDA consumer registers (NOTE [device reads]). Its pages are the
    slot's own, so it sees every later rewrite: a reader uses it only while
    its private view holds the slot. Needs the segment's descriptor: open
    (``segment.fd >= 0``), i.e. the slot is not retired.
    """
    return segment.map_readonly(), HEADER_SIZE

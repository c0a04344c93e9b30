"""What a forked child gets of this process's slot mappings.

It owns the fork handlers of the mapping code: a writer's slot mappings a child
never gets (``dont_fork``: NOTE [creator-only cleanup] in ``segment``), a batch's
private views a child gets as its own copy (``copy_at_fork``: NOTE [batches cross a
fork]), the views a loop holds ahead of the user that a child drops (``hide``), and
the lock that keeps a fork from falling between a view's mapping and its
registration (``no_fork``). It imports only ``ringdir`` (for libc).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np

from . import ringdir

log = logging.getLogger(__name__)

LIBC_MMAP: Callable[..., int] | None = ringdir.LIBC.mmap
LIBC_MUNMAP: Callable[..., int] | None = ringdir.LIBC.munmap
LIBC_MADVISE: Callable[..., int] | None = ringdir.LIBC.madvise
MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
MADV_DOFORK = getattr(mmap, "MADV_DOFORK", 11)
MAP_FIXED_NOREPLACE = 0x100000
MAP_FIXED = 0x10
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


def _libc_mremap() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mremap  # resolved at import, never in a child
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return fn


LIBC_MREMAP: Callable[..., int] | None = _libc_mremap()


def address(mm: mmap.mmap) -> int:
    """Where ``mm`` is mapped (read-only mappings too)."""
    view = np.frombuffer(mm, dtype=np.uint8)
    addr = view.__array_interface__["data"][0]
    del view  # the buffer export must not outlive this line, or mm cannot close
    return addr


# ------------------------------------------------------- mappings a child never gets


def dont_fork(mm: mmap.mmap) -> bool:
    """``MADV_DONTFORK`` on ``mm``: a forked child does not get this mapping.

    In the child the Python ``mmap`` object still exists (the child has a copy
    of every object) but its address range is empty: something else could be
    mapped there, and the object's eventual ``munmap`` would then remove it.
    So the range is reserved in the child right after the fork with an
    inaccessible anonymous mapping (``PROT_NONE``, no memory): a stray access
    still faults, and the stale ``munmap`` only drops the reservation.

    Where the platform has no ``MADV_DONTFORK`` (not Linux) the child inherits
    the mapping as before: it then pins the pages while it lives, and its
    writes to a MAP_SHARED view would reach the segment. Returns whether the
    advice was taken.
    """
    advice = getattr(mmap, "MADV_DONTFORK", None)
    if advice is None:
        return False
    try:
        mm.madvise(advice)
    except OSError:
        return False
    addr = address(mm)
    NOT_FORKED[addr] = (weakref.ref(mm, lambda _: NOT_FORKED.pop(addr, None)), len(mm))
    return True


#: Live ``MADV_DONTFORK`` mappings: address -> (weak reference, length).
NOT_FORKED: dict[int, tuple[weakref.ref, int]] = {}


def _reserve_in_child() -> None:
    """After a fork, in the child: hold the address ranges of mappings it did not get."""
    if not NOT_FORKED or LIBC_MMAP is None:
        return
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
    inherited = sorted(_current.inherited) if _current is not None else []
    for addr, (ref, length) in list(NOT_FORKED.items()):
        mm = ref()
        if mm is None or mm.closed:
            continue
        # NOREPLACE: never over anything the child has (an old kernel treats it
        # as a hint; a range placed elsewhere is then simply not needed). Around
        # the ranges of a standing mapping this fork's child inherits (``_pass_down``).
        at = addr
        for start, n in inherited:
            if addr <= start < addr + length:
                if start > at:
                    LIBC_MMAP(at, start - at, 0, flags, -1, 0)
                at = start + n
        if at < addr + length:
            LIBC_MMAP(at, addr + length - at, 0, flags, -1, 0)


os.register_at_fork(after_in_child=_reserve_in_child)


# ------------------------------------------------- NOTE [batches cross a fork]

# NOTE [batches cross a fork]
#     A plain tensor survives a fork: the child reads its bytes (copy-on-write
#     pages). A delivered batch is a view of a private (copy-on-write) mapping
#     of a slot (``Segment.map_private``), and its unwritten pages show
#     whatever the slot holds now: what keeps them the batch's is the parent's
#     hold on the slot (NOTE [slot lifetime] in ``views``), which a child has no
#     part in. So at a fork:
#
#     - every live private view that user code can reach is inherited and, in
#       a fork handler of the child, replaced by a private anonymous copy of
#       its bytes at the same address (``mremap`` of a fresh copy over it, as
#       ``pool`` does for kept collate outputs; in pieces of ``PIECE`` bytes
#       where the whole copy cannot be had, under an address-space limit):
#       the child reads the batch as the parent had it at the fork, its
#       writes stay its own, and it holds no page of the slot afterwards
#       (a batch in its slot's standing mapping, which no child gets, is
#       passed down to this fork alone: ``MADV_DOFORK`` on its range in the
#       parent's handler, ``MADV_DONTFORK`` again before the gate opens,
#       the rest of the standing mapping reserved around it in the child;
#       NOTE [a standing mapping] in ``standing``);
#     - a view that only a loop running ahead of the user holds (its queue:
#       ``hide``) is made inaccessible in the child without a copy: no user
#       code of the child can reach it, and copying it would cost the fork
#       ``SHMLOADER_SLOTS`` batches where the child needs the user's;
#     - where a copy fails even in pieces (no memory), the view is left as it
#       is, readable and still the slot's, and the parent holds the batch (its
#       slot is not rewritten) until the child and everything it forked are
#       gone: a pipe end the child keeps until it exits, which the parent
#       looks at each time it maps a view (``let_go``). The parent logs it
#       once. Never a fault in the child, never other bytes.
#
#     Ordering: the parent keeps every view alive through the fork and waits
#     (``FORK_COPY_WAIT_S`` at most) until its child says the copies are
#     made, or is gone. ``no_fork`` is one gate (``_ForkGate``), held
#     exclusively by the forking thread from the snapshot of the views to the
#     ``fork()`` itself, and shared by every thread that maps and registers a
#     view or takes a batch out of a hidden queue (they never wait for each
#     other: a user's ``next()`` does not wait for the loop mapping the next
#     batch): a child's views are exactly the snapshot, and what one fork
#     carries from its parent's handler to its child's and back is its own
#     (a second thread's fork waits for the gate, never for the first
#     fork's child: the gate is given back before the parent waits). The
#     cost is one copy of the batches user code holds at the fork, in the
#     child, in time and memory (``os.fork`` returns that much later in the
#     parent); a forkserver or spawn context copies nothing.
#: Live private views (``map_private``): address -> (weak reference, length).
COPY_AT_FORK: dict[int, tuple[weakref.ref, int]] = {}
#: Longest the parent's ``os.fork`` waits for a child to copy the views it inherited.
FORK_COPY_WAIT_S = 60.0
#: The piece a view is copied in where the whole copy cannot be mapped at once.
PIECE = 2 << 20


class _ForkGate:
    """Shared by the threads that map and register views or hand a batch over, exclusive
    for a fork (NOTE [batches cross a fork]): they never wait for each other, only for a
    fork, and a fork waits for them (and for another fork) before its snapshot."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0  # threads in a ``no_fork`` block
        self._forking = False  # a fork holds the gate, or waits for the blocks to end

    def enter(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._inside += 1

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if not self._inside:
                self._cond.notify_all()

    def fork_begins(self) -> None:
        with self._cond:
            while self._forking:  # one fork at a time
                self._cond.wait()
            self._forking = True  # no block begins from now on
            while self._inside:
                self._cond.wait()

    def fork_ends(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def reset_in_child(self) -> None:
        """The child's copy: only the forking thread lives on, and the condition's lock
        may have been held by a thread the child does not have."""
        self.__init__()  # type: ignore[misc]


_GATE = _ForkGate()


@contextlib.contextmanager
def no_fork() -> Iterator[None]:
    """No ``os.fork`` of this process happens inside the block (NOTE [batches cross a fork]);
    other threads' blocks run meanwhile."""
    _GATE.enter()
    try:
        yield
    finally:
        _GATE.leave()


def copy_at_fork(holder: object, addr: int | None = None, length: int | None = None) -> None:
    """Give a forked child its own copy of a batch's private view.

    ``holder``: the view's own mapping, or (with ``addr`` and ``length``) the
    lease of its range in a standing mapping (NOTE [a standing mapping] in
    ``standing``), whose range each fork passes down (``MADV_DOFORK``) while it lives.
    Call inside ``no_fork``, in the block that made the view.
    """
    if addr is None or length is None:
        assert isinstance(holder, mmap.mmap)
        addr, length = address(holder), len(holder)
    at = addr

    def gone(ref: weakref.ref) -> None:  # only its own entry: a standing range is reused
        entry = COPY_AT_FORK.get(at)
        if entry is not None and entry[0] is ref:
            del COPY_AT_FORK[at]

    COPY_AT_FORK[addr] = (weakref.ref(holder, gone), length)


def retire(mm: mmap.mmap) -> None:
    """``mm`` (a private view) is about to be unmapped: no child copies or inherits it.

    NOTE [unmapped off the step] in ``unmap``.
    """
    with no_fork():
        if mm.closed:
            return
        COPY_AT_FORK.pop(address(mm), None)
        dont_fork(mm)


def registered(holder: object) -> bool:
    """Whether ``holder`` (a view's mapping or lease) is a live view a child would copy.

    Call inside ``no_fork``.
    """
    if isinstance(holder, mmap.mmap):
        if holder.closed:
            return False
        addr = address(holder)
    else:
        addr = ctypes.addressof(holder)  # type: ignore[arg-type]
    entry = COPY_AT_FORK.get(addr)
    return entry is not None and entry[0]() is holder


class Hidden(Protocol):
    """Something that holds batches no user code can reach (a loop's queue ahead)."""

    def hidden_addresses(self) -> Iterable[int]:
        """The data addresses of the arrays and tensors of the batches it holds."""
        ...


_HIDDEN: weakref.WeakSet[Hidden] = weakref.WeakSet()


def hide(holder: Hidden) -> None:
    """Views holding what ``holder`` names at a fork are dropped in the child, not copied.

    The holder's takes (a batch leaving its queue for the user) happen inside
    ``no_fork``.
    """
    _HIDDEN.add(holder)


class _Fork:
    """One fork, from the parent's ``before`` handler to its child's and back."""

    def __init__(self) -> None:
        # Both strong: no view of the snapshot is unmapped before the fork (its address
        # could then hold another mapping, which the child's copy or denial would hit).
        self.copy: list[tuple[mmap.mmap, int, int]] = []  # alive until the child copied
        self.drop: list[tuple[mmap.mmap, int, int]] = []  # alive until the fork is done
        self.pipe: tuple[int, int] | None = None  # the child answers on it
        self.inherited: list[tuple[int, int]] = []  # ranges of standing mappings the child gets


#: The fork in progress: set and read only while the forking thread holds ``_GATE``.
_current: _Fork | None = None


def _before_fork() -> None:
    global _current
    _GATE.fork_begins()
    fork = _Fork()
    try:
        hidden = _hidden_addresses()
        for addr, (ref, length) in list(COPY_AT_FORK.items()):
            mm = ref()  # a view's mapping, or its lease of a standing mapping
            if mm is None or getattr(mm, "closed", False):
                continue
            if any(addr <= a < addr + length for a in hidden):
                fork.drop.append((mm, addr, length))
                continue
            length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
            if _not_forked(addr) and not _pass_down(addr, length, fork):
                continue  # the child cannot have it (logged): it is reserved there
            fork.copy.append((mm, addr, length))
        if fork.copy:
            with contextlib.suppress(OSError):
                fork.pipe = os.pipe()
    except Exception:  # a handler must not raise: copy everything rather than nothing
        log.exception("shmloader: the fork handler failed to sort the batch views")
        fork.drop.clear()
    _current = fork


def _not_forked(addr: int) -> bool:
    """Whether ``addr`` lies in a live mapping a child does not get (a standing mapping)."""
    for start, (ref, length) in list(NOT_FORKED.items()):  # a callback may pop meanwhile
        if start <= addr < start + length:
            mm = ref()
            return mm is not None and not mm.closed
    return False


def _pass_down(addr: int, length: int, fork: _Fork) -> bool:
    """Let this fork's child inherit ``[addr, addr + length)`` of a standing mapping."""
    if LIBC_MADVISE is None or LIBC_MADVISE(addr, length, MADV_DOFORK) != 0:
        log.warning("shmloader: a held batch could not reach a forked child (%d B)", length)
        return False
    fork.inherited.append((addr, length))
    return True


def _hidden_addresses() -> list[int]:
    found: list[int] = []
    for holder in list(_HIDDEN):
        found.extend(holder.hidden_addresses())
    return found


def _copy_in_child() -> None:
    """In the child: each inherited view becomes its own copy; each hidden one is dropped."""
    global _current
    fork, _current = _current, None
    if fork is None:
        return
    _GATE.reset_in_child()  # the forking thread's hold, in the child's copy of the gate
    kept = False
    for _mm, addr, length in fork.drop:
        _deny(addr, length)
    for _mm, addr, length in fork.copy:
        if not _own_copy(addr, length):
            kept = True
    fork.drop.clear()
    if fork.pipe is not None:
        read, write = fork.pipe
        with contextlib.suppress(OSError):
            os.close(read)
        with contextlib.suppress(OSError):
            os.write(write, b"k" if kept else b"c")
        if not kept:  # kept: the end stays open until this child exits (the parent's hold)
            with contextlib.suppress(OSError):
                os.close(write)
    fork.copy.clear()


def _deny(addr: int, length: int) -> None:
    """A view no user code of the child can reach is made inaccessible (no memory, no slot)."""
    if LIBC_MMAP is not None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE
        LIBC_MMAP(addr, length, 0, flags, -1, 0)  # PROT_NONE: Python's mmap does not name it


def _own_copy(addr: int, length: int) -> bool:
    """Replace ``[addr, addr + length)`` by an anonymous copy of its bytes; False if not.

    The whole range at once, else in pieces of ``PIECE`` (an address-space
    limit leaves room for one piece where it has none for a second batch).
    False leaves the range readable: its pieces copied so far are the
    child's own, the rest still the slot's.
    """
    if LIBC_MMAP is None or LIBC_MREMAP is None or LIBC_MUNMAP is None:
        return False
    if _move_copy(addr, length):
        return True
    done = 0
    while done < length:
        n = min(PIECE, length - done)
        if not _move_copy(addr + done, n):
            return False
        done += n
    return True


def _move_copy(addr: int, length: int) -> bool:
    assert LIBC_MMAP is not None and LIBC_MREMAP is not None and LIBC_MUNMAP is not None
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    new = LIBC_MMAP(None, length, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if new is None or new == MAP_FAILED:
        return False
    ctypes.memmove(new, addr, length)
    if LIBC_MREMAP(new, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr) != addr:
        LIBC_MUNMAP(new, length)
        return False
    return True


def _after_fork_parent() -> None:
    """In the parent: hold the views until the child copied them, or is gone."""
    global _current
    fork, _current = _current, None
    if fork is None:
        return
    fork.drop.clear()  # the child has them, or denied them: the parent's may go
    for addr, length in fork.inherited:  # before the gate opens: only this fork's child had them
        if LIBC_MADVISE is not None:
            LIBC_MADVISE(addr, length, MADV_DONTFORK)
    fork.inherited.clear()
    try:
        if fork.pipe is not None:
            # the child's end is then the only one: EOF when it is gone. Closed while the
            # lock is held, so that no other fork's child inherits it.
            os.close(fork.pipe[1])
    finally:
        _GATE.fork_ends()
    if fork.pipe is not None:
        _await_child(fork.pipe[0], fork.copy)


def _await_child(read: int, views: list[tuple[mmap.mmap, int, int]]) -> None:
    answer = b""
    try:
        deadline = time.monotonic() + FORK_COPY_WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "shmloader: a forked child did not copy the %d batch view(s) it inherited "
                    "within %.0f s; their slots may be rewritten under it "
                    "(NOTE [batches cross a fork])",
                    len(views),
                    FORK_COPY_WAIT_S,
                )
                break
            ready, _, _ = select.select([read], [], [], left)
            if ready:
                answer = os.read(read, 1)  # b"c": copied; b"k": kept; b"": the child is gone
                break
    except (OSError, ValueError):
        pass
    if answer == b"k":
        _hold_for_child(read, views)
        return
    with contextlib.suppress(OSError):
        os.close(read)


_told_kept = False
#: Views children could not copy, held until the pipe end each child keeps is closed:
#: (read end, views). Looked at (``let_go``) whenever this process registers a view.
_HELD: list[tuple[int, list[tuple[mmap.mmap, int, int]]]] = []


def _hold_for_child(read: int, views: list[tuple[mmap.mmap, int, int]]) -> None:
    """The child could not copy: its views stay the slots' until it and its children exit."""
    global _told_kept
    if not _told_kept:
        _told_kept = True
        held = sum(length for _mm, _addr, length in views)
        log.warning(
            "shmloader: a forked child could not copy the batches it inherited (%d view(s), "
            "%.1f MiB; no memory for the copy): it reads them from their slots, which this "
            "process keeps from reuse until the child exits. Fork while holding fewer or smaller "
            "batches, or use a forkserver or spawn context (NOTE [batches cross a fork]); "
            "said once",
            len(views),
            held / (1 << 20),
        )
    _HELD.append((read, views))


def let_go() -> None:
    """Drop the views held for children that are gone (their pipe ends read EOF).

    Called by the thread that maps views, after each (outside ``no_fork``).
    """
    if not _HELD:
        return
    try:
        gone, _, _ = select.select([read for read, _ in _HELD], [], [], 0)
    except (OSError, ValueError):
        return
    for read, views in [h for h in _HELD if h[0] in gone]:
        with contextlib.suppress(OSError):
            if os.read(read, 64):
                continue  # not EOF (a stray byte): the child still holds them
        _HELD.remove((read, views))
        with contextlib.suppress(OSError):
            os.close(read)
        views.clear()  # the views die here (or with their last user): their slots are released


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_copy_in_child
)

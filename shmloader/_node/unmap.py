"""Unmapping dropped batches on a thread of their own, not on the one that dropped them.

It owns the process's unmap thread and its queue: a batch view made with
``lease`` rests on a lease (a ``ctypes`` array over the mapping's bytes), and
when the lease dies (the last array or tensor of the batch is gone) its mapping is
handed to that thread, which unmaps it; the mapping's own finalizers (the slot's
release) then run there. NOTE [unmapped off the step]. It imports ``forks``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from . import forks

log = logging.getLogger(__name__)


# NOTE [unmapped off the step]
#     Dropping a batch unmaps its view: 8.2-8.4 ms per 256 MiB on a default
#     /dev/shm (65,536 page-table entries), paid by whichever thread lets go
#     of the last tensor of the batch: the training thread, at the ``for``
#     loop's next ``next()``. So the view's numpy array does not rest on the
#     ``mmap`` object but on a lease, a ``ctypes`` array over the same bytes
#     that owns nothing; the lease's finalizer only puts the ``mmap`` on this
#     module's queue (microseconds), and one thread per process, the only
#     one that takes from it, unmaps it (``mmap.close``) and drops it, which
#     runs the mapping's finalizers: the slot's release still follows the
#     unmap (NOTE [slot lifetime] in ``views``), only later and elsewhere.
#     A batch lent from its slot's standing mapping is not unmapped: the
#     thread drops the pages its user wrote and then releases it (NOTE [a
#     standing mapping] in ``standing``).
#     Before the unmap the mapping is retired for forks under ``no_fork``
#     (``forks.retire``: never copied into a child, never inherited), and the
#     unmap itself runs outside that lock, so neither a fork nor the loop
#     mapping the next batch waits for it. Whoever needs the releases of what
#     was dropped (a reader before its BYE, a test) calls ``settle``. In a
#     forked child, and where the thread cannot start, the mapping is unmapped
#     where the lease died, as before. The finalizer takes no lock of
#     ``forks``: it may run in any thread, a fork handler's garbage collection
#     included. The thread ends after ``IDLE_S`` without work (a closed loader
#     leaves no thread behind) and the next drop starts it again. Views
#     under ``LEASE_MIN_BYTES``, and views that die on a loop's own thread
#     (``unmap_here``: a batch decoded into copies), are unmapped where they
#     die: their unmap is cheap or already off the step, and a release that
#     waits for another thread lets the writer grow the ring meanwhile (a
#     4-rank soak of tiny batches grew it from 4 to 7 slots).
class _Unmapper:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.idle = threading.Condition()
        self.handed = 0  # mappings put on the queue
        self.done = 0  # mappings the thread is through with

    def hand_over(self, job: Callable[[], None], here: bool) -> None:
        """The lease's finalizer: queue ``job``, starting the thread if it is not running.

        Where it is not queued (this thread unmaps its own, or no thread can
        start) ``job`` runs here if ``here``, else it is dropped: a job that
        holds a mapping unmaps it by dying. Never in a forked child. Takes no
        lock of ``forks`` (it may run inside a fork handler, from a garbage
        collection); ``idle`` is re-entrant.
        """
        if os.getpid() != self.pid:
            return
        if not getattr(_here, "unmaps", False) and self._queue(job):
            return
        if here:
            job()

    def _queue(self, job: Callable[[], None]) -> bool:
        with self.idle:
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="shmloader-unmap", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread (interpreter exit, a limit)
                    return False
                self.thread = thread
            self.handed += 1
            self.queue.put(job)
        return True

    def _run(self) -> None:
        while True:
            try:
                job = self.queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self.idle:  # _queue puts under this lock: nothing is left behind
                    if self.queue.empty():
                        self.thread = None
                        return
                continue
            try:
                job()
            except Exception:  # a finalizer's error must not end the thread
                log.exception("shmloader: unmapping a dropped batch failed")
            del job  # a mapping's finalizers (the slot's release) run here
            with self.idle:
                self.done += 1
                self.idle.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until every mapping handed over so far is unmapped; False after ``timeout``."""
        if threading.current_thread() is self.thread:
            return True
        deadline = time.monotonic() + timeout
        with self.idle:
            target = self.handed
            while self.done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        return True


def _unmap(mm: mmap.mmap) -> None:
    forks.retire(mm)  # under no_fork: from now on no child copies or inherits it
    with contextlib.suppress(BufferError):  # an export still alive: its holder's drop unmaps
        mm.close()  # outside no_fork: neither a fork nor the next mapping waits for it


#: Seconds the unmap thread waits for work before it ends (the next drop starts it again).
IDLE_S = 1.0
#: Views smaller than this are unmapped where they are dropped: a few pages cost less
#: to unmap than the hand-over, and their release is not delayed.
LEASE_MIN_BYTES = 1 << 20
#: ``.unmaps``: this thread unmaps what it drops itself (``unmap_here``).
_here = threading.local()


def unmap_here() -> None:
    """Views this thread drops are unmapped here, not handed over: a loop's own thread
    (a view it decoded into copies dies on it) is no user's step, and its releases must
    not wait for another thread (NOTE [unmapped off the step])."""
    _here.unmaps = True


_unmapper = _Unmapper()


def _after_fork_in_child() -> None:
    global _unmapper
    _unmapper = _Unmapper()  # the parent's queue and thread are not the child's


os.register_at_fork(after_in_child=_after_fork_in_child)


def lease(mm: mmap.mmap, at: int, nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` at offset ``at`` of ``mm``, unmapped off the dropping thread.

    ``mm`` stays mapped while any array or tensor made from the result lives;
    then the unmap thread unmaps and drops it (NOTE [unmapped off the step]).
    ``mapping_of`` finds ``mm`` again from the result.
    """
    return _lend(mm, at, nbytes, functools.partial(_unmap, mm), here=False)[0]


def lease_standing(
    mm: mmap.mmap, nbytes: int, recycle: Callable[[], None]
) -> tuple[np.ndarray, ctypes.Array]:
    """A uint8 array of the first ``nbytes`` of ``mm`` (a standing mapping), and its lease.

    When the last array or tensor made from it is gone, ``recycle`` runs on
    the unmap thread (where it cannot, where the lease died): NOTE [a
    standing mapping] in ``standing``. ``mm`` stays mapped meanwhile.
    """
    view, lent = _lend(mm, 0, nbytes, recycle, here=True)
    lent.standing = True  # type: ignore[attr-defined]
    return view, lent


def _lend(
    mm: mmap.mmap, at: int, nbytes: int, job: Callable[[], None], *, here: bool
) -> tuple[np.ndarray, ctypes.Array]:
    """A lease (a ``ctypes`` array over ``mm``'s bytes that owns nothing) whose death hands
    ``job`` to the unmap thread, and a uint8 array resting on it."""
    lent = (ctypes.c_uint8 * max(nbytes, 1)).from_address(forks.address(mm) + at)
    lent.mapping = weakref.ref(mm)  # type: ignore[attr-defined]
    weakref.finalize(lent, _unmapper.hand_over, job, here).atexit = False
    view = np.frombuffer(lent, dtype=np.uint8, count=nbytes)  # type: ignore[call-overload]
    return view, lent


def holder_of(view: np.ndarray) -> object | None:
    """What a batch's view rests on: its lease where that is in a standing mapping, else
    its own mapping (``mapping_of``)."""
    base = view.base
    for lent in (base, getattr(base, "obj", None)):
        if getattr(lent, "standing", False):
            return lent
    return mapping_of(view)


def mapping_of(view: np.ndarray) -> mmap.mmap | None:
    """The mapping a view made by ``lease`` (or ``np.frombuffer`` of an mmap) rests on."""
    base = view.base
    for lent in (base, getattr(base, "obj", None)):  # the lease, or a memoryview of it
        ref = getattr(lent, "mapping", None)
        if ref is not None:
            return ref()
    mm = getattr(base, "obj", base)
    return mm if isinstance(mm, mmap.mmap) else None


def settle(timeout: float = 5.0) -> bool:
    """Wait until every batch dropped so far is unmapped and released; False after ``timeout``."""
    return _unmapper.settle(timeout)

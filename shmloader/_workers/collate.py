"""What the leader's DataLoader workers run: ``SlotCollate``, the ``collate_fn`` wrapper
the leader installs, claims a slot of its worker's partition of the pool, runs the
user's collate with torch's shared-memory allocations answered from that slot (NOTE
[collate into the slot]), encodes the batch keeping what already lies in place, copies
the rest after it and returns a ``SlotRef`` in the batch's place. It owns the wrapper,
its ``install``/``uninstall`` on a loader and the allocator it puts in a worker's torch;
it touches the pool only through the worker's ``WorkerSlots`` and, called in the main
process, nothing: there the wrapper is the user's collate unchanged. One batch from a
worker to the leader, drawn: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .._proto import codec
from ..errors import LoaderStateError, ShmLoaderError
from .control import PoolSpec
from .partition import WorkerSlots, estimate_bytes
from .pool import SlotRef, WorkerPool


class WorkerFailure:
    """An error of our own making in a worker, carried to the leader as a value.

    ``UnsupportedBatchError``, ``ShmCapacityError``, a pool wait that timed
    out: the DataLoader would rebuild them as ``RuntimeError`` (their
    constructors take more than one argument), while the leader re-raises
    them with the same type and message, and readers get ``LeaderError``
    carrying both, as for any leader error. The user's own exceptions
    (dataset, collate) still travel the DataLoader's way.
    """

    __slots__ = ("attrs", "message", "module", "name", "trace", "worker")

    def __init__(self, exc: BaseException, worker: int) -> None:
        self.module = type(exc).__module__
        self.name = type(exc).__qualname__
        self.message = str(exc)
        self.trace = "".join(traceback.format_exception(exc))
        self.worker = worker
        self.attrs = {
            k: v for k, v in vars(exc).items() if isinstance(v, int | str | float | type(None))
        }

    def __reduce__(self) -> tuple:
        fields = (self.module, self.name, self.message, self.trace, self.worker, self.attrs)
        return (_rebuild_failure, fields)

    def exception(self) -> BaseException:
        """The original exception type with the original message, and where it came from."""
        try:
            cls = getattr(importlib.import_module(self.module), self.name)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                raise TypeError(cls)
            exc = Exception.__new__(cls)  # not cls(...): constructors differ
            Exception.__init__(exc, self.message)
            for key, value in self.attrs.items():
                setattr(exc, key, value)
        except Exception:
            exc = ShmLoaderError(f"{self.module}.{self.name}: {self.message}")
        exc.add_note(f"Raised in DataLoader worker {self.worker}:\n{self.trace}")
        return exc


def _rebuild_failure(
    module: str, name: str, message: str, trace: str, worker: int, attrs: dict
) -> WorkerFailure:
    failure = WorkerFailure.__new__(WorkerFailure)
    failure.module, failure.name, failure.message = module, name, message
    failure.trace, failure.worker, failure.attrs = trace, worker, attrs
    return failure


# ------------------------------------------------- NOTE [collate into the slot]


class _Arena:
    """Bump allocator over a claimed slot's payload: the collate's shared-memory outputs.

    ``track`` is told of every piece handed out (NOTE [kept collate outputs] in ``partition``).

    NOTE [collate into the slot]
        Inside a DataLoader worker, torch's ``default_collate`` stacks each
        tensor (and each numpy array, as a tensor) into memory it gets from
        ``UntypedStorage._new_shared``: fresh shared memory, so that the batch
        can reach the main process without a copy, written at page-fault speed.
        While the user's collate runs, the slot collate answers that call (on
        this thread only) from the slot it already claimed: a bump allocator
        (``_Arena``) over the slot's pre-touched pages. The stacked batch is then
        already where the payload goes, and ``codec.encode(placed=...)`` keeps
        those leaves where they are (NOTE [placed leaves] in ``codec``); only
        the rest (leaves a custom collate made in private memory, small numbers)
        is copied after them. Any allocation that does not fit, any other
        thread, any other device gets torch's own ``_new_shared``. If the
        finished batch outgrows the slot, the worker grows the slot and copies
        the whole batch, as without the allocator. A collate may keep references
        to its outputs past the call (a memory bank, a view of one leaf): the
        pieces it keeps are copied out of the slot, at their addresses, before
        the slot is written again (NOTE [kept collate outputs] in ``partition``), so
        they keep their bytes as with plain PyTorch.
        ``SHMLOADER_COLLATE_IN_SLOT=0`` (``Config.collate_in_slot``, carried to
        the workers in the ``PoolSpec``) turns the allocator off: every batch is
        then written by one copy after the collate.
    """

    def __init__(self, dest: np.ndarray, track: Callable[[np.ndarray], None] | None = None) -> None:
        self.dest = dest
        self.base = dest.ctypes.data
        self.top = 0  # bytes handed out so far (the next leaf to copy goes after)
        self.track = track

    def storage(self, nbytes: int) -> torch.UntypedStorage | None:
        """``nbytes`` of the slot as a storage, or None when they do not fit."""
        at = codec.align(self.top)
        if nbytes <= 0 or at + nbytes > self.dest.nbytes:
            return None
        self.top = at + nbytes
        piece = self.dest[at : at + nbytes]  # the storage holds it for exactly its own life
        if self.track is not None:
            self.track(piece)
        return torch.frombuffer(piece, dtype=torch.uint8).untyped_storage()

    def offset_of(self, obj: Any, nbytes: int) -> int | None:
        """Where ``obj``'s bytes lie in the slot, if they were made here."""
        ptr = obj.data_ptr() if isinstance(obj, torch.Tensor) else obj.ctypes.data
        offset = ptr - self.base
        return offset if offset >= 0 and offset + nbytes <= self.top else None


_LOCAL = threading.local()  # .arena: the arena of the collate running on this thread
_TORCH_NEW_SHARED: Any = None  # torch's own UntypedStorage._new_shared, once replaced


def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> Any:
    """``UntypedStorage._new_shared`` in a worker: from the slot while a collate runs."""
    arena = getattr(_LOCAL, "arena", None)
    on_cpu = device is None or torch.device(device).type == "cpu"
    if arena is not None and cls is torch.UntypedStorage and on_cpu:
        storage = arena.storage(size)
        if storage is not None:
            return storage
    return _TORCH_NEW_SHARED.__func__(cls, size, device=device)


def _install_allocator() -> bool:
    """Route this process's ``_new_shared`` through ``_new_shared`` (idempotent)."""
    global _TORCH_NEW_SHARED
    if _TORCH_NEW_SHARED is None:
        current = inspect.getattr_static(torch.UntypedStorage, "_new_shared", None)
        if not isinstance(current, classmethod):  # a torch we do not know: leave it alone
            return False
        _TORCH_NEW_SHARED = torch.UntypedStorage._new_shared
        torch.UntypedStorage._new_shared = classmethod(_new_shared)  # type: ignore[method-assign, assignment]
    return True


@contextlib.contextmanager
def _allocating_from(arena: _Arena | None) -> Iterator[None]:
    _LOCAL.arena = arena
    try:
        yield
    finally:
        _LOCAL.arena = None


class SlotCollate:
    """``collate_fn`` wrapper: collate into this worker's pool slot, then finish the batch there.

    ``hint`` (what it claims before the collate has made the batch) is the
    larger of the samples' bytes and this worker's last batch.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], spec: PoolSpec) -> None:
        self.collate_fn = collate_fn
        self.spec = spec
        self._slots: WorkerSlots | None = None  # made lazily, in the worker process

    def __getstate__(self) -> dict:
        return {"collate_fn": self.collate_fn, "spec": self.spec, "_slots": None}

    def __call__(self, samples: Any) -> Any:
        info = get_worker_info()
        if info is None:  # the main process (num_workers=0, or a caller of its own)
            return self.collate_fn(samples)
        claimed = None
        try:
            slots = self._worker_slots(info.id)
            estimate = estimate_bytes(samples)
            if not slots.grown:  # first batch: the pool at this size must fit, before collating
                slots.check_capacity(estimate, "batches of these samples")
            if self.spec.collate_in_slot and _install_allocator():
                hint = max(estimate, slots.last_nbytes)
                index, ticket = claimed = slots.claim(hint)
                dest, gen = slots.payload(index, hint)
        except ShmLoaderError as exc:
            if claimed is not None:
                slots.free(claimed[0])
            return WorkerFailure(exc, info.id)
        if claimed is None:  # no allocator: collate as usual, then one copy
            batch = self.collate_fn(samples)  # the user's errors travel the DataLoader's way
            return self.write(batch, info.id)
        arena = _Arena(dest, functools.partial(slots.track, index, gen))
        try:
            with _allocating_from(arena):
                batch = self.collate_fn(samples)
        except BaseException:
            slots.free(index)
            raise
        return self._finish(slots, batch, index, ticket, gen, arena, info.id)

    def _finish(
        self,
        slots: WorkerSlots,
        batch: Any,
        index: int,
        ticket: int,
        gen: int,
        arena: _Arena,
        worker_id: int,
    ) -> SlotRef | WorkerFailure:
        """Encode a batch collated into slot ``index``; copy what is not in place yet."""
        allow = self.spec.allow_pickle
        try:
            enc = codec.encode(batch, allow_pickle=allow, placed=arena.offset_of, start=arena.top)
            need, dest = enc.nbytes, arena.dest
            if need > dest.nbytes:
                # Outgrew the slot it was collated into: the next generation, sized
                # for this layout so that the next batch fits in place, takes the
                # whole batch by one copy. Never the same slot: the copy's sources
                # lie in it.
                enc = codec.encode(batch, allow_pickle=allow)
                dest, gen = slots.payload(index, need)
            del batch
            t0 = time.perf_counter_ns()
            codec.write_payload(enc, dest)
            write_ns = time.perf_counter_ns() - t0
        except ShmLoaderError as exc:
            slots.free(index)
            return WorkerFailure(exc, worker_id)
        except BaseException:
            slots.free(index)
            raise
        slots.last_nbytes = need
        if not enc.nbytes:  # nothing to write: metadata only, no slot
            slots.free(index)
            return SlotRef(self.spec.token, -1, 0, 0, 0, enc.meta, self.spec.owner_pid)
        placed = sum(lf.nbytes for lf, s in zip(enc.leaves, enc.sources, strict=True) if s is None)
        slots.filled(index, write_ns, placed)
        return SlotRef(
            self.spec.token, index, gen, ticket, enc.nbytes, enc.meta, self.spec.owner_pid
        )

    def _worker_slots(self, worker_id: int) -> WorkerSlots:
        slots = self._slots
        if slots is None or slots.pid != os.getpid():  # forked: never reuse the parent's
            slots = self._slots = WorkerSlots(self.spec, worker_id)
        return slots

    def write(self, batch: Any, worker_id: int) -> SlotRef | WorkerFailure:
        """Encode ``batch`` into a slot of this worker's partition; its reference."""
        slots = self._worker_slots(worker_id)
        claimed = None
        try:
            enc = codec.encode(batch, allow_pickle=self.spec.allow_pickle)
            del batch
            if not enc.nbytes:  # nothing to write: metadata only, no slot
                return SlotRef(self.spec.token, -1, 0, 0, 0, enc.meta, self.spec.owner_pid)
            index, ticket = claimed = slots.claim(enc.nbytes)
            dest, gen = slots.payload(index, enc.nbytes)
            t0 = time.perf_counter_ns()
            codec.write_payload(enc, dest)
            write_ns = time.perf_counter_ns() - t0
        except ShmLoaderError as exc:
            if claimed is not None:
                slots.free(claimed[0])
            return WorkerFailure(exc, worker_id)
        except BaseException:
            if claimed is not None:
                slots.free(claimed[0])
            raise
        slots.last_nbytes = enc.nbytes
        slots.filled(index, write_ns)
        return SlotRef(
            self.spec.token, index, gen, ticket, enc.nbytes, enc.meta, self.spec.owner_pid
        )


def check_installable(loader: Any) -> None:
    """Raise :class:`LoaderStateError` if another open pool's wrapper is on ``loader``.

    Two ShmLoaders over one DataLoader at once would have one DataLoader's
    workers write two rings: refused, naming the fix.
    """
    collate = getattr(loader, "collate_fn", None)
    if isinstance(collate, SlotCollate):
        raise LoaderStateError(
            f"the DataLoader that make_loader returned ({type(loader).__name__} at "
            f"{id(loader):#x}) is already published by another open ShmLoader (its "
            f"collate_fn is wrapped for pool {collate.spec.token}); have make_loader build a "
            "new DataLoader for each ShmLoader (lambda: DataLoader(...)), or close() the "
            "other ShmLoader first"
        )


def install(loader: Any, pool: WorkerPool) -> bool:
    """Wrap ``loader.collate_fn`` for ``pool``; False when it cannot be wrapped.

    The wrapper is removed again when ``pool`` closes (``uninstall``), so the
    same DataLoader can be given to a later ShmLoader; while it is in place,
    another ``install`` raises (``check_installable``).
    """
    check_installable(loader)
    collate = getattr(loader, "collate_fn", None)
    if collate is None:
        return False
    loader.collate_fn = SlotCollate(collate, pool.spec)
    pool.on_close(functools.partial(uninstall, loader, pool.spec))
    return True


def uninstall(loader: Any, spec: PoolSpec) -> None:
    """Undo ``install``: the user's collate back, and persistent workers (which carry
    the wrapper for ``spec``'s closed pool) shut down so that the next ``iter()``
    starts workers with the collate the loader has then."""
    wrapper = getattr(loader, "collate_fn", None)
    if not isinstance(wrapper, SlotCollate) or wrapper.spec is not spec:
        return
    loader.collate_fn = wrapper.collate_fn
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        with contextlib.suppress(Exception):
            iterator._shutdown_workers()
        loader._iterator = None

"""The worker writer: a DataLoader worker publishes its own batches into the ring.

The leader wraps its ``DataLoader``'s ``collate_fn`` in a :class:`WorkerWriter`
(a plain picklable object, so every ``multiprocessing_context`` works: fork,
forkserver, spawn). Inside a worker the wrapper calls the user's collate,
encodes the batch (``codec.encode``, which refuses unsupported leaves before
anything is written), claims a slot of its partition of the pool (``pool``),
writes the payload there once and returns a :class:`~shmloader.pool.SlotRef`
in the batch's place. The DataLoader carries that small object to the main
process, keeps its in-order delivery, and the leader announces the slot::

    DataLoader worker w                          leader main process
    -------------------                          -------------------
    batch = collate_fn(samples)    (user's)
    enc = codec.encode(batch)      (refuses bad leaves: WorkerFailure)
    i = claim(enc.nbytes)          FREE -> WRITING (grow if too small)
    codec.write_payload(enc, slot i)   the one write of the payload
    FILLED; return SlotRef ----- DataLoader queue -----> ref = next(source)
                                                          slot = pool.adopt(ref)   FILLED -> HELD
                                                          announce (meta only), xnode.send(slot)
                                                          yield decode(private view of slot)
                                                          ... every rank released: HELD -> FREE

Errors of our own making inside the worker (``UnsupportedBatchError``,
``ShmCapacityError``, a pool wait that timed out) travel as a
:class:`WorkerFailure` value instead of an exception: the DataLoader would
rebuild them as ``RuntimeError`` (their constructors take more than one
argument), while the leader re-raises them with the same type and message,
and readers get ``LeaderError`` carrying both, as for any leader error. The
user's own exceptions (dataset, collate) still travel the DataLoader's way.
Called outside a worker (no ``get_worker_info()``), the wrapper is the
user's collate unchanged.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from torch.utils.data import get_worker_info

from . import codec
from .errors import ShmLoaderError
from .pool import PoolSpec, SlotRef, WorkerSlots, estimate_bytes


class WorkerFailure:
    """An error raised by the worker writer, carried to the leader as a value."""

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


class WorkerWriter:
    """``collate_fn`` wrapper: collate, then write the batch into this worker's pool slot."""

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
        try:
            slots = self._worker_slots(info.id)
            if not slots.grown:  # first batch: the pool at this size must fit, before collating
                slots.check_capacity(estimate_bytes(samples), "batches of these samples")
        except ShmLoaderError as exc:
            return WorkerFailure(exc, info.id)
        batch = self.collate_fn(samples)  # the user's errors travel the DataLoader's way
        return self.write(batch, info.id)

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
        slots.filled(index, write_ns)
        return SlotRef(
            self.spec.token, index, gen, ticket, enc.nbytes, enc.meta, self.spec.owner_pid
        )


def install(loader: Any, spec: PoolSpec) -> bool:
    """Wrap ``loader.collate_fn`` (a DataLoader with workers); False when it cannot be."""
    collate = getattr(loader, "collate_fn", None)
    if collate is None or isinstance(collate, WorkerWriter):
        return False
    loader.collate_fn = WorkerWriter(collate, spec)
    return True

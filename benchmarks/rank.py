"""What one rank of one benchmark configuration does (a spawned process).

Every configuration runs in freshly spawned ranks: ``sp`` processes, one SP
group, gloo on loopback. Rank 0 is the group's leader. A rank measures
itself and writes its numbers as JSON; the parent (``run``) combines them.

Transport runs (:func:`transport`), per step, for the three ways plus
``objlist``:

Phase A, *follower time to a usable batch*::

    leader / every base rank          follower
    ------------------------          --------
    prepare(): the batch is ready     .
      (shmloader: loaded AND published;
       broadcast: loaded;
       base: own worker has it queued)
    settle(): the leader's worker has
      produced the next one too (idle;
      shmloader: refill() below)
    ------------- barrier(group) -------------
    take() (broadcast: send)          t0 = now; batch = take(); t1 = now
                                      follower_ms = t1 - t0
    ------------- barrier(group) -------------
    drop the previous batch           drop_ms = time to drop the previous batch
    refill(): shmloader's worker has
      produced the next one (into the
      slot every rank just dropped)
    ------------- barrier(group) -------------
                                      touch_ms = time to touch every page of it
                                        (even steps) or read_ms = time to read
                                        every byte once (odd steps): both on
                                        a batch nothing has read yet
    ------------- barrier(group) -------------

Phase B, *end-to-end delivery* (followers already waiting)::

    ------------- barrier(group) -------------
    batch = next(loader)              batch = e2e()   (blocks)
    start_ns = now   (the loader      hold_ns = now
      handed it over: publish starts)
    publish / send
                                      e2e = max(hold_ns over followers) - start_ns

Realistic runs (:func:`realistic`): a plain training loop (``next`` then a
barrier as the step) over a DataLoader with workers doing decode-like CPU
work, to measure CPU seconds, memory and steps per second.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import procstat, transports
from .workload import BatchSpec, realistic_loader, tensors, transport_loader


@dataclass(frozen=True)
class Case:
    """One configuration: a run kind, a way (``mode``), an SP size and a batch size."""

    run: str  # "transport", "realistic", "budget" or "profile" (benchmarks.breakdown)
    mode: str  # "base", "broadcast", "objlist" or "shmloader"
    sp: int
    target_bytes: int
    warmup: int
    steps: int  # measured steps (per phase in transport runs)
    workers: int
    decode_scale: int = 2
    memory_samples: int = 3
    timeout_s: float = 600.0
    shm_dir: str = ""  # the ring directory (SHMLOADER_SHM_DIR) for the huge-page way

    @property
    def total_batches(self) -> int:
        """Batches the loader yields: warm-up plus measured steps of every phase."""
        phases = 2 if self.run == "transport" else 1
        return self.warmup + phases * self.steps

    @property
    def label(self) -> str:
        return f"{self.run} sp{self.sp} {self.mode} {self.target_bytes / (1 << 20):g}MiB"


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of the machine."""
    return time.monotonic_ns()


def ms_since(t0: int) -> float:
    return (now_ns() - t0) / 1e6


# ----------------------------------------------------------------- recorder


class Recorder:
    """This rank's measurements: per-step fields, CPU and memory."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self.records: dict[str, list[dict[str, Any]]] = {}
        self.extra: dict[str, Any] = {}
        self.memory_start = procstat.tree_memory(self.pid)
        self.shm_start = procstat.shm_used()
        self.memory_samples: list[dict[str, int]] = []
        self.cpu_start = procstat.tree_cpu_seconds(self.pid)
        self.cpu_s: float | None = None

    def add(self, phase: str, fields: dict[str, Any]) -> None:
        self.records.setdefault(phase, []).append(fields)

    def sample_memory(self) -> None:
        """PSS of this rank and its workers now; /dev/shm usage now."""
        mem = procstat.tree_memory(self.pid)
        self.memory_samples.append(
            {
                "pss": mem.pss,
                "pss_shmem": mem.pss_shmem,
                "processes": mem.processes,
                "shm_used": procstat.shm_used(),
            }
        )

    def stop_cpu(self) -> None:
        """CPU seconds since the recorder started (workers included once joined)."""
        self.cpu_s = procstat.tree_cpu_seconds(self.pid) - self.cpu_start

    def result(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "records": self.records,
            "cpu_s": self.cpu_s,
            "memory_start": {
                "pss": self.memory_start.pss,
                "pss_shmem": self.memory_start.pss_shmem,
                "processes": self.memory_start.processes,
                "shm_used": self.shm_start,
            },
            "memory_samples": self.memory_samples,
            **self.extra,
        }


# --------------------------------------------------------------------- ways


class Stamped:
    """Wraps the leader's loader; notes when each batch left it (publish starts next).

    ``hook``, when set, runs on the batch first (the interleaved memcpy floor,
    see :class:`Floor`); the stamp is taken after it.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.last_ns = 0
        self.it: Iterator[Any] | None = None
        self.hook: Callable[[Any], dict[str, Any]] | None = None
        self.fields: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self.it = iter(self.loader)
        for batch in self.it:
            self.fields = self.hook(batch) if self.hook is not None else {}
            self.last_ns = now_ns()
            yield batch


class StampedLoader(torch.utils.data.DataLoader):
    """A DataLoader that notes when each batch left it, and stays a DataLoader.

    ``Stamped`` hides the DataLoader, which turns the worker writer off (the
    leader's main process then copies the batch: the one-copy way). The
    zero-copy way swaps the loader's class to this subclass instead, so that
    ShmLoader still sees a DataLoader with workers and still gets stamps.
    """

    last_ns = 0
    it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        self.it = super().__iter__()
        for item in self.it:
            self.last_ns = now_ns()
            yield item


class Floor:
    """The leader's physical floor: ``np.copyto`` of the batch into a pre-touched buffer.

    Measured on the same batches, in the same quiet moments, as the publish
    it is compared with (every other measured phase-A step): ``memcpy_cold_ms``
    copies the batch as the loader handed it over (its pages not yet mapped
    in this process, as a publish finds them); ``memcpy_warm_ms`` copies it
    again (source mapped). The publish that follows on such a step reads a
    warm source: it is recorded as ``publish_warm_ms``.
    """

    def __init__(self) -> None:
        self.dest: np.ndarray | None = None

    def __call__(self, batch: Any) -> dict[str, Any]:
        sources = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors(batch)]
        need = sum(s.size for s in sources)
        if self.dest is None or self.dest.size < need:
            self.dest = np.empty(need, np.uint8)
            self.dest.fill(1)  # pre-touch: the ring's slots are pre-touched too
        cold = copy_once(sources, self.dest)
        warm = copy_once(sources, self.dest)
        return {"memcpy_cold_ms": cold, "memcpy_warm_ms": warm}


def wait_ready(it: Iterator[Any], timeout: float) -> None:
    """Block until a DataLoader iterator has a batch queued (base: no wait on workers).

    Peeks at the worker result queue of torch's multi-process iterator; with
    no workers (or another iterator) there is nothing to wait for.
    """
    if not getattr(it, "_tasks_outstanding", 0):
        return  # nothing requested from the workers (no workers, or the loader is done)
    queue = getattr(it, "_data_queue", None)
    reader = getattr(queue, "_reader", None)
    if reader is not None:
        reader.poll(timeout)


def shutdown(it: Iterator[Any] | None) -> None:
    """Stop a DataLoader iterator's workers now (joined, so their CPU is counted)."""
    stop = getattr(it, "_shutdown_workers", None)
    if callable(stop):
        stop()


class Way:
    """How the leader's batch reaches every rank; subclasses per mode.

    ``prepare``/``take`` make one phase-A step, ``e2e`` one phase-B step,
    ``step`` one plain training-loop step; each returns the batch and the
    fields to record.
    """

    def __init__(self, rank: int, group: dist.ProcessGroup, make: Callable[[], Any]) -> None:
        self.rank, self.group, self.make = rank, group, make
        self.leader = rank == 0
        #: Set by phase A on the leader: measure the memcpy floor on this step's batch.
        self.floor: Floor | None = None
        #: This rank's loader iterator, where it has one.
        self.it: Iterator[Any] | None = None

    def prepare(self) -> dict[str, Any]:
        return {}

    def settle(self) -> None:
        """Phase A, after ``prepare``: wait until the leader's workers are idle again.

        The workers start on the next batch as soon as one is taken; waiting
        for it keeps their work out of the followers' measured ``take``.
        """

    def refill(self) -> None:
        """Phase A, once every rank dropped its previous batch: wait for the next one.

        For a way whose workers write into slots the ranks release (shmloader's
        pool of two slots), the next batch can only be written once the
        previous one is dropped everywhere.
        """

    def take(self) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def e2e(self) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def step(self) -> Any:
        return self.e2e()[0]

    def finish(self) -> None:
        """Consume the end of the loader on every rank that has one."""
        if self.it is not None and next(self.it, None) is not None:
            raise RuntimeError("the loader yielded more batches than planned")

    def close(self) -> None:
        """Release the loader, its workers and anything shared."""
        shutdown(self.it)
        self.it = None


class Base(Way):
    """Every rank runs its own DataLoader: no sharing at all."""

    def __init__(self, rank: int, group: dist.ProcessGroup, make: Callable[[], Any]) -> None:
        super().__init__(rank, group, make)
        self.loader = make()
        self.it: Iterator[Any] | None = iter(self.loader)

    def prepare(self) -> dict[str, Any]:
        wait_ready(self.it, timeout=600)  # type: ignore[arg-type]
        return {}

    def take(self) -> tuple[Any, dict[str, Any]]:
        t0 = now_ns()
        batch = next(self.it)  # type: ignore[arg-type]
        return batch, {"follower_ms": ms_since(t0)}

    def e2e(self) -> tuple[Any, dict[str, Any]]:
        return self.take()


class Broadcast(Way):
    """The leader loads; the batch goes over gloo (seed: skeleton pickled, tensors broadcast)."""

    send = staticmethod(transports.send_broadcast)
    receive = staticmethod(transports.receive_broadcast)

    def __init__(self, rank: int, group: dist.ProcessGroup, make: Callable[[], Any]) -> None:
        super().__init__(rank, group, make)
        self.it: Iterator[Any] | None = iter(make()) if self.leader else None
        self.pending: Any = None

    def prepare(self) -> dict[str, Any]:
        if self.leader:
            self.pending = next(self.it)  # type: ignore[arg-type]
        return {}

    def settle(self) -> None:
        if self.leader:
            wait_ready(self.it, timeout=600)  # type: ignore[arg-type]

    def _deliver(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        if self.leader:
            _, meta_ms, tensor_ms = self.send(batch, self.group, 0)
            return batch, {
                "meta_ms": meta_ms,
                "tensor_ms": tensor_ms,
                "publish_ms": meta_ms + tensor_ms,
            }
        t0 = now_ns()
        got, meta_ms, tensor_ms = self.receive(self.group, 0)
        return got, {"follower_ms": ms_since(t0), "meta_ms": meta_ms, "tensor_ms": tensor_ms}

    def take(self) -> tuple[Any, dict[str, Any]]:
        batch, self.pending = self.pending, None
        return self._deliver(batch)

    def e2e(self) -> tuple[Any, dict[str, Any]]:
        if self.leader:
            batch = next(self.it)  # type: ignore[arg-type]
            start = now_ns()
            batch, fields = self._deliver(batch)
            return batch, {**fields, "start_ns": start}
        batch, fields = self._deliver(None)
        return batch, {**fields, "hold_ns": now_ns()}


class ObjList(Broadcast):
    """The leader loads; the whole batch goes through ``broadcast_object_list`` (pickle)."""

    send = staticmethod(transports.send_objlist)
    receive = staticmethod(transports.receive_objlist)


class Shared(Way):
    """``ShmLoader`` with sharing on, embedded mode (no daemon): the zero-copy way.

    The leader's DataLoader workers write every batch into the ring (the
    worker writer); the leader's main process announces it.
    """

    zero_copy = True

    def __init__(self, rank: int, group: dist.ProcessGroup, make: Callable[[], Any]) -> None:
        from shmloader import Config, ShmLoader

        super().__init__(rank, group, make)
        self.stamped: Stamped | StampedLoader | None = None

        def factory() -> Stamped | StampedLoader:
            loader = make()
            if self.zero_copy:
                loader.__class__ = StampedLoader
                self.stamped = loader
            else:
                self.stamped = Stamped(loader)
            return self.stamped

        config = Config.from_env(enabled=True, daemon=None)
        self.loader = ShmLoader(factory, group, config=config)
        self.it: Iterator[Any] | None = iter(self.loader)
        self.pending: Any = None

    def _leader_next(self) -> tuple[Any, dict[str, Any]]:
        """The leader's ``next``: its loader's batch, published; with the publish numbers."""
        before = self.loader.stats()
        if isinstance(self.stamped, Stamped):
            self.stamped.hook = self.floor
        batch = next(self.it)  # type: ignore[arg-type]
        returned = now_ns()
        after = self.loader.stats()
        start = self.stamped.last_ns if self.stamped is not None else returned
        publish = after.get("publish_ms_total", 0.0) - before.get("publish_ms_total", 0.0)
        fields = {
            "start_ns": start,
            "write_ms": after.get("write_ms_last"),
            "ring_slots": after.get("ring_slots"),
        }
        if self.zero_copy and self.stamped is not None:
            # the main process never saw the payload: its whole time from the
            # DataLoader's hand-over to the user's batch, and the worker's write
            fields.update(
                publish_ms=publish,
                overhead_ms=(returned - start) / 1e6,
                worker_write_ms=after.get("worker_write_ms_last"),
                main_ms=after.get("main_ms_last"),
                zero_copy=after.get("worker_written", 0) > before.get("worker_written", 0),
            )
            if self.floor is not None:  # memcpy of the same bytes (the delivered view)
                fields.update(self.floor(batch))
        elif self.floor is not None and self.stamped is not None:
            # the floor just read the source: this publish found it warm
            fields.update(self.stamped.fields, publish_warm_ms=publish)
        else:
            fields.update(publish_ms=publish, overhead_ms=(returned - start) / 1e6)
        return batch, fields

    def prepare(self) -> dict[str, Any]:
        if not self.leader:
            return {}
        self.pending, fields = self._leader_next()
        return fields

    def refill(self) -> None:
        # Not in ``settle``: while every rank still holds its previous batch, the
        # worker has no slot to write the next one into (two slots in lockstep).
        if self.leader and self.stamped is not None and self.stamped.it is not None:
            wait_ready(self.stamped.it, timeout=600)  # type: ignore[arg-type]

    def take(self) -> tuple[Any, dict[str, Any]]:
        if self.leader:
            batch, self.pending = self.pending, None
            return batch, {}
        t0 = now_ns()
        batch = next(self.it)  # type: ignore[arg-type]
        fields = {
            "follower_ms": ms_since(t0),
            "receive_ms": self.loader.stats().get("receive_ms_last"),
        }
        return batch, fields

    def e2e(self) -> tuple[Any, dict[str, Any]]:
        if self.leader:
            return self._leader_next()
        batch = next(self.it)  # type: ignore[arg-type]
        return batch, {"hold_ns": now_ns()}

    def close(self) -> None:
        self.it = None
        self.stamped = None
        with contextlib.suppress(Exception):
            self.extra_stats = self.loader.stats()
        self.loader.close()


class SharedOneCopy(Shared):
    """``ShmLoader`` whose leader main process copies each batch into the ring (one copy).

    The loader is hidden behind ``Stamped`` (not a DataLoader), which is how
    any non-DataLoader iterable is published: the way before the worker writer.
    """

    zero_copy = False


WAYS: dict[str, type[Way]] = {
    "base": Base,
    "broadcast": Broadcast,
    "objlist": ObjList,
    "shmloader": Shared,
    "shmloader-1copy": SharedOneCopy,
    # the zero-copy way with its ring in a huge=within_size tmpfs (``Case.shm_dir``)
    "shmloader-huge": Shared,
    # every loop in step with its user (SHMLOADER_AHEAD=0, set by benchmarks.step)
    "shmloader-in-step": Shared,
}


# -------------------------------------------------------------- measurements


def read_all(batch: Any) -> float:
    """Milliseconds to read every byte of the batch's tensors once (XOR-reduce)."""
    t0 = now_ns()
    for t in tensors(batch):
        flat = t.reshape(-1).view(torch.uint8).numpy()
        if flat.size % 8 == 0:
            np.bitwise_xor.reduce(flat.view(np.uint64))
        elif flat.size:
            np.bitwise_xor.reduce(flat)
    return ms_since(t0)


def read_per_page(batch: Any, page: int = 4096) -> int:
    """Read one byte per ``page`` bytes of every distinct storage behind ``batch``
    (an expanded view is its storage); the sum read, so nothing is optimised away."""
    total = 0
    seen: set[int] = set()
    for t in tensors(batch):
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or not storage.nbytes():
            continue
        seen.add(storage.data_ptr())
        flat = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        total += int(np.add.reduce(flat[::page], dtype=np.uint64)) + int(flat[-1])
    return total


def touch_pages(batch: Any) -> float:
    """Milliseconds to touch every 4 KiB page of the memory behind the batch's tensors once."""
    t0 = now_ns()
    read_per_page(batch)
    return ms_since(t0)


def copy_once(sources: list[np.ndarray], dest: np.ndarray) -> float:
    """Milliseconds to copy ``sources`` back to back into ``dest`` with ``np.copyto``."""
    t0 = now_ns()
    offset = 0
    for src in sources:
        np.copyto(dest[offset : offset + src.size], src)
        offset += src.size
    return ms_since(t0)


def _build_ms(batch: Any) -> float | None:
    """How long the loader took to write this batch (the transport workload says)."""
    return batch.get("build_ms") if isinstance(batch, dict) else None


def _sample_points(case: Case) -> set[int]:
    """Measured steps (0-based) after which memory is sampled, spread over the phase."""
    n = min(case.memory_samples, case.steps)
    return {int((k + 1) * case.steps / (n + 1)) for k in range(n)}


# -------------------------------------------------------------------- phases


def phase_a(way: Way, case: Case, rec: Recorder) -> None:
    """Follower time to a usable batch once the leader is ready (see module doc).

    A step is: the leader makes the batch ready while followers wait in a
    barrier, and waits until its DataLoader worker has produced the next one
    (so no loading competes with the measurement: transport only); after
    the barrier followers take it (timed); after a second barrier every rank
    drops its previous batch (``drop_ms``: like ``for batch in loader``, a
    rank still holds its previous batch while asking for the next; for
    shmloader dropping it unmaps it); shmloader's leader then waits for its
    worker's next batch (``refill``: in a lockstep job the pool has two
    slots, so the worker writes it into the slot every rank just dropped,
    not while they still hold it); after a barrier followers read the new
    batch once (``read_ms``); a closing barrier keeps the leader's next
    publish from competing with them for the cores.
    On every other measured step the shmloader leader first measures the
    memcpy floor on the batch (:class:`Floor`).
    """
    floor = Floor() if way.leader and isinstance(way, Shared) else None
    prev: Any = None
    for i in range(case.warmup + case.steps):
        measured = i >= case.warmup
        way.floor = floor if measured and (i - case.warmup) % 2 == 0 else None
        fields = way.prepare()
        way.settle()
        dist.barrier(way.group)
        batch, got = way.take()
        fields.update(got, build_ms=_build_ms(batch))
        dist.barrier(way.group)  # nobody's drop or read competes with another's take
        t0 = now_ns()
        prev = None
        fields["drop_ms"] = ms_since(t0)
        way.refill()
        dist.barrier(way.group)  # the next batch's write does not compete with the read
        if "follower_ms" in fields:  # a fresh batch: the first access pays its page faults
            if i % 2 == 0:
                fields["touch_ms"] = touch_pages(batch)
            else:
                fields["read_ms"] = read_all(batch)
        dist.barrier(way.group)
        if measured:
            rec.add("A", fields)
        prev = batch
        del batch
    way.floor = None
    del prev, floor


def phase_b(way: Way, case: Case, rec: Recorder) -> None:
    """End-to-end delivery with followers already waiting; steps per second.

    Memory is sampled here (every rank holding its current batch), and the
    sampling time is left out of the steps per second.
    """
    samples = _sample_points(case)
    prev: Any = None
    sampling_ns = 0
    t0 = now_ns()
    for i in range(case.steps):
        dist.barrier(way.group)
        batch, fields = way.e2e()
        fields["build_ms"] = _build_ms(batch)
        prev = None
        rec.add("B", fields)
        if i in samples:
            t_sample = now_ns()
            dist.barrier(way.group)
            rec.sample_memory()
            dist.barrier(way.group)
            sampling_ns += now_ns() - t_sample
        prev = batch
        del batch
    del prev
    dist.barrier(way.group)
    rec.extra["phase_b_s"] = (now_ns() - t0 - sampling_ns) / 1e9


def transport(rank: int, case: Case, group: dist.ProcessGroup, rec: Recorder) -> None:
    spec = BatchSpec.for_bytes(case.target_bytes)

    def make() -> Any:
        return transport_loader(spec, case.total_batches, case.workers)

    t0 = now_ns()
    way = WAYS[case.mode](rank, group, make)
    rec.extra["setup_s"] = (now_ns() - t0) / 1e9
    try:
        phase_a(way, case, rec)
        phase_b(way, case, rec)
        way.finish()
        dist.barrier(group)  # close only after every rank finished iterating
    finally:
        t0 = now_ns()
        way.close()
        rec.extra["close_s"] = (now_ns() - t0) / 1e9
        rec.extra["loader_stats"] = getattr(way, "extra_stats", None)
    del way
    gc.collect()
    dist.barrier(group)
    rec.stop_cpu()
    rec.extra["payload_bytes"] = spec.nbytes


def realistic(rank: int, case: Case, group: dist.ProcessGroup, rec: Recorder) -> None:
    spec = BatchSpec.for_bytes(case.target_bytes)

    def make() -> Any:
        return realistic_loader(spec, case.total_batches, case.workers, case.decode_scale)

    t0 = now_ns()
    way = WAYS[case.mode](rank, group, make)
    rec.extra["setup_s"] = (now_ns() - t0) / 1e9
    samples = _sample_points(case)
    try:
        t_loop = now_ns()
        for i in range(case.total_batches):
            if i == case.warmup:
                t_loop = now_ns()
            t0 = now_ns()
            batch = way.step()
            if i >= case.warmup:
                rec.add("R", {"wait_ms": ms_since(t0)})
                if i - case.warmup in samples:
                    dist.barrier(group)
                    rec.sample_memory()
            del batch
            dist.barrier(group)  # the training step: SP peers move in lockstep
        rec.extra["loop_s"] = (now_ns() - t_loop) / 1e9
        way.finish()
        dist.barrier(group)
    finally:
        t0 = now_ns()
        way.close()
        rec.extra["close_s"] = (now_ns() - t0) / 1e9
        rec.extra["loader_stats"] = getattr(way, "extra_stats", None)
    del way
    gc.collect()
    dist.barrier(group)
    rec.stop_cpu()
    rec.extra["payload_bytes"] = spec.nbytes


# --------------------------------------------------------------- entry point


#: What one rank runs once its group is up: ``transport``, ``realistic``,
#: ``breakdown.profile``. Handed to the spawned rank by ``run.launch``.
Body = Callable[[int, Case, dist.ProcessGroup, Recorder], None]


def body_for(run: str) -> Body:
    """The body of a run kind of ``run``: ``transport``, else ``realistic`` (budget too)."""
    return transport if run == "transport" else realistic


def run_rank(rank: int, case: Case, port: int, body: Body) -> dict[str, Any]:
    """Join the group, run ``body`` for ``case``, return this rank's measurements."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=case.sp,
        timeout=datetime.timedelta(seconds=case.timeout_s),
    )
    try:
        group = dist.new_group(list(range(case.sp)))
        dist.barrier(group)
        rec = Recorder(rank)
        body(rank, case, group, rec)
        dist.barrier(group)
        return rec.result()
    finally:
        dist.destroy_process_group()


def rank_main(rank: int, case: dict[str, Any], port: int, outdir: str, body: Body) -> None:
    """Spawn target: run one rank and leave ``<rank>.json`` or ``<rank>.err`` in ``outdir``."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # the parent can then kill this rank and its workers as one group
    os.environ.pop("SHMLOADER_DAEMON", None)  # embedded mode
    if case.get("shm_dir"):  # the huge-page way: its ring (and nothing else) there
        os.environ["SHMLOADER_SHM_DIR"] = case["shm_dir"]
    if mp.get_start_method(allow_none=True) == "forkserver":
        # Forked from ``run``'s warm server (``--quick``, a smoke run): the
        # DataLoader workers' forkserver is forked from this rank too, before
        # gloo starts a thread, instead of a cold interpreter importing torch
        # again (about 1.5 s of every configuration on 2 cores).
        from tests.support.harness import _fork_worker_server

        _fork_worker_server()
    try:
        result = run_rank(rank, Case(**case), port, body)
        tmp = os.path.join(outdir, f"{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(outdir, f"{rank}.json"))
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None

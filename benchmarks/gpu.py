"""``python -m benchmarks.gpu [--out DIR]``: batches to the GPU, four ways, SP ranks on one node.

Needs CUDA (exits with a message otherwise). On a one-GPU machine every SP
rank uses that one GPU, as the issue's measurements did; the report says so.
The workload is ``benchmarks.run``'s (templated long-context batches from a
DataLoader with ``--workers`` workers per loading rank). Ways:

- ``base``: every rank loads its own batch (``pin_memory=False``) and copies
  it with ``.cuda(non_blocking=True)``;
- ``base_pinned``: the same with ``pin_memory=True`` (the DataLoader's pin
  thread copies each batch into pinned memory first);
- ``shm_views``: ``ShmLoader`` host views + ``.cuda(non_blocking=True)``;
- ``shm_device``: ``ShmLoader(device="cuda")``: copies from the registered
  ring on a side stream, ``SHMLOADER_PREFETCH`` ahead.

One step, every rank::

    t0 = now
    batch = next(it)                                   next_ms
    (base ways, shm_views: batch = {k: v.cuda(non_blocking=True)})
    ready = Event(); ready.record(); ready.synchronize()
    usable_ms = now - t0                               time to a GPU-resident batch
    GPU work (torch.cuda._sleep, --gpu-ms, calibrated after warming the GPU's
              clocks) reading nothing; synchronize
    barrier(group)                                      step_ms = now - t0

Per way and size: next/usable/step p50 and p99 (over every rank's steps),
host-to-device bandwidth (device way: the stage's event timings; other ways:
bytes / (usable - next); the stage's counters are reset after the warm-up
steps), a pinned tensor's bandwidth for reference (every rank allocates and
pins its tensor first, then the ranks meet and copy at the same time, as they
copy from the ring; only the copies are timed; the median over ranks), node
CPU seconds (ranks and workers), node memory (PSS), pinned host bytes
allocated by torch (``torch.cuda.host_memory_stats``) and, for the device
way, registrations against ring slots. The batches of the first measured and
the last step are compared, leaf by leaf, with the loader's own
(``bytes_checked``; a difference fails the configuration). Writes
``gpu.json``, ``gpu.md`` and ``gpu.png`` into ``--out``.

The ranks stay in the launcher's process group and die with it
(``PR_SET_PDEATHSIG``), so a time cap that signals the group (timeout(1),
``.ci/device-check``) ends every one of them; a configuration past its
``--timeout`` has its ranks and their workers killed by pid.

Every CUDA call a rank makes goes through :class:`Cuda`. ``--cpu-smoke``
swaps in :class:`HostStandIn` (host copies, a sleep for the GPU work,
:class:`HostOps` as the device of ``ShmLoader``) so that every code path of
this benchmark runs without a GPU: ``tests/device/test_device.py`` runs it, so the
benchmark cannot rot before it first meets a GPU. Its figures say nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

from . import provenance

MiB = 1 << 20
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WAYS = ("base", "base_pinned", "shm_views", "shm_device")
LABELS = {
    "base": "base, pin_memory=False",
    "base_pinned": "base, pin_memory=True",
    "shm_views": "shmloader views + .cuda()",
    "shm_device": 'shmloader device="cuda"',
}


# ------------------------------------------------------------------- a rank


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _reset_device_stats(loader: Any) -> None:
    """Zero a ``ShmLoader``'s device counters (after the warm-up steps)."""
    stage = getattr(loader, "_stage", None)
    if stage is not None and hasattr(stage, "reset_stats"):
        stage.reset_stats()


def _nbytes(batch: Any) -> int:
    from .workload import tensors

    return sum(t.numel() * t.element_size() for t in tensors(batch))


def _map(batch: Any, fn: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map(v, fn) for k, v in batch.items()}
    if isinstance(batch, list):
        return [_map(v, fn) for v in batch]
    return batch


class Cuda:
    """Every CUDA call a rank makes, in one place (``HostStandIn`` replaces it on a CPU)."""

    name = "cuda"

    def set_device(self, rank: int, gpu: int) -> None:
        import torch

        count = torch.cuda.device_count()
        torch.cuda.set_device(gpu % count if gpu >= 0 else rank % count)

    def device(self) -> Any:
        """What ``ShmLoader(device=...)`` gets in the device way."""
        return "cuda"

    def to_device(self, batch: Any) -> Any:
        return _map(batch, lambda t: t.cuda(non_blocking=True))

    def ready(self) -> None:
        """Block until the work queued so far (the copies) has run: the batch is usable."""
        import torch

        event = torch.cuda.Event()
        event.record()
        event.synchronize()

    def sleep_cycles_per_ms(self) -> float:
        """Clock cycles of ``torch.cuda._sleep`` per ms, at working clocks.

        An idle GPU runs at low clocks for the first few hundred ms of work:
        calibrated there, the "30 ms" of work per step would be much less once
        the clocks rise. So the GPU is kept busy for about half a second
        first, and the median of three timings is taken.
        """
        import torch

        cycles = 10_000_000
        warm_until = time.perf_counter() + 0.5
        while time.perf_counter() < warm_until:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()
        rates = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            rates.append(cycles / max(a.elapsed_time(b), 1e-3))
        return statistics.median(rates)

    def work(self, cycles: int) -> None:
        """GPU work reading nothing, waited for."""
        import torch

        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    def host_pinned(self) -> int | None:
        """Peak pinned host bytes torch allocated in this process, or None when unknown."""
        import torch

        try:
            stats = torch.cuda.host_memory_stats()
        except (AttributeError, RuntimeError):
            return None
        for key in ("allocated_bytes.peak", "allocated_bytes.all.peak", "reserved_bytes.peak"):
            if key in stats:
                return int(stats[key])
        return None

    def pinned_ref(self, nbytes: int) -> Any:
        """A pinned tensor of ``nbytes`` and its device destination, allocated and pinned
        (about 220 ms per 256 MiB) before the ranks meet to time the copies."""
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True)  # first-touch costs out of the timed copies
        torch.cuda.synchronize()
        return src, dst

    def pinned_gbs(self, ref: Any) -> float:
        """Host-to-device bandwidth of ``pinned_ref``'s copy, the copies alone timed."""
        import torch

        src, dst = ref
        nbytes = src.numel()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return nbytes / statistics.median(times) / 1e6

    def memory_allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated()


class HostStandIn(Cuda):
    """``--cpu-smoke``: every CUDA call replaced by its host analogue, so that the code
    paths of this benchmark run (and stay runnable) where there is no GPU. The
    device way delivers through ``HostOps`` (``shmloader.device.stage.DeviceOps`` on the
    host). The figures mean nothing about GPUs; ``main`` says so in the results.
    """

    name = "host stand-in"

    def set_device(self, rank: int, gpu: int) -> None:
        pass

    def device(self) -> Any:
        return HostOps()

    def to_device(self, batch: Any) -> Any:
        return _map(batch, lambda t: t.clone())

    def ready(self) -> None:
        pass

    def sleep_cycles_per_ms(self) -> float:
        return 1e6

    def work(self, cycles: int) -> None:
        time.sleep(cycles / 1e6 / 1e3)

    def host_pinned(self) -> int | None:
        return 0  # nothing is pinned without CUDA

    def pinned_ref(self, nbytes: int) -> Any:
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8)
        return src, torch.empty_like(src)

    def pinned_gbs(self, ref: Any) -> float:
        src, dst = ref
        t0 = time.perf_counter()
        dst.copy_(src)
        return src.numel() / max(time.perf_counter() - t0, 1e-9) / 1e9

    def memory_allocated(self) -> int:
        return 0


class HostOps:
    """A ``shmloader.device.stage.DeviceOps`` on the host: copies run at once, events are done.

    The "device" is called ``cuda:0`` so that stats read as on a GPU rank; its
    memory is host memory. Copy time is the host copy's.
    """

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cuda", 0)
        self._done: dict[int, float] = {}

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def on_thread(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def empty(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def unpin(self, buffer: Any) -> None:
        pass

    def is_pinned(self, tensor: Any) -> bool:
        return False

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def record(self) -> float:
        return time.perf_counter()

    def query(self, event: float) -> bool:
        return True

    def wait(self, event: float) -> None:
        pass

    def synchronize(self, event: float) -> None:
        pass

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def hand_over(self, tensor: Any) -> None:
        pass

    def registration(self) -> str | None:
        return None

    def register(self, address: int, nbytes: int) -> str | None:
        return None

    def unregister(self, address: int) -> str | None:
        return None


def run_rank(rank: int, cfg: dict[str, Any], port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shmloader import Config, ShmLoader

    from . import procstat
    from .workload import BatchSpec, TemplatedBatches, build

    torch.set_num_threads(1)
    gpu = HostStandIn() if cfg.get("cpu_smoke") else Cuda()
    gpu.set_device(rank, cfg["gpu"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=cfg["sp"],
        timeout=datetime.timedelta(seconds=cfg["timeout"]),
    )
    way, sp = cfg["way"], cfg["sp"]
    spec = BatchSpec.for_bytes(cfg["mib"] * MiB)
    length = cfg["warmup"] + cfg["steps"]
    pin = way == "base_pinned" and not cfg.get("cpu_smoke")  # nothing to pin for without CUDA

    def make() -> DataLoader:
        return DataLoader(
            TemplatedBatches(spec, length),
            batch_size=None,
            shuffle=False,
            num_workers=cfg["workers"],
            collate_fn=build,
            prefetch_factor=1 if cfg["workers"] else None,
            pin_memory=pin,
        )

    try:
        group = dist.new_group(list(range(sp)))
        cycles = gpu.sleep_cycles_per_ms() * cfg["gpu_ms"]
        dist.barrier(group)
        cpu0 = procstat.tree_cpu_seconds(os.getpid())
        loader: Any
        if way.startswith("base"):
            loader = make()
        else:
            config = Config.from_env(enabled=True)
            device = gpu.device() if way == "shm_device" else "cpu"
            loader = ShmLoader(make, group, config=config, device=device)
        it = iter(loader)
        rows: dict[str, list[float]] = {"next_ms": [], "usable_ms": [], "step_ms": [], "h2d": []}
        kept: dict[int, Any] = {}  # step -> the batch as delivered, for _check_bytes
        mem_peak = 0
        for step in range(length):
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            if way != "shm_device":
                batch = gpu.to_device(batch)
            gpu.ready()
            t2 = time.perf_counter()
            gpu.work(int(cycles))
            if step in (cfg["warmup"], length - 1):
                kept[step] = batch  # on the device: holds no slot; checked after the loop
            del batch
            dist.barrier(group)
            t3 = time.perf_counter()
            if step + 1 == cfg["warmup"]:
                _reset_device_stats(loader)  # stats from the measured steps only
            if step >= cfg["warmup"]:
                rows["next_ms"].append((t1 - t0) * 1e3)
                rows["usable_ms"].append((t2 - t0) * 1e3)
                rows["step_ms"].append((t3 - t0) * 1e3)
                if way != "shm_device" and t2 > t1:
                    rows["h2d"].append(spec.nbytes / (t2 - t1) / 1e9)
                if step in (cfg["warmup"], length - 1):
                    mem_peak = max(mem_peak, procstat.tree_memory(os.getpid()).pss)
        next(it, None)
        cpu = procstat.tree_cpu_seconds(os.getpid()) - cpu0
        checked = _check_bytes(kept, TemplatedBatches(spec, length))
        kept.clear()
        pinned_host = gpu.host_pinned()  # before the reference below pins its own tensor
        # The reference under the ring's contention: every rank copies its own
        # pinned tensor at the same time, as every rank copies from the ring;
        # allocated and pinned before the barrier, so that the copies overlap.
        ref = gpu.pinned_ref(spec.nbytes)
        dist.barrier(group)
        pinned_ref = gpu.pinned_gbs(ref)
        del ref
        out: dict[str, Any] = {
            "rank": rank,
            **rows,
            "cpu_s": cpu,
            "pss": mem_peak,
            "pinned_host_bytes": pinned_host,
            "pinned_ref_gbs": pinned_ref,
            "payload_bytes": spec.nbytes,
            "bytes_checked": checked,
            "device_mem_allocated": gpu.memory_allocated(),
        }
        if isinstance(loader, ShmLoader):
            stats = loader.stats()
            out["stats"] = {k: v for k, v in stats.items() if not isinstance(v, dict)}
            loader.close()
        dist.barrier(group)
        return out
    finally:
        dist.destroy_process_group()


def _check_bytes(kept: dict[int, Any], source: Any) -> int:
    """Compare the batches a rank kept with the loader's own; the leaves checked.

    Raises when a byte differs: the benchmark's figures are about batches that
    arrived intact (every way, the device way included).
    """
    import torch

    checked = 0
    for step, got in kept.items():
        want = _by_path(source.batch(step))
        have = _by_path(got)
        if set(have) != set(want):
            raise AssertionError(f"step {step}: leaves {sorted(have)} instead of {sorted(want)}")
        for path, w in want.items():
            if not torch.equal(have[path].cpu(), w):
                raise AssertionError(f"step {step}: {path} ({tuple(w.shape)}) arrived changed")
            checked += 1
    return checked


def _by_path(batch: Any, path: str = "") -> dict[str, Any]:
    """The tensor leaves of ``batch`` by where they are (aliases counted at each place)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return {path: batch}
    out: dict[str, Any] = {}
    if isinstance(batch, dict):
        for k, v in batch.items():
            out.update(_by_path(v, f"{path}/{k}"))
    elif isinstance(batch, list | tuple):
        for k, v in enumerate(batch):
            out.update(_by_path(v, f"{path}/{k}"))
    return out


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: this rank gets SIGKILL when the launching process dies."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_main(rank: int, cfg: dict[str, Any], port: int, outdir: str) -> None:
    # Stays in the launcher's process group (no setpgid): a time cap that
    # signals the group (timeout(1), .ci/device-check) reaches every rank.
    _die_with_parent()
    os.environ.pop("SHMLOADER_DAEMON", None)
    try:
        result = run_rank(rank, cfg, port)
        with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None


# ------------------------------------------------------------------ parent


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (its DataLoader workers), by pid."""
    from .procstat import descendants

    for victim in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, 9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: dict[str, Any]) -> tuple[list[dict] | None, str]:
    """Run one configuration in fresh ranks; (per-rank results, or None and why).

    Ranks are cold interpreters (spawn: a CUDA process is never forked), but
    with ``--warm-ranks`` (``--cpu-smoke`` only: its ranks touch no CUDA) they
    fork from a server that imported torch once (``run.WARM``), not 2-3 s of
    imports a rank on 2 cores.
    """
    if cfg.get("warm_ranks"):
        from .run import WARM

        mp.set_forkserver_preload(WARM)
        ctx = mp.get_context("forkserver")
    else:
        ctx = mp.get_context("spawn")
    outdir = tempfile.mkdtemp(prefix="shml-gpu-")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, port, outdir)) for r in range(cfg["sp"])]
    for p in procs:
        p.start()
    deadline = time.monotonic() + cfg["timeout"]
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    why = ""
    for p in procs:
        if p.is_alive():
            why = why or f"timed out after {cfg['timeout']:.0f} s"
            _kill_tree(p.pid)
            p.join(5)
    results = []
    for r in range(cfg["sp"]):
        path = os.path.join(outdir, f"{r}.json")
        err = os.path.join(outdir, f"{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        elif os.path.exists(err):
            with open(err) as f:
                why = why or f"rank {r} failed:\n{f.read()}"
    shutil.rmtree(outdir, ignore_errors=True)
    return (results if len(results) == cfg["sp"] and not why else None), why


def aggregate(cfg: dict[str, Any], ranks: list[dict]) -> dict[str, Any]:
    every = {k: [v for r in ranks for v in r[k]] for k in ("next_ms", "usable_ms", "step_ms")}
    per_rank_usable = [_pct(r["usable_ms"], 0.5) for r in ranks]
    row: dict[str, Any] = {
        "way": cfg["way"],
        "mib": cfg["mib"],
        "sp": cfg["sp"],
        "payload_mib": ranks[0]["payload_bytes"] / MiB,
        "next_p50": _pct(every["next_ms"], 0.5),
        "usable_p50": _pct(every["usable_ms"], 0.5),
        "usable_p99": _pct(every["usable_ms"], 0.99),
        "usable_p50_worst_rank": max(v for v in per_rank_usable if v is not None),
        "step_p50": _pct(every["step_ms"], 0.5),
        "step_p99": _pct(every["step_ms"], 0.99),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "node_pss_mib": sum(r["pss"] for r in ranks) / MiB,
        "pinned_host_mib": (
            sum(r["pinned_host_bytes"] for r in ranks) / MiB
            if all(r["pinned_host_bytes"] is not None for r in ranks)
            else None
        ),
        # median over ranks that copied at the same time (NOTE in run_rank)
        "pinned_ref_gbs": _median([r["pinned_ref_gbs"] for r in ranks]),
        # leaves compared with the loader's own batch, every rank (_check_bytes)
        "bytes_checked": sum(r.get("bytes_checked", 0) for r in ranks),
    }
    if cfg["way"] == "shm_device":
        stats = [r.get("stats", {}) for r in ranks]
        bws = [s.get("device_bandwidth_gbs") for s in stats if s.get("device_bandwidth_gbs")]
        row["h2d_gbs"] = statistics.median(bws) if bws else None
        row["registered"] = all(s.get("device_registered") for s in stats)
        row["registrations"] = sum(s.get("device_registrations", 0) for s in stats)
        row["ring_slots"] = stats[0].get("ring_slots")
    else:
        h2d = [v for r in ranks for v in r["h2d"]]
        row["h2d_gbs"] = statistics.median(h2d) if h2d else None
    return row


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets at the largest size measured."""
    if not rows:
        return []
    mib = max(r["mib"] for r in rows)
    at = {r["way"]: r for r in rows if r["mib"] == mib}
    dev = at.get("shm_device")
    out = []

    def add(name: str, value: Any, ok: bool | None) -> None:
        out.append({"target": name, "value": value, "met": ok})

    if dev is None:
        return [{"target": "device way", "value": "not measured", "met": None}]
    usable = dev["usable_p50_worst_rank"]
    add(f"time to a GPU-resident {mib} MiB batch, p50, worst rank <= 1 ms", usable, usable <= 1.0)
    bases = [at[w]["step_p50"] for w in ("base", "base_pinned") if w in at]
    best = min(bases) if bases else None
    add(
        "step p50 no slower than the best base way",
        f"{dev['step_p50']:.1f} vs {best:.1f} ms" if best else "no base way",
        dev["step_p50"] <= best if best else None,
    )
    ref, bw = dev.get("pinned_ref_gbs"), dev.get("h2d_gbs")
    add(
        "ring-to-device bandwidth >= 90% of a pinned tensor's",
        f"{bw:.1f} / {ref:.1f} GB/s" if bw and ref else "not measured",
        (bw >= 0.9 * ref) if bw and ref else None,
    )
    pinned = dev.get("pinned_host_mib")
    regs, slots = dev.get("registrations"), dev.get("ring_slots")
    per_batch = regs is not None and slots is not None and regs <= slots * dev["sp"]
    # Pinned host memory is only the stage's staging buffers for small leaves
    # (NOTE [no pageable copies] in shmloader.device.registrar): far below one batch per rank.
    small = None if pinned is None else pinned <= 0.1 * dev["payload_mib"] * dev["sp"]
    add(
        "no pin_memory() copies of batches (pinned: small-leaf staging only) and zero "
        "per-batch registrations",
        f"pinned {pinned} MiB, {regs} registrations for {slots} slots x {dev['sp']} ranks",
        None if small is None else small and per_batch,
    )
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    sharing = "all ranks share one GPU" if m["gpus"] == 1 else "rank r uses GPU r % GPUs"
    lines = [
        "# GPU delivery",
        "",
        *([*provenance.header(result["provenance"]), ""] if "provenance" in result else []),
        f"{m['gpu']} x{m['gpus']}, {m['cpus']} CPUs, torch {m['torch']}; SP{result['sp']} on "
        f"one node; {sharing}; {result['workers']} workers per loading rank; "
        f"{result['gpu_ms']} ms of GPU work per step.",
        "",
        "| way | MiB | next p50 | usable p50 / p99 | worst rank usable p50 | step p50 / p99 "
        "| H2D GB/s | node CPU s | node PSS MiB | pinned MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(x: Any, d: int = 1) -> str:
        return "-" if x is None else f"{x:.{d}f}" if isinstance(x, float) else str(x)

    for r in result["rows"]:
        lines.append(
            f"| {LABELS[r['way']]} | {r['mib']} | {f(r['next_p50'], 2)} | "
            f"{f(r['usable_p50'], 2)} / {f(r['usable_p99'], 2)} | "
            f"{f(r['usable_p50_worst_rank'], 2)} | {f(r['step_p50'])} / {f(r['step_p99'])} | "
            f"{f(r['h2d_gbs'])} | {f(r['cpu_s'])} | {f(r['node_pss_mib'], 0)} | "
            f"{f(r['pinned_host_mib'], 0)} |"
        )
    lines += ["", "| target | value | met |", "| --- | --- | --- |"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['target']} | {f(t['value'], 2)} | {met} |")
    for s in result.get("skipped", []):
        lines.append(f"\nSkipped: {s}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in (
        (axes[0], "usable_p50", "time to a GPU-resident batch, p50 (ms)"),
        (axes[1], "step_p50", "whole step, p50 (ms)"),
    ):
        for way in WAYS:
            pts = sorted((r["mib"], r[key]) for r in rows if r["way"] == way and r[key])
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=LABELS[way])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch MiB")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 256], help="batch sizes in MiB")
    p.add_argument("--sp", type=int, default=4, help="SP ranks on this node (default 4)")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="ways to run")
    p.add_argument("--steps", type=int, default=30, help="measured steps per way and size")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps (ring, registration)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per loading rank")
    p.add_argument("--gpu-ms", type=float, default=30.0, help="GPU work per step, ms")
    p.add_argument(
        "--gpu", type=int, default=-1, help="one GPU index for every rank (default: rank %% GPUs)"
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU: run every code path with a host stand-in for CUDA (figures meaningless; "
        "written to --out, default a new temporary directory); what the test suite runs",
    )
    p.add_argument(
        "--warm-ranks",
        action="store_true",
        help="with --cpu-smoke: fork the ranks from a server that imported torch once instead "
        "of spawning cold interpreters (faster; not how a GPU run starts its ranks)",
    )
    args = p.parse_args(argv)
    if args.warm_ranks and not args.cpu_smoke:
        p.error("--warm-ranks needs --cpu-smoke (a CUDA process is never forked)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            "benchmarks.gpu needs a CUDA GPU: torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run it on a GPU node; the CPU logic of device "
            "delivery is covered by tests/device/test_device.py (--cpu-smoke runs this benchmark's "
            "code paths with a host stand-in for CUDA, figures meaningless).",
            file=sys.stderr,
        )
        return 2
    from . import procstat

    record = provenance.start("benchmarks.gpu", argv)
    if args.cpu_smoke:
        if args.out == DEFAULT_OUT:  # never overwrite real results with stand-in figures
            args.out = tempfile.mkdtemp(prefix="shml-gpu-smoke-")
        gpu_name, gpus = f"no GPU: {HostStandIn.name} (--cpu-smoke, figures meaningless)", 1
    else:
        gpu_name, gpus = torch.cuda.get_device_name(0), torch.cuda.device_count()
    machine = {
        "gpu": gpu_name,
        "gpus": gpus,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "host": procstat.machine(),
    }
    rows: list[dict] = []
    skipped: list[str] = []
    t_all = time.monotonic()
    os.makedirs(args.out, exist_ok=True)

    def result() -> dict[str, Any]:
        return {
            "machine": machine,
            "sp": args.sp,
            "workers": args.workers,
            "gpu_ms": args.gpu_ms,
            "rows": rows,
            "targets": targets(rows),
            "skipped": skipped,
            "seconds": time.monotonic() - t_all,
            "provenance": provenance.finish(dict(record)),  # as of this write
        }

    def write() -> None:
        """The results so far: a run cut short by a time cap keeps what it measured."""
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(result(), f, indent=1)
        with open(os.path.join(args.out, "gpu.md"), "w") as f:
            f.write(markdown(result()))

    for mib in args.sizes:
        for way in args.ways:
            cfg = {
                "way": way,
                "mib": mib,
                "sp": args.sp,
                "steps": args.steps,
                "warmup": args.warmup,
                "workers": args.workers,
                "gpu_ms": args.gpu_ms,
                "gpu": args.gpu,
                "timeout": args.timeout,
                "cpu_smoke": args.cpu_smoke,
                "warm_ranks": args.warm_ranks,
            }
            t0 = time.monotonic()
            ranks, why = launch(cfg)
            if ranks is None:
                skipped.append(f"{way} {mib} MiB: {why}")
                print(f"[gpu] {way} {mib} MiB: FAILED {why}", file=sys.stderr)
                write()
                continue
            row = aggregate(cfg, ranks)
            rows.append(row)
            write()
            print(
                f"[gpu] {way:>11} {mib:>4} MiB: usable p50 {row['usable_p50']:.2f} ms, "
                f"step p50 {row['step_p50']:.1f} ms ({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
            )
    write()
    if rows:
        plot(rows, os.path.join(args.out, "gpu.png"))
    print(markdown(result()))
    print(f"[gpu] results in {args.out}", file=sys.stderr)
    return 0 if rows and not skipped else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m benchmarks.step [--quick] [--out DIR]``: how long a training step waits for data.

Not a benchmark of the transport (``benchmarks.run`` is) but of the step a
user runs. Every rank of one SP group runs simulated training steps::

    batch = next(it)          # next_ms: what a step waits for its batch
    (previous batch dropped)  # drop_ms: as ``for batch in loader`` drops it
    read one value per page   # read_ms: the step consumes the batch
    compute for C ms          # time.sleep (default) or a busy wait
    all_reduce(one value)     # allreduce_ms: the step's sync with its peers

for five ways, back to back in one run, on freshly started ranks each
(``tests.support.harness.run_ranks``, gloo on loopback): ``base`` (every rank runs
its own DataLoader), ``broadcast`` (the leader loads; the batch skeleton by
``broadcast_object_list``, every tensor by ``dist.broadcast``, as the
XTuner seed does: ``transports.send_broadcast``), ``shmloader-in-step``
(``ShmLoader`` with ``SHMLOADER_AHEAD=0``: every rank's per-batch work
inside its own ``next()``, as before NOTE [running ahead]), ``shmloader``
(``ShmLoader``, embedded mode, DataLoader workers writing the ring, every
loop ahead) and
``shmloader-huge`` (the same, its ring in a ``huge=within_size`` tmpfs in a
private mount namespace: ``benchmarks.hugedir``; root only, skipped with
the reason otherwise). Topologies: one node at SP2/4/8, and SP2/SP4 over two
simulated nodes (each node but the first with a private ``/dev/shm`` in its
own mount namespace, as the tests do; root only). Sizes 16, 64, 256 MiB
(``workload.BatchSpec``, the transport workload of ``benchmarks.run``).

C, the compute time of a step, is calibrated first in the same run, per
topology and size, on fresh ranks of that topology: the leader makes a batch
(production, ``TemplatedBatches.batch``) and sends it the broadcast way
(transfer: the most any way moves per batch, every byte to every other
rank); C = ``--compute-factor`` (2) x (production p50 + slowest rank's
transfer p50), at least ``--min-compute-ms``, rounded up to 10 ms. So every
way has at least twice the time it needs to have the next batch ready.
``--compute-ms`` fixes C instead.

The compute is a sleep by default: a GPU step leaves the CPU free for the
DataLoader workers and any thread that publishes or receives ahead, which is
the case this benchmark is about. ``--compute busy`` spins instead (a CPU
bound step: on a 2-core machine with SP4 or more ranks it starves the
loaders and measures contention, not the data path).

Reported per way and rank: ``next()`` p50/p90 and the step's time above C
(wall time of the whole step minus C: ``next``, drop, read, the sleep's
overshoot and the all_reduce, which also waits for the slowest peer), plus
its targets where measured. Writes ``step.json`` (every number
and every rank's per-step records), ``step.md`` and ``step.png`` to
``--out`` (default a new temporary directory: a run never overwrites
committed results), printed when it starts and again with every file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import hugedir, procstat, provenance, report, transports
from .rank import WAYS as RANK_WAYS
from .rank import Broadcast, Case
from .rank import read_per_page as rank_read_per_page
from .workload import BatchSpec, TemplatedBatches, transport_loader

MiB = 1 << 20
#: Topology name -> (SP size, node of each rank or None for one node).
TOPOLOGIES: dict[str, tuple[int, list[int] | None]] = {
    "1node-sp2": (2, None),
    "1node-sp4": (4, None),
    "1node-sp8": (8, None),
    "2nodes-sp2": (2, [0, 1]),
    "2nodes-sp4": (4, [0, 0, 1, 1]),
}
MODES = ("base", "broadcast", "shmloader-in-step", "shmloader", "shmloader-huge")
LABELS = {
    "base": "base (every rank loads)",
    "broadcast": "broadcast (leader loads, dist.broadcast)",
    "shmloader-in-step": "shmloader, in step (SHMLOADER_AHEAD=0)",
    "shmloader": "shmloader (ahead)",
    "shmloader-huge": "shmloader (ahead), huge-page ring",
}
STYLE = {
    **report.STYLE,
    "shmloader-huge": ("tab:purple", "P", "-"),
    "shmloader-in-step": ("tab:gray", "x", ":"),
}
TARGET_NEXT_MS = 1.0  # shmloader's next() p50 on every rank
TARGET_TWO_NODES = 1.1  # SP group over two nodes vs the same group on one node


# ------------------------------------------------------------------ in a rank


def now_ns() -> int:
    return time.monotonic_ns()


def read_per_page(batch: Any, page: int) -> int:
    """Read one byte per ``page`` bytes of every distinct storage behind ``batch``.

    The step consuming its batch: the first read of each page of a fresh
    mapping pays its page fault (at 64 KiB, the kernel's default fault-around
    window, one read fault maps the whole window of a shared-memory file, as
    a full read would). Returns the sum read (so nothing is optimised away).
    """
    return rank_read_per_page(batch, page)


def compute(ms: float, kind: str) -> None:
    """The step's compute: ``sleep`` (a GPU step, CPU free) or ``busy`` (spin)."""
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    deadline = now_ns() + int(ms * 1e6)
    while now_ns() < deadline:
        pass


def _take(way: Any) -> Any:
    """One ``next()`` of the way: the leader's load-and-send for broadcast, else its iterator."""
    if isinstance(way, Broadcast):
        return way.e2e()[0]
    return next(way.it)


def step_rank(
    rank: int,
    world: int,
    *,
    mode: str,
    mib: float,
    warmup: int,
    steps: int,
    workers: int,
    compute_ms: float,
    compute_kind: str,
    page: int,
) -> dict[str, Any]:
    """One rank of one way: ``warmup + steps`` training steps; its per-step records."""
    torch.set_num_threads(1)
    bind_own_ring()  # NOTE [one huge ring per node]
    group = dist.group.WORLD
    spec = BatchSpec.for_bytes(int(mib * MiB))
    total = warmup + steps

    def make() -> Any:
        return transport_loader(spec, total, workers)

    t0 = now_ns()
    way = RANK_WAYS[mode](rank, group, make)
    setup_s = (now_ns() - t0) / 1e9
    token = torch.ones(1)
    records: list[dict[str, float]] = []
    prev: Any = None
    try:
        dist.barrier(group)
        for i in range(total):
            t0 = now_ns()
            batch = _take(way)
            t1 = now_ns()
            prev = None  # ``for batch in loader`` drops the previous batch here
            t2 = now_ns()
            read_per_page(batch, page)
            t3 = now_ns()
            compute(compute_ms, compute_kind)
            t4 = now_ns()
            dist.all_reduce(token, group=group)
            t5 = now_ns()
            prev = batch
            del batch
            if i >= warmup:
                records.append(
                    {
                        "next_ms": (t1 - t0) / 1e6,
                        "drop_ms": (t2 - t1) / 1e6,
                        "read_ms": (t3 - t2) / 1e6,
                        # the batch in hand and read: next() and the first touch of each page
                        "next_read_ms": (t1 - t0 + t3 - t2) / 1e6,
                        "compute_ms": (t4 - t3) / 1e6,
                        "allreduce_ms": (t5 - t4) / 1e6,
                        "step_ms": (t5 - t0) / 1e6,
                        "above_ms": (t5 - t0) / 1e6 - compute_ms,
                    }
                )
        del prev
        way.finish()
        dist.barrier(group)  # close only once every rank finished iterating
    finally:
        way.close()
    return {
        "rank": rank,
        "pid": os.getpid(),
        "ring": ring_facts() if mode.startswith("shmloader") else None,
        "setup_s": setup_s,
        "records": records,
        "loader_stats": getattr(way, "extra_stats", None),
        "payload_bytes": spec.nbytes,
    }


def ring_facts() -> dict[str, Any]:
    """Where this rank's ring was: its directory as this rank sees it (the inode tells
    one node's from another's, NOTE [one huge ring per node]) and its page size."""
    from shmloader._node import ringdir

    path = ringdir.from_env()
    st = os.stat(path)
    facts = ringdir.describe(path)
    return {"dir": path, "dev": st.st_dev, "ino": st.st_ino, "huge": facts.huge, "why": facts.why}


def calibrate_rank(rank: int, world: int, *, mib: float, reps: int) -> dict[str, Any]:
    """Production and transfer of one batch on this topology: the leader makes a batch
    (``TemplatedBatches.batch``) and sends it the broadcast way; ``reps`` times after
    one warm-up. Returns this rank's times (ms)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    spec = BatchSpec.for_bytes(int(mib * MiB))
    data = TemplatedBatches(spec, reps + 1) if rank == 0 else None
    produce, transfer = [], []
    for i in range(reps + 1):
        dist.barrier(group)
        if data is not None:
            t0 = now_ns()
            batch = data.batch(i)
            made = (now_ns() - t0) / 1e6
        dist.barrier(group)
        t0 = now_ns()
        if data is not None:
            transports.send_broadcast(batch, group, 0)
        else:
            batch = transports.receive_broadcast(group, 0)[0]
        sent = (now_ns() - t0) / 1e6
        del batch
        if i:
            transfer.append(sent)
            if data is not None:
                produce.append(made)
    return {"rank": rank, "produce_ms": produce, "transfer_ms": transfer}


# ------------------------------------------------------------------ the run


@dataclass
class Config:
    """One topology at one batch size: its C and what each way measured."""

    topology: str
    mib: float
    compute_ms: float = 0.0
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def sp(self) -> int:
        return TOPOLOGIES[self.topology][0]

    @property
    def nodes(self) -> list[int] | None:
        return TOPOLOGIES[self.topology][1]


def role(topology: str, rank: int) -> str:
    """``leader`` (rank 0), ``node leader`` (first rank of another node) or ``follower``."""
    nodes = TOPOLOGIES[topology][1] or [0] * TOPOLOGIES[topology][0]
    if rank == 0:
        return "leader"
    return "node leader" if nodes.index(nodes[rank]) == rank else "follower"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def rank_row(cfg: Config, mode: str, result: dict[str, Any]) -> dict[str, Any]:
    """The summary of one rank of one way: percentiles over its measured steps."""
    recs = result["records"]
    row: dict[str, Any] = {
        "topology": cfg.topology,
        "sp": cfg.sp,
        "mib": cfg.mib,
        "payload_mib": result["payload_bytes"] / MiB,
        "compute_ms": cfg.compute_ms,
        "mode": mode,
        "rank": result["rank"],
        "node": (cfg.nodes or [0] * cfg.sp)[result["rank"]],
        "role": role(cfg.topology, result["rank"]),
        "steps": len(recs),
    }
    keys = ("next_ms", "above_ms", "read_ms", "next_read_ms", "drop_ms", "allreduce_ms", "step_ms")
    for key in keys:
        values = [r.get(key, r["next_ms"] + r["read_ms"]) for r in recs]
        row[key.replace("_ms", "_ms_p50")] = _pct(values, 50)
        row[key.replace("_ms", "_ms_p90")] = _pct(values, 90)
    row["compute_over_ms_p50"] = _pct([r["compute_ms"] - cfg.compute_ms for r in recs], 50)
    return row


def compute_for(calibration: list[dict[str, Any]], args: argparse.Namespace) -> tuple[float, dict]:
    """C from a calibration (module doc): factor x (production + slowest transfer)."""
    produce = float(np.median(calibration[0]["produce_ms"]))
    transfer = max(float(np.median(r["transfer_ms"])) for r in calibration)
    need = args.compute_factor * (produce + transfer)
    c = max(args.min_compute_ms, math.ceil(need / 10) * 10)
    return float(c), {"produce_ms_p50": produce, "transfer_ms_p50_slowest": transfer}


def launch(cfg: Config, fn: str, kwargs: dict, args: argparse.Namespace, rank_env: dict) -> Any:
    """Run this module's function ``fn`` on fresh ranks of ``cfg``'s topology
    (``tests.support.harness.run_ranks``). By name: under ``python -m`` this module is
    ``__main__``, which a rank cannot import."""
    from tests.support.harness import run_ranks

    return run_ranks(
        f"benchmarks.step:{fn}",
        cfg.sp,
        kwargs=kwargs,
        nodes=cfg.nodes,
        rank_env=rank_env,
        timeout=args.timeout,
        node_shm_size=f"{max(2048, int(24 * cfg.mib))}m",
        gc_after=True,
    )


def skip_reason(cfg: Config, mode: str, args: argparse.Namespace, huge: dict) -> str | None:
    """Why this way cannot run here now, or None (root, the huge mount, memory)."""
    if cfg.nodes is not None and os.geteuid() != 0:
        return "needs root (each simulated node mounts a tmpfs in a private mount namespace)"
    if mode == "shmloader-huge" and huge.get("dir") is None:
        return huge.get("why", "no huge-page ring")
    from .run import skip_reason as memory

    return memory(Case("transport", mode, cfg.sp, int(cfg.mib * MiB), 0, 1, args.workers))


def mode_env(cfg: Config, mode: str, huge: dict) -> dict[int, dict[str, str]]:
    """Each rank's environment for ``mode``: the huge-page ring's, or every loop in step."""
    if mode == "shmloader-in-step":  # NOTE [running ahead] switched off
        return {rank: {"SHMLOADER_AHEAD": "0"} for rank in range(cfg.sp)}
    return huge_env(cfg, mode, huge)


def huge_env(cfg: Config, mode: str, huge: dict) -> dict[int, dict[str, str]]:
    """Each rank's environment for the huge-page way (NOTE [one huge ring per node])."""
    if mode != "shmloader-huge":
        return {}
    nodes = cfg.nodes or [0] * cfg.sp
    ring = os.path.join(huge["dir"], "node0")
    out = {}
    for rank, node in enumerate(nodes):
        own = os.path.join(huge["dir"], f"node{node}")
        for d in (ring, own):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o1777)
        out[rank] = {"SHMLOADER_SHM_DIR": ring}
        if node:
            out[rank][BIND_ENV] = f"{own}:{ring}"
    return out


#: ``SRC:DST``: a rank of a simulated node other than the first binds SRC over DST.
BIND_ENV = "SHMLOADER_BENCH_BIND_RING"


def bind_own_ring() -> None:
    """NOTE [one huge ring per node]

    Every rank of a group must name the same ``shm_dir`` (shmloader checks
    it), but two simulated nodes must not share a ring directory. The
    huge-page tmpfs (``hugedir.mount``, in the parent's private mount
    namespace) holds one directory per node; every rank names ``node0``'s,
    and each rank of another node, already in its node's private mount
    namespace (``tests.support.harness``: a rank of node k > 0 always has one),
    bind-mounts its own node's directory over that path first. So every
    node sees its own huge-page ring at the same path, and nothing of
    another's, as on two hosts.
    """
    spec = os.environ.get(BIND_ENV)
    if not spec:
        return
    src, dst = spec.split(":")
    if os.readlink("/proc/self/ns/mnt") == os.readlink(f"/proc/{os.getppid()}/ns/mnt"):
        raise RuntimeError(f"{BIND_ENV}={spec}: this rank shares its parent's mount namespace")
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(src.encode(), dst.encode(), None, 4096, None) != 0:  # MS_BIND
        raise OSError(ctypes.get_errno(), f"bind {src} over {dst}")


def plan(args: argparse.Namespace) -> list[Config]:
    return [Config(t, float(m)) for t in args.topologies for m in args.sizes]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_config(cfg: Config, args: argparse.Namespace, huge: dict, result: dict) -> None:
    """Calibrate C (unless given), then every way on fresh ranks; rows into ``result``."""
    label = f"{cfg.topology} {cfg.mib:g}MiB"
    if cfg.nodes is not None and os.geteuid() != 0:
        why = skip_reason(cfg, "base", args, huge)
        for mode in args.modes:
            result["skipped"].append({"config": label, "mode": mode, "reason": why})
        log(f"{label}: skipped: {why}")
        return
    if args.compute_ms is not None:
        cfg.compute_ms = float(args.compute_ms)
        cfg.calibration = {"given": True}
    else:
        t0 = time.monotonic()
        try:
            cal = launch(
                cfg, "calibrate_rank", {"mib": cfg.mib, "reps": args.calibrate_reps}, args, {}
            )
        except AssertionError as exc:  # harness.RankFailure
            why = f"calibration failed: {str(exc).strip().splitlines()[-1][:300]}"
            for mode in args.modes:
                result["failed"].append({"config": label, "mode": mode, "reason": why})
            log(f"{label}: FAILED: {why}")
            return
        cfg.compute_ms, cfg.calibration = compute_for(cal, args)
        cal_ms = cfg.calibration
        log(
            f"{label}: C = {cfg.compute_ms:g} ms (production {cal_ms['produce_ms_p50']:.1f} ms"
            f" + transfer {cal_ms['transfer_ms_p50_slowest']:.1f} ms,"
            f" x{args.compute_factor:g}; {time.monotonic() - t0:.1f} s)"
        )
    result["configs"].append(
        {
            "topology": cfg.topology,
            "mib": cfg.mib,
            "sp": cfg.sp,
            "nodes": cfg.nodes,
            "compute_ms": cfg.compute_ms,
            "calibration": cfg.calibration,
            "loadavg_1m": os.getloadavg()[0],
        }
    )
    for mode in args.modes:
        why = skip_reason(cfg, mode, args, huge)
        if why is not None:
            result["skipped"].append({"config": label, "mode": mode, "reason": why})
            log(f"{label} {mode}: skipped: {why}")
            continue
        t0 = time.monotonic()
        kwargs = {
            "mode": mode,
            "mib": cfg.mib,
            "warmup": args.warmup,
            "steps": args.steps or _steps(cfg.mib),
            "workers": args.workers,
            "compute_ms": cfg.compute_ms,
            "compute_kind": args.compute,
            "page": args.page,
        }
        try:
            ranks = launch(cfg, "step_rank", kwargs, args, mode_env(cfg, mode, huge))
        except AssertionError as exc:  # harness.RankFailure
            why = str(exc).strip().splitlines()[-1][:300]
            result["failed"].append({"config": label, "mode": mode, "reason": why})
            log(f"{label} {mode}: FAILED: {why}")
            continue
        rows = [rank_row(cfg, mode, r) for r in ranks]
        result["rows"].extend(rows)
        result["raw"].append({"config": label, "mode": mode, "ranks": ranks})
        nexts = " ".join(f"{r['next_ms_p50']:.2f}" for r in rows)
        above = max(r["above_ms_p50"] for r in rows)
        log(
            f"{label} {mode}: next() p50 per rank {nexts} ms, step above C p50 "
            f"{above:.2f} ms (worst rank) ({time.monotonic() - t0:.1f} s)"
        )


def _steps(mib: float) -> int:
    """Measured steps per way: fewer for big batches (each step lasts C)."""
    return 20 if mib <= 16 else 14 if mib <= 64 else 10


# ------------------------------------------------------------------ report


def worst(rows: list[dict], topology: str, mib: float, mode: str, key: str) -> float | None:
    """The largest ``key`` over the ranks of one way, or None where it did not run."""
    way = (topology, mib, mode)
    vals = [r[key] for r in rows if (r["topology"], r["mib"], r["mode"]) == way and key in r]
    return max(vals) if vals else None


def targets(rows: list[dict]) -> list[dict[str, str]]:
    """Issue 31's targets, for every configuration measured (worst rank's p50 each)."""
    out = []
    configs = sorted({(r["topology"], r["mib"]) for r in rows}, key=lambda c: (c[1], c[0]))
    for topology, mib in configs:
        where = f"{topology}, {mib:g} MiB"
        base = worst(rows, topology, mib, "base", "next_ms_p50")
        for mode in ("shmloader", "shmloader-huge"):
            mine = worst(rows, topology, mib, mode, "next_ms_p50")
            if mine is None:
                continue
            out.append(
                _target(f"{mode} next() p50 <= 1 ms on every rank", where, mine, TARGET_NEXT_MS)
            )
            read = worst(rows, topology, mib, mode, "next_read_ms_p50")
            if read is not None:
                out.append(
                    _target(
                        f"{mode} next()+read p50 <= 1 ms on every rank",
                        where,
                        read,
                        TARGET_NEXT_MS,
                    )
                )
            if base is not None:
                out.append(_target(f"{mode} next() p50 <= base's", where, mine, base))
            sp = TOPOLOGIES[topology][0]
            if TOPOLOGIES[topology][1] is not None:
                one = worst(rows, f"1node-sp{sp}", mib, mode, "next_ms_p50")
                if one is not None:
                    out.append(
                        _target(
                            f"{mode} next() p50 over two nodes <= 1.1x one node (SP{sp})",
                            where,
                            mine,
                            TARGET_TWO_NODES * one,
                        )
                    )
    return out


def _target(name: str, where: str, value: float, bound: float) -> dict[str, str]:
    return {
        "target": name,
        "where": where,
        "measured": f"{value:.2f} ms vs {bound:.2f} ms",
        "verdict": "met" if value <= bound else "MISSED",
    }


def markdown(result: dict[str, Any]) -> str:
    f = report._fmt
    m = result["machine"]
    record = result.get("provenance")
    lines = [
        "# shmloader step benchmark",
        "",
        *(provenance.header(record) if record else [f"Command: `{result['command']}`."]),
        "",
        f"{m.get('cores')} cores, "
        f"load average {result['loadavg_start']:.1f} at start, {result['loadavg_max']:.1f} at "
        f"worst (1 min, before each configuration); compute `{result['compute']}`; "
        f"one value read per {result['page']} bytes; "
        f"{result['workers']} DataLoader worker(s) per loading rank; "
        f"huge-page ring: {result['huge_ring']}.",
        "",
        "Per way and rank, over the measured steps (ms). `next()`: the call that hands the "
        "step its batch. *drop*: dropping the previous batch right after (as `for batch in "
        "loader` does). *read*: one value per page. *next()+read*: the two together, per "
        "step: from asking for the batch until every page of it was touched once. *above C*: "
        "the whole step (next, drop, read, compute, all_reduce) minus C; the all_reduce also "
        "waits for the slowest rank.",
        "",
        "| topology | MiB | C | way | rank | role | next() p50 | next() p90 | drop p50 | read p50 "
        "| next()+read p50 | all_reduce p50 | above C p50 | above C p90 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = ("next_ms_p50", "next_ms_p90", "drop_ms_p50", "read_ms_p50", "next_read_ms_p50",
            "allreduce_ms_p50", "above_ms_p50", "above_ms_p90")  # fmt: skip
    for r in result["rows"]:
        head = (
            f"| {r['topology']} | {r['mib']:g} | {r['compute_ms']:g} | {r['mode']} | {r['rank']} "
        )
        lines.append(head + f"| {r['role']} | " + " | ".join(f(r[k], 3) for k in keys) + " |")
    lines += ["", "## C per configuration", "", "| topology | MiB | C ms | how |"]
    lines.append("| --- | --- | --- | --- |")
    for c in result["configs"]:
        cal = c["calibration"]
        how = (
            "--compute-ms"
            if cal.get("given")
            else f"{result['compute_factor']:g} x (production {cal['produce_ms_p50']:.1f} + "
            f"transfer {cal['transfer_ms_p50_slowest']:.1f})"
        )
        lines.append(f"| {c['topology']} | {c['mib']:g} | {c['compute_ms']:g} | {how} |")
    if result["targets"]:
        lines += ["", "## Targets (worst rank's p50)", ""]
        lines += ["| target | where | measured | verdict |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {t['target']} | {t['where']} | {t['measured']} | {t['verdict']} |"
            for t in result["targets"]
        ]
    for title, key in (("Skipped", "skipped"), ("Failed", "failed")):
        if result[key]:
            lines += ["", f"## {title}", ""]
            lines += [f"- {s['config']} {s['mode']}: {s['reason']}" for s in result[key]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    """Per topology: worst rank's next() p50 and step above C p50 vs batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = [t for t in TOPOLOGIES if any(r["topology"] == t for r in rows)] or ["none"]
    fig, axes = plt.subplots(2, len(topologies), figsize=(4.2 * len(topologies), 7), squeeze=False)
    for col, topology in enumerate(topologies):
        for row, (key, ylabel) in enumerate(
            (
                ("next_ms_p50", "next() p50, worst rank (ms)"),
                ("above_ms_p50", "step above C p50, worst rank (ms)"),
            )
        ):
            ax = axes[row][col]
            for mode in MODES:
                sizes = sorted(
                    {r["mib"] for r in rows if (r["topology"], r["mode"]) == (topology, mode)}
                )
                if not sizes:
                    continue
                ys = [max(worst(rows, topology, s, mode, key) or 0.0, 0.01) for s in sizes]
                color, marker, line = STYLE[mode]
                ax.plot(sizes, ys, line, color=color, marker=marker, label=LABELS[mode])
            if key == "next_ms_p50":
                ax.axhline(
                    TARGET_NEXT_MS,
                    color="green",
                    linewidth=0.8,
                    linestyle="--",
                    label="target 1 ms",
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            report._size_ticks(ax, sorted({r["mib"] for r in rows if r["topology"] == topology}))
            ax.set_xlabel("batch (MiB)")
            ax.set_ylabel(ylabel)
            ax.set_title(topology)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(result: dict[str, Any], out: str) -> list[str]:
    """``step.json`` (with raw per-step records), ``step.md``, ``step.png``; their paths."""
    paths = [os.path.join(out, n) for n in ("step.json", "step.md", "step.png")]
    with open(paths[0], "w") as fh:
        json.dump(result, fh, indent=1)
    with open(paths[1], "w") as fh:
        fh.write(markdown(result))
    plot(result["rows"], paths[2])
    return [os.path.abspath(p) for p in paths]


# -------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step",
        description="How long a simulated training step waits for its batch, per way and rank.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: SP2 on one node and over two nodes, 4 MiB, a few steps",
    )
    p.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    p.add_argument("--topologies", nargs="+", choices=tuple(TOPOLOGIES), help="default all")
    p.add_argument("--sizes", type=float, nargs="+", help="batch sizes in MiB (16 64 256)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default all")
    p.add_argument("--steps", type=int, help="measured steps per way (default: by size)")
    p.add_argument("--warmup", type=int, default=3, help="steps not measured (workers, ring)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per loading rank")
    p.add_argument(
        "--compute",
        choices=("sleep", "busy"),
        default="sleep",
        help="the step's compute: sleep (a GPU step, CPU free) or a busy wait",
    )
    p.add_argument("--compute-ms", type=float, help="fixed C in ms (default: calibrated)")
    p.add_argument(
        "--compute-factor",
        type=float,
        default=2.0,
        help="C = factor x (production + transfer), calibrated per configuration",
    )
    p.add_argument("--min-compute-ms", type=float, default=20.0, help="C is at least this")
    p.add_argument("--calibrate-reps", type=int, default=3, help="calibration batches")
    p.add_argument("--page", type=int, default=64 << 10, help="read one value per this many bytes")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch of ranks")
    args = p.parse_args(argv)
    if args.quick:
        args.topologies = args.topologies or ["1node-sp2", "2nodes-sp2"]
        args.sizes = args.sizes or [4.0]
        args.steps = args.steps or 5
        args.warmup = min(args.warmup, 2)
        args.workers = 1
        args.calibrate_reps = min(args.calibrate_reps, 2)
        args.timeout = min(args.timeout, 120.0)
    args.topologies = args.topologies or list(TOPOLOGIES)
    args.sizes = args.sizes or [16.0, 64.0, 256.0]
    for name in ("steps", "warmup", "calibrate_reps", "page"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if any(s <= 0 for s in args.sizes):
        p.error(f"--sizes {args.sizes}: every size must be > 0 MiB")
    if args.compute_ms is not None and args.compute_ms < 0:
        p.error(f"--compute-ms {args.compute_ms}: must be >= 0")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shml-step-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("SHMLOADER_QUIET", "1")  # no banner per launch of ranks
    os.makedirs(args.out, exist_ok=True)
    record = provenance.start("benchmarks.step", argv)
    configs = plan(args)
    log(
        f"benchmarks.step: {len(configs)} configurations x {len(args.modes)} ways; "
        f"results go to {args.out}"
    )
    huge: dict[str, Any] = {"why": "not asked for (--modes)"}
    if "shmloader-huge" in args.modes:
        size = int(0.6 * procstat.meminfo().get("MemAvailable", 0))
        path, why = hugedir.mount(size)
        huge = {"dir": path, "why": why}
        log(f"benchmarks.step: huge-page ring: {why}")
    started = time.monotonic()
    result: dict[str, Any] = {
        "command": record["command"],
        "provenance": record,
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": procstat.machine(),
        "loadavg_start": os.getloadavg()[0],
        "compute": args.compute,
        "compute_factor": args.compute_factor,
        "page": args.page,
        "workers": args.workers,
        "huge_ring": huge["why"],
        "configs": [],
        "rows": [],
        "raw": [],
        "skipped": [],
        "failed": [],
    }
    loads = [result["loadavg_start"]]
    try:
        for cfg in configs:
            loads.append(os.getloadavg()[0])
            run_config(cfg, args, huge, result)
    finally:
        hugedir.unmount(huge.get("dir"))
    result["loadavg_max"] = max(loads)
    result["wall_s"] = time.monotonic() - started
    result["targets"] = targets(result["rows"])
    with contextlib.suppress(OSError):
        result["machine"]["loadavg_end"] = list(os.getloadavg())
    provenance.finish(record)
    for path in write(result, args.out):
        log(f"wrote {path}")
    log(f"{len(configs)} configurations in {result['wall_s']:.0f} s")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

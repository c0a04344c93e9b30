"""``python -m benchmarks.run [--quick] [--out DIR]``: every configuration, one run.

It measures the transport per batch where the user asks for it, so every
loop runs in step with its user (``SHMLOADER_AHEAD=0`` unless set): what
running ahead saves a training step is ``benchmarks.step``'s subject.

Runs the same workload three ways (``base``: every SP rank loads its own
batch; ``broadcast``: the leader loads and sends the batch over gloo, as
leader-only loaders do; ``shmloader``: ``ShmLoader`` embedded mode; and
``shmloader-huge``: the same with its ring in a tmpfs mounted with
``huge=within_size`` in a private mount namespace, as root only, skipped
with the reason otherwise: ``benchmarks.hugedir``), plus the whole batch
through ``broadcast_object_list`` (``objlist``) at the smaller sizes, then a
"realistic workers" run for CPU and memory, and an equal-CPU-budget run
(``budget``: the realistic workload with ``w`` workers on every base rank
against ``SP x w`` on shmloader's one loading rank: the same worker
processes on the node, so steps per second show how much faster data
arrives for the same CPU). Each configuration runs in
freshly spawned ranks; a line per configuration goes to stderr. Writes
``results.json``, ``results.md``, ``delivery.png`` and ``e2e.png`` to
``--out`` (default ``benchmarks/results``; with ``--quick`` a new temporary
directory), printed when the run starts and again with every file at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

from . import hugedir, procstat, provenance, report
from .rank import Body, Case, body_for, rank_main

MiB = 1 << 20
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: Fraction of available RAM (and of free /dev/shm) a configuration may plan to use.
MEMORY_SHARE = 0.6


# --------------------------------------------------------------------- plan


def _steps(mib: int) -> int:
    """Measured steps per phase: fewer for the big batches, to keep the run bounded."""
    return 20 if mib <= 16 else 16 if mib <= 64 else 10 if mib <= 256 else 6


def plan(args: argparse.Namespace) -> list[Case]:
    """Every configuration of this run, in order: per SP, per size, the ways back to back."""
    cases: list[Case] = []
    for sp in args.sp:
        for mib in args.sizes:
            steps = args.steps or _steps(mib)
            for mode in ("base", "broadcast", "shmloader-1copy", "shmloader", "shmloader-huge"):
                cases.append(
                    Case(
                        "transport", mode, sp, mib * MiB, args.warmup, steps, args.transport_workers
                    )
                )
            if mib <= args.objlist_max_mib:
                cases.append(
                    Case(
                        "transport",
                        "objlist",
                        sp,
                        mib * MiB,
                        1,
                        args.objlist_steps,
                        args.transport_workers,
                    )
                )
    for sp in args.sp:
        for mode in ("base", "broadcast", "shmloader"):
            cases.append(
                Case(
                    "realistic",
                    mode,
                    sp,
                    int(args.realistic_mib * MiB),
                    args.realistic_warmup,
                    args.realistic_steps,
                    args.realistic_workers,
                    decode_scale=args.decode_scale,
                )
            )
    for sp in args.sp:  # equal CPU budget: as many worker processes on the node either way
        w = args.budget_workers
        for mode, workers in (("base", w), ("shmloader", sp * w)):
            cases.append(
                Case(
                    "budget",
                    mode,
                    sp,
                    int(args.realistic_mib * MiB),
                    args.realistic_warmup,
                    args.budget_steps,
                    workers,
                    decode_scale=args.decode_scale,
                )
            )
    return [
        replace(c, timeout_s=args.timeout)
        for c in cases
        if c.mode in args.modes and c.run in args.runs and not _left_out_of_quick(c, args)
    ]


def _left_out_of_quick(case: Case, args: argparse.Namespace) -> bool:
    """``--quick`` keeps one configuration per question (about 20 s on 2 cores).

    Each configuration starts fresh ranks (a second or two on 2 cores whatever
    it measures), so the smoke run measures the one-copy way only at its
    largest size, ``broadcast_object_list`` only at its smallest, the
    realistic run without the broadcast way, and not the huge-page way (the
    zero-copy way's code in another directory; it needs root and a mount).
    """
    if not getattr(args, "quick", False):
        return False
    mib = case.target_bytes / MiB
    return (
        case.mode == "shmloader-huge"
        or (case.run == "transport" and case.mode == "shmloader-1copy" and mib < max(args.sizes))
        or (case.run == "transport" and case.mode == "objlist" and mib > min(args.sizes))
        or (case.run == "realistic" and case.mode == "broadcast")
    )


def memory_need(case: Case) -> tuple[int, int]:
    """Rough peak (RAM, /dev/shm) bytes of a configuration, in batches times size.

    Per loading rank: one batch held, one in flight from its worker; the
    ring: up to three slots of 1.125 batches; a broadcast follower: one
    received batch plus its buffer; pickling: the batch, its pickle and the
    received pickle.
    """
    b = case.target_bytes
    if case.mode == "base":
        return case.sp * 3 * b, case.sp * 2 * b
    if case.mode == "broadcast":
        return 3 * b + (case.sp - 1) * 2 * b, 2 * b
    if case.mode == "objlist":
        return 3 * b + (case.sp - 1) * 4 * b, 2 * b
    if case.mode in ("shmloader", "shmloader-huge"):  # the worker pool: workers x (prefetch +
        slots = max(case.workers, 1) * (1 + 4 + 1)  # ranks' share + 1)
        return 3 * b + 4 * b, int(slots * 1.2 * b)
    return 3 * b + 4 * b, 6 * b


def skip_reason(case: Case) -> str | None:
    """Why ``case`` cannot run on this machine now, or None."""
    ram, shm = memory_need(case)
    available = procstat.meminfo().get("MemAvailable", 0)
    if ram > MEMORY_SHARE * available:
        return (
            f"needs about {ram / 2**30:.1f} GiB of RAM; "
            f"{available / 2**30:.1f} GiB available (using at most {MEMORY_SHARE:.0%})"
        )
    free = procstat.shm_free()
    if shm > MEMORY_SHARE * free:
        return f"needs about {shm / 2**30:.1f} GiB of /dev/shm; {free / 2**30:.1f} GiB free"
    return None


# ------------------------------------------------------------------- launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: mp.process.BaseProcess) -> None:
    """Kill a rank and its DataLoader workers (the rank leads its own process group)."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


#: How ranks start: fresh interpreters, so that each rank's CPU seconds and
#: memory include what a real rank pays. ``--quick`` (a smoke run, never a
#: result) forks them from a server that imported ``WARM`` once instead, and
#: each such rank forks its DataLoader workers' server from itself
#: (``rank.rank_main``), so no worker imports torch again either.
START_METHOD = "spawn"
WARM = ["torch", "torch.distributed", "torch.utils.data", "numpy", "zmq"]


def warm_starts() -> None:
    """Start ranks from a forkserver with ``WARM`` imported (``--quick`` only)."""
    global START_METHOD
    START_METHOD = "forkserver"
    mp.set_forkserver_preload(WARM)


def launch(case: Case, body: Body | None = None) -> tuple[list[dict] | None, str]:
    """Run ``case`` on ``case.sp`` new ranks; their results, or None and why not.

    Each rank runs ``body`` (default: its run kind's, ``rank.body_for``).
    """
    body = body_for(case.run) if body is None else body
    ctx = mp.get_context(START_METHOD)
    outdir = tempfile.mkdtemp(prefix="shml-bench-")
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, asdict(case), port, outdir, body), daemon=False)
        for r in range(case.sp)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + case.timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                _kill(p)
            p.join(10)
    try:
        return _collect(case, procs, outdir, hung)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def _collect(
    case: Case, procs: list[mp.process.BaseProcess], outdir: str, hung: list[int]
) -> tuple[list[dict] | None, str]:
    results, errors = [], []
    for rank in range(case.sp):
        err, out = os.path.join(outdir, f"{rank}.err"), os.path.join(outdir, f"{rank}.json")
        if os.path.exists(err):
            with open(err) as f:
                errors.append(f"rank {rank}: {f.read().strip().splitlines()[-1]}")
        elif os.path.exists(out):
            with open(out) as f:
                results.append(json.load(f))
        else:
            errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
    if hung:
        errors.insert(0, f"ranks {hung} still ran after {case.timeout_s:.0f} s and were killed")
    if errors:
        _collect_garbage()
        return None, "; ".join(errors)
    for r in results:
        r["exitcode"] = procs[r["rank"]].exitcode
    return results, ""


def _collect_garbage() -> None:
    """After a killed or failed configuration: remove what dead ranks left in /dev/shm."""
    with contextlib.suppress(Exception):
        from shmloader._node import reaping

        reaping.collect_garbage(dry_run=False)


# ------------------------------------------------------------------ progress


def _summary(row: dict[str, Any]) -> str:
    f = report._fmt
    if row["run"] in ("realistic", "budget"):
        return (
            f"wait p50 {f(row.get('wait_ms_p50'))} ms, {f(row.get('steps_per_s'))} steps/s, "
            f"cpu {f(row['cpu_s'])} s, batch mem {f(row.get('batch_mem_mib'), 0)} MiB"
        )
    parts = [
        f"follower p50 {f(row.get('follower_ms_p50'), 3)} p99 {f(row.get('follower_ms_p99'), 3)} ms"
    ]
    if row.get("publish_ms_p50") is not None:
        parts.append(f"publish {f(row['publish_ms_p50'])} ms")
    if row.get("memcpy_cold_ms") is not None:
        parts.append(f"memcpy {f(row['memcpy_cold_ms'])}/{f(row['memcpy_warm_ms'])} ms")
    if row.get("e2e_ms_p50") is not None:
        parts.append(f"e2e {f(row['e2e_ms_p50'])} ms")
    parts.append(f"{f(row.get('steps_per_s'))} steps/s")
    parts.append(f"cpu {f(row['cpu_s'])} s")
    parts.append(f"batch mem {f(row.get('batch_mem_mib'), 0)} MiB")
    return ", ".join(parts)


def progress(i: int, n: int, case: Case, text: str, seconds: float) -> None:
    print(f"[{i:2d}/{n}] {case.label}: {text} ({seconds:.1f} s)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1 and 16 MiB, SP2, few steps, ranks forked from a warm server "
        "(CPU and memory rows not comparable with a full run)",
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"output directory (default {DEFAULT_OUT}; with --quick a new temporary "
        "directory, so a smoke run never overwrites the committed results)",
    )
    p.add_argument("--sizes", type=int, nargs="+", help="batch sizes in MiB")
    p.add_argument("--sp", type=int, nargs="+", help="SP group sizes (one node)")
    p.add_argument("--steps", type=int, help="measured steps per phase (default: by size)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps (ring growth, workers)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("base", "broadcast", "objlist", "shmloader-1copy", "shmloader", "shmloader-huge"),
        default=["base", "broadcast", "objlist", "shmloader-1copy", "shmloader", "shmloader-huge"],
        help="only these ways (default all)",
    )
    p.add_argument(
        "--runs",
        nargs="+",
        choices=("transport", "realistic", "budget"),
        default=["transport", "realistic", "budget"],
        help="only these runs (default all)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shml-bench-") if args.quick else DEFAULT_OUT
    args.transport_workers = 1
    args.decode_scale = 2
    if args.quick:
        warm_starts()  # a smoke run: its CPU and memory rows are not a result
        args.sizes = args.sizes or [1, 16]
        args.sp = args.sp or [2]
        args.steps = args.steps or 5
        args.warmup = 3
        args.objlist_max_mib, args.objlist_steps = 16, 2
        args.realistic_mib, args.realistic_steps, args.realistic_warmup = 4, 3, 1
        args.realistic_workers = 1
        args.budget_workers, args.budget_steps = 1, 3
        args.timeout = min(args.timeout, 120.0)
    else:
        args.sizes = args.sizes or [1, 16, 64, 256, 1024]
        args.sp = args.sp or [2, 4]
        args.objlist_max_mib, args.objlist_steps = 256, 2
        args.realistic_mib, args.realistic_steps, args.realistic_warmup = 32, 8, 2
        args.realistic_workers = 2
        args.budget_workers, args.budget_steps = 1, 16
    return args


def in_ring_dirs(cases: list[Case], huge_dir: str) -> list[Case]:
    """``cases`` with the huge-page way's ring in ``huge_dir``; every other way keeps
    ``/dev/shm`` (a ring elsewhere would measure the huge pages as ``shmloader``'s)."""
    return [replace(c, shm_dir=huge_dir) if c.mode == "shmloader-huge" else c for c in cases]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    # The transport's cost per batch, measured where the user asks for it: every loop
    # in step with its user. What running ahead (NOTE [running ahead]) does for a
    # training step is benchmarks.step's subject.
    os.environ.setdefault("SHMLOADER_AHEAD", "0")
    os.makedirs(args.out, exist_ok=True)
    record = provenance.start("benchmarks.run", argv)
    machine = procstat.machine()
    cases = plan(args)
    print(
        f"benchmarks.run: {len(cases)} configurations; results go to {args.out}",
        file=sys.stderr,
        flush=True,
    )
    huge_why = ""
    if any(c.mode == "shmloader-huge" for c in cases):
        size = int(MEMORY_SHARE * procstat.meminfo().get("MemAvailable", 0))
        huge_dir, huge_why = hugedir.mount(size)
        print(f"benchmarks.run: huge-page ring: {huge_why}", file=sys.stderr, flush=True)
        machine["huge_ring"] = huge_why
        cases = in_ring_dirs(cases, huge_dir or "")
    started = time.monotonic()
    rows: list[dict] = []
    skipped: list[dict] = []
    failed: list[dict] = []
    loads: list[float] = []
    for i, case in enumerate(cases, 1):
        t0 = time.monotonic()
        loads.append(os.getloadavg()[0])
        reason = skip_reason(case)
        if case.mode == "shmloader-huge" and not case.shm_dir:
            reason = huge_why
        if reason is not None:
            skipped.append({"label": case.label, "reason": reason, "case": asdict(case)})
            progress(i, len(cases), case, f"skipped: {reason}", 0.0)
            continue
        ranks, error = launch(case)
        if ranks is None:
            failed.append({"label": case.label, "reason": error, "case": asdict(case)})
            progress(i, len(cases), case, f"FAILED: {error}", time.monotonic() - t0)
            continue
        row = report.aggregate(asdict(case), sorted(ranks, key=lambda r: r["rank"]))
        row["loadavg_1m"] = loads[-1]
        row["exit_codes"] = [r.get("exitcode") for r in ranks]
        row["raw"] = ranks
        rows.append(row)
        progress(i, len(cases), case, _summary(row), time.monotonic() - t0)
    machine["loadavg_end"] = list(os.getloadavg())
    result = {
        "command": record["command"],
        "argv": sys.argv[1:] if argv is None else argv,
        "provenance": provenance.finish(record),
        "machine": machine,
        "loadavg_max": max(loads, default=0.0),
        "wall_s": time.monotonic() - started,
        "rows": rows,
        "skipped": skipped,
        "failed": failed,
    }
    result["targets"] = report.targets(rows)
    for path in write(result, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print(f"{len(cases)} configurations in {result['wall_s']:.0f} s", file=sys.stderr)
    return 1 if failed else 0


def write(result: dict[str, Any], out: str) -> list[str]:
    """``results.json`` (with raw per-rank data), ``results.md``, the plots; their paths."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    lean = {**result, "rows": [{k: v for k, v in r.items() if k != "raw"} for r in result["rows"]]}
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report.markdown(lean))
    report.plot(
        result["rows"],
        os.path.join(out, "delivery.png"),
        "follower_ms_p50",
        "follower time to a usable batch (ms)",
        "Follower time to a usable batch",
    )
    report.plot(
        result["rows"],
        os.path.join(out, "e2e.png"),
        "e2e_ms_p50",
        "leader publish start -> last follower holds it (ms)",
        "End-to-end delivery",
    )
    names = ("results.json", "results.md", "delivery.png", "e2e.png")
    return [os.path.abspath(os.path.join(out, name)) for name in names]


if __name__ == "__main__":
    raise SystemExit(main())

"""The huge-page ring's directory, and what a rank pays to touch a batch delivered there.

``mount()`` makes this process (its calling thread, and every rank it
spawns afterwards) enter a private mount namespace and mounts a tmpfs with
``huge=within_size`` there, so nothing of it is visible to the rest of the
machine and the kernel frees it when the run ends. Root only; anything
else, or a kernel that gives the mount no huge pages, is a reason to skip
the way (NOTE [huge-page ring] in ``shmloader._node.ringdir``). ``benchmarks.run``
and ``benchmarks.step`` use it for their ``shmloader-huge`` way.

``python -m benchmarks.hugedir [--mib 256] [--batches 8] [--out DIR]``: the
touch cost per path. An SP2 group on fresh ranks shares batches of one
contiguous float32 tensor through a ring in that tmpfs (and, for
reference, in ``/dev/shm``), once per path a slot is written by::

    main     the leader's main process copies the batch in (no DataLoader workers:
             the path of every node leader's ring too)
    collate  a DataLoader worker's collate stacks two samples into the slot (batch_size=2)
    copy     a DataLoader worker copies its sample into the slot (batch_size=None)

and once per mode, when a rank reads one byte per 4 KiB of the batch it was
handed (a mapping nothing has read yet) and then drops it::

    quiet     each rank in turn while the other waits, once no DataLoader worker writes
    lockstep  every rank right after its next(), then a barrier (a training step's
              collective); DataLoader workers write ahead meanwhile
    free      every rank right after its next(), no barrier: the leader runs ahead
              within the ring's window, writing the next batch while the follower reads

Per rank: the time of the read and of the drop (the unmap and the release),
the minor page faults the read took, and from ``/proc/self/smaps`` how much
of the batch's mapping 2 MiB page-table entries map (``ShmemPmdMapped`` /
``FilePmdMapped``) against what it maps at all (``Rss``): page tables, not
time, say whether a rank got whole huge pages; time also says what else the
machine did meanwhile. Writes ``hugedir.json`` and ``hugedir.md`` to
``--out`` (default a new temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any

from . import provenance

CLONE_NEWNS = 0x00020000
MS_REC = 16384
MS_PRIVATE = 1 << 18
MiB = 1 << 20
HUGE = 2 * MiB


def mount(size_bytes: int) -> tuple[str | None, str]:
    """``(path, how)`` of a fresh ``huge=within_size`` tmpfs, or ``(None, why not)``."""
    if os.geteuid() != 0:
        return None, "needs root (a tmpfs mounted in a private mount namespace)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return None, f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return None, f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    path = tempfile.mkdtemp(prefix="shml-bench-huge-")
    mib = max(size_bytes >> 20, 64)
    options = f"huge=within_size,size={mib}m,mode=1777"
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options.encode()) != 0:
        err = os.strerror(ctypes.get_errno())
        os.rmdir(path)
        return None, f"mount -t tmpfs -o {options}: {err}"
    from shmloader._node import ringdir

    facts = ringdir.describe(path)
    if not facts.huge:
        return None, f"the kernel gives the tmpfs no huge pages: {facts.why}"
    return path, f"tmpfs -o {options} at {path}: {facts.why}"


def unmount(path: str | None) -> None:
    """Unmount ``mount``'s tmpfs (this process's private namespace only) and remove
    its now empty mount point, which the shared ``/tmp`` would otherwise keep."""
    if path is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(path.encode(), 2) == 0:  # MNT_DETACH
        with contextlib.suppress(OSError):
            os.rmdir(path)


# ------------------------------------------------------------ touch per path

#: How each path's slot is written (the module doc's table).
PATHS = {
    "main": "leader's main process copies the batch in (no workers; every node leader's ring)",
    "collate": "a DataLoader worker's collate stacks 2 samples into the slot (batch_size=2)",
    "copy": "a DataLoader worker copies its sample into the slot (batch_size=None)",
}
#: Where the ring lives: the huge-page tmpfs, or /dev/shm for reference.
RINGS = ("huge", "shm")


def loader_for(path: str, mib: float, batches: int) -> Any:
    """The DataLoader of ``path``: ``batches`` batches of one ``mib`` MiB float32 tensor."""
    from torch.utils.data import DataLoader

    nbytes = int(mib * MiB)
    if path == "collate":
        return DataLoader(Filled(2 * batches, nbytes // 2), batch_size=2, num_workers=2,
                          prefetch_factor=1)  # fmt: skip
    workers = 0 if path == "main" else 2
    return DataLoader(Filled(batches, nbytes), batch_size=None, num_workers=workers,
                      prefetch_factor=1 if workers else None)  # fmt: skip


class Filled:
    """A map-style dataset: sample ``i`` is a float32 tensor of ``nbytes`` filled with ``i``."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.full((self.nbytes // 4,), float(i))


def mapping_of(address: int) -> dict[str, int]:
    """The ``/proc/self/smaps`` entry holding ``address``: start, offset and kB fields."""
    out: dict[str, int] = {}
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                inside = lo <= address < hi
                if inside:
                    out = {"start": lo, "end": hi, "offset": int(parts[2], 16)}
            elif inside and len(parts) >= 2 and parts[1].isdigit():
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def touch(batch: Any) -> dict[str, Any]:
    """Read one byte per 4 KiB of ``batch`` (a tensor): ms, minor faults, its mapping."""
    from .rank import read_per_page

    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0 = time.perf_counter_ns()
    read_per_page(batch, 4096)
    ms = (time.perf_counter_ns() - t0) / 1e6
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
    m = mapping_of(batch.data_ptr())
    return {
        "touch_ms": ms,
        "faults": faults,
        "pmd_kb": m.get("ShmemPmdMapped", 0) + m.get("FilePmdMapped", 0),
        "rss_kb": m.get("Rss", 0),
        "anon_kb": m.get("Anonymous", 0),
        "length_kb": (m.get("end", 0) - m.get("start", 0)) >> 10,
        # 2 MiB entries need the address and the file offset congruent modulo 2 MiB
        "congruent": (m.get("start", 0) - m.get("offset", 0)) % HUGE == 0,
    }


def settle(it: Any, timeout: float = 60.0) -> None:
    """Wait until no DataLoader worker of ``it`` is busy (their CPU time stands still)."""
    pids = [w.pid for w in getattr(it, "_workers", None) or []]
    if not pids:
        return
    deadline, last, still = time.monotonic() + timeout, -1, 0
    while still < 3 and time.monotonic() < deadline:
        now = sum(_cpu_ticks(p) for p in pids)
        still = still + 1 if now == last else 0
        last = now
        time.sleep(0.02)


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def touch_rank(
    rank: int, world: int, *, path: str, mib: float, batches: int, warmup: int, mode: str
) -> dict:
    """One rank of one path: ``warmup + batches`` batches, each touched and dropped (``MODES``)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shmloader import Config, ShmLoader

    torch.set_num_threads(1)
    group = dist.group.WORLD
    made: list[Any] = []

    class Kept(DataLoader):  # still a DataLoader (the worker writer stays on)
        def __iter__(self) -> Any:
            it = super().__iter__()
            made.append(it)
            return it

    def factory() -> Any:
        loader = loader_for(path, mib, warmup + batches)
        loader.__class__ = Kept
        return loader

    loader = ShmLoader(factory, group, config=Config.from_env(enabled=True, daemon=None))
    records = []
    try:
        it = iter(loader)
        for i in range(warmup + batches):
            batch = next(it)
            if mode == "quiet" and made:
                settle(made[-1])  # nothing writes the next batch while ranks touch this one
            for turn in range(world if mode == "quiet" else 1):
                if mode == "quiet":
                    dist.barrier(group)
                if turn == rank or mode != "quiet":
                    record = touch(batch)
                    t0 = time.perf_counter_ns()
                    del batch  # unmapped here: the last reference to the view goes
                    record["drop_ms"] = (time.perf_counter_ns() - t0) / 1e6
            if mode != "free":
                dist.barrier(group)
            if i >= warmup:
                records.append(record)
        del it
        dist.barrier(group)
    finally:
        role = loader.role
        loader.close()
    return {"rank": rank, "role": role, "records": records}


def summary(ring: str, mode: str, path: str, ranks: list[dict]) -> list[dict[str, Any]]:
    """One row per rank of one run: p50 and min of the times, the mapping's worst batch."""
    import numpy as np

    rows = []
    for r in ranks:
        recs = r["records"]
        ms = [x["touch_ms"] for x in recs]
        rows.append(
            {
                "ring": ring,
                "mode": mode,
                "path": path,
                "rank": r["rank"],
                "role": r["role"],
                "touch_ms_p50": float(np.median(ms)),
                "touch_ms_min": min(ms),
                "drop_ms_p50": float(np.median([x["drop_ms"] for x in recs])),
                "faults_p50": float(np.median([x["faults"] for x in recs])),
                "pmd_kb_min": min(x["pmd_kb"] for x in recs),
                "rss_kb_max": max(x["rss_kb"] for x in recs),
                "anon_kb_max": max(x["anon_kb"] for x in recs),
                "congruent": all(x["congruent"] for x in recs),
            }
        )
    return rows


#: When the ranks touch their batch (``touch_rank``'s ``mode``).
MODES = {
    "quiet": "each rank in turn while the others wait, once no DataLoader worker writes",
    "lockstep": "every rank right after its next(), then a barrier: a training step's "
    "collective (DataLoader workers write ahead meanwhile)",
    "free": "every rank right after its next(), no barrier: the leader runs ahead within "
    "the ring's window and writes the next batch while the follower reads this one",
}


def markdown(result: dict[str, Any]) -> str:
    record = result.get("provenance")
    lines = [
        "# Touching a delivered batch, per path",
        "",
        *(provenance.header(record) if record else [f"Command: `{result['command']}`."]),
        "",
        f"SP2 on one node, {result['mib']:g} MiB batches (one float32 "
        f"tensor), {result['batches']} measured after {result['warmup']}; one byte read per "
        f"4 KiB of a mapping nothing has read yet, then the batch dropped (unmapped); "
        f"{result['cores']} cores, load average {result['loadavg'][0]:.1f} at start, "
        f"{result['loadavg'][1]:.1f} at the end; kernel {result['kernel']}; huge-page ring: "
        f"{result['huge_ring']}.",
        "",
        "*PMD kB*: of the batch's mapping, what 2 MiB page-table entries map (least over the "
        "batches); *resident kB*: what it maps at all (whole huge pages: the two are equal); "
        "*congruent*: address and file offset of the mapping agree modulo 2 MiB.",
        "",
        "| ring | mode | path | rank | touch ms p50 | touch ms min | drop ms p50 | faults p50 "
        "| PMD kB | resident kB | anonymous kB | congruent |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['ring']} | {r['mode']} | {r['path']} | {r['role']} | {r['touch_ms_p50']:.2f} "
            f"| {r['touch_ms_min']:.2f} | {r['drop_ms_p50']:.3f} | {r['faults_p50']:.0f} "
            f"| {r['pmd_kb_min']} | {r['rss_kb_max']} | {r['anon_kb_max']} "
            f"| {'yes' if r['congruent'] else 'no'} |"
        )
    lines += ["", "Paths (how the slot was written):", ""]
    lines += [f"- `{k}`: {v}" for k, v in PATHS.items()]
    lines += ["", "Modes:", ""] + [f"- `{k}`: {v}" for k, v in MODES.items()]
    if result["skipped"]:
        lines += ["", "Skipped:", ""]
        lines += [
            f"- {s['ring']} {s['mode']} {s['path']}: {s['reason']}" for s in result["skipped"]
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hugedir",
        description="What each rank pays to touch a delivered batch, per path and ring.",
    )
    p.add_argument("--mib", type=float, default=256.0, help="batch size in MiB (default 256)")
    p.add_argument("--batches", type=int, default=8, help="measured batches per run")
    p.add_argument("--warmup", type=int, default=2, help="batches not measured (slots grow)")
    p.add_argument("--paths", nargs="+", choices=tuple(PATHS), default=list(PATHS))
    p.add_argument("--rings", nargs="+", choices=RINGS, default=list(RINGS))
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch of ranks")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.batches < 1 or args.warmup < 0:
        p.error("--mib must be > 0, --batches >= 1 and --warmup >= 0")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shml-hugedir-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("SHMLOADER_QUIET", "1")
    os.makedirs(args.out, exist_ok=True)
    from tests.support.harness import RankFailure, run_ranks

    huge_dir, why = None, "not asked for (--rings)"
    if "huge" in args.rings:
        huge_dir, why = mount(int(24 * args.mib * MiB))  # the worker pool, grown once
    print(f"benchmarks.hugedir: huge-page ring: {why}; results go to {args.out}", file=sys.stderr)
    record = provenance.start("benchmarks.hugedir", argv)
    result: dict[str, Any] = {
        "command": record["command"],
        "provenance": record,
        "mib": args.mib,
        "batches": args.batches,
        "warmup": args.warmup,
        "cores": os.cpu_count(),
        "kernel": os.uname().release,
        "huge_ring": why,
        "loadavg": [os.getloadavg()[0]],
        "rows": [],
        "raw": [],
        "skipped": [],
    }
    try:
        for ring in args.rings:
            for mode in args.modes:
                for path in args.paths:
                    run = {"ring": ring, "mode": mode, "path": path}
                    if ring == "huge" and huge_dir is None:
                        result["skipped"].append({**run, "reason": why})
                        continue
                    env = {"SHMLOADER_SHM_DIR": huge_dir if ring == "huge" else "/dev/shm"}
                    kwargs = {"path": path, "mib": args.mib, "batches": args.batches,
                              "warmup": args.warmup, "mode": mode}  # fmt: skip
                    try:
                        ranks = run_ranks("benchmarks.hugedir:touch_rank", 2, kwargs=kwargs,
                                          env=env, timeout=args.timeout)  # fmt: skip
                    except RankFailure as exc:
                        reason = str(exc).strip().splitlines()[-1][:300]
                        result["skipped"].append({**run, "reason": reason})
                        continue
                    rows = summary(ring, mode, path, ranks)
                    result["rows"].extend(rows)
                    result["raw"].append({**run, "ranks": ranks})
                    for r in rows:
                        print(
                            f"{ring} {mode} {path} {r['role']}: touch p50 "
                            f"{r['touch_ms_p50']:.2f} ms, drop {r['drop_ms_p50']:.3f} ms, "
                            f"{r['faults_p50']:.0f} faults, {r['pmd_kb_min']} of "
                            f"{r['rss_kb_max']} kB in 2 MiB entries",
                            file=sys.stderr,
                        )
    finally:
        unmount(huge_dir)
    result["loadavg"].append(os.getloadavg()[0])
    provenance.finish(record)
    paths = [os.path.join(args.out, n) for n in ("hugedir.json", "hugedir.md")]
    with open(paths[0], "w") as fh:
        json.dump(result, fh, indent=1)
    with open(paths[1], "w") as fh:
        fh.write(markdown(result))
    for p in paths:
        print(f"wrote {os.path.abspath(p)}", file=sys.stderr)
    failed = [s for s in result["skipped"] if s["reason"] != why]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

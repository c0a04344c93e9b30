"""``python -m benchmarks.breakdown``: where a shmloader step's time goes.

Runs phase-A steps of the transport workload (see ``benchmarks.rank``) with
shmloader only, and times the library's internal steps by wrapping them at
run time (nothing in the library is changed on disk):

- follower ``next()``: flush of queued releases, the wait for the BATCH
  message (``Spoke.wait``), attaching the segment, the private mapping
  (``RingReader.view``), ``codec.decode``;
- dropping the previous batch (the unmapping of its private mapping);
- leader publish: ``codec.encode``, waiting for readers, ``RingWriter.acquire``
  (slot growth), ``codec.write_payload``, the announcement.

Also keeps a cProfile of the follower's ``next()`` calls. Prints the table
and writes ``breakdown.txt`` / ``breakdown.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from . import provenance
from .rank import Case, Recorder, Shared, now_ns, read_all
from .run import DEFAULT_OUT, launch, warm_starts
from .workload import BatchSpec, TemplatedBatches, transport_loader

MiB = 1 << 20


def _timed(fn: Callable[..., Any], acc: dict[str, list[float]], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name].append((time.perf_counter_ns() - t0) / 1e6)

    return wrapper


def targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of every library step the breakdown times."""
    from shmloader._node import ring
    from shmloader._proto import codec
    from shmloader._roles import follower, leader
    from shmloader._roles.node_writer import NodeWriter
    from shmloader._transport.channel import Spoke

    targets: list[tuple[Any, str, str]] = [
        (codec, "encode", "leader: codec.encode"),
        (codec, "write_payload", "leader: codec.write_payload"),
        (codec, "decode", "follower: codec.decode"),
        (ring.RingWriter, "acquire", "leader: RingWriter.acquire"),
        (ring.RingReader, "view", "follower: RingReader.view (mmap)"),
        (Spoke, "wait", "follower: Spoke.wait (BATCH message)"),
        (NodeWriter, "await_readers", "leader: _await_readers"),
        (NodeWriter, "announce", "leader: _announce"),
        (NodeWriter, "tell_readers", "leader: _tell_readers (announcement)"),
        (leader.Leader, "_publish", "leader: _publish (all)"),
        (follower.Follower, "_attach", "follower: _attach"),
        (follower._Releaser, "send", "follower: _Releaser.send (releases, requests)"),
    ]
    return targets


def missing_targets() -> list[str]:
    """Timed steps that no longer exist in the library (the smoke test keeps this empty)."""
    return [f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in targets() if not hasattr(o, a)]


def install(acc: dict[str, list[float]]) -> list[str]:
    """Wrap the library's internal steps with timers feeding ``acc`` (this process only).

    A step the library no longer has is skipped, never an ``AttributeError``;
    its name is returned (and printed by ``main``).
    """
    missing = []
    for owner, attr, name in targets():
        if not hasattr(owner, attr):
            missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            continue
        setattr(owner, attr, _timed(getattr(owner, attr), acc, name))
    return missing


def profile(rank: int, case: Case, group: dist.ProcessGroup, rec: Recorder) -> None:
    """Rank body (``Case.run == "profile"``): phase-A steps with timers and cProfile."""
    acc: dict[str, list[float]] = defaultdict(list)
    install(acc)
    spec = BatchSpec.for_bytes(case.target_bytes)
    way = Shared(rank, group, lambda: transport_loader(spec, case.total_batches, case.workers))
    prof = cProfile.Profile()
    prev: Any = None
    try:
        for i in range(case.warmup + case.steps):
            if i == case.warmup:
                acc.clear()
            way.prepare()
            way.settle()
            dist.barrier(group)
            measured = i >= case.warmup and rank != 0
            t0 = now_ns()
            if measured:
                prof.enable()
            batch, _ = way.take()
            if measured:
                prof.disable()
            acc["follower: next() total" if rank else "leader: take"].append((now_ns() - t0) / 1e6)
            dist.barrier(group)
            t0 = now_ns()
            prev = None
            acc["drop previous batch (unmap)"].append((now_ns() - t0) / 1e6)
            if rank:
                acc["follower: read every byte once"].append(read_all(batch))
            dist.barrier(group)
            prev = batch
            del batch
        del prev
        way.finish()
        dist.barrier(group)
    finally:
        way.close()
    rec.extra["breakdown"] = {k: v for k, v in acc.items() if v}
    if rank:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
        rec.extra["cprofile"] = out.getvalue()


def table(ranks: list[dict], steps: int) -> str:
    """Per rank: each timed step's calls, median and mean milliseconds per call."""
    import statistics

    lines = []
    for r in ranks:
        lines.append(f"rank {r['rank']} ({'leader' if r['rank'] == 0 else 'follower'})")
        lines.append(f"  {'step':44s} {'calls':>6s} {'p50 ms':>9s} {'mean ms':>9s} {'max ms':>9s}")
        for name, values in sorted(r.get("breakdown", {}).items()):
            lines.append(
                f"  {name:44s} {len(values):6d} {statistics.median(values):9.3f} "
                f"{statistics.fmean(values):9.3f} {max(values):9.3f}"
            )
    return "\n".join(lines)


def cache_effect(sizes: tuple[int, ...] = (1, 64, 256, 1024), repeats: int = 11) -> str:
    """Same follower-side decode, timed right after copying ``size`` MiB in this process.

    Nothing in ``codec.decode`` depends on the payload size; if its time
    grows with the bytes copied just before, the growth is the copy evicting
    the interpreter's working set from the caches.
    """
    import statistics

    import numpy as np

    from shmloader._proto import codec

    enc = codec.encode(TemplatedBatches(BatchSpec.for_bytes(MiB), 1).batch(0))
    payload = np.zeros(enc.nbytes, np.uint8)
    lines = ["codec.decode of the same 1 MiB batch's metadata, right after a copy of:"]
    for size in sizes:
        src, dst = np.ones(size * MiB, np.uint8), np.zeros(size * MiB, np.uint8)
        times = []
        for _ in range(repeats):
            np.copyto(dst, src)
            t0 = time.perf_counter_ns()
            codec.decode(enc.meta, payload)
            times.append((time.perf_counter_ns() - t0) / 1e6)
        lines.append(f"  {size:5d} MiB: p50 {statistics.median(times):.3f} ms")
        del src, dst
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__)
    p.add_argument("--size", type=int, default=256, help="batch MiB (default 256)")
    p.add_argument("--sp", type=int, default=4, help="SP group size (default 4)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--no-cache-effect", action="store_true", help="skip the cache-effect table")
    p.add_argument(
        "--warm-ranks",
        action="store_true",
        help="fork the ranks (and their workers' server) from a server that imported torch "
        "once, as benchmarks.run --quick does: a smoke run's start in seconds less",
    )
    args = p.parse_args(argv)
    if args.warm_ranks:
        warm_starts()
    record = provenance.start("benchmarks.breakdown", argv)
    missing = missing_targets()
    if missing:
        print(f"warning: not timed (gone from the library): {', '.join(missing)}", file=sys.stderr)
    os.environ["OMP_NUM_THREADS"] = "1"
    case = Case("profile", "shmloader", args.sp, args.size * MiB, args.warmup, args.steps, 1)
    ranks, error = launch(case, profile)
    if ranks is None:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    ranks.sort(key=lambda r: r["rank"])
    provenance.finish(record)
    text = (
        "\n".join(provenance.header(record)) + "\n\n"
        f"shmloader breakdown: SP{args.sp}, {args.size} MiB, {args.steps} steps, "
        f"load average {os.getloadavg()[0]:.2f}\n\n{table(ranks, args.steps)}\n\n"
        f"cProfile of rank 1's next() calls:\n{ranks[1].get('cprofile', '')}\n"
        f"{'' if args.no_cache_effect else cache_effect()}\n"
    )
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"breakdown_sp{args.sp}_{args.size}mib.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"breakdown_sp{args.sp}_{args.size}mib.json"), "w") as f:
        ranks_out = [{"rank": r["rank"], "breakdown": r.get("breakdown")} for r in ranks]
        json.dump({"provenance": record, "ranks": ranks_out}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

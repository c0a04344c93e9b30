"""What ``os.fork()`` costs a rank that holds delivered batches, sharing on and off.

``python -m benchmarks.forks [--mib 256] [--forks 5] [--out DIR]``: an SP2 group on
one node, fresh ranks per configuration, batches of one contiguous float32 tensor
of ``--mib`` MiB (a DataLoader with 2 workers when the loop runs ahead, none when
the leader stays in step). Each rank holds the last ``held`` batches it was handed
(1 or 3), waits until its loop has filled what it runs ahead, and forks ``--forks``
children one after the other, each rank in turn while the other waits::

    parent                                 child
    t0 = now; pid = os.fork()              (the fork handlers: copies of what the
    fork_ms = now - t0                      user holds; NOTE [batches cross a fork])
                                           private = Private_Dirty of smaps_rollup
                                           writes it to a pipe, _exit(0)

*fork ms* is the parent's wait in ``os.fork()`` (the child's copies included: the
parent returns once they are made); *child private MiB* is what the child has
that is its own (copied pages, and what the interpreter dirtied since the fork),
measured right after the fork. Sharing off a batch is a plain tensor: the child
shares its pages copy-on-write and copies nothing. Writes ``forks.json`` and
``forks.md`` to ``--out`` (default a new temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from . import provenance
from .hugedir import Filled  # sample i: a float32 tensor of nbytes filled with i

MiB = 1 << 20


def _private_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fork_rank(
    rank: int, world: int, *, mib: float, held: int, share: bool, ahead: bool, forks: int
) -> dict[str, Any]:
    """One rank: hold ``held`` batches, let the loop fill its queue, fork ``forks`` times."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shmloader import Config, ShmLoader

    workers = 2 if ahead else 0
    n = held + 4  # enough for the loop to fill its queue behind what is held
    loader = ShmLoader(
        lambda: DataLoader(Filled(n, int(mib * MiB)), batch_size=None, num_workers=workers),
        dist.group.WORLD,
        config=Config.from_env(enabled=share, ahead=ahead),
    )
    it = iter(loader)
    holding = [next(it) for _ in range(held)]
    deadline = time.monotonic() + 60
    depth = getattr(getattr(loader, "_ahead", None), "depth", 0)  # SHMLOADER_SLOTS - 1
    while loader.stats().get("ahead_ready", 0) < depth and time.monotonic() < deadline:
        time.sleep(0.05)
    queued = loader.stats().get("ahead_ready", 0)
    fork_ms, child_mib = [], []
    for turn in range(world):
        dist.barrier()
        if turn != rank:
            continue
        for _ in range(forks):
            read, write = os.pipe()
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    os.write(write, repr(_private_mib()).encode())
                finally:
                    os._exit(0)
            fork_ms.append((time.perf_counter() - t0) * 1e3)
            os.close(write)
            with os.fdopen(read) as f:
                child_mib.append(float(f.read() or "nan"))
            os.waitpid(pid, 0)
    dist.barrier()
    ok = all(float(b[0]) == float(i) for i, b in enumerate(holding))
    del holding
    for _ in it:
        pass
    loader.close()
    return {
        "rank": rank,
        "queued": queued,
        "fork_ms": fork_ms,
        "child_private_mib": child_mib,
        "batches_intact": ok,
    }


CONFIGS = [
    {"share": share, "ahead": ahead, "held": held}
    for share in (True, False)
    for ahead in (True, False)
    for held in (1, 3)
]


def summary(config: dict[str, Any], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in ranks:
        rows.append(
            {
                **config,
                "role": "leader" if r["rank"] == 0 else "follower",
                "queued": r["queued"],
                "fork_ms_p50": statistics.median(r["fork_ms"]),
                "fork_ms_max": max(r["fork_ms"]),
                "child_private_mib_p50": statistics.median(r["child_private_mib"]),
                "intact": r["batches_intact"],
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    record = result["provenance"]
    lines = [
        "# What os.fork() costs a rank holding batches",
        "",
        *provenance.header(record),
        "",
        f"SP2 on one node, {result['mib']:g} MiB batches (one float32 tensor), "
        f"{result['forks']} forks per rank and configuration, each rank in turn. *ahead*: the "
        "loop runs ahead (a DataLoader with 2 workers; *queued* batches ready behind what is "
        "held), else every rank in step (no workers, SHMLOADER_AHEAD=0). *held*: batches the "
        "user's code holds at the fork. *child private MiB*: `Private_Dirty` of the child "
        "right after the fork (its copies, and the interpreter's own pages it dirtied).",
        "",
        "| sharing | loop | held | rank | queued | fork ms p50 | fork ms max "
        "| child private MiB p50 | batches intact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {'on' if r['share'] else 'off'} | {'ahead' if r['ahead'] else 'in step'} "
            f"| {r['held']} | {r['role']} | {r['queued']} | {r['fork_ms_p50']:.1f} "
            f"| {r['fork_ms_max']:.1f} | {r['child_private_mib_p50']:.1f} "
            f"| {'yes' if r['intact'] else 'NO'} |"
        )
    if result["failed"]:
        lines += ["", "Failed:", ""] + [f"- {f}" for f in result["failed"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.forks",
        description="What os.fork() costs a rank holding delivered batches, sharing on and off.",
    )
    p.add_argument("--mib", type=float, default=256.0, help="batch size in MiB (default 256)")
    p.add_argument("--forks", type=int, default=5, help="forks per rank and configuration")
    p.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch of ranks")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.forks < 1:
        p.error("--mib must be > 0 and --forks >= 1")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shml-forks-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("SHMLOADER_QUIET", "1")
    os.makedirs(args.out, exist_ok=True)
    from tests.support.harness import RankFailure, run_ranks

    print(f"benchmarks.forks: {len(CONFIGS)} configurations; results go to {args.out}",
          file=sys.stderr)  # fmt: skip
    record = provenance.start("benchmarks.forks", argv)
    result: dict[str, Any] = {
        "command": record["command"],
        "provenance": record,
        "mib": args.mib,
        "forks": args.forks,
        "rows": [],
        "failed": [],
    }
    for config in CONFIGS:
        kwargs = {**config, "mib": args.mib, "forks": args.forks}
        try:
            ranks = run_ranks("benchmarks.forks:fork_rank", 2, kwargs=kwargs,
                              timeout=args.timeout, node_shm_size="8g")  # fmt: skip
        except RankFailure as exc:
            result["failed"].append(f"{config}: {str(exc).strip().splitlines()[-1][:300]}")
            continue
        rows = summary(config, ranks)
        result["rows"].extend(rows)
        for r in rows:
            print(
                f"sharing {'on' if r['share'] else 'off'}, "
                f"{'ahead' if r['ahead'] else 'in step'}, {r['held']} held, {r['role']}: "
                f"fork {r['fork_ms_p50']:.1f} ms, child {r['child_private_mib_p50']:.1f} MiB",
                file=sys.stderr,
            )
    provenance.finish(record)
    paths = [os.path.join(args.out, n) for n in ("forks.json", "forks.md")]
    with open(paths[0], "w") as fh:
        json.dump(result, fh, indent=1)
    with open(paths[1], "w") as fh:
        fh.write(markdown(result))
    for p in paths:
        print(f"wrote {os.path.abspath(p)}", file=sys.stderr)
    bad = [r for r in result["rows"] if not r["intact"]]
    return 1 if result["failed"] or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cross-node step against a plain gloo broadcast to every rank.

SP4 over two simulated nodes of two ranks each (each node with its own tmpfs
over /dev/shm in a private mount namespace, as in the tests; needs root). For
each batch size it reports the median time from "every rank asks" to "every
rank holds the batch" with shmloader (the leader writes its ring once, sends
the payload once to the other node's leader, which receives it into its own
ring; followers map), the same for a plain ``dist.broadcast`` of the payload
to the three other ranks, and the bytes that crossed between the nodes per
batch. Run: ``.venv/bin/python -m benchmarks.crossnode [--sizes MIB ...]
[--steps N] [--out FILE]`` (``--help`` for the defaults).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader

from . import provenance

MIB = 1 << 20


def bench(rank: int, world: int, *, size_mib: int, steps: int) -> dict:
    n = size_mib * MIB
    batches = [{"x": torch.full((n // 8,), i, dtype=torch.int64)} for i in range(2)]

    class Source:
        def __len__(self) -> int:
            return steps

        def __iter__(self):
            for i in range(steps):
                yield batches[i % 2]

    loader = ShmLoader(Source, dist.group.WORLD, config=Config.from_env(enabled=True))
    shared = []
    it = iter(loader)
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        batch = next(it)
        dist.barrier()  # every rank holds its batch
        shared.append(time.perf_counter() - t)
        del batch
    for _ in it:
        pass
    stats = loader.stats()
    loader.close()
    plain = []
    buf = batches[0]["x"].clone() if rank == 0 else torch.empty(n // 8, dtype=torch.int64)
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        plain.append(time.perf_counter() - t)
    return {
        "shm": statistics.median(shared[1:]),
        "plain": statistics.median(plain[1:]),
        "stats": stats,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.crossnode",
        description="SP4 over two simulated nodes (needs root: private tmpfs per node): "
        "shmloader's cross-node step against a plain gloo broadcast.",
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="batch sizes in MiB")
    p.add_argument("--steps", type=int, default=6, help="steps per size (the first is warm-up)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per size")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    p.add_argument("--node-shm", default="2g", help="tmpfs size of each simulated node's /dev/shm")
    args = p.parse_args(argv)
    if any(s < 1 for s in args.sizes):
        p.error(f"--sizes {args.sizes}: every size must be >= 1 MiB")
    if args.steps < 2:
        p.error(f"--steps {args.steps}: needs >= 2 (the first step is warm-up)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tests.support.harness import run_ranks

    record = provenance.start("benchmarks.crossnode", argv)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    emit("| batch MiB | shmloader step ms | plain broadcast to 3 ranks ms | MiB between nodes |")
    emit("| --- | --- | --- | --- |")
    for size in args.sizes:
        out = run_ranks(
            bench,
            4,
            kwargs={"size_mib": size, "steps": args.steps},
            nodes=[0, 0, 1, 1],
            timeout=args.timeout,
            node_shm_size=args.node_shm,
        )
        s = out[0]["stats"]
        sent = s["cross_node_bytes_sent"] / s["published"] / MIB
        emit(f"| {size} | {out[0]['shm'] * 1e3:.1f} | {out[0]['plain'] * 1e3:.1f} | {sent:.0f} |")
    if args.out is not None:  # the table, then what made it (provenance's two lines)
        with open(args.out, "w") as f:
            f.write("\n".join([*lines, "", *provenance.header(provenance.finish(record)), ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cross-node step against a plain gloo broadcast to every rank.

SP4 over two simulated nodes of two ranks each (each node with its own tmpfs
over /dev/shm in a private mount namespace, as in the tests; needs root). For
each batch size it reports the median time from "every rank asks" to "every
rank holds the batch" with shmloader (the leader writes its ring once, sends
the payload once to the other node's leader, which receives it into its own
ring; followers map), the same for a plain ``dist.broadcast`` of the payload
to the three other ranks, and the bytes that crossed between the nodes per
batch. Run: ``.venv/bin/python -m benchmarks.crossnode``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader

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


def main(argv: list[str] | None = None) -> None:
    import argparse

    from tests.harness import run_ranks

    p = argparse.ArgumentParser(prog="python -m benchmarks.crossnode", description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="batch MiB")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--node-shm", default="2g", help="tmpfs size of the simulated node")
    args = p.parse_args(argv)
    print("| batch MiB | shmloader step ms | plain broadcast to 3 ranks ms | MiB between nodes |")
    print("| --- | --- | --- | --- |")
    for size in args.sizes:
        out = run_ranks(
            bench,
            4,
            kwargs={"size_mib": size, "steps": args.steps},
            nodes=[0, 0, 1, 1],
            timeout=300,
            node_shm_size=args.node_shm,
        )
        s = out[0]["stats"]
        sent = s["cross_node_bytes_sent"] / s["published"] / MIB
        print(
            f"| {size} | {out[0]['shm'] * 1e3:.1f} | {out[0]['plain'] * 1e3:.1f} | {sent:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

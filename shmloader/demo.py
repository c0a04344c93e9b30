"""``shmloader demo``: the main job, end to end on one machine.

Starts ``--ranks`` local processes (gloo on loopback) split into SP groups of
``--sp``; each group's leader runs a real ``DataLoader`` with workers over a
synthetic long-context multimodal dataset (token ids, labels, position ids,
image tensors in bfloat16, per-sample metadata), and ``ShmLoader`` shares its
batches. Then the same ranks run the same job with every rank loading its
own batches. Each rank fingerprints every batch; the parent checks that all
SP peers received identical batches in both runs and prints a report.
Embedded mode: no daemon needed, nothing left in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from .errors import human_bytes


class LongContextMultimodal(torch.utils.data.Dataset):
    """Synthetic samples shaped like a long-context vision-language batch."""

    def __init__(self, samples: int, seq_len: int, image_size: int, images: int) -> None:
        self.samples, self.seq_len, self.image_size, self.images = (
            samples,
            seq_len,
            image_size,
            images,
        )

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 151_000, (self.seq_len,), generator=g)
        # "decode and resize" work a real pipeline would do per image
        raw = torch.rand(self.images, 3, self.image_size * 2, self.image_size * 2, generator=g)
        pixels = torch.nn.functional.avg_pool2d(raw, 2).to(torch.bfloat16)
        return {
            "input_ids": tokens,
            "pixel_values": pixels,
            "meta": {"id": i, "source": f"shard-{i % 7:03d}", "num_images": self.images},
        }


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = torch.stack([s["input_ids"] for s in samples])
    return {
        "input_ids": ids,
        "labels": ids,  # aliased, as many collators do
        "position_ids": torch.arange(ids.shape[1]).expand_as(ids),
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "meta": [s["meta"] for s in samples],
    }


def fingerprint(batch: Any) -> str:
    """A hash over every tensor's bytes and every leaf, in order."""
    h = hashlib.blake2b(digest_size=16)

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(str((obj.dtype, tuple(obj.shape))).encode())
            h.update(obj.contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k, v in obj.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)
        else:
            h.update(repr(obj).encode())

    walk(batch)
    return h.hexdigest()


def _rank(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    import torch.distributed as dist

    from . import Config, ShmLoader

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks
    )
    groups = [dist.new_group(list(range(s, s + args.sp))) for s in range(0, args.ranks, args.sp)]
    group = groups[rank // args.sp]
    dp, dp_rank = args.ranks // args.sp, rank // args.sp
    dataset = LongContextMultimodal(
        args.steps * dp * args.batch_size, args.seq_len, args.image_size, args.images
    )

    def make() -> torch.utils.data.DataLoader:
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=dp, rank=dp_rank, seed=0
        )
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=args.workers,
            collate_fn=collate,
            persistent_workers=args.workers > 0,
        )

    report: dict[str, Any] = {"rank": rank}
    for mode in ("shared", "alone"):
        cpu0 = time.process_time()
        loader = ShmLoader(make, group, config=Config.from_env(enabled=mode == "shared"))
        prints, waits = [], []
        t = time.perf_counter()
        for batch in loader:
            waits.append(time.perf_counter() - t)
            prints.append(fingerprint(batch))
            nbytes = sum(
                v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor)
            )
            del batch
            dist.barrier(group)  # a training step: SP peers move in lockstep
            t = time.perf_counter()
        stats = loader.stats()
        loader.close()
        report[mode] = {
            "role": loader.role,
            "prints": prints,
            "wait_ms": [w * 1e3 for w in waits],
            "stats": stats,
            "bytes": nbytes,
            "cpu_s": time.process_time() - cpu0,
        }
        dist.barrier()
    out.put(report)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4, help="local ranks to start (default 4)")
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel group size (default 2)")
    p.add_argument("--steps", type=int, default=8, help="batches per rank (default 8)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per sample (default 32768)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--images", type=int, default=4, help="images per sample (default 4)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per loading rank")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2 or args.sp < 2 or args.ranks % args.sp:
        print(
            f"--ranks ({args.ranks}) must be a multiple of --sp ({args.sp}), both >= 2",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("SHMLOADER", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    print(
        f"shmloader demo: {args.ranks} ranks, SP {args.sp}, {args.steps} steps, "
        f"{args.workers} workers per loading rank, seq_len {args.seq_len}, "
        f"{args.images} images of {args.image_size}px per sample"
    )
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(reports) < args.ranks and time.monotonic() < deadline:
            try:
                r = out.get(timeout=0.5)
                reports[r["rank"]] = r
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    if len(reports) < args.ranks:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        print(f"FAILED: only {sorted(reports)} reported (exit codes {codes})", file=sys.stderr)
        return 1
    return _report(args, reports)


def _report(args: argparse.Namespace, reports: dict[int, dict]) -> int:
    ok = True
    for start in range(0, args.ranks, args.sp):
        group = range(start, start + args.sp)
        for mode in ("shared", "alone"):
            prints = {r: reports[r][mode]["prints"] for r in group}
            if len({tuple(p) for p in prints.values()}) != 1 or not prints[start]:
                ok = False
                print(f"MISMATCH: SP group {list(group)} ({mode}) received different batches")
        if reports[start]["shared"]["prints"] != reports[start]["alone"]["prints"]:
            ok = False
            print(f"MISMATCH: SP group {list(group)}: shared batches differ from unshared ones")
    lead = reports[0]["shared"]
    followers = [reports[r]["shared"] for r in range(args.ranks) if r % args.sp]
    stats = lead["stats"]
    steps = stats.get("published", 0)
    publish_ms = stats.get("publish_ms_total", 0.0) / max(steps, 1)
    recv = [
        f["stats"].get("receive_ms_total", 0.0) / max(f["stats"].get("received", 1), 1)
        for f in followers
    ]
    alone_wait = [statistics.median(reports[r]["alone"]["wait_ms"]) for r in range(args.ranks)]
    alone_med = statistics.median(alone_wait)
    shared_wait = [
        statistics.median(reports[r]["shared"]["wait_ms"]) for r in range(args.ranks) if r % args.sp
    ]
    cpu_shared = sum(reports[r]["shared"]["cpu_s"] for r in range(args.ranks))
    cpu_alone = sum(reports[r]["alone"]["cpu_s"] for r in range(args.ranks))
    nbytes = lead["bytes"]
    payload = np.zeros(nbytes, np.uint8)
    t = time.perf_counter()
    for _ in range(3):
        payload.copy()
    memcpy_ms = (time.perf_counter() - t) / 3 * 1e3
    print()
    print(f"  steps per rank                  {steps}")
    print(f"  bytes per batch                 {human_bytes(nbytes)}")
    print(f"  plain memcpy of those bytes     {memcpy_ms:8.2f} ms")
    print(f"  leader publish (encode + write) {publish_ms:8.2f} ms  per batch, once per SP group")
    print(f"  follower receive (map + decode) {statistics.mean(recv):8.3f} ms  per batch")
    print(f"  follower wait for next batch    {statistics.median(shared_wait):8.2f} ms  (median)")
    print(f"  each rank loads its own: wait   {alone_med:8.2f} ms  (median)")
    print(f"  main-process CPU, all ranks     {cpu_shared:8.2f} s  vs {cpu_alone:.2f} s unshared")
    print(
        f"  DataLoaders started             {args.ranks // args.sp} shared vs {args.ranks} unshared"
    )
    print()
    print("OK: every SP peer received identical batches" if ok else "FAILED: batches differed")
    return 0 if ok else 1

"""``shmloader demo``: the main job, end to end on one machine.

It owns the demo: ``--ranks`` local processes (gloo on loopback) in SP groups of
``--sp``, each group's leader running a real ``DataLoader`` with workers over a
synthetic long-context multimodal dataset, once with ``ShmLoader`` and once with
every rank loading its own batches; each rank fingerprints every batch, and the
parent checks that SP peers received identical batches and prints what both
modes cost. Embedded mode: it needs no daemon and leaves nothing in
``/dev/shm``.
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

from ..errors import human_bytes


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

    from .. import Config, ShmLoader

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
        sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
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
        dist.barrier()  # both modes start together on every rank
        base_pss = _pss(os.getpid())
        cpu0 = time.process_time()
        t0 = t = time.perf_counter()
        loader = ShmLoader(make, group, config=Config.from_env(enabled=mode == "shared"))
        prints, waits, peak = [], [], 0
        first = None
        for batch in loader:
            waits.append(time.perf_counter() - t)
            if first is None:
                first = time.perf_counter() - t0
            prints.append(fingerprint(batch))
            nbytes = sum(
                v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor)
            )
            # this rank's tree (itself and its workers) while it holds a batch
            peak = max(peak, sum(_pss(pid) for pid in [os.getpid(), *_children()]) - base_pss)
            del batch
            time.sleep(args.compute_ms / 1e3)  # a training step's compute (a GPU's, say) ...
            dist.barrier(group)  # ... and its sync: SP peers move in lockstep
            t = time.perf_counter()
        workers = _children()  # persistent DataLoader workers, still alive
        worker_cpu = sum(_cpu_seconds(pid) for pid in workers)
        stats = loader.stats()
        report[mode] = {
            "role": loader.role,
            "prints": prints,
            "wait_ms": [w * 1e3 for w in waits],
            "stats": stats,
            "bytes": nbytes,
            "cpu_s": time.process_time() - cpu0,
            "worker_cpu_s": worker_cpu,
            "workers": len(workers),
            "loads": loader.is_leader,
            "first_s": first,
            "peak_bytes": peak,
        }
        loader.close()
        dist.barrier()
    out.put(report)
    dist.destroy_process_group()


def _children() -> list[int]:
    """Live child processes of this process (its DataLoader workers)."""
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pss(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes: shared pages counted once per node."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4, help="local ranks to start (default 4)")
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel group size (default 2)")
    p.add_argument("--steps", type=int, default=6, help="batches per rank (default 6)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per sample (default 32768)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--images", type=int, default=4, help="images per sample (default 4)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per loading rank")
    p.add_argument(
        "--compute-ms",
        type=float,
        default=100.0,
        help="each step's compute before it asks for the next batch (a sleep; default 100)",
    )
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
    load = os.getloadavg()  # the demo's times are of this machine as loaded: shown beside them
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
    return _report(args, reports, load)


# What the report sets side by side, measured in the same run for both modes:
# DataLoaders running and worker processes started (each rank's live
# children), CPU seconds of every process (each rank's own, plus its workers'
# user and system time read from ``/proc`` before they stop), node memory of
# loading (proportional set size of each rank and its workers above the
# rank's own before its loader started, peak per rank, summed: pages shared
# by several processes count once), time from construction to the first
# batch, and what each step waits in next() after its compute.
def _report(
    args: argparse.Namespace, reports: dict[int, dict], load: tuple[float, float, float]
) -> int:
    from ..config import Config

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
    shared_wait = [
        statistics.median(reports[r]["shared"]["wait_ms"]) for r in range(args.ranks) if r % args.sp
    ]
    nbytes = lead["bytes"]
    payload = np.zeros(nbytes, np.uint8)
    t = time.perf_counter()
    for _ in range(3):
        payload.copy()
    memcpy_ms = (time.perf_counter() - t) / 3 * 1e3

    def total(mode: str, key: str) -> float:
        return sum(reports[r][mode][key] for r in range(args.ranks))

    def cpu(mode: str) -> float:
        return total(mode, "cpu_s") + total(mode, "worker_cpu_s")

    def first(mode: str) -> float:
        return statistics.median(reports[r][mode]["first_s"] or 0.0 for r in range(args.ranks))

    rows = [
        ("DataLoaders running", "{:.0f}", total("shared", "loads"), total("alone", "loads")),
        (
            "worker processes started",
            "{:.0f}",
            total("shared", "workers"),
            total("alone", "workers"),
        ),
        ("CPU seconds, every process", "{:.2f} s", cpu("shared"), cpu("alone")),
        (
            "node memory of loading, peak",
            "{}",
            total("shared", "peak_bytes"),
            total("alone", "peak_bytes"),
        ),
        ("time to a usable batch", "{:.2f} s", first("shared"), first("alone")),
        (
            f"next() after {args.compute_ms:g} ms of compute",
            "{:.2f} ms",
            statistics.median(shared_wait),
            statistics.median(alone_wait),
        ),
    ]
    print()
    print(f"  {'measured in this run':32} {'shared':>12} {'unshared':>12}")
    for name, fmt, shared, alone in rows:
        cells = [human_bytes(int(v)) if fmt == "{}" else fmt.format(v) for v in (shared, alone)]
        print(f"  {name:32} {cells[0]:>12} {cells[1]:>12}")
    print()
    print("  CPU: ranks' and DataLoader workers' user + system time over the whole run;")
    print("  memory: proportional set size of every rank and worker above the rank's own")
    print("  before its loader started (shared pages counted once), its peak per rank,")
    print("  summed; time to a usable batch: construction to the first batch, median rank;")
    print("  next(): what a step waits for its batch, followers (shared) and every rank")
    print("  (unshared), median; shared, every rank's loop ran ahead during the compute.")
    print()
    # where each per-batch time is spent: a loop ahead of next() works on its own thread
    ahead = Config.from_env(enabled=True).ahead
    lead_on = "on its loop's thread" if ahead and args.workers else "in next()"
    recv_on = "on its loop's thread, ahead of" if ahead else "on the user's thread, in"
    write = "take the slot a worker wrote" if args.workers else "write the batch into a slot"
    fault = ", fault every page in" if ahead else ""
    pad = " " * 47
    print(f"  bytes per batch                 {human_bytes(nbytes)}, {steps} steps per rank")
    print(f"  plain memcpy of those bytes     {memcpy_ms:8.2f} ms  in the parent, after the run")
    print(
        f"  leader publish, mean            {publish_ms:8.2f} ms  per batch and SP group, {lead_on}"
    )
    print(f"{pad}({write}, announce it)")
    print(
        f"  follower receive, mean          {statistics.mean(recv):8.2f} ms  per batch, {recv_on}"
    )
    print(f"{pad}next() (ACK, map{fault}, decode)")
    end, cores = os.getloadavg()[0], os.cpu_count()
    print(
        f"  load average (1 min)            {load[0]:.2f} at the start, {end:.2f} at the end, "
        f"{cores} cores"
    )
    print("  (every time above is of this machine under that load)")
    print()
    print("OK: every SP peer received identical batches" if ok else "FAILED: batches differed")
    return 0 if ok else 1

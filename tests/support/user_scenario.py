"""One rank of the user scenario, run by torchrun from tests/faults/test_user_scenario.py.

What a user writes: a ShmLoader whose DataLoader has persistent workers,
iterated from a background prefetch thread; an epoch-level metric that keeps
every batch's ``labels``; and a rank that fails in the middle of epoch 2, so
that torchrun's agent stops the others with SIGTERM.

    python -m torch.distributed.run --standalone --nproc-per-node 3 \
        tests/support/user_scenario.py --out DIR --fail-rank R --fail-at N

Each rank writes ``DIR/rank<r>.json`` once epoch 1 is done (its pid, its
DataLoader workers' pids, ``loader.stats()``, the tokens of the segments its
processes own) and appends every pid it or its workers have to ``DIR/pids``.
Rank ``--fail-rank`` raises after ``--fail-at`` batches of epoch 2; the other
ranks block in the prefetch queue's consumer and are stopped by torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmLoader
from shmloader._node.segment import list_segments, read_header

SAMPLES = 48
BATCH = 4
#: 256 KiB of features per sample: a batch is far over the small-leaf threshold,
#: so only the labels (owned copies) may be kept without keeping a slot.
FEATURES = 64 << 10


class Data(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((FEATURES,), float(i)), "labels": torch.tensor([i, -i])}


def _note_pid(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def _worker_init(pids: str):
    def init(worker_id: int) -> None:
        _note_pid(pids)

    return init


def make_loader(pids: str):
    def factory() -> DataLoader:
        return DataLoader(
            Data(),
            batch_size=BATCH,
            num_workers=2,
            persistent_workers=True,
            worker_init_fn=_worker_init(pids),
        )

    return factory


class Prefetcher:
    """The common pattern: a thread iterates the loader into a bounded queue."""

    _END = object()

    def __init__(self, loader, depth: int = 2) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, args=(loader,), daemon=True)
        self.thread.start()

    def _run(self, loader) -> None:
        try:
            for batch in loader:
                self.queue.put(batch)
        except BaseException as exc:  # handed to the consumer
            self.queue.put(exc)
            return
        self.queue.put(self._END)

    def __iter__(self):
        while True:
            item = self.queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def own_tokens() -> list[str]:
    """Tokens of the /dev/shm segments whose owner is this process."""
    tokens = set()
    for name in list_segments():
        try:
            header = read_header(name)
        except Exception:
            continue
        if header.pid == os.getpid():
            tokens.add(header.token)
    return sorted(tokens)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, required=True)
    p.add_argument("--fail-at", type=int, default=2)
    # long enough that the others are still busy when torchrun's agent sees the failure
    p.add_argument("--step-s", type=float, default=1.0, help="compute time per step of epoch 2")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pids = os.path.join(a.out, "pids")
    _note_pid(pids)
    loader = ShmLoader(make_loader(pids), dist.group.WORLD)
    kept: list[torch.Tensor] = []  # the epoch-level metric keeps every batch's labels
    for epoch in range(2):
        loader.set_epoch(epoch)
        for step, batch in enumerate(Prefetcher(loader)):
            kept.append(batch["labels"])
            if epoch == 0 and step == 0:
                first_stats = loader.stats()
            assert batch["x"].shape == (BATCH, FEATURES)
            if epoch == 1:
                time.sleep(a.step_s)  # the step's compute: SIGTERM finds the others here
            if epoch == 1 and rank == a.fail_rank and step == a.fail_at:
                raise RuntimeError(f"rank {rank} fails in the middle of epoch 2 (as planned)")
        if epoch == 0:
            report = {
                "rank": rank,
                "pid": os.getpid(),
                "first_stats": first_stats,
                "stats": loader.stats(),
                "tokens": own_tokens(),
                "labels": sorted(int(t[0]) for b in kept for t in b),
            }
            with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
                json.dump(report, f)
            dist.barrier()  # every rank's report is written before anyone fails
    raise AssertionError("epoch 2 ended on a rank that was meant to be stopped")


if __name__ == "__main__":
    main()

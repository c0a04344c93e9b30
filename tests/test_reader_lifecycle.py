"""A reader's side of the protocol, pinned in real ranks: what a follower owes the writer
(ACKs, releases, stamps) and what a batch it holds owes the user after close().
"""

from __future__ import annotations

import gc
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from shmloader import Config, ShmLoader
from shmloader.errors import DivergenceError
from tests.harness import run_ranks

LEAF = 1 << 16  # float32 elements: 256 KiB, far above SHMLOADER_SMALL_COPY (a view)


class Filled(Dataset):
    """Sample ``i`` is a vector of ``i`` everywhere: a changed byte shows."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((LEAF,), float(i))


class EpochRange(Sampler):
    """``n`` indices per epoch, from ``100 * epoch``; ``n_of`` may change the count per epoch."""

    def __init__(self, n: int, n_of: dict[int, int] | None = None) -> None:
        self.n, self.n_of, self.epoch = n, n_of or {}, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(100 * self.epoch, 100 * self.epoch + len(self)))

    def __len__(self) -> int:
        return self.n_of.get(self.epoch, self.n)


def _loader(workers: int, n: int = 4, n_of: dict[int, int] | None = None) -> ShmLoader:
    def make() -> DataLoader:
        return DataLoader(
            Filled(), batch_size=1, sampler=EpochRange(n, n_of), num_workers=workers
        )

    return ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True))


# ------------------------------------------------------------ held past close()


def kept_past_close(rank: int, world: int, *, workers: int) -> list[str]:
    """The follower keeps every batch of epoch 0 and closes; the leader runs epoch 1."""
    loader = _loader(workers, n_of={1: 12, 2: 12})  # enough later batches to cycle any pool
    loader.set_epoch(0)
    kept = list(loader) if rank == 1 else []  # the leader keeps nothing: its holds go
    for _ in loader if rank == 0 else ():
        pass
    expected = [b.clone() for b in kept]
    if rank == 1:
        loader.close()  # its BYE drops its holds: the leader may rewrite those slots
    dist.barrier()
    if rank == 0:
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        loader.close()
    dist.barrier()
    changed = [
        f"batch {i}: {float(b[0, 0])} (was {float(e[0, 0])})"
        for i, (b, e) in enumerate(zip(kept, expected, strict=True))
        if not torch.equal(b, e)
    ]
    if rank == 1:
        loader.close()
    return changed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_held_past_close_never_changes(workers):
    assert run_ranks(kept_past_close, 2, kwargs={"workers": workers}) == [[], []]


# ------------------------------------------------------------- quiet at exit


def _hold_and_return(rank: int) -> None:
    loader = _loader(0)
    batch = next(iter(loader))
    assert batch.shape == (1, LEAF)
    # returns holding both: the frame drops the loader (its finalizer closes the
    # socket) and the batch (its release) in whichever order it likes


def dropped_with_its_batch(rank: int, world: int) -> list[str]:
    raised: list[str] = []
    previous, sys.unraisablehook = sys.unraisablehook, lambda u: raised.append(repr(u.exc_value))
    try:
        _hold_and_return(rank)
        gc.collect()
        time.sleep(0.2)  # a release racing the close would have failed by now
        gc.collect()
    finally:
        sys.unraisablehook = previous
    dist.barrier()
    return raised


@pytest.mark.timeout(60)
def test_a_release_after_the_loader_is_gone_is_silent():
    assert run_ranks(dropped_with_its_batch, 2) == [[], []]

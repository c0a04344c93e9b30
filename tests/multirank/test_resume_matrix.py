"""Mid-epoch resume is exact: every sampler kind x worker mode x sharing x kind of stop.

One SP2 launch (two ranks over gloo) runs every combination uninterrupted
for two epochs and saves, on every rank, ``state_dict()`` at three stops:
in epoch 0 (mid-window, ``accumulation_steps=2``), at the boundary between
the epochs (after epoch 0's loop ended) and in epoch 1 (mid-window). A
second launch (new processes, every generator reseeded as a restarted job
does) loads each state and finishes the run. Per batch, the resumed run
must repeat the uninterrupted one from the saved cursor on: the sample ids,
a random augmentation drawn in the dataset's ``__getitem__`` (in the
DataLoader's workers when it has any) and the step's own draws (dropout).

The one combination that cannot be exact is named in docs/user-guide.md: with
persistent workers, the workers' generators carry their state from one
epoch into the next, and no checkpoint holds it, so after a resume in a
later epoch only the ids and the step's draws repeat (the augmentation is
what fresh workers draw).
"""

from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import BalancedBatchSampler, Config, ShardedSampler, ShmLoader
from tests.support import ranks
from tests.support.harness import run_ranks

N, BATCH, K = 16, 2, 2  # samples, batch size (shuffle, sharded), accumulation steps
LENGTHS = [3 + (i * 7) % 11 for i in range(N)]  # token lengths for the balanced sampler
KINDS = ("shuffle", "sharded", "balanced")
WORKERS = ("0", "2", "2p")  # 2p: two persistent workers
STOPS = ("e0", "boundary", "e1")


class Augmented(Dataset):
    """A sample's id and a random augmentation drawn where the sample is made."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        # float64: one 64-bit draw, which followers can mirror when it is drawn in the
        # leader's main process (num_workers=0; NOTE [RNG mirroring])
        return {"id": i, "aug": torch.rand(1, dtype=torch.float64)}


def _collate(samples: list[dict]) -> dict:
    return {
        "ids": torch.tensor([s["id"] for s in samples]),
        "aug": torch.cat([s["aug"] for s in samples]),
    }


def _factory(kind: str, workers: str):
    num_workers = 0 if workers == "0" else 2
    extra = {"num_workers": num_workers, "collate_fn": _collate}
    if num_workers:
        extra["persistent_workers"] = workers == "2p"

    def make() -> DataLoader:
        ds = Augmented()
        if kind == "shuffle":
            return DataLoader(ds, batch_size=BATCH, shuffle=True, **extra)
        if kind == "sharded":
            sampler = ShardedSampler(ds, num_replicas=1, rank=0, seed=3)
            return DataLoader(ds, batch_size=BATCH, sampler=sampler, **extra)
        balanced = BalancedBatchSampler(LENGTHS, num_replicas=1, rank=0, max_tokens=24, seed=3)
        return DataLoader(ds, batch_sampler=balanced, **extra)

    return make


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _run(loader: ShmLoader, start: int, save=None) -> list:
    """Epochs ``start``..1; each batch's (epoch, ids, augmentation, step draws).

    ``len(loader)`` is recorded as ("len", epoch, length) after each ``set_epoch``.
    """
    records: list = []
    for epoch in range(start, 2):
        loader.set_epoch(epoch)
        records.append(("len", epoch, len(loader)))
        for batch in loader:
            step = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
            records.append((epoch, batch["ids"].tolist(), batch["aug"].tolist(), step))
            if save is not None:
                save(epoch, _batches(records), False)
        if save is not None:
            save(epoch, _batches(records), True)
    return records


def _batches(records: list) -> list:
    return [r for r in records if r[0] != "len"]


def _cells():
    return [(k, w, s) for k in KINDS for w in WORKERS for s in (True, False)]


def _full(loader: ShmLoader, path: str) -> list:
    """The uninterrupted run; ``state_dict()`` saved at each stop (``path % stop``)."""
    ends: list = []  # batches when epoch 0's loop ended

    def save(epoch: int, batches: list, ended: bool) -> None:
        seen = len(batches)
        if epoch == 0 and ended:
            ends.append(seen)
            torch.save(loader.state_dict(), path % "boundary")
        elif not ended and seen - sum(ends) == 3:  # mid-window: the cursor rounds down to 2
            torch.save(loader.state_dict(), path % f"e{epoch}")

    return _run(loader, 0, save)


def matrix_phase(rank: int, world: int, *, phase: str, ckpt_dir: str) -> dict:
    """``full``: every cell uninterrupted, states saved at each stop; ``resume``: each stop."""
    group, _ = ranks.sp_groups(world, world)
    out: dict = {}
    for kind, workers, share in _cells():
        cell = f"{kind}-{workers}-{'on' if share else 'off'}"
        make = _factory(kind, workers)
        config = Config.from_env(enabled=share)
        path = os.path.join(ckpt_dir, f"{cell}-%s-rank{rank}.pt")
        if phase == "full":
            _seed(7 + rank)
            loader = ShmLoader(make, group, accumulation_steps=K, config=config)
            out[cell] = _full(loader, path)
            loader.close()
            continue
        for stop in STOPS:
            state = torch.load(path % stop)
            _seed(1000 + rank)  # a restarted job: nothing of the old generators survives
            loader = ShmLoader(make, group, accumulation_steps=K, config=config)
            loader.load_state_dict(state)
            loaded = len(loader)  # before any set_epoch: the saved epoch's
            out[(cell, stop)] = (state, loaded, _run(loader, state["epoch"]))
            loader.close()
    return out


@pytest.mark.slow  # the whole matrix: 72 loaders in two launches (README: selections)
@pytest.mark.timeout(420)
def test_resume_matrix_is_exact_per_batch():
    # Both ranks on one simulated node with its own tmpfs (tests.support.harness): the 72
    # loaders of this test never meet another run's segments or reaping.
    with tempfile.TemporaryDirectory() as ckpt:
        kw = {"ckpt_dir": ckpt}
        full = run_ranks(matrix_phase, 2, kwargs={**kw, "phase": "full"}, timeout=200, nodes=[1, 1])
        resumed = run_ranks(
            matrix_phase, 2, kwargs={**kw, "phase": "resume"}, timeout=200, nodes=[1, 1]
        )
    failures = []
    for rank in range(2):
        for kind, workers, share in _cells():
            cell = f"{kind}-{workers}-{'on' if share else 'off'}"
            records = full[rank][cell]
            failures += _length_failures(records, f"rank {rank} {cell}")
            batches = _batches(records)
            for stop in STOPS:
                state, _, got = resumed[rank][(cell, stop)]
                first = next(i for i, r in enumerate(batches) if r[0] == state["epoch"])
                want, got = batches[first + state["batches"] :], _batches(got)
                if workers == "2p" and state["epoch"] > 0:  # workers' generators: see above
                    got = [(e, ids, None, step) for e, ids, _, step in got]
                    want = [(e, ids, None, step) for e, ids, _, step in want]
                if got != want:
                    bad = sum(g != w for g, w in zip(got, want, strict=False))
                    bad += abs(len(got) - len(want))
                    failures.append(f"rank {rank} {cell} stop {stop}: {bad}/{len(want)} batches")
            if share:  # len() after a resume: what the unshared resume says, on every rank
                off = cell[: -len("on")] + "off"
                for stop in STOPS:
                    _, on_loaded, on_run = resumed[rank][(cell, stop)]
                    _, off_loaded, off_run = resumed[rank][(off, stop)]
                    lens = [on_loaded] + [r for r in on_run if r[0] == "len"]
                    if lens != [off_loaded] + [r for r in off_run if r[0] == "len"]:
                        failures.append(f"rank {rank} {cell} stop {stop}: len {lens} vs unshared")
    assert not failures, f"{len(failures)} cells differ:\n" + "\n".join(failures)
    for rank in range(2):  # sharing changes neither the data nor any rank's generators
        for kind, workers in [(k, w) for k in KINDS for w in WORKERS]:
            on, off = full[rank][f"{kind}-{workers}-on"], full[rank][f"{kind}-{workers}-off"]
            if rank == 0:
                assert on == off, f"{kind}-{workers}: sharing changed the leader's run"
            else:  # the follower sees the leader's data; its own step draws are its own
                steps_on, steps_off = [r[3] for r in _batches(on)], [r[3] for r in _batches(off)]
                assert steps_on == steps_off, f"{kind}-{workers}: the follower's RNG"
                lens_on, lens_off = (
                    [r for r in on if r[0] == "len"],
                    [r for r in off if r[0] == "len"],
                )
                assert lens_on == lens_off, f"{kind}-{workers}: the follower's len()"


def _length_failures(records: list, where: str) -> list[str]:
    """``len(loader)`` after each ``set_epoch`` must be the batches that epoch delivered."""
    out = []
    for _, epoch, length in [r for r in records if r[0] == "len"]:
        arrived = sum(1 for r in records if r[0] == epoch)
        if length != arrived:
            out.append(f"{where}: len {length} in epoch {epoch}, {arrived} batches arrived")
    return out

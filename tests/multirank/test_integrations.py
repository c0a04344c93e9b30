"""Checkpoints through the frameworks (NOTE [per-rank state in frameworks]).

Real ``torch.distributed.checkpoint`` (DCP) and real accelerate, on 4 CPU
ranks over gloo (SP 2 x DP 2): a run stopped mid-epoch, saved through the
framework, resumed in new processes, delivers exactly the batches (and the
main-process RNG draws) of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from shmloader import Config, ShardedSampler, ShmLoader, TopologyMismatchError
from shmloader.integrations import dcp as shm_dcp
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

SP, N, EPOCHS = 2, 24, 2  # 12 samples per DP replica: 6 batches of 2 per epoch
STOP = 8  # batches delivered before the save: mid-way through the second epoch


def _loader(world: int, share: bool, num_workers: int = 0) -> ShmLoader:
    from shmloader import dp_topology_from_group

    group, _ = ranks.sp_groups(world, SP)
    replicas, dp_rank = dp_topology_from_group(group)

    def make() -> DataLoader:
        ds = ranks.Synthetic(N)
        sampler = ShardedSampler(ds, num_replicas=replicas, rank=dp_rank, seed=5)
        return DataLoader(
            ds, batch_size=2, sampler=sampler, num_workers=num_workers, collate_fn=ranks.collate
        )

    return ShmLoader(make, group, config=Config.from_env(enabled=share))


def _record(epoch: int, batch: dict) -> tuple:
    digest = hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest()
    return (epoch, batch["meta"].sample_ids, torch.rand(2).tolist(), digest)


def _run(loader: ShmLoader, start: int, stop: int | None, save: Any) -> list:
    """Train from epoch ``start``; after ``stop`` batches call ``save()`` and stop."""
    records = []
    for epoch in range(start, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            records.append(_record(epoch, batch))
            if len(records) == stop:
                save()
                return records
    return records


# ------------------------------------------------------------------ DCP


def dcp_phase(rank: int, world: int, *, phase: str, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp

    out = {}
    if phase == "first":
        torch.manual_seed(rank)
        with _loader(world, True) as loader:
            out["full"] = _run(loader, 0, None, None)
        torch.manual_seed(rank)
        with _loader(world, True) as loader:

            def save() -> None:
                dcp.save({"dataloader": shm_dcp.PerRankState(loader)}, checkpoint_id=ckpt)

            out["stop"] = _run(loader, 0, STOP, save)
    else:
        torch.manual_seed(1000 + rank)  # a new process: nothing of the old RNG survives
        with _loader(world, True) as loader:
            dcp.load({"dataloader": shm_dcp.PerRankState(loader)}, checkpoint_id=ckpt)
            start = loader.state_dict()["epoch"]
            out["resume"] = _run(loader, start, None, None)
    return out


def test_dcp_save_and_load_resume_every_rank_exactly_mid_epoch():
    with tempfile.TemporaryDirectory() as ckpt:
        first = run_ranks(dcp_phase, 4, kwargs={"phase": "first", "ckpt": ckpt}, timeout=280)
        second = run_ranks(dcp_phase, 4, kwargs={"phase": "resume", "ckpt": ckpt}, timeout=280)
    for rank in range(4):
        full = first[rank]["full"]
        assert len(full) == EPOCHS * N // (4 // SP) // 2
        assert first[rank]["stop"] == full[:STOP]
        assert second[rank]["resume"] == full[STOP:], f"rank {rank}"
    # SP peers got the same data; the two DP replicas different data
    assert [r[1] for r in first[0]["full"]] == [r[1] for r in first[1]["full"]]
    assert [r[1] for r in first[0]["full"]] != [r[1] for r in first[2]["full"]]


def test_per_rank_state_refuses_a_checkpoint_without_this_ranks_key():
    class Stub:
        def state_dict(self) -> dict:
            return {"format": "x", "n": torch.arange(3)}

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    stub = Stub()
    adapter = shm_dcp.PerRankState(stub)  # type: ignore[arg-type]
    saved = adapter.state_dict()
    assert list(saved) == ["rank0"] and isinstance(saved["rank0"], bytes)
    adapter.load_state_dict(saved)
    assert stub.loaded["format"] == "x" and torch.equal(stub.loaded["n"], torch.arange(3))
    with pytest.raises(TopologyMismatchError, match=r"no loader state for this rank \('rank0'"):
        adapter.load_state_dict({"rank1": saved["rank0"]})
    with pytest.raises(TopologyMismatchError, match="not the bytes"):
        adapter.load_state_dict({"rank0": {"format": "x"}})


# ------------------------------------------------------------------ accelerate


def _accelerator(rank: int, world: int) -> Any:
    """accelerate's MULTI_CPU state over the process group the harness made."""
    import os

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert (accelerator.num_processes, accelerator.process_index) == (world, rank)
    return accelerator


def accelerate_phase(rank: int, world: int, *, phase: str, ckpt: str) -> dict:
    from shmloader.integrations.accelerate import AllRanksState

    accelerator = _accelerator(rank, world)
    out: dict = {}
    if phase == "first":
        torch.manual_seed(rank)
        with _loader(world, True) as loader:
            out["full"] = _run(loader, 0, None, None)
        torch.manual_seed(rank)
        with _loader(world, True) as loader:
            out["prepared_is_loader"] = accelerator.prepare(loader) is loader
            accelerator.register_for_checkpointing(AllRanksState(loader))
            out["stop"] = _run(loader, 0, STOP, lambda: accelerator.save_state(ckpt))
    else:
        torch.manual_seed(1000 + rank)
        with _loader(world, True) as loader:
            accelerator.register_for_checkpointing(AllRanksState(loader))
            accelerator.load_state(ckpt)
            out["resume"] = _run(loader, loader.state_dict()["epoch"], None, None)
    return out


def test_accelerate_save_state_and_load_state_resume_every_rank_exactly_mid_epoch():
    pytest.importorskip("accelerate")
    with tempfile.TemporaryDirectory() as ckpt:
        kw = {"ckpt": f"{ckpt}/state"}
        first = run_ranks(accelerate_phase, 4, kwargs={**kw, "phase": "first"}, timeout=280)
        second = run_ranks(accelerate_phase, 4, kwargs={**kw, "phase": "resume"}, timeout=280)
    for rank in range(4):
        assert first[rank]["prepared_is_loader"]  # prepare() hands a ShmLoader back as it is
        full = first[rank]["full"]
        assert first[rank]["stop"] == full[:STOP]
        assert second[rank]["resume"] == full[STOP:], f"rank {rank}"


def test_all_ranks_state_alone_and_its_refusals():
    from shmloader.integrations.accelerate import AllRanksState

    loader = ShmLoader(lambda: [torch.ones(1)] * 3, None)
    it = iter(loader)
    next(it)
    state = AllRanksState(loader).state_dict()
    assert set(state) == {"format", "world", "rank0"} and state["world"] == 1
    fresh = ShmLoader(lambda: [torch.ones(1)] * 3, None)
    AllRanksState(fresh).load_state_dict(state)
    assert len(list(fresh)) == 2  # resumed after the one batch delivered
    with pytest.raises(TopologyMismatchError, match="not the loader itself"):
        AllRanksState(fresh).load_state_dict(loader.state_dict())
    with pytest.raises(TopologyMismatchError, match="no loader state for 'rank0'"):
        AllRanksState(fresh).load_state_dict({"format": state["format"], "world": 1})
    loader.close()
    fresh.close()


def test_all_ranks_state_under_another_world_size_loads_rank_0s_on_every_rank():
    from shmloader.integrations.accelerate import FORMAT, AllRanksState

    class Stub:
        loaded = None

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    saved = {"format": FORMAT, "world": 4}
    saved |= {f"rank{r}": shm_dcp.dumps({"saved_by": r}) for r in range(4)}
    stub = Stub()
    AllRanksState(stub).load_state_dict(saved)  # type: ignore[arg-type]  # this world: 1 rank
    assert stub.loaded == {"saved_by": 0}  # a DP resize: the state ShardedSampler re-splits
    saved["world"] = 1
    saved["rank0"] = shm_dcp.dumps({"saved_by": "the same world"})
    AllRanksState(stub).load_state_dict(saved)  # type: ignore[arg-type]
    assert stub.loaded == {"saved_by": "the same world"}

"""Training fidelity: RNG parity with unshared loading, epochs, length, checkpoint/resume."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shmloader import Config, ShmLoader
from tests.multirank.test_sharing import assert_same
from tests.support import ranks
from tests.support.harness import run_ranks

# ------------------------------------------------------------------ rank code


def _shuffled_loader(num_workers: int, persistent: bool, n: int = 12):
    def make() -> DataLoader:
        # RandomSampler without a generator: draws its shuffle seed from the
        # default generator every epoch, on top of the base-seed draws.
        return DataLoader(
            ranks.Synthetic(n),
            batch_size=2,
            shuffle=True,
            num_workers=num_workers,
            persistent_workers=persistent,
            collate_fn=ranks.collate,
        )

    return make


def rng_run(rank: int, world: int, *, num_workers: int, persistent: bool, share: bool) -> dict:
    torch.manual_seed(1234 + 7 * rank)  # every rank's generator differs, as in real jobs
    loader = ShmLoader(
        _shuffled_loader(num_workers, persistent),
        dist.group.WORLD,
        config=Config.from_env(enabled=share),
    )
    states, drawn, order = [], [], []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            drawn.append(torch.rand(2))  # the training step's own randomness (dropout...)
            order.append(batch["meta"].sample_ids)
        states.append(torch.get_rng_state())
    loader.close()
    return {"states": states, "drawn": drawn, "order": order}


def rng_both(rank: int, world: int, **kw) -> dict:
    return {
        "alone": rng_run(rank, world, share=False, **kw),
        "shared": rng_run(rank, world, share=True, **kw),
    }


def empty_epochs(rank: int, world: int, *, share: bool) -> dict:
    """Epochs without a batch: ``iter()`` still draws the DataLoader's base seed."""
    torch.manual_seed(99 + rank)
    before = torch.get_rng_state()
    loader = ShmLoader(
        lambda: DataLoader(ranks.Synthetic(0), batch_size=2, collate_fn=ranks.collate),
        dist.group.WORLD,
        config=Config.from_env(enabled=share),
    )
    out = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        out.append((sum(1 for _ in loader), torch.get_rng_state()))
    loader.close()
    return {"before": before, "epochs": out}


def checkpoint_run(
    rank: int,
    world: int,
    *,
    sp: int,
    kind: str,
    num_workers: int,
    share: bool,
    stop_at: int | None,
    ckpt_dir: str,
    resume: bool,
    accumulation_steps: int = 2,
) -> dict:
    """Run 2 epochs; optionally stop after ``stop_at`` batches and save, or resume."""
    group, _ = ranks.sp_groups(world, sp)
    loader = ShmLoader(
        ranks.make_loader_factory(num_workers, n=20),
        group,
        accumulation_steps=accumulation_steps,
        config=Config.from_env(enabled=share),
    )
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    start_epoch = 0
    if resume:
        state = torch.load(path, weights_only=False)
        loader.load_state_dict(state)
        start_epoch = state["epoch"]
    seen, delivered = [], 0
    for epoch in range(start_epoch, 2):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(ranks.to_plain(batch))
            delivered += 1
            if stop_at is not None and delivered == stop_at:
                torch.save(loader.state_dict(), path)
                state = loader.state_dict()
                loader.close()
                return {"seen": seen, "state": state}
    loader.close()
    return {"seen": seen, "state": None}


def load_mismatch(rank: int, world: int, *, ckpt_dir: str) -> str:
    group, _ = ranks.sp_groups(world, 4)
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=8), group, config=Config.from_env(enabled=True)
    )
    try:
        loader.load_state_dict(
            torch.load(os.path.join(ckpt_dir, f"rank{rank}.pt"), weights_only=False)
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        loader.close()
    return "loaded"


def restart_mid_epoch(rank: int, world: int) -> dict:
    """A total-steps loop: iteration restarts mid-epoch, every rank in step."""
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=20), dist.group.WORLD, config=Config.from_env(enabled=True)
    )
    got = []
    for _ in range(3):
        for i, batch in enumerate(loader):
            got.append(batch["meta"].sample_ids)
            if i == 2:
                break
    length = len(loader)
    full = [b["meta"].sample_ids for b in loader]
    loader.close()
    return {"got": got, "len": length, "full": full}


# ------------------------------------------------------------------ tests


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "num_workers,persistent",
    [(0, False), (2, False), (2, True)],
    ids=["workers0", "workers2", "workers2-persistent"],
)
def test_rng_state_matches_unshared_at_every_epoch_end(num_workers, persistent):
    out = run_ranks(rng_both, 2, kwargs={"num_workers": num_workers, "persistent": persistent})
    for rank, o in enumerate(out):
        for epoch, (s, a) in enumerate(
            zip(o["shared"]["states"], o["alone"]["states"], strict=True)
        ):
            assert torch.equal(s, a), (
                f"rank {rank}: RNG differs from sharing-off after epoch {epoch}"
            )
        for s, a in zip(o["shared"]["drawn"], o["alone"]["drawn"], strict=True):
            assert torch.equal(s, a), f"rank {rank}: the training step drew different numbers"
    assert out[0]["shared"]["order"] == out[0]["alone"]["order"], "the leader's data changed"
    # the followers' order equals the leader's (shuffled with the leader's RNG)
    assert out[0]["shared"]["order"] == out[1]["shared"]["order"]


@pytest.mark.timeout(180)
def test_an_epoch_without_batches_mirrors_the_draws_of_iter():
    # the END message carries the draws of an epoch that ended before its first batch
    alone = run_ranks(empty_epochs, 2, kwargs={"share": False})
    shared = run_ranks(empty_epochs, 2, kwargs={"share": True})
    for rank in range(2):
        assert [n for n, _ in shared[rank]["epochs"]] == [0, 0]
        assert not torch.equal(alone[rank]["epochs"][0][1], alone[rank]["before"])  # it draws
        for (_, a), (_, s) in zip(alone[rank]["epochs"], shared[rank]["epochs"], strict=True):
            assert torch.equal(a, s), f"rank {rank}: RNG differs from sharing-off"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "share,kind,num_workers",
    [(True, "dataloader", 2), (False, "dataloader", 0)],
    ids=["dataloader-2-shared", "dataloader-0-unshared"],
)
def test_resume_continues_exactly_like_an_uninterrupted_run(share, kind, num_workers):
    # DP2 x SP2 with the rich batch; two corners of the grid: every sampler x workers x
    # sharing x stop combination is compared per batch in tests/multirank/test_resume_matrix.py.
    # torchdata's StatefulDataLoader (its own state restored): tests/multirank/test_checkpoint.py
    world, sp, k = 4, 2, 2
    base = {
        "sp": sp,
        "kind": kind,
        "num_workers": num_workers,
        "share": share,
        "accumulation_steps": k,
    }
    with tempfile.TemporaryDirectory() as ckpt:
        full = run_ranks(
            checkpoint_run,
            world,
            kwargs={**base, "stop_at": None, "ckpt_dir": ckpt, "resume": False},
        )
        stop = 7  # mid optimizer step (k=2): the checkpoint must rewind to batch 6
        first = run_ranks(
            checkpoint_run,
            world,
            kwargs={**base, "stop_at": stop, "ckpt_dir": ckpt, "resume": False},
        )
        second = run_ranks(
            checkpoint_run,
            world,
            kwargs={**base, "stop_at": None, "ckpt_dir": ckpt, "resume": True},
        )
    per_epoch = len(full[0]["seen"]) // 2
    for rank in range(world):
        state = first[rank]["state"]
        epoch, position = divmod(stop, per_epoch)
        assert state["epoch"] == epoch
        assert state["batches"] == position - position % k, "not rewound to the optimizer step"
        cursor = state["batches"] + state["epoch"] * per_epoch
        assert "loader" not in state
        expected = full[rank]["seen"][cursor:]
        assert len(second[rank]["seen"]) == len(expected) > 0
        for step, (x, y) in enumerate(zip(second[rank]["seen"], expected, strict=True)):
            assert_same(x, y, f"rank {rank} resumed step {step}")
        assert state["topology"]["sp"] == sp and state["topology"]["world"] == world


@pytest.mark.timeout(120)
def test_sp2_checkpoint_is_refused_under_sp4():
    base = {"sp": 2, "kind": "dataloader", "num_workers": 0, "share": True, "resume": False}
    with tempfile.TemporaryDirectory() as ckpt:
        run_ranks(checkpoint_run, 4, kwargs={**base, "stop_at": 2, "ckpt_dir": ckpt})
        out = run_ranks(load_mismatch, 4, kwargs={"ckpt_dir": ckpt})
    for msg in out:
        assert msg.startswith("TopologyMismatchError") and "sp: checkpoint 2, now 4" in msg


@pytest.mark.timeout(120)
def test_restarting_iteration_mid_epoch_keeps_every_rank_in_step():
    out = run_ranks(restart_mid_epoch, 3)
    assert out[0]["got"] == out[1]["got"] == out[2]["got"]
    assert len(out[0]["got"]) == 9
    assert out[0]["len"] == out[1]["len"] == out[2]["len"] == 10
    assert out[0]["full"] == out[1]["full"] == out[2]["full"] and len(out[0]["full"]) == 10


def test_state_is_validated_before_anything_changes():
    from shmloader.errors import ConfigError, LoaderStateError, TopologyMismatchError

    loader = ShmLoader(ranks.make_loader_factory(0, n=8), None, config=Config(enabled=False))
    good = loader.state_dict()
    bad = [
        ("state", []),
        ("state['format']", {**good, "format": "other"}),
        ("state['epoch']", {**good, "epoch": -1}),
        ("state['batches']", {**good, "batches": "3"}),
        ("state['accumulation_steps']", {**good, "accumulation_steps": 0}),
        ("state['topology']", {**good, "topology": None}),
    ]
    for name, state in bad:
        with pytest.raises(ConfigError, match=name.replace("[", r"\[").replace("]", r"\]")):
            loader.load_state_dict(state)
        now = loader.state_dict()
        assert torch.equal(now.pop("rng")["torch"], good["rng"]["torch"])
        assert now == {k: v for k, v in good.items() if k != "rng"}, "a refused state changed"
    with pytest.raises(TopologyMismatchError, match="world"):
        loader.load_state_dict({**good, "topology": {**good["topology"], "world": 8}})
    loader.load_state_dict({**good, "epoch": 1, "batches": 2})
    assert loader.state_dict()["batches"] == 2, "a loaded cursor is reported before iterating"
    resumed = [b["meta"].sample_ids for b in loader]
    fresh = ShmLoader(ranks.make_loader_factory(0, n=8), None, config=Config(enabled=False))
    fresh.set_epoch(1)
    assert resumed == [b["meta"].sample_ids for b in fresh][2:] and len(resumed) == 2
    fresh.close()
    with pytest.raises(LoaderStateError, match="before the first iteration"):
        loader.load_state_dict(good)
    loader.close()

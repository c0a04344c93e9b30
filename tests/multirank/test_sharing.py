"""Multi-process: batches shared inside one node equal what every rank loads itself."""

from __future__ import annotations

import pytest
import torch

from tests.support import ranks
from tests.support.harness import run_ranks


def assert_same(a, b, where=""):
    """Deep equality of two batches, tensors compared bitwise with dtype and shape."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bool else a,
            b.view(torch.uint8) if b.dtype == torch.bool else b,
        ), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        assert a == b, where
    elif hasattr(a, "dtype"):  # numpy
        assert a.dtype == b.dtype and (a == b).all(), where
    else:
        assert a == b, where


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,sp", [(4, 2), (4, 4)], ids=["dp2xsp2", "dp1xsp4"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shared_batches_equal_unshared(world, sp, num_workers):
    kwargs = {"sp": sp, "num_workers": num_workers}
    shared = run_ranks(ranks.deliver, world, kwargs={**kwargs, "share": True})
    alone = run_ranks(ranks.deliver, world, kwargs={**kwargs, "share": False})
    for rank in range(world):
        s, a = shared[rank], alone[rank]
        assert len(s["batches"]) == len(a["batches"]) > 0
        for step, (x, y) in enumerate(zip(s["batches"], a["batches"], strict=True)):
            assert_same(x, y, f"rank {rank} step {step}")
        assert all(s["aliases"]), "labels must stay the same object as input_ids"
        assert s["len"] == a["len"]
        leader = rank % sp == 0
        assert s["role"] == ("leader" if leader else "follower")
        assert s["made"] == (1 if leader else 0), "followers must never call make_loader"
    # SP peers got identical batches; DP replicas got different ones
    for group_start in range(0, world, sp):
        for peer in range(group_start + 1, group_start + sp):
            for x, y in zip(shared[group_start]["batches"], shared[peer]["batches"], strict=True):
                assert_same(x, y)
    if world // sp > 1:
        assert not torch.equal(
            shared[0]["batches"][0]["input_ids"], shared[sp]["batches"][0]["input_ids"]
        )
    leader_stats = shared[0]["stats"]
    assert leader_stats["published"] == len(shared[0]["batches"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copy", [False, True], ids=["views", "SHMLOADER_COPY"])
def test_followers_write_privately_and_held_batches_never_change(copy):
    steps = 7  # more than twice the ring's 2 slots
    out = run_ranks(ranks.hold_and_write, 3, kwargs={"sp": 3, "steps": steps, "copy": copy})
    for rank, r in enumerate(out):
        assert r["unchanged"], f"rank {rank}: a held batch changed under it"
        assert r["own_writes_kept"], f"rank {rank}: its own in-place writes were lost"
    # the leader's snapshots show that nobody's writes reached it
    for step, snap in enumerate(out[0]["snapshots"]):
        assert int(snap["input_ids"].min()) >= 0, (
            f"a follower's write leaked to the leader at {step}"
        )
        for rank in (1, 2):
            assert torch.equal(
                snap["pixel_values"].right, out[rank]["snapshots"][step]["pixel_values"].right
            )
    if copy:  # owned copies release their slot at once: the ring stays at its window
        assert out[0]["stats"]["ring_slots"] <= 3
    else:
        assert out[0]["stats"]["ring_slots"] >= steps, "held batches must grow the ring"


@pytest.mark.timeout(120)
def test_sharded_sampler_sp_peers_draw_identical_indices_with_and_without_sharing():
    out = run_ranks(ranks.sharded_both, 4, kwargs={"sp": 2})
    for rank in range(4):
        assert out[rank]["shared"] == out[rank]["alone"], f"rank {rank}"
    assert out[0]["shared"] == out[1]["shared"] and out[2]["shared"] == out[3]["shared"]
    epoch0 = [i for step in out[0]["shared"][:6] for i in step] + [
        i for step in out[2]["shared"][:6] for i in step
    ]
    assert set(epoch0) == set(range(21)), "the two DP replicas together cover the dataset"


@pytest.mark.timeout(60)
def test_batches_held_past_close_release_silently():
    assert run_ranks(ranks.keep_past_close, 3) == [[], [], []]

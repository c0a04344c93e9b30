"""The checkpoint recipe: per-rank state, RNG at the step boundary, DP resize, torchdata.

A "training step" here draws from every default generator (torch, Python's
``random``, numpy), as dropout or augmentation in the main process would; a
resumed run must replay the same batches *and* the same draws as an
uninterrupted one.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import tempfile

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shmloader import Config, ShardedSampler, ShmLoader, TopologyMismatchError
from shmloader.errors import ConfigError
from tests.support import ranks
from tests.support.fake_device import FakeOps
from tests.support.harness import run_ranks

SP, K, N = 2, 2, 24  # SP size, accumulation steps, samples (12 per replica at DP 2: 6 batches)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _factory(kind: str, num_workers: int, num_replicas: int, dp_rank: int):
    def make():
        ds = ranks.Synthetic(N)
        sampler = ShardedSampler(ds, num_replicas=num_replicas, rank=dp_rank, seed=11)
        cls = DataLoader
        if kind == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader as cls
        return cls(
            ds, batch_size=2, sampler=sampler, num_workers=num_workers, collate_fn=ranks.collate
        )

    return make


def _digest(batch: dict) -> str:
    """SHA-1 of every tensor's bytes, dtype and shape: the batch bit for bit."""
    h = hashlib.sha1()
    for key in sorted(batch):
        value = batch[key]
        for t in value if isinstance(value, tuple | list) else [value]:
            if isinstance(t, torch.Tensor):
                t = t.contiguous()
                h.update(f"{key}{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _roundtrip(state: dict) -> dict:
    """As a checkpoint file would: torch.save, then torch.load with its safe default."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(
    rank: int,
    world: int,
    *,
    kind: str,
    num_workers: int,
    share: bool,
    stop: int | None = None,
    state: dict | None = None,
    epochs: int = 2,
    prefetch: int | None = None,
    k: int = K,
) -> dict:
    """Iterate ``epochs``; each batch's record is its ids, the step's draws and its digest.

    ``prefetch``: deliver through a fake device (``tests.support.fake_device``) that
    many batches ahead of the user, as ``device="cuda"`` does. ``world`` 1:
    this process alone, no ``torch.distributed``.
    """
    from shmloader import dp_topology_from_group

    group, num_replicas, dp_rank = None, 1, 0
    if world > 1:
        group, _ = ranks.sp_groups(world, SP)
        num_replicas, dp_rank = dp_topology_from_group(group)
    extra: dict = {}
    if prefetch is not None:
        extra["device"] = FakeOps(auto=True)
    loader = ShmLoader(
        _factory(kind, num_workers, num_replicas, dp_rank),
        group,
        accumulation_steps=k,
        config=Config.from_env(enabled=share, prefetch=prefetch or 2),
        **extra,
    )
    start = 0
    if state is not None:
        _seed_all(1000 + rank)  # a new process: nothing of the old RNG survives
        loader.load_state_dict(state)
        start = state["epoch"]
    else:
        _seed_all(rank)
    records, delivered = [], 0
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            draws = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
            records.append((epoch, batch["meta"].sample_ids, draws, _digest(batch)))
            delivered += 1
            if delivered == stop:
                saved = _roundtrip(loader.state_dict())
                loader.close()
                return {"records": records, "state": saved}
    loader.close()
    return {"records": records, "state": None, "after": torch.rand(2).tolist()}


def resume_matrix(
    rank: int, world: int, *, kind: str, num_workers: int, stops: list, prefetch: int | None = None
) -> dict:
    """Uninterrupted, then for each stop: run to it, save, resume (shared, unshared, crossed)."""
    out: dict = {}
    for share in (True, False):
        common = {"kind": kind, "num_workers": num_workers, "prefetch": prefetch}
        out[("full", share)] = _train(rank, world, share=share, **common)
        for stop in stops:
            first = _train(rank, world, share=share, stop=stop, **common)
            out[("first", share, stop)] = first
            resume_share = share if stop % 2 else not share  # odd stops resume crossed
            out[("second", share, stop)] = _train(
                rank, world, share=resume_share, state=first["state"], **common
            )
    return out


def _assert_resumed(
    full: dict, first: dict, second: dict, where: str, *, replicas: int = 4 // SP, k: int = K
) -> None:
    state = first["state"]
    per_epoch = N // replicas // 2
    stop = len(first["records"])
    epoch, position = divmod(stop, per_epoch)
    if position == 0 and stop:  # saved after an epoch's last batch, before its END
        epoch, position = epoch - 1, per_epoch
    assert (state["epoch"], state["batches"]) == (epoch, position - position % k), where
    cursor = state["epoch"] * per_epoch + state["batches"]
    expected = full["records"][cursor:]
    assert len(second["records"]) == len(expected) > 0, where
    for i, (got, want) in enumerate(zip(second["records"], expected, strict=True)):
        assert got == want, f"{where}: resumed batch {i} (ids, dropout draws, bytes) differ"
    assert second["after"] == full["after"], f"{where}: RNG after the run differs"


STOPS = [1, 3, 6, 8, 9]  # mid-window at 0 | mid-window | epoch end | boundary | mid-window


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefetch", [None, 2], ids=["host", "device-prefetch-2"])
def test_resume_with_dropout_is_exact_at_every_kind_of_stop(prefetch):
    # With a device, each rank pulls ``prefetch`` batches ahead of the user: the state
    # must still be the user's position, with the RNG as it was there, and the
    # prefetched-but-undelivered batches must come again after the resume.
    out = run_ranks(
        resume_matrix,
        4,
        kwargs={"kind": "dataloader", "num_workers": 0, "stops": STOPS, "prefetch": prefetch},
        timeout=280,
    )
    for rank, o in enumerate(out):
        for share in (True, False):
            for stop in STOPS:
                _assert_resumed(
                    o[("full", share)],
                    o[("first", share, stop)],
                    o[("second", share, stop)],
                    f"rank {rank} share={share} stop={stop}",
                )
        full_on, full_off = out[rank][("full", True)], out[rank][("full", False)]
        assert full_on["records"] == full_off["records"], "sharing changed data or RNG"


# ------------------------------------------------------------------ torchdata, real exits


def torchdata_phase(
    rank: int, world: int, *, phase: str, ckpt_dir: str, prefetch: int | None = None
) -> dict:
    """``first``: an uninterrupted run, then one stopped mid-window; ``resume``: a new process."""
    out = {}
    for share in (True, False):
        common = {"kind": "torchdata", "num_workers": 2, "share": share, "prefetch": prefetch}
        path = os.path.join(ckpt_dir, f"{share}-loader-rank{rank}.pt")
        if phase == "first":
            out[("full", share)] = _train(rank, world, **common)
            out[("stop", share)] = _train(rank, world, stop=9, **common)
            torch.save(out[("stop", share)]["state"], path)
        else:
            state = torch.load(path)  # the default: weights_only=True
            out[("resume", share)] = _train(rank, world, state=state, **common)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefetch", [None, 2], ids=["host", "device-prefetch-2"])
def test_torchdata_stateful_dataloader_save_exit_resume(prefetch):
    pytest.importorskip("torchdata")
    with tempfile.TemporaryDirectory() as ckpt:
        kw = {"ckpt_dir": ckpt, "prefetch": prefetch}
        first = run_ranks(torchdata_phase, 4, kwargs={**kw, "phase": "first"}, timeout=200)
        second = run_ranks(torchdata_phase, 4, kwargs={**kw, "phase": "resume"}, timeout=200)
    for rank in range(4):
        for share in (True, False):
            stopped = first[rank][("stop", share)]
            leader = rank % SP == 0 or not share
            assert ("loader" in stopped["state"]) == leader, "only a loader holder saves it"
            assert ("sampler" in stopped["state"]) == leader
            _assert_resumed(
                first[rank][("full", share)],
                stopped,
                second[rank][("resume", share)],
                f"rank {rank} share={share} torchdata",
            )


# ------------------------------------------------------------------ the wrong way fails


def wrong_way(rank: int, world: int) -> dict:
    first = _train(rank, world, kind="dataloader", num_workers=0, share=True, stop=3)
    group, _ = ranks.sp_groups(world, SP)
    out = {}
    torch.distributed.barrier()
    states = [None] * world
    torch.distributed.all_gather_object(states, first["state"])
    for name, state in (("rank0", states[0]), ("own", states[rank])):
        loader = ShmLoader(_factory("dataloader", 0, 2, rank // SP), group)
        try:
            loader.load_state_dict(state)
            out[name] = "loaded"
        except TopologyMismatchError as exc:
            out[name] = str(exc)
        loader.close()
    return out


@pytest.mark.timeout(120)
def test_save_on_rank0_load_everywhere_says_the_right_way():
    out = run_ranks(wrong_way, 4)
    assert out[0] == {"rank0": "loaded", "own": "loaded"}
    for rank in (1, 2, 3):
        assert out[rank]["own"] == "loaded"
        msg = out[rank]["rank0"]
        assert f"saved by rank 0 and this is rank {rank}" in msg
        assert "on every rank" in msg and "loader-rank{rank}.pt" in msg


# ------------------------------------------------------------------ DP resize


def save_at_dp2(rank: int, world: int, *, kind: str, ckpt_dir: str) -> list:
    out = _train(rank, world, kind=kind, num_workers=0, share=True, stop=3)
    torch.save(out["state"], os.path.join(ckpt_dir, f"loader-rank{rank}.pt"))
    return [ids for _, ids, *_ in out["records"]]


def resume_resized(rank: int, world: int, *, kind: str, ckpt_dir: str, source: int) -> dict:
    state = torch.load(os.path.join(ckpt_dir, f"loader-rank{source}.pt"))
    try:
        out = _train(rank, world, kind=kind, num_workers=0, share=True, state=state, epochs=1)
    except TopologyMismatchError as exc:
        return {"error": str(exc)}
    return {"ids": [ids for _, ids, *_ in out["records"]]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["dataloader", "torchdata"])
def test_dp_resize_through_load_state_dict(kind):
    if kind == "torchdata":
        pytest.importorskip("torchdata")
    with tempfile.TemporaryDirectory() as ckpt:
        before = run_ranks(save_at_dp2, 4, kwargs={"kind": kind, "ckpt_dir": ckpt})
        kw = {"kind": kind, "ckpt_dir": ckpt}
        after = {
            world: run_ranks(resume_resized, world, kwargs={**kw, "source": 0}) for world in (2, 6)
        }
        follower = run_ranks(resume_resized, 2, kwargs={**kw, "source": 1})
    # consumed before the save: the cursor (2 batches of 2) of each DP replica
    done = [i for rank in (0, 2) for ids in before[rank][:2] for i in ids]
    for world, out in after.items():
        rest = [i for rank in range(0, world, SP) for ids in out[rank]["ids"] for i in ids]
        for rank in range(world):  # SP peers got the same data
            assert out[rank]["ids"] == out[rank - rank % SP]["ids"]
        assert sorted(set(done + rest)) == list(range(N)), f"world {world}: samples lost"
        padding = -(-(N - len(done)) // (world // SP)) * (world // SP) - (N - len(done))
        assert len(done) + len(rest) == N + padding, f"world {world}: samples repeated"
    for o in follower:
        assert "load the state rank 0 saved on every rank" in o["error"]


# ------------------------------------------------------------------ single process


def _local(n: int = 8, prefetch: int | None = None) -> ShmLoader:
    device = FakeOps(auto=True) if prefetch is not None else None
    config = Config(enabled=False, prefetch=prefetch or 2)
    return ShmLoader(ranks.make_loader_factory(0, n=n), None, config=config, device=device)


@pytest.mark.parametrize("prefetch", [None, 2], ids=["host", "device-prefetch-2"])
def test_a_new_epoch_starts_at_its_beginning_in_the_state(prefetch):
    loader = _local(prefetch=prefetch)
    assert len(list(loader)) == 4
    assert loader.state_dict()["batches"] == 4
    loader.set_epoch(1)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 0), "set_epoch must reset the cursor"
    it = iter(loader)
    next(it)
    loader.set_epoch(2)  # left epoch 1 after one batch, prefetched more
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (2, 0), "set_epoch must reset the cursor"
    loader.close()


@pytest.mark.parametrize("kind", ["dataloader", "torchdata"])
@pytest.mark.parametrize(("prefetch", "k"), [(2, 2), (3, 3), (1, 1), (2, 1)])
def test_local_resume_with_device_prefetch_is_exact_at_every_stop(kind, prefetch, k):
    # Every stop of two epochs, in this process (the local role): the state is the
    # user's position and RNG, not the prefetcher's, and the prefetched batches come again.
    if kind == "torchdata":
        pytest.importorskip("torchdata")
    common = {"kind": kind, "num_workers": 0, "share": False, "prefetch": prefetch, "k": k}
    full = _train(0, 1, **common)
    assert len(full["records"]) == N  # 12 batches per epoch
    host = _train(0, 1, **{**common, "prefetch": None})
    assert full["records"] == host["records"], "prefetch changed data or RNG"
    for stop in range(1, N):
        first = _train(0, 1, stop=stop, **common)
        second = _train(0, 1, state=first["state"], **common)
        where = f"{kind} prefetch={prefetch} k={k} stop={stop}"
        _assert_resumed(full, first, second, where, replicas=1, k=k)


def test_format_1_states_still_load_and_bad_rng_is_refused():
    loader = _local()
    batches = [b["meta"].sample_ids for b in loader]
    state = loader.state_dict()
    loader.close()
    old = {k: v for k, v in state.items() if k != "rng"}
    old["format"] = "shmloader.state/1"
    old["batches"] = 2
    old["topology"] = {**{k: v for k, v in state["topology"].items() if k != "rank"}}
    old["topology"]["dp_rank"] = 0
    resumed = _local()
    resumed.load_state_dict(old)
    assert [b["meta"].sample_ids for b in resumed] == batches[2:]
    resumed.close()
    fresh = _local()
    with pytest.raises(ConfigError, match=r"state\['rng'\]"):
        fresh.load_state_dict({**state, "rng": {"torch": "x"}})
    fresh.close()


def test_format_2_states_load_with_a_warning_and_new_keys_are_validated(caplog):
    loader = _local()
    it = iter(loader)
    batches = [next(it)["meta"].sample_ids for _ in range(2)]
    state = loader.state_dict()
    batches += [b["meta"].sample_ids for b in it]
    loader.close()
    assert state["format"] == "shmloader.state/3" and state["opened"]["seeded"] is True
    old = {k: v for k, v in state.items() if k not in ("opened", "reset_next")}
    old["format"] = "shmloader.state/2"
    resumed = _local()
    with caplog.at_level("WARNING", logger="shmloader"):
        resumed.load_state_dict(old)
    assert "carries no RNG of the epoch's start" in caplog.text
    assert [b["meta"].sample_ids for b in resumed] == batches[2:]  # a seeded sampler
    resumed.close()
    again = _local()
    again.load_state_dict(state)  # saved again before iterating: what was loaded
    assert torch.equal(
        again.state_dict()["opened"]["rng"]["torch"], state["opened"]["rng"]["torch"]
    )
    again.close()
    fresh = _local()
    bad = [
        ("opened", {"rng": state["rng"], "seeded": 1}, r"state\['opened'\]"),
        ("opened", {"rng": {"torch": "x"}, "seeded": True}, r"state\['opened'\]\['rng'\]"),
        ("reset_next", "yes", r"state\['reset_next'\]"),
    ]
    for key, value, match in bad:
        with pytest.raises(ConfigError, match=match):
            fresh.load_state_dict({**state, key: value})
    fresh.close()


def _ids_per_epoch(loader: ShmLoader, epochs: range) -> list:
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out.append([b["id"].tolist() for b in loader])
    return out


def _shuffled_persistent():
    ds = [{"id": i} for i in range(12)]
    return DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, persistent_workers=True)


def test_next_epoch_after_a_boundary_state_keeps_persistent_workers_reset():
    # The uninterrupted run's epoch-1 iter() resets its persistent workers and draws
    # only the shuffle seed; the resumed process makes its workers anew, and must not
    # draw their base seed from the default generator first (NOTE [RNG at the epoch's
    # start]). Here the resumed run goes straight to epoch 1.
    config = Config(enabled=False)
    _seed_all(5)
    loader = ShmLoader(_shuffled_persistent, None, config=config)
    _ids_per_epoch(loader, range(1))
    state = _roundtrip(loader.state_dict())
    assert state["reset_next"] is True
    want = _ids_per_epoch(loader, range(1, 3))
    loader.close()
    _seed_all(99)
    resumed = ShmLoader(_shuffled_persistent, None, config=config)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert resumed.state_dict()["reset_next"] is True  # saved again before iterating
    assert _ids_per_epoch(resumed, range(1, 3)) == want
    resumed.close()

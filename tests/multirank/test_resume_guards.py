"""What a checkpoint must share with the loader it resumes (NOTE [a resume fits the loader]).

A state resumes at its cursor by replaying the saved order: the cursor must be
an optimizer-step boundary of the loader's ``accumulation_steps``, and the
leader's dataset and sampler seed the saved ones; ``accumulation_steps`` itself
is validated at construction. ``AllRanksState`` (accelerate) under another
world size loads rank 0's state on every rank, also where the rank's own key
is in the checkpoint, at world size 2 over gloo.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from shmloader import Config, ShardedSampler, ShmLoader, TopologyMismatchError
from shmloader.errors import ConfigError
from shmloader.integrations import dcp as shm_dcp
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

N = 16  # samples; batch size 1, so batches = samples


def _factory(
    n: int = N, seed: int = 3, sampler: str = "distributed", shuffle: bool = True
) -> Callable[[], Any]:
    def make() -> DataLoader:
        ds = list(range(n))
        if sampler == "sharded":
            order: Any = ShardedSampler(ds, num_replicas=1, rank=0, seed=seed, shuffle=shuffle)
        else:
            order = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        return DataLoader(ds, batch_size=1, sampler=order)

    return make


def _loader(k: int = 1, **factory: Any) -> ShmLoader:
    return ShmLoader(_factory(**factory), None, accumulation_steps=k, config=Config(enabled=False))


def _ids(batches: Any) -> list[int]:
    return [int(b) for b in batches]


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _saved(k: int, stop: int | None, **factory: Any) -> tuple[dict, list[int]]:
    """The state after ``stop`` batches (None: the whole epoch), and the epoch's order."""
    with _loader(k, **factory) as loader:
        full = _ids(loader)
    with _loader(k, **factory) as loader:
        it = iter(loader)
        taken = _ids(next(it) for _ in range(stop if stop is not None else len(full)))
        if stop is None:
            assert next(it, None) is None  # the epoch's end reached
        state = _roundtrip(loader.state_dict())
    assert taken == full[: len(taken)]
    return state, full


# ------------------------------------------------------------ accumulation


@pytest.mark.parametrize(
    ("saved_k", "stop", "k", "at"),
    [(2, 6, 3, 6), (2, 7, 3, 6), (2, 5, 1, 4), (3, 7, 2, 6), (2, 4, 4, 4)],
    ids=["6-of-2-as-3", "7-rounded-to-6-as-3", "4-as-1", "6-of-3-as-2", "4-of-2-as-4"],
)
def test_a_cursor_on_a_boundary_of_the_new_accumulation_resumes_exactly(saved_k, stop, k, at):
    state, full = _saved(saved_k, stop)
    assert (state["batches"], state["accumulation_steps"], state["ended"]) == (at, saved_k, False)
    with _loader(k) as resumed:
        resumed.load_state_dict(state)
        again = resumed.state_dict()  # before iterating: what was loaded, in this layout
        assert (again["batches"], again["accumulation_steps"]) == (at, k)
        assert _ids(resumed) == full[at:]


@pytest.mark.parametrize(
    ("saved_k", "stop", "k", "at"),
    [(2, 5, 3, 4), (1, 5, 2, 5), (3, 3, 2, 3), (2, 6, 4, 6)],
    ids=["4-of-2-as-3", "5-of-1-as-2", "3-of-3-as-2", "6-of-2-as-4"],
)
def test_a_cursor_inside_a_step_of_the_new_accumulation_is_refused(saved_k, stop, k, at):
    state, full = _saved(saved_k, stop)
    assert state["batches"] == at
    with _loader(k) as resumed:
        with pytest.raises(TopologyMismatchError) as refused:
            resumed.load_state_dict(state)
        text = str(refused.value)
        assert f"accumulation_steps={saved_k} at batch {at}" in text
        assert f"this loader has accumulation_steps={k}" in text
        assert f"Construct the loader with accumulation_steps={saved_k}" in text
        # validated before anything changed: the loader starts at the epoch's beginning
        assert resumed.state_dict()["batches"] == 0
        assert _ids(resumed) == full


@pytest.mark.parametrize("n", [7, 8], ids=["odd-end", "end-on-a-step-of-the-old"])
def test_a_state_at_the_epochs_end_resumes_under_any_accumulation(n):
    state, full = _saved(2, None, n=n)
    assert (state["batches"], state["ended"]) == (n, True)
    with _loader(3, n=n) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict()["ended"] is True  # saved again before iterating
        assert _ids(resumed) == []  # the saved epoch is over
        resumed.set_epoch(1)
        assert sorted(_ids(resumed)) == sorted(full)


def test_a_state_without_ended_is_judged_by_its_own_accumulation():
    odd, _ = _saved(2, None, n=7)  # batch 7 of accumulation 2: only an epoch's end
    even, _ = _saved(2, None, n=8)  # batch 8: a step boundary too, so it cannot tell
    for state in (odd, even):
        del state["ended"]
        del state["dataset"]
    with _loader(3, n=7) as resumed:
        resumed.load_state_dict(odd)
        assert _ids(resumed) == []
    with _loader(3, n=8) as resumed, pytest.raises(TopologyMismatchError, match="batch 8"):
        resumed.load_state_dict(even)


def test_a_malformed_ended_is_refused():
    state, _ = _saved(2, 5)
    with _loader(2) as resumed:
        with pytest.raises(ConfigError, match=r"state\['ended'\]='yes'"):
            resumed.load_state_dict({**state, "ended": "yes"})
        with pytest.raises(ConfigError, match=r"batch 5 is no multiple"):
            resumed.load_state_dict({**state, "batches": 5, "ended": False})


# ------------------------------------------------------------ dataset identity


def test_another_dataset_length_is_refused_naming_both():
    state, _ = _saved(1, 4)
    assert state["dataset"] == {"length": N, "sampler_seed": 3}
    with _loader(n=N + 2) as resumed:
        with pytest.raises(TopologyMismatchError) as refused:
            resumed.load_state_dict(state)
        text = str(refused.value)
        assert f"a dataset of {N} samples" in text and f"dataset has {N + 2}" in text
        assert "Resume with the dataset the checkpoint was saved with" in text
        assert resumed.state_dict()["batches"] == 0


@pytest.mark.parametrize("sampler", ["distributed", "sharded"])
def test_another_sampler_seed_is_refused_naming_both(sampler):
    state, _ = _saved(1, 4, sampler=sampler, seed=5)
    assert state["dataset"]["sampler_seed"] == 5
    with _loader(sampler=sampler, seed=6) as resumed:
        with pytest.raises(TopologyMismatchError) as refused:
            resumed.load_state_dict(state)
        text = str(refused.value)
        assert "a sampler seeded 5" in text and "has seed=6" in text
        assert "Construct the sampler with seed=5" in text


@pytest.mark.parametrize("sampler", ["distributed", "sharded"])
def test_the_seed_of_a_sampler_that_does_not_shuffle_is_not_compared(sampler):
    state, full = _saved(1, 4, sampler=sampler, seed=5, shuffle=False)
    assert "sampler_seed" not in state["dataset"]
    with _loader(sampler=sampler, seed=6, shuffle=False) as resumed:
        resumed.load_state_dict(state)
        assert _ids(resumed) == full[4:] == list(range(4, N))


def test_a_state_without_the_dataset_key_still_loads():
    state, full = _saved(1, 4)
    del state["dataset"]
    del state["ended"]
    with _loader(n=N + 2, seed=3) as other:  # nothing to compare with: loads as before
        other.load_state_dict(state)
    with _loader() as resumed:
        resumed.load_state_dict(state)
        assert _ids(resumed) == full[4:]


def test_a_malformed_dataset_is_refused():
    state, _ = _saved(1, 4)
    with _loader() as resumed:
        for bad in ({"length": "16"}, {"length": True}, {"size": 16}, [16]):
            with pytest.raises(ConfigError, match=r"state\['dataset'\]"):
                resumed.load_state_dict({**state, "dataset": bad})


def test_a_loader_that_tells_nothing_saves_an_empty_identity():
    def plain() -> list[torch.Tensor]:
        return [torch.tensor(i) for i in range(4)]

    with ShmLoader(plain, None, config=Config(enabled=False)) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    assert state["dataset"] == {}
    with ShmLoader(plain, None, config=Config(enabled=False)) as resumed:
        resumed.load_state_dict(state)
        assert _ids(resumed) == [1, 2, 3]


def test_a_sampler_that_restores_its_own_state_adopts_the_saved_seed():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make(seed: int) -> Callable[[], Any]:
        def build() -> Any:
            ds = list(range(N))
            order = ShardedSampler(ds, num_replicas=1, rank=0, seed=seed)
            return sdl.StatefulDataLoader(ds, batch_size=1, sampler=order)

        return build

    config = Config(enabled=False)
    with ShmLoader(make(5), None, config=config) as loader:
        full = _ids(loader)
    with ShmLoader(make(5), None, config=config) as loader:
        it = iter(loader)
        _ids(next(it) for _ in range(4))
        state = _roundtrip(loader.state_dict())
    assert "loader" in state and state["dataset"]["sampler_seed"] == 5
    with ShmLoader(make(6), None, config=config) as resumed:
        resumed.load_state_dict(state)  # the StatefulDataLoader restores the sampler's seed
        assert _ids(resumed) == full[4:]


# ------------------------------------------------------------ accumulation_steps itself


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "2", None])
def test_accumulation_steps_must_be_an_integer_of_at_least_1(value):
    built = []

    def make() -> list[int]:
        built.append(1)
        return [1, 2]

    with pytest.raises(ConfigError) as refused:
        ShmLoader(make, None, accumulation_steps=value)
    assert refused.value.name == "accumulation_steps"
    assert str(refused.value).startswith(f"accumulation_steps={value!r} is not valid")
    assert "an integer >= 1" in str(refused.value)
    assert built == []  # refused before anything was built


# ------------------------------------------------------------ at world size 2 over gloo

SP = 2
STOP = 2  # batches each rank takes before the save at world 4


def _sharded(world: int, k: int = 1, n: int = 24) -> ShmLoader:
    from shmloader import dp_topology_from_group

    group, _ = ranks.sp_groups(world, SP)
    replicas, dp_rank = dp_topology_from_group(group)

    def make() -> DataLoader:
        ds = ranks.Synthetic(n)
        order = ShardedSampler(ds, num_replicas=replicas, rank=dp_rank, seed=5)
        return DataLoader(ds, batch_size=2, sampler=order, collate_fn=ranks.collate)

    return ShmLoader(make, group, accumulation_steps=k, config=Config.from_env(enabled=True))


def save_all_ranks(rank: int, world: int, *, path: str) -> list[int]:
    """World 4 (SP 2 x DP 2): ``STOP`` batches, then every rank's state through AllRanksState."""
    from shmloader.integrations.accelerate import AllRanksState

    with _sharded(world) as loader:
        it = iter(loader)
        ids = [i for _ in range(STOP) for i in next(it)["meta"].sample_ids]
        state = AllRanksState(loader).state_dict()  # collective
    if rank == 0:
        torch.save(state, path)
    return ids


def load_elsewhere(rank: int, world: int, *, path: str) -> dict:
    """World 2 (SP 2 x DP 1): each rank loads the world-4 checkpoint; and the layout guard."""
    from shmloader.integrations.accelerate import FORMAT, AllRanksState

    out: dict[str, Any] = {}

    class Stub:
        loaded: Any = None

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    stub = Stub()
    four = {"format": FORMAT, "world": 4}
    four |= {f"rank{r}": shm_dcp.dumps({"saved_by": r}) for r in range(4)}
    AllRanksState(stub).load_state_dict(four)  # type: ignore[arg-type]
    out["resized"] = stub.loaded
    two = {**four, "world": 2}
    AllRanksState(stub).load_state_dict(two)  # type: ignore[arg-type]
    out["same_world"] = stub.loaded

    import torch.distributed as dist

    saved = torch.load(path, weights_only=True)
    assert set(saved) >= {"rank0", "rank1", "rank2", "rank3"}  # this rank's own key is there
    with _sharded(world) as loader:
        try:
            AllRanksState(loader).load_state_dict(saved)
            problem = None
        except TopologyMismatchError as e:
            problem = str(e)
        # agreed before iterating: a rank that refused must not leave its peer waiting
        problems: list[Any] = [None] * world
        dist.all_gather_object(problems, problem)
        out["problems"] = problems
        if any(problems):
            return out
        out["ids"] = [i for batch in loader for i in batch["meta"].sample_ids]

    # the layout guard on a leader and a follower alike: saved at batch 4 with 2, loaded with 3
    with _sharded(world, k=2) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = loader.state_dict()
    assert state["batches"] == 4
    with _sharded(world, k=3) as loader:
        try:
            loader.load_state_dict(state)
            out["k3"] = "loaded"
        except TopologyMismatchError as e:
            out["k3"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_all_ranks_state_under_another_world_size_loads_rank_0s_on_ranks_with_their_own_key():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "all.pt")
        first = run_ranks(save_all_ranks, 4, kwargs={"path": path}, timeout=280)
        second = run_ranks(load_elsewhere, 2, kwargs={"path": path}, timeout=280)
    for rank in (0, 1):
        out = second[rank]
        assert out["resized"] == {"saved_by": 0}, f"rank {rank} loaded another rank's state"
        assert out["problems"] == [None, None], f"rank {rank}: {out['problems']}"
        assert out["same_world"] == {"saved_by": rank}
        assert "accumulation_steps=2 at batch 4" in out["k3"], f"rank {rank}: {out['k3']}"
    assert first[0] == first[1] and first[2] == first[3]  # SP peers shared their batches
    consumed = set(first[0]) | set(first[2])
    assert len(consumed) == 2 * STOP * 2
    # the one new DP replica re-splits the rest of the epoch: every sample once, none consumed
    assert second[0]["ids"] == second[1]["ids"]
    assert sorted(second[0]["ids"]) == sorted(set(range(24)) - consumed)

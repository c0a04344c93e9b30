"""What the leader's ``make_loader`` does that followers never run.

NOTE [factory draws] (``rng``): the factory's draws from the default
generators are counted on the leader and mirrored on every other rank.
NOTE [samplers over SP groups] (``_setup.build``): a data-parallel sampler in the
factory keyed on other replicas than the SP groups is refused.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset, random_split

from shmloader import Config, ShmLoader
from shmloader._roles import rng
from shmloader.errors import ProtocolError
from tests.support import ranks
from tests.support.harness import run_ranks

# ------------------------------------------------------------------ counting words


@pytest.fixture(autouse=True)
def keep_global_rng():
    state = rng.capture()
    yield
    rng.restore(state)


def test_torch_state_keeps_the_word_index_where_counting_reads_it() -> None:
    """The index of the next Mersenne word at byte 16 of torch's CPU state: a
    torch that moves it makes this fail rather than miscount silently."""
    g = torch.Generator().manual_seed(5)
    for words in (1, 2, 623, 624, 625, 2000):
        g.manual_seed(5)
        torch.empty(words, dtype=torch.int32).random_(generator=g)
        assert rng._torch_index(g.get_state()) == (words - 1) % 624 + 1


@pytest.mark.parametrize(
    "draw",
    [
        lambda: torch.randperm(1000),  # 999 words
        lambda: torch.randperm(100_000),  # more than a hundred regenerations
        lambda: torch.empty((), dtype=torch.int64).random_(),  # torchdata's sampler seed
        lambda: random_split(range(97), [0.5, 0.5]),
        lambda: random.shuffle(list(range(300))),
        lambda: np.random.permutation(5000),
        lambda: (torch.rand(7), random.random(), np.random.randint(0, 9, 11)),
    ],
)
def test_counted_words_mirrored_land_every_generator_where_the_draw_left_it(draw) -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    start = rng.capture()
    before = rng.snapshot_all()
    draw()
    after = rng.snapshot_all()
    counts = rng.count_words(before)
    assert None not in counts.values()
    assert any(counts.values())
    rng.restore(start)
    rng.mirror_words(counts)
    for g in rng._GENERATORS:
        assert g.same(g.state(), after[g.name]), f"{g.name} is not where the factory left it"


def test_a_draw_of_no_whole_words_is_not_counted() -> None:
    before = rng.snapshot_all()
    torch.randn(3)  # leaves a cached normal in the state
    counts = rng.count_words(before, limit=4096)
    assert counts == {"torch": None, "python": 0, "numpy": 0}


def test_mirror_words_refuses_what_no_leader_sends() -> None:
    for bad in (
        [3],
        {"torch": -1},
        {"torch": rng.MAX_FACTORY_WORDS + 1},
        {"cuda": 1},
        {"numpy": 1.5},
    ):
        with pytest.raises(ProtocolError):
            rng.mirror_words(bad)


# ------------------------------------------------------------------ rank code


def _drawing_factory(num_workers: int):
    """A factory that draws while it builds: a ``randperm`` subset of a
    ``random_split`` half, a Python shuffle, and torchdata's
    ``StatefulDataLoader(shuffle=True)`` (its sampler's seed)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> DataLoader:
        ds = ranks.Synthetic(40)
        half, _ = random_split(ds, [0.5, 0.5])
        keep = torch.randperm(len(half))[:14].tolist()
        random.shuffle(keep)
        np.random.permutation(keep)
        return StatefulDataLoader(
            Subset(half, keep),
            batch_size=2,
            shuffle=True,
            num_workers=num_workers,
            collate_fn=ranks.collate,
        )

    return make


def factory_rng_run(rank: int, world: int, *, num_workers: int, share: bool) -> dict:
    torch.manual_seed(99 + 5 * rank)  # every rank's torch generator differs
    # Python's shuffle and numpy's permutation reject draws: how many words they
    # take depends on the state, so they mirror exactly from the same seed only
    # (NOTE [factory draws]); torch's randperm and seeds take a fixed count.
    random.seed(99)
    np.random.seed(99)
    loader = ShmLoader(
        _drawing_factory(num_workers), dist.group.WORLD, config=Config.from_env(enabled=share)
    )
    states = [rng.capture()]  # right after construction: the factory's draws
    order = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            order.append(batch["meta"].sample_ids)
            states.append(rng.capture())
            torch.rand(3)  # the training step's own randomness
    loader.close()
    return {"states": states, "order": order}


def factory_rng_both(rank: int, world: int, *, num_workers: int) -> dict:
    return {
        "alone": factory_rng_run(rank, world, num_workers=num_workers, share=False),
        "shared": factory_rng_run(rank, world, num_workers=num_workers, share=True),
    }


def _same_state(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["torch"], b["torch"])
        and torch.equal(a["python"]["internal"], b["python"]["internal"])
        and a["python"]["gauss"] == b["python"]["gauss"]
        and torch.equal(a["numpy"]["keys"], b["numpy"]["keys"])
        and a["numpy"]["pos"] == b["numpy"]["pos"]
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_followers_generators_match_sharing_off_whatever_the_factory_draws(num_workers) -> None:
    out = run_ranks(factory_rng_both, 2, kwargs={"num_workers": num_workers}, timeout=150)
    for rank, o in enumerate(out):
        alone, shared = o["alone"], o["shared"]
        assert len(alone["states"]) == len(shared["states"]) == 15
        differ = [
            step
            for step, (a, s) in enumerate(zip(alone["states"], shared["states"], strict=True))
            if not _same_state(a, s)
        ]
        assert differ == [], f"rank {rank}: default generators differ at steps {differ}"
    # followers get the leader's batches, which are what its own loader yields alone
    assert out[1]["shared"]["order"] == out[0]["alone"]["order"]


def _sampler_factory(kind: str, rank: int, world: int, sp: int):
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make() -> DataLoader:
        ds = ranks.Synthetic(16)
        if kind == "global":  # keyed on the global rank: the mistake
            sampler = DistributedSampler(ds, seed=1)
        elif kind == "torchdata-global":
            sampler = StatefulDistributedSampler(ds, num_replicas=world, rank=rank, seed=1)
        elif kind == "same-rank":  # the right size, but every group replica 0
            sampler = DistributedSampler(ds, num_replicas=world // sp, rank=0, seed=1)
        else:  # the DP topology: accepted
            sampler = StatefulDistributedSampler(
                ds, num_replicas=world // sp, rank=rank // sp, seed=1
            )
        return DataLoader(ds, batch_size=2, sampler=sampler, collate_fn=ranks.collate)

    return make


def sampler_checks(rank: int, world: int, *, sp: int) -> dict:
    group, _ = ranks.sp_groups(world, sp)
    out: dict = {}
    for kind in ("global", "torchdata-global", "same-rank", "dp"):
        try:
            loader = ShmLoader(
                _sampler_factory(kind, rank, world, sp), group, config=Config.from_env(enabled=True)
            )
        except Exception as exc:
            out[kind] = f"{type(exc).__name__}: {exc}"
            continue
        out[kind] = [b["meta"].sample_ids for b in loader]
        loader.close()
    return out


@pytest.mark.timeout(180)
def test_a_distributed_sampler_keyed_on_the_global_rank_is_refused_by_every_rank() -> None:
    out = run_ranks(sampler_checks, 4, kwargs={"sp": 2}, timeout=150)
    for rank, o in enumerate(out):
        leader = rank % 2 == 0
        for kind, field, value in (
            ("global", "DistributedSampler.num_replicas", "4"),
            ("torchdata-global", "StatefulDistributedSampler.num_replicas", "4"),
        ):
            text = o[kind]
            assert isinstance(text, str), f"rank {rank}: {kind} was accepted"
            assert text.startswith("ConfigError" if leader else "LeaderError"), text
            assert f"{field}={value}" in text and "2 SP groups" in text, text
            assert "dp_topology" in text, text
        text = o["same-rank"]
        if rank < 2:  # group {0, 1} is replica 0: right
            assert isinstance(text, list), text
        else:
            assert isinstance(text, str) and "DistributedSampler.rank=0" in text, text
            assert "index, 1 of 2" in text and "dp_topology" in text, text
    # the DP topology is accepted and the two groups together see every sample once
    seen = [i for rank in (0, 2) for ids in out[rank]["dp"] for i in ids]
    assert sorted(seen) == list(range(16))
    assert out[1]["dp"] == out[0]["dp"] and out[3]["dp"] == out[2]["dp"]


# ------------------------------------------------- NOTE [limits of exact resume]


def _own_generator_loader(where: str | None) -> ShmLoader:
    def make() -> DataLoader:
        ds = ranks.Synthetic(12)
        if where == "sampler":
            sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3))
            return DataLoader(ds, batch_size=2, sampler=sampler, collate_fn=ranks.collate)
        generator = torch.Generator().manual_seed(3) if where == "loader" else None
        return DataLoader(
            ds, batch_size=2, shuffle=True, generator=generator, collate_fn=ranks.collate
        )

    return ShmLoader(make, None, config=Config(enabled=False))


def _own_generator_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if "its own generator=" in m]


@pytest.mark.parametrize("where", ["loader", "sampler", None])
def test_a_mid_epoch_resume_of_a_loader_with_its_own_generator_warns_once(where) -> None:
    from tests.support.harness import capture_warnings

    first = _own_generator_loader(where)
    it = iter(first)
    for _ in range(3):
        next(it)
    mid_epoch = first.state_dict()
    first.set_epoch(1)
    epoch_start = first.state_dict()
    first.close()
    warnings = capture_warnings()
    try:
        resumed = _own_generator_loader(where)
        resumed.load_state_dict(epoch_start)  # an epoch's start: nothing is fast-forwarded
        list(resumed)
        assert _own_generator_warnings(warnings.messages) == []
        resumed.close()
        resumed = _own_generator_loader(where)
        resumed.load_state_dict(mid_epoch)
        assert len(list(resumed)) == 3
        resumed.set_epoch(1)  # the next epoch: nothing fast-forwarded, nothing said
        assert len(list(resumed)) == 6
        resumed.close()
    finally:
        import logging

        logging.getLogger("shmloader").removeHandler(warnings)
    said = _own_generator_warnings(warnings.messages)
    if where is None:  # the default generator is restored: exact, no warning
        assert said == []
    else:
        assert len(said) == 1, said
        named = "DataLoader and sampler" if where == "loader" else "sampler"
        assert f"loader whose {named} draws" in said[0], said[0]

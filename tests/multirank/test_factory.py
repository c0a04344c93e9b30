"""What the leader's ``make_loader`` does that followers never run.

NOTE [factory draws] (``_rng``): the factory's draws from the default
generators are counted on the leader and mirrored on every other rank.
NOTE [samplers over SP groups] (``_setup.build``): a data-parallel sampler in the
factory keyed on other replicas than the SP groups is refused.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset, random_split

from shmloader import Config, ShmLoader
from shmloader import _rng as rng
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


def _seed(torch_seed: int, python_seed: int = 3, numpy_seed: int = 3) -> None:
    torch.manual_seed(torch_seed)
    random.seed(python_seed)
    np.random.seed(numpy_seed)


def _states() -> dict:
    return {g.name: g.state() for g in rng._GENERATORS}


def _where(states: dict) -> dict:
    """Per generator: whether the default generator is in that state now."""
    return {g.name: g.same(g.state(), states[g.name]) for g in rng._GENERATORS}


def _factory(draw, seeds: tuple) -> tuple[dict, dict]:
    """The leader's side: what ``factory_draws`` sends (through JSON) and where it ends."""
    _seed(*seeds)
    before = rng.snapshot_all()
    draw()
    sent = json.loads(json.dumps(rng.factory_draws(before)))
    return sent, _states()


def _unshared(draw, seeds: tuple) -> dict:
    """Where a rank seeded with ``seeds`` ends when it runs the factory itself (sharing off)."""
    _seed(*seeds)
    draw()
    return _states()


def _follow(sent: dict, seeds: tuple) -> list[str]:
    _seed(*seeds)
    return rng.follow_factory(sent)


ALL_KINDS = [
    lambda: torch.randperm(1000),  # 999 words
    lambda: torch.randperm(100_000),  # more than a hundred blocks
    lambda: torch.empty((), dtype=torch.int64).random_(),  # torchdata's sampler seed
    lambda: random_split(range(97), [0.5, 0.5]),
    lambda: random.shuffle(list(range(300))),
    lambda: np.random.permutation(5000),
    lambda: (torch.rand(7), random.random(), np.random.randint(0, 9, 11)),
    lambda: (torch.randn(3), random.gauss(0, 1), np.random.standard_normal(3)),  # cached normals
    lambda: (torch.manual_seed(8), random.seed(8), np.random.seed(8), torch.rand(2)),  # reseeded
]


@pytest.mark.parametrize("draw", ALL_KINDS)
def test_a_rank_seeded_like_the_leader_ends_where_the_factory_left_it_whatever_it_drew(
    draw,
) -> None:
    sent, leader = _factory(draw, (3,))
    assert sent, "the factory moved a generator"
    assert _follow(sent, (3,)) == []
    assert all(_where(leader).values()), _where(leader)
    assert all(_where(_unshared(draw, (3,))).values())  # and that is the unshared run's state


FIXED_COUNT = [
    lambda: torch.randperm(1000),
    lambda: torch.randperm(100_000),
    lambda: torch.empty((), dtype=torch.int64).random_(),
    lambda: random_split(range(97), [0.5, 0.5]),
    lambda: (torch.rand(7), torch.randint(0, 9, (11,)), torch.bernoulli(torch.full((5,), 0.5))),
]


@pytest.mark.parametrize("draw", FIXED_COUNT)
def test_a_rank_seeded_otherwise_draws_as_many_torch_words_and_ends_as_unshared(draw) -> None:
    sent, _ = _factory(draw, (3,))
    assert set(sent) == {"torch"}
    expected = _unshared(draw, (4,))
    assert _follow(sent, (4,)) == []
    assert _where(expected)["torch"]


def test_factory_draws_past_millions_of_words_are_mirrored_on_a_rank_seeded_otherwise() -> None:
    """A ``random_split`` of a pretraining corpus: more words than any small fixed cap
    (16.8 M here), mirrored exactly on a rank whose torch generator was elsewhere."""

    def draw() -> None:
        torch.randperm(16_800_000)

    sent, _ = _factory(draw, (3,))
    expected = _unshared(draw, (4,))
    assert _follow(sent, (4,)) == []
    assert _where(expected)["torch"]


@pytest.mark.parametrize(
    "name, draw",
    [
        ("python", lambda: random.shuffle(list(range(300)))),
        ("numpy", lambda: np.random.permutation(5000)),
    ],
)
def test_a_rank_seeded_otherwise_is_told_its_python_or_numpy_draws_may_differ(name, draw) -> None:
    seeds = (3, 3, 3)
    sent, _ = _factory(draw, seeds)
    other = (3, 4, 4)  # Python's and numpy's generators seeded per rank
    said = _follow(sent, other)
    assert len(said) == 1, said
    text = said[0]
    assert f"this rank's {name} generator was in another state" in text, text
    assert "reject draws" in text and "may differ" in text, text
    assert f"seed {name}'s generator alike on every rank" in text, text
    assert "a generator of their own" in text, text
    # a rank seeded like the leader is exact and says nothing
    assert _follow(sent, seeds) == []


@pytest.mark.parametrize(
    "draw, cause",
    [
        (lambda: torch.randn(3), "cached normal"),
        (lambda: (torch.manual_seed(8), torch.rand(2)), "seeded"),
        (lambda: random.gauss(0, 1), "cached normal"),
        (lambda: (random.seed(8), random.random()), "no count up to 65536"),
    ],
)
def test_a_draw_no_count_explains_warns_on_a_rank_seeded_otherwise_with_its_cause(
    draw, cause
) -> None:
    sent, _ = _factory(draw, (3,))
    (name,) = sent
    _seed(4, 4, 4)
    untouched = _states()
    said = rng.follow_factory(sent, limit=1 << 16)
    assert len(said) == 1, said
    assert f"default {name} generator" in said[0] and cause in said[0], said[0]
    assert "differs from sharing off" in said[0] and "alike on every rank" in said[0], said[0]
    assert all(_where(untouched).values())  # nothing drawn for it


def test_follow_factory_refuses_what_no_leader_sends() -> None:
    good = _factory(lambda: torch.rand(2), (3,))[0]
    for bad in (
        [3],
        {"cuda": good["torch"]},
        {"torch": 5},
        {"torch": {"before": "AAAA", "after": good["torch"]["after"]}},
        {"torch": {"before": good["torch"]["before"]}},
        {"python": {"before": [3, [1, 2], None], "after": [3, [1, 2], None]}},
        {"numpy": {"before": ["MT19937", [-1] * 624, 1, 0, 0.0], "after": []}},
    ):
        with pytest.raises(ProtocolError):
            rng.follow_factory(bad)


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


def _corpus_factory(torch_normal: bool):
    """A pretraining-style factory: a ``random_split``-sized permutation of 16.8 M
    samples (more words than any small fixed cap), a Python shuffle of a file list
    and, optionally, a ``torch.randn`` that leaves a cached normal."""

    def make() -> DataLoader:
        torch.randperm(16_800_000)
        random.shuffle(list(range(300)))
        if torch_normal:
            torch.randn(3)
        return DataLoader(ranks.Synthetic(8), batch_size=2, shuffle=True, collate_fn=ranks.collate)

    return make


def corpus_run(rank: int, world: int, *, share: bool, per_rank: bool) -> dict:
    from tests.support.harness import capture_warnings

    # per_rank: torch's and Python's generators seeded seed + rank, as is common
    torch.manual_seed(99 + (5 * rank if per_rank else 0))
    random.seed(99 + (rank if per_rank else 0))
    np.random.seed(99)
    warnings = capture_warnings()
    loader = ShmLoader(
        _corpus_factory(torch_normal=not per_rank),
        dist.group.WORLD,
        config=Config.from_env(enabled=share),
    )
    states = [rng.capture()]
    for batch in loader:
        assert batch["meta"].sample_ids
        states.append(rng.capture())
        torch.rand(3)
    loader.close()
    import logging

    logging.getLogger("shmloader").removeHandler(warnings)
    return {"states": states, "said": [m for m in warnings.messages if "make_loader" in m]}


def corpus_both(rank: int, world: int, *, per_rank: bool) -> dict:
    return {
        share: corpus_run(rank, world, share=share, per_rank=per_rank) for share in (False, True)
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("per_rank", [False, True], ids=["seeded-alike", "seeded-per-rank"])
def test_a_factory_drawing_millions_of_words_leaves_every_rank_as_sharing_off(per_rank) -> None:
    out = run_ranks(corpus_both, 2, kwargs={"per_rank": per_rank}, timeout=220)
    for rank, o in enumerate(out):
        alone, shared = o[False], o[True]
        assert alone["said"] == [], alone["said"]
        for step, (a, s) in enumerate(zip(alone["states"], shared["states"], strict=True)):
            assert torch.equal(a["torch"], s["torch"]), f"rank {rank}: torch differs at step {step}"
            assert torch.equal(a["numpy"]["keys"], s["numpy"]["keys"]), (rank, step)
            if not per_rank or rank == 0:  # seeded alike, or the leader: Python's exact too
                assert torch.equal(a["python"]["internal"], s["python"]["internal"]), (rank, step)
    assert out[0][True]["said"] == []  # the leader's draws are real: nothing to say
    said = out[1][True]["said"]
    if per_rank:  # the follower is told, once, that its shuffle's count may differ
        assert len(said) == 1 and "python generator was in another state" in said[0], said
    else:
        assert said == [], said


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

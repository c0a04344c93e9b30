"""Tests of shmloader.samplers.sharded: one global order, cyclic padding, strided shares, resume."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from shmloader.samplers.sharded import ShardedBatchSampler, ShardedSampler, dp_topology_from_group

SETTINGS = settings(
    deadline=None,
    max_examples=100,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
sizes = st.integers(0, 60)
replicas = st.integers(1, 9)
seeds = st.one_of(st.integers(0, 1000), st.integers(0, 2**63 - 1))
epochs = st.integers(0, 10_000)


# ---------------------------------------------------------------------------- helpers
def make(n_items: int, n: int, r: int, epoch: int = 0, **kw) -> ShardedSampler:
    sampler = ShardedSampler(range(n_items), num_replicas=n, rank=r, **kw)
    sampler.set_epoch(epoch)
    return sampler


def shares(n_items: int, n: int, epoch: int = 0, **kw) -> list[list[int]]:
    return [list(make(n_items, n, r, epoch, **kw)) for r in range(n)]


def interleave(per_rank: list[list[int]]) -> list[int]:
    """Rebuild the global padded order from strided shares (position p -> rank p % n)."""
    n = len(per_rank)
    assert len({len(s) for s in per_rank}) == 1, "ranks got unequal shares"
    return [per_rank[p % n][p // n] for p in range(len(per_rank[0]) * n)]


def epoch_order(n_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The unpadded order of an epoch: what a single replica draws."""
    return list(make(n_items, 1, 0, epoch, seed=seed, shuffle=shuffle))


def padded_len(m: int, unit: int, drop_last: bool) -> int:
    if m == 0:
        return 0
    return m // unit * unit if drop_last else math.ceil(m / unit) * unit


def take(sampler: ShardedSampler, k: int) -> list[int]:
    return list(itertools.islice(iter(sampler), k))


# ---------------------------------------------------------------------------- one order
@SETTINGS
@given(n_items=sizes, n=replicas, seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_one_order_cyclic_padding_strided_shares(n_items, n, seed, epoch, drop_last):
    per_rank = shares(n_items, n, epoch, seed=seed, drop_last=drop_last)
    order = epoch_order(n_items, seed, epoch)
    assert sorted(order) == list(range(n_items))
    length = padded_len(n_items, n, drop_last)
    for r, share in enumerate(per_rank):
        assert len(share) == length // n == len(make(n_items, n, r, epoch, drop_last=drop_last))
    # Every rank's share comes from one global order (the one a single replica sees),
    # padded by repeating it from its start, split strided.
    assert interleave(per_rank) == [order[p % n_items] for p in range(length)]


@SETTINGS
@given(data=st.data(), seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_cyclic_padding_with_fewer_items_than_half_the_replicas(data, seed, epoch, drop_last):
    """Every example has 1 <= items < replicas / 2: the order wraps around several times
    (the general property test above rarely draws such a case)."""
    n = data.draw(st.integers(4, 64), label="replicas")
    n_items = data.draw(st.integers(1, (n - 1) // 2), label="items")
    assert 2 * n_items < n
    per_rank = shares(n_items, n, epoch, seed=seed, drop_last=drop_last)
    order = epoch_order(n_items, seed, epoch)
    length = padded_len(n_items, n, drop_last)
    assert length == (0 if drop_last else n)
    assert all(len(share) == length // n for share in per_rank)
    assert interleave(per_rank) == [order[p % n_items] for p in range(length)]
    if not drop_last:  # every item is repeated, each about equally often
        counts = Counter(itertools.chain.from_iterable(per_rank))
        assert set(counts) == set(range(n_items))
        assert max(counts.values()) - min(counts.values()) <= 1


@SETTINGS
@given(n_items=st.integers(1, 60), n=replicas, seed=seeds, epoch=epochs)
def test_nothing_lost_and_padding_spread(n_items, n, seed, epoch):
    per_rank = shares(n_items, n, epoch, seed=seed)
    assert all(per_rank), "a rank got nothing although the dataset is not empty"
    counts = Counter(itertools.chain.from_iterable(per_rank))
    assert set(counts) == set(range(n_items))
    total = sum(counts.values())
    assert total % n == 0 and total - n < n_items <= total
    assert set(counts.values()) <= {total // n_items, -(-total // n_items)}


@SETTINGS
@given(n_items=sizes, n=replicas, seed=seeds, epoch=epochs)
def test_drop_last_truncates_without_repeats(n_items, n, seed, epoch):
    per_rank = shares(n_items, n, epoch, seed=seed, drop_last=True)
    flat = list(itertools.chain.from_iterable(per_rank))
    assert len(flat) == len(set(flat)) == n_items // n * n


@SETTINGS
@given(n_items=sizes, n=replicas, epoch=epochs, drop_last=st.booleans())
def test_shuffle_false_is_arange(n_items, n, epoch, drop_last):
    per_rank = shares(n_items, n, epoch, shuffle=False, drop_last=drop_last)
    length = padded_len(n_items, n, drop_last)
    assert interleave(per_rank) == [p % n_items for p in range(length)]


def test_padding_example_from_docs():
    order = epoch_order(4, seed=3, epoch=0)
    per_rank = shares(4, 8, seed=3)
    assert [s[0] for s in per_rank] == order + order  # [C,A,D,B] -> [C,A,D,B,C,A,D,B]
    assert shares(4, 8, shuffle=False) == [[0], [1], [2], [3], [0], [1], [2], [3]]


def test_reshuffle_per_epoch_and_seed_known_case():
    base = epoch_order(20, seed=0, epoch=0)
    assert base == epoch_order(20, seed=0, epoch=0)  # deterministic
    assert base != list(range(20))
    assert epoch_order(20, seed=0, epoch=1) != base
    assert epoch_order(20, seed=1, epoch=0) != base
    # Epoch and seed are not simply added together.
    assert epoch_order(20, seed=1, epoch=0) != epoch_order(20, seed=0, epoch=1)


@SETTINGS
@given(n_items=st.integers(5, 60), seed=seeds, epoch=st.integers(0, 1000))
def test_reshuffle_per_epoch(n_items, seed, epoch):
    orders = {tuple(epoch_order(n_items, seed, e)) for e in range(epoch, epoch + 4)}
    assert len(orders) > 1


def test_default_rng_untouched():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    py_before, np_before = random.getstate(), np.random.get_state()[1].copy()
    runs = []
    for seed in (0, None):
        torch.manual_seed(seed or 99)
        expected_state = torch.get_rng_state()
        sampler = ShardedSampler(range(50), num_replicas=3, rank=1, seed=7)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            runs.append(list(sampler))
        state = sampler.state_dict()
        sampler.load_state_dict(state)
        list(
            ShardedSampler(
                range(50), num_replicas=2, rank=0, buckets=[range(20), range(20, 50)], batch_size=3
            )
        )
        assert torch.equal(torch.get_rng_state(), expected_state)
    # Same indices whatever the global seed was.
    assert runs[:3] == runs[3:]
    torch.manual_seed(1234)
    assert torch.equal(torch.get_rng_state(), before)
    assert random.getstate() == py_before
    assert np.array_equal(np.random.get_state()[1], np_before)


# ---------------------------------------------------------------------------- resume
@SETTINGS
@given(
    n_items=sizes,
    n=replicas,
    seed=seeds,
    epoch=epochs,
    drop_last=st.booleans(),
    data=st.data(),
)
def test_exact_resume(n_items, n, seed, epoch, drop_last, data):
    full = shares(n_items, n, epoch, seed=seed, drop_last=drop_last)
    k = data.draw(st.integers(0, len(full[0])), label="k")
    saver = make(n_items, n, 0, epoch, seed=seed, drop_last=drop_last)
    assert take(saver, k) == full[0][:k]
    state = saver.state_dict()
    assert state["cursor"] == k * n
    for r in range(n):  # rank 0's state resumes every rank
        resumed = make(n_items, n, r, seed=seed + 1 if seed < 1000 else 0, drop_last=drop_last)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)  # the resume loop re-selects the same epoch: kept
        assert resumed.seed == seed and resumed.epoch == epoch
        assert len(resumed) == len(full[r]) - k
        assert list(resumed) == full[r][k:]
        assert resumed.state_dict()["cursor"] == padded_len(n_items, n, drop_last)


@SETTINGS
@given(n_items=sizes, n=replicas, seed=seeds, data=st.data())
def test_state_dict_consumed_override(n_items, n, seed, data):
    sampler = make(n_items, n, n - 1, seed=seed)
    full = list(sampler)  # ran ahead to the end, like a prefetching DataLoader
    k = data.draw(st.integers(0, len(full)), label="k")
    state = sampler.state_dict(consumed=k)
    assert state["cursor"] == k * n
    resumed = make(n_items, n, n - 1, seed=seed)
    resumed.load_state_dict(state)
    assert list(resumed) == full[k:]
    for bad in (-1, len(full) + 1, "1", 1.0, True):
        with pytest.raises(ValueError, match="consumed"):
            sampler.state_dict(consumed=bad)


def run_elastic(n_items, n_old, n_new, k, seed, epoch):
    """Old ranks take k samples each, rank 0's state is loaded by every new rank."""
    old = shares(n_items, n_old, epoch, seed=seed)
    saver = make(n_items, n_old, 0, epoch, seed=seed)
    take(saver, k)
    state = saver.state_dict()
    consumed = [s[:k] for s in old]
    new = []
    for r in range(n_new):
        sampler = make(n_items, n_new, r, seed=seed)
        sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
        new.append(list(sampler))
        assert len(sampler) == len(new[-1])
    return consumed, new, state


@SETTINGS
@given(
    n_items=sizes,
    n_old=replicas,
    n_new=replicas,
    seed=seeds,
    epoch=epochs,
    data=st.data(),
)
def test_elastic_resume_nothing_lost(n_items, n_old, n_new, seed, epoch, data):
    k = data.draw(st.integers(0, padded_len(n_items, n_old, False) // n_old), label="k")
    consumed, new, _ = run_elastic(n_items, n_old, n_new, k, seed, epoch)
    before = set(itertools.chain.from_iterable(consumed))
    after = set(itertools.chain.from_iterable(new))
    assert before | after == set(range(n_items))
    order = epoch_order(n_items, seed, epoch)
    if n_new == n_old:
        # Same topology: the padded order simply continues (its padding may repeat samples).
        length = padded_len(n_items, n_old, False)
        assert interleave(new) == [order[p % n_items] for p in range(k * n_old, length)]
        return
    assert not before & after, "a sample seen before the resize was drawn again"
    # The exact rule: the unconsumed remainder of the same order, padded cyclically from its
    # start to a multiple of the new num_replicas, split strided.
    rest = order[min(k * n_old, n_items) :]
    expected = [rest[p % len(rest)] for p in range(padded_len(len(rest), n_new, False))]
    assert interleave(new) == expected


@pytest.mark.parametrize(("n_old", "n_new"), [(4, 2), (2, 4), (3, 5)])
def test_elastic_resume_drop_last(n_old, n_new):
    n_items, k = 23, 2
    saver = make(n_items, n_old, 0, 5, drop_last=True)
    take(saver, k)
    state = saver.state_dict()
    new = []
    for r in range(n_new):
        sampler = make(n_items, n_new, r, drop_last=True)
        sampler.load_state_dict(state)
        new.append(list(sampler))
    rest = epoch_order(n_items, 0, 5)[k * n_old :]
    assert interleave(new) == rest[: len(rest) // n_new * n_new]


@SETTINGS
@given(
    n_items=sizes,
    ns=st.tuples(replicas, replicas, replicas),
    seed=seeds,
    epoch=epochs,
    data=st.data(),
)
def test_resume_of_resumed_state(n_items, ns, seed, epoch, data):
    assume(ns[0] != ns[1] != ns[2])  # every step re-splits (same-size resume: exact, above)
    seen: list[set[int]] = []
    state = None
    for phase, n in enumerate(ns[:2]):
        runs = [make(n_items, n, r, epoch, seed=seed) for r in range(n)]
        if state is not None:
            for s in runs:
                s.load_state_dict(state)
        passes = [list(s) for s in runs]  # what this phase would draw uninterrupted
        k = data.draw(st.integers(0, len(passes[0])), label=f"k{phase}")
        taken = [take(s, k) for s in runs]
        assert taken == [p[:k] for p in passes]
        seen.append(set(itertools.chain.from_iterable(taken)))
        state = runs[0].state_dict()
        assert state == {**runs[-1].state_dict(), "rank": 0}  # one state for all ranks
        # Same topology: the (possibly already re-based) state resumes exactly.
        twin = make(n_items, n, n - 1, seed=seed)
        twin.load_state_dict(json.loads(json.dumps(state)))
        assert list(twin) == passes[-1][k:]
    last = []
    for r in range(ns[2]):
        sampler = make(n_items, ns[2], r, seed=seed)
        sampler.load_state_dict(state)
        last.append(list(sampler))
    seen.append(set(itertools.chain.from_iterable(last)))
    assert set().union(*seen) == set(range(n_items))
    for a, b in itertools.combinations(seen, 2):
        assert not a & b


def test_set_epoch_after_elastic_resume_starts_fresh_full_epoch():
    saver = make(30, 4, 0, epoch=2)
    take(saver, 3)
    state = saver.state_dict()
    sampler = make(30, 3, 1)
    sampler.load_state_dict(state)
    sampler.set_epoch(2)  # same epoch: resume point kept
    rest = list(sampler)
    assert len(rest) == math.ceil((30 - 12) / 3)
    assert list(sampler) == rest  # every pass of the resumed epoch restarts at the resume point
    sampler.set_epoch(3)
    assert list(sampler) == list(make(30, 3, 1, epoch=3))
    assert sampler.state_dict()["bases"] == [0]
    assert len(sampler) == 10


def test_cursor_counts_yields_and_stale_iterators_do_not_move_it():
    sampler = make(40, 4, 2)
    it = iter(sampler)
    assert sampler.state_dict()["cursor"] == 0
    for i in range(1, 4):
        next(it)
        assert sampler.state_dict()["cursor"] == 4 * i
    sampler.set_epoch(1)
    assert sampler.state_dict()["cursor"] == 0
    next(it)  # an iterator of the previous epoch
    assert sampler.state_dict()["cursor"] == 0
    second = iter(sampler)
    next(second)
    next(it)
    state = sampler.state_dict()
    assert state["cursor"] == 4 and state["epoch"] == 1  # only the newest pass counts


def test_state_dict_is_plain_and_json_round_trips():
    sampler = make(17, 3, 1, epoch=4, seed=11, buckets=[range(10), range(10, 17)], batch_size=2)
    take(sampler, 3)
    state = sampler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert all(isinstance(v, (int, str, list)) for v in state.values())
    assert state["version"] == 1 and state["epoch"] == 4 and state["seed"] == 11
    assert state["cursor"] == 9 and state["num_replicas"] == 3 and state["rank"] == 1
    assert state["dataset_len"] == 17 and state["bases"] == [0, 0]
    assert isinstance(state["buckets_fingerprint"], str) and state["buckets_fingerprint"]


# ---------------------------------------------------------------------------- buckets
@st.composite
def bucket_cases(draw):
    n_items = draw(st.integers(0, 60))
    n_buckets = draw(st.integers(1, 5))
    # -1: in no bucket. Some buckets may end up empty.
    owner = draw(st.lists(st.integers(-1, n_buckets - 1), min_size=n_items, max_size=n_items))
    buckets = [[i for i in range(n_items) if owner[i] == j] for j in range(n_buckets)]
    return n_items, buckets, owner


def bucket_runs(n_items, buckets, n, bs, epoch=0, **kw):
    return [make(n_items, n, r, epoch, buckets=buckets, batch_size=bs, **kw) for r in range(n)]


@SETTINGS
@given(
    case=bucket_cases(),
    n=st.integers(1, 6),
    bs=st.integers(1, 4),
    seed=seeds,
    epoch=epochs,
    drop_last=st.booleans(),
)
def test_buckets_one_bucket_per_step_and_per_bucket_padding(case, n, bs, seed, epoch, drop_last):
    n_items, buckets, owner = case
    runs = bucket_runs(n_items, buckets, n, bs, epoch, seed=seed, drop_last=drop_last)
    per_rank = [list(s.batches()) for s in runs]
    assert [list(s) for s in runs] == [list(itertools.chain(*b)) for b in per_rank]
    steps = len(per_rank[0])
    assert all(len(b) == steps for b in per_rank)
    assert all(len(s) == steps * bs for s in runs)
    # The reference order of every bucket: what one replica with batch_size 1 draws of it.
    single = list(make(n_items, 1, 0, epoch, buckets=buckets, batch_size=1, seed=seed))
    padded: dict[int, list[int]] = {j: [] for j in range(len(buckets))}
    for s in range(steps):
        assert all(len(b[s]) == bs for b in per_rank)
        owners = {owner[i] for b in per_rank for i in b[s]}
        assert len(owners) == 1, f"step {s} mixes buckets {owners}"
        padded[owners.pop()].extend(interleave([b[s] for b in per_rank]))
    for j, bucket in enumerate(buckets):
        order = [i for i in single if owner[i] == j]
        assert sorted(order) == bucket
        length = padded_len(len(bucket), n * bs, drop_last)
        assert padded[j] == [order[p % len(order)] for p in range(length)]


def test_bucket_schedule_is_deterministic_and_reshuffled_per_epoch():
    buckets = [list(range(0, 40)), list(range(40, 80)), [], list(range(80, 120))]

    def schedule(epoch, seed=0):
        batches = list(make(120, 2, 1, epoch, buckets=buckets, batch_size=4, seed=seed).batches())
        return [b[0] // 40 for b in batches]

    assert schedule(0) == schedule(0)
    assert sorted(schedule(0)) == [0] * 5 + [1] * 5 + [2] * 5  # index // 40: bucket 3 -> 2
    assert schedule(0) != schedule(1)
    assert schedule(0) != schedule(0, seed=1)
    ordered = list(make(120, 2, 0, 3, buckets=buckets, batch_size=4, shuffle=False).batches())
    assert [b[0] // 40 for b in ordered] == [0] * 5 + [1] * 5 + [2] * 5
    assert ordered[0] == [0, 2, 4, 6]
    # Every bucket has its own order: equal-sized buckets are not permuted alike.
    twins = make(40, 1, 0, buckets=[range(20), range(20, 40)], batch_size=20, shuffle=True)
    first, second = twins.batches()
    first, second = (first, second) if first[0] < 20 else (second, first)
    assert sorted(first) == list(range(20)) and sorted(second) == list(range(20, 40))
    assert [i - 20 for i in second] != first


@SETTINGS
@given(case=bucket_cases(), n=st.integers(1, 6), bs=st.integers(1, 4), seed=seeds, data=st.data())
def test_buckets_exact_resume(case, n, bs, seed, data):
    n_items, buckets, _ = case
    runs = bucket_runs(n_items, buckets, n, bs, 7, seed=seed)
    full = [list(s) for s in runs]
    k = data.draw(st.integers(0, len(full[0])), label="k")  # may stop mid-step
    take(runs[0], k)
    state = runs[0].state_dict()
    for r in range(n):
        resumed = make(n_items, n, r, buckets=buckets, batch_size=bs, seed=seed)
        resumed.load_state_dict(state)
        assert len(resumed) == len(full[r]) - k
        assert list(resumed) == full[r][k:]
    # Batch-wise: save after m whole steps, resume the remaining steps.
    m = data.draw(st.integers(0, len(full[0]) // bs), label="m")
    it = runs[1 % n].batches()
    done = list(itertools.islice(it, m))
    state = runs[1 % n].state_dict()
    assert state["cursor"] == m * n * bs
    resumed = make(n_items, n, 1 % n, buckets=buckets, batch_size=bs, seed=seed)
    resumed.load_state_dict(state)
    assert list(itertools.chain(*done, *resumed.batches())) == full[1 % n]


@SETTINGS
@given(
    case=bucket_cases(),
    n_old=st.integers(1, 6),
    n_new=st.integers(1, 6),
    bs=st.integers(1, 4),
    seed=seeds,
    data=st.data(),
)
def test_buckets_elastic_resume_nothing_lost(case, n_old, n_new, bs, seed, data):
    assume(n_old != n_new)  # same size: exact resume, tested above
    n_items, buckets, owner = case
    old = bucket_runs(n_items, buckets, n_old, bs, 2, seed=seed)
    full = [list(s) for s in old]
    k = data.draw(st.integers(0, len(full[0])), label="k")
    take(old[0], k)
    state = old[0].state_dict()
    before = {i for f in full for i in f[:k]}
    new = bucket_runs(n_items, buckets, n_new, bs, 0, seed=seed)
    for s in new:
        s.load_state_dict(state)
    per_rank = [list(s.batches()) for s in new]
    after = {i for b in per_rank for batch in b for i in batch}
    assert before | after == {i for i in range(n_items) if owner[i] >= 0}
    assert not before & after
    steps = len(per_rank[0])
    assert all(len(b) == steps and all(len(x) == bs for x in b) for b in per_rank)
    for s in range(steps):
        assert len({owner[i] for b in per_rank for i in b[s]}) == 1
    # The re-based state resumes again, under yet another topology.
    take(new[0], bs)
    again = make(n_items, 1, 0, buckets=buckets, batch_size=bs, seed=seed)
    again.load_state_dict(new[0].state_dict())
    third = set(again)
    first_step = {i for b in per_rank for i in (b[0] if b else [])}
    assert first_step | third >= after
    assert not third & before


def test_buckets_drop_last_drops_short_buckets_and_skips_empty():
    buckets = [[0, 1, 2], [], list(range(3, 20))]
    for r in range(2):
        sampler = make(20, 2, r, buckets=buckets, batch_size=3, drop_last=True)
        got = list(sampler)
        assert len(got) == len(sampler) == 6  # bucket 2: 17 -> 12 positions; 2 steps
        assert all(i >= 3 for i in got)
    padded = [list(make(20, 2, r, buckets=buckets, batch_size=3)) for r in range(2)]
    assert len(padded[0]) == 3 + 9  # bucket 0 padded to 6, bucket 2 to 18
    assert set(itertools.chain(*padded)) == set(range(20))


# ---------------------------------------------------------------------------- edge sizes
@pytest.mark.parametrize("n", [1, 2, 9])
@pytest.mark.parametrize("drop_last", [False, True])
def test_empty_dataset(n, drop_last):
    for r in range(n):
        sampler = make(0, n, r, drop_last=drop_last, batch_size=2)
        assert len(sampler) == 0 and list(sampler) == [] and list(sampler.batches()) == []
        state = sampler.state_dict()
        assert state["cursor"] == 0 and state["dataset_len"] == 0
        other = make(0, n + 1, 0, drop_last=drop_last)
        other.load_state_dict(state)
        assert list(other) == [] and len(other) == 0
        bucketed = make(0, n, r, buckets=[[], []], batch_size=2, drop_last=drop_last)
        assert list(bucketed) == [] and len(bucketed) == 0


def test_tiny_datasets():
    assert shares(1, 8) == [[0]] * 8
    assert shares(3, 4, drop_last=True) == [[]] * 4
    first, second = epoch_order(2, 0, 0)
    assert Counter(itertools.chain(*shares(2, 9))) == Counter({first: 5, second: 4})


# ---------------------------------------------------------------------------- validation
BAD_ARGS = [
    ({"num_replicas": 0}, ["num_replicas", "0"]),
    ({"num_replicas": -3}, ["num_replicas", "-3"]),
    ({"num_replicas": 2.0}, ["num_replicas", "2.0"]),
    ({"num_replicas": True}, ["num_replicas", "True"]),
    ({"rank": -1}, ["rank", "-1"]),
    ({"rank": 4}, ["rank", "4"]),
    ({"rank": "1"}, ["rank", "'1'"]),
    ({"seed": -1}, ["seed", "-1"]),
    ({"seed": 2**63}, ["seed", str(2**63)]),
    ({"seed": 1.5}, ["seed", "1.5"]),
    ({"shuffle": "yes"}, ["shuffle", "'yes'"]),
    ({"drop_last": 1}, ["drop_last", "1"]),
    ({"batch_size": 0, "buckets": [[0]]}, ["batch_size", "0"]),
    ({"batch_size": -2}, ["batch_size", "-2"]),
    ({"buckets": [[0, 1]]}, ["batch_size", "None"]),
    ({"buckets": [[0, 10]], "batch_size": 1}, ["buckets[0][1]", "10"]),
    ({"buckets": [[1], [-1]], "batch_size": 1}, ["buckets[1][0]", "-1"]),
    ({"buckets": [[0, 1.5]], "batch_size": 1}, ["buckets[0][1]", "1.5"]),
    ({"buckets": [["a"]], "batch_size": 1}, ["buckets[0][0]", "'a'"]),
    ({"buckets": [[True]], "batch_size": 1}, ["buckets[0][0]", "True"]),
    ({"buckets": [5], "batch_size": 1}, ["buckets[0]", "5"]),
    ({"buckets": "abc", "batch_size": 1}, ["buckets", "'abc'"]),
]


@pytest.mark.parametrize(("kwargs", "words"), BAD_ARGS)
def test_bad_arguments(kwargs, words):
    args = {"num_replicas": 4, "rank": 0, **kwargs}
    with pytest.raises(ValueError) as info:
        ShardedSampler(range(10), **args)
    for word in words:
        assert word in str(info.value)


def test_bad_dataset_epoch_and_batches_without_batch_size():
    with pytest.raises(ValueError, match="dataset"):
        ShardedSampler(object(), num_replicas=1, rank=0)
    sampler = make(10, 2, 0)
    for bad in (-1, 1.0, "2"):
        with pytest.raises(ValueError, match="epoch"):
            sampler.set_epoch(bad)
    with pytest.raises(ValueError, match="batch_size"):
        sampler.batches()


def test_accepts_numpy_and_tensor_buckets():
    sampler = make(6, 1, 0, buckets=[np.arange(3), torch.arange(3, 6)], batch_size=3)
    assert sorted(sampler) == list(range(6))
    with pytest.raises(ValueError, match="buckets"):
        make(6, 1, 0, buckets=[np.array([0.0, 1.0])], batch_size=1)


def mutate(state, key, value):
    out = dict(state)
    if value is DELETE:
        del out[key]
    else:
        out[key] = value
    return out


DELETE = object()
BAD_STATES = [
    ("cursor", DELETE, "cursor"),
    ("extra", 1, "extra"),
    ("format", "torch", "format"),
    ("version", 2, "version"),
    ("version", "1", "version"),
    ("epoch", -1, "epoch"),
    ("epoch", 1.5, "epoch"),
    ("seed", -1, "seed"),
    ("seed", "0", "seed"),
    ("cursor", -4, "cursor"),
    ("cursor", 6, "cursor"),  # not a multiple of num_replicas
    ("cursor", 10_000, "cursor"),
    ("cursor", True, "cursor"),
    ("num_replicas", 0, "num_replicas"),
    ("num_replicas", "4", "num_replicas"),
    ("rank", 4, "rank"),
    ("rank", -1, "rank"),
    ("dataset_len", 21, "dataset_len"),
    ("dataset_len", None, "dataset_len"),
    ("shuffle", False, "shuffle"),
    ("shuffle", "True", "shuffle"),
    ("drop_last", True, "drop_last"),
    ("buckets_fingerprint", "abc", "buckets_fingerprint"),
    ("buckets_fingerprint", 5, "buckets_fingerprint"),
    ("bases", [0, 0], "bases"),
    ("bases", [21], "bases"),
    ("bases", [-1], "bases"),
    ("bases", "0", "bases"),
    ("bases", [1.0], "bases"),
]


@pytest.mark.parametrize(("key", "value", "word"), BAD_STATES)
def test_malformed_state_refused_and_sampler_unchanged(key, value, word):
    loaded = make(20, 4, 1, epoch=3, seed=5)
    take(loaded, 2)
    sampler = make(20, 4, 2, seed=9)
    sampler.load_state_dict(loaded.state_dict())
    before = sampler.state_dict()
    # The refused state differs from the loaded one in every mutable field.
    other = make(20, 4, 0, epoch=4, seed=6)
    take(other, 1)
    other_state = other.state_dict()
    assert all(other_state[f] != before[f] for f in ("epoch", "seed", "cursor", "rank"))
    with pytest.raises(ValueError, match=word):
        sampler.load_state_dict(mutate(other_state, key, value))
    assert sampler.state_dict() == before
    assert list(sampler) == list(make(20, 4, 2, epoch=3, seed=5))[2:]


@pytest.mark.parametrize("state", [None, [], "state"])
def test_non_dict_state_refused(state):
    sampler = make(5, 1, 0)
    with pytest.raises(ValueError, match="state"):
        sampler.load_state_dict(state)
    assert sampler.state_dict()["cursor"] == 0


def test_bucket_state_into_other_buckets_refused():
    a = make(10, 2, 0, buckets=[range(5), range(5, 10)], batch_size=2)
    b = make(10, 2, 0, buckets=[range(4), range(4, 10)], batch_size=2)
    c = make(10, 2, 0, buckets=[range(5), range(5, 10)], batch_size=1)
    for other in (b, c, make(10, 2, 0)):
        with pytest.raises(ValueError, match="buckets_fingerprint"):
            other.load_state_dict(a.state_dict())


def test_without_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"seed=None needs torch\.distributed"):
        ShardedSampler(range(5), num_replicas=1, rank=0, seed=None)
    with pytest.raises(ValueError, match=r"torch\.distributed"):
        dp_topology_from_group()


# ---------------------------------------------------------------------------- DataLoader
def test_dataloader_integration():
    data = list(range(100, 130))
    buckets = [list(range(0, 12)), list(range(12, 30))]
    sampler = ShardedSampler(data, num_replicas=2, rank=1, buckets=buckets, batch_size=3)
    batch_sampler = ShardedBatchSampler(sampler)
    loader = DataLoader(data, batch_sampler=batch_sampler)
    expected = list(sampler.batches())
    assert len(loader) == len(expected) == 5
    got = [b.tolist() for b in loader]
    assert got == [[data[i] for i in b] for b in expected]
    # Checkpoint by consumed batches, resume the rest.
    state = batch_sampler.state_dict(consumed_batches=2)
    resumed = ShardedBatchSampler(
        ShardedSampler(data, num_replicas=2, rank=1, buckets=buckets, batch_size=3)
    )
    resumed.load_state_dict(state)
    assert len(resumed) == 3 and list(resumed) == expected[2:]
    # A pass resumed mid-step starts with a short list; consumed_batches counts it.
    mid = ShardedSampler(data, num_replicas=2, rank=1, buckets=buckets, batch_size=3)
    take(mid, 4)  # one step and one sample of the next
    mid_batches = ShardedBatchSampler(
        ShardedSampler(data, num_replicas=2, rank=1, buckets=buckets, batch_size=3)
    )
    mid_batches.load_state_dict(mid.state_dict())
    rest = list(mid_batches)
    assert len(mid_batches) == len(rest) == 4
    assert rest == [expected[1][1:], *expected[2:]]
    again = ShardedBatchSampler(
        ShardedSampler(data, num_replicas=2, rank=1, buckets=buckets, batch_size=3)
    )
    again.load_state_dict(mid_batches.state_dict(consumed_batches=2))
    assert list(again) == expected[3:]
    # Plain sampler= use.
    flat = ShardedSampler(data, num_replicas=3, rank=0)
    assert [int(x) for x in DataLoader(data, sampler=flat, batch_size=None)] == [
        data[i] for i in flat
    ]
    with pytest.raises(ValueError, match="sampler"):
        ShardedBatchSampler(flat)


# ---------------------------------------------------------------------------- multi-process
def _dist_worker(rank: int, world: int) -> dict:
    """In a rank of ``harness.run_ranks`` (gloo initialised): what its samplers draw."""
    blocks = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sp_group = blocks[rank // 2]
    sampler = ShardedSampler(
        range(37),
        **dict(zip(("num_replicas", "rank"), dp_topology_from_group(sp_group), strict=True)),
    )
    result = {"topo": [sampler.num_replicas, sampler.rank], "epochs": []}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        result["epochs"].append(list(sampler))
    unseeded = ShardedSampler(range(37), num_replicas=2, rank=sampler.rank, seed=None)
    result["seed"] = unseeded.seed
    result["unseeded"] = list(unseeded)
    result["strided"] = list(dp_topology_from_group(strided[rank % 2]))
    result["no_sp"] = list(dp_topology_from_group(None))
    uneven = [dist.new_group([0]), dist.new_group([1, 2, 3])]
    try:
        dp_topology_from_group(uneven[min(rank, 1)])
        result["uneven"] = "accepted"
    except ValueError as exc:
        result["uneven"] = str(exc)
    return result


@pytest.mark.timeout(120)
def test_multiprocess_sp_peers_draw_identical_indices():
    # warm ranks (NOTE [warm ranks]): seed=None's seed comes from secrets, which a fork
    # does not repeat, so a rank drawing its own seed still shows
    from tests.support.harness import run_ranks

    world = 4
    res = run_ranks(_dist_worker, world, timeout=100)
    assert [r["topo"] for r in res] == [[2, 0], [2, 0], [2, 1], [2, 1]]
    assert [r["strided"] for r in res] == [[2, 0], [2, 1], [2, 0], [2, 1]]
    assert [r["no_sp"] for r in res] == [[4, r] for r in range(world)]
    assert all("sp_group" in r["uneven"] for r in res), [r["uneven"] for r in res]
    for epoch in range(2):
        assert res[0]["epochs"][epoch] == res[1]["epochs"][epoch]
        assert res[2]["epochs"][epoch] == res[3]["epochs"][epoch]
        assert set(res[0]["epochs"][epoch]) | set(res[2]["epochs"][epoch]) == set(range(37))
        assert len(res[0]["epochs"][epoch]) == len(res[2]["epochs"][epoch]) == 19
        # The same order as this process computes: nothing rank-local went in.
        assert res[0]["epochs"][epoch] == list(make(37, 2, 0, epoch))
        assert res[2]["epochs"][epoch] == list(make(37, 2, 1, epoch))
    assert res[0]["epochs"][0] != res[0]["epochs"][1]
    assert len({r["seed"] for r in res}) == 1
    seed = res[0]["seed"]
    assert res[0]["unseeded"] == res[1]["unseeded"] == list(make(37, 2, 0, seed=seed))
    assert res[2]["unseeded"] == res[3]["unseeded"] == list(make(37, 2, 1, seed=seed))

"""BalancedBatchSampler: coverage, budget, balance, determinism, exact and elastic resume."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from shmloader import BalancedBatchSampler, TopologyMismatchError
from shmloader.samplers._packing import (
    greedy_bins,
    group_and_refine,
    pack_levels,
    pack_lpt,
    refine,
)
from shmloader.samplers.balanced import plan_window

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = settings(
    deadline=None,
    max_examples=60,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CAP = 100


@st.composite
def length_lists(draw, max_size: int = 60):
    """Length distributions: uniform, long-tailed (a few near the cap), constant, tiny."""
    kind = draw(st.sampled_from(["uniform", "tail", "constant", "small"]))
    size = draw(st.integers(0, max_size))
    if kind == "uniform":
        return draw(st.lists(st.integers(1, CAP), min_size=size, max_size=size))
    if kind == "tail":
        small = st.integers(1, 12)
        big = st.integers(60, CAP)
        return draw(st.lists(st.one_of(small, small, small, big), min_size=size, max_size=size))
    if kind == "constant":
        return [draw(st.integers(0, CAP))] * size
    return draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))


replicas = st.integers(1, 5)
windows = st.integers(1, 4)
costs = st.sampled_from(["tokens", "attention"])
seeds = st.integers(0, 2**63 - 1)


def make(lengths, n, r, epoch=0, **kw) -> BalancedBatchSampler:
    kw.setdefault("max_tokens", CAP)
    sampler = BalancedBatchSampler(lengths, num_replicas=n, rank=r, **kw)
    sampler.set_epoch(epoch)
    return sampler


def run_all(lengths, n, epoch=0, **kw) -> list[list[list[int]]]:
    return [list(make(lengths, n, r, epoch, **kw)) for r in range(n)]


def flat(per_rank) -> list[int]:
    return [i for lists in per_rank for micro in lists for i in micro]


def take(sampler, k) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), k))


def step_costs(per_rank, cost_of) -> list[list[float]]:
    steps = zip(*per_rank, strict=True)
    return [[sum(cost_of(i) for i in micro) for micro in step] for step in steps]


# ---------------------------------------------------------------------------- coverage
@SETTINGS
@given(
    lengths=length_lists(),
    n=replicas,
    window=windows,
    cost=costs,
    seed=seeds,
    epoch=st.integers(0, 100),
)
def test_every_sample_once_within_budget_equal_steps(lengths, n, window, cost, seed, epoch):
    kw = {"window": window, "cost": cost, "seed": seed}
    runs = run_all(lengths, n, epoch, **kw)
    sampler = make(lengths, n, 0, epoch, **kw)
    # Equal step counts, the same __len__ on every rank: as many steps as plain greedy
    # packing of the epoch's order into max_tokens bins, spread over n replicas.
    order = sampler._order(epoch)
    greedy = len(greedy_bins([lengths[i] for i in order], CAP))
    assert [len(r) for r in runs] == [math.ceil(greedy / n)] * n == [len(sampler)] * n
    for micro in itertools.chain.from_iterable(runs):
        assert micro, "an empty micro-batch"
        assert sum(lengths[i] for i in micro) <= CAP
    counts = Counter(flat(runs))
    assert set(counts) == set(range(len(lengths)))
    # Padding: the extra slots repeat the order's first samples, cyclically (spread).
    extra = sum(counts.values()) - len(lengths)
    assert extra >= 0
    expected = Counter(range(len(lengths))) + Counter(order[k % len(order)] for k in range(extra))
    assert counts == expected


@SETTINGS
@given(lengths=length_lists(), n=replicas, window=windows, seed=seeds)
def test_drop_last_never_repeats(lengths, n, window, seed):
    runs = run_all(lengths, n, window=window, seed=seed, drop_last=True)
    padded = run_all(lengths, n, window=window, seed=seed)
    counts = Counter(flat(runs))
    assert all(c == 1 for c in counts.values())
    order = make(lengths, n, 0, seed=seed)._order(0)
    greedy = len(greedy_bins([lengths[i] for i in order], CAP))
    assert [len(r) for r in runs] == [greedy // n] * n
    assert len(padded[0]) == math.ceil(greedy / n)
    for micro in itertools.chain.from_iterable(runs):
        assert micro and sum(lengths[i] for i in micro) <= CAP


def test_padding_example():
    # 5 samples of 60 tokens (one per bin), 2 replicas: 3 steps, one slot of padding.
    sampler = make([60] * 5, 2, 0, window=2, seed=3)
    order = sampler._order(0)
    runs = run_all([60] * 5, 2, window=2, seed=3)
    assert [len(r) for r in runs] == [3, 3]
    assert Counter(flat(runs)) == Counter([*range(5), order[0]])


def test_tiny_and_empty():
    assert run_all([], 3) == [[], [], []]
    assert len(make([], 3, 0)) == 0
    runs = run_all([7], 3)  # one sample, three replicas: each gets it once
    assert runs == [[[0]], [[0]], [[0]]]
    assert run_all([7], 3, drop_last=True) == [[], [], []]


# ---------------------------------------------------------------------------- balance
def test_plan_window_balances_known_cases():
    # A perfect split exists: LPT finds it.
    lengths = [5, 5, 3, 3, 2, 2]
    plan = plan_window(lengths, lengths, num_replicas=2, steps=1, max_tokens=10)
    assert sorted(sum(lengths[p] for p in m) for m in plan[0]) == [10, 10]
    # Steps group bins of similar cost: two heavy bins together, two light ones together.
    lengths = [90, 88, 10, 9, 1, 1, 1, 1]
    plan = plan_window(lengths, lengths, num_replicas=2, steps=2, max_tokens=100)
    per_step = sorted(sorted(sum(lengths[p] for p in m) for m in step) for step in plan)
    assert per_step[1][0] >= 88, per_step  # the 90 and 88 share a step
    # Refinement: LPT alone gives [3, 2, 2] | [3, 2] (7 vs 5); a swap evens it to 6 | 6.
    lengths = [3, 3, 2, 2, 2]
    plan = plan_window(lengths, lengths, num_replicas=2, steps=1, max_tokens=100)
    assert sorted(sum(lengths[p] for p in m) for m in plan[0]) == [6, 6]
    # ... but never past max_tokens: here the even split by cost would need 11 tokens.
    plan = plan_window(lengths, [3, 3, 2, 2, 2], num_replicas=2, steps=1, max_tokens=7)
    assert all(sum(lengths[p] for p in m) <= 7 for m in plan[0])


def test_refinement_never_exceeds_the_budget():
    # Moving (or swapping) the 8-token sample would even the costs best, but the other bin
    # has 2 tokens of room: only the 1-token samples may move.
    lengths, costs = [1, 1, 8, 4, 4], [1, 1, 6, 0, 0]
    step = [[0, 1, 2], [3, 4]]
    cost, tokens = [8, 0], [10, 8]
    refine(step, lengths, costs, 10, cost, tokens)
    assert sorted(p for b in step for p in b) == [0, 1, 2, 3, 4]
    assert 2 in step[0]
    for b, c, t in zip(step, cost, tokens, strict=True):
        assert sum(lengths[p] for p in b) == t <= 10
        assert sum(costs[p] for p in b) == c
    assert max(cost) < 8


def test_steps_group_bins_of_similar_cost():
    bins = [[0], [1], [2], [3]]
    lengths = [50, 40, 55, 45]
    plan, score = group_and_refine(bins, lengths, lengths, 2, 2, 100)
    assert plan == [[[2], [0]], [[3], [1]]]  # (55, 50) and (45, 40), not (50, 40), (55, 45)
    assert score == pytest.approx(55 / 52.5 + 45 / 42.5)


@pytest.mark.parametrize("cost", ["tokens", "attention"])
def test_plan_window_keeps_the_better_packing(cost):
    lengths = _long_tail(1500, seed=4)
    windows = greedy_bins(lengths, 16384)
    n, steps = 4, 6
    cut = windows[n * steps - 1][-1] + 1
    lens = lengths[:cut]
    costs = lens if cost == "tokens" else [v * v for v in lens]
    order = sorted(range(len(lens)), key=lambda p: (-costs[p], -lens[p], p))
    scores = []
    for bins in (
        pack_lpt(lens, costs, order, n * steps, 16384),
        pack_levels(lens, costs, order, steps, n, 16384),
    ):
        assert bins is not None
        scores.append(group_and_refine(bins, lens, costs, n, steps, 16384)[1])
    plan = plan_window(lens, costs, num_replicas=n, steps=steps, max_tokens=16384)
    got = 0.0
    for step in plan:
        c = [sum(costs[p] for p in m) for m in step]
        got += max(c) / (sum(c) / n)
    assert got == pytest.approx(min(scores))
    assert scores[0] != pytest.approx(scores[1])  # the choice matters here


def _long_tail(n_samples: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1500), 1.2, n_samples), 64, 16384).astype(int).tolist()


def _greedy_baseline_ratio(lengths, n, cost_of, cap, seed) -> float:
    """Mean per-step max/mean ratio of ShardedSampler-style shares packed greedily."""
    from shmloader import ShardedSampler

    streams = []
    for r in range(n):
        order = list(ShardedSampler(range(len(lengths)), num_replicas=n, rank=r, seed=seed))
        bins = greedy_bins([lengths[i] for i in order], cap)
        streams.append([[order[p] for p in b] for b in bins])
    steps = min(len(s) for s in streams)
    ratios = []
    for s in range(steps):
        c = [sum(cost_of(i) for i in streams[r][s]) for r in range(n)]
        ratios.append(max(c) / (sum(c) / n))
    return sum(ratios) / len(ratios)


@pytest.mark.parametrize("cost", ["tokens", "attention"])
def test_balance_beats_greedy_sharding_on_a_long_tail(cost):
    lengths = _long_tail(3000)
    n, cap = 4, 16384
    cost_of = (lambda i: lengths[i]) if cost == "tokens" else (lambda i: lengths[i] ** 2)
    runs = run_all(lengths, n, max_tokens=cap, window=8, cost=cost, seed=1)
    ratios = [max(c) / (sum(c) / n) for c in step_costs(runs, cost_of)]
    ours = sum(ratios) / len(ratios)
    base = _greedy_baseline_ratio(lengths, n, cost_of, cap, seed=1)
    assert ours < 1 + (base - 1) / 3, (ours, base)


# ---------------------------------------------------------------------------- cost
@SETTINGS
@given(lengths=length_lists(), n=replicas, window=windows, seed=seeds)
def test_cost_callable_honoured(lengths, n, window, seed):
    calls = []

    def square(length: int) -> int:
        calls.append(length)
        return length * length

    by_callable = run_all(lengths, n, window=window, seed=seed, cost=square)
    assert Counter(calls) == {v: n for v in set(lengths)}  # once per distinct length, per rank
    assert by_callable == run_all(lengths, n, window=window, seed=seed, cost="attention")
    identity = run_all(lengths, n, window=window, seed=seed, cost=lambda v: v)
    assert identity == run_all(lengths, n, window=window, seed=seed, cost="tokens")


def test_cost_callable_counts_samples():
    # cost = 1 per sample: the planner evens out sample counts, whatever the lengths.
    lengths = [60] * 2 + [1] * 60
    runs = run_all(lengths, 4, max_tokens=1000, window=2, cost=lambda v: 1)
    for step in zip(*runs, strict=True):
        counts = [len(m) for m in step]
        assert max(counts) - min(counts) <= 1, counts
    by_tokens = run_all(lengths, 4, max_tokens=1000, window=2, cost="tokens")
    assert by_tokens != runs


# ---------------------------------------------------------------------------- determinism
def test_deterministic_across_instances_and_ignores_global_rng():
    lengths = _long_tail(400, seed=3)
    torch.manual_seed(1)
    a = run_all(lengths, 3, max_tokens=16384, cost="attention", seed=9, epoch=2)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    b = run_all(lengths, 3, max_tokens=16384, cost="attention", seed=9, epoch=2)
    assert a == b
    assert torch.equal(torch.get_rng_state(), state)
    c = run_all(lengths, 3, max_tokens=16384, cost="attention", seed=9, epoch=3)
    assert c != a  # another epoch, another order


_CHILD = """
import json, sys
import numpy as np
from shmloader import BalancedBatchSampler
lengths = np.clip(np.random.default_rng(3).lognormal(7.3, 1.2, 400), 64, 16384).astype(int)
out = [list(BalancedBatchSampler(lengths, num_replicas=3, rank=r, max_tokens=16384,
                                 cost=c, seed=9, window=4)) for r in range(3)
       for c in ("tokens", "attention")]
print(json.dumps(out))
"""


def test_deterministic_across_processes():
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": REPO}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=100
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout))
    lengths = np.clip(np.random.default_rng(3).lognormal(7.3, 1.2, 400), 64, 16384).astype(int)
    here = [
        list(make(lengths, 3, r, max_tokens=16384, cost=c, seed=9, window=4))
        for r in range(3)
        for c in ("tokens", "attention")
    ]
    assert outs[0] == outs[1] == here


# ---------------------------------------------------------------------------- resume
@SETTINGS
@given(
    lengths=length_lists(40),
    n=replicas,
    window=windows,
    seed=seeds,
    drop_last=st.booleans(),
)
def test_exact_resume_at_every_position(lengths, n, window, seed, drop_last):
    kw = {"window": window, "seed": seed, "drop_last": drop_last}
    full = run_all(lengths, n, 4, **kw)
    for k in range(len(full[0]) + 1):
        saver = make(lengths, n, 0, 4, **kw)
        assert take(saver, k) == full[0][:k]
        state = json.loads(json.dumps(saver.state_dict()))
        assert state["cursor"] == k
        for r in range(n):  # rank 0's state resumes every rank
            resumed = make(lengths, n, r, window=window, seed=0, drop_last=drop_last)
            resumed.load_state_dict(state)
            resumed.set_epoch(4)  # the resume loop re-selects the same epoch: kept
            assert resumed.seed == seed and resumed.epoch == 4
            assert len(resumed) == len(full[r]) - k
            assert list(resumed) == full[r][k:]
            assert list(resumed) == full[r][k:]  # every pass of the epoch restarts there


def elastic(lengths, ns, ks, **kw):
    """Run topologies ``ns`` in turn, each for ``ks[i]`` steps (the last to the end)."""
    delivered: list[list[int]] = []
    state = None
    for phase, n in enumerate(ns):
        runs = [make(lengths, n, r, **kw) for r in range(n)]
        if state is not None:
            for s in runs:
                s.load_state_dict(state)
        assert len({len(s) for s in runs}) == 1
        passes = [list(s) for s in runs]
        k = len(passes[0]) if phase == len(ns) - 1 else min(ks[phase], len(passes[0]))
        taken = [take(s, k) for s in runs]
        assert taken == [p[:k] for p in passes]
        delivered.append(flat(taken))
        state = runs[0].state_dict()
        assert state == {**runs[-1].state_dict(), "rank": 0}
    return delivered, state


@SETTINGS
@given(
    lengths=length_lists(40),
    ns=st.lists(replicas, min_size=2, max_size=3),
    window=windows,
    cost=costs,
    seed=seeds,
    data=st.data(),
)
def test_elastic_resume_nothing_lost_or_repeated(lengths, ns, window, cost, seed, data):
    ks = [data.draw(st.integers(0, 12), label=f"k{i}") for i in range(len(ns))]
    kw = {"window": window, "cost": cost, "seed": seed}
    delivered, _ = elastic(lengths, ns, ks, **kw)
    everything = Counter(itertools.chain.from_iterable(delivered))
    assert set(everything) == set(range(len(lengths)))
    # Nothing delivered by one topology comes again under a later one with another size,
    # unless the earlier one ran into its padding (whose repeats then count as delivered).
    for a, b in itertools.combinations(range(len(ns)), 2):
        if all(ns[i] != ns[i + 1] for i in range(a, b)):
            assert not set(delivered[a]) & set(delivered[b])


@SETTINGS
@given(
    lengths=length_lists(40),
    n_old=replicas,
    n_new=replicas,
    window=windows,
    seed=seeds,
    data=st.data(),
)
def test_resume_after_elastic_resume_is_exact(lengths, n_old, n_new, window, seed, data):
    kw = {"window": window, "seed": seed}
    k = data.draw(st.integers(0, 10), label="k")
    saver = make(lengths, n_old, 0, **kw)
    take(saver, k)
    state = saver.state_dict()
    runs = [make(lengths, n_new, r, **kw) for r in range(n_new)]
    for s in runs:
        s.load_state_dict(state)
    full = [list(s) for s in runs]
    j = data.draw(st.integers(0, len(full[0])), label="j")
    take(runs[0], j)
    state2 = json.loads(json.dumps(runs[0].state_dict()))
    for r in range(n_new):  # same topology: the re-planned rest continues exactly
        twin = make(lengths, n_new, r, **kw)
        twin.load_state_dict(state2)
        assert list(twin) == full[r][j:]


def test_elastic_resume_mid_window_known_case():
    lengths = [60, 50, 40, 30, 20, 10, 5, 5, 5, 5, 90, 80, 70, 1, 2, 3] * 3
    saver = make(lengths, 4, 0, window=4, seed=7)
    take(saver, 3)  # inside the first window
    old = [take(make(lengths, 4, r, window=4, seed=7), 3) for r in range(4)]
    state = saver.state_dict()
    new = []
    for r in range(3):
        s = make(lengths, 3, r, window=4, seed=7)
        s.load_state_dict(state)
        assert s.state_dict()["history"] == [[4, 3]] and s.cursor == 0
        new.append(list(s))
    before, after = set(flat(old)), Counter(flat(new))
    assert not before & set(after)
    assert before | set(after) == set(range(len(lengths)))


def test_state_dict_consumed_and_stale_iterators():
    lengths = _long_tail(200, seed=5)
    sampler = make(lengths, 2, 1, max_tokens=16384, window=3)
    full = list(sampler)  # ran ahead to the end, like a prefetching DataLoader
    state = sampler.state_dict(consumed=4)
    assert state["cursor"] == 4
    resumed = make(lengths, 2, 1, max_tokens=16384, window=3)
    resumed.load_state_dict(state)
    assert list(resumed) == full[4:]
    for bad in (-1, len(full) + 1, "1", 1.0, True):
        with pytest.raises(ValueError, match="consumed"):
            sampler.state_dict(consumed=bad)
    it = iter(sampler)
    next(it)
    sampler.set_epoch(1)
    assert sampler.cursor == 0
    next(it)  # a stale iterator of epoch 0
    assert sampler.cursor == 0
    second = iter(sampler)
    next(second)
    assert sampler.state_dict()["cursor"] == 1 and sampler.state_dict()["epoch"] == 1
    sampler.set_epoch(1)  # same epoch: kept
    assert sampler.cursor == 1


def test_plan_cache_is_keyed_on_the_seed():
    # A sampler that planned under its own seed, then loads a state of another seed at
    # the same epoch, history and size, must plan the state's seed, not reuse its cache.
    lengths = _long_tail(120, seed=3)
    planned = make(lengths, 2, 1, max_tokens=16384, window=2, seed=1)
    assert len(planned) > 2  # the segment of seed 1 is now cached
    other = make(lengths, 2, 0, max_tokens=16384, window=2, seed=2)
    want = list(make(lengths, 2, 1, max_tokens=16384, window=2, seed=2))
    assert want != list(planned)  # the seeds do plan differently
    planned.load_state_dict(other.state_dict())
    assert planned.seed == 2
    assert list(planned) == want


def test_state_dict_consumed_after_a_resume_keeps_the_resume_point():
    lengths = _long_tail(160, seed=9)
    kw = {"max_tokens": 16384, "window": 3, "seed": 4}
    full = list(make(lengths, 2, 0, **kw))
    saver = make(lengths, 2, 0, **kw)
    take(saver, 3)
    resumed = make(lengths, 2, 0, **kw)
    resumed.load_state_dict(saver.state_dict())  # the pass starts at step 3
    assert list(resumed) == full[3:]  # ran ahead to the end, like a prefetching DataLoader
    state = resumed.state_dict(consumed=2)  # 2 lists of this pass were used
    assert state["cursor"] == 5
    again = make(lengths, 2, 0, **kw)
    again.load_state_dict(state)
    assert list(again) == full[5:]
    assert resumed.state_dict(consumed=len(resumed))["cursor"] == len(full)
    with pytest.raises(ValueError, match="consumed"):
        resumed.state_dict(consumed=len(full) - 2)  # more than the pass holds


@pytest.mark.parametrize("seed", [13, 14, 15, 16])
def test_elastic_resume_never_plans_consumed_samples_again(seed):
    # Three topologies, each stopped inside a window: every later segment is planned
    # from what no earlier topology delivered (padding aside, which repeats the later
    # segment's own samples), and all samples are delivered.
    lengths = [60, 50, 40, 30, 20, 10, 5, 5, 5, 5, 90, 80, 70, 1, 2, 3, 44, 33] * 4
    kw = {"window": 4, "seed": seed}
    delivered, state = [], None
    for n, k in ((4, 5), (3, 2), (2, None)):
        runs = [make(lengths, n, r, **kw) for r in range(n)]
        for sampler in runs:
            if state is not None:
                sampler.load_state_dict(state)
        taken = [take(sampler, len(sampler) if k is None else k) for sampler in runs]
        delivered.append(set(flat(taken)))
        state = runs[0].state_dict()
        if k is not None:
            assert 0 < k < len(runs[0])
    assert state["history"] == [[4, 5], [3, 2]]
    for a, b in itertools.combinations(range(3), 2):
        assert not delivered[a] & delivered[b], f"topologies {a} and {b} share samples"
    assert set().union(*delivered) == set(range(len(lengths)))


def test_set_epoch_after_resume_starts_fresh():
    lengths = [10, 20, 30, 40, 50, 60, 70, 80] * 4
    saver = make(lengths, 2, 0, epoch=2)
    take(saver, 3)
    s = make(lengths, 3, 1)
    s.load_state_dict(saver.state_dict())
    s.set_epoch(2)
    assert s.epoch == 2 and s.state_dict()["history"] == [[2, 3]]
    s.set_epoch(3)
    assert s.state_dict()["history"] == [] and list(s) == list(make(lengths, 3, 1, epoch=3))


# ---------------------------------------------------------------------------- validation
def test_too_long_sample_names_index_and_length():
    with pytest.raises(ValueError, match=r"lengths\[2\]=101 .*max_tokens=100"):
        BalancedBatchSampler([5, 6, 101], num_replicas=1, rank=0, max_tokens=100)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_replicas": 0}, "num_replicas"),
        ({"rank": 2}, "rank"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"window": 0}, "window"),
        ({"cost": "flops"}, "cost"),
        ({"cost": lambda v: -1}, r"cost\(1\)"),
        ({"cost": lambda v: float("nan")}, r"cost\(1\)"),
        ({"seed": -1}, "seed"),
        ({"drop_last": 1}, "drop_last"),
        ({"lengths": [1, -2]}, r"lengths\[1\]=-2"),
        ({"lengths": [1, 2.5]}, r"lengths\[1\]=2\.5"),
        ({"lengths": "abc"}, "lengths"),
        ({"lengths": np.ones(3)}, "dtype"),
        ({"lengths": lambda i: 3}, "num_samples"),
        ({"lengths": [1, 2], "num_samples": 3}, "num_samples"),
    ],
)
def test_bad_arguments(kwargs, words):
    args = {"lengths": [1, 2, 3], "num_replicas": 2, "rank": 1, "max_tokens": 10, **kwargs}
    with pytest.raises(ValueError, match=words):
        BalancedBatchSampler(args.pop("lengths"), **args)


def test_lengths_forms():
    ref = list(make([3, 9, 4, 7, 1], 2, 0, max_tokens=10))
    assert list(make(np.array([3, 9, 4, 7, 1]), 2, 0, max_tokens=10)) == ref
    assert list(make(torch.tensor([3, 9, 4, 7, 1]), 2, 0, max_tokens=10)) == ref
    table = [3, 9, 4, 7, 1]
    reads = []

    def length(i: int) -> int:
        reads.append(i)
        return table[i]

    sampler = make(length, 2, 0, max_tokens=10, num_samples=5)
    assert reads == list(range(5))  # read once, at construction
    assert list(sampler) == ref and list(sampler) == ref and reads == list(range(5))


def _mutate(state, key, value):
    out = dict(state)
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


@pytest.mark.parametrize(
    ("key", "value", "error", "word"),
    [
        ("format", "x", ValueError, "format"),
        ("version", 2, ValueError, "version"),
        ("epoch", -1, ValueError, "epoch"),
        ("seed", "1", ValueError, "seed"),
        ("cursor", 10_000, ValueError, "cursor"),
        ("cursor", -1, ValueError, "cursor"),
        ("num_replicas", 0, ValueError, "num_replicas"),
        ("rank", 5, ValueError, "rank"),
        ("history", [[2]], ValueError, "history"),
        ("history", [[2, 10_000]], ValueError, "history"),
        ("history", "x", ValueError, "history"),
        ("max_tokens", 99, TopologyMismatchError, "max_tokens"),
        ("window", 3, TopologyMismatchError, "window"),
        ("cost", "attention", TopologyMismatchError, "cost"),
        ("drop_last", True, TopologyMismatchError, "drop_last"),
        ("dataset_len", 7, TopologyMismatchError, "dataset_len"),
        ("fingerprint", "0" * 64, TopologyMismatchError, "lengths/costs"),
        ("window", "8", ValueError, "window"),
        ("cursor", None, ValueError, "missing"),
        ("extra", 1, ValueError, "unknown"),
    ],
)
def test_bad_state_refused_and_sampler_unchanged(key, value, error, word):
    lengths = [10, 20, 30, 40, 50, 60, 70, 80] * 3
    saver = make(lengths, 2, 0, seed=4)
    take(saver, 2)
    good = saver.state_dict()
    target = make(lengths, 2, 1, seed=5)
    before = (list(target), target.state_dict())
    with pytest.raises(error, match=word):
        target.load_state_dict(_mutate(good, key, value))
    assert (list(target), target.state_dict()) == before
    with pytest.raises(ValueError, match="expected a dict"):
        target.load_state_dict([1, 2])


def test_other_lengths_refused():
    a = make([10, 20, 30], 1, 0)
    b = make([10, 20, 31], 1, 0)
    with pytest.raises(TopologyMismatchError, match="lengths/costs"):
        b.load_state_dict(a.state_dict())


# ---------------------------------------------------------------------------- log, stats
def test_balance_log_and_stats(caplog):
    lengths = _long_tail(300, seed=2)
    caplog.set_level(logging.INFO, logger="shmloader.balance")
    s0 = make(lengths, 3, 0, max_tokens=16384, window=2, cost="attention")
    s1 = make(lengths, 3, 1, max_tokens=16384, window=2, cost="attention")
    assert s0.balance_stats()["steps"] == 0 and s0.balance_stats()["ratio_mean"] is None
    s2 = make(lengths, 3, 2, max_tokens=16384, window=2, cost="attention")
    lists = [list(s0), list(s1), list(s2)]
    records = [r for r in caplog.records if r.name == "shmloader.balance"]
    # Windows of 2 steps; a short last one joins the one before it.
    windows = max(1, len(lists[0]) // 2)
    assert len(records) == windows  # rank 0 only, one line per window
    assert "max/mean" in records[0].getMessage() and "padding" in records[0].getMessage()
    stats = s1.balance_stats()
    assert stats == {**s0.balance_stats()}
    assert stats["steps"] == len(lists[0]) and stats["windows"] == windows
    last = stats["last"]
    for step in last["steps"]:
        micro = [lists[r][step["step"]] for r in range(3)]
        assert step["tokens"] == [sum(lengths[i] for i in m) for m in micro]
        assert step["cost"] == [sum(lengths[i] ** 2 for i in m) for m in micro]
        assert step["padding"] == [16384 - t for t in step["tokens"]]
        assert step["ratio"] == pytest.approx(max(step["cost"]) / (sum(step["cost"]) / 3))
    ratios = [s["ratio"] for s in last["steps"]]
    assert last["ratio_max"] == max(ratios) and stats["ratio_max"] >= max(ratios)
    assert 1.0 <= stats["ratio_mean"] <= stats["ratio_max"]


# ---------------------------------------------------------------------------- DataLoader
class Packed(Dataset):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "tokens": torch.full((self.lengths[i],), i, dtype=torch.int64)}


def collate_packed(samples: list[dict]) -> dict:
    return {
        "input_ids": torch.cat([s["tokens"] for s in samples]),
        "ids": torch.tensor([s["id"] for s in samples]),
    }


def test_dataloader_batch_sampler():
    lengths = [5, 17, 3, 30, 12, 8, 25, 1, 9, 14] * 3
    sampler = make(lengths, 2, 1, max_tokens=40, window=2)
    expected = list(make(lengths, 2, 1, max_tokens=40, window=2))
    loader = DataLoader(Packed(lengths), batch_sampler=sampler, collate_fn=collate_packed)
    assert len(loader) == len(expected)
    got = [b["ids"].tolist() for b in loader]
    assert got == expected
    for b in loader:
        assert b["input_ids"].numel() <= 40


# ---------------------------------------------------------------------------- multi-process
LENGTHS = [int(v) for v in np.random.default_rng(11).integers(1, 60, 57)]


def balanced_under_shmloader(rank: int, world: int, *, sp: int) -> dict:
    from shmloader import Config, ShmLoader, dp_topology_from_group
    from tests.support.ranks import sp_groups

    group, _ = sp_groups(world, sp)
    num_replicas, dp_rank = dp_topology_from_group(group)

    def make_loader() -> DataLoader:
        sampler = BalancedBatchSampler(
            LENGTHS, num_replicas=num_replicas, rank=dp_rank, max_tokens=64, window=3, seed=2
        )
        return DataLoader(Packed(LENGTHS), batch_sampler=sampler, collate_fn=collate_packed)

    loader = ShmLoader(make_loader, group, config=Config.from_env(enabled=True))
    out = {"topo": [num_replicas, dp_rank], "epochs": [], "len": len(loader)}
    for epoch in range(2):
        loader.set_epoch(epoch)
        out["epochs"].append([(b["ids"].tolist(), b["input_ids"].tolist()) for b in loader])
    out["leader"] = loader.is_leader
    loader.close()
    # seed=None: rank 0 draws one seed for everybody (a collective of every rank).
    unseeded = BalancedBatchSampler(
        LENGTHS, num_replicas=num_replicas, rank=dp_rank, max_tokens=64, seed=None
    )
    out["unseeded"] = (unseeded.seed, list(unseeded))
    return out


@pytest.mark.timeout(120)
def test_sp_peers_receive_the_planned_batches():
    from tests.support.harness import run_ranks

    res = run_ranks(balanced_under_shmloader, 4, kwargs={"sp": 2}, timeout=100)
    assert [r["topo"] for r in res] == [[2, 0], [2, 0], [2, 1], [2, 1]]
    assert [r["leader"] for r in res] == [True, False, True, False]
    for epoch in range(2):
        plans = [list(make(LENGTHS, 2, d, epoch, max_tokens=64, window=3, seed=2)) for d in (0, 1)]
        for rank, r in enumerate(res):
            got = r["epochs"][epoch]
            assert [ids for ids, _ in got] == plans[rank // 2]  # the planned lists, on SP peers
            assert all(toks == [i for i in ids for _ in range(LENGTHS[i])] for ids, toks in got)
            assert r["len"] == len(plans[0])
        assert res[0]["epochs"][epoch] == res[1]["epochs"][epoch]
        assert res[2]["epochs"][epoch] == res[3]["epochs"][epoch]
        assert set(flat(plans)) == set(range(len(LENGTHS)))
    assert res[0]["epochs"][0] != res[0]["epochs"][1]
    seed = res[0]["unseeded"][0]
    assert {r["unseeded"][0] for r in res} == {seed}
    for rank, r in enumerate(res):
        assert r["unseeded"][1] == list(make(LENGTHS, 2, rank // 2, max_tokens=64, seed=seed))


# ---------------------------------------------------------------------------- benchmark
@pytest.mark.timeout(120)
def test_balance_benchmark_quick_writes_json_and_markdown(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.balance", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "balance.json").read_text())
    assert result["rows"] and {"dp", "window", "cost", "ratio_mean", "baseline_ratio_mean"} <= set(
        result["rows"][0]
    )
    text = (tmp_path / "balance.md").read_text()
    assert "| dp |" in text and "planning" in text

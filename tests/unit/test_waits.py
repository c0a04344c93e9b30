"""The per-rank wait histogram behind stat's p50/p95/p99 and the daemon's metrics."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from shmloader._proto.waits import BOUNDS_MS, NBUCKETS, WINDOW, WaitHistogram, bucket_of, quantile


def test_bucket_edges_belong_to_the_bucket_below() -> None:
    for i, bound in enumerate(BOUNDS_MS):
        assert bucket_of(bound) == i, bound  # le: a wait equal to the bound is in it
        assert bucket_of(bound * 1.001) == i + 1, bound
    assert bucket_of(0.0) == bucket_of(-3.0) == bucket_of(math.nan) == 0
    assert bucket_of(1e12) == NBUCKETS - 1
    ratios = {round(b / a, 9) for a, b in itertools.pairwise(BOUNDS_MS)}
    assert ratios == {round(2**0.25, 9)}
    assert BOUNDS_MS[0] < 0.01 and BOUNDS_MS[-1] > 100_000  # 10 us .. 100 s


@pytest.mark.parametrize("seed", range(5))
def test_percentiles_are_within_one_bucket_of_the_exact_ones(seed: int) -> None:
    rng = random.Random(seed)
    waits = [rng.lognormvariate(rng.uniform(-3, 6), rng.uniform(0.1, 2)) for _ in range(400)]
    h = WaitHistogram()
    for w in waits:
        h.add(w)
    exact = sorted(waits)
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        want = exact[min(len(exact) - 1, math.ceil(q * len(exact)) - 1)]
        got = h.recent()[name]
        assert want / 2**0.25 <= got <= want * 2**0.25, (name, got, want)


def test_recent_percentiles_follow_a_stall_and_the_totals_keep_everything() -> None:
    h = WaitHistogram()
    for _ in range(3 * WINDOW):
        h.add(1.0)
    assert h.recent() == {"p50": pytest.approx(1.0, rel=0.2), "p95": pytest.approx(1.0, rel=0.2),
                          "p99": pytest.approx(1.0, rel=0.2)}  # fmt: skip
    for _ in range(WINDOW // 10):  # a rank starts to stall: the tail shows at once
        h.add(500.0)
    assert h.recent()["p99"] == pytest.approx(500.0, rel=0.2)
    assert h.recent()["p50"] == pytest.approx(1.0, rel=0.2)
    for _ in range(2 * WINDOW):  # ... then the median once it lasts
        h.add(500.0)
    assert h.recent()["p50"] == pytest.approx(500.0, rel=0.2)
    assert len(h) == sum(h.counts) == 3 * WINDOW + WINDOW // 10 + 2 * WINDOW
    assert len(h.counts) == NBUCKETS  # fixed size, whatever the number of batches
    assert h.sum_ms == pytest.approx(3 * WINDOW + 500.0 * (WINDOW // 10 + 2 * WINDOW))
    json.dumps(h.counts)


def test_an_empty_histogram_has_no_percentiles() -> None:
    assert WaitHistogram().recent() == {"p50": None, "p95": None, "p99": None}
    assert quantile([0] * NBUCKETS, 0.5) is None


def test_the_daemon_takes_only_well_formed_histograms() -> None:
    from shmloaderd import protocol

    from shmloader.errors import ProtocolError

    def report(hist) -> bytes:
        msg = {"v": protocol.VERSION, "op": "report", "token": "ab", "rank": 0, "wait_hist": hist}
        return json.dumps(msg).encode()

    op, fields = protocol.parse(report([1] * NBUCKETS))
    assert op == "report" and fields["wait_hist"] == [1] * NBUCKETS
    for bad in ([1] * (NBUCKETS + 1), [-1] * NBUCKETS, [0.5] * NBUCKETS, [True] * NBUCKETS, 7):
        with pytest.raises(ProtocolError, match="wait_hist"):
            protocol.parse(report(bad))

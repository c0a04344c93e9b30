"""A rank's waits for its batches: a fixed-bucket histogram, O(1) per batch.

It owns ``WaitHistogram`` (every wait since the first batch, for the daemon's
Prometheus histogram, and the recent windows behind ``stat``'s p50/p95/p99) and
the bucket bounds both sides share (``BOUNDS_MS``, ``valid_counts``). Pure
arithmetic: it imports nothing and touches nothing outside its own counters.
"""

from __future__ import annotations

import math

# Every batch a rank takes adds its wait (milliseconds) to one bucket; nothing
# grows with the number of batches. Bucket ``i`` counts waits in
# ``(BOUNDS_MS[i-1], BOUNDS_MS[i]]`` (bucket 0 everything up to the first
# bound, the last one everything above the last bound). Bounds are
# ``2 ** (k / 4)`` ms for ``k`` in -28 .. 68, about 7.8 us to 131 s in steps of
# 19%: a percentile read from the buckets is within that step of the exact one.
# Two views come from the same ``add``: since the first batch (``counts``,
# ``sum_ms``), what the daemon exports as a Prometheus histogram, which must only
# grow; and recent batches (the current window of ``WINDOW`` and the previous
# one), what ``p50``/``p95``/``p99`` in ``shmloader stat`` describe, so a rank
# that stalls now shows it now, not diluted by an hour of good batches.
#: Upper bounds of the buckets, milliseconds (the last bucket is unbounded).
BOUNDS_MS: tuple[float, ...] = tuple(2 ** (k / 4) for k in range(-28, 69))
_FIRST_K = -28
#: Buckets: one per bound plus the unbounded one.
NBUCKETS = len(BOUNDS_MS) + 1
#: Batches per window of the recent percentiles (they cover 1 to 2 windows).
WINDOW = 256
#: Percentiles ``stat`` shows, as (name, fraction).
PERCENTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))


def bucket_of(ms: float) -> int:
    """The bucket a wait of ``ms`` milliseconds falls in."""
    if not ms > BOUNDS_MS[0]:  # also NaN and negative clock steps
        return 0
    k = math.ceil(4 * math.log2(ms) - 1e-9)  # smallest k with 2**(k/4) >= ms
    return min(k - _FIRST_K, NBUCKETS - 1)


def quantile(counts: list[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of the waits in ``counts``, in ms; None if empty.

    Interpolated geometrically inside its bucket (the bounds are geometric);
    a quantile in the unbounded bucket reads as the last bound.
    """
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i >= len(BOUNDS_MS):
                return BOUNDS_MS[-1]
            hi = BOUNDS_MS[i]
            lo = BOUNDS_MS[i - 1] if i else hi / 2**0.25
            frac = min(max((rank - seen) / n, 0.0), 1.0)
            return lo * (hi / lo) ** frac
        seen += n
    return BOUNDS_MS[-1]


class WaitHistogram:
    """Waits of one rank (the buckets and the two views: at ``BOUNDS_MS``)."""

    def __init__(self) -> None:
        self.counts = [0] * NBUCKETS
        self.sum_ms = 0.0
        self.n = 0
        self._cur = [0] * NBUCKETS
        self._cur_n = 0
        self._prev = [0] * NBUCKETS

    def add(self, ms: float) -> None:
        i = bucket_of(ms)
        self.counts[i] += 1
        self.sum_ms += max(ms, 0.0)
        self.n += 1
        if self._cur_n >= WINDOW:
            self._prev, self._cur, self._cur_n = self._cur, [0] * NBUCKETS, 0
        self._cur[i] += 1
        self._cur_n += 1

    def __len__(self) -> int:
        return self.n

    def recent(self) -> dict[str, float | None]:
        """``{"p50": ms, "p95": ms, "p99": ms}`` over the recent batches (None if none)."""
        both = [a + b for a, b in zip(self._prev, self._cur, strict=True)]
        out: dict[str, float | None] = {}
        for name, q in PERCENTILES:
            v = quantile(both, q)
            out[name] = None if v is None else round(v, 4)
        return out


def valid_counts(value: object) -> bool:
    """Whether ``value`` is a histogram's ``counts`` as reported (NBUCKETS ints >= 0)."""
    return (
        isinstance(value, list)
        and len(value) == NBUCKETS
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in value)
    )

"""Packing one window's samples into bins, the planning core of the balanced sampler.

It owns the packers ``plan_window`` (in ``balanced``) runs on a window: largest
cost first into the cheapest bin that fits (``pack_lpt``), steps filled level by
level up to their most expensive bin (``pack_levels``), sequential next-fit with
bins split to the count needed (``greedy_bins``, ``split_to``); then bins grouped
into steps of similar cost and each step evened out by moves and swaps within
``max_tokens`` (``group_and_refine``, ``refine``), scored by each step's max/mean
cost (``ratio``). Pure and deterministic: Python arithmetic in a fixed order, ties
broken by position (NOTE [plan determinism] in ``balanced``); the rules:
docs/internals/samplers.md. It imports nothing of shmloader.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

Cost = int | float
Plan = list[list[list[int]]]  # plan[step][replica] = positions into the window's samples

_REFINE_TRIES = 4  # cheapest bins of a step tried as partners of its most expensive one


def ratio(costs: Sequence[Cost]) -> float:
    """max/mean of a step's per-replica costs (1.0 for an all-zero step)."""
    mean = sum(costs) / len(costs)
    return float(max(costs) / mean) if mean > 0 else 1.0


def greedy_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sequential greedy (next-fit) packing of positions ``0..len-1`` in order."""
    bins: list[list[int]] = []
    fill = max_tokens + 1  # no bin open
    for pos, length in enumerate(lengths):
        if fill + length <= max_tokens:
            bins[-1].append(pos)
            fill += length
        else:
            bins.append([pos])
            fill = length
    return bins


def pack_lpt(
    lengths: Sequence[int],
    costs: Sequence[Cost],
    order: list[int],
    nbins: int,
    max_tokens: int,
) -> list[list[int]] | None:
    """Largest cost first (``order``) into the cheapest bin where it fits; ``None`` if one
    fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(nbins)]
    tokens = [0] * nbins
    heap: list[tuple[Cost, int, int, int]] = [(0, 0, 0, b) for b in range(nbins)]
    # Bins too full for the current sample wait here, by room (max first), until a sample
    # small enough comes; so a full bin is skipped once, not once per later sample.
    parked: list[tuple[int, tuple[Cost, int, int, int]]] = []
    for pos in order:
        length = lengths[pos]
        while parked and -parked[0][0] >= length:
            heapq.heappush(heap, heapq.heappop(parked)[1])
        while heap:
            entry = heapq.heappop(heap)
            if tokens[entry[3]] + length <= max_tokens:
                break
            heapq.heappush(parked, (tokens[entry[3]] - max_tokens, entry))
        else:
            return None
        cost, tok, count, b = entry
        bins[b].append(pos)
        tokens[b] = tok + length
        heapq.heappush(heap, (cost + costs[pos], tok + length, count + 1, b))
    return bins


def pack_levels(
    lengths: Sequence[int],
    costs: Sequence[Cost],
    order: list[int],
    steps: int,
    n: int,
    max_tokens: int,
) -> list[list[int]] | None:
    """Fill every step's bins up to the step's most expensive bin; ``None`` if stuck.

    Bins ``s * n .. s * n + n - 1`` form step ``s``. Samples by decreasing cost: each goes to
    the fitting bin furthest below its step's top cost (its *deficit*) when the sample fits
    in that deficit; otherwise it opens the next unused step (becoming its top), or, once
    every step is in use, goes to the most deficient bin anyway. Once as many samples remain
    as bins are empty, each goes to an empty bin. A step's top rising does not re-rank its
    other bins (kept cheap; they are found at their old rank).
    """
    nbins = steps * n
    m = len(lengths)
    if m < nbins:
        return None
    bins: list[list[int]] = [[] for _ in range(nbins)]
    cost: list[Cost] = [0] * nbins
    tokens = [0] * nbins
    top: list[Cost] = [0] * steps
    version = [0] * nbins
    heap: list[tuple[Cost, int, int, int]] = []  # (cost - step top, tokens, bin, version)
    parked: list[tuple[int, tuple[Cost, int, int, int]]] = []
    empties: list[int] = []  # empty bins of opened steps (may be stale)
    empty = nbins
    opened = 0

    def push_step(s: int) -> None:
        for b in range(s * n, (s + 1) * n):
            version[b] += 1
            heapq.heappush(heap, (cost[b] - top[s], tokens[b], b, version[b]))

    for k, pos in enumerate(order):
        c, length = costs[pos], lengths[pos]
        while parked and -parked[0][0] >= length:
            entry = heapq.heappop(parked)[1]
            if entry[3] == version[entry[2]]:
                heapq.heappush(heap, entry)
        b = -1
        opening = False
        if m - k <= empty:
            while empties and bins[empties[-1]]:
                empties.pop()
            if empties:
                b = empties.pop()
            else:
                opening = True
        else:
            found = None
            while heap:
                entry = heapq.heappop(heap)
                if entry[3] != version[entry[2]]:
                    continue
                if tokens[entry[2]] + length <= max_tokens:
                    found = entry
                    break
                heapq.heappush(parked, (tokens[entry[2]] - max_tokens, entry))
            if found is not None and (top[found[2] // n] - cost[found[2]] >= c or opened == steps):
                b = found[2]
            elif opened < steps:
                opening = True
                if found is not None:
                    heapq.heappush(heap, found)
            else:
                return None
        if opening:
            s = opened
            opened += 1
            b = s * n
            empties.extend(range((s + 1) * n - 1, s * n, -1))
        s = b // n
        if not bins[b]:
            empty -= 1
        bins[b].append(pos)
        cost[b] += c
        tokens[b] += length
        if opening:
            top[s] = cost[b]
            push_step(s)
        else:
            if cost[b] > top[s]:
                top[s] = cost[b]
            version[b] += 1
            heapq.heappush(heap, (cost[b] - top[s], tokens[b], b, version[b]))
    return bins


def split_to(bins: list[list[int]], nbins: int) -> list[list[int]]:
    """Split bins (one sample off the fullest) until there are ``nbins`` non-empty bins."""
    bins = [list(b) for b in bins]
    while len(bins) < nbins:
        most = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        bins.append([bins[most].pop()])
    return bins


def refine(
    step: list[list[int]],
    lengths: Sequence[int],
    costs: Sequence[Cost],
    max_tokens: int,
    cost: list[Cost],
    tokens: list[int],
) -> None:
    """Even out one step's bins in place (with their ``cost`` and ``tokens``): moves and
    swaps between the most expensive bin and one of the cheapest few that can take them."""

    def exchange(hi: int, lo: int) -> tuple[Cost, int, int] | None:
        """Best move (``b == -1``) or swap ``(new max of the pair, a in hi, b in lo)``."""
        gap = cost[hi] - cost[lo]
        best: tuple[Cost, int, int] | None = None
        room_lo, room_hi = max_tokens - tokens[lo], max_tokens - tokens[hi]
        if len(step[hi]) > 1:
            for a in step[hi]:
                d = costs[a]
                if 0 < d < gap and lengths[a] <= room_lo:
                    new = max(cost[hi] - d, cost[lo] + d)
                    if best is None or new < best[0]:
                        best = (new, a, -1)
        lo_sorted = sorted(step[lo], key=lambda p: (costs[p], p))
        lo_costs = [costs[p] for p in lo_sorted]
        for a in step[hi]:
            at = bisect.bisect_left(lo_costs, costs[a] - gap / 2)
            for j in (at - 1, at):
                if not 0 <= j < len(lo_sorted):
                    continue
                b = lo_sorted[j]
                d = costs[a] - costs[b]
                grow = lengths[a] - lengths[b]
                if 0 < d < gap and grow <= room_lo and -grow <= room_hi:
                    new = max(cost[hi] - d, cost[lo] + d)
                    if best is None or new < best[0]:
                        best = (new, a, b)
        return best if best is not None and best[0] < cost[hi] else None

    for _ in range(4 * len(step) + 8):
        hi = max(range(len(step)), key=lambda b: (cost[b], -b))
        cheapest = sorted(range(len(step)), key=lambda b: (cost[b], b))[:_REFINE_TRIES]
        best = lo = None
        for lo in cheapest:
            if cost[lo] >= cost[hi]:
                break
            best = exchange(hi, lo)
            if best is not None:
                break
        if best is None or lo is None:
            return
        _, a, b = best
        step[hi].remove(a)
        step[lo].append(a)
        d, grow = costs[a], lengths[a]
        if b >= 0:
            step[lo].remove(b)
            step[hi].append(b)
            d, grow = d - costs[b], grow - lengths[b]
        cost[hi] -= d
        cost[lo] += d
        tokens[hi] -= grow
        tokens[lo] += grow


def group_and_refine(
    bins: list[list[int]],
    lengths: Sequence[int],
    costs: Sequence[Cost],
    num_replicas: int,
    steps: int,
    max_tokens: int,
) -> tuple[Plan, float]:
    """Steps of ``num_replicas`` bins of similar cost (by decreasing cost), then refined.

    Returns the plan and its score: the sum over steps of max/mean cost (lower is better).
    """
    bin_cost = [sum([costs[p] for p in b]) for b in bins]
    bin_tokens = [sum([lengths[p] for p in b]) for b in bins]
    ranked = sorted(range(len(bins)), key=lambda b: (-bin_cost[b], -bin_tokens[b], b))
    plan: Plan = []
    score = 0.0
    for s in range(steps):
        chosen = ranked[s * num_replicas : (s + 1) * num_replicas]
        step = [bins[b] for b in chosen]
        cost = [bin_cost[b] for b in chosen]
        refine(step, lengths, costs, max_tokens, cost, [bin_tokens[b] for b in chosen])
        plan.append(step)
        score += ratio(cost)
    return plan, score

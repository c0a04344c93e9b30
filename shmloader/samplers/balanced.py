"""Balanced packing across data-parallel replicas: :class:`BalancedBatchSampler`.

With long-context data the cost of a packed micro-batch varies wildly, and the
slowest DP replica sets every step. It owns the sampler and :func:`plan_window`
(the packers it runs are ``_packing``'s): each window of ``window`` steps is
planned for all replicas at once, so that in every step each replica gets one
micro-batch within ``max_tokens`` and the micro-batches of one step cost about
the same; keyed on the DP size and rank like :class:`shmloader.ShardedSampler`,
so SP peers get identical lists with no communication (NOTE [plan determinism];
the rules: docs/internals/samplers.md). It touches no default RNG; its balance
log goes to the logger ``"shmloader.balance"``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ..errors import TopologyMismatchError
from ._packing import (
    Cost,
    Plan,
    greedy_bins,
    group_and_refine,
    pack_levels,
    pack_lpt,
    ratio,
    split_to,
)
from ._state import (
    MAX_SEED,
    broadcast_seed,
    check_bool,
    check_int,
    check_state_head,
    is_int,
    seeded_generator,
)

__all__ = ["BalancedBatchSampler", "plan_window"]

log = logging.getLogger("shmloader.balance")

STATE_FORMAT = "shmloader.BalancedBatchSampler"
STATE_VERSION = 1

_STREAM_ORDER = 0xBA1A
_STREAM_WINDOW = 0xB1D5

_STATE_KEYS = (
    "format",
    "version",
    "epoch",
    "seed",
    "cursor",
    "num_replicas",
    "rank",
    "dataset_len",
    "max_tokens",
    "window",
    "cost",
    "drop_last",
    "fingerprint",
    "history",
)


# ---------------------------------------------------------------------------- planning
# NOTE [plan determinism]
#     Every rank must compute the same plan with no communication. The plan is built with
#     Python ints (``tokens``, ``attention``) or Python floats added in one fixed order (a
#     callable cost), never with numpy reductions (their summation order depends on the CPU's
#     SIMD width), and ties are broken by position; the only randomness is ``torch.randperm``
#     with a private generator (so a resume across torch versions whose ``randperm`` differs
#     would see another order, as for :class:`ShardedSampler`). Float costs assume the same
#     Python on every rank (``sum`` of floats is compensated from Python 3.12 on).
def plan_window(
    lengths: Sequence[int],
    costs: Sequence[Cost],
    *,
    num_replicas: int,
    steps: int,
    max_tokens: int,
    generator: torch.Generator | None = None,
) -> Plan:
    """Plan one window: ``plan[step][replica]`` is a list of positions into ``lengths``.

    Every position appears exactly once, every list is non-empty and within ``max_tokens``.
    Needs ``len(lengths) >= steps * num_replicas`` and that sequential greedy packing of the
    positions in order fits in ``steps * num_replicas`` bins (as it does for the windows the
    sampler makes). ``generator``: permute steps and bins (docs/internals/samplers.md, step 5);
    ``None`` keeps steps by decreasing cost and bins by decreasing cost.
    """
    nbins = steps * num_replicas
    if nbins == 0:
        return []
    if len(lengths) < nbins:
        raise ValueError(
            f"lengths of {len(lengths)} samples is not valid: a plan of {steps} steps x "
            f"{num_replicas} replicas needs at least {nbins} samples"
        )
    order = sorted(range(len(lengths)), key=lambda p: (-costs[p], -lengths[p], p))
    best: tuple[Plan, float] | None = None
    for bins in (
        pack_lpt(lengths, costs, order, nbins, max_tokens),
        pack_levels(lengths, costs, order, steps, num_replicas, max_tokens),
    ):
        if bins is not None:
            candidate = group_and_refine(bins, lengths, costs, num_replicas, steps, max_tokens)
            if best is None or candidate[1] < best[1]:
                best = candidate
    if best is None:
        greedy = greedy_bins(lengths, max_tokens)
        if len(greedy) > nbins:
            raise ValueError(
                f"steps={steps} is not valid: these samples need {len(greedy)} greedy bins of "
                f"max_tokens={max_tokens}, more than {nbins}"
            )
        bins = split_to(greedy, nbins)
        best = group_and_refine(bins, lengths, costs, num_replicas, steps, max_tokens)
    plan = best[0]
    if generator is not None:
        plan = [plan[s] for s in torch.randperm(steps, generator=generator).tolist()]
        if num_replicas > 1:
            plan = [
                [step[r] for r in torch.randperm(num_replicas, generator=generator).tolist()]
                for step in plan
            ]
    return plan


# ---------------------------------------------------------------------------- inputs
def _read_lengths(
    lengths: Sequence[int] | Callable[[int], int], num_samples: int | None, max_tokens: int
) -> list[int]:
    if callable(lengths) and not isinstance(lengths, (Sequence, np.ndarray, torch.Tensor)):
        if num_samples is None:
            raise ValueError(
                "num_samples=None is not valid: a callable lengths= needs num_samples= "
                "(the dataset's length)"
            )
        check_int("num_samples", num_samples, 0)
        values = [lengths(i) for i in range(num_samples)]
    else:
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.numpy()
        if isinstance(lengths, np.ndarray):
            if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
                raise ValueError(
                    f"lengths of dtype {lengths.dtype} and shape {lengths.shape} is not valid: "
                    "expected a 1-d integer array"
                )
            values = lengths.tolist()
        elif isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
            raise ValueError(
                f"lengths={lengths!r} is not valid: expected a sequence of ints or a callable "
                "index -> length"
            )
        else:
            values = list(lengths)
        if num_samples is not None and num_samples != len(values):
            raise ValueError(
                f"num_samples={num_samples!r} is not valid: lengths has {len(values)} entries"
            )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, np.integer):
            v = int(v)
        if not is_int(v) or v < 0:
            raise ValueError(
                f"lengths[{i}]={v!r} is not valid: expected an int >= 0 (tokens of sample {i})"
            )
        if v > max_tokens:
            raise ValueError(
                f"lengths[{i}]={v} is not valid: sample {i} is longer than max_tokens="
                f"{max_tokens}; raise max_tokens or drop/split that sample"
            )
        out.append(v)
    return out


def _read_costs(lengths: list[int], cost: str | Callable[[int], Cost]) -> list[Cost]:
    if cost == "tokens":
        return list(lengths)
    if cost == "attention":
        return [v * v for v in lengths]
    if isinstance(cost, str) or not callable(cost):
        raise ValueError(
            f"cost={cost!r} is not valid: expected 'tokens', 'attention' or a callable "
            "length -> cost"
        )
    table: dict[int, Cost] = {}
    for v in sorted(set(lengths)):
        c = cost(v)
        if isinstance(c, np.generic):
            c = c.item()
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(
                f"cost({v})={c!r} is not valid: the cost callable must return a finite number >= 0"
            )
        table[v] = c
    return [table[v] for v in lengths]


def _fingerprint(lengths: list[int], costs: list[Cost]) -> str:
    digest = hashlib.sha256(b"balanced:v1:")
    digest.update(np.asarray(lengths, dtype="<i8").tobytes())
    digest.update(np.asarray(costs, dtype="<f8").tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Window:
    start: int  # positions [start, stop) of the segment order
    stop: int
    steps: int


@dataclass
class _Segment:
    order: list[int]  # dataset indices of this segment, in order
    windows: list[_Window]
    first_step: list[int]  # global step of the segment at which each window starts
    steps: int


@dataclass
class _Stats:
    epoch: int = -1
    windows: int = 0
    steps: int = 0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)


class BalancedBatchSampler(Sampler[list[int]]):
    """Batch sampler packing samples into ``max_tokens`` micro-batches, cost-balanced over
    DP replicas: in every step each replica gets one list, and the lists of a step cost
    about the same. Use it as ``DataLoader(dataset, batch_sampler=...)``.

    The window, plan, padding, resume and log rules: docs/internals/samplers.md.

    Args:
        lengths: tokens of every sample: a sequence (list, numpy or torch 1-d ints) or a
            callable ``index -> length`` with ``num_samples``; read once, here.
        num_replicas: DP size (``>= 1``); SP peers pass the same value.
        rank: DP rank in ``[0, num_replicas)``.
        max_tokens: token budget of one micro-batch; a longer sample is a ``ValueError``.
        window: steps planned together (``>= 1``; larger balances better, plans longer).
        cost: ``"tokens"``, ``"attention"`` (length squared) or a callable
            ``length -> cost`` (finite, ``>= 0``).
        seed: non-negative int; ``None`` takes one seed from rank 0 (collective).
        drop_last: drop the epoch's last incomplete step instead of padding it.
        num_samples: the number of samples, required with a callable ``lengths``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | Callable[[int], int],
        *,
        num_replicas: int,
        rank: int,
        max_tokens: int,
        window: int = 8,
        cost: str | Callable[[int], Cost] = "tokens",
        seed: int | None = 0,
        drop_last: bool = False,
        num_samples: int | None = None,
    ) -> None:
        super().__init__()
        self._num_replicas = check_int("num_replicas", num_replicas, 1)
        self._rank = check_int("rank", rank, 0, self._num_replicas - 1)
        self._max_tokens = check_int("max_tokens", max_tokens, 1)
        self._window = check_int("window", window, 1)
        self._drop_last = check_bool("drop_last", drop_last)
        if seed is not None:
            check_int("seed", seed, 0, MAX_SEED)
        self._lengths = _read_lengths(lengths, num_samples, self._max_tokens)
        self._costs = _read_costs(self._lengths, cost)
        self._cost_name = cost if isinstance(cost, str) else "callable"
        self._fingerprint = _fingerprint(self._lengths, self._costs)
        # Last: seed=None is a collective, entered only once all arguments were accepted.
        self._seed = broadcast_seed() if seed is None else seed
        self._epoch = 0
        self._history: tuple[tuple[int, int], ...] = ()
        self._start = 0  # cursor where a pass starts (a resume point), in steps
        self._cursor = 0
        self._token = 0  # identifies the pass whose progress moves the cursor
        self._segment_cache: tuple[tuple[Any, ...], _Segment] | None = None
        self._stats = _Stats()

    # ------------------------------------------------------------------ properties
    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @property
    def window(self) -> int:
        return self._window

    @property
    def cursor(self) -> int:
        """Global steps of the current segment consumed (lists yielded by this rank)."""
        return self._cursor

    # ------------------------------------------------------------------ layout
    def _order(self, epoch: int) -> list[int]:
        gen = seeded_generator(self._seed, epoch, _STREAM_ORDER)
        return torch.randperm(len(self._lengths), generator=gen).tolist()

    def _layout(self, order: list[int], n: int) -> _Segment:
        """Cut a segment order into windows (the sequential greedy walk of the docstring)."""
        lengths, cap, per = self._lengths, self._max_tokens, self._window * n
        windows: list[_Window] = []
        start, bins, fill = 0, 0, cap + 1
        for pos, index in enumerate(order):
            length = lengths[index]
            if fill + length <= cap:
                fill += length
                continue
            if bins == per:
                windows.append(_Window(start, pos, self._window))
                start, bins = pos, 0
            bins += 1
            fill = length
        if bins:
            steps = bins // n if self._drop_last else -(-bins // n)
            stop = len(order)
            if self._drop_last and bins % n:  # keep the samples of the first steps * n bins
                stop = start
                if steps:
                    greedy = greedy_bins([lengths[i] for i in order[start:]], cap)
                    stop = start + greedy[steps * n - 1][-1] + 1
            if bins < per and windows:  # a short last window joins the one before it
                prev = windows.pop()
                start, steps = prev.start, prev.steps + steps
            if steps:
                windows.append(_Window(start, stop, steps))
        first, total = [], 0
        for w in windows:
            first.append(total)
            total += w.steps
        return _Segment(order, windows, first, total)

    def _window_plan(
        self, seg: _Segment, w: int, n: int, epoch: int, segment_no: int
    ) -> tuple[list[int], Plan]:
        """(dataset indices of window ``w``, padding included; its plan)."""
        win = seg.windows[w]
        indices = seg.order[win.start : win.stop]
        need = win.steps * n
        if len(indices) < need:  # padding: the segment's first samples, cyclically
            indices = indices + [seg.order[k % len(seg.order)] for k in range(need - len(indices))]
        gen = seeded_generator(self._seed, epoch, _STREAM_WINDOW, segment_no, w)
        plan = plan_window(
            [self._lengths[i] for i in indices],
            [self._costs[i] for i in indices],
            num_replicas=n,
            steps=win.steps,
            max_tokens=self._max_tokens,
            generator=gen,
        )
        return indices, plan

    def _consumed(self, seg: _Segment, n: int, steps: int, epoch: int, segment_no: int) -> set:
        """Dataset indices the first ``steps`` steps of a segment delivered."""
        done: set[int] = set()
        for w, win in enumerate(seg.windows):
            first = seg.first_step[w]
            if first >= steps:
                break
            if first + win.steps <= steps:
                done.update(seg.order[win.start : win.stop])
                continue
            indices, plan = self._window_plan(seg, w, n, epoch, segment_no)
            for step in plan[: steps - first]:
                for micro in step:
                    done.update(indices[p] for p in micro)
        return done

    def _segment_for(
        self, epoch: int, history: tuple[tuple[int, int], ...], n: int
    ) -> tuple[_Segment, list[int]]:
        """The segment a topology of ``n`` replicas plays after ``history``; and the steps of
        every historical segment (for validation)."""
        key = (epoch, history, n, self._seed)
        if self._segment_cache is not None and self._segment_cache[0][:-1] == key:
            return self._segment_cache[1], self._segment_cache[0][-1]
        order = self._order(epoch)
        past_steps = []
        for k, (old_n, steps) in enumerate(history):
            seg = self._layout(order, old_n)
            past_steps.append(seg.steps)
            if steps > seg.steps:
                raise ValueError(
                    f"state['history'][{k}]={[old_n, steps]} is not valid: that segment has "
                    f"only {seg.steps} steps"
                )
            done = self._consumed(seg, old_n, steps, epoch, k)
            order = [i for i in order if i not in done]
        seg = self._layout(order, n)
        self._segment_cache = ((*key, past_steps), seg)
        return seg, past_steps

    def _segment(self) -> _Segment:
        return self._segment_for(self._epoch, self._history, self._num_replicas)[0]

    # ------------------------------------------------------------------ epoch, length
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass; the epoch already selected keeps a resume point."""
        check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._history, self._start, self._cursor = epoch, (), 0, 0
            self._token += 1

    def __len__(self) -> int:
        """Lists this rank yields in a pass (from the start or the resume point); the same on
        every rank."""
        return self._segment().steps - self._start

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[list[int]]:
        self._token += 1
        token = self._token
        self._cursor = self._start
        seg = self._segment()
        epoch, segment_no, n, r = self._epoch, len(self._history), self._num_replicas, self._rank
        start = self._start

        def gen() -> Iterator[list[int]]:
            for w, win in enumerate(seg.windows):
                first = seg.first_step[w]
                if first + win.steps <= start:
                    continue
                indices, plan = self._window_plan(seg, w, n, epoch, segment_no)
                self._record(epoch, w, first, indices, plan, len(indices) - win.stop + win.start)
                for s in range(max(0, start - first), win.steps):
                    out = [indices[p] for p in plan[s][r]]
                    if self._token == token:
                        self._cursor += 1
                    yield out

        return gen()

    # ------------------------------------------------------------------ balance log
    def _record(
        self, epoch: int, w: int, first: int, indices: list[int], plan: Plan, repeats: int
    ) -> None:
        steps: list[dict[str, Any]] = []
        for s, step in enumerate(plan):
            tokens = [sum(self._lengths[indices[p]] for p in micro) for micro in step]
            costs = [sum(self._costs[indices[p]] for p in micro) for micro in step]
            steps.append(
                {
                    "step": first + s,
                    "ratio": ratio(costs),
                    "cost": costs,
                    "tokens": tokens,
                    "padding": [self._max_tokens - t for t in tokens],
                }
            )
        st = self._stats
        if st.epoch != epoch:
            self._stats = st = _Stats(epoch=epoch)
        ratios = [s["ratio"] for s in steps]
        st.windows += 1
        st.steps += len(steps)
        st.ratio_sum += sum(ratios)
        st.ratio_max = max(st.ratio_max, *ratios)
        n = self._num_replicas
        tokens = [sum(s["tokens"][r] for s in steps) for r in range(n)]
        padding = [sum(s["padding"][r] for s in steps) for r in range(n)]
        st.last = {
            "window": w,
            "ratio_mean": sum(ratios) / len(ratios),
            "ratio_max": max(ratios),
            "tokens": tokens,
            "padding": padding,
            "repeats": repeats,
            "steps": steps,
        }
        if self._rank == 0 and log.isEnabledFor(logging.INFO):
            log.info(
                "balance epoch %d window %d steps %d-%d cost=%s max/mean mean %.3f worst %.3f; "
                "tokens per replica %s; padding per replica %s",
                epoch,
                w,
                first,
                first + len(steps) - 1,
                self._cost_name,
                st.last["ratio_mean"],
                st.last["ratio_max"],
                tokens,
                padding,
            )

    def balance_stats(self) -> dict[str, Any]:
        """Balance of the plans made so far in the current epoch (by any pass).

        Keys: ``epoch``, ``cost``, ``windows``/``steps`` planned, ``ratio_mean`` and
        ``ratio_max`` (per-step max/mean cost over replicas, averaged / worst over those
        steps) and ``last``: the last window planned (``window``, ``ratio_mean``,
        ``ratio_max``, per-replica ``tokens`` and ``padding`` summed over its steps,
        ``repeats`` (padding samples), and ``steps``: per step ``step``, ``ratio`` and per
        replica ``cost``, ``tokens``, ``padding``). Empty figures before any plan.
        """
        st = self._stats
        return {
            "epoch": st.epoch,
            "cost": self._cost_name,
            "windows": st.windows,
            "steps": st.steps,
            "ratio_mean": st.ratio_sum / st.steps if st.steps else None,
            "ratio_max": st.ratio_max if st.steps else None,
            "last": dict(st.last),
        }

    # ------------------------------------------------------------------ state
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """A plain ``dict`` (ints, strs, bools, lists of ints) describing the position.

        ``consumed=k``: ``k`` lists of the current pass were consumed (use it under a
        prefetching ``DataLoader``) instead of the count yielded.
        """
        cursor = self._cursor
        if consumed is not None:
            check_int("consumed", consumed, 0, len(self))
            cursor = self._start + consumed
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "seed": self._seed,
            "cursor": cursor,
            "num_replicas": self._num_replicas,
            "rank": self._rank,
            "dataset_len": len(self._lengths),
            "max_tokens": self._max_tokens,
            "window": self._window,
            "cost": self._cost_name,
            "drop_last": self._drop_last,
            "fingerprint": self._fingerprint,
            "history": [list(h) for h in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output: the next pass continues at the next step.

        Everything is validated before anything changes. A malformed field is a
        ``ValueError`` naming it; a state whose plan this sampler cannot reproduce (other
        lengths or costs, ``max_tokens``, ``window``, ``drop_last``) is a
        :class:`TopologyMismatchError`. The state's ``seed`` is adopted. Under another
        ``num_replicas`` the rest of the epoch is re-planned (docs/internals/samplers.md).
        """
        epoch, seed, old_n = check_state_head(state, _STATE_KEYS, STATE_FORMAT, STATE_VERSION)

        def name(key: str) -> str:
            return f"state[{key!r}]"

        mine: dict[str, object] = {
            "dataset_len": len(self._lengths),
            "max_tokens": self._max_tokens,
            "window": self._window,
            "cost": self._cost_name,
            "drop_last": self._drop_last,
            "fingerprint": self._fingerprint,
        }
        for key, value in mine.items():
            if type(state[key]) is not type(value):
                raise ValueError(
                    f"{name(key)}={state[key]!r} is not valid: expected a {type(value).__name__}"
                )
            if state[key] != value:
                what = "lengths/costs" if key == "fingerprint" else key
                raise TopologyMismatchError(
                    f"{name(key)}={state[key]!r} does not match this sampler's {value!r}: the "
                    f"state was planned with other {what}, so its plan cannot be reproduced; "
                    f"construct the sampler with the checkpoint's {what}"
                )
        raw = state["history"]
        if not isinstance(raw, (list, tuple)) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 for h in raw
        ):
            raise ValueError(
                f"{name('history')}={raw!r} is not valid: expected a list of [num_replicas, "
                "steps] pairs"
            )
        history = tuple(
            (
                check_int(f"{name('history')}[{k}][0]", h[0], 1),
                check_int(f"{name('history')}[{k}][1]", h[1], 0),
            )
            for k, h in enumerate(raw)
        )
        cursor = check_int(name("cursor"), state["cursor"], 0)
        # Validated by replaying the history (raises on steps past a segment's end).
        saved_seed = self._seed
        self._seed = seed
        try:
            old_seg, _ = self._segment_for(epoch, history, old_n)
        finally:
            self._seed = saved_seed
        if cursor > old_seg.steps:
            raise ValueError(
                f"{name('cursor')}={cursor} is not valid: the saved segment has only "
                f"{old_seg.steps} steps"
            )
        if old_n != self._num_replicas and cursor:
            history, cursor = (*history, (old_n, cursor)), 0
        # Validated: commit.
        self._seed = seed
        self._epoch, self._history, self._start, self._cursor = epoch, history, cursor, cursor
        self._token += 1

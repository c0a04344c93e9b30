"""A sequence-parallel-aware drop-in for ``torch.utils.data.DistributedSampler``.

With sequence parallelism the DP size is ``world // sp_size`` and all SP peers
of one DP replica must draw the same indices: it owns :class:`ShardedSampler`
and :class:`ShardedBatchSampler`, keyed on the DP size and DP rank
(:func:`dp_topology_from_group`) instead of the global rank, with one order for
all ranks from a private generator, cyclic padding, a strided partition, buckets
and exact and elastic resume (the rules: docs/internals/samplers.md). It never
touches the default RNG and communicates only to draw a seed when ``seed=None``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import ConfigError
from ..mesh import describe, is_mesh, resolve_group
from ._state import (
    MAX_SEED,
    broadcast_seed,
    check_bool,
    check_int,
    check_state_head,
    collective_device,
    is_int,
    seeded_generator,
)

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "ShardedBatchSampler",
    "ShardedSampler",
    "dp_topology_from_group",
]

STATE_FORMAT = "shmloader.ShardedSampler"
STATE_VERSION = 1

_STREAM_ORDER = 0x0D1E
_STREAM_BUCKET = 0xB0C7
_STREAM_SCHEDULE = 0x5C4E
_FLAT_CHUNK = 4096

_STATE_KEYS = (
    "format",
    "version",
    "epoch",
    "seed",
    "cursor",
    "num_replicas",
    "rank",
    "dataset_len",
    "shuffle",
    "drop_last",
    "buckets_fingerprint",
    "bases",
)


def _padded_len(remaining: int, unit: int, drop_last: bool) -> int:
    if remaining == 0:
        return 0
    if drop_last:
        return (remaining // unit) * unit
    return -(-remaining // unit) * unit


def _validate_buckets(buckets: object, dataset_len: int) -> list[torch.Tensor]:
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise ValueError(f"buckets={buckets!r} is not valid: expected a list of index lists")
    out: list[torch.Tensor] = []
    for j, bucket in enumerate(buckets):
        if isinstance(bucket, torch.Tensor):
            bucket = bucket.tolist() if bucket.dim() == 1 else bucket
        elif isinstance(bucket, np.ndarray) and bucket.ndim == 1:
            if bucket.dtype.kind not in "iu":
                raise ValueError(
                    f"buckets[{j}] is not valid: dtype {bucket.dtype} is not an integer dtype"
                )
            bucket = bucket.tolist()
        if isinstance(bucket, (str, bytes)) or not isinstance(bucket, Sequence):
            raise ValueError(f"buckets[{j}]={bucket!r} is not valid: expected a list of indices")
        for pos, index in enumerate(bucket):
            if not (is_int(index) or isinstance(index, np.integer)):
                raise ValueError(
                    f"buckets[{j}][{pos}]={index!r} is not valid: expected an int index"
                )
            if not 0 <= int(index) < dataset_len:
                raise ValueError(
                    f"buckets[{j}][{pos}]={int(index)} is not valid: expected an index in "
                    f"[0, {dataset_len}) (len(dataset)={dataset_len})"
                )
        out.append(torch.tensor([int(i) for i in bucket], dtype=torch.int64))
    return out


def _fingerprint(buckets: list[torch.Tensor] | None, batch_size: int | None) -> str:
    if buckets is None:
        return ""
    digest = hashlib.sha256(f"buckets:v1:{batch_size}:{len(buckets)}".encode())
    for bucket in buckets:
        digest.update(len(bucket).to_bytes(8, "little"))
        digest.update(bucket.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def dp_topology_from_group(sp_group: Any = None) -> tuple[int, int]:
    """Return ``(num_replicas, rank)``: the DP size and this rank's DP index.

    ``sp_group`` is this rank's sequence-parallel process group or a one-dimensional
    ``DeviceMesh`` (``mesh["sp"]``); ``None``: no SP, so the DP topology is the world. For an
    n-dimensional mesh use :func:`shmloader.dp_topology` (local, and aware of tp/pp dims).
    SP groups must partition the world into groups of one size, in any
    layout (contiguous blocks ``{0,1},{2,3}`` or strided ``{0,2},{1,3}``): the DP rank is the
    index of this rank's SP group among all SP groups ordered by their lowest global rank.

    This is a collective over the default group (one ``all_gather`` of each rank's SP-group
    leader and size): every rank must call it. Raises ``ValueError`` when torch.distributed is
    not initialised or the SP groups are not such a partition (on every rank alike).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "dp_topology_from_group() needs torch.distributed to be initialised "
            "(call dist.init_process_group first)"
        )
    world = dist.get_world_size()
    rank = dist.get_rank()
    if sp_group is None:
        return world, rank
    if is_mesh(sp_group) and sp_group.ndim != 1:
        raise ConfigError(
            "sp_group",
            describe(sp_group),
            "a one-dimensional DeviceMesh (mesh['sp']) or a process group; for the whole mesh "
            "call shmloader.dp_topology(mesh, sp_dim='sp')",
        )
    sp_group = resolve_group(sp_group)
    sp_size = dist.get_world_size(sp_group)
    leader = min(dist.get_process_group_ranks(sp_group)) if sp_size >= 1 else -1
    device = collective_device()
    mine = torch.tensor([leader, sp_size], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    pairs = [(int(t[0].item()), int(t[1].item())) for t in gathered]
    leaders = [p[0] for p in pairs]
    sizes = {p[1] for p in pairs}
    distinct = sorted(set(leaders))
    problem = ""
    if sizes != {sp_size} or sp_size < 1:
        problem = f"SP group sizes differ across ranks or a rank is not in its group: {pairs}"
    elif world % sp_size:
        problem = f"world size {world} is not a multiple of SP size {sp_size}"
    elif len(distinct) != world // sp_size or any(
        leaders.count(lead) != sp_size or leaders[lead] != lead for lead in distinct
    ):
        problem = f"SP groups do not partition the world (group leaders per rank: {leaders})"
    if problem:
        raise ValueError(f"sp_group={sp_group!r} is not valid: {problem}")
    return world // sp_size, distinct.index(leader)


@dataclass(frozen=True)
class _Plan:
    """Where a pass of the current epoch starts: re-based groups and a cursor into them."""

    epoch: int
    bases: tuple[int, ...]
    start_cursor: int


@dataclass
class _Segment:
    remainders: list[torch.Tensor]  # per group: the unpadded remaining order (dataset indices)
    padded_lens: list[int]  # per group: length after cyclic padding / truncation
    schedule: list[int] | None  # bucket of every global step (bucket mode only)
    total: int  # positions in the whole padded segment


class ShardedSampler(Sampler[int]):
    """Sampler giving DP replica ``rank`` of ``num_replicas`` its share of one global order.

    A drop-in for ``DistributedSampler`` where ``num_replicas``/``rank`` are the DP size and DP
    rank (see :func:`dp_topology_from_group`), so SP peers draw identical indices. The exact
    ordering, padding, partition, resume and bucket rules: docs/internals/samplers.md.

    Args:
        dataset: anything with ``len()``; only its length is used.
        num_replicas: DP size (``>= 1``).
        rank: DP rank in ``[0, num_replicas)``.
        shuffle: permute the order every epoch (else ``0, 1, 2, ...``).
        seed: non-negative int; ``None`` takes one seed from rank 0 (collective, needs
            torch.distributed).
        drop_last: truncate to a multiple of ``num_replicas`` (of ``num_replicas * batch_size``
            per bucket) instead of padding cyclically.
        buckets: optional list of index lists; every step's batch comes from one bucket.
        batch_size: samples per rank per step; required with ``buckets``; without buckets it
            only sets the size of the lists :meth:`batches` yields.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int | None = 0,
        drop_last: bool = False,
        buckets: Sequence[Sequence[int]] | None = None,
        batch_size: int | None = None,
    ) -> None:
        super().__init__()
        try:
            dataset_len = len(dataset)
        except TypeError as exc:
            raise ValueError(
                f"dataset of type {type(dataset).__qualname__} is not valid: it has no len()"
            ) from exc
        self._num_replicas = check_int("num_replicas", num_replicas, 1)
        self._rank = check_int("rank", rank, 0, self._num_replicas - 1)
        self._shuffle = check_bool("shuffle", shuffle)
        self._drop_last = check_bool("drop_last", drop_last)
        if batch_size is not None:
            check_int("batch_size", batch_size, 1)
        if seed is not None:
            check_int("seed", seed, 0, MAX_SEED)
        self._batch_size = batch_size
        self._dataset_len = dataset_len
        self._buckets: list[torch.Tensor] | None = None
        if buckets is not None:
            if batch_size is None:
                raise ValueError("batch_size=None is not valid: buckets= requires a batch_size")
            self._buckets = _validate_buckets(buckets, dataset_len)
        self._fingerprint = _fingerprint(self._buckets, batch_size)
        # Last: seed=None is a collective (every rank must construct its sampler), entered
        # only once all arguments were accepted.
        self._seed = broadcast_seed() if seed is None else seed
        self._plan = _Plan(0, (0,) * self._num_groups, 0)
        self._cursor = 0
        self._token = 0  # identifies the pass whose progress moves the cursor

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
        return self._plan.epoch

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def cursor(self) -> int:
        """Positions of the current segment's padded order consumed by all ranks together."""
        return self._cursor

    @property
    def _num_groups(self) -> int:
        return 1 if self._buckets is None else len(self._buckets)

    def _group_len(self, j: int) -> int:
        return self._dataset_len if self._buckets is None else len(self._buckets[j])

    # ------------------------------------------------------------------ epoch plan
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass, like ``DistributedSampler.set_epoch``.

        A different epoch starts fresh from its beginning; the epoch already selected keeps a
        resume point set by :meth:`load_state_dict`.
        """
        check_int("epoch", epoch, 0)
        if epoch != self._plan.epoch:
            self._plan = _Plan(epoch, (0,) * self._num_groups, 0)
            self._cursor = 0
            self._token += 1

    def _padded_lens(self, bases: Sequence[int], num_replicas: int) -> list[int]:
        unit = num_replicas * (1 if self._buckets is None else (self._batch_size or 1))
        return [
            _padded_len(self._group_len(j) - base, unit, self._drop_last)
            for j, base in enumerate(bases)
        ]

    def _schedule(
        self, padded_lens: Sequence[int], num_replicas: int, seed: int, epoch: int
    ) -> list[int]:
        assert self._batch_size is not None
        unit = num_replicas * self._batch_size
        counts = torch.tensor([length // unit for length in padded_lens], dtype=torch.int64)
        ids = torch.repeat_interleave(torch.arange(len(padded_lens)), counts)
        if self._shuffle and len(ids) > 1:
            perm = torch.randperm(
                len(ids), generator=seeded_generator(seed, epoch, _STREAM_SCHEDULE)
            )
            ids = ids[perm]
        return ids.tolist()

    def _group_order(self, j: int, epoch: int) -> torch.Tensor:
        if self._buckets is None:
            if not self._shuffle:
                return torch.arange(self._dataset_len, dtype=torch.int64)
            gen = seeded_generator(self._seed, epoch, _STREAM_ORDER)
            return torch.randperm(self._dataset_len, generator=gen)
        bucket = self._buckets[j]
        if not self._shuffle or len(bucket) < 2:
            return bucket
        gen = seeded_generator(self._seed, epoch, _STREAM_BUCKET, j)
        return bucket[torch.randperm(len(bucket), generator=gen)]

    def _segment(self, plan: _Plan) -> _Segment:
        remainders = [self._group_order(j, plan.epoch)[base:] for j, base in enumerate(plan.bases)]
        padded = self._padded_lens(plan.bases, self._num_replicas)
        schedule = None
        if self._buckets is not None:
            schedule = self._schedule(padded, self._num_replicas, self._seed, plan.epoch)
        return _Segment(remainders, padded, schedule, sum(padded))

    def __len__(self) -> int:
        """Number of indices this rank yields in a pass of the current epoch (from its start,
        or from the resume point set by :meth:`load_state_dict`)."""
        total = sum(self._padded_lens(self._plan.bases, self._num_replicas))
        return (total - self._plan.start_cursor) // self._num_replicas

    # ------------------------------------------------------------------ iteration
    def _start_pass(self, chunk: int) -> tuple[int, Iterator[list[int]]]:
        """Start a pass (eagerly): reset the cursor to the pass start, take ownership of it.

        Returns the pass token and a generator of this rank's indices in lists: one list per
        global step with buckets, lists of ``chunk`` indices without. The caller advances the
        cursor (only while its token is current, so a stale iterator cannot move it).
        """
        self._token += 1
        self._cursor = self._plan.start_cursor
        seg = self._segment(self._plan)
        n, r = self._num_replicas, self._rank
        done = self._plan.start_cursor // n  # samples of this rank already taken in segment

        def flat() -> Iterator[list[int]]:
            rem, stop = seg.remainders[0], seg.padded_lens[0] // n
            for k in range(done, stop, chunk):
                positions = torch.arange(k, min(k + chunk, stop), dtype=torch.int64) * n + r
                yield rem[positions % len(rem)].tolist()

        def bucketed(schedule: list[int], bs: int) -> Iterator[list[int]]:
            step0, offset = divmod(done, bs)
            seen = [0] * len(seg.remainders)  # occurrences of every bucket so far
            for j in schedule[:step0]:
                seen[j] += 1
            for s in range(step0, len(schedule)):
                j = schedule[s]
                first = offset if s == step0 else 0
                positions = seen[j] * n * bs + r + n * torch.arange(first, bs, dtype=torch.int64)
                seen[j] += 1
                yield seg.remainders[j][positions % len(seg.remainders[j])].tolist()

        if seg.schedule is None:
            return self._token, flat()
        assert self._batch_size is not None
        return self._token, bucketed(seg.schedule, self._batch_size)

    def __iter__(self) -> Iterator[int]:
        token, chunks = self._start_pass(_FLAT_CHUNK)
        n = self._num_replicas

        def gen() -> Iterator[int]:
            for out in chunks:
                for index in out:
                    if self._token == token:
                        self._cursor += n
                    yield index

        return gen()

    def batches(self) -> Iterator[list[int]]:
        """Yield this rank's indices as lists of ``batch_size`` (one list per global step).

        With buckets every list is one step from one bucket (the first list of a pass resumed
        mid-step is shorter). Without buckets the pass is cut into lists of ``batch_size``
        (the last may be shorter). The cursor advances when a list is yielded.
        """
        if self._batch_size is None:
            raise ValueError("batch_size=None is not valid: batches() needs a batch_size")
        token, chunks = self._start_pass(self._batch_size)
        n = self._num_replicas

        def gen() -> Iterator[list[int]]:
            for out in chunks:
                if self._token == token:
                    self._cursor += len(out) * n
                yield out

        return gen()

    def _batch_lengths(self) -> tuple[int, int]:
        """(length of the first list of a :meth:`batches` pass, number of lists)."""
        assert self._batch_size is not None
        bs, remaining = self._batch_size, len(self)
        first = bs
        if self._buckets is not None:
            first = bs - (self._plan.start_cursor // self._num_replicas) % bs
        if remaining == 0:
            return 0, 0
        return min(first, remaining), 1 + -(-(remaining - min(first, remaining)) // bs)

    # ------------------------------------------------------------------ state
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """A plain ``dict`` (ints, strings, bools, a list of ints) describing the position.

        Fields: ``format``/``version``; ``epoch``; ``seed``; ``cursor`` (positions of the current
        segment's padded order consumed by all ranks, = samples of this rank * num_replicas);
        ``num_replicas``/``rank``/``dataset_len``/``shuffle``/``drop_last``/
        ``buckets_fingerprint`` (topology; fingerprint ``""`` without buckets); ``bases`` (per
        group, unpadded positions consumed by earlier topologies this epoch).

        ``consumed=k``: report that ``k`` samples of this rank were consumed since the current
        pass started (use it under a prefetching ``DataLoader``), instead of the yield count.
        """
        cursor = self._cursor
        if consumed is not None:
            check_int("consumed", consumed, 0, len(self))
            cursor = self._plan.start_cursor + consumed * self._num_replicas
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._plan.epoch,
            "seed": self._seed,
            "cursor": cursor,
            "num_replicas": self._num_replicas,
            "rank": self._rank,
            "dataset_len": self._dataset_len,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "buckets_fingerprint": self._fingerprint,
            "bases": list(self._plan.bases),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output; the next pass continues from its cursor.

        Everything is validated before anything changes; a refused state raises ``ValueError``
        naming the field and leaves the sampler as it was. The state's ``seed`` is adopted (it
        defines the order being resumed). Under a different ``num_replicas`` the remainder of
        the epoch is re-split (docs/internals/samplers.md); under the same ``num_replicas`` and
        any rank the segment continues exactly.
        """
        epoch, seed, old_n = check_state_head(state, _STATE_KEYS, STATE_FORMAT, STATE_VERSION)

        def field(name: str) -> str:
            return f"state[{name!r}]"

        dataset_len = check_int(field("dataset_len"), state["dataset_len"], 0)
        if dataset_len != self._dataset_len:
            raise ValueError(
                f"{field('dataset_len')}={dataset_len} is not valid: this sampler's dataset has "
                f"{self._dataset_len} samples"
            )
        for name, mine in (("shuffle", self._shuffle), ("drop_last", self._drop_last)):
            value = check_bool(field(name), state[name])
            if value != mine:
                raise ValueError(
                    f"{field(name)}={value!r} is not valid: this sampler has {name}={mine!r}"
                )
        fingerprint = state["buckets_fingerprint"]
        if not isinstance(fingerprint, str):
            raise ValueError(
                f"{field('buckets_fingerprint')}={fingerprint!r} is not valid: expected a str"
            )
        if fingerprint != self._fingerprint:
            raise ValueError(
                f"{field('buckets_fingerprint')}={fingerprint!r} is not valid: the state was "
                f"saved with other buckets/batch_size than this sampler's "
                f"({self._fingerprint!r})"
            )
        raw_bases = state["bases"]
        if not isinstance(raw_bases, (list, tuple)) or len(raw_bases) != self._num_groups:
            raise ValueError(
                f"{field('bases')}={raw_bases!r} is not valid: expected a list of "
                f"{self._num_groups} ints"
            )
        bases = tuple(
            check_int(f"{field('bases')}[{j}]", base, 0, self._group_len(j))
            for j, base in enumerate(raw_bases)
        )
        old_lens = self._padded_lens(bases, old_n)
        cursor = check_int(field("cursor"), state["cursor"], 0, sum(old_lens))
        if cursor % old_n:
            raise ValueError(
                f"{field('cursor')}={cursor} is not valid: expected a multiple of "
                f"num_replicas={old_n}"
            )

        if old_n == self._num_replicas:
            plan = _Plan(epoch, bases, cursor)
        else:
            consumed = self._consumed_per_group(old_lens, old_n, seed, epoch, cursor)
            new_bases = tuple(
                base + min(used, self._group_len(j) - base)
                for j, (base, used) in enumerate(zip(bases, consumed, strict=True))
            )
            plan = _Plan(epoch, new_bases, 0)
        # Validated: commit.
        self._seed = seed
        self._plan = plan
        self._cursor = plan.start_cursor
        self._token += 1

    def _consumed_per_group(
        self, padded_lens: list[int], num_replicas: int, seed: int, epoch: int, cursor: int
    ) -> list[int]:
        """Positions of every group's padded remainder consumed at ``cursor``."""
        if self._buckets is None:
            return [cursor]
        assert self._batch_size is not None
        unit = num_replicas * self._batch_size
        schedule = self._schedule(padded_lens, num_replicas, seed, epoch)
        steps, partial = divmod(cursor, unit)
        consumed = [0] * len(padded_lens)
        for j in schedule[:steps]:
            consumed[j] += unit
        if partial:
            consumed[schedule[steps]] += partial
        return consumed


class ShardedBatchSampler(Sampler[list[int]]):
    """Wrap a :class:`ShardedSampler` with a ``batch_size`` for ``DataLoader(batch_sampler=)``.

    Yields :meth:`ShardedSampler.batches`; checkpoint through the wrapped sampler
    (``batch_sampler.sampler.state_dict()``), which this wrapper forwards too.
    """

    def __init__(self, sampler: ShardedSampler) -> None:
        super().__init__()
        if not isinstance(sampler, ShardedSampler) or sampler.batch_size is None:
            raise ValueError(
                f"sampler={sampler!r} is not valid: expected a ShardedSampler with a batch_size"
            )
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.batches()

    def __len__(self) -> int:
        return self.sampler._batch_lengths()[1]

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self, consumed_batches: int | None = None) -> dict[str, Any]:
        """The sampler's state; ``consumed_batches=k``: ``k`` lists of this pass consumed."""
        if consumed_batches is None:
            return self.sampler.state_dict()
        check_int("consumed_batches", consumed_batches, 0, len(self))
        assert self.sampler.batch_size is not None
        first, _ = self.sampler._batch_lengths()
        consumed = 0
        if consumed_batches:
            consumed = first + (consumed_batches - 1) * self.sampler.batch_size
        return self.sampler.state_dict(consumed=min(consumed, len(self.sampler)))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

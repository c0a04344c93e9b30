"""The rank that runs the user's loader: ``local`` (sharing off), and the leader built on it.

With sharing off every rank is *local*: it iterates its own loader exactly
as without shmloader, and runs its batches through the codec's checks until
one would be refused with sharing on, which it names in one warning
(NOTE [sharing off is plain torch] in ``loader``)::

    local
    -----
    source = iter(loader)          (_open_source: skip a resumed cursor)
    _mark_boundary()               (optimizer-step boundary: loader state, RNG)
    batch = next(source)
    codec.encode(batch)            (metadata only: warns once what sharing would refuse)
    yield batch

The leader (``leader``) opens and steps its loader the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from . import codec, rng
from .errors import UnsupportedBatchError
from .roles import log


class _Local:
    """Open, fast-forward and step the user's loader; the local role's loop."""

    def _local_iteration(self, skip: int) -> Iterator[Any]:
        source, _ = self._open_source(skip)
        while True:
            self._check_open()
            self._mark_boundary()
            box = []  # NOTE [no batch in the frame] (loader)
            try:
                box.append(next(source))
            except StopIteration:
                self._exhausted = True
                return
            if not self._told_unshareable:  # NOTE [sharing off is plain torch] (loader)
                try:
                    codec.encode(box[0], allow_pickle=self.config.allow_pickle)
                except UnsupportedBatchError as exc:
                    self._told_unshareable = True
                    log.warning(
                        "shmloader: sharing is off, so this batch is delivered as the loader "
                        "made it; with SHMLOADER=1 it would be refused: %s",
                        exc,
                    )
            self._delivered += 1
            yield box.pop()

    def _open_source(self, skip: int) -> tuple[Iterator[Any], int]:
        """``iter()`` the user's loader and fast-forward ``skip`` batches (a resume).

        Returns the iterator and the default-generator draws made so far
        (NOTE [RNG mirroring] in ``rng``). Skipping replays the skipped batches through
        the loader, so its sampler, workers and RNG end where an
        uninterrupted run would be.
        """
        self._capture_rng()  # the first request of this iteration
        self._just_opened = True
        before = rng.snapshot()
        loader = self._loader
        # NOTE [RNG at the epoch's start] (rng): a resume reopens the loader with the
        # generators of the saved epoch's start, then puts the step boundary back.
        resumed, self._resume_open = self._resume_open, None
        undo, self._rng_undo = self._rng_undo, None
        seeded = rng.will_consume_base_seed(loader)
        unseeded = False
        if resumed is not None and not _stateful(loader):
            if skip and resumed.get("rng") is not None:
                undo = undo or rng.capture()
                rng.restore(resumed["rng"])
                unseeded = seeded and not resumed["seeded"]
            else:
                unseeded = seeded and resumed["reset_next"]
        self._iter_open = {"epoch": self._epoch, "rng": rng.capture(), "seeded": seeded}
        if unseeded:
            self._iter_open["seeded"] = False
            source = rng.iter_without_base_seed(loader)  # type: ignore[arg-type]
        else:
            source = iter(loader)  # type: ignore[arg-type]
        for _ in range(skip):
            try:
                next(source)
            except StopIteration:
                break
        if undo is not None:  # NOTE [RNG at the step boundary] (rng)
            rng.restore(undo)
        return source, self._count(before)

    def _mark_boundary(self) -> None:
        """Remember a stateful loader's state at an optimizer-step boundary."""
        k = self.accumulation_steps
        if k > 1 and self._delivered % k == 0 and _stateful(self._loader):
            self._boundary_state = self._loader.state_dict()  # type: ignore[union-attr]
        if self._just_opened:  # _open_source captured this request before opening
            self._just_opened = False
        else:
            self._capture_rng()

    def _count(self, before: torch.Tensor) -> int:
        n = rng.count_draws(before, rng.snapshot())
        if n is None:
            if not self._warned_rng:
                self._warned_rng = True
                log.warning(
                    "shmloader: the leader's loader drew from the default torch generator in a way "
                    "followers cannot mirror (e.g. torch.rand in a main-process collate_fn); "
                    "followers' RNG will differ from sharing-off (NOTE [RNG mirroring])"
                )
            return 0
        return n


def _stateful(loader: object) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )

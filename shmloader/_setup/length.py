"""``len(loader)`` on every rank: the leader's loader's length for the current epoch.

It owns ``GroupLength``: the length broadcast at set-up, and after each change
every rank makes (``set_epoch`` to another epoch, ``load_state_dict``) the
leader's new length under that change's key in the process group's key-value
store, which the other ranks read (NOTE [length per epoch]). It touches only
those keys; no collective runs in ``len()``.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from .._topology import GroupTopology
from ..errors import PeerLostError


# NOTE [length per epoch]
#     ``len(loader)`` is what ``len()`` of the leader's loader says now,
#     exactly what sharing off gives on every rank: a
#     ``BalancedBatchSampler``'s length changes with the epoch, and after
#     a resume a fast-forwarded loader's length is still the whole epoch
#     (the batches a resume skips count, as ``len(DataLoader)`` counts
#     them), while a ``ShardedSampler`` re-split under another DP size
#     says what is left. The leader broadcasts its length at set-up; it
#     can change only where every rank of the group calls the same
#     thing: ``set_epoch`` to another epoch and ``load_state_dict``. Each
#     rank counts those changes; after change ``n`` the leader writes its
#     length under key ``n`` of the loader in the process group's
#     key-value store (no collective), and another rank's ``len()``
#     reads key ``n``, waiting at most ``SHMLOADER_TIMEOUT`` for a
#     leader that has not made that change yet.
class GroupLength:
    """The leader's length as every rank of the group sees it (NOTE [length per epoch])."""

    def __init__(
        self,
        topo: GroupTopology,
        at_setup: int | None,
        loader: Callable[[], Iterable[Any] | None],
        timeout: float,
        epoch: Callable[[], int],
    ) -> None:
        self.topo = topo
        self.at_setup = at_setup  # broadcast by the leader at set-up; None: no len()
        self.loader = loader  # the leader's loader (None on other ranks)
        self.timeout = timeout
        self.epoch = epoch
        self.changes = 0  # changes of the leader's length this rank has seen
        self.read: tuple[int, int] | None = None  # (change, length) last read from the store

    def changed(self) -> None:
        """Every rank: ``set_epoch`` to another epoch or ``load_state_dict`` ran."""
        self.changes += 1
        if not self.topo.is_leader:
            return
        try:
            length = len(self.loader())  # type: ignore[arg-type]
        except TypeError:
            length = -1
        store = default_store()
        if store is not None:  # unreachable: the other ranks' len() names the leader
            with contextlib.suppress(RuntimeError, dist.DistError):
                store.set(self._key(self.changes), str(length))

    def value(self) -> int | None:
        """The length on a rank that is not the leader (waits for the leader's change)."""
        if self.changes == 0:
            return self.at_setup
        change = self.changes
        if self.read is not None and self.read[0] == change:
            return self.read[1] if self.read[1] >= 0 else None
        store = default_store()
        if store is None:  # no key-value store: the set-up length
            return self.at_setup
        key = self._key(change)
        try:
            store.wait([key], datetime.timedelta(seconds=self.timeout))
            length = int(store.get(key))
        except (RuntimeError, dist.DistError, ValueError) as exc:
            raise PeerLostError(
                self.topo.leader,
                "leader",
                f"it did not publish its loader's length for epoch {self.epoch()} within "
                f"{self.timeout:.0f} s ({exc}); len() waits until the leader has called the same "
                "set_epoch()/load_state_dict() as this rank",
            ) from None
        self.read = (change, length)
        return length if length >= 0 else None

    def _key(self, change: int) -> str:
        return f"shmloader/len/{self.topo.fact(self.topo.leader).token}/{change}"


def default_store() -> Any:
    """The default process group's key-value store, or None (a world of one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialised, or internals changed
        return None

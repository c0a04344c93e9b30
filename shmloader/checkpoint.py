"""Checkpoints: a rank's state at an optimizer-step boundary, validated, saved and loaded.

It owns the state's format (``STATE_FORMAT``: cursor, RNG at the step boundary
and the epoch's start, sampler and loader state, topology),
``Checkpoints.state_dict`` and ``load`` and ``validate_state`` (NOTE
[checkpoints]). It reads the ``Cursor`` and ``Boundary``, the leader's
``Source``, the device stage's and the ahead loop's hand-over positions, and on load writes only
the cursor's pending resume and the boundary's pending RNG, which take effect at
the next ``iter()`` (docs/internals/flow.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ._roles import rng
from ._roles.base import log
from ._roles.cursor import Boundary, Cursor
from ._roles.local import Source, stateful
from .errors import ConfigError, TopologyMismatchError
from .samplers.sharded import ShardedBatchSampler, ShardedSampler

if TYPE_CHECKING:
    from ._roles.ahead import Ahead
    from .device.stage import DeviceStage

STATE_FORMAT = "shmloader.state/3"
#: Earlier formats ``load_state_dict`` still accepts: 2 has no RNG of the epoch's start
#: (``opened``), 1 no RNG and no saving rank.
OLD_STATE_FORMATS = ("shmloader.state/2", "shmloader.state/1")


class Checkpoints:
    """``ShmLoader.state_dict``/``load_state_dict`` of one rank (NOTE [checkpoints])."""

    def __init__(
        self,
        cursor: Cursor,
        boundary: Boundary,
        source: Source | None,
        group_ranks: list[int] | None,
        stage: DeviceStage | None,
        ahead: Ahead | None = None,
    ) -> None:
        self.cursor = cursor
        self.boundary = boundary
        self.source = source  # the leader's and local ranks' loader; None on others
        self.group_ranks = group_ranks
        self.stage = stage
        self.ahead = ahead  # the role's loop on its own thread (NOTE [running ahead])

    @property
    def loader(self) -> Any:
        return self.source.loader if self.source is not None else None

    def live_position(self) -> tuple[int, bool, Any, Any]:
        """(delivered, exhausted, boundary state, loader state) of the role's loop now."""
        now = self.source.state() if self.source is not None else None
        return self.cursor.delivered, self.cursor.exhausted, self.boundary.loader_state, now

    def position(self) -> tuple[int, bool, Any, Any]:
        """``live_position()`` as of the last batch handed over by a loop that runs ahead.

        A loop on its own thread (NOTE [running ahead] in ``_roles.ahead``) is
        up to its depth further: what was published ahead is never checkpointed.
        """
        ahead = self.ahead
        if ahead is not None and ahead.position is not None:
            return ahead.position
        return self.live_position()

    def user_position(self) -> tuple[int, bool, Any, Any]:
        """``position()`` as of the last batch the user received.

        With device prefetch the loop has pulled up to ``prefetch`` batches
        more than the user has: the stage keeps the position from when the
        batch it handed over last was pulled.
        """
        if self.stage is not None and self.stage.position is not None:
            return self.stage.position
        return self.position()

    def user_request(self) -> None:
        """The user's ``next()`` under device prefetch (NOTE [checkpoints under prefetch])."""
        handed = self.stage.position if self.stage is not None else None
        if handed is None and self.ahead is not None:
            handed = self.ahead.position  # NOTE [running ahead] (_roles.ahead)
        delivered = handed[0] if handed is not None else self.cursor.delivered  # none handed yet
        self.boundary.user_request(delivered)

    def topology(self) -> dict[str, Any]:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        group = list(self.group_ranks) if self.group_ranks is not None else [rank]
        sp = len(group)
        return {
            "world": world,
            "sp": sp,
            "dp": world // sp,
            "rank": rank,
            "sp_rank": group.index(rank),
            "group": group,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (``ShmLoader.state_dict``)."""
        cursor, boundary, loader = self.cursor, self.boundary, self.loader
        k = boundary.steps
        if cursor.resumes_here():
            at = delivered = cursor.resume[1]  # type: ignore[index]  # loaded, not iterated yet
            _, _, saved, now = self.position()
        else:
            delivered, exhausted, saved, now = self.user_position()
            at = delivered if exhausted else delivered - delivered % k
        partial = at != delivered
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "epoch": cursor.epoch,
            "batches": at,
            "accumulation_steps": k,
            "topology": self.topology(),
        }
        if boundary.pending is not None:
            state["rng"] = boundary.pending
        elif partial and boundary.rng is not None:
            state["rng"] = boundary.rng
        else:
            state["rng"] = rng.capture()
        if loader is not None:
            sampler = _sampler_state(loader, at - cursor.sampler_base)
            if sampler is not None:
                state["sampler"] = sampler
            if stateful(loader):
                state["loader"] = saved if partial else now
            state.update(self._open_state(at))
        return state

    def _open_state(self, at: int) -> dict[str, Any]:
        """``opened`` and ``reset_next`` of a leader's state (NOTE [RNG at the epoch's start])."""
        loaded = self.boundary.resume_open
        if loaded is not None:  # loaded, not iterated yet
            out = {"reset_next": loaded["reset_next"]}
            if at and self.cursor.resumes_here() and loaded.get("rng") is not None:
                out["opened"] = {"rng": loaded["rng"], "seeded": loaded["seeded"]}
            return out
        out = {"reset_next": rng.reuses_workers(self.loader)}
        opened = self.boundary.opened
        if at and opened is not None and opened["epoch"] == self.cursor.epoch:
            out["opened"] = {"rng": opened["rng"], "seeded": opened["seeded"]}
        return out

    def load(self, state: dict[str, Any], set_epoch: Callable[[int], None]) -> None:
        """Validate ``state`` completely, then apply it (``ShmLoader.load_state_dict``)."""
        topology = self.topology()
        epoch, batches, loader_state = validate_state(state, topology)
        cursor, boundary, loader = self.cursor, self.boundary, self.loader
        resized = state["topology"]["world"] != topology["world"]
        sampler = _find_sharded(loader) if loader is not None else None
        if resized:
            if loader is not None and sampler is None:
                raise TopologyMismatchError(
                    f"the checkpoint was taken at world size {state['topology']['world']}, now "
                    f"{topology['world']}: resuming under another DP size needs "
                    "the loader's sampler to be a shmloader.ShardedSampler (DataLoader(sampler="
                    "...) or batch_sampler=ShardedBatchSampler(...)), which re-splits the rest "
                    "of the epoch"
                )
            if sampler is not None:
                sampler.load_state_dict(state["sampler"])  # validates before it changes
            set_epoch(epoch)
            cursor.resume = (epoch, 0, True)
            boundary.resume_open = None  # no rank's stream continues
            return
        restore = loader_state is not None and loader is not None
        if restore and not stateful(loader):
            raise ConfigError(
                "state['loader']",
                type(loader_state).__name__,
                "no loader state, because the current loader has no load_state_dict()",
            )
        set_epoch(epoch)
        if restore:
            loader.load_state_dict(loader_state)
        cursor.resume = (epoch, batches, not restore)
        boundary.pending = state.get("rng")
        boundary.resume_open = None
        if loader is not None:  # NOTE [RNG at the epoch's start] (rng.py)
            opened = state.get("opened") or {}
            boundary.resume_open = {
                "rng": opened.get("rng"),
                "seeded": opened.get("seeded", True),
                "reset_next": state.get("reset_next", False),
            }
            if state["format"] != STATE_FORMAT and batches and not stateful(loader):
                log.warning(
                    "shmloader: this checkpoint (%s) carries no RNG of the epoch's start: a "
                    "shuffled loader or random transforms in its workers resume differently "
                    "than an uninterrupted run would; checkpoints saved now (%s) resume exactly",
                    state["format"],
                    STATE_FORMAT,
                )


def _find_sharded(loader: object) -> Any:
    """The loader's ``ShardedSampler`` or ``ShardedBatchSampler``, or None."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, ShardedBatchSampler):
        return batch_sampler
    for candidate in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(candidate, ShardedSampler):
            return candidate
    return None


def _sampler_state(loader: object, batches: int) -> dict[str, Any] | None:
    """The loader's ``ShardedSampler`` state once ``batches`` of its current pass were used.

    The sampler's own cursor runs ahead of training (workers prefetch), so
    the state is computed from the batches the SP group really consumed.
    """
    found = _find_sharded(loader)
    if found is None:
        return None
    if isinstance(found, ShardedBatchSampler):
        return found.state_dict(consumed_batches=min(batches, len(found)))
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not isinstance(size, int):
        return None
    return found.state_dict(consumed=min(batches * size, len(found)))


_RECIPE = (
    "Save loader.state_dict() on every rank (e.g. torch.save(loader.state_dict(), "
    "f'{ckpt}/loader-rank{rank}.pt')) and load each rank's own; to resume under another "
    "DP size, load the state rank 0 saved on every rank."
)


# NOTE [checkpoints]
#     A state is per rank: it carries the rank's RNG at the step boundary
#     and, on an SP group's leader, its DP replica's loader and sampler
#     position. Same world size: only the rank that saved a state may load
#     it (and its group must be the same ranks). Another world size with
#     the same SP size is a DP resize: any rank may load a state that
#     carries a ``ShardedSampler``'s state (a leader's), which the new
#     leader's sampler re-splits. The SP size never changes.
def validate_state(state: Any, topology: dict[str, Any]) -> tuple[int, int, Any]:
    """Check a checkpoint completely before anything changes (NOTE [checkpoints]);
    return (epoch, cursor, loader state)."""
    if not isinstance(state, dict):
        raise ConfigError("state", type(state).__name__, "the dict returned by state_dict()")
    fmt = state.get("format")
    if fmt != STATE_FORMAT and fmt not in OLD_STATE_FORMATS:
        raise ConfigError("state['format']", fmt, f"{STATE_FORMAT!r} (or {OLD_STATE_FORMATS})")
    for key, minimum in (("epoch", 0), ("batches", 0), ("accumulation_steps", 1)):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"state[{key!r}]", value, f"an integer >= {minimum}")
    saved = state.get("topology")
    if not isinstance(saved, dict):
        raise ConfigError("state['topology']", saved, "a dict")
    if "rng" in state and (problem := rng.check(state["rng"])) is not None:
        raise ConfigError("state['rng']", type(state["rng"]).__name__, problem)
    if "reset_next" in state and not isinstance(state["reset_next"], bool):
        raise ConfigError("state['reset_next']", state["reset_next"], "True or False")
    if "opened" in state:
        opened = state["opened"]
        if not isinstance(opened, dict) or not isinstance(opened.get("seeded"), bool):
            raise ConfigError(
                "state['opened']", type(opened).__name__, "a dict with 'rng' and 'seeded' (a bool)"
            )
        if (problem := rng.check(opened.get("rng"))) is not None:
            raise ConfigError("state['opened']['rng']", type(opened.get("rng")).__name__, problem)
    if saved.get("sp") != topology["sp"]:
        raise TopologyMismatchError(
            f"this checkpoint was taken under another SP size (sp: checkpoint "
            f"{saved.get('sp')!r}, now {topology['sp']!r}; group: checkpoint "
            f"{saved.get('group')!r}, now {topology['group']!r}); the SP size cannot change on "
            "resume: resume with the SP size the checkpoint was taken with"
        )
    if saved.get("world") != topology["world"]:
        if not isinstance(state.get("sampler"), dict):
            raise TopologyMismatchError(
                f"this checkpoint was taken at world size {saved.get('world')!r} (DP "
                f"{saved.get('dp')!r}), now {topology['world']} (DP {topology['dp']}): "
                "resuming under another DP size needs the state of a shmloader.ShardedSampler, "
                "which only an SP group leader's checkpoint carries, and only when its loader's "
                "sampler is one: load the state rank 0 saved on every rank"
            )
        return state["epoch"], 0, None
    if fmt != "shmloader.state/1" and saved.get("rank") != topology["rank"]:
        raise TopologyMismatchError(
            f"this state was saved by rank {saved.get('rank')!r} and this is rank "
            f"{topology['rank']}: loader state is per rank (it carries the rank's RNG at the "
            "optimizer-step boundary and, on an SP group's leader, its DP replica's data "
            "position). " + _RECIPE
        )
    if saved.get("group") != topology["group"]:
        raise TopologyMismatchError(
            f"this checkpoint was taken under other SP groups (group: checkpoint "
            f"{saved.get('group')!r}, now {topology['group']!r}) and cannot map onto the current "
            "ranks: resume with the same SP group layout. " + _RECIPE
        )
    return state["epoch"], state["batches"], state.get("loader")

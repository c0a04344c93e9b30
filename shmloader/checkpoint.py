"""Checkpoints: a rank's state at an optimizer-step boundary, validated, saved and loaded.

It owns the state's format (``STATE_FORMAT``: cursor, RNG at the step boundary
and the epoch's start, sampler and loader state, topology, the dataset's
identity), ``Checkpoints.state_dict`` and ``load`` and ``validate_state`` (NOTE
[checkpoints]) and what a state must share with the loader it is loaded into
(NOTE [a resume fits the loader]). It reads the ``Cursor`` (the position handed over
to the user, NOTE [the position handed over]), the ``Boundary`` and the leader's
``Source``, and on load writes only the cursor's pending resume and the boundary's
pending RNG, which take effect at the next ``iter()`` (docs/internals/flow.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from . import _rng as rng
from ._roles.base import log
from ._roles.cursor import Boundary, Cursor, Position
from ._roles.local import Source, stateful
from .errors import ConfigError, TopologyMismatchError
from .samplers.sharded import ShardedBatchSampler, ShardedSampler

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
    ) -> None:
        self.cursor = cursor
        self.boundary = boundary
        self.source = source  # the leader's and local ranks' loader; None on others
        self.group_ranks = group_ranks
        self.resumed_ended = False  # the loaded state's ``ended``, until its iteration

    @property
    def loader(self) -> Any:
        return self.source.loader if self.source is not None else None

    def snapshot(self) -> Position:
        """The role's loop's position now (NOTE [the position handed over] in ``cursor``)."""
        now = self.source.state() if self.source is not None else None
        cursor = self.cursor
        return Position(
            cursor.epoch, cursor.delivered, cursor.exhausted, self.boundary.loader_state, now
        )

    def position(self) -> Position:
        """The user's position: the last one handed over, or, where no loop runs ahead of
        the user, the loop's (NOTE [the position handed over])."""
        handed = self.cursor.handed
        return handed if handed is not None else self.snapshot()

    def user_request(self) -> None:
        """The user's ``next()`` under device prefetch (NOTE [checkpoints under prefetch])."""
        self.boundary.user_request(self.cursor.user_delivered())

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
        user = self.position()
        saved, now = user.step_state, user.loader_state
        if cursor.resumes_here():
            at = delivered = cursor.resume[1]  # type: ignore[index]  # loaded, not iterated yet
            ended = self.resumed_ended
        else:
            delivered, ended = user.delivered, user.exhausted
            at = delivered if ended else delivered - delivered % k
        partial = at != delivered
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "epoch": cursor.epoch,
            "batches": at,
            "ended": ended,
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
            state["dataset"] = {key: value for key, (_, value) in _identity(loader).items()}
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
        restore = not resized and loader_state is not None and loader is not None
        if not resized:
            check_boundary(state, boundary.steps)
        if loader is not None:
            check_identity(state, loader, adopts_seed=resized or restore)
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
            self.resumed_ended = False
            boundary.resume_open = None  # no rank's stream continues
            return
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
        self.resumed_ended = _ended(state)
        boundary.pending = state.get("rng")
        boundary.resume_open = None
        if loader is not None:  # NOTE [RNG at the epoch's start] (_rng.py)
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


# NOTE [a resume fits the loader]
#     A state resumes at its cursor by replaying the saved order, so it
#     loads only into a loader that gives that cursor the same meaning:
#
#     - The cursor is an optimizer-step boundary of the current layout: the
#       saved ``accumulation_steps`` or, when the loader's differs, a cursor
#       that is a multiple of the loader's (saved at batch 6 with 2, loaded
#       with 3: step 3 of 3 starts there, exact) or the end of the epoch
#       (``ended``; a state without it, older than the key, ended where its
#       cursor is no multiple of its own accumulation). Anything else would
#       start the resumed run in the middle of an optimizer step.
#     - The leader's dataset has the saved length, and the sampler that
#       orders it (a ``seed`` attribute: ``DistributedSampler``,
#       ``ShardedSampler``, ``BalancedBatchSampler``; not with ``shuffle=False``)
#       the saved seed: the same cursor in another dataset or order is other
#       samples. A sampler
#       that loads its own state adopts the saved seed (a ``ShardedSampler``
#       under a DP resize or in a ``StatefulDataLoader``), so its seed is not
#       compared. A ``generator=`` has no seed that identifies the order
#       (NOTE [limits of exact resume] in ``local``).
#
#     Each mismatch is a ``TopologyMismatchError`` naming both values and
#     the fix, raised before anything changes. A key the state lacks (saved
#     before it existed) or the loader cannot tell (a dataset without
#     ``len()``, a loader without ``dataset``) is not compared. Only a rank
#     that runs the loader holds its identity: a follower checks the layout.
def _ended(state: dict[str, Any]) -> bool:
    """Whether the state's cursor is the end of its epoch (NOTE [a resume fits the loader])."""
    ended = state.get("ended")
    if isinstance(ended, bool):
        return ended
    return state["batches"] % state["accumulation_steps"] != 0


def check_boundary(state: dict[str, Any], steps: int) -> None:
    """Refuse a cursor inside an optimizer step of ``steps`` micro-batches (NOTE [a resume
    fits the loader])."""
    saved, batches = state["accumulation_steps"], state["batches"]
    if saved == steps or batches % steps == 0 or _ended(state):
        return
    below = batches - batches % steps
    raise TopologyMismatchError(
        f"this checkpoint was saved with accumulation_steps={saved} at batch {batches} of epoch "
        f"{state['epoch']}, and this loader has accumulation_steps={steps}: batch {batches} "
        f"is inside an optimizer step of {steps} micro-batches (steps start at batches "
        f"{below} and {below + steps}), so the resumed run would start a step part-way. "
        f"Construct the loader with accumulation_steps={saved} to resume from this checkpoint "
        f"(or with one that divides {batches}), or resume from a checkpoint saved at a batch "
        f"that is a multiple of {steps}"
    )


def _identity(loader: object) -> dict[str, tuple[str, int]]:
    """The loader's dataset length and its sampler's seed, each with where it was read.

    Keys ``length`` and ``sampler_seed``, each only where the loader tells it
    (NOTE [a resume fits the loader]).
    """
    out: dict[str, tuple[str, int]] = {}
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        try:
            length = len(dataset)
        except (TypeError, NotImplementedError):  # an IterableDataset without __len__
            length = None
        if isinstance(length, int) and not isinstance(length, bool):
            out["length"] = ("dataset", length)
    owner = _seed_owner(loader)
    if owner is not None:
        out["sampler_seed"] = (owner[0], owner[2])
    return out


def _seed_owner(loader: object) -> tuple[str, object, int] | None:
    """(where, sampler, seed) of the first sampler of ``loader`` whose integer ``seed``
    orders it (not one constructed with ``shuffle=False``, which its seed does not order)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for where, obj in (
        ("sampler", getattr(loader, "sampler", None)),
        ("batch_sampler", batch_sampler),
        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None)),
    ):
        seed = getattr(obj, "seed", None)
        if getattr(obj, "shuffle", None) is False:
            continue
        if isinstance(seed, int) and not isinstance(seed, bool):
            return where, obj, seed
    return None


def check_identity(state: dict[str, Any], loader: object, *, adopts_seed: bool) -> None:
    """Refuse a state saved with another dataset length or sampler seed (NOTE [a resume fits
    the loader]); ``adopts_seed``: a sampler that loads its own state takes the saved seed."""
    saved = state.get("dataset")
    if not isinstance(saved, dict):
        return
    now = _identity(loader)
    if "length" in saved and "length" in now and saved["length"] != now["length"][1]:
        raise TopologyMismatchError(
            f"this checkpoint was saved with a dataset of {saved['length']} samples, and this "
            f"loader's dataset has {now['length'][1]}: the resume would replay the saved "
            "positions in another dataset and deliver other samples than the run it resumes. "
            "Resume with the dataset the checkpoint was saved with; to train on the changed "
            "dataset, start its epoch afresh instead of loading this state"
        )
    owner = _seed_owner(loader)
    if owner is None or "sampler_seed" not in saved or saved["sampler_seed"] == owner[2]:
        return
    if adopts_seed and stateful(owner[1]):
        return
    where, sampler, seed = owner
    raise TopologyMismatchError(
        f"this checkpoint was saved with a sampler seeded {saved['sampler_seed']}, and this "
        f"loader's {where} ({type(sampler).__name__}) has seed={seed}: the resume would replay "
        "the saved positions in another order and deliver other samples than the run it "
        f"resumes. Construct the sampler with seed={saved['sampler_seed']}"
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
    if "ended" in state:
        ended = state["ended"]
        if not isinstance(ended, bool):
            raise ConfigError("state['ended']", ended, "True or False")
        if not ended and state["batches"] % state["accumulation_steps"]:
            raise ConfigError(
                "state['ended']",
                ended,
                f"True: batch {state['batches']} is no multiple of the state's "
                f"accumulation_steps={state['accumulation_steps']}, so only an epoch's end "
                "can be saved there",
            )
    if "dataset" in state:
        dataset = state["dataset"]
        if not isinstance(dataset, dict) or any(
            key not in ("length", "sampler_seed") or not isinstance(v, int) or isinstance(v, bool)
            for key, v in dataset.items()
        ):
            raise ConfigError(
                "state['dataset']", dataset, "a dict of ints with keys 'length' and 'sampler_seed'"
            )
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

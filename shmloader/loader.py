"""``ShmLoader``: the public façade over one role object.

It owns construction, ``__iter__`` (the sharing line at the first; the
pipeline from the role's loop on the producer to the user), ``__len__``,
``set_epoch``, ``state_dict`` and ``load_state_dict``, ``stats`` and ``close``
(``_setup.closing``: every step of closing, in order, once, from any thread), and
holds by composition what ``shmloader._setup.build`` made for this rank: one
role object, its producer and ``Owner``, the ``Cursor`` and ``Boundary``, the
checkpoints, the group's length and the device stage. It keeps no role's state
itself; the roles it may hold are mapped in docs/architecture.md; how its calls
reach them, and one batch's way, in docs/internals/flow.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._roles.base import CLOSE_WAIT_S, Owner, Role
from ._roles.cursor import Boundary, Cursor
from ._roles.iteration import Iteration
from ._roles.stats import RankStats
from ._setup import arrival, banner
from ._setup.build import (
    Shared,
    build,
    build_local,
    close_quietly,
    group_ranks,
    resolve_config,
)
from ._setup.closing import Closing
from ._topology import GroupTopology
from .checkpoint import Checkpoints
from .config import Config
from .device.stage import DeviceOps, DeviceStage
from .device.which import resolve as resolve_device
from .errors import ConfigError, LoaderStateError
from .mesh import resolve_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ShmLoader:
    """Iterate one loader per SP group; every rank of ``group`` gets identical batches.

    Args:
        make_loader: zero-argument callable returning an iterable of batches,
            usually a ``torch.utils.data.DataLoader``. With sharing on only the
            group's leader calls it.
        group: the ``torch.distributed`` process group whose ranks must receive
            identical batches, or a ``DeviceMesh``: a one-dimensional one
            (``mesh["sp"]``) or any mesh with ``mesh_dim``. ``None``, a group
            of size 1, or sharing off (``SHMLOADER`` unset): every rank calls
            ``make_loader`` itself.
        mesh_dim: with ``group=mesh``, the dimension whose ranks share batches
            (``"sp"``); see :mod:`shmloader.mesh`.
        accumulation_steps: micro-batches per optimizer step (checkpoints
            resume at optimizer-step boundaries).
        config: a :class:`~shmloader.Config`; default ``Config.from_env()``.
        device: ``None`` (``Config.device``, ``SHMLOADER_DEVICE``), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"`` or ``"auto"``: with a CUDA device every
            tensor of every batch arrives on it, copied from the registered
            ring on a side stream ``Config.prefetch`` batches ahead
            (``shmloader.device.stage``).
        select: ``select(batch) -> batch`` (or ``select(batch, step)``: the
            batch's position in its epoch), applied to the shared CPU view
            before any device copy, on every path (NOTE [select] in
            ``shmloader.device.stage``); e.g. this rank's sequence shard.

    Construction is collective over ``group`` when sharing is on: every rank
    of the group must construct its ``ShmLoader`` at the same point.
    """

    def __init__(
        self,
        make_loader: Callable[[], Iterable[Any]],
        group: dist.ProcessGroup | DeviceMesh | None = None,
        *,
        mesh_dim: str | int | None = None,
        accumulation_steps: int = 1,
        config: Config | None = None,
        device: str | torch.device | DeviceOps | None = None,
        select: Callable[[Any], Any] | None = None,
    ) -> None:
        if not callable(make_loader):
            raise TypeError(f"make_loader must be a zero-argument callable, got {make_loader!r}")
        if (
            not isinstance(accumulation_steps, int)
            or isinstance(accumulation_steps, bool)
            or accumulation_steps < 1
        ):
            raise ConfigError("accumulation_steps", accumulation_steps, "an integer >= 1")
        group = resolve_group(group, mesh_dim)
        self.config = resolve_config(config, group)
        # Device delivery: validated before anything is built (shmloader.device.which).
        target = (
            device if isinstance(device, DeviceOps) else resolve_device(device, self.config.device)
        )
        self._stage: DeviceStage | None = None
        if target is not None or select is not None:
            self._stage = DeviceStage(target, select=select, prefetch=self.config.prefetch)
        self.accumulation_steps = accumulation_steps
        # NOTE [one owner] (_roles.base): close() waits at most a role's longest wait (the
        # timeout) and then some for the producer to free what it owns
        self._owner = Owner(float(self.config.timeout or 0) + 2 * CLOSE_WAIT_S)
        self._cursor = Cursor()
        self._boundary = Boundary(
            accumulation_steps, prefetching=self._stage is not None and self._stage.on_device
        )
        self._stats = RankStats()
        #: the pass in use, which a later iter() or set_epoch ends on a sharing rank
        #: (NOTE [an iterator keeps its loader] in _roles.iteration)
        self._pass: weakref.ref[Iteration] | None = None
        shared = Shared(
            self.config, self._cursor, self._boundary, self._stats, self._stage, self._owner
        )
        ranks = group_ranks(group)
        if isinstance(device, DeviceOps):
            kind = "cuda" if self._stage is not None and self._stage.on_device else "cpu"
        else:  # as asked: 'auto' may resolve differently on ranks with and without a GPU
            kind = str(self.config.device if device is None else device).partition(":")[0]
        agreed = arrival.agreed_settings(self.config, accumulation_steps, kind)
        if not (self.config.enabled and ranks is not None and len(ranks) > 1):
            self._built = build_local(make_loader, ranks, shared, agreed)
        else:
            try:
                self._built = build(make_loader, group, ranks, shared, agreed)  # type: ignore[arg-type]
            except BaseException:
                if self._stage is not None:
                    close_quietly([self._stage.close])
                raise
        self._role: Role = self._built.role
        #: the producer, which runs the role's loop (NOTE [one path] in _roles.producer); None
        #: with sharing off
        self._producer = self._built.producer
        if self._producer is not None:
            self._boundary.prefetching = True  # the step boundary at the user's request
            self._stats.ahead = True
        self._closing = Closing(self._owner, self._producer, self._stage, self._role, self._built)
        if self._producer is not None:
            self._producer.closing = self._closing.free
        if self._role.name != "local":
            # a loader dropped unclosed, or at exit; only in this process, never in a
            # forked child at its exit (NOTE [creator-only cleanup] in segment)
            weakref.finalize(self, self._closing.dropped)
        up = dist.is_available() and dist.is_initialized()
        me, world = (dist.get_rank(), dist.get_world_size()) if up else (0, 1)
        reporter = self._built.reporter
        #: Said at the first iter() (NOTE [the sharing line] in banner), then None.
        self._line = banner.line(
            self.config,
            ranks,
            self._built.topo,
            reporter.daemon if reporter is not None else None,
            me,
            world,
        )
        self._checkpoints = Checkpoints(self._cursor, self._boundary, self._built.source, ranks)

    @property
    def is_leader(self) -> bool:
        """True on the rank that runs the loader (every rank when sharing is off)."""
        return self.role in ("local", "leader")

    @property
    def role(self) -> str:
        """``local``, ``leader``, ``node leader`` or ``follower``."""
        return self._role.name

    @property
    def topology(self) -> GroupTopology | None:
        """The SP group's ranks by node, as this rank sees them (``nodes[0][0]`` is the
        leader); None when this rank runs its own loader (sharing off, or a group of 1)."""
        return self._built.topo

    @property
    def _loader(self) -> Iterable[Any] | None:
        """The user's loader on the leader and local ranks (None elsewhere and after close)."""
        source = self._built.source
        return source.loader if source is not None else None

    def __len__(self) -> int:
        """The leader's loader's ``len()`` for the current epoch, the same on every rank
        (NOTE [length per epoch] in ``length``)."""
        self._check_open()
        if self.is_leader:
            return len(self._loader)  # type: ignore[arg-type]
        assert self._built.length is not None
        length = self._built.length.value()
        if length is None:
            raise TypeError(
                "the leader's loader has no len() (an IterableDataset without __len__?)"
            )
        return length

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` and forward it to the leader's loader and sampler.

        Only the leader holds a loader: a sampler object a follower built is
        never iterated and never sees ``set_epoch``; checkpoint
        ``ShmLoader.state_dict()`` (which takes the sampler's state on the
        leader), not such a sampler's own state.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError("epoch", epoch, "an integer >= 0")
        self._check_open()
        self._end_pass(f"set_epoch({epoch})")
        self._settle()
        changed = self._cursor.set_epoch(epoch)
        self._role.set_epoch(epoch)
        if changed and self._built.length is not None:
            self._built.length.changed()  # NOTE [length per epoch] (length)

    def __iter__(self) -> Iterator[Any]:
        """One pass over the epoch set by ``set_epoch``: the same batches, in the same order,
        on every rank of the group; after ``load_state_dict``, from the saved position."""
        self._check_open()
        self._end_pass("a later iter() of the same ShmLoader")
        self._settle()
        self._role.ready()
        if self._line is not None:
            banner.show(self._line)
            self._line = None
        cursor, skip = self._cursor.begin()
        self._boundary.begin(cursor)  # NOTE [RNG at the step boundary] (_rng)
        it = self._cursor.it
        inner = self._role.iterate(it, cursor, skip)
        stage, producer = self._stage, self._producer
        on_device = stage is not None and stage.on_device
        reporter = self._built.reporter
        settled = reporter.now if reporter is not None else None
        checkpoints, hand = self._checkpoints, self._cursor.hand
        if producer is not None and on_device and not producer.in_step:
            # NOTE [copies issued by the loop ahead] (device.stage)
            assert stage is not None
            inner = stage.issue(inner, self._owner, producer.idle, start=cursor)
            inner = producer.run(
                inner, checkpoints.snapshot, hand, checkpoints.user_request, self._user_waited
            )
            inner = stage.deliver(inner, settled)
        else:
            if producer is not None:  # NOTE [one path] (_roles.producer)
                # a device stage pulls ahead on this thread: it hands the positions over
                pulls = on_device
                inner = producer.run(
                    inner,
                    checkpoints.snapshot,
                    _ignore if pulls else hand,
                    None if pulls else checkpoints.user_request,
                    self._user_waited,
                    self._role.supply(it, cursor, skip),  # in step, the leader's loader
                )
            if stage is not None and on_device:  # prefetch on this thread
                inner = stage.wrap(
                    inner,
                    checkpoints.snapshot,
                    checkpoints.user_request,
                    settled,
                    start=cursor,
                    hand=hand,
                )
            elif stage is not None:
                inner = stage.wrap(inner, start=cursor)
        # the iterator keeps this loader alive (NOTE [an iterator keeps its loader])
        current = Iteration(inner, self)
        if self.role != "local":
            self._pass = weakref.ref(current)
        return current

    def _end_pass(self, call: str) -> None:
        """A sharing rank's pass in use ends here (NOTE [an iterator keeps its loader])."""
        current = self._pass() if self._pass is not None else None
        self._pass = None
        if current is not None:
            current.end_by(call)

    def _user_waited(self, t0: float) -> None:
        """The user waited for a batch a loop ran ahead for (NOTE [running ahead])."""
        self._stats.note_wait(t0, handed=True)
        if self._built.reporter is not None:
            self._built.reporter.first_wait()

    def _settle(self) -> None:
        """No loop runs ahead now (NOTE [running ahead]); the user's position is the last
        one handed over (NOTE [the position handed over] in ``_roles.cursor``)."""
        if self._producer is not None:
            self._producer.settle()

    def stats(self) -> dict[str, Any]:
        """Counters of this rank: batches, bytes, times (ms), ring size."""
        out: dict[str, Any] = {"role": self.role, "epoch": self._cursor.epoch}
        out.update(self._stats.counts)
        out.update(self._role.stats())
        ready = self._producer.queued if self._producer is not None else None
        if ready is not None:  # batches ready for the user (NOTE [running ahead])
            out["ahead_ready"] = ready
        if self._stage is not None:
            out.update(self._stage.stats())
        return out

    def close(self) -> None:
        """Release every resource. Idempotent; also runs at interpreter exit.

        From any thread: an iteration under way on another thread stops first
        (it raises ``ShmLoaderError``), then the peers are told and everything
        is freed, by the thread that owns it (NOTE [one owner] in
        ``_roles.base``). Every step of closing is ``Closing``'s (``_setup.closing``), in its order,
        run once.
        """
        self._closing()

    def _check_open(self) -> None:
        self._owner()

    def __enter__(self) -> ShmLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's position at an optimizer-step boundary (NOTE [checkpoints], ``checkpoint``).

        Keys: ``format``; ``epoch``; ``batches`` (the cursor: batches of this
        epoch the SP group consumed, counted once per group, rounded down to a
        whole optimizer step of ``accumulation_steps`` unless the epoch ended);
        ``accumulation_steps``; ``topology`` (world, SP size, DP size, the
        saving rank and its group); ``rng``: this rank's default generators at
        that boundary (NOTE [RNG at the step boundary] in ``_rng.py``); on the
        leader (every rank with sharing off): ``sampler``, the state of a
        :class:`~shmloader.ShardedSampler` at that boundary (what resuming
        under another DP size needs), and ``loader``, the state of a loader
        with ``state_dict``/``load_state_dict`` (torchdata's
        ``StatefulDataLoader``) at that boundary. Before the first iteration
        after ``load_state_dict`` it reports what was loaded.

        Not collective: call it on every rank and save each rank's own.
        """
        return self._checkpoints.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from this rank's ``state_dict()``. Call before iterating; validates first.

        The next iteration of the saved epoch (``set_epoch`` to it, or no
        ``set_epoch`` at all) continues after the saved cursor: the leader
        restores its loader's own state when the checkpoint has one, or else
        fast-forwards its loader by the cursor, and every rank's default
        generators are set to the saved ``rng`` when that iteration starts.

        Under another world size with the same SP size (DP resized), load the
        state an SP group leader saved (rank 0's) on every rank: the leader's
        ``ShardedSampler`` re-splits the rest of the epoch over the new DP
        replicas and the loader starts fresh on it (RNG is not restored: no
        rank's stream continues). Raises :class:`TopologyMismatchError` for
        another rank's state, another SP size or a resize the state cannot
        serve (each naming the fix), :class:`ConfigError` for a malformed
        state and :class:`LoaderStateError` once iteration has started.
        """
        if self._cursor.it > 0:
            raise LoaderStateError(
                "load_state_dict() must be called before the first iteration; "
                "construct a new ShmLoader to resume"
            )
        self._checkpoints.load(state, self.set_epoch)
        if self._built.length is not None:
            self._built.length.changed()  # NOTE [length per epoch] (length)


def _ignore(_: object) -> None:
    """A position the device stage hands over itself (NOTE [the position handed over])."""

"""Set-up: from a process group to this rank's role object (collective over the SP group).

It owns ``build`` (sharing on: marks, the gloo exchange group, discovery,
agreement on the leader's loader and length, the daemon, ring and sockets, then
one ``Leader``, ``NodeLeader`` or ``Follower``) and ``build_local`` (sharing off: one
mark, the user's loader, ``Local``), the checks on what the leader's loader may
be (NOTE [samplers over SP groups]) and the timeouts (NOTE [set-up is bounded]);
whatever it made is closed if a later step raises. It is the one module that
imports every role; the steps are in docs/internals/flow.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .. import _rng as rng
from .._node import segment
from .._node.ring import RingReader, RingWriter, new_token
from .._proto.bodies import error_body, json_body, leader_error
from .._roles.base import Context, Owner, Role, log
from .._roles.cursor import Boundary, Cursor
from .._roles.follower import Follower
from .._roles.leader import Leader, worker_pool
from .._roles.local import Local, Source
from .._roles.node_leader import NodeLeader
from .._roles.node_writer import NodeWriter
from .._roles.producer import Producer
from .._roles.receiver import Receiver
from .._roles.stats import RankStats, Reporter, connect_daemon, describe, device_fields
from .._topology import GroupTopology, broadcast_bytes, discover, node_claim
from .._transport.channel import Hub, Spoke
from .._transport.xnode import CrossNode, loader_tag
from .._workers.collate import check_installable
from ..config import DEFAULT_TIMEOUT_S, Config
from ..device.stage import DeviceStage
from ..device.which import warn_pin_memory
from ..errors import ConfigError, PeerLostError
from . import arrival
from .length import GroupLength

#: gloo exchange groups made for non-gloo SP groups, one per rank tuple for the
#: life of the process: every ShmLoader over the same ranks shares it, so ranks
#: never create groups in different numbers (torch names groups by count).
_EXCHANGE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclasses.dataclass
class Built:
    """What set-up made for one ``ShmLoader``."""

    role: Role
    source: Source | None = None  # the leader's and local ranks' loader
    topo: GroupTopology | None = None
    length: GroupLength | None = None
    reporter: Reporter | None = None
    #: Frees the role's resources, then the daemon's registration and the topology's.
    closers: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    #: the loader's producer, which runs the role's loop (NOTE [one path] in
    #: ``_roles.producer``); None with sharing off
    producer: Producer | None = None


@dataclasses.dataclass(frozen=True)
class Shared:
    """What the façade makes before set-up and every role shares."""

    config: Config
    cursor: Cursor
    boundary: Boundary
    stats: RankStats
    stage: DeviceStage | None
    check_open: Owner


def build_local(
    make_loader: Callable[[], Iterable[Any]], ranks: list[int] | None, shared: Shared, agreed: dict
) -> Built:
    """Sharing off: this rank loads its own batches."""
    unwarned = None
    if ranks is not None and len(ranks) > 1:
        # NOTE [set-up marks] (arrival): one set, one check, no wait
        unwarned = arrival.arrive(
            ranks,
            dist.get_rank(),
            sharing=False,
            node=node_claim(shared.config.node),
            agreed=agreed,
            timeout=shared.config.timeout or DEFAULT_TIMEOUT_S,
        )
    log_role(ranks, "local", sharing=False)
    ctx = _context(shared, lambda: None, None)
    source = Source(make_loader(), shared.cursor, shared.boundary)
    return Built(Local(ctx, source, unwarned), source)


def build(
    make_loader: Callable[[], Iterable[Any]],
    group: dist.ProcessGroup,
    ranks: list[int],
    shared: Shared,
    agreed: dict,
) -> Built:
    """Sharing on: set up with the group and make this rank's role (collective)."""
    config = shared.config
    segment.use_dir(config.shm_dir)  # NOTE [huge-page ring] (ringdir)
    arrival.arrive(  # NOTE [set-up is bounded], NOTE [set-up marks] (arrival)
        ranks,
        dist.get_rank(),
        sharing=True,
        node=node_claim(config.node),
        agreed=agreed,
        timeout=config.timeout or DEFAULT_TIMEOUT_S,
    )
    pg = exchange_group(group, config.timeout)
    made = _Made()  # closed if a later step raises
    try:
        try:
            topo = discover(
                pg, new_token(), node_override=config.node, runtime_parent=config.runtime_dir
            )
            made.topo = topo.close
            loader, length, error, leader_ahead = _agree_on_loader(
                make_loader, topo, pg, config, ranks
            )
        except (RuntimeError, dist.DistError) as exc:  # a peer died during set-up
            detail = f"the set-up exchange over the group failed: {exc}"
            raise PeerLostError(None, "peer", detail) from exc
        if error is not None:
            raise error
        built = _make_role(shared, topo, pg, loader, length, leader_ahead, made)
    except BaseException:
        close_quietly(made.in_order())
        raise
    log_role(ranks, built.role.name, sharing=True, leader=topo.leader)
    return built


def _make_role(
    shared: Shared,
    topo: GroupTopology,
    pg: dist.ProcessGroup,
    loader: Iterable[Any] | None,
    length: int | None,
    leader_ahead: bool,
    made: _Made,
) -> Built:
    """The one factory of roles: what this rank's place in the topology needs."""
    config = shared.config
    daemon = connect_daemon(config)
    if daemon is not None:
        made.daemon = daemon.close
    reporter = Reporter(
        topo,
        topo.role(),
        shared.stats,
        daemon,
        job=config.job,
        device=functools.partial(device_fields, shared.stage),
    )
    on_device = shared.stage is not None and shared.stage.on_device
    producer = _producer(config, topo, leader_ahead, shared.check_open, on_device)
    running = not producer.in_step  # the loop runs ahead of its user (NOTE [running ahead])
    ctx = _context(shared, reporter.report, producer)
    xnode = None
    if len(topo.nodes) > 1 and topo.me in topo.node_leaders:
        tag = loader_tag(topo.fact(topo.leader).token)  # NOTE [running ahead] (producer)
        xnode = CrossNode(
            pg,
            topo.leader,
            topo.node_leaders,
            tag,
            ctx.check_open,
            timeout=config.timeout or DEFAULT_TIMEOUT_S,
            patient=ctx.patient,
        )
    source = None
    role: Role
    if topo.is_writer:
        description = describe(topo, config.job)
        ring = RingWriter(
            topo.ring_token,
            frozenset(topo.readers),
            description,
            self_rank=topo.me,  # the writer's own batch is a view of the slot too
            daemon=daemon,
        )
        made.ring = ring.close
        if daemon is not None:
            daemon.register(description)
            made.unregister = functools.partial(daemon.unregister, topo.ring_token)
        pool = None
        if topo.is_leader:
            peers = {
                f.rank: (f.pid, f.start, f.pidns) for f in topo.facts if f.rank in topo.readers
            }
            pool = worker_pool(loader, ring, config, daemon, peers)  # type: ignore[arg-type]
            if pool is not None:
                made.pool = pool.close
        hub = Hub(topo.socket_path)
        made.hub = hub.close
        writer = NodeWriter(ctx, topo, ring, hub, xnode, pool)
        writer.prefault = running  # the producer faults the user's pages in
        writer.later = True  # ahead or in step: NOTE [unmapped off the step] (unmap)
        reporter.writer = writer
        if topo.is_leader:
            source = Source(loader, shared.cursor, shared.boundary)  # type: ignore[arg-type]
            role = Leader(ctx, source, writer, pool)
            if producer.in_step:  # its loader stays on the user's thread (NOTE [draws ahead])
                role.feed = producer.feed()
                # pool slots back to the workers while it waits for what they write
                producer.idle = writer.free_released
            if shared.stage is not None and shared.stage.on_device:
                warn_pin_memory(loader, pool)
        else:
            assert xnode is not None
            role = NodeLeader(ctx, Receiver(ctx, topo, leader_ahead), writer, xnode)
    else:
        # a node leader's loop runs ahead as the config says, the group leader's as it said
        writer_ahead = leader_ahead if topo.writer == topo.leader else config.ahead
        ring_reader = RingReader(topo.ring_token, topo.me)
        ring_reader.prefault = running  # the producer faults the user's pages in
        ring_reader.later = True  # ahead or in step: NOTE [unmapped off the step] (unmap)
        made.reader = ring_reader.close
        spoke = Spoke(topo.socket_path, topo.me, wake=producer.doorbell)
        made.spoke = spoke.close
        follower = Follower(ctx, topo, Receiver(ctx, topo, writer_ahead), ring_reader, spoke)
        follower.out.doorbell = producer.doorbell  # a dropped batch's RELEASE leaves at once
        producer.idle = follower.out.flush  # NOTE [prompt release] (follower)
        role = follower
    closers = role.closers()
    if xnode is not None:
        closers.append(xnode.close)  # its link ends after the goodbyes handed to it
    if daemon is not None:
        if topo.is_writer:
            closers.append(functools.partial(daemon.unregister, topo.ring_token))
        closers.append(daemon.close)
    closers.append(topo.close)
    lengths = GroupLength(
        topo,
        length,
        lambda: source.loader if source is not None else None,
        config.timeout or DEFAULT_TIMEOUT_S,
        lambda: shared.cursor.epoch,
    )
    return Built(role, source, topo, lengths, reporter, closers, producer)


def _producer(
    config: Config, topo: GroupTopology, leader_ahead: bool, owner: Owner, on_device: bool = False
) -> Producer:
    """This rank's producer (NOTE [one path] in ``_roles.producer``): ahead of its user, or in
    step (depth 0: ``SHMLOADER_AHEAD=0``, or a leader that said at set-up that its loop
    cannot run ahead, ``leads_ahead``; NOTE [running ahead]).

    Ahead, the queue holds ``slots - 1`` batches: with the one the
    thread is about to queue, the loop is ``slots`` batches ahead of the user,
    the ring's depth, which NOTE [ring growth] already counts
    (``_roles.node_writer``). On a device (``on_device``) the loop also issues
    each batch's copy (NOTE [copies issued by the loop ahead] in
    ``device.stage``) and what it queues are batches on the device, whose
    slots are free once their copy completed; the stage keeps it
    ``Config.prefetch`` batches ahead, so the queue only has to hold that many.
    """
    timeout = config.timeout or DEFAULT_TIMEOUT_S
    if not config.ahead or (topo.is_leader and not leader_ahead):
        return Producer(owner, 0, timeout=timeout)
    depth = config.prefetch if on_device else config.slots - 1
    return Producer(owner, max(1, depth), timeout=timeout)


def leads_ahead(config: Config, loader: object) -> bool:
    """Whether the leader's loop runs ahead: only for a DataLoader with workers whose samplers
    are torch's, torchdata's or shmloader's (NOTE [draws ahead] in ``_roles.leader``)."""
    if not (
        config.ahead and isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0
    ):
        return False
    batch_sampler = getattr(loader, "batch_sampler", None)
    order = [loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    known = ("torch", "torchdata", "shmloader")
    return all(s is None or type(s).__module__.split(".")[0] in known for s in order)


@dataclasses.dataclass
class _Made:
    """What set-up made so far, to close in the same order as a ``ShmLoader``'s close."""

    spoke: Callable[[], None] | None = None
    reader: Callable[[], None] | None = None
    hub: Callable[[], None] | None = None
    ring: Callable[[], None] | None = None
    pool: Callable[[], None] | None = None
    unregister: Callable[[], None] | None = None
    daemon: Callable[[], None] | None = None
    topo: Callable[[], None] | None = None

    def in_order(self) -> list[Callable[[], None]]:
        closers = (getattr(self, f.name) for f in dataclasses.fields(self))
        return [c for c in closers if c is not None]


def _context(shared: Shared, report: Callable[[], None], producer: Producer | None) -> Context:
    fields = (shared.config, shared.cursor, shared.boundary, shared.stats, report)
    if producer is None:
        return Context(*fields, shared.check_open, rng.mirror_draws)
    return Context(*fields, shared.check_open, producer.defer, producer.patient)


def _agree_on_loader(
    make_loader: Callable[[], Iterable[Any]],
    topo: GroupTopology,
    pg: dist.ProcessGroup,
    config: Config,
    ranks: list[int] | None = None,
) -> tuple[Iterable[Any] | None, int | None, BaseException | None, bool]:
    """The leader builds its loader and tells everyone its length, or why it failed.

    Returns (the leader's loader or None, its length or None, the exception
    this rank must raise: the original on the leader, a ``LeaderError``
    carrying it on the others; never a hang; whether the leader's loop runs
    ahead). The exception is returned, not
    raised, so that the caller does not take it for a peer lost during the
    exchange. The default generators' states around the factory travel with
    the length and every other rank follows them (NOTE [factory draws] in
    ``_rng``); a data-parallel sampler keyed on other replicas than the SP
    groups is refused (NOTE [samplers over SP groups]).
    """
    error: BaseException | None = None
    loader = None
    report: dict[str, Any] = {"length": -1}
    if topo.is_leader:
        try:
            before = rng.snapshot_all()
            loader = make_loader()
            draws = rng.factory_draws(before)
            check_installable(loader)  # one DataLoader, one open ShmLoader (_workers/collate.py)
            if ranks is not None:
                check_samplers(loader, ranks, dist.get_world_size())
            with contextlib.suppress(TypeError):
                report["length"] = len(loader)  # type: ignore[arg-type]
            report["draws"] = draws
            report["ahead"] = leads_ahead(config, loader)
        except BaseException as exc:
            error = exc
            report = {"error": error_body(0, exc)}
    raw = broadcast_bytes(json.dumps(report).encode() if topo.is_leader else None, topo.leader, pg)
    agreed = json_body(raw)
    if "error" in agreed:
        body = agreed["error"] if isinstance(agreed["error"], dict) else {}
        return None, None, error or leader_error(body, topo.leader), False
    if not topo.is_leader:
        for warning in rng.follow_factory(agreed.get("draws", {})):  # NOTE [factory draws] (_rng)
            log.warning("shmloader: %s", warning)
    length = agreed.get("length")
    ahead = agreed.get("ahead") is True  # NOTE [running ahead] (producer): for the readers
    return loader, length if isinstance(length, int) and length >= 0 else None, None, ahead


# NOTE [samplers over SP groups]
#     With sharing on only each SP group's leader runs ``make_loader``, so a
#     data-parallel sampler inside it must be keyed on the groups: as many
#     replicas as SP groups (or fewer, where model-parallel ranks share a
#     replica), and the group's own index among them. A
#     ``DistributedSampler(ds)`` keyed on the global rank and world size runs
#     only as the leaders' replicas (0 and 2 of 4 at SP2): half the dataset
#     is never seen, silently. So ``check_samplers`` refuses, with a
#     ``ConfigError`` that every rank gets, a ``DistributedSampler`` (torch's,
#     torchdata's ``StatefulDistributedSampler``, any subclass) whose
#     ``num_replicas`` exceeds the number of SP groups, or which has exactly as
#     many replicas and another ``rank`` than the group's data-parallel index
#     (``dp_topology_from_group``'s: the groups ordered by lowest rank, known
#     here for groups of contiguous or evenly strided ranks). Fewer replicas
#     than groups is a layout with model-parallel dimensions and is accepted.
#     Sharing off, every rank runs its own sampler and nothing is lost.


def check_samplers(loader: object, ranks: list[int], world: int) -> None:
    """NOTE [samplers over SP groups]: refuse a DP sampler keyed on other replicas."""
    size = len(ranks)
    if size < 2 or world % size:
        return
    groups = world // size
    index = _dp_index(sorted(ranks), groups)
    for sampler in _samplers(loader):
        replicas, rank = sampler.num_replicas, sampler.rank
        kind = type(sampler).__name__
        if replicas > groups:
            raise ConfigError(
                f"{kind}.num_replicas",
                replicas,
                f"the number of data-parallel replicas, {groups} SP groups of {size} ranks in a "
                f"world of {world} (only each group's leader runs make_loader, so replicas "
                f"{groups}..{replicas - 1} would never be loaded): build it with "
                "num_replicas, rank = shmloader.dp_topology(mesh) (or "
                "dp_topology_from_group(sp_group)), not the global world size and rank",
            )
        if replicas == groups and index is not None and rank != index:
            raise ConfigError(
                f"{kind}.rank",
                rank,
                f"this SP group's data-parallel index, {index} of {groups} (group {ranks}): "
                "build it with num_replicas, rank = shmloader.dp_topology(mesh) (or "
                "dp_topology_from_group(sp_group)), not the global rank",
            )


def _dp_index(ranks: list[int], groups: int) -> int | None:
    """The group's index among all SP groups by lowest rank, where its ranks tell it."""
    lead = ranks[0]
    if ranks == list(range(lead, lead + len(ranks))) and lead % len(ranks) == 0:
        return lead // len(ranks)  # contiguous blocks {0,1}, {2,3}
    if ranks == [lead + k * groups for k in range(len(ranks))] and lead < groups:
        return lead  # strided {0,2}, {1,3}
    return None


def _samplers(loader: object) -> list[Any]:
    """The ``DistributedSampler`` objects a loader draws its indices from."""
    from torch.utils.data import DistributedSampler

    found: dict[int, Any] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for candidate in (
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        if isinstance(candidate, DistributedSampler):
            found[id(candidate)] = candidate
    return list(found.values())


def exchange_group(group: dist.ProcessGroup, timeout: float | None) -> dist.ProcessGroup:
    """A gloo group with the ranks of ``group`` for set-up and the cross-node path."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _EXCHANGE_GROUPS:
        _EXCHANGE_GROUPS[ranks] = dist.new_group(
            list(ranks),
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout or DEFAULT_TIMEOUT_S),
            use_local_synchronization=True,
        )
    return _EXCHANGE_GROUPS[ranks]


def close_quietly(closers: Iterable[Callable[[], None]]) -> None:
    for close in closers:
        with contextlib.suppress(Exception):
            close()


# NOTE [set-up is bounded]
#     ``timeout=None`` (``SHMLOADER_TIMEOUT`` unset) follows the process
#     group's own timeout, else torch's default (30 min): a leader busy
#     alone (evaluation, a checkpoint) is tolerated as long as the job's
#     collectives would tolerate it. Set-up starts with every rank's mark in
#     the default store, waited for within that timeout (NOTE [set-up
#     marks] in ``arrival``): a rank that never constructs its ShmLoader is
#     named in a warning every 30 s and in a ``PeerLostError`` at the
#     timeout, one that marked and died within about a second, one with
#     sharing off or other settings in a ``ConfigError`` at once.
def group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """Seconds of ``group``'s own collective timeout, or None when it cannot be read.

    torch keeps it per backend in the backend's options (``ProcessGroupGloo`` /
    ``ProcessGroupNCCL`` ``options._timeout``, a ``timedelta``); the group's
    CPU backend is asked first, then its CUDA one.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            seconds = backend.options._timeout.total_seconds()
        except Exception:  # no backend for that device, or a torch without these internals
            continue
        if seconds > 0:
            return float(seconds)
    return None


def resolve_config(config: Config | None, group: dist.ProcessGroup | None) -> Config:
    """The config a ShmLoader runs with: the environment's by default, timeout resolved
    (NOTE [set-up is bounded])."""
    if config is None:
        config = Config.from_env()
    elif not config.enabled and not getattr(config, "_from_env", False) and _env_enabled():
        log.warning(
            "shmloader: config=%r has enabled=False although SHMLOADER is set: sharing is off "
            "for this ShmLoader. A Config built directly does not read the environment; use "
            "Config.from_env(...) to change some settings and keep the launcher's",
            config,
        )
    if config.timeout is None:
        timeout = group_timeout(group)
        if timeout is None:
            timeout = group_timeout(dist.group.WORLD) if dist.is_initialized() else None
        config = dataclasses.replace(config, timeout=timeout or DEFAULT_TIMEOUT_S)
    return config


def _env_enabled() -> bool:
    try:
        return Config.from_env().enabled
    except ConfigError:
        return False


def group_ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    """The global ranks of ``group``; None without a group or torch.distributed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        ranks = dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        raise ConfigError(
            "group",
            group,
            "a process group of the initialised default group (from "
            "torch.distributed.new_group), not one of another or destroyed world",
        ) from None
    if dist.get_rank() not in ranks:
        raise ConfigError("group", ranks, f"a group that contains this rank ({dist.get_rank()})")
    return ranks


def log_role(
    ranks: list[int] | None, role: str, *, sharing: bool, leader: int | None = None
) -> None:
    """The one INFO line per rank and construction: its role and whether sharing is on."""
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if sharing:
        log.info(
            "shmloader: rank %d is the %s of group %s (leader rank %s); sharing on",
            me,
            role,
            ranks,
            leader,
        )
    elif ranks is not None and len(ranks) > 1:
        log.info(
            "shmloader: rank %d loads its own batches for group %s; sharing off "
            "(SHMLOADER=1 shares one loader per group)",
            me,
            ranks,
        )
    else:
        log.info("shmloader: rank %d loads its own batches (no group to share with)", me)

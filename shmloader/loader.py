"""``ShmLoader``: orchestration only.

Roles (see ``topology``): the *leader* runs the user's loader and publishes
each batch once into its node's ring; a *node leader* receives each batch from
the leader over the cross-node path straight into its own ring and publishes
it on its node; a *follower* maps what its node's writer published. With
sharing off every rank is *local*: it builds and iterates its own loader,
exactly as without shmloader.

This module keeps the public API, set-up, epochs, checkpoints, stats and
close; each role's loop lives in its own module (``local``, ``leader``,
``relay``, ``follower``, with ``writer`` and ``reader`` for what the writers
and the readers share; the map is in ``roles``). ``ShmLoader`` inherits
them all, so every role works on the same ``self``.

One batch, leader to a follower on another node::

    leader                          node leader (node B)          follower (node B)
    ------                          --------------------          -----------------
    batch = next(loader)
    enc = codec.encode(batch)
    slot = ring.acquire(n)
    codec.write_payload(enc, slot)
    xnode.send(meta, slot) =======> xnode.receive_header()
                                    slot' = ring.acquire(n)
                                    xnode.receive_payload(slot')
    hub.publish(BATCH) -> local     hub.publish(BATCH) --ZeroMQ->  spoke receives BATCH
    followers                                                     mmap slot' MAP_PRIVATE
    yield decode(private view)      yield decode(private view)    yield codec.decode(view)
                                                                  ... batch garbage ->
                                    ring.release  <--RELEASE----  weakref.finalize

NOTE [no batch in the frame]
    A generator keeps its locals alive while it is suspended at ``yield``. A
    batch stored in a local would stay referenced one step after the user
    dropped it: its slot would not be released and the ring would grow by one
    slot. The loops therefore yield straight from an expression (``box.pop()``,
    a call) and keep no batch, payload or view in a local across a ``yield``.

NOTE [iteration numbers]
    Every rank counts its own ``iter()`` calls; the writer stamps each message
    with (``it``: its count, ``epoch``: its ``set_epoch``, ``pos``: the
    batch's index in the epoch, resumed cursor included). All ranks of a group
    must iterate in the same pattern (same epochs, same early ``break``s, same
    resume), so equal counts mean the same iteration. A reader asking for
    batch ``p`` of iteration ``it`` at epoch ``e``:

    - BATCH/END of ``it`` stamped ``(e, p)``: the batch, or the normal end;
    - any other ``(epoch, pos)`` in ``it``, or a message of a *later*
      iteration (the writer broke out of ``it`` while this rank did not):
      ``DivergenceError`` naming both positions, never a silent short epoch
      (the later message is kept for this rank's next iteration);
    - STOP (``KeyboardInterrupt``/``SystemExit`` in the leader's loader):
      ``LeaderStoppedError``, not a normal end; ERROR: ``LeaderError``;
    - a message of an *earlier* iteration: this rank broke out of that one
      before the writer did. Its batches are ACKed and released inside the
      receive path (the writer may be waiting for exactly those ACKs), a
      warning names both positions once, and the wait goes on: the current
      iteration is received whole.

    An early ``break`` on every rank at the same point sends nothing extra
    (the leader publishes only what its user takes) and needs no message.
    A node leader applies the same rules to the leader's cross-node stamps.

NOTE [small leaves]
    Tensors and arrays of at most ``Config.small_copy_bytes`` (64 KiB) are
    decoded as owned copies, not views of the slot, on every rank: keeping
    ``batch["labels"]`` for an epoch-level metric then keeps nothing of the
    slot, which is released as soon as the large leaves die. A batch made
    only of small leaves is released right at delivery.

NOTE [sharing off is plain torch]
    With sharing off every rank delivers exactly what its loader yields, as
    without shmloader: a batch that plain torch accepts (a ``pathlib.Path``,
    a tensor that requires grad, any object) is never refused. Each batch
    still runs through the codec's checks (``codec.encode``: metadata only,
    no payload copy) until the first one sharing would refuse, which is
    named in one warning carrying the ``UnsupportedBatchError`` that
    ``SHMLOADER=1`` would raise; later batches are not checked. With sharing
    on such a batch is refused before anything is written. ``len()`` and
    ``next()`` after ``close()`` raise the same ``ShmLoaderError`` in both
    modes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import arrival, codec, rng, wire  # noqa: F401  (codec: tests/faults patch loader.codec)
from .admin import DEVICE_REPORTED
from .channel import Hub, Peer, Spoke
from .config import DEFAULT_TIMEOUT_S, Config
from .daemon_client import DaemonClient
from .device import DeviceOps, DeviceStage, warn_pin_memory
from .device import resolve as resolve_device
from .errors import (
    ConfigError,
    LoaderStateError,
    PeerLostError,
    ShmLoaderError,
    TopologyMismatchError,
)
from .follower import _Follower, _Releaser
from .leader import _Leader
from .local import _stateful
from .mesh import resolve_group
from .pool import WorkerPool
from .relay import _Relay
from .ring import RingReader, RingWriter, new_token
from .roles import _error_body, _json_body, _leader_error, log
from .topology import GroupTopology, broadcast_bytes, discover, node_claim
from .waits import WaitHistogram
from .wire import Kind
from .xnode import CrossNode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


STATE_FORMAT = "shmloader.state/3"
#: Earlier formats ``load_state_dict`` still accepts: 2 has no RNG of the epoch's start
#: (``opened``), 1 no RNG and no saving rank.
OLD_STATE_FORMATS = ("shmloader.state/2", "shmloader.state/1")
#: Seconds between two progress reports to the daemon.
REPORT_EVERY_S = 1.0
#: Most per-rank rows a writer puts in its ring's description (for ``stat``).
DESCRIBED_RANKS = 64

#: gloo exchange groups made for non-gloo SP groups, one per rank tuple for the
#: life of the process: every ShmLoader over the same ranks shares it, so ranks
#: never create groups in different numbers (torch names groups by count).
_EXCHANGE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


class ShmLoader(_Leader, _Relay, _Follower):
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
            (``shmloader.device``).
        select: ``select(batch) -> batch``, applied to the shared CPU view
            before any device copy, on every path (NOTE [select] in
            ``shmloader.device``); e.g. this rank's sequence shard.

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
        self.config = _resolve_config(config, group)
        # Device delivery: validated before anything is built (shmloader.device).
        target = device
        if not isinstance(device, DeviceOps):
            target = resolve_device(device, self.config.device)
        self._stage: DeviceStage | None = None
        if target is not None or select is not None:
            self._stage = DeviceStage(target, select=select, prefetch=self.config.prefetch)
        self.accumulation_steps = accumulation_steps
        self._epoch = 0
        self._it = 0  # NOTE [iteration numbers]
        self._seq = 0  # batches announced by this writer
        self._pos = 0  # writer: position stamped on the next message of this epoch
        self._left: dict[int, tuple[int, int]] = {}  # reader: it -> (epoch, pos) when left
        self._noted = 0  # the last iteration _note_left accounted for
        self._iter_epoch = 0  # the epoch the current iteration started in
        self._ring_warned = 0  # age of a held batch last warned about (NOTE [ring growth])
        self._delivered = 0  # position in the epoch: batches the user received (or skipped)
        self._exhausted = False  # the current iteration ran to its end
        # (epoch, cursor, skip) from load_state_dict; skip is False when the
        # leader's loader restored its own position
        self._resume: tuple[int, int, bool] | None = None
        self._boundary_state: Any = None  # loader state at the last optimizer-step boundary
        # NOTE [RNG at the step boundary] (rng.py): the default generators when
        # the current step's first micro-batch was requested; a loaded capture
        # waiting for the next iteration; the same, to undo the resumed
        # loader's re-open draws; whether _open_source just captured
        self._rng_boundary: dict[str, Any] | None = None
        self._rng_pending: dict[str, Any] | None = None
        self._rng_undo: dict[str, Any] | None = None
        self._just_opened = False
        # NOTE [RNG at the epoch's start] (rng.py): how the current iteration opened the
        # loader ({"epoch", "rng", "seeded"}); what a loaded state says about it
        self._iter_open: dict[str, Any] | None = None
        self._resume_open: dict[str, Any] | None = None
        self._sampler_base = 0  # cursor at which the leader's sampler's current pass began
        self._closed = False
        self._writer_closed = False  # a reader was told its writer closed: fail fast
        self._loader: Iterable[Any] | None = None
        self._length: int | None = None  # the leader's len() at set-up
        # NOTE [length per epoch]: changes of the leader's length this rank has seen, and
        # (change, length) last read from the store
        self._len_changes = 0
        self._len_read: tuple[int, int] | None = None
        self._topo: GroupTopology | None = None
        self._ring: RingWriter | None = None
        self._pool: WorkerPool | None = None  # the leader's DataLoader workers write the ring
        self._hub: Hub | None = None
        self._reader: RingReader | None = None
        self._spoke: Spoke | None = None
        self._xnode: CrossNode | None = None
        self._xstash: tuple | None = None  # node leader: a header of the next iteration
        self._daemon: DaemonClient | None = None
        self._next_report = 0.0
        self._stats: collections.Counter = collections.Counter()
        self._waits = WaitHistogram()  # ms per batch, O(1) each (``waits``)
        self._wait_since: float | None = None  # perf_counter when this rank first waited
        self._warned_rng = False
        self._told_unshareable = False  # NOTE [sharing off is plain torch]
        self._group_ranks = _group_ranks(group)
        sharing = (
            self.config.enabled and self._group_ranks is not None and len(self._group_ranks) > 1
        )
        if isinstance(device, DeviceOps):
            kind = "cuda" if self._stage is not None and self._stage.on_device else "cpu"
        else:  # as asked: 'auto' may resolve differently on ranks with and without a GPU
            kind = str(self.config.device if device is None else device).partition(":")[0]
        self._agreed = arrival.agreed_settings(self.config, accumulation_steps, kind)
        # sharing off: looked at once more when the first iteration starts, in
        # case peers with sharing on marked after this rank (NOTE [set-up marks])
        self._unwarned: arrival.Arrival | None = None
        if not sharing:
            self._role = "local"
            if self._group_ranks is not None and len(self._group_ranks) > 1:
                # NOTE [set-up marks] (arrival): one set, one check, no wait
                self._unwarned = arrival.arrive(
                    self._group_ranks,
                    dist.get_rank(),
                    sharing=False,
                    node=node_claim(self.config.node),
                    agreed=self._agreed,
                    timeout=self.config.timeout or DEFAULT_TIMEOUT_S,
                )
            _log_role(self._group_ranks, "local", sharing=False)
            self._loader = make_loader()
            return
        try:
            self._setup(make_loader, group)  # type: ignore[arg-type]
        except BaseException:
            _close_quietly(self._closers())
            raise
        # Runs only in this process, never in a forked child at its exit
        # (NOTE [creator-only cleanup] in segment).
        self._finalizer = weakref.finalize(self, _close_in, os.getpid(), self._closers())
        if self._role == "leader" and self._stage is not None and self._stage.on_device:
            warn_pin_memory(self._loader, self._pool)

    # ------------------------------------------------------------------ set-up

    def _setup(self, make_loader: Callable[[], Iterable[Any]], group: dist.ProcessGroup) -> None:
        arrival.arrive(  # NOTE [set-up is bounded], NOTE [set-up marks] (arrival)
            self._group_ranks,
            dist.get_rank(),
            sharing=True,
            node=node_claim(self.config.node),
            agreed=self._agreed,
            timeout=self.config.timeout or DEFAULT_TIMEOUT_S,
        )
        pg = self._exchange_group(group)
        try:
            topo = discover(
                pg,
                new_token(),
                node_override=self.config.node,
                runtime_parent=self.config.runtime_dir,
            )
            self._topo = topo
            self._role = topo.role()
            error = self._agree_on_loader(make_loader, pg)
        except (RuntimeError, dist.DistError) as exc:  # a peer died during set-up
            detail = f"the set-up exchange over the group failed: {exc}"
            raise PeerLostError(None, "peer", detail) from exc
        if error is not None:
            raise error

        self._daemon = self._connect_daemon()
        if topo.is_writer:
            description = self._description()
            self._ring = RingWriter(
                topo.ring_token,
                frozenset(topo.readers),
                description,
                self_rank=topo.me,  # the writer's own batch is a view of the slot too
                daemon=self._daemon,
            )
            if self._daemon is not None:
                self._daemon.register(description)
            if topo.is_leader:
                self._pool = self._worker_pool()
            self._hub = Hub(topo.socket_path)
            self._hello: set[int] = set()
            self._acked = dict.fromkeys(topo.readers, 0)
            self._gone: set[int] = set()
            self._self_releases: collections.deque = collections.deque()
        else:
            self._reader = RingReader(topo.ring_token, topo.me)
            self._spoke = Spoke(topo.socket_path, topo.me)
            self._out = _Releaser(self._spoke, topo.me)
            self._stash: wire.Message | None = None
            me = topo.fact(topo.me)
            self._out.send(wire.frames(Kind.HELLO, rank=topo.me, pid=me.pid, start=me.start))
        if len(topo.nodes) > 1 and topo.me in topo.node_leaders:
            self._xnode = CrossNode(pg, topo.leader, topo.node_leaders)
        _log_role(self._group_ranks, self._role, sharing=True, leader=topo.leader)

    def _agree_on_loader(
        self, make_loader: Callable[[], Iterable[Any]], pg: dist.ProcessGroup
    ) -> BaseException | None:
        """The leader builds its loader and tells everyone its length, or why it failed.

        Returns the exception this rank must raise: the original on the leader,
        a ``LeaderError`` carrying it on the others (never a hang).
        """
        topo = self._topo
        assert topo is not None
        error: BaseException | None = None
        report: dict[str, Any] = {"length": -1}
        if topo.is_leader:
            try:
                self._loader = make_loader()
                self._check_loader_free()  # one DataLoader, one open ShmLoader (leader.py)
                with contextlib.suppress(TypeError):
                    report["length"] = len(self._loader)  # type: ignore[arg-type]
            except BaseException as exc:
                error = exc
                report = {"error": _error_body(0, exc)}
        raw = broadcast_bytes(
            json.dumps(report).encode() if topo.is_leader else None, topo.leader, pg
        )
        agreed = _json_body(raw)
        if "error" in agreed:
            body = agreed["error"] if isinstance(agreed["error"], dict) else {}
            return error or _leader_error(body, topo.leader)
        length = agreed.get("length")
        self._length = length if isinstance(length, int) and length >= 0 else None
        return None

    def _exchange_group(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """A gloo group with the ranks of ``group`` for set-up and the cross-node path."""
        if dist.get_backend(group) == "gloo":
            return group
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in _EXCHANGE_GROUPS:
            _EXCHANGE_GROUPS[ranks] = dist.new_group(
                list(ranks),
                backend="gloo",
                timeout=datetime.timedelta(seconds=self.config.timeout),
                use_local_synchronization=True,
            )
        return _EXCHANGE_GROUPS[ranks]

    def _description(self) -> dict:
        topo = self._topo
        assert topo is not None
        return {
            "token": topo.ring_token,
            "group": list(topo.ranks),
            "leader": topo.leader,
            "writer": topo.me,
            "node": list(topo.node),
            # NOTE [pid namespaces] in shmloaderd.registry: a pid means something
            # only in its namespace
            "pids": {
                str(f.rank): [f.pid, f.start, f.pidns] for f in topo.facts if f.rank in topo.node
            },
            "world": dist.get_world_size(),
            "job": self.config.job,
        }

    def _closers(self) -> list[Callable[[], None]]:
        # A reader's socket closes through its _Releaser, so that a batch dying after
        # the close (even in the finalizer's order at exit) releases nothing.
        out = self._out if self._spoke is not None else None
        parts = (self._stage, out, self._reader, self._hub, self._ring, self._pool)
        closers = [c.close for c in parts if c is not None]
        if self._daemon is not None and self._topo is not None:
            if self._topo.is_writer:
                closers.append(functools.partial(self._daemon.unregister, self._topo.ring_token))
            closers.append(self._daemon.close)
        if self._topo is not None:
            closers.append(self._topo.close)
        return closers

    def _connect_daemon(self) -> DaemonClient | None:
        """The node daemon's client, or None: embedded mode (logged once if unreachable)."""
        if not self.config.daemon:
            return None
        client = DaemonClient(self.config.daemon)
        if client.connect():
            return client
        client.close()
        return None

    def _note_wait(self, t0: float) -> None:
        """Count the wait for data that started at ``perf_counter()`` ``t0``."""
        ms = (time.perf_counter() - t0) * 1e3
        if self._wait_since is None:
            self._wait_since = t0
        self._stats["wait_ms_total"] += ms
        self._waits.add(ms)

    def _wait_stats(self) -> dict[str, Any]:
        """This rank's waits for ``stat``: ``wait_ms_p50``/``_p95``/``_p99`` over recent
        batches and ``wait_share``, the share of wall time spent waiting; {} before
        the first batch."""
        if not len(self._waits) or self._wait_since is None:
            return {}
        wall_ms = (time.perf_counter() - self._wait_since) * 1e3
        share = min(1.0, self._stats["wait_ms_total"] / wall_ms) if wall_ms > 0 else None
        out: dict[str, Any] = {f"wait_ms_{k}": v for k, v in self._waits.recent().items()}
        out["wait_share"] = share if share is None else round(share, 4)
        return out

    def _device_fields(self) -> dict[str, Any]:
        """This rank's device-delivery counters for ``shmloader stat``; empty without a device.

        The raw counters (``admin.DEVICE_REPORTED``); ``stat`` derives the
        bandwidth from them (``admin.device_fields``).
        """
        if self._stage is None or not self._stage.on_device:
            return {}
        s = self._stage.stats()
        fields = {key: s[key] for key in DEVICE_REPORTED}
        refused = fields["device_registration_refused"]
        if isinstance(refused, str):  # the daemon takes printable text of <= 128 characters
            fields["device_registration_refused"] = "".join(
                c if c.isprintable() else " " for c in refused
            )[:128]
        fields["device_copy_ms_total"] = round(float(fields["device_copy_ms_total"]), 4)
        return fields

    def _report_now(self) -> None:
        """Report at once (an iteration's copies settled): ``stat`` shows its final counters."""
        if self._closed:
            return
        self._next_report = 0.0
        with contextlib.suppress(Exception):  # a report never fails the iteration
            self._report()

    def _report(self) -> None:
        """At most once a second: this rank's progress for ``shmloader stat``.

        The writer rewrites its ring's description with per-rank rows (found
        by a scan of /dev/shm, no daemon needed); with a daemon every rank
        also reports its own row (the daemon adds followers' wait times).
        """
        client, topo = self._daemon, self._topo
        now = time.monotonic()
        if topo is None or now < self._next_report:
            return
        self._next_report = now + REPORT_EVERY_S
        waits = self._wait_stats()
        # the daemon exports the histogram since the first batch (Prometheus)
        hist = {"wait_hist": self._waits.counts, "wait_ms_sum": round(self._waits.sum_ms, 3)}
        device = self._device_fields()
        if topo.is_writer:
            published = self._stats["bytes_published"] or self._stats["bytes_received"]
            mine = {"role": self._role, "batches": self._seq, **waits,
                    "traffic_bytes": published, **device}  # fmt: skip
            if self._ring is not None:
                ranks = {str(topo.me): mine}
                for rank, acked in self._acked.items():
                    row = {"role": topo.role(rank), "batches": acked, "lag": self._seq - acked}
                    ranks[str(rank)] = row
                if len(ranks) > DESCRIBED_RANKS:  # the control segment holds 16 KiB
                    ranks = {str(topo.me): mine}
                with contextlib.suppress(ValueError, TypeError):  # closed, or not JSON
                    self._ring.describe({**self._description(), "ranks": ranks})
            if client is None:
                return
            client.report(topo.ring_token, topo.me, published=self._seq, role=self._role,
                          nbytes=published, device=device, waits={**waits, **hist})  # fmt: skip
            for rank, acked in self._acked.items():
                client.report(topo.ring_token, rank, consumed=acked, lag=self._seq - acked)
        elif client is not None:
            received = self._stats["received"]
            mean = self._stats["receive_ms_total"] / received if received else None
            client.report(topo.ring_token, topo.me, consumed=received, receive_ms=mean,
                          role=self._role, nbytes=self._stats["bytes_received"], device=device,
                          waits={**waits, **hist})  # fmt: skip

    # ------------------------------------------------------------- public API

    @property
    def is_leader(self) -> bool:
        """True on the rank that runs the loader (every rank when sharing is off)."""
        return self._role in ("local", "leader")

    @property
    def role(self) -> str:
        """``local``, ``leader``, ``node leader`` or ``follower``."""
        return self._role

    @property
    def topology(self) -> GroupTopology | None:
        return self._topo

    def __len__(self) -> int:
        """The leader's loader's ``len()`` for the current epoch, the same on every rank.

        NOTE [length per epoch]
            ``len(loader)`` is what ``len()`` of the leader's loader says now,
            exactly what sharing off gives on every rank: a
            ``BalancedBatchSampler``'s length changes with the epoch, and after
            a resume a fast-forwarded loader's length is still the whole epoch
            (the batches a resume skips count, as ``len(DataLoader)`` counts
            them), while a ``ShardedSampler`` re-split under another DP size
            says what is left. The leader broadcasts its length at set-up; it
            can change only where every rank of the group calls the same
            thing: ``set_epoch`` to another epoch and ``load_state_dict``. Each
            rank counts those changes; after change ``n`` the leader writes its
            length under key ``n`` of the loader in the process group's
            key-value store (no collective), and another rank's ``len()``
            reads key ``n``, waiting at most ``SHMLOADER_TIMEOUT`` for a
            leader that has not made that change yet.
        """
        self._check_open()
        if self._role in ("local", "leader"):
            return len(self._loader)  # type: ignore[arg-type]
        length = self._length if self._len_changes == 0 else self._published_length()
        if length is None:
            raise TypeError(
                "the leader's loader has no len() (an IterableDataset without __len__?)"
            )
        return length

    def _length_changed(self) -> None:
        """Every rank: the leader's length may have changed (NOTE [length per epoch])."""
        if self._topo is None:
            return
        self._len_changes += 1
        if self._role != "leader":
            return
        try:
            length = len(self._loader)  # type: ignore[arg-type]
        except TypeError:
            length = -1
        store = _default_store()
        if store is not None:  # unreachable: the other ranks' len() names the leader
            with contextlib.suppress(RuntimeError, dist.DistError):
                store.set(self._length_key(self._len_changes), str(length))

    def _length_key(self, change: int) -> str:
        assert self._topo is not None
        return f"shmloader/len/{self._topo.fact(self._topo.leader).token}/{change}"

    def _published_length(self) -> int | None:
        """The length the leader wrote at this rank's latest change (waits for it)."""
        change = self._len_changes
        if self._len_read is not None and self._len_read[0] == change:
            return self._len_read[1] if self._len_read[1] >= 0 else None
        store = _default_store()
        if store is None:  # no key-value store: the set-up length
            return self._length
        key = self._length_key(change)
        timeout = self.config.timeout or DEFAULT_TIMEOUT_S
        try:
            store.wait([key], datetime.timedelta(seconds=timeout))
            length = int(store.get(key))
        except (RuntimeError, dist.DistError, ValueError) as exc:
            leader = self._topo.leader if self._topo is not None else None
            raise PeerLostError(
                leader,
                "leader",
                f"it did not publish its loader's length for epoch {self._epoch} within "
                f"{timeout:.0f} s ({exc}); len() waits until the leader has called the same "
                "set_epoch()/load_state_dict() as this rank",
            ) from None
        self._len_read = (change, length)
        return length if length >= 0 else None

    def _note_left(self) -> None:
        """Remember where this rank left an unfinished iteration (NOTE [iteration numbers]).

        Called before anything resets the position: a new ``iter()`` or a
        ``set_epoch`` to another epoch, whichever comes first.
        """
        if self._noted == self._it:
            return
        self._noted = self._it
        if self._exhausted or self._it == 0:
            return
        self._left[self._it] = (self._iter_epoch, self._delivered)
        for old in [k for k in self._left if k < self._it - 4]:
            del self._left[old]

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` and forward it to the leader's loader and sampler.

        Only the leader holds a loader: a sampler object a follower built is
        never iterated and never sees ``set_epoch``; checkpoint
        ``ShmLoader.state_dict()`` (which takes the sampler's state on the
        leader), not such a sampler's own state.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError("epoch", epoch, "an integer >= 0")
        changed = epoch != self._epoch
        if changed:  # a new epoch starts at its beginning
            self._note_left()
            self._delivered, self._exhausted, self._sampler_base = 0, False, 0
            if self._stage is not None:
                self._stage.position = None  # the user's position, too
        self._epoch = epoch
        if self._xnode is not None:
            self._xnode.position = (epoch, self._pos)
        if self._loader is not None:
            _forward_set_epoch(self._loader, epoch)
        if changed:
            self._length_changed()

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise ShmLoaderError("this ShmLoader is closed; make a new one")
        if self._writer_closed:
            raise PeerLostError(
                self._topo.writer if self._topo else None,
                "writer",
                "it closed its ShmLoader: no more batches will come",
            )
        self._note_left()
        self._it += 1
        self._iter_epoch = self._epoch
        cursor, skip = self._take_resume()
        self._delivered = cursor
        self._pos = cursor
        if self._xnode is not None:  # the leader's cross-node stamps
            self._xnode.position = (self._epoch, self._pos)
        self._exhausted = False
        self._sampler_base = 0 if skip else cursor
        restore, self._rng_pending = self._rng_pending, None
        if restore is not None:  # NOTE [RNG at the step boundary]
            rng.restore(restore)
        self._rng_undo = restore if restore is not None and cursor > 0 else None
        if self._role == "local":
            if self._unwarned is not None:  # NOTE [set-up marks] (arrival)
                self._unwarned, unwarned = None, self._unwarned
                if not unwarned.warned:
                    unwarned.check_peers_on()
            inner = self._local_iteration(cursor if skip else 0)
        elif self._role == "leader":
            inner = self._leader_iteration(self._it, cursor if skip else 0)
        elif self._role == "node leader":
            inner = self._relay_iteration(self._it)
        else:
            inner = self._follower_iteration(self._it)
        if self._stage is None:
            return inner
        self._stage.position = None
        if not self._stage.on_device:
            return self._stage.wrap(inner)
        return self._stage.wrap(inner, self._position, self._user_request, self._report_now)

    def stats(self) -> dict[str, Any]:
        """Counters of this rank: batches, bytes, times (ms), ring size."""
        out: dict[str, Any] = {"role": self._role, "epoch": self._epoch, **self._stats}
        if self._ring is not None:
            out["ring_slots"] = len(self._ring.slots)
            out["ring_bytes"] = self._ring.total_bytes
        if self._xnode is not None:
            out["cross_node_bytes_sent"] = self._xnode.bytes_sent
        if self._stage is not None:
            out.update(self._stage.stats())
        return out

    def close(self) -> None:
        """Release every resource. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        if self._stage is not None:
            self._stage.close()  # copies in flight finish; unregister before unmap
        if self._spoke is not None:
            self._reader.own_views()  # NOTE [held past close] (ring): before BYE drops the holds
            with contextlib.suppress(Exception):
                self._out.send(wire.frames(Kind.BYE, rank=self._me))
            self._out.closed = True
        if self._hub is not None:
            with contextlib.suppress(Exception):
                self._await_attach()
                stop = self._stamped(Kind.STOP, self._it, reason="the writer closed", closed=1)
                self._tell_readers(stop, best_effort=True)
        if self._role != "local":
            self._finalizer()
        self._loader = None

    def _check_open(self) -> None:
        """The same error in every mode and role once ``close()`` ran."""
        if self._closed:
            raise ShmLoaderError("this ShmLoader is closed; make a new one")

    def __enter__(self) -> ShmLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's position at an optimizer-step boundary (see NOTE [checkpoints]).

        Keys: ``format``; ``epoch``; ``batches`` (the cursor: batches of this
        epoch the SP group consumed, counted once per group, rounded down to a
        whole optimizer step of ``accumulation_steps`` unless the epoch ended);
        ``accumulation_steps``; ``topology`` (world, SP size, DP size, the
        saving rank and its group); ``rng``: this rank's default generators at
        that boundary (NOTE [RNG at the step boundary] in ``rng.py``); on the
        leader (every rank with sharing off): ``sampler``, the state of a
        :class:`~shmloader.ShardedSampler` at that boundary (what resuming
        under another DP size needs), and ``loader``, the state of a loader
        with ``state_dict``/``load_state_dict`` (torchdata's
        ``StatefulDataLoader``) at that boundary. Before the first iteration
        after ``load_state_dict`` it reports what was loaded.

        Not collective: call it on every rank and save each rank's own.
        """
        k = self.accumulation_steps
        if self._resume is not None and self._resume[0] == self._epoch:
            cursor = delivered = self._resume[1]  # loaded, not iterated yet
            _, _, boundary, now = self._position()
        else:
            delivered, exhausted, boundary, now = self._user_position()
            cursor = delivered if exhausted else delivered - delivered % k
        partial = cursor != delivered
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "batches": cursor,
            "accumulation_steps": k,
            "topology": self._topology_state(),
        }
        if self._rng_pending is not None:
            state["rng"] = self._rng_pending
        elif partial and self._rng_boundary is not None:
            state["rng"] = self._rng_boundary
        else:
            state["rng"] = rng.capture()
        if self._loader is not None:
            sampler = _sampler_state(self._loader, cursor - self._sampler_base)
            if sampler is not None:
                state["sampler"] = sampler
            if _stateful(self._loader):
                state["loader"] = boundary if partial else now
            state.update(self._open_state(cursor))
        return state

    def _open_state(self, cursor: int) -> dict[str, Any]:
        """``opened`` and ``reset_next`` of a leader's state (NOTE [RNG at the epoch's start])."""
        loaded = self._resume_open
        if loaded is not None:  # loaded, not iterated yet
            out = {"reset_next": loaded["reset_next"]}
            here = self._resume is not None and self._resume[0] == self._epoch
            if cursor and here and loaded.get("rng") is not None:
                out["opened"] = {"rng": loaded["rng"], "seeded": loaded["seeded"]}
            return out
        out = {"reset_next": rng.reuses_workers(self._loader)}
        opened = self._iter_open
        if cursor and opened is not None and opened["epoch"] == self._epoch:
            out["opened"] = {"rng": opened["rng"], "seeded": opened["seeded"]}
        return out

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
        if self._it > 0:
            raise LoaderStateError(
                "load_state_dict() must be called before the first iteration; "
                "construct a new ShmLoader to resume"
            )
        self._load_state(state)
        self._length_changed()  # NOTE [length per epoch]

    def _load_state(self, state: dict[str, Any]) -> None:
        epoch, batches, loader_state = _validate_state(state, self._topology_state())
        resized = state["topology"]["world"] != self._topology_state()["world"]
        sampler = _find_sharded(self._loader) if self._loader is not None else None
        if resized:
            if self._loader is not None and sampler is None:
                raise TopologyMismatchError(
                    f"the checkpoint was taken at world size {state['topology']['world']}, now "
                    f"{self._topology_state()['world']}: resuming under another DP size needs "
                    "the loader's sampler to be a shmloader.ShardedSampler (DataLoader(sampler="
                    "...) or batch_sampler=ShardedBatchSampler(...)), which re-splits the rest "
                    "of the epoch"
                )
            if sampler is not None:
                sampler.load_state_dict(state["sampler"])  # validates before it changes
            self.set_epoch(epoch)
            self._resume = (epoch, 0, True)
            self._resume_open = None  # no rank's stream continues
            return
        restore = loader_state is not None and self._loader is not None
        if restore and not _stateful(self._loader):
            raise ConfigError(
                "state['loader']",
                type(loader_state).__name__,
                "no loader state, because the current loader has no load_state_dict()",
            )
        self.set_epoch(epoch)
        if restore:
            self._loader.load_state_dict(loader_state)  # type: ignore[union-attr]
        self._resume = (epoch, batches, not restore)
        self._rng_pending = state.get("rng")
        self._resume_open = None
        if self._loader is not None:  # NOTE [RNG at the epoch's start] (rng.py)
            opened = state.get("opened") or {}
            self._resume_open = {
                "rng": opened.get("rng"),
                "seeded": opened.get("seeded", True),
                "reset_next": state.get("reset_next", False),
            }
            if state["format"] != STATE_FORMAT and batches and not _stateful(self._loader):
                log.warning(
                    "shmloader: this checkpoint (%s) carries no RNG of the epoch's start: a "
                    "shuffled loader or random transforms in its workers resume differently "
                    "than an uninterrupted run would; checkpoints saved now (%s) resume exactly",
                    state["format"],
                    STATE_FORMAT,
                )

    def _position(self) -> tuple[int, bool, Any, Any]:
        """(delivered, exhausted, boundary state, loader state) of the iteration now."""
        now = None
        if self._loader is not None and _stateful(self._loader):
            now = self._loader.state_dict()  # type: ignore[union-attr]
        return self._delivered, self._exhausted, self._boundary_state, now

    def _user_position(self) -> tuple[int, bool, Any, Any]:
        """``_position()`` as of the last batch the user received.

        With device prefetch the loop has pulled up to ``prefetch`` batches
        more than the user has: the stage keeps the position from when the
        batch it handed over last was pulled.
        """
        if self._stage is not None and self._stage.position is not None:
            return self._stage.position
        return self._position()

    def _take_resume(self) -> tuple[int, bool]:
        """(cursor, skip) this iteration starts at: a pending resume of this epoch, or (0, _)."""
        resume, self._resume = self._resume, None
        if resume is None or resume[0] != self._epoch:
            return 0, False
        return resume[1], resume[2]

    def _topology_state(self) -> dict[str, Any]:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        group = list(self._group_ranks) if self._group_ranks is not None else [rank]
        sp = len(group)
        return {
            "world": world,
            "sp": sp,
            "dp": world // sp,
            "rank": rank,
            "sp_rank": group.index(rank),
            "group": group,
        }

    # ------------------------------------------------------ used by every role

    @property
    def _me(self) -> int:
        assert self._topo is not None
        return self._topo.me

    def _capture_rng(self) -> None:
        """At a request of a step's first micro-batch, before the loader's draws for it.

        NOTE [RNG at the step boundary] (``rng.py``): the leader and local
        ranks capture in ``_open_source`` (an iteration's first request, before
        the loader is opened) and in ``_mark_boundary`` (every later request);
        followers and node leaders in ``_deliver``, before mirroring draws.
        With device prefetch those are pulls ahead of the user, so the stage
        captures instead, at the user's request (``_user_request``).
        """
        k = self.accumulation_steps
        if self._stage is not None and self._stage.on_device:
            return
        if k > 1 and self._delivered % k == 0:
            self._rng_boundary = rng.capture()

    def _user_request(self) -> None:
        """``_capture_rng`` at the user's ``next()`` under device prefetch.

        NOTE [checkpoints under prefetch] (``device``): the loop pulls up to
        ``prefetch`` batches before the user asks for them, so the step
        boundary is counted in batches handed to the user, and the capture is
        made before the stage pulls anything for this request.
        """
        k = self.accumulation_steps
        handed = self._stage.position if self._stage is not None else None
        delivered = handed[0] if handed is not None else self._delivered  # none handed yet
        if k > 1 and delivered % k == 0:
            self._rng_boundary = rng.capture()

    def _peer(self, rank: int) -> Peer:
        assert self._topo is not None
        return self._topo.peer(rank)


# ------------------------------------------------------------------ helpers


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


def _resolve_config(config: Config | None, group: dist.ProcessGroup | None) -> Config:
    """The config a ShmLoader runs with: the environment's by default, timeout resolved.

    NOTE [set-up is bounded]
        ``timeout=None`` (``SHMLOADER_TIMEOUT`` unset) follows the process
        group's own timeout, else torch's default (30 min): a leader busy
        alone (evaluation, a checkpoint) is tolerated as long as the job's
        collectives would tolerate it. Set-up starts with every rank's mark in
        the default store, waited for within that timeout (NOTE [set-up
        marks] in ``arrival``): a rank that never constructs its ShmLoader is
        named in a warning every 30 s and in a ``PeerLostError`` at the
        timeout, one that marked and died within about a second, one with
        sharing off or other settings in a ``ConfigError`` at once.
    """
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


def _log_role(
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


def _default_store() -> Any:
    """The default process group's key-value store, or None (a world of one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialised, or internals changed
        return None


def _group_ranks(group: dist.ProcessGroup | None) -> list[int] | None:
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


def _forward_set_epoch(loader: object, epoch: int) -> None:
    """Call ``set_epoch`` on the loader and on its sampler(s), once each."""
    targets: list[object] = [loader]
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    targets += [sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    done: set[int] = set()
    for target in targets:
        fn = getattr(target, "set_epoch", None)
        if target is not None and callable(fn) and id(target) not in done:
            done.add(id(target))
            fn(epoch)


def _find_sharded(loader: object) -> Any:
    """The loader's ``ShardedSampler`` or ``ShardedBatchSampler``, or None."""
    from .sampler import ShardedBatchSampler, ShardedSampler

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
    from .sampler import ShardedBatchSampler

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


def _validate_state(state: Any, topology: dict[str, Any]) -> tuple[int, int, Any]:
    """Check a checkpoint completely before anything changes; return its cursor.

    NOTE [checkpoints]
        A state is per rank: it carries the rank's RNG at the step boundary
        and, on an SP group's leader, its DP replica's loader and sampler
        position. Same world size: only the rank that saved a state may load
        it (and its group must be the same ranks). Another world size with
        the same SP size is a DP resize: any rank may load a state that
        carries a ``ShardedSampler``'s state (a leader's), which the new
        leader's sampler re-splits. The SP size never changes.
    """
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


def _close_in(creator: int, closers: list[Callable[[], None]]) -> None:
    if os.getpid() == creator:
        _close_quietly(closers)


def _close_quietly(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        with contextlib.suppress(Exception):
            close()

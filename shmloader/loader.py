"""``ShmLoader``: orchestration only.

Roles (see ``topology``): the *leader* runs the user's loader and publishes
each batch once into its node's ring; a *node leader* receives each batch from
the leader over the cross-node path straight into its own ring and publishes
it on its node; a *follower* maps what its node's writer published. With
sharing off every rank is *local*: it builds and iterates its own loader,
exactly as without shmloader.

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
    hub.send(BATCH) -> local        hub.send(BATCH) --ZeroMQ--->  spoke receives BATCH
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
    with its count (``it``). All ranks of a group iterate in the same pattern
    (same epochs, same early ``break``s), so equal counts mean the same
    iteration. A reader drops (and releases) batches of an earlier iteration,
    and ends its current iteration when a later one starts.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import datetime
import functools
import json
import logging
import os
import threading
import time
import traceback
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import codec, rng, wire
from .channel import Hub, Peer, Spoke
from .config import Config
from .daemon_client import DaemonClient
from .errors import (
    ConfigError,
    LeaderError,
    LoaderStateError,
    PeerLostError,
    ProtocolError,
    ShmLoaderError,
    TopologyMismatchError,
)
from .ring import RingReader, RingWriter, Slot, new_token, private_view
from .topology import GroupTopology, broadcast_bytes, discover
from .wire import Kind
from .xnode import KIND_BATCH, KIND_END, KIND_ERROR, KIND_STOP, CrossNode

log = logging.getLogger(__name__)

STATE_FORMAT = "shmloader.state/1"
#: Seconds between two progress reports to the daemon.
REPORT_EVERY_S = 1.0
#: Longest a writer waits, on close or on an error, for readers it must reach.
CLOSE_WAIT_S = 10.0

#: gloo exchange groups made for non-gloo SP groups, one per rank tuple for the
#: life of the process: every ShmLoader over the same ranks shares it, so ranks
#: never create groups in different numbers (torch names groups by count).
_EXCHANGE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


class _Releaser:
    """A reader's outgoing messages, and its RELEASEs sent the moment a batch dies.

    NOTE [prompt release]
        A reader's batch dies (``weakref.finalize`` on its mapping) when the
        user drops it, typically when ``batch`` is rebound at the top of the
        next step. Sending RELEASE right then, instead of with the reader's
        next request, lets the writer reuse that slot for the very next
        batch, so a lockstep job needs two slots, not three. The finalizer
        sends only on the thread that owns the socket and never inside one of
        our own socket calls (a garbage collection can run a finalizer
        anywhere): otherwise it queues, and the next call flushes the queue.
    """

    def __init__(self, spoke: Spoke, rank: int) -> None:
        self.spoke = spoke
        self.rank = rank
        self.pending: collections.deque = collections.deque()
        self.owner = threading.get_ident()
        self.busy = False
        self.closed = False  # after close(): batches that die later release nothing

    def release(self, item: tuple[int, int, int]) -> None:
        """The finalizer callback: queue, and send now when that is safe."""
        if self.closed:
            return
        self.pending.append(item)
        if not self.busy and threading.get_ident() == self.owner:
            self.send([])

    def send(self, parts: list) -> None:
        """Send ``parts`` (if any) after every queued RELEASE, guarded against re-entry."""
        if self.busy:
            raise AssertionError("re-entrant send on a reader socket")
        self.busy = True
        try:
            while self.pending:
                index, gen, seq = self.pending.popleft()
                self.spoke.send(wire.frames(Kind.RELEASE, seq, rank=self.rank, slot=index, gen=gen))
            if parts:
                self.spoke.send(parts)
        finally:
            self.busy = False

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """While we wait on the socket, finalizers only queue."""
        self.send([])
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


class ShmLoader:
    """Iterate one loader per SP group; every rank of ``group`` gets identical batches.

    Args:
        make_loader: zero-argument callable returning an iterable of batches,
            usually a ``torch.utils.data.DataLoader``. With sharing on only the
            group's leader calls it.
        group: the ``torch.distributed`` process group whose ranks must receive
            identical batches. ``None``, a group of size 1, or sharing off
            (``SHMLOADER`` unset): every rank calls ``make_loader`` itself.
        accumulation_steps: micro-batches per optimizer step (checkpoints
            resume at optimizer-step boundaries).
        config: a :class:`~shmloader.Config`; default ``Config.from_env()``.

    Construction is collective over ``group`` when sharing is on: every rank
    of the group must construct its ``ShmLoader`` at the same point.
    """

    def __init__(
        self,
        make_loader: Callable[[], Iterable[Any]],
        group: dist.ProcessGroup | None = None,
        *,
        accumulation_steps: int = 1,
        config: Config | None = None,
    ) -> None:
        if not callable(make_loader):
            raise TypeError(f"make_loader must be a zero-argument callable, got {make_loader!r}")
        if (
            not isinstance(accumulation_steps, int)
            or isinstance(accumulation_steps, bool)
            or accumulation_steps < 1
        ):
            raise ConfigError("accumulation_steps", accumulation_steps, "an integer >= 1")
        self.config = config if config is not None else Config.from_env()
        self.accumulation_steps = accumulation_steps
        self._epoch = 0
        self._it = 0  # NOTE [iteration numbers]
        self._seq = 0  # batches announced by this writer
        self._delivered = 0  # position in the epoch: batches the user received (or skipped)
        self._exhausted = False  # the current iteration ran to its end
        # (epoch, cursor, skip) from load_state_dict; skip is False when the
        # leader's loader restored its own position
        self._resume: tuple[int, int, bool] | None = None
        self._boundary_state: Any = None  # loader state at the last optimizer-step boundary
        self._closed = False
        self._writer_closed = False  # a reader was told its writer closed: fail fast
        self._loader: Iterable[Any] | None = None
        self._length: int | None = None
        self._topo: GroupTopology | None = None
        self._ring: RingWriter | None = None
        self._hub: Hub | None = None
        self._reader: RingReader | None = None
        self._spoke: Spoke | None = None
        self._xnode: CrossNode | None = None
        self._daemon: DaemonClient | None = None
        self._next_report = 0.0
        self._stats: collections.Counter = collections.Counter()
        self._warned_rng = False
        self._group_ranks = _group_ranks(group)
        sharing = (
            self.config.enabled and self._group_ranks is not None and len(self._group_ranks) > 1
        )
        if not sharing:
            self._role = "local"
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

    # ------------------------------------------------------------------ set-up

    def _setup(self, make_loader: Callable[[], Iterable[Any]], group: dist.ProcessGroup) -> None:
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
            self._hub = Hub(topo.socket_path)
            self._hello: set[int] = set()
            self._acked = dict.fromkeys(topo.readers, 0)
            self._gone: set[int] = set()
            self._self_releases: collections.deque = collections.deque()
        else:
            self._reader = RingReader(topo.ring_token)
            self._spoke = Spoke(topo.socket_path, topo.me)
            self._out = _Releaser(self._spoke, topo.me)
            self._stale: list[wire.Message] = []
            self._stash: wire.Message | None = None
            me = topo.fact(topo.me)
            self._out.send(wire.frames(Kind.HELLO, rank=topo.me, pid=me.pid, start=me.start))
        if len(topo.nodes) > 1 and topo.me in topo.node_leaders:
            self._xnode = CrossNode(pg, topo.leader, topo.node_leaders)

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
            "pids": {str(f.rank): [f.pid, f.start] for f in topo.facts if f.rank in topo.node},
            "world": dist.get_world_size(),
        }

    def _closers(self) -> list[Callable[[], None]]:
        parts = (self._spoke, self._reader, self._hub, self._ring)
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

    def _report(self) -> None:
        """Tell the daemon (at most once a second) how far this rank's peers are."""
        client, topo = self._daemon, self._topo
        now = time.monotonic()
        if client is None or topo is None or now < self._next_report:
            return
        self._next_report = now + REPORT_EVERY_S
        if topo.is_writer:
            client.report(topo.ring_token, topo.me, published=self._seq)
            for rank, acked in self._acked.items():
                client.report(topo.ring_token, rank, consumed=acked, lag=self._seq - acked)
        else:
            received = self._stats["received"]
            mean = self._stats["receive_ms_total"] / received if received else None
            client.report(topo.ring_token, topo.me, consumed=received, receive_ms=mean)

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
        if self._role == "local":
            return len(self._loader)  # type: ignore[arg-type]
        if self._length is None:
            raise TypeError(
                "the leader's loader has no len() (an IterableDataset without __len__?)"
            )
        return self._length

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` and forward it to the leader's loader and sampler."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError("epoch", epoch, "an integer >= 0")
        self._epoch = epoch
        if self._loader is not None:
            _forward_set_epoch(self._loader, epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise ShmLoaderError("this ShmLoader is closed; make a new one")
        if self._writer_closed:
            raise PeerLostError(
                self._topo.writer if self._topo else None,
                "writer",
                "it closed its ShmLoader: no more batches will come",
            )
        self._it += 1
        cursor, skip = self._take_resume()
        self._delivered = cursor
        self._exhausted = False
        if self._role == "local":
            return self._local_iteration(cursor if skip else 0)
        if self._role == "leader":
            return self._leader_iteration(self._it, cursor if skip else 0)
        if self._role == "node leader":
            return self._relay_iteration(self._it)
        return self._follower_iteration(self._it)

    def stats(self) -> dict[str, Any]:
        """Counters of this rank: batches, bytes, times (ms), ring size."""
        out: dict[str, Any] = {"role": self._role, "epoch": self._epoch, **self._stats}
        if self._ring is not None:
            out["ring_slots"] = len(self._ring.slots)
            out["ring_bytes"] = self._ring.total_bytes
        if self._xnode is not None:
            out["cross_node_bytes_sent"] = self._xnode.bytes_sent
        return out

    def close(self) -> None:
        """Release every resource. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        if self._spoke is not None:
            with contextlib.suppress(Exception):
                self._out.send(wire.frames(Kind.BYE, rank=self._me))
            self._out.closed = True
        if self._hub is not None:
            with contextlib.suppress(Exception):
                self._await_attach()
                stop = wire.frames(Kind.STOP, reason="the writer closed", closed=1)
                self._tell_readers(stop, best_effort=True)
        if self._role != "local":
            self._finalizer()
        self._loader = None

    def __enter__(self) -> ShmLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What the user has received so far, at an optimizer-step boundary.

        Keys: ``format``, ``epoch``, ``batches`` (the cursor: batches of this
        epoch the SP group consumed, counted once per group, rounded down to a
        whole optimizer step of ``accumulation_steps`` unless the epoch ended),
        ``accumulation_steps``, ``topology`` and, on the leader of a loader
        with ``state_dict``/``load_state_dict`` (torchdata's
        ``StatefulDataLoader``), ``loader``: that loader's own state at the
        same boundary. Followers never hold loader state. Before the first
        iteration after ``load_state_dict`` it reports the loaded cursor.
        """
        k = self.accumulation_steps
        if self._resume is not None and self._resume[0] == self._epoch:
            cursor = delivered = self._resume[1]  # loaded, not iterated yet
        else:
            delivered = self._delivered
            cursor = delivered if self._exhausted else delivered - delivered % k
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "batches": cursor,
            "accumulation_steps": k,
            "topology": self._topology_state(),
        }
        if self._loader is not None and _stateful(self._loader):
            partial = cursor != delivered
            loader_state = self._boundary_state if partial else self._loader.state_dict()  # type: ignore[union-attr]
            state["loader"] = loader_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``. Call before iterating; validates everything first.

        The next iteration of the saved epoch (``set_epoch`` to it, or no
        ``set_epoch`` at all) continues after the saved cursor: the leader
        restores its loader's own state when the checkpoint has one, or else
        fast-forwards its loader by the cursor. Any rank of the same SP group
        may load any peer's state (their cursors are equal). Raises
        :class:`TopologyMismatchError` when the checkpoint was taken under
        other ranks or another SP size, :class:`ConfigError` for a malformed
        state and :class:`LoaderStateError` once iteration has started.
        """
        if self._it > 0:
            raise LoaderStateError(
                "load_state_dict() must be called before the first iteration; "
                "construct a new ShmLoader to resume"
            )
        epoch, batches, loader_state = _validate_state(state, self._topology_state())
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
            "sp_rank": group.index(rank),
            "dp_rank": min(group) // sp,
            "group": group,
        }

    # ------------------------------------------------------------ iteration

    @property
    def _me(self) -> int:
        assert self._topo is not None
        return self._topo.me

    def _local_iteration(self, skip: int) -> Iterator[Any]:
        source, _ = self._open_source(skip)
        while True:
            self._mark_boundary()
            box = []  # NOTE [no batch in the frame]
            try:
                box.append(next(source))
            except StopIteration:
                self._exhausted = True
                return
            self._delivered += 1
            yield box.pop()

    def _open_source(self, skip: int) -> tuple[Iterator[Any], int]:
        """``iter()`` the user's loader and fast-forward ``skip`` batches (a resume).

        Returns the iterator and the default-generator draws made so far
        (NOTE [RNG mirroring]). Skipping replays the skipped batches through
        the loader, so its sampler, workers and RNG end where an
        uninterrupted run would be.
        """
        before = rng.snapshot()
        source = iter(self._loader)  # type: ignore[arg-type]
        for _ in range(skip):
            try:
                next(source)
            except StopIteration:
                break
        return source, self._count(before)

    def _mark_boundary(self) -> None:
        """Remember a stateful loader's state at an optimizer-step boundary."""
        k = self.accumulation_steps
        if k > 1 and self._delivered % k == 0 and _stateful(self._loader):
            self._boundary_state = self._loader.state_dict()  # type: ignore[union-attr]

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

    # -- leader --------------------------------------------------------------

    def _leader_iteration(self, it: int, skip: int) -> Iterator[Any]:
        try:
            source, pending = self._open_source(skip)
            while True:
                self._mark_boundary()
                before = rng.snapshot()
                box = []  # NOTE [no batch in the frame]
                try:
                    box.append(next(source))
                except StopIteration:
                    self._end(it, pending + self._count(before))
                    self._exhausted = True
                    return
                draws, pending = pending + self._count(before), 0
                self._delivered += 1
                yield self._publish(it, box.pop(), draws)
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._fail(it, exc)
            raise

    def _publish(self, it: int, batch: Any, draws: int) -> Any:
        """Write ``batch`` once into the ring, announce it; return the leader's own copy.

        The leader, too, gets a copy-on-write view of the slot (unless
        ``SHMLOADER_COPY``), so the loader's batch can be freed at once: the
        node holds each batch once, in the ring, and every rank of the group
        sees the very same structure.
        """
        enc = codec.encode(batch, allow_pickle=self.config.allow_pickle)
        self._await_readers()
        t0 = time.perf_counter_ns()
        slot = self._ring.acquire(enc.nbytes) if enc.nbytes else None  # type: ignore[union-attr]
        if slot is not None:
            codec.write_payload(enc, slot.payload)
        t1 = time.perf_counter_ns()
        payload = slot.payload[: enc.nbytes] if slot is not None else None
        crc = _crc(payload) if self.config.verify and payload is not None else -1
        if self._xnode is not None:
            self._xnode.send(KIND_BATCH, it, enc.meta, payload, draws=draws, crc=crc)
        self._announce(it, enc.meta, enc.nbytes, slot, draws, t1 - t0, crc)
        self._stats["published"] += 1
        self._stats["bytes_published"] += enc.nbytes
        self._stats["publish_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
        self._stats["write_ms_last"] = (t1 - t0) / 1e6
        if self.config.copy:
            if slot is not None:
                self._ring.release(self._me, slot.index, slot.gen)  # type: ignore[union-attr]
            return batch
        return codec.decode(enc.meta, self._own_view(slot, enc.nbytes))

    def _own_view(self, slot: Slot | None, nbytes: int) -> np.ndarray:
        """The writer's private view of a slot it just published; releases itself."""
        if slot is None:
            return np.empty(0, np.uint8)
        release = functools.partial(self._self_releases.append, (slot.index, slot.gen))
        return private_view(slot.segment, nbytes, release)

    def _end(self, it: int, draws: int) -> None:
        if self._xnode is not None:
            self._xnode.send(KIND_END, it, b"", draws=draws)
        self._await_readers(window=False)
        self._tell_readers(wire.frames(Kind.END, it=it, draws=draws))

    def _fail(self, it: int, exc: BaseException) -> None:
        """Tell every reader (and from the leader every node leader) that this iteration failed.

        Readers that have not said HELLO yet are waited for (bounded): a
        message sent before their connection is up would be lost, and they
        would report the leader lost instead of its error.
        """
        try:
            stop = isinstance(exc, KeyboardInterrupt | SystemExit)
            if stop:
                kind, body = KIND_STOP, {"reason": f"{type(exc).__name__} on the leader"}
                parts = wire.frames(Kind.STOP, closed=0, **body)
            else:
                kind, body = KIND_ERROR, _error_body(it, exc)
                parts = wire.frames(Kind.ERROR, **body)
            link_broken = self._xnode is not None and self._xnode.broken
            if self._xnode is not None and self._role == "leader" and not link_broken:
                self._xnode.send_json(kind, it, body)
            with contextlib.suppress(PeerLostError):
                self._await_readers(window=False, timeout=min(self.config.timeout, CLOSE_WAIT_S))
            self._tell_readers(parts, best_effort=True)
        except Exception as notify_error:  # the original error matters more
            log.warning("shmloader: could not tell followers about %r: %s", exc, notify_error)

    # -- writer bookkeeping (leader and node leader) -------------------------

    def _announce(
        self, it: int, meta: bytes, nbytes: int, slot: Slot | None, draws: int, ns: int, crc: int
    ) -> None:
        """Tell this node's readers that batch ``seq`` is in ``slot``."""
        ring = self._ring
        assert ring is not None
        seq = self._seq
        self._seq += 1
        if slot is not None:
            ring.publish(slot, seq, nbytes, ns)
        parts = wire.frames(
            Kind.BATCH,
            seq,
            meta,
            it=it,
            slot=-1 if slot is None else slot.index,
            gen=0 if slot is None else slot.gen,
            seg="" if slot is None else slot.segment.name,
            nbytes=nbytes,
            draws=draws,
            crc=crc,
        )
        self._tell_readers(parts)
        self._report()

    def _tell_readers(self, parts: list, *, best_effort: bool = False) -> None:
        """Send to every live reader; a lost one raises after all others were told."""
        assert self._hub is not None and self._topo is not None
        lost: PeerLostError | None = None
        for rank in self._topo.readers:
            if rank in self._gone:
                continue
            try:
                self._hub.send(rank, parts)
            except PeerLostError as exc:
                self._drop_reader(rank)
                lost = lost or exc
        if lost is not None and not best_effort:
            raise lost

    def _drop_reader(self, rank: int) -> None:
        """``rank`` said BYE or is unreachable: stop waiting for it and sending to it."""
        self._gone.add(rank)
        assert self._ring is not None
        self._ring.drop_reader(rank)

    def _handle(self, msg: wire.Message, rank: int | None) -> bool:
        """Apply one reader message to the writer's state; never raises on bad input."""
        ring = self._ring
        assert ring is not None
        if rank not in self._acked:
            log.warning("shmloader: message from rank %s, which is not a reader here", rank)
            return False
        try:
            if msg.kind == Kind.HELLO:
                self._hello.add(rank)
            elif msg.kind == Kind.ACK:
                self._acked[rank] = max(self._acked[rank], msg.seq + 1)
            elif msg.kind == Kind.RELEASE:
                ring.release(rank, msg["slot"], msg["gen"])
            elif msg.kind == Kind.ATTACHED:
                ring.attached(rank, msg["seg"])
            elif msg.kind == Kind.BYE:
                self._drop_reader(rank)
            else:
                raise ProtocolError(f"{msg.kind.name} is not a reader's message")
        except ProtocolError as exc:
            log.warning("shmloader: dropped a message from rank %d: %s", rank, exc)
        return False

    def _pump(self) -> None:
        """Apply every message already waiting, and our own releases (node leader)."""
        assert self._hub is not None and self._ring is not None
        while (got := self._hub.receive(0)) is not None:
            self._handle(*got)
        while self._self_releases:
            index, gen = self._self_releases.popleft()
            with contextlib.suppress(ProtocolError):
                self._ring.release(self._me, index, gen)

    def _wait_for(self, waiting: Callable[[], list[int]], timeout: float, doing: str) -> None:
        """Handle reader messages until ``waiting()`` is empty (NOTE [bounded waits])."""
        hub = self._hub
        assert hub is not None
        self._pump()
        if not waiting():
            return

        def handle(msg: wire.Message, rank: int | None) -> bool:
            self._handle(msg, rank)
            return not waiting()

        t0 = time.perf_counter()
        hub.wait(handle, lambda: [self._peer(r) for r in waiting()], timeout=timeout, doing=doing)
        self._stats["wait_readers_ms_total"] += (time.perf_counter() - t0) * 1e3

    def _await_readers(self, *, window: bool = True, timeout: float | None = None) -> None:
        """Wait until every reader said HELLO and (``window``) none lags ``slots`` behind."""
        topo = self._topo
        assert topo is not None
        slots = self.config.slots

        def waiting() -> list[int]:
            live = [r for r in topo.readers if r not in self._gone]
            late = [r for r in live if r not in self._hello]
            if late or not window:
                return late
            return [r for r in live if self._seq - self._acked[r] >= slots]

        self._wait_for(
            waiting,
            self.config.timeout if timeout is None else timeout,
            f"waiting for followers to take batch {self._seq}",
        )

    def _await_attach(self) -> None:
        """Before unlinking at close: let readers open the segments they were told about.

        A reader maps a slot by name, so a name unlinked before a lagging
        reader opened it would make that reader fail. Bounded by
        ``CLOSE_WAIT_S``; readers that said BYE or died are not waited for.
        """
        ring = self._ring
        assert ring is not None
        try:
            self._wait_for(
                lambda: sorted(ring.unattached() - self._gone),
                min(self.config.timeout, CLOSE_WAIT_S),
                "closing: waiting for followers to map the last batches",
            )
        except PeerLostError as exc:
            log.warning("shmloader: closing without every follower's last batch: %s", exc)

    def _peer(self, rank: int) -> Peer:
        assert self._topo is not None
        return self._topo.peer(rank)

    # -- node leader ---------------------------------------------------------

    def _relay_iteration(self, it: int) -> Iterator[Any]:
        try:
            yield from self._relay(it)
        except GeneratorExit:
            raise
        except LeaderError:
            raise  # already forwarded to this node's readers
        except BaseException as exc:  # e.g. the cross-node link broke: tell our readers
            self._fail(it, exc)
            raise

    def _relay(self, it: int) -> Iterator[Any]:
        xnode, ring = self._xnode, self._ring
        assert xnode is not None and ring is not None
        while True:
            kind, _leader_it, nbytes, meta, draws, crc = xnode.receive_header()
            if kind == KIND_END:
                self._await_readers(window=False)
                self._tell_readers(wire.frames(Kind.END, it=it, draws=draws))
                rng.mirror_draws(draws)
                self._exhausted = True
                return
            if kind in (KIND_ERROR, KIND_STOP):
                body = _json_body(meta)
                if kind == KIND_STOP:
                    reason = str(body.get("reason", ""))
                    parts = wire.frames(Kind.STOP, reason=reason, closed=0)
                    self._tell_readers(parts, best_effort=True)
                    log.warning("shmloader: the leader stopped: %s", reason)
                    return
                body["it"] = it
                self._tell_readers(wire.frames(Kind.ERROR, **_error_fields(body)), best_effort=True)
                raise _leader_error(body, self._topo.leader if self._topo else None)
            t0 = time.perf_counter_ns()
            self._await_readers()
            slot = ring.acquire(nbytes) if nbytes else None
            if slot is not None:
                xnode.receive_payload(slot.payload[:nbytes])
                if crc >= 0:
                    _check_crc(slot.payload[:nbytes], crc, self._seq)
            self._announce(it, meta, nbytes, slot, draws, time.perf_counter_ns() - t0, crc)
            yield self._deliver(meta, self._own_view(slot, nbytes), draws, t0)

    def _deliver(self, meta: bytes, payload: np.ndarray, draws: int, t0: int) -> Any:
        """Decode a received batch (views of ``payload``), mirror RNG draws, count it."""
        batch = codec.decode(meta, payload, allow_pickle=self.config.allow_pickle)
        if self.config.copy:
            batch = _owned_copy(batch)
        rng.mirror_draws(draws)
        self._delivered += 1
        elapsed = (time.perf_counter_ns() - t0) / 1e6
        self._stats["received"] += 1
        self._stats["receive_ms_total"] += elapsed
        self._stats["receive_ms_last"] = elapsed
        self._report()
        return batch

    # -- follower ------------------------------------------------------------

    def _next_event(self, it: int) -> wire.Message:
        """The next message of iteration ``it`` (NOTE [iteration numbers])."""
        spoke, topo = self._spoke, self._topo
        assert spoke is not None and topo is not None
        if self._stash is not None:
            msg, self._stash = self._stash, None
            if self._current(msg, it):
                self._drop_stale()
                return msg
        found: list[wire.Message] = []

        def handle(msg: wire.Message, _rank: int | None) -> bool:
            if self._current(msg, it):
                found.append(msg)
                return True
            return False

        peer = self._peer(topo.writer)
        t0 = time.perf_counter()
        with self._out.receiving():
            spoke.wait(
                handle,
                lambda: [peer],
                timeout=self.config.timeout,
                doing=f"waiting for batch {self._delivered} of iteration {it}",
            )
        self._stats["wait_ms_total"] += (time.perf_counter() - t0) * 1e3
        self._drop_stale()
        return found[0]

    def _drop_stale(self) -> None:
        """ACK and RELEASE batches of an earlier iteration, outside the receive."""
        while self._stale:
            msg = self._stale.pop()
            self._out.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
            if msg["slot"] >= 0:
                self._attach(msg["seg"])
                self._out.release((msg["slot"], msg["gen"], msg.seq))

    def _current(self, msg: wire.Message, it: int) -> bool:
        """Whether ``msg`` belongs to iteration ``it``; stale batches are released here."""
        msg_it = msg.body.get("it", it)
        if msg.kind == Kind.STOP or msg_it == it:
            return True
        if msg_it > it:  # the writer moved on: end ours, keep the message for the next
            self._stash = msg
            return True
        if msg.kind == Kind.BATCH:  # an earlier iteration's batch we will never use
            self._stale.append(msg)
        return False

    def _attach(self, seg: str) -> None:
        assert self._reader is not None and self._spoke is not None
        try:
            opened = self._reader.open(seg)
        except ProtocolError as exc:
            writer = self._peer(self._topo.writer) if self._topo else None
            if writer is not None and not writer.alive():
                raise PeerLostError(
                    writer.rank, writer.role, f"it died before we mapped {seg}"
                ) from None
            raise ShmLoaderError(
                f"cannot map the batch in {seg}: {exc}. The writer may have closed its ShmLoader "
                "while this rank was still iterating: close() every rank's loader only after "
                "every rank finished iterating"
            ) from None
        if opened:
            self._out.send(wire.frames(Kind.ATTACHED, rank=self._me, seg=seg))

    def _follower_iteration(self, it: int) -> Iterator[Any]:
        reader, spoke, topo = self._reader, self._spoke, self._topo
        assert reader is not None and spoke is not None and topo is not None
        while True:
            msg = self._next_event(it)
            if msg is self._stash:  # a later iteration started: ours is over
                return
            if msg.kind == Kind.END:
                rng.mirror_draws(msg["draws"])
                self._exhausted = True
                return
            if msg.kind == Kind.STOP:
                if msg["closed"]:
                    self._writer_closed = True
                    raise PeerLostError(
                        topo.writer,
                        topo.role(topo.writer),
                        "it closed its ShmLoader while this rank was still iterating",
                    )
                log.warning("shmloader: the leader stopped: %s", msg["reason"])
                return
            if msg.kind == Kind.ERROR:
                raise _leader_error(msg.body, topo.leader)
            if msg.kind != Kind.BATCH:
                log.warning("shmloader: unexpected %s from the writer; ignored", msg.kind.name)
                continue
            t0 = time.perf_counter_ns()
            self._out.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
            yield self._deliver(msg.blob, self._map(msg), msg["draws"], t0)

    def _map(self, msg: wire.Message) -> np.ndarray:
        """A private view of the payload a BATCH announced (empty without payload)."""
        nbytes = msg["nbytes"]
        if not nbytes:
            return np.empty(0, np.uint8)
        assert self._reader is not None
        self._attach(msg["seg"])
        release = functools.partial(self._out.release, (msg["slot"], msg["gen"], msg.seq))
        payload = self._reader.view(msg["seg"], nbytes, release)
        if msg["crc"] >= 0:
            _check_crc(payload, msg["crc"], msg.seq)
        return payload


# ------------------------------------------------------------------ helpers


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


def _stateful(loader: object) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _validate_state(state: Any, topology: dict[str, Any]) -> tuple[int, int, Any]:
    """Check a checkpoint completely before anything changes; return its cursor."""
    if not isinstance(state, dict):
        raise ConfigError("state", type(state).__name__, "the dict returned by state_dict()")
    if state.get("format") != STATE_FORMAT:
        raise ConfigError("state['format']", state.get("format"), repr(STATE_FORMAT))
    for key, minimum in (("epoch", 0), ("batches", 0), ("accumulation_steps", 1)):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"state[{key!r}]", value, f"an integer >= {minimum}")
    saved = state.get("topology")
    if not isinstance(saved, dict):
        raise ConfigError("state['topology']", saved, "a dict")
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, now {topology[key]!r}"
        for key in ("world", "sp", "group")
        if saved.get(key) != topology[key]
    ]
    if diffs:
        raise TopologyMismatchError(
            "this checkpoint was taken under another topology and cannot map onto the current "
            "ranks (" + "; ".join(diffs) + "). Resume with the same world size and SP groups; "
            "to change the data-parallel size, resume the sampler's own state "
            "(shmloader.ShardedSampler supports that) and start the loader fresh."
        )
    return state["epoch"], state["batches"], state.get("loader")


def _owned_copy(batch: Any) -> Any:
    """Replace shared views by owned copies (``SHMLOADER_COPY=1``).

    A module-level recursion with an explicit memo, not a nested closure: a
    closure that refers to itself is a reference cycle, which would keep the
    copies (and through them nothing else, but still memory) alive until the
    cycle collector runs.
    """
    return _clone(batch, {})


def _clone(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor | np.ndarray):
        if id(obj) not in memo:  # aliases stay aliases
            memo[id(obj)] = obj.clone() if isinstance(obj, torch.Tensor) else obj.copy()
        return memo[id(obj)]
    if isinstance(obj, list):
        return [_clone(v, memo) for v in obj]
    if type(obj) is tuple:
        return tuple(_clone(v, memo) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_clone(v, memo) for v in obj))
    if isinstance(obj, dict):
        return {k: _clone(v, memo) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        new = copy.copy(obj)
        for name in obj.__dataclass_fields__:
            object.__setattr__(new, name, _clone(getattr(obj, name), memo))
        return new
    return obj


def _crc(payload: np.ndarray) -> int:
    return zlib.crc32(payload)


def _check_crc(payload: np.ndarray, expected: int, seq: int) -> None:
    got = _crc(payload)
    if got != expected:
        raise ProtocolError(
            f"batch {seq}: payload CRC-32 {got:08x} != {expected:08x} announced by the writer; "
            "the shared memory was modified or corrupted between write and read"
        )


def _json_body(meta: bytes) -> dict:
    try:
        body = json.loads(meta)
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    if isinstance(body, dict):
        return body
    return {"type": "ProtocolError", "message": repr(meta[:200])}


def _error_body(it: int, exc: BaseException) -> dict[str, Any]:
    return {
        "it": it,
        "type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def _error_fields(body: dict) -> dict:
    return {
        "it": int(body.get("it", 0)) if isinstance(body.get("it", 0), int) else 0,
        "type": str(body.get("type", "Exception")),
        "message": str(body.get("message", "")),
        "traceback": str(body.get("traceback", "")),
    }


def _leader_error(body: dict, leader: int | None) -> ShmLoaderError:
    """The error a reader raises for the leader's ERROR message.

    A peer lost by the leader is a peer lost by the whole group: readers raise
    ``PeerLostError`` with the leader's account. Anything else the leader's
    loader raised becomes ``LeaderError`` carrying type, message and traceback.
    """
    f = _error_fields(body)
    if f["type"] == "PeerLostError":
        return PeerLostError(None, "peer", f"the leader (rank {leader}) reported: {f['message']}")
    return LeaderError(f["type"], f["message"], f["traceback"], leader_rank=leader)


def _close_in(creator: int, closers: list[Callable[[], None]]) -> None:
    if os.getpid() == creator:
        _close_quietly(closers)


def _close_quietly(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        with contextlib.suppress(Exception):
            close()

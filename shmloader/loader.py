"""``ShmLoader``: orchestration only.

Roles (see ``topology``): the *leader* runs the user's loader and publishes
each batch once into its node's ring; a *node leader* receives each batch from
the leader over the cross-node broadcast straight into its own ring and
publishes it on its node; a *follower* maps what its node's writer published.
With sharing off every rank is *local*: it builds and iterates its own loader,
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
    yield batch (the original)      yield decode(private view)    yield codec.decode(view)
                                                                  ... batch garbage ->
                                    ring.release  <--RELEASE----  weakref.finalize

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
from .channel import Hub, Peer, Spoke, socket_path
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
from .ring import RingReader, RingWriter, Slot, new_token
from .topology import GroupTopology, discover
from .wire import Kind
from .xnode import KIND_BATCH, KIND_END, KIND_ERROR, KIND_STOP, CrossNode

log = logging.getLogger(__name__)

_LENGTH_NONE = -1  # the leader's loader has no __len__
_LENGTH_FAILED = -2  # make_loader raised on the leader


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
        # (epoch, cursor, skip) from load_state_dict: skip=False when the loader restored itself
        self._resume: tuple[int, int, bool] | None = None
        self._skip = True
        self._boundary_state: Any = None  # loader state at the last optimizer-step boundary
        self._closed = False
        self._loader: Iterable[Any] | None = None
        self._length: int | None = None
        self._topo: GroupTopology | None = None
        self._ring: RingWriter | None = None
        self._hub: Hub | None = None
        self._reader: RingReader | None = None
        self._spoke: Spoke | None = None
        self._xnode: CrossNode | None = None
        self._own_groups: list[dist.ProcessGroup] = []
        self._daemon: DaemonClient | None = None
        self._next_report = 0.0
        self._stats = collections.Counter()
        self._warned_rng = False

        self._group_ranks: list[int] | None = None
        if group is not None and dist.is_available() and dist.is_initialized():
            try:
                self._group_ranks = dist.get_process_group_ranks(group)
            except (ValueError, RuntimeError, KeyError):
                raise ConfigError(
                    "group",
                    group,
                    "a process group of the initialised default group (from "
                    "torch.distributed.new_group), not one of another or destroyed world",
                ) from None
            if dist.get_rank() not in self._group_ranks:
                raise ConfigError(
                    "group",
                    self._group_ranks,
                    f"a group that contains this rank ({dist.get_rank()})",
                )
        sharing = (
            self.config.enabled
            and group is not None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(group) > 1
        )
        if not sharing:
            self._role = "local"
            self._loader = make_loader()
            return
        try:
            self._setup(make_loader, group)
        except BaseException:
            _close_quietly(self._closers())
            raise
        self._finalizer = weakref.finalize(self, _close_quietly, self._closers())

    # ------------------------------------------------------------------ set-up

    def _setup(self, make_loader: Callable[[], Iterable[Any]], group: dist.ProcessGroup) -> None:
        pg = self._exchange_group(group)
        topo = discover(pg, new_token(), node_override=self.config.node)
        self._topo = topo
        self._role = topo.role()
        error: BaseException | None = None
        length = torch.tensor([_LENGTH_NONE], dtype=torch.int64)
        if topo.is_leader:
            try:
                self._loader = make_loader()
                with contextlib.suppress(TypeError):
                    length[0] = len(self._loader)  # type: ignore[arg-type]
            except BaseException as exc:
                error, length[0] = exc, _LENGTH_FAILED
        dist.broadcast(length, src=topo.leader, group=pg)
        if error is not None:
            raise error
        if int(length[0]) == _LENGTH_FAILED:
            raise LeaderError(
                "Exception",
                "make_loader() raised on the leader",
                "see the leader's log",
                leader_rank=topo.leader,
            )
        self._length = int(length[0])

        self._daemon = self._connect_daemon()
        if topo.is_writer:
            self._ring = RingWriter(
                topo.ring_token,
                frozenset(topo.readers),
                self._description(),
                self_rank=None if topo.is_leader else topo.me,
                daemon=self._daemon,
            )
            if self._daemon is not None:
                self._daemon.register(self._description())
            self._hub = Hub(socket_path(self.config.runtime_dir, topo.ring_token, os.getpid()))
            self._hello: set[int] = set()
            self._acked = dict.fromkeys(topo.readers, 0)
            self._gone: set[int] = set()
            self._self_releases: collections.deque = collections.deque()
        else:
            writer = topo.fact(topo.writer)
            self._reader = RingReader(topo.ring_token)
            self._spoke = Spoke(
                socket_path(self.config.runtime_dir, topo.ring_token, writer.pid), topo.me
            )
            self._releases: collections.deque = collections.deque()
            self._stash: wire.Message | None = None
            self._spoke.send(
                wire.frames(
                    Kind.HELLO, rank=topo.me, pid=os.getpid(), start=topo.fact(topo.me).start
                )
            )
        if len(topo.nodes) > 1 and topo.me in topo.node_leaders:
            xg = dist.new_group(
                list(topo.node_leaders),
                backend="gloo",
                timeout=datetime.timedelta(seconds=self.config.timeout),
                use_local_synchronization=True,
            )
            self._own_groups.append(xg)
            self._xnode = CrossNode(xg, topo.leader, topo.node_leaders)

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

    def _exchange_group(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """A gloo group with the ranks of ``group`` for the CPU set-up exchange."""
        if dist.get_backend(group) == "gloo":
            return group
        ranks = dist.get_process_group_ranks(group)
        pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._own_groups.append(pg)
        return pg

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
        return [
            c.close for c in (self._spoke, self._reader, self._hub, self._ring) if c is not None
        ]

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
        if self._length is None or self._length < 0:
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
        self._it += 1
        self._skip = self._resume is None or self._resume[2]
        self._delivered = self._take_resume()
        self._exhausted = False
        if self._role == "local":
            return self._local_iteration()
        if self._role == "leader":
            return self._leader_iteration(self._it)
        if self._role == "node leader":
            return self._relay_iteration(self._it)
        return self._follower_iteration(self._it)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What the user has received so far, at an optimizer-step boundary.

        Keys: ``format``, ``epoch``, ``batches`` (the cursor: batches of this
        epoch the SP group consumed, counted once per group, rounded down to a
        whole optimizer step of ``accumulation_steps`` unless the epoch ended),
        ``accumulation_steps``, ``topology`` and, on the leader of a loader
        with ``state_dict``/``load_state_dict`` (torchdata's
        ``StatefulDataLoader``), ``loader``: that loader's own state at the
        same boundary. Followers never hold loader state.
        """
        k = self.accumulation_steps
        cursor = self._delivered if self._exhausted else self._delivered - self._delivered % k
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "batches": cursor,
            "accumulation_steps": k,
            "topology": self._topology_state(),
        }
        if self._loader is not None and _stateful(self._loader):
            partial = cursor != self._delivered
            state["loader"] = self._boundary_state if partial else self._loader.state_dict()  # type: ignore[union-attr]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``. Call before iterating; validates everything first.

        The next iteration of the saved epoch (``set_epoch`` to it, or no
        ``set_epoch`` at all) continues after the saved cursor: the leader
        restores its loader's own state when the checkpoint has one, or else
        fast-forwards its loader by the cursor. Raises
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
        # The cursor is kept on every rank (it is what state_dict reports); the
        # leader skips that many batches unless its loader restored itself.
        self._resume = (epoch, batches, not restore)

    def _take_resume(self) -> int:
        """The cursor this iteration starts at (a pending resume of this epoch)."""
        resume, self._resume = self._resume, None
        if resume is None or resume[0] != self._epoch:
            return 0
        return resume[1]

    def _topology_state(self) -> dict[str, Any]:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        if self._topo is not None:
            group = list(self._topo.ranks)
        elif self._group_ranks is not None:
            group = list(self._group_ranks)
        else:
            group = [rank]
        sp = len(group)
        return {
            "world": world,
            "sp": sp,
            "dp": world // sp,
            "sp_rank": group.index(rank),
            "dp_rank": min(group) // sp,
            "group": group,
        }

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
                self._flush_releases()
                self._spoke.send(wire.frames(Kind.BYE, rank=self._me))
        if self._hub is not None:
            with contextlib.suppress(Exception):
                self._await_attach()
                self._tell_readers(wire.frames(Kind.STOP, reason="the writer closed"))
        if self._role != "local":
            self._finalizer()
        for g in self._own_groups:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(g)
        self._own_groups.clear()
        self._loader = None

    def __enter__(self) -> ShmLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ iteration

    @property
    def _me(self) -> int:
        assert self._topo is not None
        return self._topo.me

    def _local_iteration(self) -> Iterator[Any]:
        source, _ = self._open_source()
        while True:
            self._mark_boundary()
            try:
                batch = next(source)
            except StopIteration:
                self._exhausted = True
                return
            self._delivered += 1
            yield batch

    def _open_source(self) -> tuple[Iterator[Any], int]:
        """``iter()`` the user's loader and fast-forward to a resumed cursor.

        Returns the iterator and the default-generator draws made so far
        (NOTE [RNG mirroring]). Skipping replays the skipped batches through
        the loader, so its sampler, workers and RNG end where an
        uninterrupted run would be.
        """
        before = rng.snapshot()
        source = iter(self._loader)  # type: ignore[arg-type]
        for _ in range(self._delivered if self._skip else 0):
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

    def _leader_iteration(self, it: int) -> Iterator[Any]:
        steps = 0
        try:
            source, pending = self._open_source()
            while True:
                self._mark_boundary()
                before = rng.snapshot()
                try:
                    batch = next(source)
                except StopIteration:
                    self._end(it, steps, pending + self._count(before))
                    self._exhausted = True
                    return
                draws, pending = pending + self._count(before), 0
                self._publish(it, batch, draws)
                steps += 1
                self._delivered += 1
                yield batch
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._fail(it, exc)
            raise

    def _publish(self, it: int, batch: Any, draws: int) -> None:
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
                self._gone.add(rank)
                lost = lost or exc
        if lost is not None and not best_effort:
            raise lost

    def _end(self, it: int, steps: int, draws: int) -> None:
        if self._xnode is not None:
            self._xnode.send(KIND_END, it, b"", draws=draws)
        self._await_readers(window=False)
        self._tell_readers(wire.frames(Kind.END, it=it, steps=steps, draws=draws))

    def _fail(self, it: int, exc: BaseException) -> None:
        """Tell every reader (and from the leader every node leader) that this iteration failed."""
        try:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                body = {"reason": f"{type(exc).__name__} on the leader"}
                if self._xnode is not None and self._role == "leader":
                    self._xnode.send_json(KIND_STOP, it, body)
                self._tell_readers(wire.frames(Kind.STOP, **body), best_effort=True)
                return
            body = {
                "it": it,
                "type": type(exc).__qualname__,
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(exc)),
            }
            broken = isinstance(exc, PeerLostError)  # the broadcast itself may be what broke
            if self._xnode is not None and self._role == "leader" and not broken:
                self._xnode.send_json(KIND_ERROR, it, body)
            self._tell_readers(wire.frames(Kind.ERROR, **body), best_effort=True)
        except Exception as notify_error:  # the original error matters more
            log.warning("shmloader: could not tell followers about %r: %s", exc, notify_error)

    # -- writer bookkeeping --------------------------------------------------

    def _handle(self, msg: wire.Message, rank: int | None) -> bool:
        """Apply one reader message to the writer's state; never raises on bad input."""
        ring = self._ring
        assert ring is not None and self._topo is not None
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
                self._gone.add(rank)
                ring.drop_reader(rank)
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

    def _await_readers(self, *, window: bool = True) -> None:
        """Wait until every reader said HELLO and (``window``) none lags ``slots`` behind."""
        self._pump()
        topo, hub = self._topo, self._hub
        assert topo is not None and hub is not None
        slots = self.config.slots

        def waiting() -> list[int]:
            live = [r for r in topo.readers if r not in self._gone]
            late = [r for r in live if r not in self._hello]
            if late or not window:
                return late
            return [r for r in live if self._seq - self._acked[r] >= slots]

        def handle(msg: wire.Message, rank: int | None) -> bool:
            self._handle(msg, rank)
            return not waiting()

        if waiting():
            t0 = time.perf_counter()
            hub.wait(
                handle,
                lambda: [self._peer(r) for r in waiting()],
                timeout=self.config.timeout,
                doing=f"waiting for followers to take batch {self._seq}",
            )
            self._stats["wait_readers_ms_total"] += (time.perf_counter() - t0) * 1e3

    def _await_attach(self) -> None:
        """Before unlinking at close: let readers open the segments they were told about.

        A reader maps a slot by name, so a name unlinked before a lagging
        reader opened it would make that reader fail. Bounded by
        ``CLOSE_WAIT_S``; readers that said BYE or died are not waited for.
        """
        ring, hub = self._ring, self._hub
        assert ring is not None and hub is not None

        def waiting() -> list[int]:
            return sorted(ring.unattached() - self._gone)

        def handle(msg: wire.Message, rank: int | None) -> bool:
            self._handle(msg, rank)
            return not waiting()

        self._pump()
        if not waiting():
            return
        try:
            hub.wait(
                handle,
                lambda: [self._peer(r) for r in waiting()],
                timeout=min(self.config.timeout, CLOSE_WAIT_S),
                doing="closing: waiting for followers to map the last batches",
            )
        except PeerLostError as exc:
            log.warning("shmloader: closing without every follower's last batch: %s", exc)

    def _peer(self, rank: int) -> Peer:
        assert self._topo is not None
        f = self._topo.fact(rank)
        return Peer(rank, self._topo.role(rank), f.pid, f.start)

    # -- node leader ---------------------------------------------------------

    def _relay_iteration(self, it: int) -> Iterator[Any]:
        try:
            yield from self._relay(it)
        except GeneratorExit:
            raise
        except LeaderError:
            raise  # already forwarded to this node's readers
        except BaseException as exc:  # e.g. the broadcast broke: tell our readers
            self._fail(it, exc)
            raise

    def _relay(self, it: int) -> Iterator[Any]:
        xnode, ring = self._xnode, self._ring
        assert xnode is not None and ring is not None
        steps = 0
        while True:
            kind, _leader_it, nbytes, meta, draws, crc = xnode.receive_header()
            if kind == KIND_END:
                self._await_readers(window=False)
                self._tell_readers(wire.frames(Kind.END, it=it, steps=steps, draws=draws))
                rng.mirror_draws(draws)
                self._exhausted = True
                return
            if kind in (KIND_ERROR, KIND_STOP):
                body = _json_body(meta)
                if kind == KIND_STOP:
                    reason = str(body.get("reason", ""))
                    self._tell_readers(wire.frames(Kind.STOP, reason=reason), best_effort=True)
                    log.warning("shmloader: the leader stopped: %s", body.get("reason"))
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
            t1 = time.perf_counter_ns()
            seq = self._seq
            self._announce(it, meta, nbytes, slot, draws, t1 - t0, crc)
            if slot is not None:
                view = slot.segment.map_private(nbytes)
                item = (slot.index, slot.gen)
                weakref.finalize(view, self._self_releases.append, item)
                payload = np.frombuffer(view, dtype=np.uint8, count=nbytes)
                del view
            else:
                payload = np.empty(0, np.uint8)
            batch = codec.decode(meta, payload, allow_pickle=self.config.allow_pickle)
            del payload
            if self.config.copy:
                batch = _owned_copy(batch)
            rng.mirror_draws(draws)
            steps += 1
            self._delivered += 1
            self._stats["received"] += 1
            self._stats["receive_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
            self._stats["last_seq"] = seq
            yield batch

    # -- follower ------------------------------------------------------------

    def _flush_releases(self) -> None:
        spoke = self._spoke
        assert spoke is not None
        while self._releases:
            index, gen, seq = self._releases.popleft()
            spoke.send(wire.frames(Kind.RELEASE, seq, rank=self._me, slot=index, gen=gen))

    def _next_event(self, it: int) -> wire.Message:
        """The next message of iteration ``it`` (NOTE [iteration numbers])."""
        spoke, topo = self._spoke, self._topo
        assert spoke is not None and topo is not None
        self._flush_releases()
        if self._stash is not None:
            msg, self._stash = self._stash, None
            if self._current(msg, it):
                return msg
        found: list[wire.Message] = []

        def handle(msg: wire.Message, _rank: int | None) -> bool:
            if msg.kind == Kind.RETIRE:
                self._reader.forget(msg["seg"])  # type: ignore[union-attr]
                return False
            if self._current(msg, it):
                found.append(msg)
                return True
            return False

        writer = topo.writer
        peer = self._peer(writer)
        t0 = time.perf_counter()
        spoke.wait(
            handle,
            lambda: [peer],
            timeout=self.config.timeout,
            doing=f"waiting for batch {self._delivered} of iteration {it}",
        )
        self._stats["wait_ms_total"] += (time.perf_counter() - t0) * 1e3
        return found[0]

    def _current(self, msg: wire.Message, it: int) -> bool:
        """Whether ``msg`` belongs to iteration ``it``; stale batches are released here."""
        msg_it = msg.body.get("it", it)
        if msg.kind == Kind.STOP or msg_it == it:
            return True
        if msg_it > it:  # the writer moved on: end ours, keep the message for the next
            self._stash = msg
            return True
        if msg.kind == Kind.BATCH:  # an earlier iteration's batch we will never use
            spoke = self._spoke
            assert spoke is not None
            spoke.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
            if msg["slot"] >= 0:
                self._attach(msg["seg"])
                spoke.send(
                    wire.frames(
                        Kind.RELEASE, msg.seq, rank=self._me, slot=msg["slot"], gen=msg["gen"]
                    )
                )
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
            self._spoke.send(wire.frames(Kind.ATTACHED, rank=self._me, seg=seg))

    def _follower_iteration(self, it: int) -> Iterator[Any]:
        reader, spoke = self._reader, self._spoke
        assert reader is not None and spoke is not None
        while True:
            msg = self._next_event(it)
            if msg is self._stash:  # a later iteration started: ours is over
                return
            if msg.kind == Kind.END:
                rng.mirror_draws(msg["draws"])
                self._exhausted = True
                return
            if msg.kind == Kind.STOP:
                log.warning("shmloader: the leader stopped: %s", msg["reason"])
                return
            if msg.kind == Kind.ERROR:
                raise _leader_error(msg.body, self._topo.leader if self._topo else None)
            if msg.kind != Kind.BATCH:
                log.warning("shmloader: unexpected %s from the writer; ignored", msg.kind.name)
                continue
            t0 = time.perf_counter_ns()
            nbytes = msg["nbytes"]
            spoke.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
            if nbytes:
                self._attach(msg["seg"])
                item = (msg["slot"], msg["gen"], msg.seq)
                payload = reader.view(
                    msg["seg"], nbytes, functools.partial(self._releases.append, item)
                )
                if msg["crc"] >= 0:
                    _check_crc(payload, msg["crc"], msg.seq)
            else:
                payload = np.empty(0, np.uint8)
            batch = codec.decode(msg.blob, payload, allow_pickle=self.config.allow_pickle)
            del payload
            if self.config.copy:
                batch = _owned_copy(batch)
            rng.mirror_draws(msg["draws"])
            self._delivered += 1
            self._stats["received"] += 1
            self._stats["receive_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
            self._stats["receive_ms_last"] = (time.perf_counter_ns() - t0) / 1e6
            self._report()
            yield batch


# ------------------------------------------------------------------ helpers


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


STATE_FORMAT = "shmloader.state/1"
#: Seconds between two progress reports to the daemon.
REPORT_EVERY_S = 1.0
#: Longest a writer's close() waits for readers to map what it announced.
CLOSE_WAIT_S = 10.0


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
        for key in ("world", "sp", "sp_rank", "group")
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
    """Replace shared views by owned copies (``SHMLOADER_COPY=1``)."""
    memo: dict[int, Any] = {}

    def clone(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor | np.ndarray):
            if id(obj) not in memo:
                memo[id(obj)] = obj.clone() if isinstance(obj, torch.Tensor) else obj.copy()
            return memo[id(obj)]
        if isinstance(obj, list):
            return [clone(v) for v in obj]
        if type(obj) is tuple:
            return tuple(clone(v) for v in obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(clone(v) for v in obj))
        if isinstance(obj, dict):
            return {k: clone(v) for k, v in obj.items()}
        if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
            new = copy.copy(obj)
            for name in obj.__dataclass_fields__:
                object.__setattr__(new, name, clone(getattr(obj, name)))
            return new
        return obj

    return clone(batch)


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
    return (
        body if isinstance(body, dict) else {"type": "ProtocolError", "message": repr(meta[:200])}
    )


def _error_fields(body: dict) -> dict:
    return {
        "it": int(body.get("it", 0)),
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


def _close_quietly(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        with contextlib.suppress(Exception):
            close()

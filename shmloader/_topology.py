"""Who is where: node identity, roles in an SP group, and the set-up exchange.

It owns the facts each rank shares (``RankFacts``), the node claim and the probe
segments with their life locks that decide which ranks share a ``/dev/shm``
(host names lie), ``GroupTopology`` (the leader, each node's writer and readers)
and the all-gathers of bytes (no pickle) of the set-up; how nodes are decided is
in docs/internals/flow.md. It touches only its own probe segment and runtime
directory, and imports only the node layer, ``channel``'s ``Peer`` and
``errors``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._node import reaping, segment
from ._node.rundir import make_private_dir, remove_private_dir, socket_path
from ._node.segment import KIND_PROBE, PREFIX, Segment, ring_dir
from ._transport.channel import Peer
from .errors import ProtocolError, TopologyMismatchError

_LEN = struct.Struct("<q")


@dataclass(frozen=True)
class RankFacts:
    """What one rank tells its group at set-up."""

    rank: int
    pid: int
    start: int
    host: str
    claim: str
    token: str
    probe: str = ""  # name of this rank's probe segment (random part included)
    pidns: int = 0  # inode of this rank's pid namespace (0: unknown)
    rundir: str = ""  # this rank's private runtime directory (NOTE [private runtime directory])

    def to_json(self) -> dict:
        return self.__dict__.copy()


class _Held:
    """What a topology holds open: our locked probe, peers' probes, our runtime dir.

    Released by ``GroupTopology.close`` or when the topology is garbage, only in
    the process that made it (NOTE [creator-only cleanup]).
    """

    def __init__(self, probe: Segment, rundir: str) -> None:
        self.probe = probe
        self.rundir = rundir
        self.peers: dict[int, Segment] = {}
        self.creator = os.getpid()
        _ALL_HELD.add(self)

    def free(self) -> None:
        if os.getpid() != self.creator:
            return
        for seg in [self.probe, *self.peers.values()]:
            seg.unlink()
            seg.close()
        self.peers.clear()
        if self.rundir:
            remove_private_dir(self.rundir, self.creator)


_ALL_HELD: weakref.WeakSet[_Held] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child: close our copies of the probe descriptors.

    A ``flock`` lives until every descriptor of its open file is closed; a
    child (a DataLoader worker) that kept its copy would keep its parent's
    life lock held after the parent died.
    """
    for held in list(_ALL_HELD):
        for seg in [held.probe, *held.peers.values()]:
            with contextlib.suppress(OSError):
                seg.close()


os.register_at_fork(after_in_child=_drop_inherited_locks)


@dataclass(frozen=True)
class GroupTopology:
    """The roles of one SP group, as seen from ``me``.

    ``nodes[0]`` is the leader's node; inside each node the first rank is the
    node's writer (the leader itself on ``nodes[0]``).
    """

    me: int
    ranks: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...]
    facts: tuple[RankFacts, ...]
    held: _Held | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.held is not None:
            weakref.finalize(self, self.held.free)

    def close(self) -> None:
        """Drop the life lock and the peers' probes, remove our runtime directory."""
        if self.held is not None:
            self.held.free()

    @property
    def leader(self) -> int:
        return self.nodes[0][0]

    @property
    def is_leader(self) -> bool:
        return self.me == self.leader

    @property
    def node(self) -> tuple[int, ...]:
        return next(n for n in self.nodes if self.me in n)

    @property
    def writer(self) -> int:
        """The rank that writes this rank's node ring."""
        return self.node[0]

    @property
    def is_writer(self) -> bool:
        return self.me == self.writer

    @property
    def node_leaders(self) -> tuple[int, ...]:
        return tuple(n[0] for n in self.nodes)

    @property
    def readers(self) -> tuple[int, ...]:
        """Ranks of this node that map slots of its ring (all but the writer)."""
        return self.node[1:]

    def fact(self, rank: int) -> RankFacts:
        return next(f for f in self.facts if f.rank == rank)

    @property
    def socket_path(self) -> str:
        """The socket of this rank's node writer (in the writer's private directory)."""
        return socket_path(self.fact(self.writer).rundir)

    def peer(self, rank: int) -> Peer:
        """``rank`` as a process we can wait on (NOTE [liveness across pid namespaces])."""
        f = self.fact(rank)
        probe = self.held.peers.get(rank) if self.held is not None else None
        return Peer(
            rank,
            self.role(rank),
            f.pid,
            f.start,
            pidns=f.pidns,
            life_fd=probe.fd if probe is not None else None,
        )

    @property
    def ring_token(self) -> str:
        """Token of this node's ring: the writer's random token."""
        return self.fact(self.writer).token

    def role(self, rank: int | None = None) -> str:
        rank = self.me if rank is None else rank
        if rank == self.leader:
            return "leader"
        if rank in self.node_leaders:
            return "node leader"
        return "follower"


def node_claim(override: str | None) -> str:
    """This rank's claimed node key (how nodes are decided: docs/internals/flow.md)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        st = os.stat(ring_dir())  # the ring directory's filesystem (ringdir)
        shm = f"{st.st_dev:x}:{st.st_ino:x}"
    except OSError:
        shm = "noshm"
    return f"{override or ''}|{boot}|{shm}"


def all_gather_bytes(data: bytes, group: dist.ProcessGroup) -> list[bytes]:
    """All-gather variable-length bytes over a gloo group, without pickle."""
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(t.item()) for t in lengths)
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    bufs = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(bufs, mine, group=group)
    return [bytes(b[: int(n.item())].numpy()) for b, n in zip(bufs, lengths, strict=True)]


def broadcast_bytes(data: bytes | None, src: int, group: dist.ProcessGroup) -> bytes:
    """Broadcast bytes from global rank ``src`` over a gloo group, without pickle."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)[: max(n, 1)]
    else:
        buf = torch.empty(max(n, 1), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf[:n].numpy())


def discover(
    group: dist.ProcessGroup,
    token: str,
    *,
    node_override: str | None,
    runtime_parent: str | None = None,
) -> GroupTopology:
    """Run the set-up exchange over ``group`` (a gloo group) and return the roles.

    Collective over ``group``: every rank of it must call it. Before it
    starts, this rank's dead leftovers are reaped (``reaping.reap_own``).
    """
    reaping.reap_own(runtime_parent)
    me = dist.get_rank()
    ranks = tuple(dist.get_process_group_ranks(group))
    probe = Segment.create_unique(f"/{PREFIX}{token}-probe", KIND_PROBE, token, 0)
    fcntl.flock(probe.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # our life lock: nobody else has it
    held = _Held(probe, "")
    try:
        held.rundir = make_private_dir(runtime_parent)
        mine = RankFacts(
            # segment.MY_START read now, not at import: it is refreshed after a fork
            me,
            os.getpid(),
            segment.MY_START,
            socket.gethostname(),
            node_claim(node_override),
            token,
            probe.name,
            segment.MY_PIDNS,
            held.rundir,
        )
        gathered = all_gather_bytes(json.dumps(mine.to_json()).encode(), group)
        facts = [_parse_facts(raw) for raw in gathered]
        seen = [f.rank for f in facts if f.claim == mine.claim and _can_see(f, me, held)]
        seen_all = [json.loads(raw) for raw in all_gather_bytes(json.dumps(seen).encode(), group)]
        probe.unlink()  # the descriptor (and its life lock) stays
        by_rank = {f.rank: f for f in facts}
        if sorted(by_rank) != sorted(ranks):
            raise TopologyMismatchError(
                f"set-up exchange returned ranks {sorted(by_rank)} for a group of {sorted(ranks)}"
            )
        saw = {f.rank: set(s) for f, s in zip(facts, seen_all, strict=True)}
        nodes = _nodes(sorted(ranks), by_rank, saw)
    except BaseException:
        held.free()
        raise
    leader = min(ranks)
    nodes.sort(key=lambda n: (leader not in n, n[0]))
    node = next(n for n in nodes if me in n)
    for rank in list(held.peers):
        if rank not in node:  # only the ranks of our node are ever waited on by lock
            seg = held.peers.pop(rank)
            seg.close()
    if node[0] != me:  # not a writer: nobody will connect to our directory
        remove_private_dir(held.rundir, held.creator)
        held.rundir = ""
    return GroupTopology(
        me, tuple(sorted(ranks)), tuple(tuple(n) for n in nodes), tuple(facts), held
    )


def _parse_facts(raw: bytes) -> RankFacts:
    try:
        d = json.loads(raw)
        return RankFacts(
            int(d["rank"]),
            int(d["pid"]),
            int(d["start"]),
            str(d["host"]),
            str(d["claim"]),
            str(d["token"]),
            str(d["probe"]),
            int(d["pidns"]),
            str(d["rundir"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"bad set-up facts from a peer: {exc}") from None


def _can_see(f: RankFacts, me: int, held: _Held) -> bool:
    """Whether ``f``'s probe is visible here; keeps it open for liveness when so."""
    if f.rank == me:
        return True
    if not f.probe.startswith(f"/{PREFIX}{f.token}-probe."):
        return False
    try:
        seg = Segment.attach(f.probe, kind=KIND_PROBE, token=f.token)
    except ProtocolError:
        return False
    if seg.header.pid != f.pid:
        seg.close()
        return False
    with contextlib.suppress(KeyError):
        held.peers.pop(f.rank).close()
    held.peers[f.rank] = seg
    return True


def _nodes(
    ranks: Sequence[int], facts: dict[int, RankFacts], saw: dict[int, set[int]]
) -> list[list[int]]:
    """Group ranks into nodes: same claim and mutual visibility, greedily by rank."""
    nodes: list[list[int]] = []
    for r in ranks:
        for node in nodes:
            if facts[node[0]].claim == facts[r].claim and all(
                r in saw[m] and m in saw[r] for m in node
            ):
                node.append(r)
                break
        else:
            nodes.append([r])
    return nodes

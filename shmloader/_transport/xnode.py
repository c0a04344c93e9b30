"""The cross-node path (``CrossNode``): the group leader sends each event (a ``CrossHeader``,
the metadata, the payload) point-to-point to every node leader over the group's gloo
exchange group, and a node leader receives it, the payload straight into the slot of
its own ring it is given. It sends and receives ``wire.CrossHeader`` (the event's
``Kind`` and stamps, checked on arrival), and touches nothing else: the ring and
the stamps are the node writer's (``_roles.node_writer``, which keeps ``position``
current). The messages, and why the path is built this way:
``docs/internals/datapath.md``.
"""

from __future__ import annotations

import json
import threading
import zlib
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .._proto.wire import CrossHeader, Kind
from ..errors import PeerLostError, ProtocolError, ShmLoaderError

#: Longest the leader's ``close()`` waits for node leaders to take its closing STOP
#: (NOTE [closing across nodes]); after it the message stays posted, and is taken when
#: they close.
CLOSE_WAIT_S = 2.0


class Event(NamedTuple):
    """What a node leader received of one event: its header and metadata (the payload follows)."""

    head: CrossHeader
    meta: bytes

    @property
    def nbytes(self) -> int:
        return self.head.nbytes

    @property
    def crc(self) -> int:
        return self.head.crc


def loader_tag(token: str) -> int:
    """The point-to-point tag of one loader's cross-node messages, from its leader's random
    token (every rank of the group knows it): loaders on one group never share a tag."""
    return zlib.crc32(token.encode()) & 0x7FFFFFFF


# NOTE [closing across nodes]
#     A gloo message is delivered only once its peer posts the matching
#     receive, and neither side can cancel or poll its wait: a wait with a
#     timeout that expires closes the pair (every later message between
#     the two ranks fails), so no wait here has one. A posted message that
#     nobody receives blocks nothing else: other tags and the group's
#     collectives pass it (tried on torch's gloo). So the leader's loop,
#     running ahead, may have sent node leaders batches past where their
#     users left, and those sends wait. The rules that keep every message
#     received and no close() waiting for one:
#
#         leader                                node leader
#         ------                                -----------
#         send k    (posted under ``_tx``;      loop: receive k, k+1, ...
#                    its wait is parked)        user leaves: loop halted
#         send k+1  ... waits                   close(): ``NodeLeader`` drains on a
#         close(): STOP {closed} (posted        thread: every event up to the
#                  under ``_tx``, after k+1;    leader's closing STOP, each
#                  ``closed`` refuses later     payload into nothing
#                  sends; waited CLOSE_WAIT_S)
#
#     - every wait of a send or a header receive is *parked*
#       (``Owner.parked``): ``close()`` and ``Producer.settle`` never wait for
#       it; the thread's next step after it is a check, so it ends once its
#       peer takes the message;
#     - the leader's closing STOP is its last message of the loader: posted
#       under the send lock after whatever a loop already posted (gloo keeps
#       one pair's messages of a tag in order), and ``closed`` refuses any
#       send after it;
#     - a node leader's ``close()`` drains up to that STOP on a daemon
#       thread (``NodeLeader.drain``), unless its loop already received it: the
#       leader's sends all complete, and its parked thread ends. An iteration
#       left early is drained by the next one (``NodeLeader._next_event``);
#     - each loader's messages carry their own tag (``loader_tag``), so a
#       receive a closed loader's drain still has posted never takes a later
#       loader's message on the same group; a link that broke ends the drain
#       (the leader died: there is nothing left to receive).
#
#     Until a send completes gloo holds its tensor, a view of the ring slot:
#     the slot's mapping outlives the ring's close (``ring`` closes a mapping
#     with exported views only once they die), never the other way round.


def _wait_all(works: list) -> None:
    for work in works:
        try:
            work.wait()
        except (RuntimeError, dist.DistBackendError):
            return  # the link broke: the node leader is gone, nothing is left to deliver


class CrossNode:
    """The leader's sends to node leaders, and a node leader's receives."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        leader: int,
        node_leaders: tuple[int, ...],
        tag: int = 0,
    ) -> None:
        self.group = group
        self.leader = leader
        #: this loader's messages on the group (``loader_tag``): a node leader's receive
        #: still posted by a closed loader never takes a later loader's on the same group
        self.tag = tag
        self.peers = tuple(r for r in node_leaders if r != leader)
        self.bytes_sent = 0
        #: set when a transfer failed: the link, not the data, is what broke
        self.broken = False
        #: (epoch, pos) stamped on the next header the leader sends
        self.position = (0, 0)
        #: the leader said its closing STOP: no later send (NOTE [closing across nodes])
        self.closed = False
        self._tx = threading.Lock()  # one event's messages posted together, in order
        #: payload bytes of the last header received, not received yet (a node leader's)
        self.owed = 0

    def _failed(self, exc: Exception, who: str) -> PeerLostError:
        self.broken = True
        return PeerLostError(None, who, f"the cross-node transfer failed: {exc}")

    # -- leader ------------------------------------------------------------

    def send(
        self,
        kind: Kind,
        it: int,
        meta: bytes,
        payload: np.ndarray | None = None,
        *,
        draws: int = 0,
        crc: int = -1,
    ) -> None:
        """Send one event to every node leader and wait until each took it (the caller
        parks the wait: NOTE [closing across nodes])."""
        nbytes = 0 if payload is None else payload.nbytes
        head = CrossHeader(kind, it, nbytes, len(meta), draws, crc, *self.position)
        with self._tx:
            if self.closed:
                raise ShmLoaderError("this loader's cross-node link is closed")
            works = self._post(head, meta, payload)
        try:
            for work in works:
                work.wait()
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"node leader(s) {list(self.peers)}") from None
        self.bytes_sent += nbytes * len(self.peers)

    def _post(self, head: CrossHeader, meta: bytes, payload: np.ndarray | None) -> list:
        """Post the event's messages to every node leader (under ``_tx``); their works."""
        tensors = [torch.frombuffer(bytearray(head.pack()), dtype=torch.int64)]
        if meta:
            tensors.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if head.nbytes:
            tensors.append(torch.from_numpy(payload))
        try:
            return [
                dist.isend(t, dst=peer, group=self.group, tag=self.tag)
                for t in tensors
                for peer in self.peers
            ]
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"node leader(s) {list(self.peers)}") from None

    def send_json(self, kind: Kind, it: int, body: dict) -> None:
        self.send(kind, it, json.dumps(body).encode())

    def say_closed(self, it: int) -> None:
        """The leader's last message: STOP {closed}, after everything posted before it
        (NOTE [closing across nodes]). Waits at most ``CLOSE_WAIT_S`` for node leaders
        to take it; never raises."""
        meta = json.dumps({"reason": "the leader closed", "closed": 1}).encode()
        head = CrossHeader(Kind.STOP, it, 0, len(meta), 0, -1, *self.position)
        with self._tx:
            if self.closed or self.broken:
                self.closed = True
                return
            self.closed = True
            try:
                works = self._post(head, meta, None)
            except PeerLostError:
                return
        waiter = threading.Thread(
            target=_wait_all, args=(works,), name="shmloader-xnode-close", daemon=True
        )
        waiter.start()
        waiter.join(CLOSE_WAIT_S)

    # -- node leader ---------------------------------------------------------

    def _recv(self, tensor: torch.Tensor) -> None:
        try:
            dist.recv(tensor, src=self.leader, group=self.group, tag=self.tag)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"leader rank {self.leader}") from None

    def receive_header(self) -> Event:
        """The next event's header and metadata; its payload is ``receive_payload``'s (or
        ``skip_payload``'s: one left owed is skipped here first)."""
        self.skip_payload()
        raw = torch.zeros(len(CrossHeader._fields), dtype=torch.int64)
        self._recv(raw)
        head = CrossHeader.unpack(raw.numpy().tobytes())
        meta = b""
        if head.meta_len:
            buf = torch.empty(head.meta_len, dtype=torch.uint8)
            self._recv(buf)
            meta = buf.numpy().tobytes()
        self.owed = head.nbytes
        return Event(head, meta)

    def receive_payload(self, dest: np.ndarray) -> None:
        """Receive the payload owed straight into ``dest`` (a ring slot's bytes)."""
        if dest.nbytes != self.owed:
            raise ProtocolError(f"a payload of {dest.nbytes} bytes asked, {self.owed} owed")
        self._recv(torch.from_numpy(dest))
        self.owed = 0

    def skip_payload(self) -> None:
        """Receive the payload owed (if any) into nothing: a batch this node will not
        publish, or one a loop left half received (NOTE [closing across nodes])."""
        if self.owed:
            self._recv(torch.empty(self.owed, dtype=torch.uint8))
            self.owed = 0

"""The cross-node path: the group leader sends each event once to every other node.

Each node leader receives the leader's header, metadata and payload
point-to-point over the group's gloo exchange group, the payload straight into
a slot of its own ring, and then announces it on its node exactly as a leader
would. The leader posts the sends to all node leaders at once and waits for
them together, so a batch crosses the network once per node, never once per
rank. ``it``, ``epoch`` and ``pos`` stamp the leader's position (``cursor``,
NOTE [iteration numbers]); the leader's ``Writer`` keeps ``position`` current. Everything
travels as ``uint8``/``int64`` tensors: no pickle, no ``broadcast_object_list``::

    message 1  int64[8]         kind, it, nbytes, meta_len, draws, crc (-1: none), epoch, pos
    message 2  uint8[meta_len]  codec metadata (BATCH) or JSON (ERROR/STOP)
    message 3  uint8[nbytes]    payload, slot to slot (BATCH with nbytes > 0)

Point-to-point on the exchange group rather than a node-leader subgroup: a
subgroup made by the node leaders alone would shift torch's group numbering
on those ranks only, and any later group created with local synchronisation
would then rendezvous under different names on different ranks.

Coexisting with NCCL: the exchange group is gloo over the CPU whatever the
default backend is (``shmloader._setup.build.exchange_group``); the batch stays on the CPU
and training moves it to the GPU afterwards, as it would without shmloader.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist

from .._proto.codec import MAX_META_BYTES
from .._roles.rng import MAX_MIRRORED_DRAWS
from ..errors import PeerLostError, ProtocolError

KIND_BATCH, KIND_END, KIND_ERROR, KIND_STOP = 1, 2, 3, 4
_FIELDS = 8


class CrossNode:
    """The leader's sends to node leaders, and a node leader's receives."""

    def __init__(
        self, group: dist.ProcessGroup, leader: int, node_leaders: tuple[int, ...]
    ) -> None:
        self.group = group
        self.leader = leader
        self.peers = tuple(r for r in node_leaders if r != leader)
        self.bytes_sent = 0
        #: set when a transfer failed: the link, not the data, is what broke
        self.broken = False
        #: (epoch, pos) stamped on the next header the leader sends
        self.position = (0, 0)

    def _failed(self, exc: Exception, who: str) -> PeerLostError:
        self.broken = True
        return PeerLostError(None, who, f"the cross-node transfer failed: {exc}")

    # -- leader ------------------------------------------------------------

    def send(
        self,
        kind: int,
        it: int,
        meta: bytes,
        payload: np.ndarray | None = None,
        *,
        draws: int = 0,
        crc: int = -1,
    ) -> None:
        nbytes = 0 if payload is None else payload.nbytes
        head = [kind, it, nbytes, len(meta), draws, crc, *self.position]
        tensors = [torch.tensor(head, dtype=torch.int64)]
        if meta:
            tensors.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if nbytes:
            tensors.append(torch.from_numpy(payload))
        try:
            works = [
                dist.isend(t, dst=peer, group=self.group) for t in tensors for peer in self.peers
            ]
            for work in works:
                work.wait()
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"node leader(s) {list(self.peers)}") from None
        self.bytes_sent += nbytes * len(self.peers)

    def send_json(self, kind: int, it: int, body: dict) -> None:
        self.send(kind, it, json.dumps(body).encode())

    # -- node leader ---------------------------------------------------------

    def _recv(self, tensor: torch.Tensor) -> None:
        try:
            dist.recv(tensor, src=self.leader, group=self.group)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"leader rank {self.leader}") from None

    def receive_header(self) -> tuple[int, int, int, bytes, int, int, int, int]:
        """(kind, it, nbytes, meta, draws, crc, epoch, pos) of the next event."""
        head = torch.zeros(_FIELDS, dtype=torch.int64)
        self._recv(head)
        kind, it, nbytes, meta_len, draws, crc, epoch, pos = (int(x) for x in head)
        if kind not in (KIND_BATCH, KIND_END, KIND_ERROR, KIND_STOP) or nbytes < 0 or meta_len < 0:
            raise ProtocolError(f"bad cross-node header {head.tolist()}")
        if meta_len > MAX_META_BYTES or not 0 <= draws <= MAX_MIRRORED_DRAWS:
            raise ProtocolError(
                f"cross-node header {head.tolist()} out of bounds: metadata at most "
                f"{MAX_META_BYTES} bytes, draws 0..{MAX_MIRRORED_DRAWS}"
            )
        meta = b""
        if meta_len:
            buf = torch.empty(meta_len, dtype=torch.uint8)
            self._recv(buf)
            meta = buf.numpy().tobytes()
        return kind, it, nbytes, meta, draws, crc, epoch, pos

    def receive_payload(self, dest: np.ndarray) -> None:
        """Receive the payload straight into ``dest`` (a ring slot's bytes)."""
        self._recv(torch.from_numpy(dest))

"""The cross-node path: the group leader broadcasts to one node leader per node.

The node leaders of a group (the group leader included) form a gloo process
group, created once at set-up. For every event the leader broadcasts a fixed
header, then the metadata bytes, then (for a batch) the payload straight out
of its ring slot; each node leader receives the payload straight into a slot
of its own ring and then announces it on its node exactly as a leader would.
Everything travels as ``uint8``/``int64`` tensors: no pickle, no
``broadcast_object_list``::

    broadcast 1  int64[6]   kind, it, nbytes, meta_len, draws, crc (-1: none)
    broadcast 2  uint8[meta_len]   codec metadata (BATCH) or JSON (ERROR/STOP)
    broadcast 3  uint8[nbytes]     payload, slot to slot (BATCH with nbytes > 0)

Coexisting with NCCL: this group is always gloo over the CPU, whatever the
default backend is; the batch stays on the CPU and training moves it to the
GPU afterwards, as it would without shmloader.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist

from .errors import PeerLostError, ProtocolError

KIND_BATCH, KIND_END, KIND_ERROR, KIND_STOP = 1, 2, 3, 4
_FIELDS = 6


class CrossNode:
    """One group's node-leader broadcast. Collective: every node leader calls each step."""

    def __init__(
        self, group: dist.ProcessGroup, leader: int, node_leaders: tuple[int, ...]
    ) -> None:
        self.group = group
        self.leader = leader
        self.node_leaders = node_leaders
        self.bytes_sent = 0

    def _bcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, src=self.leader, group=self.group)
        except (RuntimeError, dist.DistBackendError) as exc:
            others = [r for r in self.node_leaders if r != dist.get_rank()]
            raise PeerLostError(
                None, f"node leader(s) {others}", f"the cross-node broadcast failed: {exc}"
            ) from None

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
        self._bcast(torch.tensor([kind, it, nbytes, len(meta), draws, crc], dtype=torch.int64))
        if meta:
            self._bcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if nbytes:
            self._bcast(torch.from_numpy(payload))
            self.bytes_sent += nbytes

    def send_json(self, kind: int, it: int, body: dict) -> None:
        self.send(kind, it, json.dumps(body).encode())

    # -- node leader ---------------------------------------------------------

    def receive_header(self) -> tuple[int, int, int, bytes, int, int]:
        """(kind, it, nbytes, meta, draws, crc) of the next event."""
        head = torch.zeros(_FIELDS, dtype=torch.int64)
        self._bcast(head)
        kind, it, nbytes, meta_len, draws, crc = (int(x) for x in head)
        if kind not in (KIND_BATCH, KIND_END, KIND_ERROR, KIND_STOP) or nbytes < 0 or meta_len < 0:
            raise ProtocolError(f"bad cross-node header {head.tolist()}")
        meta = b""
        if meta_len:
            buf = torch.empty(meta_len, dtype=torch.uint8)
            self._bcast(buf)
            meta = buf.numpy().tobytes()
        return kind, it, nbytes, meta, draws, crc

    def receive_payload(self, dest: np.ndarray) -> None:
        """Receive the payload straight into ``dest`` (a ring slot's bytes)."""
        self._bcast(torch.from_numpy(dest))

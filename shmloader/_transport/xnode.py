"""The cross-node path (``CrossNode``): the group leader sends each event (a ``Header``,
the metadata, the payload) point-to-point to every node leader over the group's gloo
exchange group, and a node leader receives it, the payload straight into the slot of
its own ring it is given. It owns the header's byte layout (``Header``, ``_HEADER``)
and the one table between ``wire.Kind`` and an event's cross-node code (``CODES``),
reads the codec's and the RNG mirror's bounds, and touches nothing else: the ring and
the stamps are the node writer's (``_roles.node_writer``, which keeps ``position``
current). The messages, and why the path is built this way:
``docs/internals/datapath.md``.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .._proto.codec import MAX_META_BYTES
from .._proto.wire import MAX_MIRRORED_DRAWS, Kind
from ..errors import PeerLostError, ProtocolError

#: The cross-node code of each event kind, the first word of its header on the wire.
#: The one table between ``Kind`` and those bytes: the codes predate ``Kind``'s numbers.
CODES: dict[Kind, int] = {Kind.BATCH: 1, Kind.END: 2, Kind.ERROR: 3, Kind.STOP: 4}
_KINDS = {code: kind for kind, code in CODES.items()}


class Header(NamedTuple):
    """The first message of every cross-node event: ``_HEADER``'s eight int64 words, in order."""

    kind: Kind  # on the wire: CODES[kind]
    it: int
    nbytes: int  # payload bytes (the third message, BATCH only; 0: none)
    meta_len: int  # bytes of the second message: codec metadata (BATCH) or JSON (ERROR, STOP)
    draws: int
    crc: int  # the payload's CRC-32, -1: none
    epoch: int
    pos: int

    def pack(self) -> bytes:
        return _HEADER.pack(CODES[self.kind], *self[1:])

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        """The header in ``raw``; :class:`ProtocolError` unless every field is in bounds."""
        words = _HEADER.unpack(raw)
        code, _it, nbytes, meta_len, draws = words[:5]
        if code not in _KINDS or nbytes < 0 or meta_len < 0:
            raise ProtocolError(f"bad cross-node header {list(words)}")
        if meta_len > MAX_META_BYTES or not 0 <= draws <= MAX_MIRRORED_DRAWS:
            raise ProtocolError(
                f"cross-node header {list(words)} out of bounds: metadata at most "
                f"{MAX_META_BYTES} bytes, draws 0..{MAX_MIRRORED_DRAWS}"
            )
        return cls(_KINDS[code], *words[1:])


#: int64 words in the machine's byte order, as a ``torch.int64`` tensor holds them.
_HEADER = struct.Struct(f"={len(Header._fields)}q")


class Event(NamedTuple):
    """What a node leader received of one event: its header and metadata (the payload follows)."""

    head: Header
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
        nbytes = 0 if payload is None else payload.nbytes
        head = Header(kind, it, nbytes, len(meta), draws, crc, *self.position)
        tensors = [torch.frombuffer(bytearray(head.pack()), dtype=torch.int64)]
        if meta:
            tensors.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if nbytes:
            tensors.append(torch.from_numpy(payload))
        try:
            works = [
                dist.isend(t, dst=peer, group=self.group, tag=self.tag)
                for t in tensors
                for peer in self.peers
            ]
            for work in works:
                work.wait()  # type: ignore[union-attr]  # None only off the group
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"node leader(s) {list(self.peers)}") from None
        self.bytes_sent += nbytes * len(self.peers)

    def send_json(self, kind: Kind, it: int, body: dict) -> None:
        self.send(kind, it, json.dumps(body).encode())

    # -- node leader ---------------------------------------------------------

    def _recv(self, tensor: torch.Tensor) -> None:
        try:
            dist.recv(tensor, src=self.leader, group=self.group, tag=self.tag)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"leader rank {self.leader}") from None

    def receive_header(self) -> Event:
        """The next event's header and metadata; its payload is ``receive_payload``'s."""
        raw = torch.zeros(len(Header._fields), dtype=torch.int64)
        self._recv(raw)
        head = Header.unpack(raw.numpy().tobytes())
        meta = b""
        if head.meta_len:
            buf = torch.empty(head.meta_len, dtype=torch.uint8)
            self._recv(buf)
            meta = buf.numpy().tobytes()
        return Event(head, meta)

    def receive_payload(self, dest: np.ndarray) -> None:
        """Receive the payload straight into ``dest`` (a ring slot's bytes)."""
        self._recv(torch.from_numpy(dest))

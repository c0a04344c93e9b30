"""The datapath's one vocabulary of events, pure: ``Kind`` names every message between a
node's writer and its readers (ZeroMQ) and every event the leader sends node leaders
(four of them: ``CROSS_KINDS``). It owns the node messages' frames (``_HEADER``, the
JSON body, the metadata blob), each kind's body schema (``SCHEMA``), the cross-node
events' header (``CrossHeader``: eight words, the first the event's ``Kind``) and the
check of what arrives (``parse``, ``CrossHeader.unpack``: a
:class:`~shmloader.errors.ProtocolError` for anything malformed, which receivers log
and drop), and touches no socket and no shared memory. The table of kinds, directions
and fields, and what the stamps mean: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ProtocolError

MAGIC = b"SL"
VERSION = 1
_HEADER = struct.Struct("<2sBBQ")  # frame 0: magic b"SL", version, kind, seq
MAX_BODY = 1 << 20
MAX_BLOB = 64 << 20
#: A draw count (32-bit words of the default generator) is given up past this many
#: between two snapshots (NOTE [counting words] in ``_rng``).
MAX_COUNTED_DRAWS = 1 << 24
#: Most words one message can carry: an ``iter()`` and a ``next()``, each counted.
MAX_MIRRORED_DRAWS = 2 * MAX_COUNTED_DRAWS


class Kind(enum.IntEnum):
    """What a message or a cross-node event is: the header's kind byte of a node message."""

    HELLO = 1
    BATCH = 2
    ACK = 3
    RELEASE = 4
    ATTACHED = 5
    END = 6
    ERROR = 7
    STOP = 8
    BYE = 9
    RETIRE = 10


_STR, _INT = str, int
SCHEMA: dict[Kind, dict[str, type]] = {
    Kind.HELLO: {"rank": _INT, "pid": _INT, "start": _INT},
    Kind.BATCH: {
        "it": _INT,
        "epoch": _INT,
        "pos": _INT,
        "slot": _INT,
        "gen": _INT,
        "seg": _STR,
        "nbytes": _INT,
        "draws": _INT,
        "crc": _INT,
    },
    Kind.ACK: {"rank": _INT},
    Kind.RELEASE: {"rank": _INT, "slot": _INT, "gen": _INT},
    Kind.ATTACHED: {"rank": _INT, "seg": _STR},
    Kind.END: {"it": _INT, "epoch": _INT, "pos": _INT, "draws": _INT},
    Kind.ERROR: {"it": _INT, "type": _STR, "message": _STR, "traceback": _STR},
    Kind.STOP: {"it": _INT, "epoch": _INT, "pos": _INT, "reason": _STR, "closed": _INT},
    Kind.BYE: {"rank": _INT},
    Kind.RETIRE: {"seg": _STR},
}


@dataclass(frozen=True)
class Message:
    kind: Kind
    seq: int
    body: dict[str, Any]
    blob: bytes = b""

    def __getitem__(self, key: str) -> Any:
        return self.body[key]


def frames(kind: Kind, seq: int = 0, blob: bytes | memoryview | None = None, **body: Any) -> list:
    """Encode a message as ZeroMQ frames, checking the body against the schema."""
    _check_body(kind, body)
    out: list = [_HEADER.pack(MAGIC, VERSION, int(kind), seq), json.dumps(body).encode()]
    if blob is not None:
        out.append(blob)
    return out


def parse(parts: list[bytes]) -> Message:
    """Decode and validate received frames; :class:`ProtocolError` if malformed."""
    if not 2 <= len(parts) <= 3:
        raise ProtocolError(f"message of {len(parts)} frames; expected 2 or 3")
    header, body_raw = parts[0], parts[1]
    if len(header) != _HEADER.size:
        raise ProtocolError(f"header of {len(header)} bytes; expected {_HEADER.size}")
    magic, version, kind_raw, seq = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"message version {version}; this build speaks {VERSION}")
    try:
        kind = Kind(kind_raw)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_raw}") from None
    if len(body_raw) > MAX_BODY:
        raise ProtocolError(f"body of {len(body_raw)} bytes exceeds {MAX_BODY}")
    try:
        body = json.loads(bytes(body_raw))
    except (ValueError, RecursionError) as exc:  # ValueError: also ints of > 4300 digits
        raise ProtocolError(f"{kind.name} body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.name} body is a {type(body).__name__}, not an object")
    _check_body(kind, body)
    blob = bytes(parts[2]) if len(parts) == 3 else b""
    if len(blob) > MAX_BLOB:
        raise ProtocolError(f"blob of {len(blob)} bytes exceeds {MAX_BLOB}")
    if kind == Kind.BATCH and (body["nbytes"] < 0 or body["slot"] < -1 or body["gen"] < 0):
        raise ProtocolError(f"BATCH with negative sizes: {body}")
    return Message(kind, seq, body, blob)


def _check_body(kind: Kind, body: dict[str, Any]) -> None:
    schema = SCHEMA[kind]
    for name, typ in schema.items():
        value = body.get(name)
        if type(value) is not typ:
            raise ProtocolError(
                f"{kind.name}.{name} is {type(value).__name__} {value!r:.40}; "
                f"expected {typ.__name__}"
            )


#: The kinds of the events the leader sends node leaders (``_transport.xnode``).
CROSS_KINDS = frozenset({Kind.BATCH, Kind.END, Kind.ERROR, Kind.STOP})


class CrossHeader(NamedTuple):
    """The first message of every cross-node event: ``_CROSS``'s eight int64 words, in
    order, the first the event's ``Kind`` (one vocabulary on both paths)."""

    kind: Kind
    it: int
    nbytes: int  # payload bytes (the third message, BATCH only; 0: none)
    meta_len: int  # bytes of the second message: codec metadata (BATCH) or JSON (ERROR, STOP)
    draws: int
    crc: int  # the payload's CRC-32, -1: none
    epoch: int
    pos: int

    def pack(self) -> bytes:
        return _CROSS.pack(*self)

    @classmethod
    def unpack(cls, raw: bytes) -> CrossHeader:
        """The header in ``raw``; :class:`ProtocolError` unless every field is in bounds."""
        words = _CROSS.unpack(raw)
        code, _it, nbytes, meta_len, draws = words[:5]
        if code not in CROSS_KINDS or nbytes < 0 or meta_len < 0:
            raise ProtocolError(f"bad cross-node header {list(words)}")
        if meta_len > MAX_BLOB or not 0 <= draws <= MAX_MIRRORED_DRAWS:
            raise ProtocolError(
                f"cross-node header {list(words)} out of bounds: metadata at most "
                f"{MAX_BLOB} bytes, draws 0..{MAX_MIRRORED_DRAWS}"
            )
        return cls(Kind(code), *words[1:])


#: int64 words in the machine's byte order, as a ``torch.int64`` tensor holds them.
_CROSS = struct.Struct(f"={len(CrossHeader._fields)}q")

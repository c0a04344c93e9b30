"""Signalling messages between the ranks of one group on one node. Pure.

Every message is a ZeroMQ multipart message of two or three frames::

    frame 0  header  struct "<2sBBQ"   magic b"SL", version, kind, seq
    frame 1  body    UTF-8 JSON object, the kind's fields (schema below)
    frame 2  blob    optional bytes: the codec's batch metadata (BATCH only)

Payload bytes never travel here: a BATCH names the slot that holds them.

    kind      direction  body fields
    HELLO     R -> W     rank, pid, start
    BATCH     W -> R     it, epoch, pos, slot, gen, seg, nbytes, draws, crc   (+ blob: metadata)
    ACK       R -> W     rank                    (seq: the batch received)
    RELEASE   R -> W     rank, slot, gen         (seq: the batch dropped)
    ATTACHED  R -> W     rank, seg
    END       W -> R     it, epoch, pos, draws   (the leader's iterator ended after pos batches)
    ERROR     W -> R     it, type, message, traceback           (readers ACK it: seq)
    STOP      W -> R     it, epoch, pos, reason, closed         (readers ACK it: seq)
                                      (KeyboardInterrupt/SystemExit in the leader's loader,
                                       or closed=1: the writer closed)
    BYE       R -> W     rank                    (a reader closes)
    RETIRE    W -> R     seg                     (the writer retired that slot segment:
                                                  NOTE [retired slots] in ring)

Every writer message is stamped with the writer's position: ``it`` numbers its
``iter()`` calls, ``epoch`` is its ``set_epoch`` value and ``pos`` the batch's
index in that epoch (resumed cursors included). A reader drops what belongs to
an earlier iteration and refuses, with a typed error naming both positions,
anything that shows the ranks iterate differently (``loader``, NOTE
[iteration numbers]). ERROR and STOP carry as ``seq`` the writer's next batch
number; readers ACK that number, so the writer knows its last word arrived
before its process may exit. ``draws`` is the number of
default-generator draws the leader's loader made (see ``rng``). ``crc`` is the
payload's CRC-32 with ``SHMLOADER_VERIFY=1``, else -1. A BATCH of a slot
that DataLoader workers write also carries ``rel`` (the pool control
segment's name) and ``tk`` (the batch's ticket): where and what the reader
stores once its view is gone (NOTE [release words] in ``release``); a
malformed pair only means the reader releases by RELEASE alone.

``parse`` checks magic, version, kind and every field's type, and raises
:class:`~shmloader.errors.ProtocolError` on anything else; receivers log and
drop such messages (they never crash on them).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError

MAGIC = b"SL"
VERSION = 1
_HEADER = struct.Struct("<2sBBQ")
MAX_BODY = 1 << 20
MAX_BLOB = 64 << 20


class Kind(enum.IntEnum):
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

"""The control protocol of shmloaderd, version 1.

Pure: bytes in, dicts out. It owns the wire format (one frame, one UTF-8 JSON
object each way, at most ``MAX_REQUEST`` bytes, never pickle), every op and its
fields (``OPS``; the table is in docs/internals/wire.md), and ``parse``,
``encode`` and ``error``: a missing or mistyped field, an unknown op or another
``v`` is an ``ok: false`` answer, unknown fields are ignored. It touches no
socket and no file; the transport (ZeroMQ over ``ipc://``, peers by
``SO_PEERCRED``) is the server's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from shmloader._node.segment import PREFIX
from shmloader._proto.waits import NBUCKETS, valid_counts
from shmloader._transport.daemon_client import MAX_REQUEST, PROTOCOL_VERSION
from shmloader.errors import ProtocolError

VERSION = PROTOCOL_VERSION
TOKEN_RE = re.compile(r"^[0-9A-Za-z]{1,16}$")
_SUFFIX_RE = re.compile(r"^[0-9A-Za-z_.]{1,64}$")
MAX_RANKS = 1 << 20
MAX_LIST = 4096

Check = Callable[[Any, str], Any]


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{where} must be an integer, got {type(value).__name__}")
    if not 0 <= value < 1 << 63:
        raise ProtocolError(f"{where}={value} is out of range (0 .. 2**63-1)")
    return value


def _number(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ProtocolError(f"{where} must be a number, got {type(value).__name__}")
    if not 0 <= value < 1e18:
        raise ProtocolError(f"{where}={value} is out of range")
    return float(value)


def _token(value: Any, where: str) -> str:
    if not isinstance(value, str) or not TOKEN_RE.match(value):
        raise ProtocolError(f"{where}={value!r:.40} is not a ring token (1-16 letters or digits)")
    return value


def _ranks(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise ProtocolError(f"{where} must be a list of at most {MAX_LIST} ranks")
    return [_int(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _pids(value: Any, where: str) -> dict[int, tuple[int, int]]:
    """``{rank: [pid, start]}`` (namespaces, a third element, go to ``pids_ns``)."""
    if not isinstance(value, dict) or len(value) > MAX_LIST:
        raise ProtocolError(f"{where} must be an object {{rank: [pid, start, pidns?]}}")
    out = {}
    for key, pair in value.items():
        if not isinstance(key, str) or not key.isdigit():
            raise ProtocolError(f"{where} key {key!r:.20} is not a rank number")
        if not isinstance(pair, list) or len(pair) not in (2, 3):
            raise ProtocolError(f"{where}[{key}] must be [pid, start] or [pid, start, pidns]")
        out[int(key)] = (_int(pair[0], f"{where}[{key}][0]"), _int(pair[1], f"{where}[{key}][1]"))
    return out


def _pid_namespaces(value: dict) -> dict[int, int]:
    """The third elements of a checked ``pids`` object: {rank: pidns}."""
    return {
        int(k): _int(pair[2], f"pids[{k}][2]")
        for k, pair in value.items()
        if len(pair) == 3 and pair[2]
    }


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > 128 or not value.isprintable():
        raise ProtocolError(f"{where} must be a printable string of at most 128 characters")
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{where} must be true or false, got {type(value).__name__}")
    return value


def _role(value: Any, where: str) -> str:
    if value not in ("leader", "node leader", "follower"):
        raise ProtocolError(f'{where}={value!r:.20} must be "leader", "node leader" or "follower"')
    return value


def _wait_hist(value: Any, where: str) -> list[int]:
    if not valid_counts(value):
        raise ProtocolError(
            f"{where} must be a list of {NBUCKETS} counts (integers >= 0), one per wait bucket"
        )
    return value


def _share(value: Any, where: str) -> float:
    share = _number(value, where)
    if share > 1.0:
        raise ProtocolError(f"{where}={value} must be a fraction between 0 and 1")
    return share


def segment_name(token: str, value: Any, where: str) -> str:
    """Check that ``value`` names a segment of ring ``token``."""
    prefix = f"/{PREFIX}{token}-"
    if not isinstance(value, str) or not value.startswith(prefix):
        raise ProtocolError(f"{where}={value!r:.80} is not a segment of ring {token} ({prefix}*)")
    if not _SUFFIX_RE.match(value[len(prefix) :]):
        raise ProtocolError(f"{where}={value!r:.80} has an invalid suffix")
    return value


def _action(value: Any, where: str) -> str:
    if value not in ("add", "remove"):
        raise ProtocolError(f'{where}={value!r:.20} must be "add" or "remove"')
    return value


def _segments(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise ProtocolError(f"{where} must be a list of at most {MAX_LIST} {{name, bytes}}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ProtocolError(f"{where}[{i}] must be an object {{name, bytes}}")
    return value  # names are checked against the token in ``parse``


# op -> field -> (check, required)
OPS: dict[str, dict[str, tuple[Check, bool]]] = {
    "hello": {"pid": (_int, False)},
    "register": {
        "token": (_token, True),
        "group": (_ranks, True),
        "pids": (_pids, True),
        "node": (_ranks, False),
        "leader": (_int, False),
        "writer": (_int, False),
        "world": (_int, False),
        "segments": (_segments, False),
        "job": (_text, False),
    },
    "segment": {
        "token": (_token, True),
        "action": (_action, True),
        "name": (lambda v, w: v, True),
        "bytes": (_int, False),
    },
    "admit": {
        "token": (_token, True),
        "bytes": (_int, True),
        "pid": (_int, False),
        "start": (_int, False),
        "pidns": (_int, False),
        "shm_dir": (_text, False),  # the ring directory (NOTE [watched ring directories])
    },
    "report": {
        "token": (_token, True),
        "rank": (_int, True),
        "published": (_int, False),
        "consumed": (_int, False),
        "receive_ms": (_number, False),
        "lag": (_int, False),
        "role": (_role, False),
        "wait_ms_p50": (_number, False),
        "wait_ms_p95": (_number, False),
        "wait_ms_p99": (_number, False),
        "wait_share": (_share, False),
        "wait_hist": (_wait_hist, False),
        "wait_ms_sum": (_number, False),
        "bytes": (_int, False),
        "device": (_text, False),
        "device_batches": (_int, False),
        "device_bytes": (_int, False),
        "device_copy_ms_total": (_number, False),
        "device_registered": (_flag, False),
        "device_registration_refused": (_text, False),
    },
    "unregister": {"token": (_token, True)},
    "stats": {},
    "adopt": {
        "token": (_token, True),
        "name": (lambda v, w: v, True),
        "bytes": (_int, True),
        "pid": (_int, True),
        "start": (_int, True),
        "pidns": (_int, False),
        "shm_dir": (_text, False),  # the adopter's ring directory (ringdir)
    },
}


def parse(raw: bytes) -> tuple[str, dict[str, Any]]:
    """Decode and validate one request frame: ``(op, fields)``; ProtocolError if bad."""
    if len(raw) > MAX_REQUEST:
        raise ProtocolError(f"request of {len(raw)} bytes exceeds the {MAX_REQUEST}-byte limit")
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request is not UTF-8 JSON ({exc})") from None
    except RecursionError:
        raise ProtocolError("request JSON is nested too deeply") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"request must be a JSON object, got {type(msg).__name__}")
    version = msg.get("v")
    if version != VERSION:
        raise ProtocolError(
            f"request version v={version!r:.20}; this shmloaderd speaks v={VERSION} "
            "(upgrade the older of shmloader and shmloaderd)"
        )
    op = msg.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op {op!r:.40}; known ops: {', '.join(sorted(OPS))}")
    fields: dict[str, Any] = {}
    for name, (check, required) in OPS[op].items():
        if name not in msg or msg[name] is None:
            if required:
                raise ProtocolError(f"op {op!r} needs field {name!r}")
            continue
        fields[name] = check(msg[name], name)
    if "pids" in fields:
        fields["pids_ns"] = _pid_namespaces(msg["pids"])
    if "name" in fields:
        fields["name"] = segment_name(fields["token"], fields["name"], "name")
    if "segments" in fields:
        fields["segments"] = {
            segment_name(fields["token"], s.get("name"), f"segments[{i}].name"): _int(
                s.get("bytes", 0), f"segments[{i}].bytes"
            )
            for i, s in enumerate(fields["segments"])
        }
    return op, fields


def encode(reply: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **reply}, separators=(",", ":")).encode()


def error(message: str) -> bytes:
    return encode({"ok": False, "error": message})

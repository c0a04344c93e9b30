"""ERROR and STOP bodies: what the leader says of an error, and what a reader raises.

Owns the JSON body of an error (type, message, traceback, iteration) built
from an exception, its reading from untrusted bytes, and the typed error a
reader raises for it; pure, no I/O.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from ..errors import LeaderError, PeerLostError, ShmLoaderError


def json_body(meta: bytes) -> dict:
    try:
        body = json.loads(meta)
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    if isinstance(body, dict):
        return body
    return {"type": "ProtocolError", "message": repr(meta[:200])}


def error_body(it: int, exc: BaseException) -> dict[str, Any]:
    return {
        "it": it,
        "type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def error_fields(body: dict) -> dict:
    return {
        "it": int(body.get("it", 0)) if isinstance(body.get("it", 0), int) else 0,
        "type": str(body.get("type", "Exception")),
        "message": str(body.get("message", "")),
        "traceback": str(body.get("traceback", "")),
    }


def leader_error(body: dict, leader: int | None) -> ShmLoaderError:
    """The error a reader raises for the leader's ERROR message.

    A peer lost by the leader is a peer lost by the whole group: readers raise
    ``PeerLostError`` with the leader's account. Anything else the leader's
    loader raised becomes ``LeaderError`` carrying type, message and traceback.
    """
    f = error_fields(body)
    if f["type"] == "PeerLostError":
        return PeerLostError(None, "peer", f"the leader (rank {leader}) reported: {f['message']}")
    return LeaderError(f["type"], f["message"], f["traceback"], leader_rank=leader)

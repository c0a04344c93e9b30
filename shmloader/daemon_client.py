"""The library's side of the ``shmloaderd`` control socket. Optional by design.

When ``SHMLOADER_DAEMON`` names the daemon's control socket, the writer of
each ring tells the daemon what it creates so that the node's shared-memory
budget is enforced and a crashed job's leftovers are reaped. Without a
daemon, or when it is unreachable, everything runs embedded: ``connect()``
returns False (logged once per process) and every other call is a no-op.

Wire format (protocol version 1; the daemon's ``shmloaderd.protocol`` has the
full table of ops and fields)::

    client (REQ)                          shmloaderd (ROUTER)
    one frame: UTF-8 JSON object   --->   {"v": 1, "op": "<op>", ...fields}
    one frame: UTF-8 JSON object   <---   {"v": 1, "ok": true, ...results}
                                          {"v": 1, "ok": false, "error": "..."}

No pickle, ever; a request is at most ``MAX_REQUEST`` bytes.

Client state machine (zero is invalid)::

              connect(): hello answered
    NEW ----------------------------------> UP
     |                                      |  a call timed out / socket error
     | connect(): no answer                 v
     +----------------------------------> DOWN  (every call is a no-op, logged once)

A daemon that is SIGKILLed mid-job therefore costs one bounded wait
(``timeout``), never an exception. The only exception a call raises on
purpose is :class:`~shmloader.errors.ShmCapacityError`, from ``admit`` when
the daemon refuses an allocation over the node budget.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import zmq

from . import segment
from .errors import ShmCapacityError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Largest request the daemon accepts (bytes of JSON).
MAX_REQUEST = 1 << 20
#: Default control socket of a system-wide daemon (systemd RuntimeDirectory).
DEFAULT_SOCKET = "/run/shmloader/control.sock"

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str, *args: object) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


class DaemonClient:
    """A bounded-time client of one ``shmloaderd`` control socket.

    Thread-safe (one request at a time). Every method but ``admit`` and
    ``connect`` returns quietly whatever happens to the daemon.
    """

    NEW, UP, DOWN = "new", "up", "down"

    def __init__(self, path: str, timeout: float = 1.0) -> None:
        self.path = path
        self.timeout = float(timeout)
        self.state = self.NEW
        self.daemon_info: dict[str, Any] = {}
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._ctx: zmq.Context | None = None

    # ------------------------------------------------------------ transport

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context.instance()
            sock = self._ctx.socket(zmq.REQ)
            ms = max(1, int(self.timeout * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, ms)
            sock.setsockopt(zmq.SNDTIMEO, ms)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing to a daemon that is not there
            sock.connect(f"ipc://{self.path}")
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def request(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """Send one request; the reply, or None when the daemon did not answer.

        After a missed answer the socket is recreated (a REQ socket cannot
        send again before it received) and the client goes DOWN.
        """
        if self.state == self.DOWN:
            return None
        if not os.path.exists(self.path):  # nobody ever bound it: no need to wait
            self._go_down(f"{self.path} does not exist")
            return None
        body = json.dumps({"v": PROTOCOL_VERSION, "op": op, **fields}).encode()
        with self._lock:
            try:
                sock = self._socket()
                sock.send(body)
                raw = sock.recv()
            except zmq.ZMQError as exc:
                self._drop_socket()
                self._go_down(f"no answer within {self.timeout:g} s to {op!r} ({exc})")
                return None
        try:
            reply = json.loads(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            log.warning("shmloader: shmloaderd at %s sent a malformed reply to %r", self.path, op)
            return None
        if not reply.get("ok"):
            log.warning(
                "shmloader: shmloaderd at %s rejected %r: %s", self.path, op, reply.get("error")
            )
        return reply

    def _go_down(self, why: str) -> None:
        was_up = self.state == self.UP
        self.state = self.DOWN
        if was_up:
            _warn_once(
                f"down:{self.path}",
                "shmloader: lost shmloaderd at %s (%s); continuing without it (no budget "
                "checks, no reaping of this job's leftovers by the daemon)",
                self.path,
                why,
            )

    # ------------------------------------------------------------------ ops

    def connect(self) -> bool:
        """Say hello; False (logged once per process) when nobody answers."""
        if self.state == self.UP:
            return True
        self.state = self.NEW
        reply = self.request("hello", pid=os.getpid())
        if reply is None or not reply.get("ok"):
            self.state = self.DOWN
            self._drop_socket()
            _warn_once(
                f"unreachable:{self.path}",
                "shmloader: SHMLOADER_DAEMON=%s does not answer; running embedded (start it "
                "with `systemctl start shmloaderd` or `shmloaderd --socket %s`)",
                self.path,
                self.path,
            )
            return False
        self.state = self.UP
        self.daemon_info = reply
        return True

    def register(
        self, description: Mapping[str, Any], segments: Mapping[str, int] | None = None
    ) -> None:
        """Register a ring: ``description`` is the ring's control description
        (``token``, ``group``, ``leader``, ``writer``, ``node``, ``pids``
        ``{rank: [pid, start]}``, ``world``); ``segments`` maps names to bytes."""
        fields = dict(description)
        fields["pids"] = {str(k): list(v) for k, v in fields.get("pids", {}).items()}
        if segments:
            fields["segments"] = [{"name": n, "bytes": int(b)} for n, b in segments.items()]
        self.request("register", **fields)

    def add_segment(self, token: str, name: str, nbytes: int) -> None:
        self.request("segment", token=token, action="add", name=name, bytes=int(nbytes))

    def remove_segment(self, token: str, name: str) -> None:
        self.request("segment", token=token, action="remove", name=name)

    def admit(self, token: str, nbytes: int) -> None:
        """Ask for ``nbytes`` of shared memory for ring ``token``.

        Raises :class:`ShmCapacityError` when the daemon refuses (node budget
        or ``/dev/shm`` exhausted); returns quietly when it grants it or does
        not answer.
        """
        reply = self.request(
            "admit", token=token, bytes=int(nbytes), pid=os.getpid(), start=segment.MY_START
        )
        if reply is None or not reply.get("ok") or reply.get("admitted", True):
            return
        budget = reply.get("budget")
        in_use = reply.get("in_use")
        free = None
        if isinstance(budget, int) and isinstance(in_use, int):
            free = max(budget - in_use, 0)
        elif isinstance(reply.get("shm_free"), int):
            free = reply["shm_free"]
        raise ShmCapacityError(
            int(nbytes),
            free,
            f"shmloaderd ({self.path}) refused ring {token}",
            fix=str(reply.get("reason") or "raise the daemon's --budget"),
        )

    def adopt(self, token: str, name: str, nbytes: int) -> int | None:
        """Take a pre-touched segment of the daemon's warm pool as ``name``.

        Returns its payload capacity (>= ``nbytes``) when the daemon renamed
        one to ``name`` with this process as owner in its header: open it with
        ``Segment.attach(name, kind=KIND_DATA, token=token)``, it is already
        touched. None when the pool has nothing that fits or the daemon is
        away: create the segment as usual (after ``admit``).
        """
        reply = self.request(
            "adopt",
            token=token,
            name=name,
            bytes=int(nbytes),
            pid=os.getpid(),
            start=segment.MY_START,
        )
        if reply is None or not reply.get("ok") or not reply.get("adopted"):
            return None
        capacity = reply.get("capacity")
        return capacity if isinstance(capacity, int) else None

    def report(
        self,
        token: str,
        rank: int,
        *,
        published: int | None = None,
        consumed: int | None = None,
        receive_ms: float | None = None,
        lag: int | None = None,
    ) -> None:
        """Progress counters of one rank of ring ``token`` (all optional)."""
        fields: dict[str, Any] = {"token": token, "rank": int(rank)}
        for key, value in (
            ("published", published),
            ("consumed", consumed),
            ("receive_ms", receive_ms),
            ("lag", lag),
        ):
            if value is not None:
                fields[key] = value
        self.request("report", **fields)

    def unregister(self, token: str) -> None:
        self.request("unregister", token=token)

    def stats(self) -> dict[str, Any] | None:
        """The daemon's ``shmloader stat --json`` document, or None."""
        reply = self.request("stats")
        if reply is None or not reply.get("ok"):
            return None
        doc = reply.get("stats")
        return doc if isinstance(doc, dict) else None

    def close(self) -> None:
        with self._lock, contextlib.suppress(zmq.ZMQError):
            self._drop_socket()
        self.state = self.DOWN

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

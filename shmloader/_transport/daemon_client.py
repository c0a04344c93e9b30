"""The library's side of the ``shmloaderd`` control socket.

Optional by design. It owns ``DaemonClient`` (register, admit, adopt, report,
stats: one JSON frame each way, protocol version 1; its states, up, down and
retrying, are in docs/internals/state-machines.md) and the picklable
``Admitter`` a DataLoader worker asks with. Without a daemon, or while it is
away, every call is a no-op (NOTE [daemon restarts]); a daemon that appears
later is asked at the next call (NOTE [finding the daemon] in ``config``); the
only exception raised on purpose is the ``ShmCapacityError`` of a refused
``admit`` (NOTE [a refusal is a refusal]). It touches only the daemon's socket
and imports only ``segment``, ``errors`` and ``config``'s socket paths.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from .._node import segment
from ..config import DAEMON_SOCKET, well_known_socket
from ..errors import ConfigError, ShmCapacityError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Largest request the daemon accepts (bytes of JSON).
MAX_REQUEST = 1 << 20
#: Default control socket of a system-wide daemon (systemd RuntimeDirectory).
DEFAULT_SOCKET = DAEMON_SOCKET
#: Seconds a DOWN client waits before it tries the daemon again (then doubling).
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0

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
        self.reconnects = 0  # times a DOWN client found the daemon again
        self.seen = False  # a daemon answered this client once
        self._sock: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._ctx: zmq.Context | None = None
        self._daemon_id: str | None = None
        self._retry_at = 0.0
        self._backoff = RETRY_FIRST_S
        # the socket file at the last failure: another one is asked at once
        self._down_id: tuple[int, int] | None = None
        self._closed = False
        # NOTE [daemon restarts]: what to tell a daemon that does not know us
        self._registration: dict[str, Any] | None = None
        self._segments: dict[str, int] = {}
        self._granted_blind = False

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

    def _call(self, op: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """One request/reply; None (and DOWN) when the daemon did not answer."""
        if _socket_id(self.path) is None:  # nobody bound it: no need to wait
            self._go_down(f"{self.path} does not exist")
            return None
        body = json.dumps({"v": PROTOCOL_VERSION, "op": op, **fields}).encode()
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
        return reply

    def request(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """Send one request; the reply, or None when the daemon did not answer.

        A DOWN client tries the daemon again once its backoff elapsed; a
        restarted daemon is told our ring again first (NOTE [daemon restarts]).
        """
        with self._lock:
            if self.state == self.DOWN and not self._reconnect():
                return None
            reply = self._call(op, fields)
            if reply is None:
                return None
            if op != "hello" and self._restarted(reply):
                self._reregister(f"shmloaderd at {self.path} restarted")
                reply = self._call(op, fields)
                if reply is None:
                    return None
            elif self._unknown_ring(op, reply):
                self._reregister(f"shmloaderd at {self.path} did not know ring {fields['token']}")
                reply = self._call(op, fields)
                if reply is None:
                    return None
        if not reply.get("ok"):
            _warn_once(
                f"rejected:{self.path}:{op}",
                "shmloader: shmloaderd at %s rejected %r: %s (not logged again for this op)",
                self.path,
                op,
                reply.get("error"),
            )
        return reply

    # NOTE [daemon restarts]
    #     A daemon that restarts (or whose loop was blocked past ``timeout``) must
    #     not leave its clients unchecked for the rest of the job. A DOWN client
    #     retries on its next call after the backoff (at once when the socket file
    #     appeared or was replaced since: NOTE [finding the daemon] in ``config``;
    #     a missing one costs a ``stat()``), and every reply carries the
    #     daemon's ``daemon_id`` (random per daemon process): a new id, or a reply
    #     saying the daemon does not know our ring, makes the client re-register
    #     the ring (description and segments as last told) before it goes on. A
    #     call made while the daemon is away returns quietly (``admit`` grants,
    #     logged once per outage): the job never fails because the daemon did.
    def _restarted(self, reply: dict[str, Any]) -> bool:
        """Whether ``reply`` comes from another daemon process than our hello did."""
        got = reply.get("daemon_id")
        if not isinstance(got, str):
            return False
        if self._daemon_id is None:
            self._daemon_id = got
            return False
        return got != self._daemon_id

    def _unknown_ring(self, op: str, reply: dict[str, Any]) -> bool:
        error = str(reply.get("error", ""))
        return (
            not reply.get("ok")
            and op in ("report", "segment")
            and "unknown token" in error
            and self._registration is not None
        )

    def _reregister(self, why: str) -> None:
        """Hello, then the ring as last told (NOTE [daemon restarts])."""
        hello = self._call("hello", {"pid": os.getpid()})
        if hello is None:
            return
        first = not self.seen
        self.seen = True
        self.daemon_info = hello
        self._daemon_id = (
            hello.get("daemon_id") if isinstance(hello.get("daemon_id"), str) else None
        )
        if self._registration is not None:
            fields = dict(self._registration)
            if self._segments:
                fields["segments"] = [{"name": n, "bytes": b} for n, b in self._segments.items()]
            self._call("register", fields)
            if first:  # NOTE [finding the daemon]: a job that started before its daemon
                log.info("shmloader: %s; registered ring %s", why, fields.get("token"))
            else:
                log.warning("shmloader: %s; registered ring %s again", why, fields.get("token"))

    def _reconnect(self) -> bool:
        """DOWN -> UP if the daemon answers now: asked at once when its socket file
        is another than at the last failure, else once the backoff elapsed; a
        missing socket file is not asked at all (NOTE [finding the daemon] in ``config``)."""
        if self._closed:
            return False
        now_id = _socket_id(self.path)
        if now_id is None:
            self._down_id = None
            return False
        if now_id == self._down_id and time.monotonic() < self._retry_at:
            return False
        if not _listening(self.path):
            self._down_id = now_id
            self._schedule_retry()
            return False
        seen = self.seen
        self.state = self.NEW  # a failing call now goes DOWN without a second "lost"
        self._reregister(f"shmloaderd at {self.path} answers {'again' if seen else 'now'}")
        if self.state == self.DOWN:
            return False
        self.state = self.UP
        self.reconnects += seen
        self._backoff = RETRY_FIRST_S
        self._granted_blind = False
        return True

    def _schedule_retry(self) -> None:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RETRY_MAX_S)

    def _go_down(self, why: str) -> None:
        was_up = self.state == self.UP
        self.state = self.DOWN
        self._down_id = _socket_id(self.path)
        self._schedule_retry()
        if was_up:
            log.warning(
                "shmloader: lost shmloaderd at %s (%s); going on without it and trying again "
                "in %d s, or as soon as its socket is made again (no budget checks meanwhile)",
                self.path,
                why,
                max(1, round(self._retry_at - time.monotonic())),
            )

    # ------------------------------------------------------------------ ops

    def connect(self) -> bool:
        """Say hello. True when this client is worth keeping: the daemon answered
        (``state`` UP), or nobody did and it is asked again at later calls (DOWN,
        NOTE [finding the daemon] in ``config``); False when the daemon refused the
        hello or the client is closed. A well-known socket that does not exist is
        the usual node without a daemon: no wait, nothing logged; anything else
        that does not answer is logged once per process."""
        with self._lock:
            if self._closed:
                return False
            if self.state == self.UP:
                return True
            self.state = self.NEW
            if _socket_id(self.path) is not None and not _listening(self.path):
                self._go_down("nobody listens on it")  # a stale socket: no 1 s wait
                reply = None
            else:
                reply = self._call("hello", {"pid": os.getpid()})
            if reply is None:
                if self._down_id is not None or self.path != well_known_socket():
                    _warn_once(
                        f"unreachable:{self.path}",
                        "shmloader: shmloaderd at %s does not answer; running embedded and "
                        "registering once it answers (start it with `systemctl start "
                        "shmloaderd` or `shmloaderd --socket %s`; SHMLOADER_DAEMON=off asks "
                        "no daemon)",
                        self.path,
                        self.path,
                    )
                return True
            if not reply.get("ok"):
                self.state = self.DOWN
                self._closed = True
                self._drop_socket()
                _warn_once(
                    f"refused:{self.path}",
                    "shmloader: shmloaderd at %s refused our hello (%s); running embedded "
                    "without it",
                    self.path,
                    reply.get("error"),
                )
                return False
            self.seen = True
            self.state = self.UP
            self.daemon_info = reply
            self._daemon_id = (
                reply.get("daemon_id") if isinstance(reply.get("daemon_id"), str) else None
            )
            return True

    def register(
        self, description: Mapping[str, Any], segments: Mapping[str, int] | None = None
    ) -> None:
        """Register a ring: ``description`` is the ring's control description
        (``token``, ``group``, ``leader``, ``writer``, ``node``, ``pids``
        ``{rank: [pid, start, pidns]}``, ``world``, ``job``?, ``started_unix``?);
        ``segments`` maps names to bytes. Remembered, so that a restarted
        daemon is told again (NOTE [daemon restarts])."""
        fields = dict(description)
        fields["pids"] = {str(k): list(v) for k, v in fields.get("pids", {}).items()}
        fields.pop("ranks", None)  # progress goes through report
        with self._lock:
            self._registration = dict(fields)
            if segments:
                self._segments.update({n: int(b) for n, b in segments.items()})
            if self._segments:
                fields["segments"] = [{"name": n, "bytes": b} for n, b in self._segments.items()]
            self.request("register", **fields)

    def add_segment(self, token: str, name: str, nbytes: int) -> None:
        with self._lock:
            self._segments[name] = int(nbytes)
            self.request("segment", token=token, action="add", name=name, bytes=int(nbytes))

    def remove_segment(self, token: str, name: str) -> None:
        with self._lock:
            self._segments.pop(name, None)
            self.request("segment", token=token, action="remove", name=name)

    def check_ring_dir(self, directory: str) -> None:
        """Refuse a ring directory a node-mode daemon does not watch, before the writer
        makes anything there.

        The daemon would refuse the ring's first admission anyway (NOTE
        [watched ring directories] in ``shmloaderd.registry``), but the control
        segment made before it would stay behind in a directory the daemon
        never reaps if the job then died. Says nothing where the daemon runs
        for one user, is away, or watches ``directory``.
        """
        if self.state == self.NEW:
            self.connect()  # its hello says where it looks
        info = self.daemon_info
        dirs = info.get("shm_dirs")
        if not info.get("node_mode") or not isinstance(dirs, list):
            return
        real = os.path.realpath(directory)
        watched = [d for d in dirs if isinstance(d, str)]
        if real in {os.path.realpath(d) for d in watched}:
            return
        raise ConfigError(
            "SHMLOADER_SHM_DIR",
            real,
            f"one of the ring directories the node's shmloaderd ({self.path}) watches "
            f"({', '.join(watched)}): a ring elsewhere could be neither counted against a "
            "budget nor reaped after a crash, so nothing was made there. Set "
            "SHMLOADER_SHM_DIR to one of them (or unset it for /dev/shm), or ask the node's "
            "operator to add the directory to shmloaderd's --shm-dir",
        )

    # NOTE [a refusal is a refusal]
    #     An ``admit`` the daemon answers with ``ok: false`` (a request it refused:
    #     a pid not the caller's, too many jobs, a request it could not read) is a
    #     refusal like ``admitted: false``: :class:`ShmCapacityError` naming the
    #     daemon's reason, and the segment is not created. Read as a grant (as
    #     before), a refused job went on past its budget, unaccounted. Only a
    #     daemon that does not answer at all grants blindly (above).
    def admit(self, token: str, nbytes: int) -> None:
        """Ask for ``nbytes`` of shared memory for ring ``token``.

        Raises :class:`ShmCapacityError` when the daemon refuses (node or uid
        budget, ``/dev/shm`` exhausted, a ring directory it does not watch, or
        a request it refuses outright: NOTE [a refusal is a refusal]); returns
        quietly when it grants it or does not answer (logged once per outage).
        """
        reply = self.request(
            "admit",
            token=token,
            bytes=int(nbytes),
            pid=os.getpid(),
            start=segment.MY_START,
            pidns=segment.MY_PIDNS,
            shm_dir=os.path.realpath(segment.ring_dir()),
        )
        if reply is None:
            if self.seen and not self._granted_blind:  # a node without a daemon says nothing
                self._granted_blind = True
                log.warning(
                    "shmloader: shmloaderd at %s is away: %d bytes for ring %s taken without "
                    "its budget check (it is asked again once it answers)",
                    self.path,
                    int(nbytes),
                    token,
                )
            return
        if not reply.get("ok"):  # NOTE [a refusal is a refusal]
            raise ShmCapacityError(
                int(nbytes),
                None,
                f"shmloaderd ({self.path}) refused ring {token}: {reply.get('error')}",
                fix="nothing was admitted; fix what the daemon names, or run with "
                "SHMLOADER_DAEMON=off (no budget) if the daemon is at fault",
            )
        if reply.get("admitted", True):
            return
        budget = reply.get("budget")
        in_use = reply.get("in_use")
        free = None
        uid_budget, uid_in_use = reply.get("uid_budget"), reply.get("uid_in_use")
        if isinstance(uid_budget, int) and isinstance(uid_in_use, int):  # node mode
            free = max(uid_budget - uid_in_use, 0)
            if isinstance(budget, int) and isinstance(in_use, int):
                free = min(free, max(budget - in_use, 0))
        elif isinstance(budget, int) and isinstance(in_use, int):
            free = max(budget - in_use, 0)
        elif isinstance(reply.get("shm_free"), int):
            free = reply["shm_free"]
        raise ShmCapacityError(
            int(nbytes),
            free,
            f"shmloaderd ({self.path}) refused ring {token}",
            fix=str(reply.get("reason") or "raise the daemon's --budget"),
        )

    def admitter(self) -> Admitter:
        """A picklable ``admit`` of this daemon for another process (a DataLoader worker)."""
        return Admitter(self.path, self.timeout)

    def adopt(self, token: str, name: str, nbytes: int) -> int | None:
        """Take one of the daemon's warm (pre-touched) segments as ``name``.

        Returns its payload capacity (>= ``nbytes``) when the daemon renamed
        one to ``name`` with this process as owner in its header: open it with
        ``Segment.attach(name, kind=KIND_DATA, token=token)``, it is already
        touched. None when none of them fits or the daemon is
        away: create the segment as usual (after ``admit``).
        """
        reply = self.request(
            "adopt",
            token=token,
            name=name,
            bytes=int(nbytes),
            pid=os.getpid(),
            start=segment.MY_START,
            pidns=segment.MY_PIDNS,
            shm_dir=os.path.realpath(segment.ring_dir()),
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
        role: str | None = None,
        wait_ms_p50: float | None = None,
        wait_share: float | None = None,
        nbytes: int | None = None,
        device: dict[str, Any] | None = None,
        waits: dict[str, Any] | None = None,
    ) -> None:
        """Progress counters of one rank of ring ``token`` (all optional).

        ``wait_ms_p50``: median milliseconds the rank waited for a batch
        (recent batches); ``wait_share``: the fraction of its wall time since
        its first batch spent waiting; ``nbytes``: payload bytes it received
        or published so far (traffic, not memory held); ``device``: its
        device-delivery counters (``inventory.DEVICE_REPORTED``), None or empty on
        host delivery; ``waits``: any of ``wait_ms_p50``, ``wait_ms_p95``, ``wait_ms_p99``,
        ``wait_share``, and the histogram since the first batch
        (``wait_hist``: ``waits.NBUCKETS`` counts, ``wait_ms_sum``).
        """
        fields: dict[str, Any] = {"token": token, "rank": int(rank)}
        for key, value in (
            ("published", published),
            ("consumed", consumed),
            ("receive_ms", receive_ms),
            ("lag", lag),
            ("role", role),
            ("wait_ms_p50", wait_ms_p50),
            ("wait_share", wait_share),
            ("bytes", nbytes),
        ):
            if value is not None:
                fields[key] = value
        for key, value in (*(device or {}).items(), *(waits or {}).items()):
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
            self._closed = True
            self._drop_socket()
        self.state = self.DOWN

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Admitter:
    """``DaemonClient.admit`` for a process of the job other than the one that
    registered it: a DataLoader worker growing a pool slot asks the same
    daemon, before it creates the segment (NOTE [pool admission] in ``pool``).

    Pickled as the socket path and timeout; connects lazily, once per process.
    """

    def __init__(self, path: str, timeout: float) -> None:
        self.path, self.timeout = path, float(timeout)
        self._client: DaemonClient | None = None
        self._pid = 0

    def __getstate__(self) -> dict:
        return {"path": self.path, "timeout": self.timeout, "_client": None, "_pid": 0}

    def __call__(self, token: str, nbytes: int) -> None:
        if self._client is None or self._pid != os.getpid():
            self._client = DaemonClient(self.path, self.timeout)
            self._pid = os.getpid()
            self._client.connect()
        self._client.admit(token, nbytes)


def _socket_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _listening(path: str) -> bool:
    """Whether a process listens on the unix socket ``path`` (refused at once if not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.2)
        try:
            probe.connect(path)
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
    return True

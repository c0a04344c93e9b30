"""The daemon proper: one thread, one loop, one control socket.

It owns ``Daemon``: binding the control socket, the loop (reap passes, watchdog,
requests; every step bounded, ``stop`` ends it within ``SLICE_S``: drawn in
docs/internals/flow.md), moving the control socket's bytes through ``zmtp.Wire``
(the ZMTP it speaks, the bounds on what clients send), serving each request
after its peer's credentials are checked, and the stats document with each
asker's view (``view``); what the registry adds to the document and the per-uid
accounts are ``document``'s. Nothing a client sends can stop the loop: a malformed
request, or an exception while serving one, is answered ``ok: false`` and
logged; a connection that breaks a bound is dropped and logged. It unlinks only
what the reaping rule allows (through ``shmloader._node.reaping``), its own warm
pool and its socket.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from shmloader._node import segment as segment_module
from shmloader._node.cleanup import remove_runtime_dir
from shmloader._node.inventory import (
    build_document,
    ring_dirs,
    scan_entries,
)
from shmloader._node.reaping import dead_runtime_dirs, remove_if_dead, stale_sockets
from shmloader._node.segment import HEADER_SIZE
from shmloader._transport.daemon_client import DaemonClient
from shmloader.errors import ProtocolError, human_bytes

from . import document, notify, protocol, zmtp
from ._version import __version__
from .document import UidAccounts, left
from .guard import DEFAULT_MAX_UID_CONNECTIONS, ConnectionGuard, shut_down
from .registry import MAX_OWNERS, Job, Registry, RegistryFull, _from_description
from .tenants import Peer, Tenancy, UidBudgets, peer_of, user_name
from .warm import WarmSegments

log = logging.getLogger("shmloaderd")

SLICE_S = 0.1
#: A connection sending a bigger frame is dropped (NOTE [bounded state] in ``registry``).
MAX_WIRE = zmtp.MAX_FRAME
#: Seconds a connection may send nothing before libzmq is asked whether it still has it.
IDLE_PROBE_S = 60.0
#: Longest wait of the loop while replies wait for libzmq to take them.
WAITING_S = 0.002
#: Longest ipc:// path (sockaddr_un.sun_path less its NUL).
MAX_SOCKET_PATH = 107


class StartError(Exception):
    """The daemon cannot start: the message says why and what to do."""


class _RateLimited:
    """At most ``burst`` warnings per ``period`` seconds, then a count of the rest."""

    def __init__(
        self, burst: int = 10, period: float = 10.0, what: str = "malformed request(s)"
    ) -> None:
        self.burst, self.period, self.what = burst, period, what
        self.window, self.count, self.suppressed = 0.0, 0, 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.window > self.period:
            if self.suppressed:
                log.warning("... %d more %s not logged", self.suppressed, self.what)
            self.window, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.burst:
            log.warning(msg, *args)
        else:
            self.suppressed += 1


class Daemon:
    def __init__(
        self,
        socket_path: str,
        *,
        budget: Callable[[], int | None] = lambda: None,
        budget_text: str = "unlimited",
        reap_interval: float = 0.5,
        pool_bytes: int = 0,
        pool_segment: int = 64 << 20,
        tenants: bool = False,
        uid_budgets: UidBudgets | None = None,
        shm_dirs: list[str] | None = None,
        max_uid_connections: int = DEFAULT_MAX_UID_CONNECTIONS,
        uid_budget_text: str = "",
    ) -> None:
        self.path = os.path.abspath(socket_path)
        self.uid_budget_text = uid_budget_text  # for the startup line (node mode)
        self.max_uid_connections = max_uid_connections  # NOTE [connection bound] in ``guard``
        self.guard: ConnectionGuard | None = None
        # ring directories reaped and accounted (``--shm-dir``; NOTE [huge-page ring])
        self.shm_dirs = ring_dirs() if shm_dirs is None else shm_dirs
        self.budget = budget
        self.budget_text = budget_text
        self.reap_interval = reap_interval
        self.warm = WarmSegments(pool_bytes, pool_segment)
        self.tenancy = Tenancy(tenants)  # NOTE [tenants]
        self.uid_budgets = uid_budgets or UidBudgets()
        self.registry = Registry(
            budget,
            lambda: self.warm.nbytes,
            self.warm.shrink,
            uid_budget=self.uid_budgets,
            tenants=tenants,
            dirs=self.shm_dirs,
        )
        self.accounts = UidAccounts(self.registry, self.uid_budgets)  # NOTE [over budget]
        self.sock: zmq.Socket | None = None
        self.ctx: zmq.Context | None = None
        self.started = time.time()
        self.daemon_id = secrets.token_hex(8)  # NOTE [daemon restarts] in daemon_client
        self.reaped_segments = 0
        self.reaped_bytes = 0
        self.reaped_sockets = 0
        self.reap_failures = 0  # reap passes that failed, files it could not remove
        self.requests: dict[str, int] = {}
        self._count_lock = threading.Lock()  # requests is read by the metrics thread
        self._bad = _RateLimited()
        self.wire = zmtp.Wire()  # NOTE [bounded state] in ``registry``: what clients send
        self._dropped = _RateLimited(what="dropped connection(s)")
        self._next_sweep = 0.0
        self._snapshot: dict[str, Any] | None = None
        self._bound = False

    # ----------------------------------------------------------------- bind

    def bind(self) -> None:
        """Create the 0700 directory if needed, check it, bind the 0600 socket.

        In node mode: a 0755 directory nobody else may write, a 0666 socket
        (every user connects; who they are comes from ``SO_PEERCRED``).
        """
        tenants = self.tenancy.enabled
        if len(self.path.encode()) > MAX_SOCKET_PATH:
            raise StartError(
                f"--socket {self.path} is {len(self.path.encode())} bytes long; unix sockets "
                f"allow {MAX_SOCKET_PATH}: choose a shorter path"
            )
        directory = os.path.dirname(self.path)
        if not os.path.lexists(directory):
            try:
                os.makedirs(directory, mode=0o755 if tenants else 0o700)
            except OSError as exc:
                raise StartError(f"cannot create {directory}: {exc.strerror}") from None
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise StartError(f"{directory} (the directory of --socket) is not a directory")
        if st.st_uid != os.geteuid():
            raise StartError(
                f"{directory} belongs to uid {st.st_uid}, not to us ({os.geteuid()}); run "
                "shmloaderd as that user or choose a --socket in a directory of ours"
            )
        if tenants and stat.S_IMODE(st.st_mode) & 0o022:
            raise StartError(
                f"{directory} has mode {stat.S_IMODE(st.st_mode):o}; in node mode the control "
                f"socket needs a directory only we can write (chmod 755 {directory}, or "
                "another --socket)"
            )
        if not tenants and stat.S_IMODE(st.st_mode) & 0o077:
            raise StartError(
                f"{directory} has mode {stat.S_IMODE(st.st_mode):o}; the control socket needs a "
                f"directory only we can enter (chmod 700 {directory}, or another --socket)"
            )
        if os.path.lexists(self.path):
            probe = DaemonClient(self.path, timeout=0.5)
            hello = probe.request("hello")
            probe.close()
            if hello is not None:
                raise StartError(
                    f"another shmloaderd (pid {hello.get('pid')}) already serves {self.path}"
                )
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise StartError(f"{self.path} exists and is not a socket; remove it or move it")
            os.unlink(self.path)  # a dead daemon's socket
            log.info("removed the stale control socket %s", self.path)
        self.ctx = zmq.Context()
        # STREAM, not ROUTER: a ROUTER keeps every frame of an unfinished multipart
        # message, with no bound (NOTE [bounded state] in ``registry``); the daemon
        # speaks ZMTP itself (``zmtp``), libzmq keeps at most RCVHWM chunks a connection
        sock = self.ctx.socket(zmq.STREAM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, zmtp.RCVHWM)
        sock.setsockopt(zmq.SNDHWM, zmtp.SNDHWM)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        # before bind: no connection is accepted unseen (NOTE [connection bound] in ``guard``)
        guard = ConnectionGuard(sock, self.path, self.max_uid_connections)
        old = os.umask(0o111 if tenants else 0o177)
        try:
            sock.bind(f"ipc://{self.path}")
        except zmq.ZMQError as exc:
            guard.close()
            sock.close(linger=0)
            raise StartError(f"cannot bind {self.path}: {exc}") from None
        finally:
            os.umask(old)
        if tenants:
            os.chmod(directory, stat.S_IMODE(os.lstat(directory).st_mode) | 0o555)
        os.chmod(self.path, 0o666 if tenants else 0o600)
        self.sock = sock
        self.guard = guard
        guard.start()
        self._bound = True
        self.warm.start()
        log.info(
            "shmloaderd %s (pid %d) serving %s%s; budget %s%s; reaping every %g s%s",
            __version__,
            os.getpid(),
            self.path,
            " for every user of the node (node mode)" if tenants else f" for uid {os.geteuid()}",
            self.budget_text,
            f"; uid budgets {self.uid_budget_text or 'none'}" if tenants else "",
            self.reap_interval,
            f"; warm segments {human_bytes(self.warm.target)}" if self.warm.target else "",
        )

    # ----------------------------------------------------------------- loop

    def serve(self, stop: threading.Event) -> None:
        assert self.sock is not None
        watchdog = notify.watchdog_interval()
        next_reap = next_dog = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_reap:
                self.reap_pass()
                next_reap = time.monotonic() + self.reap_interval
            if watchdog is not None and now >= next_dog:
                notify.notify("WATCHDOG=1")
                next_dog = now + watchdog
            due = min(next_reap, next_dog if watchdog is not None else next_reap)
            wait = max(0.0, min(SLICE_S, due - time.monotonic()))
            if self.wire.waiting:  # replies libzmq refused: try again soon
                wait = min(wait, WAITING_S)
            if self.sock.poll(int(wait * 1000), zmq.POLLIN) or self.wire.waiting:
                self._drain()
            if time.monotonic() >= self._next_sweep:
                self._sweep(time.monotonic())

    def _drain(self) -> None:
        assert self.sock is not None
        for _ in range(256):  # then let the reaper run
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) == 2:  # a STREAM message: [id, bytes]
                self._bytes_in(frames[0].bytes, frames[1])
        for ident in list(self.wire.waiting):  # replies libzmq refused: try again
            waiting = self.wire.conns.get(ident)
            if waiting is not None:
                self._serve_conn(ident, waiting)

    def _bytes_in(self, ident: bytes, data: zmq.Frame) -> None:
        """One chunk of a connection's bytes (NOTE [bounded state] in ``registry``)."""
        now = time.monotonic()
        if not len(data):  # STREAM's notice: a connection opened, or closed
            if self.wire.notice(ident):  # NOTE [notices of the end] (zmtp)
                fd = _src_fd(data)
                new = self.wire.opened(ident, peer_of(data), fd, _inode(fd), now)  # NOTE [tenants]
                self._serve_conn(ident, new)
            return
        conn = self.wire.conns.get(ident)
        if conn is None:
            return  # bytes still queued from one we hung up on
        try:
            self.wire.feed(conn, data.bytes, now)
        except zmtp.Dropped as exc:
            self._hang_up(ident, str(exc))
            return
        self._serve_conn(ident, conn)

    def _serve_conn(self, ident: bytes, conn: zmtp.Conn) -> None:
        """Answer a connection's finished requests in order while libzmq takes its
        replies; none is read while a piece of its replies waits."""
        while True:
            while len(conn.outbox) < zmtp.PIECE:
                try:
                    frames = self.wire.next(conn, time.monotonic())
                except zmtp.Dropped as exc:
                    self._hang_up(ident, str(exc))
                    return
                if frames is None:
                    break
                conn.outbox += zmtp.encode(self._answer(frames, conn.peer))
            if not conn.outbox or not self._flush(ident, conn):
                return

    def _answer(self, frames: list[bytes], peer: Peer | None) -> list[bytes]:
        """The reply to one message, with its envelope (a ``REQ``'s empty delimiter)."""
        if len(frames) >= 2 and frames[0] == b"":
            envelope, body = frames[:1], frames[1:]  # REQ
        else:
            envelope, body = [], frames  # DEALER
        if len(body) != 1:
            return [*envelope, self._reject(f"request of {len(body)} frames; expected exactly one")]
        return [*envelope, self.handle(body[0], peer)]

    def _flush(self, ident: bytes, conn: zmtp.Conn) -> bool:
        """Hand the connection's outbox to libzmq, a piece at a time; False when
        libzmq takes no more now (its queue is full) or the connection is gone."""
        assert self.sock is not None
        while conn.outbox:
            piece = bytes(conn.outbox[: zmtp.PIECE])
            try:
                self.sock.send_multipart([ident, piece], zmq.NOBLOCK)
            except zmq.Again:  # SNDHWM pieces unread, or libzmq is closing it
                self.wire.waiting.add(ident)
                return False
            except zmq.ZMQError:  # EHOSTUNREACH: libzmq has closed it
                self.wire.forget(ident, noticed=False)
                return False
            del conn.outbox[: zmtp.PIECE]
            conn.pieces += 1
        self.wire.waiting.discard(ident)
        if not conn.held:
            conn.since = 0.0
        return True

    def _hang_up(self, ident: bytes, why: str) -> None:
        """Drop a connection for what it sent, and log it; no other is touched."""
        assert self.sock is not None
        conn = self.wire.forget(ident, noticed=False)
        if conn is None:
            return
        self.wire.dropped += 1
        self._count("dropped")
        who = str(conn.peer) if conn.peer is not None else "a peer of unknown uid"
        self._dropped.warn("dropped a connection of %s to the control socket: %s", who, why)
        try:  # STREAM: an empty message closes it
            self.sock.send_multipart([ident, b""], zmq.NOBLOCK)
            return
        except zmq.Again:  # refused: its replies fill its queue; end its stream instead
            pass
        except zmq.ZMQError:
            return  # EHOSTUNREACH: already gone
        # refused before libzmq ever took SNDHWM pieces for it: its queue cannot be full,
        # libzmq is closing it already
        full = conn.pieces >= zmtp.SNDHWM  # NOTE [notices of the end] (zmtp)
        if full and conn.fd is not None and conn.ino is not None and conn.peer is not None:
            shut_down(conn.fd, conn.ino, self.path, conn.peer.pid, conn.peer.uid)

    def _sweep(self, now: float) -> None:
        """Drop connections holding an unfinished request or unread replies for too
        long; forget those libzmq closed without a notice (it has none to give
        when that connection's queue is full)."""
        self._next_sweep = now + 1.0
        for ident in self.wire.overdue(now):
            conn = self.wire.conns[ident]
            what = "replies stayed unread" if conn.outbox else "request stayed unfinished"
            self._hang_up(ident, f"its {what} for {zmtp.UNFINISHED_S:g} s")
        for ident in self.wire.idle(now, IDLE_PROBE_S):
            conn = self.wire.conns[ident]
            conn.last = now
            if not conn.outbox:
                conn.outbox += zmtp.PROBE
                self._flush(ident, conn)

    def _count(self, op: str) -> None:
        with self._count_lock:
            self.requests[op] = self.requests.get(op, 0) + 1

    def _reject(self, why: str) -> bytes:
        self._count("invalid")
        self._bad.warn("rejected a malformed request: %s", why)
        return protocol.encode({"ok": False, "error": why, "daemon_id": self.daemon_id})

    def handle(self, raw: bytes, peer: Peer | None = None) -> bytes:
        """One request frame in, one reply frame out. Never raises.

        ``peer``: the connection's credentials (NOTE [tenants]); in node mode a
        request naming what is not the peer's is refused here, and logged.
        """
        try:
            op, fields = protocol.parse(raw)
        except ProtocolError as exc:
            return self._reject(str(exc))
        self._count(op)
        try:
            denied = self.tenancy.check(op, fields, peer)
            if denied is not None:
                self._count("denied")
                if op == "admit":  # NOTE [budget] in ``registry``: every refusal counted
                    self.registry.note_refusal(self.tenancy.uid_of(peer), "denied", denied)
                self._bad.warn("refused %r from %s: %s", op, peer, denied)
                return protocol.encode(
                    {"ok": False, "error": f"refused: {denied}", "daemon_id": self.daemon_id}
                )
            reply = self.dispatch(op, fields, peer)
        except RegistryFull as exc:
            reply = {"ok": False, "error": str(exc)}
            if op == "admit":
                self.registry.note_refusal(self.tenancy.uid_of(peer), "registry_full", str(exc))
        except Exception as exc:  # a bug of ours must not take the node's daemon down
            log.exception("internal error serving %r", op)
            reply = {"ok": False, "error": f"internal error serving {op!r}: {exc}"}
        log.debug("%s %s -> %s", op, fields.get("token", ""), reply.get("ok"))
        return protocol.encode({**reply, "daemon_id": self.daemon_id})

    def dispatch(self, op: str, f: dict[str, Any], peer: Peer | None = None) -> dict[str, Any]:
        r = self.registry
        uid = self.tenancy.uid_of(peer)
        anyone = self.tenancy.enabled and peer is not None and peer.root  # NOTE [whose job]
        if op == "hello":
            return {
                "ok": True,
                "daemon": "shmloaderd",
                "version": __version__,
                "pid": os.getpid(),
                "protocol": protocol.VERSION,
                "socket": self.path,
                "budget": self.budget(),
                "shm_dirs": list(self.shm_dirs),  # ``shmloader gc``/``stat`` look there too
                # a job in node mode makes its ring only in one of them (NOTE [watched
                # ring directories] in ``registry``): it checks before it makes anything
                "node_mode": self.tenancy.enabled,
            }
        if op == "stats":
            return {"ok": True, "stats": self.view(self.stats(), peer)}
        if op == "register":
            return r.register(f, uid, any_uid=anyone)
        if op == "segment":
            return r.segment(f, uid, any_uid=anyone)
        if op == "admit":
            return r.admit(f, uid, any_uid=anyone)
        if op == "report":
            return r.report(f, uid, any_uid=anyone)
        if op == "unregister":
            return r.unregister(f, uid, any_uid=anyone)
        if op == "adopt":
            warm_dir = os.path.realpath(segment_module.SHM_DIR)
            if f.get("shm_dir", warm_dir) != warm_dir:  # a link cannot cross directories
                reason = f"the warm segments are in {warm_dir}, the ring in {f['shm_dir']}"
                return {"ok": True, "adopted": False, "reason": reason}
            job = r.job(f["token"], uid, any_uid=anyone)
            if self.tenancy.enabled and job.uid is not None:  # NOTE [tenants]: fchown to them
                gid = peer.gid if peer is not None and peer.uid == job.uid else None
                owner = {"uid": job.uid, "gid": gid}
            else:
                owner = {}
            reply = self.warm.adopt(
                f["token"], f["name"], f["bytes"], f["pid"], f["start"], f.get("pidns", 0), **owner
            )
            if reply.get("adopted"):
                job.segments[f["name"]] = HEADER_SIZE + reply["capacity"]
                if not job.pids and len(job.owners) < MAX_OWNERS:
                    job.owners.add((f["pid"], f["start"]))
                    job.note_namespace(f["pid"], f["start"], f.get("pidns"))
            return reply
        raise AssertionError(f"op {op} in protocol.OPS but not dispatched")

    # ---------------------------------------------------------------- reaper

    # The reaper follows the reaping rule (NOTE [reaping rule]): a segment goes only
    # when its header validates and its owner (pid, start time) is dead; a socket
    # ``<token>-<pid>.sock`` in one of our uid's runtime directories goes when its pid
    # is gone (the rule ``shmloader gc`` uses). In node mode (NOTE [tenants] in
    # ``tenants``) the same rule covers every uid's segments and private runtime
    # directories, each reap logged with its uid, job and bytes. Warm-segment work runs on
    # its own thread (NOTE [pool off the loop] in ``warm``): nothing on the loop
    # waits for page faults. On SIGTERM nothing of a live job is unlinked; on the
    # next start the jobs are re-discovered from their control segments.
    def reap_pass(self) -> None:
        """Unlink what dead owners left, update the registry, refill the warm segments."""
        every_uid = self.tenancy.enabled  # NOTE [reaping rule] in shmloader._node.reaping
        try:
            entries = scan_entries(every_uid=every_uid, dirs=self.shm_dirs)
            names = self._job_names(entries)
            kept = []
            reaped: dict[tuple[int, str], tuple[int, int]] = {}  # (uid, token)
            for e in entries:
                if e.header is not None and not e.alive:
                    freed = remove_if_dead(e.name, every_uid=every_uid, directory=e.directory)
                    if freed is not None and freed.removed:
                        self.reaped_segments += 1
                        self.reaped_bytes += freed.bytes
                        uid = freed.extra["uid"]
                        n, b = reaped.get((uid, freed.token), (0, 0))
                        reaped[(uid, freed.token)] = (n + 1, b + freed.bytes)
                        self.accounts.note_reaped(uid, freed.bytes)
                        log.info(
                            "reaped %s (%s, %s, uid %d %s, %s): owner pid %d (start %d) is gone",
                            freed.name,
                            freed.kind,
                            human_bytes(freed.bytes),
                            uid,
                            user_name(uid),
                            names.get((uid, freed.token), f"ring {freed.token}"),
                            freed.owner_pid,
                            freed.extra["owner_start"],
                        )
                        continue
                kept.append(e)
            known = set(self.registry.jobs)
            for why in self.registry.observe(kept, reaped):
                log.info("forgot %s", why)
            self._note_reaped(reaped, known, entries)
            self._reap_sockets()
            budget = self.budget()
            room = None if budget is None else budget - self.registry.in_use()
            self.warm.request_refill(room)  # NOTE [pool off the loop]
            doc = self._document(kept)
            self.accounts.note_over_budget(doc)
            self._snapshot = {"stats": doc, "waits": document.waits(self.registry)}
        except Exception:
            self.reap_failures += 1
            log.exception("reap pass failed; retrying at the next one")

    def _job_names(self, entries: list) -> dict[tuple[int, str], str]:
        """(uid, token) -> "job NAME (ring TOKEN)" for the log: the registry's name,
        else the one its control segment describes (log lines name the job, not
        only its token)."""
        out = {}
        for e in entries:
            key = None if e.header is None else (e.header.uid, e.header.token)
            if key is None or key in out:
                continue
            job = self.registry.jobs.get(key)
            name = job.name if job is not None else None
            if name is None and e.description:
                raw = e.description.get("job")
                name = raw[:128] if isinstance(raw, str) else None
            if name:
                out[key] = f"job {name} (ring {e.header.token})"
        return out

    def _note_reaped(
        self, reaped: dict[tuple[int, str], tuple[int, int]], known: set, entries: list
    ) -> None:
        """Reaped segments of a ring the registry never knew (it died before this
        daemon saw it alive) still leave a record (NOTE [dead jobs stay visible])."""
        for key, (n, nbytes) in reaped.items():
            if key in known:
                continue
            if key in self.registry.ended:
                self.registry.note_reaped(key, n, nbytes)
                continue
            uid, token = key
            ctl = next(
                (e for e in entries if e.header and e.header.token == token
                 and e.header.uid == uid and e.header.kind_name == "control"),
                None,
            )  # fmt: skip
            if ctl is None or ctl.header is None:
                continue  # no ring: a probe or a warm segment, nothing to show as a job
            job = Job(token, since=ctl.header.created_ns / 1e9, uid=uid)
            _from_description(job, ctl)
            self.registry.record_end(job, "its processes died", n, nbytes)

    def _reap_sockets(self) -> None:
        """Remove dead writers' private runtime directories and older-layout sockets."""
        for path in dead_runtime_dirs(every_uid=self.tenancy.enabled):
            if remove_runtime_dir(path):
                self.reaped_sockets += 1
                log.info("reaped the runtime directory %s: its process is gone", path)
        for path in stale_sockets():
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.reap_failures += 1
                log.warning("could not remove the stale socket %s: %s", path, exc)
                continue
            self.reaped_sockets += 1
            log.info("reaped the stale socket %s: its process is gone", path)

    # ----------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        return self._document(scan_entries(every_uid=self.tenancy.enabled, dirs=self.shm_dirs))

    def _document(self, entries: list) -> dict[str, Any]:
        doc = build_document(
            [e for e in entries if not (e.header and e.header.token == self.warm.token)],
            "daemon",
            self.shm_dirs,
        )
        now = time.monotonic()
        document.add_registry(doc, self.registry, now)
        doc["node"]["shmloader_bytes"] = sum(j["bytes"] for j in doc["jobs"]) + self.warm.nbytes
        doc["daemon"] = {
            "pid": os.getpid(),
            "version": __version__,
            "socket": self.path,
            "budget_bytes": self.budget(),
            "in_use_bytes": self.registry.in_use(now),
            "granted_pending_bytes": sum(j.pending(now) for j in self.registry.jobs.values()),
            "budget_left_bytes": left(self.budget(), self.registry.in_use(now)),
            "uptime_s": round(time.time() - self.started, 3),
            "reaped_segments": self.reaped_segments,
            "reaped_bytes": self.reaped_bytes,
            "reaped_sockets": self.reaped_sockets,
            "reap_failures": self.reap_failures,
            "pool_bytes": self.warm.nbytes,
            "pool_segments": len(self.warm.items),
            "tenants": self.tenancy.enabled,
            "connections_shed": 0 if self.guard is None else self.guard.shed,
            "uids": self.accounts.rows(doc["jobs"], now, self.guard),
        }
        document.mark_over_budget(doc["jobs"], doc["daemon"]["uids"])
        return doc

    def view(self, doc: dict[str, Any], peer: Peer | None) -> dict[str, Any]:
        """What ``peer`` may see of a stats document (NOTE [tenants]).

        Root, or any peer outside node mode: everything. A user in node mode:
        its own jobs in full; of the rest of the node only totals (``others``:
        jobs and bytes; the node's budget and use in ``daemon``), its own row
        of ``daemon.uids``, and only its own entries of ``invalid``.
        """
        if not self.tenancy.enabled or peer is None or peer.root:
            return doc
        uid = peer.uid
        mine = [j for j in doc["jobs"] if j.get("uid") == uid]
        others = [j for j in doc["jobs"] if j.get("uid") != uid]
        out = dict(doc)
        out["jobs"] = mine
        out["others"] = {"jobs": len(others), "bytes": sum(j["bytes"] for j in others)}
        out["invalid"] = [
            bad for bad in doc.get("invalid", []) if _file_uid(bad.get("name")) == uid
        ]
        if doc.get("daemon"):
            daemon = dict(doc["daemon"])
            daemon["uids"] = {str(uid): self.accounts.row(uid, mine, time.monotonic(), self.guard)}
            out["daemon"] = daemon
        return out

    def _counters(self) -> dict[str, Any]:
        return {
            "reaped_segments": self.reaped_segments,
            "reaped_bytes": self.reaped_bytes,
            "reaped_sockets": self.reaped_sockets,
            "reap_failures": self.reap_failures,
            "granted": self.registry.granted,
            "refused": self.registry.refused,
            "requests": self._requests_copy(),
        }

    def _requests_copy(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self.requests)

    def snapshot(self) -> dict[str, Any]:
        """The stats of the latest reap pass and live counters, for the metrics
        thread: no I/O, nothing the loop thread could be changing under it."""
        snap = self._snapshot
        stats = snap["stats"] if snap is not None else build_document([], "daemon")
        waits = snap["waits"] if snap is not None else []
        return {"stats": stats, "counters": self._counters(), "waits": waits}

    # ----------------------------------------------------------------- close

    def close(self) -> None:
        """Close the socket and unlink the warm segments; live jobs' segments stay."""
        self.warm.close()
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self._bound:
            self._bound = False
            try:
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("could not remove %s: %s", self.path, exc)


def _inode(fd: int | None) -> int | None:
    """The inode of the socket ``fd`` is now (None if it cannot be told)."""
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _src_fd(frame: zmq.Frame) -> int | None:
    """libzmq's descriptor of the connection a frame came from (None if not told)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def _file_uid(name: Any) -> int | None:
    """Owner of ``<ring directory>/<name>`` (None when it cannot be told)."""
    if not isinstance(name, str):
        return None
    for directory in ring_dirs():
        try:
            return os.lstat(os.path.join(directory, name.lstrip("/"))).st_uid
        except OSError:
            continue
    return None

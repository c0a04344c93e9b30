"""Connections per uid, and the daemon's file descriptors: no client can take it down.

It owns ``raise_fd_limit`` (the soft ``RLIMIT_NOFILE`` raised to the hard limit
at start) and ``ConnectionGuard``, a monitor of the ROUTER socket that counts
each uid's connections by ``SO_PEERCRED`` and shuts down the newest past
``--max-uid-connections`` (NOTE [connection bound]). It never closes a
descriptor libzmq owns; it imports nothing of shmloader.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("shmloaderd")

#: Connections one uid may hold open at once by default (each process of a job
#: that talks to the daemon holds one: ranks, DataLoader workers, ``stat``).
DEFAULT_MAX_UID_CONNECTIONS = 512
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_UCRED = struct.Struct("iII")  # pid, uid, gid
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.getsockopt.argtypes = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint32),
]
_LIBC.getsockname.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
_LIBC.shutdown.argtypes = [ctypes.c_int, ctypes.c_int]


# NOTE [connection bound]
#     libzmq accepts every connection to the control socket on its own I/O
#     thread, before any request, and aborts the whole process when
#     ``accept()`` fails with ``EMFILE`` (an ``errno_assert`` in its ipc
#     listener). In node mode the socket is 0666: about 1,100 idle unix
#     connections of any local user, no ZeroMQ handshake needed, ended the
#     root daemon by SIGABRT under systemd's default soft limit of 1,024, and
#     every job of the node then ran without budget or reaping. Two defences:
#
#     - at start the soft ``RLIMIT_NOFILE`` is raised to the hard limit
#       (``raise_fd_limit``; the shipped unit sets ``LimitNOFILE=``), so the
#       daemon has room far beyond what any one user's connections may take;
#     - a monitor of the ROUTER socket (``ConnectionGuard``, its own thread)
#       learns each accepted connection's descriptor, reads its
#       ``SO_PEERCRED`` and keeps a count per uid; a connection that takes a
#       uid past ``--max-uid-connections`` is shut down at once (libzmq then
#       sees the end of the stream and closes it itself: the daemon never
#       closes a descriptor libzmq owns). Before the shutdown the descriptor
#       is checked again to be a connection to our socket of that very uid,
#       so a number libzmq has since reused for anything else is left alone.
#       Root is not bounded.
#
#     A user at the bound loses only its newest connections (such a client
#     finds the daemon away and runs on: NOTE [daemon restarts] in
#     ``shmloader._transport.daemon_client``).
def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (NOTE [connection bound]);
    returns (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def peer_uid(fd: int, path: str) -> int | None:
    """The ``SO_PEERCRED`` uid of ``fd`` when it is a connection to the unix socket
    ``path``; None for anything else (closed, reused, not ours)."""
    cred = peer_cred(fd, path)
    return None if cred is None else cred[1]


def shut_down(fd: int, ino: int, path: str, pid: int, uid: int) -> bool:
    """End the stream of libzmq's connection ``fd`` (libzmq then closes it itself),
    only while ``fd`` is that very socket (inode ``ino``, read when it was accepted)
    and a connection to ``path`` of that process (``pid`` and ``uid`` by
    ``SO_PEERCRED``): a number libzmq has since given to another connection, of
    this process or another, is left alone."""
    try:
        if os.fstat(fd).st_ino != ino:
            return False
    except OSError:
        return False
    if peer_cred(fd, path) != (pid, uid):
        return False
    return _LIBC.shutdown(fd, socket.SHUT_RDWR) == 0


def peer_cred(fd: int, path: str) -> tuple[int, int] | None:
    """(pid, uid) of ``SO_PEERCRED`` when ``fd`` is a connection to ``path``."""
    addr = ctypes.create_string_buffer(128)
    size = ctypes.c_uint32(len(addr))
    if _LIBC.getsockname(fd, addr, ctypes.byref(size)) != 0 or size.value <= 2:
        return None
    family = int.from_bytes(addr.raw[:2], "little")
    name = addr.raw[2 : size.value].split(b"\0", 1)[0]
    if family != socket.AF_UNIX or name != os.fsencode(path):
        return None
    cred = ctypes.create_string_buffer(_UCRED.size)
    size = ctypes.c_uint32(_UCRED.size)
    if _LIBC.getsockopt(fd, socket.SOL_SOCKET, socket.SO_PEERCRED, cred, ctypes.byref(size)):
        return None
    pid, uid, _gid = _UCRED.unpack(cred.raw)
    return pid, uid


class ConnectionGuard:
    """Counts the control socket's connections per uid; sheds those past the bound."""

    def __init__(self, sock: zmq.Socket, path: str, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.conns: dict[int, int] = {}  # fd -> uid
        self.per_uid: dict[int, int] = {}
        self.shed = 0  # connections shut down, in all
        self._lock = threading.Lock()  # the counts are read by stats
        self._stop = threading.Event()
        self._last_log = 0.0
        self._unlogged = 0
        self._thread = threading.Thread(target=self._run, name="shmloaderd-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def counts(self) -> dict[int, int]:
        with self._lock:
            return dict(self.per_uid)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.monitor.poll(100):
                    continue
                self._event(recv_monitor_message(self.monitor))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("connection guard: monitor failed; retrying")
                time.sleep(0.1)
            except Exception:  # never let a bug here end the guard
                log.exception("connection guard: event not handled")

    def _event(self, msg: Mapping[str, Any]) -> None:
        fd = msg.get("value")
        if not isinstance(fd, int):
            return
        if msg["event"] != zmq.EVENT_ACCEPTED:
            with self._lock:
                uid = self.conns.pop(fd, None)
                if uid is not None:
                    self.per_uid[uid] -= 1
                    if not self.per_uid[uid]:
                        del self.per_uid[uid]
            return
        uid = peer_uid(fd, self.path)
        if uid is None:
            return
        with self._lock:
            old = self.conns.pop(fd, None)  # a lost close event: the number was reused
            if old is not None:
                self.per_uid[old] -= 1
            self.conns[fd] = uid
            self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
            over = uid != 0 and self.per_uid[uid] > self.limit
        if over and peer_uid(fd, self.path) == uid:  # still that connection's number
            _LIBC.shutdown(fd, socket.SHUT_RDWR)
            self.shed += 1
            self._warn(uid)

    def _warn(self, uid: int) -> None:
        now = time.monotonic()
        if now - self._last_log < 10.0:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last such line)" if self._unlogged else ""
        log.warning(
            "closed a connection of uid %d: it holds %d connections to the control socket, "
            "more than --max-uid-connections %d%s",
            uid,
            self.per_uid.get(uid, 0),
            self.limit,
            more,
        )
        self._last_log, self._unlogged = now, 0

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self.monitor.close(linger=0)

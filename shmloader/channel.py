"""ZeroMQ signalling inside one node: the writer's ``Hub``, each reader's ``Spoke``.

The writer binds a ROUTER socket at ``ipc://<runtime dir>/<token>-<pid>.sock``;
each reader connects a DEALER whose routing id is ``r<rank>``. Messages are
the ``wire`` module's frames; payload never travels here.

The runtime directory is ``$SHMLOADER_RUNTIME_DIR`` (else ``$XDG_RUNTIME_DIR``,
else ``/tmp``) joined with ``shmloader-<uid>``, created 0700 and refused when it
belongs to someone else or is open to others, so no other user can connect.

NOTE [bounded waits]
    No wait in shmloader is unbounded. Every blocking receive polls in slices
    of ``SLICE_S``; between slices it checks that the peers it waits for are
    alive (pid plus start time, see ``segment.process_alive``) and raises
    :class:`~shmloader.errors.PeerLostError` as soon as one is dead, or once
    the configured timeout has passed without an answer. A dead peer is thus
    detected within about ``SLICE_S`` whatever the timeout is. Before it
    concludes that a peer died, a wait drains what is already queued (for up
    to ``DRAIN_S``): a peer's last word (the leader's ERROR) is handled, not
    lost to the race between its send and its exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable

import zmq

from .errors import ConfigError, PeerLostError, ProtocolError
from .segment import process_alive
from .wire import Message, parse

log = logging.getLogger(__name__)

SLICE_S = 0.2
#: How long a wait keeps draining queued messages once a peer is seen dead.
DRAIN_S = 0.05


def runtime_dir(parent: str | None) -> str:
    """The per-user 0700 socket directory, created if needed and checked."""
    base = parent or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"shmloader-{os.geteuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError("SHMLOADER_RUNTIME_DIR", base, f"a writable directory ({exc})") from None
    st = os.lstat(path)
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or stat.S_IMODE(st.st_mode) & 0o077
    ):
        raise ConfigError(
            "SHMLOADER_RUNTIME_DIR",
            base,
            f"a directory where {path} is ours with mode 0700 (it has uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):o}); remove it or choose another directory",
        )
    return path


#: sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def socket_path(parent: str | None, token: str, pid: int) -> str:
    path = os.path.join(runtime_dir(parent), f"{token}-{pid}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ConfigError(
            "SHMLOADER_RUNTIME_DIR",
            parent or os.environ.get("XDG_RUNTIME_DIR") or "/tmp",
            f"a shorter directory: the socket path {path} is {len(path.encode())} bytes and "
            f"ipc sockets take at most {MAX_SOCKET_PATH}",
        )
    return path


_context: zmq.Context | None = None
_context_pid = -1


def context() -> zmq.Context:
    """One ZeroMQ context per process (re-made after fork)."""
    global _context, _context_pid
    if _context is None or _context_pid != os.getpid():
        _context = zmq.Context()
        _context_pid = os.getpid()
    return _context


class Peer:
    """A process we wait on: rank, role, pid and start time."""

    def __init__(self, rank: int, role: str, pid: int, start: int) -> None:
        self.rank, self.role, self.pid, self.start = rank, role, pid, start

    def alive(self) -> bool:
        return process_alive(self.pid, self.start)


class _Endpoint:
    sock: zmq.Socket

    def _receive(self, timeout: float) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return self.sock.recv_multipart(copy=True)
        return None

    def wait(
        self,
        handle: Callable[[Message, int | None], bool],
        peers: Callable[[], Iterable[Peer]],
        *,
        timeout: float,
        doing: str,
        idle: Callable[[], None] | None = None,
    ) -> None:
        """Receive and ``handle`` messages until it returns True (NOTE [bounded waits]).

        ``handle(msg, sender_rank)`` returns True when the wait is over.
        ``peers()`` are the processes whose death ends the wait with
        :class:`PeerLostError`. ``idle()`` runs once per slice on the waiting
        thread (a reader flushes RELEASEs queued by other threads there).
        """
        deadline = time.monotonic() + timeout
        next_check = 0.0
        while True:
            now = time.monotonic()
            msg = self.receive(min(SLICE_S, max(deadline - now, 0)))
            if msg is not None and handle(*msg):
                return
            if idle is not None:
                idle()
            now = time.monotonic()
            if now >= next_check:  # liveness at most every slice, even under a stream
                next_check = now + SLICE_S
                for peer in peers():
                    if not peer.alive():
                        # Its last messages may be queued behind the liveness check.
                        while (msg := self.receive(DRAIN_S)) is not None:
                            if handle(*msg):
                                return
                        raise PeerLostError(
                            peer.rank, peer.role, f"process {peer.pid} died while we were {doing}"
                        )
            if now >= deadline:
                waiting = ", ".join(f"{p.role} rank {p.rank}" for p in peers())
                raise PeerLostError(
                    None,
                    waiting or "peer",
                    f"no answer for {timeout:.0f} s (SHMLOADER_TIMEOUT) while {doing}",
                )

    def receive(self, timeout: float) -> tuple[Message, int | None] | None:  # pragma: no cover
        raise NotImplementedError


class Hub(_Endpoint):
    """The writer's ROUTER socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = context().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # our own token and pid: a leftover of this very process
        self.sock.bind(f"ipc://{path}")
        os.chmod(path, 0o600)

    def send(self, rank: int, parts: list) -> None:
        try:
            self.sock.send_multipart([b"r%d" % rank, *parts])
        except (zmq.Again, zmq.ZMQError) as exc:
            raise PeerLostError(rank, "follower", f"cannot deliver to it ({exc})") from None

    def receive(self, timeout: float) -> tuple[Message, int | None] | None:
        while (raw := self._receive(timeout)) is not None:
            timeout = 0
            got = self._parse(raw)
            if got is not None:
                return got
        return None

    def _parse(self, raw: list[bytes]) -> tuple[Message, int | None] | None:
        ident, parts = raw[0], raw[1:]
        try:
            if not ident.startswith(b"r") or not ident[1:].isdigit():
                raise ProtocolError(f"unknown routing id {ident[:20]!r}")
            rank = int(ident[1:])
            msg = parse(parts)
            if msg.body.get("rank", rank) != rank:
                raise ProtocolError(f"message from r{rank} claims rank {msg.body.get('rank')}")
        except ProtocolError as exc:
            log.warning("shmloader: dropped a malformed message: %s", exc)
            return None
        return msg, rank

    def close(self) -> None:
        self.sock.close(linger=100)  # let a last END/STOP leave; bounded
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Spoke(_Endpoint):
    """A reader's DEALER socket."""

    def __init__(self, path: str, rank: int) -> None:
        self.sock = context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"r%d" % rank)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.connect(f"ipc://{path}")

    def send(self, parts: list) -> None:
        try:
            self.sock.send_multipart(parts)
        except zmq.Again:
            log.warning("shmloader: the writer did not take a message within 1 s; dropped it")

    def receive(self, timeout: float) -> tuple[Message, int | None] | None:
        while (raw := self._receive(timeout)) is not None:
            timeout = 0
            try:
                return parse(raw), None
            except ProtocolError as exc:
                log.warning("shmloader: dropped a malformed message: %s", exc)
        return None

    def close(self) -> None:
        self.sock.close()

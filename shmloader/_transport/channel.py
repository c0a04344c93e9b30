"""ZeroMQ signalling inside one node: the writer's ``Hub``, each reader's ``Spoke``.

It owns the node's sockets (the writer's ROUTER and XPUB in its private 0700
runtime directory, each reader's DEALER and SUB; drawn in
docs/internals/wire.md), announcing once to every reader (NOTE [one
announcement]), peer liveness (pid and start time, or a life lock across pid
namespaces) and bounded waits (NOTE [bounded waits]). It carries ``wire`` frames
only, never payload; it touches only its own sockets, in the directory
``rundir`` made.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import cast

import zmq

from .._node import segment
from .._node.rundir import announce_path, check_private_dir, remove_private_dir
from .._node.segment import process_alive
from .._proto.wire import Message, parse
from ..errors import PeerLostError, ProtocolError
from .doorbell import Doorbell

log = logging.getLogger(__name__)

SLICE_S = 0.2
#: How long a wait keeps draining queued messages once a peer is seen dead.
DRAIN_S = 0.05


#: Marker topics start with this byte; wire frames never do (they start with the magic).
MARKER = b"\xff"
#: How long a writer waits for the BYE of a reader whose socket closed.
BYE_GRACE_S = 0.2


def marker(rank: int) -> bytes:
    """The topic a reader subscribes to so that the writer sees it arrive and leave."""
    return MARKER + b"r%d" % rank


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
    """A process we wait on: rank, role, pid and start time.

    NOTE [liveness across pid namespaces]
        A peer in our pid namespace is alive while (pid, start time) runs. A
        peer in another one (containers sharing ``/dev/shm`` but not pids)
        has a pid that means nothing here; it is judged by its *life lock*
        instead: every rank holds an exclusive ``flock`` on its probe segment
        for as long as its loader's topology lives, and we keep a descriptor
        of that segment (``life_fd``). ``flock(LOCK_SH | LOCK_NB)`` on it
        fails while the owner lives and succeeds once every descriptor of the
        owner is closed, i.e. it died. Works wherever ``/dev/shm`` is shared.
        Without a life lock (another node) a foreign peer counts as alive and
        the timeout bounds the wait.
    """

    def __init__(
        self,
        rank: int,
        role: str,
        pid: int,
        start: int,
        *,
        pidns: int = 0,
        life_fd: int | None = None,
    ) -> None:
        self.rank, self.role, self.pid, self.start = rank, role, pid, start
        self.pidns, self.life_fd = pidns, life_fd

    def alive(self) -> bool:
        if not self.pidns or not segment.MY_PIDNS or self.pidns == segment.MY_PIDNS:
            return process_alive(self.pid, self.start)
        if self.life_fd is None:
            return True
        return life_lock_held(self.life_fd)


def life_lock_held(fd: int) -> bool:
    """Whether someone else holds the exclusive life lock of ``fd``'s file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell: do not call a peer dead on a doubt
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


# NOTE [bounded waits]
#     No wait in shmloader is unbounded. Every blocking receive polls in slices
#     of ``SLICE_S``; between slices it checks that the peers it waits for are
#     alive (pid plus start time, see ``segment.process_alive``) and raises
#     :class:`~shmloader.errors.PeerLostError` as soon as one is dead, or once
#     the configured timeout has passed without an answer. A dead peer is thus
#     detected within about ``SLICE_S`` whatever the timeout is. Before it
#     concludes that a peer died, a wait drains what is already queued (for up
#     to ``DRAIN_S``): a peer's last word (the leader's ERROR) is handled, not
#     lost to the race between its send and its exit.
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
        patient: Callable[[], bool] | None = None,
    ) -> None:
        """Receive and ``handle`` messages until it returns True (NOTE [bounded waits]).

        ``handle(msg, sender_rank)`` returns True when the wait is over.
        ``peers()`` are the processes whose death ends the wait with
        :class:`PeerLostError`. ``idle()`` runs once per slice on the waiting
        thread (a reader flushes RELEASEs queued by other threads there).
        ``patient()``, asked when ``timeout`` is over: True gives the wait
        another ``timeout`` (a loop that runs ahead while its user is not
        waiting for it: NOTE [running ahead] in ``_roles.producer``).
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
            if now >= deadline and patient is not None and patient():
                deadline = now + timeout
            if now >= deadline:
                waiting = ", ".join(f"{p.role} rank {p.rank}" for p in peers())
                raise PeerLostError(
                    None,
                    waiting or "peer",
                    f"no answer for {timeout:.0f} s (SHMLOADER_TIMEOUT) while {doing}",
                )

    def receive(self, timeout: float) -> tuple[Message, int | None] | None:  # pragma: no cover
        raise NotImplementedError


# NOTE [one announcement]
#     A writer's messages are the same for every reader, so they are published
#     once on the XPUB instead of sent once per reader: the writer's cost per
#     batch does not grow with the group. What is per reader (its HELLO, ACKs,
#     releases, BYE) stays on the ROUTER. Two rules keep the guarantees a
#     per-reader send gave:
#
#     - *Nobody misses a message.* A publication reaches only subscriptions
#       the XPUB has already processed. Each reader subscribes to everything
#       and to its own marker topic ``\xffr<rank>`` (no message starts with
#       ``\xff``); the XPUB hands each marker up when it took it, and the
#       writer counts a reader as arrived only once it has both the reader's
#       HELLO and its marker (``Hub.subscribed``). The writer publishes only
#       after every live reader arrived (``Writer.await_readers``).
#     - *A reader that went away is noticed at once.* A reader's socket closing
#       unsubscribes its marker (``Hub.left``); the writer checks after every
#       publication, and a reader gone without BYE is lost (PeerLostError),
#       as a failed send to it was (its BYE may trail on the other socket: the
#       writer waits ``BYE_GRACE_S`` for it first).
class Hub(_Endpoint):
    """The writer's sockets: the ROUTER readers talk to, the XPUB it announces on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.creator = os.getpid()  # NOTE [creator-only cleanup]
        #: Readers whose marker subscription the XPUB took, and those whose socket
        #: closed since (NOTE [one announcement]).
        self.subscribed: set[int] = set()
        self.left: set[int] = set()
        check_private_dir(os.path.dirname(path))
        # A context of its own, terminated at close: NOTE [the last word leaves].
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        self.pub = self._ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the window rule bounds the queue
        self.pub.setsockopt(zmq.LINGER, 0)
        pub = announce_path(path)
        self.pub.bind(f"ipc://{pub}")
        os.chmod(pub, 0o600)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.pub, zmq.POLLIN)

    def broadcast(self, parts: list) -> None:
        """Send ``parts`` to every subscribed reader at once (NOTE [one announcement])."""
        self.pub.send_multipart(parts)
        self.events()

    def events(self) -> bool:
        """Take the XPUB's (un)subscriptions now; whether any reader arrived or left."""
        changed = False
        while cast(int, self.pub.get(zmq.EVENTS)) & zmq.POLLIN:  # cheaper than a recv that fails
            raw = self.pub.recv(zmq.NOBLOCK)
            rank = _marker_rank(raw[1:])
            if rank is None or raw[:1] not in (b"\x00", b"\x01"):
                continue  # the everything subscription, or a stranger's topic: no one to track
            changed = True
            if raw[:1] == b"\x01":
                self.subscribed.add(rank)
                self.left.discard(rank)
            else:
                self.subscribed.discard(rank)
                self.left.add(rank)
        return changed

    # wider than _Endpoint.receive: (None, None) too, which the hub's handlers take
    def receive(  # type: ignore[override]
        self, timeout: float
    ) -> tuple[Message | None, int | None] | None:
        """The next reader message, or ``(None, None)`` when a reader arrived or left."""
        if self.sock.closed:  # as a closed socket's own poll would (zmq's poller would hang)
            raise zmq.ZMQError(zmq.ENOTSOCK)
        while True:
            ready = dict(self._poller.poll(int(timeout * 1000)))
            timeout = 0
            if not ready:
                return None
            if self.pub in ready and self.events():
                return None, None
            if self.sock in ready:
                got = self._parse(self.sock.recv_multipart(copy=True))
                if got is not None:
                    return got

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
        """Close the sockets and remove them and their directory; a no-op in a forked child.

        NOTE [the last word leaves]
            A socket's ``close`` only hands its queue to ZeroMQ's I/O thread,
            and pyzmq never terminates a context at interpreter exit, so a
            writer whose process ends right after ``close()`` (a fast exit,
            ``os._exit`` in a forked process) could take its last END or STOP
            with it: the reader then sees the writer dead instead of the end
            of the epoch. The hub's sockets have a context of their own, and
            ``close()`` terminates it: it returns once the queue has left,
            or after the 500 ms linger at most.
        """
        if os.getpid() != self.creator:
            return  # the parent's socket and files are not ours to touch
        self.pub.close(linger=500)  # let a last END/STOP leave; bounded
        self.sock.close(linger=500)
        self._ctx.term()  # returns when both queues left, or the linger ran out
        remove_private_dir(os.path.dirname(self.path), self.creator)


def _marker_rank(topic: bytes) -> int | None:
    if not topic.startswith(MARKER + b"r") or not topic[2:].isdigit() or len(topic) > 12:
        return None
    return int(topic[2:])


class Spoke(_Endpoint):
    """A reader's sockets: the DEALER it talks to the writer on, the SUB it hears it on."""

    def __init__(self, path: str, rank: int, *, wake: Doorbell | None = None) -> None:
        # Gone already (a writer that failed and closed first) is not an error
        # here: ZeroMQ connects lazily and the wait's liveness check reports it.
        with contextlib.suppress(FileNotFoundError):
            check_private_dir(os.path.dirname(path))
        self.creator = os.getpid()
        self.sock = context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"r%d" % rank)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.connect(f"ipc://{path}")
        self.sub = context().socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.SUBSCRIBE, marker(rank))  # NOTE [one announcement]
        self.sub.connect(f"ipc://{announce_path(path)}")
        #: the owner's doorbell: a ring ends a wait's slice at once, so that its ``idle``
        #: sends what another thread queued (a dropped batch's RELEASE) without delay
        self.wake = wake
        self._poller = zmq.Poller()
        self._poller.register(self.sub, zmq.POLLIN)
        if wake is not None:
            self._poller.register(wake.fileno(), zmq.POLLIN)

    def _receive(self, timeout: float) -> list[bytes] | None:
        ready = dict(self._poller.poll(int(timeout * 1000)))
        if self.sub in ready:
            return self.sub.recv_multipart(copy=True)
        if self.wake is not None and ready:
            self.wake.clear()  # rung: the wait runs its idle now
        return None

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
        if os.getpid() == self.creator:  # NOTE [creator-only cleanup]
            self.sock.close()
            self.sub.close()

"""The control socket's wire: ZMTP 3.0, spoken by the daemon itself.

The control socket is a ZeroMQ ``STREAM`` socket: libzmq accepts the
connections (``ConnectionGuard`` still counts them) and moves their raw bytes,
at most ``RCVHWM`` chunks per connection; this module speaks ZMTP 3.0 over
them as a ``ROUTER`` would (NULL mechanism), so clients (``REQ``, ``DEALER``)
are unchanged. It owns ``Wire``: each connection's state, the parse of its
bytes into requests under the bounds of what one connection and one uid may
make the daemon hold (NOTE [bounded state] in ``registry``), and the encoding
of replies. It touches no socket: the server moves the bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from shmloader._transport.daemon_client import MAX_REQUEST

from .tenants import Peer

#: A frame announcing more is refused, its connection dropped (a request is at
#: most ``MAX_REQUEST``; up to this size it is read and answered with an error).
MAX_FRAME = 4 * MAX_REQUEST
#: What one connection may make the daemon hold of a request it has not finished.
CONN_BYTES = MAX_FRAME + (64 << 10)
#: Frames of one message at most (a request is one frame, after a ``REQ``'s
#: empty delimiter).
MAX_FRAMES = 16
#: What all connections of one uid may make the daemon hold of unfinished requests.
UID_BYTES = 4 * CONN_BYTES
#: Seconds a connection may hold an unfinished request, or replies it does not
#: read, before it is dropped.
UNFINISHED_S = 30.0
#: Connections forgotten before libzmq's notice of their end, kept to tell that notice
#: from a start (NOTE [notices of the end]).
FORGOTTEN = 4096
#: Largest command frame (``READY``'s properties, ``PING``).
MAX_COMMAND = 4096
#: The libzmq chunks of raw bytes (8 KiB at most each) one connection may have
#: queued for the daemon; libzmq reads no more of it until the daemon takes them.
RCVHWM = 4
#: Replies are handed to libzmq in pieces of at most this many bytes, at most
#: ``SNDHWM`` pieces queued for one connection; the rest waits in its ``outbox``
#: (less than a piece and one reply), and no further request of that
#: connection is read meanwhile.
PIECE = 32 << 10
SNDHWM = 4

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
GREETING_SIZE = 64
#: Ours: ZMTP 3.0, NULL mechanism, as-server 0.
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _command(body: bytes) -> bytes:
    return _header(_COMMAND, len(body)) + body


def _header(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", size)
    return bytes([flags, size])


#: What the daemon sends a connection first: its greeting and its ``READY``.
HELLO = GREETING + _command(b"\x05READY" + _property(b"Socket-Type", b"ROUTER"))
#: A command every ZMTP peer ignores (libzmq reads it as a heartbeat answer):
#: written to a long-idle connection to learn whether libzmq still has it.
PROBE = _command(b"\x04PONG")


class Dropped(Exception):
    """The connection broke a bound or the protocol: the message says which."""


@dataclass
class Conn:
    """One connection: who it is, where its handshake stands, what it has sent."""

    peer: Peer | None
    fd: int | None  # libzmq's descriptor of it, for a hang-up libzmq cannot queue
    last: float  # monotonic time of its latest bytes
    ino: int | None = None  # its socket's inode: ``fd`` is that socket only while it matches
    pieces: int = 0  # pieces of replies libzmq took for it (NOTE [notices of the end])
    stage: int = 0  # 0: its greeting, 1: its READY, 2: requests
    buf: bytearray = field(default_factory=bytearray)  # received, not parsed yet
    frames: list[bytes] = field(default_factory=list)  # of its unfinished message
    framed: int = 0  # bytes in ``frames``
    held: int = 0  # ``len(buf) + framed``, as charged to its uid
    outbox: bytearray = field(default_factory=bytearray)  # replies not queued yet
    since: float = 0.0  # monotonic time it began to hold anything; 0: holds nothing

    @property
    def uid(self) -> int:
        return -1 if self.peer is None else self.peer.uid


class Wire:
    """The ZMTP 3.0 state of every connection; bounds what each may make us hold."""

    def __init__(
        self,
        *,
        max_frame: int = MAX_FRAME,
        conn_bytes: int = CONN_BYTES,
        uid_bytes: int = UID_BYTES,
        max_frames: int = MAX_FRAMES,
    ) -> None:
        self.max_frame = max_frame
        self.conn_bytes = conn_bytes
        self.uid_bytes = uid_bytes
        self.max_frames = max_frames
        self.conns: dict[bytes, Conn] = {}
        self.held_by_uid: dict[int, int] = {}
        self.waiting: set[bytes] = set()  # connections whose outbox libzmq refused
        self.dropped = 0  # connections dropped for what they sent, in all
        #: connections the daemon forgot before libzmq's notice of their end came (NOTE
        #: [notices of the end]), oldest first; at most ``FORGOTTEN`` of them
        self.forgotten: dict[bytes, None] = {}

    # NOTE [notices of the end]
    #     libzmq tells a STREAM socket of a connection's start and of its end
    #     alike: an empty message from it. The daemon forgets a connection
    #     itself when it hangs up or finds it gone (``forget``), and the
    #     notice of its end comes after; taken for a start, it would make a
    #     connection that is not there, whose descriptor number libzmq may
    #     have given to another connection meanwhile. So the notice of a
    #     forgotten connection only ends its entry in ``forgotten`` (libzmq's
    #     routing ids are never reused); at most ``FORGOTTEN`` entries are kept
    #     (NOTE [bounded state] in ``registry``), the oldest going first.
    #
    #     The same lateness rules a hang-up by descriptor (``guard.shut_down``,
    #     for a connection whose unread replies fill its queue, so that libzmq
    #     refuses the empty message that would close it): the descriptor read
    #     at a start that is processed late may already be another
    #     connection's. Only a connection libzmq took ``SNDHWM`` pieces for
    #     was alive at its start, so only its descriptor is used, and only
    #     while it is still that socket (its inode).
    def notice(self, ident: bytes) -> bool:
        """libzmq's empty message of ``ident``: True when it is a new connection's start
        (else the end of a known or forgotten one, which is forgotten now)."""
        if ident in self.forgotten:  # the end of one the daemon forgot already
            del self.forgotten[ident]
            return False
        return self.forget(ident) is None

    def opened(
        self, ident: bytes, peer: Peer | None, fd: int | None, ino: int | None, now: float
    ) -> Conn:
        """A new connection; ``HELLO`` waits in its outbox."""
        conn = self.conns[ident] = Conn(peer, fd, now, ino=ino, since=now)
        conn.outbox += HELLO
        return conn

    def forget(self, ident: bytes, *, noticed: bool = True) -> Conn | None:
        """Forget a connection and what it held; its state, None when unknown.
        ``noticed=False``: libzmq's notice of its end is still to come."""
        conn = self.conns.pop(ident, None)
        self.waiting.discard(ident)
        if conn is not None:
            self._charge(conn, 0)
            if not noticed:
                self.forgotten[ident] = None
                while len(self.forgotten) > FORGOTTEN:
                    del self.forgotten[next(iter(self.forgotten))]
        return conn

    def held(self, uid: int) -> int:
        return self.held_by_uid.get(uid, 0)

    def feed(self, conn: Conn, data: bytes, now: float) -> None:
        """Bytes of a connection in, kept until ``next`` parses them.

        Raises ``Dropped`` when the connection or its uid would hold more than
        its bound (the caller then hangs up and calls ``closed``).
        """
        conn.last = now
        conn.buf += data
        self._settle(conn, now)
        self._check(conn, conn.held)

    def next(self, conn: Conn, now: float) -> list[bytes] | None:
        """Its next finished message (a list of frames), None until it has one.

        Raises ``Dropped`` naming the bound or rule it broke. No bound is
        passed, even for a moment: a frame is refused from its header, before
        its bytes are kept.
        """
        out: list[list[bytes]] = []
        try:
            while not out and self._step(conn, out):
                pass
        finally:
            self._settle(conn, now)
        return out[0] if out else None

    def _settle(self, conn: Conn, now: float) -> None:
        self._charge(conn, len(conn.buf) + conn.framed)
        if conn.held or conn.outbox:
            conn.since = conn.since or now
        else:
            conn.since = 0.0

    def _check(self, conn: Conn, held: int) -> None:
        if held > self.conn_bytes:
            raise Dropped(
                f"it would hold {held} bytes of requests not answered yet, more than the "
                f"{self.conn_bytes} one connection may"
            )
        others = self.held(conn.uid) - conn.held
        if others + held > self.uid_bytes:
            raise Dropped(
                f"its uid's connections would hold {others + held} bytes of requests not "
                f"answered yet, more than the {self.uid_bytes} one uid may"
            )

    def _step(self, conn: Conn, out: list[list[bytes]]) -> bool:
        """Parse one greeting, command or frame off ``conn.buf``; False: need more."""
        buf = conn.buf
        if conn.stage == 0:
            if len(buf) < GREETING_SIZE:
                if buf and buf[0] != 0xFF:
                    raise Dropped("it does not speak ZMTP (no greeting)")
                return False
            greeting = bytes(buf[:GREETING_SIZE])
            del buf[:GREETING_SIZE]
            if greeting[0] != 0xFF or not greeting[9] & 1 or greeting[10] < 3:
                raise Dropped("its greeting is not ZMTP 3 (ZMTP 1 and 2 are not served)")
            if greeting[12:32].rstrip(b"\0") != b"NULL":
                mechanism = greeting[12:32].rstrip(b"\0").decode("ascii", "replace")
                raise Dropped(f"it asks for the {mechanism!r} mechanism; only NULL is served")
            conn.stage = 1
            return True
        if len(buf) < 2:
            return False
        flags = buf[0]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise Dropped(f"a frame has the reserved flags {flags:#04x}")
        if flags & _LONG:
            if len(buf) < 9:
                return False
            size, start = struct.unpack_from(">Q", buf, 1)[0], 9
        else:
            size, start = buf[1], 2
        command = bool(flags & _COMMAND)
        if command and (flags & _MORE or size > MAX_COMMAND):
            raise Dropped(f"a command of {size} bytes{' with MORE' if flags & _MORE else ''}")
        if conn.stage == 1 and not command:
            raise Dropped("it sent a message before its READY")
        if not command:  # NOTE [bounded state]: refused from the header, before its bytes
            if size > self.max_frame:
                raise Dropped(f"a frame of {size} bytes; at most {self.max_frame} are read")
            if len(conn.frames) >= self.max_frames:
                raise Dropped(f"a message of more than {self.max_frames} frames")
            self._check(conn, max(conn.held, conn.framed + start + size))
        if len(buf) < start + size:
            return False
        body = bytes(buf[start : start + size])
        del buf[: start + size]
        if command:
            self._command(conn, body)
            return True
        conn.frames.append(body)
        conn.framed += size
        if not flags & _MORE:
            out.append(conn.frames)
            conn.frames, conn.framed = [], 0
        return True

    def _command(self, conn: Conn, body: bytes) -> None:
        name = body[1 : 1 + body[0]] if body else b""
        if conn.stage == 1:
            if name != b"READY":
                raise Dropped(f"its handshake sent {name!r:.40}, not READY")
            conn.stage = 2
        elif name == b"PING" and len(body) >= 7:  # ZMTP 3.1 heartbeat: answer its context
            conn.outbox += _command(b"\x04PONG" + body[7:23])

    def _charge(self, conn: Conn, held: int) -> None:
        uid = conn.uid
        total = self.held_by_uid.get(uid, 0) - conn.held + held
        if total:
            self.held_by_uid[uid] = total
        else:
            self.held_by_uid.pop(uid, None)
        conn.held = held

    def overdue(self, now: float, limit: float = UNFINISHED_S) -> list[bytes]:
        """Connections holding an unfinished request or unread replies for ``limit`` s."""
        return [i for i, c in self.conns.items() if c.since and now - c.since > limit]

    def idle(self, now: float, limit: float) -> list[bytes]:
        """Connections that sent nothing for ``limit`` s (their state is probed)."""
        return [i for i, c in self.conns.items() if now - c.last > limit]


def encode(frames: list[bytes]) -> bytes:
    """One message as ZMTP frames."""
    out = bytearray()
    for i, frame in enumerate(frames):
        out += _header(_MORE if i < len(frames) - 1 else 0, len(frame))
        out += frame
    return bytes(out)

"""What clients send, and what a user's dead jobs leave: bounded per connection and per uid.

A node-mode daemon under a raw ZMTP 3.0 client of another uid (greeting, READY
and frames written by hand on a unix socket: a ZeroMQ client never lets an
unfinished multipart message leave its process) that sends frames with the
MORE flag and never a last one, on many connections; one that sends requests
and never reads a reply; one that sends a flood of empty frames. The daemon's
RSS stays under the bound docs/operating.md states, each offender is dropped
and logged, and the other user and the offender's own next client are
answered (NOTE [bounded state] in ``shmloaderd.registry``).

The users are forked children of this process that drop to unused uids, as in
test_daemon_tenants.py; the commands they run are defined here.
"""

from __future__ import annotations

import socket
import struct

import pytest
from shmloaderd import zmtp
from shmloaderd.tenants import Peer

import tests.daemon.test_daemon_tenants as tenants
from tests.daemon.test_daemon import Daemons, daemons, wait_until  # noqa: F401 (fixture)
from tests.daemon.test_daemon_tenants import _node_daemon, free_uids, users

MIB = 1 << 20
#: RSS the daemon may gain under every flood here: the bound one uid's
#: unfinished requests may make it hold, and 32 MiB for libzmq's per-connection
#: queues and the allocator's slack (docs/operating.md, "What clients can make
#: the daemon hold").
RSS_BOUND = zmtp.UID_BYTES + 32 * MIB


def _greet(path: str) -> socket.socket:
    """A raw ZMTP 3.0 DEALER: greeting and READY written by hand."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    return s


def _frame(data: bytes, more: bool) -> bytes:
    return bytes([0x02 | int(more)]) + struct.pack(">Q", len(data)) + data


def _send_all(s: socket.socket, frames: list[bytes]) -> int:
    """Frames sent before the daemon dropped the connection."""
    for i, f in enumerate(frames):
        try:
            s.sendall(f)
        except OSError:  # EPIPE, ECONNRESET: it was dropped
            return i
    return len(frames)


def _closed(s: socket.socket) -> bool:
    """Whether the daemon has closed ``s`` (EOF once its greeting is read)."""
    s.setblocking(False)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:  # ECONNRESET
        return True


# ------------------------------------------------------- in a user's child


def cmd_zmtp_unfinished(path: str, conns: int, frames_each: int) -> list[int]:
    """``conns`` connections, each sending up to ``frames_each`` frames of 1 MiB with
    MORE and never the last; they stay open. Frames each sent before it was dropped."""
    held = tenants._state.setdefault("zmtp", [])
    sent = []
    mib = _frame(b"x" * MIB, more=True)
    for _ in range(conns):
        s = _greet(path)
        held.append(s)
        sent.append(_send_all(s, [mib] * frames_each))
    return sent


def cmd_zmtp_tiny_frames(path: str, n: int) -> int:
    """One connection sending ``n`` empty frames with MORE."""
    s = _greet(path)
    tenants._state.setdefault("zmtp", []).append(s)
    return _send_all(s, [_frame(b"", more=True) * 1024] * (n // 1024))


def cmd_zmtp_unread(path: str, n: int) -> int:
    """One connection sending ``n`` ``stats`` requests and never reading a reply."""
    s = _greet(path)
    tenants._state.setdefault("zmtp", []).append(s)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = _frame(b'{"v":1,"op":"stats"}', more=False) * 256
    return _send_all(s, [request] * (n // 256)) * 256


def cmd_zmtp_closed() -> list[bool]:
    return [_closed(s) for s in tenants._state.get("zmtp", [])]


def cmd_zmtp_end() -> None:
    for s in tenants._state.pop("zmtp", []):
        s.close()


for _name, _fn in list(globals().items()):  # the users' children run ``tenants.cmd_*``
    if _name.startswith("cmd_zmtp_"):
        setattr(tenants, _name, _fn)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for pid {pid}")


# ------------------------------------------------------------------ tests


@pytest.mark.timeout(120)
def test_unfinished_multipart_requests_are_bounded_per_connection_and_uid(
    daemons: Daemons,  # noqa: F811
) -> None:
    """Before, a ROUTER kept every frame of an unfinished message: 1,536 frames of
    1 MiB with MORE took the root daemon from 40 MiB to 1,582 MiB, and nothing was
    logged. Now a connection is dropped from the frame header that takes it past
    its bound, and a uid's connections together past theirs."""
    a_uid, b_uid = free_uids()
    path, d = _node_daemon(daemons)
    with users(path, a_uid, b_uid) as (a, b):
        assert a.call("stats")["daemon"]["tenants"] is True  # its own client connected
        before = _rss(d.proc.pid)
        # one connection: the reproduction, cut short
        (sent,) = a.call("zmtp_unfinished", path, 1, 64, timeout=60)
        assert sent <= zmtp.CONN_BYTES // MIB, sent
        # many connections, each under its own bound: the uid's bound drops the rest
        per = zmtp.CONN_BYTES // MIB - 1
        conns = 2 * zmtp.UID_BYTES // (per * MIB)
        sent_each = a.call("zmtp_unfinished", path, conns, per, timeout=60)
        assert sum(sent_each) * MIB <= zmtp.UID_BYTES + conns * MIB, sent_each
        # a flood of empty frames: bounded by their count, not their bytes
        assert a.call("zmtp_tiny_frames", path, 1 << 20) < 1 << 20
        grown = _rss(d.proc.pid) - before
        assert grown < RSS_BOUND, f"the daemon grew by {grown >> 20} MiB under the flood"
        wait_until(
            lambda: sum(a.call("zmtp_closed")) >= 1 + conns // 2 + 1,
            20,
            "the offending connections dropped",
            0.2,
        )
        closed = a.call("zmtp_closed")
        assert closed[0] and closed[-1], closed  # the first flood and the tiny frames
        assert not all(closed[1:-1]), closed  # within the uid's bound: kept
        assert b.call("stats")["daemon"]["tenants"] is True  # another user is answered
        assert a.call("stats")["daemon"]["tenants"] is True  # and the offender's own client
        a.call("zmtp_end")
    out = d.output()
    assert f"dropped a connection of uid {a_uid}" in out, out[-3000:]
    assert "more than the" in out and "one connection may" in out
    assert "one uid may" in out
    assert f"a message of more than {zmtp.MAX_FRAMES} frames" in out


@pytest.mark.timeout(120)
def test_replies_never_read_are_bounded(daemons: Daemons) -> None:  # noqa: F811
    """A client that sends requests and never reads a reply: the daemon reads no
    further request of it while a piece of its replies waits, so what it sends
    then counts against its bound, and it is dropped."""
    a_uid, b_uid = free_uids()
    path, d = _node_daemon(daemons)
    with users(path, a_uid, b_uid) as (a, b):
        assert a.call("stats")["daemon"]["tenants"] is True
        before = _rss(d.proc.pid)
        n = 1 << 20  # 1 Mi stats requests: 22 MiB sent, a GiB of replies
        assert a.call("zmtp_unread", path, n, timeout=60) < n
        grown = _rss(d.proc.pid) - before
        assert grown < RSS_BOUND, f"the daemon grew by {grown >> 20} MiB"
        wait_until(lambda: all(a.call("zmtp_closed")), 20, "the reader dropped", 0.2)
        assert b.call("stats")["daemon"]["tenants"] is True
        assert a.call("stats")["daemon"]["tenants"] is True
        a.call("zmtp_end")
    assert "requests not answered yet" in d.output()


def test_zmtp_wire_refuses_from_the_frame_header() -> None:
    """The parser alone: a frame past a bound is refused before its bytes arrive."""
    wire = zmtp.Wire(conn_bytes=4096, uid_bytes=6000)
    peer = Peer(1000, 1000, 1)
    conn = wire.opened(b"a", peer, None, None, 0.0)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    wire.feed(conn, greeting + bytes([0x04, 6]) + b"\x05READY", 0.0)
    assert wire.next(conn, 0.0) is None and conn.stage == 2
    wire.feed(conn, _frame(b"", True) + _frame(b"{}", False), 0.0)
    assert wire.next(conn, 0.0) == [b"", b"{}"]
    wire.feed(conn, _frame(b"y" * 3000, True), 0.0)
    assert wire.next(conn, 0.0) is None and wire.held(1000) == 3000
    other = wire.opened(b"b", peer, None, None, 0.0)
    wire.feed(other, greeting + bytes([0x04, 6]) + b"\x05READY", 0.0)
    wire.next(other, 0.0)
    with pytest.raises(zmtp.Dropped, match="one uid may"):  # only its header has come
        wire.feed(other, struct.pack(">BQ", 0x03, 3000), 0.0)
        wire.next(other, 0.0)
    with pytest.raises(zmtp.Dropped, match="one connection may"):
        wire.feed(conn, struct.pack(">BQ", 0x03, 2000), 0.0)
        wire.next(conn, 0.0)
    wire.forget(b"a")
    wire.forget(b"b")
    assert wire.held_by_uid == {}


def test_the_unit_caps_the_daemons_memory() -> None:
    """The shipped unit bounds the whole daemon: past it the daemon is reclaimed
    and killed, never the node's jobs chosen by the OOM killer."""
    from tests.daemon.test_daemon import REPO

    with open(f"{REPO}/systemd/shmloaderd.service") as f:
        settings = [line for line in f.read().splitlines() if not line.startswith("#")]
    assert "MemoryHigh=768M" in settings and "MemoryMax=1G" in settings, settings
    assert RSS_BOUND < 768 * MIB


def test_one_users_dead_jobs_never_evict_anothers() -> None:
    """Before, 256 dead-job records were shared, the oldest of any uid going first:
    a user letting 300 of its jobs die removed another user's record from that
    user's ``stat`` within seconds of the promised 600 s. Each uid has its share."""
    from shmloaderd import registry as registry_module
    from shmloaderd.registry import MAX_UID_ENDED, Job, Registry

    registry = Registry(lambda: None, tenants=True)
    victim = Job("b0b0000000000001", uid=61722)
    registry.record_end(victim, "its processes died", 1, 4096)
    for i in range(MAX_UID_ENDED + 44):
        registry.record_end(Job(f"{i:016x}", uid=61721), "its processes died", 1, 4096)
    assert victim.key in registry.ended, "another user's dead jobs evicted this one"
    mine = [t for u, t in registry.ended if u == 61721]
    assert len(mine) == MAX_UID_ENDED and mine[0] == f"{44:016x}"  # its own oldest went
    # past the total, the uid keeping the most gives one up, not the victim
    registry_module_max = registry_module.MAX_ENDED
    try:
        registry_module.MAX_ENDED = len(registry.ended)
        registry.record_end(Job("c0c0000000000001", uid=61723), "its processes died", 0, 0)
    finally:
        registry_module.MAX_ENDED = registry_module_max
    assert victim.key in registry.ended and (61723, "c0c0000000000001") in registry.ended
    assert len([1 for u, _ in registry.ended if u == 61721]) == MAX_UID_ENDED - 1

"""shmloaderd as a real subprocess: control protocol, budget, reaping, restart, sd_notify.

Every daemon runs from ``sys.executable -m shmloaderd`` with its control socket
in a short private temp directory; the ``Daemons`` fixture always stops them
(SIGTERM, then SIGKILL) and removes the directory. Segments are real POSIX
shared memory, created in this process or in a spawned child.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from shmloader._node import inventory
from shmloader._node.ring import RingWriter, control_stem, new_token
from shmloader._node.segment import (
    HEADER_SIZE,
    KIND_DATA,
    MY_START,
    Header,
    Segment,
    read_header,
    shm_path,
)
from shmloader._proto.waits import WaitHistogram
from shmloader._transport.daemon_client import MAX_REQUEST, PROTOCOL_VERSION, DaemonClient
from shmloader.errors import ProtocolError, ShmCapacityError
from tests.daemon.test_admin import run_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: How long a test waits for a daemon's answer: a hang guard, not a latency bound.
REQUEST_GUARD_S = 10.0
#: How long a test waits for a reaper pass (every 0.05-0.5 s here) to reap a dead
#: job: dozens of passes on any machine; without the reaper the job stays forever.
REAP_GUARD_S = 20.0


# ----------------------------------------------------------------- fixtures


class Daemon:
    """One running ``shmloaderd`` subprocess."""

    def __init__(self, proc: subprocess.Popen, path: str, log: str) -> None:
        self.proc, self.path, self.log = proc, path, log

    def client(self, timeout: float = 2.0) -> DaemonClient:
        c = DaemonClient(self.path, timeout=timeout)
        ok = c.connect() and c.state == c.UP
        assert ok, f"daemon at {self.path} does not answer:\n{self.output()}"
        return c

    def request(self, op: str, **fields) -> dict:
        with DaemonClient(self.path, timeout=REQUEST_GUARD_S) as c:
            reply = c.request(op, **fields)
        assert reply is not None, f"no answer to {op}:\n{self.output()}"
        return reply

    def stats(self) -> dict:
        reply = self.request("stats")
        assert reply["ok"], reply
        return reply["stats"]

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def terminate(self, timeout: float = 30.0) -> float:
        """SIGTERM; seconds until it exited."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        return time.monotonic() - t0


class Daemons:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="shd-", dir="/tmp")  # short: sun_path is 107 bytes
        self.all: list[Daemon] = []

    def start(
        self,
        *args: str,
        env: dict | None = None,
        wait: bool = True,
        name: str = "c.sock",
        preexec=None,
    ) -> Daemon:
        path = os.path.join(self.dir, name)
        log = os.path.join(self.dir, f"log{len(self.all)}")
        if "--tenants" not in args:  # the suite runs as root: these test a single user's daemon
            args = ("--single-user", *args)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "shmloaderd", "--socket", path, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=REPO,
                preexec_fn=preexec,
            )
        d = Daemon(proc, path, log)
        self.all.append(d)
        if wait:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"shmloaderd exited {proc.returncode}:\n{d.output()}")
                probe = DaemonClient(path, timeout=0.2)
                ok = os.path.exists(path) and probe.request("hello") is not None
                probe.close()
                if ok:
                    break
                assert time.monotonic() < deadline, f"shmloaderd never answered:\n{d.output()}"
                time.sleep(0.05)
        return d

    def close(self) -> None:
        for d in self.all:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(5)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    ds = Daemons()
    try:
        yield ds
    finally:
        ds.close()


def wait_until(cond, timeout: float, what: str, step: float = 0.02) -> float:
    """Poll ``cond`` until true; seconds it took. Fails with ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(step)
    return time.monotonic() - t0


def exists(name: str) -> bool:
    return os.path.exists(shm_path(name))


def description(token: str, pid: int = 0, start: int = 0, ranks=(0, 1)) -> dict:
    pid = pid or os.getpid()
    start = start or MY_START
    return {
        "token": token,
        "group": list(ranks),
        "leader": ranks[0],
        "writer": ranks[0],
        "node": list(ranks),
        "pids": {str(r): [pid, start] for r in ranks},
        "world": len(ranks),
    }


@contextlib.contextmanager
def live_ring(readers=frozenset()) -> Iterator[RingWriter]:
    """A RingWriter owned by this (live) process, with one published batch."""
    token = new_token()
    ring = RingWriter(token, frozenset(readers), description(token))
    try:
        slot = ring.acquire(100_000)
        ring.hold_for_readers(slot, 0, 100_000, 2_000_000)
        yield ring
    finally:
        ring.close()


def _doomed_writer(token: str, ready) -> None:  # runs in a spawned child
    from shmloader._node import segment  # read MY_START in the child: its own start time

    desc = {**description(token, os.getpid(), segment.MY_START), "job": "doomed-7"}
    ring = RingWriter(token, frozenset({1}), desc)
    slot = ring.acquire(100_000)  # reader 1 never attaches: the data segment stays named
    ring.hold_for_readers(slot, 0, 100_000, 1_000_000)
    ready.send(slot.segment.name)
    time.sleep(60)


@contextlib.contextmanager
def forked(target, *args) -> Iterator[mp.Process]:
    ctx = mp.get_context("spawn")  # never fork this (threaded) process; no torch to load
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    try:
        yield p
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def rewrite_header(seg: Segment, **changes) -> None:
    h = seg.header
    fields = {f: getattr(h, f) for f in ("kind", "uid", "token", "pid", "start", "capacity")}
    fields.update(changes)
    new = Header(created_ns=h.created_ns, **fields)
    os.pwrite(seg.fd, new.pack(), 0)


# ------------------------------------------------------------- pure helpers


@pytest.mark.timeout(10)
def test_size_and_budget_parsing() -> None:
    import argparse

    from shmloaderd.__main__ import budget_function, parse_budget, parse_size

    assert parse_size("512") == 512
    assert parse_size("4K") == 4096
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("2MiB") == 2 << 20
    assert parse_budget("8G") == ("bytes", 8 << 30)
    assert parse_budget("50%") == ("pct", 50.0)
    half = budget_function(("pct", 50.0))()
    st = os.statvfs("/dev/shm")
    assert half == st.f_blocks * st.f_frsize // 2
    for bad in ("", "12X", "-1G", "G"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_size(bad)
    for bad in ("0%", "150%", "x%"):
        with pytest.raises(argparse.ArgumentTypeError, match="percentage"):
            parse_budget(bad)


@pytest.mark.timeout(10)
def test_protocol_rejects_malformed_requests() -> None:
    from shmloaderd import protocol

    def err(raw) -> str:
        with pytest.raises(ProtocolError) as info:
            protocol.parse(raw if isinstance(raw, bytes) else json.dumps(raw).encode())
        return str(info.value)

    assert "not UTF-8 JSON" in err(b"\xff\xfe garbage")
    assert "not UTF-8 JSON" in err(b"{not json")
    assert "JSON object" in err([1, 2])
    assert "version" in err({"op": "hello"})
    assert "version" in err({"v": 2, "op": "hello"})
    assert "unknown op 'fly'" in err({"v": 1, "op": "fly"})
    assert "unknown op" in err({"v": 1, "op": ["hello"]})
    assert "needs field 'token'" in err({"v": 1, "op": "admit", "bytes": 1})
    assert "bytes must be an integer" in err({"v": 1, "op": "admit", "token": "ab", "bytes": "1"})
    assert "bytes must be an integer" in err({"v": 1, "op": "admit", "token": "ab", "bytes": True})
    assert "out of range" in err({"v": 1, "op": "admit", "token": "ab", "bytes": -5})
    assert "not a ring token" in err({"v": 1, "op": "unregister", "token": "../etc"})
    assert "not a segment of ring ab" in err(
        {"v": 1, "op": "segment", "token": "ab", "action": "add", "name": "/shml-cd-ctl"}
    )
    assert "invalid suffix" in err(
        {"v": 1, "op": "segment", "token": "ab", "action": "add", "name": "/shml-ab-x/../y"}
    )
    assert "[pid, start]" in err(
        {"v": 1, "op": "register", "token": "ab", "group": [0], "pids": {"0": 5}}
    )
    report = {"v": 1, "op": "report", "token": "ab", "rank": 0}
    assert "true or false" in err({**report, "device_registered": 1})
    assert "printable string" in err({**report, "device": "cuda:0\n"})
    assert "must be a number" in err({**report, "device_copy_ms_total": "2"})
    device = {"device": "cuda:0", "device_batches": 3, "device_bytes": 4096,
              "device_copy_ms_total": 1.5, "device_registered": False,
              "device_registration_refused": "cudaHostRegister: error 999"}  # fmt: skip
    assert protocol.parse(json.dumps({**report, **device}).encode())[1] == {
        "token": "ab",
        "rank": 0,
        **device,
    }
    assert "exceeds" in err(b"x" * (MAX_REQUEST + 1))
    assert "nested too deeply" in err(b"[" * 200_000 + b"]" * 200_000)
    op, fields = protocol.parse(
        json.dumps(
            {
                "v": 1,
                "op": "register",
                "token": "ab",
                "group": [0, 1],
                "pids": {"1": [10, 20]},
                "segments": [{"name": "/shml-ab-ctl", "bytes": 4096}],
                "future_field": "ignored",
            }
        ).encode()
    )
    assert op == "register"
    assert fields["pids"] == {1: (10, 20)}
    assert fields["segments"] == {"/shml-ab-ctl": 4096}
    assert "future_field" not in fields


# ------------------------------------------------------- the daemon as a process


@pytest.mark.timeout(30)
def test_refuses_to_start_on_foreign_or_open_directory(daemons: Daemons, tmp_path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    out = subprocess.run(  # single-user: the rule of a daemon started as a user
        [sys.executable, "-m", "shmloaderd", "--single-user", "--socket", str(open_dir / "c.sock")],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=REPO,
    )
    assert out.returncode == 2, out
    assert "mode 755" in out.stderr and "chmod 700" in out.stderr
    assert not (open_dir / "c.sock").exists()

    first = daemons.start()
    second = subprocess.run(
        [sys.executable, "-m", "shmloaderd", "--socket", first.path],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=REPO,
    )
    assert second.returncode == 2
    assert f"another shmloaderd (pid {first.proc.pid}) already serves" in second.stderr
    assert first.request("hello")["pid"] == first.proc.pid  # the first one is untouched


@pytest.mark.timeout(40)
def test_register_admit_refuse_report_stats_metrics(daemons: Daemons, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemons.start("--budget", "1T", "--metrics-port", str(port))
    st = os.stat(d.path)
    assert oct(st.st_mode & 0o777) == "0o600"
    assert oct(os.stat(daemons.dir).st_mode & 0o777) == "0o700"

    client = d.client()
    assert client.daemon_info["pid"] == d.proc.pid
    assert client.daemon_info["budget"] == 1 << 40
    token = new_token()
    desc = description(token, ranks=(4, 5, 6))
    client.register(desc, {f"/shml-{token}-ctl": 20480})
    client.admit(token, 1 << 20)  # granted: returns quietly
    with pytest.raises(ShmCapacityError) as info:
        client.admit(token, 2 << 40)
    msg = str(info.value)
    assert "1.0 TiB" in msg and "--budget" in msg
    assert token in msg and str(os.getpid()) in msg  # names the job and its pids
    assert info.value.needed == 2 << 40

    seg = f"/shml-{token}-0.0"
    client.add_segment(token, seg, 1 << 30)  # declared only: nothing in /dev/shm
    job = next(j for j in d.stats()["jobs"] if j["token"] == token)
    assert job["bytes"] < 1 << 30, "a declared size counted (NOTE [budget]: observed only)"
    client.remove_segment(token, seg)

    client.report(token, 5, consumed=7, receive_ms=0.25, published=9)
    client.report(token, 6, consumed=9, lag=0, receive_ms=0.5)
    hist = WaitHistogram()
    for ms in (0.5, 0.5, 3.0, 300.0):
        hist.add(ms)
    client.report(token, 4, published=9, role="leader", wait_ms_p50=120.0, wait_share=0.75,
                  waits={"wait_ms_p95": 280.0, "wait_ms_p99": 299.5, "wait_hist": hist.counts,
                         "wait_ms_sum": hist.sum_ms})  # fmt: skip
    doc = d.stats()
    assert doc["schema"] == inventory.SCHEMA == 3 and doc["source"] == "daemon"
    assert doc["daemon"]["pid"] == d.proc.pid and doc["daemon"]["budget_bytes"] == 1 << 40
    job = next(j for j in doc["jobs"] if j["token"] == token)
    assert job["registered"] is True
    assert job["group"] == [4, 5, 6] and job["leader"] == 4
    assert job["followers"]["5"]["lag"] == 2 and job["followers"]["5"]["receive_ms"] == 0.25
    assert job["followers"]["6"]["lag"] == 0
    leader = job["ranks"]["4"]
    assert leader["role"] == "leader" and leader["batches"] == 9
    assert leader["wait_ms_p50"] == 120.0 and leader["wait_share"] == 0.75
    assert leader["wait_ms_p95"] == 280.0 and leader["wait_ms_p99"] == 299.5
    assert job["ranks"]["5"]["batches"] == 7 and job["ranks"]["5"]["lag"] == 2
    # NOTE [honest bytes]: the grant is reserved apart; ``bytes`` is what /dev/shm holds
    assert job["granted_pending_bytes"] >= 1 << 20 and job["bytes"] == job["segment_bytes"]
    assert doc["daemon"]["granted_pending_bytes"] >= 1 << 20
    assert doc["daemon"]["in_use_bytes"] >= job["bytes"] + job["granted_pending_bytes"]

    # the same document through `shmloader stat --json --daemon PATH`
    code, out, err = run_cli(["stat", "--json", "--daemon", d.path], capsys)
    assert code == 0 and err == ""
    via_cli = json.loads(out)
    assert via_cli["source"] == "daemon"
    assert token in {j["token"] for j in via_cli["jobs"]}

    def metrics() -> dict[str, float]:
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                          if ln[:1] != "#")}  # fmt: skip

    uid = f'uid="{os.geteuid()}"'  # whose job: its control segment's owner
    lag_key = f'shmloaderd_follower_lag_batches{{rank="5",token="{token}",{uid}}}'
    wait_until(lambda: lag_key in metrics(), 3, "the report reaches the metrics", step=0.1)
    values = metrics()
    assert values[lag_key] == 2
    share_key = f'shmloaderd_rank_wait_share{{job="",rank="4",role="leader",token="{token}",{uid}}}'
    assert values[share_key] == 0.75
    # the rank's waits as a Prometheus histogram, labelled by job and rank
    labels = f'job="",rank="4",role="leader",token="{token}",{uid}'

    def bucket(le: str) -> str:  # the exposition sorts the labels
        return (
            f'shmloaderd_rank_wait_seconds_bucket{{job="",le="{le}",rank="4",'
            f'role="leader",token="{token}",{uid}}}'
        )

    wait_until(lambda: bucket("+Inf") in metrics(), 3, "the histogram", step=0.1)
    values = metrics()
    assert values[bucket("0.0005")] == 2  # 0.5 ms twice (a bucket edge: le)
    assert values[bucket("0.004")] == 3 and values[bucket("0.256")] == 3
    assert values[bucket("0.512")] == 4 == values[bucket("+Inf")]
    assert values[f"shmloaderd_rank_wait_seconds_count{{{labels}}}"] == 4
    assert values[f"shmloaderd_rank_wait_seconds_sum{{{labels}}}"] == pytest.approx(0.304)
    assert values["shmloaderd_reaped_sockets_total"] >= 0
    assert values['shmloaderd_requests_total{op="admit"}'] == 2
    assert values['shmloaderd_admissions_total{result="refused"}'] == 1
    assert values["shmloaderd_budget_bytes"] == 1 << 40

    client.unregister(token)
    assert token not in {j["token"] for j in d.stats()["jobs"]}
    client.close()


@pytest.mark.timeout(60)
def test_sigkilled_writer_is_reaped_by_the_reaper(daemons: Daemons, capsys) -> None:
    d = daemons.start("--reap-interval", "0.5")
    token = new_token()
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    with forked(_doomed_writer, token, child_end) as child:
        assert parent_end.poll(20), "the child never created its ring"
        data_name = parent_end.recv()
        (ctl,) = [
            "/" + n for n in os.listdir("/dev/shm") if n.startswith(control_stem(token)[1:] + ".")
        ]
        assert exists(ctl) and exists(data_name)
        wait_until(lambda: token in {j["token"] for j in d.stats()["jobs"]}, 5, "job discovered")
        killed_at = time.time()
        os.kill(child.pid, signal.SIGKILL)
        # reaped by a reaper pass (every 0.5 s); nothing else would ever remove them
        wait_until(lambda: not exists(ctl) and not exists(data_name), REAP_GUARD_S, f"{ctl} reaped")
        child.join(5)
    doc = d.stats()
    assert doc["daemon"]["reaped_segments"] >= 2
    # NOTE [dead jobs stay visible]: dead, holding nothing, saying what was reaped and when
    time.sleep(1.0)  # a few more reaper passes
    job = next(j for j in d.stats()["jobs"] if j["token"] == token)
    assert job["state"] == "dead" and job["bytes"] == 0, job
    assert job["job"] == "doomed-7", (job, d.output())
    ended = job["ended"]
    assert ended["reaped_segments"] == 2 and ended["reaped_bytes"] >= 2 * HEADER_SIZE + 100_000
    assert killed_at <= ended["unix"] <= time.time() and "died" in ended["why"]
    code, text, _ = run_cli(["stat", "--daemon", d.path], capsys)
    assert code == 0 and "dead since" in text and "reaped 2 segment(s)" in text
    log = d.output()
    assert f"reaped {ctl}" in log and f"owner pid {child.pid}" in log
    assert f"job doomed-7 (ring {token}" in log  # log lines name the job, not only its token


@pytest.mark.timeout(30)
def test_reaper_checks_start_time_and_never_touches_invalid_or_live(daemons: Daemons) -> None:
    token = new_token()
    recycled = Segment.create(f"/shml-{token}-0.0", KIND_DATA, token, 4096)
    live = Segment.create(f"/shml-{token}-1.0", KIND_DATA, token, 4096)
    junk = f"/shml-{token}-junk"
    fd = os.open(shm_path(junk), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b"\0" * 8192)  # not a shmloader header
    os.close(fd)
    foreign = Segment.create(f"/shml-{token}-2.0", KIND_DATA, token, 4096)
    try:
        # our own pid, but another start time: a recycled pid, so a dead owner
        rewrite_header(recycled, start=MY_START + 12345)
        # a dead owner, but the name carries another token: fails validation
        rewrite_header(foreign, token="0123456789abcdef", pid=dead_pid())
        d = daemons.start("--reap-interval", "0.2")
        wait_until(lambda: not exists(recycled.name), 2.0, "segment of a recycled pid reaped")
        time.sleep(0.6)  # three more passes
        assert exists(live.name), "a live owner's segment was removed"
        assert exists(junk), "an entry failing header validation was removed"
        assert exists(foreign.name), "a segment whose name and token disagree was removed"
        invalid = {i["name"] for i in d.stats()["invalid"]}
        assert {junk, foreign.name} <= invalid
    finally:
        for seg in (recycled, live, foreign):
            seg.unlink()
            seg.close()
        os.unlink(shm_path(junk))


@pytest.mark.timeout(40)
def test_malformed_control_messages_never_crash_it(daemons: Daemons) -> None:
    d = daemons.start()
    # 1. raw garbage on the unix socket (not even ZMTP)
    for blob in (b"\x00" * 64, os.urandom(4096), b"GET / HTTP/1.0\r\n\r\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(d.path)
            with contextlib.suppress(OSError):
                s.sendall(blob)
    # 2. well-framed ZeroMQ messages with bad bodies, through a DEALER and a REQ
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(f"ipc://{d.path}")
    try:
        cases = [
            (b"not json", "not UTF-8 JSON"),
            (b"\xff\xfe\xfd", "not UTF-8 JSON"),
            (b"[1,2,3]", "JSON object"),
            (b'"hello"', "JSON object"),
            (b'{"v":1}', "unknown op"),
            (b'{"v":1,"op":"teleport"}', "unknown op 'teleport'"),
            (b'{"v":99,"op":"hello"}', "v=99"),
            (b'{"v":1,"op":"admit","token":"ab","bytes":"lots"}', "bytes must be an integer"),
            (b'{"v":1,"op":"register","token":"ab","group":"all","pids":{}}', "group"),
            (b'{"v":1,"op":"report","token":"ab","rank":0}', "unknown token ab"),
            (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
            (b"x" * (2 * MAX_REQUEST), "exceeds"),
        ]
        for body, expected in cases:
            dealer.send(body)
            reply = json.loads(dealer.recv())
            assert reply["ok"] is False and expected in reply["error"], (body[:40], reply)
        dealer.send_multipart([b"two", b"frames"])
        assert "exactly one" in json.loads(dealer.recv())["error"]
        # bigger than the wire limit: ZeroMQ drops that connection, nothing else happens
        dealer.setsockopt(zmq.RCVTIMEO, 500)
        dealer.send(b"y" * (8 * MAX_REQUEST))
        with pytest.raises(zmq.Again):
            dealer.recv()
    finally:
        dealer.close(linger=0)
    assert d.proc.poll() is None, d.output()
    assert d.request("hello")["ok"] is True
    assert "rejected a malformed request" in d.output()


@pytest.mark.timeout(60)
def test_dropping_a_connection_never_ends_another_of_the_same_process(daemons: Daemons) -> None:
    # NOTE [notices of the end] in daemon/shmloaderd/zmtp.py: a garbage connection's
    # descriptor number, read when the daemon got to its start, may be the next
    # connection's by then; its hang-up must not end that one (it did in 1 of 3 tries)
    d = daemons.start()
    ctx = zmq.Context.instance()
    unanswered = []
    for attempt in range(20):
        for blob in (b"\x00" * 64, os.urandom(4096), b"GET / HTTP/1.0\r\n\r\n"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(d.path)
                with contextlib.suppress(OSError):
                    s.sendall(blob)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 2000)
        dealer.connect(f"ipc://{d.path}")
        try:
            dealer.send(json.dumps({"v": PROTOCOL_VERSION, "op": "hello"}).encode())
            try:
                assert json.loads(dealer.recv())["ok"] is True
            except zmq.Again:
                unanswered.append(attempt)
        finally:
            dealer.close(linger=0)
    assert unanswered == [], d.output()[-3000:]
    assert d.proc.poll() is None, d.output()


#: A reaper interval no SIGTERM test waits out: the loop must end within its slice.
SLOW_REAP_S = 120.0


@pytest.mark.timeout(90)
def test_restart_rediscovers_live_job_and_sigterm_is_prompt(daemons: Daemons) -> None:
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract = f"shmloaderd-test-{os.getpid()}-{time.monotonic_ns()}"
    notify.bind("\0" + abstract)
    notify.settimeout(10)
    env = {"NOTIFY_SOCKET": "@" + abstract, "WATCHDOG_USEC": "200000"}
    try:
        with live_ring() as ring:
            ctl = ring.control.name
            first = daemons.start("--reap-interval", "0.2", env=env)
            got = notify.recv(4096).decode()
            assert "READY=1" in got.split("\n")
            assert notify.recv(4096) == b"WATCHDOG=1"
            assert notify.recv(4096) == b"WATCHDOG=1"  # again, 0.1 s later
            job = next(j for j in first.stats()["jobs"] if j["token"] == ring.token)
            assert job["state"] == "live" and job["registered"] is False
            first.terminate(timeout=30)
            assert first.proc.returncode == 0
            while (msg := notify.recv(4096)) == b"WATCHDOG=1":
                pass
            assert msg == b"STOPPING=1"
            assert exists(ctl), "SIGTERM unlinked a live job's control segment"
            assert not os.path.exists(first.path), "the control socket was left behind"

            second = daemons.start("--reap-interval", "0.2")
            job = next(j for j in second.stats()["jobs"] if j["token"] == ring.token)
            assert job["group"] == [0, 1] and job["writer_pid"] == os.getpid()
            assert job["published"] == 1 and job["slots"] == 1
            time.sleep(0.5)
            assert exists(ctl), "the restarted daemon unlinked a live job's control segment"
            assert f"discovered job {ring.token}" in second.output()
            second.terminate()

            # prompt: SIGTERM ends the loop within its 0.1 s slice, where a loop that
            # slept until its next reaper pass would take the whole 120 s interval
            third = daemons.start("--reap-interval", str(SLOW_REAP_S), name="t.sock")
            try:
                took = third.terminate(timeout=SLOW_REAP_S / 4)
            except subprocess.TimeoutExpired:
                pytest.fail(f"SIGTERM did not stop the daemon within {SLOW_REAP_S / 4:.0f} s")
            assert third.proc.returncode == 0 and took < SLOW_REAP_S / 4, took
            assert exists(ctl), "SIGTERM unlinked a live job's control segment"
    finally:
        notify.close()


@pytest.mark.timeout(30)
def test_client_survives_a_sigkilled_daemon(daemons: Daemons, caplog) -> None:
    # nobody there: kept, DOWN, and asked again at later calls (NOTE [finding the daemon])
    nobody = DaemonClient(os.path.join(daemons.dir, "nobody.sock"), timeout=0.3)
    assert nobody.connect() is True and nobody.state == DaemonClient.DOWN
    nobody.close()
    d = daemons.start()
    wait_s = 2.0  # the client's bounded wait for an answer
    client = d.client(timeout=wait_s)
    token = new_token()
    client.register(description(token))
    d.proc.kill()
    d.proc.wait(5)
    t0 = time.monotonic()
    client.admit(token, 1 << 20)  # no answer: granted by default, after one bounded wait
    took = time.monotonic() - t0
    assert took < 2 * wait_s, f"{took:.1f} s: more than one {wait_s} s wait"
    assert client.state == DaemonClient.DOWN
    t0 = time.monotonic()
    for _ in range(50):
        client.report(token, 1, consumed=1)
        client.admit(token, 1 << 40)  # a no-op now, never ShmCapacityError
    client.unregister(token)
    took = time.monotonic() - t0
    # 101 calls together take less than the one wait a single call would make if it waited
    assert took < wait_s, f"{took:.1f} s for 101 calls on a DOWN client: they waited"
    assert client.stats() is None
    client.close()
    lost = [r for r in caplog.records if "lost shmloaderd" in r.getMessage()]
    assert len(lost) == 1


@pytest.mark.timeout(40)
def test_warm_pool_adopt(daemons: Daemons) -> None:
    d = daemons.start("--pool", "2M", "--pool-segment", "1M", "--reap-interval", "0.1")
    wait_until(lambda: d.stats()["daemon"]["pool_segments"] == 1, 10, "pool filled")
    # 2M holds one 1M segment plus its header page, not two
    time.sleep(0.3)
    assert d.stats()["daemon"]["pool_segments"] == 1
    token = new_token()
    name = f"/shml-{token}-0.0"
    too_big = d.request("adopt", token=token, name=name, bytes=2 << 20, pid=os.getpid(),
                        start=MY_START)  # fmt: skip
    assert too_big["ok"] and too_big["adopted"] is False and "--pool-segment" in too_big["reason"]
    with DaemonClient(d.path, timeout=REQUEST_GUARD_S) as client:
        assert client.adopt(token, name, 512 << 10) == 1 << 20
    seg = Segment.attach(name, kind=KIND_DATA, token=token)
    try:
        assert seg.header.pid == os.getpid() and seg.header.start == MY_START
        assert seg.capacity == 1 << 20
        job = next(j for j in d.stats()["jobs"] if j["token"] == token)
        assert job["bytes"] >= HEADER_SIZE + (1 << 20)
        wait_until(lambda: d.stats()["daemon"]["pool_segments"] == 1, 5, "pool refilled")
        pool_names = [n for n in os.listdir("/dev/shm") if n.startswith("shml-pool")]
        assert pool_names
        d.terminate()
        assert exists(name), "stopping the daemon unlinked an adopted segment"
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in pool_names)
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.timeout(60)
def test_warm_pool_names_cannot_be_planted(daemons: Daemons) -> None:
    """NOTE [warm segment names]: a local user who sees the pool's first segment plants a
    FIFO or a file at every name derivable from it; the daemon neither blocks
    nor fails, and the pool fills again after an adoption."""
    d = daemons.start("--pool", "3M", "--pool-segment", "1M", "--reap-interval", "0.05")
    wait_until(lambda: d.stats()["daemon"]["pool_segments"] == 2, 10, "pool filled")
    seen = [
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("shml-pool") and read_header("/" + n).pid == d.proc.pid
    ]
    pool_token = seen[0].removeprefix("shml-").split("-")[0]
    # squatting is cheap: enough names that skipping one per reaper pass never gets past
    derivable = [f"shml-{pool_token}-{n}" for n in range(3000)]
    derivable += [f"{n}.0" for n in derivable[:50]] + [f"shml-{pool_token}-pool"]
    planted = []
    token = new_token()
    try:
        for i, name in enumerate(n for n in derivable if n not in seen):
            path = os.path.join("/dev/shm", name)
            if i % 2:
                os.mkfifo(path, 0o600)
            else:
                with open(path, "w") as f:
                    f.write("squatted")
            planted.append(path)
        squat = {os.path.basename(p) for p in planted}
        for k in range(2):  # each adoption asks the pool for a new segment
            with DaemonClient(d.path, timeout=REQUEST_GUARD_S) as client:
                assert client.adopt(token, f"/shml-{token}-{k}.0.a{k}", 4096) == 1 << 20

        def made_since() -> list[str]:
            out = []
            for n in os.listdir("/dev/shm"):
                if n.startswith(f"shml-{pool_token}-") and n not in seen and n not in squat:
                    with contextlib.suppress(OSError, ProtocolError):
                        if read_header("/" + n).pid == d.proc.pid:
                            out.append(n)
            return out

        wait_until(lambda: len(made_since()) == 2, 10, "pool refilled past the planted names")
        # still answering: a loop that opened a planted FIFO would wait for a writer forever
        assert d.request("hello")["ok"]
    finally:
        for path in planted:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for k in range(2):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/shml-{token}-{k}.0.a{k}")
        d.terminate()
    assert not any(n.startswith(f"shml-{pool_token}") for n in os.listdir("/dev/shm"))


@pytest.mark.timeout(30)
def test_unit_file_verifies(tmp_path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    with open(os.path.join(REPO, "systemd", "shmloaderd.service")) as f:
        unit = f.read()
    assert "Type=notify" in unit and "WatchdogSec=" in unit
    assert "RuntimeDirectoryMode=0755" in unit  # node mode: every user reaches the socket
    assert "ReadWritePaths=/dev/shm" in unit
    settings = [line for line in unit.splitlines() if not line.startswith("#")]
    for forbidden in ("PrivateIPC=yes", "PrivateDevices=yes", "ProtectProc=invisible"):
        assert forbidden not in settings
    exe = shutil.which("shmloaderd") or os.path.join(os.path.dirname(sys.executable), "shmloaderd")
    if not os.path.exists(exe):
        pytest.skip(f"no shmloaderd script at {exe} for ExecStart")
    copy = tmp_path / "shmloaderd.service"
    copy.write_text(unit.replace("/opt/shmloader/bin/shmloaderd", exe))
    out = subprocess.run(
        [tool, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=25
    )
    if "Failed to" in out.stderr and "bus" in out.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {out.stderr.strip()[:200]}")
    complaints = [line for line in out.stderr.splitlines() if "shmloaderd.service" in line]
    assert out.returncode == 0 and not complaints, out.stderr


@pytest.mark.timeout(10)
def test_sd_notify_abstract_and_path(tmp_path, monkeypatch) -> None:
    from shmloaderd import notify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False
    path = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert notify.notify("READY=1") is True
        assert s.recv(100) == b"READY=1"
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert notify.watchdog_interval() is None


@pytest.mark.timeout(10)
def test_pending_grants_stop_counting_once_allocated() -> None:
    from shmloaderd.registry import Grant, Job

    job = Job("ab")
    now = time.monotonic()
    job.grants = [Grant(1000, now + 30, 0), Grant(500, now + 30, 0)]
    assert job.usage(now) == 1500
    job.observed = 1000  # the first slot shows up in the ring counters
    assert job.usage(now) == 1000 + 500
    job.observed = 1500
    assert job.usage(now) == 1500
    job.grants = [Grant(700, now - 1, 0)]  # expired
    job.observed = 0
    assert job.usage(now) == 0
    job.segments = {"/shml-ab-ctl": 1 << 62}  # declared, never observed: holds nothing
    assert job.usage(now) == 0


@pytest.mark.timeout(10)
def test_a_grant_counts_from_the_bytes_the_job_already_holds() -> None:
    """A job holding 1 MiB asks for 1 MiB more: 2 MiB count until the new segment
    shows up. Counted from zero, the held 1 MiB would pass for the new one."""
    from shmloaderd.registry import Registry

    reg = Registry(lambda: None)
    token = new_token()
    held = Segment.create_unique(f"/shml-{token}-0", KIND_DATA, token, 1 << 20)
    more = None
    try:
        one = HEADER_SIZE + (1 << 20)
        assert reg.admit({"token": token, "bytes": one, "pid": os.getpid(), "start": MY_START})[
            "admitted"
        ]
        job = reg.find(token)
        assert job.observed == one
        assert reg.in_use() == 2 * one, "the grant was counted against bytes held before it"
        more = Segment.create_unique(f"/shml-{token}-1", KIND_DATA, token, 1 << 20)
        reg.observe_one(job)
        assert reg.in_use() == 2 * one, "the granted segment counted twice once it showed up"
    finally:
        for seg in (held, more):
            if seg is not None:
                seg.unlink()
                seg.close()


@pytest.mark.timeout(10)
def test_admin_reads_control_counters_like_ring_writes_them() -> None:
    from shmloader._node import ring

    assert inventory._COUNTERS.format == ring._COUNTERS.format
    assert inventory._COUNTERS_AT == ring._COUNTERS_AT


@pytest.mark.timeout(10)
def test_admission_shrinks_the_warm_pool_before_refusing() -> None:
    from shmloaderd.registry import Registry

    pool = {"bytes": 2 << 20}

    def shrink(need: int) -> int:
        freed = min(need, pool["bytes"])
        pool["bytes"] -= freed
        return freed

    reg = Registry(lambda: 3 << 20, lambda: pool["bytes"], shrink)
    token = new_token()
    ok = reg.admit({"token": token, "bytes": 1 << 20, "pid": os.getpid(), "start": MY_START})
    assert ok["admitted"] is True and pool["bytes"] == 2 << 20  # fits beside the pool
    ok = reg.admit({"token": token, "bytes": 1 << 20})
    assert ok["admitted"] is True and pool["bytes"] == 1 << 20  # the pool gave way
    no = reg.admit({"token": token, "bytes": 2 << 20})
    assert no["admitted"] is False and pool["bytes"] == 0
    assert "3.0 MiB" in no["reason"] and f"job {token}" in no["reason"]
    assert no["in_use"] == 2 << 20 and reg.refused == 1 and reg.granted == 2


# ------------------------------------------- the daemon trusts nobody, never switches off


@pytest.mark.timeout(60)
def test_client_registers_again_after_a_daemon_restart(daemons: Daemons, caplog) -> None:
    """A restarted daemon checks the job again: no 'running unchecked' for the rest of it."""
    first = daemons.start("--budget", "1T")
    client = first.client(timeout=0.5)
    token = new_token()
    client.register(description(token, ranks=(0, 1)))
    client.admit(token, 1 << 20)
    first.proc.kill()
    first.proc.wait(5)
    client.report(token, 0, published=1)  # no answer: DOWN after one bounded wait
    assert client.state == DaemonClient.DOWN
    second = daemons.start("--budget", "1T")  # same socket path, a new daemon
    assert second.request("hello")["daemon_id"] != client.daemon_info["daemon_id"]

    def registered() -> bool:
        client.report(token, 1, consumed=1, lag=0)  # a DOWN client retries after its backoff
        jobs = {j["token"]: j for j in second.stats()["jobs"]}
        return token in jobs and jobs[token]["registered"]

    wait_until(registered, 10, "the client registered its ring with the new daemon", step=0.2)
    assert client.state == DaemonClient.UP and client.reconnects == 1
    job = next(j for j in second.stats()["jobs"] if j["token"] == token)
    assert job["group"] == [0, 1] and job["ranks"]["1"]["lag"] == 0
    with pytest.raises(ShmCapacityError, match=r"1\.0 TiB"):
        client.admit(token, 2 << 40)  # checked again, not granted blindly
    assert any("registered ring" in r.getMessage() for r in caplog.records)

    # a daemon restarted between two calls (no timeout seen): the id in the reply tells
    second.terminate()
    third = daemons.start("--budget", "1T")
    client.report(token, 0, published=2)
    job = next(j for j in third.stats()["jobs"] if j["token"] == token)
    assert job["registered"] and client.reconnects in (1, 2)
    client.unregister(token)
    client.close()


@pytest.mark.timeout(40)
def test_pool_refill_never_blocks_the_loop(monkeypatch, tmp_path) -> None:
    """Faulting a pooled segment in runs off the loop: requests keep being answered."""
    import threading

    from shmloaderd import warm as pool_module
    from shmloaderd.server import Daemon as InProcessDaemon

    touching, done = threading.Event(), threading.Event()
    real_populate = pool_module.populate

    def slow_populate(mm) -> None:  # a 1 GiB segment on a busy node: until the test is done
        touching.set()
        done.wait(60)
        real_populate(mm)

    monkeypatch.setattr(pool_module, "populate", slow_populate)
    d = InProcessDaemon(
        str(tmp_path / "c.sock"), reap_interval=0.05, pool_bytes=2 << 20, pool_segment=1 << 20
    )
    d.bind()
    stop = threading.Event()
    loop = threading.Thread(target=d.serve, args=(stop,))
    loop.start()
    answered = 0
    try:
        with DaemonClient(d.path, timeout=REQUEST_GUARD_S) as client:
            assert touching.wait(10), "the pool never started filling"
            # the fill does not end while these are asked: a request behind it is never answered
            for _ in range(20):
                assert client.request("hello") is not None, "a request waited behind the refill"
                answered += 1
                time.sleep(0.02)
            assert client.state != DaemonClient.DOWN
    finally:
        done.set()
        stop.set()
        loop.join(10)
        d.close()
    assert answered == 20


@pytest.mark.timeout(300)
def test_filling_a_multi_gib_pool_keeps_stats_prompt(daemons: Daemons) -> None:
    """Faulting 2 GiB in holds no lock the loop needs, the GIL included: ``stats``
    requests keep being answered during the fill, none waiting for a good part of
    it (measured against the fill's own duration in the same run: a fill holding
    the GIL or a lock of the loop holds a request for the rest of the fill)."""
    seg_bytes = 2 << 30
    free = inventory.shm_free_bytes()
    if free is not None and free < 3 * seg_bytes:
        pytest.skip(f"/dev/shm has {free} bytes free; the test fills a 2 GiB pool")
    d = daemons.start(
        "--pool", str(seg_bytes + (64 << 20)), "--pool-segment", str(seg_bytes),
        "--reap-interval", "0.05",
    )  # fmt: skip
    times: list[float] = []
    began = None  # when the first request that saw the fill was sent
    deadline = time.monotonic() + 240  # a hang guard: 2 GiB on a loaded node
    try:
        with DaemonClient(d.path, timeout=REQUEST_GUARD_S) as client:
            while True:
                t0 = time.monotonic()
                reply = client.request("stats")
                took = time.monotonic() - t0
                assert reply is not None and reply["ok"], d.output()
                daemon = reply["stats"]["daemon"]
                if daemon["pool_segments"]:
                    fill = time.monotonic() - (t0 if began is None else began)
                    break
                if daemon["pool_bytes"]:  # the filler holds the segment it is making
                    began = t0 if began is None else began
                    times.append(took)
                assert time.monotonic() < deadline, "the pool never filled"
                time.sleep(0.01)
    finally:
        d.terminate(timeout=30)  # SIGTERM unlinks the pool: nothing of the 2 GiB stays
    assert len(times) >= 3, (
        f"only {len(times)} requests answered in the {fill:.2f} s fill: "
        "the loop waited for it (or the fill was too quick to tell)"
    )
    median = sorted(times)[len(times) // 2]
    assert max(times) < fill / 2, (
        f"a stats request waited {max(times) * 1e3:.0f} ms of the {fill * 1e3:.0f} ms fill "
        f"({len(times)} requests, median {median * 1e3:.1f} ms)"
    )


@pytest.mark.timeout(40)
def test_declared_bytes_never_refuse_other_jobs(daemons: Daemons) -> None:
    d = daemons.start("--budget", "1T")
    hostile, honest = d.client(), d.client()
    bad = new_token()
    huge = 1 << 62
    hostile.register(description(bad), {f"/shml-{bad}-ctl": huge})
    hostile.add_segment(bad, f"/shml-{bad}-0.0", huge)
    with pytest.raises(ShmCapacityError):
        hostile.admit(bad, huge)  # refused, and not recorded as a grant
    good = new_token()
    honest.register(description(good))
    honest.admit(good, 8 << 20)  # granted: returns quietly
    doc = d.stats()
    assert doc["daemon"]["in_use_bytes"] < 1 << 40  # (other jobs of this node count too)
    assert next(j for j in doc["jobs"] if j["token"] == bad)["bytes"] < 1 << 20
    for c, t in ((hostile, bad), (honest, good)):
        c.unregister(t)
        c.close()


@pytest.mark.timeout(60)
def test_reports_of_invented_ranks_do_not_grow_the_daemon(daemons: Daemons) -> None:
    from shmloaderd.registry import MAX_GRANTS, MAX_OWNERS, Registry

    reg = Registry(lambda: None)
    token = new_token()
    assert reg.report({"token": token, "rank": 0})["ok"] is False  # unknown job
    reg.register({"token": token, "group": [0, 1], "pids": {0: (os.getpid(), MY_START)}})
    for rank in range(2, 200_002):
        assert reg.report({"token": token, "rank": rank, "consumed": 1})["ok"] is False
    assert reg.report({"token": token, "rank": 1, "consumed": 3})["ok"] is True
    assert set(reg.find(token).reports) == {1}
    # admissions with invented pids and too many pending grants are bounded too
    other = new_token()
    for pid in range(1, 1000):
        reg.admit({"token": other, "bytes": 1, "pid": pid, "start": 1})
    assert len(reg.find(other).owners) <= MAX_OWNERS
    assert len(reg.find(other).grants) <= MAX_GRANTS

    # the real daemon, 20,000 pipelined reports of invented ranks
    d = daemons.start()
    with d.client() as c:
        c.register(description(token, ranks=(0, 1)))
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(f"ipc://{d.path}")
    try:
        replies = []
        for first in range(2, 20_002, 500):  # in windows: the daemon never queues past its HWM
            for rank in range(first, first + 500):
                body = {"v": 1, "op": "report", "token": token, "rank": rank, "consumed": 1}
                dealer.send(json.dumps(body).encode())
            replies += [json.loads(dealer.recv()) for _ in range(500)]
        assert len(replies) == 20_000
    finally:
        dealer.close(linger=0)
    assert not any(r["ok"] for r in replies)
    assert "not in the group" in replies[0]["error"]
    job = next(j for j in d.stats()["jobs"] if j["token"] == token)
    assert set(job["followers"]) <= {"0", "1"} and set(job["ranks"]) <= {"0", "1"}


@pytest.mark.timeout(40)
def test_daemon_reaps_dead_private_runtime_dirs(daemons: Daemons, no_leaks) -> None:
    """A writer killed before its close leaves ``shml-<pid>...`` with its socket: reaped."""
    from shmloader._node.rundir import (
        SOCKET_NAME,
        make_private_dir,
        remove_private_dir,
        rundir_prefix,
    )

    dead = tempfile.mkdtemp(prefix=rundir_prefix(dead_pid(), 1, 0), dir=no_leaks)
    live = make_private_dir(no_leaks)
    for path in (dead, live):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(path, SOCKET_NAME))
    try:
        d = daemons.start("--reap-interval", "0.1", env={"SHMLOADER_RUNTIME_DIR": no_leaks})
        wait_until(lambda: not os.path.exists(dead), 5, "the dead writer's directory reaped")
        assert os.path.exists(os.path.join(live, SOCKET_NAME)), "a live process's socket went"
        assert d.stats()["daemon"]["reaped_sockets"] >= 1
        assert f"reaped the runtime directory {dead}" in d.output()
    finally:
        remove_private_dir(live, os.getpid())
        shutil.rmtree(dead, ignore_errors=True)


def test_daemon_reaps_stale_sockets(daemons: Daemons, no_leaks) -> None:
    runtime = os.path.join(no_leaks, f"shmloader-{os.geteuid()}")
    os.makedirs(runtime, mode=0o700)
    stale = os.path.join(runtime, f"abcd-{dead_pid()}.sock")
    live = os.path.join(runtime, f"abcd-{os.getpid()}.sock")
    for path in (stale, live):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
    try:
        d = daemons.start("--reap-interval", "0.1", env={"SHMLOADER_RUNTIME_DIR": no_leaks})
        wait_until(lambda: not os.path.exists(stale), 5, "the stale socket reaped")
        assert os.path.exists(live), "a live process's socket was removed"
        assert d.stats()["daemon"]["reaped_sockets"] >= 1
        assert f"reaped the stale socket {stale}" in d.output()
    finally:
        for path in (stale, live):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

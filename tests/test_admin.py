"""``shmloader stat`` and ``shmloader gc`` without a daemon (``shmloader.admin``).

Segments are real: a live ``RingWriter`` owned by this process, segments whose
header names a dead or recycled owner, and a ``shml-*`` file that is not ours.
The daemon-backed ``stat`` is tested in ``test_daemon``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from shmloader import admin
from shmloader.ring import RingWriter, new_token
from shmloader.segment import HEADER_SIZE, KIND_CONTROL, KIND_DATA, MY_START, Header, Segment
from shmloader.segment import shm_path as _shm_path

JOB_KEYS = {
    "token", "state", "registered", "group", "leader", "writer", "node_ranks", "world",
    "pids", "writer_pid", "writer_alive", "segments", "segment_bytes", "bytes", "slots",
    "ring_bytes", "published", "bytes_published", "publish_ms_avg", "last_publish_unix",
    "readers", "followers",
}  # fmt: skip


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run ``shmloader <argv>`` through ``admin.register`` as cli.py does."""
    parser = argparse.ArgumentParser(prog="shmloader")
    admin.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    capsys.readouterr()
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def live_ring() -> Iterator[RingWriter]:
    token = new_token()
    desc = {
        "token": token,
        "group": [0, 1, 2, 3],
        "leader": 0,
        "writer": 0,
        "node": [0, 1],
        "pids": {"0": [os.getpid(), MY_START], "1": [os.getpid(), MY_START]},
        "world": 4,
    }
    ring = RingWriter(token, frozenset({1}), desc)
    try:
        slot = ring.acquire(200_000)
        ring.publish(slot, 0, 150_000, 3_000_000)
        yield ring
    finally:
        ring.close()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def orphan(kind: int = KIND_CONTROL, **header) -> Segment:
    """A real segment whose header names another owner (dead by default)."""
    token = new_token()
    suffix = "ctl" if kind == KIND_CONTROL else "0.0"
    seg = Segment.create(f"/shml-{token}-{suffix}", kind, token, 8192)
    h = seg.header
    fields = {"pid": dead_pid(), "start": h.start, **header}
    new = Header(h.kind, h.uid, h.token, fields["pid"], fields["start"], h.capacity, h.created_ns)
    os.pwrite(seg.fd, new.pack(), 0)
    return seg


@contextlib.contextmanager
def cleanup(*segments: Segment) -> Iterator[None]:
    try:
        yield
    finally:
        for seg in segments:
            seg.unlink()
            seg.close()


@pytest.mark.timeout(20)
def test_scan_documents_a_live_job() -> None:
    with live_ring() as ring:
        doc = admin.scan()
        assert doc["schema"] == 1 and doc["source"] == "scan" and doc["daemon"] is None
        assert doc["node"]["shm_size_bytes"] > 0 and doc["node"]["shm_free_bytes"] > 0
        job = next(j for j in doc["jobs"] if j["token"] == ring.token)
        assert set(job) == JOB_KEYS
        assert job["state"] == "live" and job["registered"] is False
        assert job["group"] == [0, 1, 2, 3] and job["leader"] == 0 and job["world"] == 4
        assert job["node_ranks"] == [0, 1]
        assert job["writer_pid"] == os.getpid() and job["writer_alive"] is True
        assert job["published"] == 1 and job["bytes_published"] == 150_000
        assert job["publish_ms_avg"] == 3.0
        assert job["slots"] == 1 and job["readers"] == 1
        slot_bytes = ring.slots[0].capacity
        assert job["ring_bytes"] == slot_bytes
        kinds = sorted(s["kind"] for s in job["segments"])
        assert kinds == ["control", "data"]  # the reader never attached: data still named
        assert job["bytes"] == job["segment_bytes"] >= slot_bytes + 2 * HEADER_SIZE
        assert doc["node"]["shmloader_bytes"] >= job["bytes"]
        json.dumps(doc)  # serialisable as is
    assert ring.token not in {j["token"] for j in admin.scan()["jobs"]}


@pytest.mark.timeout(20)
def test_stat_without_daemon_says_it_scans(capsys, monkeypatch) -> None:
    monkeypatch.delenv("SHMLOADER_DAEMON", raising=False)
    with live_ring() as ring:
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0
        assert "scanning /dev/shm headers" in out.splitlines()[0]
        row = next(line for line in out.splitlines() if line.startswith(ring.token))
        assert "live" in row and "0-3" in row and str(os.getpid()) in row

        code, out, err = run_cli(["stat", "--json"], capsys)
        doc = json.loads(out)
        assert code == 0 and doc["source"] == "scan" and "scanning /dev/shm" in err
        assert ring.token in {j["token"] for j in doc["jobs"]}

        monkeypatch.setenv("SHMLOADER_DAEMON", "/nonexistent/shmloaderd.sock")
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0 and "/nonexistent/shmloaderd.sock did not answer" in out

        code, out, _ = run_cli(["stat", "--watch", "0.01", "--count", "3"], capsys)
        assert code == 0 and out.count("\x1b[H\x1b[2J") == 3 and out.count(ring.token) == 3
        code, out, _ = run_cli(["stat", "--json", "--watch", "0.01", "--count", "2"], capsys)
        assert code == 0 and [json.loads(x)["schema"] for x in out.splitlines()] == [1, 1]
    code, _, err = run_cli(["stat", "--watch", "0"], capsys)
    assert code == 2 and "--watch 0" in err


@pytest.mark.timeout(20)
def test_gc_removes_only_dead_owners_and_dry_run_removes_nothing(capsys, no_leaks) -> None:
    runtime = os.path.join(no_leaks, f"shmloader-{os.geteuid()}")
    os.makedirs(runtime, mode=0o700)
    stale_sock = os.path.join(runtime, f"abcd-{dead_pid()}.sock")
    live_sock = os.path.join(runtime, f"abcd-{os.getpid()}.sock")
    for path in (stale_sock, live_sock):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
    dead = orphan(KIND_CONTROL)
    dead_data = orphan(KIND_DATA)
    recycled = orphan(KIND_DATA, pid=os.getpid(), start=MY_START + 777)  # pid reused
    unknown_start = orphan(KIND_DATA, pid=os.getpid(), start=0)  # start 0: pid alone decides
    junk_token = new_token()
    junk = f"/shml-{junk_token}-ctl"
    fd = os.open(_shm_path(junk), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, b"NOTOURS!" + b"\0" * 8192)
    os.close(fd)
    should_go = {dead.name, dead_data.name, recycled.name}
    try:
        with live_ring() as ring, cleanup(dead, dead_data, recycled, unknown_start):
            live_names = {s["name"] for j in admin.scan()["jobs"] for s in j["segments"]
                          if j["token"] == ring.token}  # fmt: skip
            assert len(live_names) == 2

            listed = admin.collect_garbage(dry_run=True)
            names = {i["name"] for i in listed if i["type"] == "segment"}
            assert should_go <= names
            assert not names & (live_names | {junk, unknown_start.name})
            assert stale_sock in {i["name"] for i in listed if i["type"] == "socket"}
            assert not any(i["removed"] for i in listed)
            for name in should_go | live_names | {junk}:
                assert os.path.exists(_shm_path(name)), f"--dry-run removed {name}"
            assert os.path.exists(stale_sock)

            # Scoped to this test's jobs: a test never collects other runs' leftovers.
            scope = [dead, dead_data, recycled, unknown_start]
            tokens = {s.header.token for s in scope} | {ring.token, junk_token, "abcd"}
            code, out, _ = run_cli(["gc", *(f"--token={t}" for t in sorted(tokens))], capsys)
            assert code == 0
            for name in should_go:
                assert not os.path.exists(_shm_path(name)), f"gc left {name}"
                assert f"removed {name}" in out
            assert f"removed stale socket {stale_sock}" in out and "freed" in out
            for name in live_names | {junk, unknown_start.name}:
                assert os.path.exists(_shm_path(name)), f"gc removed {name}"
            assert not os.path.exists(stale_sock) and os.path.exists(live_sock)

            code, out, _ = run_cli(["gc", "--dry-run"], capsys)
            assert code == 0
            assert not any(name in out for name in live_names | {junk})
            scan = admin.scan()
            assert junk in {i["name"] for i in scan["invalid"]}
    finally:
        os.unlink(_shm_path(junk))
        os.unlink(live_sock)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale_sock)


@pytest.mark.timeout(20)
def test_gc_json_and_nothing_to_do(capsys) -> None:
    seg = orphan(KIND_DATA)
    with cleanup(seg):
        code, out, _ = run_cli(["gc", "--json", "--dry-run"], capsys)
        items = [i for i in json.loads(out) if i["name"] == seg.name]
        assert code == 0 and len(items) == 1
        item = items[0]
        assert item["type"] == "segment" and item["kind"] == "data" and not item["removed"]
        assert item["bytes"] == HEADER_SIZE + seg.capacity and item["token"] == seg.header.token
        code, out, _ = run_cli(["gc", "--json", "--token", seg.header.token], capsys)
        assert [i["removed"] for i in json.loads(out) if i["name"] == seg.name] == [True]
    mine = [i for i in admin.collect_garbage(dry_run=True) if i["token"] == seg.header.token]
    assert mine == []


@pytest.mark.timeout(10)
def test_table_formatting_of_a_daemon_document() -> None:
    doc = admin.build_document([], "daemon")
    doc["daemon"] = {
        "pid": 42,
        "version": "0.1.0",
        "socket": "/run/shmloader/control.sock",
        "budget_bytes": 1 << 30,
        "in_use_bytes": 3 << 20,
        "uptime_s": 1.0,
        "reaped_segments": 2,
        "reaped_bytes": 8192,
        "pool_bytes": 0,
        "pool_segments": 0,
    }
    job = {k: None for k in JOB_KEYS}
    job.update(
        token="feedfacecafebeef",
        state="dead",
        group=[0, 1, 2, 3],
        segments=[],
        bytes=3 << 20,
        writer_pid=77,
        writer_alive=False,
        followers={"2": {"consumed": 5, "lag": 1, "receive_ms": 0.125}},
    )
    doc["jobs"] = [job]
    text = admin.format_table(doc)
    assert "shmloaderd pid 42: budget 1.0 GiB, 3.0 MiB in use, reaped 2 segment(s)" in text
    assert "feedfacecafebeef dead" in text and "77†" in text
    assert "rank 2: consumed 5, lag 1, receive 0.125 ms" in text
    assert "writer process is gone" in text

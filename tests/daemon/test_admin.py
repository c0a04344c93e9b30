"""``shmloader stat`` and ``shmloader gc`` without a daemon (``shmloader._node.inventory``).

Segments are real: a live ``RingWriter`` owned by this process, segments whose
header names a dead or recycled owner, and a ``shml-*`` file that is not ours.
The daemon-backed ``stat`` is tested in ``test_daemon``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator

import pytest

from shmloader._node import inventory, reaping
from shmloader._node.ring import RingWriter, new_token
from shmloader._node.segment import HEADER_SIZE, KIND_CONTROL, KIND_DATA, MY_START, Header, Segment
from shmloader._node.segment import shm_path as _shm_path
from shmloader.tools import stat as stat_cli

JOB_KEYS = {
    "token", "state", "registered", "group", "leader", "writer", "node_ranks", "world",
    "pids", "writer_pid", "writer_alive", "segments", "segment_bytes", "bytes", "slots",
    "ring_bytes", "published", "bytes_published", "publish_ms_avg", "last_publish_unix",
    "readers", "followers", "job", "started_unix", "age_s", "reclaimable_bytes", "ranks",
    "granted_pending_bytes", "ended", "uid", "user", "shm_dir", "huge_pages",
}  # fmt: skip


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run ``shmloader <argv>`` through ``stat.register`` as cli.py does."""
    parser = argparse.ArgumentParser(prog="shmloader")
    stat_cli.register(parser.add_subparsers(dest="command", required=True))
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
        ring.hold_for_readers(slot, 0, 150_000, 3_000_000)
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
        doc = inventory.scan()
        assert doc["schema"] == inventory.SCHEMA == 3
        assert doc["source"] == "scan" and doc["daemon"] is None
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
    assert ring.token not in {j["token"] for j in inventory.scan()["jobs"]}


@pytest.mark.timeout(20)
def test_stat_without_daemon_says_it_scans(capsys, monkeypatch) -> None:
    monkeypatch.delenv("SHMLOADER_DAEMON", raising=False)
    with live_ring() as ring:
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0
        assert "scanning the ring directories" in out.splitlines()[0]
        row = next(line for line in out.splitlines() if ring.token in line.split()[:2])
        assert "live" in row and "0-3" in row and str(os.getpid()) in row

        code, out, err = run_cli(["stat", "--json"], capsys)
        doc = json.loads(out)
        assert code == 0 and doc["source"] == "scan" and "scanning the ring directories" in err
        assert ring.token in {j["token"] for j in doc["jobs"]}

        monkeypatch.setenv("SHMLOADER_DAEMON", "/nonexistent/shmloaderd.sock")
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0 and "/nonexistent/shmloaderd.sock did not answer" in out

        code, out, _ = run_cli(["stat", "--watch", "0.01", "--count", "3"], capsys)
        assert code == 0 and out.count("\x1b[H\x1b[2J") == 3 and out.count(ring.token) == 3
        code, out, _ = run_cli(["stat", "--json", "--watch", "0.01", "--count", "2"], capsys)
        assert code == 0 and [json.loads(x)["schema"] for x in out.splitlines()] == [3, 3]
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
            live_names = {s["name"] for j in inventory.scan()["jobs"] for s in j["segments"]
                          if j["token"] == ring.token}  # fmt: skip
            assert len(live_names) == 2

            listed = reaping.collect_garbage(dry_run=True)
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
            code, out, _ = run_cli(
                ["gc", "--verbose", *(f"--token={t}" for t in sorted(tokens))], capsys
            )
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
            scan = inventory.scan()
            assert junk in {i["name"] for i in scan["invalid"]}
    finally:
        os.unlink(_shm_path(junk))
        os.unlink(live_sock)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale_sock)


@contextlib.contextmanager
def dead_ring(job: str) -> Iterator[RingWriter]:
    """A ring described as ``job`` whose writer (the owner of all its segments) died."""
    token = new_token()
    ring = RingWriter(token, frozenset({1}), {"token": token, "job": job, "pids": {}})
    slot = ring.acquire(100_000)  # reader 1 never attaches: the data segment stays named
    ring.hold_for_readers(slot, 0, 100_000, 1_000_000)
    pid = dead_pid()
    originals = []
    for seg in (ring.control, slot.segment):
        h = seg.header
        originals.append((seg, h))
        Header(h.kind, h.uid, h.token, pid, h.start, h.capacity, h.created_ns).write(seg.fd)
    try:
        yield ring
    finally:
        for seg, h in originals:
            h.write(seg.fd)  # ours again, so that close() cleans up what is left
        ring.close()


@pytest.mark.timeout(20)
def test_gc_job_removes_only_that_jobs_rings(capsys) -> None:
    with dead_ring("train-a") as a, dead_ring("train-b") as b:
        names = {
            r.token: {s["name"] for j in inventory.scan()["jobs"] if j["token"] == r.token
                      for s in j["segments"]}
            for r in (a, b)
        }  # fmt: skip
        assert all(len(v) == 2 for v in names.values())
        code, out, _ = run_cli(["gc", "--job", "train-a"], capsys)
        assert code == 0
        # one line for the job, named as `stat` names it, with its ring token
        lines = [x for x in out.splitlines() if x.startswith("removed ")]
        assert len(lines) == 1 and lines[0].endswith(" is gone"), out
        assert lines[0].startswith(f"removed job train-a (ring {a.token}): 2 segment(s), "), out
        assert "freed 2 segment(s) of 1 job(s)" in out, out
        for name in names[a.token]:
            assert name not in out and not os.path.exists(_shm_path(name))
        for name in names[b.token]:
            assert name not in out and os.path.exists(_shm_path(name)), "gc --job took another job"
        code, out, _ = run_cli(["gc", "--job", "train-a"], capsys)
        assert code == 0 and "nothing to collect for job train-a" in out
        code, out, _ = run_cli(["gc", "--job", "train-b", "--dry-run", "-v"], capsys)
        assert f"would remove job train-b (ring {b.token}): 2 segment(s)" in out, out
        assert all(f"    would remove {n}" in out for n in names[b.token]), out


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
    mine = [i for i in reaping.collect_garbage(dry_run=True) if i["token"] == seg.header.token]
    assert mine == []


@pytest.mark.timeout(10)
def test_table_formatting_of_a_daemon_document() -> None:
    doc = inventory.build_document([], "daemon")
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
        job="train-llama-70b-sp8",
        age_s=3725.0,
        state="dead",
        group=[0, 1, 2, 3],
        segments=[],
        bytes=144 << 10,
        reclaimable_bytes=144 << 10,
        writer_pid=77,
        writer_alive=False,
        ranks={
            "0": {
                "role": "leader",
                "batches": 9,
                "wait_ms_p50": 812.5,
                "wait_ms_p95": 1500.0,
                "wait_ms_p99": 2048.25,
                "wait_share": 0.93,
                "lag": None,
                "traffic_bytes": 9 << 20,
                "updated_unix": 1.0,
            },
        },
        followers={"2": {"consumed": 5, "lag": 1, "receive_ms": 0.125}},
    )
    doc["jobs"] = [job]
    text = stat_cli.format_table(doc)
    assert "shmloaderd pid 42: budget 1.0 GiB, 3.0 MiB in use, reaped 2 segment(s)" in text
    row = next(line for line in text.splitlines() if line.startswith("feedfacecafebeef"))
    assert row.split()[1:4] == ["train-llama-7…", "dead", "1h02m"] and "77†" in row
    assert "dead: `shmloader gc` frees 144.0 KiB" in text
    leader = next(line.split() for line in text.splitlines() if line.strip().startswith("0 "))
    assert leader == ["0", "leader", "9", "812.50", "ms", "1500.00", "ms", "2048.25", "ms",
                      "93%", "-", "9.0", "MiB"]  # fmt: skip
    follower = next(line.split() for line in text.splitlines() if line.strip().startswith("2 "))
    assert follower[:3] == ["2", "follower", "5"] and follower[7] == "1"  # batches, lag
    assert "writer process is gone" in text and "WAITING: share of wall time" in text
    header = next(line.split() for line in text.splitlines() if line.strip().startswith("RANK"))
    assert header[-1] == "TRAFFIC" and "TRAFFIC: payload bytes" in text  # not memory held
    assert "HELD" in text.splitlines()[2].split()


@pytest.mark.timeout(20)
def test_a_dead_jobs_bytes_are_what_gc_frees(capsys) -> None:
    """The ring counters of a dead writer describe mappings that died with it."""
    with live_ring() as ring:
        slot = ring.slots[0]
        slot.segment.unlink()  # the reader attached: the slot's name is gone
        ctl = ring.control
        h = ctl.header
        dead = Header(h.kind, h.uid, h.token, dead_pid(), h.start, h.capacity, h.created_ns)
        dead.write(ctl.fd)  # now the writer is dead
        job = next(j for j in inventory.scan()["jobs"] if j["token"] == ring.token)
        assert job["state"] == "dead" and job["ring_bytes"] == slot.capacity
        freed = [i for i in reaping.collect_garbage(dry_run=True) if i["token"] == ring.token]
        would_free = sum(i["bytes"] for i in freed)
        assert would_free == HEADER_SIZE + ctl.capacity
        assert job["bytes"] == job["reclaimable_bytes"] == would_free
        assert job["age_s"] is not None and job["started_unix"] == h.created_ns / 1e9
        h.write(ctl.fd)  # ours again, so that close() unlinks it


@pytest.mark.timeout(20)
def test_live_job_bytes_count_unlinked_slots_the_writer_maps() -> None:
    with live_ring() as ring:
        ring.slots[0].segment.unlink()  # name gone, memory still mapped by the writer
        job = next(j for j in inventory.scan()["jobs"] if j["token"] == ring.token)
        assert job["segment_bytes"] == HEADER_SIZE + ring.control.capacity
        observed = inventory.observed_bytes(ring.token, inventory.scan_entries(), os.getpid())
        slot_file = HEADER_SIZE + ring.slots[0].capacity
        assert observed == job["segment_bytes"] + slot_file, (observed, job)
        assert job["bytes"] >= observed


@pytest.mark.timeout(20)
def test_scan_shows_the_job_name_and_rank_rows_the_writer_describes(capsys) -> None:
    with live_ring() as ring:
        desc = {"token": ring.token, "group": [0, 1], "leader": 0, "writer": 0, "node": [0, 1],
                "pids": {}, "world": 2, "job": "train-7b",
                "ranks": {"0": {"role": "leader", "batches": 12, "wait_ms_p50": 40.0,
                                "wait_share": 0.8, "bytes": 1 << 20},
                          "1": {"role": "follower", "batches": 11, "lag": 1},
                          "x": {"role": "leader"}, "2": "junk"}}  # fmt: skip
        ring.describe(desc)
        doc = inventory.scan()
        job = next(j for j in doc["jobs"] if j["token"] == ring.token)
        assert job["job"] == "train-7b" and set(job["ranks"]) == {"0", "1"}
        assert job["ranks"]["0"]["wait_share"] == 0.8 and job["ranks"]["1"]["lag"] == 1
        assert job["ranks"]["0"]["traffic_bytes"] == 1 << 20  # a description's older "bytes"
        assert job["ranks"]["1"]["wait_ms_p50"] is None
        # a scan cannot know a follower's wait: it says why, and what to do
        # (of this job: other jobs on the node, another test's, add their own followers)
        (why,) = [n for n in inventory.notes([job], "scan") if "followers' waits" in n]
        assert "ranks 1)" in why and "SHMLOADER_DAEMON" in why
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0 and "train-7b" in out and "80%" in out
        listed = re.search(r"note: followers' waits for data \(ranks ([0-9,.]+)\) are reported "
                           r"only to shmloaderd", out)  # fmt: skip
        assert listed and "1" in listed[1].split(","), out


def test_device_fields_of_a_rank_row_are_type_checked_and_the_bandwidth_derived() -> None:
    row = {"device": "cuda:3", "device_batches": 4, "device_bytes": 8_000_000,
           "device_copy_ms_total": 2.0, "device_registered": True,
           "device_registration_refused": None}  # fmt: skip
    got = inventory.device_fields(row)
    assert got["device"] == "cuda:3" and got["device_bandwidth_gbs"] == 4.0
    assert got["device_registered"] is True and set(got) == set(inventory.DEVICE_KEYS)
    junk = {"device": "cuda:0", "device_bytes": "8", "device_copy_ms_total": True,
            "device_registered": 1, "device_batches": -0.5}  # fmt: skip
    assert inventory.device_fields(junk) == {
        **dict.fromkeys(inventory.DEVICE_KEYS),
        "device": "cuda:0",
    }
    for no_device in ({}, {"device": ""}, {"device": 3}, "junk", {"device_bytes": 5}):
        assert inventory.device_fields(no_device) == dict.fromkeys(inventory.DEVICE_KEYS)
    stalled = inventory.device_fields({**row, "device_copy_ms_total": 0.0})
    assert stalled["device_bandwidth_gbs"] is None  # nothing timed yet: no bandwidth


@pytest.mark.timeout(20)
def test_gc_reaps_sockets_of_recycled_pids_in_every_runtime_dir(no_leaks) -> None:
    uid = os.geteuid()
    plain = os.path.join(no_leaks, f"shmloader-{uid}")
    private = os.path.join(no_leaks, f"shmloader-{uid}-x1y2z3")  # a mkdtemp-style one
    foreign = os.path.join(no_leaks, f"shmloader-{uid}-open")
    for d in (plain, private, foreign):
        os.makedirs(d, mode=0o700)
    os.chmod(foreign, 0o755)  # open to others: not ours to clean
    socks = {
        "dead": os.path.join(private, f"abcd-{dead_pid()}.sock"),
        "recycled": os.path.join(plain, f"beef-{os.getpid()}.sock"),
        "live": os.path.join(plain, f"cafe-{os.getpid()}.sock"),
        "foreign": os.path.join(foreign, f"dead-{dead_pid()}.sock"),
    }
    for path in socks.values():
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
    old = os.stat(socks["live"]).st_mtime - 10 * 86400  # made before this process started
    os.utime(socks["recycled"], (old, old))
    try:
        removed = {i["name"] for i in reaping.collect_garbage() if i["type"] == "socket"}
        assert {socks["dead"], socks["recycled"]} <= removed
        assert os.path.exists(socks["live"]) and os.path.exists(socks["foreign"])
        assert not os.path.exists(socks["dead"]) and not os.path.exists(socks["recycled"])
    finally:
        for path in socks.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.mark.timeout(20)
def test_stat_finds_the_default_daemon_socket(capsys, monkeypatch, tmp_path) -> None:
    """``stat`` asks the socket a job asks without a variable (NOTE [finding the daemon]):
    the well-known one, here moved by ``SHMLOADER_RUNTIME_DIR``; ``off`` asks none."""
    monkeypatch.delenv("SHMLOADER_DAEMON", raising=False)
    monkeypatch.setenv("SHMLOADER_RUNTIME_DIR", str(tmp_path))
    missing = str(tmp_path / "shmloader" / "control.sock")
    code, out, _ = run_cli(["stat"], capsys)
    assert code == 0 and f"no {missing}" in out.splitlines()[0]
    os.mkdir(tmp_path / "shmloader")
    with socket.socket(socket.AF_UNIX) as s:  # exists, but nobody answers
        s.bind(missing)
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0 and f"shmloaderd at {missing} did not answer" in out
        monkeypatch.setenv("SHMLOADER_DAEMON", "off")
        code, out, _ = run_cli(["stat"], capsys)
        assert code == 0 and "no daemon (SHMLOADER_DAEMON=off)" in out.splitlines()[0]
    os.unlink(missing)


def test_every_public_exception_is_importable_from_the_package() -> None:
    import inspect as pyinspect

    import shmloader
    from shmloader import errors

    public = {
        name
        for name, obj in vars(errors).items()
        if pyinspect.isclass(obj) and issubclass(obj, errors.ShmLoaderError)
    }
    assert {"LoaderStateError", "ProtocolError", "ShmLoaderError"} <= public
    for name in public:
        assert getattr(shmloader, name) is getattr(errors, name), name
        assert name in shmloader.__all__, name


@pytest.mark.timeout(20)
def test_reaping_unlinks_only_the_very_file_it_found_dead(monkeypatch) -> None:
    """The name is unlinked only while it still is the file validated and found dead."""
    dead = orphan(KIND_DATA)
    live = Segment.create(f"/shml-{dead.header.token}-0.1", KIND_DATA, dead.header.token, 8192)
    judged = reaping.owner_alive

    def swap_then_judge(header: Header) -> bool:  # another file takes the name meanwhile
        os.rename(_shm_path(live.name), _shm_path(dead.name))
        return judged(header)

    monkeypatch.setattr(reaping, "owner_alive", swap_then_judge)
    with cleanup(dead, live):
        assert reaping.remove_if_dead(dead.name) is None
        assert os.fstat(live.fd).st_nlink == 1  # the live owner's file is still named
    assert not os.path.exists(_shm_path(dead.name))


# ------------------------------------------------- NOTE [every ring directory]


@pytest.fixture
def daemons():
    from tests.daemon.test_daemon import Daemons

    ds = Daemons()
    try:
        yield ds
    finally:
        ds.close()


@contextlib.contextmanager
def ring_dir_of_root() -> Iterator[str]:
    """A ring directory as an operator makes one (root's, 0700), removed afterwards."""
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="shml-ringdir-", dir="/dev/shm")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.timeout(60)
def test_gc_and_stat_look_in_the_daemons_and_the_systemd_ring_directories(
    capsys, monkeypatch, daemons
) -> None:
    """Without SHMLOADER_SHM_DIR, gc said "nothing to collect" while dead segments sat
    in the daemon's --shm-dir and in the systemd mount's directory."""
    from shmloader._node import ringdir, segment

    with ring_dir_of_root() as theirs, ring_dir_of_root() as mounted:
        d = daemons.start("--shm-dir", theirs, "--reap-interval", "3600")  # no reaping now
        monkeypatch.setattr(ringdir, "SYSTEMD_RING_DIR", mounted, raising=False)
        monkeypatch.setenv("SHMLOADER_DAEMON", d.path)
        monkeypatch.delenv("SHMLOADER_SHM_DIR", raising=False)
        dead = {}
        for where in (theirs, mounted):
            with segment.in_dir(where):
                seg = orphan(KIND_DATA)
                seg.close()
            dead[where] = seg
        tokens = [f"--token={s.header.token}" for s in dead.values()]
        code, out, _ = run_cli(["gc", "--dry-run", "--verbose", *tokens], capsys)
        for seg in dead.values():
            assert f"would remove {seg.name}" in out, out
        scanned = {j["token"]: j["shm_dir"] for j in inventory.scan()["jobs"]}
        assert scanned.get(dead[mounted].header.token) == mounted
        code, out, _ = run_cli(["gc", *tokens], capsys)
        assert code == 0 and "freed 2 segment(s)" in out, out
        for where, seg in dead.items():
            assert not os.path.exists(os.path.join(where, seg.name.lstrip("/")))


@pytest.mark.timeout(60)
def test_stat_says_where_each_ring_really_is(daemons) -> None:
    """The daemon's first --shm-dir is not where every ring is: the header names each
    ring directory, a ring in /dev/shm is said to be there, a dead job's record
    (no directory known) shows no ``ring in None``."""
    import multiprocessing as mp

    from shmloader._node import segment
    from shmloader._transport.daemon_client import DaemonClient
    from tests.daemon.test_daemon import wait_until

    def die_in(where: str) -> None:
        with segment.in_dir(where):
            token = new_token()
            ring = RingWriter(token, frozenset({1}), {"token": token, "job": "gone"})
            ring.hold_for_readers(ring.acquire(4096), 0, 4096, 1)
        os._exit(0)

    with ring_dir_of_root() as huge, live_ring() as ring:
        d = daemons.start("--shm-dir", huge, "--reap-interval", "0.2")
        client = DaemonClient(d.path)
        try:
            client.register(
                {"token": ring.token, "group": [0, 1], "pids": {"0": [os.getpid(), MY_START]}}
            )
            client.admit(ring.token, 1 << 20)  # granted, not allocated yet
            client.report(ring.token, 0, published=1, role="leader")
            child = mp.get_context("fork").Process(target=die_in, args=(huge,))
            child.start()
            child.join(30)
            wait_until(
                lambda: any(j["state"] == "dead" and j["ended"] for j in d.stats()["jobs"]),
                10,
                "the dead ring's record",
            )
            table = stat_cli.format_table(client.stats())
        finally:
            client.close()
    lines = table.splitlines()
    assert "ring in None" not in table, table
    assert "/dev/shm" in lines[0] and huge in lines[0], lines[0]
    at = next(i for i, line in enumerate(lines) if line.split()[0:1] == [ring.token])
    block = []
    for line in lines[at + 1 :]:
        if not line.startswith("    "):
            break
        block.append(line)
    assert any("admitted, not in /dev/shm yet" in line for line in block), block
    assert not any(huge in line for line in block), block
    assert "HELD: bytes in /dev/shm" not in table

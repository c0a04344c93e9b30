"""shmloaderd in node mode: one root daemon, jobs of two users at once.

The suite runs as root (CI too), so each user is a child forked from this
process that drops to an unused uid (``setgroups([])``, ``setgid``,
``setuid``) and then runs commands sent over a pipe: make a live ring and
register it, ask ``stats``, send a raw request, ``admit``, ``adopt``, run
``gc``, leave a segment behind. Forking (not ``setpriv`` + a new
interpreter) keeps the test independent of whether the virtual
environment's interpreter is readable by other uids: every module the
children use is imported here first.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import shutil
import signal
import socket
import stat
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterator

import pytest
from shmloaderd.__main__ import build_parser, node_mode, parse_uid_budget
from shmloaderd.server import Daemon as InProcessDaemon
from shmloaderd.tenants import Peer, Tenancy, peer_of

from shmloader import admin, channel, segment
from shmloader.daemon_client import DaemonClient
from shmloader.errors import ShmCapacityError, human_bytes
from shmloader.ring import RingWriter, control_stem, new_token
from shmloader.segment import KIND_CONTROL, KIND_DATA, Segment, shm_path
from tests.test_daemon import Daemons, daemons, exists, wait_until  # noqa: F401 (fixture)

#: Two uids no account or process of this machine uses (checked by ``free_uids``).
UIDS = (61721, 61722)


def free_uids() -> tuple[int, int]:
    import pwd

    used = {p.pw_uid for p in pwd.getpwall()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            used.add(os.stat(f"/proc/{pid}").st_uid)
    for uid in UIDS:
        if uid in used:
            pytest.skip(f"uid {uid} is in use on this machine; the test needs two unused uids")
    if os.geteuid() != 0:
        pytest.skip("running jobs as other users needs root (CI runs the suite as root)")
    pid = os.fork()
    if pid == 0:  # can this machine (a container without CAP_SETUID?) switch uids at all
        try:
            os.setgroups([])
            os.setgid(UIDS[0])
            os.setuid(UIDS[0])
        finally:
            os._exit(0 if os.getuid() == UIDS[0] else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        pytest.skip(f"this machine cannot switch to uid {UIDS[0]} (no CAP_SETUID?)")
    return UIDS


# ------------------------------------------------------------ a user's child

_state: dict = {}  # in a user's child: its rings and its daemon client


def _client() -> DaemonClient:
    return _state["client"]


def cmd_ring(readers: list[int], token: str = "") -> dict:
    """A live ring with one published batch, registered with the daemon."""
    token = token or new_token()
    pid, start, ns = os.getpid(), segment.MY_START, segment.MY_PIDNS
    desc = {
        "token": token, "group": [0, 1], "leader": 0, "writer": 0, "node": [0, 1],
        "pids": {"0": [pid, start, ns]}, "world": 2, "job": f"job-of-{os.getuid()}",
    }  # fmt: skip
    ring = RingWriter(token, frozenset(readers), desc)
    slot = ring.acquire(100_000)
    ring.publish(slot, 0, 100_000, 1_000_000)
    _state.setdefault("rings", []).append(ring)
    _client().register(desc)
    names = [n for n in segment.list_segments() if n.startswith(f"/shml-{token}-")]
    return {"token": token, "names": names}


def cmd_stats() -> dict:
    return _client().stats() or {}


def cmd_request(op: str, fields: dict) -> dict:
    return _client().request(op, **fields) or {}


def cmd_admit(token: str, nbytes: int) -> str:
    try:
        _client().admit(token, nbytes)
    except ShmCapacityError as exc:
        return f"refused: {exc}"
    return "granted"


def cmd_adopt(token: str, name: str, nbytes: int) -> dict:
    """Adopt a pooled segment; its owner and mode as this job sees them once mapped."""
    capacity = _client().adopt(token, name, nbytes)
    if capacity is None:
        return {"capacity": None}
    seg = Segment.attach(name, kind=KIND_DATA, token=token)  # validates: ours, 0600
    try:
        mm = seg.map_shared()
        mm[4096] = 7  # writable: the job uses it as its own
        mm.close()
        st = os.fstat(seg.fd)
        return {"capacity": capacity, "uid": st.st_uid, "mode": stat.S_IMODE(st.st_mode)}
    finally:
        seg.unlink()
        seg.close()


def cmd_leftover(token: str) -> str:
    """A data segment of job ``token`` that this process leaves behind when it exits."""
    return Segment.create_unique(f"/shml-{token}-0.0", KIND_DATA, token, 4096).name


def cmd_plant_control(token: str) -> str:
    """A control segment of this user under another user's job token."""
    return Segment.create_unique(control_stem(token), KIND_CONTROL, token, 4096).name


def cmd_own_daemon(base: str) -> dict:
    """Start (bind) and stop a daemon as this user, with the default mode: single-user."""
    where = tempfile.mkdtemp(dir=base)
    path = os.path.join(where, "c.sock")
    tenants = node_mode(build_parser().parse_args(["--socket", path]), os.geteuid())
    d = InProcessDaemon(path, tenants=tenants)
    try:
        d.bind()
        mode = stat.S_IMODE(os.stat(path).st_mode)
    finally:
        d.close()
        os.rmdir(where)
    return {"tenants": tenants, "socket_mode": mode}


def cmd_rundir(base: str) -> str:
    """A writer's private runtime directory under ``base``, left behind when this exits."""
    return channel.make_private_dir(base)


def cmd_gc() -> list:
    """``shmloader gc --json`` as this user."""
    out = io.StringIO()
    ns = argparse.Namespace(dry_run=False, json=True, token=None, owner_pid=None, job=None)
    with contextlib.redirect_stdout(out):
        admin.cmd_gc(ns)
    return json.loads(out.getvalue())


def _serve(uid: int, path: str, rfd: int, wfd: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _state["client"] = DaemonClient(path, timeout=5.0)
    with os.fdopen(rfd) as commands, os.fdopen(wfd, "w") as answers:
        for line in commands:
            name, args = json.loads(line)
            if name == "exit":  # leave everything behind, like a crash
                os._exit(0)
            try:
                result = {"ok": globals()[f"cmd_{name}"](*args)}
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            answers.write(json.dumps(result) + "\n")
            answers.flush()


class User:
    """A forked child acting as ``uid``; ``call`` runs one ``cmd_*`` there."""

    def __init__(self, uid: int, path: str) -> None:
        self.uid = uid
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(down_w)
                os.close(up_r)
                _serve(uid, path, down_r, up_w)
            finally:
                os._exit(0)
        os.close(down_r)
        os.close(up_w)
        self.pid = pid
        self._out = os.fdopen(down_w, "w")
        self._in = os.fdopen(up_r)

    def call(self, name: str, *args, timeout: float = 20.0):
        self._out.write(json.dumps([name, list(args)]) + "\n")
        self._out.flush()
        ready, _, _ = select.select([self._in], [], [], timeout)
        assert ready, f"user {self.uid}: no answer to {name} within {timeout} s"
        answer = json.loads(self._in.readline())
        assert "error" not in answer, f"user {self.uid}: {name}: {answer['error']}"
        return answer["ok"]

    def exit(self) -> None:
        """The child exits leaving its segments behind (its owner is then dead)."""
        self._out.write(json.dumps(["exit", []]) + "\n")
        self._out.flush()
        os.waitpid(self.pid, 0)
        self.pid = 0

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)  # not a zombie: its segments now have a dead owner
        self.pid = 0

    def close(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0
        self._out.close()
        self._in.close()


@contextlib.contextmanager
def users(path: str, *uids: int) -> Iterator[list[User]]:
    made: list[User] = []
    try:
        for uid in uids:
            made.append(User(uid, path))
        yield made
    finally:
        for u in made:
            u.close()


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


# ------------------------------------------------------------------ pure


@pytest.mark.timeout(10)
def test_node_mode_flags_and_peer_credentials() -> None:
    p = build_parser()
    assert node_mode(p.parse_args([]), 0) is True  # root: every user
    assert node_mode(p.parse_args([]), 1000) is False  # a user: only itself, as before
    assert node_mode(p.parse_args(["--single-user"]), 0) is False
    assert node_mode(p.parse_args(["--tenants"]), 1000) is True
    assert parse_uid_budget("1001=8G") == (1001, ("bytes", 8 << 30))
    assert parse_uid_budget("root=25%") == (0, ("pct", 25.0))
    for bad in ("1001", "nosuchuser-x=1G", "1001=lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_uid_budget(bad)

    class Frame:
        def __init__(self, addr: str) -> None:
            self.addr = addr

        def get(self, key: str) -> str:
            assert key == "Peer-Address"
            return self.addr

    assert peer_of(Frame("localhost:1001:100:4242")) == Peer(1001, 100, 4242)
    assert peer_of(Frame(":0:0:1")) == Peer(0, 0, 1)
    assert peer_of(Frame("localhost")) is None
    # no credentials: refused in node mode, never in single-user mode
    fields = {"token": "ab", "bytes": 1}
    assert "cannot tell who" in Tenancy(True).check("admit", fields, None, lambda t: set())
    assert Tenancy(False).check("admit", fields, None, lambda t: {5}) is None


# ------------------------------------------------------ two users, one daemon


@pytest.mark.timeout(90)
def test_one_root_daemon_serves_two_users(daemons: Daemons) -> None:  # noqa: F811
    a_uid, b_uid = free_uids()
    os.chmod(daemons.dir, 0o755)  # the users reach the socket through it
    path = os.path.join(daemons.dir, "c.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = tempfile.mkdtemp(prefix="shmlrt-", dir="/tmp")  # a /tmp of its own: 1777
    os.chmod(base, 0o1777)
    try:
        _two_users(daemons, path, port, base, a_uid, b_uid)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _two_users(daemons: Daemons, path: str, port: int, base: str, a_uid: int, b_uid: int) -> None:  # noqa: F811
    with users(path, a_uid, b_uid, b_uid) as (a, b, b_gone):
        # -- gc before any daemon runs: a user's gc leaves the other's leftovers alone
        a_gone = User(a_uid, path)
        try:
            a_left = a_gone.call("leftover", new_token())
            a_dir = a_gone.call("rundir", base)
            a_gone.exit()
        finally:
            a_gone.close()
        b_token = new_token()
        b_left = b_gone.call("leftover", b_token)
        b_left2 = b_gone.call("leftover", new_token())
        b_gone.exit()
        assert exists(a_left) and exists(b_left) and exists(b_left2)
        # a daemon started by a user serves that user only, as before
        assert a.call("own_daemon", base) == {"tenants": False, "socket_mode": 0o600}

        freed = a.call("gc")
        assert [i["name"] for i in freed if i["type"] == "segment"] == [a_left], freed
        assert not exists(a_left) and exists(b_left) and exists(b_left2)
        # root's gc (scoped to one job so that it touches nothing else on the node)
        root = admin.collect_garbage(tokens={b_token}, every_uid=True)
        assert [(i["name"], i["uid"]) for i in root] == [(b_left, b_uid)]
        assert not exists(b_left) and exists(b_left2)
        left2_bytes = human_bytes(os.stat(shm_path(b_left2)).st_size)

        # -- the root daemon in node mode (root's default; the fixture asks for it explicitly)
        d = daemons.start(
            "--tenants", "--budget", "32M", "--reap-interval", "0.2", "--uid-budget", f"{a_uid}=4M",
            "--pool", "1100K", "--pool-segment", "1M", "--metrics-port", str(port),
            env={"SHMLOADER_RUNTIME_DIR": base},
        )  # fmt: skip
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
        assert stat.S_IMODE(os.stat(daemons.dir).st_mode) == 0o755
        # every user's dead leftovers are reaped, and logged with uid and bytes
        wait_until(lambda: not exists(b_left2), 5, f"{b_left2} of uid {b_uid} reaped")
        assert f"reaped {b_left2} (data, {left2_bytes}, uid {b_uid}" in d.output()
        wait_until(lambda: not os.path.exists(a_dir), 5, f"{a_dir} of uid {a_uid} reaped")

        ra, rb = a.call("ring", [1]), b.call("ring", [1])
        ta, tb = ra["token"], rb["token"]

        # -- stat: each user sees its own job in full, the rest as totals; root sees all
        sa, sb = a.call("stats"), b.call("stats")
        assert [j["token"] for j in sa["jobs"]] == [ta] and sa["jobs"][0]["uid"] == a_uid
        assert [j["token"] for j in sb["jobs"]] == [tb] and sb["jobs"][0]["uid"] == b_uid
        assert sa["others"]["jobs"] >= 1 and sa["others"]["bytes"] >= 100_000
        assert tb not in json.dumps(sa) and ta not in json.dumps(sb)
        assert list(sa["daemon"]["uids"]) == [str(a_uid)]
        assert sa["daemon"]["uids"][str(a_uid)]["budget_bytes"] == 4 << 20
        full = d.stats()
        owners = {j["token"]: j["uid"] for j in full["jobs"]}
        assert owners[ta] == a_uid and owners[tb] == b_uid
        assert full["daemon"]["tenants"] is True
        assert {str(a_uid), str(b_uid)} <= set(full["daemon"]["uids"])
        table = admin.format_table(full)
        assert "USER" in table and str(a_uid) in table and str(b_uid) in table
        mine = admin.format_table(sa)
        assert "other users: " in mine and f"uid {a_uid} ({a_uid}): " in mine and tb not in mine

        # -- naming the other user's token or pid is refused, and logged
        for op, fields in (
            ("report", {"token": tb, "rank": 0, "consumed": 1}),
            ("adopt", {"token": tb, "name": f"/shml-{tb}-9.0.ab", "bytes": 1, "pid": a.pid,
                       "start": segment.proc_start_time(a.pid)}),
            ("register", {"token": tb, "group": [0], "pids": {"0": [a.pid, 0]}}),
            ("unregister", {"token": tb}),
            ("admit", {"token": tb, "bytes": 1}),
        ):  # fmt: skip
            reply = a.call("request", op, fields)
            assert not reply["ok"] and f"belongs to uid {b_uid}" in reply["error"], (op, reply)
        reply = a.call("request", "register", {"token": ta, "group": [0],
                                               "pids": {"0": [b.pid, 0]}})  # fmt: skip
        assert not reply["ok"] and f"pid {b.pid} belongs to uid {b_uid}" in reply["error"]
        assert f"refused 'report' from uid {a_uid}" in d.output()
        assert tb in {j["token"] for j in d.stats()["jobs"]}  # B's job untouched

        # -- a token claimed by B before its control segment existed goes to the segment's owner
        tc = new_token()
        claim = {"token": tc, "group": [0], "pids": {"0": [b.pid, 0]}}
        assert b.call("request", "register", claim)["ok"]
        assert {j["token"]: j["uid"] for j in d.stats()["jobs"]}[tc] == b_uid
        rc = a.call("ring", [1], tc)  # A's ring: its control segment is A's
        job = next(j for j in d.stats()["jobs"] if j["token"] == tc)
        assert job["uid"] == a_uid and job["registered"] and job["job"] == f"job-of-{a_uid}"
        reply = b.call("request", "report", {"token": tc, "rank": 0, "consumed": 1})
        assert not reply["ok"] and f"belongs to uid {a_uid}" in reply["error"]
        assert "the claim is dropped" in d.output()

        # -- a control segment B plants under A's token takes nothing from A
        planted = b.call("plant_control", ta)
        time.sleep(0.5)  # reaper passes see both control segments
        assert a.call("request", "report", {"token": ta, "rank": 0, "consumed": 1})["ok"]
        reply = b.call("request", "report", {"token": ta, "rank": 0, "consumed": 1})
        assert not reply["ok"] and f"belongs to uid {a_uid}" in reply["error"]
        assert {j["token"]: j["uid"] for j in d.stats()["jobs"]}[ta] == a_uid

        # -- per-uid budget: A is refused past its 4 MiB, B (no uid budget) admitted
        refused = a.call("admit", ta, 8 << 20)
        assert refused.startswith("refused") and f"budget of uid {a_uid}" in refused
        assert "4.0 MiB" in refused and tb not in refused, refused
        assert "but only 3." in refused, refused  # what is left of A's budget
        assert b.call("admit", tb, 8 << 20) == "granted"

        # -- the warm pool: a segment adopted by A is A's, 0600, before A maps it
        wait_until(lambda: d.stats()["daemon"]["pool_segments"] >= 1, 10, "pool filled")
        got = a.call("adopt", ta, f"/shml-{ta}-7.0.{os.urandom(4).hex()}", 4096)
        assert got == {"capacity": 1 << 20, "uid": a_uid, "mode": 0o600}

        # -- the node budget still caps the sum; its refusal shows B only totals of A's jobs
        refused = b.call("admit", tb, 64 << 20)
        assert "node budget" in refused and "job(s) of other users" in refused, refused
        assert ta not in refused and tc not in refused and tb in refused

        # -- metrics carry the uid (from the stats of the latest reaper pass)
        refused_key = (
            f'shmloaderd_uid_admissions_total{{result="refused",uid="{a_uid}",user="{a_uid}"}}'
        )
        wait_until(lambda: _metrics(port).get(refused_key) == 1, 3, "uid rows in the metrics", 0.1)
        values = _metrics(port)
        assert values[f'shmloaderd_uid_budget_bytes{{uid="{a_uid}",user="{a_uid}"}}'] == 4 << 20
        assert values[f'shmloaderd_uid_reaped_bytes_total{{uid="{b_uid}",user="{b_uid}"}}'] > 0

        # -- a SIGKILLed job of each user is reaped by the reaper (every 0.2 s): within
        # 100 passes on any machine; a reaper that skipped a user's jobs never reaps them
        names = ra["names"] + rb["names"] + rc["names"] + [planted]
        assert all(exists(n) for n in names) and len(names) >= 4
        a.kill()
        b.kill()
        wait_until(lambda: not any(exists(n) for n in names), 20.0, "both jobs reaped")
        log = d.output()
        for uid, token in ((a_uid, ta), (b_uid, tb)):  # uid, job name and bytes of each reap
            assert f"uid {uid} {uid}, job job-of-{uid} (ring {token})): owner pid" in log, log
    for name in (a_left, b_left, b_left2):
        assert not os.path.exists(shm_path(name))

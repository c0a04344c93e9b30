"""Budgets that bind without a setting: a job finds the node's daemon by itself.

NOTE [finding the daemon] (``shmloader.config``): with ``SHMLOADER_DAEMON`` unset a
job asks the well-known socket, which ``SHMLOADER_RUNTIME_DIR`` moves (here: a
directory of the test's own, so no daemon of the machine is ever found); a job
that started before the daemon registers at its first call once the daemon
answers. NOTE [over budget] (``shmloaderd.document``): in node mode the daemon
marks every job of a uid over its budget, embedded or not, in ``stat``, the
metrics and its log. The node-mode test forks users as in
``test_daemon_tenants`` (root, two unused uids).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader
from shmloader._node import segment
from shmloader._node.ring import RingWriter, new_token
from shmloader._roles.stats import connect_daemon
from shmloader._transport import daemon_client
from shmloader._transport.daemon_client import DaemonClient
from shmloader.config import well_known_socket
from shmloader.errors import ShmCapacityError
from shmloader.tools import stat as stat_cli
from tests.daemon.test_daemon import Daemons, daemons, wait_until  # noqa: F401 (fixture)
from tests.daemon.test_daemon_tenants import _reaped, free_uids
from tests.support.harness import run_ranks

MIB = 1 << 20

# ------------------------------------------------------------ a user's child

_state: dict = {}  # in a user's child: its jobs, by name


def cmd_job(name: str, slots: int, nbytes: int) -> dict:
    """A job's ring as the loader makes it, asking the daemon the environment names
    (``connect_daemon(Config.from_env())``, the loader's own call): ``slots``
    batches of ``nbytes``, each admitted before it is made; stops at a refusal."""
    client = connect_daemon(Config.from_env())
    token = new_token()
    pid, start, ns = os.getpid(), segment.MY_START, segment.MY_PIDNS
    desc = {
        "token": token, "group": [0, 1], "leader": 0, "writer": 0, "node": [0, 1],
        "pids": {"0": [pid, start, ns]}, "world": 2, "job": name,
    }  # fmt: skip
    ring = RingWriter(token, frozenset([1]), desc, daemon=client)
    if client is not None:
        client.register(desc)
    _state[name] = {"ring": ring, "client": client, "token": token}
    return {
        "token": token,
        "client": None if client is None else client.state,
        **cmd_slots(name, slots, nbytes),
    }


def cmd_slots(name: str, slots: int, nbytes: int) -> dict:
    ring = _state[name]["ring"]
    made = 0
    try:
        for _ in range(slots):
            slot = ring.acquire(nbytes)
            ring.hold_for_readers(slot, made, nbytes, 1_000_000)
            made += 1
    except ShmCapacityError as exc:
        return {"made": made, "refused": str(exc)}
    return {"made": made, "refused": None}


def cmd_tick(name: str) -> str:
    """What the loader's reporter does once a second: one report; the client's state after."""
    job = _state[name]
    job["client"].report(job["token"], 0, published=1, role="leader")
    return job["client"].state


def cmd_close(name: str) -> None:
    job = _state.pop(name)
    if job["client"] is not None:
        job["client"].unregister(job["token"])
        job["client"].close()
    job["ring"].close()


def _serve(uid: int, environ: dict, rfd: int, wfd: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.environ.clear()
    os.environ.update(environ)
    # a backoff longer than the test: the late daemon must be asked at the first call
    # after its socket appears, not when a backoff elapsed (NOTE [finding the daemon])
    daemon_client.RETRY_FIRST_S = 600.0
    with os.fdopen(rfd) as commands, os.fdopen(wfd, "w") as answers:
        for line in commands:
            name, args = json.loads(line)
            try:
                result = {"ok": globals()[f"cmd_{name}"](*args)}
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            answers.write(json.dumps(result) + "\n")
            answers.flush()


class User:
    """A forked child acting as ``uid`` with ``environ``; ``call`` runs one ``cmd_*`` there."""

    def __init__(self, uid: int, environ: dict) -> None:
        self.uid = uid
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(down_w)
                os.close(up_r)
                _serve(uid, environ, down_r, up_w)
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

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self._out.close()
        self._in.close()


@contextlib.contextmanager
def users(*made: tuple[int, dict]) -> Iterator[list[User]]:
    out: list[User] = []
    try:
        for uid, environ in made:
            out.append(User(uid, environ))
        yield out
    finally:
        for u in out:
            u.close()


def _samples(port: int) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample the daemon's metrics show."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if m and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2] or ""))
            out.append((m[1], labels, float(m[3])))
    return out


def _value(port: int, name: str, **labels: str) -> float | None:
    for n, got, value in _samples(port):
        if n == name and all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


def _shows(port: int, want: float, name: str, **labels: str) -> None:
    """Wait for the metrics (the latest reaper pass's, 0.1 s apart) to show ``want``."""
    wait_until(lambda: _value(port, name, **labels) == want, 10, f"{name}{labels} == {want}", 0.1)


def _job(doc: dict, token: str) -> dict | None:
    return next((j for j in doc["jobs"] if j["token"] == token), None)


# ------------------------------------------------------ node mode, two users


@pytest.mark.timeout(120)
def test_a_node_daemon_budgets_jobs_that_set_no_variable(daemons: Daemons, monkeypatch) -> None:  # noqa: F811
    """Two users, no ``SHMLOADER_DAEMON``. B's job starts before the daemon and takes
    2 MiB against B's 1 MiB budget unchecked; at its first call after the daemon
    answers it registers, and the daemon marks it over budget (stat, metrics, log)
    and refuses its next slot. A's job, started after the daemon, registers at
    once and is refused past A's budget; A's embedded job (``SHMLOADER_DAEMON=off``)
    over A's budget is marked too. Every refusal's reason is in ``stat --json``
    and in the labelled counter."""
    a_uid, b_uid = free_uids()
    os.chmod(daemons.dir, 0o755)  # the users reach the socket through it
    monkeypatch.delenv("SHMLOADER_DAEMON", raising=False)
    monkeypatch.setenv("SHMLOADER_RUNTIME_DIR", daemons.dir)  # moves the well-known socket
    path = well_known_socket()
    assert path == os.path.join(daemons.dir, "shmloader", "control.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    with users((a_uid, env), (b_uid, env), (a_uid, {**env, "SHMLOADER_DAEMON": "off"})) as (
        a,
        b,
        a_off,
    ):
        # -- B's job before any daemon: embedded, its client kept (DOWN), 2 MiB unchecked
        early = b.call("job", "b-early", 2, MIB)
        assert early["client"] == DaemonClient.DOWN and early["made"] == 2, early
        assert b.call("tick", "b-early") == DaemonClient.DOWN  # no socket yet: no wait
        d = daemons.start(
            "--tenants",
            "--reap-interval",
            "0.1",
            "--uid-budget",
            f"{a_uid}=3M",
            "--uid-budget",
            f"{b_uid}=1M",
            "--metrics-addr",
            f"127.0.0.1:{port}",
            name="shmloader/control.sock",
        )
        assert d.path == path
        assert f"uid budgets {a_uid} (" in d.output() and f"{b_uid} (" in d.output()
        # -- the daemon answers: B's next call registers the ring (the backoff is 600 s)
        assert b.call("tick", "b-early") == DaemonClient.UP
        job = _job(d.stats(), early["token"])
        assert job is not None and job["registered"] and job["uid"] == b_uid, job
        wait_until(
            lambda: (_job(d.stats(), early["token"]) or {}).get("over_budget"),
            10,
            "B's early job marked over its uid's budget",
            0.1,
        )
        row = d.stats()["daemon"]["uids"][str(b_uid)]
        assert row["over_budget"] and row["over_budget_bytes"] > 0, row
        _shows(port, 1, "shmloaderd_uid_over_budget", uid=str(b_uid))
        _shows(port, 1, "shmloaderd_job_over_budget", token=early["token"])
        assert f"(ring {early['token']}) of uid {b_uid}" in d.output()
        assert "is over its uid's budget" in d.output()
        # its next slot is refused: the uid's budget binds from now on
        more = b.call("slots", "b-early", 1, MIB)
        assert more["made"] == 0 and f"budget of uid {b_uid}" in more["refused"], more
        # -- A, after the daemon, no variable: registered at once, refused past 3 MiB
        a_job = a.call("job", "a-late", 3, MIB)
        assert a_job["client"] == DaemonClient.UP, a_job
        assert 1 <= a_job["made"] < 3 and f"budget of uid {a_uid}" in a_job["refused"], a_job
        assert _job(d.stats(), a_job["token"])["registered"]
        assert not _job(d.stats(), a_job["token"])["over_budget"]  # refused, not over
        # -- A's embedded job: never asks, yet counted: A is over, both its jobs marked
        off = a_off.call("job", "a-off", 2, MIB)
        assert off["client"] is None and off["made"] == 2, off
        wait_until(
            lambda: (_job(d.stats(), off["token"]) or {}).get("over_budget"),
            10,
            "A's embedded job marked over its uid's budget",
            0.1,
        )
        doc = d.stats()
        assert not _job(doc, off["token"])["registered"]
        assert _job(doc, a_job["token"])["over_budget"]
        _shows(port, 1, "shmloaderd_uid_over_budget", uid=str(a_uid))
        assert f"(ring {off['token']}) of uid {a_uid}" in d.output()
        assert "not registered: it runs embedded" in d.output()
        # -- the last refusal of each uid, with its reason, where an operator looks
        for uid in (a_uid, b_uid):
            last = doc["daemon"]["uids"][str(uid)]["last_refusal"]
            assert last["reason"] == "uid_budget" and str(uid) in last["message"], last
            assert doc["daemon"]["uids"][str(uid)]["refusals"] == {"uid_budget": 1}
            _shows(port, 1, "shmloaderd_uid_refusals_total", uid=str(uid), reason="uid_budget")
        # root's table shows the marks
        table = stat_cli.format_table(doc)
        assert "OVER BUDGET" in table and "last refusal (uid_budget)" in table, table
        # -- A's embedded job ends: A is within its budget again, and says so
        a_off.call("close", "a-off")
        wait_until(
            lambda: not _job(d.stats(), a_job["token"])["over_budget"],
            10,
            "A back within its budget",
            0.1,
        )
        _shows(port, 0, "shmloaderd_uid_over_budget", uid=str(a_uid))
        assert f"(ring {a_job['token']}) of uid {a_uid} is within its uid's budget" in d.output()
    _reaped(a_uid, b_uid)


# ------------------------------------------------- a real job before its daemon


class _Steady:
    """Small batches, 20 ms each to make: a job that keeps running while the test acts."""

    def __len__(self) -> int:
        return 1500

    def __iter__(self):
        for i in range(1500):
            time.sleep(0.02)
            yield {"x": torch.full((256,), i)}


def late_daemon_job(rank: int, world: int, log: str) -> dict:
    """Rank 0 starts ``shmloaderd`` (its default socket: the well-known one) after the
    job's third batch; every rank goes on until the daemon lists the ring as
    registered, or the data runs out."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        loader = ShmLoader(_Steady, dist.group.WORLD, config=Config.from_env(enabled=True))
        batches = iter(loader)
        next(batches)
    token = loader.topology.ring_token
    path = well_known_socket()
    proc, registered, after = None, None, 0
    done = torch.zeros(1)
    try:
        for i, _ in enumerate(batches):
            if rank == 0 and i == 2:
                assert not os.path.exists(path), path
                with open(log, "w") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "shmloaderd", "--single-user"],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
            if rank == 0 and proc is not None:
                after += 1
                if os.path.exists(path):
                    with DaemonClient(path, timeout=1.0) as client:
                        doc = client.stats()
                    job = None if doc is None else _job(doc, token)
                    if job is not None and job["registered"]:
                        registered = job
                        done[0] = 1
            dist.broadcast(done, 0)
            if done[0]:
                break
    finally:
        loader.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    return {"banner": err.getvalue(), "registered": registered, "after": after, "path": path}


@pytest.mark.timeout(120)
def test_a_job_started_before_its_daemon_registers_once_it_answers(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("SHMLOADER_DAEMON", raising=False)
    log = str(tmp_path / "shmloaderd.log")
    try:
        out = run_ranks(late_daemon_job, 2, kwargs={"log": log}, env={"SHMLOADER": "1"})
        with open(log) as f:
            daemon_log = f.read()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(log)
    first = out[0]
    path = first["path"]
    assert f"embedded (no daemon at {path}; one started later is joined)" in first["banner"]
    job = first["registered"]
    # within the job's data (1500 batches of 20 ms): the reporter's next call after the
    # daemon answered registered the ring
    assert job is not None, f"never registered:\n{daemon_log}"
    assert job["job"] == os.environ["SHMLOADER_JOB"] and job["group"] == [0, 1]
    assert f"serving {path}" in daemon_log


# ------------------------------------------------------------- small pieces


@pytest.mark.timeout(30)
def test_no_daemon_at_the_well_known_socket_costs_no_wait_and_says_nothing(
    monkeypatch, tmp_path, caplog
) -> None:
    """NOTE [finding the daemon]: the usual node without a daemon is silent; a socket
    someone named, or a well-known one nobody answers on, is said once."""
    monkeypatch.delenv("SHMLOADER_DAEMON", raising=False)
    monkeypatch.setenv("SHMLOADER_RUNTIME_DIR", str(tmp_path))
    daemon_client._warned.clear()
    quiet = connect_daemon(Config.from_env())
    assert quiet is not None and quiet.state == DaemonClient.DOWN
    quiet.admit("ab", 1 << 20)  # granted blindly, nothing to say
    quiet.close()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    monkeypatch.setenv("SHMLOADER_DAEMON", str(tmp_path / "named.sock"))
    named = connect_daemon(Config.from_env())
    assert named is not None and named.state == DaemonClient.DOWN
    named.close()
    assert "does not answer; running embedded and registering once it answers" in caplog.text
    monkeypatch.setenv("SHMLOADER_DAEMON", "off")
    assert connect_daemon(Config.from_env()) is None


@pytest.mark.timeout(60)
def test_json_log_lines(daemons: Daemons) -> None:  # noqa: F811
    d = daemons.start("--log-format", "json")
    first = json.loads(d.output().splitlines()[0])
    assert {"time", "level", "logger", "pid", "message"} <= set(first)
    serving = [json.loads(line) for line in d.output().splitlines() if "serving" in line]
    assert serving and serving[0]["level"] == "INFO" and d.path in serving[0]["message"]

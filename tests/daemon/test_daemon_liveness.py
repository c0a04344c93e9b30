"""The daemon's liveness rule for a job: alive while any of its processes lives."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import secrets

import pytest
from shmloaderd import protocol
from shmloaderd.registry import Job, Registry
from shmloaderd.warm import WarmSegments

from shmloader._node import segment
from shmloader._node.inventory import inspect
from shmloader._node.ring import control_stem, new_token
from shmloader._node.segment import (
    KIND_CONTROL,
    Segment,
    owner_alive,
    proc_start_time,
    read_header,
    unlink_name,
)

pytestmark = pytest.mark.timeout(60)


def _dead_pid() -> tuple[int, int]:
    p = mp.get_context("fork").Process(target=os._exit, args=(0,))
    p.start()
    start = proc_start_time(p.pid) or 1
    p.join()
    return p.pid, start


def test_a_job_stays_alive_while_any_of_its_pids_lives() -> None:
    dead = _dead_pid()
    me = (os.getpid(), proc_start_time(os.getpid()))
    job = Job("feedfacecafebeef", pids={0: dead, 1: me})
    assert job.alive() is True, "one live rank keeps the job"
    registry = Registry(lambda: None)
    registry.jobs[job.key] = job
    registry.observe([])
    assert job.key in registry.jobs, "a job with a live rank must not be dropped"
    job.pids[1] = _dead_pid()
    assert job.alive() is False
    registry.observe([])
    assert job.key not in registry.jobs


# ------------------------------------------------------- NOTE [pid namespaces]


def _foreign_ns() -> int:
    return segment.MY_PIDNS + 1  # an inode that is not our pid namespace


def _control_of_another_namespace(token: str, pid: int, start: int) -> Segment:
    """A live job's control segment, written by a process of another pid namespace."""
    seg = Segment.create_unique(control_stem(token), KIND_CONTROL, token, 4096)
    header = dataclasses.replace(seg.header, pid=pid, start=start, pidns=_foreign_ns())
    header.write(seg.fd)
    seg.header = header
    return seg


def test_a_job_of_another_pid_namespace_is_never_called_dead() -> None:
    """Its pids mean nothing here: the job stays (and counts against the budget)
    while its ring lives, and goes when its control segment goes."""
    pid, start = _dead_pid()  # no such process here: it runs in its own namespace
    token = new_token()
    _, fields = protocol.parse(
        json.dumps(
            {"v": 1, "op": "register", "token": token, "group": [0, 1],
             "pids": {"0": [pid, start, _foreign_ns()], "1": [pid + 1, start, _foreign_ns()]}}
        ).encode()
    )  # fmt: skip
    assert fields["pids"] == {0: (pid, start), 1: (pid + 1, start)}
    registry = Registry(lambda: None)
    registry.register(fields)
    assert registry.find(token).alive() is None, "a pid of another namespace was judged here"
    seg = _control_of_another_namespace(token, pid, start)
    try:
        for _ in range(2):
            entry = inspect(seg.name)
            assert entry is not None and entry.alive
            registry.observe([entry])
            assert registry.find(token) is not None, (
                "a live job of another pid namespace was dropped"
            )
        assert registry.in_use() >= seg.capacity, "its bytes stopped counting"
    finally:
        seg.unlink()
        seg.close()
    registry.observe([])
    assert registry.find(token) is None, "a closed ring of another namespace was kept"


def test_a_discovered_job_takes_the_namespace_of_its_writer() -> None:
    """A job found by its control segment (after a daemon restart), pids from
    its description without namespaces (older writers): the header's namespace
    applies."""
    pid, start = _dead_pid()
    token = new_token()
    seg = _control_of_another_namespace(token, pid, start)
    try:
        registry = Registry(lambda: None)
        entry = inspect(seg.name)
        assert entry is not None
        entry.description = {"group": [0], "node": [0], "pids": {"0": [pid, start]}}
        registry.observe([entry])
        registry.observe([entry])
        assert registry.find(token) is not None and registry.find(token).pids == {0: (pid, start)}
    finally:
        seg.unlink()
        seg.close()


def test_a_job_of_our_namespace_still_ends_with_its_processes() -> None:
    """The namespace rule must not keep dead jobs of our own namespace."""
    pid, start = _dead_pid()
    job = Job(new_token(), pids={0: (pid, start)})
    job.note_namespace(pid, start, segment.MY_PIDNS)
    assert job.alive() is False
    job.note_namespace(pid, start, _foreign_ns())
    assert job.alive() is None


def test_warm_pool_adoption_stamps_the_adopters_namespace(no_leaks) -> None:
    """An adopted segment names its new owner's pid namespace: no reaper of
    another namespace may judge it by its pid (before, the header said 0)."""
    pool = WarmSegments(8 << 20, 1 << 20)
    try:
        assert pool.refill(None)
        token = new_token()
        name = f"/shml-{token}-0.0.{secrets.token_hex(8)}"
        reply = pool.adopt(token, name, 4096, os.getpid(), segment.MY_START)
        assert reply["adopted"], reply
        assert read_header(name).pidns == segment.MY_PIDNS
        unlink_name(name)
        # a client of another namespace: its pid cannot be checked here, its header says so
        pid, start = _dead_pid()
        assert pool.refill(None)
        name = f"/shml-{token}-1.0.{secrets.token_hex(8)}"
        reply = pool.adopt(token, name, 4096, pid, start, _foreign_ns())
        assert reply["adopted"], reply
        header = read_header(name)
        assert (header.pid, header.pidns) == (pid, _foreign_ns())
        assert owner_alive(header), "a reaper would remove a live foreign job's slot"
        unlink_name(name)
        # ... while a dead pid of our own namespace is still refused
        assert pool.refill(None)
        refused = pool.adopt(token, f"/shml-{token}-2.0.ab", 4096, pid, start, segment.MY_PIDNS)
        assert not refused["ok"] and "not running" in refused["error"]
    finally:
        pool.close()


# ------------------------------------------------- NOTE [dead jobs stay visible]


def test_a_dead_job_stays_on_record_for_a_while_and_the_record_is_bounded(monkeypatch) -> None:
    from shmloaderd import registry as registry_module

    registry = Registry(lambda: None)
    dead = Job("deadbeef00000001", pids={0: _dead_pid()}, name="train-x")
    closed = Job("c105ed0000000001", pids={0: (os.getpid(), proc_start_time(os.getpid()))})
    closed.ctl_seen = True  # its control segment was seen and is gone: closed in order
    registry.jobs = {dead.key: dead, closed.key: closed}
    registry.observe([], {dead.key: (2, 8192)})
    assert not registry.jobs
    assert set(registry.ended) == {dead.key}, "an orderly close leaves no dead record"
    rec = registry.ended[dead.key]
    assert (rec.reaped_segments, rec.reaped_bytes, rec.job.name) == (2, 8192, "train-x")
    registry.forget_ended(rec.unix + registry_module.ENDED_KEEP_S - 1)
    assert dead.key in registry.ended
    registry.forget_ended(rec.unix + registry_module.ENDED_KEEP_S + 1)
    assert not registry.ended
    monkeypatch.setattr(registry_module, "MAX_ENDED", 3)
    for i in range(5):
        registry.record_end(Job(f"{i:016x}", uid=registry.me), "its processes died", 0, 0)
    assert [t for _, t in registry.ended] == [f"{i:016x}" for i in (2, 3, 4)]  # the oldest go first
    registry.job(f"{4:016x}")  # the same token alive again
    assert (registry.me, f"{4:016x}") not in registry.ended

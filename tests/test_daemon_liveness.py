"""The daemon's liveness rule for a job: alive while any of its processes lives."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from shmloaderd.registry import Job, Registry

from shmloader.segment import proc_start_time

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
    registry.jobs[job.token] = job
    registry.observe([])
    assert job.token in registry.jobs, "a job with a live rank must not be dropped"
    job.pids[1] = _dead_pid()
    assert job.alive() is False
    registry.observe([])
    assert job.token not in registry.jobs

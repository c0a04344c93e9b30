"""The leak check judges only what this run made (NOTE [only our own segments] in conftest).

Another run (or a job) on the same node leaves segments of a dead owner in
/dev/shm: this run must neither count them as its leak nor remove them; its
own dead leftovers must still count. Judged on headers (a real dead
segment would be reaped at once by any daemon running on the node).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from shmloader._node.ring import RingWriter, new_token
from shmloader._node.segment import KIND_CONTROL, KIND_DATA, MY_START, Header, proc_start_time
from tests.conftest import RUN_JOB, judge, run_jobs


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _header(kind: int, token: str, pid: int, start: int) -> Header:
    return Header(kind, os.geteuid(), token, pid, start, 8192, 0)


@pytest.mark.timeout(20)
def test_only_this_runs_segments_are_judged() -> None:
    assert os.environ["SHMLOADER_JOB"] == RUN_JOB  # every ring this run makes says so
    dead = _dead_pid()
    mine, other, unknown = new_token(), new_token(), new_token()
    jobs = {mine: RUN_JOB, other: "pytest-1-feedface"}  # another run of the suite
    for kind in (KIND_CONTROL, KIND_DATA):
        assert judge(_header(kind, mine, dead, MY_START), jobs), "our dead leftover escaped"
        assert not judge(_header(kind, other, dead, MY_START), jobs), "another run's counted"
        assert not judge(_header(kind, unknown, dead, MY_START), jobs), "a stranger's counted"
    assert not judge(None, jobs), "an unreadable header counted as ours"
    # live owners: ours when they descend from this process, whatever the job says
    assert judge(_header(KIND_DATA, other, os.getpid(), MY_START), jobs)
    init = _header(KIND_DATA, mine, 1, proc_start_time(1) or 0)
    assert not judge(init, jobs), "a live process outside this run counted as ours"


@pytest.mark.timeout(20)
def test_run_jobs_reads_the_job_of_every_ring() -> None:
    token = new_token()
    ring = RingWriter(token, frozenset(), {"token": token, "job": RUN_JOB, "pids": {}})
    try:
        assert run_jobs()[token] == RUN_JOB
    finally:
        ring.close()

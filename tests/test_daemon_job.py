"""A real multi-rank job against a real daemon: registration, stat, daemon death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from shmloader import Config, ShmLoader
from tests import ranks
from tests.harness import run_ranks
from tests.test_daemon import daemons  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(120)


def job(rank: int, world: int, *, kill_daemon: int | None) -> dict:
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=16), dist.group.WORLD, config=Config.from_env(enabled=True)
    )
    seen, stat = [], None
    for i, batch in enumerate(loader):
        seen.append(ranks.to_plain(batch))
        if i == 2:
            if rank == 0 and kill_daemon is not None:
                os.kill(kill_daemon, signal.SIGKILL)
            elif rank == 0:
                out = subprocess.run(
                    [sys.executable, "-m", "shmloader", "stat", "--json"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                )
                stat = json.loads(out.stdout)
        dist.barrier()
    token = loader.topology.ring_token
    loader.close()
    return {"seen": seen, "stat": stat, "token": token, "role": loader.role}


def test_stat_json_during_a_live_job_comes_from_the_daemon(daemons):  # noqa: F811
    d = daemons.start()
    out = run_ranks(
        job, 3, kwargs={"kill_daemon": None}, env={"SHMLOADER": "1", "SHMLOADER_DAEMON": d.path}
    )
    stat = out[0]["stat"]
    assert stat["schema"] == 2 and stat["source"] == "daemon"
    jobs = {j["token"]: j for j in stat["jobs"]}
    mine = jobs[out[0]["token"]]
    assert mine["registered"] and mine["writer_alive"] and mine["state"] == "live"
    assert mine["group"] == [0, 1, 2] and mine["readers"] == 2
    assert mine["published"] >= 3 and mine["ring_bytes"] > 0
    followers = mine["followers"]
    assert {"1", "2"} <= set(followers)
    assert all(isinstance(followers[r]["consumed"], int) for r in ("1", "2"))  # reported 1/s
    # after the job: unregistered, nothing left
    after = {j["token"] for j in d.stats()["jobs"]}
    assert out[0]["token"] not in after


def test_daemon_killed_mid_job_never_breaks_the_job(daemons):  # noqa: F811
    d = daemons.start()
    out = run_ranks(
        job,
        3,
        kwargs={"kill_daemon": d.proc.pid},
        env={"SHMLOADER": "1", "SHMLOADER_DAEMON": d.path},
    )
    d.proc.wait(5)
    assert d.proc.returncode == -signal.SIGKILL
    lengths = {len(o["seen"]) for o in out}
    assert lengths == {8}, "every rank got every batch after the daemon died"
    for a, b in zip(out[0]["seen"], out[1]["seen"], strict=True):
        assert a["meta"] == b["meta"]

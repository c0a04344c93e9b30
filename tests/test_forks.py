"""No test forks from a multi-threaded process (Python 3.12 warns: the child may deadlock).

DataLoader workers and ``multiprocessing`` children without an explicit
context start by the default method, fork on Linux before Python 3.14. The
pytest process runs ZeroMQ threads once an in-process test made a socket, and
a rank runs gloo and ZeroMQ threads before its loader starts workers. The
harness makes forkserver the default in both (``harness.fork_safe_workers``,
from ``conftest.pytest_configure`` and from every rank), with torch preloaded
in the server so a worker starts about as fast as a fork.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch.distributed as dist
import zmq

from shmloader import Config, ShmLoader
from tests import ranks
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _load_recording_forks(make) -> dict:
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(_threads()))
    threads = _threads()
    seen = sum(1 for _ in make())
    return {"forks": forks, "seen": seen, "threads": threads, "method": mp.get_start_method()}


def forks_while_loading(rank: int, world: int) -> dict:
    loader = ShmLoader(
        ranks.make_loader_factory(2, n=8), dist.group.WORLD, config=Config.from_env(enabled=False)
    )
    try:
        return _load_recording_forks(lambda: loader)
    finally:
        loader.close()


def test_dataloader_workers_never_fork_a_threaded_process() -> None:
    ctx = zmq.Context()  # what an in-process test leaves behind: an I/O thread
    ctx.socket(zmq.PAIR).close()
    try:
        here = _load_recording_forks(ranks.make_loader_factory(2, n=8))
    finally:
        ctx.term()
    assert here["seen"] == 4 and here["threads"] > 1
    assert here["forks"] == [], f"the test process forked with {here['forks']} threads"

    for rank, o in enumerate(run_ranks(forks_while_loading, 2)):
        assert o["seen"] == 4 and o["threads"] > 1
        assert o["method"] == "forkserver", f"rank {rank} starts workers by {o['method']}"
        assert o["forks"] == [], f"rank {rank} forked with {o['forks']} threads"

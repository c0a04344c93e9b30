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

import gc
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


# ------------------------------------------------- descriptors in forked children


def _shml_descriptors(pid: int | str) -> list[str]:
    """Targets of ``pid``'s open descriptors that are shmloader segments."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if "/shml-" in target:
            found.append(target)
    return found


def _holders(pid: int | str, name: str) -> int:
    """How many descriptors and mappings of ``pid`` refer to segment ``name``."""
    stem = name.lstrip("/")
    with open(f"/proc/{pid}/maps") as f:
        mapped = sum(stem in line for line in f)
    return mapped + sum(stem in t for t in _shml_descriptors(pid))


@pytest.mark.timeout(30)
def test_a_forked_child_holds_no_segment_descriptor_and_retired_slots_are_freed() -> None:
    """NOTE [no inherited descriptors] (segment): neither a ``Segment``'s own
    descriptor nor the duplicate a mapping would keep reaches a forked child,
    so a slot the parent retires while the child lives is held by nobody."""
    from shmloader import segment
    from shmloader.ring import RingReader, RingWriter, new_token
    from shmloader.segment import KIND_DATA, Segment

    token = new_token()
    w = RingWriter(token, frozenset({1}), {"job": "t"})
    r = RingReader(token)
    rfd, wfd = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = orphan_fd = -1
    try:
        slot = w.acquire(1 << 20)
        name = slot.segment.name
        r.open(name)
        view = r.view(name, 1 << 20, lambda: None)  # a reader's batch, alive at the fork
        # a segment dropped without close(): its descriptor stays open, held by nobody
        dropped = Segment.create_unique(f"/shml-{token}-dropped", KIND_DATA, token, 4096)
        orphan_fd, orphan_name = dropped.fd, dropped.name
        del dropped
        gc.collect()
        assert _shml_descriptors("self"), "the parent holds its segments open"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child: lives on until told
            os.write(ready_w, b"r")  # the fork handlers have run by now
            os.read(rfd, 1)
            os._exit(0)
        assert os.read(ready_r, 1) == b"r"
        assert _shml_descriptors(pid) == [], "a forked child holds segment descriptors"
        # The parent retires the slot (grows it) and drops the batch: with no
        # holder left anywhere, the kernel frees the slot's memory now.
        slot.state = type(slot.state).FREE
        w.acquire(4 << 20)  # too big for the free slot: it is replaced
        assert w.slots[0].segment.name != name
        r.forget(name)
        del view
        assert _holders("self", name) == 0
        assert _holders(pid, name) == 0, "the child still pins the retired slot"
        assert _shml_descriptors(pid) == []
    finally:
        os.write(wfd, b"x")
        for fd in (rfd, wfd, ready_r, ready_w):
            os.close(fd)
        if pid > 0:
            os.waitpid(pid, 0)
        if orphan_fd >= 0:
            os.close(orphan_fd)
            segment.unlink_name(orphan_name)
        r.close()
        w.close()

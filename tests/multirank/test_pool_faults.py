"""The worker pool with real processes: a leader killed while a DataLoader
worker waits for a slot, one DataLoader for two ShmLoaders, slots of abandoned
iterators, and the daemon's admission for what workers grow.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from shmloader._workers.collate import WorkerFailure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The pool timeout of WAITING_LEADER (its ``timeout=300.0``): a worker that
#: outlived its leader by a tenth of it was not ended by its liveness check
#: (every 0.2 s) but by something slower, or by nothing.
POOL_TIMEOUT_S = 300.0

#: A leader whose only worker filled every slot of its partition (the
#: SlotRefs are kept, so nothing is ever freed) and now waits in claim(),
#: with a pool timeout far longer than the test.
WAITING_LEADER = r"""
import time
from torch.utils.data import DataLoader
from shmloader._workers.pool import WorkerPool
from shmloader._node.ring import RingWriter, new_token
from shmloader._workers.collate import install
from tests.multirank.test_worker_writer import Sized

loader = DataLoader(Sized(64, grow=False), batch_size=2, num_workers=1,
                    multiprocessing_context="fork")
ring = RingWriter(new_token(), frozenset(), {"test": True}, self_rank=0)
pool = WorkerPool(ring, num_workers=1, prefetch_factor=2, ring_slots=2, timeout=300.0,
                  allow_pickle=False)
install(loader, pool)
it = iter(loader)
held = [next(it) for _ in range(pool.spec.per_worker)]
time.sleep(0.5)  # the worker collates the next batch: no EMPTY slot
states = {pool.state(i) for i in range(pool.spec.total)}
assert states == {"FILLED"}, states
print(ring.token, it._workers[0].pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return True
    return raw[raw.rindex(b")") + 2 :].split()[0] in (b"Z", b"X")


def _unlink_job(token: str) -> None:
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"shml-{token}"):
            os.unlink(os.path.join("/dev/shm", name))


@pytest.mark.timeout(120)
def test_a_worker_waiting_for_a_slot_exits_soon_after_its_leaders_death():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    leader = subprocess.Popen(
        [sys.executable, "-c", WAITING_LEADER], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    token = None
    try:
        line = leader.stdout.readline().split()
        assert len(line) == 2, f"the leader did not start: rc {leader.poll()}"
        token, worker = line[0], int(line[1])
        assert not _gone(worker)
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        # found by the worker's liveness check: long before its 300 s pool timeout
        bound = POOL_TIMEOUT_S / 10
        t0 = time.monotonic()
        while not _gone(worker) and time.monotonic() - t0 < bound:
            time.sleep(0.02)
        still = not _gone(worker)
        if still:
            os.kill(worker, signal.SIGKILL)
        assert not still, f"the worker outlived its leader by {bound:.0f} s (pool timeout 300 s)"
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        leader.stdout.close()
        if token is not None:
            _unlink_job(token)


def one_dataloader_two_shmloaders(rank: int, world: int) -> dict:
    """Two ShmLoaders over one DataLoader: at once (refused), then one after the other."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shmloader import Config, ShmLoader
    from tests.faults.scenarios import outcome
    from tests.multirank.test_worker_writer import Sized

    dl = DataLoader(
        Sized(8, grow=False),
        batch_size=2,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    config = Config.from_env(enabled=True)

    def build() -> ShmLoader:
        return ShmLoader(lambda: dl, dist.group.WORLD, config=config)

    def ids(loader: ShmLoader) -> list[int]:
        return [int(i) for batch in loader for i in batch["i"]]

    first = build()
    got = {"first": ids(first)}
    got["at_once"] = outcome(lambda: str(build()))
    got["first_again"] = ids(first)  # the refused one changed nothing
    first.close()
    second = build()
    got["second"] = ids(second)
    second.close()
    return got


def break_early_every_epoch(rank: int, world: int, epochs: int) -> dict:
    """Each epoch takes one batch and breaks: the workers' prefetched batches are
    FILLED in slots whose SlotRefs never reach the main process, and the workers
    are shut down with the iterator. The next iter() must reclaim those slots."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shmloader import Config, ShmLoader
    from tests.faults.scenarios import outcome
    from tests.multirank.test_worker_writer import Sized

    config = Config.from_env(enabled=True, timeout=6.0)

    def make() -> DataLoader:
        return DataLoader(
            Sized(64, grow=False), batch_size=2, num_workers=1, multiprocessing_context="fork"
        )

    loader = ShmLoader(make, dist.group.WORLD, config=config)

    def run() -> list[int]:
        firsts = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                firsts.append(int(batch["i"][0]))
                del batch
                break
        return firsts

    try:
        got = outcome(run)
        if loader.is_leader:
            pool = loader._role.pool
            got["stuck"] = [pool.state(i) for i in range(pool.spec.total)].count("FILLED")
            got["per_worker"] = pool.spec.per_worker
        return got
    finally:
        loader.close()


def two_pool_scenarios(rank: int, world: int, epochs: int) -> dict:
    """Both multi-rank pool scenarios in one launch (each builds its own loaders)."""
    return {
        "two": one_dataloader_two_shmloaders(rank, world),
        "breaks": break_early_every_epoch(rank, world, epochs),
    }


@pytest.mark.timeout(240)
def test_one_dataloader_for_two_shmloaders_and_slots_of_abandoned_iterators():
    """One launch of 2 ranks, two defects:

    - one DataLoader given to two ShmLoaders: at once is refused at
      construction on every rank, one after the other's close() works;
    - slots FILLED by the workers of an iterator abandoned mid-epoch (their
      SlotRefs never reach the main process) are reclaimed at the next iter().
    """
    from tests.support.harness import run_ranks

    epochs = 8
    out = run_ranks(two_pool_scenarios, 2, kwargs={"epochs": epochs}, timeout=200)
    for rank, got in enumerate(item["two"] for item in out):
        assert got["first"] == got["first_again"] == got["second"] == list(range(8)), got
        refused = got["at_once"]
        assert not refused["ok"], refused
        if rank == 0:
            assert refused["type"] == "LoaderStateError", refused
            assert "already published by another open ShmLoader" in refused["message"]
            assert "close() the other ShmLoader" in refused["message"]
        else:
            assert refused["type"] == "LeaderError", refused
            assert refused["attrs"]["original_type"] == "LoaderStateError", refused
    for got in (item["breaks"] for item in out):
        assert got["ok"], got
        assert got["value"] == [0] * epochs
    lead = out[0]["breaks"]
    # what the last epoch's worker left behind, never more: the rest came back
    assert lead["stuck"] < lead["per_worker"] - 1, lead


@pytest.fixture
def daemons():
    from tests.daemon.test_daemon import Daemons

    running = Daemons()
    try:
        yield running
    finally:
        running.close()


def _job_bytes(token: str) -> int:
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"shml-{token}"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join("/dev/shm", name)).st_size
    return total


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores
def test_workers_ask_the_daemon_before_they_grow_a_slot(daemons):
    """A 20 MiB daemon budget, 3 workers, 8 MiB batches (9 MiB slots): /dev/shm
    never holds more of the job than the budget, and the refusal reaches the
    leader as ShmCapacityError from the daemon."""
    import threading

    from torch.utils.data import DataLoader

    from shmloader._node.ring import RingWriter, new_token
    from shmloader._workers.collate import install
    from shmloader._workers.pool import WorkerPool
    from shmloader.errors import ShmCapacityError
    from tests.daemon.test_daemon import description

    budget = 20 << 20
    d = daemons.start("--budget", str(budget))

    def attempt() -> tuple[ShmCapacityError, int]:
        client = d.client()
        token = new_token()
        client.register(description(token))
        data = [torch.full((1 << 20,), float(i)) for i in range(12)]  # 4 MiB samples
        loader = DataLoader(data, batch_size=2, num_workers=3, multiprocessing_context="fork")
        ring = RingWriter(token, frozenset(), {"test": True}, self_rank=0, daemon=client)
        peak, stop = [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _job_bytes(token))
                time.sleep(0.002)

        watcher = threading.Thread(target=sample)
        watcher.start()
        pool = None
        try:
            pool = WorkerPool(
                ring, num_workers=3, prefetch_factor=2, ring_slots=2, timeout=30.0,
                allow_pickle=False, daemon=client,
            )  # fmt: skip
            assert install(loader, pool)
            it = iter(loader)
            with pytest.raises(ShmCapacityError) as info:
                for seq, ref in enumerate(it):
                    if isinstance(ref, WorkerFailure):
                        raise ref.exception()
                    # published and never released: each batch grows another slot
                    ring.hold_for_readers(pool.accept(ref), seq, ref.nbytes, 0)
            time.sleep(0.3)  # what the other workers do meanwhile counts too
            del it
        finally:
            stop.set()
            watcher.join()
            ring.close()
            if pool is not None:
                pool.close()
            # a next attempt must not find this one still counted against the node budget
            deadline = time.monotonic() + 10
            while _job_bytes(token) and time.monotonic() < deadline:
                time.sleep(0.05)
            with contextlib.suppress(Exception):
                client.unregister(token)
            client.close()
        return info.value, peak[0]

    # The node budget counts every job the daemon finds in /dev/shm: a refusal that names
    # another ring (another test's job, running beside this one) says nothing of ours
    for tries_left in (2, 1, 0):
        try:
            error, peak = attempt()
        except ShmCapacityError as refused:  # at the pool's construction: ours, or not
            error, peak = refused, 0
            if not tries_left or len(set(re.findall(r"ring ([0-9a-f]{16})", str(error)))) <= 1:
                raise
            continue
        if not tries_left or len(set(re.findall(r"ring ([0-9a-f]{16})", str(error)))) <= 1:
            break
    assert "shmloaderd" in str(error) and "--budget" in str(error), error
    assert peak <= budget, f"/dev/shm held {peak / 2**20:.1f} MiB of a 20 MiB budget"

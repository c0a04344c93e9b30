"""The worker writer: DataLoader workers write batches straight into pool slots.

Single-process tests drive a ``WorkerPool`` the way the leader does (accept,
publish, private view, release, sync) against a real DataLoader in every
multiprocessing context; multi-rank tests check delivery, faults and the
cross-node path through ``ShmLoader``.
"""

from __future__ import annotations

import os
import signal
import types

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from shmloader._node.ring import RingWriter, new_token
from shmloader._node.views import private_view
from shmloader._proto import codec
from shmloader._workers.collate import SlotCollate, WorkerFailure, install
from shmloader._workers.control import PoolState, per_worker_slots
from shmloader._workers.pool import WorkerPool
from shmloader.errors import ShmCapacityError, UnsupportedBatchError
from tests.multirank.test_sharing import assert_same
from tests.support.harness import run_ranks


class Sized(Dataset):
    """Samples whose size grows with the index, so slots must grow mid-epoch."""

    def __init__(self, n: int = 16, grow: bool = True) -> None:
        self.n, self.grow = n, grow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        length = 64 + ((i // 3) * 9000 if self.grow else 0)  # equal within a batch of 3
        return {"x": torch.randn(length, generator=g), "i": i, "seed_draw": torch.randint(9, (1,))}


class Stream(IterableDataset):
    """An iterable dataset split across workers by worker id."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, self.n, nw):
            size = 1000 * (1 + i // 4)  # equal within each worker's batch of 2
            yield {"x": torch.arange(size, dtype=torch.float64) + i, "rand": torch.rand(3)}


def custom_collate(samples):
    """A non-default collate: a dict of lists plus a numpy array."""
    return {
        "xs": [s["x"] * 2 for s in samples],
        "ids": np.array([s["i"] for s in samples]),
        "draws": torch.cat([s["seed_draw"] for s in samples]),
    }


def _loader(kind: str, context: str | None, persistent: bool = False, collate=None) -> DataLoader:
    if kind == "iterable":
        ds, kw = Stream(), {"batch_size": 2}
    else:  # a custom collate takes samples of any size: shuffle them
        ds, kw = Sized(), {"batch_size": 3, "shuffle": collate is not None}
    return DataLoader(
        ds,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=persistent,
        collate_fn=collate,
        generator=None,
        **kw,
    )


class Leader:
    """What ShmLoader's leader does with each SlotRef, minus the sockets."""

    def __init__(self, loader: DataLoader, slots: int = 2, collate_in_slot: bool = True) -> None:
        self.ring = RingWriter(new_token(), frozenset(), {"test": True}, self_rank=0)
        self.pool = WorkerPool(
            self.ring,
            num_workers=loader.num_workers,
            prefetch_factor=loader.prefetch_factor,
            ring_slots=slots,
            timeout=20.0,
            allow_pickle=False,
            collate_in_slot=collate_in_slot,
        )
        assert install(loader, self.pool)
        self.seq = 0

    def deliver(self, ref) -> object:
        if isinstance(ref, WorkerFailure):
            raise ref.exception()
        slot = self.pool.accept(ref)
        self.ring.hold_for_readers(slot, self.seq, ref.nbytes, 0)
        self.seq += 1
        released = []
        view = private_view(slot.segment, ref.nbytes, lambda: released.append(1))
        batch = codec.decode(ref.meta, view)
        out = _owned(batch)
        del batch, view
        assert released, "the private view must die with the batch"
        self.ring.release(0, slot.index, slot.gen)
        self.pool.sync()
        return out

    def close(self) -> None:
        self.ring.close()
        self.pool.close()


def _owned(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_owned(v) for v in obj]
    return obj


def _epochs(
    loader: DataLoader, leader: Leader | None, epochs: int = 2
) -> tuple[list, torch.Tensor]:
    torch.manual_seed(1234)
    out = []
    for _ in range(epochs):
        for item in loader:
            out.append(leader.deliver(item) if leader else item)
    return out, torch.get_rng_state()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind,context,persistent,collate",
    [
        ("map", "fork", False, None),
        ("map", "forkserver", True, custom_collate),
        ("map", "spawn", False, custom_collate),
        ("iterable", "spawn", True, None),
        ("iterable", "fork", False, None),
    ],
    ids=[
        "map-fork",
        "map-forkserver-persistent-custom",
        "map-spawn-custom",
        "iter-spawn-persistent",
        "iter-fork",
    ],
)
def test_worker_written_batches_equal_plain_dataloader_and_rng(kind, context, persistent, collate):
    if context == "forkserver":  # the server outlives the test: stop it (no_leaks counts it)
        import multiprocessing.forkserver as fs

        request_stop = fs._forkserver._stop
    else:
        request_stop = None
    try:
        _check_equal(kind, context, persistent, collate)
    finally:
        if request_stop is not None:
            request_stop()


#: The plain DataLoader the spawn cases are compared with: forked workers. A plain
#: DataLoader's batches and main-process RNG do not depend on how its workers start
#: (each worker is seeded from the main process's base seed), and spawn's cold
#: workers (a few seconds each on 2 cores) are the subject only with the pool.
PLAIN_CONTEXT = {"spawn": "fork"}


def _check_equal(kind, context, persistent, collate):
    reference = _loader(kind, PLAIN_CONTEXT.get(context, context), persistent, collate)
    plain, plain_rng = _epochs(reference, None)
    loader = _loader(kind, context, persistent, collate)
    leader = Leader(loader)
    try:
        got, rng = _epochs(loader, leader)
        grown = [s.gen for s in leader.ring.slots]
        del loader  # shuts persistent workers down before the pool goes
    finally:
        leader.close()
    assert len(got) == len(plain) > 0
    for step, (a, b) in enumerate(zip(got, plain, strict=True)):
        assert_same(a, b, f"step {step}")
    assert torch.equal(rng, plain_rng), "the main process's RNG must advance exactly as without us"
    assert leader.seq == len(plain), "every batch must have come through a pool slot"
    if kind == "map":
        assert max(grown) > 0, "growing samples must have grown some slot"


def test_pool_is_sized_for_prefetch_plus_what_ranks_hold():
    assert per_worker_slots(prefetch_factor=2, ring_slots=2, num_workers=2) == 2 + 2 + 1
    assert per_worker_slots(prefetch_factor=4, ring_slots=2, num_workers=8) == 4 + 1 + 1


def test_main_process_collate_is_the_users_collate():
    ring = RingWriter(new_token(), frozenset(), {}, self_rank=0)
    pool = WorkerPool(
        ring, num_workers=1, prefetch_factor=2, ring_slots=2, timeout=5, allow_pickle=False
    )
    try:
        writer = SlotCollate(custom_collate, pool.spec)
        batch = writer(
            [{"x": torch.ones(2), "i": 1, "seed_draw": torch.zeros(1, dtype=torch.int64)}]
        )
        assert isinstance(batch["ids"], np.ndarray), "outside a worker: the batch, unchanged"
        assert all(pool.state(i) == "EMPTY" for i in range(pool.spec.total))
    finally:
        ring.close()
        pool.close()


def _bad_collate(samples):
    return {"ok": torch.zeros(4), "bad": [lambda: None]}


def test_unsupported_batch_in_a_worker_raises_the_same_type_and_message_on_the_leader():
    loader = DataLoader(Sized(4, grow=False), batch_size=2, num_workers=1, collate_fn=_bad_collate)
    leader = Leader(loader)
    try:
        with pytest.raises(UnsupportedBatchError) as info:
            for item in loader:
                leader.deliver(item)
        assert "batch['bad'][0]" in str(info.value)
        assert "function" in str(info.value)
        assert "DataLoader worker 0" in "".join(info.value.__notes__)
        assert all(leader.pool.state(i) == "EMPTY" for i in range(leader.pool.spec.total))
    finally:
        leader.close()


def _kill_while_writing(worker_id):
    """worker_init_fn: the worker SIGKILLs itself half-way through its second write."""
    import shmloader._workers.collate as w

    real = w.codec.write_payload
    calls = {"n": 0}

    def write_then_die(enc, dest):
        calls["n"] += 1
        if calls["n"] == 2:
            dest[: enc.nbytes // 2] = 0xAB
            os.kill(os.getpid(), signal.SIGKILL)
        real(enc, dest)

    w.codec = types.SimpleNamespace(**{**vars(codec), "write_payload": write_then_die})


def test_worker_killed_mid_write_raises_and_its_slot_is_reclaimed():
    loader = DataLoader(
        Sized(12, grow=False), batch_size=2, num_workers=1, worker_init_fn=_kill_while_writing
    )
    leader = Leader(loader)
    delivered = []
    it = iter(loader)
    try:
        with pytest.raises(RuntimeError, match=r"exited unexpectedly|killed by signal"):
            for item in it:
                delivered.append(leader.deliver(item))
        it._shutdown_workers()  # the traceback keeps the iterator: unregister its SIGCHLD pids
        # the first batch may or may not arrive before SIGCHLD; the second never does
        assert len(delivered) <= 1, "the half-written batch must never be delivered"
        for batch in delivered:
            assert torch.equal(
                batch["x"], torch.stack([Sized(12, grow=False)[i]["x"] for i in (0, 1)])
            )
        stuck = [i for i in range(leader.pool.spec.total) if leader.pool.state(i) != "EMPTY"]
        assert stuck, "the killed worker's slot is WRITING until reclaimed"
        assert leader.pool.reclaim() == stuck
        assert all(leader.pool.state(i) == "EMPTY" for i in range(leader.pool.spec.total))
    finally:
        it._shutdown_workers()
        leader.close()


def test_a_dropped_slotref_frees_its_slot():
    loader = DataLoader(Sized(8, grow=False), batch_size=2, num_workers=1)
    leader = Leader(loader)
    try:
        it = iter(loader)
        ref = next(it)
        assert leader.pool.state(ref.index) == "FILLED"
        index = ref.index
        del ref  # what a resume fast-forward does with skipped batches
        assert leader.pool.state(index) == "EMPTY"
        del it
    finally:
        leader.close()


def test_pool_names_cannot_be_predicted_or_squatted():
    """FIFOs planted at every name derivable from the ring token change nothing.

    NOTE [pool names]: the control segment and each slot generation carry a
    random part; a fixed name would make the pool hang or fail on a planted file.
    """
    import re

    token = new_token()
    loader = DataLoader(Sized(9), batch_size=3, num_workers=1)  # batches grow: new generations
    per = per_worker_slots(loader.prefetch_factor, 2, 1)
    planted = [f"/dev/shm/shml-{token}-pool"]
    planted += [f"/dev/shm/shml-{token}-{i}.{gen}" for i in range(per) for gen in range(4)]
    for path in planted:
        os.mkfifo(path, 0o600)
    ring = RingWriter(token, frozenset(), {"test": True}, self_rank=0)
    pool = None
    try:
        pool = WorkerPool(
            ring,
            num_workers=1,
            prefetch_factor=loader.prefetch_factor,
            ring_slots=2,
            timeout=20.0,
            allow_pickle=False,
        )
        assert install(loader, pool)
        assert re.fullmatch(rf"/shml-{token}-pool\.[0-9a-f]{{16}}", pool.control.name)
        gens = set()
        for seq, ref in enumerate(loader):
            slot = pool.accept(ref)
            gens.add(slot.gen)
            assert re.fullmatch(
                rf"/shml-{token}-{ref.index}\.{slot.gen}\.[0-9a-f]{{16}}", slot.segment.name
            )
            ring.hold_for_readers(slot, seq, ref.nbytes, 0)
            ring.release(0, slot.index, slot.gen)
            pool.sync()
        assert max(gens) >= 1, "no slot grew: the test did not reach the worker's growth path"
    finally:
        ring.close()
        if pool is not None:
            pool.close()
        for path in planted:
            os.unlink(path)


def test_pool_larger_than_dev_shm_is_a_capacity_error_before_any_batch(monkeypatch):
    import shmloader._workers.partition as partition

    big = [torch.full((1 << 18,), float(i)) for i in range(4)]  # 1 MiB samples
    loader = DataLoader(big, batch_size=2, num_workers=1, multiprocessing_context="fork")
    leader = Leader(loader)
    monkeypatch.setattr(partition, "shm_free_bytes", lambda: 1 << 10)  # inherited by fork
    try:
        with pytest.raises(ShmCapacityError) as info:
            for item in loader:
                leader.deliver(item)
        message = str(info.value)
        assert "num_workers" in message and "/dev/shm" in message
        assert leader.seq == 0
    finally:
        leader.close()
    assert PoolState.EMPTY == 1


# ----------------------------------------------------------------- multi-rank


def _rank_loader(kind: str, context: str | None, persistent: bool, mib: float = 0, n: int = 16):
    def make() -> DataLoader:
        if mib:
            data = [torch.full((int(mib * (1 << 20)) // 8,), float(i)) for i in range(4)]
            return DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context=context)
        collate = _bad_collate if kind == "unsupported" else custom_collate
        return DataLoader(
            Sized(n),
            batch_size=3,
            shuffle=True,
            num_workers=2,
            multiprocessing_context=context,
            persistent_workers=persistent,
            collate_fn=collate,
        )

    return make


def deliver_workers(
    rank: int,
    world: int,
    *,
    context: str | None = None,
    persistent: bool = False,
    share: bool = True,
    kind: str = "map",
    mib: float = 0,
    epochs: int = 2,
) -> dict:
    """Every batch (owned copies), the RNG state and the stats, or what was raised."""
    from shmloader import Config, ShmLoader
    from tests.faults.scenarios import outcome

    group = torch.distributed.new_group(list(range(world)), backend="gloo")
    torch.manual_seed(7)

    def run() -> dict:
        loader = ShmLoader(
            _rank_loader(kind, context, persistent, mib),
            group,
            config=Config.from_env(enabled=share),
        )
        try:
            batches = []
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                batches += [_owned(b) for b in loader]
            return {"batches": batches, "rng": torch.get_rng_state(), "stats": loader.stats()}
        finally:
            loader.close()

    return outcome(run)


def _check_shared_equals_unshared(
    world: int, alone_context: str | None = None, **kwargs
) -> list[dict]:
    """``alone_context``: how the unshared ranks' workers start, where not as the shared
    leader's (what an unshared run yields does not depend on it)."""
    shared = run_ranks(deliver_workers, world, kwargs={**kwargs, "share": True}, timeout=150)
    if alone_context is not None:
        kwargs["context"] = alone_context
    alone = run_ranks(deliver_workers, world, kwargs={**kwargs, "share": False}, timeout=150)
    for rank in range(world):
        s, a = shared[rank], alone[rank]
        assert s["ok"] and a["ok"], (s, a)
        s, a = s["value"], a["value"]
        assert len(s["batches"]) == len(a["batches"]) > 0
        for step, (x, y) in enumerate(zip(s["batches"], a["batches"], strict=True)):
            assert_same(x, y, f"rank {rank} step {step}")
        assert torch.equal(s["rng"], a["rng"]), f"rank {rank}: RNG differs from unshared"
    lead = shared[0]["value"]["stats"]
    assert lead["worker_written"] == lead["published"] == len(shared[0]["value"]["batches"])
    return shared


@pytest.mark.timeout(330)
def test_shared_equals_unshared_with_spawned_persistent_workers():
    # the unshared ranks' workers from their warm forkserver: 4 cold interpreters fewer
    _check_shared_equals_unshared(2, "forkserver", context="spawn", persistent=True)


@pytest.mark.timeout(330)
def test_copy_mode_with_worker_written_slots(monkeypatch):
    monkeypatch.setenv("SHMLOADER_COPY", "1")
    _check_shared_equals_unshared(2, context="forkserver")


@pytest.mark.timeout(330)
def test_cross_node_with_worker_written_slots():
    shared = run_ranks(
        deliver_workers, 4, kwargs={"context": "fork"}, nodes=[0, 0, 1, 1], timeout=150
    )
    alone = run_ranks(deliver_workers, 4, kwargs={"context": "fork", "share": False}, timeout=150)
    for rank in range(4):
        s, a = shared[rank]["value"], alone[rank]["value"]
        assert len(s["batches"]) == len(a["batches"]) > 0
        for step, (x, y) in enumerate(zip(s["batches"], a["batches"], strict=True)):
            assert_same(x, y, f"rank {rank} step {step}")
        assert torch.equal(s["rng"], a["rng"])
    assert shared[0]["value"]["stats"]["worker_written"] > 0
    assert shared[0]["value"]["stats"]["cross_node_bytes_sent"] > 0


@pytest.mark.timeout(180)
def test_unsupported_batch_in_a_worker_reaches_every_rank_with_type_and_message():
    out = run_ranks(deliver_workers, 2, kwargs={"kind": "unsupported"}, timeout=150)
    lead, follower = out
    assert not lead["ok"] and lead["type"] == "UnsupportedBatchError", lead
    assert "batch['bad'][0]" in lead["message"]
    assert not follower["ok"] and follower["type"] == "LeaderError", follower
    assert follower["attrs"]["original_type"] == "UnsupportedBatchError"
    assert lead["message"] in follower["message"]


def small_shm_job(rank: int, world: int) -> dict:
    """In a 64 MiB /dev/shm, 6 MiB batches from 2 workers: without sharing (both
    ranks load: up to 2 x 2 workers x prefetch_factor 2 batches, 48 MiB), with it
    (the full pool, 10 slots of 6.75 MiB, does not fit); then 16 MiB batches
    (more than base PyTorch fits too): a typed error."""
    import logging

    from shmloader import Config, ShmLoader
    from tests.faults.scenarios import outcome

    group = torch.distributed.new_group(list(range(world)), backend="gloo")
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shmloader._workers.pool").addHandler(handler)

    def factory(mib: int):
        def make() -> DataLoader:
            data = [torch.full((mib << 20 >> 3,), float(i)) for i in range(8)]  # float32
            return DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")

        return make

    def run(share: bool, mib: int) -> dict:
        loader = ShmLoader(factory(mib), group, config=Config.from_env(enabled=share))
        try:
            sums = [float(b.double().sum()) for epoch in range(2) for b in loader]
            pool = getattr(loader._role, "pool", None)  # the leader's WorkerPool
            return {"sums": sums, "in_use": None if pool is None else int(pool.words[3])}
        finally:
            loader.close()

    out = {"off": outcome(lambda: run(False, 6)), "on": outcome(lambda: run(True, 6))}
    out["warned"] = [w for w in warned if "/dev/shm cannot hold" in w]
    out["too_big"] = outcome(lambda: run(True, 16))
    return out


@pytest.mark.timeout(240)
def test_a_job_that_fits_a_64_mib_dev_shm_without_sharing_fits_with_it():
    """Docker's 64 MiB /dev/shm (a tmpfs in a private mount namespace), 2 workers:
    6 MiB batches run with sharing off and on (the pool shrinks to the slots per
    worker that fit, warning once); 16 MiB batches are a typed error on every rank."""
    out = run_ranks(small_shm_job, 2, nodes=[1, 1], node_shm_size="64m", timeout=200)
    lead, follower = out
    for got in out:
        assert got["off"]["ok"] and got["on"]["ok"], got
        assert got["on"]["value"]["sums"] == got["off"]["value"]["sums"]
        assert len(got["on"]["value"]["sums"]) == 8
    assert 2 <= lead["on"]["value"]["in_use"] < per_worker_slots(2, 2, 2), lead["on"]
    assert len(lead["warned"]) == 1, lead["warned"]
    assert "prefetch_factor=2" in lead["warned"][0] and "--shm-size" in lead["warned"][0]
    big = lead["too_big"]
    assert not big["ok"] and big["type"] == "ShmCapacityError", big
    assert "num_workers" in big["message"] and "--shm-size" in big["message"]
    # nothing the user cannot change: 2 slots per worker is the least, whatever
    # SHMLOADER_SLOTS and prefetch_factor say
    assert "SHMLOADER_SLOTS" not in big["message"] and "prefetch_factor" not in big["message"]
    assert not follower["too_big"]["ok"] and follower["too_big"]["type"] == "LeaderError"
    assert follower["too_big"]["attrs"]["original_type"] == "ShmCapacityError"


def kill_leader_holding(rank: int, world: int) -> dict:
    """The leader SIGKILLs itself while its workers hold FILLED slots and ranks hold batches."""
    import time

    from shmloader import Config, ShmLoader
    from tests.faults.scenarios import die, outcome

    group = torch.distributed.new_group(list(range(world)), backend="gloo")
    loader = ShmLoader(
        _rank_loader("map", "fork", False, n=24), group, config=Config.from_env(enabled=True)
    )

    def run() -> int:
        held = []
        for step, batch in enumerate(loader):
            held.append(batch)
            if rank == 0 and step == 2:
                time.sleep(0.5)  # let the workers fill their prefetch slots
                die()
        return len(held)

    try:
        return outcome(run)
    finally:
        loader.close()


@pytest.mark.timeout(180)
def test_leader_killed_while_workers_hold_slots_leaves_nothing_after_gc():
    out = run_ranks(kill_leader_holding, 2, expect_failure=True, gc_after=True, timeout=150)
    assert out[0] is None or isinstance(out[0], str), "the leader must have died"
    assert not out[1]["ok"] and out[1]["type"] == "PeerLostError", out[1]
    # no_leaks then checks that gc left no shml- segment of the job in /dev/shm


def _bare_pool(num_workers: int, per_worker_ring_slots: int = 2) -> tuple[RingWriter, WorkerPool]:
    ring = RingWriter(new_token(), frozenset(), {}, self_rank=0)
    pool = WorkerPool(
        ring,
        num_workers=num_workers,
        prefetch_factor=2,
        ring_slots=per_worker_ring_slots,
        timeout=5,
        allow_pickle=False,
    )
    return ring, pool


def test_a_claim_takes_the_smallest_free_slot_that_fits_else_grows_the_largest():
    from shmloader._workers.partition import WorkerSlots

    ring, pool = _bare_pool(1)
    try:
        slots = WorkerSlots(pool.spec, 0)
        caps = [8192, 65536, 4096, 32768, 16384, 4096, 12288]
        assert len(caps) == pool.spec.per_worker
        for i, cap in enumerate(caps):
            slots._record(i).capacity = cap
        slots._record(4).state = PoolState.WRITING  # not EMPTY: never taken
        assert slots._try_claim(10_000)[0] == 6  # 12288: the smallest that fits (16384 is busy)
        assert slots._try_claim(10_000)[0] == 3  # then 32768
        assert slots._try_claim(5000)[0] == 0  # 8192
        assert slots._try_claim(100_000)[0] == 1  # none fits: the largest EMPTY one grows
        assert slots._try_claim(1)[0] in (2, 5)  # 4096, either of the two
        del slots
    finally:
        ring.close()
        pool.close()


def test_worker_partitions_never_overlap():
    from shmloader._workers.partition import WorkerSlots

    ring, pool = _bare_pool(3)
    try:
        per = pool.spec.per_worker
        taken: dict[int, list[int]] = {}
        for w in (1, 0, 2):  # a worker claims until its partition is empty
            slots = WorkerSlots(pool.spec, w)
            got = []
            while (claim := slots._try_claim(1)) is not None:
                got.append(claim[0])
            taken[w] = sorted(got)
            del slots
        for w in range(3):
            assert taken[w] == list(range(w * per, (w + 1) * per)), taken
    finally:
        ring.close()
        pool.close()


def test_a_slot_filled_by_a_worker_that_died_is_reclaimed_and_a_live_ones_is_not():
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    ring, pool = _bare_pool(1)
    try:
        for i, (state, pid) in enumerate(
            [
                (PoolState.FILLED, dead.pid),
                (PoolState.WRITING, dead.pid),
                (PoolState.FILLED, os.getpid()),
                (PoolState.WRITING, os.getpid()),
            ]
        ):
            pool._record(i).pid, pool._record(i).state = pid, state
        assert pool.reclaim() == [0, 1]
        assert [pool.state(i) for i in range(4)] == ["EMPTY", "EMPTY", "FILLED", "WRITING"]
    finally:
        ring.close()
        pool.close()


def test_garbage_in_the_control_segment_leaves_no_name_after_close():
    """close() unlinks what was made for the pool, whatever its control words say."""
    from shmloader._workers.partition import WorkerSlots

    ring, pool = _bare_pool(2)
    token = ring.token
    try:
        slots = WorkerSlots(pool.spec, 1)
        grown = []
        for _ in range(3):  # a worker grows three of its slots (names only it knows of)
            index, _ticket = slots._try_claim(1 << 20)
            slots.payload(index, 1 << 20)
            grown.append(index)
        slots._forget(grown[0])
        del slots
        rng = np.random.default_rng(5)
        for i in range(pool.spec.total):  # then every record's gen and name turn to garbage
            pool._record(i).gen, pool._record(i).name = rng.integers(0, 2**63, 2, dtype=np.uint64)
    finally:
        ring.close()
        pool.close()
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"shml-{token}")]
    assert not left, left


def test_a_slot_another_live_worker_still_references_is_never_claimed():
    """NOTE [kept collate outputs]: the ``kept`` word keeps a second process with the
    same worker id (two iterators alive at once) off memory a collate still holds."""
    import subprocess

    from shmloader._workers.partition import WorkerSlots

    dead = subprocess.Popen(["true"])
    dead.wait()
    ring, pool = _bare_pool(1)
    live = subprocess.Popen(["sleep", "30"])
    try:
        slots = WorkerSlots(pool.spec, 0)
        for i in range(pool.spec.per_worker):
            slots._record(i).capacity = 4096 * (i + 1)  # slot 0 is the smallest, then 1, ...
        slots._record(0).kept = live.pid  # another worker still holds memory in it
        slots._record(1).kept = dead.pid  # a dead one does not count
        slots._record(2).kept = os.getpid()  # this worker's own: it copies them out itself
        assert slots._try_claim(1)[0] == 1
        assert slots._try_claim(1)[0] == 2
        assert slots._try_claim(1)[0] == 3
        del slots
    finally:
        live.kill()
        live.wait()
        ring.close()
        pool.close()


def _pool_owner_start(conn) -> None:
    from shmloader._node.segment import proc_start_time

    ring, pool = _bare_pool(1)
    try:
        conn.send(
            (
                pool.spec.owner_pid == os.getpid(),
                pool.spec.owner_start,
                proc_start_time(os.getpid()),
            )
        )
    finally:
        ring.close()
        pool.close()


def test_a_forked_leader_names_its_own_start_time_as_the_pools_owner():
    """Workers judge the leader by pid and start time (a waiting worker ends when
    it is gone): a leader forked from a process that imported shmloader must
    name its own start time, not its parent's."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_pool_owner_start, args=(theirs,))
    child.start()
    try:
        same_pid, owner_start, real_start = ours.recv()
    finally:
        child.join(30)
    assert same_pid and owner_start == real_start

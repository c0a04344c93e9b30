"""What the device path promises, proved on CUDA (skipped where there is none).

Each test here has a fake-device counterpart in ``tests/device/test_device.py`` for
the logic; these check the same promise against the real driver and
allocator:

- no copy reads pageable memory: every source of every device copy
  ``is_pinned()`` (registered slots, staging buffers, leaves pinned already);
- ``select`` on the GPU delivers each rank only its slice, equal to slicing the
  source, and copies only those bytes;
- stream safety: the consumer stream's wait on the copy's event is what makes
  a batch readable at once (a control run without it reads stale memory), and
  a batch dropped while a queued kernel still reads it keeps its bytes until
  that kernel ran (``record_stream``; a control run without it sees them
  overwritten);
- memory over several epochs of varying sizes: reserved device memory,
  registered and pinned host bytes, and followers' retired slots stay bounded;
- ring slots written by DataLoader workers, several epochs and the huge-page
  ring deliver the same bytes on the device as on the host.

A control run that does not fail means the check is blind: the test fails.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from shmloader import Config, ShmLoader
from shmloader._node import ringdir
from shmloader.device import containers
from shmloader.device import cuda as cudaops
from shmloader.device import registrar as hostmem
from shmloader.device import stage as device
from tests.device.test_device import RingSource, same
from tests.support.harness import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False); "
    "tests/device/test_device.py covers the stage's logic without one",
)

#: ``torch.cuda._sleep`` cycles that keep a stream busy for tens of ms on any current GPU.
BUSY = 200_000_000


@pytest.fixture
def source():
    src = RingSource()
    yield src
    gc.collect()
    src.close()


@pytest.fixture(autouse=True)
def no_failed_unregister(caplog):
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        yield
    failed = [r.getMessage() for r in caplog.records if "Unregister" in r.getMessage()]
    assert not failed, failed


class Watched(cudaops.CudaOps):
    """``CudaOps`` that checks every copy's source and can be slowed or broken.

    ``delay``: the side stream sleeps before each batch's first copy, so that a
    consumer that does not wait reads before the bytes land; ``wait`` and
    ``record_stream`` False remove the stage's consumer wait / record_stream
    (control runs).
    """

    def __init__(self, dev, *, delay: int = 0, wait: bool = True, record_stream: bool = True):
        super().__init__(dev)
        self.delay, self.waits, self.records = delay, wait, record_stream
        self.sources = 0
        self.pageable: list[int] = []

    def copy(self, dst, src):
        self.sources += 1
        if not src.is_pinned():
            self.pageable.append(src.numel())
        if self.delay:
            torch.cuda._sleep(self.delay)  # on the side stream: the copy lands later
        super().copy(dst, src)

    def wait(self, event):
        if self.waits:
            super().wait(event)

    def hand_over(self, tensor):
        if self.records:
            super().hand_over(tensor)


def cuda0() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------ no pageable copies


def test_no_copy_reads_pageable_memory(source):
    """Registered slots, staged small leaves, lazy views, batches no slot holds
    and leaves pinned already: every copy's source is page-locked."""
    source.own_below = 1024  # the small leaves are owned copies: staged
    ops = Watched(cuda0())
    stage = device.DeviceStage(ops, prefetch=2)
    z = torch.complex(torch.arange(8.0), torch.ones(8))
    ring_batches = [
        source.deliver({"x": torch.full((1 << 16,), i), "s": torch.arange(3) + i, "z": z})
        for i in range(4)
    ]
    owned = [{"x": torch.full((1 << 16,), 10 + i), "s": torch.arange(3)} for i in range(4)]
    pinned = [{"x": torch.full((1 << 16,), 20 + i).pin_memory()} for i in range(4)]
    lazy = [{"z": z.conj()}]
    got = list(stage.wrap(iter(ring_batches + owned + pinned + lazy)))
    torch.cuda.synchronize()
    assert ops.sources > 0 and ops.pageable == [], f"pageable copies of {ops.pageable} bytes"
    for i in range(4):
        assert torch.equal(got[i]["x"].cpu(), torch.full((1 << 16,), i))
        assert torch.equal(got[i]["s"].cpu(), torch.arange(3) + i)
        assert torch.equal(got[4 + i]["x"].cpu(), torch.full((1 << 16,), 10 + i))
        assert torch.equal(got[8 + i]["x"].cpu(), torch.full((1 << 16,), 20 + i))
    assert torch.equal(got[12]["z"].cpu(), z.conj().resolve_conj())
    stats = stage.stats()
    assert stats["device_copies_registered"] == 4  # the ring batches' "x" and "z"
    assert stats["device_pinned_leaf_bytes"] == 4 * (1 << 16) * 8  # not copied again
    assert stats["device_staged_bytes"] == 4 * 24 + 4 * ((1 << 16) * 8 + 24) + 8 * 8
    stage.close()


# ------------------------------------------------------------ select over ranks


def select_rank(rank: int, world: int, *, steps: int) -> dict:
    """An SP rank that selects its quarter of the sequence on the GPU."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    calls: list[int] = []

    def my_slice(batch, step):
        calls.append(step)
        n = batch["ids"].shape[-1] // world
        return {"ids": batch["ids"][:, rank * n : (rank + 1) * n], "i": batch["i"]}

    def make():
        return [
            {"ids": torch.arange(4 * 1024).reshape(4, 1024) + 10_000 * i, "i": i}
            for i in range(steps)
        ]

    loader = ShmLoader(
        make, group, config=Config.from_env(enabled=True), device="cuda", select=my_slice
    )
    out: dict = {"ok": [], "steps": calls, "role": loader.role}
    for batch in loader:
        i = batch["i"]
        want = (torch.arange(4 * 1024).reshape(4, 1024) + 10_000 * i)[
            :, rank * 256 : (rank + 1) * 256
        ]
        out["ok"].append(
            batch["ids"].device.type == "cuda" and torch.equal(batch["ids"].cpu(), want)
        )
    out["stats"] = {k: v for k, v in loader.stats().items() if k.startswith("device")}
    loader.close()
    return out


def test_select_on_the_gpu_delivers_each_rank_only_its_slice():
    out = run_ranks(select_rank, 4, kwargs={"steps": 12})
    for r in out:
        assert r["ok"] == [True] * 12
        assert r["steps"] == list(range(12))  # select is told the step it is for
        assert r["stats"]["device_bytes"] == 12 * 4 * 256 * 8  # 1/SP of the bytes, no more
        assert r["stats"]["device_registered"]


# ------------------------------------------------------------ stream safety


def _ring_batches(source: RingSource, n: int, base: int, size: int = 1 << 20):
    for i in range(n):
        yield source.deliver({"x": torch.full((size,), base + i, dtype=torch.int32), "i": base + i})


def test_the_consumer_stream_reads_a_batch_only_after_its_copy(source):
    """The copy lands late (the side stream sleeps first); the consumer reads at
    once. With the stage's wait every read is right; the control run without
    it must read stale memory at least once."""

    def run(wait: bool, base: int) -> list[bool]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # no block of an earlier run can hold the right bytes
        ops = Watched(cuda0(), delay=BUSY // 4, wait=wait)
        stage = device.DeviceStage(ops, prefetch=2)
        sums = []
        for batch in stage.wrap(_ring_batches(source, 6, base)):
            sums.append((batch["i"], batch["x"].to(torch.int64).sum()))  # queued at once
        torch.cuda.synchronize()
        stage.close()
        return [int(s) == (1 << 20) * i for i, s in sums]

    assert all(run(wait=True, base=1_000))
    assert not all(run(wait=False, base=2_000)), "the control run read no stale byte"


def test_a_batch_dropped_under_a_queued_kernel_keeps_its_bytes(source):
    """The consumer queues a long kernel, then a read of the batch, and drops
    the batch; the stage's next copies (same size) must not reuse its memory
    before that read ran (record_stream). Control: without it, they do."""

    def run(record: bool, base: int) -> bool:
        # An empty cache: the caching allocator's best fit for the next batch of
        # the same size is then the dropped batch's block, unless record_stream
        # holds it back until the consumer stream's work ran.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        ops = Watched(cuda0(), record_stream=record)
        stage = device.DeviceStage(ops, prefetch=2)
        it = stage.wrap(_ring_batches(source, 8, base))
        batch = next(it)
        torch.cuda._sleep(BUSY)  # the consumer stream is busy for a while
        total = batch["x"].to(torch.int64).sum()  # reads the batch after that
        del batch
        rest = [next(it)["i"] for _ in range(5)]  # copies into freed blocks meanwhile
        torch.cuda.synchronize()
        for _ in it:
            pass
        stage.close()
        assert rest == [base + k for k in range(1, 6)]
        return int(total) == (1 << 20) * base

    assert run(record=True, base=3_000)
    assert not run(record=False, base=4_000), "the control run's batch was not overwritten"


# ------------------------------------------------------------ memory over epochs


def test_memory_stays_bounded_over_epochs_of_varying_sizes(source):
    source.own_below = 4096  # a small staged leaf every batch
    stage = device.DeviceStage(torch.device("cuda"), prefetch=2)
    sizes = [1 << 14, 1 << 20, 1 << 16, 1 << 22]  # int32 elements: 64 KiB .. 16 MiB
    reserved, staging, registered = [], [], []
    for epoch in range(6):
        order = sizes[epoch % 2 :] + sizes[: epoch % 2]
        batches = (
            source.deliver(
                {"x": torch.full((n,), k + 1, dtype=torch.int32), "s": torch.ones(8) * k}
            )
            for k, n in enumerate(order * 4)
        )
        for batch in stage.wrap(batches):
            y = batch["x"].sum()  # consumer work on the batch
            del batch, y
        torch.cuda.synchronize()
        gc.collect()
        stats = stage.stats()
        reserved.append(torch.cuda.memory_reserved())
        staging.append(stats["device_staging_bytes"])
        registered.append(stats["device_registered_bytes"])
        live = {s.segment.name for s in source.ring.slots if s.segment.fd >= 0}
        mapped = {m.segment.name for m in stage._registrar._maps.values()}  # type: ignore[union-attr]
        assert mapped <= live, f"epoch {epoch}: a retired slot is still registered"
    biggest = (1 << 22) * 4
    assert max(reserved[2:]) <= reserved[1] + 2 * biggest, reserved  # no growth after warm-up
    assert max(staging) <= hostmem.STAGING_BUFFERS * hostmem.staging_capacity(4096)
    assert stage.stats()["device_staging_peak_bytes"] <= 2 * hostmem.staging_capacity(4096)
    stage.close()
    assert stage.stats()["device_locked_bytes"] == 0


class EpochSampler(torch.utils.data.Sampler):
    """Indices ``1000 * epoch + k``: ``Growing`` makes each epoch's samples another size."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(1000 * self.epoch, 1000 * self.epoch + self.n))

    def __len__(self) -> int:
        return self.n


class Growing(torch.utils.data.Dataset):
    """``tests.support.ranks.Synthetic`` samples: 1x, 41x, 81x long in epochs 0, 1, 2, ..."""

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> dict:
        from tests.support import ranks

        return ranks.Synthetic(1000, scale=1 + 40 * ((i // 1000) % 3))[i % 1000]


def epochs_rank(rank: int, world: int, *, devices: dict, epochs: int, workers: int) -> dict:
    """SP ranks over several epochs of batches that change size per epoch (slots
    grow and shrink); DataLoader workers (``workers`` > 0) write the slots."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from tests.support import ranks

    group = dist.new_group(list(range(world)))

    def make():
        return DataLoader(
            Growing(),
            batch_size=2,
            sampler=EpochSampler(12),
            num_workers=workers,
            collate_fn=ranks.collate,
        )

    loader = ShmLoader(make, group, config=Config.from_env(enabled=True), device=devices[str(rank)])
    out: dict = {"role": loader.role, "batches": [], "per_epoch": []}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            host = containers.map_tensors(batch, lambda t: t.cpu(), {})
            out["batches"].append(ranks.to_plain(host))
            del batch, host
        stats = loader.stats()
        out["per_epoch"].append(
            {k: v for k, v in stats.items() if k.startswith(("device", "ring"))}
        )
    loader.close()
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_followers_retired_slots_and_pinned_bytes_stay_bounded_over_epochs(workers):
    """Every GPU rank gets the host ranks' bytes; the slots that grew are
    unregistered on every rank (registered bytes follow the live ring)."""
    host = run_ranks(
        epochs_rank,
        2,
        kwargs={"devices": {"0": "cpu", "1": "cpu"}, "epochs": 3, "workers": workers},
    )
    gpu = run_ranks(
        epochs_rank,
        2,
        kwargs={"devices": {"0": "cuda", "1": "cuda"}, "epochs": 3, "workers": workers},
    )
    assert same(gpu[0]["batches"], host[0]["batches"]) and same(
        gpu[1]["batches"], host[0]["batches"]
    )
    (leader,) = [r for r in gpu if r["role"] == "leader"]
    for r in gpu:
        for e, at_leader in zip(r["per_epoch"], leader["per_epoch"], strict=True):
            assert e["device_unregister_failures"] == 0
            # a retired slot is never kept registered: at most one live segment per slot
            assert e["device_registered_slots"] <= at_leader["ring_slots"]
            # staging bounded by the batches (all well below 1 MiB), not by their count
            assert e["device_staging_bytes"] <= hostmem.STAGING_BUFFERS * (2 << 20)


def test_the_huge_page_ring_delivers_the_same_bytes_on_the_device(huge_dir):
    if not ringdir.describe(huge_dir).huge:
        pytest.skip(f"no huge pages here: {ringdir.describe(huge_dir).why}")
    kwargs = {"epochs": 2, "workers": 2}
    env = {"SHMLOADER_SHM_DIR": huge_dir}
    host = run_ranks(
        epochs_rank, 2, kwargs={"devices": {"0": "cpu", "1": "cpu"}, **kwargs}, env=env
    )
    gpu = run_ranks(
        epochs_rank, 2, kwargs={"devices": {"0": "cuda", "1": "cuda"}, **kwargs}, env=env
    )
    for r in gpu:
        assert same(r["batches"], host[0]["batches"])
        assert r["per_epoch"][-1]["device_registered"]

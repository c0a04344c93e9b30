"""Device delivery on a real GPU. Skipped where ``torch.cuda.is_available()`` is False.

Run where there is a GPU: ``python -m pytest -q tests/gpu`` (one GPU is
enough: all ranks share it). The logic behind these tests (prefetch, events,
release, registration counting, fallback) is covered without a GPU by
``tests/device/test_device.py``; these check what only CUDA can: bit-equal device
values, real ``cudaHostRegister`` on shared slots next to copy-on-write
views, device memory, and a registration CUDA itself refuses.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
import torch

from shmloader import Config, ShmLoader
from shmloader.device import cuda as cudaops
from shmloader.device import stage as device
from shmloader.device import which
from shmloader.errors import ConfigError
from tests.device.test_device import RingSource, _all_dtypes_batch, _assert_same, same
from tests.support.harness import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False); "
    "tests/device/test_device.py covers the stage's logic without one",
)


@pytest.fixture
def source():
    src = RingSource()
    yield src
    gc.collect()
    src.close()


@pytest.fixture(autouse=True)
def no_failed_unregister(caplog):
    """A failed ``cudaHostUnregister`` only logs in the product (its range is
    kept mapped); here it fails the test."""
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        yield
    failed = [r.getMessage() for r in caplog.records if "cudaHostUnregister" in r.getMessage()]
    assert not failed, failed


def _to_host(obj):
    if isinstance(obj, torch.Tensor):
        assert obj.device.type == "cuda"
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    return obj


def test_values_bit_equal_to_host_delivery_for_every_dtype(source):
    stage = device.DeviceStage(torch.device("cuda"), prefetch=2)
    want = [_all_dtypes_batch() for _ in range(4)]
    got = list(stage.wrap(iter([source.deliver(b) for b in want])))
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert g["ids"] is g["labels"]
        assert isinstance(g["np"], np.ndarray)
        _assert_same(_to_host(g), w)
    stats = stage.stats()
    assert stats["device_registered"] and stats["device_registrations"] >= 1
    assert stats["device_bandwidth_gbs"] and stats["device_bandwidth_gbs"] > 0
    stage.close()


def test_a_batch_held_across_many_steps_never_changes(source):
    stage = device.DeviceStage(torch.device("cuda"), prefetch=2)
    # a pattern per step, never zero: a fresh slot's zeros cannot pass for batch 0
    it = stage.wrap(
        source.deliver({"x": torch.full((1 << 16,), i + 1, dtype=torch.int32)}) for i in range(300)
    )
    held = next(it)
    expected = torch.full((1 << 16,), 1, dtype=torch.int32)
    for _ in it:
        pass  # the slot of batch 0 is rewritten about 150 times meanwhile
    torch.cuda.synchronize()
    assert torch.equal(held["x"].cpu(), expected)
    # NOTE [copies in flight]: at most prefetch copies hold slots while the next is written
    assert len(source.ring.slots) <= stage.prefetch + 1
    stage.close()
    assert stage.stats()["device_unregister_failures"] == 0


def test_no_device_memory_growth_over_1000_steps(source):
    """Reserved memory (what the caching allocator holds, not only what is
    allocated) with the same three batches alive at both ends."""
    import collections

    stage = device.DeviceStage(torch.device("cuda"), prefetch=2)
    batches = (source.deliver({"x": torch.full((1 << 18,), i % 7 + 1)}) for i in range(1000))
    alive: collections.deque = collections.deque(maxlen=3)
    after_warmup = None
    for step, batch in enumerate(stage.wrap(batches)):
        y = (batch["x"] * 2).sum()  # consumer-stream work on the batch
        alive.append(batch)
        if step == 50:
            torch.cuda.synchronize()
            gc.collect()
            after_warmup = torch.cuda.memory_reserved()
        del batch, y
    torch.cuda.synchronize()
    gc.collect()
    assert after_warmup is not None and len(alive) == 3
    one_batch = (1 << 18) * 8
    assert torch.cuda.memory_reserved() <= after_warmup + one_batch
    alive.clear()
    stage.close()


def test_the_ring_grows_under_registered_copies(source):
    """Growing batches retire slots: each retired slot is unregistered (never
    a failure) and unmapped, and every value arrives."""
    stage = device.DeviceStage(torch.device("cuda"), prefetch=2)
    sizes = [1 << 12] * 10 + [1 << 16] * 10 + [1 << 20] * 10 + [1 << 22] * 5
    got = list(
        stage.wrap(
            source.deliver({"x": torch.full((n,), i + 1, dtype=torch.int32)})
            for i, n in enumerate(sizes)
        )
    )
    torch.cuda.synchronize()
    for i, (b, n) in enumerate(zip(got, sizes, strict=True)):
        assert b["x"].shape == (n,) and int(b["x"].min()) == int(b["x"].max()) == i + 1
    stats = stage.stats()
    reg = stage._registrar
    assert reg is not None and reg.unregistrations >= 3, "slots grew: old ones unregistered"
    assert stats["device_unregister_failures"] == 0 and stats["device_registration_refusals"] == 0
    stage.close()
    assert reg.live == 0 and reg.stuck == []


def test_cuda_means_this_ranks_gpu_by_local_rank(monkeypatch):
    """Without set_device, device="cuda" is cuda:$LOCAL_RANK (NOTE [which GPU])."""
    count = torch.cuda.device_count()
    last = count - 1
    assert torch.cuda.current_device() == 0
    env = {"LOCAL_RANK": str(last)}
    assert which.resolve("cuda", environ=env) == torch.device("cuda", last)
    beyond = {"LOCAL_RANK": str(count + 2)}
    if count == 1:  # one visible GPU per rank (CUDA_VISIBLE_DEVICES): that one
        assert which.resolve("cuda", environ=beyond) == torch.device("cuda", 0)
    else:
        with pytest.raises(ConfigError, match="sees only"):
            which.resolve("cuda", environ=beyond)
    monkeypatch.setenv("LOCAL_RANK", str(last))
    loader = ShmLoader(
        lambda: [{"x": torch.arange(10)}], None, config=Config(enabled=False), device="cuda"
    )
    try:
        (batch,) = list(loader)
        assert batch["x"].device == torch.device("cuda", last)
        assert torch.equal(batch["x"].cpu(), torch.arange(10))
    finally:
        loader.close()


def test_refused_registration_falls_back_and_leaves_no_cuda_error(source, caplog, monkeypatch):
    # Default flags on a read-only mapping are refused by CUDA itself.
    monkeypatch.setattr(cudaops, "HOST_REGISTER_FLAGS", 0)
    stage = device.DeviceStage(torch.device("cuda"), prefetch=2)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        got = list(stage.wrap(source.deliver({"x": torch.arange(1000) + i}) for i in range(10)))
    assert [int(b["x"][0]) for b in got] == list(range(10))
    assert stage.stats()["device_registered"] is False
    assert sum("refused" in r.message for r in caplog.records) == 1
    torch.ones(4, device="cuda").add_(1)  # the refused call left no pending CUDA error
    torch.cuda.synchronize()
    stage.close()


# ------------------------------------------------------------ real ranks


def gpu_rank(rank: int, world: int, *, devices: dict, write: bool, steps: int) -> dict:
    """One rank of an SP group on this node's GPU (``devices[rank]``: cpu or cuda)."""
    import torch.distributed as dist

    calls = {"register": 0}
    real = cudaops._Cudart.register

    def counting(self, address: int, nbytes: int, flags: int = cudaops.HOST_REGISTER_FLAGS):
        if flags == cudaops.HOST_REGISTER_FLAGS:  # a ring slot, not a staging buffer
            calls["register"] += 1
        return real(self, address, nbytes, flags)

    cudaops._Cudart.register = counting  # type: ignore[method-assign]
    from shmloader._node import views

    mapped: list[str] = []
    real_map = views.map_shared_readonly

    def counting_map(segment):
        mapped.append(segment.name)
        return real_map(segment)

    views.map_shared_readonly = counting_map
    group = dist.new_group(list(range(world)))

    def make():
        return [
            {"x": torch.full((1 << 20,), i, dtype=torch.int64), "f": torch.rand(3, 1000)}
            for i in range(steps)
        ]

    torch.manual_seed(0)
    loader = ShmLoader(make, group, config=Config.from_env(enabled=True), device=devices[str(rank)])
    held, seen = [], []
    for i, batch in enumerate(loader):
        if write and batch["x"].device.type == "cpu":
            batch["x"].fill_(-1)  # a private in-place write: nobody else may see it
        held.append(batch)
        seen.append(int(batch["x"][0]) if not write else i)
    torch.cuda.synchronize()
    unchanged = all(
        int(b["x"].min())
        == int(b["x"].max())
        == (-1 if write and b["x"].device.type == "cpu" else i)
        for i, b in enumerate(held)
    )
    stats = loader.stats()
    out = {
        "role": loader.role,
        "seen": seen,
        "unchanged": unchanged,
        "registrations": calls["register"],
        "segments": mapped,
        "ring_slots": stats.get("ring_slots"),
        "stats": {k: v for k, v in stats.items() if k.startswith("device")},
        "plain": [{k: v.cpu() for k, v in b.items()} for b in held[:3]],
    }
    del held
    loader.close()
    return out


def test_every_rank_gets_bit_equal_batches_and_registers_each_slot_once():
    devices = {"0": "cuda", "1": "cuda", "2": "cuda"}
    out = run_ranks(gpu_rank, 3, kwargs={"devices": devices, "write": False, "steps": 40})
    (leader,) = [r for r in out if r["role"] == "leader"]
    for r in out:
        assert r["seen"] == list(range(40)) and r["unchanged"]
        assert same(r["plain"], out[0]["plain"])
        assert r["stats"]["device_registered"]
        # once per slot segment per rank: never per batch
        assert r["registrations"] == r["stats"]["device_registrations"] == len(r["segments"])
        assert len(set(r["segments"])) == len(r["segments"])
        # equal batches: no slot grows, so the leader made no more segments than slots
        assert 1 <= r["registrations"] <= leader["ring_slots"]


def test_copy_on_write_intact_while_another_rank_has_the_slots_registered():
    devices = {"0": "cpu", "1": "cuda", "2": "cpu"}
    out = run_ranks(gpu_rank, 3, kwargs={"devices": devices, "write": True, "steps": 20})
    assert all(r["unchanged"] for r in out)  # held CPU batches kept their private writes
    gpu = out[1]["plain"]
    assert all(int(b["x"].min()) == int(b["x"].max()) == i for i, b in enumerate(gpu))
    assert out[1]["registrations"] >= 1

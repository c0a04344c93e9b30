"""The device stage without a GPU: a fake device drives prefetch, streams and release.

``FakeOps`` (``tests.support.fake_device``) implements ``shmloader.device.stage.DeviceOps``
on the host: its "device" memory is host tensors and its events complete when
the test says so (``complete()``), so every rule of the stage is observable here: prefetch
depth and order, the consumer waiting on the copy's event, slots released when
the copy completes (not when the user drops the batch), errors and stops
through the prefetcher, close with copies in flight, ``select``, registration
once per slot (counted), unregister before unmap, and the fallback when
registration is refused. Batches come from a real ring (``RingSource``): the
stage finds slots, maps and "registers" them exactly as on a GPU rank. The
containers the codec delivers (``OrderedDict``, transformers' ``BatchEncoding``)
also go through ``ShmLoader(device=FakeOps)`` on real ranks, sharing on and off.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import types
import typing

import numpy as np
import pytest
import torch

from shmloader import Config, ShmLoader
from shmloader._node.ring import RingWriter, SlotState, new_token
from shmloader._node.views import private_view, view_source
from shmloader._proto import codec
from shmloader.config import DEFAULT_PREFETCH
from shmloader.device import cuda as cudaops
from shmloader.device import registrar as hostmem
from shmloader.device import stage as device
from shmloader.device import which
from shmloader.errors import ConfigError, ShmLoaderError
from tests.support.fake_device import FakeCuda, FakeOps
from tests.support.harness import run_ranks

# ----------------------------------------------------------------- sources


class RingSource:
    """A ring in this process; each batch is decoded from a private view of a slot.

    That is what every rank's loop yields (NOTE [slot lifetime]): the view
    HOLDS its slot until it dies.
    """

    def __init__(self, own_below: int = 0) -> None:
        self.ring = RingWriter(new_token(), frozenset(), {"test": True}, self_rank=0)
        self.seq = 0
        self.released: list[int] = []
        self.own_below = own_below  # SHMLOADER_SMALL_COPY as a reader decodes (NOTE [small leaves])

    def deliver(self, batch):
        enc = codec.encode(batch)
        slot = self.ring.acquire(enc.nbytes)
        codec.write_payload(enc, slot.payload)
        self.ring.hold_for_readers(slot, self.seq, enc.nbytes, 0)
        release = functools.partial(self._release, slot.index, slot.gen, self.seq)
        self.seq += 1
        view = private_view(slot.segment, enc.nbytes, release)
        return codec.decode(enc.meta, view, own_below=self.own_below)

    def _release(self, index: int, gen: int, seq: int) -> None:
        self.released.append(seq)
        self.ring.release(0, index, gen)

    def held(self) -> int:
        return sum(s.state == SlotState.HELD for s in self.ring.slots)

    def segments(self) -> set[str]:
        return {s.segment.name for s in self.ring.slots if s.state != SlotState.RETIRED}

    def close(self) -> None:
        self.ring.close()


@pytest.fixture
def source():
    src = RingSource()
    yield src
    gc.collect()
    src.close()


def numbered(source: RingSource, n: int, *, size: int = 1000, log: list | None = None):
    """Batches ``{"x": [i] * size, "i": i}`` delivered through ``source``'s ring."""
    for i in range(n):
        if log is not None:
            log.append(i)
        yield source.deliver({"x": torch.full((size,), i, dtype=torch.int64), "i": i})


def _all_dtypes_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out[str(dt)] = torch.randn(3, 5, generator=g).to(dt)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        out[str(dt)] = torch.randint(-100 if dt != torch.uint8 else 0, 100, (7,), generator=g).to(
            dt
        )
    out["bool"] = torch.rand(4, 4, generator=g) > 0.5
    out["complex64"] = torch.randn(6, dtype=torch.complex64, generator=g)
    out["complex128"] = torch.randn(2, 3, dtype=torch.complex128, generator=g)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    out["five_d"] = torch.arange(2 * 3 * 1 * 2 * 2, dtype=torch.int32).reshape(2, 3, 1, 2, 2)
    shared = torch.arange(10)
    out["ids"] = shared
    out["labels"] = shared
    out["np"] = np.arange(6, dtype=np.float32)
    out["meta"] = [{"k": 1, "s": "x", "b": b"y", "n": None, "f": 1.5, "t": True}]
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got, want) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert torch.equal(_raw(got), _raw(want))  # bit for bit
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    else:
        assert got == want


# ------------------------------------------------------------------ values


def test_every_dtype_arrives_bit_equal_from_the_registered_mapping(source):
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    want = [_all_dtypes_batch() for _ in range(3)]
    got = list(stage.wrap(iter([source.deliver(b) for b in want])))
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
        assert g["ids"] is g["labels"]  # aliases stay aliases
        assert isinstance(g["np"], np.ndarray)  # numpy arrays stay host views
    assert ops.copies and all(ops.from_registered(a) for a, _ in ops.copies)
    stats = stage.stats()
    assert stats["device_registered"] is True
    assert stats["device_copies_registered"] == 3
    stage.close()


def test_a_device_batch_never_changes_when_its_slot_is_rewritten(source):
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=1)
    held = []
    for batch in stage.wrap(numbered(source, 30)):
        held.append(batch)
    assert len(source.ring.slots) <= 3  # slots were reused under the held batches
    for i, batch in enumerate(held):
        assert batch["i"] == i and torch.equal(batch["x"], torch.full((1000,), i))
    stage.close()


# ---------------------------------------------------------------- prefetch


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_prefetch_depth_and_order(source, prefetch):
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=prefetch)
    pulled: list[int] = []
    it = stage.wrap(numbered(source, 10, log=pulled))
    for step in range(10):
        batch = next(it)
        assert batch["i"] == step
        assert len(pulled) == min(10, step + 1 + prefetch)  # copies issued ahead
        assert ops.waits[-1] is ops.events[2 * step + 1]  # waits on its own end event
        assert stage.ahead == min(prefetch, 9 - step)
    with pytest.raises(StopIteration):
        next(it)
    assert [n for _, n in ops.copies] == [8000] * 10
    stage.close()


def test_slot_is_released_when_the_copy_completes_not_when_the_user_drops(source):
    ops = FakeOps()  # events complete only on complete()
    stage = device.DeviceStage(ops, prefetch=1)
    held_at_pull: list[int] = []

    def batches():
        for i in range(6):
            held_at_pull.append(source.held())  # what the writer could reuse right now
            yield source.deliver({"x": torch.full((1000,), i), "i": i})

    it = stage.wrap(batches())
    batch = next(it)  # batches 0 and 1 pulled, copies in flight
    assert source.held() == 2 and source.released == []
    del batch
    gc.collect()
    assert source.released == [], "the user's drop must not release: the copy still reads"
    ops.complete()
    kept = next(it)  # polls: 0 and 1 completed -> released although the user holds 1
    assert kept["i"] == 1
    assert source.released[:2] == [0, 1]
    assert held_at_pull[2] == 0, "completed copies must free their slots before pulling more"
    assert len(ops.handed) == 2  # record_stream on the consumer's stream, per tensor
    ops.complete()
    rest = [b["i"] for b in it]
    assert rest == [2, 3, 4, 5]
    assert source.held() == 0 and sorted(source.released) == list(range(6))
    assert kept["i"] == 1 and torch.equal(kept["x"], torch.full((1000,), 1))
    stage.close()


class Boom(ValueError):
    pass


def _failing(source: RingSource, good: int, exc: BaseException):
    yield from numbered(source, good)
    raise exc


def test_an_error_arrives_after_the_batches_before_it(source):
    stage = device.DeviceStage(FakeOps(auto=True), prefetch=2)
    it = stage.wrap(_failing(source, 3, Boom("bad sample 3")))
    assert [next(it)["i"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(Boom, match="bad sample 3"):
        next(it)
    assert source.held() == 0
    stage.close()


def test_keyboard_interrupt_is_not_deferred(source):
    ops = FakeOps()
    stage = device.DeviceStage(ops, prefetch=2)
    it = stage.wrap(_failing(source, 2, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        next(it)  # pulling ahead hit it
    assert source.held() == 0 and ops.synced == 2  # copies settled, slots released
    stage.close()


def test_a_stop_ends_the_iteration_after_the_batches_in_flight(source):
    # A follower's loop returns on the leader's STOP: the stage drains and ends.
    stage = device.DeviceStage(FakeOps(auto=True), prefetch=3)
    assert [b["i"] for b in stage.wrap(numbered(source, 2))] == [0, 1]
    assert source.held() == 0
    stage.close()


def test_close_with_copies_in_flight(source):
    ops = FakeOps()
    stage = device.DeviceStage(ops, prefetch=3)
    it = stage.wrap(numbered(source, 10))
    first = next(it)
    assert source.held() == 4
    stage.close()
    assert source.held() == 0 and ops.synced == 4
    assert ops.registered == {} and len(ops.unregister_calls) == len(ops.register_calls)
    assert all(ops.mapped_at_unregister), "unregister must come before unmap"
    with pytest.raises(ShmLoaderError, match="closed"):
        next(it)
    assert first["i"] == 0
    stage.close()  # idempotent


def test_breaking_out_settles_and_releases(source):
    ops = FakeOps()
    stage = device.DeviceStage(ops, prefetch=2)
    pulled: list[int] = []
    for batch in stage.wrap(numbered(source, 10, log=pulled)):
        if batch["i"] == 1:
            break
    del batch
    gc.collect()
    assert source.held() == 0 and pulled == [0, 1, 2, 3]
    stage.close()


# ------------------------------------------------------------ registration


def test_registration_once_per_slot_and_unregistered_when_the_slot_grows(source):
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    list(stage.wrap(numbered(source, 40)))
    assert len(ops.register_calls) == len(source.ring.slots)  # once per slot, not per batch
    first = set(ops.registered)
    # Bigger batches: every slot is retired and replaced by a bigger one.
    list(stage.wrap(numbered(source, 20, size=100_000)))
    assert not first & set(ops.registered), "a retired slot's registration must go"
    assert set(ops.unregister_calls) == first
    assert all(ops.mapped_at_unregister)
    assert len(ops.register_calls) == len(first) + len(ops.registered)
    stage.close()
    assert ops.registered == {}


def test_registration_refused_falls_back_and_logs_once(source, caplog):
    ops = FakeOps(refuse="cudaHostRegister: error 999 (refused by a fake)", auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        got = list(stage.wrap(numbered(source, 12)))
    assert [b["i"] for b in got] == list(range(12))
    assert all(torch.equal(b["x"], torch.full((1000,), b["i"])) for b in got)
    # each slot asked once (one refusal costs that slot only), never again per batch
    assert len(ops.register_calls) == len(source.ring.slots) < 12
    assert len(caplog.records) == 1 and "error 999" in caplog.records[0].message
    assert ops.pageable_copies == 0  # staged through pinned memory instead
    stats = stage.stats()
    assert stats["device_registered"] is False and "999" in stats["device_registration_refused"]
    assert stats["device_registration_refusals"] == len(source.ring.slots)
    stage.close()


def test_batches_not_in_the_ring_are_copied_plainly():
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    owned = [{"x": torch.arange(6).reshape(2, 3).t()} for _ in range(3)]  # non-contiguous
    got = list(stage.wrap(iter(owned)))
    assert all(torch.equal(g["x"], o["x"]) for g, o in zip(got, owned, strict=True))
    assert ops.register_calls == []
    stage.close()


# ------------------------------------------------------------------ select


def shard(batch, rank: int = 1, sp: int = 4):
    """The SP-shard example of docs/gpu.md: this rank's quarter of the sequence."""
    x = batch["x"]
    n = x.shape[-1] // sp
    return {"x": x[..., rank * n : (rank + 1) * n], "i": batch["i"]}


def test_select_copies_only_the_shard_from_the_registered_slot(source):
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2, select=shard)
    batches = (source.deliver({"x": torch.arange(3 * 64).reshape(3, 64), "i": i}) for i in range(4))
    got = list(stage.wrap(batches))
    want = torch.arange(3 * 64).reshape(3, 64)[:, 16:32]
    assert all(torch.equal(g["x"], want) for g in got)
    assert stage.stats()["device_bytes"] == 4 * want.numel() * 8  # 1/SP of the bytes
    assert all(ops.from_registered(a) for a, _ in ops.copies)  # 3 runs per batch, no host copy
    assert len(ops.copies) == 4 * 3
    stage.close()


def test_select_applies_on_host_delivery(source):
    stage = device.DeviceStage(None, select=shard)
    got = [b["x"] for b in stage.wrap(numbered(source, 3, size=64))]
    assert [g.tolist() for g in got] == [[i] * 16 for i in range(3)]
    assert view_source(got[0].data_ptr()) is not None  # still a view of the slot, no copy
    assert stage.stats() == {"device": "cpu"}
    del got
    stage.close()


# ------------------------------------------------------------------ config


def test_device_and_prefetch_settings():
    assert Config.from_env({}).device == "cpu" and Config.from_env({}).prefetch == DEFAULT_PREFETCH
    env = {"SHMLOADER_DEVICE": "CUDA:1", "SHMLOADER_PREFETCH": "3"}
    assert (Config.from_env(env).device, Config.from_env(env).prefetch) == ("cuda:1", 3)
    for name, raw in (
        ("SHMLOADER_DEVICE", "gpu"),
        ("SHMLOADER_DEVICE", "cuda:-1"),
        ("SHMLOADER_DEVICE", "cuda:01"),
        ("SHMLOADER_PREFETCH", "0"),
        ("SHMLOADER_PREFETCH", "two"),
    ):
        with pytest.raises(ConfigError, match=name):
            Config.from_env({name: raw})
    with pytest.raises(ConfigError, match="device"):
        Config(device="tpu")
    with pytest.raises(ConfigError, match="prefetch"):
        Config(prefetch=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_auto_is_host_delivery_and_cuda_is_refused():
    assert which.resolve("auto") is None and which.resolve(None, "auto") is None
    assert which.resolve(None) is None and which.resolve(torch.device("cpu")) is None
    with pytest.raises(ConfigError, match=r"torch\.cuda\.is_available"):
        which.resolve("cuda")
    with pytest.raises(ConfigError, match=r"torch\.cuda\.is_available"):
        ShmLoader(lambda: [1], device="cuda:0")
    with pytest.raises(ConfigError, match="select"):
        ShmLoader(lambda: [1], select=3)  # type: ignore[arg-type]


def test_pin_memory_is_reported_once(caplog, monkeypatch):
    monkeypatch.setattr(which, "_warned_pin", False)
    pinned = torch.utils.data.DataLoader(list(range(4)), pin_memory=True)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        assert which.warn_pin_memory(torch.utils.data.DataLoader(list(range(4)))) is False
        assert which.warn_pin_memory(pinned) is True
        assert which.warn_pin_memory(pinned) is False
    assert len(caplog.records) == 1 and "pin_memory=False" in caplog.records[0].message


# ------------------------------------------------------------ ShmLoader


class Stateful:
    """A loader with its own state: how many batches its iterator produced."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.produced = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while self.produced < self.n:
            self.produced += 1
            yield {"x": torch.full((4,), self.produced - 1)}

    def state_dict(self) -> dict:
        return {"produced": self.produced}

    def load_state_dict(self, state: dict) -> None:
        self.produced = state["produced"]


def test_checkpoint_counts_what_the_user_received_not_what_was_prefetched():
    ops = FakeOps(auto=True)
    loader = ShmLoader(lambda: Stateful(10), device=ops, config=Config(prefetch=3))
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    assert state["batches"] == 4 and state["loader"] == {"produced": 4}
    assert loader._loader.produced == 7  # type: ignore[union-attr]  # 4 handed + 3 ahead
    rest = [b["x"][0].item() for b in it]
    assert rest == list(range(4, 10))
    assert loader.state_dict()["batches"] == 10
    assert loader.stats()["device_batches"] == 10
    loader.close()


def sp_shard(batch):
    """A select for ``tests.support.ranks`` batches: each row's first 8 tokens (non-contiguous)."""
    return {"ids": batch["input_ids"][:, :8], "np": batch["np"], "meta": batch["meta"]}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def deliver_on_fake_device(
    rank: int, world: int, *, share: bool, select: bool, fake: bool = True
) -> dict:
    """Rank function: SP group of ``world`` ranks, batches through a fake device."""
    import torch.distributed as dist

    from shmloader._node import views
    from tests.support import ranks

    mapped: list[str] = []  # segments this rank mapped for registration
    real_map = views.map_shared_readonly

    def counting_map(segment):
        mapped.append(segment.name)
        return real_map(segment)

    views.map_shared_readonly = counting_map
    ops = FakeOps(auto=True)
    group = dist.new_group(list(range(world)))
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=12),
        group,
        # every leaf a view of the slot (NOTE [small leaves]), so every copy can read a
        # registered mapping
        config=Config.from_env(enabled=share, small_copy_bytes=0),
        device=ops if fake else None,
        select=sp_shard if select else None,
    )
    batches = [ranks.to_plain(b) for epoch in range(2) for b in loader]
    out = {
        "batches": batches,
        "role": loader.role,
        "stats": loader.stats(),
        "registrations": len(ops.register_calls),
        "segments": mapped,
        "all_registered": all(ops.from_registered(a) for a, _ in ops.copies),
        "slots": loader.stats().get("ring_slots"),
    }
    loader.close()
    out["unregistered"] = ops.registered == {}
    return out


def test_every_role_delivers_the_same_batches_through_the_device_stage():
    shared = run_ranks(deliver_on_fake_device, 3, kwargs={"share": True, "select": False})
    alone = run_ranks(deliver_on_fake_device, 3, kwargs={"share": False, "select": False})
    assert [r["role"] for r in shared] == ["leader", "follower", "follower"]
    for r in shared + alone:
        assert same(r["batches"], alone[0]["batches"])
        assert r["stats"]["device_batches"] == len(alone[0]["batches"]) > 0
        assert r["unregistered"]
    for r in shared:  # every rank copies from its own registered mapping of each slot
        assert r["all_registered"] and r["stats"]["device_registered"]
        # once per slot segment (a slot that grows is a new segment), never per batch
        assert r["registrations"] == len(r["segments"]) == len(set(r["segments"]))
        # slots recycled: far fewer registrations than batches, even with the SLOTS (2)
        # more a loop ahead holds (NOTE [running ahead] in shmloader/_roles/producer.py)
        assert 0 < r["registrations"] <= len(r["batches"]) // 2 + 3
    assert all(r["registrations"] == 0 for r in alone)  # sharing off: nothing to register


def test_select_on_every_path_gives_the_same_shards():
    shared = run_ranks(deliver_on_fake_device, 2, kwargs={"share": True, "select": True})
    alone = run_ranks(deliver_on_fake_device, 2, kwargs={"share": False, "select": True})
    host = run_ranks(
        deliver_on_fake_device, 2, kwargs={"share": True, "select": True, "fake": False}
    )
    assert all(r["stats"]["device"] == "cpu" for r in host)
    for r in shared + alone + host:
        assert same(r["batches"], alone[0]["batches"])
    assert shared[0]["batches"][0]["ids"].shape[1] == 8


def copies_issued_before_asked(rank: int, world: int, *, prefetch: int) -> dict:
    """Rank function: how many batches' copies were issued before the user asked."""
    import time

    import torch.distributed as dist

    from tests.support import ranks

    ops = FakeOps(auto=True)
    group = dist.new_group(list(range(world)))
    loader = ShmLoader(
        ranks.make_loader_factory(2, n=16),  # workers: the leader's loop runs ahead too
        group,
        config=Config.from_env(enabled=True, small_copy_bytes=0, prefetch=prefetch),
        device=ops,
    )

    def issued() -> int:
        return len(ops.events) // 2  # a start and an end event per batch

    def settle_at_least(n: int) -> int:
        deadline = time.monotonic() + 60  # a hang guard, not a bound
        while issued() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # room for a loop that would go past its bound
        return issued()

    it = iter(loader)
    out = {"role": loader.role, "before_first": settle_at_least(1)}
    first = next(it)  # the user holds batch 0 (and never asks for more meanwhile)
    out["holding_first"] = settle_at_least(1 + prefetch)
    out["handed_first"] = len(ops.waits)
    # the numpy leaf stays a view of the slot: keep plain copies, not the batches
    out["values"] = [ranks.to_plain(first)] + [ranks.to_plain(b) for b in it]
    out["stats"] = loader.stats()
    del first
    loader.close()
    out["unregistered"] = ops.registered == {}
    out["unbound_calls"] = ops.unbound_calls
    return out


@pytest.mark.parametrize("prefetch", [1, 3])
def test_a_loop_ahead_issues_the_copies_before_the_user_asks(prefetch):
    """NOTE [copies issued by the loop ahead]: on a rank whose loop runs ahead, the
    copy of the next batch to the device is issued by that loop as soon as it has
    the batch, not at the user's next(): before the first next() of an epoch, and
    ``prefetch`` batches past the one the user holds (no more), on every role."""
    out = run_ranks(copies_issued_before_asked, 2, kwargs={"prefetch": prefetch})
    assert [o["role"] for o in out] == ["leader", "follower"]
    for o in out:
        assert o["before_first"] >= 1, o["role"]  # issued before anything was asked
        assert o["handed_first"] == 1
        assert o["holding_first"] == 1 + prefetch, o["role"]  # ahead by prefetch, bounded
        assert len(o["values"]) == o["stats"]["device_batches"] == 8
        assert o["unregistered"]
        # the loop's thread made the device current before its first CUDA call
        assert o["unbound_calls"] == 0, o["role"]
    assert same(out[0]["values"], out[1]["values"])


def left_and_went_on(rank: int, world: int) -> dict:
    """Rank function: prefetch 1; the user leaves an epoch after one batch, with the count
    of issued batches one too high (what a break racing the loop's issue used to leave),
    and goes on with the next epoch; a close after 60 s (a hang guard) ends a stuck one."""
    import threading

    import torch.distributed as dist

    from tests.support import ranks

    group = dist.new_group(list(range(world)))
    loader = ShmLoader(
        ranks.make_loader_factory(2, n=16),
        group,
        config=Config.from_env(enabled=True, small_copy_bytes=0, prefetch=1),
        device=FakeOps(auto=True),
    )
    for _batch in loader:
        break
    del _batch
    loader._stage.ahead += 1  # type: ignore[union-attr]  # the leftover of such a race
    loader.set_epoch(1)
    guard = threading.Timer(60, loader.close)
    guard.start()
    try:
        got = sum(1 for _ in loader)
    except ShmLoaderError as exc:
        got = str(exc)
    guard.cancel()
    loader.close()
    return {"got": got}


def test_each_iterations_loop_counts_its_own_issued_batches():
    """NOTE [copies issued by the loop ahead]: the count that bounds the loop to
    ``prefetch`` batches starts at 0 with each iteration's loop, so nothing a left
    iteration leaves behind can stop the next one from pulling (prefetch 1: it would
    wait for room forever)."""
    out = run_ranks(left_and_went_on, 2)
    assert [o["got"] for o in out] == [8, 8], out


def left_during_a_select(rank: int, world: int) -> dict:
    """Rank function: prefetch 1; the user holds batch 0 and leaves the iteration while the
    loop ahead is inside ``select`` of batch 1 (0.8 s long: past the role's last check);
    the copies issued, the copies in flight and the device counters once the user left
    (the stage settled) and again once that ``select`` returned."""
    import threading
    import time

    import torch.distributed as dist

    from tests.support import ranks

    inside = threading.Event()

    def select(batch, step):
        if step == 1:
            inside.set()
            time.sleep(0.8)
        return batch

    ops = FakeOps(auto=True)
    loader = ShmLoader(
        ranks.make_loader_factory(2, n=16),
        dist.new_group(list(range(world))),
        config=Config.from_env(enabled=True, small_copy_bytes=0, prefetch=1),
        device=ops,
        select=select,
    )

    def now() -> dict:
        stage = loader._stage
        assert stage is not None
        device = {k: v for k, v in loader.stats().items() if k.startswith("device_")}
        return {"copies": len(ops.copies), "in_flight": len(stage._inflight), **device}

    for _batch in loader:
        assert inside.wait(30)
        break
    del _batch
    left = now()
    time.sleep(1.5)  # the select returns meanwhile
    out = {"left": left, "later": now()}
    loader.close()
    return out


def test_no_copy_is_issued_after_the_user_left_and_the_stage_settled():
    """NOTE [copies issued by the loop ahead]: a loop that passed its last check before the
    user left (it was in ``select``) issues nothing once the stage settled: no copy, none in
    flight holding a slot, the counters final."""
    out = run_ranks(left_during_a_select, 2)
    for rank, o in enumerate(out):
        assert o["left"]["in_flight"] == 0, (rank, o)
        assert o["later"] == o["left"], (rank, o)


class FailsAtBatch(FakeOps):
    """A fake device whose copy of batch ``at`` (counted from 0) raises."""

    def __init__(self, at: int, **kw) -> None:
        super().__init__(**kw)
        self.at = at

    def copy(self, dst, src):
        if len(self.events) // 2 == self.at:  # its start event not recorded yet: batch ``at``
            raise RuntimeError(f"CUDA error: copy of batch {self.at} failed (a fake)")
        super().copy(dst, src)


def copy_error_at_its_step(rank: int, world: int) -> dict:
    """Rank function: the follower's copy of batch 3 fails on its loop's thread, long
    before the user asks for batch 3; every rank's user computes 0.2 s per step."""
    import time

    import torch.distributed as dist

    from tests.support import ranks

    ops = FailsAtBatch(3, auto=True) if rank == 1 else FakeOps(auto=True)
    group = dist.new_group(list(range(world)))
    loader = ShmLoader(
        ranks.make_loader_factory(2, n=16),
        group,
        config=Config.from_env(enabled=True, small_copy_bytes=0),
        device=ops,
    )
    seen, error = 0, None
    try:
        for _batch in loader:
            seen += 1
            time.sleep(0.2)
    except RuntimeError as exc:
        error = str(exc)
    loader.close()
    return {"seen": seen, "error": error}


def test_a_copy_that_fails_on_the_loop_ahead_fails_at_its_own_step():
    """NOTE [copies issued by the loop ahead]: an error of the copy is the loop's error,
    raised after the batches issued before it, at the step it belongs to."""
    out = run_ranks(copy_error_at_its_step, 2)
    assert out[0] == {"seen": 8, "error": None}, out
    assert out[1]["seen"] == 3, out  # batches 0-2, then the error at step 3
    assert "copy of batch 3 failed" in out[1]["error"], out


def test_gpu_benchmark_has_help_and_a_clear_error_without_cuda():
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60, env=env)
    helped = run([sys.executable, "-m", "benchmarks.gpu", "--help"])
    assert helped.returncode == 0 and "--sizes" in helped.stdout
    if not torch.cuda.is_available():
        out = run([sys.executable, "-m", "benchmarks.gpu", "--sizes", "1"])
        assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


@pytest.mark.slow  # a whole program end to end (README: selections)
@pytest.mark.timeout(240)
def test_gpu_benchmark_runs_every_way_on_a_host_stand_in(tmp_path):
    # ``--cpu-smoke``: benchmarks/gpu.py's code paths (ranks, the four ways, the
    # device way through ShmLoader(device=HostOps()), aggregation, targets, outputs)
    # run without a GPU, so the benchmark cannot rot before it first meets one.
    # --warm-ranks: forked from a warm server, not 8 cold interpreters (the ranks'
    # start, as a GPU run makes it, is the cap test's below).
    import json
    import subprocess
    import sys

    from benchmarks.gpu import WAYS, HostOps

    assert isinstance(HostOps(), cudaops.DeviceOps)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = ["--cpu-smoke", "--warm-ranks", "--sizes", "1", "--sp", "2", "--steps", "3"]
    argv += ["--warmup", "1", "--workers", "0", "--gpu-ms", "1", "--timeout", "120"]
    argv += ["--out", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", *argv],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert "--cpu-smoke" in result["machine"]["gpu"] and result["skipped"] == []
    rows = {r["way"]: r for r in result["rows"]}
    assert set(rows) == set(WAYS)
    for row in rows.values():
        assert row["usable_p50"] is not None and row["step_p50"] > 0 and row["h2d_gbs"]
        assert row["bytes_checked"] > 0  # every way's delivered bytes compared with the loader's
    dev = rows["shm_device"]
    assert dev["registered"] is True  # every rank's copies read its registered mapping
    assert 0 < dev["registrations"] <= dev["ring_slots"] * 2  # once per slot per rank
    assert len(result["targets"]) == 4
    assert "figures meaningless" in (tmp_path / "gpu.md").read_text()
    assert (tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_the_device_check_fails_and_says_why_on_a_machine_without_a_gpu(tmp_path):
    """``.ci/device-check`` cannot pass by running nothing."""
    import subprocess
    import sys

    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), ".ci", "device-check"
    )
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    run = subprocess.run([script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "DEVICE CHECK FAILED" in run.stdout and "no CUDA GPU here" in run.stdout
    assert "tests_gpu not run" in run.stdout and "bench not run" in run.stdout
    assert (tmp_path / "summary.txt").read_text() == run.stdout


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``SHML_TEST_MARK=mark``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"SHML_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat", "rb") as st:
                            if st.read().rpartition(b")")[2].split()[0] != b"Z":
                                found.append(int(entry))
            except OSError:
                continue
    return found


def _maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


@pytest.mark.timeout(240)
def test_gpu_benchmark_ranks_stay_under_their_launchers_cap(tmp_path):
    """``.ci/device-check`` caps a part with timeout(1), which signals the part's
    process group: the benchmark's ranks must neither leave it nor outlive it."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "SHML_TEST_MARK": mark}
    argv = ["--cpu-smoke", "--ways", "base", "--sizes", "1", "--sp", "2", "--steps", "100000"]
    argv += ["--warmup", "1", "--workers", "0", "--gpu-ms", "50", "--timeout", "200"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu", *argv, "--out", str(tmp_path)],
        env=env,
        start_new_session=True,  # its own group, as timeout(1) makes one
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # launcher + 2 ranks, each past its start: a rank loads torch only in
        # run_rank, after whatever _rank_main does to its process group
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            running = [pid for pid in _marked(mark) if _maps_torch(pid)]
            if len(running) >= 3:
                break
            time.sleep(0.5)
        assert len(running) >= 3, "the benchmark's ranks never started"
        os.killpg(proc.pid, signal.SIGTERM)  # what timeout(1) sends at the cap
        proc.wait(60)
        deadline = time.monotonic() + 30
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _marked(mark), "benchmark ranks outlived their group's SIGTERM"
    finally:
        for pid in _marked(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, 9)
        proc.wait(30)


def test_cuda_ops_and_the_fake_implement_the_same_seam():
    import inspect

    names = [n for n in vars(cudaops.DeviceOps) if not n.startswith("_")]
    assert {"copy", "record", "query", "wait", "register", "unregister"} <= set(names)
    from benchmarks.gpu import HostOps

    for impl in (cudaops.CudaOps, FakeOps, HostOps):
        for name in names:
            if name == "device":
                continue
            want = inspect.signature(getattr(cudaops.DeviceOps, name)).parameters
            assert inspect.signature(getattr(impl, name)).parameters.keys() == want.keys()


def test_a_copy_that_fails_midway_still_settles_and_unregisters(source):
    class Failing(FakeOps):
        def copy(self, dst, src):
            if len(self.copies) == 1:
                raise RuntimeError("CUDA out of memory (fake)")
            super().copy(dst, src)

    ops = Failing(auto=True)
    stage = device.DeviceStage(ops, prefetch=1)
    batches = (source.deliver({"a": torch.ones(10), "b": torch.zeros(10)}) for _ in range(3))
    with pytest.raises(RuntimeError, match="out of memory"):
        next(stage.wrap(batches))
    gc.collect()
    assert source.held() == 0
    # nothing still counts as reading the slot's mapping: it can go when the slot does
    assert [m.users for m in stage._registrar._maps.values()] == [0]  # type: ignore[union-attr]
    stage.close()
    assert ops.registered == {} and all(ops.mapped_at_unregister)


# ------------------------------------------------- registration: refusals, libraries


def test_one_refused_slot_costs_that_slot_and_not_the_job(source):
    """A refusal (ENOMEM on one large slot) is per slot: slots registered
    before and after it keep their registered copies."""
    refused: list[int] = []

    def refuse_second(address: int, nbytes: int) -> str | None:
        if len(refused) == 0 and len(ops.register_calls) == 2:
            refused.append(address)
            return "cudaHostRegister: error 2 (out of memory)"
        return None

    ops = FakeOps(refuse=refuse_second, auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    got = list(stage.wrap(numbered(source, 24)))
    assert [b["i"] for b in got] == list(range(24))
    assert all(torch.equal(b["x"], torch.full((1000,), b["i"])) for b in got)
    assert refused and len(ops.register_calls) == len(source.ring.slots) >= 3
    stats = stage.stats()
    assert stats["device_registration_refusals"] == 1
    assert stats["device_registered_slots"] == len(source.ring.slots) - 1
    # most batches still read a registered slot; the refused slot's are staged
    assert 0 < stats["device_copies_registered"] < 24
    assert ops.pageable_copies == 0
    stage.close()


def test_where_registration_is_unavailable_nothing_is_registered_and_it_is_said_once(
    source, caplog
):
    why = "cuda:0 cannot register read-only host memory (cudaDevAttrHostRegisterReadOnlySupported)"
    ops = FakeOps(unavailable=why, auto=True)  # the fake asserts register() is never called
    stage = device.DeviceStage(ops, prefetch=2)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        got = list(stage.wrap(numbered(source, 8)))
    assert all(torch.equal(b["x"], torch.full((1000,), b["i"])) for b in got)
    assert ops.register_calls == [] and ops.pageable_copies == 0
    assert len(caplog.records) == 1 and "ReadOnlySupported" in caplog.records[0].message
    assert stage.stats()["device_registration_refused"] == why
    stage.close()


def test_a_failed_unregister_is_never_unmapped(source, caplog):
    """Unmapping a range whose unregister failed lets the address come back
    in a later mapping, which CUDA then refuses as registered already (the
    fake asserts that it never sees that)."""
    ops = FakeOps(auto=True, fail_unregister=True)
    stage = device.DeviceStage(ops, prefetch=1)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        list(stage.wrap(numbered(source, 6)))
        first = dict(ops.registered)
        for size in (50_000, 200_000, 800_000):  # every slot grows: retired, unregistered
            list(stage.wrap(numbered(source, 4, size=size)))
    assert ops.unregister_calls and set(first) <= set(ops.unregister_calls)
    stuck = stage._registrar.stuck  # type: ignore[union-attr]
    assert {m.address for m in stuck} >= set(first)
    assert all(not m.mm.closed for m in stuck), "a still-registered range was unmapped"
    assert stage.stats()["device_unregister_failures"] == len(stuck)
    assert any("stay mapped" in r.message for r in caplog.records)
    stage.close()


@pytest.mark.parametrize(
    "paths, version, want",
    [
        (["/x/libcudart.so.13", "/y/libcudart.so.12.4.127"], "12.4", "/y/libcudart.so.12.4.127"),
        (["/y/libcudart.so.12", "/x/libcudart.so.13.0.48"], "13.0", "/x/libcudart.so.13.0.48"),
        (["/x/libcudart.so.13"], "12.8", None),  # only another runtime: none of torch's
        (["/x/libcudart.so"], "12.8", "/x/libcudart.so"),  # the one, unversioned
        (["/x/libcudart.so", "/y/libcudart.so.11.0"], "12.1", None),
        ([], "12.1", None),
        (["/x/libcudart.so.12"], None, None),  # a CPU build of torch
    ],
)
def test_the_runtime_of_torchs_own_cuda_version_is_picked(paths, version, want):
    assert cudaops.pick_cudart(paths, version) == want


# ------------------------------------------------------------ no pageable copies


def test_small_leaves_are_copied_from_pinned_memory_never_pageable(source):
    """NOTE [no pageable copies]: leaves decoded as owned copies (at most
    SHMLOADER_SMALL_COPY bytes), lazy conj views and leaves made in the
    main process all reach the GPU through one pinned buffer per batch."""
    source.own_below = 64 << 10
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    want = []
    for i in range(4):
        want.append(
            {
                "big": torch.full((100_000,), i, dtype=torch.int32),  # a view of the slot
                "cu_seqlens": torch.tensor([0, 7, 19, i + 20], dtype=torch.int32),  # owned
                "grid_thw": torch.full((3, 3), i, dtype=torch.int64),
                "exactly": torch.full((16 << 10,), i, dtype=torch.int32),  # 64 KiB: owned
            }
        )
    got = list(stage.wrap(iter([source.deliver(b) for b in want])))
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert ops.pageable_copies == 0, "a pageable host-to-device copy on the step's path"
    # one staging buffer per batch (not per leaf), reused: never one allocation per batch
    assert sum(what == "pinned" for what, _ in ops.timeline) <= hostmem.STAGING_BUFFERS < 4
    assert stage.stats()["device_copies_registered"] == 4  # "big" still from the slot
    assert stage.stats()["device_staged_bytes"] == 4 * (16 + 72 + (64 << 10))
    stage.close()


def test_copy_start_is_recorded_right_before_the_first_copy(source):
    """NOTE [copy timing]: registering, allocating and staging happen before
    the start event, so the copy time is the copies' own."""
    source.own_below = 1024
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=1)
    list(stage.wrap(source.deliver({"x": torch.ones(5000), "s": torch.ones(3)}) for _ in range(3)))
    records = [k for k, (what, _) in enumerate(ops.timeline) if what == "record"]
    assert len(records) == 6
    for start, end in zip(records[::2], records[1::2], strict=True):
        between = {what for what, _ in ops.timeline[start + 1 : end]}
        assert between == {"copy"}, ops.timeline[start:end]
        assert ops.timeline[start + 1][0] == "copy"
    stage.close()


def test_close_waits_for_copies_in_flight_before_it_unregisters(source):
    ops = FakeOps()  # copies complete only when the stage synchronises
    stage = device.DeviceStage(ops, prefetch=3)
    it = stage.wrap(numbered(source, 10))
    next(it)
    stage.close()
    kinds = [what for what, _ in ops.timeline]
    assert "unregister" in kinds and "sync" in kinds
    last_sync = max(k for k, what in enumerate(kinds) if what == "sync")
    first_unregister = kinds.index("unregister")
    assert last_sync < first_unregister, "unregistered while a copy could still read the slot"
    assert all(ops.mapped_at_unregister)


# ------------------------------------------------------------ host/device equality


@dataclasses.dataclass(slots=True)
class SlottedBatch:
    """A slots dataclass with a ClassVar: ``__dataclass_fields__`` lists the ClassVar too."""

    kind: typing.ClassVar[str] = "slotted"
    x: torch.Tensor
    z: torch.Tensor


def conj_select(batch):
    return {"z": batch.z.conj(), "neg": batch.z.conj().imag, "x": batch.x[:, ::2], "b": batch}


def test_host_and_device_delivery_give_equal_values(source):
    """Every batch the codec accepts arrives equal on the host and the device
    path: slots dataclasses with a ClassVar, and a select returning lazily
    conjugated or negated views (resolved, not copied as their raw bits)."""
    batches = []
    for i in range(3):
        z = torch.complex(torch.arange(8.0) + i, torch.arange(8.0) - i)
        batches.append(SlottedBatch(x=torch.arange(24.0).reshape(4, 6) * i, z=z))
    host_stage = device.DeviceStage(None, select=conj_select)
    host = list(host_stage.wrap(iter([source.deliver(b) for b in batches])))
    ops = FakeOps(auto=True)
    dev_stage = device.DeviceStage(ops, select=conj_select, prefetch=2)
    on_device = list(dev_stage.wrap(iter([source.deliver(b) for b in batches])))
    for h, d, b in zip(host, on_device, batches, strict=True):
        assert type(d["b"]) is SlottedBatch
        for key in ("z", "neg", "x"):
            assert torch.equal(d[key], h[key].resolve_conj().resolve_neg()), key
        assert torch.equal(d["z"], b.z.conj()) and torch.equal(d["neg"], -b.z.imag)
        assert torch.equal(d["b"].x, b.x) and torch.equal(d["b"].z, b.z)
    assert ops.pageable_copies == 0
    dev_stage.close()
    host_stage.close()


# ------------------------------------------------------------ which GPU


@pytest.mark.parametrize(
    "count, current, local_rank, want",
    [
        (8, 0, None, 0),  # no launcher: the current device
        (8, 3, None, 3),
        (8, 0, "5", 5),  # torchrun, no set_device: this rank's GPU, not cuda:0
        (8, 5, "5", 5),  # torchrun after set_device(LOCAL_RANK)
        (8, 0, "0", 0),
        (1, 0, "5", 0),  # one visible GPU per rank (CUDA_VISIBLE_DEVICES)
        (8, 2, "9", 2),  # LOCAL_RANK cannot index; the script chose
        (8, 0, "x", 0),  # not a number: no launcher's
        (2, 1, "-1", 1),
    ],
)
def test_cuda_is_this_ranks_gpu_under_torchrun(count, current, local_rank, want):
    env = {} if local_rank is None else {"LOCAL_RANK": local_rank}
    cuda = FakeCuda(count=count, current=current)
    for spec in ("cuda", "auto", torch.device("cuda")):
        assert which.resolve(spec, cuda=cuda, environ=env) == torch.device("cuda", want)
    last = count - 1  # an explicit index is taken as it is
    assert which.resolve(f"cuda:{last}", cuda=cuda, environ=env) == torch.device("cuda", last)


@pytest.mark.parametrize(
    "local_rank, current, want",
    [
        ("0", 2, 2),  # Lightning Trainer(devices=[2, 3]): its DDP children set_device(2)/(3)
        ("1", 3, 3),
        ("0", 4, 4),  # set_device(local_rank + 4): the second half of the node
        ("3", 7, 7),
        ("5", 3, 3),  # any current device other than 0 is the script's choice
        ("5", 0, 5),  # current 0: what a script that set nothing sees -> cuda:$LOCAL_RANK
    ],
)
def test_a_current_device_other_than_0_is_the_scripts_choice(local_rank, current, want):
    """NOTE [which GPU]: the script's (or its framework's) device choice wins."""
    cuda = FakeCuda(count=8)
    cuda.set_device(current)
    assert which.resolve("cuda", cuda=cuda, environ={"LOCAL_RANK": local_rank}).index == want
    # an explicit index is never second-guessed
    assert which.resolve("cuda:1", cuda=cuda, environ={"LOCAL_RANK": local_rank}).index == 1


def test_a_local_rank_beyond_the_visible_gpus_is_refused_where_it_cannot_be_resolved():
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=9 and this rank sees only 8"):
        which.resolve("cuda", cuda=FakeCuda(count=8), environ={"LOCAL_RANK": "9"})
    with pytest.raises(ConfigError, match="index below 8"):
        which.resolve("cuda:8", cuda=FakeCuda(count=8), environ={})
    off = FakeCuda(available=False)
    assert which.resolve("auto", cuda=off, environ={"LOCAL_RANK": "1"}) is None
    with pytest.raises(ConfigError, match=r"is_available"):
        which.resolve("cuda", cuda=off, environ={})


def test_pin_memory_warning_only_where_the_pin_thread_copies(caplog, monkeypatch):
    """With the worker pool the leader's DataLoader yields slot references,
    which torch's pin thread passes through: nothing is pinned, nothing to say."""
    monkeypatch.setattr(which, "_warned_pin", False)
    pinned = torch.utils.data.DataLoader(list(range(4)), pin_memory=True)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        assert which.warn_pin_memory(pinned, pool=object()) is False
        assert caplog.records == []
        assert which.warn_pin_memory(pinned, pool=None) is True


def test_without_torchs_own_runtime_nothing_is_registered(monkeypatch):
    """torch.cuda.cudart() cannot clear a refused registration's pending error
    (torch's next kernel launch would raise it): without a ``libcudart`` of
    torch's CUDA version mapped, nothing is registered at all."""
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(cudaops, "_mapped_cudarts", lambda: ["/other/libcudart.so.99"])
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    rt = cudaops._Cudart(torch.device("cuda", 0))
    assert rt.lib is None
    assert rt.unavailable is not None and "12.4" in rt.unavailable
    assert "cannot clear" in rt.unavailable
    assert rt.register(4096, 4096) == rt.unavailable  # never reaches a CUDA call


# ------------------------------------------------------------ containers


class BatchEncodingLike(collections.UserDict):
    """What Hugging Face's ``BatchEncoding`` is: a ``UserDict`` with state of its own."""

    def __init__(self, data=None, encodings=None) -> None:
        super().__init__(data)
        self._encodings = encodings

    @property
    def encodings(self):
        return self._encodings


class ReadOnlyMapping(collections.abc.Mapping):
    """A ``Mapping`` that is no dict and cannot be written."""

    def __init__(self, data) -> None:
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Pair(tuple):
    """A tuple subclass that is no namedtuple."""


Point = collections.namedtuple("Point", "a b")


@dataclasses.dataclass
class Box:
    x: torch.Tensor
    note: str = "n"


def every_container(batch):
    """A ``select`` returning every kind of container ``collections.abc`` knows."""
    x = batch["x"]
    return {
        "ordered": collections.OrderedDict([("b", x[:10]), ("a", x[10:20])]),
        "default": collections.defaultdict(list, {"x": x[:5]}),
        "encoding": BatchEncodingLike({"ids": x[:8], "mask": x[8:16]}, encodings=["e"]),
        "readonly": ReadOnlyMapping({"x": x[:3]}),
        "proxy": types.MappingProxyType({"x": x[:2]}),
        "tuple": (x[:1], x[1:2]),
        "pair": Pair((x[:1], x[2:3])),
        "named": Point(x[:4], "text"),
        "userlist": collections.UserList([x[:2], 1]),
        "deque": collections.deque([x[:3]]),
        "box": Box(x[:6]),
        "untouched": ("no", "tensors", 1),
        "i": batch["i"],
    }


def test_every_container_reaches_the_device_as_its_own_type(source):
    """NOTE [containers on the device]: Mappings that are no dict (``BatchEncoding``),
    ``OrderedDict``/``defaultdict``, Sequences, tuple subclasses, namedtuples and
    dataclasses come back as their own type with every tensor on the device."""
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2, select=every_container)
    batches = (source.deliver({"x": torch.arange(100) + 1000 * i, "i": i}) for i in range(3))
    got = list(stage.wrap(batches))
    on_device = {t.data_ptr() for t in ops.handed}

    def check(t, want):
        assert isinstance(t, torch.Tensor) and t.data_ptr() in on_device, "left on the host"
        assert torch.equal(t, want)

    for i, b in enumerate(got):
        x = torch.arange(100) + 1000 * i
        assert type(b["ordered"]) is collections.OrderedDict and list(b["ordered"]) == ["b", "a"]
        check(b["ordered"]["b"], x[:10])
        check(b["ordered"]["a"], x[10:20])
        assert type(b["default"]) is collections.defaultdict
        assert b["default"].default_factory is list
        check(b["default"]["x"], x[:5])
        assert type(b["encoding"]) is BatchEncodingLike and b["encoding"].encodings == ["e"]
        check(b["encoding"]["ids"], x[:8])
        check(b["encoding"]["mask"], x[8:16])
        assert type(b["readonly"]) is ReadOnlyMapping
        check(b["readonly"]["x"], x[:3])
        assert type(b["proxy"]) is types.MappingProxyType
        check(b["proxy"]["x"], x[:2])
        assert type(b["tuple"]) is tuple
        check(b["tuple"][1], x[1:2])
        assert type(b["pair"]) is Pair
        check(b["pair"][1], x[2:3])
        assert type(b["named"]) is Point and b["named"].b == "text"
        check(b["named"].a, x[:4])
        assert type(b["userlist"]) is collections.UserList and b["userlist"][1] == 1
        check(b["userlist"][0], x[:2])
        assert type(b["deque"]) is collections.deque
        check(b["deque"][0], x[:3])
        assert type(b["box"]) is Box and b["box"].note == "n"
        check(b["box"].x, x[:6])
        assert b["untouched"] == ("no", "tensors", 1) and b["i"] == i
    assert ops.pageable_copies == 0
    stage.close()


def test_what_the_codec_delivers_arrives_in_the_same_containers_on_the_device(source):
    """Host and device delivery agree on the container types of every batch the
    codec accepts (whatever containers it delivers: the device walk follows)."""
    candidates = [
        collections.OrderedDict([("b", torch.arange(4)), ("a", torch.ones(3))]),
        collections.defaultdict(list, {"x": torch.arange(5)}),
        BatchEncodingLike({"ids": torch.arange(6)}, encodings=["e"]),  # refused: its state
        BatchEncodingLike({"ids": torch.arange(6)}),  # a padding collator's: no encodings
        Point(torch.arange(3), "text"),
        Box(torch.arange(7)),
        [torch.arange(2), (torch.ones(2), "s")],
        {"nested": {"x": torch.arange(3)}, "t": (torch.zeros(1),)},
    ]
    delivered = 0
    for batch in candidates:
        try:
            host = source.deliver(batch)
        except Exception:  # a container this codec does not encode: nothing to deliver
            continue
        stage = device.DeviceStage(FakeOps(auto=True), prefetch=1)
        (got,) = list(stage.wrap(iter([source.deliver(batch)])))
        assert same_types(got, host), (type(got), type(host))
        delivered += 1
        del host, got
        stage.close()
    # mappings of their own type, dicts, lists, tuples, namedtuples, dataclasses at least
    assert delivered >= 6


def same_types(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, collections.abc.Mapping):
        return list(a) == list(b) and all(same_types(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return all(
            same_types(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    return a == b


class OrderedPadding:
    """A padding collator whose batch is an ``OrderedDict``, its keys in reverse."""

    def __init__(self, tokenizer) -> None:
        from transformers import DataCollatorWithPadding

        self.pad = DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def __call__(self, features):
        return collections.OrderedDict(reversed(list(self.pad(features).items())))


def collated_mappings_on_fake_device(rank: int, world: int) -> dict:
    """Rank function: transformers' ``BatchEncoding`` and an ``OrderedDict`` through
    ``ShmLoader(device=FakeOps)``, sharing on (leader, follower) and off, and the
    same loader plain (what torch alone delivers)."""
    import torch.distributed as dist
    from transformers import DataCollatorWithPadding

    from tests.multirank.test_mappings import Sentences, tiny_tokenizer

    group = dist.new_group(list(range(world)))
    tok = tiny_tokenizer()
    ds = Sentences(tok, n=9)
    collators = {
        "padding": DataCollatorWithPadding(tok, return_tensors="pt"),
        "ordered": OrderedPadding(tok),
    }
    out: dict = {}
    for name, collate in collators.items():

        def make(collate=collate) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=collate)

        out[(name, "plain")] = [
            (type(b).__qualname__, list(b), {k: v.clone() for k, v in b.items()}) for b in make()
        ]
        for share in (True, False):
            ops = FakeOps(auto=True)
            loader = ShmLoader(make, group, config=Config.from_env(enabled=share), device=ops)
            batches = []
            for b in loader:
                handed = {t.data_ptr() for t in ops.handed}
                on_device = [k for k, v in b.items() if v.data_ptr() in handed]
                batches.append(
                    (type(b).__qualname__, list(b), {k: v.clone() for k, v in b.items()}, on_device)
                )
            out[(name, share)] = {"role": loader.role, "batches": batches}
            loader.close()
    return out


@pytest.mark.timeout(180)
def test_collated_mappings_reach_the_device_as_their_own_type_on_every_role():
    """NOTE [containers on the device] end to end: a ``DataCollatorWithPadding`` batch
    (``BatchEncoding``) and an ``OrderedDict`` arrive as their own type, keys in
    order, every tensor on the (fake) device, equal to plain torch's batches, on the
    leader, a follower and with sharing off (where ``device=`` once left a
    ``BatchEncoding``'s tensors on the host and made an ``OrderedDict`` a dict)."""
    pytest.importorskip("transformers")
    out = run_ranks(collated_mappings_on_fake_device, 2, timeout=150)
    kinds = {"padding": "BatchEncoding", "ordered": "OrderedDict"}
    for rank, o in enumerate(out):
        for name, kind in kinds.items():
            plain = o[(name, "plain")]
            assert len(plain) == 3 and all(p[0] == kind for p in plain)
            assert plain[0][1][0] == ("idx" if name == "ordered" else "input_ids")
            for share, role in ((True, ("leader", "follower")[rank]), (False, "local")):
                run = o[(name, share)]
                assert run["role"] == role, (rank, name, share)
                assert len(run["batches"]) == len(plain), (rank, name, share)
                for (got_kind, keys, values, on_device), (_, want_keys, want) in zip(
                    run["batches"], plain, strict=True
                ):
                    where = (rank, name, share, keys)
                    assert got_kind == kind and keys == want_keys, where
                    assert on_device == keys, f"{where}: left on the host: {on_device}"
                    for k in keys:
                        assert torch.equal(values[k], want[k]), (where, k)


# ------------------------------------------------------------ pinned staging


def test_pinned_staging_is_bounded_reused_and_released_when_batches_shrink():
    """NOTE [pinned staging]: batches no slot holds (sharing off) are staged through
    at most STAGING_BUFFERS reused buffers sized from the batches seen, released
    (unpinned) when the batches shrink; never one allocation per batch."""
    ops = FakeOps(deferred=True)  # a copy lands only when its event completes
    stage = device.DeviceStage(ops, prefetch=2)
    sizes = [1 << 20] * 12 + [8 << 20] * 12 + [64 << 10] * 12

    def batches():
        for i, n in enumerate(sizes):
            yield {"x": torch.full((n // 4,), i, dtype=torch.int32)}  # owned: staged

    locked = []
    for k, batch in enumerate(stage.wrap(batches())):
        # a staging buffer rewritten while a copy still read it would show here
        assert torch.equal(batch["x"], torch.full((sizes[k] // 4,), k, dtype=torch.int32)), k
        locked.append(ops.locked)
        assert stage.stats()["device_staging_bytes"] == ops.locked
        if k % 3 == 2:
            ops.complete()  # the DMA catches up now and then, not at once
        del batch
    allocations = sum(what == "pinned" for what, _ in ops.timeline)
    assert allocations <= 3 * hostmem.STAGING_BUFFERS < len(sizes)
    assert max(locked) <= hostmem.STAGING_BUFFERS * hostmem.staging_capacity(8 << 20)
    small = hostmem.staging_capacity(64 << 10)
    stats = stage.stats()
    assert stats["device_staging_bytes"] == ops.locked <= hostmem.STAGING_BUFFERS * small
    assert ops.unpinned, "the 8 MiB buffers must go once the batches shrank"
    assert stats["device_staging_peak_bytes"] == max(locked)
    assert stats["device_staged_bytes"] == sum(sizes)
    assert stats["device_locked_bytes"] == ops.locked  # nothing registered with sharing off
    assert ops.pageable_copies == 0
    stage.close()
    assert ops.locked == 0 and stage.stats()["device_locked_bytes"] == 0


def test_leaves_already_pinned_are_copied_as_they_are():
    """A leaf pinned already (``DataLoader(pin_memory=True)``) is not copied again."""
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    batches = [{"x": ops.pin(torch.full((1000,), i)), "small": torch.tensor([i])} for i in range(5)]
    got = list(stage.wrap(iter(batches)))
    for i, b in enumerate(got):
        assert torch.equal(b["x"], torch.full((1000,), i)) and b["small"].tolist() == [i]
    assert ops.copies_from_pinned_leaves == 5 and ops.pageable_copies == 0
    stats = stage.stats()
    assert stats["device_pinned_leaf_bytes"] == 5 * 8000
    assert stats["device_staged_bytes"] == 5 * 8  # only the unpinned leaf is staged
    stage.close()


def test_locked_bytes_count_registered_slots_and_staging(source):
    source.own_below = 1024  # "s" is decoded as an owned copy: staged
    ops = FakeOps(auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    batches = (source.deliver({"x": torch.ones(5000), "s": torch.ones(3)}) for _ in range(6))
    assert len(list(stage.wrap(batches))) == 6
    stats = stage.stats()
    assert stats["device_registered_bytes"] == sum(ops.registered.values()) > 0
    assert stats["device_staging_bytes"] == ops.locked > 0
    assert stats["device_locked_bytes"] == sum(ops.registered.values()) + ops.locked
    stage.close()
    stats = stage.stats()
    assert stats["device_locked_bytes"] == 0 and ops.locked == 0 and ops.registered == {}


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_copies_in_flight_are_bounded_and_so_are_the_slots_they_hold(source, prefetch):
    """NOTE [copies in flight]: a DMA that never catches up by itself does not
    make the ring grow: at most prefetch + 1 copies are in flight."""
    ops = FakeOps(deferred=True)  # copies complete only when the stage waits for them
    stage = device.DeviceStage(ops, prefetch=prefetch)
    held = []
    for batch in stage.wrap(numbered(source, 20)):
        held.append(batch)
        assert len(stage._inflight) <= prefetch + 1
    assert len(source.ring.slots) <= prefetch + 1
    assert stage.stats()["device_copy_waits"] > 0
    for i, batch in enumerate(held):
        assert torch.equal(batch["x"], torch.full((1000,), i))
    stage.close()


def test_memory_stays_bounded_over_epochs_of_varying_sizes(source):
    """Registered mappings follow the ring (retired slots unregistered), staging
    stays within its bound, over several epochs of batches of varying size."""
    source.own_below = 4096  # the small leaf is staged every batch
    ops = FakeOps(deferred=True)
    stage = device.DeviceStage(ops, prefetch=2)
    g = torch.Generator().manual_seed(0)
    # small, then large (slots grow), then small for long enough that the ring shrinks
    for epoch, base in enumerate([1000, 400_000, 1000, 50_000]):
        order = [base + int(n) for n in torch.randint(0, base // 4, (12,), generator=g)]
        batches = (
            source.deliver({"x": torch.full((n,), k, dtype=torch.int32), "s": torch.ones(4) * k})
            for k, n in enumerate(order)
        )
        for k, batch in enumerate(stage.wrap(batches)):
            assert torch.equal(batch["x"], torch.full((order[k],), k, dtype=torch.int32))
            assert torch.equal(batch["s"], torch.ones(4) * k)
            stats = stage.stats()
            live = [s for s in source.ring.slots if s.state != SlotState.RETIRED]
            assert stats["device_registered_slots"] <= len(live) + stage.prefetch + 1
            assert ops.locked <= hostmem.STAGING_BUFFERS * hostmem.staging_capacity(64 * 4)
            if k % 2:
                ops.complete()
        live = {s.segment.name for s in source.ring.slots if s.state != SlotState.RETIRED}
        mapped = {m.segment.name for m in stage._registrar._maps.values()}  # type: ignore[union-attr]
        assert mapped <= live, f"epoch {epoch}: a retired slot is still registered"
        assert len(ops.registered) == stage._registrar.live  # type: ignore[union-attr]
    assert stage._registrar.unregistrations > 0  # type: ignore[union-attr]
    stage.close()
    assert ops.registered == {} and ops.locked == 0


# ------------------------------------------------------------ libcudart


@pytest.mark.parametrize(
    "paths, why",
    [
        (["/usr/lib/libcudart.so.12.4.127 (deleted)"], "replaced or removed on disk"),
        (["/nonexistent/shmloader-test/libcudart.so.12"], "could not be bound"),
    ],
)
def test_a_runtime_that_cannot_be_bound_means_staging_with_one_warning(
    monkeypatch, caplog, source, paths, why
):
    """NOTE [libcudart]: a library file replaced since it was loaded (the path in
    /proc/self/maps ends in " (deleted)") or one ctypes cannot load is no crash."""
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(cudaops, "_mapped_cudarts", lambda: paths)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    rt = cudaops._Cudart(torch.device("cuda", 0))
    assert rt.lib is None and rt.unavailable is not None and why in rt.unavailable
    assert rt.register(4096, 4096) == rt.unavailable  # never reaches a CUDA call
    ops = FakeOps(unavailable=rt.unavailable, auto=True)
    stage = device.DeviceStage(ops, prefetch=2)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        got = list(stage.wrap(numbered(source, 6)))
    assert all(torch.equal(b["x"], torch.full((1000,), b["i"])) for b in got)
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    assert ops.register_calls == [] and ops.pageable_copies == 0
    stage.close()


# ------------------------------------------------------------ select: which step


def test_select_is_told_the_step_it_is_for_on_every_path():
    """NOTE [select]: on a device select runs up to prefetch batches before the
    user's next(); a select with a ``step`` parameter is told which batch's step
    it runs for, on every path and after a resume."""
    for dev in (FakeOps(auto=True), None):
        seen: list[tuple[int, int, int]] = []  # (step, batch value, batches the user had)
        received = []

        def select(batch, step, seen=seen, received=received):
            seen.append((step, int(batch["x"][0]), len(received)))
            return batch

        loader = ShmLoader(
            lambda: Stateful(10), device=dev, select=select, config=Config(prefetch=3)
        )
        it = iter(loader)
        for _ in range(4):
            received.append(next(it))
        state = loader.state_dict()
        loader.close()
        assert [(s, v) for s, v, _ in seen[:4]] == [(k, k) for k in range(4)]
        if dev is not None:  # pulled ahead: before the user had batch k - prefetch
            assert [had for *_, had in seen] == [max(0, k - 3) for k in range(len(seen))]
        else:  # at the user's next(): after every batch before it
            assert [had for *_, had in seen] == [0, 1, 2, 3]
        seen.clear()
        resumed = ShmLoader(
            lambda: Stateful(10), device=dev, select=select, config=Config(prefetch=3)
        )
        resumed.load_state_dict(state)
        assert [int(b["x"][0]) for b in resumed] == list(range(4, 10))
        assert [(s, v) for s, v, _ in seen] == [(k, k) for k in range(4, 10)]
        resumed.close()


# ------------------------------------------------------------ errors, streams


def test_a_sticky_cuda_error_does_not_mask_the_original_exception(source):
    """NOTE [errors in the copy]: after a sticky error every CUDA call fails,
    recording the end event in the copy's cleanup too."""

    class Sticky(FakeOps):
        broken = False

        def copy(self, dst, src):
            if len(self.copies) == 1:
                self.broken = True
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().copy(dst, src)

        def _sticky(self):
            if self.broken:
                raise RuntimeError("CUDA error: an illegal memory access (sticky, from an event)")

        def record(self):
            self._sticky()
            return super().record()

        def query(self, event):
            self._sticky()
            return super().query(event)

        def synchronize(self, event):
            self._sticky()
            super().synchronize(event)

    ops = Sticky(auto=True)
    stage = device.DeviceStage(ops, prefetch=1)
    batches = (source.deliver({"a": torch.ones(10), "b": torch.zeros(10)}) for _ in range(3))
    with pytest.raises(RuntimeError, match="was encountered") as info:
        next(stage.wrap(batches))
    assert any("end event" in note for note in getattr(info.value, "__notes__", []))
    del info
    gc.collect()
    assert source.held() == 0  # the failed batch's slot was let go
    stage.close()


def test_the_consumer_sees_the_copied_bytes_only_through_the_stages_wait(source):
    """Stream safety on the fake: copies land at their event; a consumer reading
    a batch at once sees its bytes because the stage made its stream wait. The
    control run without that wait must see stale bytes, else this proves nothing."""

    def run(wait: bool) -> list[bool]:
        ops = FakeOps(deferred=True)
        if not wait:
            ops.wait = lambda event: None  # type: ignore[method-assign]
        stage = device.DeviceStage(ops, prefetch=2)
        ok = [
            torch.equal(b["x"], torch.full((1000,), b["i"]))
            for b in stage.wrap(numbered(source, 6))
        ]
        stage.close()
        return ok

    assert all(run(wait=True))
    assert not all(run(wait=False)), "the control run read no stale byte: the check is blind"

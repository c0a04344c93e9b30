"""The device stage without a GPU: a fake device drives prefetch, streams and release.

``FakeOps`` (``tests.fake_device``) implements ``shmloader.device.DeviceOps``
on the host: its "device" memory is host tensors and its events complete when
the test says so (``complete()``), so every rule of the stage is observable here: prefetch
depth and order, the consumer waiting on the copy's event, slots released when
the copy completes (not when the user drops the batch), errors and stops
through the prefetcher, close with copies in flight, ``select``, registration
once per slot (counted), unregister before unmap, and the fallback when
registration is refused. Batches come from a real ring (``RingSource``): the
stage finds slots, maps and "registers" them exactly as on a GPU rank.
"""

from __future__ import annotations

import functools
import gc
import logging
import os

import numpy as np
import pytest
import torch

from shmloader import Config, ShmLoader, codec, device
from shmloader.config import DEFAULT_PREFETCH
from shmloader.errors import ConfigError, ShmLoaderError
from shmloader.ring import RingWriter, SlotState, new_token, private_view, view_source
from tests.fake_device import FakeOps
from tests.harness import run_ranks

# ----------------------------------------------------------------- sources


class RingSource:
    """A ring in this process; each batch is decoded from a private view of a slot.

    That is what every rank's loop yields (NOTE [slot lifetime]): the view
    HOLDS its slot until it dies.
    """

    def __init__(self) -> None:
        self.ring = RingWriter(new_token(), frozenset(), {"test": True}, self_rank=0)
        self.seq = 0
        self.released: list[int] = []

    def deliver(self, batch):
        enc = codec.encode(batch)
        slot = self.ring.acquire(enc.nbytes)
        codec.write_payload(enc, slot.payload)
        self.ring.publish(slot, self.seq, enc.nbytes, 0)
        release = functools.partial(self._release, slot.index, slot.gen, self.seq)
        self.seq += 1
        return codec.decode(enc.meta, private_view(slot.segment, enc.nbytes, release))

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
    assert len(ops.register_calls) == 1  # refused once: never asked again
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "error 999" in caplog.records[0].message
    stats = stage.stats()
    assert stats["device_registered"] is False and "999" in stats["device_registration_refused"]
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
    """The SP-shard example of the README: this rank's quarter of the sequence."""
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
    assert device.resolve("auto") is None and device.resolve(None, "auto") is None
    assert device.resolve(None) is None and device.resolve(torch.device("cpu")) is None
    with pytest.raises(ConfigError, match=r"torch\.cuda\.is_available"):
        device.resolve("cuda")
    with pytest.raises(ConfigError, match=r"torch\.cuda\.is_available"):
        ShmLoader(lambda: [1], device="cuda:0")
    with pytest.raises(ConfigError, match="select"):
        ShmLoader(lambda: [1], select=3)  # type: ignore[arg-type]


def test_pin_memory_is_reported_once(caplog, monkeypatch):
    monkeypatch.setattr(device, "_warned_pin", False)
    pinned = torch.utils.data.DataLoader(list(range(4)), pin_memory=True)
    with caplog.at_level(logging.WARNING, logger="shmloader.device"):
        assert device.warn_pin_memory(torch.utils.data.DataLoader(list(range(4)))) is False
        assert device.warn_pin_memory(pinned) is True
        assert device.warn_pin_memory(pinned) is False
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
    """A select for ``tests.ranks`` batches: the first 8 tokens of every row (non-contiguous)."""
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

    from shmloader import ring
    from tests import ranks

    mapped: list[str] = []  # segments this rank mapped for registration
    real_map = ring.map_shared_readonly

    def counting_map(segment):
        mapped.append(segment.name)
        return real_map(segment)

    ring.map_shared_readonly = counting_map
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
        assert 0 < r["registrations"] <= len(r["batches"]) // 2  # slots recycled
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


@pytest.mark.timeout(240)
def test_gpu_benchmark_runs_every_way_on_a_host_stand_in(tmp_path):
    # ``--cpu-smoke``: benchmarks/gpu.py's code paths (ranks, the four ways, the
    # device way through ShmLoader(device=HostOps()), aggregation, targets, outputs)
    # run without a GPU, so the benchmark cannot rot before it first meets one.
    import json
    import subprocess
    import sys

    from benchmarks.gpu import WAYS, HostOps

    assert isinstance(HostOps(), device.DeviceOps)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = ["--cpu-smoke", "--sizes", "1", "--sp", "2", "--steps", "3", "--warmup", "1"]
    argv += ["--workers", "0", "--gpu-ms", "1", "--timeout", "120", "--out", str(tmp_path)]
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
    dev = rows["shm_device"]
    assert dev["registered"] is True  # every rank's copies read its registered mapping
    assert 0 < dev["registrations"] <= dev["ring_slots"] * 2  # once per slot per rank
    assert len(result["targets"]) == 4
    assert "figures meaningless" in (tmp_path / "gpu.md").read_text()
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_cuda_ops_and_the_fake_implement_the_same_seam():
    import inspect

    names = [n for n in vars(device.DeviceOps) if not n.startswith("_")]
    assert {"copy", "record", "query", "wait", "register", "unregister"} <= set(names)
    from benchmarks.gpu import HostOps

    for impl in (device.CudaOps, FakeOps, HostOps):
        for name in names:
            if name == "device":
                continue
            want = inspect.signature(getattr(device.DeviceOps, name)).parameters
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

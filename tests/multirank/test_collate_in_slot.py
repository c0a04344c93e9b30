"""Collating straight into the slot (NOTE [collate into the slot] in ``collate``).

Inside a DataLoader worker, ``default_collate`` gets its output memory from
``UntypedStorage._new_shared``; the worker writer answers that call from the
slot it claimed, so the stacked batch is already where the payload goes and
the codec keeps it in place (NOTE [placed leaves] in ``codec``). These tests
pin that it happens (the bytes the leader is told were made in place), that
batches stay bit-identical to a plain DataLoader whatever the collate does
with its output (views, aliases, temporaries, growth), and that the
allocator never leaks out of its collate and thread.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from shmloader import Config
from shmloader._proto import codec
from shmloader._workers import collate as worker
from tests.multirank.test_sharing import assert_same
from tests.multirank.test_worker_writer import Leader, _owned

pytestmark = pytest.mark.timeout(180)


class Rows(Dataset):
    """Samples of a few dtypes, numpy included (default_collate makes it a tensor)."""

    def __init__(self, n: int = 12, width: int = 3000) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {
            "x": torch.randn(self.width, generator=g),
            "ids": torch.randint(0, 50_000, (self.width // 2,), generator=g, dtype=torch.int64),
            "np": np.arange(self.width // 4, dtype=np.int16) + i,
            "label": i,
            "drawn": torch.rand(2),  # the worker's own RNG: seeds must be unchanged
        }


def views_collate(samples):
    """default_collate, then views and aliases of its output, and a discarded temporary."""
    default_collate(samples)  # a temporary: made in the slot too, never part of the batch
    b = default_collate(samples)
    x = b["x"]
    return {
        "x": x,
        "x_again": x,  # the same object: one leaf
        "flat": x.view(-1),  # another view of the same bytes: copied, not placed twice
        "strided": x[:, ::2],  # non-contiguous: copied
        "tail": x[1:],  # a view at an unaligned offset of the same bytes
        "ids": b["ids"],
        "np": b["np"],
        "label": b["label"],
        "drawn": b["drawn"],
    }


def _tensor_bytes(batch) -> int:
    """Bytes of the distinct storages default_collate made for ``batch``."""
    seen, total = set(), 0
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            total += v.untyped_storage().nbytes()
    return total


def _run(loader: DataLoader, share: bool, in_slot: bool = True) -> tuple[list, list[int]]:
    torch.manual_seed(99)
    leader = Leader(loader, collate_in_slot=in_slot) if share else None
    out, placed = [], []
    try:
        for item in loader:
            if leader is None:
                out.append(_owned(item))
                continue
            out.append(leader.deliver(item))
            placed.append(leader.pool.last_placed)
        if leader is not None:
            states = [leader.pool.state(i) for i in range(leader.pool.spec.total)]
            assert set(states) == {"EMPTY"}, states
    finally:
        if leader is not None:
            leader.close()
    return out, placed


#: The plain DataLoader the shared runs are compared with starts its workers by
#: fork: the batches do not depend on how a plain worker starts (each is seeded
#: from the main process's base seed), and a spawned one imports torch again
#: (about 1.3 s of CPU each, two per reference).
PLAIN = "fork"


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_default_collate_writes_the_batch_in_place(context):
    def make(context: str = context):
        return DataLoader(Rows(), batch_size=3, num_workers=2, multiprocessing_context=context)

    plain, _ = _run(make(PLAIN), share=False)
    shared, placed = _run(make(), share=True)
    assert_same(shared, plain)
    # The samples' own bytes size the slot before the collate runs: every
    # stacked tensor of every batch is made in its slot, none copied; only the
    # labels (torch.tensor of Python ints, not shared memory) are copied.
    stacked = _tensor_bytes(plain[0]) - plain[0]["label"].nbytes
    assert placed == [stacked] * len(placed), placed


def test_switched_off_copies_every_batch():
    def make(context: str = "spawn"):
        return DataLoader(Rows(), batch_size=3, num_workers=2, multiprocessing_context=context)

    plain, _ = _run(make(PLAIN), share=False)
    shared, placed = _run(make(), share=True, in_slot=False)  # travels in the PoolSpec
    assert_same(shared, plain)
    assert placed == [0] * len(placed)
    config = Config.from_env({"SHMLOADER_COLLATE_IN_SLOT": "0"})
    assert not config.collate_in_slot and Config.from_env({}).collate_in_slot


def test_views_aliases_and_temporaries_arrive_as_without_sharing():
    def make():
        return DataLoader(
            Rows(), batch_size=4, num_workers=2, collate_fn=views_collate, prefetch_factor=2
        )

    plain, _ = _run(make(), share=False)
    shared, placed = _run(make(), share=True)
    assert_same(shared, plain)
    # A worker's first batch: the temporary took the slot sized from the samples,
    # the batch itself went to torch's memory and was copied (into a grown slot,
    # sized for the layout it would have had). From then on: made in place.
    first = plain[0]
    in_place = sum(first[k].nbytes for k in ("x", "ids", "np", "drawn"))
    assert placed[:2] == [0, 0], placed
    assert placed[2:] == [in_place] * (len(placed) - 2), placed


class Growing(Dataset):
    """Every batch larger than any before it."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1000 * 4**i,), float(i))


def quadruple_collate(samples):
    """A batch 4x the samples' bytes: larger than the slot claimed from their size."""
    return default_collate([torch.cat([s, s, s, s]) for s in samples])


def test_a_batch_that_outgrows_its_slot_is_copied_into_a_grown_one():
    def make():
        return DataLoader(Growing(), batch_size=1, num_workers=1, collate_fn=quadruple_collate)

    plain, _ = _run(make(), share=False)
    shared, placed = _run(make(), share=True)
    assert_same(shared, plain)
    # each batch is 4x the samples and 4x its predecessor: once past the pool's
    # smallest slot it never fits the slot claimed for it, so the allocator falls
    # back and the batch is copied into a grown generation
    assert placed[-4:] == [0] * 4, placed


def boom_collate(samples):
    out = default_collate(samples)
    if int(out["label"][0]) == 6:
        raise ValueError("collate failed on purpose")
    return out


def test_a_collate_error_gives_the_claimed_slot_back():
    # the last batch fails: no later task claims a slot; the worker stays alive
    loader = DataLoader(
        Rows(n=9), batch_size=3, num_workers=1, collate_fn=boom_collate, prefetch_factor=1
    )
    leader = Leader(loader)
    try:
        it = iter(loader)
        with pytest.raises(ValueError, match="on purpose"):
            while True:
                leader.deliver(next(it))
        states = [leader.pool.state(i) for i in range(leader.pool.spec.total)]
        assert states == ["EMPTY"] * leader.pool.spec.total  # not WRITING: given back
        del it
    finally:
        leader.close()


# ---------------------------------------------------------------- the pieces


def test_codec_keeps_placed_leaves_where_they_are_and_copies_the_rest():
    dest = np.zeros(4096, dtype=np.uint8)
    base = dest.ctypes.data
    inside = torch.frombuffer(dest[128 : 128 + 400], dtype=torch.float32)  # 100 floats, in place
    inside.copy_(torch.arange(100, dtype=torch.float32))
    outside = torch.arange(10, dtype=torch.int64)

    def placed(obj, nbytes):
        off = obj.data_ptr() - base
        return off if off >= 0 and off + nbytes <= 1024 else None

    batch = {"in": inside, "out": outside, "again": inside.view(10, 10), "odd": inside[1:]}
    enc = codec.encode(batch, placed=placed, start=1024)
    offsets = [lf.offset for lf in enc.leaves]
    assert offsets[0] == 128 and enc.sources[0] is None  # placed, not copied
    assert offsets[1] == 1024 and enc.sources[1] is outside  # copied after `start`
    assert offsets[2] >= 1024 and enc.sources[2] is not None  # same bytes again: copied
    assert offsets[3] >= 1024 and enc.sources[3] is not None  # unaligned: copied
    assert enc.nbytes == max(lf.offset + lf.nbytes for lf in enc.leaves)
    before = dest[128:528].copy()
    codec.write_payload(enc, dest)
    assert np.array_equal(dest[128:528], before)
    out = codec.decode(enc.meta, dest[: enc.nbytes])
    assert_same(out, batch)


def test_codec_layout_without_placement_is_unchanged():
    batch = {"a": torch.arange(5), "b": np.ones(3), "c": b"xyz"}
    enc = codec.encode(batch)
    assert [lf.offset for lf in enc.leaves] == [0, 64, 128]
    assert enc.nbytes == 131 and all(s is not None for s in enc.sources)


def test_the_allocator_serves_only_its_own_thread_and_falls_back_when_full():
    assert worker._install_allocator()
    dest = np.zeros(1 << 16, dtype=np.uint8)
    arena = worker._Arena(dest)
    base = dest.ctypes.data
    other: list[int] = []

    def elsewhere():
        other.append(torch.UntypedStorage._new_shared(1024).data_ptr())

    with worker._allocating_from(arena):
        mine = torch.UntypedStorage._new_shared(1000)
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        too_big = torch.UntypedStorage._new_shared(1 << 17)
    after = torch.UntypedStorage._new_shared(64)
    assert mine.data_ptr() == base and arena.top == 1000
    assert not base <= other[0] < base + dest.nbytes  # another thread: torch's own
    assert not base <= too_big.data_ptr() < base + dest.nbytes  # did not fit: torch's own
    assert not base <= after.data_ptr() < base + dest.nbytes  # after the collate: torch's own

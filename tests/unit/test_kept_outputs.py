"""Collates that keep their earlier outputs get the same bytes as without sharing.

NOTE [collate into the slot] in ``collate``: a collate's shared-memory outputs
are made in the worker's pool slot. A collate may keep them past the call (a
memory bank of negatives, a packing carry, a view of one leaf) and return or
read them batches later; plain PyTorch keeps such outputs intact (each is
fresh shared memory), so the slot they lie in must never be rewritten under
them. Each case runs the same DataLoader with and without the pool and
compares every batch; the single-process ``Leader`` releases each batch at
once, so a slot is reused as early as it can be.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, default_collate

from shmloader._workers.partition import _page_ranges, _privatise
from tests.multirank.test_collate_in_slot import Rows, _run
from tests.multirank.test_sharing import assert_same

pytestmark = pytest.mark.timeout(240)

#: What a collate keeps of its output: the whole leaf, a view of one row, an
#: unaligned tail, a strided view, or the whole batch dict.
KEEP = {
    "leaf": lambda b: b["x"],
    "row": lambda b: b["x"][0],
    "tail": lambda b: b["x"][1:],
    "strided": lambda b: b["ids"][:, ::3],
    "batch": lambda b: b,
}
#: How the kept output comes back: as it is, as a fresh tensor computed from
#: it, or only read into a number (the kept memory must still be intact).
GIVE = {
    "as_is": lambda kept: kept,
    "computed": lambda kept: (kept["x"] if isinstance(kept, dict) else kept) * 2,
    "sum": lambda kept: float((kept["x"] if isinstance(kept, dict) else kept).double().sum()),
}


class Keeping:
    """default_collate plus a bank: returns, beside the batch, what it kept ``depth`` calls back."""

    def __init__(self, depth: int, keep: str = "leaf", give: str = "as_is") -> None:
        self.depth, self.keep, self.give = depth, keep, give
        self.bank: list = []

    def __call__(self, samples):
        batch = default_collate(samples)
        self.bank.append(KEEP[self.keep](batch))
        old = self.bank.pop(0) if len(self.bank) > self.depth else None
        batch["bank"] = None if old is None else GIVE[self.give](old)
        return batch


def _compare(collate: Keeping, workers: int, n: int = 24, batch_size: int = 2) -> None:
    def make() -> DataLoader:
        return DataLoader(
            Rows(n, width=600),
            batch_size=batch_size,
            num_workers=workers,
            collate_fn=Keeping(collate.depth, collate.keep, collate.give),
            multiprocessing_context="fork",
        )

    plain, _ = _run(make(), share=False)
    shared, placed = _run(make(), share=True)
    assert sum(placed) > 0, "the batches must have been collated in their slots"
    assert len(shared) == len(plain) == n // batch_size
    for step, (a, b) in enumerate(zip(shared, plain, strict=True)):
        assert_same(a, b, f"batch {step}")


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_a_memory_bank_returns_the_bytes_it_kept(depth, workers):
    _compare(Keeping(depth), workers)


@pytest.mark.parametrize("keep", ["row", "tail"])
def test_a_kept_view_of_one_leaf_stays_intact(keep):
    _compare(Keeping(1, keep), workers=1)


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    depth=st.integers(1, 5),
    keep=st.sampled_from(sorted(KEEP)),
    give=st.sampled_from(sorted(GIVE)),
    workers=st.sampled_from([1, 2]),
    size=st.sampled_from([1, 3]),
)
def test_any_collate_that_keeps_references_equals_no_sharing(depth, keep, give, workers, size):
    _compare(Keeping(depth, keep, give), workers, n=6 * size * workers, batch_size=size)


def test_detached_pieces_keep_their_bytes_at_their_addresses_while_the_slot_is_rewritten():
    """``_privatise``: the pages under a kept piece become private; the rest stays shared."""
    page = mmap.PAGESIZE
    fd = os.memfd_create("kept-test")
    try:
        os.ftruncate(fd, 8 * page)
        worker_map = mmap.mmap(fd, 8 * page, flags=mmap.MAP_SHARED)  # the worker's mapping
        other_map = mmap.mmap(fd, 8 * page, flags=mmap.MAP_SHARED)  # a fresh one, later writes
    finally:
        os.close(fd)
    slot, other = np.frombuffer(worker_map, np.uint8), np.frombuffer(other_map, np.uint8)
    slot[:] = 7
    piece = slot[page + 100 : 3 * page + 5]  # unaligned at both ends: pages 1..3
    kept = torch.frombuffer(piece, dtype=torch.uint8)
    address = kept.data_ptr()
    _privatise([(piece.ctypes.data, piece.nbytes)])
    other[:] = 1  # the slot is rewritten for the next batch
    assert kept.data_ptr() == address, "the kept tensor must not move"
    assert bool((kept == 7).all()), "the kept tensor must keep its bytes"
    assert (slot[:page] == 1).all() and (slot[4 * page :] == 1).all(), "other pages stay shared"
    kept[:] = 9  # and writes to it stay private
    assert (other[page : 4 * page] == 1).all()
    assert _page_ranges([(page + 100, 10), (page + 200, 10), (5 * page, 1), (0, 0)]) == [
        (page, 2 * page),
        (5 * page, 6 * page),
    ]
    del kept, piece, slot, other

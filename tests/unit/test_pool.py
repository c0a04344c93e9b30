"""The pool's main-process side on its own (``shmloader._workers.pool.WorkerPool``)."""

from __future__ import annotations

import pytest

from shmloader._node.ring import RingWriter, new_token
from shmloader._workers.control import LEAVING
from shmloader._workers.pool import WorkerPool

pytestmark = pytest.mark.timeout(30)


def test_an_iterator_ended_late_stops_no_worker_of_a_later_iteration():
    # ``leaving``: the leader's DataLoader iterator ends (a break, an error), and its workers'
    # waits for a slot end at once. One that ends late (an error's traceback kept its frame
    # past the next iter()) must not end the next iteration's workers' waits
    ring = RingWriter(new_token(), frozenset(), {"test": True}, self_rank=0)
    pool = WorkerPool(
        ring, num_workers=1, prefetch_factor=2, ring_slots=2, timeout=30.0, allow_pickle=False
    )
    try:
        pool.reclaim()  # the first iter()
        first = pool.iteration
        pool.reclaim()  # the next iter()
        pool.leaving(first)
        assert pool.words[LEAVING] == 0
        pool.leaving(pool.iteration)  # this iteration's iterator ends
        assert pool.words[LEAVING] == 1
        pool.reclaim()
        assert pool.words[LEAVING] == 0
    finally:
        pool.close()
        ring.close()

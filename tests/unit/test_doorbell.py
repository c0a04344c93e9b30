"""``Doorbell``: a ring wakes the waiter at once, is taken once, and never blocks the ringer.

That a ring keeps the GIL (NOTE [a ring keeps the GIL] in shmloader/_transport/doorbell.py)
is measured, not asserted: benchmarks/results/step_handover (a GIL handed over at a ring is
a race that a unit test on an idle machine does not lose).
"""

from __future__ import annotations

import time

from shmloader._transport.doorbell import Doorbell


def test_a_ring_wakes_a_waiter_and_is_taken_once():
    bell = Doorbell()
    assert not bell.wait(0.01)
    bell.ring()
    bell.ring()
    assert bell.wait(1.0)
    assert not bell.wait(0.01), "the rings were cleared with the wake"


def test_many_rings_never_block_the_ringer():
    bell = Doorbell()
    t0 = time.monotonic()
    for _ in range(200_000):  # far past what the pipe holds
        bell.ring()
    assert time.monotonic() - t0 < 5.0
    assert bell.wait(1.0)

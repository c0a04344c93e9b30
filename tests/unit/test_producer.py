"""The producer on its own (``shmloader._roles.producer``): what the user's thread sees when
the producer thread itself ends of an error that was no loop's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from shmloader._roles.base import Owner
from shmloader._roles.cursor import Position
from shmloader._roles.producer import Producer
from shmloader.errors import ShmLoaderError

pytestmark = pytest.mark.timeout(30)


def _stopped(producer: Producer) -> None:
    """Close as ``ShmLoader.close()`` does: stop, wait, and the thread is gone."""
    producer.owner.close()
    producer.stop()
    producer.finish()
    assert producer._thread is not None
    producer._thread.join(5)
    assert not producer._thread.is_alive()


def _iterate(producer: Producer, items: Iterable[Any]) -> Iterator[Any]:
    return producer.run(
        iter(items),
        position=lambda: Position(0, 0, False, None, None),
        hand=lambda _position: None,
        request=None,
        waited=lambda _t0: None,
    )


def test_a_producer_that_died_between_iterations_fails_the_next_one_at_once(caplog):
    # ``idle`` runs between iterations (the RELEASEs a finalizer queued): a bug there ends
    # the producer thread; the next iter() must say so, not wait for a batch forever
    broken = threading.Event()

    def idle() -> None:
        if broken.is_set():
            raise RuntimeError("the hub's socket broke")

    producer = Producer(Owner(5.0), 1, idle=idle)
    assert list(_iterate(producer, [1, 2])) == [1, 2]
    broken.set()
    producer.doorbell.ring()
    deadline = time.monotonic() + 10
    while producer.death is None and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(ShmLoaderError, match="producer thread died of RuntimeError"):
        next(_iterate(producer, [3]))
    assert time.monotonic() - t0 < 1.0
    assert "the loader's producer thread died" in caplog.text
    _stopped(producer)


def test_a_loops_own_error_is_raised_at_its_step_and_the_producer_lives_on():
    # the control of the test above: an error of the user's loader is the loop's, not a
    # death of the producer, and the next iteration runs on the same thread
    def fails():
        yield 1
        raise ValueError("sample 1 is broken")

    producer = Producer(Owner(5.0), 1)
    it = _iterate(producer, fails())
    assert next(it) == 1
    with pytest.raises(ValueError, match="sample 1 is broken"):
        next(it)
    assert producer.death is None
    assert list(_iterate(producer, [7, 8])) == [7, 8]
    _stopped(producer)


def test_a_batch_made_as_the_user_leaves_is_never_queued_into_the_left_iteration():
    # the user leaves (``_halt``: the queue cleared) right after the producer's last check
    # before it queues a batch: that batch dies with the producer's frame, it is never
    # queued into the iteration left (where it would hold its slot until the next iter())
    class LeavesAfterTheCheck(Owner):
        armed = False

        def __call__(self) -> None:
            super().__call__()
            if self.armed and threading.current_thread() is producer._thread:
                self.armed = False
                assert producer._run is not None
                producer._halt(producer._run)

    owner = LeavesAfterTheCheck(5.0)
    taken = threading.Event()

    def batches():
        yield 0
        assert taken.wait(10)  # the user has batch 0
        owner.armed = True  # the next check is the one before batch 1 is queued
        yield 1

    producer = Producer(owner, 2)
    it = _iterate(producer, batches())
    assert next(it) == 0
    taken.set()
    run = producer._run
    assert run is not None
    deadline = time.monotonic() + 10
    while not run.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.finished and not owner.armed
    assert list(run.queue) == [], run.queue
    it.close()
    _stopped(producer)

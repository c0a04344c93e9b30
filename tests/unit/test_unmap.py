"""NOTE [unmapped off the step] (unmap): a dropped batch view is unmapped and released on
the unmap thread, after its unmap, never on the thread that dropped it."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from shmloader._node import standing, unmap
from shmloader._node.ring import RingReader, RingWriter, new_token
from shmloader._node.views import private_view

pytestmark = pytest.mark.timeout(60)
NBYTES = 8 << 20


@pytest.fixture
def slot():
    token = new_token()
    writer = RingWriter(token, frozenset({1}), {"job": "unmap"})
    slot = writer.acquire(NBYTES)
    slot.payload[:NBYTES] = 5
    yield slot
    assert unmap.settle(10)
    writer.close()


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(v, 16) for v in line.split()[0].split("-"))
            if start <= addr < end:
                return "shml-" in line
    return False


@pytest.fixture(params=["own", "standing"])
def way(request, monkeypatch) -> str:
    """A view of its own per batch, or a slot's standing mapping (NOTE [a standing mapping])."""
    if request.param == "own":
        monkeypatch.setattr(standing, "_enabled", False)
    return request.param


def _dropped(slot, *, later: bool, nbytes: int = NBYTES) -> list[tuple[str, str, str]]:
    """Map a view, write into it and read it through a tensor, drop it on this thread; what
    ran where, and what the view's address held then: ``unmapped`` (no slot), ``clean`` (the
    slot's bytes again, the write dropped) or ``dirty`` (the batch's write still there)."""
    events: list[tuple[str, str, str]] = []
    done = threading.Event()
    addr = 0

    def seen(what: str) -> None:
        if not _mapped(addr):
            state = "unmapped"
        else:
            state = "clean" if ctypes.c_uint8.from_address(addr + 8).value == 5 else "dirty"
        events.append((what, threading.current_thread().name, state))
        if len(events) == 2:
            done.set()

    view = private_view(
        slot.segment, nbytes, lambda: seen("released"), lambda: seen("unmapped"), later=later
    )
    addr = view.__array_interface__["data"][0]
    t = torch.from_numpy(view)[1:]  # a tensor of the batch holds it, as a user's does
    del view
    assert int(t[7]) == 5 and _mapped(addr)
    t[7] = 77  # the user's own write: a private page
    assert slot.payload[8] == 5
    del t
    assert done.wait(10), f"the dropped view was not unmapped and released: {events}"
    return events


def test_a_dropped_view_is_unmapped_and_released_on_the_unmap_thread(slot, way) -> None:
    """After its unmap, or (a standing mapping) after the batch's writes were dropped."""
    after = "unmapped" if way == "own" else "clean"
    for _ in range(3):
        events = _dropped(slot, later=True)
        # both after the unmap (the address holds no slot any more), both on its thread
        assert sorted(events) == [
            ("released", "shmloader-unmap", after),
            ("unmapped", "shmloader-unmap", after),
        ], events


def test_without_later_the_dropping_thread_unmaps_as_before(slot) -> None:
    here = threading.current_thread().name
    events = _dropped(slot, later=False)
    assert sorted(events) == [("released", here, "unmapped"), ("unmapped", here, "unmapped")]


def test_settle_returns_once_every_dropped_view_is_released(slot, way) -> None:
    released: list[int] = []
    views = [
        private_view(slot.segment, NBYTES, lambda i=i: released.append(i), later=True)
        for i in range(5)
    ]
    del views
    assert unmap.settle(10)
    assert sorted(released) == list(range(5))


def test_the_unmap_thread_ends_when_idle_and_starts_again(slot, way) -> None:
    def running() -> bool:
        return any(t.name == "shmloader-unmap" for t in threading.enumerate())

    _dropped(slot, later=True)
    deadline = time.monotonic() + 10 * unmap.IDLE_S
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(), "the unmap thread outlived its work"
    events = _dropped(slot, later=True)
    assert {e[1] for e in events} == {"shmloader-unmap"}


def test_a_reader_closing_owns_only_what_the_user_still_holds(slot, way) -> None:
    """NOTE [held past close] (ring): views dropped but not yet unmapped are no batch held."""
    reader = RingReader(slot.segment.name.split("-")[1])
    reader.later = True
    reader.open(slot.segment.name)
    kept = reader.view(slot.segment.name, NBYTES, lambda: None)
    for _ in range(4):
        reader.view(slot.segment.name, NBYTES, lambda: None)  # dropped at once
    assert reader.own_views() == 1
    slot.payload[:NBYTES] = 9  # the writer goes on: the held batch is the reader's own now
    assert int(kept[12345]) == 5
    del kept
    reader.close()


def test_a_small_view_and_a_loop_threads_drop_are_unmapped_where_they_die(slot, way) -> None:
    """Under ``LEASE_MIN_BYTES`` the unmap is cheaper than the hand-over; on a thread that
    unmaps its own (a loop's, ``unmap_here``) a release must not wait for another thread."""
    here = threading.current_thread().name
    small = _dropped(slot, later=True, nbytes=unmap.LEASE_MIN_BYTES - 4096)
    assert {e[1] for e in small} == {here}, small
    out: list = []

    def loop() -> None:
        unmap.unmap_here()
        out.extend(_dropped(slot, later=True))

    t = threading.Thread(target=loop, name="a-loop")
    t.start()
    t.join(30)
    assert {e[1] for e in out} == {"a-loop"}, out

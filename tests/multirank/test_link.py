"""The cross-node link over real gloo on loopback: every gloo call on the link thread, the
producer's waits left at a check (NOTE [the link owns gloo] in shmloader/_transport/xnode.py).

Two ranks, a ``CrossNode`` each (rank 0 the leader, rank 1 a node leader), no ring: the
payload is a plain array, as a ring slot's bytes are to the link.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch.distributed as dist

from shmloader._proto.wire import Kind
from shmloader._roles.base import Halted
from shmloader._transport.xnode import CrossNode, loader_tag
from tests.support.harness import run_ranks

NBYTES = 8 << 20  # far more than a loopback socket buffers: the send waits for its receive


class _Halt:
    """A producer's check: raises ``Halted`` once ``halt`` is set."""

    def __init__(self) -> None:
        self.halt = threading.Event()

    def __call__(self) -> None:
        if self.halt.is_set():
            raise Halted("this iteration was halted")


def _link(check: _Halt) -> CrossNode:
    return CrossNode(dist.group.WORLD, 0, (0, 1), loader_tag("test-link"), check)


def _link_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "shmloader-link" and t.is_alive()]


def _wait_links_gone(limit: float = 10.0) -> list[str]:
    deadline = time.monotonic() + limit
    while _link_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return _link_threads()


def _closed(xnode: CrossNode, out: dict) -> dict:
    """Close this rank's link; ``out`` with the link threads still alive after a while."""
    xnode.close()
    out["links"] = _wait_links_gone()
    dist.barrier()
    return out


def halted_send(rank: int, world: int) -> dict:
    """The leader's send waits for a node leader that receives 2 s later; its iteration is
    halted after 0.3 s. The halted wait ends at its next check; the send goes on on the
    link; ``sent`` then waits for it; what the node leader receives is what was sent."""
    check = _Halt()
    xnode = _link(check)
    out: dict = {}
    if rank == 0:
        slot = np.full(NBYTES, 7, np.uint8)
        threading.Timer(0.3, check.halt.set).start()
        t0 = time.monotonic()
        try:
            xnode.send(Kind.BATCH, 0, b"{}", slot, at=(0, 0))
            out["halted"] = False
        except Halted:
            out["halted"] = True
        out["left_s"] = time.monotonic() - t0
        check.halt.clear()
        xnode.sent()  # NOTE [a slot in flight]: nothing refills the slot before this
        out["sent_s"] = time.monotonic() - t0
        slot[:] = 9  # the next batch, written into the same slot
        xnode.say_closed(1, at=(0, 1))
    else:
        time.sleep(2.0)
        event = xnode.receive_header()
        dest = np.zeros(event.nbytes, np.uint8)
        xnode.receive_payload(dest)
        out["kind"], out["nbytes"] = int(event.head.kind), event.nbytes
        out["values"] = sorted(set(np.unique(dest).tolist()))
        xnode.drain()
    return _closed(xnode, out)


def test_a_halted_send_leaves_at_a_check_and_its_slot_is_refilled_only_once_it_was_sent():
    out = run_ranks(halted_send, 2, timeout=60)
    leader, node_leader = out
    assert leader["halted"], out
    assert leader["left_s"] < 1.0, out  # one slice past the halt, not the node leader's 2 s
    assert leader["sent_s"] >= 1.5, out  # sent() waited for the receive
    assert node_leader["kind"] == int(Kind.BATCH) and node_leader["nbytes"] == NBYTES, out
    assert node_leader["values"] == [7], out  # never the next batch's bytes
    assert leader["links"] == [] and node_leader["links"] == [], out


def halted_receive(rank: int, world: int) -> dict:
    """A node leader's receive of the next header waits for a leader that sends 1 s later;
    its iteration is halted after 0.3 s and it drops what is left of iteration 0. The
    batch's payload is then taken into nothing as it comes: the leader's send completes
    though nobody asked for that payload, and the node leader's next header is the next
    event, the leftover header first (asked for once, never twice)."""
    check = _Halt()
    xnode = _link(check)
    out: dict = {}
    if rank == 0:
        time.sleep(1.0)
        t0 = time.monotonic()
        xnode.send(Kind.BATCH, 0, b"{}", np.full(NBYTES, 3, np.uint8), at=(0, 4))
        out["send_s"] = time.monotonic() - t0
        xnode.send(Kind.END, 1, b"", at=(1, 0))
        xnode.say_closed(1, at=(1, 0))
    else:
        threading.Timer(0.3, check.halt.set).start()
        t0 = time.monotonic()
        try:
            xnode.receive_header()
            out["halted"] = False
        except Halted:
            out["halted"] = True
            xnode.drop_leftover(0)
        out["left_s"] = time.monotonic() - t0
        time.sleep(3.0)  # the next iteration starts late: the leader's send did not wait
        check.halt.clear()
        first, second = xnode.receive_header(), xnode.receive_header()
        out["events"] = [(int(e.head.kind), e.head.it, e.head.pos) for e in (first, second)]
        xnode.drain()
    return _closed(xnode, out)


def test_a_halted_receive_leaves_at_a_check_and_takes_the_leftover_payload_as_it_comes():
    out = run_ranks(halted_receive, 2, timeout=60)
    leader, node_leader = out
    assert node_leader["halted"] and node_leader["left_s"] < 1.0, out
    assert leader["send_s"] < 2.0, out  # not the node leader's 3 s pause
    assert node_leader["events"] == [(int(Kind.BATCH), 0, 4), (int(Kind.END), 1, 0)], out
    assert leader["links"] == [] and node_leader["links"] == [], out

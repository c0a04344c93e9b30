"""A writer's last word (ERROR, STOP) is ACKed by every reader before the writer goes on.

``NodeWriter.tell_last``: the process may exit right after the error propagates,
and a message still in ZeroMQ's queue would be lost (the reader would report
the leader lost instead of its error). So the writer waits, bounded, for each
reader's ACK of *that* message, also from a reader that had ACKed every
earlier batch: its ACK of the last batch is not one of the last word.
"""

from __future__ import annotations

import collections
import types

import pytest

from shmloader._proto import wire
from shmloader._proto.wire import Kind
from shmloader._roles.cursor import Cursor
from shmloader._roles.node_writer import NodeWriter
from shmloader.config import Config


class _Hub:
    """What the writer uses of its hub; ``wait`` answers with the reader's ACK of the
    message published last, as a reader that received it does."""

    def __init__(self) -> None:
        self.left: set[int] = set()
        self.subscribed = {1}
        self.published: list[wire.Message] = []
        self.waited: list[list] = []

    def broadcast(self, parts: list) -> None:
        self.published.append(wire.parse(parts))

    def receive(self, timeout: float):
        return None

    def wait(self, handle, peers, *, timeout: float, doing: str, idle=None, patient=None) -> None:
        self.waited.append(peers())
        ack = wire.parse(wire.frames(Kind.ACK, self.published[-1].seq, rank=1))
        assert handle(ack, 1), "the reader ACKed the last word and the writer still waits"


def _writer(batches: int) -> tuple[NodeWriter, _Hub]:
    hub = _Hub()
    topo = types.SimpleNamespace(
        readers=[1], ranks=[0, 1], me=0, peer=lambda r: f"rank {r}", role=lambda r: "follower"
    )
    ctx = types.SimpleNamespace(
        config=Config(enabled=True, timeout=30.0),
        cursor=Cursor(),
        stats=types.SimpleNamespace(counts=collections.defaultdict(float)),
        report=lambda: None,
    )
    ring = types.SimpleNamespace(take_retired=list)  # no slot retired (NOTE [retired slots])
    w = NodeWriter(ctx, topo, ring, hub, None)  # type: ignore[arg-type]
    w.hello.add(1)
    w.seq = batches
    w.acked[1] = batches  # the reader ACKed batches 0 .. batches - 1: every one
    return w, hub


@pytest.mark.parametrize(
    "exc, kind", [(ValueError("bad sample"), Kind.ERROR), (KeyboardInterrupt(), Kind.STOP)]
)
@pytest.mark.parametrize("batches", [0, 3])
def test_the_last_word_waits_for_each_readers_ack_of_that_message(exc, kind, batches) -> None:
    w, hub = _writer(batches)
    w.fail(0, exc)
    assert [m.kind for m in hub.published] == [kind]
    assert hub.published[0].seq == batches, "the last word carries the next batch number"
    assert hub.waited == [["rank 1"]], "the writer did not wait for the reader's ACK of it"
    assert w.acked[1] == batches + 1

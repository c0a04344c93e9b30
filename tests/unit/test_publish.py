"""``NodeWriter.publish``: the one publish sequence, its order and its checksum.

A real ring (``RingWriter``, one reader) and a writer whose hub and cross-node
link record what they are asked, in one log: the leader sends each batch to
the node leaders *before* its own node's readers hear of it, the CRC-32 it
announces is the payload's, a node leader refuses a payload whose CRC-32 is not
the leader's before announcing anything, and the counters are the leader's.
"""

from __future__ import annotations

import collections
import types
import zlib

import numpy as np
import pytest
import torch

from shmloader._node.ring import RingWriter, SlotState, new_token
from shmloader._proto import codec, wire
from shmloader._proto.wire import CrossHeader, Kind
from shmloader._roles.base import Halted
from shmloader._roles.cursor import Cursor
from shmloader._roles.node_writer import NodeWriter
from shmloader._transport.xnode import Event
from shmloader.config import Config
from shmloader.errors import ProtocolError


class _Hub:
    def __init__(self, log: list) -> None:
        self.log = log
        self.left: set[int] = set()
        self.subscribed = {1}

    def broadcast(self, parts: list) -> None:
        msg = wire.parse(parts)
        self.log.append(("announce", msg.kind, msg.body.get("crc")))

    def receive(self, timeout: float):
        return None

    def close(self) -> None:
        pass


class _Link:
    """The part of ``CrossNode`` a writer uses; a node leader's payload comes from ``incoming``."""

    def __init__(self, log: list, incoming: bytes = b"") -> None:
        self.log, self.incoming = log, incoming
        self.broken = False
        self.bytes_sent = 0

        #: a send the writer stopped waiting for, as the link's: it reads its payload, a
        #: view of the slot, until ``sent`` or the next send (the link sends in order)
        self.in_flight: np.ndarray | None = None
        self.halt_next = False  # the next send's wait is halted (NOTE [a slot in flight])
        self.delivered: list[bytes] = []  # what the node leaders received of in-flight sends

    def send(self, kind, it, meta, payload=None, *, at, draws=0, crc=-1) -> None:
        self.sent()
        self.log.append(("send", kind, crc, None if payload is None else bytes(payload)))
        if self.halt_next:
            self.halt_next, self.in_flight = False, payload
            raise Halted("this iteration was halted")

    def sent(self) -> None:
        if self.in_flight is not None:
            self.delivered.append(bytes(self.in_flight))
            self.in_flight = None

    def receive_payload(self, dest: np.ndarray) -> None:
        self.log.append(("receive", dest.nbytes))
        dest[:] = np.frombuffer(self.incoming, np.uint8)


class _Owner:
    """The loader's owner as the writer uses it: a check."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self) -> None:
        self.log.append(("check_open",))


@pytest.fixture
def node():
    made: list[RingWriter] = []

    def make(*, leader: bool = True, incoming: bytes = b"", **config):
        log: list = []
        ring = RingWriter(new_token(), frozenset({1}), {"job": "test"}, self_rank=0)
        made.append(ring)
        topo = types.SimpleNamespace(
            readers=[1], ranks=[0, 1], me=0, leader=0 if leader else 2, is_leader=leader,
            peer=lambda r: f"rank {r}", role=lambda r: "follower",
        )  # fmt: skip
        ctx = types.SimpleNamespace(
            config=Config(enabled=True, timeout=30.0, **config),
            cursor=Cursor(),
            stats=types.SimpleNamespace(counts=collections.Counter()),
            report=lambda: None,
            check_open=_Owner(log),
        )
        writer = NodeWriter(ctx, topo, ring, _Hub(log), _Link(log, incoming))  # type: ignore[arg-type]
        writer.hello.add(1)
        return writer, log

    yield make
    for ring in made:
        ring.close()


def _encoded() -> codec.Encoded:
    return codec.encode({"x": torch.arange(4096, dtype=torch.int32)}, allow_pickle=False)


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_the_leader_sends_to_node_leaders_before_its_readers_hear_of_the_batch(node, verify):
    writer, log = node(verify=verify)
    enc = _encoded()
    view = writer.publish(0, enc, 0)
    payload = bytes(view)
    crc = zlib.crc32(payload) if verify else -1
    # the send (waited on the link: NOTE [the link owns gloo]), then a check: a close
    # meanwhile announces nothing
    assert [e[0] for e in log] == ["send", "check_open", "announce"], log
    assert log[0] == ("send", Kind.BATCH, crc, payload), "node leaders: another CRC-32 or payload"
    assert log[2] == ("announce", Kind.BATCH, crc), "the readers were told another CRC-32"
    assert writer.seq == 1


def test_the_leaders_counters_are_counted_once_per_batch(node):
    writer, _log = node()
    enc = _encoded()
    for _ in range(2):
        assert writer.publish(0, enc, 0) is not None
    counts = writer.ctx.stats.counts
    assert counts["published"] == 2 and counts["bytes_published"] == 2 * enc.nbytes
    assert counts["write_ms_last"] > 0 and counts["publish_ms_total"] > 0
    assert "worker_written" not in counts


def test_without_a_view_the_writers_hold_ends_at_once(node):
    writer, _log = node()
    assert writer.publish(0, _encoded(), 0, view=False) is None
    (slot,) = writer.ring.slots
    assert slot.state == SlotState.HELD and slot.holders == {1}, "only the reader holds it"


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupt"])
def test_a_node_leader_checks_the_leaders_crc_before_announcing(node, corrupt):
    payload = bytes(range(256)) * 64
    crc = zlib.crc32(payload) ^ (1 if corrupt else 0)
    writer, log = node(leader=False, incoming=payload)
    event = Event(CrossHeader(Kind.BATCH, 0, len(payload), 0, 0, crc, 0, 0), b"")
    if corrupt:
        with pytest.raises(ProtocolError, match="CRC-32"):
            writer.publish(0, event, 0)
        assert [e[0] for e in log] == ["receive"], "a corrupt payload was announced"
        return
    view = writer.publish(0, event, 0)
    assert bytes(view) == payload
    assert log == [("receive", len(payload)), ("announce", Kind.BATCH, crc)], log
    assert "published" not in writer.ctx.stats.counts, "a node leader counts what it receives"


def test_no_slot_is_refilled_while_a_send_left_in_flight_still_reads_it(node):
    # NOTE [a slot in flight] (xnode): the leader's wait for a send was halted, the slot it
    # sends was never announced (so it is FREE), and the next iteration publishes at once
    writer, _log = node()
    link = writer.xnode
    first = codec.encode({"x": torch.full((4096,), 1, dtype=torch.int32)}, allow_pickle=False)
    link.halt_next = True
    with pytest.raises(Halted):
        writer.publish(0, first, 0)
    second = codec.encode({"x": torch.full((4096,), 2, dtype=torch.int32)}, allow_pickle=False)
    writer.publish(1, second, 0)
    sent = bytearray(first.nbytes)
    codec.write_payload(first, np.frombuffer(sent, np.uint8))
    assert link.delivered == [bytes(sent)], "a node leader received bytes of the next batch"

"""The node leader: receives each batch from the leader and publishes it on its node.

One batch, on a node leader (``Relay``); it holds a ``Reader`` of the
leader's stamps (``reader``) and is the ``Writer`` of its node (``writer``)::

    leader                          node leader (node B)          follower (node B)
    ------                          --------------------          -----------------
    xnode.send(meta, slot) =======> xnode.receive_header()
                                    (stamp checked: NOTE [iteration numbers])
                                    writer.await_readers()
                                    slot' = ring.acquire(n)
                                    xnode.receive_payload(slot')
                                    writer.announce: hub.publish(BATCH) -> spoke receives BATCH
                                    yield decode(private view)

END, ERROR and STOP from the leader are forwarded to this node's readers.
The relay owns only ``stash`` (a header of the next iteration, received
while this one was still going).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._proto import wire
from .._proto.wire import Kind
from .._transport.xnode import KIND_END, KIND_ERROR, KIND_STOP, CrossNode
from ..errors import LeaderError
from . import rng
from .base import Context, _check_crc, _error_fields, _json_body, _leader_error
from .node_writer import Writer
from .reader import Reader


class Relay:
    """The node leader's loop: the leader's batches, received into this node's ring."""

    name = "node leader"

    def __init__(self, ctx: Context, reader: Reader, writer: Writer, xnode: CrossNode) -> None:
        self.ctx = ctx
        self.reader = reader
        self.writer = writer
        self.xnode = xnode
        self.stash: tuple | None = None  # a header of the next iteration

    def ready(self) -> None:
        pass

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        self.writer.begin(cursor)
        return self._loop(it)

    def set_epoch(self, epoch: int) -> None:
        self.writer.follow_epoch()

    def close(self) -> None:
        self.writer.say_closed(self.ctx.cursor.it)

    def closers(self) -> list[Callable[[], None]]:
        return [self.writer.hub.close, self.writer.ring.close]

    def stats(self) -> dict[str, Any]:
        ring = self.writer.ring
        return {
            "ring_slots": len(ring.slots),
            "ring_bytes": ring.total_bytes,
            "cross_node_bytes_sent": self.xnode.bytes_sent,
        }

    def _loop(self, it: int) -> Iterator[Any]:
        try:
            yield from self._relay(it)
        except GeneratorExit:
            raise
        except LeaderError:
            raise  # already forwarded to this node's readers
        except BaseException as exc:  # e.g. the cross-node link broke: tell our readers
            if not self.ctx.check_open.closed:  # closed: close() tells them (STOP)
                self.writer.fail(it, exc)
            raise

    def _relay(self, it: int) -> Iterator[Any]:
        ctx, xnode, reader, writer = self.ctx, self.xnode, self.reader, self.writer
        ring = writer.ring
        while True:
            ctx.check_open()
            t_wait = time.perf_counter()
            if self.stash is None:
                # gloo only: close() need not wait for the leader's next header
                # (NOTE [close from any thread] in base)
                with ctx.check_open.outside():
                    self.stash = xnode.receive_header()
            head, self.stash = self.stash, None
            ctx.stats.note_wait(t_wait)
            kind, leader_it, nbytes, meta, draws, crc, epoch, pos = head
            theirs = (leader_it, epoch, pos)
            mine = ctx.cursor.mine(it)
            terminal = kind in (KIND_ERROR, KIND_STOP)
            if leader_it < it and not terminal:  # this node left that iteration early
                if nbytes:
                    xnode.receive_payload(np.empty(nbytes, np.uint8))
                reader.left_behind(leader_it, pos, kind == KIND_END)
                continue
            if leader_it > it:  # the leader left our iteration: keep its message for the next
                self.stash = head
                raise reader.diverged("left", theirs, mine)
            if kind == KIND_END:
                if (epoch, pos) != mine[1:]:
                    raise reader.diverged("ended", theirs, mine)
                writer.await_readers(window=False)
                writer.tell_readers(writer.stamped(Kind.END, it, draws=draws))
                rng.mirror_draws(draws)
                ctx.cursor.finish()
                return
            if terminal:
                body = _json_body(meta)
                if kind == KIND_STOP:
                    reason = str(body.get("reason", ""))
                    writer.tell_last(writer.stamped(Kind.STOP, it, reason=reason, closed=0))
                    raise reader.stopped(reason, theirs, mine)
                body["it"] = it
                writer.tell_last(wire.frames(Kind.ERROR, writer.seq, **_error_fields(body)))
                raise _leader_error(body, writer.topo.leader)
            if (epoch, pos) != mine[1:]:
                if nbytes:
                    xnode.receive_payload(np.empty(nbytes, np.uint8))
                raise reader.diverged("batch", theirs, mine)
            t0 = time.perf_counter_ns()
            writer.await_readers()
            slot = ring.acquire(nbytes) if nbytes else None
            if slot is not None:
                xnode.receive_payload(slot.payload[:nbytes])
                if crc >= 0:
                    _check_crc(slot.payload[:nbytes], crc, writer.seq)
            writer.announce(it, meta, nbytes, slot, draws, time.perf_counter_ns() - t0, crc)
            yield reader.deliver(meta, writer.own_view(slot, nbytes), draws, t0)

"""The node leader (``NodeLeader``): one loop over the leader's events, each batch received over
the cross-node path straight into a slot of this node's ring through its node writer's
one ``publish``, END, ERROR and STOP passed on to this node's readers. It owns only
``stash`` (an event of the leader's next iteration, received while this one was still
going), checks each stamp through its ``Receiver``, moves the ``Cursor`` (at the end of
an iteration) and touches the ring and the hub only through its ``NodeWriter``; one batch
on a node leader, drawn: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from .._proto import wire
from .._proto.bodies import error_fields, json_body, leader_error
from .._proto.wire import Kind
from .._transport.xnode import CrossNode, Event
from ..errors import LeaderError
from .base import Context, Halted
from .node_writer import NodeWriter
from .receiver import Receiver, Sorted


class NodeLeader:
    """The node leader's loop: the leader's batches, received into this node's ring."""

    name = "node leader"

    def __init__(
        self, ctx: Context, receiver: Receiver, writer: NodeWriter, xnode: CrossNode
    ) -> None:
        self.ctx = ctx
        self.receiver = receiver
        self.writer = writer
        self.xnode = xnode
        self.stash: Event | None = None  # an event of the next iteration

    def ready(self) -> None:
        pass

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        self.writer.begin(cursor)
        return self._loop(it)

    def supply(self, it: int, cursor: int, skip: bool) -> None:
        return None

    def set_epoch(self, epoch: int) -> None:
        pass  # a node leader stamps nothing of its own: it checks the leader's stamps

    def close(self) -> None:
        self.writer.say_closed(self.ctx.cursor.it)
        self.xnode.drain()  # NOTE [closing across nodes] (xnode): on the link, never waited

    def closers(self) -> list[Callable[[], None]]:
        return self.writer.closers()

    def stats(self) -> dict[str, Any]:
        return self.writer.stats()

    def _loop(self, it: int) -> Iterator[Any]:
        try:
            yield from self._receive(it)
        except GeneratorExit:
            raise
        except LeaderError:
            raise  # already forwarded to this node's readers
        except BaseException as exc:  # e.g. the cross-node link broke: tell our readers
            if not self.ctx.check_open.quiet():  # closed: close() tells them (STOP)
                self.writer.fail(it, exc)
            raise

    def _receive(self, it: int) -> Iterator[Any]:
        ctx, receiver, writer = self.ctx, self.receiver, self.writer
        while True:
            event = self._next_event(it)
            head, mine = event.head, ctx.cursor.mine(it)
            theirs = (head.it, head.epoch, head.pos)
            if head.kind == Kind.END:
                if (head.epoch, head.pos) != mine[1:]:
                    raise receiver.diverged("ended", theirs, mine)
                writer.end(it, head.draws)
                ctx.mirror(head.draws)
                ctx.cursor.finish()
                return
            if head.kind == Kind.STOP:
                reason = str(json_body(event.meta).get("reason", ""))
                writer.tell_last(writer.stamped(Kind.STOP, it, reason=reason, closed=0))
                raise receiver.stopped(reason, theirs, mine)
            if head.kind == Kind.ERROR:
                body = {**json_body(event.meta), "it": it}
                writer.tell_last(wire.frames(Kind.ERROR, writer.seq, **error_fields(body)))
                raise leader_error(body, writer.topo.leader)
            if (head.epoch, head.pos) != mine[1:]:
                self._skip_payload(event)
                raise receiver.diverged("batch", theirs, mine)
            t0 = time.perf_counter_ns()
            try:
                view = writer.publish(it, event, head.draws)
            except Halted:  # in the wait for this node's readers, before the payload came
                self._skip_payload(event)  # NOTE [running ahead]: the leader's send completes
                raise
            yield receiver.deliver(event.meta, view, head.draws, t0)
            del view  # NOTE [no batch in the frame] (base)

    def _next_event(self, it: int) -> Event:
        """The leader's next event of iteration ``it``, or its last word (ERROR, STOP).

        Events of an iteration this node left early are dropped here, their
        payload received into nothing (NOTE [iteration numbers] in ``cursor``);
        one of a later iteration is kept in ``stash`` for it, and raises.
        """
        ctx, xnode, receiver = self.ctx, self.xnode, self.receiver
        while True:
            ctx.check_open()
            t_wait = time.perf_counter()
            if self.stash is None:
                try:
                    self.stash = xnode.receive_header()  # NOTE [the link owns gloo] (xnode)
                except Halted:
                    # a batch of the iteration its user left: its payload into nothing once
                    # its header comes, or the leader's send of it waits for this node's
                    # next iteration (NOTE [running ahead])
                    xnode.drop_leftover(it)
                    raise
            event, self.stash = self.stash, None
            ctx.stats.note_wait(t_wait)
            head = event.head
            verdict = receiver.sort(head.kind, head.it, it)  # NOTE [one inbox] (receiver)
            if verdict is Sorted.PAST:  # NOTE [running ahead]: an error its user never reached
                continue
            if verdict is Sorted.LEFTOVER:
                self._skip_payload(event)  # this node left that iteration early
                receiver.left_behind(head.it, head.pos, head.kind == Kind.END)
                continue
            if verdict is Sorted.LATER:  # the leader left our iteration: keep it for the next
                self.stash = event
                raise receiver.diverged(
                    "left", (head.it, head.epoch, head.pos), ctx.cursor.mine(it)
                )
            return event

    def _skip_payload(self, event: Event) -> None:
        """Receive (and drop) the payload of a batch this node will not publish: the last
        header received is always ``event``'s (``stash`` holds one only while empty)."""
        self.xnode.skip_payload()

"""What a receiver does: each rank that gets its batches from a writer (a follower from
its node's writer, a node leader from the leader).

A receiver checks every message's stamp against its own position
(NOTE [iteration numbers] in ``cursor``) and delivers a batch::

    stamp (it, epoch, pos) == mine     -> deliver: decode views, mirror RNG draws
    another (epoch, pos), a later it   -> diverged: DivergenceError naming both
    STOP                               -> stopped: LeaderStoppedError
    an earlier it (this rank left it)  -> left_behind: warn once, go on

Which iteration a message belongs to is sorted here once, for both
(``sort``, NOTE [one inbox]). It reads the ``Cursor`` (where this rank left an
iteration) and, at delivery, moves it one batch and captures the step
boundary's RNG; it counts what it received in ``RankStats``.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import numpy as np

from .._proto import codec
from .._proto.codec import owned_copy
from .._proto.wire import Kind
from .._topology import GroupTopology
from ..errors import DivergenceError, LeaderStoppedError
from .base import Context, log


class Sorted(enum.Enum):
    """What a writer's message is to the iteration a receiver waits in (NOTE [one inbox])."""

    TAKE = "take"  # this iteration's, or the writer's last word (ERROR, STOP)
    LATER = "later"  # a later iteration's: kept for it (``stash``); this one diverged
    LEFTOVER = "leftover"  # a batch or end of an iteration this rank left: dropped
    PAST = "past"  # an error the writer raised past where every user left: dropped quietly


# NOTE [one inbox]
#     A follower (its node writer's ZeroMQ messages) and a node leader (the
#     leader's gloo events) sort what arrives against the iteration they wait in
#     by one rule, ``Receiver.sort`` (NOTE [iteration numbers] in ``cursor``):
#
#         stamped it == mine                            TAKE
#         ERROR of an earlier it the writer ran ahead   PAST (no user reached it:
#           into, where this rank left it                 NOTE [running ahead])
#         ERROR or STOP of an earlier it, or a          TAKE (the writer's last word)
#           closing STOP of any (a node writer's)
#         a later it                                    LATER (kept; DivergenceError)
#         any other of an earlier it                    LEFTOVER (ACKed and released,
#                                                         or its payload received into
#                                                         nothing; left_behind warns)
#
#     What each does with a message is its own (a follower ACKs and releases, a
#     node leader skips the payload); which message it is, is decided here once.
#     A node leader's closing STOP of a later iteration is LATER: the leader
#     closed past it, and its drain, not the loop, takes it.


class Receiver:
    """Stamp checks, the inbox's sorting and delivery shared by followers and node
    leaders."""

    def __init__(self, ctx: Context, topo: GroupTopology, writer_ahead: bool = False) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.topo = topo
        #: this rank's writer's loop runs ahead of its user (NOTE [running ahead])
        self.writer_ahead = writer_ahead

    def sort(self, kind: Kind, msg_it: int, it: int, *, closing: bool = False) -> Sorted:
        """What a message of ``kind`` stamped ``msg_it`` is to iteration ``it`` (NOTE [one
        inbox]); ``closing``: it is a node writer's closing STOP."""
        if msg_it == it:
            return Sorted.TAKE
        earlier = msg_it < it
        if kind == Kind.ERROR and earlier and self.writer_ahead and msg_it in self.ctx.cursor.left:
            return Sorted.PAST
        if kind in (Kind.ERROR, Kind.STOP) and (earlier or closing):
            return Sorted.TAKE
        if not earlier:
            return Sorted.LATER
        return Sorted.LEFTOVER

    def diverged(
        self, how: str, theirs: tuple[int, int, int], mine: tuple[int, int, int]
    ) -> DivergenceError:
        """NOTE [iteration numbers] (``cursor``): this rank and its writer iterate differently."""
        what = {
            "left": (
                f"the leader left iteration {mine[0]} after {mine[2]} batches and went on to "
                f"iteration {theirs[0]}, while this rank still asked for batch {mine[2]} "
                "(one rank broke out of its loop, another did not)"
            ),
            "ended": (
                f"the leader's epoch ended after {theirs[2]} batches, while this rank "
                f"received {mine[2]}"
            ),
            "batch": (
                f"the leader sent batch {theirs[2]} of epoch {theirs[1]}, while this rank "
                f"expected batch {mine[2]} of epoch {mine[1]} (a set_epoch() or "
                "load_state_dict() made on some ranks only?)"
            ),
        }[how]
        topo = self.topo
        return DivergenceError(
            what,
            rank=topo.me if topo else None,
            leader_rank=topo.leader if topo else None,
            leader_position=theirs,
            position=mine,
        )

    def stopped(
        self, reason: str, theirs: tuple[int, int, int], mine: tuple[int, int, int]
    ) -> LeaderStoppedError:
        log.warning("shmloader: the leader stopped: %s", reason)
        return LeaderStoppedError(
            reason,
            leader_rank=self.topo.leader if self.topo else None,
            leader_position=theirs,
            position=mine,
        )

    def left_behind(self, it: int, pos: int, end: bool) -> None:
        """A message of iteration ``it``, which this rank left early: warn once, naming both.

        Not for what a writer whose loop runs ahead published past its own
        user, up to ``SHMLOADER_SLOTS`` batches past where this rank left
        (NOTE [running ahead] in ``producer``): a writer that left at the same
        point sent those too. A writer in step with its user sends nothing past it.
        """
        left = self.ctx.cursor.left.get(it)
        if left is None:
            return
        ahead = self.config.slots if self.writer_ahead else 0
        if pos < left[1] + ahead or (end and pos <= left[1] + ahead):
            return
        self.ctx.cursor.take_left(it)
        log.warning(
            "shmloader: rank %s left iteration %d (epoch %d) after %d batches, but the leader "
            "went on (%s); those batches were released unused. Ranks of one group that break "
            "out of an epoch must break at the same point, or they train on different batches",
            self.topo.me if self.topo else "?",
            it,
            left[0],
            left[1],
            f"its epoch ended after {pos} batches" if end else f"it sent batch {pos}",
        )

    def deliver(self, meta: bytes, payload: np.ndarray, draws: int, t0: int) -> Any:
        """Decode a received batch (views of ``payload``), mirror RNG draws, count it."""
        batch = codec.decode(
            meta,
            payload,
            allow_pickle=self.config.allow_pickle,
            own_below=self.config.small_copy_bytes,
        )
        nbytes = payload.nbytes
        del payload  # NOTE [small leaves] (base): a batch of small leaves only is released here
        if self.config.copy:
            batch = owned_copy(batch)
        cursor, counts = self.ctx.cursor, self.ctx.stats.counts
        self.ctx.boundary.capture(cursor.delivered)  # NOTE [RNG at the step boundary] (_rng)
        self.ctx.mirror(draws)  # NOTE [running ahead] (producer): at the hand-over
        cursor.count()
        elapsed = (time.perf_counter_ns() - t0) / 1e6
        counts["received"] += 1
        counts["bytes_received"] += nbytes
        counts["receive_ms_total"] += elapsed
        counts["receive_ms_last"] = elapsed
        self.ctx.report()
        return batch

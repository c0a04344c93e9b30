"""Where a rank is: its iterations and epoch (``Cursor``), its step boundary (``Boundary``).

``ShmLoader`` makes both once and passes them to the role it builds; every role
reads them, and each field has one writer (drawn above each class). It owns the
stamps a writer puts on every message and a reader checks (NOTE [iteration
numbers]) and where this rank left an unfinished iteration. It imports only
``rng``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from .. import _rng as rng

#: Iterations a rank remembers having left early (NOTE [iteration numbers]).
LEFT_KEPT = 5


class Position(NamedTuple):
    """Where a rank is in its epoch, as a checkpoint reads it (NOTE [the position handed
    over]): one snapshot, taken where the batch it follows was produced."""

    epoch: int
    delivered: int  # batches of the epoch before this point (handed over or skipped)
    exhausted: bool  # the iteration ran to its end
    step_state: Any  # a stateful loader's state at the last optimizer-step boundary
    loader_state: Any  # its state at this point


# NOTE [the position handed over]
#     A rank's loop may run ahead of its user (NOTE [running ahead] in ``producer``,
#     NOTE [checkpoints under prefetch] in ``device.stage``): the ``Cursor``'s
#     ``delivered`` and ``exhausted`` are the loop's. What a checkpoint describes
#     is the user's position: the ``Position`` snapshotted right after the loop
#     produced the batch, which travels with it and becomes ``handed`` when the
#     batch (or the end) is handed to the user. ``handed`` is None while no loop
#     has run ahead of the user since the iteration began (a loop in step with
#     its user, or before the first batch): the loop's position is the user's
#     then. Nothing is rewound when the user leaves an iteration: ``handed``
#     stays where the user left until the next ``iter()`` or ``set_epoch`` to
#     another epoch, and where a rank left an iteration is read from it.


# NOTE [iteration numbers]
#     Every rank counts its own ``iter()`` calls; the writer stamps each message
#     with (``it``: its count, ``epoch``: its ``set_epoch``, ``pos``: the
#     batch's index in the epoch, resumed cursor included). All ranks of a group
#     must iterate in the same pattern (same epochs, same early ``break``s, same
#     resume), so equal counts mean the same iteration. A reader asking for
#     batch ``p`` of iteration ``it`` at epoch ``e``:
#
#     - BATCH/END of ``it`` stamped ``(e, p)``: the batch, or the normal end;
#     - any other ``(epoch, pos)`` in ``it``, or a message of a *later*
#       iteration (the writer broke out of ``it`` while this rank did not):
#       ``DivergenceError`` naming both positions, never a silent short epoch
#       (the later message is kept for this rank's next iteration);
#     - STOP (``KeyboardInterrupt``/``SystemExit`` in the leader's loader):
#       ``LeaderStoppedError``, not a normal end; ERROR: ``LeaderError``;
#     - a message of an *earlier* iteration: this rank broke out of that one
#       before the writer did. Its batches are ACKed and released inside the
#       receive path (the writer may be waiting for exactly those ACKs), a
#       warning names both positions once, and the wait goes on: the current
#       iteration is received whole.
#
#     An early ``break`` on every rank at the same point sends nothing extra
#     (the leader publishes only what its user takes) and needs no message.
#     A node leader applies the same rules to the leader's cross-node stamps.
#
# Each field has one writer:
#
#     Cursor field    written by                       read by
#     ------------    ----------                       -------
#     epoch           set_epoch (ShmLoader)            every role (stamps, checks)
#     it, iter_epoch  begin (ShmLoader.__iter__)       every role
#     delivered       begin; count (the role's loop)   roles, checkpoints
#     exhausted       begin; finish (the role's loop)  checkpoints
#     handed          hand (the user's thread), begin  checkpoints, note_left
#     sampler_base    begin, set_epoch                 checkpoints
#     resume          checkpoint.load, begin takes it  checkpoints
#     left, noted     note_left                        reader (a writer still in a left iteration)
@dataclasses.dataclass
class Cursor:
    """This rank's iteration count, epoch and position in it."""

    epoch: int = 0
    it: int = 0  # NOTE [iteration numbers]
    iter_epoch: int = 0  # the epoch the current iteration started in
    delivered: int = 0  # position in the epoch: batches the user received (or skipped)
    exhausted: bool = False  # the current iteration ran to its end
    sampler_base: int = 0  # cursor at which the leader's sampler's current pass began
    # (epoch, cursor, skip) from load_state_dict; skip is False when the
    # leader's loader restored its own position
    resume: tuple[int, int, bool] | None = None
    #: the user's position, where a loop runs ahead (NOTE [the position handed over])
    handed: Position | None = None
    left: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # it -> (e, pos)
    noted: int = 0  # the last iteration note_left accounted for

    def hand(self, position: Position) -> None:
        """A batch (or the end) whose snapshot is ``position`` reached the user."""
        self.handed = position

    def user_delivered(self) -> int:
        """Batches of this epoch the user has (NOTE [the position handed over])."""
        return self.delivered if self.handed is None else self.handed.delivered

    def mine(self, it: int) -> tuple[int, int, int]:
        """(iteration, epoch, position) of the batch this rank asks for next."""
        return it, self.epoch, self.delivered

    def count(self) -> None:
        """One more batch of this epoch handed over (or skipped)."""
        self.delivered += 1

    def finish(self) -> None:
        """The current iteration ran to its end."""
        self.exhausted = True

    def set_epoch(self, epoch: int) -> bool:
        """Move to ``epoch``; whether it is another one (which starts at its beginning)."""
        changed = epoch != self.epoch
        if changed:
            self.note_left()
            self.delivered, self.exhausted, self.sampler_base = 0, False, 0
            self.handed = None
        self.epoch = epoch
        return changed

    def begin(self) -> tuple[int, bool]:
        """A new ``iter()``: count it; return (cursor, skip) it starts at.

        The cursor is a pending resume of this epoch, or 0; ``skip`` says
        whether the leader's loader must be fast-forwarded by it (False when
        the loader restored its own position).
        """
        self.note_left()
        self.it += 1
        self.iter_epoch = self.epoch
        resume, self.resume = self.resume, None
        cursor, skip = (0, False) if resume is None or resume[0] != self.epoch else resume[1:]
        self.delivered = cursor
        self.exhausted = False
        self.handed = None
        self.sampler_base = 0 if skip else cursor
        return cursor, skip

    def resumes_here(self) -> bool:
        """A loaded state waits for this epoch's next iteration."""
        return self.resume is not None and self.resume[0] == self.epoch

    def note_left(self) -> None:
        """Remember where this rank left an unfinished iteration (NOTE [iteration numbers]).

        Called before anything resets the position: a new ``iter()`` or a
        ``set_epoch`` to another epoch, whichever comes first.
        """
        if self.noted == self.it:
            return
        self.noted = self.it
        user = self.handed  # NOTE [the position handed over]: not the loop's
        delivered, exhausted = (
            (self.delivered, self.exhausted) if user is None else (user.delivered, user.exhausted)
        )
        if exhausted or self.it == 0:
            return
        self.left[self.it] = (self.iter_epoch, delivered)
        for old in [k for k in self.left if k < self.it - LEFT_KEPT + 1]:
            del self.left[old]

    def take_left(self, it: int) -> tuple[int, int] | None:
        """(epoch, position) where this rank left iteration ``it``, once; else None."""
        return self.left.pop(it, None)


# Each field has one writer:
#
#     Boundary field  written by                       read by
#     --------------  ----------                       -------
#     rng             capture (a step's first request) checkpoints
#     taken_at_iter   capture (at iter()), user_request user_request
#     pending, undo   checkpoint.load, begin            begin, the leader's Source
#     opened          the leader's Source (open)        checkpoints
#     resume_open     checkpoint.load                   the leader's Source, checkpoints
#     loader_state    the leader's Source (boundary)    checkpoints
#     just_opened     the leader's Source               the leader's Source
class Boundary:
    """This rank's RNG and loader state at the optimizer-step boundary and the epoch's start.

    NOTE [RNG at the step boundary] and NOTE [RNG at the epoch's start] in
    ``_rng.py`` say what each capture is for. ``capture`` runs at the request
    of a step's first micro-batch: the leader and local ranks in their
    ``Source`` (an iteration's first request, before the loader is opened,
    and every later request), followers and node leaders at delivery, before
    mirroring draws. With device prefetch those are pulls ahead of the user,
    so the stage captures instead, at the user's request (``user_request``).
    """

    def __init__(self, accumulation_steps: int, *, prefetching: bool) -> None:
        self.steps = accumulation_steps
        self.prefetching = prefetching
        self.rng: dict[str, Any] | None = None  # the generators at the step's first request
        self.pending: dict[str, Any] | None = None  # a loaded capture for the next iteration
        self.undo: dict[str, Any] | None = None  # the same, to undo a resumed re-open's draws
        self.just_opened = False  # the Source captured this request before opening
        # how the current iteration opened the loader ({"epoch", "rng", "seeded"});
        # what a loaded state says about it
        self.opened: dict[str, Any] | None = None
        self.resume_open: dict[str, Any] | None = None
        self.loader_state: Any = None  # a stateful loader's state at the last step boundary
        self.taken_at_iter: int | None = None  # ``capture(at_iter=True)`` took this request

    def at_step_start(self, delivered: int) -> bool:
        return self.steps > 1 and delivered % self.steps == 0

    def capture(self, delivered: int, *, at_iter: bool = False) -> None:
        """At a request of batch ``delivered``, before the loader's draws for it.

        ``at_iter``: the leader opens its loader at the user's ``iter()``, ahead
        of the first request (NOTE [running ahead] in ``producer``): the boundary
        is captured now, before the opening draws, and that first request
        (``user_request`` of the same batch) keeps it.
        """
        if (at_iter or not self.prefetching) and self.at_step_start(delivered):
            self.rng = rng.capture()
            self.taken_at_iter = delivered if at_iter else None

    def user_request(self, delivered: int) -> None:
        """``capture`` at the user's ``next()`` under device prefetch.

        NOTE [checkpoints under prefetch] (``shmloader.device.stage``): the loop pulls up to
        ``prefetch`` batches before the user asks for them, so the step
        boundary is counted in batches handed to the user, and the capture is
        made before the stage pulls anything for this request.
        """
        if self.taken_at_iter == delivered:  # captured at iter(), before the loader opened
            self.taken_at_iter = None
            return
        if self.at_step_start(delivered):
            self.rng = rng.capture()

    def begin(self, cursor: int) -> None:
        """A new ``iter()`` at ``cursor``: a loaded RNG takes effect (NOTE [RNG at the step
        boundary]); from a cursor past 0 the resumed loader's re-open is undone after."""
        restore, self.pending = self.pending, None
        if restore is not None:
            rng.restore(restore)
        self.undo = restore if restore is not None and cursor > 0 else None

"""Running ahead (``Producer``): a role's loop on the loader's producer thread, its batches
handed to the user.

It owns the producer (one thread per loader, for its whole life), the queue between
it and the user, the hand-over (draws mirrored, the position a checkpoint reads)
and the halt when the user leaves an iteration (NOTE [running ahead], below). It
imports ``base``, ``cursor`` and ``rng`` only; which roles run ahead is ``_setup.build``'s
choice; one batch's way through it is in docs/internals/flow.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from .. import _rng as rng
from .._node import forks, unmap
from .._transport.channel import SLICE_S
from .._transport.doorbell import Doorbell
from ..errors import ShmLoaderError
from .base import CLOSED_MESSAGE, Halted, Owner, log
from .cursor import Position

# NOTE [running ahead]
#     A step should never wait for data that could have been ready. So the
#     per-batch work of the leader (take the worker's slot, send it to every
#     node leader, announce it), of a node leader (receive the payload into
#     its ring, announce it) and of a follower (wait for the announcement,
#     map, decode, fault the pages in: ``prefault``, ``madvise(MADV_POPULATE_READ)``
#     of each view the loop makes) runs on the loader's producer thread, up to
#     ``depth`` batches ahead of the user's ``next()``, which then only takes a
#     ready batch from the queue::
#
#         the producer                               the user's thread
#         ------------                               -----------------
#         role loop: next() -> batch k+2     put ->  [ k+1 | k+2 ]  -> take: mirror draws,
#         waits in slices: closed? halted?            queue, depth     set position, yield k+1
#
#     The producer is started at the loader's first ``iter()`` and ends at its
#     ``close()``; it runs one iteration at a time and waits between them, so
#     no thread starts or ends at an epoch boundary (where a DataLoader forks
#     its workers) and two loops of one role never run at once.
#
#     What stays on the user's thread, exactly where it is with sharing off:
#
#     - ``iter()`` of the user's loader (the leader opens it at the user's
#       ``iter()``: its draws, base seed and sampler seed, are made there);
#     - the RNG: a receiver's draws are not mirrored by its loop but at the
#       hand-over of the batch (or END) they came with (``defer``), and the
#       step boundary is captured at the user's request (``Boundary`` in its
#       prefetching mode). The leader runs ahead only where ``next()`` of its
#       loader draws nothing from the default generators (a DataLoader with
#       workers; NOTE [draws ahead] in ``leader``);
#     - the position: the loop's ``Cursor`` runs ahead; checkpoints read the
#       position of the last batch handed over (its ``Position``, snapshotted
#       on the producer right after the loop yielded it: NOTE [the position
#       handed over] in ``cursor``), as under device prefetch.
#
#     Errors keep their place: the loop's exception is queued behind the
#     batches it produced before it and raised at the step it would have
#     reached. The user leaving an iteration (``break``, the iterator
#     dropped) halts it (the run's ``halt`` event, ``Owner.halted_by``): the
#     producer's next check raises ``Halted``, so the iteration ends without
#     telling the peers anything (as a loop left at a ``yield`` tells them
#     nothing) and what it queued is dropped; ``settle`` (before the next
#     ``iter()``, ``set_epoch`` or ``close``) waits for the producer to leave
#     it; the user's position stays the last one handed over. No wait of
#     the producer is one it cannot leave: a gloo send or receive, which
#     nothing can cut short, runs on the loader's link thread while the
#     producer waits for it in slices (NOTE [the link owns gloo] in
#     ``_transport.xnode``). A header a halted node leader then gets is a
#     later iteration's (kept as the role's ``stash``) or a leftover, whose
#     payload its link takes into nothing at once so that the leader's send
#     of it completes; each loader's cross-node messages carry a tag of
#     their own (``loader_tag``). What is left in flight at ``close()`` is
#     drained there (NOTE [closing across nodes]). An error the leader's
#     loop raised past where every user left (its user never reached it) is
#     dropped by the readers, as the leader's own user never sees it. ``close()`` from any thread
#     stops the producer, which then frees what it owns (NOTE [one owner] in
#     ``base``); it is a daemon, so interpreter exit never waits for it.


# NOTE [one path]
#     Every sharing rank's batches come from its producer, ahead of the user or
#     in step with it; the user's thread only takes them from its queue. In step
#     (``depth`` 0: ``SHMLOADER_AHEAD=0``, or a leader whose ``next()`` of its
#     loader may draw from the default generators, NOTE [draws ahead] in
#     ``leader``) the producer makes a batch only once the user asked for it
#     (``asked``, counted at each ``next()``), so nothing is received, mapped or
#     published before the user's step needs it, exactly as a loop in the
#     user's thread would. What must happen on the user's thread still does: an
#     in-step leader draws each item from its loader there (``supply``, through
#     the ``Feed``), and the producer publishes it. So each resource has one
#     owner, whatever the mode: the producer's are the ring, the sockets, the
#     worker pool's main-process side and the device copies it issues; the
#     user's thread owns the user's loader in step and the hand-over. Whoever
#     must reach the producer rings its ``Doorbell`` (a take, a request, a
#     batch dropped whose RELEASE is queued): it never waits a slice for them.


class _Batch(NamedTuple):
    batch: Any
    draws: int  # default-generator draws to mirror at its hand-over
    position: Position | None  # what a checkpoint reads once the user has it (None: in step)


class _End(NamedTuple):
    draws: int
    position: Position | None


class _Failed(NamedTuple):
    exc: BaseException


_Item = _Batch | _End | _Failed


class _Run:
    """One iteration on the producer: its loop, its queue, the draws its loop deferred."""

    def __init__(self, inner: Iterator[Any], position: Callable[[], Position]) -> None:
        self.inner = inner
        self.position = position
        self.queue: collections.deque[_Item] = collections.deque()
        self.ready = threading.Condition()
        self.finished = False  # the producer queued its last item (or ended without one)
        self.draws = 0  # deferred on the producer since its last item
        self.waiting: _Batch | None = None  # the batch the producer waits to queue (``_put``)
        self.asked = 0  # the user's next() calls (in step: how many the producer may make)
        self.made = 0  # next() calls of the loop the producer began
        #: set when the user left this iteration: the producer's next check raises ``Halted``
        self.halt = threading.Event()

    def take_draws(self) -> int:
        n, self.draws = self.draws, 0
        return n


class Feed:
    """In step, the leader's items, drawn from its loader on the user's thread, to the
    producer (NOTE [one path]): the user's thread ``draw``s one per ``next()``; the
    role's loop on the producer iterates it."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.items: collections.deque[Any] = collections.deque()

    def draw(self, source: Iterator[Any]) -> None:
        """On the user's thread: the next item of ``source`` (its end, its error) to the
        producer."""
        box: list[Any] = []  # NOTE [no batch in the frame] (base)
        try:
            box.append(next(source))
        except StopIteration:
            box.append(_END)
        except BaseException as exc:  # KeyboardInterrupt too: the producer tells the peers
            box.append(_Failed(exc))
        self.items.append(box.pop())
        self.producer.doorbell.ring()

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> Any:
        producer = self.producer
        while not self.items:
            producer.wait_a_slice()
        item = self.items.popleft()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failed):
            raise item.exc
        return item


_END = object()


class Producer:
    """The loader's producer: a role's loop on its own thread, ``depth`` batches ahead of
    the user, or in step with it (``depth`` 0: NOTE [one path]).

    The producer is one thread for the loader's whole life: started at the
    first ``run``, it takes one iteration at a time and waits between them;
    it ends once ``stop`` was called. No thread starts or ends at an epoch
    boundary, where a DataLoader forks its workers (python/cpython#112275: a
    thread state made or freed at the moment of ``fork()`` can hang the child).
    """

    def __init__(
        self,
        owner: Owner,
        depth: int,
        *,
        idle: Callable[[], None] | None = None,
        timeout: float = float("inf"),
        doorbell: Doorbell | None = None,
    ) -> None:
        self.owner = owner
        #: ``ShmLoader``'s closing sequence, which the producer runs once it stopped, unless
        #: ``close()`` took its resources while it was away (NOTE [one owner] in ``base``)
        self.closing: Callable[[], None] | None = None
        #: set once the closing sequence ran (or was not the producer's): ``finish`` waits
        #: for this, not for the loops' ends, which close the user's loader after it
        self.closed = threading.Event()
        #: what a closing loader's loops left (a loop, or the error that ended one, whose
        #: frames hold the user's loader), let go after the closing sequence (NOTE
        #: [goodbyes first])
        self._remains: list[Any] = []
        #: batches it may hold ready for the user; 0: it makes each one when asked
        self.depth = depth
        self.in_step = depth == 0
        #: how long the user may wait for a batch before a wait of the loop may fail
        #: (``patient``): the loader's timeout
        self.timeout = timeout
        self._user_since: float | None = None  # when the user began to wait, if waiting
        #: run while the producer waits (to queue, to be asked, for an iteration), at once
        #: when the doorbell rings and once a slice: the RELEASEs, own releases and free
        #: pool slots that finalizers queued (NOTE [one owner] in ``base``)
        self.idle = idle
        #: rung by whatever the producer waits for: a take, a request, a dropped batch
        self.doorbell = doorbell if doorbell is not None else Doorbell()
        self._run: _Run | None = None  # the user's iteration (the last one started)
        self._jobs = threading.Lock()  # guards ``_next`` and ``_stopped``
        self._next: _Run | None = None  # started by the user, not yet taken by the producer
        self._stopped = False
        self._thread: threading.Thread | None = None  # the producer
        self._current: _Run | None = None  # the run the producer works on (its thread only)
        #: the error the producer thread died of, if one ended it (not a loop's: a bug)
        self.death: BaseException | None = None
        forks.hide(self)  # a forked child drops the batches queued here (hidden_addresses)

    @property
    def queued(self) -> int | None:
        """Batches ready for the user (for ``stats``); None in step."""
        run = self._run
        if self.in_step:
            return None
        if run is None:
            return 0
        return sum(isinstance(item, _Batch) for item in list(run.queue))  # not an END or error

    def hidden_addresses(self) -> list[int]:
        """Data addresses of the batches queued for the user and of the one waiting to be
        queued: no user code reaches them yet, so a forked child drops them instead of
        copying (NOTE [batches cross a fork] in ``_node.forks``). Called in ``os.fork``'s
        handler; takes no lock."""
        run = self._run
        if run is None:
            return []
        found: list[int] = []
        # the queue copied in one C call; a batch queued meanwhile is missed (then copied)
        for item in [*run.queue, run.waiting]:
            if isinstance(item, _Batch):
                _addresses(item.batch, found)
        return found

    def patient(self) -> bool:
        """A wait of the loop past its timeout goes on unless the user has been waiting
        that long (NOTE [running ahead]): a loop ahead of a user who evaluates for an
        hour waits for its peers just as long, and fails only once the user waits."""
        if self.owner.closed:  # closing: its waits are bounded by their own timeouts
            return False
        since = self._user_since
        return since is None or time.monotonic() - since < self.timeout

    def defer(self, draws: int) -> None:
        """The loop's ``mirror``: draws to replay at the next hand-over (NOTE [running ahead])."""
        run = self._current
        assert run is not None, "defer() outside the producer's iteration"
        run.draws += draws

    def feed(self) -> Feed:
        """A new feed for an in-step leader's loop (``run``'s ``supply``)."""
        return Feed(self)

    def run(
        self,
        inner: Iterator[Any],
        position: Callable[[], Position],
        hand: Callable[[Position], None],
        request: Callable[[], None] | None,
        waited: Callable[[float], None],
        supply: tuple[Iterator[Any], Feed] | None = None,
    ) -> Iterator[Any]:
        """The user's side: batches of ``inner``, which the producer runs.

        ``position()``: the loop's position, snapshotted (ahead only) after each
        batch on the producer and now, before it starts; ``hand(p)``: the user
        has reached ``p`` (NOTE [the position handed over] in ``cursor``). ``request()``: the
        user asks for a batch (the step boundary's capture), before anything is
        handed over. ``waited(t0)``: the user waited for a batch since
        ``perf_counter()`` ``t0``. ``supply``: in step, (the user's loader,
        drawn on this thread at each ``next()``; the feed ``inner`` reads it from).
        """
        self.settle()
        if not self.in_step:  # in step the loop is where the user is: nothing to hand over
            hand(position())  # (nor to ask of a loader not opened yet: it may draw)
        self._alive()
        run = self._run = _Run(inner, position)
        with self._jobs:
            if self._stopped:
                raise ShmLoaderError(CLOSED_MESSAGE)
            self._next = run  # an earlier run not yet taken was halted by settle: it goes
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="shmloader-producer", daemon=True
                )
                self.owner.producer = self._thread
                self._thread.start()
        self.doorbell.ring()
        return self._hand_over(run, hand, request, waited, supply)

    def _hand_over(
        self,
        run: _Run,
        hand: Callable[[Position], None],
        request: Callable[[], None] | None,
        waited: Callable[[float], None],
        supply: tuple[Iterator[Any], Feed] | None,
    ) -> Iterator[Any]:
        try:
            while True:
                if request is not None:
                    request()
                t0 = time.perf_counter()
                if supply is not None:  # in step: the leader's loader, on this thread
                    supply[1].draw(supply[0])
                item = self._take(run)
                waited(t0)
                if isinstance(item, _Failed):
                    raise item.exc
                rng.mirror_draws(item.draws)
                if item.position is not None:
                    hand(item.position)
                if isinstance(item, _End):
                    return
                box = [item.batch]  # NOTE [no batch in the frame] (base)
                del item
                if not self.in_step:
                    # room in the queue: the producer wakes only once the hand-over is
                    # done, so that it does not run for the GIL inside the user's next()
                    self.doorbell.ring()
                yield box.pop()
        finally:
            self._halt(run)

    def _take(self, run: _Run) -> _Item:
        with run.ready:
            run.asked += 1
            if self.in_step:
                self.doorbell.ring()  # the producer may make this one now
            try:
                while not run.queue:
                    if self._user_since is None:
                        self._user_since = time.monotonic()
                    self.owner()  # closed: the closed error, as any wait
                    self._alive()
                    if run.finished:
                        raise ShmLoaderError(
                            "the loader's producer thread ended this iteration without a batch "
                            "or an error (it was halted or closed)"
                        )
                    run.ready.wait(SLICE_S)
            finally:
                self._user_since = None
            with forks.no_fork():  # a fork sees it queued (hidden) or handed over, never between
                item = run.queue.popleft()
        return item

    def _alive(self) -> None:
        """Raise if the producer thread died of an error that was no loop's."""
        if self.death is not None:
            raise ShmLoaderError(
                f"this ShmLoader's producer thread died of {self.death!r} (logged with its "
                "traceback); make a new ShmLoader"
            ) from self.death

    # -- the producer --------------------------------------------------------

    def wait_a_slice(self) -> None:
        """On the producer: wait for the doorbell, at most a slice, then check (closed,
        halted) and run ``idle``."""
        self.doorbell.wait(SLICE_S)
        self.owner()
        if self.idle is not None:
            self.idle()

    def _serve(self) -> None:
        """The producer's life: one iteration at a time until ``stop``, then the closing
        sequence, unless ``close()`` took what it owns (NOTE [one owner] in ``base``)."""
        unmap.unmap_here()  # what the loop drops is unmapped here: NOTE [unmapped off the step]
        owner = self.owner
        try:
            while (run := self._await_run()) is not None:
                self._current = run
                try:
                    with owner.halted_by(run.halt):
                        self._produce(run)
                finally:
                    self._current = None
        except BaseException as exc:  # not a loop's error (``_produce`` queues those): a bug
            self.death = exc  # every wait of the user's for this producer raises it now
            log.error("shmloader: the loader's producer thread died", exc_info=True)
        finally:
            try:
                if self.closing is not None and not owner.taken:
                    with owner.closing():
                        self.closing()
            finally:
                self.closed.set()
                while self._remains:
                    _end_loop(self._remains.pop())

    # NOTE [goodbyes first]
    #     Ending a loop ends the user's loader in it: a DataLoader iterator's
    #     shutdown joins its workers, and a worker waiting for a pool slot no
    #     rank will release sees the shutdown only once its wait to grow one ran
    #     out (``partition.GROW_GRACE_S``, 2 s). Where the loader is closing,
    #     the producer says its goodbyes and frees what it owns first, then lets
    #     go of what its loops left (a loop, or the error that ended one: its
    #     traceback's frames hold the user's loader); ``close()`` waits for the
    #     first (``closed``) only.

    def _await_run(self) -> _Run | None:
        """The next iteration the user started; None once stopped. Between iterations the
        producer only runs ``idle``, when rung and once a slice."""
        while True:
            with self._jobs:
                if self._next is not None:
                    run, self._next = self._next, None
                    return run
                if self._stopped:
                    return None
            self.doorbell.wait(SLICE_S)
            if self.idle is not None and not self.owner.closed:
                self.idle()

    def _produce(self, run: _Run) -> None:
        owner, inner, position = self.owner, run.inner, run.position
        try:
            owner()
            while True:
                if self.in_step:  # NOTE [one path]: make only what the user asked for
                    while run.made >= run.asked:
                        self.wait_a_slice()
                run.made += 1
                box = []  # NOTE [no batch in the frame] (base)
                try:
                    box.append(next(inner))
                except StopIteration:
                    self._put(run, _End(run.take_draws(), self._snapshot(position)))
                    return
                self._put(run, _Batch(box.pop(), run.take_draws(), self._snapshot(position)))
        except Halted:
            pass
        except BaseException as exc:  # the loop's own error: raised at its step
            if owner.closed:
                self._remains.append(exc)  # NOTE [goodbyes first]
            else:
                with run.ready:
                    run.queue.append(_Failed(exc))
        finally:
            if owner.closed:
                self._remains.append(inner)  # NOTE [goodbyes first]
            else:
                _end_loop(inner)
            del inner
            run.inner = iter(())  # the finished loop's frame, and what it holds, go now
            with run.ready:
                run.finished = True
                run.ready.notify_all()

    def _snapshot(self, position: Callable[[], Position]) -> Position | None:
        """The position a batch carries (NOTE [the position handed over] in ``cursor``);
        None in step, where the cursor does not run ahead of the user."""
        return None if self.in_step else position()

    def _put(self, run: _Run, item: _Batch | _End) -> None:
        """Queue ``item`` once fewer than ``depth`` wait (in step: at once)."""
        run.waiting = item if isinstance(item, _Batch) else None
        try:
            while True:
                self.owner()  # closed or halted: the item dies with this frame
                with run.ready:
                    if run.halt.is_set():  # since the check: ``_halt`` cleared the queue
                        raise Halted("this iteration was halted")
                    if self.in_step or len(run.queue) < self.depth or isinstance(item, _End):
                        run.queue.append(item)
                        run.ready.notify_all()
                        return
                self.wait_a_slice()
        finally:
            run.waiting = None

    # -- stopping -----------------------------------------------------------

    def _halt(self, run: _Run) -> None:
        """The user left the iteration: the producer stops it at its next check; drop its
        queue."""
        run.halt.set()
        with run.ready:
            dropped = list(run.queue)  # their batches die outside the lock
            run.queue.clear()
            run.ready.notify_all()
        self.doorbell.ring()
        del dropped

    @property
    def started(self) -> bool:
        """Whether the producer runs (it owns the loader's resources: NOTE [one owner])."""
        return self._thread is not None

    def on_its_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        """``close()``: the producer leaves its iteration at its next check (the loader is
        closed), runs ``closing`` and ends."""
        with self._jobs:
            self._stopped = True
            self._next = None
        run = self._run
        if run is not None:
            self._halt(run)
        self.doorbell.ring()

    def finish(self) -> bool:
        """``close()``, after ``stop``: wait until the producer ran ``closing`` (True: it
        ends the user's loader after, NOTE [goodbyes first]), or take what it owns if it is
        away in the user's code (False: the caller closes it; NOTE [one owner]). Bounded
        by ``Owner.limit``."""
        thread, owner = self._thread, self.owner
        assert thread is not None
        deadline = time.monotonic() + owner.limit
        while thread.is_alive() and not self.closed.is_set():
            if owner.take():
                return False
            if time.monotonic() > deadline:
                log.warning(
                    "shmloader: close(): the loader's producer did not stop within %.0f s; "
                    "closing anyway",
                    owner.limit,
                )
                owner.taken = True
                return False
            thread.join(SLICE_S / 4)
        return True

    def settle(self, timeout: float | None = None) -> None:
        """Halt the user's iteration and wait for the producer to leave it, at most
        ``timeout`` seconds.

        ``timeout``: default the owner's limit, with a warning when it is
        over.

        Once it waited, the role's loop is not running: the caller may touch
        what the loop owns from its own thread. Nothing is rewound: the user's
        position is the last one handed over (NOTE [the position handed over]).
        """
        run = self._run
        if run is None:
            return
        self._halt(run)
        limit = self.owner.limit if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self._left(run):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with run.ready:
                if not run.finished:
                    run.ready.wait(min(left, SLICE_S))
        if timeout is None and not self._left(run):
            log.warning(
                "shmloader: the loader's producer thread did not leave its iteration within "
                "%.0f s (it is inside the user's loader); going on without it",
                self.owner.limit,
            )

    def _left(self, run: _Run) -> bool:
        """Whether the producer is out of ``run``: finished it, or never took it."""
        with self._jobs:
            untaken = self._next is run
        if run.finished or untaken:
            return True
        thread = self._thread
        return thread is None or not thread.is_alive()


def _end_loop(remains: Any) -> None:
    """End a role's loop (and the user's loader it iterates); an error is only let go."""
    if not isinstance(remains, BaseException):
        with contextlib.suppress(Exception):
            remains.close()


def _addresses(obj: Any, found: list[int], depth: int = 0) -> None:
    """Append the data address of every tensor and array in ``obj`` (a batch) to ``found``."""
    if depth > 64:
        return
    if hasattr(obj, "data_ptr") and callable(obj.data_ptr):  # a torch.Tensor
        found.append(obj.data_ptr())
    elif hasattr(obj, "__array_interface__"):  # a numpy array
        found.append(obj.__array_interface__["data"][0])
    elif isinstance(obj, str | bytes | bytearray | memoryview):
        return
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _addresses(value, found, depth + 1)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _addresses(value, found, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _addresses(getattr(obj, field.name, None), found, depth + 1)

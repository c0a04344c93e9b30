"""Device delivery: every tensor of a delivered batch arrives on the GPU.

It owns :class:`DeviceStage`, which wraps the delivered-batch iterator of every
role; no thread of its own: where the role's loop runs ahead its thread issues
the copies and the consuming thread hands them over (NOTE [copies issued by the
loop ahead]), elsewhere all of it runs in the consuming thread: ``select``,
side-stream prefetch with a bounded number of copies in flight, slot release on
copy completion and the hand-over position checkpoints read (NOTE [checkpoints
under prefetch]). Which GPU ``cuda`` is comes from ``shmloader.device.which``;
the walk over a batch's containers and the block layout of a leaf from
``shmloader.device.containers``. It copies through ``shmloader.device.cuda`` and
reads page-locked memory from ``shmloader.device.registrar``; one ``next()`` and
a batch's states in the stage are in docs/internals/flow.md and
docs/internals/state-machines.md.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._transport.channel import SLICE_S
from ..errors import ConfigError, ShmLoaderError
from .containers import align, blocks, map_tensors
from .cuda import CudaOps, DeviceOps
from .registrar import HostMapping, Registrar, Staging

# ------------------------------------------------------------------- stage


@dataclass(eq=False)
class _Copy:
    """The copies of one batch: what they read and the CPU leaves that hold its slots."""

    start: Any = None
    end: Any = None  # None after a failure left no event to wait for (NOTE [errors in the copy])
    keep: list[torch.Tensor] = field(default_factory=list)  # CPU leaves: they HOLD the slots
    nbytes: int = 0
    maps: list[HostMapping] = field(default_factory=list)
    staged: torch.Tensor | None = None  # the staging buffer its staged leaves are read from


@dataclass(eq=False)
class _Plan:
    """One leaf's copy: device memory, and page-locked views or a host tensor to stage."""

    dst: torch.Tensor
    sources: list[torch.Tensor]
    host: torch.Tensor | None  # set: no page-locked memory holds it; staged first


@dataclass(eq=False)
class _Ready:
    batch: Any
    end: Any
    tensors: list[torch.Tensor]
    position: Any


class DeviceStage:
    """``select`` and, on a CUDA device, prefetch to the device for one ``ShmLoader``.

    ``device`` is a CUDA ``torch.device``, a :class:`DeviceOps` (the seam), or
    None for host delivery (then only ``select`` applies).

    NOTE [select]
        ``select(batch)`` runs on the shared CPU view before any copy, on
        every path (CPU delivery too), so a script behaves the same without
        a GPU. It must return views (slicing is free) and must not write
        into the batch: the copy reads the slot through the registered
        mapping, which does not see the rank's private in-place writes.

        When it runs: on host delivery at the user's ``next()``; on a device
        it must run before the copy (it decides what is copied), i.e. when
        the batch is pulled, up to ``prefetch`` batches before the user's
        ``next()`` for it. A ``select`` that reads per-step state of the
        script (a curriculum, a step-keyed shard) would see an earlier step
        there; so a ``select`` with a parameter named ``step`` is called as
        ``select(batch, step=k)``, ``k`` the batch's position in its epoch
        (0 for an epoch's first batch, micro-batches counted, the same on
        every rank of the group and after a resume): the step it is for,
        on every path. Read the step from that argument, not from state the
        training loop updates.
    """

    def __init__(
        self,
        device: torch.device | DeviceOps | None,
        *,
        select: Callable[..., Any] | None = None,
        prefetch: int = 2,
    ) -> None:
        if select is not None and not callable(select):
            raise ConfigError("select", select, "None or a callable taking and returning a batch")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ConfigError("prefetch", prefetch, "an integer >= 1")
        self.select = select
        self._select_step = _takes_step(select)
        self.prefetch = prefetch
        self._ops: DeviceOps | None
        if isinstance(device, DeviceOps):
            self._ops = device
        elif device is not None:
            self._ops = CudaOps(device)
        else:
            self._ops = None
        self.device = self._ops.device if self._ops is not None else None
        self._registrar = Registrar(self._ops) if self._ops is not None else None
        self._staging = Staging(self._ops) if self._ops is not None else None
        self._inflight: list[_Copy] = []  # copies whose CPU leaves still hold slots, in order
        # a Counter of ints and float milliseconds (typeshed's Counter: int values only)
        self._stats = cast("dict[str, Any]", collections.Counter())
        self._closed = False
        #: the stage's state (copies in flight, registrar, staging, counters), shared by
        #: the thread that issues and the one that hands over;
        #: NOTE [copies issued by the loop ahead]. Reentrant: ``_stage`` reaps in ``_start``
        self._lock = threading.RLock()
        #: ``ahead`` alone (a hand-over takes only this one, never ``_lock``); taken
        #: after ``_lock`` where both are held
        self._room = threading.Condition(threading.Lock())
        #: batches pulled from the role's iterator and not yet handed to the user
        self.ahead = 0

    @property
    def on_device(self) -> bool:
        return self._ops is not None

    def wrap(
        self,
        inner: Iterator[Any],
        position: Callable[[], Any] | None = None,
        request: Callable[[], None] | None = None,
        settled: Callable[[], None] | None = None,
        *,
        start: int = 0,
        hand: Callable[[Any], None] | None = None,
    ) -> Iterator[Any]:
        """Iterate ``inner`` through ``select`` and, on a device, the prefetcher.

        ``position()`` is called after every pull and at the end, and what it
        returned for a batch goes to ``hand()`` when the batch is handed over
        (the end's at the end), so that the loader reports where the *user*
        is, not the stage (NOTE [the position handed over] in
        ``_roles.cursor``). Not at the start: asking a loader for its state
        before ``iter()`` may open it (torchdata's ``StatefulDataLoader``
        does, drawing a base seed). ``request()`` is
        called at every ``next()`` of the user, before the stage pulls
        anything for it (NOTE [checkpoints under prefetch]). ``settled()``
        is called once the iteration is over and its copies have settled (the
        counters of ``stats()`` are final for it). ``start`` is the epoch
        position of ``inner``'s first batch (the ``step`` of NOTE [select]).
        """
        if self._closed:
            raise ShmLoaderError("this ShmLoader is closed; make a new one")
        if self._ops is None:
            return self._host(inner, start)
        return self._prefetching(inner, position, request, settled, start, hand)

    def _select(self, batch: Any, step: int) -> Any:
        if self.select is None:
            return batch
        if self._select_step:
            return self.select(batch, step=step)
        return self.select(batch)

    def _host(self, inner: Iterator[Any], start: int) -> Iterator[Any]:
        step = start
        while True:
            box = []  # NOTE [no batch in the frame] (_roles.base)
            try:
                box.append(next(inner))
            except StopIteration:
                return
            step += 1
            yield self._select(box.pop(), step - 1)

    # NOTE [checkpoints under prefetch]
    #     The stage pulls up to ``prefetch`` batches before the user asks for them,
    #     and pulling runs the role's loop: the loader steps, the loop counts, a
    #     follower mirrors the leader's RNG draws. ``ShmLoader.state_dict()`` must
    #     still describe the last batch *handed over*, so that a resume delivers
    #     the pulled-but-undelivered batches again:
    #
    #     - position: ``position()`` is snapshotted right after each pull (cursor,
    #       end of epoch, a stateful loader's state and its state at the step
    #       boundary) and travels with the batch; handing the batch over hands its
    #       snapshot on (``hand``: the cursor's ``handed``, what ``state_dict()``
    #       reads, NOTE [the position handed over] in ``_roles.cursor``);
    #     - RNG: the capture at a step's first micro-batch (NOTE [RNG at the step
    #       boundary] in ``_rng``) happens in ``request()``, at the user's
    #       ``next()``, not where the loop pulls (that is up to ``prefetch``
    #       batches earlier, before the user's own draws for the batches between).
    #
    #     A resumed stage pulls the batches after the cursor back to back, without
    #     the user's draws in between: the loader's draws from the default
    #     generators must not depend on that order. They do not for a DataLoader
    #     (draws at ``iter()`` only, before the first pull) nor with workers; they
    #     do for randomness drawn per batch in the main process (``num_workers=0``
    #     with random augmentation in the dataset or ``collate_fn``), which a
    #     resume under prefetch cannot replay exactly: give it its own generator.
    def _prefetching(
        self,
        inner: Iterator[Any],
        position: Callable[[], Any] | None,
        request: Callable[[], None] | None,
        settled: Callable[[], None] | None,
        start: int,
        hand: Callable[[Any], None] | None,
    ) -> Iterator[Any]:
        queue: collections.deque[_Ready] = collections.deque()
        error: Exception | None = None
        done = False
        end_position: Any = None
        step = start  # the epoch position of the next batch pulled
        try:
            while True:  # one turn per next() of the user
                if self._closed:
                    raise ShmLoaderError("this ShmLoader was closed while iterating")
                if request is not None:
                    request()  # before this turn's pulls draw anything
                self._reap()  # free slots first: the writer may need them for what we pull
                # Errors wait behind the batches already pulled, as on the host path.
                while not done and error is None and len(queue) <= self.prefetch:
                    try:
                        self._bound()
                        queue.append(self._start(next(inner), position, step))
                        step += 1
                    except StopIteration:
                        done = True
                        end_position = position() if position is not None else None
                    except Exception as exc:
                        error = exc
                self.ahead = len(queue)
                self._reap()
                if not queue:
                    if error is not None:
                        raise error
                    if hand is not None and end_position is not None:
                        hand(end_position)
                    return
                self.ahead = len(queue) - 1
                box = [queue.popleft()]  # NOTE [no batch in the frame] (_roles.base)
                if hand is not None and box[0].position is not None:
                    hand(box[0].position)
                yield self._hand_over(box.pop())
        finally:
            self.ahead = 0
            queue.clear()
            with contextlib.suppress(Exception):
                inner.close()  # type: ignore[attr-defined]
            self._settle()
            if settled is not None:
                settled()

    # NOTE [copies issued by the loop ahead]
    #     Where a role's loop runs ahead on its own thread (NOTE [running ahead]
    #     in ``shmloader._roles.producer``), the stage is split in two halves so that
    #     a batch's copy to the device starts as soon as the loop has the batch,
    #     not when the user asks for the one before it:
    #
    #         the producer                               the user's thread
    #         -----------------------------------        -----------------
    #         issue: reap, bound, next() of the role,    deliver: reap, wait for the
    #         select, plan, register, stage, copy on     batch's end event on the
    #         the side stream, record  -> _Ready  ->     consumer's stream, record_stream
    #                                  (Producer's queue)   -> the batch on the device
    #
    #     - What crosses threads: ``_Ready`` (device tensors and the end event)
    #       through ``Producer``'s queue, and the copies in flight (``_inflight``,
    #       with the registrar, the staging buffers and the counters), which
    #       both halves touch only under ``_lock``; the count of issued batches
    #       (``ahead``) has a lock of its own (``_room``), the only one a
    #       hand-over takes, so it never waits for the loop's host work
    #       (``select``, registration, staging) nor for a DMA; the user's reap
    #       is skipped while the loop holds ``_lock``. The loop calls ``select``
    #       outside both, and waits (host) for the oldest copy outside them
    #       (``_bound_ahead``). A halt between the role's last check and the
    #       copies is caught by a check under ``_lock``, so a user who left the
    #       iteration finds nothing issued and counted after it reset the count.
    #     - The loop's thread makes the stage's device current for as long as
    #       it issues (``DeviceOps.on_thread``): a new thread's current device
    #       is 0, and a CUDA call there would make a context on GPU 0 for a
    #       rank that computes on another.
    #     - What stays on the user's thread: the consumer stream's wait and
    #       ``record_stream`` (a thread's current stream is its own), the step
    #       boundary's capture (``Producer``'s ``request``) and the hand-over
    #       position (``Producer``'s, snapshotted on the producer right after each
    #       batch was issued: NOTE [the position handed over] in ``_roles.cursor``).
    #     - Bounds: the loop pulls a batch only while fewer than ``prefetch``
    #       issued batches wait for the user (``_room_ahead``, in slices that
    #       check the owner), so ``prefetch`` batches are on the device ahead of
    #       the one the user holds, as on the user's thread; at most
    #       ``prefetch + 1`` batches' copies are in flight (NOTE [copies in
    #       flight]). Once a copy completed its slot is released: a batch
    #       waiting on the device holds none.
    #     - An error of the copy is the loop's error: queued behind the batches
    #       issued before it and raised at its step. The stage is closed once
    #       the producer left its iteration (NOTE [one owner] in ``_roles.base``),
    #       so no copy is issued on a closed stage (checked again under the lock).
    #
    #     Where no loop runs ahead (a producer in step, NOTE [one path] in
    #     ``_roles.producer``; sharing off) the stage pulls on the user's thread
    #     (``_prefetching``), each pull one batch the loop makes when asked.
    def issue(
        self,
        inner: Iterator[Any],
        check: Callable[[], None],
        idle: Callable[[], None] | None = None,
        *,
        start: int = 0,
    ) -> Iterator[_Ready]:
        """The loop's half (NOTE [copies issued by the loop ahead]): ``inner``'s batches
        with their copies issued, as ``_Ready``, at most ``prefetch`` of them not yet
        handed over. ``check()`` raises once the loop must stop (the ``Owner``) and
        ``idle()`` runs while it waits for room (``Producer.idle``); ``start`` as in
        ``wrap``."""
        ops = self._ops
        if ops is None:
            raise ShmLoaderError("issue() is the device path's; a host stage wraps (a bug)")
        step = start
        try:
            with ops.on_thread():  # this loop's thread: the stage's device is current
                with self._room:
                    self.ahead = 0  # the previous iteration's loop has ended (one at a time)
                while True:
                    self._room_ahead(check, idle)
                    self._bound_ahead()
                    box = []  # NOTE [no batch in the frame] (_roles.base)
                    try:
                        box.append(next(inner))
                    except StopIteration:
                        return
                    batch = self._select(box.pop(), step)  # the user's code: outside the lock
                    with self._lock:
                        # a halt or close since the role's last check: issue nothing; from
                        # here to the count, the user's deliver() cannot reset it
                        check()
                        if self._closed:
                            raise ShmLoaderError("this ShmLoader was closed while iterating")
                        ready = self._start(batch, None, step, selected=True)
                        del batch
                        with self._room:
                            self.ahead += 1
                    step += 1
                    yield ready
        finally:
            with contextlib.suppress(Exception):
                inner.close()  # type: ignore[attr-defined]

    def deliver(
        self, issued: Iterator[_Ready], settled: Callable[[], None] | None = None
    ) -> Iterator[Any]:
        """The user's half (NOTE [copies issued by the loop ahead]): each issued batch
        handed over on the consumer's stream; ``settled`` as in ``wrap``."""
        try:
            while True:
                if self._closed:
                    raise ShmLoaderError("this ShmLoader was closed while iterating")
                self._reap_quietly()
                box = []  # NOTE [no batch in the frame] (_roles.base)
                try:
                    box.append(next(issued))
                except StopIteration:
                    return
                with self._room:
                    self.ahead = max(0, self.ahead - 1)
                    self._room.notify_all()
                # no lock: the consumer stream's wait, record_stream and a counter only
                # the hand-over writes (NOTE [copies issued by the loop ahead])
                yield self._hand_over(box.pop())
        finally:
            with contextlib.suppress(Exception):
                issued.close()  # type: ignore[attr-defined]  # halts the loop first
            with self._lock:
                with self._room:
                    self.ahead = 0
                    self._room.notify_all()
                self._settle()
            if settled is not None:
                settled()

    def _reap_quietly(self) -> None:
        """Reap on the user's thread unless the loop's thread is in the stage now: the
        user never waits for the loop's host work (it reaps itself before each pull)."""
        if self._lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._lock.release()

    def _room_ahead(self, check: Callable[[], None], idle: Callable[[], None] | None) -> None:
        """Wait, in slices, until fewer than ``prefetch`` issued batches wait for the user."""
        while True:
            with self._room:
                if self._closed or self.ahead < self.prefetch:
                    return
                self._room.wait(SLICE_S)
            check()
            if idle is not None:
                idle()

    def _bound_ahead(self) -> None:
        """``_bound`` on the loop's thread: its host wait for the oldest copy outside the
        lock (NOTE [copies issued by the loop ahead]); the copy is reaped after it."""
        ops = self._ops
        assert ops is not None
        while True:
            with self._lock:
                if self._closed:
                    return
                self._reap()
                if len(self._inflight) <= self.prefetch:
                    return
                oldest = self._inflight[0].end
                self._stats["device_copy_waits"] += 1
            if oldest is not None:
                ops.synchronize(oldest)

    def _bound(self) -> None:
        """Wait for the oldest copies beyond ``prefetch`` in flight, before pulling one more.

        NOTE [copies in flight]
            At most ``prefetch + 1`` batches' copies are in flight at any
            time: before each pull the stage waits (host) for the oldest
            beyond ``prefetch``. Copies run on the side stream, which never
            waits for the step's compute, so they lag only when the DMA
            itself is slower than the steps, and the wait is the
            back-pressure. What it bounds: ring slots held for copies (at
            most ``prefetch`` while the writer fills the next, so a ring of
            ``prefetch + 1`` slots serves a GPU rank alone) and, with
            ``registrar.STAGING_BUFFERS``, page-locked staging memory.
        """
        while len(self._inflight) > self.prefetch:
            self._wait_oldest(lambda copy: True)
            self._stats["device_copy_waits"] += 1

    def _wait_oldest(self, which: Callable[[_Copy], bool]) -> bool:
        """Wait (host) for the oldest copy in flight that ``which`` picks and finish it."""
        ops = self._ops
        assert ops is not None
        for k, copy in enumerate(self._inflight):
            if which(copy):
                if copy.end is not None:
                    ops.synchronize(copy.end)
                del self._inflight[k]
                self._finish(copy)
                return True
        return False

    def _start(
        self,
        batch: Any,
        position: Callable[[], Any] | None,
        step: int,
        *,
        selected: bool = False,
    ) -> _Ready:
        """Issue the copies of one pulled batch on the side stream.

        Everything per leaf that is host work (finding and registering its
        slot, allocating device memory, staging what no page-locked memory
        holds) comes first; the start event is recorded right before the
        first copy.

        NOTE [copy timing]
            The start event is recorded right before the batch's first
            copy, after the host work for it (finding and registering slots,
            allocating device memory, staging): ``device_copy_ms_total``
            times the copies, not Python.
        """
        ops = self._ops
        assert ops is not None
        if not selected:
            batch = self._select(batch, step)
        copy = _Copy()
        tensors: list[torch.Tensor] = []
        plans: list[_Plan] = []
        with ops.side():
            try:
                out = map_tensors(batch, lambda t: self._plan(t, copy, plans, tensors), {})
                del batch  # the leaves in copy.keep hold the slots, not the container
                self._stage(plans, copy)
                copy.start = ops.record()
                for plan in plans:
                    at = 0
                    for src in plan.sources:
                        n = src.numel()
                        ops.copy(plan.dst[at : at + n], src)
                        at += n
            except BaseException as exc:
                self._end(copy, exc)
                raise
            self._end(copy, None)
        where = position() if position is not None else None
        return _Ready(out, copy.end, tensors, where)

    def _end(self, copy: _Copy, failure: BaseException | None) -> None:
        """Record the batch's events and count it in flight, even after a failure.

        NOTE [errors in the copy]
            A batch whose copy failed midway is reaped like any other: its
            copies issued so far may still run, so its end event is
            recorded and its leaves are kept until it completes. After a
            sticky CUDA error (an illegal address, say) every later CUDA
            call fails too, recording that event included: the original
            exception is the one raised, with the recording's failure added
            as a note, and the batch, with no event to wait for, counts as
            completed (the failed context runs no more copies).
        """
        ops = self._ops
        assert ops is not None
        try:
            if copy.start is None:
                copy.start = ops.record()
            copy.end = ops.record()
        except Exception as exc:
            copy.end = None
            if failure is None:
                raise
            failure.add_note(
                f"shmloader: recording the copy's end event then failed too ({exc!r}; a sticky "
                "CUDA error fails every later call)"
            )
        finally:
            self._inflight.append(copy)

    def _plan(
        self, t: torch.Tensor, copy: _Copy, plans: list[_Plan], tensors: list[torch.Tensor]
    ) -> torch.Tensor:
        """Device memory for one leaf and where its bytes come from (NOTE [no pageable copies])."""
        ops = self._ops
        assert ops is not None
        if t.device.type != "cpu":
            return t
        copy.keep.append(t)
        source = t
        if t.is_conj() or t.is_neg():
            # Lazy views: their memory holds the unconjugated, unnegated bits.
            source = t.resolve_conj().resolve_neg()
        nbytes = t.numel() * t.element_size()
        dst = ops.empty(nbytes)
        sources = None
        if source is t:
            sources = self._sources(t, copy)
            if sources is None and t.numel() > 0 and t.is_contiguous() and ops.is_pinned(t):
                sources = [t.reshape(-1).view(torch.uint8)]  # pinned already: as it is
                self._stats["device_pinned_leaf_bytes"] += nbytes
        plans.append(_Plan(dst, sources or [], None if sources is not None else source))
        copy.nbytes += nbytes
        out = dst.view(t.dtype).reshape(t.shape)
        tensors.append(out)
        return out

    def _stage(self, plans: list[_Plan], copy: _Copy) -> None:
        """Copy the leaves no page-locked memory holds into one staging buffer.

        NOTE [no pageable copies], NOTE [pinned staging] (``registrar``).
        """
        staging = self._staging
        assert staging is not None
        pending = [p for p in plans if p.host is not None and p.host.numel() > 0]
        if not pending:
            return
        sizes = [p.host.numel() * p.host.element_size() for p in pending]  # type: ignore[union-attr]
        total = sum(align(n) for n in sizes)
        staging.note(total)
        buffer = staging.take(total)
        if buffer is None:  # every buffer is read by a copy in flight: completed already?
            self._reap()
            buffer = staging.take(total)
        while buffer is None:  # no: wait for the oldest that holds one
            if not self._wait_oldest(lambda c: c.staged is not None):
                raise ShmLoaderError("every staging buffer is busy but no copy holds one (a bug)")
            self._stats["device_staging_waits"] += 1
            buffer = staging.take(total)
        copy.staged = buffer  # given back when the copies completed
        at = 0
        for plan, n in zip(pending, sizes, strict=True):
            host = plan.host
            assert host is not None
            if not host.is_contiguous():
                host = host.contiguous()
            window = buffer[at : at + n]
            window.copy_(host.reshape(-1).view(torch.uint8))
            plan.sources = [window]
            at += align(n)
        self._stats["device_staged_bytes"] += sum(sizes)

    def _sources(self, t: torch.Tensor, copy: _Copy) -> list[torch.Tensor] | None:
        """uint8 views of registered memory whose bytes, in order, are ``t``'s values
        row-major; None when no registered mapping holds ``t`` as few enough runs."""
        if t.numel() == 0:
            return []
        hit = self._registrar.lookup(t) if self._registrar is not None else None
        if hit is None:
            return None
        mapping, at = hit
        layout = blocks(t)
        if layout is None or mapping.base is None:
            return None
        if mapping not in copy.maps:
            mapping.users += 1
            copy.maps.append(mapping)
        size = t.element_size()
        offsets, inner = layout
        return [mapping.base[at + off * size : at + (off + inner) * size] for off in offsets]

    # NOTE [device memory reuse]
    #     Device memory of each batch is allocated on the side stream (where the
    #     copy writes it) and, when the batch is handed over, ``record_stream``-ed
    #     on the consumer's current stream: when the user drops the batch, the
    #     caching allocator reuses the block only after the consumer-stream work
    #     queued until then has finished, so no later copy overwrites memory a
    #     kernel still reads. Chosen over a ring of device buffers because batch
    #     shapes vary (packed sequences, ``select``) and the allocator already
    #     recycles blocks by size; a buffer ring would need sizing and a second
    #     hand-back protocol. Chosen by reasoning, not by measurement (no GPU
    #     here): ``python -m benchmarks.gpu`` watches device memory for growth,
    #     and ``tests/gpu`` checks that a batch dropped under a queued kernel
    #     keeps its bytes.
    def _hand_over(self, ready: _Ready) -> Any:
        ops = self._ops
        assert ops is not None
        if ready.end is not None:
            ops.wait(ready.end)  # the consumer's stream waits; the host does not
        for tensor in ready.tensors:
            ops.hand_over(tensor)
        self._stats["device_batches"] += 1
        return ready.batch

    def _reap(self) -> None:
        """Drop the CPU leaves of completed copies: their slots are released now."""
        ops = self._ops
        assert ops is not None
        still = []
        for copy in self._inflight:
            if copy.end is None or ops.query(copy.end):
                self._finish(copy)
            else:
                still.append(copy)
        self._inflight = still
        if self._registrar is not None:
            self._registrar.sweep()

    def _finish(self, copy: _Copy) -> None:
        ops = self._ops
        assert ops is not None
        self._stats["device_bytes"] += copy.nbytes
        with contextlib.suppress(Exception):  # an event that never completed has no time
            self._stats["device_copy_ms_total"] += ops.elapsed_ms(copy.start, copy.end)
        self._stats["device_copies"] += 1
        if copy.maps:
            self._stats["device_copies_registered"] += 1
        for mapping in copy.maps:
            mapping.users -= 1
        copy.keep = []  # the last references to the CPU leaves: RELEASE
        if copy.staged is not None and self._staging is not None:
            self._staging.give_back(copy.staged)
        copy.staged = None

    def _settle(self) -> None:
        """Wait for every copy still in flight and let its slots go (iteration end, close)."""
        ops = self._ops
        if ops is None:
            return
        inflight, self._inflight = self._inflight, []
        for copy in inflight:
            if copy.end is not None:
                with contextlib.suppress(Exception):
                    ops.synchronize(copy.end)
            self._finish(copy)
        if self._registrar is not None:
            self._registrar.sweep()

    def stats(self) -> dict[str, Any]:
        """Device counters of this rank (``{"device": "cpu"}`` on host delivery)."""
        if self._ops is None:
            return {"device": "cpu"}
        with self._lock:
            return self._stats_now()

    def _stats_now(self) -> dict[str, Any]:
        s = self._stats
        ms = s["device_copy_ms_total"]
        reg, staging = self._registrar, self._staging
        assert reg is not None and staging is not None
        return {
            "device": str(self.device),
            "device_batches": s["device_batches"],
            "device_bytes": s["device_bytes"],
            "device_copy_ms_total": ms,
            "device_bandwidth_gbs": s["device_bytes"] / ms / 1e6 if ms > 0 else None,
            "device_registered": reg.registrations > 0,
            "device_registrations": reg.registrations,
            "device_registered_slots": reg.live,
            "device_copies_registered": s["device_copies_registered"],
            "device_registration_refused": reg.refused,
            "device_registration_refusals": reg.refusals,
            "device_unregister_failures": len(reg.stuck),
            "device_staged_bytes": s["device_staged_bytes"],
            "device_pinned_leaf_bytes": s["device_pinned_leaf_bytes"],
            "device_copy_waits": s["device_copy_waits"],
            "device_staging_waits": s["device_staging_waits"],
            "device_registered_bytes": reg.locked_bytes,
            "device_staging_bytes": staging.locked,
            "device_staging_peak_bytes": staging.peak,
            "device_staging_buffers": staging.buffers,
            "device_locked_bytes": reg.locked_bytes + staging.locked,
        }

    def reset_stats(self) -> None:
        """Zero the copy counters (after a warm-up); registrations and buffers are kept."""
        with self._lock:
            self._stats.clear()

    def close(self) -> None:
        """Wait for copies in flight, release their slots, unregister and unmap. Idempotent."""
        # on whichever thread closes (the producer, NOTE [one owner] in ``_roles.base``):
        # the stage's device current there, as where it issued
        on = self._ops.on_thread() if self._ops is not None else contextlib.nullcontext()
        with self._lock, on:
            if self._closed:
                return
            self._closed = True
            self._settle()
            if self._registrar is not None:
                self._registrar.close()
            if self._staging is not None:
                self._staging.close()


# ----------------------------------------------------------------- helpers


def _takes_step(select: Callable[..., Any] | None) -> bool:
    """Whether ``select`` has a parameter named ``step`` (NOTE [select])."""
    if select is None:
        return False
    try:
        parameter = inspect.signature(select).parameters.get("step")
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameter is not None and parameter.kind in kinds

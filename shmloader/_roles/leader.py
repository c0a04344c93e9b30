"""The leader (``Leader``): one loop over the user's loader, each batch (or the ``SlotRef``
a DataLoader worker wrote in its place) handed to its node writer's one ``publish``, and
``worker_pool``, which makes the workers' slot pool for a ``DataLoader`` with workers. It
owns its ``Source`` and the pool's lifetime, moves the ``Cursor``'s position, writes the
counter of its main process's own time per worker-written batch (``main_ms_last``) and
touches the ring, the hub and the cross-node link only through its ``NodeWriter``; one
batch on the leader, drawn: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from .. import _rng as rng
from .._node.ring import RingWriter
from .._proto import codec
from .._proto.codec import owned_copy
from .._transport.daemon_client import DaemonClient
from .._workers import collate
from .._workers.pool import SlotRef, WorkerPool
from ..config import Config
from .base import Context
from .local import Source, forward_set_epoch
from .node_writer import NodeWriter
from .producer import Feed


def worker_pool(
    loader: Iterable[Any],
    ring: RingWriter,
    config: Config,
    daemon: DaemonClient | None,
    peers: dict[int, tuple[int, int, int]],
) -> WorkerPool | None:
    """A slot pool written by the leader's DataLoader workers (``collate``), or None.

    Only for a ``torch.utils.data.DataLoader`` with ``num_workers > 0``;
    any other loader is written by the leader's main process. ``peers``:
    pid, start time and pid namespace of this node's readers, for a
    worker's liveness check of a holder that never released (NOTE [release
    words] in ``release``).
    """
    workers = getattr(loader, "num_workers", 0)
    if not isinstance(loader, torch.utils.data.DataLoader) or not workers:
        return None
    pool = WorkerPool(
        ring,
        num_workers=workers,
        prefetch_factor=loader.prefetch_factor or 2,
        ring_slots=config.slots,
        timeout=config.timeout,  # type: ignore[arg-type]  # resolved at set-up
        allow_pickle=config.allow_pickle,
        collate_in_slot=config.collate_in_slot,
        daemon=daemon,
        peers=peers,
    )
    try:
        installed = collate.install(loader, pool)
    except BaseException:
        pool.close()
        raise
    if not installed:
        pool.close()
        return None
    return pool


class _Ended(NamedTuple):
    """The loader ended; ``draws``: what its last ``next()`` (or ``iter()``) drew."""

    draws: int


class Leader:
    """The leader's loop: the loader's batches, published to the ring and node leaders."""

    name = "leader"

    def __init__(
        self, ctx: Context, source: Source, writer: NodeWriter, pool: WorkerPool | None
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.source = source
        self.writer = writer
        self.pool = pool
        #: in step, what the user's thread drew from the loader, for the producer's loop
        #: (NOTE [one path] in ``producer``); None: the loop runs ahead and steps the loader
        self.feed: Feed | None = None

    def ready(self) -> None:
        pass

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        """The producer's loop: each item of the loader published (NOTE [one path] in
        ``producer``). Ahead, the producer steps the loader itself; in step, it takes what the
        user's thread drew (``supply``) from the ``feed``."""
        self.writer.begin(cursor)
        if self.feed is not None:
            self.feed.items.clear()
            return self._loop(it, self.feed)
        # NOTE [running ahead] (producer): the user's iter() of the loader, here, on the
        # caller's thread; only its next() moves to the producer
        try:
            opened = self._open(cursor if skip else 0, at_iter=True)
        except BaseException as exc:
            if not self.ctx.check_open.quiet():
                self.writer.fail(it, exc)
            raise
        return self._loop(it, self._items(0, opened))

    def supply(self, it: int, cursor: int, skip: bool) -> tuple[Iterator[Any], Feed] | None:
        """In step, the loader's items as the user's thread draws them, and the feed they go
        to (NOTE [one path])."""
        if self.feed is None:
            return None
        return self._items(cursor if skip else 0), self.feed

    def _open(self, skip: int, *, at_iter: bool = False) -> tuple[Iterator[Any], int, int]:
        """Reclaim the slots of dead workers and open the user's loader (``Source.open``):
        its batches, the draws its opening cost, and the pool's count of iterations then."""
        if self.pool is not None:
            self.pool.reclaim()  # slots of workers that died in an earlier iteration
        batches, pending = self.source.open(skip, at_iter=at_iter)
        return batches, pending, self.pool.iteration if self.pool is not None else 0

    def set_epoch(self, epoch: int) -> None:
        if self.source.loader is not None:
            forward_set_epoch(self.source.loader, epoch)

    def close(self) -> None:
        self.writer.say_closed(self.ctx.cursor.it)

    def closers(self) -> list[Callable[[], None]]:
        return self.writer.closers() + ([self.pool.close] if self.pool else [])

    def stats(self) -> dict[str, Any]:
        return self.writer.stats()

    # NOTE [draws ahead]
    #     The leader counts the default-generator draws of each ``next()`` of its
    #     loader (a snapshot before, a count after) and its followers mirror
    #     them. A loop that runs ahead (NOTE [running ahead] in ``producer``)
    #     cannot count: the user's thread draws (dropout, augmentation) at the
    #     same time, and a count would take those for the loader's. So only a
    #     loader whose ``next()`` draws nothing runs ahead: a ``DataLoader``
    #     with workers (its samplers draw their seed when ``iter()`` primes the
    #     workers, on the caller's thread; a worker's draws are its own
    #     process's) whose samplers are torch's, torchdata's or shmloader's: a
    #     sampler of the user's own may draw from the default generator for
    #     each index, in this process, inside ``next()``; with one the leader
    #     stays in step and counts (``_setup.build.leads_ahead``). Its draws per
    #     batch are 0 by that rule, and what
    #     ``iter()`` drew goes with the first batch, as in every loop. A loader
    #     without workers runs its dataset in this process, on the caller's
    #     thread, where its draws land exactly as with sharing off.
    def _items(
        self, skip: int, opened: tuple[Iterator[Any], int, int] | None = None
    ) -> Iterator[tuple[Any, int] | _Ended]:
        """The loader's batches with the draws each cost (NOTE [draws ahead]), then
        ``_Ended``: on the user's thread in step, on the producer ahead."""
        ctx, source = self.ctx, self.source
        if opened is None:
            opened = self._open(skip)
        batches, pending, opened_at = opened
        try:
            while True:
                ctx.check_open()
                source.boundary_reached()
                before = None if self.feed is None else rng.snapshot()  # NOTE [draws ahead]
                box = []  # NOTE [no batch in the frame] (base)
                t_wait = time.perf_counter()
                try:
                    # the user's code: close() from another thread need not wait for
                    # it (NOTE [one owner] in base)
                    with ctx.check_open.outside():
                        box.append(next(batches))
                except StopIteration:
                    ctx.cursor.finish()
                    yield _Ended(pending + self._drawn(before))
                    return
                ctx.stats.note_wait(t_wait)
                draws, pending = pending + self._drawn(before), 0
                ctx.cursor.count()
                yield box.pop(), draws
        except BaseException:  # left early: the loader's iterator ends with this frame
            if self.pool is not None:
                self.pool.leaving(opened_at)  # its workers stop waiting for slots
            raise

    def _loop(self, it: int, items: Iterator[tuple[Any, int] | _Ended]) -> Iterator[Any]:
        ctx, writer = self.ctx, self.writer
        try:
            while True:
                ctx.check_open()
                writer.free_released()  # before we block on the workers
                box = [next(items)]  # NOTE [no batch in the frame] (base)
                if isinstance(box[0], _Ended):
                    writer.end(it, box[0].draws)
                    return
                yield self._publish(it, *box.pop())
        except GeneratorExit:
            raise
        except BaseException as exc:
            # closed: close() tells the peers (STOP); halted: the user left (NOTE [running ahead])
            if not ctx.check_open.quiet():
                writer.fail(it, exc)
            raise

    def _drawn(self, before: torch.Tensor | None) -> int:
        """Draws of the loader's last ``next()`` (NOTE [draws ahead]: none when ahead)."""
        return 0 if before is None else self.source.count(before)

    def _publish(self, it: int, batch: Any, draws: int) -> Any:
        """Publish ``batch`` (``NodeWriter.publish``); return the leader's own copy of it.

        The leader, too, gets a copy-on-write view of the slot (unless
        ``SHMLOADER_COPY``), so the loader's batch can be freed at once: the
        node holds each batch once, in the ring, and every rank of the group
        sees the very same structure. A ``SlotRef`` (a DataLoader worker wrote
        the batch into a pool slot, ``collate``) is published as it is: its
        metadata, no payload copy.
        """
        if isinstance(batch, collate.WorkerFailure):
            raise batch.exception()
        config, writer = self.config, self.writer
        if not isinstance(batch, SlotRef):
            enc = codec.encode(batch, allow_pickle=config.allow_pickle)
            if config.copy:  # the loader's own batch: the writer keeps nothing of the slot
                writer.publish(it, enc, draws, view=False)
                return batch
            view = writer.publish(it, enc, draws)
            return codec.decode(
                enc.meta, view, allow_pickle=config.allow_pickle, own_below=config.small_copy_bytes
            )
        view = writer.publish(it, batch, draws)
        if config.copy:
            return owned_copy(codec.decode(batch.meta, view, allow_pickle=config.allow_pickle))
        out = codec.decode(
            batch.meta, view, allow_pickle=config.allow_pickle, own_below=config.small_copy_bytes
        )
        # the main process's own work on this batch, waiting for readers left out
        self.ctx.stats.counts["main_ms_last"] = (time.perf_counter_ns() - writer.began_ns) / 1e6
        return out

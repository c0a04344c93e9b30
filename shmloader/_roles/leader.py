"""The leader: runs the user's loader and publishes each batch once.

One batch, on the leader (``Leader.iterate``)::

    batch = next(loader)                      (Source; or a SlotRef a DataLoader worker wrote)
    enc = codec.encode(batch)
    writer.await_readers()                    (window: SHMLOADER_SLOTS)
    slot = ring.acquire(n)                    (_publish_ref: pool.adopt(ref))
    codec.write_payload(enc, slot)
    xnode.send(meta, slot) =================> each node leader (``relay``)
    writer.announce: hub.publish(BATCH) ----> this node's followers (``follower``)
    yield decode(private view of the slot)    (the leader's own copy-on-write view)

    end of the loader:  _end: xnode END, END to readers
    the loader raised:  writer.fail: ERROR, or STOP for
                        KeyboardInterrupt / SystemExit, to every reader and node leader

The leader holds a ``Source`` (``local``), its node's ``Writer``, the
DataLoader workers' ``WorkerPool`` (or None) and the ``CrossNode`` link to
node leaders (or None); it writes only the ``Cursor``'s position and its
publication counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._node.ring import RingWriter
from .._proto import codec
from .._proto.wire import Kind
from .._transport.daemon_client import DaemonClient
from .._transport.xnode import KIND_BATCH, KIND_END, CrossNode
from .._workers import collate as worker_writer
from .._workers.pool import SlotRef, WorkerPool
from ..config import Config
from . import rng
from .base import Context, _crc, _owned_copy
from .local import Source, _forward_set_epoch
from .node_writer import Writer


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
        timeout=config.timeout,
        allow_pickle=config.allow_pickle,
        collate_in_slot=config.collate_in_slot,
        daemon=daemon,
        peers=peers,
    )
    try:
        installed = worker_writer.install(loader, pool)
    except BaseException:
        pool.close()
        raise
    if not installed:
        pool.close()
        return None
    return pool


class Leader:
    """The leader's loop: the loader's batches, published to the ring and node leaders."""

    name = "leader"

    def __init__(
        self,
        ctx: Context,
        source: Source,
        writer: Writer,
        pool: WorkerPool | None,
        xnode: CrossNode | None,
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.source = source
        self.writer = writer
        self.ring = writer.ring
        self.pool = pool
        self.xnode = xnode

    def ready(self) -> None:
        pass

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        self.writer.begin(cursor)
        return self._loop(it, cursor if skip else 0)

    def set_epoch(self, epoch: int) -> None:
        self.writer.follow_epoch()
        if self.source.loader is not None:
            _forward_set_epoch(self.source.loader, epoch)

    def close(self) -> None:
        self.writer.say_closed(self.ctx.cursor.it)

    def closers(self) -> list[Callable[[], None]]:
        return [self.writer.hub.close, self.ring.close] + ([self.pool.close] if self.pool else [])

    def stats(self) -> dict[str, Any]:
        out = {"ring_slots": len(self.ring.slots), "ring_bytes": self.ring.total_bytes}
        if self.xnode is not None:
            out["cross_node_bytes_sent"] = self.xnode.bytes_sent
        return out

    def _loop(self, it: int, skip: int) -> Iterator[Any]:
        ctx, source, pool = self.ctx, self.source, self.pool
        try:
            if pool is not None:
                pool.reclaim()  # slots of workers that died in an earlier iteration
            batches, pending = source.open(skip)
            while True:
                ctx.check_open()
                source.boundary_reached()
                if pool is not None:  # free what ranks released before we block on workers
                    self.writer.pump()
                    pool.sync()
                before = rng.snapshot()
                box = []  # NOTE [no batch in the frame] (base)
                t_wait = time.perf_counter()
                try:
                    # the user's code: close() from another thread need not wait for
                    # it (NOTE [close from any thread] in base)
                    with ctx.check_open.outside():
                        box.append(next(batches))
                except StopIteration:
                    self._end(it, pending + source.count(before))
                    ctx.cursor.finish()
                    return
                ctx.stats.note_wait(t_wait)
                draws, pending = pending + source.count(before), 0
                ctx.cursor.count()
                yield self._publish(it, box.pop(), draws)
        except GeneratorExit:
            raise
        except BaseException as exc:
            if not ctx.check_open.closed:  # closed: close() tells the peers (STOP)
                self.writer.fail(it, exc, forward=True)
            raise

    def _publish(self, it: int, batch: Any, draws: int) -> Any:
        """Write ``batch`` once into the ring, announce it; return the leader's own copy.

        The leader, too, gets a copy-on-write view of the slot (unless
        ``SHMLOADER_COPY``), so the loader's batch can be freed at once: the
        node holds each batch once, in the ring, and every rank of the group
        sees the very same structure. A ``SlotRef`` (a DataLoader worker wrote
        the batch into a pool slot, ``collate``) is announced as it is.
        """
        if isinstance(batch, worker_writer.WorkerFailure):
            raise batch.exception()
        if isinstance(batch, SlotRef):
            return self._publish_ref(it, batch, draws)
        enc = codec.encode(batch, allow_pickle=self.config.allow_pickle)
        self.writer.await_readers()
        t0 = time.perf_counter_ns()
        slot = self.ring.acquire(enc.nbytes) if enc.nbytes else None
        if slot is not None:
            codec.write_payload(enc, slot.payload)
        t1 = time.perf_counter_ns()
        payload = slot.payload[: enc.nbytes] if slot is not None else None
        crc = _crc(payload) if self.config.verify and payload is not None else -1
        if self.xnode is not None:
            self.xnode.send(KIND_BATCH, it, enc.meta, payload, draws=draws, crc=crc)
            self.ctx.check_open()  # a close() that gave up waiting for this send
        self.writer.announce(it, enc.meta, enc.nbytes, slot, draws, t1 - t0, crc)
        counts = self.ctx.stats.counts
        counts["published"] += 1
        counts["bytes_published"] += enc.nbytes
        counts["publish_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
        counts["write_ms_last"] = (t1 - t0) / 1e6
        if self.config.copy:
            if slot is not None:
                self.ring.release(self.writer.topo.me, slot.index, slot.gen)
            return batch
        return codec.decode(
            enc.meta,
            self.writer.own_view(slot, enc.nbytes),
            allow_pickle=self.config.allow_pickle,
            own_below=self.config.small_copy_bytes,
        )

    def _publish_ref(self, it: int, ref: SlotRef, draws: int) -> Any:
        """Announce a batch a worker wrote into a pool slot: metadata only, no payload copy."""
        pool = self.pool
        assert pool is not None
        self.writer.await_readers()
        t0 = time.perf_counter_ns()
        slot = pool.adopt(ref) if ref.nbytes else None  # no payload: no slot
        payload = slot.payload[: ref.nbytes] if slot is not None else None
        crc = _crc(payload) if self.config.verify and payload is not None else -1
        if self.xnode is not None:
            self.xnode.send(KIND_BATCH, it, ref.meta, payload, draws=draws, crc=crc)
            self.ctx.check_open()  # a close() that gave up waiting for this send
        self.writer.announce(it, ref.meta, ref.nbytes, slot, draws, 0, crc)
        counts = self.ctx.stats.counts
        counts["published"] += 1
        counts["worker_written"] += 1
        counts["bytes_published"] += ref.nbytes
        counts["publish_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
        counts["write_ms_last"] = 0.0  # the main process wrote nothing
        counts["worker_write_ms_last"] = pool.last_write_ns / 1e6
        counts["bytes_collated_in_place"] += pool.last_placed
        view = self.writer.own_view(slot, ref.nbytes)
        if self.config.copy:
            batch = _owned_copy(codec.decode(ref.meta, view, allow_pickle=self.config.allow_pickle))
            del view
            return batch
        batch = codec.decode(
            ref.meta,
            view,
            allow_pickle=self.config.allow_pickle,
            own_below=self.config.small_copy_bytes,
        )
        # the main process's own work on this batch, waiting for readers left out
        counts["main_ms_last"] = (time.perf_counter_ns() - t0) / 1e6
        return batch

    def _end(self, it: int, draws: int) -> None:
        if self.xnode is not None:
            self.xnode.send(KIND_END, it, b"", draws=draws)
        self.writer.await_readers(window=False)
        self.writer.tell_readers(self.writer.stamped(Kind.END, it, draws=draws))

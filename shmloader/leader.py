"""The leader: runs the user's loader and publishes each batch once.

One batch, on the leader (``_leader_iteration``)::

    batch = next(loader)                      (or a SlotRef a DataLoader worker wrote)
    enc = codec.encode(batch)
    _await_readers()                          (window: SHMLOADER_SLOTS)
    slot = ring.acquire(n)                    (_publish_ref: pool.adopt(ref))
    codec.write_payload(enc, slot)
    xnode.send(meta, slot) =================> each node leader (``relay``)
    _announce: hub.publish(BATCH) ----------> this node's followers (``follower``)
    yield decode(private view of the slot)    (the leader's own copy-on-write view)

    end of the loader:  _end: xnode END, END to readers
    the loader raised:  _fail (``writer``): ERROR, or STOP for
                        KeyboardInterrupt / SystemExit, to every reader and node leader
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from . import codec, rng
from . import worker as worker_writer
from .local import _Local
from .pool import SlotRef, WorkerPool
from .roles import _crc, _owned_copy
from .wire import Kind
from .writer import _Writer
from .xnode import KIND_BATCH, KIND_END


class _Leader(_Local, _Writer):
    """The leader's loop: the loader's batches, published to the ring and node leaders."""

    def _worker_pool(self) -> WorkerPool | None:
        """A slot pool written by the leader's DataLoader workers (``worker``), or None.

        Only for a ``torch.utils.data.DataLoader`` with ``num_workers > 0``;
        any other loader is written by the leader's main process.
        """
        loader = self._loader
        workers = getattr(loader, "num_workers", 0)
        if not isinstance(loader, torch.utils.data.DataLoader) or not workers:
            return None
        assert self._ring is not None
        pool = WorkerPool(
            self._ring,
            num_workers=workers,
            prefetch_factor=loader.prefetch_factor or 2,
            ring_slots=self.config.slots,
            timeout=self.config.timeout,
            allow_pickle=self.config.allow_pickle,
            collate_in_slot=self.config.collate_in_slot,
            daemon=self._daemon,
            peers=self._release_peers(),
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

    def _release_peers(self) -> dict[int, tuple[int, int, int]]:
        """Pid, start and pid namespace of this node's readers: a worker's liveness
        check of a holder that never released (NOTE [release words] in ``release``)."""
        topo = self._topo
        return {f.rank: (f.pid, f.start, f.pidns) for f in topo.facts if f.rank in topo.readers}

    def _check_loader_free(self) -> None:
        """Refuse, at set-up, a DataLoader another open ShmLoader's pool wraps.

        Called right after ``make_loader`` on the leader, so that every rank
        gets the error (``worker.check_installable``) instead of a pool that
        could not be installed.
        """
        worker_writer.check_installable(self._loader)

    def _leader_iteration(self, it: int, skip: int) -> Iterator[Any]:
        try:
            if self._pool is not None:
                self._pool.reclaim()  # slots of workers that died in an earlier iteration
            source, pending = self._open_source(skip)
            while True:
                self._check_open()
                self._mark_boundary()
                if self._pool is not None:  # free what ranks released before we block on workers
                    self._pump()
                    self._pool.sync()
                before = rng.snapshot()
                box = []  # NOTE [no batch in the frame] (loader)
                t_wait = time.perf_counter()
                try:
                    box.append(next(source))
                except StopIteration:
                    self._end(it, pending + self._count(before))
                    self._exhausted = True
                    return
                self._note_wait(t_wait)
                draws, pending = pending + self._count(before), 0
                self._delivered += 1
                yield self._publish(it, box.pop(), draws)
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._fail(it, exc)
            raise

    def _publish(self, it: int, batch: Any, draws: int) -> Any:
        """Write ``batch`` once into the ring, announce it; return the leader's own copy.

        The leader, too, gets a copy-on-write view of the slot (unless
        ``SHMLOADER_COPY``), so the loader's batch can be freed at once: the
        node holds each batch once, in the ring, and every rank of the group
        sees the very same structure. A ``SlotRef`` (a DataLoader worker wrote
        the batch into a pool slot, ``worker``) is announced as it is.
        """
        if isinstance(batch, worker_writer.WorkerFailure):
            raise batch.exception()
        if isinstance(batch, SlotRef):
            return self._publish_ref(it, batch, draws)
        enc = codec.encode(batch, allow_pickle=self.config.allow_pickle)
        self._await_readers()
        t0 = time.perf_counter_ns()
        slot = self._ring.acquire(enc.nbytes) if enc.nbytes else None  # type: ignore[union-attr]
        if slot is not None:
            codec.write_payload(enc, slot.payload)
        t1 = time.perf_counter_ns()
        payload = slot.payload[: enc.nbytes] if slot is not None else None
        crc = _crc(payload) if self.config.verify and payload is not None else -1
        if self._xnode is not None:
            self._xnode.send(KIND_BATCH, it, enc.meta, payload, draws=draws, crc=crc)
        self._announce(it, enc.meta, enc.nbytes, slot, draws, t1 - t0, crc)
        self._stats["published"] += 1
        self._stats["bytes_published"] += enc.nbytes
        self._stats["publish_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
        self._stats["write_ms_last"] = (t1 - t0) / 1e6
        if self.config.copy:
            if slot is not None:
                self._ring.release(self._me, slot.index, slot.gen)  # type: ignore[union-attr]
            return batch
        return codec.decode(
            enc.meta,
            self._own_view(slot, enc.nbytes),
            allow_pickle=self.config.allow_pickle,
            own_below=self.config.small_copy_bytes,
        )

    def _publish_ref(self, it: int, ref: SlotRef, draws: int) -> Any:
        """Announce a batch a worker wrote into a pool slot: metadata only, no payload copy."""
        assert self._pool is not None and self._ring is not None
        self._await_readers()
        t0 = time.perf_counter_ns()
        slot = self._pool.adopt(ref) if ref.nbytes else None  # no payload: no slot
        payload = slot.payload[: ref.nbytes] if slot is not None else None
        crc = _crc(payload) if self.config.verify and payload is not None else -1
        if self._xnode is not None:
            self._xnode.send(KIND_BATCH, it, ref.meta, payload, draws=draws, crc=crc)
        self._announce(it, ref.meta, ref.nbytes, slot, draws, 0, crc)
        self._stats["published"] += 1
        self._stats["worker_written"] += 1
        self._stats["bytes_published"] += ref.nbytes
        self._stats["publish_ms_total"] += (time.perf_counter_ns() - t0) / 1e6
        self._stats["write_ms_last"] = 0.0  # the main process wrote nothing
        self._stats["worker_write_ms_last"] = self._pool.last_write_ns / 1e6
        self._stats["bytes_collated_in_place"] += self._pool.last_placed
        view = self._own_view(slot, ref.nbytes)
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
        self._stats["main_ms_last"] = (time.perf_counter_ns() - t0) / 1e6
        return batch

    def _end(self, it: int, draws: int) -> None:
        if self._xnode is not None:
            self._xnode.send(KIND_END, it, b"", draws=draws)
        self._await_readers(window=False)
        self._tell_readers(self._stamped(Kind.END, it, draws=draws))

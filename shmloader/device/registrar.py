"""Page-locked host memory the device copies read: registered slots and staging buffers.

It owns each slot's read-only shared mapping, registered with CUDA once
(:class:`Registrar`; NOTE [registration]), and the few reused pinned staging
buffers every other leaf is copied into first (:class:`Staging`; NOTE [pinned
staging]), with the locked bytes counted, so that no copy reads pageable memory
(NOTE [no pageable copies]). It maps slots through ``views`` and ``segment`` and
does every device call through ``DeviceOps``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .._node import views
from .._node.segment import Segment
from .cuda import DeviceOps

log = logging.getLogger("shmloader.device")

# NOTE [no pageable copies]
#     A host-to-device copy from pageable memory is staged by the driver and
#     may synchronise with the stream: ``next()`` would wait for the whole
#     batch's DMA. So the stage never issues one. A leaf is copied from where
#     it is when that is page-locked: a registered slot, or a tensor pinned
#     already (``DataLoader(pin_memory=True)`` with sharing off, say;
#     ``DeviceOps.is_pinned``). Every other leaf (leaves of at most
#     ``SHMLOADER_SMALL_COPY`` bytes, which readers decode as owned copies,
#     e.g. ``cu_seqlens``; lazily conjugated or negated views, resolved first;
#     leaves of a refused slot; sharing off or ``SHMLOADER_COPY=1``) is copied
#     on the host into one staging buffer per batch (NOTE [pinned staging])
#     and DMA'd from there.
#: Staging buffers at most (NOTE [pinned staging]).
STAGING_BUFFERS = 2
#: Staged batches whose sizes decide a new buffer's size and when a free one goes.
STAGING_WINDOW = 8
#: A free buffer more than this many times what the recent batches need is released.
STAGING_SHRINK = 2


# ------------------------------------------------------------- registration


# NOTE [registration]
#     Each rank maps each slot segment once, read-only and MAP_SHARED
#     (``views.map_shared_readonly``), and registers that mapping once with
#     ``cudaHostRegisterReadOnly | cudaHostRegisterPortable`` (measured on an
#     H200: 51-108 ms per GiB, once; copies at 53 GB/s, like a pinned tensor;
#     default flags on a read-only mapping are refused; registering the
#     private copy-on-write view instead breaks copy-on-write or costs 5-10x).
#     Whether the GPU can register read-only memory at all is asked once
#     (``cudaDevAttrHostRegisterReadOnlySupported``); where it cannot, or no
#     ``libcudart`` can be bound (NOTE [libcudart] in ``cuda``), nothing is
#     registered and every leaf is staged (NOTE [no pageable copies]). The
#     mapping lives while its segment does: when the slot is retired (grown;
#     the segment's descriptor is closed) and no copy uses it, or on close, it
#     is unregistered first and unmapped after. A refusal costs its slot
#     only: that segment is never asked again and its batches are staged,
#     while slots registered before or after keep their DMA (ordinary causes:
#     the driver cannot page-lock one more large slot, a range still
#     registered; ``ulimit -l`` does not apply to ``cudaHostRegister``). An
#     unregister that fails leaves its mapping mapped for the process's life
#     (``Registrar.stuck``): unmapping a range the driver still holds would
#     let the address come back in a later mapping, which CUDA then refuses
#     as registered already.
@dataclass(eq=False)
class HostMapping:
    """One rank's registered, read-only MAP_SHARED mapping of one slot segment."""

    segment: Segment
    mm: mmap.mmap
    base: torch.Tensor | None  # uint8 over the whole mapping
    address: int
    payload_at: int
    users: int = 0  # copies in flight that read it


class Registrar:
    """The registered mappings of one stage, one per slot segment (NOTE [registration])."""

    def __init__(self, ops: DeviceOps) -> None:
        self._ops = ops
        self._maps: dict[int, HostMapping] = {}  # id(segment) -> mapping; the segment is held
        #: slots whose registration was refused: copied through staging, never asked again
        self._refused: weakref.WeakKeyDictionary[Segment, str] = weakref.WeakKeyDictionary()
        #: mappings whose unregister failed: kept mapped for good (never unmapped registered)
        self.stuck: list[HostMapping] = []
        self.refused: str | None = None  # the last refusal, or why nothing is registered
        self.refusals = 0
        self.registrations = 0
        self.unregistrations = 0
        self._told_unavailable = False

    @property
    def live(self) -> int:
        return len(self._maps)

    @property
    def locked_bytes(self) -> int:
        """Bytes registered now: live mappings and those stuck registered."""
        return sum(len(m.mm) for m in self._maps.values()) + sum(len(m.mm) for m in self.stuck)

    def lookup(self, tensor: torch.Tensor) -> tuple[HostMapping, int] | None:
        """The registered mapping ``tensor`` can be copied from and its byte offset there."""
        found = views.view_source(tensor.data_ptr())
        if found is None:
            return None  # not a view of a slot (sharing off, SHMLOADER_COPY, no payload)
        segment, offset = found
        mapping = self._maps.get(id(segment))
        if mapping is None:
            if segment.fd < 0 or segment in self._refused:
                return None  # retired already, or refused: staged
            if not self._available():
                return None
            mapping = self._open(segment)
            if mapping is None:
                return None
        return mapping, mapping.payload_at + offset

    def _available(self) -> bool:
        reason = self._ops.registration()
        if reason is None:
            return True
        self.refused = reason
        if not self._told_unavailable:
            self._told_unavailable = True
            log.warning(
                "shmloader: ring slots are not registered with CUDA: %s. Batches go to the GPU "
                "through a pinned staging buffer (one host copy more; same bytes)",
                reason,
            )
        return False

    def _open(self, segment: Segment) -> HostMapping | None:
        mm, payload_at = views.map_shared_readonly(segment)
        array = np.frombuffer(mm, dtype=np.uint8)
        address = array.__array_interface__["data"][0]
        error = self._ops.register(address, len(mm))
        if error is not None:
            del array
            mm.close()
            self._refused[segment] = error
            self.refused = error
            self.refusals += 1
            log.log(
                logging.WARNING if self.refusals == 1 else logging.DEBUG,
                "shmloader: CUDA refused to register ring slot %s (%s); this slot's batches go "
                "to the GPU through a pinned staging buffer (one host copy more), the other "
                "slots are still registered",
                segment.name,
                error,
            )
            return None
        self.registrations += 1
        with warnings.catch_warnings():  # read-only: only the DMA engine reads it
            warnings.simplefilter("ignore", UserWarning)
            base = torch.from_numpy(array)
        mapping = HostMapping(segment, mm, base, address, payload_at)
        self._maps[id(segment)] = mapping
        return mapping

    def sweep(self) -> None:
        """Unregister and unmap the mappings of retired slots no copy reads any more."""
        for key, mapping in list(self._maps.items()):
            if mapping.segment.fd < 0 and mapping.users == 0:
                self._drop(key)

    def _drop(self, key: int) -> None:
        mapping = self._maps.pop(key)
        try:
            error = self._ops.unregister(mapping.address)  # before unmap, always
        except Exception as exc:
            error = f"cudaHostUnregister raised {exc!r}"
        if error is not None:
            # Unmapping a range the driver still holds registered would let the
            # address come back in a later mapping (refused: already registered).
            self.stuck.append(mapping)
            log.warning(
                "shmloader: %s for ring slot %s; its %d bytes stay mapped for the life of "
                "this process rather than being unmapped while still registered",
                error,
                mapping.segment.name,
                len(mapping.mm),
            )
            return
        self.unregistrations += 1
        mapping.base = None
        with contextlib.suppress(BufferError):
            mapping.mm.close()

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)


# ------------------------------------------------------------------ staging


# NOTE [pinned staging]
#     Staging buffers are the stage's own, bounded and reused, never one
#     allocation per batch (torch's caching host allocator rounds each up to a
#     power of two and keeps what it locked for the process's life: a 300 MiB
#     batch per step kept about 1.5 GiB page-locked per rank). At most
#     ``STAGING_BUFFERS`` exist; a batch takes the smallest free one that holds
#     its staged bytes, and gives it back when its copies completed. With none
#     free and the limit reached, the stage waits (host) for the oldest copy
#     that holds one: the DMA is then two batches behind the host, and waiting
#     is the bound. A new buffer is sized from the batches seen: the largest
#     of the last ``STAGING_WINDOW`` plus an eighth, rounded up to 64 KiB (2 MiB
#     above 8 MiB). A free buffer more than ``STAGING_SHRINK`` times what the
#     last ``STAGING_WINDOW`` batches needed is released (unregistered and
#     unmapped: the memory goes back to the system), so one large batch does
#     not keep its staging for the rest of the job. ``stats()`` counts the
#     bytes locked now (``device_staging_bytes``, with the registered slots'
#     ``device_registered_bytes``: ``device_locked_bytes``) and its peak.
def staging_capacity(nbytes: int) -> int:
    """A new staging buffer's size for batches staging up to ``nbytes`` (NOTE [pinned staging])."""
    want = nbytes + nbytes // 8
    granule = (2 << 20) if want > (8 << 20) else (64 << 10)
    return max(granule, (want + granule - 1) // granule * granule)


class Staging:
    """The stage's page-locked staging buffers: bounded, reused (NOTE [pinned staging])."""

    def __init__(self, ops: DeviceOps, limit: int = STAGING_BUFFERS) -> None:
        self._ops = ops
        self.limit = limit
        self._free: list[torch.Tensor] = []
        self._busy: dict[int, torch.Tensor] = {}  # id -> buffer a batch's copies read
        self._recent: collections.deque[int] = collections.deque(maxlen=STAGING_WINDOW)
        self.locked = 0  # bytes page-locked now
        self.peak = 0
        self.allocations = 0
        self.releases = 0

    @property
    def buffers(self) -> int:
        return len(self._free) + len(self._busy)

    def note(self, nbytes: int) -> None:
        """One batch stages ``nbytes``: its size counts for sizing and release."""
        self._recent.append(nbytes)
        self._shrink()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least ``nbytes``, or None: the limit is reached and none is free
        that holds it (the caller waits for a copy that holds one, then asks again)."""
        fits = [b for b in self._free if b.numel() >= nbytes]
        if fits:
            buffer = min(fits, key=lambda b: b.numel())
            self._free.remove(buffer)
        else:
            if self.buffers >= self.limit:
                if not self._free:
                    return None
                self._release(min(self._free, key=lambda b: b.numel()))  # too small: replace
            size = staging_capacity(max(nbytes, max(self._recent, default=0)))
            buffer = self._ops.pinned(size)
            self.allocations += 1
            self.locked += buffer.numel()
            self.peak = max(self.peak, self.locked)
        self._busy[id(buffer)] = buffer
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """``buffer``'s copies completed: it can be written again."""
        if self._busy.pop(id(buffer), None) is not None:
            self._free.append(buffer)
            self._shrink()

    def _shrink(self) -> None:
        if len(self._recent) < STAGING_WINDOW:
            return
        limit = STAGING_SHRINK * staging_capacity(max(self._recent))
        for buffer in [b for b in self._free if b.numel() > limit]:
            self._release(buffer)

    def _release(self, buffer: torch.Tensor) -> None:
        self._free.remove(buffer)
        self.locked -= buffer.numel()
        self.releases += 1
        self._ops.unpin(buffer)

    def close(self) -> None:
        """Release every free buffer (the stage settles its copies first)."""
        for buffer in list(self._free):
            self._release(buffer)

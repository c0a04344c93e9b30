"""Device delivery: every tensor of a delivered batch arrives on the GPU.

``ShmLoader(..., device="cuda", select=...)`` wraps the delivered-batch
iterator of every role (local, leader, node leader, follower) in one
:class:`DeviceStage`; the roles' loops do not change. The stage runs in the
consuming thread (no background thread: a follower's ZeroMQ socket belongs to
the thread that iterates, and releases are sent from it, NOTE [prompt release]
in ``follower``).

One ``next()`` on a CUDA rank::

    reap      poll the end event of every copy whose CPU view still holds a slot;
              completed: drop the view -> weakref.finalize -> RELEASE (slot FREE)
    pull      while fewer than 1 + prefetch batches are in flight:
                cpu = select(next(inner))           shared CPU views, still HOLDING their slots
                on the side stream:
                  per tensor leaf: slot = ring.view_source(ptr)
                                   mapping = registered read-only MAP_SHARED map of slot
                                             (made and cudaHostRegister'ed once per slot)
                                   or, in no registered slot: into the pinned staging buffer
                  start event (NOTE [copy timing])
                  per leaf:        device bytes <- mapping or staging buffer  (async DMA)
                end event; keep cpu until the end event completes
    reap      again (copies issued a step ago have usually completed)
    hand over the oldest: current stream waits for its end event (no host sync),
              record_stream(current) on its tensors; return it

Life of one batch in the stage (zero is invalid, as for slots)::

        pull + issue copies          end event completed (polled)
    PULLED ------------------> COPYING -----------------------------> COPIED
                                  |      CPU view dropped: the slot is RELEASEd
                                  |
                                  +-- hand-over may happen in COPYING or COPIED:
                                      the consumer stream waits on the event

So a GPU consumer holds ring memory for one copy's duration (plus at most one
step until the next poll), not for as long as it keeps the batch: the device
tensors own their memory.

NOTE [checkpoints under prefetch]
    The stage pulls up to ``prefetch`` batches before the user asks for them,
    and pulling runs the role's loop: the loader steps, the loop counts, a
    follower mirrors the leader's RNG draws. ``ShmLoader.state_dict()`` must
    still describe the last batch *handed over*, so that a resume delivers
    the pulled-but-undelivered batches again:

    - position: ``position()`` is snapshotted right after each pull (cursor,
      end of epoch, a stateful loader's state and its state at the step
      boundary) and travels with the batch; handing the batch over makes its
      snapshot ``self.position``, what ``state_dict()`` reads;
    - RNG: the capture at a step's first micro-batch (NOTE [RNG at the step
      boundary] in ``rng``) happens in ``request()``, at the user's
      ``next()``, not where the loop pulls (that is up to ``prefetch``
      batches earlier, before the user's own draws for the batches between).

    A resumed stage pulls the batches after the cursor back to back, without
    the user's draws in between: the loader's draws from the default
    generators must not depend on that order. They do not for a DataLoader
    (draws at ``iter()`` only, before the first pull) nor with workers; they
    do for randomness drawn per batch in the main process (``num_workers=0``
    with random augmentation in the dataset or ``collate_fn``), which a
    resume under prefetch cannot replay exactly: give it its own generator.

NOTE [registration]
    Each rank maps each slot segment once, read-only and MAP_SHARED
    (``ring.map_shared_readonly``), and registers that mapping once with
    ``cudaHostRegisterReadOnly | cudaHostRegisterPortable`` (measured on an
    H200: 51-108 ms per GiB, once; copies at 53 GB/s, like a pinned tensor;
    default flags on a read-only mapping are refused; registering the
    private copy-on-write view instead breaks copy-on-write or costs 5-10x).
    Whether the GPU can register read-only memory at all is asked once
    (``cudaDevAttrHostRegisterReadOnlySupported``); where it cannot, nothing
    is registered and every leaf is staged (NOTE [no pageable copies]).
    The mapping lives while its segment does: when the slot is retired
    (grown; the segment's descriptor is closed) and no copy uses it, or on
    close, it is unregistered first and unmapped after. A refusal costs its
    slot only: that segment is never asked again and its batches are
    staged, while slots registered before or after keep their DMA (ordinary
    causes: the driver cannot page-lock one more large slot, a range still
    registered; ``ulimit -l`` does not apply to ``cudaHostRegister``). An
    unregister that fails leaves its mapping mapped for the process's life
    (``Registrar.stuck``): unmapping a range the driver still holds would
    let the address come back in a later mapping, which CUDA then refuses
    as registered already.

    Binding: ``ctypes`` on the ``libcudart`` that torch itself loaded (found
    in ``/proc/self/maps``), so the calls run in torch's CUDA runtime
    instance; of several mapped copies (another extension may bring a newer
    runtime, whose registrations an older driver refuses) the one whose
    major version is ``torch.version.cuda``'s (``pick_cudart``). Chosen over
    ``torch.cuda.cudart()`` because that binding has no ``cudaGetLastError``:
    a refused ``cudaHostRegister`` leaves the error pending in the runtime,
    and torch's next kernel-launch check would raise it from an unrelated
    operation; here it is cleared at once. So where no matching
    ``libcudart`` is mapped (a static build) nothing is registered at all.
    Chosen over ``cuda-bindings`` because it needs no new dependency and no
    second runtime.

NOTE [no pageable copies]
    A host-to-device copy from pageable memory is staged by the driver and
    may synchronise with the stream: ``next()`` would wait for the whole
    batch's DMA. So the stage never issues one: every leaf that no
    registered mapping holds (leaves of at most ``SHMLOADER_SMALL_COPY``
    bytes, which readers decode as owned copies, e.g. ``cu_seqlens``; lazily
    conjugated or negated views, resolved first; leaves of a refused slot;
    sharing off) is copied on the host into one pinned buffer per batch
    (``DeviceOps.pinned``: torch's caching host allocator) and DMA'd from
    there. The buffer lives until the batch's copies completed.

NOTE [copy timing]
    The start event is recorded right before the batch's first copy, after
    the host work for it (finding and registering slots, allocating device
    memory, staging): ``device_copy_ms_total`` times the copies, not Python.

NOTE [which GPU]
    ``device="cuda"`` means this rank's GPU. torch keeps no trace of a
    ``torch.cuda.set_device`` call other than the current device, and a
    script that set nothing sees ``cuda:0``; so: with ``LOCAL_RANK`` unset
    (no launcher), the current device; with ``LOCAL_RANK=L`` below
    ``device_count()``, ``cuda:L`` when the current device is 0 or L, and a
    ``ConfigError`` when the script made another device current (two
    answers; neither can be assumed); with ``L`` not below the count, the
    current device when only one GPU is visible (``CUDA_VISIBLE_DEVICES``
    per rank) or the script chose one, else a ``ConfigError``. A script that
    really wants rank L on ``cuda:0`` says ``device="cuda:0"``: an explicit
    index is taken as it is.

NOTE [device memory reuse]
    Device memory of each batch is allocated on the side stream (where the
    copy writes it) and, when the batch is handed over, ``record_stream``-ed
    on the consumer's current stream: when the user drops the batch, the
    caching allocator reuses the block only after the consumer-stream work
    queued until then has finished, so no later copy overwrites memory a
    kernel still reads. Chosen over a ring of device buffers because batch
    shapes vary (packed sequences, ``select``) and the allocator already
    recycles blocks by size; a buffer ring would need sizing and a second
    hand-back protocol. Chosen by reasoning, not by measurement (no GPU
    here): ``python -m benchmarks.gpu`` watches device memory for growth.

NOTE [select]
    ``select(batch)`` runs on the shared CPU view before any copy, on every
    path (CPU delivery too), so a script behaves the same without a GPU. It
    must return views (slicing is free) and must not write into the batch:
    the copy reads the slot through the registered mapping, which does not
    see the rank's private in-place writes.

The device copy sits behind :class:`DeviceOps` (empty/copy/record/query/
wait/...): :class:`CudaOps` is the real one; tests drive the whole stage with
a fake whose copies complete when the test says so.
"""

from __future__ import annotations

import collections
import contextlib
import copy as copy_module
import ctypes
import dataclasses
import itertools
import logging
import math
import mmap
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from . import ring
from .config import _DEVICE_ACCEPTED, valid_device
from .errors import ConfigError, ShmLoaderError
from .segment import Segment

log = logging.getLogger(__name__)

#: ``cudaHostRegisterPortable | cudaHostRegisterReadOnly``.
HOST_REGISTER_FLAGS = 0x01 | 0x08
#: A non-contiguous tensor is copied as this many contiguous blocks at most;
#: beyond it, it is made contiguous on the host and copied from there.
MAX_BLOCKS = 64

_warned_pin = False


# ----------------------------------------------------------------- devices


def resolve(
    spec: str | torch.device | None,
    default: str = "cpu",
    *,
    cuda: Any = None,
    environ: Mapping[str, str] | None = None,
) -> torch.device | None:
    """The CUDA device batches go to, or None for host delivery (NOTE [which GPU]).

    ``spec`` None means ``default`` (``Config.device``). ``auto`` is ``cuda``
    when ``torch.cuda.is_available()``, else host delivery. ``cuda:N`` is
    device N. ``cuda`` is this rank's GPU: the current device when the script
    set one, else ``cuda:$LOCAL_RANK``. Raises ``ConfigError`` for a bad
    value, a CUDA device this rank does not have, or a current device and a
    ``LOCAL_RANK`` that contradict each other. ``cuda`` and ``environ`` stand
    in for ``torch.cuda`` and ``os.environ`` (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    environ = os.environ if environ is None else environ
    value = default if spec is None else spec
    if isinstance(value, torch.device):
        value = str(value)
    if not valid_device(value):
        raise ConfigError("device", value, _DEVICE_ACCEPTED)
    if value == "cpu":
        return None
    if value == "auto":
        if not cuda.is_available():
            return None
        value = "cuda"
    if not cuda.is_available():
        raise ConfigError(
            "device",
            value,
            "'cpu' or 'auto' on this rank: torch.cuda.is_available() is False "
            "('auto' delivers on the GPU where there is one and in host memory elsewhere)",
        )
    count = cuda.device_count()
    if value == "cuda":
        return torch.device("cuda", _this_ranks_gpu(cuda.current_device(), count, environ))
    index = int(value.partition(":")[2])
    if index >= count:
        raise ConfigError("device", value, f"a CUDA device index below {count}")
    return torch.device("cuda", index)


def _this_ranks_gpu(current: int, count: int, environ: Mapping[str, str]) -> int:
    """``device="cuda"`` on one rank: NOTE [which GPU]."""
    raw = environ.get("LOCAL_RANK", "").strip()
    try:
        local = int(raw) if raw else None
    except ValueError:
        local = None
    if local is None or local < 0:
        return current  # not under a launcher that says: the current device
    if local < count:
        if current in (0, local):
            return local  # cuda:0 is also what a script that set nothing sees
        raise ConfigError(
            "device",
            "cuda",
            f"one GPU for this rank, but the script made cuda:{current} current while "
            f"LOCAL_RANK={local} names cuda:{local}. Call torch.cuda.set_device(LOCAL_RANK) "
            f"before ShmLoader, or pass device='cuda:{current}' if cuda:{current} is meant",
        )
    if count == 1 or current != 0:
        return current  # one visible GPU per rank (CUDA_VISIBLE_DEVICES), or the script chose
    raise ConfigError(
        "device",
        "cuda",
        f"one GPU for this rank, but LOCAL_RANK={local} and this rank sees only {count} CUDA "
        "devices (more ranks on the node than GPUs?). Give each rank its own GPU "
        "(CUDA_VISIBLE_DEVICES, or torch.cuda.set_device before ShmLoader), or pass "
        "device='cuda:N'",
    )


def warn_pin_memory(loader: object, pool: object = None) -> bool:
    """Say once (per process) that ``pin_memory=True`` is wasted work on the device path.

    Only where the pin thread really copies batches: with the worker pool
    (``pool`` not None) the leader's DataLoader yields slot references, which
    torch's pin thread passes through untouched.
    """
    global _warned_pin
    if getattr(loader, "pin_memory", False) is not True or _warned_pin or pool is not None:
        return False
    _warned_pin = True
    log.warning(
        "shmloader: the leader's DataLoader has pin_memory=True, but with device= the batch "
        "goes to the GPU from the page-locked ring, never from the loader's pinned copy: the "
        "pin thread copies every batch for nothing (about 220 ms per 256 MiB). "
        "Fix: DataLoader(..., pin_memory=False)"
    )
    return True


@runtime_checkable
class DeviceOps(Protocol):
    """The seam between the stage and a device: byte copies on a side stream, events.

    Every call happens in the consuming thread. ``empty`` and ``copy`` are
    issued inside ``side()`` so that they run on the side stream in order.
    ``pinned`` gives page-locked host memory for the leaves no registered
    mapping holds (NOTE [no pageable copies]); ``registration`` says why
    ring slots cannot be registered at all (None: they can);
    ``register``/``unregister`` return an error text or None.
    """

    device: torch.device

    def side(self) -> contextlib.AbstractContextManager[Any]: ...
    def empty(self, nbytes: int) -> torch.Tensor: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def record(self) -> Any: ...
    def query(self, event: Any) -> bool: ...
    def wait(self, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def hand_over(self, tensor: torch.Tensor) -> None: ...
    def registration(self) -> str | None: ...
    def register(self, address: int, nbytes: int) -> str | None: ...
    def unregister(self, address: int) -> str | None: ...


class CudaOps:
    """:class:`DeviceOps` on a CUDA device: one side stream, timing events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
        self._cudart = _Cudart(device)

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        # torch's caching host allocator: page-locked once, reused after warm-up.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # From page-locked memory (a registered slot, a pinned staging buffer)
        # this returns at once and the DMA runs on the side stream.
        dst.copy_(src, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def hand_over(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))  # NOTE [device memory reuse]

    def registration(self) -> str | None:
        return self._cudart.unavailable

    def register(self, address: int, nbytes: int) -> str | None:
        return self._cudart.register(address, nbytes)

    def unregister(self, address: int) -> str | None:
        return self._cudart.unregister(address)


#: ``cudaDevAttrHostRegisterReadOnlySupported``
_ATTR_READ_ONLY = 113
#: What a refusal's error code usually means (NOTE [registration]).
_CAUSES = {
    1: "invalid value: the address, length or flags were refused",
    2: "the driver could not page-lock this much host memory (locked-memory limits such as "
    "ulimit -l do not apply to cudaHostRegister)",
    712: "this address range is registered already",
    801: "this platform cannot register host memory",
}


class _Cudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` in torch's runtime (NOTE [registration])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.init()
        path = pick_cudart(_mapped_cudarts(), torch.version.cuda)
        self.lib: ctypes.CDLL | None = None
        #: why nothing is registered in this process (None: slots are registered)
        self.unavailable: str | None = None
        if path is None:
            self.unavailable = (
                f"no libcudart of torch's CUDA {torch.version.cuda} is loaded in this process "
                "(a static build?), and torch.cuda.cudart() cannot clear the error a refused "
                "registration leaves pending (torch's next kernel launch would raise it)"
            )
            return
        lib = ctypes.CDLL(path)
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaDeviceGetAttribute.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.cudaDeviceGetAttribute.restype = ctypes.c_int
        self.lib = lib
        value = ctypes.c_int(0)
        index = device.index if device.index is not None else torch.cuda.current_device()
        code = lib.cudaDeviceGetAttribute(ctypes.byref(value), _ATTR_READ_ONLY, index)
        if code != 0:
            lib.cudaGetLastError()
        elif value.value == 0:
            # Registering the read-only mapping with any other flags is refused.
            self.unavailable = (
                f"{device} cannot register read-only host memory "
                "(cudaDevAttrHostRegisterReadOnlySupported is 0)"
            )

    def _error(self, code: int) -> str:
        assert self.lib is not None
        self.lib.cudaGetLastError()  # clear it: torch would raise it later
        text = (self.lib.cudaGetErrorString(code) or b"?").decode(errors="replace")
        cause = _CAUSES.get(code)
        return f"error {code} ({text}{': ' + cause if cause else ''})"

    def register(self, address: int, nbytes: int) -> str | None:
        if self.unavailable is not None or self.lib is None:
            return self.unavailable
        with torch.cuda.device(self.device):
            code = self.lib.cudaHostRegister(address, nbytes, HOST_REGISTER_FLAGS)
        return None if code == 0 else f"cudaHostRegister: {self._error(code)}"

    def unregister(self, address: int) -> str | None:
        assert self.lib is not None  # only what register() registered
        with torch.cuda.device(self.device):
            code = self.lib.cudaHostUnregister(address)
        return None if code == 0 else f"cudaHostUnregister: {self._error(code)}"


def _mapped_cudarts() -> list[str]:
    """Paths of every ``libcudart`` mapped into this process, in map order."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line[line.find("/") :].rstrip("\n") if "/" in line else ""
                if "/libcudart.so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def pick_cudart(paths: list[str], cuda_version: str | None) -> str | None:
    """The ``libcudart`` of torch's own CUDA major version among ``paths`` (NOTE [registration]).

    Another extension may have loaded a different (newer) runtime first; its
    registrations would be refused by an older driver, or live in another
    runtime instance than torch's. A path without a version suffix counts
    only when it is the one candidate. None: none matches.
    """
    major = (cuda_version or "").partition(".")[0]
    if not major:
        return None
    versioned = [p for p in paths if _soname_major(p) is not None]
    for path in versioned:
        if _soname_major(path) == major:
            return path
    bare = [p for p in paths if _soname_major(p) is None]
    return bare[0] if len(paths) == 1 and bare else None


def _soname_major(path: str) -> str | None:
    """``12`` of ``.../libcudart.so.12.4.127``; None for a bare ``libcudart.so``."""
    tail = path.rpartition("/libcudart.so")[2]
    if not tail.startswith("."):
        return None
    return tail[1:].split(".")[0] or None


# ------------------------------------------------------------- registration


@dataclass(eq=False)
class _Mapping:
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
        self._maps: dict[int, _Mapping] = {}  # id(segment) -> mapping; the segment is held
        #: slots whose registration was refused: copied through staging, never asked again
        self._refused: weakref.WeakKeyDictionary[Segment, str] = weakref.WeakKeyDictionary()
        #: mappings whose unregister failed: kept mapped for good (never unmapped registered)
        self.stuck: list[_Mapping] = []
        self.refused: str | None = None  # the last refusal, or why nothing is registered
        self.refusals = 0
        self.registrations = 0
        self.unregistrations = 0
        self._told_unavailable = False

    @property
    def live(self) -> int:
        return len(self._maps)

    def lookup(self, tensor: torch.Tensor) -> tuple[_Mapping, int] | None:
        """The registered mapping ``tensor`` can be copied from and its byte offset there."""
        found = ring.view_source(tensor.data_ptr())
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

    def _open(self, segment: Segment) -> _Mapping | None:
        mm, payload_at = ring.map_shared_readonly(segment)
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
        mapping = _Mapping(segment, mm, base, address, payload_at)
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


# ------------------------------------------------------------------- stage


@dataclass(eq=False)
class _Copy:
    """The copies of one batch: what they read and the CPU views that hold its slots."""

    start: Any = None
    end: Any = None
    keep: Any = None  # the selected CPU batch: its private views HOLD the slots
    nbytes: int = 0
    maps: list[_Mapping] = field(default_factory=list)
    staged: torch.Tensor | None = None  # the pinned buffer its staged leaves are read from


@dataclass(eq=False)
class _Plan:
    """One leaf's copy: device memory, and registered views or a host tensor to stage."""

    dst: torch.Tensor
    sources: list[torch.Tensor]
    host: torch.Tensor | None  # set: no registered mapping holds it; staged first


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
    """

    def __init__(
        self,
        device: torch.device | DeviceOps | None,
        *,
        select: Callable[[Any], Any] | None = None,
        prefetch: int = 2,
    ) -> None:
        if select is not None and not callable(select):
            raise ConfigError("select", select, "None or a callable taking and returning a batch")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ConfigError("prefetch", prefetch, "an integer >= 1")
        self.select = select
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
        self._inflight: list[_Copy] = []  # copies whose CPU views still hold slots
        self._stats: collections.Counter = collections.Counter()
        self._closed = False
        #: batches pulled from the role's iterator and not yet handed to the user
        self.ahead = 0
        #: what ``position()`` returned when the last handed-over batch was pulled
        self.position: Any = None

    @property
    def on_device(self) -> bool:
        return self._ops is not None

    def wrap(
        self,
        inner: Iterator[Any],
        position: Callable[[], Any] | None = None,
        request: Callable[[], None] | None = None,
        settled: Callable[[], None] | None = None,
    ) -> Iterator[Any]:
        """Iterate ``inner`` through ``select`` and, on a device, the prefetcher.

        ``position()`` is called after every pull and at the end, so that
        the loader can report where the *user* is, not the stage; until the
        first hand-over ``self.position`` stays None (nothing handed over yet:
        the loop's own position is the user's). Not at the start: asking a
        loader for its state before ``iter()`` may open it (torchdata's
        ``StatefulDataLoader`` does, drawing a base seed). ``request()`` is
        called at every ``next()`` of the user, before the stage pulls
        anything for it (NOTE [checkpoints under prefetch]). ``settled()``
        is called once the iteration is over and its copies have settled (the
        counters of ``stats()`` are final for it).
        """
        if self._closed:
            raise ShmLoaderError("this ShmLoader is closed; make a new one")
        if self._ops is None:
            return self._host(inner)
        return self._prefetching(inner, position, request, settled)

    def _host(self, inner: Iterator[Any]) -> Iterator[Any]:
        select = self.select
        assert select is not None
        while True:
            box = []  # NOTE [no batch in the frame] (roles)
            try:
                box.append(next(inner))
            except StopIteration:
                return
            yield select(box.pop())

    def _prefetching(
        self,
        inner: Iterator[Any],
        position: Callable[[], Any] | None,
        request: Callable[[], None] | None,
        settled: Callable[[], None] | None,
    ) -> Iterator[Any]:
        queue: collections.deque[_Ready] = collections.deque()
        error: Exception | None = None
        done = False
        end_position: Any = None
        self.position = None
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
                        queue.append(self._start(next(inner), position))
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
                    if position is not None:
                        self.position = end_position
                    return
                self.ahead = len(queue) - 1
                yield self._hand_over(queue.popleft())
        finally:
            self.ahead = 0
            queue.clear()
            with contextlib.suppress(Exception):
                inner.close()  # type: ignore[attr-defined]
            self._settle()
            if settled is not None:
                settled()

    def _start(self, batch: Any, position: Callable[[], Any] | None) -> _Ready:
        """Issue the copies of one pulled batch on the side stream.

        Everything per leaf that is host work (finding and registering its
        slot, allocating device memory, staging what no registered mapping
        holds) comes first; the start event is recorded right before the
        first copy (NOTE [copy timing]).
        """
        ops = self._ops
        assert ops is not None
        if self.select is not None:
            batch = self.select(batch)
        copy = _Copy(keep=batch)
        tensors: list[torch.Tensor] = []
        plans: list[_Plan] = []
        with ops.side():
            try:
                out = _map_tensors(batch, lambda t: self._plan(t, copy, plans, tensors), {})
                self._stage(plans, copy)
                copy.start = ops.record()
                for plan in plans:
                    at = 0
                    for src in plan.sources:
                        n = src.numel()
                        ops.copy(plan.dst[at : at + n], src)
                        at += n
            finally:  # even a failed batch is reaped like any other: its copies may run
                if copy.start is None:
                    copy.start = ops.record()
                copy.end = ops.record()
                self._inflight.append(copy)
        where = position() if position is not None else None
        return _Ready(out, copy.end, tensors, where)

    def _plan(
        self, t: torch.Tensor, copy: _Copy, plans: list[_Plan], tensors: list[torch.Tensor]
    ) -> torch.Tensor:
        """Device memory for one leaf and where its bytes come from."""
        ops = self._ops
        assert ops is not None
        if t.device.type != "cpu":
            return t
        source = t
        if t.is_conj() or t.is_neg():
            # Lazy views: their memory holds the unconjugated, unnegated bits.
            source = t.resolve_conj().resolve_neg()
        nbytes = t.numel() * t.element_size()
        dst = ops.empty(nbytes)
        registered = self._sources(source, copy) if source is t else None
        plans.append(_Plan(dst, registered or [], None if registered is not None else source))
        copy.nbytes += nbytes
        out = dst.view(t.dtype).reshape(t.shape)
        tensors.append(out)
        return out

    def _stage(self, plans: list[_Plan], copy: _Copy) -> None:
        """Copy the leaves no registered mapping holds into one pinned buffer.

        NOTE [no pageable copies].
        """
        ops = self._ops
        assert ops is not None
        pending = [p for p in plans if p.host is not None and p.host.numel() > 0]
        if not pending:
            return
        sizes = [p.host.numel() * p.host.element_size() for p in pending]  # type: ignore[union-attr]
        total = sum(_align(n) for n in sizes)
        buffer = ops.pinned(total)
        copy.staged = buffer  # lives until the copies completed
        at = 0
        for plan, n in zip(pending, sizes, strict=True):
            host = plan.host
            assert host is not None
            if not host.is_contiguous():
                host = host.contiguous()
            window = buffer[at : at + n]
            window.copy_(host.reshape(-1).view(torch.uint8))
            plan.sources = [window]
            at += _align(n)
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
        blocks = _blocks(t)
        if blocks is None or mapping.base is None:
            return None
        if mapping not in copy.maps:
            mapping.users += 1
            copy.maps.append(mapping)
        size = t.element_size()
        offsets, inner = blocks
        return [mapping.base[at + off * size : at + (off + inner) * size] for off in offsets]

    def _hand_over(self, ready: _Ready) -> Any:
        ops = self._ops
        assert ops is not None
        ops.wait(ready.end)  # the consumer's stream waits; the host does not
        for tensor in ready.tensors:
            ops.hand_over(tensor)
        self.position = ready.position
        self._stats["device_batches"] += 1
        return ready.batch

    def _reap(self) -> None:
        """Drop the CPU views of completed copies: their slots are released now."""
        ops = self._ops
        assert ops is not None
        still = []
        for copy in self._inflight:
            if ops.query(copy.end):
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
        copy.keep = None  # the last reference to the CPU views: RELEASE
        copy.staged = None

    def _settle(self) -> None:
        """Wait for every copy still in flight and let its slots go (iteration end, close)."""
        ops = self._ops
        if ops is None:
            return
        inflight, self._inflight = self._inflight, []
        for copy in inflight:
            with contextlib.suppress(Exception):
                ops.synchronize(copy.end)
            self._finish(copy)
        if self._registrar is not None:
            self._registrar.sweep()

    def stats(self) -> dict[str, Any]:
        """Device counters of this rank (empty on host delivery without ``select``)."""
        if self._ops is None:
            return {"device": "cpu"}
        s = self._stats
        ms = s["device_copy_ms_total"]
        reg = self._registrar
        assert reg is not None
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
        }

    def reset_stats(self) -> None:
        """Zero the copy counters (after a warm-up); registrations are kept."""
        self._stats.clear()

    def close(self) -> None:
        """Wait for copies in flight, release their slots, unregister and unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._settle()
        if self._registrar is not None:
            self._registrar.close()


# ----------------------------------------------------------------- helpers


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def _blocks(t: torch.Tensor) -> tuple[list[int], int] | None:
    """``t`` as contiguous runs: (element offsets from ``t``'s first element, run length).

    None when it would take more than ``MAX_BLOCKS`` runs.
    """
    shape, stride = list(t.shape), list(t.stride())
    run, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    outer_shape, outer_stride = shape[:k], stride[:k]
    if math.prod(outer_shape) > MAX_BLOCKS:
        return None
    offsets = [
        sum(i * s for i, s in zip(index, outer_stride, strict=True))
        for index in itertools.product(*(range(n) for n in outer_shape))
    ]
    return offsets, run


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; aliases stay aliases.

    Containers as in the batch contract (list, tuple, namedtuple, dict,
    dataclass); numpy arrays and other leaves are returned as they are.
    """
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if isinstance(obj, list):
        return [_map_tensors(v, fn, memo) for v in obj]
    if type(obj) is tuple:
        return tuple(_map_tensors(v, fn, memo) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn, memo) for v in obj))
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, memo) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy_module.copy(obj)
        for f in dataclasses.fields(obj):  # not ClassVar / InitVar pseudo-fields
            object.__setattr__(new, f.name, _map_tensors(getattr(obj, f.name), fn, memo))
        return new
    return obj

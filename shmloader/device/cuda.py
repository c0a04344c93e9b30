"""The device seam: :class:`DeviceOps`, and :class:`CudaOps`, its CUDA implementation.

It owns the one contract every device operation of the stage goes through
(copies on a side stream, events, page-locked host memory, ``cudaHostRegister``)
and its CUDA implementation, with the ``ctypes`` binding of torch's own
``libcudart`` (NOTE [libcudart]); ``tests.support.fake_device`` implements the
same contract on the host. It imports nothing of shmloader and touches only the
CUDA runtime and the memory it is handed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

log = logging.getLogger("shmloader.device")

#: ``cudaHostRegisterPortable | cudaHostRegisterReadOnly`` (ring slots, NOTE [registration]).
HOST_REGISTER_FLAGS = 0x01 | 0x08
#: ``cudaHostRegisterPortable``: the stage's own staging buffers (written on the host).
STAGING_REGISTER_FLAGS = 0x01
#: What ``/proc/self/maps`` appends to the path of a file unlinked or replaced since mapped.
DELETED = " (deleted)"


@runtime_checkable
class DeviceOps(Protocol):
    """The seam between the stage and a device: byte copies on a side stream, events.

    ``wait`` and ``hand_over`` happen in the consuming thread (its current
    stream); the rest in the thread that issues the copies, which is the
    consuming one or a role's loop ahead (NOTE [copies issued by the loop
    ahead] in ``stage``), never two at once; such a loop's thread enters
    ``on_thread()`` first (the device current on that thread). ``empty`` and
    ``copy`` are issued inside ``side()`` so that they run on the side stream
    in order.
    ``pinned`` gives a page-locked host buffer of exactly ``nbytes`` that the
    stage owns until it passes it to ``unpin`` (NOTE [pinned staging] in
    ``registrar``); ``is_pinned`` says whether a host tensor is page-locked
    already (it is copied from as it is). ``registration`` says why ring
    slots cannot be registered at all (None: they can);
    ``register``/``unregister`` return an error text or None.
    """

    device: torch.device

    def side(self) -> contextlib.AbstractContextManager[Any]: ...
    def on_thread(self) -> contextlib.AbstractContextManager[Any]: ...
    def empty(self, nbytes: int) -> torch.Tensor: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def unpin(self, buffer: torch.Tensor) -> None: ...
    def is_pinned(self, tensor: torch.Tensor) -> bool: ...
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
        #: data_ptr of each staging buffer this object registered -> its mapping
        self._own: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def on_thread(self) -> contextlib.AbstractContextManager[Any]:
        # A thread starts on device 0; without this, entering and leaving the side
        # stream's context there would make GPU 0 current and create its context.
        return torch.cuda.device(self.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        # Anonymous memory registered by us: exactly this size, and unpin()
        # gives it back to the system (torch's caching host allocator rounds
        # up to a power of two and never returns what it locked).
        if self._cudart.lib is not None and nbytes > 0:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            array = np.frombuffer(mm, dtype=np.uint8)
            address = array.__array_interface__["data"][0]
            if self._cudart.register(address, nbytes, STAGING_REGISTER_FLAGS) is None:
                buffer = torch.from_numpy(array)
                self._own[buffer.data_ptr()] = (mm, array)
                return buffer
            del array
            mm.close()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def unpin(self, buffer: torch.Tensor) -> None:
        own = self._own.pop(buffer.data_ptr(), None)
        if own is None:
            # torch's allocator: drop the storage (the caller still holds the tensor
            # object), then hand its cached page-locked blocks back where it can
            buffer.set_()  # type: ignore[call-overload]  # torch's stubs lack the bare set_()
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
            return
        mm, array = own
        error = self._cudart.unregister(array.__array_interface__["data"][0])
        if error is not None:  # never unmap a range the driver still holds
            log.warning("shmloader: %s for a staging buffer; it stays mapped", error)
            self._own[buffer.data_ptr()] = own
            return
        buffer.set_()  # type: ignore[call-overload]  # the storage held the array (the mapping)
        del array, own
        with contextlib.suppress(BufferError):
            mm.close()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

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
        return self._cudart.register(address, nbytes, HOST_REGISTER_FLAGS)

    def unregister(self, address: int) -> str | None:
        return self._cudart.unregister(address)


#: ``cudaDevAttrHostRegisterReadOnlySupported``
_ATTR_READ_ONLY = 113
#: What a refusal's error code usually means (NOTE [registration] in ``registrar``).
_CAUSES = {
    1: "invalid value: the address, length or flags were refused",
    2: "the driver could not page-lock this much host memory (locked-memory limits such as "
    "ulimit -l do not apply to cudaHostRegister)",
    712: "this address range is registered already",
    801: "this platform cannot register host memory",
}


# NOTE [libcudart]
#     ``cudaHostRegister`` and ``cudaHostUnregister`` are called through
#     ``ctypes`` on the ``libcudart`` that torch itself loaded (found in
#     ``/proc/self/maps``), so they run in torch's CUDA runtime instance; of
#     several mapped copies (another extension may bring a newer runtime, whose
#     registrations an older driver refuses) the one whose major version is
#     ``torch.version.cuda``'s (``pick_cudart``). Chosen over
#     ``torch.cuda.cudart()`` because that binding has no ``cudaGetLastError``:
#     a refused ``cudaHostRegister`` leaves the error pending in the runtime,
#     and torch's next kernel-launch check would raise it from an unrelated
#     operation; here it is cleared at once. Chosen over ``cuda-bindings``
#     because it needs no new dependency and no second runtime.
#
#     Where no such library can be bound, nothing is registered and the stage
#     stages every leaf through torch's pinned memory (NOTE [pinned staging] in
#     ``registrar``), saying why once: no matching ``libcudart`` mapped (a static
#     build); the mapped file was replaced or removed on disk after it was
#     loaded (``/proc/self/maps`` shows its path with `` (deleted)``: the path
#     now names another file or none); or ``ctypes.CDLL`` of the path failed
#     for any other reason.
class _Cudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` in torch's runtime (NOTE [libcudart])."""

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
        if path.endswith(DELETED):
            self.unavailable = (
                f"torch's libcudart {path[: -len(DELETED)]} was replaced or removed on disk after "
                "this process loaded it (/proc/self/maps marks it deleted), so it cannot be bound "
                "again by path; restart the job after the CUDA runtime is updated"
            )
            return
        try:
            lib = _bind(path)
        except (OSError, AttributeError) as exc:
            self.unavailable = f"torch's libcudart {path} could not be bound ({exc})"
            return
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

    def register(self, address: int, nbytes: int, flags: int = HOST_REGISTER_FLAGS) -> str | None:
        if self.lib is None:
            return self.unavailable
        if self.unavailable is not None and flags & 0x08:
            return self.unavailable  # read-only registration is what is unavailable
        with torch.cuda.device(self.device):
            code = self.lib.cudaHostRegister(address, nbytes, flags)
        return None if code == 0 else f"cudaHostRegister: {self._error(code)}"

    def unregister(self, address: int) -> str | None:
        assert self.lib is not None  # only what register() registered
        with torch.cuda.device(self.device):
            code = self.lib.cudaHostUnregister(address)
        return None if code == 0 else f"cudaHostUnregister: {self._error(code)}"


def _bind(path: str) -> ctypes.CDLL:
    """``path`` loaded with the prototypes of the calls used; OSError/AttributeError if not."""
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
    return lib


def _mapped_cudarts() -> list[str]:
    """Paths of every ``libcudart`` mapped into this process, in map order.

    A path keeps the `` (deleted)`` that ``/proc/self/maps`` appends to a
    file replaced or removed since it was mapped (NOTE [libcudart]).
    """
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
    """The ``libcudart`` of torch's own CUDA major version among ``paths`` (NOTE [libcudart]).

    Another extension may have loaded a different (newer) runtime first; its
    registrations would be refused by an older driver, or live in another
    runtime instance than torch's. A path without a version suffix counts
    only when it is the one candidate. None: none matches. A path marked
    `` (deleted)`` is returned as it is (the caller says why it cannot bind it).
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
    path = path.removesuffix(DELETED)
    tail = path.rpartition("/libcudart.so")[2]
    if not tail.startswith("."):
        return None
    return tail[1:].split(".")[0] or None

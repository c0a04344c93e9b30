"""A fake device for CPU tests: ``FakeOps`` implements ``shmloader.device.stage.DeviceOps``.

Its "device" memory is host tensors and its events complete when the test
says so (``complete()``), or at once (``auto=True``); it counts every
registration, copy, wait and hand-over so that tests can check the stage's
rules without a GPU. Importable by spawned ranks (``tests.support.harness``).

With ``deferred=True`` a copy moves its bytes only when a later event is
done or waited for, as a DMA on a stream would: device memory holds
``STALE`` bytes until then, so a consumer that reads a batch without the
stage's wait, or a staging buffer rewritten while a copy still reads it,
shows up as wrong values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

#: What fresh fake device memory holds until a deferred copy lands in it.
STALE = 0xEE


class FakeEvent:
    def __init__(self, n: int) -> None:
        self.n = n
        self.done = False


class FakeOps:
    """A ``DeviceOps`` whose copies run on the host and complete under test control."""

    device = torch.device("cpu")

    def __init__(
        self,
        *,
        refuse: str | Callable[[int, int], str | None] | None = None,
        auto: bool = False,
        device: str | None = None,
        unavailable: str | None = None,
        fail_unregister: bool = False,
        deferred: bool = False,
    ) -> None:
        if device is not None:  # a name for stats and ``stat`` (e.g. "cuda:1"); memory stays host
            self.device = torch.device(device)
        self.refuse = refuse  # every registration, or per (address, bytes)
        self.unavailable = unavailable  # registration() says why nothing registers
        self.fail_unregister = fail_unregister
        self.auto = auto  # every event completes at once
        self.events: list[FakeEvent] = []
        self.registered: dict[int, int] = {}
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []
        self.copies: list[tuple[int, int]] = []  # (source address, bytes)
        self.waits: list[FakeEvent] = []
        self.handed: list[torch.Tensor] = []
        self.synced = 0
        self.in_side = False
        self.mapped_at_unregister: list[bool] = []
        self.pinned_buffers: list[torch.Tensor] = []  # live: pinned() and not unpin()ned
        self.unpinned: list[int] = []  # bytes of each buffer given back
        self.pinned_leaves: list[torch.Tensor] = []  # tensors pin() made "page-locked"
        self.pageable_copies = 0  # copies from neither a registered nor a pinned source
        self.deferred = deferred
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (event n, dst, src)
        self.copies_from_pinned_leaves = 0
        #: every call in order: ("empty"|"pinned"|"copy"|"record"|"sync"|"register"|"unregister", n)
        self.timeline: list[tuple[str, int]] = []
        #: the thread that made this device (the consumer's, whose current device the
        #: script chose) and the threads inside ``on_thread()`` now
        self.owner = threading.get_ident()
        self.bound: set[int] = set()
        #: calls of the copy path (empty, copy, record, sync) from another thread that
        #: had not made the device current (NOTE [copies issued by the loop ahead])
        self.unbound_calls = 0

    @contextlib.contextmanager
    def on_thread(self):
        me = threading.get_ident()
        self.bound.add(me)
        try:
            yield
        finally:
            self.bound.discard(me)

    def _note_thread(self) -> None:
        me = threading.get_ident()
        if me != self.owner and me not in self.bound:
            self.unbound_calls += 1

    @contextlib.contextmanager
    def side(self):
        self.in_side = True
        try:
            yield
        finally:
            self.in_side = False

    def empty(self, nbytes: int) -> torch.Tensor:
        assert self.in_side, "device memory allocated off the side stream"
        self._note_thread()
        self.timeline.append(("empty", nbytes))
        return torch.full((nbytes,), STALE, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.timeline.append(("pinned", nbytes))
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_buffers.append(buffer)
        return buffer

    def unpin(self, buffer: torch.Tensor) -> None:
        assert any(b is buffer for b in self.pinned_buffers), "unpinning a buffer not pinned"
        reading = [n for n, _, src in self.pending if _within(src.data_ptr(), buffer)]
        assert not reading, "a staging buffer released while a copy still reads it"
        self.pinned_buffers = [b for b in self.pinned_buffers if b is not buffer]
        self.unpinned.append(buffer.numel())
        self.timeline.append(("unpin", buffer.numel()))

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return any(_within(tensor.data_ptr(), b) for b in self.pinned_leaves)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.pin_memory()`` for this fake: a copy that ``is_pinned`` says is pinned."""
        out = tensor.clone()
        self.pinned_leaves.append(out)
        return out

    @property
    def locked(self) -> int:
        """Bytes of staging memory pinned now."""
        return sum(b.numel() for b in self.pinned_buffers)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self.in_side, "copy issued off the side stream"
        self._note_thread()
        assert src.dtype == torch.uint8 and src.dim() == 1 and src.is_contiguous()
        address = src.data_ptr()
        from_leaf = self.is_pinned(src)
        self.copies_from_pinned_leaves += from_leaf
        if not (self.from_registered(address) or self.from_pinned(address) or from_leaf):
            self.pageable_copies += 1
        self.timeline.append(("copy", src.numel()))
        self.copies.append((address, src.numel()))
        if self.deferred:
            self.pending.append((len(self.events), dst, src))  # lands with the next event
        else:
            dst.copy_(src)

    def _land(self, upto: int) -> None:
        """Run the deferred copies issued before event ``upto`` (stream order)."""
        keep = []
        for n, dst, src in self.pending:
            if n <= upto:
                dst.copy_(src)
            else:
                keep.append((n, dst, src))
        self.pending = keep

    def record(self) -> FakeEvent:
        self._note_thread()
        event = FakeEvent(len(self.events))
        self.events.append(event)
        self.timeline.append(("record", event.n))
        if self.auto:
            self._done_upto(event.n)
        return event

    def _done_upto(self, n: int) -> None:
        """Events complete in stream order: ``n`` and every one before it."""
        self._land(n)
        for event in self.events[: n + 1]:
            event.done = True

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def wait(self, event: FakeEvent) -> None:
        # The consumer's later work sees what the copies before the event wrote.
        self.waits.append(event)
        self._land(event.n)

    def synchronize(self, event: FakeEvent) -> None:
        self._note_thread()
        self.synced += 1
        self.timeline.append(("sync", event.n))
        self._done_upto(event.n)

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        return 2.0

    def hand_over(self, tensor: torch.Tensor) -> None:
        self.handed.append(tensor)

    def registration(self) -> str | None:
        return self.unavailable

    def register(self, address: int, nbytes: int) -> str | None:
        assert self.unavailable is None, "registering although registration() said no"
        assert not self.from_registered(address), "registering a range registered already"
        self.register_calls.append((address, nbytes))
        self.timeline.append(("register", nbytes))
        error = self.refuse(address, nbytes) if callable(self.refuse) else self.refuse
        if error is not None:
            return error
        self.registered[address] = nbytes
        return None

    def unregister(self, address: int) -> str | None:
        assert address in self.registered, "unregistering an address never registered"
        self.mapped_at_unregister.append(_mapped(address))
        self.unregister_calls.append(address)
        self.timeline.append(("unregister", address))
        if self.fail_unregister:
            return "cudaHostUnregister: error 1 (refused by a fake)"
        del self.registered[address]
        return None

    def complete(self) -> None:
        if self.events:
            self._done_upto(len(self.events) - 1)

    def from_registered(self, address: int) -> bool:
        return any(a <= address < a + n for a, n in self.registered.items())

    def from_pinned(self, address: int) -> bool:
        return any(_within(address, b) for b in self.pinned_buffers)


def _within(address: int, t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    return t.data_ptr() <= address < t.data_ptr() + max(nbytes, 1)


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


class FakeCuda:
    """Stands in for ``torch.cuda`` in ``shmloader.device.which.resolve``: a node's GPUs as
    one rank sees them.

    ``current`` is what ``torch.cuda.current_device()`` returns: 0 until the
    script calls ``set_device`` (torch keeps no other trace of that call).
    """

    def __init__(self, count: int = 8, current: int = 0, available: bool = True) -> None:
        self.count = count
        self.current = current
        self.available = available

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count if self.available else 0

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.current = index

"""A fake device for CPU tests: ``FakeOps`` implements ``shmloader.device.DeviceOps``.

Its "device" memory is host tensors and its events complete when the test
says so (``complete()``), or at once (``auto=True``); it counts every
registration, copy, wait and hand-over so that tests can check the stage's
rules without a GPU. Importable by spawned ranks (``tests.harness``).
"""

from __future__ import annotations

import contextlib

import torch


class FakeEvent:
    def __init__(self, n: int) -> None:
        self.n = n
        self.done = False


class FakeOps:
    """A ``DeviceOps`` whose copies run on the host and complete under test control."""

    device = torch.device("cpu")

    def __init__(
        self, *, refuse: str | None = None, auto: bool = False, device: str | None = None
    ) -> None:
        if device is not None:  # a name for stats and ``stat`` (e.g. "cuda:1"); memory stays host
            self.device = torch.device(device)
        self.refuse = refuse
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

    @contextlib.contextmanager
    def side(self):
        self.in_side = True
        try:
            yield
        finally:
            self.in_side = False

    def empty(self, nbytes: int) -> torch.Tensor:
        assert self.in_side, "device memory allocated off the side stream"
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self.in_side, "copy issued off the side stream"
        assert src.dtype == torch.uint8 and src.dim() == 1 and src.is_contiguous()
        self.copies.append((src.data_ptr(), src.numel()))
        dst.copy_(src)

    def record(self) -> FakeEvent:
        event = FakeEvent(len(self.events))
        event.done = self.auto
        self.events.append(event)
        return event

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def wait(self, event: FakeEvent) -> None:
        self.waits.append(event)

    def synchronize(self, event: FakeEvent) -> None:
        self.synced += 1
        event.done = True

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        return 2.0

    def hand_over(self, tensor: torch.Tensor) -> None:
        self.handed.append(tensor)

    def register(self, address: int, nbytes: int) -> str | None:
        self.register_calls.append((address, nbytes))
        if self.refuse is not None:
            return self.refuse
        self.registered[address] = nbytes
        return None

    def unregister(self, address: int) -> None:
        assert address in self.registered, "unregistering an address never registered"
        self.mapped_at_unregister.append(_mapped(address))
        del self.registered[address]
        self.unregister_calls.append(address)

    def complete(self) -> None:
        for event in self.events:
            event.done = True

    def from_registered(self, address: int) -> bool:
        return any(a <= address < a + n for a, n in self.registered.items())


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False

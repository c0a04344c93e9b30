"""Rank programs that die or fail at chosen points (importable by spawned ranks).

Faults are injected from the outside by monkeypatching inside the doomed
rank's own process: no test hook lives in the library.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shmloader import Config, ShmLoader
from tests.support import ranks


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Boom(Exception):
    pass


class Exploding:
    """A loader whose iterator raises (or interrupts) at batch ``at``."""

    def __init__(self, n: int, at: int, exc: type[BaseException]) -> None:
        self.n, self.at, self.exc = n, at, exc

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == self.at:
                raise self.exc(f"sample {i} is corrupt")
            yield {"x": torch.full((4,), i)}


def outcome(fn) -> dict[str, Any]:
    """Run ``fn``; report what it returned or raised and how long that took."""
    t0 = time.monotonic()
    try:
        value = fn()
        return {"ok": True, "value": value, "seconds": time.monotonic() - t0}
    except BaseException as exc:
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "attrs": {k: v for k, v in vars(exc).items() if isinstance(v, str | int | type(None))},
            "seconds": time.monotonic() - t0,
        }


def leader_raises(rank: int, world: int, *, exc: str, at: int = 3) -> dict:
    kind = {"Boom": Boom, "KeyboardInterrupt": KeyboardInterrupt}[exc]
    loader = ShmLoader(
        lambda: Exploding(6, at, kind), dist.group.WORLD, config=Config.from_env(enabled=True)
    )
    got: list[int] = []

    def run():
        for batch in loader:
            got.append(int(batch["x"][0]))
        return got

    out = outcome(run)
    out["got"] = got
    loader.close()
    return out


def kill_at(rank: int, world: int, *, victim: int, point: str, timeout: float = 30.0) -> dict:
    """Every rank iterates; ``victim`` SIGKILLs itself at ``point``.

    Each fault is patched where the library looks the name up: the follower says
    HELLO through ``wire.frames`` (``_roles.follower``), a node's writer copies a
    batch into its slot with ``codec.write_payload`` (``_roles.node_writer``), and
    ``_setup.build`` makes the ``CrossNode`` a node leader receives payloads from.
    """
    from shmloader._proto.wire import Kind
    from shmloader._roles import follower, node_writer
    from shmloader._setup import build

    if rank == victim:
        if point == "before-hello":
            real = follower.wire.frames

            def frames(kind, *a, **kw):
                if kind == Kind.HELLO:
                    die()
                return real(kind, *a, **kw)

            follower.wire.frames = frames
        elif point == "mid-publish":
            real_write = node_writer.codec.write_payload

            def write(enc, dest):
                if ranks._MADE.get("writes", 0) == 2:
                    dest[: enc.nbytes // 2] = 7  # half a batch written, then gone
                    die()
                ranks._MADE["writes"] = ranks._MADE.get("writes", 0) + 1
                real_write(enc, dest)

            node_writer.codec.write_payload = write
        elif point == "during-broadcast":

            class Dying(build.CrossNode):
                def receive_payload(self, dest):
                    if ranks._MADE.get("recv", 0) == 2:
                        die()
                    ranks._MADE["recv"] = ranks._MADE.get("recv", 0) + 1
                    super().receive_payload(dest)

            build.CrossNode = Dying  # type: ignore[misc]
    loader = ShmLoader(
        lambda: DataLoader(ranks.Synthetic(40), batch_size=2, collate_fn=ranks.collate),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, timeout=timeout),
    )
    held = []

    def run():
        for i, batch in enumerate(loader):
            if rank == victim and point == "holding-slot" and i == 2:
                held.append(batch)
                die()
            held.append(batch)
            held[:] = held[-3:]  # hold a few batches, as a training step might
        return len(held)

    out = outcome(run)
    out["pid"] = os.getpid()
    held.clear()
    loader.close()
    return out


def make_loader_raises(rank: int, world: int) -> dict:
    def make():
        raise FileNotFoundError("/data/shard-000.tar is missing")

    return outcome(lambda: ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True)))


def leader_closes_early(rank: int, world: int) -> dict:
    """The leader leaves its loop after 2 batches and closes; followers keep iterating
    (a timeout of 60 s: what a follower that did not know would wait)."""
    loader = ShmLoader(
        lambda: Exploding(6, 99, Boom),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, timeout=60.0),
    )
    got: list[int] = []

    def run():
        for batch in loader:
            got.append(int(batch["x"][0]))
            if rank == 0 and len(got) == 2:
                loader.close()
                return got
        return got

    first = outcome(run)
    again = outcome(lambda: list(loader)) if rank != 0 else None
    loader.close()
    return {"first": first, "again": again, "got": got}

"""Rank programs for multi-process tests (importable by spawned children)."""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from shmloader import Config, ShmLoader

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Meta:
    sample_ids: list
    source: str


class Large(Dataset):
    """Sample ``i`` is 8 MiB of ``i``: more than a loopback socket buffers, so the leader's
    send of it completes only once the node leader receives its payload."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2 << 20,), float(i))


class Synthetic(Dataset):
    """Deterministic samples of every supported kind, sizes varying per index."""

    def __init__(self, n: int = 24, scale: int = 1) -> None:
        self.n, self.scale = n, scale

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        length = 16 * self.scale + (i % 5) * 8
        return {
            "tokens": torch.randint(0, 32000, (length,), generator=g),
            "image": torch.randn(3, 8, 8, generator=g).to(torch.bfloat16),
            "mask": torch.rand(length, generator=g) > 0.5,
            "id": i,
            "name": f"sample-{i}",
        }


def collate(samples: list[dict]) -> dict:
    longest = max(s["tokens"].numel() for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, s in enumerate(samples):
        tokens[row, : s["tokens"].numel()] = s["tokens"]
    image = torch.stack([s["image"] for s in samples])
    return {
        "input_ids": tokens,
        "labels": tokens,  # the same object twice: an alias
        "position_ids": torch.arange(longest).expand(len(samples), longest),  # non-contiguous
        "pixel_values": Pair(image, image.transpose(-1, -2)),
        "mask": [s["mask"] for s in samples],
        "meta": Meta([s["id"] for s in samples], "synthetic"),
        "np": np.arange(len(samples), dtype=np.float32),
        "raw": b"\x00\x01",
        "scalar": torch.tensor(len(samples) + 0.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.complex64),
        "none": None,
    }


def to_plain(obj: Any) -> Any:
    """An owned, comparable copy of a delivered batch."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_plain(v) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(to_plain(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj)
    return obj


def sp_groups(world: int, sp: int) -> tuple[Any, list[int]]:
    """Create every SP group (contiguous blocks) and return this rank's."""
    mine, ranks = None, []
    for start in range(0, world, sp):
        members = list(range(start, start + sp))
        g = dist.new_group(members, backend="gloo")
        if dist.get_rank() in members:
            mine, ranks = g, members
    return mine, ranks


_MADE = {"count": 0}


def make_loader_factory(
    num_workers: int, n: int = 24, batch_size: int = 2, dp: int = 1, dp_rank: int = 0
):
    def make() -> DataLoader:
        _MADE["count"] += 1
        ds = Synthetic(n)
        sampler = torch.utils.data.DistributedSampler(
            ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=1
        )
        return DataLoader(
            ds,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=collate,
        )

    return make


def deliver(
    rank: int, world: int, *, sp: int, num_workers: int, epochs: int = 2, share: bool = True
) -> dict:
    """Iterate a ShmLoader for ``epochs`` and return every batch and facts."""
    group, _members = sp_groups(world, sp)
    dp_rank = rank // sp
    loader = ShmLoader(
        make_loader_factory(num_workers, dp=world // sp, dp_rank=dp_rank),
        group,
        config=Config.from_env(enabled=share),
    )
    batches, aliases = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            aliases.append(batch["input_ids"] is batch["labels"])
            batches.append(to_plain(batch))
    out = {
        "batches": batches,
        "aliases": aliases,
        "len": len(loader),
        "made": _MADE["count"],
        "role": loader.role,
        "stats": loader.stats(),
        "pid": os.getpid(),
    }
    loader.close()
    return out


def hold_and_write(rank: int, world: int, *, sp: int, steps: int, copy: bool = False) -> dict:
    """Hold every batch for the whole run and write into each in place."""
    group, _ = sp_groups(world, sp)
    loader = ShmLoader(
        make_loader_factory(0, n=steps * 2),
        group,
        # small_copy_bytes=0: every leaf a view of the slot, the case this test is about
        config=Config.from_env(enabled=True, slots=2, copy=copy, small_copy_bytes=0),
    )
    held, snapshots = [], []
    for batch in loader:
        snapshots.append(to_plain(batch))
        held.append(batch)
        if not loader.is_leader:
            batch["input_ids"].fill_(-rank)  # private: nobody else may see this
            batch["pixel_values"].left.zero_()
        dist.barrier(group)  # lockstep, so the leader really reuses slots if it may
    unchanged = all(
        torch.equal(h["pixel_values"].right, s["pixel_values"].right)
        and np.array_equal(h["np"], s["np"])
        for h, s in zip(held, snapshots, strict=True)
    )
    own_writes_kept = loader.is_leader or all(int(h["input_ids"].max()) == -rank for h in held)
    stats = loader.stats()
    del held
    loader.close()
    return {
        "snapshots": snapshots,
        "unchanged": unchanged,
        "own_writes_kept": own_writes_kept,
        "stats": stats,
    }


def deliver_both(rank: int, world: int, *, sp: int, num_workers: int, epochs: int = 2) -> dict:
    """``deliver`` with sharing off, then on, in the same processes (one spawn)."""
    alone = deliver(rank, world, sp=sp, num_workers=num_workers, epochs=epochs, share=False)
    _MADE["count"] = 0
    shared = deliver(rank, world, sp=sp, num_workers=num_workers, epochs=epochs, share=True)
    return {"alone": alone, "shared": shared}


def sharded_indices(rank: int, world: int, *, sp: int, share: bool) -> list[list[int]]:
    """Sample ids each rank receives with a ShardedSampler keyed on the DP rank."""
    from shmloader import ShardedSampler, dp_topology_from_group

    group, _ = sp_groups(world, sp)
    num_replicas, dp_rank = dp_topology_from_group(group)

    def make() -> DataLoader:
        ds = Synthetic(21)
        sampler = ShardedSampler(ds, num_replicas=num_replicas, rank=dp_rank, seed=5)
        return DataLoader(ds, batch_size=2, sampler=sampler, collate_fn=collate)

    loader = ShmLoader(make, group, config=Config.from_env(enabled=share))
    ids = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids += [batch["meta"].sample_ids for batch in loader]
    loader.close()
    return ids


def sharded_both(rank: int, world: int, *, sp: int) -> dict:
    return {
        "alone": sharded_indices(rank, world, sp=sp, share=False),
        "shared": sharded_indices(rank, world, sp=sp, share=True),
    }


def keep_past_close(rank: int, world: int) -> list[str]:
    """Hold batches past close(): their release must be silent, not a finalizer error."""
    import gc
    import sys

    loader = ShmLoader(
        lambda: [{"x": torch.ones(1000)}] * 3,
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
    )
    kept = list(loader)
    loader.close()
    raised: list[str] = []
    previous, sys.unraisablehook = sys.unraisablehook, lambda u: raised.append(repr(u.exc_value))
    try:
        del kept
        gc.collect()
    finally:
        sys.unraisablehook = previous
    return raised


class Big(Dataset):
    """Samples of 2 MiB (float32), so that batches span several huge pages."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((512 * 1024,), float(i))


def pmd_mapped_kb(address: int) -> int:
    """kB of the mapping holding ``address`` that 2 MiB page-table entries map."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                kb = int(line.split()[1])
                if kb:
                    return kb
    return 0


def mapping_kb(address: int) -> dict[str, int]:
    """kB of the mapping holding ``address``: ``rss`` (all it maps), ``pmd`` (what 2 MiB
    page-table entries map) and ``anon`` (copy-on-write copies)."""
    out = {"rss": 0, "pmd": 0, "anon": 0}
    keys = {"Rss:": "rss", "ShmemPmdMapped:": "pmd", "FilePmdMapped:": "pmd", "Anonymous:": "anon"}
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head in keys:
                out[keys[head]] += int(line.split()[1])
    return out


#: How each path of ``huge_paths`` writes its slots: (batch_size, num_workers).
HUGE_PATHS = {
    "main": (2, 0),  # the leader's main process copies the batch in
    "collate": (2, 2),  # a DataLoader worker's collate stacks into the slot
    "copy": (None, 2),  # a DataLoader worker copies its sample in
}


def huge_paths(rank: int, world: int, *, path: str) -> dict:
    """Share ``Big`` batches over a ring in SHMLOADER_SHM_DIR, slots written the way
    ``path`` names (``HUGE_PATHS``); per batch, after every page was read: the
    mapping's kB (``mapping_kb``) and the batch's own."""
    batch_size, num_workers = HUGE_PATHS[path]
    group, _members = sp_groups(world, world)
    loader = ShmLoader(
        lambda: DataLoader(Big(), batch_size=batch_size, num_workers=num_workers),
        group,
        config=Config.from_env(enabled=True),
    )
    out: dict[str, Any] = {"role": loader.role, "maps": [], "worker_written": 0}
    for batch in loader:
        rows = batch.reshape(-1, 512 * 1024)  # one Big sample per row
        assert float(rows.sum()) == float(rows[:, 0].sum()) * rows.shape[1]  # every page read
        out["maps"].append({**mapping_kb(batch.data_ptr()), "batch": batch.nbytes >> 10})
        del batch
    out["worker_written"] = loader.stats().get("worker_written", 0)
    loader.close()
    return out


def huge_ring(rank: int, world: int, *, num_workers: int) -> dict:
    """Share ``Big`` batches through the ring directory SHMLOADER_SHM_DIR names;
    report where the ring lived, what ``stat`` said about it and the batches."""
    from shmloader._node import inventory, segment

    group, _members = sp_groups(world, world)
    loader = ShmLoader(
        lambda: DataLoader(Big(), batch_size=2, num_workers=num_workers),
        group,
        config=Config.from_env(enabled=True),
    )
    out: dict[str, Any] = {"dir": segment.SHM_DIR, "firsts": [], "pmd_kb": [], "role": loader.role}
    for batch in loader:
        out["firsts"].append(batch[:, 0].tolist())
        assert float(batch.sum()) == float(batch[:, 0].sum()) * batch.shape[1]  # every page read
        out["pmd_kb"].append(pmd_mapped_kb(batch.data_ptr()))
        if "job" not in out:
            token = loader.topology.ring_token  # type: ignore[union-attr]
            job = next(j for j in inventory.scan()["jobs"] if j["token"] == token)
            out["job"] = {k: job.get(k) for k in ("shm_dir", "huge_pages", "state")}
            out["in_dev_shm"] = [n for n in os.listdir("/dev/shm") if token in n]
        del batch
    loader.close()
    return out


def shmloader_threads(ignore: tuple[str, ...] = ()) -> list[str]:
    """Names of this process's live shmloader threads, but ``ignore``'s."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("shmloader-") and t.name not in ignore
    ]


def threads_left(limit: float, ignore: tuple[str, ...] = ()) -> list[str]:
    """``shmloader_threads`` once none is left, or after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while (left := shmloader_threads(ignore)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left

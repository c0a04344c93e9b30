"""Soak: 10,000 small batches through SP4 leak no descriptor, mapping, socket or memory.

Sampled at batch 1,000 and at the last: a leak of one descriptor, socket or
mapping per few thousand batches shows, and so does memory growing by 0.9 KiB
a batch (``RSS_SLACK_KIB`` over the 9,000 batches between the samples; a
quiet run grows by about 0.1 MiB).
"""

from __future__ import annotations

import contextlib
import os
import resource

import pytest
import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader
from tests.support.harness import run_ranks

STEPS = 10_000
#: RSS growth allowed between the samples: 0.9 KiB a batch over 9,000 batches.
RSS_SLACK_KIB = 8 * 1024


class Small:
    def __len__(self) -> int:
        return STEPS

    def __iter__(self):
        for i in range(STEPS):
            yield {"tokens": torch.full((64,), i), "meta": {"step": i}}


def resources() -> dict[str, int]:
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    sockets = sum(1 for link in links if link.startswith("socket:"))
    return {"fds": len(links), "maps": maps, "rss_kib": rss, "sockets": sockets}


def soak(rank: int, world: int) -> dict:
    loader = ShmLoader(Small, dist.group.WORLD, config=Config.from_env(enabled=True))
    samples, last = {}, -1
    for i, batch in enumerate(loader):
        last = int(batch["tokens"][0])
        assert last == i
        if i in (1_000, STEPS - 1):
            samples[i] = resources()
    out = {"samples": samples, "last": last, "stats": loader.stats()}
    loader.close()
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_10k_batches_sp4_no_growth():
    out = run_ranks(soak, 4, timeout=540)
    for rank, o in enumerate(out):
        early, late = o["samples"][1_000], o["samples"][STEPS - 1]
        assert o["last"] == STEPS - 1
        assert late["fds"] <= early["fds"] + 2, (rank, early, late)
        assert late["sockets"] <= early["sockets"], (rank, early, late)
        assert late["maps"] <= early["maps"] + 16, (rank, early, late)
        assert late["rss_kib"] <= early["rss_kib"] + RSS_SLACK_KIB, (rank, early, late)
        print(f"rank {rank}: at 1k {early}, at {STEPS // 1000}k {late}")
    assert out[0]["stats"]["ring_slots"] <= 4, "the ring must not grow under a steady job"

"""NOTE [unmapped off the step] (unmap): the batch the user drops at the next ``next()`` is
unmapped and released by the unmap thread, ahead or in step, on every role (leader,
follower, node leader), and every batch is still exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from shmloader import Config, ShmLoader
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(180)

N = 12


class Rows(Dataset):
    """Sample ``i``: a little over 1 MiB of ``i`` (a slot view past ``LEASE_MIN_BYTES``)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full(((1 << 18) + 1024,), float(i))


def drops(rank: int, world: int, *, ahead: bool) -> dict:
    from shmloader._node import unmap

    loader = ShmLoader(
        lambda: DataLoader(Rows(), batch_size=None, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, ahead=ahead),
    )
    before = unmap._unmapper.done
    seen = []
    for batch in loader:  # the previous batch is dropped at each next()
        seen.append(float(batch[0]) if bool((batch == batch[0]).all()) else None)
    del batch
    assert unmap.settle(10)
    unmapped = unmap._unmapper.done - before
    loader.close()
    return {
        "seen": seen,
        "unmapped": unmapped,
        "role": loader.role,
    }


@pytest.mark.parametrize("nodes", [None, [0, 0, 1]], ids=["one-node", "two-nodes"])
def test_batches_dropped_ahead_are_unmapped_by_the_unmap_thread_on_every_role(nodes) -> None:
    out = run_ranks(drops, len(nodes or [0, 1]), kwargs={"ahead": True}, nodes=nodes)
    for rank, o in enumerate(out):
        assert o["seen"] == [float(i) for i in range(N)], (rank, o["seen"])
        # every batch of the epoch went through the unmap thread (the leader's own too)
        assert o["unmapped"] >= N, (rank, o["role"], o["unmapped"])


def test_in_step_too_every_dropped_batch_is_unmapped_by_the_unmap_thread() -> None:
    # nothing of the data path on the training thread, in step as well
    # (the in-step 256 MiB step: drop 10-16 ms -> 0.1 ms, above C 41 -> 36 ms)
    out = run_ranks(drops, 2, kwargs={"ahead": False})
    for rank, o in enumerate(out):
        assert o["seen"] == [float(i) for i in range(N)], (rank, o["seen"])
        assert o["unmapped"] >= N, (rank, o["role"], o["unmapped"])


def lockstep(rank: int, world: int) -> dict:
    """In step, two slots. The follower takes batch k (dropping k - 1) and sleeps 50 ms;
    then the leader publishes batch k + 1, for which it needs the slot of k - 1; only then
    does the follower ask for k + 1 (a request of its own would wake its producer)."""
    import time

    loader = ShmLoader(
        lambda: DataLoader(Rows(), batch_size=None),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, ahead=False, slots=2),
    )
    it = iter(loader)
    seen = []
    for _ in range(N):
        if rank == 0:
            dist.barrier()  # the follower dropped its batch before last 50 ms ago
            batch = next(it)
            dist.barrier()
        else:
            dist.barrier()
            dist.barrier()  # the leader published the batch we ask for now
            batch = next(it)
            time.sleep(0.05)
        seen.append(float(batch[0]))
    out = {"seen": seen, "slots": loader.stats().get("ring_slots")}
    del batch, it
    loader.close()
    return out


def test_a_dropped_batchs_release_leaves_at_once_so_a_lockstep_job_cycles_two_slots() -> None:
    """NOTE [prompt release] (follower): a dropped batch's RELEASE is queued by its
    finalizer and the producer, woken by its doorbell, sends it at once, long before the
    leader publishes the batch after next; one that waited for the end of the producer's
    slice (200 ms) or for the follower's next request would find every slot held and grow
    the ring to three."""
    out = run_ranks(lockstep, 2)
    assert [o["seen"] for o in out] == [[float(i) for i in range(N)]] * 2, out
    assert out[0]["slots"] == 2, out[0]

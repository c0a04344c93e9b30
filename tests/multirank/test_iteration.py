"""The iterator a user holds (NOTE [an iterator keeps its loader] in
``shmloader._roles.iteration``): ``for batch in ShmLoader(...)`` with no name for
the loader runs its whole epoch on every role; a later ``iter()`` or a mid-epoch
``set_epoch`` ends a sharing rank's pass in use with an error naming the call;
an error is raised again at every later ``next()``; ``set_epoch`` after
``close()`` is refused."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shmloader import Config, ShmLoader
from shmloader.errors import ShmLoaderError
from tests.support.harness import run_ranks
from tests.support.ranks import Large, threads_left

pytestmark = pytest.mark.timeout(120)

N = 6


class Filled(torch.utils.data.Dataset):
    """Item ``i`` is 64 KiB of ``i``; item ``fail_at`` raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"item {i} is broken")
        return torch.full((1 << 14,), float(i))


def _make(workers: int, fail_at: int | None = None):
    return lambda: DataLoader(Filled(fail_at), batch_size=1, num_workers=workers)


def _cfg(enabled: bool, ahead: bool = True) -> Config:
    return Config.from_env(enabled=enabled, ahead=ahead)


# ------------------------------------------------------------------ rank code


def unnamed_loader(rank: int, world: int, *, workers: int, enabled: bool) -> dict:
    """``for batch in ShmLoader(...)``: the loader is nobody's variable."""
    seen = []
    role = None
    for batch in ShmLoader(_make(workers), dist.group.WORLD, config=_cfg(enabled)):
        seen.append(float(batch[0, 0]))
        role = role or "seen"
    gc.collect()
    dist.barrier()  # every rank finished its epoch and then closed: nothing hangs here
    return {"seen": seen}


def dropped_mid_epoch(rank: int, world: int) -> dict:
    """``for batch in ShmLoader(...)`` over two nodes, left after 2 batches: the loader is
    dropped with its iterator while the leader's loop has a send ahead that its node
    leader, in step, has not taken; its finalizer closes it as ``close()`` would: goodbyes
    said, so the node leader drains that send and every thread ends. Then a new loader on
    the same group, a whole epoch."""
    make = lambda: DataLoader(Large(), batch_size=1, num_workers=2)  # noqa: E731
    seen = []
    for batch in ShmLoader(make, dist.group.WORLD, config=_cfg(True, ahead=rank == 0)):
        seen.append(float(batch[0, 0]))
        if len(seen) == 2:
            time.sleep(0.5)  # the leader's loop sends ahead meanwhile
            break
    del batch
    gc.collect()
    left = threads_left(10)
    dist.barrier()
    again = [float(b[0, 0]) for b in ShmLoader(make, dist.group.WORLD, config=_cfg(True))]
    gc.collect()
    dist.barrier()
    return {"seen": seen, "left": left, "again": again}


def roles_of_unnamed(rank: int, world: int, *, workers: int) -> dict:
    loader = ShmLoader(_make(workers), dist.group.WORLD, config=_cfg(True))
    role = loader.role
    it = iter(loader)
    del loader
    gc.collect()  # only the iterator refers to the loader now
    seen = [float(b[0, 0]) for b in it]
    del it
    gc.collect()
    dist.barrier()
    return {"role": role, "seen": seen}


def second_pass(rank: int, world: int, *, how: str, ahead: bool, enabled: bool) -> dict:
    """Take 2 batches, then a second iter() (or set_epoch) on every rank; the first
    iterator's next() names the call that ended it; the second pass is whole."""
    loader = ShmLoader(_make(2), dist.group.WORLD, config=_cfg(enabled, ahead))
    first = iter(loader)
    taken = [float(next(first)[0, 0]) for _ in range(2)]
    if how == "set_epoch":
        loader.set_epoch(1)
    second = [float(b[0, 0]) for b in loader]
    try:
        later = float(next(first)[0, 0])
        error = None
    except StopIteration:
        later, error = None, "StopIteration"
    except ShmLoaderError as exc:
        later, error = None, str(exc)
    loader.close()
    return {"taken": taken, "second": second, "later": later, "error": error}


def sticky_error(rank: int, world: int, *, enabled: bool) -> dict:
    loader = ShmLoader(_make(0, fail_at=3), dist.group.WORLD, config=_cfg(enabled))
    it = iter(loader)
    seen, errors = [], []
    for _ in range(N + 2):
        try:
            seen.append(float(next(it)[0, 0]))
        except StopIteration:
            errors.append("StopIteration")
            break
        except Exception as exc:
            errors.append(type(exc).__name__)
    loader.close()
    return {"seen": seen, "errors": errors}


def set_epoch_after_close(rank: int, world: int, *, enabled: bool) -> str:
    loader = ShmLoader(_make(0), dist.group.WORLD, config=_cfg(enabled))
    for _ in loader:
        pass
    loader.close()
    try:
        loader.set_epoch(1)
    except ShmLoaderError as exc:
        return str(exc)
    return "accepted"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "workers"])
def test_an_unnamed_loader_runs_its_whole_epoch_on_every_role(workers):
    # three ranks on two nodes: the leader, a follower and a node leader
    out = run_ranks(roles_of_unnamed, 3, kwargs={"workers": workers}, nodes=[0, 0, 1])
    assert sorted(o["role"] for o in out) == ["follower", "leader", "node leader"], out
    for o in out:
        assert o["seen"] == [float(i) for i in range(N)], o


@pytest.mark.parametrize("enabled", [True, False], ids=["shared", "local"])
@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "workers"])
def test_for_batch_in_an_unnamed_shmloader(workers, enabled):
    out = run_ranks(unnamed_loader, 2, kwargs={"workers": workers, "enabled": enabled})
    for o in out:
        assert o["seen"] == [float(i) for i in range(N)], o


@pytest.mark.parametrize("how", ["iter", "set_epoch"])
@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in-step"])
def test_a_later_call_ends_the_pass_in_use_by_name(how, ahead):
    out = run_ranks(
        second_pass, 3, kwargs={"how": how, "ahead": ahead, "enabled": True}, nodes=[0, 0, 1]
    )
    named = "set_epoch(1)" if how == "set_epoch" else "a later iter()"
    for o in out:
        assert o["taken"] == [0.0, 1.0], o
        assert o["second"] == [float(i) for i in range(N)], o
        assert o["later"] is None and named in (o["error"] or ""), o


def test_with_sharing_off_both_iterators_go_on_as_with_a_dataloader():
    out = run_ranks(second_pass, 2, kwargs={"how": "iter", "ahead": True, "enabled": False})
    for o in out:
        assert o["second"] == [float(i) for i in range(N)], o
        assert o["later"] == 2.0, o  # the first iterator goes on where it was


@pytest.mark.parametrize("enabled", [True, False], ids=["shared", "local"])
def test_an_error_is_raised_again_at_every_later_next(enabled):
    out = run_ranks(sticky_error, 2, kwargs={"enabled": enabled})
    for o in out:
        assert o["seen"] == [0.0, 1.0, 2.0], o
        # never a normal end after the error: the epoch is not silently short
        assert len(o["errors"]) == N + 2 - 3 and "StopIteration" not in o["errors"], o
        assert len(set(o["errors"])) == 1, o


@pytest.mark.parametrize("enabled", [True, False], ids=["shared", "local"])
def test_set_epoch_after_close_is_refused(enabled):
    out = run_ranks(set_epoch_after_close, 2, kwargs={"enabled": enabled})
    for o in out:
        assert "closed" in o, o


def test_a_loader_dropped_mid_epoch_says_its_goodbyes_across_nodes():
    # its finalizer closes it as close() does (Closing.dropped): the leader's closing STOP
    # and the node leader's drain end the sends its loop had ahead, and every thread ends
    out = run_ranks(dropped_mid_epoch, 2, nodes=[0, 1])
    for rank, o in enumerate(out):
        assert o["seen"] == [0.0, 1.0], (rank, o)
        assert o["left"] == [], (rank, o)
        assert o["again"] == [float(i) for i in range(8)], (rank, o)

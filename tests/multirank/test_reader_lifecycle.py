"""A reader's side of the protocol, pinned in real ranks: what a follower owes the writer
(ACKs, releases, stamps) and what a batch it holds owes the user after close().
"""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from shmloader import Config, ShmLoader
from shmloader.errors import DivergenceError, PeerLostError
from tests.support.harness import capture_warnings, run_ranks

LEAF = 1 << 16  # float32 elements: 256 KiB, far above SHMLOADER_SMALL_COPY (a view)


class Filled(Dataset):
    """Sample ``i`` is a vector of ``i`` everywhere: a changed byte shows."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((LEAF,), float(i))


class EpochRange(Sampler):
    """``n`` indices per epoch, from ``100 * epoch``; ``n_of`` may change the count per epoch."""

    def __init__(self, n: int, n_of: dict[int, int] | None = None) -> None:
        self.n, self.n_of, self.epoch = n, n_of or {}, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(100 * self.epoch, 100 * self.epoch + len(self)))

    def __len__(self) -> int:
        return self.n_of.get(self.epoch, self.n)


def _loader(workers: int, n: int = 4, n_of: dict[int, int] | None = None) -> ShmLoader:
    def make() -> DataLoader:
        return DataLoader(Filled(), batch_size=1, sampler=EpochRange(n, n_of), num_workers=workers)

    return ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True))


# ------------------------------------------------------------ held past close()


def kept_past_close(rank: int, world: int, *, workers: int, how: str) -> list[str]:
    """The follower keeps every batch of epoch 0 and closes (or drops its loader without
    close(): no BYE, the leader carries on without it); the leader runs epochs 1 and 2."""
    loader = _loader(workers, n_of={1: 12, 2: 12})  # enough later batches to cycle any pool
    loader.set_epoch(0)
    kept = list(loader) if rank == 1 else []  # the leader keeps nothing: its holds go
    for _ in loader if rank == 0 else ():
        pass
    expected = [b.clone() for b in kept]
    if rank == 1 and how == "close":
        loader.close()  # its BYE drops its holds: the leader may rewrite those slots
    elif rank == 1:
        del loader  # the finalizer closes the socket, no BYE: the leader drops its holds
        gc.collect()
    dist.barrier()
    if rank == 0:
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            for _ in range(3):  # a follower lost without a BYE is a PeerLostError, once
                try:
                    for _ in loader:
                        pass
                    break
                except PeerLostError:
                    continue
        loader.close()
    dist.barrier()
    changed = [
        f"batch {i}: {float(b[0, 0])} (was {float(e[0, 0])})"
        for i, (b, e) in enumerate(zip(kept, expected, strict=True))
        if not torch.equal(b, e)
    ]
    return changed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "how"), [(0, "close"), (2, "close"), (0, "dropped")])
def test_a_batch_held_past_close_never_changes(workers, how):
    assert run_ranks(kept_past_close, 2, kwargs={"workers": workers, "how": how}) == [[], []]


# ------------------------------------------------------------- quiet at exit


def _hold_and_return(rank: int) -> None:
    loader = _loader(0)
    batch = next(iter(loader))
    assert batch.shape == (1, LEAF)
    dist.barrier()  # every rank mapped its batch before the writer's loader goes
    # returns holding both: the frame drops the loader (its finalizer closes the
    # socket) and the batch (its release) in whichever order it likes


def dropped_with_its_batch(rank: int, world: int) -> list[str]:
    raised: list[str] = []
    previous, sys.unraisablehook = sys.unraisablehook, lambda u: raised.append(repr(u.exc_value))
    try:
        _hold_and_return(rank)
        gc.collect()
        time.sleep(0.2)  # a release racing the close would have failed by now
        gc.collect()
    finally:
        sys.unraisablehook = previous
    dist.barrier()
    return raised


@pytest.mark.timeout(60)
def test_a_release_after_the_loader_is_gone_is_silent():
    assert run_ranks(dropped_with_its_batch, 2) == [[], []]


# ------------------------------------------------- what a follower owes the writer


class Raises(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:
            raise ValueError("sample 1 is corrupt")
        return torch.full((4,), float(i))


#: How long the follower of ``error_acked_on_receipt`` keeps its loader open at
#: most, waiting for the leader to have raised.
HOLD_OPEN_S = 40.0


def error_acked_on_receipt(rank: int, world: int, *, flag: str) -> dict:
    """The follower keeps its loader open until the leader raised its error (or
    ``HOLD_OPEN_S`` passed): an ACK sent only at close() would hold the leader
    until then, or until its bounded wait for the ACK ran out (it says so)."""
    warnings = capture_warnings()
    loader = ShmLoader(
        lambda: DataLoader(Raises(), batch_size=1),
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
    )
    it = iter(loader)
    next(it)
    try:
        next(it)
    except Exception as exc:  # the leader: its ValueError; the follower: LeaderError
        raised = type(exc).__name__
    open_when_raised = None
    if rank == 0:
        with open(flag, "w") as f:  # the leader has raised: say so to the follower
            f.write(raised)
    else:
        deadline = time.monotonic() + HOLD_OPEN_S
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        open_when_raised = os.path.exists(flag)  # the leader raised while we had not closed
    loader.close()
    return {"raised": raised, "open_when_raised": open_when_raised, "warnings": warnings.messages}


@pytest.mark.timeout(120)
def test_the_leaders_error_is_acked_on_receipt_not_at_close(tmp_path):
    flag = str(tmp_path / "leader-raised")
    leader, follower = run_ranks(error_acked_on_receipt, 2, kwargs={"flag": flag}, timeout=100)
    assert (leader["raised"], follower["raised"]) == ("ValueError", "LeaderError")
    assert follower["open_when_raised"], "the leader waited for the follower's close, not its ACK"
    # ... nor did its bounded wait for the ACK run out (CLOSE_WAIT_S): the ACK came
    unconfirmed = [m for m in leader["warnings"] if "not every follower confirmed" in m]
    assert not unconfirmed, unconfirmed


def breaks_early(rank: int, world: int) -> list[int]:
    """The follower breaks out of every epoch after one batch; the leader goes on to the end.

    The batches the follower left behind must be released when its next
    iteration meets them, or they stay HELD and the leader's ring grows.
    """
    loader = _loader(0, n=8)
    slots = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        for step, _ in enumerate(loader):
            if rank == 1 and step == 0:
                break
        if rank == 0:
            slots.append(loader.stats()["ring_slots"])
    loader.close()
    return slots


@pytest.mark.timeout(90)
def test_batches_a_follower_left_behind_are_released():
    slots, _ = run_ranks(breaks_early, 2)
    cfg = Config.from_env()
    # + SLOTS: what the follower's loop took ahead of its user (NOTE [running ahead])
    assert max(slots) <= 2 * cfg.slots + 2, f"the leader's ring grew: {slots}"


def epochs_disagree(rank: int, world: int) -> str:
    """The leader's epoch 1 is empty; the follower never called set_epoch(1)."""
    loader = _loader(0, n=3, n_of={1: 0})
    if rank == 0:
        loader.set_epoch(1)
    try:
        got = len(list(loader))
        outcome = f"{got} batches"
    except DivergenceError as exc:
        outcome = f"DivergenceError: {exc}"
    loader.close()
    return outcome


@pytest.mark.timeout(60)
def test_an_end_of_another_epoch_is_a_divergence_not_an_empty_epoch():
    leader, follower = run_ranks(epochs_disagree, 2)
    assert leader == "0 batches"
    assert follower.startswith("DivergenceError") and "ended" in follower, follower


def epoch_set_on_the_leader_only(rank: int, world: int) -> tuple[list[float], str]:
    """The leader called set_epoch(1), the follower did not; every epoch has 3 batches."""
    loader = _loader(0, n=3)
    if rank == 0:
        loader.set_epoch(1)
    got = []
    try:
        for batch in loader:
            got.append(float(batch[0, 0]))
        outcome = "ended"
    except DivergenceError as exc:
        outcome = f"DivergenceError: {exc}"
    loader.close()
    return got, outcome


@pytest.mark.timeout(60)
def test_a_batch_of_another_epoch_is_a_divergence_before_it_is_delivered():
    """A follower checks every BATCH's stamp (epoch, position) against its own before it
    delivers it: a batch of the leader's epoch 1 is never handed out as one of epoch 0
    (caught at the END only, the follower would have trained on the whole wrong epoch)."""
    (leader_got, leader_outcome), (got, outcome) = run_ranks(epoch_set_on_the_leader_only, 2)
    assert (leader_got, leader_outcome) == ([100.0, 101.0, 102.0], "ended")
    assert got == [], f"batches of the leader's epoch 1 were delivered as epoch 0's: {got}"
    assert outcome.startswith("DivergenceError"), outcome
    assert "batch 0 of epoch 1" in outcome and "batch 0 of epoch 0" in outcome, outcome


# ------------------------------------------------------------------ SIGTERM


def test_a_forked_child_stopped_by_sigterm_leaves_its_parents_runtime_directory(tmp_path):
    import os
    import signal

    from shmloader._node import cleanup

    rundir = tmp_path / "shml-rundir"
    rundir.mkdir()
    cleanup.own(directory=str(rundir))
    try:
        pid = os.fork()
        if pid == 0:  # the child: inherits the parent's registry, then SIGTERM
            try:
                time.sleep(30)
            finally:
                os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) or os.WIFEXITED(status)
        assert rundir.exists(), "the child removed its parent's runtime directory"
        assert str(rundir) in cleanup.owned()[1]
    finally:
        cleanup.disown(directory=str(rundir))


# ------------------------------------------ a reader gone, with or without BYE


class _Hub:
    """A hub that saw rank 1's socket close; its BYE (if any) arrives a moment later."""

    def __init__(self, bye: bool) -> None:
        from shmloader._proto import wire

        self.left, self.subscribed = {1}, {2}
        self.published = 0
        bye_msg = (wire.parse(wire.frames(wire.Kind.BYE, rank=1)), 1)
        self.queued = [None, None, bye_msg] if bye else []  # trails the unsubscription

    def broadcast(self, parts: list) -> None:
        self.published += 1

    def receive(self, timeout: float):
        time.sleep(timeout)
        return self.queued.pop(0) if self.queued else None


class _Ring:
    def __init__(self) -> None:
        self.dropped: list[int] = []

    def take_retired(self) -> list[str]:
        return []

    def drop_reader(self, rank: int) -> None:
        self.dropped.append(rank)


def _writer(bye: bool):
    import types

    from shmloader._roles.node_writer import NodeWriter

    topo = types.SimpleNamespace(readers=[1, 2], role=lambda rank: "follower")
    ctx = types.SimpleNamespace(cursor=types.SimpleNamespace(epoch=0), config=None)
    writer = NodeWriter(ctx, topo, _Ring(), _Hub(bye), None)
    writer.hello = {1, 2}
    return writer


def _end() -> list:
    from shmloader._proto import wire

    return wire.frames(wire.Kind.END, it=1, epoch=0, pos=3, draws=0)


def test_a_reader_that_left_with_a_trailing_bye_is_not_lost():
    writer = _writer(bye=True)
    writer.tell_readers(_end())  # no raise: its BYE came within the grace
    assert writer.gone == {1} and writer.ring.dropped == [1]
    assert writer.hub.published == 1, "one publication for every reader"


def test_a_reader_whose_socket_closed_without_bye_is_lost():
    from shmloader.errors import PeerLostError

    writer = _writer(bye=False)
    with pytest.raises(PeerLostError, match="follower rank 1"):
        writer.tell_readers(_end())
    assert writer.gone == {1}
    writer.hub.left = {1}
    writer.tell_readers(_end())  # told once: a reader already dropped is not lost again


# ------------------------------------------------- retired slots (ring shrink)


class BigThenSmall(Dataset):
    """Samples 0..3 are 8 MiB, the rest 256 KiB: the writer's ring shrinks after them."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full(((1 << 21) if i < 4 else LEAF,), float(i))


def _ring_of(loader: ShmLoader):
    role = loader._role
    return getattr(role, "ring", None) or role.writer.ring


def _open_slots(token: str) -> tuple[set[str], int]:
    """This process's open descriptors of ring ``token``'s slots (names), and its mappings."""
    import os
    import re

    slot = re.compile(rf"shml-{token}-\d+\.\d+\.[0-9a-z]+")
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if m := slot.search(target):
            fds.add("/" + m.group(0))
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if slot.search(line))
    return fds, maps


def shrunk_ring(rank: int, world: int, *, device: bool) -> dict:
    """Every rank keeps the 8 MiB batches until step 6, then only batch 1 (to the end) and the
    last batch: the writers' rings grow to 4-5 large slots, then shrink to a few small ones."""
    from tests.support.fake_device import FakeOps

    follower_device = FakeOps(auto=True) if device else None
    loader = ShmLoader(
        lambda: DataLoader(BigThenSmall(), batch_size=1),
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
        device=follower_device,
    )
    role = loader.role
    kept = {}
    for step, batch in enumerate(loader):
        assert float(batch[0, 0]) == step
        if step < 4 or step == 19:
            kept[step] = batch
        if step == 6:
            kept = {1: kept[1]}
        del batch
        dist.barrier()  # lockstep: each writer retires what every reader released
    assert float(kept[1][0, 0]) == 1, "a held batch changed"
    out: dict = {"role": role}
    if role == "follower":
        out["token"] = loader._role.ring.token
        out["fds"], out["maps"] = _open_slots(out["token"])
        if device:
            out["registered"] = len(follower_device.registered)
    else:
        ring = _ring_of(loader)
        from shmloader._node.ring import SlotState

        live = [s for s in ring.slots if s.state != SlotState.RETIRED]
        out.update(token=ring.token, retired=len(ring._retired))
        out["live"] = {s.segment.name for s in live}
    writers = [None] * world
    dist.all_gather_object(writers, {out["token"]: out.get("live")} if role != "follower" else {})
    out["writers"] = {k: v for w in writers for k, v in w.items()}
    kept.clear()
    loader.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("nodes", "device"), [(None, False), ([0, 0, 1, 1], False), ([0, 0, 1, 1], True)]
)
def test_followers_drop_the_slots_their_writer_retired(nodes, device):
    world = 4 if nodes else 2
    out = run_ranks(shrunk_ring, world, kwargs={"device": device}, nodes=nodes)
    for o in out:
        if o["role"] != "follower":
            assert o["retired"] >= 1, f"the {o['role']}'s ring never shrank: {o}"
            continue
        live = o["writers"][o["token"]]
        # open: only what the writer's ring still has (the kept 8 MiB batch's slot
        # is HELD there); mapped: the two kept batches' views at most
        assert o["fds"] <= live, f"retired slots still open: {sorted(o['fds'] - live)}"
        assert o["maps"] <= (len(live) if device else 2), o
        if device:
            assert o["registered"] <= len(live), o

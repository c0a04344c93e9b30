"""Running ahead (NOTE [running ahead] in shmloader/_roles/producer.py): each rank's per-batch
work happens on a background thread before the user asks, and every guarantee holds.

One node (SP2) and an SP group over two simulated nodes (private /dev/shm per node,
tests/support/harness.py); the leader's DataLoader has workers, so the leader runs ahead
too (NOTE [draws ahead] in shmloader/_roles/leader.py).
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from shmloader import Config, ShmLoader
from shmloader.errors import LeaderError, ShmLoaderError
from tests.support.fake_device import FakeOps
from tests.support.harness import capture_warnings, run_ranks
from tests.support.ranks import Large

pytestmark = pytest.mark.timeout(180)

NODES = {"one-node": None, "two-nodes": [0, 0, 1, 1]}
#: where each rank's batches go: host memory, or a fake device the loop ahead copies to
#: (one node only: the device stage is per rank, the cross-node path the same either way)
PLACES = {
    "one-node": (None, False),
    "two-nodes": ([0, 0, 1, 1], False),
    "one-node-device": (None, True),
}


class Numbered(Dataset):
    """Sample ``i`` is 64 KiB of ``i``; ``fail_at`` raises there (in a worker)."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is broken")
        return torch.full((1 << 14,), float(i))


def _loader(n: int = 12, fail_at: int | None = None, device: bool = False, **config) -> ShmLoader:
    """``device``: deliver through a fake device, so each loop ahead also issues the copies
    (NOTE [copies issued by the loop ahead] in shmloader/device/stage.py)."""
    return ShmLoader(
        lambda: DataLoader(Numbered(n, fail_at), batch_size=1, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, **config),
        device=FakeOps(auto=True) if device else None,
    )


def _ahead_threads() -> list[threading.Thread]:
    """Every thread of shmloader's: producers, the cross-node links (a node leader's drain
    and the leader's closing STOP are their last jobs: NOTE [closing across nodes] in
    shmloader/_transport/xnode.py)."""
    return [t for t in threading.enumerate() if t.name.startswith("shmloader-") and t.is_alive()]


# ------------------------------------------------------------------ rank code


def ready_before_asked(rank: int, world: int, *, ahead: bool) -> dict:
    """After each batch the user 'computes' for 0.3 s; then, before asking for the next,
    how many batches this rank had received (or published) and holds ready."""
    loader = _loader(8, ahead=ahead)
    seen, ready, counted = [], [], []
    for batch in loader:
        seen.append(int(batch[0, 0]))
        # the step's compute: the next batch can arrive meanwhile (the first step also
        # waits for the second DataLoader worker to start, slow on a busy machine). In
        # step the leader computes less: its next batches are published (up to its
        # window) long before the follower asks, which must not take them before then
        quick = not ahead and rank == 0 and len(seen) > 1
        time.sleep(0.05 if quick else 1.5 if len(seen) == 1 else 0.3)
        stats = loader.stats()
        ready.append(stats.get("ahead_ready", 0))
        counted.append(stats.get("received", stats.get("published", 0)))
    loader.close()
    return {"seen": seen, "ready": ready, "counted": counted, "role": loader.role}


def error_at_its_step(rank: int, world: int, *, device: bool = False) -> dict:
    """Sample 5 raises in the leader's worker: every rank gets batches 0-4, then the error."""
    loader = _loader(12, fail_at=5, device=device)
    seen: list[int] = []
    try:
        for batch in loader:
            seen.append(int(batch[0, 0]))
            time.sleep(0.1)  # the leader's loop reaches sample 5 well before the user does
        error = None
    except Exception as exc:  # the test compares what each rank saw
        error = type(exc).__name__, isinstance(exc, LeaderError)
    loader.close()
    return {"seen": seen, "error": error}


def close_mid_lookahead(rank: int, world: int, *, how: str, device: bool = False) -> dict:
    """The user closes while batches wait ahead: from its own loop or from another thread."""
    loader = _loader(40, device=device)
    seen: list[int] = []
    outcome = "finished"
    if how == "inside":
        for batch in loader:
            seen.append(int(batch[0, 0]))
            if len(seen) == 3:
                time.sleep(0.3)  # batches queue up ahead
                loader.close()
                break
        # a checkpoint after close() describes the 3 batches taken, not what ran ahead
        outcome = f"state at {loader.state_dict()['batches']}"
    else:
        closer = threading.Timer(1.0, loader.close)
        try:
            for batch in loader:
                seen.append(int(batch[0, 0]))
                if len(seen) == 3:
                    closer.start()
                time.sleep(0.2)
        except ShmLoaderError as exc:
            outcome = str(exc)
        closer.join()
    loader.close()
    deadline = time.monotonic() + 10
    while _ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [t.name for t in _ahead_threads()]
    dist.barrier()  # no rank exits (which would break a wait of its peers) before all looked
    return {"seen": seen, "outcome": outcome, "threads": len(left), "left": left}


def closed_with_a_payload_owed(rank: int, world: int) -> dict:
    """Over two nodes, a node leader's user takes every batch at once, its follower's user
    one and then pauses 3 s: the node leader's loop waits for its reader with the leader's
    next header taken and its payload not yet, when it closes from another thread (first:
    its loop can take nothing more); the other ranks close a second later."""
    loader = _loader(40)
    # timed from this rank's first batch: ranks start at different times on a busy machine
    closer = threading.Timer(1.5 if rank == 2 else 2.5, loader.close)
    seen: list[int] = []
    counted: list[int] = []  # batches taken 1.5 s after the first (rank 2 then closes)
    counter = threading.Timer(1.5, lambda: counted.append(len(seen)))
    with contextlib.suppress(ShmLoaderError):
        for batch in loader:
            seen.append(int(batch[0, 0]))
            if len(seen) == 1:
                closer.start()
                counter.start()
            if rank == 3 and len(seen) == 1:
                time.sleep(3.0)  # its loop fills its window, then the node leader's waits
    closer.join()
    counter.join()
    deadline = time.monotonic() + 10
    while _ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [t.name for t in _ahead_threads()]
    dist.barrier()  # no rank exits (which would break a wait of its peers) before all looked
    return {"seen": seen, "left": left, "counted": counted[0]}


def break_holding_a_header(rank: int, world: int) -> dict:
    """Over two nodes: the node leader's follower (rank 3, in step: it takes only what its
    user asks) takes batch 0 and pauses, so the node leader's loop, its user having taken
    batches 0 and 1, waits for that reader with the leader's header of batch 3 taken and its
    payload not yet. The node leader's user then breaks, and iterates again 2 s later; the
    node leader's follower breaks after its pause. The leader and its follower go through the
    epoch. Then every rank a second epoch, whole; each rank says when (wall clock) it got
    each batch of the first epoch, and when it broke and began again."""
    loader = ShmLoader(
        lambda: DataLoader(Large(), batch_size=1, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, ahead=rank != 3),
    )
    first: list[tuple[int, float]] = []
    out: dict = {}
    for batch in loader:
        first.append((int(batch[0, 0]), time.time()))
        if rank == 2 and len(first) == 2:
            time.sleep(1.0)  # its loop takes batch 2 into its queue, then waits in batch 3
            out["broke"] = time.time()
            break
        if rank == 3:
            time.sleep(2.5)  # past the node leader's break: its loop waits for this reader
            break
    del batch
    if rank == 2:
        time.sleep(2.0)  # nothing of this node receives meanwhile but what the break left
    loader.set_epoch(1)
    out["again"] = time.time()
    out["second"] = [int(b[0, 0]) for b in loader]
    loader.close()
    return {**out, "first": first}


def send_in_flight_at_a_break(rank: int, world: int) -> dict:
    """Two nodes, one rank each; the leader's DataLoader worker writes 8 MiB batches into
    pool slots, far ahead (``prefetch_factor`` 8). The node leader's user takes batch 0 and
    pauses 3 s: its loop holds batches 1 and 2, and the leader's send of batch 3 waits. The
    leader's user takes batches 0-2 and breaks (that send goes on, reading its pool slot),
    then iterates again, so the worker writes the next iteration's batches. Back, the node
    leader's user takes what its iteration still has, then hears the leader left it."""
    loader = ShmLoader(
        lambda: DataLoader(Large(), batch_size=1, num_workers=1, prefetch_factor=8),
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
    )
    got: list[tuple[float, float]] = []  # each batch's smallest and largest value
    outcome = "finished"
    if rank == 0:
        for batch in loader:
            got.append((float(batch.min()), float(batch.max())))
            if len(got) == 3:
                time.sleep(0.5)  # the send of batch 3 is in flight
                break
        del batch
        again = next(iter(loader))  # the worker writes this iteration's batches meanwhile
        got.append((float(again.min()), float(again.max())))
        del again
    else:
        try:
            for batch in loader:
                got.append((float(batch.min()), float(batch.max())))
                if len(got) == 1:
                    time.sleep(3.0)
        except ShmLoaderError as exc:
            outcome = type(exc).__name__
    loader.close()
    return {"got": got, "outcome": outcome}


def resume_in_flight(
    rank: int, world: int, *, stop: int | None, ckpt: str, device: bool = False
) -> dict:
    """Save at batch ``stop`` while the next ones are already here; or, with ``stop``
    None and a saved state in ``ckpt``, resume from it (else run the whole epoch).

    Each step draws from the default generator (as dropout does), so the RNG at the
    step boundary is part of what the resume must restore.
    """
    import os

    torch.manual_seed(100 + rank)
    loader = _loader(16, device=device)
    path = os.path.join(ckpt, f"rank{rank}.pt")
    if stop is None and os.path.exists(path):
        loader.load_state_dict(torch.load(path, weights_only=False))
    seen, drawn, in_flight, saved = [], [], 0, None
    for batch in loader:
        seen.append(int(batch[0, 0]))
        drawn.append(float(torch.rand(1)))
        if stop is not None and len(seen) == stop:
            time.sleep(0.3)  # let the loop run ahead of us
            stats = loader.stats()
            in_flight = stats.get("received", stats.get("published", 0)) - len(seen)
            saved = loader.state_dict()
            torch.save(saved, path)
            break
    loader.close()
    return {
        "seen": seen,
        "drawn": drawn,
        "batches": saved and saved["batches"],
        "in_flight": in_flight,
    }


def break_and_go_on(rank: int, world: int, *, device: bool = False) -> dict:
    """Every rank breaks after 3 batches (the loops ran ahead), then iterates again."""
    warnings = capture_warnings()
    loader = _loader(10, device=device)
    first = []
    for batch in loader:
        first.append(int(batch[0, 0]))
        time.sleep(0.2)
        if len(first) == 3:
            break
    del batch
    dropped = loader.stats().get("ahead_ready")  # the queue went with the iteration
    loader.set_epoch(1)
    dist.barrier()  # a collective between epochs: no rank's set_epoch may wait for another's
    second = [int(b[0, 0]) for b in loader]
    state = loader.state_dict()
    loader.close()
    return {
        "first": first,
        "second": second,
        "state": state["batches"],
        "warnings": warnings.messages,
        "dropped": dropped,
    }


def pause_longer_than_the_timeout(rank: int, world: int, *, workers: int, nodes: bool) -> dict:
    """Every rank pauses 6 s (an evaluation) with a 5 s timeout: no peer is silent for
    longer than the user waits, so nothing may fail (the loops wait while the users
    do not ask). The group is the user's own gloo group with a 5 s timeout too: over two
    nodes a gloo wait left open through the pause would time out there and close every
    pair of that group (NOTE [a link of its own] in shmloader/_transport/xnode.py); a
    collective of the user's on it after the epoch shows it intact. Over two nodes the
    in-step leader's node leader runs ahead (its receive of the next header waits through
    the pause), and the leader that runs ahead has a node leader in step with batches no
    socket buffers (the leader's send of the next one waits through the pause)."""
    import datetime

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    loader = ShmLoader(
        lambda: DataLoader(Large(6) if nodes else Numbered(6), batch_size=1, num_workers=workers),
        group,
        # 5 s: a busy machine's first batch
        config=Config.from_env(enabled=True, timeout=5.0, ahead=not (nodes and workers and rank)),
    )
    seen = []
    try:
        for batch in loader:
            seen.append(int(batch[0, 0]))
            if len(seen) == 2:
                time.sleep(6.0)
        outcome = "finished"
    except Exception as exc:  # the test reads the outcome
        outcome = f"{type(exc).__name__}: {exc}"
    loader.close()
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return {"seen": seen, "outcome": outcome, "total": int(total)}


def silent_leader(rank: int, world: int) -> dict:
    """Over two nodes, a 3 s timeout: the leader (in step, no workers) takes batch 0 and then
    computes for 6 s without asking for more; the node leader asks for batch 1 at once. A
    live peer silent for longer than the user waits is lost, across nodes as on one node."""
    loader = ShmLoader(
        lambda: DataLoader(Numbered(6), batch_size=1, num_workers=0),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, timeout=3.0),
    )
    it = iter(loader)
    out: dict = {"first": int(next(it)[0, 0])}
    t0 = time.monotonic()
    if rank == 0:
        time.sleep(6.0)
    else:
        try:
            next(it)
            out["outcome"] = "a batch"
        except ShmLoaderError as exc:
            out["outcome"] = type(exc).__name__
    out["waited"] = time.monotonic() - t0
    del it
    loader.close()
    return out


def slow_node_leader(rank: int, world: int) -> dict:
    """Node leader 2 takes 0.25 s per step; the others step as fast as they can. Each
    rank notes when it took each batch (one clock for every process of the machine)."""
    loader = _loader(16)
    taken = []
    for _ in loader:
        taken.append(time.monotonic())
        if rank == 2:
            time.sleep(0.25)
    loader.close()
    return {"taken": taken}


def iter_then_draw(rank: int, world: int, *, share: bool) -> dict:
    """The user draws between ``iter()`` and the first ``next()``: on the leader,
    ``iter()`` of its loader (the base seed) has drawn already, as in plain torch."""
    torch.manual_seed(11)
    opened_on: list[str] = []

    class Recording(DataLoader):
        def __iter__(self):
            opened_on.append(threading.current_thread().name)
            return super().__iter__()

    def make() -> DataLoader:
        return Recording(Numbered(4), batch_size=1, num_workers=2)

    if share:
        loader = ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True))
    it = iter(loader if share else make())
    drawn = torch.rand(2)
    seen = [int(b[0, 0]) for b in it]
    if share:
        loader.close()
    return {"drawn": drawn, "seen": seen, "opened_on": opened_on}


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("nodes", NODES.values(), ids=NODES.keys())
def test_every_rank_has_the_next_batch_before_it_asks(nodes):
    # over two nodes: the leader sent batch k+1 to the node leader, which received it into
    # its ring and announced it to its follower, while every user computed on batch k
    out = run_ranks(ready_before_asked, 4 if nodes else 2, kwargs={"ahead": True}, nodes=nodes)
    for rank, o in enumerate(out):
        assert o["seen"] == list(range(8)), (rank, o)
        # while the user computed on batch k, batch k+1 was received (or published) and
        # decoded: it waits, ready, in the queue
        assert all(n >= 1 for n in o["ready"][:-1]), (rank, o)
        # and never more than its depth: SHMLOADER_SLOTS (2) - 1, the batch the user holds
        # being the other slot (NOTE [running ahead])
        assert max(o["ready"]) <= 1, (rank, o)
        assert all(c >= k + 2 for k, c in enumerate(o["counted"][:-1])), (rank, o)


def test_without_ahead_nothing_is_taken_before_it_is_asked_for():
    # the control of the test above: the same loop, SHMLOADER_AHEAD=0
    out = run_ranks(ready_before_asked, 2, kwargs={"ahead": False})
    assert out[1]["counted"] == list(range(1, 9)), out[1]
    assert out[1]["ready"] == [0] * 8, out[1]


@pytest.mark.parametrize("nodes, device", PLACES.values(), ids=PLACES.keys())
def test_a_leader_error_at_batch_k_surfaces_at_step_k_on_every_rank(nodes, device):
    out = run_ranks(error_at_its_step, 4 if nodes else 2, kwargs={"device": device}, nodes=nodes)
    assert out[0]["error"] == ("ValueError", False), out
    for rank, o in enumerate(out):
        assert o["seen"] == [0, 1, 2, 3, 4], (rank, o)  # not earlier, not later
        if rank:
            assert o["error"] == ("LeaderError", True), (rank, o)


@pytest.mark.parametrize("nodes, device", PLACES.values(), ids=PLACES.keys())
@pytest.mark.parametrize("how", ["inside", "another-thread"])
def test_close_mid_lookahead_stops_every_thread(how, nodes, device):
    # over two nodes the leader has sends in flight that no loop will take: each node
    # leader's close drains them up to the leader's closing STOP, so both links (and the
    # leader's wait for the STOP) end (NOTE [closing across nodes])
    kwargs = {"how": how, "device": device}
    out = run_ranks(close_mid_lookahead, 4 if nodes else 2, kwargs=kwargs, nodes=nodes)
    for rank, o in enumerate(out):
        assert o["threads"] == 0, (rank, o)
        if how == "inside":
            assert o["seen"] == [0, 1, 2], (rank, o)
            assert o["outcome"] == "state at 3", (rank, o)
        else:
            closed = "this ShmLoader is closed; make a new one"
            # a node's loop may take the leader's closing STOP before its own close
            assert o["outcome"] == closed or "the leader closed" in o["outcome"], (rank, o)
            assert 3 <= len(o["seen"]) < 40, (rank, o)


def test_a_close_while_a_node_leader_owes_a_payload_leaves_no_send_waiting():
    # the drain takes the payload of the header the loop had taken first, then the rest up to
    # the leader's closing STOP (NOTE [closing across nodes] in shmloader/_transport/xnode.py)
    out = run_ranks(closed_with_a_payload_owed, 4, nodes=[0, 0, 1, 1])
    for rank, o in enumerate(out):
        assert o["left"] == [], (rank, o)
        assert o["seen"] == list(range(len(o["seen"]))), (rank, o)
    assert out[2]["counted"] > out[3]["counted"], out  # the node leader's user was ahead


def test_a_node_leader_that_breaks_holding_a_header_takes_its_payload_at_once():
    # the leader's send of batch 3 completes at the node leader's break, not at its next
    # iteration (2 s later): the leader (which announces a batch to its own node once sent) and its
    # follower get batch 3 while the node leader is away (NOTE [running ahead] in
    # shmloader/_roles/producer.py)
    out = run_ranks(break_holding_a_header, 4, nodes=[0, 0, 1, 1])
    broke, again = out[2]["broke"], out[2]["again"]
    assert [b for b, _ in out[2]["first"]] == [0, 1], out[2]
    for rank in (0, 1):
        got = dict(out[rank]["first"])
        assert sorted(got) == list(range(8)), (rank, out[rank])
        assert got[2] < broke, (rank, out)  # the node leader's loop had batch 2 queued
        # batch 3 waited for the node leader's break (its loop held that header), no longer
        assert broke - 0.05 <= got[3] < again - 1.0, (rank, got[3] - broke, again - broke)
    for rank, o in enumerate(out):
        assert o["second"] == list(range(8)), (rank, o)


def test_a_send_left_in_flight_keeps_its_pool_slot_from_the_workers():
    # NOTE [a slot in flight] in shmloader/_transport/xnode.py: the pool slot of batch 3 goes
    # back to the worker only once its send completed, so the node leader, still in that
    # iteration, gets batch 3's bytes, not the next iteration's
    out = run_ranks(send_in_flight_at_a_break, 2, nodes=[0, 1])
    leader, node_leader = out
    assert leader["got"] == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (0.0, 0.0)], out
    assert node_leader["got"] == [(float(k), float(k)) for k in range(4)], out
    assert node_leader["outcome"] == "DivergenceError", out


@pytest.mark.parametrize("nodes, device", PLACES.values(), ids=PLACES.keys())
def test_a_resume_saved_while_batches_are_ahead_is_exact(nodes, device, tmp_path):
    world, ckpt = (4 if nodes else 2), str(tmp_path)
    kw = {"ckpt": ckpt, "device": device}
    whole = run_ranks(resume_in_flight, world, kwargs={**kw, "stop": None}, nodes=nodes)
    first = run_ranks(resume_in_flight, world, kwargs={**kw, "stop": 5}, nodes=nodes)
    for rank, o in enumerate(first):
        assert o["in_flight"] >= 1, (rank, o)  # the save really found batches ahead
        assert o["batches"] == 5, (rank, o)
    rest = run_ranks(resume_in_flight, world, kwargs={**kw, "stop": None}, nodes=nodes)
    for rank in range(world):
        assert first[rank]["seen"] + rest[rank]["seen"] == whole[rank]["seen"], rank
        assert first[rank]["drawn"] + rest[rank]["drawn"] == whole[rank]["drawn"], rank


@pytest.mark.parametrize("nodes, device", PLACES.values(), ids=PLACES.keys())
def test_breaking_out_early_on_every_rank_is_quiet_and_exact(nodes, device):
    # over two nodes the node leader's loop may be anywhere when its user breaks: in the
    # wait for its readers with a header taken, or in the receive of the next header
    out = run_ranks(break_and_go_on, 4 if nodes else 2, kwargs={"device": device}, nodes=nodes)
    for rank, o in enumerate(out):
        assert o["first"] == [0, 1, 2], (rank, o)
        assert o["second"] == list(range(10)), (rank, o)
        assert o["state"] == 10, (rank, o)
        assert o["dropped"] == 0, (rank, o)
        assert not [m for m in o["warnings"] if "left iteration" in m], (rank, o)


def test_a_slow_node_leader_holds_the_leader_within_the_ring_depth():
    out = run_ranks(slow_node_leader, 4, nodes=[0, 0, 1, 1])
    leader, slow = out[0]["taken"], out[2]["taken"]
    slots = Config().slots
    # how far the leader's user got ahead of the slow node leader's user: the leader's
    # lookahead, the cross-node send in flight and the node leader's lookahead, no more
    gaps = [k + 1 - sum(t <= at for t in slow) for k, at in enumerate(leader)]
    assert max(gaps) <= 2 * slots + 2, gaps


def test_the_leaders_loader_is_opened_at_the_users_iter():
    # against plain torch: iter(DataLoader) draws the base seed at once
    shared = run_ranks(iter_then_draw, 2, kwargs={"share": True})
    alone = run_ranks(iter_then_draw, 2, kwargs={"share": False})
    assert shared[0]["seen"] == alone[0]["seen"] == [0, 1, 2, 3]
    # the leader: iter() drew the base seed before the user's draw, as plain torch does
    # (a follower replays those draws with the first batch, after it: docs/user-guide.md)
    assert torch.equal(shared[0]["drawn"], alone[0]["drawn"])
    assert shared[0]["opened_on"] == [threading.main_thread().name]  # the user's thread


@pytest.mark.parametrize("nodes", [None, [0, 1]], ids=["one-node", "two-nodes"])
@pytest.mark.parametrize("workers", [0, 2], ids=["leader-in-step", "leader-ahead"])
def test_a_pause_longer_than_the_timeout_fails_nothing(workers, nodes):
    kwargs = {"workers": workers, "nodes": nodes is not None}
    out = run_ranks(pause_longer_than_the_timeout, 2, kwargs=kwargs, nodes=nodes)
    for rank, o in enumerate(out):
        assert o == {"seen": list(range(6)), "outcome": "finished", "total": 2}, (rank, o)


def test_a_live_leader_silent_past_the_timeout_is_lost_across_nodes():
    # NOTE [a link of its own]: the link's gloo waits outlast any pause, so the loader's own
    # timeout bounds a wait the user waits in too (CrossNode._wait), as on one node
    out = run_ranks(silent_leader, 2, nodes=[0, 1])
    node_leader = out[1]
    assert out[0]["first"] == node_leader["first"] == 0, out
    assert node_leader["outcome"] == "PeerLostError", out
    assert node_leader["waited"] < 5.0, out  # the timeout (3 s), not the leader's 6 s


class Drawing(Dataset):
    """Each sample draws from the default generator (in the loading process): whole int64
    draws, what followers can mirror (NOTE [RNG mirroring] in shmloader/_rng.py)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = int(torch.empty((), dtype=torch.int64).random_()) % 1000
        return torch.full((1 << 14,), float(i * 1000 + noise))


def drawing_steps(rank: int, world: int, *, share: bool) -> dict:
    """A DataLoader without workers whose dataset draws, and a step that draws too: the
    follower's loop runs ahead, but replays the leader's draws only at each hand-over."""
    torch.manual_seed(7 + rank)
    loader = ShmLoader(
        lambda: DataLoader(Drawing(), batch_size=1, shuffle=True),
        dist.group.WORLD,
        config=Config.from_env(enabled=share),
    )
    drawn, seen = [], []
    for batch in loader:
        seen.append(float(batch[0, 0]))
        time.sleep(0.1)  # the follower's loop has the next batch (and its draws) meanwhile
        drawn.append(torch.rand(2))  # the step's own randomness (dropout)
    loader.close()
    return {"drawn": torch.stack(drawn), "seen": seen, "state": torch.get_rng_state()}


def test_a_loader_without_workers_that_draws_keeps_exact_rng_parity():
    shared = run_ranks(drawing_steps, 2, kwargs={"share": True})
    alone = run_ranks(drawing_steps, 2, kwargs={"share": False})
    assert shared[1]["seen"] == shared[0]["seen"] == alone[0]["seen"]
    for rank in range(2):
        assert torch.equal(shared[rank]["drawn"], alone[rank]["drawn"]), rank
        assert torch.equal(shared[rank]["state"], alone[rank]["state"]), rank


def resume_in_a_window(rank: int, world: int, *, stop: int | None, ckpt: str) -> dict:
    """Two epochs of 6 batches, accumulation over 2, a draw per step; saved at micro-batch
    ``stop`` (7: inside the window that begins the second epoch, whose boundary lies before
    that epoch's ``iter()``); ``stop`` None resumes from ``ckpt`` if a state is there."""
    import os

    torch.manual_seed(200 + rank)
    loader = ShmLoader(
        lambda: DataLoader(Numbered(6), batch_size=1, num_workers=1, shuffle=True),
        dist.group.WORLD,
        accumulation_steps=2,
        config=Config.from_env(enabled=True),
    )
    path = os.path.join(ckpt, f"rank{rank}.pt")
    start = 0
    if stop is None and os.path.exists(path):
        state = torch.load(path, weights_only=False)
        loader.load_state_dict(state)
        start = state["epoch"]
    seen, drawn, micro = [], [], 0
    for epoch in range(start, 2):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(int(batch[0, 0]))
            drawn.append(float(torch.rand(1)))
            micro += 1
            if micro == stop:
                torch.save(loader.state_dict(), path)
                loader.close()
                return {"seen": seen, "drawn": drawn}
    loader.close()
    return {"seen": seen, "drawn": drawn}


def test_a_resume_inside_the_window_that_opens_an_epoch_is_exact(tmp_path):
    # the step boundary of micro-batch 6 lies before the second epoch's iter(), which the
    # leader's loop opens at once: the boundary is captured before those draws
    ckpt = str(tmp_path)
    whole = run_ranks(resume_in_a_window, 2, kwargs={"stop": None, "ckpt": ckpt})
    first = run_ranks(resume_in_a_window, 2, kwargs={"stop": 7, "ckpt": ckpt})
    rest = run_ranks(resume_in_a_window, 2, kwargs={"stop": None, "ckpt": ckpt})
    for rank in range(2):
        # the resume repeats the window's first micro-batch (the boundary is before it)
        assert first[rank]["seen"][:6] + rest[rank]["seen"] == whole[rank]["seen"], rank
        assert first[rank]["drawn"][:6] + rest[rank]["drawn"] == whole[rank]["drawn"], rank


def resident_at_hand_over(rank: int, world: int, *, ahead: bool) -> dict:
    """kB of each handed batch's mapping already in this process's page tables, before
    the user reads a byte of it (1 MiB batches; the loops had 0.2 s to run ahead)."""
    from tests.support.ranks import mapping_kb

    loader = ShmLoader(
        lambda: DataLoader(Big(), batch_size=None, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, ahead=ahead),
    )
    resident = []
    for batch in loader:
        resident.append(mapping_kb(batch.data_ptr())["rss"])
        time.sleep(0.2)
    loader.close()
    return {"resident": resident}


class Big(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 18,), float(i))  # 1 MiB


def test_a_loop_ahead_faults_the_pages_in_before_the_user_reads():
    ahead = run_ranks(resident_at_hand_over, 2, kwargs={"ahead": True})
    step = run_ranks(resident_at_hand_over, 2, kwargs={"ahead": False})
    for rank in range(2):
        # every page of the 1 MiB payload is mapped at the hand-over (MADV_POPULATE_READ);
        # in step, only what decoding touched
        assert all(kb >= 1024 for kb in ahead[rank]["resident"][1:]), (rank, ahead[rank])
        assert all(kb < 512 for kb in step[rank]["resident"][1:]), (rank, step[rank])


class DrawingSampler(torch.utils.data.Sampler):
    """A sampler of the user's own that draws each index from the default generator, lazily,
    in the main process, inside the DataLoader's ``next()``."""

    def __len__(self) -> int:
        return 6

    def __iter__(self):
        for _ in range(6):
            yield int(torch.empty((), dtype=torch.int64).random_()) % 6


def own_sampler_steps(rank: int, world: int, *, share: bool) -> dict:
    torch.manual_seed(5 + rank)
    loader = ShmLoader(
        lambda: DataLoader(Numbered(6), batch_size=1, sampler=DrawingSampler(), num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=share),
    )
    seen, drawn = [], []
    for batch in loader:
        seen.append(int(batch[0, 0]))
        time.sleep(0.05)
        drawn.append(torch.rand(2))
    stats = loader.stats()
    loader.close()
    return {"seen": seen, "drawn": torch.stack(drawn), "ahead": "ahead_ready" in stats}


def test_a_sampler_of_the_users_own_keeps_the_leader_in_step_and_rng_exact():
    shared = run_ranks(own_sampler_steps, 2, kwargs={"share": True})
    alone = run_ranks(own_sampler_steps, 2, kwargs={"share": False})
    assert not shared[0]["ahead"] and shared[1]["ahead"]  # the leader counts its draws
    assert shared[0]["seen"] == shared[1]["seen"] == alone[0]["seen"]
    for rank in range(2):
        assert torch.equal(shared[rank]["drawn"], alone[rank]["drawn"]), rank


class SlowlyBroken(Numbered):
    """Sample 4 fails, 0.3 s after it was asked for."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 4:
            time.sleep(0.3)
        return super().__getitem__(i)


def error_past_the_break(rank: int, world: int) -> dict:
    """Every user breaks after batch 3 of each epoch; the followers at once, the leader a
    second later. Meanwhile the leader's loop, running ahead, fails on sample 4 and tells
    the followers, whose loops were halted already: nobody's user ever reaches it."""
    loader = ShmLoader(
        lambda: DataLoader(SlowlyBroken(12, fail_at=4), batch_size=1, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
    )
    taken = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            taken.append(int(batch[0, 0]))
            if len(taken) % 3 == 0:
                if rank == 0:
                    time.sleep(1.0)  # its loop fails meanwhile, and says so
                break
        del batch
        dist.barrier()
    loader.close()
    return {"taken": taken}


@pytest.mark.parametrize("nodes", NODES.values(), ids=NODES.keys())
def test_an_error_past_where_every_user_left_is_raised_nowhere(nodes):
    out = run_ranks(error_past_the_break, 4 if nodes else 2, nodes=nodes)
    for rank, o in enumerate(out):
        assert o["taken"] == [0, 1, 2, 0, 1, 2], (rank, o)


def two_loaders_in_a_row(rank: int, world: int) -> dict:
    """A loader left after 3 batches and closed, then another on the same group: the first
    node leader's loop may still wait in its receive of the leader's next header."""
    first = _loader(10)
    for k, _ in enumerate(first):
        if k == 2:
            break
    first.close()
    second = _loader(6)
    seen = [int(b[0, 0]) for b in second]
    second.close()
    return {"seen": seen}


def test_a_closed_loaders_receive_never_takes_the_next_loaders_batch():
    out = run_ranks(two_loaders_in_a_row, 4, nodes=[0, 0, 1, 1])
    for rank, o in enumerate(out):
        assert o["seen"] == list(range(6)), (rank, o)


def stateful_saved_after_leaving(rank: int, world: int, *, how: str) -> dict:
    """A StatefulDataLoader with workers (the leader's loop runs ahead): the user takes 3
    batches, lets the loops run ahead, leaves (``break`` or ``close()``) and only then
    saves; a new loader resumed from that state must go on at batch 3."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(Numbered(12), batch_size=1, num_workers=2)

    loader = ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True))
    first = []
    for batch in loader:
        first.append(int(batch[0, 0]))
        if len(first) == 3:
            time.sleep(0.5)  # the loops take the next batches meanwhile
            break
    del batch
    if how == "close":
        loader.close()
    state = loader.state_dict()
    loader.close()
    dist.barrier()
    resumed = ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True))
    resumed.load_state_dict(state)
    rest = [int(b[0, 0]) for b in resumed]
    resumed.close()
    return {"first": first, "rest": rest, "batches": state["batches"]}


@pytest.mark.parametrize("how", ["break", "close"])
def test_a_stateful_loaders_state_saved_after_leaving_is_where_the_user_left(how):
    """A state_dict() taken after the user left an iteration (the loops had run ahead)
    describes the batches the user took: the cursor and the StatefulDataLoader's own
    state, which the leader's loop had advanced past them (NOTE [running ahead])."""
    pytest.importorskip("torchdata")
    out = run_ranks(stateful_saved_after_leaving, 2, kwargs={"how": how})
    for rank, o in enumerate(out):
        assert o["first"] == [0, 1, 2] and o["batches"] == 3, (rank, o)
        assert o["rest"] == list(range(3, 12)), (rank, o)


class _SlowAfter(Dataset):
    """Sample ``i`` is 64 KiB of ``i``; from sample 4 on it takes 2 s while ``slow``."""

    slow = True

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.slow and i >= 4:
            time.sleep(2.0)
        return torch.full((1 << 14,), float(i))


def parked_at_the_break(rank: int, world: int) -> dict:
    """Both ranks leave the first pass after 2 batches, while the leader's workers are slow:
    the node leader's producer then waits for its link's gloo receive of the leader's next
    header. Its second ``iter()`` must not wait for that receive; the second pass is whole."""
    dataset = _SlowAfter()
    loader = ShmLoader(
        lambda: DataLoader(dataset, batch_size=1, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
    )
    first = []
    for batch in loader:
        first.append(int(batch[0, 0]))
        if len(first) == 2:
            break
    time.sleep(0.5)  # the node leader's producer took what was sent and waits for more
    dataset.slow = False  # the next pass's workers (forked at iter()) are quick
    t0 = time.monotonic()
    it = iter(loader)
    settled_s = time.monotonic() - t0
    second = [int(batch[0, 0]) for batch in it]
    loader.close()
    return {"role": loader.role, "first": first, "second": second, "iter_s": settled_s}


def test_a_node_leaders_iter_does_not_wait_for_its_parked_gloo_receive():
    """NOTE [running ahead]: ``settle`` does not wait for a gloo receive: the link makes it,
    the producer leaves its wait at the next check (NOTE [the link owns gloo]), and the
    next iteration takes the header once it came (here after the leader's 2 s sample)."""
    out = run_ranks(parked_at_the_break, 2, nodes=[0, 1], timeout=60)
    assert [o["role"] for o in out] == ["leader", "node leader"], out
    for o in out:
        assert o["first"] == [0, 1] and o["second"] == list(range(8)), out
    assert out[1]["iter_s"] < 1.0, out[1]  # not the leader's 2 s


def leader_closes_first(rank: int, world: int) -> dict:
    """The leader leaves after 3 batches and closes; the node leader's producer takes its
    closing STOP, and the node leader closes in turn: nothing is left to drain."""
    loader = _loader(12)
    seen: list[int] = []
    outcome = "finished"
    try:
        for batch in loader:
            seen.append(int(batch[0, 0]))
            if rank == 0 and len(seen) == 3:
                break
    except Exception as exc:  # the test looks at what each rank saw
        outcome = type(exc).__name__
    loader.close()
    time.sleep(1.0)
    # a drain for a STOP that never comes would keep the link in a gloo receive
    draining = [t.name for t in threading.enumerate() if t.name == "shmloader-link"]
    dist.barrier()  # the leader lives until every rank looked
    return {"role": loader.role, "seen": seen, "outcome": outcome, "draining": draining}


def test_a_node_leader_that_took_the_closing_stop_drains_nothing():
    """NOTE [closing across nodes] (xnode): a node leader's close() drains the leader's
    sends up to its closing STOP; once its loop took that STOP there is nothing left, and a
    drain would wait on a gloo receive for a message that never comes."""
    out = run_ranks(leader_closes_first, 2, nodes=[0, 1], timeout=60)
    assert out[0]["seen"] == [0, 1, 2], out
    assert out[1]["outcome"] in ("LeaderStoppedError", "PeerLostError"), out
    assert out[1]["draining"] == [], out

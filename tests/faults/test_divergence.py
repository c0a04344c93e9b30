"""Threads, ranks that iterate differently, and the leader's last word.

- A follower iterated from a background prefetch thread while the main thread
  drops the batches (NOTE [one owner] in ``base``).
- Ranks whose loops differ: a typed error naming both positions, never a
  silent short epoch; a follower that leaves an epoch early neither deadlocks
  nor loses the next epoch (NOTE [iteration numbers]).
- A leader that fails and exits at once: its error still reaches every rank.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader
from tests.faults.scenarios import outcome
from tests.support.harness import capture_warnings, run_ranks

pytestmark = pytest.mark.timeout(120)

N = 8


def _numbered(n: int = N, size: int = 50_000):
    """Batches with one large leaf (a view of the slot) and the batch number."""
    return lambda: [{"x": torch.full((size,), i), "i": i} for i in range(n)]


# ------------------------------------------------------------------ rank code


def _consume(q: queue.Queue, thread: threading.Thread, got: list[int], hold_s: float = 0.0) -> None:
    """Take what a prefetch ``thread`` queues until its ``None``; drop each batch on this thread.

    ``hold_s``: keep each batch that long first (the thread waits for the next meanwhile).
    An exception the thread queued is raised here.
    """
    while (batch := q.get(timeout=60)) is not None:
        if isinstance(batch, BaseException):
            thread.join()
            raise batch
        got.append(int(batch["x"][0]))
        time.sleep(hold_s)
        del batch  # the release runs on this thread, not the socket's owner: only queued
    thread.join()


def prefetched(rank: int, world: int) -> dict:
    """A thread pulls batches into a queue; the main thread consumes and drops them."""
    loader = ShmLoader(
        _numbered(24),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, small_copy_bytes=0),
    )
    got: list[int] = []
    for _epoch in range(2):
        q: queue.Queue = queue.Queue(maxsize=2)

        def pull(q: queue.Queue = q) -> None:
            try:
                for batch in loader:
                    q.put(batch)
                q.put(None)
            except BaseException as exc:  # handed to the main thread
                q.put(exc)

        thread = threading.Thread(target=pull)
        thread.start()
        _consume(q, thread, got)
    stats = loader.stats()
    loader.close()
    return {"got": got, "slots": stats.get("ring_slots")}


def _slow(n: int, size: int = 50_000, pause: float = 1.0):
    """Like ``_numbered`` (views, not copies), but each batch after the first takes ``pause``."""

    def batches():
        for i in range(n):
            if i:
                time.sleep(pause)  # the follower's thread is blocked waiting meanwhile
            yield {"x": torch.full((size,), i), "i": i}

    return batches


def dropped_while_waiting(rank: int, world: int) -> dict:
    """The follower's thread waits for the next batch while the main thread drops
    the one before: its RELEASE must leave during that wait (NOTE [prompt release]
    in ``follower``), or the leader, when it writes the next batch, finds
    the slot still held."""
    loader = ShmLoader(_slow(4), dist.group.WORLD, config=Config.from_env(enabled=True, slots=2))
    got: list[int] = []
    if rank == 0:
        it = iter(loader)
        for _ in range(4):
            batch = next(it)  # the leader drops its own view before asking for the next
            got.append(int(batch["x"][0]))
            del batch
        assert next(it, None) is None
    else:
        q: queue.Queue = queue.Queue()

        def pull() -> None:
            it = iter(loader)  # no loop variable: this thread keeps no batch while waiting
            try:
                while True:
                    q.put(next(it))
            except StopIteration:
                q.put(None)
            except BaseException as exc:  # handed to the main thread
                q.put(exc)

        thread = threading.Thread(target=pull)
        thread.start()
        _consume(q, thread, got, hold_s=0.3)  # by then the thread is blocked in its wait
    stats = loader.stats()
    loader.close()
    return {"got": got, "slots": stats.get("ring_slots")}


#: The timeout of ``one_rank_breaks``: what a leader deadlocked on the leftovers'
#: ACKs would wait; an epoch pair that ends within a fraction of it did not.
BREAK_TIMEOUT_S = 80.0


def one_rank_breaks(rank: int, world: int, *, breaker: int, at: int) -> dict:
    """Rank ``breaker`` leaves epoch 0 after ``at`` batches; then every rank runs epoch 1."""
    warnings = capture_warnings()
    loader = ShmLoader(
        _numbered(), dist.group.WORLD, config=Config.from_env(enabled=True, timeout=BREAK_TIMEOUT_S)
    )
    epochs: list[list[int]] = []

    def run() -> None:
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([])
            for batch in loader:
                epochs[-1].append(batch["i"])
                if rank == breaker and epoch == 0 and len(epochs[-1]) == at:
                    break

    out = outcome(run)
    out["epochs"] = epochs
    out["warnings"] = warnings.messages
    loader.close()
    return out


def leader_exits_on_error(rank: int, world: int) -> dict:
    """The leader's loader yields a file handle; the leader exits the moment it raises."""

    def make():
        return [{"x": torch.zeros(4)}, {"x": torch.zeros(4), "log": open(os.devnull)}]

    loader = ShmLoader(make, dist.group.WORLD, config=Config.from_env(enabled=True))
    out = outcome(lambda: [int(b["x"].sum()) for b in loader])
    if rank == 0:
        # Exit at once: no close(), no atexit, no finalizers, no ZeroMQ linger; only
        # what Writer.fail made sure of. (Files are removed by hand, not by the loader.)
        writer = loader._role.writer
        writer.ring.close()
        os.unlink(writer.hub.path)
        os.rmdir(os.path.dirname(writer.hub.path))  # its private runtime directory
        os._exit(3)
    loader.close()
    return out


# ------------------------------------------------------------------ tests


def test_a_prefetch_thread_iterates_while_the_main_thread_drops_batches():
    out = run_ranks(prefetched, 3)
    for o in out:
        assert o["got"] == list(range(24)) * 2, o
    # releases from the main thread reach the writer: the ring stays near its depth
    # (+ 2: the SLOTS the followers' loops hold ahead of their users, NOTE [running ahead])
    assert out[0]["slots"] <= 6 + 2, out[0]


def test_releases_queued_by_other_threads_leave_during_the_wait():
    """The leader writes batch k+1 into batch k's slot only if the follower's
    RELEASE, queued by the main thread while the iterating thread waits, was
    sent during that wait; otherwise it arrives only with the thread's next
    call, after batch k+1, and the ring grows (a fixed pool of slots, such as
    the DataLoader workers', would wait for it until the timeout instead)."""
    out = run_ranks(dropped_while_waiting, 2)
    for o in out:
        assert o["got"] == [0, 1, 2, 3], o
    assert out[0]["slots"] == 1, out[0]


def test_the_leader_breaking_alone_is_a_divergence_error_naming_both_positions():
    out = run_ranks(one_rank_breaks, 3, kwargs={"breaker": 0, "at": 3}, expect_failure=True)
    assert out[0]["ok"] and out[0]["epochs"] == [[0, 1, 2], list(range(N))], out[0]
    for o in out[1:]:
        assert o["type"] == "DivergenceError", o
        assert o["epochs"] == [[0, 1, 2]], "no silent short epoch: the loop raised"
        msg = o["message"]
        assert "iteration 1 after 3 batches" in msg and "iteration 2" in msg, msg
        assert "epoch 0, batch 3" in msg and "epoch 1, batch 0" in msg, msg


@pytest.mark.parametrize("at", [3, N - 1], ids=["mid-epoch", "one-batch-early"])
def test_a_follower_that_leaves_early_neither_deadlocks_nor_loses_the_next_epoch(at):
    """Its leftovers are released inside the receive path (the leader waits for their
    ACKs: slots=2 < the batches left), and epoch 1 arrives whole, from its first batch."""
    out = run_ranks(one_rank_breaks, 3, kwargs={"breaker": 1, "at": at}, timeout=110)
    for rank, o in enumerate(out):
        assert o["ok"], o
        # no deadlock: well within the 80 s timeout a leader waiting for the ACKs would hit
        assert o["seconds"] < BREAK_TIMEOUT_S / 4, f"rank {rank} waited {o['seconds']:.1f} s"
        first = list(range(at)) if rank == 1 else list(range(N))
        assert o["epochs"] == [first, list(range(N))], (rank, o["epochs"])
    assert any(f"left iteration 1 (epoch 0) after {at} batches" in m for m in out[1]["warnings"]), (
        out[1]["warnings"]
    )


def test_the_leaders_error_reaches_followers_although_it_exits_at_once():
    for _ in range(3):
        out = run_ranks(leader_exits_on_error, 3, expect_failure=True)
        assert out[0] is None or isinstance(out[0], str)  # exited without a result
        for o in out[1:]:
            assert o["type"] == "LeaderError", o
            assert o["attrs"]["original_type"] == "UnsupportedBatchError", o
            assert "batch['log']" in o["message"]

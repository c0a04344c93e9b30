"""Release words: a pool slot every holder dropped is free without the leader's main process.

NOTE [release words] in ``shmloader/_node/release.py``. The single-process tests
drive a ``WorkerPool`` (the leader's main process), a ``WorkerSlots`` (a
DataLoader worker) and ``RingReader`` s (followers) in one process; one
multi-rank run checks that a lockstep job cycles through two slots.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader._node import segment
from shmloader._node.release import ReaderWords
from shmloader._node.ring import GRANULE, RingReader, RingWriter, SlotState, new_token
from shmloader._node.views import private_view
from shmloader._workers.control import PoolState
from shmloader._workers.partition import WorkerSlots
from shmloader._workers.pool import SlotRef, WorkerPool
from shmloader.errors import ProtocolError
from tests.support.harness import run_ranks

NBYTES = 4096  # fits a fresh pool slot: no growth in the single-process tests
#: The pool timeout (and, where a test sets it, the grow grace) of these tests:
#: far beyond a liveness check (``OWNER_CHECK_S``, 0.2 s) or a release the test
#: makes, so that a claim that ends within a fraction of it was ended by what
#: the test is about, on any machine, and a claim that waits for it fails.
LONG_TIMEOUT_S = 60.0


class Node:
    """A writer (rank 0) with readers 1 and 2, a one-worker pool and the worker's side."""

    def __init__(self, peers: dict | None = None) -> None:
        self.ring = RingWriter(new_token(), frozenset({1, 2}), {}, self_rank=0)
        self.pool = WorkerPool(
            self.ring,
            num_workers=1,
            prefetch_factor=1,
            ring_slots=2,
            timeout=LONG_TIMEOUT_S,
            allow_pickle=False,
            peers=peers,
        )
        self.worker = WorkerSlots(self.pool.spec, 0)
        self.readers = {r: RingReader(self.ring.token, r) for r in (1, 2)}
        self.seq = 0

    def only(self, i: int) -> None:
        """Let the worker claim slot ``i`` alone (the others look busy)."""
        for k in self.worker.partition:
            if k != i:
                self.worker._record(k).state = PoolState.WRITING

    def publish(self) -> tuple[int, int, dict]:
        """The worker fills a slot, the main process accepts and publishes it; every
        holder maps it. Returns (slot, ticket, {holder: view})."""
        i, ticket = self.worker._try_claim(NBYTES)
        dest, gen = self.worker.payload(i, NBYTES)
        dest[:NBYTES] = self.seq % 251
        self.worker.filled(i, 0)
        ref = SlotRef(self.ring.token, i, gen, ticket, NBYTES, b"", os.getpid())
        slot = self.pool.accept(ref)
        self.ring.hold_for_readers(slot, self.seq, NBYTES, 0)
        self.seq += 1
        views = {0: private_view(slot.segment, NBYTES, lambda: None, self.pool.own_release(slot))}
        fields = self.pool.announce_fields(slot)
        for rank, reader in self.readers.items():
            reader.open(slot.segment.name)
            words = (fields["rel"], i, fields["tk"])
            views[rank] = reader.view(slot.segment.name, NBYTES, lambda: None, words)
        return i, ticket, views

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        del self.worker
        self.ring.close()
        self.pool.close()


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def test_a_worker_reclaims_a_slot_every_holder_released_while_the_main_process_does_nothing(node):
    i, ticket, views = node.publish()
    node.only(i)
    for holder in (1, 0, 2):
        assert node.worker._try_claim(NBYTES) is None, f"claimed while holder {holder} maps it"
        del views[holder]
    assert node.pool.state(i) == "PUBLISHED", "the main process synced: not what is tested"
    assert node.ring.slots[i].state == SlotState.HELD  # no RELEASE was handled either
    assert node.worker._try_claim(NBYTES) == (i, ticket + 1)


def test_the_main_process_accepts_a_reclaimed_slot_and_ignores_the_late_releases(node):
    i, ticket, views = node.publish()
    first_seq = node.ring.slots[i].seq
    views.clear()
    node.only(i)
    # the worker takes it again; the main process never handled a RELEASE of the first batch
    assert node.worker._try_claim(NBYTES) == (i, ticket + 1)
    _dest, gen = node.worker.payload(i, NBYTES)
    node.worker.filled(i, 0)
    slot = node.pool.accept(SlotRef(node.ring.token, i, gen, ticket + 1, NBYTES, b"", os.getpid()))
    node.ring.hold_for_readers(slot, node.seq, NBYTES, 0)
    # the first batch's RELEASEs arrive now: they must not count for the second
    for rank in (0, 1, 2):
        node.ring.release(rank, i, gen, first_seq)
    assert node.ring.slots[i].holders == {0, 1, 2}
    node.pool.sync()
    assert node.pool.state(i) == "PUBLISHED", "a stale RELEASE freed a slot ranks still hold"


def test_sync_frees_by_the_words_alone_and_the_ring_follows(node):
    i, _ticket, views = node.publish()
    del views[1]
    node.pool.sync()
    assert node.ring.slots[i].holders == {0, 2}, "the ring's holders must follow the words"
    assert node.pool.state(i) == "PUBLISHED"
    views.clear()
    node.pool.sync()
    assert node.pool.state(i) == "EMPTY"
    assert node.ring.slots[i].state == SlotState.FREE


def test_a_word_for_another_ticket_or_from_a_non_reader_changes_nothing(node):
    i, ticket, views = node.publish()
    node.only(i)
    area = node.pool.release
    for forged in (ticket - 1, ticket + 1, 2**63):
        for j in (0, 1, 2):
            area.release(i, j, forged)
        assert node.worker._try_claim(NBYTES) is None, f"ticket {forged} freed ticket {ticket}"
    # a process that is not a reader of this node gets no column at all
    with pytest.raises(ProtocolError, match="no release word for rank 7"):
        ReaderWords(node.pool.control.name, node.ring.token, 7)
    views.clear()  # the real holders release the real ticket
    assert node.worker._try_claim(NBYTES) == (i, ticket + 1)


def test_only_the_holders_of_the_batch_count(node):
    i, ticket, views = node.publish()
    node.only(i)
    del views[0], views[1]
    assert node.worker._try_claim(NBYTES) is None
    node.pool.release.hold(i, {0, 1})  # as if reader 2 had not been a holder of this batch
    assert node.worker._try_claim(NBYTES) == (i, ticket + 1)


def test_a_dead_reader_does_not_keep_its_slot():
    dead = subprocess.Popen(["true"])
    dead.wait()
    peers = {1: (dead.pid, 1, segment.MY_PIDNS), 2: (os.getpid(), 0, 0)}
    n = Node(peers=peers)
    try:
        i, ticket, views = n.publish()
        n.only(i)
        del views[0], views[2]  # reader 1 "died" holding it: it never releases
        assert n.worker._try_claim(NBYTES) is None
        t0 = time.monotonic()
        assert n.worker.claim(NBYTES) == (i, ticket + 1), "the wait must check liveness"
        # found by a liveness check (every 0.2 s), well before the 60 s pool timeout
        assert time.monotonic() - t0 < LONG_TIMEOUT_S / 4
        del views
    finally:
        n.close()


def test_a_dropped_reader_is_gone_for_every_claimer(node):
    i, ticket, views = node.publish()
    node.only(i)
    del views[0], views[1]
    assert node.worker._try_claim(NBYTES) is None
    node.ring.drop_reader(2)  # BYE (after owning its views) or lost: the main process drops it
    assert node.worker._try_claim(NBYTES) == (i, ticket + 1)


def test_the_word_is_stored_only_after_the_pages_are_unmapped():
    ring = RingWriter(new_token(), frozenset(), {}, self_rank=0)
    try:
        slot = ring.add_pooled(
            segment.Segment.create_unique(
                f"/shml-{ring.token}-0.0", segment.KIND_DATA, ring.token, GRANULE
            )
        )
        seen = []
        view = private_view(slot.segment, NBYTES, lambda: None, lambda: seen.append(_mapped(addr)))
        addr = view.__array_interface__["data"][0]
        tensor = torch.from_numpy(view[:16])  # a tensor keeps the mapping too
        del view
        assert not seen
        assert _mapped(addr)
        del tensor
        assert seen == [False], "the word was stored while the private mapping still existed"
    finally:
        ring.close()


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_no_word_is_stored_at_interpreter_exit_while_a_view_lives(tmp_path):
    flag = tmp_path / "stored"
    script = textwrap.dedent(f"""
        from shmloader._node import segment
        from shmloader._node.ring import RingWriter, new_token
        from shmloader._node.views import private_view
        ring = RingWriter(new_token(), frozenset(), {{}}, self_rank=0)
        slot = ring.add_pooled(
            segment.Segment.create_unique(f"/shml-{{ring.token}}-0.0", 2, ring.token, 65536))
        kept = private_view(slot.segment, 4096, lambda: None, lambda: open({str(flag)!r}, "w"))
        import atexit
        atexit.register(ring.close)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=os.environ.copy())
    assert not flag.exists(), "a release word was stored at exit, with the mapping still there"


def test_a_worker_waits_for_a_slot_about_to_be_released_rather_than_grow(node, monkeypatch):
    import shmloader._workers.partition as partition

    # a grace no busy machine outlasts: the release below comes within it
    monkeypatch.setattr(partition, "GROW_GRACE_S", LONG_TIMEOUT_S)
    i, ticket, views = node.publish()  # slot i: the batch ranks hold
    fits = NBYTES  # slot i fits; make every other one too small, and EMPTY
    for k in node.worker.partition:
        if k != i:
            node.worker._record(k).capacity = 0
    node.worker.last_filled = -1  # the worker wrote a newer batch since
    assert node.worker._try_claim(fits, patient=True) is None, "grew instead of waiting"
    threading.Timer(0.05, views.clear).start()
    assert node.worker.claim(fits) == (i, ticket + 1)
    # the batch a worker wrote last is not about to be released: grow at once
    node.worker.filled(i, 0)
    node.worker._record(i).state = PoolState.PUBLISHED  # accepted, and held by every rank again
    node.pool.release.hold(i, {0, 1, 2})
    other = node.worker._try_claim(fits, patient=True)
    assert other is not None and other[0] != i, "waited for the batch ranks are about to take"


class Blocks(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 16,), float(i))  # 256 KiB: every slot used is grown


def two_slots(rank: int, world: int) -> dict:
    from shmloader import Config, ShmLoader
    from tests.faults.scenarios import outcome

    group = torch.distributed.new_group(list(range(world)), backend="gloo")

    def run() -> dict:
        loader = ShmLoader(
            lambda: DataLoader(Blocks(), batch_size=None, num_workers=1, prefetch_factor=1),
            group,
            # the main process makes no call while the worker writes: no loop runs ahead
            # (NOTE [running ahead]), whose thread would take batches meanwhile
            config=Config.from_env(enabled=True, ahead=False),
        )
        try:
            sums, filled_while_blocked = [], None
            for step, batch in enumerate(loader):
                sums.append(float(batch.sum()))
                if rank == 0 and step == 3:
                    # The main process makes no next() call now: the worker's next batch
                    # can only go into the slot ranks just dropped (known from the words).
                    del batch
                    pool = loader._role.pool
                    began = time.monotonic()
                    while time.monotonic() - began < LONG_TIMEOUT_S / 2:
                        states = [pool.state(i) for i in range(pool.spec.total)]
                        if "FILLED" in states:
                            filled_while_blocked = time.monotonic() - began
                            break
                        time.sleep(0.005)
            grown = None
            if rank == 0:
                grown = sum(s.capacity > GRANULE for s in loader._role.pool.ring.slots if s.pooled)
            return {"sums": sums, "grown": grown, "filled_after_s": filled_while_blocked}
        finally:
            loader.close()

    return outcome(run)


@pytest.mark.timeout(120)
def test_a_lockstep_job_cycles_through_two_slots():
    out = run_ranks(two_slots, 2, timeout=100)
    for rank in range(2):
        assert out[rank]["ok"], out[rank]
        assert out[rank]["value"]["sums"] == [float(i << 16) for i in range(8)]
    lead = out[0]["value"]
    # The worker wrote while the leader's main process made no call (30 s at most):
    # not freed by a sync of the main process, which never came ...
    assert lead["filled_after_s"] is not None, "the worker wrote nothing while the leader waited"
    # ... and released by the words, not taken by growing a third slot after the grow
    # grace (GROW_GRACE_S): which slot it took, not when, so that no clock is involved
    assert lead["grown"] == 2, lead


def test_after_a_wait_ran_out_a_worker_grows_at_once_until_ranks_release_again(node, monkeypatch):
    import shmloader._workers.partition as partition

    i, ticket, views = node.publish()
    for k in node.worker.partition:
        if k != i:
            node.worker._record(k).capacity = 0
    node.worker.last_filled = -1
    monkeypatch.setattr(partition, "GROW_GRACE_S", 0.05)
    first = node.worker.claim(NBYTES)  # ranks keep slot i past the grace: grows another
    assert first[0] != i and not node.worker.patient
    monkeypatch.setattr(partition, "GROW_GRACE_S", LONG_TIMEOUT_S)
    t0 = time.monotonic()
    second = node.worker.claim(NBYTES)
    assert second[0] not in (i, first[0])
    # a claim that waited again would take the whole 60 s grace (and meet the timeout)
    waited = time.monotonic() - t0
    assert waited < LONG_TIMEOUT_S / 4, f"waited again ({waited:.1f} s) for ranks keeping batches"
    views.clear()
    assert node.worker.claim(NBYTES) == (i, ticket + 1)
    assert node.worker.patient, "a slot released again: waiting pays off again"


def test_a_malformed_announcement_means_releases_by_message_only():
    from shmloader._node.release import announced_words

    good = {"rel": "/shml-x-pool.1", "slot": 3, "tk": 9}
    assert announced_words(good) == ("/shml-x-pool.1", 3, 9)
    for bad in ({"slot": 3, "tk": 9}, {**good, "tk": "9"}, {**good, "tk": 0}, {**good, "slot": -1}):
        assert announced_words(bad) is None, bad

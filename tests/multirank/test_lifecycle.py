"""Kept leaves, set-up bounds, sharing off as plain torch, and
behaviours no test pinned before (empty epochs, finished-epoch cursors, node
identity by probe, a daemon job with one live pid)."""

from __future__ import annotations

import datetime
import fractions
import logging
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shmloader import Config, ShmLoader
from shmloader._proto import codec
from shmloader.errors import ShmLoaderError, UnsupportedBatchError
from tests.faults.scenarios import outcome
from tests.support import ranks
from tests.support.harness import capture_warnings, run_ranks

pytestmark = pytest.mark.timeout(120)


def _labelled(n: int = 20):
    """A 256 KiB leaf (shared) and 128 bytes of labels (an owned copy) per batch."""
    return lambda: [{"big": torch.zeros(1 << 16), "labels": torch.arange(16) + i} for i in range(n)]


# ------------------------------------------------------------------ rank code


def keep_small_then_whole(rank: int, world: int) -> dict:
    """Every rank keeps the labels of every batch; then rank 1 keeps 6 whole batches."""
    warnings = capture_warnings()
    loader = ShmLoader(_labelled(), dist.group.WORLD, config=Config.from_env(enabled=True))
    kept = [batch["labels"] for batch in loader]
    small = {"slots": loader.stats().get("ring_slots"), "labels": [int(t[0]) for t in kept]}
    loader.close()
    loader = ShmLoader(_labelled(8), dist.group.WORLD, config=Config.from_env(enabled=True))
    whole = []
    for batch in loader:
        if rank == 1:
            whole.append(batch)
        dist.barrier()  # lockstep: the leader cannot reuse what rank 1 keeps
    whole.clear()
    loader.close()
    return {"small": small, "warnings": warnings.messages}


def sliding_window(rank: int, world: int, ahead: bool = True) -> dict:
    """Rank 1 holds its last 3 whole batches, as a prefetch queue does, and is slow."""
    import collections

    warnings = capture_warnings()
    cfg = Config.from_env(enabled=True, slots=2, ahead=ahead)
    loader = ShmLoader(_labelled(24), dist.group.WORLD, config=cfg)
    window: collections.deque = collections.deque(maxlen=3)
    for batch in loader:
        window.append(batch)
        if rank == 1:
            time.sleep(0.03)  # the leader runs its whole window ahead of us
    slots = loader.stats().get("ring_slots")
    window.clear()
    loader.close()
    return {"slots": slots, "warnings": warnings.messages}


def resolved_timeouts(rank: int, world: int) -> dict:
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=123))
    out = {}
    for name, g, cfg in [
        ("group", group, Config.from_env(enabled=True)),
        ("world", dist.group.WORLD, Config.from_env(enabled=True)),
        ("set", group, Config.from_env(enabled=True, timeout=7.0)),
    ]:
        loader = ShmLoader(lambda: [1], g, config=cfg)
        out[name] = loader.config.timeout
        loader.close()
    return out


def absent_rank(rank: int, world: int) -> dict:
    import datetime

    store = dist.distributed_c10d._get_default_store()
    guard = datetime.timedelta(seconds=60)
    if rank == 2:  # never constructs its loader; lives until both others named it
        store.wait(["named0", "named1"], guard)
        return {"ok": True}
    out = outcome(
        lambda: ShmLoader(
            lambda: [1], dist.group.WORLD, config=Config.from_env(enabled=True, timeout=2.0)
        )
    )
    # Stay until the other rank has named rank 2 as well: a rank that exits first
    # would be the peer that rank sees lost (a race of the two timeouts).
    store.set(f"named{rank}", "1")
    store.wait([f"named{1 - rank}"], guard)
    return out


def pickled_leaves(rank: int, world: int) -> dict:
    loader = ShmLoader(
        lambda: [{"f": fractions.Fraction(i, 3), "x": torch.ones(2)} for i in range(3)],
        dist.group.WORLD,
        config=Config.from_env(enabled=True, allow_pickle=True),
    )
    out = outcome(lambda: [b["f"] for b in loader])
    loader.close()
    return out


def after_close(rank: int, world: int) -> dict:
    out = {}
    for share in (False, True):
        loader = ShmLoader(
            ranks.make_loader_factory(0, n=8),
            dist.group.WORLD,
            config=Config.from_env(enabled=share),
        )
        it = iter(loader)
        next(it)
        dist.barrier()
        loader.close()
        out[share] = {
            "next": outcome(lambda it=it: next(it)),
            "len": outcome(lambda loader=loader: len(loader)),
            "iter": outcome(lambda loader=loader: iter(loader)),
        }
    return out


def empty_epochs_and_cursors(rank: int, world: int) -> dict:
    """RNG after empty epochs, and the cursor after a finished epoch (k=2), both modes."""
    out = {}
    for share in (False, True):
        torch.manual_seed(100 + rank)
        empty = ShmLoader(
            lambda: DataLoader([], batch_size=2),  # iter() still draws a base seed
            dist.group.WORLD,
            config=Config.from_env(enabled=share),
        )
        got = [b for epoch in range(2) for b in empty]
        empty.close()
        state_after_empty = torch.get_rng_state()
        loader = ShmLoader(
            ranks.make_loader_factory(0, n=10),
            dist.group.WORLD,
            accumulation_steps=2,
            config=Config.from_env(enabled=share),
        )
        n = sum(1 for _ in loader)  # 5 batches: the last optimizer step is partial
        finished = loader.state_dict()
        loader.close()
        # a resume at the epoch's end is an empty iteration too
        resumed = ShmLoader(
            ranks.make_loader_factory(0, n=10),
            dist.group.WORLD,
            accumulation_steps=2,
            config=Config.from_env(enabled=share),
        )
        resumed.load_state_dict(finished)
        rest = sum(1 for _ in resumed)
        resumed.close()
        out[share] = {
            "got": got,
            "rng_empty": state_after_empty,
            "rng_end": torch.get_rng_state(),
            "n": n,
            "cursor": finished["batches"],
            "rest": rest,
        }
    return out


def same_claim_two_nodes(rank: int, world: int) -> dict:
    import shmloader._topology as topology

    # Equal claims on both simulated nodes (as two hosts with one boot id and one
    # SHMLOADER_NODE, or a claim collision): only the probe can tell them apart.
    topology.node_claim = lambda override: "one-claim-for-all"
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=8), dist.group.WORLD, config=Config.from_env(enabled=True)
    )
    batches = [ranks.to_plain(b)["meta"].sample_ids for b in loader]
    topo = loader.topology
    out = {"nodes": [list(n) for n in topo.nodes], "role": loader.role, "batches": batches}
    loader.close()
    return out


# ------------------------------------------------------------------ tests


def test_kept_small_leaves_keep_nothing_and_kept_batches_are_named_in_a_warning():
    out = run_ranks(keep_small_then_whole, 2)
    for o in out:
        assert o["small"]["labels"] == list(range(20)), o["small"]
    # every rank kept 20 labels, yet the ring stayed near its depth (slots + 1 = 3; one
    # more when the leader publishes before a follower's RELEASE of the batch it just
    # rebound arrives: the comprehension drops it only after receiving the next one),
    # and the follower's loop holds up to SLOTS (2) more it took ahead of its user
    # (NOTE [running ahead] in shmloader._roles.producer). Kept views would have grown it to 20.
    assert out[0]["small"]["slots"] <= 4 + 2, out[0]["small"]
    # then rank 1 keeps whole batches: the warning names what it holds, and the fix
    warned = [m for m in out[0]["warnings"] if "past its depth" in m]
    assert any("batch 0 by rank(s) [1]" in m and "SHMLOADER_SLOTS" in m for m in warned), warned


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in-step"])
def test_a_prefetch_window_within_the_slots_is_not_called_kept(ahead):
    """NOTE [ring growth] in ``node_writer``: batches a rank took and still holds for a
    while (a prefetch queue) make the ring hold SLOTS plus the window, but are
    not kept batches: no warning while the window is within the depth."""
    out = run_ranks(sliding_window, 2, kwargs={"ahead": ahead})
    assert not [m for m in out[0]["warnings"] if "past its depth" in m], out[0]["warnings"]
    # bounded: the window of 2 ahead, 3 held and one being released, and with the loops
    # ahead the 2 that the follower's loop took ahead of its user (NOTE [running ahead])
    assert out[0]["slots"] <= 2 + 3 + 1 + (2 if ahead else 0), out[0]


def test_the_timeout_follows_the_process_group_unless_set():
    out = run_ranks(resolved_timeouts, 2)
    for o in out:
        assert o == {"group": 123.0, "world": 60.0, "set": 7.0}, o  # harness: world 60 s


def test_a_rank_that_never_constructs_is_named_within_the_timeout():
    out = run_ranks(absent_rank, 3)
    for o in out[:2]:
        assert o["type"] == "PeerLostError", o
        assert "rank 2" in o["message"] and "not constructed" in o["message"], o
        # its 2 s timeout, not the process group's 60 s (harness) it would otherwise follow
        assert 1.5 < o["seconds"] < 15, o


def test_allow_pickle_with_sharing_on_reaches_every_rank():
    out = run_ranks(pickled_leaves, 2)
    for o in out:
        assert o["ok"] and o["value"] == [fractions.Fraction(i, 3) for i in range(3)], o


def test_next_len_and_iter_after_close_fail_the_same_way_in_both_modes():
    out = run_ranks(after_close, 2)
    for o in out:
        for share in (False, True):
            for call in ("next", "len", "iter"):
                got = o[share][call]
                assert got["type"] == "ShmLoaderError" and "closed" in got["message"], (
                    share,
                    call,
                    got,
                )


def test_empty_epochs_keep_rng_and_a_finished_epoch_counts_every_batch():
    out = run_ranks(empty_epochs_and_cursors, 2)
    for rank, o in enumerate(out):
        alone, shared = o[False], o[True]
        assert shared["got"] == alone["got"] == []
        assert torch.equal(shared["rng_empty"], alone["rng_empty"]), f"rank {rank}: empty epoch"
        assert shared["n"] == alone["n"] == 5
        assert shared["cursor"] == alone["cursor"] == 5, "a resume would replay the last batch"
        assert shared["rest"] == alone["rest"] == 0
        assert torch.equal(shared["rng_end"], alone["rng_end"]), f"rank {rank}: resumed at end"


def test_node_identity_follows_the_probe_when_claims_are_equal():
    """Two simulated nodes claim the same identity: only the probe can tell them apart."""
    out = run_ranks(same_claim_two_nodes, 4, nodes=[0, 0, 1, 1])
    for o in out:
        assert o["nodes"] == [[0, 1], [2, 3]], o["nodes"]
        assert o["batches"] == out[0]["batches"]
    assert [o["role"] for o in out] == ["leader", "follower", "node leader", "follower"]


def test_sharing_off_delivers_what_plain_torch_does_and_names_what_sharing_would_refuse(caplog):
    """NOTE [sharing off is plain torch]: a Path, a file handle, a tensor that
    requires grad are delivered as they are (the same objects), with one
    warning carrying the error sharing on would raise; sharing on refuses."""
    grad = torch.ones(2, requires_grad=True)
    with open(os.devnull) as handle:
        batches = [
            {"path": pathlib.Path("/data/shard-0.bin"), "x": torch.ones(2)},
            {"f": handle, "grad": grad},
            {"path": pathlib.PurePosixPath("a/b")},
        ]
        with caplog.at_level(logging.WARNING, logger="shmloader"):
            loader = ShmLoader(lambda: batches, None, config=Config(enabled=False))
            got = list(loader)
    assert [b is orig for b, orig in zip(got, batches, strict=True)] == [True] * 3
    assert got[1]["grad"] is grad and got[0]["path"] == pathlib.Path("/data/shard-0.bin")
    told = [r.getMessage() for r in caplog.records if "sharing is off" in r.getMessage()]
    assert len(told) == 1 and "batch['path']" in told[0] and "PosixPath" in told[0], told
    with pytest.raises(UnsupportedBatchError, match=r"batch\['path'\]"):
        codec.encode(batches[0])  # what sharing on runs on the leader, before any write
    loader.close()
    with pytest.raises(ShmLoaderError, match="closed"):
        len(loader)


def test_the_requires_grad_refusal_gives_one_consistent_fix():
    with pytest.raises(UnsupportedBatchError) as info:
        codec.encode({"x": torch.ones(2, requires_grad=True)})
    text = str(info.value)
    assert "batch['x']" in text and "detach()" in text and "requires_grad_()" in text, text
    # no advice that cannot work for a tensor: converting it to a tensor, or pickling it
    assert "to a tensor or a str" not in text
    assert "does not change this" in text and "opt in to pickling" not in text


def test_a_direct_config_that_switches_sharing_off_under_shmloader_warns(monkeypatch, caplog):
    monkeypatch.setenv("SHMLOADER", "1")
    with caplog.at_level(logging.WARNING, logger="shmloader"):
        ShmLoader(lambda: [1], None, config=Config(allow_pickle=True)).close()
    assert any("Config.from_env" in r.getMessage() for r in caplog.records), caplog.records


# ------------------------------------------------- close() from another thread


def _until_closed(flag: str) -> None:
    """Block (bounded) until the closing rank's close() has returned: it creates ``flag``."""
    deadline = time.monotonic() + 100
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)


class _Blocking(torch.utils.data.Dataset):
    """256 KiB per sample (a view of the slot); with ``flag``, sample 3 waits for the close."""

    def __init__(self, n: int, flag: str | None) -> None:
        self.n, self.flag = n, flag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.flag and i == 3:
            _until_closed(self.flag)
        return torch.full((1 << 16,), float(i))


def closed_by_another_thread(
    rank: int,
    world: int,
    *,
    closer: int,
    busy: str,
    flag: str,
    share: bool = True,
    free: int | None = None,
) -> dict:
    """One thread iterates; on rank ``closer`` the main thread closes the loader mid-iteration.

    ``busy`` says where the other threads are meanwhile, until that close()
    has returned: ``loader``, the leader's dataset blocks in sample 3 (the
    leader is in the user's code, everyone else waits for its batch 3);
    ``blocked``, every other rank blocks in its loop's body after batch 2
    (the closer waits for them: a writer for its readers, a reader for its
    writer), but rank ``free``, which goes on. Either way the closer's
    iterating thread must leave by itself.
    """
    import threading

    warnings = capture_warnings()
    loader = ShmLoader(
        lambda: DataLoader(_Blocking(60, flag if busy == "loader" else None), batch_size=1),
        dist.group.WORLD,
        config=Config.from_env(enabled=share, slots=2, timeout=20.0),
    )
    result: dict = {}
    started = threading.Event()

    def iterate() -> None:
        try:
            for step, batch in enumerate(loader):
                assert int(batch[0, 0]) == step
                started.set()
                if busy == "blocked" and rank not in (closer, free) and step == 2:
                    _until_closed(flag)
            result["out"] = "finished"
        except BaseException as exc:
            result["out"] = f"{type(exc).__name__}: {exc}"
        finally:
            started.set()

    thread = threading.Thread(target=iterate, daemon=True)
    thread.start()
    if rank == closer:
        started.wait(60)
        time.sleep(1.0)  # the iterating thread is in its wait (or in the blocked dataset)
        loader.close()
        pathlib.Path(flag).touch()
        thread.join(60)
    else:
        thread.join(100)
        loader.close()
    gave_up = [m for m in warnings.messages if "closing anyway" in m]
    return {"out": result.get("out"), "alive": thread.is_alive(), "role": loader.role} | (
        {"gave_up": gave_up} if gave_up else {}
    )


_CLOSED = "ShmLoaderError: this ShmLoader is closed; make a new one"
_PEER_OUTCOMES = ("PeerLostError", "LeaderStoppedError")


@pytest.mark.parametrize(
    ("closer", "nodes", "busy"),
    [
        (0, None, "blocked"),  # the leader, in a wait for follower 1 (follower 2 listens)
        (0, None, "loader"),  # the leader, in the user's dataset
        (1, None, "blocked"),  # a follower, in a wait for its leader
        (0, [0, 0, 1, 1], "loader"),  # the leader of two nodes, in the user's dataset
        (2, [0, 0, 1, 1], "blocked"),  # a node leader, in a wait
        (2, [0, 0, 1, 1], "loader"),  # a node leader, in its receive from the leader
        (3, [0, 0, 1, 1], "blocked"),  # a follower of a node leader
    ],
)
def test_close_from_another_thread_stops_the_iteration_first(closer, nodes, busy, tmp_path):
    world = 4 if nodes else 3 if closer == 0 else 2
    free = 2 if world == 3 else None  # goes on while the others block: hears what the leader says
    out = run_ranks(
        closed_by_another_thread,
        world,
        kwargs={"closer": closer, "busy": busy, "flag": str(tmp_path / "closed"), "free": free},
        nodes=nodes,
        timeout=110,
    )
    assert not any(o["alive"] for o in out), out
    assert out[closer]["out"] == _CLOSED, out
    assert "gave_up" not in out[closer], "close() waited for the iterating thread in vain"
    for rank, o in enumerate(out):
        assert "ZMQError" not in o["out"] and "no answer for" not in o["out"], out
        if rank == closer:
            continue
        if out[closer]["role"] == "follower":  # its BYE: the others go on to the end
            assert o["out"] == "finished", out
        else:  # the writer closed (or, a node leader, took no more of the leader's sends)
            assert o["out"].split(":")[0] in _PEER_OUTCOMES, out


def test_close_from_another_thread_with_sharing_off(tmp_path):
    flag = str(tmp_path / "closed")
    out = run_ranks(
        closed_by_another_thread,
        2,
        kwargs={"closer": 0, "busy": "loader", "share": False, "flag": flag},
    )
    assert out[0]["out"] == _CLOSED and out[1]["out"] == "finished", out
    assert "gave_up" not in out[0], "close() waited for the user's loader"
    assert not any(o["alive"] for o in out), out


def test_close_stops_a_waiting_producer_and_takes_what_one_away_in_the_users_code_owns():
    """NOTE [one owner] in-process: a producer in a sliced wait leaves at the mark and
    frees what it owns itself; one away in the user's code is not waited for: close()
    takes its resources, and once back the producer gets the closed error and touches
    nothing. The thread that runs the closing sequence is not stopped by the mark; after
    it every thread gets the error, and a second close() closes nothing."""
    import threading

    from shmloader._roles.base import CLOSED_MESSAGE, Owner

    for away in (False, True):
        owner = Owner(60.0)
        in_wait, in_user, release_user = threading.Event(), threading.Event(), threading.Event()
        got: dict = {}

        def produce(
            owner=owner, got=got, away=away, in_user=in_user, in_wait=in_wait, go=release_user
        ) -> None:
            try:
                if away:
                    with owner.outside():  # the user's loader, blocked until close returned
                        in_user.set()
                        go.wait(60)
                        got["user code returned"] = True
                in_wait.set()
                while True:  # a sliced wait: checks once per slice
                    owner()
                    time.sleep(0.01)
            except ShmLoaderError as exc:
                got["error"] = str(exc)
            if not owner.taken:  # NOTE [one owner]: the producer frees what it still owns
                with owner.closing():
                    owner()  # the closing sequence's own waits go on
                    got["freed by"] = "producer"

        producer = threading.Thread(target=produce, daemon=True)
        owner.producer = producer
        producer.start()
        (in_user if away else in_wait).wait(60)
        assert owner.close()
        assert not owner.close(), "a second close() closes nothing"
        if away:
            assert owner.take(), "a producer in the user's code is not waited for"
            with owner.closing():
                owner()
            release_user.set()
        producer.join(60)
        assert not producer.is_alive()
        assert got["error"] == CLOSED_MESSAGE, got
        assert got.get("freed by") == (None if away else "producer"), got
        assert got.get("user code returned") is (True if away else None), got
        with pytest.raises(ShmLoaderError, match="closed"):
            owner()  # the closer too, once closing is over

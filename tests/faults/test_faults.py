"""Fault injection: real processes fail or die at chosen points.

For each case: which typed error every surviving rank raised, how long that
took, and that /dev/shm, the runtime directory and the process table are clean
afterwards (after `shmloader gc` when an owner was SIGKILLed; the suite's
autouse fixture checks the rest).
"""

from __future__ import annotations

import pytest

from tests.faults import scenarios
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

#: The survivors' timeout in the SIGKILL tests: what a rank that missed its
#: peer's death would wait; liveness tells them within a fraction of it.
KILL_TIMEOUT_S = 80.0


@pytest.mark.parametrize("at", [3, 0], ids=["mid-epoch", "first-batch"])
def test_leader_error_reaches_every_follower_with_type_message_and_traceback(at):
    """Also at the very first batch, before followers' connections may be up."""
    out = run_ranks(scenarios.leader_raises, 3, kwargs={"exc": "Boom", "at": at})
    assert out[0]["type"] == "Boom" and f"sample {at} is corrupt" in out[0]["message"]
    for r in (1, 2):
        assert out[r]["type"] == "LeaderError", out[r]
        assert out[r]["attrs"]["original_type"] == "Boom"
        assert out[r]["attrs"]["original_message"] == f"sample {at} is corrupt"
        assert "in __iter__" in out[r]["attrs"]["traceback_text"]
    assert all(o["got"] == list(range(at)) for o in out), "every rank failed on the same step"


def test_leader_keyboard_interrupt_stops_followers_with_a_typed_error_not_a_short_epoch():
    """Ctrl-C inside the leader's next(): followers' epochs did not end, so their loops
    must not end as if they had (a silent epoch of 3 batches out of 6)."""
    out = run_ranks(scenarios.leader_raises, 3, kwargs={"exc": "KeyboardInterrupt"})
    assert out[0]["type"] == "KeyboardInterrupt"
    for r in (1, 2):
        assert out[r]["type"] == "LeaderStoppedError" and out[r]["got"] == [0, 1, 2], out[r]
        assert "KeyboardInterrupt on the leader" in out[r]["message"]
        assert "at batch 3 of epoch 0" in out[r]["message"], out[r]["message"]
        assert "received 3 batches of epoch 0" in out[r]["message"]


@pytest.mark.parametrize(
    "victim,point,survivor_error",
    [
        (0, "mid-publish", "PeerLostError"),
        (1, "holding-slot", "PeerLostError"),
        (2, "before-hello", "PeerLostError"),
    ],
    ids=["leader-mid-publish", "follower-holding-slot", "follower-before-hello"],
)
def test_sigkill_is_detected_by_every_survivor_quickly(victim, point, survivor_error):
    out = run_ranks(
        scenarios.kill_at,
        3,
        kwargs={"victim": victim, "point": point, "timeout": KILL_TIMEOUT_S},
        expect_failure=True,
        gc_after=True,
        timeout=KILL_TIMEOUT_S + 20,
    )
    assert out[victim] is None or isinstance(out[victim], str), "the victim must have died"
    for rank, o in enumerate(out):
        if rank == victim:
            continue
        assert not o["ok"] and o["type"] == survivor_error, (rank, o)
        # by liveness, long before the 80 s timeout a rank would otherwise wait
        assert o["seconds"] < KILL_TIMEOUT_S / 4, f"rank {rank} took {o['seconds']:.1f} s"
        assert str(victim) in o["message"], f"the error must name rank {victim}: {o['message']}"


@pytest.mark.parametrize("victim", [1, 0], ids=["node-leader", "leader"])
def test_sigkill_during_cross_node_broadcast(victim):
    point = "during-broadcast" if victim == 1 else "mid-publish"
    out = run_ranks(
        scenarios.kill_at,
        4,
        kwargs={"victim": {1: 2, 0: 0}[victim], "point": point, "timeout": KILL_TIMEOUT_S},
        nodes=[0, 0, 1, 1],
        expect_failure=True,
        gc_after=True,
        timeout=KILL_TIMEOUT_S + 20,
    )
    dead = {1: 2, 0: 0}[victim]
    for rank, o in enumerate(out):
        if rank == dead:
            continue
        assert not o["ok"] and o["type"] in ("PeerLostError", "LeaderError"), (rank, o)
        assert o["seconds"] < KILL_TIMEOUT_S / 2, f"rank {rank} took {o['seconds']:.1f} s"


def test_leader_error_and_stop_cross_nodes():
    """A node leader forwards the leader's error, so remote followers raise it too."""
    out = run_ranks(scenarios.leader_raises, 4, kwargs={"exc": "Boom"}, nodes=[0, 0, 1, 1])
    assert out[0]["type"] == "Boom"
    for r in (1, 2, 3):
        assert out[r]["type"] == "LeaderError", (r, out[r])
        assert out[r]["attrs"]["original_message"] == "sample 3 is corrupt"
    assert all(o["got"] == [0, 1, 2] for o in out)
    stopped = run_ranks(
        scenarios.leader_raises, 4, kwargs={"exc": "KeyboardInterrupt"}, nodes=[0, 0, 1, 1]
    )
    assert all(o["type"] == "LeaderStoppedError" and o["got"] == [0, 1, 2] for o in stopped[1:]), (
        stopped
    )


def test_make_loader_failure_reaches_followers_with_the_original_error():
    out = run_ranks(scenarios.make_loader_raises, 3)
    assert out[0]["type"] == "FileNotFoundError"
    for o in out[1:]:
        assert o["type"] == "LeaderError" and o["attrs"]["original_type"] == "FileNotFoundError"
        assert "/data/shard-000.tar is missing" in o["message"]


def test_a_leader_that_closes_early_fails_its_followers_instead_of_ending_the_epoch():
    out = run_ranks(scenarios.leader_closes_early, 3)
    assert out[0]["first"]["ok"] and out[0]["got"] == [0, 1]
    for o in out[1:]:
        assert o["first"]["type"] == "PeerLostError" and "closed" in o["first"]["message"]
        assert o["got"] == [0, 1]
        # it knows the leader closed: it says so (not a later liveness check finding the
        # leader's process gone), with no wait for the 60 s timeout (leader_closes_early)
        again = o["again"]
        assert again["type"] == "PeerLostError" and "closed" in again["message"], again
        assert again["seconds"] < 15, again

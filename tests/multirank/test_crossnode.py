"""Multi-process, simulated nodes: SP groups that span nodes.

Every node but node 0 has its own tmpfs over /dev/shm (tests/support/harness.py), so
ranks of different nodes really cannot map each other's segments.
"""

from __future__ import annotations

import pytest

from tests.multirank.test_sharing import assert_same
from tests.support import ranks
from tests.support.harness import run_ranks


def _check(out, world, sp):
    for rank in range(world):
        s, a = out[rank]["shared"], out[rank]["alone"]
        assert len(s["batches"]) == len(a["batches"]) > 0
        for step, (x, y) in enumerate(zip(s["batches"], a["batches"], strict=True)):
            assert_same(x, y, f"rank {rank} step {step}")
        assert s["made"] == (1 if rank % sp == 0 else 0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "world,sp,nodes,roles",
    [
        (4, 4, [0, 0, 1, 1], ["leader", "follower", "node leader", "follower"]),
        (2, 2, [0, 1], ["leader", "node leader"]),
        (4, 2, [0, 0, 1, 1], ["leader", "follower", "leader", "follower"]),
        (4, 4, [0, 0, 0, 1], ["leader", "follower", "follower", "node leader"]),
    ],
    ids=["sp4-2x2", "sp2-2x1", "sp2-in-node-dp-across", "sp4-uneven-3+1"],
)
def test_cross_node_batches_equal_unshared(world, sp, nodes, roles):
    out = run_ranks(ranks.deliver_both, world, kwargs={"sp": sp, "num_workers": 0}, nodes=nodes)
    _check(out, world, sp)
    assert [o["shared"]["role"] for o in out] == roles
    # the payload crossed the network once per remote node, not once per rank
    lead = out[0]["shared"]["stats"]
    remote_nodes = len({n for r, n in enumerate(nodes) if r < sp} - {nodes[0]})
    sent = lead.get("cross_node_bytes_sent", 0)
    assert sent == lead["bytes_published"] * (1 if remote_nodes else 0)


def topology_roles(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from shmloader import Config, ShmLoader

    loader = ShmLoader(lambda: [[rank]], dist.group.WORLD, config=Config.from_env(enabled=True))
    nodes = loader.topology.nodes
    got = [b for b in loader]
    loader.close()
    return {"role": loader.role, "nodes": nodes, "got": got}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claimed", ["same-host", ""], ids=["equal-SHMLOADER_NODE", "unset"])
def test_ranks_that_cannot_map_each_others_shm_are_never_one_node(claimed):
    """Equal node claims (or none) but separate /dev/shm: the probe splits them."""
    env = {r: {"SHMLOADER_NODE": claimed} for r in range(2)}
    out = run_ranks(topology_roles, 2, nodes=[0, 1], rank_env=env)
    assert [o["role"] for o in out] == ["leader", "node leader"]
    assert out[0]["nodes"] == ((0,), (1,))
    assert out[1]["got"] == out[0]["got"] == [[0]]


@pytest.mark.timeout(60)
def test_ranks_sharing_shm_are_one_node_even_when_nodes_env_is_unusual():
    env = {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = run_ranks(topology_roles, 2, env=env)
    assert [o["role"] for o in out] == ["leader", "follower"]
    assert out[0]["nodes"] == ((0, 1),)

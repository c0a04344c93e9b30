"""DeviceMesh wherever a group is taken: real init_device_mesh over gloo, 4 and 8 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from shmloader import (
    Config,
    ConfigError,
    ShardedSampler,
    ShmLoader,
    dp_topology,
    dp_topology_from_group,
)
from tests.multirank.test_sharing import assert_same
from tests.support import ranks
from tests.support.harness import run_ranks

# ------------------------------------------------------------------ rank code


def _error(fn) -> str:
    try:
        fn()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _iterate(mesh, share: bool, num_replicas: int, dp_rank: int, **group_kw) -> dict:
    def make() -> DataLoader:
        ds = ranks.Synthetic(22)
        sampler = ShardedSampler(ds, num_replicas=num_replicas, rank=dp_rank, seed=3)
        return DataLoader(ds, batch_size=2, sampler=sampler, collate_fn=ranks.collate)

    loader = ShmLoader(make, config=Config.from_env(enabled=share), **group_kw)
    batches = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches += [ranks.to_plain(b) for b in loader]
    role, group = loader.role, loader.state_dict()["topology"]["group"]
    loader.close()
    return {"batches": batches, "role": role, "group": group}


def mesh_run(rank: int, world: int, *, shape: tuple, names: tuple) -> dict:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    sp = mesh["sp"]
    num_replicas, dp_rank = dp_topology(mesh, sp_dim="sp")
    out: dict = {"topology": (num_replicas, dp_rank), "coordinate": mesh.get_coordinate()}
    if len(names) == 2:
        # a 1-D mesh where a group is expected: the same answer as the process group
        out["from_group"] = dp_topology_from_group(sp)
        out["from_pg"] = dp_topology_from_group(sp.get_group())
    for share in (False, True):
        out[f"sliced-{share}"] = _iterate(mesh, share, num_replicas, dp_rank, group=sp)
        out[f"named-{share}"] = _iterate(
            mesh, share, num_replicas, dp_rank, group=mesh, mesh_dim="sp"
        )
    out["errors"] = {
        "2d-no-dim": _error(lambda: ShmLoader(lambda: [], group=mesh)),
        "bad-dim": _error(lambda: ShmLoader(lambda: [], group=mesh, mesh_dim="xp")),
        "dim-on-pg": _error(lambda: ShmLoader(lambda: [], group=sp.get_group(), mesh_dim="sp")),
        "2d-from-group": _error(lambda: dp_topology_from_group(mesh)),
        "bad-dp-dims": _error(lambda: dp_topology(mesh, dp_dims=("sp",))),
    }
    return out


def naming_run(rank: int, world: int) -> dict:
    """dp_topology's naming rules on a (dp_replicate, dp_shard, ep) mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    return {
        "unknown": _error(lambda: dp_topology(mesh, sp_dim=None)),
        "ep-is-dp": dp_topology(mesh, sp_dim=None, dp_dims=("dp_shard", "ep")),
        "ep-is-not": dp_topology(mesh, sp_dim=None, dp_dims=["dp_shard"]),
        "ep-as-sp": dp_topology(mesh, sp_dim="ep"),
        "coordinate": mesh.get_coordinate(),
        "world": dist.get_world_size(),
    }


# ------------------------------------------------------------------ tests


def _check(out: list[dict], dp_of, sp_of) -> None:
    """SP peers get identical batches, DP replicas different ones, sharing changes nothing."""
    for rank, o in enumerate(out):
        assert o["topology"] == (len({dp_of(r) for r in range(len(out))}), dp_of(rank))
        for key in ("sliced", "named"):
            shared, alone = o[f"{key}-True"], o[f"{key}-False"]
            assert len(shared["batches"]) == len(alone["batches"]) > 0
            for step, (x, y) in enumerate(zip(shared["batches"], alone["batches"], strict=True)):
                assert_same(x, y, f"rank {rank} {key} step {step}")
            peers = [r for r in range(len(out)) if sp_of(r) == sp_of(rank)]
            assert shared["group"] == peers, "the loader shares over the mesh's sp dimension"
            assert shared["role"] == ("leader" if rank == min(peers) else "follower")
            assert alone["role"] == "local"
    for a in range(len(out)):
        for b in range(a + 1, len(out)):
            same = (
                out[a]["sliced-True"]["batches"][0]["meta"]
                == (out[b]["sliced-True"]["batches"][0]["meta"])
            )
            assert same == (dp_of(a) == dp_of(b)), f"ranks {a}, {b}: data vs DP replica"
    errors = out[0]["errors"]
    assert "mesh_dim=" in errors["2d-no-dim"] and "mesh['sp']" in errors["2d-no-dim"]
    assert "mesh_dim='xp'" in errors["bad-dim"] and "'sp'" in errors["bad-dim"]
    assert "mesh_dim='sp'" in errors["dim-on-pg"] and "DeviceMesh" in errors["dim-on-pg"]
    assert "dp_topology(mesh" in errors["2d-from-group"]
    assert "dp_dims=('sp',)" in errors["bad-dp-dims"]


@pytest.mark.timeout(240)
def test_dp_sp_mesh_4_ranks():
    out = run_ranks(mesh_run, 4, kwargs={"shape": (2, 2), "names": ("dp", "sp")}, timeout=200)
    _check(out, dp_of=lambda r: r // 2, sp_of=lambda r: r // 2)
    for rank, o in enumerate(out):
        assert tuple(o["coordinate"]) == (rank // 2, rank % 2)
        assert o["from_group"] == o["from_pg"] == o["topology"]


@pytest.mark.timeout(300)
def test_dp_sp_tp_mesh_8_ranks():
    # rank = dp * 4 + sp * 2 + tp: SP groups {0,2},{1,3},{4,6},{5,7}; tp peers share data
    out = run_ranks(
        mesh_run, 8, kwargs={"shape": (2, 2, 2), "names": ("dp", "sp", "tp")}, timeout=260
    )
    _check(out, dp_of=lambda r: r // 4, sp_of=lambda r: (r // 4, r % 2))


@pytest.mark.timeout(120)
def test_dp_topology_naming_rules():
    out = run_ranks(naming_run, 4)
    for rank, o in enumerate(out):
        shard, _ = o["coordinate"]
        assert "dp_dims" in o["unknown"] and "'ep'" in o["unknown"]
        assert o["ep-is-dp"] == (4, rank)
        assert o["ep-is-not"] == o["ep-as-sp"] == (2, shard)


def test_without_a_mesh():
    with pytest.raises(ConfigError, match="mesh_dim='sp'"):
        ShmLoader(lambda: [], group=None, mesh_dim="sp")
    with pytest.raises(ConfigError, match="DeviceMesh"):
        dp_topology(object())
    assert torch.distributed.is_available()

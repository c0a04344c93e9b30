"""``DeviceMesh`` or process group: which ranks share batches, and who is a DP replica.

Most current SP/CP code (torchtitan, accelerate's parallelism config, XTuner's
newer engines) holds a ``DeviceMesh`` rather than process groups, so everything
that takes a group takes a mesh too. It owns ``resolve_group``
(``group=mesh["sp"]``, or ``group=mesh, mesh_dim="sp"``) and ``dp_topology``
(the DP size and this rank's DP index from the mesh's coordinates, no
collective; which dimensions count as data-parallel is in its docstring). It
touches no process group state and imports only ``errors``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

#: Dimension names counted as data-parallel when ``dp_dims`` is not given.
DP_DIM_NAMES = frozenset({"dp", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp", "data"})
#: Dimension names whose ranks compute on one replica's batch (never data-parallel).
MODEL_DIM_NAMES = frozenset({"sp", "cp", "tp", "pp", "etp", "context", "tensor", "pipeline"})


def device_mesh_type() -> type | None:
    """``torch.distributed.device_mesh.DeviceMesh``, or None where torch lacks it."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DeviceMesh


def is_mesh(obj: object) -> bool:
    mesh_type = device_mesh_type()
    return mesh_type is not None and isinstance(obj, mesh_type)


def describe(mesh: Any) -> str:
    """``DeviceMesh(dp=2, sp=2)``: short enough for an error message."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"DeviceMesh({dims})"


def resolve_group(group: Any, mesh_dim: str | int | None = None) -> dist.ProcessGroup | None:
    """The process group that ``ShmLoader(group=..., mesh_dim=...)`` shares over.

    ``group`` is ``None``, a ``ProcessGroup``, a one-dimensional ``DeviceMesh``
    (``mesh["sp"]``) or an n-dimensional one together with ``mesh_dim``. Any
    other combination is a ``ConfigError`` that says which one to use.
    """
    if not is_mesh(group):
        if mesh_dim is not None:
            raise ConfigError(
                "mesh_dim",
                mesh_dim,
                "None unless group is a DeviceMesh: mesh_dim names the SP dimension of a mesh "
                "passed as group (group=mesh, mesh_dim='sp')",
            )
        return group
    names = tuple(group.mesh_dim_names or ())
    if group.get_coordinate() is None:
        raise ConfigError("group", describe(group), "a DeviceMesh that contains this rank")
    if mesh_dim is None:
        if group.ndim != 1:
            raise ConfigError(
                "group",
                describe(group),
                "a one-dimensional DeviceMesh (e.g. mesh['sp']) or this mesh with mesh_dim= "
                f"naming the sequence-parallel dimension (one of {names})",
            )
        return group.get_group()
    if isinstance(mesh_dim, str) and mesh_dim not in names:
        raise ConfigError("mesh_dim", mesh_dim, f"one of the mesh's dimensions {names}")
    if not isinstance(mesh_dim, str) and not (
        isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool) and 0 <= mesh_dim < group.ndim
    ):
        raise ConfigError("mesh_dim", mesh_dim, f"a dimension name {names} or index of the mesh")
    return group.get_group(mesh_dim)


def dp_topology(
    mesh: Any,
    sp_dim: str | None = "sp",
    *,
    dp_dims: Iterable[str] | None = None,
) -> tuple[int, int]:
    """Return ``(num_replicas, dp_rank)`` of this rank in ``mesh``.

    The DP replicas are the ranks that must receive *different* data. In a mesh
    ``(pp, dp_replicate, dp_shard, cp, tp)`` those are the ``dp_*`` dimensions;
    every rank of one ``pp``/``cp``/``tp``/SP slice of a replica computes on the
    same batch. A dimension counts as data-parallel when it is named in
    ``dp_dims=`` (then exactly those, nothing else), or, with ``dp_dims=None``,
    when its name is one of ``DP_DIM_NAMES``. With ``dp_dims=None`` a dimension
    that is neither the SP dimension, nor a ``DP_DIM_NAMES`` name, nor a
    ``MODEL_DIM_NAMES`` name (``ep`` for instance, which is data-parallel in some
    stacks and not in others) is refused with a ``ConfigError`` asking for
    ``dp_dims=``: guessing wrong would silently feed two replicas the same data,
    or split one replica's batch. The DP index is the row-major index of this
    rank's coordinates over the DP dimensions, in the mesh's dimension order::

        mesh (dp=2, sp=2, tp=2), ranks 0..7      dp_topology(mesh) on each rank
        dp 0: sp 0: [0 1]  sp 1: [2 3]           ranks 0-3: (2, 0)
        dp 1: sp 0: [4 5]  sp 1: [6 7]           ranks 4-7: (2, 1)

    Args:
        mesh: a ``DeviceMesh`` with named dimensions, e.g. ``init_device_mesh("cuda",
            (2, 4), mesh_dim_names=("dp", "sp"))``.
        sp_dim: the sequence-parallel (context-parallel) dimension, or None when the mesh
            has none. Never data-parallel.
        dp_dims: the data-parallel dimensions; default: those named in ``DP_DIM_NAMES``.

    Local (no collective): the mesh already knows every rank's coordinates. Pass the
    result to ``ShardedSampler(num_replicas=..., rank=...)``.
    """
    if not is_mesh(mesh):
        raise ConfigError(
            "mesh",
            type(mesh).__name__,
            "a torch DeviceMesh (for a process group use dp_topology_from_group(group))",
        )
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ConfigError("mesh", describe(mesh), "a DeviceMesh with mesh_dim_names")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError("mesh", describe(mesh), "a DeviceMesh that contains this rank")
    if sp_dim is not None and sp_dim not in names:
        raise ConfigError("sp_dim", sp_dim, f"None or one of the mesh's dimensions {names}")
    if dp_dims is None:
        unknown = [n for n in names if n != sp_dim and n not in DP_DIM_NAMES | MODEL_DIM_NAMES]
        if unknown:
            raise ConfigError(
                "dp_dims",
                None,
                f"the data-parallel dimensions of {describe(mesh)} named explicitly: "
                f"{unknown} is neither a data-parallel name {sorted(DP_DIM_NAMES)} nor a "
                f"model-parallel one {sorted(MODEL_DIM_NAMES)} (e.g. dp_dims=('dp',))",
            )
        chosen = [n for n in names if n in DP_DIM_NAMES and n != sp_dim]
    else:
        chosen = list(dict.fromkeys([dp_dims] if isinstance(dp_dims, str) else dp_dims))
        bad = [n for n in chosen if n not in names or n == sp_dim]
        if bad:
            raise ConfigError(
                "dp_dims", tuple(chosen), f"dimensions of {names} other than sp_dim={sp_dim!r}"
            )
    dims = [names.index(n) for n in sorted(chosen, key=names.index)]
    size = math.prod(mesh.shape[d] for d in dims)
    rank = 0
    for d in dims:
        rank = rank * mesh.shape[d] + coordinate[d]
    return size, rank

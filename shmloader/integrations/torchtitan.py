"""torchtitan: its dataloader contract over a ``ShmLoader``, for the mesh the user hands in.

It owns ``ShmDataLoader``, a torchtitan ``BaseDataLoader`` (iterable, DCP
``Stateful``) whose batches come from one loader per SP group: the ranks that
differ only in the dimensions the user names (``sp_dims``: ``"cp"``, or
``("cp", "tp")``) receive identical batches, and each SP group's leader builds
torchtitan's own loader for the group's DP rank. torchtitan never passes its
``DeviceMesh`` to the dataloader builder, so the adapter takes it. Its state is
keyed by global rank (``PerRankState``, NOTE [per-rank state in frameworks] in
``shmloader.integrations.dcp``), not by DP rank as torchtitan's
``ParallelAwareDataloader`` keys its own: under CP the DP key is one key for a
whole SP group, DCP keeps one copy, and every follower's resume fails. Usage in
docs/integrations.md. Importing this module imports torchtitan's dataloader
module (and needs torchtitan); it touches only the loader it builds and the
mesh's process groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

try:
    from torchtitan.components.dataloader import BaseDataLoader
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "shmloader.integrations.torchtitan needs torchtitan (pip install torchtitan): "
        f"importing torchtitan.components.dataloader failed: {exc}"
    ) from exc

from ..errors import ConfigError
from ..loader import ShmLoader
from ..mesh import DP_DIM_NAMES, MODEL_DIM_NAMES, describe, dp_topology, is_mesh
from .dcp import PerRankState

#: Names counted as data-parallel by default: shmloader's, and torchtitan's dataloading
#: mesh's ``batch`` (``parallel_dims.get_mesh("batch")``: dp_replicate x dp_shard).
DATA_DIM_NAMES = DP_DIM_NAMES | {"batch"}


def _dims(
    mesh: Any, sp_dims: str | Sequence[str], dp_dims: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(SP dims, DP dims) of ``mesh``, each in the mesh's order, validated."""
    if not is_mesh(mesh):
        raise ConfigError(
            "mesh",
            type(mesh).__name__,
            "a torch DeviceMesh holding this rank (torchtitan: parallel_dims.get_mesh(['batch', "
            "'cp']), or init_device_mesh(..., mesh_dim_names=('batch', 'cp')))",
        )
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ConfigError("mesh", describe(mesh), "a DeviceMesh with mesh_dim_names")
    if mesh.get_coordinate() is None:
        raise ConfigError("mesh", describe(mesh), "a DeviceMesh that contains this rank")
    sp = [sp_dims] if isinstance(sp_dims, str) else list(sp_dims)
    if not sp or len(set(sp)) != len(sp) or any(d not in names for d in sp):
        raise ConfigError(
            "sp_dims",
            sp_dims,
            f"one or more distinct dimensions of {describe(mesh)}, the ones whose ranks "
            "compute on one batch (e.g. 'cp', or ('cp', 'tp'))",
        )
    if dp_dims is None:
        rest = [n for n in names if n not in sp and n not in MODEL_DIM_NAMES]
        unknown = [n for n in rest if n not in DATA_DIM_NAMES]
        if unknown:
            raise ConfigError(
                "dp_dims",
                None,
                f"the data-parallel dimensions of {describe(mesh)} named explicitly: "
                f"{unknown} is neither a data-parallel name {sorted(DATA_DIM_NAMES)} nor a "
                f"model-parallel one {sorted(MODEL_DIM_NAMES)} (e.g. dp_dims=('batch',))",
            )
        dp = rest
    else:
        dp = [dp_dims] if isinstance(dp_dims, str) else list(dp_dims)
        if len(set(dp)) != len(dp) or any(d not in names or d in sp for d in dp):
            raise ConfigError(
                "dp_dims", dp_dims, f"distinct dimensions of {names} other than sp_dims={sp!r}"
            )
    return tuple(sorted(sp, key=names.index)), tuple(sorted(dp, key=names.index))


class ShmDataLoader(BaseDataLoader):
    """torchtitan's ``BaseDataLoader`` over a ``ShmLoader``: one loader per SP group.

    ``ShmDataLoader(build, mesh, sp_dims="cp")`` on every rank. ``build`` is
    called as ``build(dp_world_size=..., dp_rank=...)``, the keywords
    torchtitan's dataloader builders take, on each SP group's leader only
    (on every rank with sharing off) and returns torchtitan's loader for that
    DP rank: a ``ParallelAwareDataloader``, or ``functools.partial(
    config.dataloader.build, tokenizer=..., seq_len=..., local_batch_size=...)``.

    Args:
        build: makes the loader of one DP rank (above).
        mesh: a ``DeviceMesh`` with named dimensions that holds this rank, the SP
            dimensions and the DP ones: torchtitan's ``parallel_dims.get_mesh(["batch",
            "cp"])`` (its dataloading mesh), or any mesh of the same kind.
        sp_dims: the dimension, or dimensions, whose ranks receive identical batches
            (``"cp"``; ``("cp", "tp")``); several are flattened into one group.
        dp_dims: the data-parallel dimensions (``dp_rank``, ``dp_world_size`` are this
            rank's index and count over them). Default: every other dimension that is not
            a model-parallel one (``pp``, ``tp``: ``shmloader.mesh.MODEL_DIM_NAMES``),
            such as ``batch``; another name (``ep``) must be named here.
        **kwargs: ``ShmLoader``'s keywords (``config``, ``device``, ``select``,
            ``accumulation_steps``).

    ``state_dict()`` is keyed by global rank, so ``dcp.save({"dataloader": ...})``
    (torchtitan's ``CheckpointManager``) keeps every rank's state and each
    rank resumes its own (NOTE [per-rank state in frameworks] in
    ``shmloader.integrations.dcp``); load it before iterating.
    """

    def __init__(
        self,
        build: Callable[..., Iterable[Any]],
        mesh: Any,
        *,
        sp_dims: str | Sequence[str] = "cp",
        dp_dims: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if not callable(build):
            raise ConfigError(
                "build", build, "a callable: build(dp_world_size=..., dp_rank=...) -> loader"
            )
        self.sp_dims, self.dp_dims = _dims(mesh, sp_dims, dp_dims)
        self.dp_world_size, self.dp_rank = dp_topology(mesh, None, dp_dims=self.dp_dims)
        sp = mesh[self.sp_dims[0]] if len(self.sp_dims) == 1 else mesh[self.sp_dims]._flatten()
        #: The SP group's one-dimensional mesh: ``mesh[sp_dims]``, flattened.
        self.sp_mesh = sp
        dp_world_size, dp_rank = self.dp_world_size, self.dp_rank

        def make() -> Iterable[Any]:
            return build(dp_world_size=dp_world_size, dp_rank=dp_rank)

        #: The ``ShmLoader`` that delivers the batches (``len``, ``set_epoch``, ``stats``).
        self.loader = ShmLoader(make, sp, **kwargs)
        self._state = PerRankState(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """``{"rank<global rank>": bytes}``: this rank's state, for DCP (``PerRankState``)."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's own state; a checkpoint without it is refused, not skipped."""
        self._state.load_state_dict(state_dict)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> ShmDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

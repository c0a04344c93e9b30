"""``torch.distributed.checkpoint`` (DCP): a ``Stateful`` keyed by global rank.

It owns ``PerRankState`` and the per-rank keys and bytes both adapters use
(``rank_key``, ``dumps``, ``loads``: NOTE [per-rank state in frameworks]). It
touches only the loader it wraps.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import TopologyMismatchError

if TYPE_CHECKING:
    from ..loader import ShmLoader


# NOTE [per-rank state in frameworks]
#     A loader's state is per rank (NOTE [checkpoints] in ``checkpoint``:
#     each rank's RNG at the step boundary, each leader's data position), but
#     the frameworks keep one copy per key: DCP deduplicates a key every rank
#     saves (``dcp.save({"data": loader})`` keeps one rank's state, and every
#     other rank's resume ends in ``TopologyMismatchError``), accelerate's
#     ``save_state`` writes a registered object's state from rank 0 only, and
#     so does Lightning's fit loop with a loader's, which it loads on every
#     rank; torchtitan keys its loaders' state by DP rank, one key for a whole
#     SP group. So the state a framework sees is keyed by the global rank,
#     ``{"rank<r>": <bytes of loader.state_dict()>}``, one key per rank, and
#     each rank restores only its own key. The value is the ``torch.save``
#     bytes of the state (opaque to DCP, which would otherwise flatten the
#     state's nested keys and demand on load the very keys the fresh
#     loader's state happens to have); it is read back with
#     ``weights_only=True``. Resuming needs the world size the checkpoint was
#     taken at (a rank with no key of its own is told so); for a DP resize
#     save and load ``loader.state_dict()`` per rank as docs/user-guide.md says.
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_key(rank: int | None = None) -> str:
    """The key this (or ``rank``'s) state is kept under (NOTE [per-rank state in frameworks])."""
    return f"rank{_rank() if rank is None else rank}"


def dumps(state: dict[str, Any]) -> bytes:
    """A loader state as the bytes frameworks keep (``torch.save``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def loads(blob: Any, where: str) -> dict[str, Any]:
    """The loader state ``dumps`` made; ``where`` names it in the error."""
    if isinstance(blob, io.BytesIO):
        blob = blob.getvalue()
    if not isinstance(blob, bytes | bytearray):
        raise TopologyMismatchError(
            f"{where} is a {type(blob).__name__}, not the bytes a shmloader adapter saved: "
            "save and load through the same adapter"
        )
    return torch.load(io.BytesIO(bytes(blob)), weights_only=True)


class PerRankState:
    """A DCP ``Stateful`` holding every rank's own ``ShmLoader`` state.

    ``dcp.save({"dataloader": PerRankState(loader)}, checkpoint_id=path)`` on
    every rank, and the same with ``dcp.load`` to resume: each rank gets back
    exactly its own state (NOTE [per-rank state in frameworks]).
    """

    def __init__(self, loader: ShmLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, bytes]:
        return {rank_key(): dumps(self.loader.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        key = rank_key()
        if not isinstance(state, dict) or key not in state:
            have = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise TopologyMismatchError(
                f"the checkpoint holds no loader state for this rank ({key!r}; it holds "
                f"{have!r}): it was taken at another world size, or saved without "
                "PerRankState on every rank. Resume at the world size it was taken at; for a DP "
                "resize save loader.state_dict() per rank and load the state rank 0 saved "
                "on every rank"
            )
        self.loader.load_state_dict(loads(state[key], f"the checkpoint's {key!r}"))

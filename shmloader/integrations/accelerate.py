"""accelerate: a checkpointed object that holds every rank's loader state.

``accelerator.save_state`` writes a registered object's ``state_dict()`` from
the main process only, so registering a ``ShmLoader`` itself would restore rank
0's state everywhere. It owns ``AllRanksState``: ``state_dict()`` gathers every
rank's own state keyed by global rank (NOTE [per-rank state in frameworks] in
``shmloader.integrations.dcp``), ``load_state_dict`` restores each rank's own
(rank 0's under a DP resize, NOTE [checkpoints]); usage in docs/integrations.md.
It never imports accelerate and touches only the loader it wraps and one
all-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import TopologyMismatchError
from .dcp import dumps, loads, rank_key

if TYPE_CHECKING:
    from ..loader import ShmLoader

FORMAT = "shmloader.ranks/1"


class AllRanksState:
    """Every rank's ``ShmLoader`` state in one object, for frameworks that save from rank 0.

    ``state_dict()`` is collective over the world (an all-gather of every
    rank's few kilobytes): call it on every rank, as ``accelerator.save_state``
    does.
    """

    def __init__(self, loader: ShmLoader) -> None:
        self.loader = loader

    @staticmethod
    def _world() -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def state_dict(self) -> dict[str, Any]:
        mine = dumps(self.loader.state_dict())
        world = self._world()
        gathered: list[Any] = [mine]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
        return {"format": FORMAT, "world": world} | {
            rank_key(r): blob for r, blob in enumerate(gathered)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise TopologyMismatchError(
                f"this checkpoint's loader state has format {found!r}, not {FORMAT!r}: save it "
                "through AllRanksState (accelerator.register_for_checkpointing(AllRanksState("
                "loader))), not the loader itself"
            )
        # Under another world size, rank 0's state on every rank, also where this rank's
        # own key is in the checkpoint: that key is a rank of the old layout (a follower's
        # state carries no ShardedSampler state to re-split), NOTE [checkpoints].
        key = rank_key() if state.get("world") == self._world() else rank_key(0)
        if key not in state:  # the same world, but not the same ranks
            raise TopologyMismatchError(
                f"the checkpoint holds no loader state for {key!r} (it holds "
                f"{sorted(k for k in state if k.startswith('rank'))!r}); resume with the ranks "
                "it was saved with"
            )
        self.loader.load_state_dict(loads(state[key], f"the checkpoint's {key!r}"))

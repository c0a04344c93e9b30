"""Lightning: a ``ShmLoader`` as the loader a ``LightningDataModule`` returns.

It owns ``LightningLoader``, what ``train_dataloader()`` returns instead of
the ``ShmLoader`` itself. Lightning treats any loader with
``state_dict``/``load_state_dict`` as stateful: its fit loop saves the loader's
state into the checkpoint rank 0 writes and, on resume, loads that one state
on every rank, after it has probed the loader with ``iter()``; and it sets the
epoch through ``loader.sampler.set_epoch``, which a ``ShmLoader`` lacks. So
the wrapper's state holds every rank's (``AllRanksState``, NOTE [per-rank
state in frameworks] in ``shmloader.integrations.dcp``), its ``__iter__``
starts the loader's iteration only at the first ``next()``, and its
``sampler`` forwards ``set_epoch``. Usage in docs/integrations.md. It never
imports Lightning and touches only the loader it wraps and one all-gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .accelerate import AllRanksState

if TYPE_CHECKING:
    from ..loader import ShmLoader


class _Epochs:
    """``loader.sampler`` as Lightning reads it: ``set_epoch`` reaches the ``ShmLoader``."""

    def __init__(self, loader: ShmLoader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)


class LightningLoader(AllRanksState):
    """A ``ShmLoader`` for Lightning's fit loop: per-rank state, lazy ``iter()``, epochs.

    ``state_dict()`` is collective over the world (``AllRanksState``):
    Lightning calls it on every rank when it saves a checkpoint
    (``ModelCheckpoint``, ``trainer.save_checkpoint``).
    """

    def __init__(self, loader: ShmLoader) -> None:
        super().__init__(loader)
        #: What Lightning calls ``set_epoch`` on at each epoch's start, resumed ones too.
        self.sampler = _Epochs(loader)

    def __iter__(self) -> Iterator[Any]:
        # A generator: Lightning's iter() probe (to check the loader is iterable)
        # starts no iteration, so the resumed state can still be loaded after it.
        yield from self.loader

    def __len__(self) -> int:
        return len(self.loader)

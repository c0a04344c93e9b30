"""Lightning's fit loop over ``LightningLoader`` (NOTE [per-rank state in frameworks]).

Real Lightning on 4 CPU ranks over gloo (SP 2 x DP 2, DDP, the process group
the harness made): a ``LightningDataModule`` returns the wrapped
``ShmLoader``; its batches and the main process's draws equal those of the
same fit over plain DataLoaders, a ``ModelCheckpoint`` taken mid-way through
the second epoch holds every rank's loader state, and ``fit(ckpt_path=...)``
with a new trainer, data module, loader and seed delivers exactly the rest.
The resume runs in the processes that saved (Lightning's import was most of
this test's time: the ranks now come from a warm server that imported it
once, ``run_ranks(preload=...)``); the DCP and torchtitan tests resume in new
ones.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.timeout(300)

SP, N, BATCH, EPOCHS = 2, 24, 2, 2  # 12 samples per DP replica: 6 steps per epoch
STOP = 8  # the checkpoint's step: batch 2 of the second epoch


class Numbers(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((2,), float(i)), "id": torch.tensor(i)}


def _env(rank: int, world: int) -> None:
    """What torchrun would set: Lightning then launches nothing and joins the harness's group."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )


def lightning_ranks(rank: int, world: int, *, ckpt: str) -> dict:
    _env(rank, world)
    import lightning.pytorch as pl

    from shmloader import Config, ShardedSampler, ShmLoader, dp_topology_from_group
    from shmloader.integrations.lightning import LightningLoader
    from tests.support import ranks

    seen: list = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch: dict, i: int) -> torch.Tensor:
            seen.append((self.current_epoch, i, batch["id"].tolist(), torch.rand(1).item()))
            return self.lin(batch["x"]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Data(pl.LightningDataModule):  # the recipe of docs/integrations.md
        def __init__(self, share: bool) -> None:
            super().__init__()
            self.share = share

        def setup(self, stage: str) -> None:  # every rank, torch.distributed initialised
            group, _ = ranks.sp_groups(world, SP)
            replicas, dp_rank = dp_topology_from_group(group)

            def make() -> DataLoader:
                ds = Numbers()
                sampler = ShardedSampler(ds, num_replicas=replicas, rank=dp_rank, seed=3)
                return DataLoader(ds, batch_size=BATCH, sampler=sampler)

            self.make = make
            if self.share:
                self.loader = ShmLoader(make, group, config=Config.from_env(enabled=True))

        def train_dataloader(self) -> Any:
            return LightningLoader(self.loader) if self.share else self.make()

        def teardown(self, stage: str) -> None:
            if self.share:
                self.loader.close()

    def fit(share: bool, seed: int, path: str | None = None, callbacks: Any = ()) -> Any:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy="ddp",
            max_epochs=EPOCHS,
            use_distributed_sampler=False,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        torch.manual_seed(seed)
        trainer.fit(Model(), datamodule=Data(share), ckpt_path=path)
        return trainer

    out: dict = {}
    fit(False, rank)
    out["plain"], seen[:] = list(seen), []
    save = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt, filename="{step}", every_n_train_steps=STOP, save_top_k=-1
    )
    fit(True, rank, callbacks=[save])
    out["shared"], seen[:] = list(seen), []
    trainer = fit(True, 1000 + rank, path=f"{ckpt}/step={STOP}.ckpt")  # all new, another seed
    out["resumed"], out["steps"] = list(seen), trainer.global_step
    return out


def test_lightning_fit_shares_batches_and_resumes_every_rank_exactly_mid_epoch():
    from tests.support.harness import run_ranks

    with tempfile.TemporaryDirectory() as ckpt:
        runs = run_ranks(
            lightning_ranks, 4, kwargs={"ckpt": ckpt}, timeout=280, preload=["lightning.pytorch"]
        )
        saved = torch.load(f"{ckpt}/step={STOP}.ckpt", weights_only=True)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert {f"rank{r}" for r in range(4)} <= set(state)  # every rank's, in rank 0's file
    steps = EPOCHS * N // (4 // SP) // BATCH
    for rank in range(4):
        plain, shared = runs[rank]["plain"], runs[rank]["shared"]
        assert len(plain) == steps
        assert shared == plain, f"rank {rank}: the shared fit differs from plain DataLoaders"
        assert runs[rank]["resumed"] == shared[STOP:], f"rank {rank} after the resume"
        assert runs[rank]["steps"] == steps
    epoch = [[r[2] for r in runs[0]["shared"] if r[0] == e] for e in range(EPOCHS)]
    assert epoch[0] != epoch[1]  # set_epoch reached the sampler: a new order each epoch
    assert [r[2] for r in runs[0]["shared"]] == [r[2] for r in runs[1]["shared"]]  # SP peers
    assert [r[2] for r in runs[0]["shared"]] != [r[2] for r in runs[2]["shared"]]  # DP

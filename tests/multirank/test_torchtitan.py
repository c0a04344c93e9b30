"""torchtitan's data path through ``ShmDataLoader`` (NOTE [per-rank state in frameworks]).

Real torchtitan 0.3.0 on 4 CPU ranks over gloo, a DeviceMesh ``(batch=2,
cp=2)`` named as torchtitan's dataloading mesh: each CP group's leader builds
torchtitan's ``ParallelAwareDataloader`` for its DP rank over a stateful token
stream shaped like its ``HuggingFaceTextDataset`` (without ``datasets``).
torchtitan's ``CheckpointManager`` saves mid-stream and, in new processes,
loads; every rank's batches equal those of torchtitan's own loader run on that
rank without shmloader, before and after the resume.
"""

from __future__ import annotations

import hashlib
import tempfile
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

pytest.importorskip("torchtitan.components.dataloader")

pytestmark = pytest.mark.timeout(300)

STEPS, STOP = 7, 4  # training steps in all; the checkpoint is taken after step STOP
SEQ, BATCH, DOCS = 8, 2, 64


class Tokens(IterableDataset, Stateful):
    """Documents of this DP rank, packed into ``SEQ``-token windows as torchtitan packs them.

    Like ``HuggingFaceTextDataset``: document ``i`` goes to DP rank ``i %
    dp_world_size``, a sample is ``({"input": ids}, labels)`` shifted by one
    token, and the state is the next document and the tokens left over.
    """

    def __init__(self, dp_rank: int, dp_world_size: int) -> None:
        self.docs = range(dp_rank, DOCS, dp_world_size)
        self._sample_idx = 0
        self._buffer: list[int] = []

    @staticmethod
    def _document(i: int) -> list[int]:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 1000, (3 + i % 7,), generator=g).tolist()

    def __iter__(self) -> Any:
        for i in self.docs[self._sample_idx :]:
            self._buffer.extend(self._document(i))
            self._sample_idx += 1
            while len(self._buffer) > SEQ:
                window, self._buffer = self._buffer[: SEQ + 1], self._buffer[SEQ:]
                yield {"input": torch.tensor(window[:-1])}, torch.tensor(window[1:])

    def state_dict(self) -> dict:
        return {"sample_idx": self._sample_idx, "buffer": list(self._buffer)}

    def load_state_dict(self, state: dict) -> None:
        self._sample_idx, self._buffer = state["sample_idx"], list(state["buffer"])


class Counter(Stateful):
    """Stands in for the trainer's optimizers, LR schedulers and train state."""

    def __init__(self) -> None:
        self.step = torch.zeros((), dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step.copy_(state["step"])


def titan_loader(*, dp_world_size: int, dp_rank: int) -> Any:
    """What torchtitan's builder makes: its ``ParallelAwareDataloader`` for one DP rank."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    ds = Tokens(dp_rank, dp_world_size)
    return ParallelAwareDataloader(
        ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=BATCH
    )


def _digest(batch: Any) -> str:
    inputs, labels = batch  # torchtitan's contract: (input_dict, labels)
    assert set(inputs) == {"input"} and labels.shape == (BATCH, SEQ)
    h = hashlib.sha1(inputs["input"].numpy().tobytes())
    h.update(labels.numpy().tobytes())
    return h.hexdigest()


def _manager(adapter: Any, folder: str) -> tuple[Any, Counter]:
    from torchtitan.components.checkpoint import CheckpointManager

    train_state = Counter()
    config = CheckpointManager.Config(enable=True, interval=STOP, keep_latest_k=0)
    manager = CheckpointManager(
        config,
        dataloader=adapter,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=Counter(),
        lr_schedulers=Counter(),
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    return manager, train_state


def titan_phase(rank: int, world: int, *, phase: str, folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from shmloader import Config, ConfigError
    from shmloader.integrations.torchtitan import ShmDataLoader

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "cp"))
    out: dict = {}

    def adapter() -> ShmDataLoader:
        return ShmDataLoader(titan_loader, mesh, sp_dims="cp", config=Config.from_env(enabled=True))

    if phase == "first":
        # torchtitan alone, as its trainer shards: DP rank and size of the batch mesh
        batch = mesh["batch"]
        alone = titan_loader(dp_world_size=batch.size(), dp_rank=batch.get_local_rank())
        it = iter(alone)
        out["alone"] = [_digest(next(it)) for _ in range(STEPS)]
        with adapter() as loader:
            out["dp"] = (loader.dp_world_size, loader.dp_rank)
            manager, train_state = _manager(loader, folder)
            it, got = iter(loader), []
            for step in range(1, STEPS + 1):  # the trainer's loop: a step, then save()
                got.append(_digest(next(it)))
                train_state.step.fill_(step)
                manager.save(step)
            manager.close()
        out["shared"] = got
        flat = ShmDataLoader(
            titan_loader, mesh, sp_dims=("batch", "cp"), config=Config.from_env(enabled=False)
        )
        out["flat"] = (flat.dp_world_size, sorted(flat.sp_mesh.mesh.flatten().tolist()))
        flat.close()
        refused = []
        for kw in ({"sp_dims": "tp"}, {"sp_dims": ()}, {"dp_dims": ("cp",)}):
            with pytest.raises(ConfigError) as err:
                ShmDataLoader(titan_loader, mesh, **kw)
            refused.append(str(err.value))
        with pytest.raises(ConfigError, match="DeviceMesh"):
            ShmDataLoader(titan_loader, object())
        out["refused"] = refused
        off = Config.from_env(enabled=False)
        tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
        with ShmDataLoader(titan_loader, tp, sp_dims="cp", config=off) as other:
            out["tp"] = (other.dp_world_size, other.dp_rank)  # tp ranks: one replica's data
        ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "cp"))
        with pytest.raises(ConfigError) as err:
            ShmDataLoader(titan_loader, ep, sp_dims="cp", config=off)
        out["ep"] = str(err.value)
        with ShmDataLoader(titan_loader, ep, sp_dims="cp", dp_dims=("ep",), config=off) as other:
            out["ep_dp"] = (other.dp_world_size, other.dp_rank)
    else:
        torch.manual_seed(1000 + rank)  # a new process: nothing of the first run survives
        with adapter() as loader:
            manager, train_state = _manager(loader, folder)
            assert manager.load(step=STOP)
            out["step"] = int(train_state.step)
            it = iter(loader)
            out["resumed"] = [_digest(next(it)) for _ in range(STEPS - STOP)]
            manager.close()
    return out


def test_torchtitan_data_path_shares_across_cp_and_resumes_through_its_checkpoint_manager():
    from torch.distributed.checkpoint import FileSystemReader

    from tests.support.harness import run_ranks

    with tempfile.TemporaryDirectory() as folder:
        kw = {"folder": folder}
        first = run_ranks(titan_phase, 4, kwargs={**kw, "phase": "first"}, timeout=280)
        saved = FileSystemReader(f"{folder}/checkpoint/step-{STOP}").read_metadata()
        second = run_ranks(titan_phase, 4, kwargs={**kw, "phase": "resume"}, timeout=280)
    keys = sorted(k for k in saved.state_dict_metadata if k.startswith("dataloader."))
    assert keys == [f"dataloader.rank{r}" for r in range(4)]  # one per global rank
    for rank in range(4):
        alone, shared = first[rank]["alone"], first[rank]["shared"]
        assert first[rank]["dp"] == (2, rank // 2)
        assert shared == alone, f"rank {rank}: batches differ from torchtitan's own loader"
        assert second[rank]["step"] == STOP
        assert second[rank]["resumed"] == alone[STOP:], f"rank {rank} after the resume"
        assert first[rank]["flat"] == (1, [0, 1, 2, 3])  # sp_dims=("batch", "cp"): one group
        assert first[rank]["tp"] == (1, 0)
        assert first[rank]["ep_dp"] == (2, rank // 2)
    assert first[0]["shared"] == first[1]["shared"]  # CP peers: identical batches
    assert first[2]["shared"] == first[3]["shared"]
    assert first[0]["shared"] != first[2]["shared"]  # DP replicas: different data
    unknown, empty, overlap = first[0]["refused"]
    assert "sp_dims='tp'" in unknown and "DeviceMesh(batch=2, cp=2)" in unknown
    assert "sp_dims=()" in empty
    assert "dp_dims=('cp',)" in overlap and "other than sp_dims" in overlap
    assert "dp_dims=None" in first[0]["ep"] and "['ep']" in first[0]["ep"]

"""A complete, small sequence-parallel training script to copy from.

    torchrun --standalone --nproc-per-node 4 examples/train_sp.py --sp 2 --ckpt /tmp/ckpt
    SHMLOADER=1 torchrun --standalone --nproc-per-node 4 examples/train_sp.py --sp 2 ...

(``torchrun`` is ``.venv/bin/torchrun`` after ``./setup.sh``.)

With ``SHMLOADER=1`` one rank per SP group runs the DataLoader and the others
map its batches from shared memory; without it every rank loads its own. The
losses are bit-identical either way, and so is a run that was stopped
(``--exit-after``, even in the middle of an accumulation window) and resumed
(``--resume``): the loader's checkpoint rewinds data *and* RNG (dropout) to
the last optimizer step, which is what the model and optimizer hold.

The parts:

1. ``init_device_mesh`` with a ``(dp, sp)`` mesh; ``dp_topology`` gives this
   rank's data-parallel size and index (SP peers share one).
2. ``ShardedSampler`` keyed on that DP index: every SP peer of a replica
   draws the same indices, replicas draw disjoint ones.
3. ``ShmLoader(make_loader, group=mesh, mesh_dim="sp", accumulation_steps=k)``.
4. A tiny model with dropout; each SP rank computes on its shard of the
   sequence; gradients are averaged over all ranks.
5. Checkpoints: every rank saves its own file (model, optimizer, loader
   state); a resume loads the rank's own file, or rank 0's when the DP size
   changed (the loader then re-splits the rest of the epoch).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset

from shmloader import ShardedSampler, ShmLoader, dp_topology

VOCAB = 64


class Tokens(Dataset):
    """Variable-length token sequences, deterministic per index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, VOCAB, (16 + 4 * (i % 5),), generator=g)


def collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for row, s in enumerate(samples):
        tokens[row, : len(s)], mask[row, : len(s)] = s, True
    return {"input_ids": tokens, "mask": mask}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(ids)))


def sp_shard(batch: dict, sp_rank: int, sp: int) -> tuple[torch.Tensor, ...]:
    """This SP rank's contiguous chunk of the sequence (inputs, targets, mask)."""
    ids, mask = batch["input_ids"], batch["mask"]
    inputs, targets, valid = ids[:, :-1], ids[:, 1:], mask[:, 1:]
    chunk = -(-inputs.shape[1] // sp)
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return inputs[:, part], targets[:, part], valid[:, part]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt", help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="resume from --ckpt")
    p.add_argument("--exit-after", type=int, help="save and exit after this many micro-batches")
    p.add_argument("--losses", help="rank 0 appends one JSON line per optimizer step here")
    args = p.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.sp, args.sp), mesh_dim_names=("dp", "sp"))
    num_replicas, dp_rank = dp_topology(mesh, sp_dim="sp")
    sp_rank = mesh.get_local_rank("sp")

    torch.manual_seed(0)  # the same initial weights everywhere
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream

    dataset = Tokens(args.samples)
    sampler = ShardedSampler(dataset, num_replicas=num_replicas, rank=dp_rank, seed=0)

    def make_loader() -> DataLoader:  # called on one rank per SP group (SHMLOADER=1)
        return DataLoader(
            dataset, batch_size=2, sampler=sampler, num_workers=args.workers, collate_fn=collate
        )

    loader = ShmLoader(make_loader, group=mesh, mesh_dim="sp", accumulation_steps=args.accum)
    # This model trains on the CPU. On GPUs, ShmLoader(..., device="cuda") delivers
    # every batch already on this rank's device (README: "Batches on the GPU").

    start_epoch, step = 0, 0
    if args.resume:
        with open(os.path.join(args.ckpt, "meta.json")) as f:
            saved_world = json.load(f)["world"]
        # Same world: each rank its own file. Another DP size: rank 0's (a leader's) state.
        source = rank if saved_world == world else 0
        ckpt = torch.load(os.path.join(args.ckpt, f"rank{source}.pt"))  # weights_only=True
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])  # data position and RNG at the step boundary
        start_epoch, step = ckpt["loader"]["epoch"], ckpt["step"]

    micro = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        losses = []
        for batch in loader:
            inputs, targets, valid = sp_shard(batch, sp_rank, args.sp)
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits[valid], targets[valid])
            (loss / args.accum).backward()
            losses.append(loss.detach())
            micro += 1
            if len(losses) == args.accum:  # one optimizer step
                for param in model.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                mean = torch.stack(losses).mean()
                dist.all_reduce(mean)
                losses = []
                if rank == 0 and args.losses:
                    with open(args.losses, "a") as f:
                        print(json.dumps({"step": step, "loss": mean.item() / world}), file=f)
            if micro == args.exit_after:  # preempted: save (maybe mid-window) and stop
                save(args.ckpt, rank, world, model, optimizer, loader, step)
                loader.close()
                dist.destroy_process_group()
                return
    loader.close()
    dist.destroy_process_group()


def save(ckpt: str, rank: int, world: int, model, optimizer, loader, step: int) -> None:
    """Every rank saves its own file. Model and optimizer are those of the last optimizer
    step; the loader's state rewinds data and RNG to that same step."""
    os.makedirs(ckpt, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),
        "step": step,
    }
    torch.save(state, os.path.join(ckpt, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt, "meta.json"), "w") as f:
            json.dump({"world": world}, f)


if __name__ == "__main__":
    main()

"""What both samplers share: their state checks, private generators and the seed broadcast.

Owns validation of a sampler state's common fields (a refused field is a
``ValueError`` naming it), seeding a private CPU generator from a hash (never
the default generator) and rank 0's seed broadcast for ``seed=None``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

MAX_SEED = 2**63 - 1  # fits an int64 tensor (broadcast) and any checkpoint format
MASK64 = 2**64 - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seeded_generator(*parts: int) -> torch.Generator:
    """A private CPU generator seeded from a hash of ``parts`` (never the default one)."""
    h = 0
    for part in parts:
        h = splitmix64(h ^ (part & MASK64))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(h)
    return gen


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_state_head(
    state: object, keys: tuple[str, ...], fmt: str, version: int
) -> tuple[int, int, int]:
    """Validate the fields every sampler state shares; return (epoch, seed, num_replicas).

    ``state`` must be a mapping with exactly ``keys``, of format ``fmt`` and
    version ``version``; a refused field is a ``ValueError`` naming it.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"state={state!r} is not valid: expected a dict from state_dict()")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"sampler state is not valid: missing field(s) {missing}")
    unknown = sorted(str(key) for key in state if key not in keys)
    if unknown:
        raise ValueError(f"sampler state is not valid: unknown field(s) {unknown}")
    if state["format"] != fmt:
        raise ValueError(f"state['format']={state['format']!r} is not valid: expected {fmt!r}")
    check_int("state['version']", state["version"], version, version)
    epoch = check_int("state['epoch']", state["epoch"], 0)
    seed = check_int("state['seed']", state["seed"], 0, MAX_SEED)
    old_n = check_int("state['num_replicas']", state["num_replicas"], 1)
    check_int("state['rank']", state["rank"], 0, old_n - 1)
    return epoch, seed, old_n


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if not is_int(value):
        raise ValueError(f"{name}={value!r} is not valid: expected an int")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value!r} is not valid: expected an int {bound}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not valid: expected a bool")
    return value


def collective_device(group: Any = None) -> torch.device:
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_seed() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "seed=None is not valid here: seed=None needs torch.distributed to be initialised "
            "(rank 0 broadcasts one seed); initialise the process group or pass a seed"
        )
    value = secrets.randbits(63) if dist.get_rank() == 0 else 0
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.broadcast(tensor, src=0)
    return int(tensor.item())

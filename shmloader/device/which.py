"""Which GPU a rank's batches go to, and the one warning about the leader's pinning.

It owns :func:`resolve`, which turns ``device=`` (or ``Config.device``) into
this rank's CUDA device or None for host delivery, ``cuda`` meaning this
rank's GPU (NOTE [which GPU]), and :func:`warn_pin_memory`, said once per
process where a DataLoader's ``pin_memory=True`` copies every batch for
nothing on the device path. It validates through ``shmloader.config`` and
raises ``shmloader.errors.ConfigError``; what it asks of the machine is
``torch.cuda`` (available, how many devices, the current one) and
``os.environ`` (``LOCAL_RANK``), both stand-ins in tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..config import _DEVICE_ACCEPTED, valid_device
from ..errors import ConfigError

log = logging.getLogger(__name__)

_warned_pin = False


def resolve(
    spec: str | torch.device | None,
    default: str = "cpu",
    *,
    cuda: Any = None,
    environ: Mapping[str, str] | None = None,
) -> torch.device | None:
    """The CUDA device batches go to, or None for host delivery (NOTE [which GPU]).

    ``spec`` None means ``default`` (``Config.device``). ``auto`` is ``cuda``
    when ``torch.cuda.is_available()``, else host delivery. ``cuda:N`` is
    device N. ``cuda`` is this rank's GPU: the current device when the script
    made one other than 0 current, else ``cuda:$LOCAL_RANK``. Raises
    ``ConfigError`` for a bad value, a CUDA device this rank does not have,
    or a ``LOCAL_RANK`` beyond the visible GPUs. ``cuda`` and ``environ``
    stand in for ``torch.cuda`` and ``os.environ`` (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    environ = os.environ if environ is None else environ
    value = default if spec is None else spec
    if isinstance(value, torch.device):
        value = str(value)
    if not valid_device(value):
        raise ConfigError("device", value, _DEVICE_ACCEPTED)
    if value == "cpu":
        return None
    if value == "auto":
        if not cuda.is_available():
            return None
        value = "cuda"
    if not cuda.is_available():
        raise ConfigError(
            "device",
            value,
            "'cpu' or 'auto' on this rank: torch.cuda.is_available() is False "
            "('auto' delivers on the GPU where there is one and in host memory elsewhere)",
        )
    count = cuda.device_count()
    if value == "cuda":
        return torch.device("cuda", _this_ranks_gpu(cuda.current_device(), count, environ))
    index = int(value.partition(":")[2])
    if index >= count:
        raise ConfigError("device", value, f"a CUDA device index below {count}")
    return torch.device("cuda", index)


def _this_ranks_gpu(current: int, count: int, environ: Mapping[str, str]) -> int:
    """``device="cuda"`` on one rank.

    NOTE [which GPU]
        ``device="cuda"`` means this rank's GPU. torch keeps no trace of a
        ``torch.cuda.set_device`` call but the current device, and a script
        that set nothing sees ``cuda:0``. So:

        - a current device other than 0 is the script's (or its framework's)
          choice and wins: Lightning's ``Trainer(devices=[2, 3])`` makes
          ``cuda:2``/``cuda:3`` current in DDP children whose ``LOCAL_RANK``
          is 0/1; ``set_device(local_rank + 4)`` uses half a node;
        - current device 0 means ``cuda:$LOCAL_RANK`` when ``LOCAL_RANK`` is
          below ``device_count()`` (torchrun, no ``set_device``); without
          ``LOCAL_RANK`` (no launcher) ``cuda:0``; with ``LOCAL_RANK`` at or
          beyond the count ``cuda:0`` when one GPU is visible
          (``CUDA_VISIBLE_DEVICES`` per rank), else a ``ConfigError`` (more
          ranks on the node than GPUs).

        What this cannot tell apart: a script that makes ``cuda:0`` current
        on a rank whose ``LOCAL_RANK`` is not 0 (``devices=[1, 0]``) gets
        ``cuda:$LOCAL_RANK``; it says ``device="cuda:0"`` (an explicit index
        is taken as it is).
    """
    if current != 0:
        return current  # the script's choice
    raw = environ.get("LOCAL_RANK", "").strip()
    try:
        local = int(raw) if raw else None
    except ValueError:
        local = None
    if local is None or local < 0:
        return 0  # not under a launcher that says
    if local < count:
        return local
    if count == 1:
        return 0  # one visible GPU per rank (CUDA_VISIBLE_DEVICES)
    raise ConfigError(
        "device",
        "cuda",
        f"one GPU for this rank, but LOCAL_RANK={local} and this rank sees only {count} CUDA "
        "devices (more ranks on the node than GPUs?). Give each rank its own GPU "
        "(CUDA_VISIBLE_DEVICES, or torch.cuda.set_device before ShmLoader), or pass "
        "device='cuda:N'",
    )


def warn_pin_memory(loader: object, pool: object = None) -> bool:
    """Say once (per process) that ``pin_memory=True`` is wasted work on the device path.

    Only where the pin thread really copies batches: with the worker pool
    (``pool`` not None) the leader's DataLoader yields slot references, which
    torch's pin thread passes through untouched.
    """
    global _warned_pin
    if getattr(loader, "pin_memory", False) is not True or _warned_pin or pool is not None:
        return False
    _warned_pin = True
    log.warning(
        "shmloader: the leader's DataLoader has pin_memory=True, but with device= the batch "
        "goes to the GPU from the page-locked ring, never from the loader's pinned copy: the "
        "pin thread copies every batch for nothing (about 220 ms per 256 MiB). "
        "Fix: DataLoader(..., pin_memory=False)"
    )
    return True

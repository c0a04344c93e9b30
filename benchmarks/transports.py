"""The ``torch.distributed`` baselines: leader-only loading, batch shipped by torch.distributed.

``broadcast``: the leader sends the batch's skeleton (every tensor replaced by
a :class:`TensorRef`, aliases kept) with ``broadcast_object_list`` (pickle),
then every distinct tensor with ``dist.broadcast`` as a byte payload;
followers allocate each tensor and receive into it.

``objlist``: the whole batch pickled through ``broadcast_object_list``.

Every function returns the batch and the milliseconds spent in the
metadata call (``meta_ms``) and in the tensor broadcasts (``tensor_ms``).

The tree walks are module-level functions with explicit accumulators, not
recursive closures: a recursive closure is a reference cycle that would keep
every tensor it collected alive until the cyclic garbage collector runs.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class TensorRef(NamedTuple):
    """Where a tensor sat in the skeleton: its index in the payload list."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _strip(obj: Any, found: list[torch.Tensor], index: dict[int, int]) -> Any:
    if isinstance(obj, torch.Tensor):
        if id(obj) not in index:
            index[id(obj)] = len(found)
            found.append(obj)
        return TensorRef(index[id(obj)], obj.dtype, tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _strip(v, found, index) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip(v, found, index) for v in obj]
    if type(obj) is tuple:
        return tuple(_strip(v, found, index) for v in obj)
    return obj


def split(batch: Any) -> tuple[Any, list[torch.Tensor]]:
    """The skeleton of ``batch`` and its distinct tensors (one entry per alias group)."""
    found: list[torch.Tensor] = []
    skeleton = _strip(batch, found, {})
    return skeleton, found


def join(obj: Any, found: list[torch.Tensor]) -> Any:
    """Put the received tensors back where the skeleton names them."""
    if isinstance(obj, TensorRef):
        return found[obj.index]
    if isinstance(obj, dict):
        return {k: join(v, found) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join(v, found) for v in obj]
    if type(obj) is tuple:
        return tuple(join(v, found) for v in obj)
    return obj


def refs(obj: Any, out: dict[int, TensorRef] | None = None) -> list[TensorRef]:
    """Every distinct :class:`TensorRef` of a skeleton, in payload order."""
    out = {} if out is None else out
    if isinstance(obj, TensorRef):
        out[obj.index] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            refs(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            refs(v, out)
    return [out[i] for i in sorted(out)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def send_broadcast(batch: Any, group: dist.ProcessGroup, src: int) -> tuple[Any, float, float]:
    """Leader: skeleton by ``broadcast_object_list``, then each tensor's bytes."""
    t0 = time.perf_counter()
    skeleton, found = split(batch)
    dist.broadcast_object_list([skeleton], src=src, group=group)
    t1 = time.perf_counter()
    for t in found:
        if t.numel():
            dist.broadcast(_as_bytes(t), src=src, group=group)
    t2 = time.perf_counter()
    return batch, (t1 - t0) * 1e3, (t2 - t1) * 1e3


def receive_broadcast(group: dist.ProcessGroup, src: int) -> tuple[Any, float, float]:
    """Follower: receive the skeleton, allocate every tensor, receive into it."""
    t0 = time.perf_counter()
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    t1 = time.perf_counter()
    found = []
    for ref in refs(box[0]):
        t = torch.empty(ref.shape, dtype=ref.dtype)
        if t.numel():
            dist.broadcast(t.reshape(-1).view(torch.uint8), src=src, group=group)
        found.append(t)
    t2 = time.perf_counter()
    return join(box[0], found), (t1 - t0) * 1e3, (t2 - t1) * 1e3


def send_objlist(batch: Any, group: dist.ProcessGroup, src: int) -> tuple[Any, float, float]:
    """Leader: the whole batch, tensors included, pickled by ``broadcast_object_list``."""
    t0 = time.perf_counter()
    dist.broadcast_object_list([batch], src=src, group=group)
    return batch, (time.perf_counter() - t0) * 1e3, 0.0


def receive_objlist(group: dist.ProcessGroup, src: int) -> tuple[Any, float, float]:
    """Follower: the whole batch unpickled from ``broadcast_object_list``."""
    t0 = time.perf_counter()
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0], (time.perf_counter() - t0) * 1e3, 0.0

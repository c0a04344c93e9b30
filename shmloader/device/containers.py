"""The walk over a delivered batch's containers, and a leaf's layout as contiguous runs.

It owns :func:`map_tensors`, which rebuilds a batch with every tensor replaced
and every container kept as its own type (NOTE [containers on the device]), and
the block layout the stage copies a leaf by: :func:`blocks` (at most
``MAX_BLOCKS`` contiguous runs) and :func:`align` (where the next leaf starts in
a staging buffer). ``shmloader.device.stage`` walks each batch through it; it
imports nothing of shmloader and touches no device.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch

#: A non-contiguous tensor is copied as this many contiguous blocks at most;
#: beyond it, it is made contiguous on the host and copied from there.
MAX_BLOCKS = 64


# ------------------------------------------------------------------ walk


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; aliases stay aliases.

    NOTE [containers on the device]
        The stage walks every container the codec can deliver or ``select``
        can return, as torch's own ``pin_memory`` does, and rebuilds each as
        its own type: mutable mappings (``dict``, ``OrderedDict``,
        ``defaultdict``, ``UserDict`` subclasses such as Hugging Face's
        ``BatchEncoding``) and mutable sequences as a shallow copy
        (``copy.copy``: a ``defaultdict``'s factory, a ``BatchEncoding``'s
        encodings and attributes stay) with the values replaced; other
        ``collections.abc.Mapping``/``Sequence`` types as
        ``type(obj)(values)``, or a ``dict``/``list`` where that type cannot
        be built from its values; tuples and namedtuples as their type;
        dataclasses field by field. A container with no tensor in it is
        returned as it is, as are strings, bytes, numpy arrays and other
        leaves. The shallow copy can share state with the original only in
        a container type whose copy does (the stage keeps the CPU leaves
        themselves until the copy completed, never through the container).
    """
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if isinstance(obj, str | bytes | bytearray | memoryview):
        return obj
    if isinstance(obj, tuple):
        values = [map_tensors(v, fn, memo) for v in obj]
        if _same(values, obj):
            return obj
        if type(obj) is tuple:
            return tuple(values)
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*values)
        return _rebuild(obj, values, tuple)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn, memo) for k, v in obj.items()}
        if _same(items.values(), obj.values()):
            return obj
        if type(obj) is dict:
            return items
        if isinstance(obj, MutableMapping):
            with contextlib.suppress(Exception):
                clone: Any = copy_module.copy(obj)
                for k, v in items.items():
                    clone[k] = v
                return clone
        return _rebuild(obj, items, dict)
    if isinstance(obj, Sequence):
        values = [map_tensors(v, fn, memo) for v in obj]
        if _same(values, obj):
            return obj
        if type(obj) is list:
            return values
        if isinstance(obj, MutableSequence):
            with contextlib.suppress(Exception):
                clone = copy_module.copy(obj)
                for k, v in enumerate(values):
                    clone[k] = v
                return clone
        return _rebuild(obj, values, list)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]  # not ClassVar / InitVar pseudo-fields
        values = [map_tensors(getattr(obj, name), fn, memo) for name in names]
        if _same(values, [getattr(obj, name) for name in names]):
            return obj
        new = copy_module.copy(obj)
        for name, value in zip(names, values, strict=True):
            object.__setattr__(new, name, value)
        return new
    return obj


def _same(values: Any, originals: Any) -> bool:
    """Whether every mapped value is its original object (nothing in it was a tensor)."""
    return all(v is o for v, o in zip(values, originals, strict=True))


def _rebuild(obj: Any, values: Any, fallback: type) -> Any:
    """``type(obj)(values)``, or ``fallback(values)`` where that type cannot be built so."""
    try:
        return type(obj)(values)
    except Exception:
        return fallback(values)


# ---------------------------------------------------------------- layout


def align(n: int, to: int = 64) -> int:
    """``n`` rounded up to a multiple of ``to``: where the next leaf starts in a staging buffer."""
    return (n + to - 1) // to * to


def blocks(t: torch.Tensor) -> tuple[list[int], int] | None:
    """``t`` as contiguous runs: (element offsets from ``t``'s first element, run length).

    None when it would take more than ``MAX_BLOCKS`` runs.
    """
    shape, stride = list(t.shape), list(t.stride())
    run, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    outer_shape, outer_stride = shape[:k], stride[:k]
    if math.prod(outer_shape) > MAX_BLOCKS:
        return None
    offsets = [
        sum(i * s for i, s in zip(index, outer_stride, strict=True))
        for index in itertools.product(*(range(n) for n in outer_shape))
    ]
    return offsets, run

"""The benchmark workload: long-context multimodal batches of a chosen size.

A batch is one packed sequence of ``SAMPLES`` samples, shaped like what a
vision-language collator hands a sequence-parallel training step::

    input_ids            (1, T)          int64    token ids
    labels               (1, T)          int64    the same tensor object as input_ids
    position_ids         (1, T)          int64    restart at every sample
    cu_seqlens           (SAMPLES + 1,)  int32    sample boundaries
    pixel_values         (P_img, 1176)   bfloat16 image patches (3 x 2 x 14 x 14)
    image_grid_thw       (n_img, 3)      int64
    pixel_values_videos  (P_vid, 1176)   bfloat16 video patches
    video_grid_thw       (n_vid, 3)      int64
    meta                 [dict, ...]     one metadata dict per sample

``T`` grows with the batch (32k tokens at 1 MiB to 512k at 1 GiB); image and
video patches fill the rest of the byte budget (60 % / 40 %).

Two datasets produce it:

- :class:`TemplatedBatches` (transport runs): every item is one whole batch
  to make; its collate, :func:`build`, writes the leaves by tiling small
  pre-generated blocks into tensors it allocates the way ``default_collate``
  does (``UntypedStorage._new_shared``: fresh shared memory inside a
  DataLoader worker, so the batch reaches the main process without a copy).
  Loading a batch costs one write of its bytes and nothing else, so delivery
  measurements are not drowned by decode work. The batch carries
  ``build_ms``, the time that write took (the worker's write into fresh
  shared memory for the base ways, into its ring slot for shmloader's
  zero-copy way: NOTE [collate into the slot] in ``shmloader._workers.collate``).
- :class:`RealisticSamples` (CPU/memory runs): every item is one sample whose
  images and video frames are "decoded" (random pixels at ``decode_scale``
  times the target resolution), resized with ``avg_pool2d``, normalised and
  cut into patches; :func:`pack` collates samples into the batch above.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

MiB = 1 << 20
SAMPLES = 4
PATCH = 14
TEMPORAL = 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH  # 1176 values per patch
IMAGES_PER_SAMPLE = 2
VIDEOS_PER_SAMPLE = 1
VIDEO_FRAMES = 4  # grid t = VIDEO_FRAMES / TEMPORAL
VOCAB = 151_000
#: Batch size (MiB) -> tokens per packed sequence: the largest key <= size wins.
TOKENS_BY_MIB = ((0, 32_768), (16, 65_536), (64, 131_072), (256, 262_144), (1024, 524_288))
#: Largest pre-generated block a templated leaf is tiled from.
BLOCK_BYTES = 4 * MiB


@dataclass(frozen=True)
class BatchSpec:
    """Shapes of one batch: ``tokens`` per sequence, image and video patch grids."""

    tokens: int
    image_grids: tuple[tuple[int, int, int], ...]
    video_grids: tuple[tuple[int, int, int], ...]

    @classmethod
    def for_bytes(cls, target: int) -> BatchSpec:
        """The spec whose payload is close to (at most a few KiB off) ``target`` bytes."""
        mib = target / MiB
        tokens = max(t for m, t in TOKENS_BY_MIB if mib >= m)
        while tokens > 1024 and 16 * tokens > target // 2:
            tokens //= 2
        n_img, n_vid = SAMPLES * IMAGES_PER_SAMPLE, SAMPLES * VIDEOS_PER_SAMPLE
        rest = max(target - 16 * tokens - 4 * (SAMPLES + 1) - 24 * (n_img + n_vid), 0)
        patch_bytes = PATCH_DIM * 2
        img_patches = int(rest * 0.6) // patch_bytes
        vid_patches = (rest - img_patches * patch_bytes) // patch_bytes
        image_grids = _grids(img_patches, n_img, 1)
        video_grids = _grids(vid_patches, n_vid, VIDEO_FRAMES // TEMPORAL)
        return cls(tokens, image_grids, video_grids)

    @property
    def image_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.image_grids)

    @property
    def video_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.video_grids)

    def leaves(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor leaf (``labels`` aliases ``input_ids``)."""
        return {
            "input_ids": ((1, self.tokens), torch.int64),
            "position_ids": ((1, self.tokens), torch.int64),
            "cu_seqlens": ((SAMPLES + 1,), torch.int32),
            "pixel_values": ((self.image_patches, PATCH_DIM), torch.bfloat16),
            "image_grid_thw": ((len(self.image_grids), 3), torch.int64),
            "pixel_values_videos": ((self.video_patches, PATCH_DIM), torch.bfloat16),
            "video_grid_thw": ((len(self.video_grids), 3), torch.int64),
        }

    @property
    def nbytes(self) -> int:
        """Payload bytes of one batch (the alias counted once)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.leaves().values())


def _grids(patches: int, count: int, t: int) -> tuple[tuple[int, int, int], ...]:
    """``count`` (t, h, w) grids of about ``patches`` patches in all (h, w even >= 2)."""
    each = max(patches // (count * t), 4)
    h = max(2, math.isqrt(each) // 2 * 2)
    w = max(2, each // h)
    return tuple((t, h, w) for _ in range(count))


def sample_meta(index: int, sample: int, tokens: int, spec: BatchSpec) -> dict[str, Any]:
    """The per-sample metadata dict a collator carries along."""
    return {
        "id": index * SAMPLES + sample,
        "source": f"shard-{(index + sample) % 97:05d}.tar",
        "num_tokens": tokens,
        "num_images": IMAGES_PER_SAMPLE,
        "num_videos": VIDEOS_PER_SAMPLE,
        "lang": "en" if sample % 3 else "zh",
        "caption": f"sample {sample} of batch {index}",
        "loss_scale": 1.0,
    }


# --------------------------------------------------------------- transport


def _new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor; in shared memory inside a DataLoader worker.

    Inside a worker this is the call ``default_collate`` makes for its output,
    so handing the batch to the main process moves a descriptor, not the bytes.
    """
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _block(dtype: torch.dtype, nbytes: int, seed: int) -> torch.Tensor:
    """A pre-generated block of plausible values, viewed as bytes."""
    g = torch.Generator().manual_seed(seed)
    n = max(nbytes // dtype.itemsize, 1)
    if dtype.is_floating_point:
        values = torch.randn(n, generator=g).to(dtype)
    else:
        values = torch.randint(0, VOCAB, (n,), generator=g, dtype=dtype)
    return values.view(torch.uint8)


def _tile(out: torch.Tensor, block: torch.Tensor) -> None:
    """Fill ``out`` with copies of ``block`` (one write of every byte of ``out``)."""
    flat = out.reshape(-1).view(torch.uint8)
    step = block.numel()
    for start in range(0, flat.numel(), step):
        end = min(start + step, flat.numel())
        flat[start:end].copy_(block[: end - start])


@dataclass(frozen=True)
class Recipe:
    """What :class:`TemplatedBatches` yields: which batch to make (:func:`build` makes it)."""

    dataset: TemplatedBatches
    index: int


class TemplatedBatches(Dataset):
    """``length`` whole batches of ``spec``, each written fresh from small templates.

    Producing a batch costs one write of its bytes into new memory: the
    transport measurements see real, freshly loaded tensors without decode
    work on the 2-core machine. Items are :class:`Recipe` s, made into
    batches by the collate :func:`build` (where a DataLoader allocates a
    batch's memory); :meth:`batch` makes one directly.
    """

    def __init__(self, spec: BatchSpec, length: int) -> None:
        self.spec, self.length = spec, length
        self.blocks = {
            name: _block(dtype, min(BLOCK_BYTES, math.prod(shape) * dtype.itemsize), i)
            for i, (name, (shape, dtype)) in enumerate(spec.leaves().items())
        }

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Recipe:
        return Recipe(self, index)

    def batch(self, index: int) -> dict[str, Any]:
        """Batch ``index``: every leaf written once into memory allocated here."""
        t0 = time.perf_counter_ns()
        leaves = {}
        for name, (shape, dtype) in self.spec.leaves().items():
            leaves[name] = _new_tensor(shape, dtype)
            _tile(leaves[name], self.blocks[name])
        per_sample = self.spec.tokens // SAMPLES
        leaves["cu_seqlens"].copy_(torch.arange(SAMPLES + 1, dtype=torch.int32) * per_sample)
        leaves["image_grid_thw"].copy_(torch.tensor(self.spec.image_grids))
        leaves["video_grid_thw"].copy_(torch.tensor(self.spec.video_grids))
        return {
            "input_ids": leaves["input_ids"],
            "labels": leaves["input_ids"],  # aliased, as many collators do
            "position_ids": leaves["position_ids"],
            "cu_seqlens": leaves["cu_seqlens"],
            "pixel_values": leaves["pixel_values"],
            "image_grid_thw": leaves["image_grid_thw"],
            "pixel_values_videos": leaves["pixel_values_videos"],
            "video_grid_thw": leaves["video_grid_thw"],
            "meta": [sample_meta(index, s, per_sample, self.spec) for s in range(SAMPLES)],
            "build_ms": (time.perf_counter_ns() - t0) / 1e6,
        }


def build(item: Recipe) -> dict[str, Any]:
    """Collate of :class:`TemplatedBatches` (``batch_size=None``): make the batch."""
    return item.dataset.batch(item.index)


# --------------------------------------------------------------- realistic


class RealisticSamples(Dataset):
    """Samples that cost real CPU: token ids plus decoded, resized, patchified media.

    ``decode_scale`` is the knob: each image or frame is "decoded" at
    ``decode_scale`` times its target side, then resized down with
    ``avg_pool2d`` (the work grows with its square).
    """

    def __init__(self, spec: BatchSpec, length: int, decode_scale: int = 2) -> None:
        self.spec, self.length, self.decode_scale = spec, length, decode_scale

    def __len__(self) -> int:
        return self.length * SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        per_sample = self.spec.tokens // SAMPLES
        first_img = (index % SAMPLES) * IMAGES_PER_SAMPLE
        first_vid = (index % SAMPLES) * VIDEOS_PER_SAMPLE
        images = [
            self._media(t, h, w, g)
            for t, h, w in self.spec.image_grids[first_img : first_img + IMAGES_PER_SAMPLE]
        ]
        videos = [
            self._media(t, h, w, g)
            for t, h, w in self.spec.video_grids[first_vid : first_vid + VIDEOS_PER_SAMPLE]
        ]
        return {
            "input_ids": torch.randint(0, VOCAB, (per_sample,), generator=g),
            "pixel_values": torch.cat(images),
            "image_grid_thw": torch.tensor(
                self.spec.image_grids[first_img : first_img + IMAGES_PER_SAMPLE]
            ),
            "pixel_values_videos": torch.cat(videos),
            "video_grid_thw": torch.tensor(
                self.spec.video_grids[first_vid : first_vid + VIDEOS_PER_SAMPLE]
            ),
            "meta": sample_meta(index // SAMPLES, index % SAMPLES, per_sample, self.spec),
        }

    def _media(self, t: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
        """Decode, resize, normalise and patchify ``t * TEMPORAL`` frames -> (t*h*w, 1176)."""
        s = self.decode_scale
        frames = t * TEMPORAL
        raw = torch.rand(frames, 3, h * PATCH * s, w * PATCH * s, generator=g)
        pixels = torch.nn.functional.avg_pool2d(raw, s) if s > 1 else raw
        pixels = ((pixels - 0.5) / 0.25).to(torch.bfloat16)
        grid = pixels.reshape(t, TEMPORAL, 3, h, PATCH, w, PATCH)
        return grid.permute(0, 3, 5, 2, 1, 4, 6).reshape(t * h * w, PATCH_DIM)


def pack(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Collate samples into one packed sequence (the batch layout above)."""
    ids = torch.cat([s["input_ids"] for s in samples]).unsqueeze(0)
    lengths = [s["input_ids"].numel() for s in samples]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return {
        "input_ids": ids,
        "labels": ids,
        "position_ids": positions,
        "cu_seqlens": cu,
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "pixel_values_videos": torch.cat([s["pixel_values_videos"] for s in samples]),
        "video_grid_thw": torch.cat([s["video_grid_thw"] for s in samples]),
        "meta": [s["meta"] for s in samples],
    }


# ------------------------------------------------------------------ loaders


def transport_loader(spec: BatchSpec, length: int, workers: int) -> DataLoader:
    """A DataLoader of ``length`` templated batches (prefetch 1 per worker, to bound memory)."""
    return DataLoader(
        TemplatedBatches(spec, length),
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        collate_fn=build,
        prefetch_factor=1 if workers else None,
    )


def realistic_loader(spec: BatchSpec, length: int, workers: int, decode_scale: int) -> DataLoader:
    """A DataLoader of ``length`` packed batches of CPU-decoded samples."""
    return DataLoader(
        RealisticSamples(spec, length, decode_scale),
        batch_size=SAMPLES,
        shuffle=False,
        num_workers=workers,
        collate_fn=pack,
    )


def tensors(batch: Any) -> list[torch.Tensor]:
    """The distinct tensors of ``batch`` in first-seen order (aliases once).

    Iterative on purpose: a recursive closure would form a reference cycle
    that keeps the found tensors (and a follower's shared mapping) alive
    until the cyclic garbage collector runs.
    """
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [batch]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
        elif isinstance(obj, dict):
            stack.extend(reversed(list(obj.values())))
        elif isinstance(obj, list | tuple):
            stack.extend(reversed(obj))
    return out


def payload_bytes(batch: Any) -> int:
    """Bytes of the distinct tensors of ``batch``."""
    return sum(t.numel() * t.element_size() for t in tensors(batch))

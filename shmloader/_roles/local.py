"""The rank that runs the user's loader: its ``Source``, and the ``Local`` role (sharing off).

``Source`` opens the user's loader, fast-forwards it on a resume, steps it,
records the step boundary and counts its RNG draws (the leader uses it too; NOTE
[limits of exact resume]); ``Local`` iterates it exactly as without shmloader,
warning once about what sharing would refuse (NOTE [sharing off is plain
torch]). It touches the user's loader and sampler and nothing shared; it imports
``codec``, ``base``, ``cursor``, ``rng``, ``arrival`` and ``errors``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import _rng as rng
from .._proto import codec
from .._setup import arrival
from ..errors import UnsupportedBatchError
from .base import Context, log
from .cursor import Boundary, Cursor


class Source:
    """The user's loader: opened, fast-forwarded (a resume) and stepped; its draws counted.

    Reads the ``Cursor`` (epoch, position); writes the ``Boundary``'s loader
    state, epoch-start RNG and step-boundary capture (NOTE [RNG at the step
    boundary], NOTE [RNG at the epoch's start] in ``_rng``).
    """

    def __init__(self, loader: Iterable[Any], cursor: Cursor, boundary: Boundary) -> None:
        self.loader: Iterable[Any] | None = loader
        self.cursor = cursor
        self.boundary = boundary
        self.warned_rng = False
        self.warned_generator = False  # NOTE [limits of exact resume]
        #: whether followers mirror its draws: not with sharing off (``Local``), where
        #: a draw no count explains concerns nobody
        self.followed = True

    def open(self, skip: int, *, at_iter: bool = False) -> tuple[Iterator[Any], int]:
        """``iter()`` the user's loader and fast-forward ``skip`` batches (a resume).

        Returns the iterator and the default-generator draws made so far
        (NOTE [RNG mirroring] in ``_rng``). Skipping replays the skipped batches through
        the loader, so its sampler, workers and RNG end where an
        uninterrupted run would be.
        """
        b = self.boundary
        # the first request of this iteration; ``at_iter``: the user's iter() (Boundary.capture)
        b.capture(self.cursor.delivered, at_iter=at_iter)
        b.just_opened = True
        before = rng.snapshot()
        loader = self.loader
        # NOTE [RNG at the epoch's start] (_rng): a resume reopens the loader with the
        # generators of the saved epoch's start, then puts the step boundary back.
        resumed, b.resume_open = b.resume_open, None
        undo, b.undo = b.undo, None
        seeded = rng.will_consume_base_seed(loader)
        unseeded = False
        if resumed is not None and skip and not stateful(loader):
            self.warn_own_generators(loader)  # NOTE [limits of exact resume]
        if resumed is not None and not stateful(loader):
            if skip and resumed.get("rng") is not None:
                undo = undo or rng.capture()
                rng.restore(resumed["rng"])
                unseeded = seeded and not resumed["seeded"]
            else:
                unseeded = seeded and resumed["reset_next"]
        b.opened = {"epoch": self.cursor.epoch, "rng": rng.capture(), "seeded": seeded}
        if unseeded:
            b.opened["seeded"] = False
            source = rng.iter_without_base_seed(loader)  # type: ignore[arg-type]
        else:
            source = iter(loader)  # type: ignore[arg-type]
        for _ in range(skip):
            try:
                next(source)
            except StopIteration:
                break
        if undo is not None:  # NOTE [RNG at the step boundary] (_rng)
            rng.restore(undo)
        return source, self.count(before)

    def warn_own_generators(self, loader: object) -> None:
        """Once: a mid-epoch resume of a loader whose sampler draws from its own generator.

        NOTE [limits of exact resume]
            A mid-epoch resume is exact because the loader is re-opened with
            the *default* generators of the saved epoch's start and fast-forwarded
            (NOTE [RNG at the epoch's start] in ``_rng``). Two kinds of
            randomness no checkpoint of ours holds, with sharing on and off
            alike, as in plain torch:

            - a ``generator=`` of the DataLoader or of its sampler (a
              ``RandomSampler(generator=g)``): its state at the saved epoch's
              start is not saved, so the resumed epoch's order (and the
              workers' base seed) come from wherever the new process left it;
              other samples are delivered. Warned once here (``generator``
              of the loader, its sampler and its batch sampler's sampler).
            - torchdata's ``StatefulDataLoader`` resumes from its own state,
              which does not hold its workers' generators: random
              augmentation in a worker's ``__getitem__`` differs after the
              resume. Draw it from a generator seeded by (epoch, index).
        """
        if self.warned_generator:
            return
        found = [
            where
            for where, obj in _sources_of_order(loader)
            if isinstance(getattr(obj, "generator", None), torch.Generator)
        ]
        if found:
            self.warned_generator = True
            log.warning(
                "shmloader: resuming mid-epoch a loader whose %s draws from its own generator=: "
                "no checkpoint holds that generator's state, so the resumed epoch delivers other "
                "samples than the uninterrupted run (as plain torch does). For an exact resume "
                "leave generator=None (the default generator is restored) or use "
                "shmloader.ShardedSampler / a StatefulDataLoader (NOTE [limits of exact resume])",
                " and ".join(found),
            )

    def boundary_reached(self) -> None:
        """Before each request: a stateful loader's state at an optimizer-step boundary."""
        b = self.boundary
        if b.at_step_start(self.cursor.delivered) and stateful(self.loader):
            b.loader_state = self.loader.state_dict()  # type: ignore[union-attr]
        if b.just_opened:  # open() captured this request before opening
            b.just_opened = False
        else:
            b.capture(self.cursor.delivered)

    def count(self, before: torch.Tensor) -> int:
        """Default-generator words drawn since ``before`` (``rng.snapshot()``); 0, once
        warned, when they cannot be mirrored (NOTE [RNG mirroring] in ``_rng``)."""
        after = rng.snapshot()
        n = rng.count_draws(before, after)
        if n is None:
            if self.followed and not self.warned_rng:
                self.warned_rng = True
                log.warning(
                    "shmloader: the leader's loader drew from the default torch generator in "
                    "this process in a way its followers cannot replay (%s), so their torch "
                    "randomness differs from sharing off from this batch on. Fix: run that "
                    "randomness in DataLoader workers (num_workers > 0: a worker's draws never "
                    "touch this process's generator), or give it a generator of its own (a "
                    "Hugging Face collator's seed=, a torch.Generator passed as generator=) "
                    "(NOTE [RNG mirroring])",
                    rng.why_uncounted(before, after),
                )
            return 0
        return n

    def state(self) -> Any:
        """A stateful loader's state now, else None."""
        return self.loader.state_dict() if stateful(self.loader) else None  # type: ignore[union-attr]


# NOTE [sharing off is plain torch]
#     With sharing off every rank delivers exactly what its loader yields, as
#     without shmloader: a batch that plain torch accepts (a ``pathlib.Path``,
#     a tensor that requires grad, any object) is never refused. Each batch
#     still runs through the codec's checks (``codec.encode``: metadata only,
#     no payload copy) until the first one sharing would refuse, which is
#     named in one warning carrying the ``UnsupportedBatchError`` that
#     ``SHMLOADER=1`` would raise; later batches are not checked. With sharing
#     on such a batch is refused before anything is written. ``len()`` and
#     ``next()`` after ``close()`` raise the same ``ShmLoaderError`` in both
#     modes. The check must run on what sharing on would check: the collate's
#     own output. With DataLoader workers, sharing on checks it in the worker
#     (``_workers.collate``), but sharing off sees only the copy the worker
#     pickled, whose mappings may have lost state the collate's had
#     (transformers' ``BatchEncoding`` drops its ``n_sequences`` on pickling) or
#     kept it: their extra state is not known here, so each mapping is
#     checked as rebuilt from its items (``_rebuilt``) and only what pickling
#     keeps (types, leaves, a mapping's rebuild) can be named.
class Local:
    """The local role's loop: the user's loader as it is (sharing off)."""

    name = "local"

    def __init__(self, ctx: Context, source: Source, unwarned: arrival.Arrival | None) -> None:
        self.ctx = ctx
        self.source = source
        source.followed = False  # sharing off: no follower mirrors its draws
        # looked at once more when the first iteration starts, in case peers
        # with sharing on marked after this rank (NOTE [set-up marks] in arrival)
        self.unwarned = unwarned
        self.told_unshareable = False  # NOTE [sharing off is plain torch]

    def ready(self) -> None:
        pass

    def iterate(self, it: int, cursor: int, skip: bool) -> Iterator[Any]:
        if self.unwarned is not None:  # NOTE [set-up marks] (arrival)
            unwarned, self.unwarned = self.unwarned, None
            if not unwarned.warned:
                unwarned.check_peers_on()
        return self._loop(cursor if skip else 0)

    def supply(self, it: int, cursor: int, skip: bool) -> None:
        return None

    def _loop(self, skip: int) -> Iterator[Any]:
        ctx, source = self.ctx, self.source
        batches, _ = source.open(skip)
        while True:
            ctx.check_open()
            source.boundary_reached()
            box = []  # NOTE [no batch in the frame] (base)
            try:
                with ctx.check_open.outside():  # NOTE [one owner] (base)
                    box.append(next(batches))
            except StopIteration:
                ctx.cursor.finish()
                return
            if not self.told_unshareable:  # NOTE [sharing off is plain torch]
                try:
                    made = _rebuilt(box[0]) if from_workers(source.loader) else box[0]
                    codec.encode(made, allow_pickle=ctx.config.allow_pickle)
                except UnsupportedBatchError as exc:
                    self.told_unshareable = True
                    log.warning(
                        "shmloader: sharing is off, so this batch is delivered as the loader "
                        "made it; with SHMLOADER=1 it would be refused: %s",
                        exc,
                    )
            ctx.cursor.count()
            yield box.pop()

    def set_epoch(self, epoch: int) -> None:
        if self.source.loader is not None:
            forward_set_epoch(self.source.loader, epoch)

    def close(self) -> None:
        pass

    def closers(self) -> list[Callable[[], None]]:
        return []

    def stats(self) -> dict[str, Any]:
        return {}


def from_workers(loader: object) -> bool:
    """Whether ``loader``'s batches are copies pickled from DataLoader workers."""
    return isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0


def _rebuilt(batch: Any) -> Any:
    """``batch`` with each mapping but a dict rebuilt from its items, as a follower
    rebuilds it (NOTE [sharing off is plain torch]); the rest as it is."""
    if type(batch) in (list, tuple):
        return type(batch)(_rebuilt(v) for v in batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_rebuilt(v) for v in batch))
    if type(batch) is dict:
        return {k: _rebuilt(v) for k, v in batch.items()}
    if isinstance(batch, Mapping):
        items = {k: _rebuilt(v) for k, v in batch.items()}
        try:
            return codec.rebuild_mapping(
                type(batch), items, getattr(batch, "default_factory", None)
            )
        except Exception:  # the codec names why it cannot be rebuilt
            return batch
    return batch


def stateful(loader: object) -> bool:
    """Whether ``loader`` has ``state_dict`` and ``load_state_dict`` (torchdata's
    ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _sources_of_order(loader: object) -> list[tuple[str, object]]:
    """The loader and the samplers it draws its order from, named."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    named = [
        ("DataLoader", loader),
        ("sampler", getattr(loader, "sampler", None)),
        ("batch_sampler", batch_sampler),
        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None)),
    ]
    seen: set[int] = set()
    out = []
    for where, obj in named:
        if obj is not None and id(obj) not in seen:
            seen.add(id(obj))
            out.append((where, obj))
    return out


def forward_set_epoch(loader: object, epoch: int) -> None:
    """Call ``set_epoch`` on the loader and on its sampler(s), once each."""
    targets: list[object] = [loader]
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    targets += [sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    done: set[int] = set()
    for target in targets:
        fn = getattr(target, "set_epoch", None)
        if target is not None and callable(fn) and id(target) not in done:
            done.add(id(target))
            fn(epoch)

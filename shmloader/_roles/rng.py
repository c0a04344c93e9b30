"""Keeping every rank's default CPU generator where sharing-off would leave it.

It owns counting and mirroring draws (``count_draws``, ``mirror_draws``: NOTE
[RNG mirroring]; the factory's words, NOTE [factory draws]) and the captures of
the default generators at a step boundary and at the epoch's start that
checkpoints carry (``capture``, ``check``, ``restore``: NOTE [RNG at the step
boundary], NOTE [RNG at the epoch's start]). It touches only torch's, Python's
and numpy's default generators and imports only ``errors``.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

from .._proto.wire import MAX_COUNTED_DRAWS, MAX_MIRRORED_DRAWS

# NOTE [RNG mirroring]
#     Without shmloader every SP rank runs its own DataLoader, and PyTorch draws
#     from the rank's *default* CPU generator while doing so: one int64 base seed
#     each time an underlying iterator is created (first ``iter()``; again every
#     epoch unless workers are persistent), plus, with a ``RandomSampler`` that
#     has no generator of its own, one int64 seed per epoch for the shuffle.
#     With sharing on, followers create no iterator, so they must make the same
#     draws themselves (draw once, discard) and nothing else; otherwise every
#     later ``torch.rand`` in training (dropout, augmentation) shifts.
#
#     The leader does not guess how many draws happened: it snapshots the
#     default generator around each ``iter()`` and ``next()`` of its loader and
#     counts the int64 draws that turn the old state into the new one
#     (``count_draws``). The count travels with every BATCH and END message and
#     followers replay it (``mirror_draws``) before they hand the batch over.
#     ``will_consume_base_seed`` states PyTorch's rule for the base seed; its
#     truth-table test is what catches a PyTorch upgrade that changes the rule.
#
#     Counting is in units of one int64 draw, and what followers must match is
#     the generator's *state*: any draw that advances the state as far as n
#     int64 draws do is mirrored exactly by n int64 draws. Not covered:
#     randomness the leader's loader draws in the main process that advances
#     the state by no whole number of int64 draws (some ``torch.rand`` sizes in
#     a ``collate_fn`` run with ``num_workers=0``); the count then comes back
#     ``None``, the leader warns once, and followers cannot mirror it. That
#     randomness is the user's: move it into workers or give it its own
#     generator. Draws inside worker processes never touch the main process's
#     generator and need no mirroring. What ``make_loader`` itself draws on the
#     leader is mirrored once, at set-up (NOTE [factory draws]).
# the bounds are the messages' (a draw count travels in them): ``_proto.wire``


def will_consume_base_seed(loader: object) -> bool:
    """Whether the next ``iter(loader)`` draws a base seed from the default generator.

    PyTorch's rule (``torch.utils.data.DataLoader.__iter__`` and
    ``_BaseDataLoaderIter.__init__``): a new underlying iterator draws one
    int64 from ``loader.generator``, the default generator when that is None.
    A new iterator is made on every ``iter()``, except with persistent workers
    (``num_workers > 0``), where it is made once and then only reset.
    """
    if not isinstance(loader, torch.utils.data.DataLoader):
        return False
    if loader.generator is not None:
        return False
    if loader.persistent_workers and loader.num_workers > 0:
        return getattr(loader, "_iterator", None) is None
    return True


def reuses_workers(loader: object) -> bool:
    """Whether the next ``iter(loader)`` resets persistent workers instead of drawing a seed.

    True for a ``DataLoader`` drawing from the default generator whose
    persistent workers already run: its next ``iter()`` draws no base seed
    (``will_consume_base_seed`` is False) where a fresh one would.
    """
    return (
        isinstance(loader, torch.utils.data.DataLoader)
        and loader.generator is None
        and not will_consume_base_seed(loader)
    )


def iter_without_base_seed(loader: torch.utils.data.DataLoader) -> Any:
    """``iter(loader)`` whose workers' base seed does not come from the default generator.

    NOTE [RNG at the epoch's start]: a resumed process makes its persistent
    workers anew where the uninterrupted run only reset them; the reset drew
    no base seed, so neither may the resumed ``iter()``, or the sampler's
    shuffle seed (the next draw) would shift. The base seed comes from a
    private generator instead, derived from the default generator's state
    (deterministic: the draw after the one the shuffle seed takes).
    """
    private = torch.Generator()
    private.set_state(torch.get_rng_state())
    torch.empty((), dtype=torch.int64).random_(generator=private)  # the shuffle seed's value
    loader.generator = private
    try:
        return iter(loader)
    finally:
        loader.generator = None


def snapshot() -> torch.Tensor:
    return torch.get_rng_state()


def count_draws(before: torch.Tensor, after: torch.Tensor) -> int | None:
    """How many int64 ``random_()`` draws turn ``before`` into ``after``.

    ``None`` when no count up to ``MAX_COUNTED_DRAWS`` does (another kind of
    draw happened).
    """
    if torch.equal(before, after):
        return 0
    g = torch.Generator()
    g.set_state(before)
    probe = torch.empty((), dtype=torch.int64)
    for n in range(1, MAX_COUNTED_DRAWS + 1):
        probe.random_(generator=g)
        if torch.equal(g.get_state(), after):
            return n
    return None


def mirror_draws(n: int) -> None:
    """Make ``n`` int64 draws from the default generator and discard them.

    ``n`` comes from a peer's message: anything outside
    ``0..MAX_MIRRORED_DRAWS`` is a :class:`ProtocolError`, never a long loop.
    """
    if not 0 <= n <= MAX_MIRRORED_DRAWS:
        from ..errors import ProtocolError

        raise ProtocolError(
            f"a peer asked for {n} generator draws; a message carries 0..{MAX_MIRRORED_DRAWS}"
        )
    if n > 0:
        probe = torch.empty((), dtype=torch.int64)
        for _ in range(n):
            probe.random_()


# -------------------------------------------------------------- the factory
#
# NOTE [factory draws]
#     ``make_loader`` runs on the leader only (``build._agree_on_loader``),
#     and a factory may draw from the default generators while it builds:
#     torchdata's ``StatefulDataLoader(shuffle=True)`` seeds its sampler from
#     torch's generator in the constructor, a ``random_split`` or a
#     ``randperm`` subset draws hundreds or thousands of words, a
#     ``random.shuffle`` of a file list draws from Python's. Sharing off, every
#     rank ran its own factory and made those draws. So the leader snapshots
#     torch's, Python's and numpy's default generators around the factory
#     (``snapshot_all``), counts the 32-bit words each advanced by
#     (``count_words``) and broadcasts the counts with the loader's length;
#     every other rank draws as many words and discards them
#     (``mirror_words``) before its ``ShmLoader`` exists.
#
#     The three generators are Mersenne Twisters of 624 words whose state
#     holds the index of the next word: a count must agree with the index
#     modulo 624, so only those counts are tried (one bulk draw of 624 words
#     per candidate), up to ``MAX_FACTORY_WORDS``. The layout of torch's
#     state (the index at byte 16) is checked by ``tests/unit/test_rng.py``; a
#     draw that is no whole number of words (``torch.randn``'s cached
#     normal, Python's ``gauss``) counts as ``None``: the leader warns once
#     and followers mirror nothing for that generator.

#: Most 32-bit words counted (and mirrored) per generator for one factory call.
MAX_FACTORY_WORDS = 1 << 24
_MT_WORDS = 624
_TORCH_INDEX_AT = 16  # bytes: CPUGeneratorImplStateLegacy.next (after the seed, left, seeded)
_CHUNK = 1 << 20  # words per bulk draw when mirroring


def _torch_index(state: torch.Tensor) -> int:
    return int.from_bytes(bytes(state[_TORCH_INDEX_AT : _TORCH_INDEX_AT + 8].tolist()), "little")


class _Torch:
    name = "torch"

    @staticmethod
    def state() -> Any:
        return torch.get_rng_state()

    @staticmethod
    def index(state: Any) -> int:
        return _torch_index(state)

    @staticmethod
    def probe(state: Any) -> Any:
        g = torch.Generator()
        g.set_state(state)
        return g

    @staticmethod
    def advance(g: Any, n: int) -> None:
        torch.empty(n, dtype=torch.int32).random_(generator=g)  # one word per element

    @staticmethod
    def probe_state(g: Any) -> Any:
        return g.get_state()

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return torch.equal(a, b)

    @staticmethod
    def draw(n: int) -> None:
        torch.empty(n, dtype=torch.int32).random_()


class _Python:
    name = "python"

    @staticmethod
    def state() -> Any:
        return random.getstate()

    @staticmethod
    def index(state: Any) -> int:
        return int(state[1][-1])

    @staticmethod
    def probe(state: Any) -> Any:
        r = random.Random()
        r.setstate(state)
        return r

    @staticmethod
    def advance(r: Any, n: int) -> None:
        r.getrandbits(32 * n)  # ceil(k / 32) words

    @staticmethod
    def probe_state(r: Any) -> Any:
        return r.getstate()

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return a == b

    @staticmethod
    def draw(n: int) -> None:
        random.getrandbits(32 * n)


class _Numpy:
    name = "numpy"

    @staticmethod
    def state() -> Any:
        return np.random.get_state()

    @staticmethod
    def index(state: Any) -> int:
        return int(state[2])

    @staticmethod
    def probe(state: Any) -> Any:
        r = np.random.RandomState()
        r.set_state(state)
        return r

    @staticmethod
    def advance(r: Any, n: int) -> None:
        r.randint(0, 1 << 32, size=n, dtype=np.uint32)  # the full range: one word each

    @staticmethod
    def probe_state(r: Any) -> Any:
        return r.get_state()

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])

    @staticmethod
    def draw(n: int) -> None:
        np.random.randint(0, 1 << 32, size=n, dtype=np.uint32)


_GENERATORS = (_Torch, _Python, _Numpy)
#: The generators a factory's draws are counted for, by name.
GENERATORS = tuple(g.name for g in _GENERATORS)


def snapshot_all() -> dict[str, Any]:
    """The default generators' states before a factory call (NOTE [factory draws])."""
    return {g.name: g.state() for g in _GENERATORS}


def count_words(before: dict[str, Any], limit: int = MAX_FACTORY_WORDS) -> dict[str, int | None]:
    """32-bit words each default generator advanced by since ``before`` (``snapshot_all``).

    ``None`` for a generator no word count up to ``limit`` explains
    (NOTE [factory draws]). Never touches the default generators.
    """
    counts: dict[str, int | None] = {}
    for g in _GENERATORS:
        old, new = before[g.name], g.state()
        if g.same(old, new):
            counts[g.name] = 0
            continue
        counts[g.name] = None
        n = (g.index(new) - g.index(old)) % _MT_WORDS
        probe = g.probe(old)
        if n:
            g.advance(probe, n)
        while n <= limit:
            if n and g.same(g.probe_state(probe), new):
                counts[g.name] = n
                break
            g.advance(probe, _MT_WORDS)
            n += _MT_WORDS
    return counts


def mirror_words(counts: object) -> None:
    """Draw ``counts[name]`` words from each default generator and discard them.

    ``counts`` comes from the leader's message: anything but a dict of the
    known generators' names to ints in ``0..MAX_FACTORY_WORDS`` is a
    :class:`ProtocolError`, never a long loop.
    """
    from ..errors import ProtocolError

    if not isinstance(counts, dict) or not set(counts) <= set(GENERATORS):
        raise ProtocolError(f"factory draws {counts!r}: expected a dict over {GENERATORS}")
    for g in _GENERATORS:
        n = counts.get(g.name, 0)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_FACTORY_WORDS:
            raise ProtocolError(
                f"the leader asked for {n!r} {g.name} words; a factory's count is "
                f"0..{MAX_FACTORY_WORDS}"
            )
        while n > 0:
            step = min(n, _CHUNK)
            g.draw(step)
            n -= step


# ------------------------------------------------------------------ checkpoints
#
# NOTE [RNG at the step boundary]
#     A checkpoint's cursor is rounded down to the start of the optimizer step
#     (``accumulation_steps``), so a resumed run replays the micro-batches of a
#     partly done step. For dropout to replay them identically, the default
#     generators must be where they were when that step's first micro-batch
#     was *requested* (before the loader's own draws for it), not where they
#     are when ``state_dict()`` is called. Every rank therefore captures them
#     (``capture``) at each request of a step's first micro-batch, and
#     ``ShmLoader.state_dict()`` carries that capture (or the generators as
#     they are, when called at a boundary). ``load_state_dict`` restores it
#     when the next iteration starts; a resume in mid-epoch also undoes the
#     draws the resumed loader makes while it is re-opened and fast-forwarded,
#     since the uninterrupted run made those at the start of the epoch.
#
#     Captured: torch's default CPU generator, Python's ``random``, numpy's
#     legacy global generator and, when CUDA is initialised, the current
#     device's CUDA generator. Stored as tensors, ints and floats only, so a
#     checkpoint loads with ``torch.load(weights_only=True)``.


# NOTE [RNG at the epoch's start]
#     The step-boundary capture is not what the resumed loader must be opened
#     with. ``iter()`` of a DataLoader draws from the default generator at the
#     start of the epoch (the workers' base seed, a ``RandomSampler``'s shuffle
#     seed) and the fast-forward replays the epoch's batches from there (with
#     workers: the same samples in the same workers, so their own generators
#     advance as they did). So the leader (every rank with sharing off)
#     captures the generators just before each ``iter()`` of its loader
#     (``local.Source.open``), with whether that ``iter()`` drew a base seed, and a
#     mid-epoch ``state_dict()`` carries both (``opened``). A resume restores
#     them in this order: the epoch's start, ``iter()`` (without the base seed
#     when the uninterrupted run only reset persistent workers:
#     ``iter_without_base_seed``), the fast-forward, then the step boundary
#     for the user (or, when the state's ``rng`` was dropped, the generators
#     as the user left them). The fast-forward's net draws are nil, so
#     followers mirror none. ``reset_next`` says whether the uninterrupted
#     run's *next* ``iter()`` would have reset persistent workers, for a resume
#     that starts the next epoch instead of the saved one.
#
#     Not recoverable: the generators inside persistent workers carry their
#     state from one epoch into the next and no checkpoint holds them, so
#     after a resume in a later epoch their draws (random augmentation in
#     ``__getitem__``) are those of fresh workers. Ids and the main process's
#     draws are still exact. Draw per-sample randomness from a generator seeded
#     by (epoch, index) to make it exact there too.


def capture() -> dict[str, Any]:
    """The default generators' states (NOTE [RNG at the step boundary])."""
    version, internal, gauss = random.getstate()
    # the legacy tuple (numpy's stubs type the default as a dict or that tuple)
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    keys, pos, has_gauss, cached = legacy[1:]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def check(state: object) -> str | None:
    """What is wrong with a captured state, or None when ``restore`` will accept it."""
    if not isinstance(state, dict):
        return "a dict from shmloader's state_dict()"
    torch_state = state.get("torch")
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        return "a dict whose 'torch' entry is a uint8 tensor (torch.get_rng_state())"
    py, npy = state.get("python"), state.get("numpy")
    if not isinstance(py, dict) or not isinstance(py.get("internal"), torch.Tensor):
        return "a dict whose 'python' entry holds random.getstate()"
    if not isinstance(npy, dict) or not isinstance(npy.get("keys"), torch.Tensor):
        return "a dict whose 'numpy' entry holds numpy.random.get_state()"
    return None


def restore(state: dict[str, Any]) -> None:
    """Set the default generators to a ``capture()`` (validated with ``check``)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, npy["pos"], npy["has_gauss"], npy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], device=state.get("cuda_device", 0))

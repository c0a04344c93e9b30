"""Keeping every rank's default CPU generator where sharing-off would leave it.

It owns counting and mirroring draws (``count_draws``, ``mirror_draws``: NOTE
[RNG mirroring], counted in words: NOTE [counting words]; the factory's draws,
``factory_draws``/``follow_factory``: NOTE [factory draws]) and the captures of
the default generators at a step boundary and at the epoch's start that
checkpoints carry (``capture``, ``check``, ``restore``: NOTE [RNG at the step
boundary], NOTE [RNG at the epoch's start]). It touches only torch's, Python's
and numpy's default generators and imports only ``wire``'s bounds and ``errors``.
"""

from __future__ import annotations

import base64
import random
from typing import Any, cast

import numpy as np
import torch

from ._proto.wire import MAX_COUNTED_DRAWS, MAX_MIRRORED_DRAWS

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
#     counts the words of its stream that turn the old state into the new one
#     (``count_draws``). The count travels with every BATCH and END message and
#     followers replay it (``mirror_draws``) before they hand the batch over.
#     ``will_consume_base_seed`` states PyTorch's rule for the base seed; its
#     truth-table test is what catches a PyTorch upgrade that changes the rule.
#
#     Counting is in 32-bit words of the generator's stream, and what
#     followers must match is the generator's *state*: any draw made of whole
#     words (an int64 seed takes 2; ``torch.rand``/``randint``/``bernoulli``
#     on CPU one per value, as in a ``DataCollatorForLanguageModeling`` run
#     in the main process) is mirrored exactly by as many words, found from
#     the two states without replaying them one by one (NOTE [counting
#     words]). Not covered: a draw that leaves a cached normal in the state
#     (``torch.randn`` of fewer than 16 values), a reseed, or more than
#     ``MAX_COUNTED_DRAWS`` words for one batch; the count then comes back
#     ``None`` and the leader warns once, with the cause and the remedy:
#     run that randomness in DataLoader workers (their draws never touch the
#     main process's generator and need no mirroring) or give it a
#     generator of its own (a collator's ``seed=``, a ``generator=``). What
#     ``make_loader`` itself draws on the leader is mirrored once, at set-up
#     (NOTE [factory draws]).
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
    """How many 32-bit words of the default torch generator turn ``before`` into ``after``.

    ``None`` when no count up to ``MAX_COUNTED_DRAWS`` does; ``why_uncounted``
    says why (NOTE [RNG mirroring]). Never touches the default generator.
    """
    return _count(_Torch, before, after, MAX_COUNTED_DRAWS)


def why_uncounted(before: torch.Tensor, after: torch.Tensor) -> str:
    """Why ``count_draws(before, after)`` is None, in words a user can act on."""
    return _why(_Torch, before, after, MAX_COUNTED_DRAWS)


def mirror_draws(n: int) -> None:
    """Draw ``n`` 32-bit words from the default torch generator and discard them.

    ``n`` comes from a peer's message: anything outside
    ``0..MAX_MIRRORED_DRAWS`` is a :class:`ProtocolError`, never a long loop.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_MIRRORED_DRAWS:
        from .errors import ProtocolError

        raise ProtocolError(
            f"a peer asked for {n!r} generator draws (32-bit words); a message carries "
            f"0..{MAX_MIRRORED_DRAWS}"
        )
    _Torch.draw(n)


# -------------------------------------------------------------- the generators
#
# NOTE [counting words]
#     torch's default CPU generator, Python's ``random`` and numpy's legacy
#     global generator are all Mersenne Twisters: 624 32-bit key words and the
#     index of the next word to hand out; at index 624 the next draw first
#     "twists" the keys into the next block of 624. Every draw made of whole
#     words (an int64 seed takes 2, a float or a bounded int 1, a double 2)
#     only moves (keys, index) along that one stream; anything else shows in
#     the state's other fields (a cached normal: ``torch.randn`` of fewer than
#     16 values, ``random.gauss``, numpy's ``standard_normal``; torch's
#     initial seed: ``manual_seed``), or lands in a state that no count
#     reaches (a seed or ``set_state`` without a new initial seed).
#
#     ``_count`` finds the number of words between two states without
#     drawing them one by one: with the same keys it is the difference of
#     the indexes; otherwise the later keys are one block of the stream after
#     the earlier ones, and a block's outputs are its keys, tempered. A
#     scratch numpy ``RandomState`` loaded with the earlier (keys, index)
#     (the same twist and tempering as torch's and Python's) hands out the
#     rest of the current block, then whole blocks in bulk until one equals
#     the later keys tempered (all 624 words), up to a limit: ``MAX_COUNTED_DRAWS``
#     for one batch, ``MAX_FACTORY_WORDS`` for the factory. The count is then
#     exact: same keys, same index, same other fields. The layout of torch's
#     state (seed, index, keys, normal cache) is pinned by
#     ``tests/unit/test_rng.py``.

_MT_WORDS = 624
_CHUNK = 1 << 20  # words per bulk draw
_T_SEED = slice(0, 8)  # torch's CPUGeneratorImplStateLegacy: the initial seed
_T_SEEDED = slice(12, 16)  # ... ``seeded`` (``left`` at 8..12 moves with every word)
_TORCH_INDEX_AT = 16  # bytes: ``next``, the index of the next word
_T_KEYS = slice(24, 24 + 8 * _MT_WORDS)  # the 624 key words, as uint64
_T_REST = slice(24 + 8 * _MT_WORDS, None)  # the cached normals (double and float)


def _torch_index(state: torch.Tensor) -> int:
    return int.from_bytes(bytes(state[_TORCH_INDEX_AT : _TORCH_INDEX_AT + 8].tolist()), "little")


def _temper(keys: np.ndarray) -> np.ndarray:
    """MT19937's output for each key word."""
    y = keys.astype(np.uint32)
    y ^= y >> np.uint32(11)
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    y ^= y >> np.uint32(18)
    return y


def _words(g: Any, n: int) -> None:
    """Draw ``n`` words from ``g.draw_chunk`` in chunks (bounded memory)."""
    while n > 0:
        step = min(n, _CHUNK)
        g.draw_chunk(step)
        n -= step


class _Torch:
    name = "torch"
    remedy = "torch.Generator() passed as generator="

    @staticmethod
    def state() -> Any:
        return torch.get_rng_state()

    @staticmethod
    def set(state: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def mt(state: Any) -> tuple[np.ndarray, int]:
        raw = state.numpy().tobytes()
        keys = np.frombuffer(raw[_T_KEYS], "<u8").astype(np.uint32)
        return keys, _torch_index(state) or _MT_WORDS  # 0: just seeded, twists first

    @staticmethod
    def rest(state: Any) -> bytes:
        raw = state.numpy().tobytes()
        return raw[_T_SEED] + raw[_T_SEEDED] + raw[_T_REST]

    @staticmethod
    def reseeded(old: Any, new: Any) -> bool:
        return _torch_index(new) == 0 or bool(torch.any(old[_T_SEED] != new[_T_SEED]))

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return torch.equal(a, b)

    @staticmethod
    def draw_chunk(n: int) -> None:
        torch.empty(n, dtype=torch.int32).random_()  # one word per element

    @classmethod
    def draw(cls, n: int) -> None:
        _words(cls, n)

    @staticmethod
    def encode(state: Any) -> Any:
        return base64.b64encode(state.numpy().tobytes()).decode()

    @staticmethod
    def decode(obj: Any) -> Any:
        raw = base64.b64decode(obj, validate=True) if isinstance(obj, str) else b""
        want = len(torch.get_rng_state())
        if len(raw) != want:
            raise ValueError(f"{len(raw)} bytes where torch's state has {want}")
        state = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        torch.Generator().set_state(state)  # torch's own checks
        return state


class _Python:
    name = "python"
    remedy = "random.Random(seed)"

    @staticmethod
    def state() -> Any:
        return random.getstate()

    @staticmethod
    def set(state: Any) -> None:
        random.setstate(state)

    @staticmethod
    def mt(state: Any) -> tuple[np.ndarray, int]:
        return np.array(state[1][:-1], dtype=np.uint32), int(state[1][-1])

    @staticmethod
    def rest(state: Any) -> tuple:
        return (state[0], state[2])

    @staticmethod
    def reseeded(old: Any, new: Any) -> bool:
        return False

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return a == b

    @staticmethod
    def draw_chunk(n: int) -> None:
        random.getrandbits(32 * n)  # n words

    @classmethod
    def draw(cls, n: int) -> None:
        _words(cls, n)

    @staticmethod
    def encode(state: Any) -> Any:
        return [state[0], list(state[1]), state[2]]

    @staticmethod
    def decode(obj: Any) -> Any:
        version, internal, gauss = obj
        state = (version, tuple(internal), gauss)
        random.Random().setstate(state)  # Python's own checks
        if not all(type(w) is int for w in internal):
            raise ValueError("key words that are not ints")
        return state


class _Numpy:
    name = "numpy"
    remedy = "np.random.default_rng(seed)"

    @staticmethod
    def state() -> Any:
        return np.random.get_state()

    @staticmethod
    def set(state: Any) -> None:
        np.random.set_state(state)

    @staticmethod
    def mt(state: Any) -> tuple[np.ndarray, int]:
        return np.asarray(state[1], dtype=np.uint32), int(state[2])

    @staticmethod
    def rest(state: Any) -> tuple:
        return (state[0], int(state[3]), float(state[4]))

    @staticmethod
    def reseeded(old: Any, new: Any) -> bool:
        return False

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])

    @staticmethod
    def draw_chunk(n: int) -> None:
        np.random.randint(0, 1 << 32, size=n, dtype=np.uint32)  # the full range: one word each

    @classmethod
    def draw(cls, n: int) -> None:
        _words(cls, n)

    @staticmethod
    def encode(state: Any) -> Any:
        return [state[0], [int(w) for w in state[1]], int(state[2]), int(state[3]), state[4]]

    @staticmethod
    def decode(obj: Any) -> Any:
        name, keys, pos, has_gauss, cached = obj
        if not all(type(w) is int and 0 <= w < 1 << 32 for w in keys):
            raise ValueError("key words that are not 32-bit ints")
        state = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(state)  # numpy's own checks
        return state


_GENERATORS = (_Torch, _Python, _Numpy)
#: The generators a factory's draws are mirrored for, by name.
GENERATORS = tuple(g.name for g in _GENERATORS)


def _count(g: Any, old: Any, new: Any, limit: int) -> int | None:
    """Words of generator ``g`` from state ``old`` to ``new``, or None (NOTE [counting words])."""
    if g.same(old, new):
        return 0
    if g.rest(old) != g.rest(new) or g.reseeded(old, new):
        return None
    (keys0, i0), (keys1, i1) = g.mt(old), g.mt(new)
    if np.array_equal(keys0, keys1):
        n = i1 - i0
        return n if 0 < n <= limit else None
    engine = np.random.RandomState()
    engine.set_state(("MT19937", keys0, i0, 0, 0.0))
    n = _MT_WORDS - i0  # the rest of the current block
    engine.randint(0, 1 << 32, size=n, dtype=np.uint32)
    target = _temper(keys1)
    blocks = 4
    while n + i1 <= limit:
        take = min(blocks, (limit - i1 - n) // _MT_WORDS + 1)
        out = engine.randint(0, 1 << 32, size=take * _MT_WORDS, dtype=np.uint32)
        hit = np.flatnonzero((out.reshape(take, _MT_WORDS) == target).all(axis=1))
        if hit.size:
            n += int(hit[0]) * _MT_WORDS + i1
            return n if n <= limit else None
        n += take * _MT_WORDS
        blocks = min(blocks * 2, _CHUNK // _MT_WORDS)
    return None


def _why(g: Any, old: Any, new: Any, limit: int) -> str:
    """Why ``_count(g, old, new, limit)`` is None."""
    if g.reseeded(old, new):
        return f"{g.name}'s generator was seeded (manual_seed) in between"
    if g.rest(old) != g.rest(new):
        return (
            "a draw of no whole number of words left a cached normal in the state "
            "(torch.randn/normal_ of fewer than 16 values, random.gauss, numpy's "
            "standard_normal)"
        )
    return (
        f"no count up to {limit} 32-bit words explains the new state: a larger draw, or "
        "the generator was seeded or set (set_rng_state, random.seed, np.random.seed) in between"
    )


# -------------------------------------------------------------- the factory
#
# NOTE [factory draws]
#     ``make_loader`` runs on the leader only (``build._agree_on_loader``),
#     and a factory may draw from the default generators while it builds:
#     torchdata's ``StatefulDataLoader(shuffle=True)`` seeds its sampler from
#     torch's generator in the constructor, a ``random_split`` or a
#     ``randperm`` subset draws as many words as the dataset has samples
#     (tens of millions for a pretraining corpus), a ``random.shuffle`` of a
#     file list draws from Python's. Sharing off, every rank ran its own
#     factory and made those draws from its own generators. So the leader
#     snapshots torch's, Python's and numpy's default generators around the
#     factory (``snapshot_all``) and sends, for each one the factory moved,
#     its state before and after (``factory_draws``) with the loader's
#     length. Every other rank, before its ``ShmLoader`` exists
#     (``follow_factory``), per generator:
#
#     - in the very state the leader's was in before (the ranks seeded
#       alike): takes the leader's state after. Sharing off it would have
#       made the same draws from the same state and ended there: exact for
#       any draw, of any size or kind (a cached normal, a reseed included).
#     - in another state (seeded per rank, ``seed + rank``): draws as many
#       32-bit words as lie between the leader's two states (NOTE [counting
#       words], up to ``MAX_FACTORY_WORDS``; the count is made here, on the
#       rank that needs it). Exact where the factory's draws take a fixed
#       number of words whatever the state: torch's ``randperm``,
#       ``random_split``, ``random_``/``rand``/``randint``, seeds, which are
#       taken to. Python's ``shuffle``/``randrange``/``choice``/``sample`` and
#       numpy's ``permutation``/``shuffle``/``randint`` reject draws, so
#       their count depends on the state: for Python's and numpy's
#       generators the rank warns once that its state may differ.
#     - where no count explains the leader's states (a cached normal, a
#       seed, a draw past ``MAX_FACTORY_WORDS``): warns once, with the
#       cause, and mirrors nothing for that generator.
#
#     The leader itself is never off (its draws are real) and says nothing.
#     The remedy every warning names: seed the generator alike on every rank
#     before ``ShmLoader``, or give the factory's draws a generator of their
#     own.

#: Most 32-bit words a rank counts between the leader's states, per generator.
MAX_FACTORY_WORDS = 1 << 30


def snapshot_all() -> dict[str, Any]:
    """The default generators' states before a factory call (NOTE [factory draws])."""
    return {g.name: g.state() for g in _GENERATORS}


def factory_draws(before: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each default generator the factory moved: its states before and after (JSON).

    ``before`` is ``snapshot_all()`` taken before the factory (NOTE [factory
    draws]). Never touches the default generators.
    """
    moved: dict[str, dict[str, Any]] = {}
    for g in _GENERATORS:
        old, new = before[g.name], g.state()
        if not g.same(old, new):
            moved[g.name] = {"before": g.encode(old), "after": g.encode(new)}
    return moved


def follow_factory(draws: object, limit: int = MAX_FACTORY_WORDS) -> list[str]:
    """Bring this rank's default generators to where the factory would have left them.

    ``draws`` is the leader's ``factory_draws``: anything else is a
    :class:`ProtocolError`, never a long loop. Returns the warnings for this
    rank, one per generator it cannot follow exactly (NOTE [factory draws]).
    """
    from .errors import ProtocolError

    if not isinstance(draws, dict) or not set(draws) <= set(GENERATORS):
        raise ProtocolError(f"factory draws {draws!r:.200}: expected a dict over {GENERATORS}")
    warnings = []
    for g in _GENERATORS:
        pair = draws.get(g.name)
        if pair is None:
            continue
        try:
            old, new = g.decode(pair["before"]), g.decode(pair["after"])
        except Exception as exc:
            raise ProtocolError(
                f"the leader's {g.name} generator states {pair!r:.200} are no states "
                f"of that generator: {type(exc).__name__}: {exc}"
            ) from None
        if g.same(g.state(), old):
            g.set(new)
            continue
        n = _count(g, old, new, limit)
        if n is None:
            warnings.append(
                f"make_loader drew from the default {g.name} generator on the leader in a way "
                f"this rank cannot replay ({_why(g, old, new, limit)}), and this rank's "
                f"{g.name} generator was in another state before make_loader than the "
                f"leader's, so it cannot take the leader's state either: its {g.name} "
                f"randomness differs from sharing off from here on. {_factory_fix(g)}"
            )
            continue
        g.draw(n)
        if g is not _Torch:
            warnings.append(
                f"this rank's {g.name} generator was in another state before make_loader "
                f"than the leader's (seeded per rank?), so it drew the {n} words the leader's "
                "factory drew; that matches sharing off only if their number does not depend "
                "on the state, and Python's shuffle/randrange/choice/sample and numpy's "
                f"permutation/shuffle/randint reject draws, so its {g.name} randomness may "
                f"differ from sharing off from here on. {_factory_fix(g)}"
            )
    return warnings


def _factory_fix(g: Any) -> str:
    return (
        f"Fix: seed {g.name}'s generator alike on every rank before ShmLoader (every rank "
        f"then takes the leader's state, whatever make_loader drew), or give make_loader's "
        f"draws a generator of their own ({g.remedy}) (NOTE [factory draws])"
    )


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

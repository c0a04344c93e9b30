"""Default-generator mirroring (NOTE [RNG mirroring]), checked against real DataLoaders.

The truth table of ``will_consume_base_seed`` is verified by measuring what
``iter(loader)`` really draws: a PyTorch upgrade that changes the rule fails
here.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import _rng as rng

pytestmark = pytest.mark.timeout(60)


class Tiny(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


@pytest.fixture(autouse=True)
def keep_global_rng():
    state = torch.get_rng_state()
    torch.manual_seed(1234)
    yield
    torch.set_rng_state(state)


def int64_draw() -> None:
    """What DataLoader does for a base seed (and RandomSampler for its seed): two words."""
    torch.empty((), dtype=torch.int64).random_()


def test_count_draws_zero_when_nothing_happened() -> None:
    s = rng.snapshot()
    assert rng.count_draws(s, rng.snapshot()) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_count_draws_counts_two_words_per_int64_draw(n: int) -> None:
    before = rng.snapshot()
    for _ in range(n):
        int64_draw()
    assert rng.count_draws(before, rng.snapshot()) == 2 * n


@pytest.mark.parametrize(
    "draw, words",
    [
        (lambda: torch.rand(1), 1),
        (lambda: torch.randint(10, (1,)), 1),
        (lambda: torch.rand(3, dtype=torch.float64), 6),
        (lambda: torch.bernoulli(torch.full((8, 128), 0.15)), 8 * 128),  # an MLM mask
        (lambda: torch.randperm(700), 699),  # past the block: 624 words
        (lambda: torch.randperm(100_000), 99_999),  # 160 blocks
        (lambda: torch.rand(1 << 20), 1 << 20),
    ],
)
def test_count_draws_counts_the_words_of_any_whole_word_draw(draw, words: int) -> None:
    for offset in (0, 1, 623):  # wherever in its block the generator stands
        torch.manual_seed(11)
        torch.empty(offset, dtype=torch.int32).random_()
        before = rng.snapshot()
        draw()
        after = rng.snapshot()
        assert rng.count_draws(before, after) == words
        torch.set_rng_state(before)
        rng.mirror_draws(words)
        assert torch.equal(rng.snapshot(), after)


@pytest.mark.parametrize(
    "draw, cause",
    [
        (lambda: torch.randn(1), "cached normal"),
        (lambda: torch.manual_seed(5), "seeded"),
        (lambda: (torch.manual_seed(5), torch.rand(3)), "seeded"),
    ],
)
def test_count_draws_none_for_other_kinds_of_draw(draw, cause: str) -> None:
    before = rng.snapshot()
    draw()
    after = rng.snapshot()
    assert rng.count_draws(before, after) is None
    assert cause in rng.why_uncounted(before, after)


def test_count_draws_gives_up_past_the_limit() -> None:
    before = rng.snapshot()
    torch.empty(rng.MAX_COUNTED_DRAWS + 1, dtype=torch.int32).random_()
    after = rng.snapshot()
    assert rng.count_draws(before, after) is None
    assert f"no count up to {rng.MAX_COUNTED_DRAWS}" in rng.why_uncounted(before, after)
    torch.set_rng_state(before)
    torch.empty(rng.MAX_COUNTED_DRAWS, dtype=torch.int32).random_()
    assert rng.count_draws(before, rng.snapshot()) == rng.MAX_COUNTED_DRAWS


def test_torch_state_layout_is_where_counting_reads_it() -> None:
    """NOTE [counting words]: torch's CPU state holds the initial seed at bytes 0-8,
    the index of the next word at 16, the 624 key words (uint64 each) from 24 and
    the cached normals after them: a torch that moves any of them fails here."""
    import numpy as np

    g = torch.Generator().manual_seed(123456789)
    assert int.from_bytes(bytes(g.get_state()[0:8].tolist()), "little") == 123456789
    assert rng._torch_index(g.get_state()) == 0  # just seeded: the next draw twists
    out = torch.empty(700, dtype=torch.int32).random_(generator=g).numpy().view(np.uint32)
    keys, index = rng._Torch.mt(g.get_state())
    assert index == 700 - 624
    # a block's outputs are its keys tempered (int32 draws keep the low 31 bits)
    assert np.array_equal(rng._temper(keys)[:index] & 0x7FFFFFFF, out[624:])
    rest = rng._Torch.rest(g.get_state())
    torch.randn(1, generator=g)  # caches a normal: the rest changes, the keys do not
    assert rng._Torch.rest(g.get_state()) != rest


def test_count_draws_does_not_touch_the_default_generator() -> None:
    before = rng.snapshot()
    int64_draw()
    after = rng.snapshot()
    rng.count_draws(before, after)
    assert torch.equal(rng.snapshot(), after)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 17])
def test_mirror_draws_lands_where_the_loader_would(n: int) -> None:
    start = rng.snapshot()
    for _ in range(n):
        int64_draw()
    expected = rng.snapshot()
    torch.set_rng_state(start)
    rng.mirror_draws(2 * n)  # two words each
    assert torch.equal(rng.snapshot(), expected)
    assert n == 0 or not torch.equal(expected, start)


@pytest.mark.parametrize(
    "draw",
    [
        lambda: torch.rand(2),
        lambda: torch.rand(1, dtype=torch.float64),
        lambda: torch.randperm(3),
        lambda: [int64_draw() for _ in range(3)],
    ],
)
def test_a_counted_draw_is_reproduced_exactly_by_mirroring(draw) -> None:
    # Whatever count_draws says, mirroring that many words must reproduce
    # the state exactly: then training randomness after it is the same.
    before = rng.snapshot()
    draw()
    after = rng.snapshot()
    n = rng.count_draws(before, after)
    assert n is not None
    torch.set_rng_state(before)
    rng.mirror_draws(n)
    assert torch.equal(rng.snapshot(), after)


def test_shuffled_loader_draws_are_mirrored() -> None:
    # A RandomSampler without its own generator draws a seed too: two draws.
    # The base seed is drawn by iter(), the sampler's seed by the first next().
    loader = DataLoader(Tiny(), batch_size=2, shuffle=True)
    before = rng.snapshot()
    it = iter(loader)
    mid = rng.snapshot()
    first = [next(it)]
    after = rng.snapshot()
    assert rng.count_draws(before, mid) == 2
    assert rng.count_draws(mid, after) == 2
    assert rng.count_draws(before, after) == 4
    first += list(it)
    torch.set_rng_state(before)
    rng.mirror_draws(4)
    assert torch.equal(rng.snapshot(), after)
    # Same state, same shuffle: a follower's own sampler would agree.
    torch.set_rng_state(before)
    assert [b.tolist() for b in iter(loader)] == [b.tolist() for b in first]


def _shutdown(*iterators) -> None:
    for it in iterators:
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    gc.collect()


def _measured_iter(loader: DataLoader):
    """Predicate before, then the draws the product counted for ``iter()``.

    The count comes from the leader's own path (``local.Source.open``:
    snapshot, ``iter()``, ``count_draws``), the number followers replay; the
    mirror is checked to land exactly where ``iter()`` left the generator.
    """
    from shmloader import Config, ShmLoader

    predicted = rng.will_consume_base_seed(loader)
    shm = ShmLoader(lambda: loader, None, config=Config(enabled=False))
    before = torch.get_rng_state()
    it, draws = shm._role.source.open(0)
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    rng.mirror_draws(draws)  # what a follower does with the count
    assert torch.equal(torch.get_rng_state(), after), "the mirror must land where iter() did"
    return predicted, draws, it


CASES = [
    # num_workers, persistent, own generator, expected (first iter, next epochs)
    (0, False, False, (True, True)),
    (4, False, False, (True, True)),
    (4, True, False, (True, False)),
    (0, False, True, (False, False)),
    (4, False, True, (False, False)),
    (4, True, True, (False, False)),
]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2-core CI
@pytest.mark.parametrize(
    "workers, persistent, own_gen, expected",
    CASES,
    ids=[
        f"w{w}-{'persistent' if p else 'fresh'}-{'gen' if g else 'nogen'}" for w, p, g, _ in CASES
    ],
)
def test_will_consume_base_seed_matches_reality(workers, persistent, own_gen, expected) -> None:
    generator = torch.Generator().manual_seed(5) if own_gen else None
    loader = DataLoader(
        Tiny(),
        batch_size=2,
        num_workers=workers,
        persistent_workers=persistent,
        generator=generator,
    )
    iterators = []
    try:
        for epoch, want in enumerate([expected[0], expected[1], expected[1]]):
            predicted, draws, it = _measured_iter(loader)
            iterators.append(it)
            assert predicted is want, f"epoch {epoch}: predicted {predicted}, expected {want}"
            assert draws == (2 if want else 0), f"epoch {epoch}: iter() drew {draws} words"
            assert [b.tolist() for b in it] == [[0, 1], [2, 3]]  # a whole epoch
    finally:
        _shutdown(*iterators, getattr(loader, "_iterator", None))
        del iterators


def test_abandoned_epoch_then_new_iter() -> None:
    # iter() again in the middle of an epoch is a new epoch too.
    loader = DataLoader(Tiny(), batch_size=1, num_workers=0)
    it = iter(loader)
    next(it)
    predicted, draws, _ = _measured_iter(loader)
    assert predicted is True and draws == 2  # one int64 base seed: two words


def test_not_a_dataloader() -> None:
    assert rng.will_consume_base_seed([1, 2, 3]) is False
    assert rng.will_consume_base_seed(iter(range(3))) is False


def test_a_main_process_draw_that_cannot_be_mirrored_is_warned_once_with_cause_and_fix(
    caplog,
) -> None:
    """NOTE [RNG mirroring]: the leader's warning names what happened and both fixes."""
    from shmloader import Config, ShmLoader

    shm = ShmLoader(lambda: DataLoader(Tiny()), None, config=Config(enabled=False))
    source = shm._role.source
    try:
        with caplog.at_level("WARNING", logger="shmloader"):
            before = rng.snapshot()
            torch.randn(3)
            assert source.count(before) == 0  # sharing off: no follower, nothing to say
            assert not [m for m in caplog.messages if "cannot replay" in m]
            source.followed = True  # as a leader's source
            before = rng.snapshot()
            torch.rand(300)  # whole words: counted, nothing said
            assert source.count(before) == 300
            for _ in range(2):
                before = rng.snapshot()
                torch.randn(3)  # a cached normal
                assert source.count(before) == 0
    finally:
        shm.close()
    said = [r.getMessage() for r in caplog.records if "cannot replay" in r.getMessage()]
    assert len(said) == 1, said
    assert "cached normal" in said[0], said[0]
    assert "DataLoader workers" in said[0] and "seed=" in said[0], said[0]

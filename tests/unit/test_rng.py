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

from shmloader._roles import rng

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
    """What DataLoader does for a base seed (and RandomSampler for its seed)."""
    torch.empty((), dtype=torch.int64).random_()


def test_count_draws_zero_when_nothing_happened() -> None:
    s = rng.snapshot()
    assert rng.count_draws(s, rng.snapshot()) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_count_draws_counts_int64_draws(n: int) -> None:
    before = rng.snapshot()
    for _ in range(n):
        int64_draw()
    assert rng.count_draws(before, rng.snapshot()) == n


@pytest.mark.parametrize(
    "draw", [lambda: torch.rand(1), lambda: torch.randn(1), lambda: torch.randint(10, (1,))]
)
def test_count_draws_none_for_other_kinds_of_draw(draw) -> None:
    before = rng.snapshot()
    draw()
    assert rng.count_draws(before, rng.snapshot()) is None


def test_count_draws_gives_up_past_the_limit() -> None:
    before = rng.snapshot()
    for _ in range(rng.MAX_COUNTED_DRAWS + 1):
        int64_draw()
    assert rng.count_draws(before, rng.snapshot()) is None


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
    rng.mirror_draws(n)
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
    # Whatever count_draws says, mirroring that many int64 draws must reproduce
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
    assert rng.count_draws(before, mid) == 1
    assert rng.count_draws(mid, after) == 1
    assert rng.count_draws(before, after) == 2
    first += list(it)
    torch.set_rng_state(before)
    rng.mirror_draws(2)
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
            assert draws == (1 if want else 0), f"epoch {epoch}: iter() made {draws} draws"
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
    assert predicted is True and draws == 1


def test_not_a_dataloader() -> None:
    assert rng.will_consume_base_seed([1, 2, 3]) is False
    assert rng.will_consume_base_seed(iter(range(3))) is False

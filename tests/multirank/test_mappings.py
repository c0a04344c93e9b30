"""Mappings other than a plain dict, as plain PyTorch delivers them (NOTE [mappings]).

The codec's rules, then transformers' real collators (a tokenizer built offline
from the ``tokenizers`` package: no hub access) through real ranks, sharing on
and off, in the main process and in DataLoader workers.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from shmloader._proto import codec
from shmloader._proto.codec import owned_copy
from shmloader.errors import ProtocolError, UnsupportedBatchError
from tests.support.harness import run_ranks
from tests.unit.test_codec import assert_same, meta_of, roundtrip

pytestmark = pytest.mark.timeout(120)


# Module-level types: followers look them up by name.
class Encoding(collections.UserDict):
    """A ``UserDict`` with state of its own, like transformers' ``BatchEncoding``."""

    def __init__(self, data: Any = None, tag: str | None = None) -> None:
        super().__init__(data)
        self.tag = tag


class WithExtras(collections.UserDict):
    """A ``UserDict`` with a second dict of its own: that one is state, not the items."""

    def __init__(self, data: Any = None) -> None:
        super().__init__(data)
        self.extras: dict = {}


def _with_extras() -> WithExtras:
    m = WithExtras({"a": 1})
    m.extras["a"] = 1  # the same keys as the items, but not the items themselves
    return m


class Frozen(Mapping):
    """An immutable mapping: rebuilt as ``type(m)(items)``, as ``default_collate`` does."""

    def __init__(self, items: Any = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Prefixed(dict):
    """A dict whose constructor renames the keys: no rebuild gives the same one."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__({f"p_{k}": v for k, v in dict(items).items()})


class Angry(collections.OrderedDict):
    """Builds on the leader; ``BROKEN`` makes its constructor raise (a follower's view)."""

    BROKEN = False

    def __init__(self, *args: Any) -> None:
        if Angry.BROKEN:
            raise RuntimeError("no")
        super().__init__(*args)


def _values_same(a: Mapping, b: Mapping) -> None:
    assert type(a) is type(b)
    assert list(a) == list(b)
    for k in a:
        assert_same(a[k], b[k], f"[{k!r}]")


# ------------------------------------------------------------------ the codec


def test_mappings_arrive_as_their_own_type_with_key_order_and_aliases() -> None:
    t = torch.arange(6).view(2, 3)
    cases = [
        collections.OrderedDict([("z", t), ("a", 1), ("m", np.ones(2, np.float32))]),
        collections.Counter({"b": 3, "a": 1}),
        collections.defaultdict(list, {"x": t, "y": [t, 2]}),
        collections.defaultdict(None, {"x": 1}),
        collections.UserDict({"ids": t, "mask": t.bool()}),
        Encoding({"ids": t}),
        WithExtras({"ids": t}),
        Frozen({"k": t, (1, 2): "tuple key"}),
    ]
    for batch in cases:
        out, _, _ = roundtrip({"outer": batch, "again": t})
        _values_same(out["outer"], batch)
        if isinstance(batch, collections.defaultdict):
            assert out["outer"].default_factory is batch.default_factory
            if batch.default_factory is not None:
                assert out["outer"]["new"] == []  # the factory works on the follower
    nested, _, _ = roundtrip(collections.OrderedDict(a=Encoding({"t": t}), b=t))
    assert type(nested["a"]) is Encoding and nested["a"]["t"] is nested["b"]  # one leaf


@pytest.mark.parametrize(
    "case, text",
    [
        ("lambda factory", "default_factory"),
        ("chainmap of two", "attribute maps"),
        ("extra state", "attribute tag"),
        ("a second dict", "attribute extras"),
        ("local type", "cannot be imported"),
        ("constructor changes keys", "same items"),
        ("mappingproxy", "cannot be imported"),
    ],
)
def test_a_mapping_that_would_not_come_back_the_same_is_refused_by_path(case, text) -> None:
    class Local(collections.UserDict):
        pass

    bad = {
        "lambda factory": lambda: collections.defaultdict(lambda: 0, a=1),
        "chainmap of two": lambda: collections.ChainMap({"a": 1}, {"b": 2}),
        "extra state": lambda: Encoding({"a": 1}, tag="kept by default_collate's copy.copy"),
        "a second dict": _with_extras,
        "local type": lambda: Local(a=1),
        "constructor changes keys": lambda: Prefixed({"a": 1}),
        "mappingproxy": lambda: types.MappingProxyType({"a": 1}),
    }[case]()
    sentinel = np.full(256, 0x5A, np.uint8)
    with pytest.raises(UnsupportedBatchError, match=text) as info:
        codec.write_payload(codec.encode({"x": torch.ones(4), "m": [bad]}), sentinel)
    assert (sentinel == 0x5A).all()
    assert info.value.path == "batch['m'][0]"
    if case not in ("local type", "mappingproxy"):
        assert "dict(m)" in str(info.value) and "allow_pickle" in str(info.value)


def test_an_unrebuildable_mapping_travels_pickled_with_allow_pickle() -> None:
    batch = {"c": collections.ChainMap({"a": 1}, {"b": torch.ones(2)}), "e": Encoding({}, "x")}
    out, enc, _ = roundtrip(batch, allow_pickle=True)
    assert out["c"].maps[0] == {"a": 1} and torch.equal(out["c"].maps[1]["b"], torch.ones(2))
    assert out["e"].tag == "x"
    assert [lf.kind for lf in enc.leaves] == ["p", "p"]


def test_the_state_check_runs_for_every_batch_not_only_the_first() -> None:
    roundtrip(Encoding({"a": 1}))  # the type's rebuild checked once, cached
    with pytest.raises(UnsupportedBatchError, match="attribute tag"):
        codec.encode(Encoding({"a": 1}, tag="later"))


_OD = "collections:OrderedDict"


@pytest.mark.parametrize(
    "tree",
    [
        ["M", "builtins:dict", []],  # dict travels as "D", never as a named type
        ["M", "tests.unit.test_codec:Point", []],  # a namedtuple, not a mapping
        ["M", "tests.multirank.test_mappings:_values_same", []],  # not a type
        ["M", "os:environ", []],  # a mapping instance, not a type
        ["M", "no_such_module_xyz:M", []],
        ["M", _OD, [[["L", []], 1]]],  # unhashable key
        ["M", _OD, [], None],  # a factory for a type that takes none
        ["M", "collections:defaultdict", []],  # no factory
        ["M", "collections:defaultdict", [], "os.system"],
        ["M", "collections:defaultdict", [], "print"],
        ["M", "collections:defaultdict", [], 5],
        ["M", _OD],
        ["M", 5, []],
    ],
    ids=lambda t: repr(t)[:60],
)
def test_bad_mapping_nodes(tree: Any) -> None:
    with pytest.raises(ProtocolError):
        codec.decode(meta_of(tree), np.zeros(0, np.uint8))


def test_a_constructor_that_raises_on_the_follower_is_a_protocol_error() -> None:
    enc = codec.encode(Angry({"a": 1}))
    Angry.BROKEN = True
    try:
        with pytest.raises(ProtocolError, match="cannot rebuild the mapping type"):
            codec.decode(enc.meta, np.zeros(enc.nbytes, np.uint8))
    finally:
        Angry.BROKEN = False


def test_owned_copies_keep_the_mapping_type() -> None:
    t = torch.arange(4)
    out, _, _ = roundtrip(
        [collections.OrderedDict(a=t), Encoding({"b": t}), collections.defaultdict(int, c=t)]
    )
    copied = owned_copy(out)
    for got, want in zip(copied, out, strict=True):
        _values_same(got, want)
    copied[0]["a"][0] = 99  # owned: the payload is untouched
    assert out[0]["a"][0] == 0 and copied[2].default_factory is int


# ------------------------------------------------------------------ transformers


WORDS = "the quick brown fox jumps over a lazy dog and runs far away".split(" ")  # noqa: SIM905


def tiny_tokenizer() -> Any:
    """A fast tokenizer built offline: a WordLevel model wrapped by transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[MASK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(special + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 3), ("[SEP]", 4)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


class Sentences(torch.utils.data.Dataset):
    """Tokenized sentences of varying length (features as a collator receives them)."""

    def __init__(self, tokenizer: Any, n: int = 24) -> None:
        self.features = [
            dict(tokenizer(" ".join(WORDS[(i * 3) % 7 : (i * 3) % 7 + 2 + i % 6]))) | {"idx": i}
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> dict:
        return dict(self.features[i])


def test_a_padding_collators_batch_encoding_round_trips() -> None:
    pytest.importorskip("transformers")
    from transformers import BatchEncoding, DataCollatorWithPadding

    tok = tiny_tokenizer()
    ds = Sentences(tok)
    batch = DataCollatorWithPadding(tok, return_tensors="pt")([ds[i] for i in range(4)])
    assert type(batch) is BatchEncoding
    out, _, _ = roundtrip(batch)
    _values_same(out, batch)
    assert out.encodings is None and out["input_ids"].shape == batch["input_ids"].shape
    called = tok(["the fox", "a lazy dog"], padding=True, return_tensors="pt")
    with pytest.raises(UnsupportedBatchError, match="attribute _encodings") as info:
        codec.encode({"enc": called})  # a fast tokenizer's own output holds Rust Encodings
    assert info.value.path == "batch['enc']"


class WithPath:
    """A collate that adds a ``Path`` (a leaf sharing refuses) beside the collator's batch."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, features: list) -> dict:
        import pathlib

        return {"enc": self.collate(features), "src": pathlib.Path("/data/shard-0.bin")}


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2-core CI
def test_sharing_off_with_workers_names_only_refusals_a_pickled_copy_can_tell(caplog) -> None:
    """NOTE [sharing off is plain torch]: a worker's batch reaches the main process
    pickled (a ``BatchEncoding`` without its ``n_sequences``): a padding collator's
    batch, which sharing on accepts in the worker, draws no warning, while a leaf
    that pickling keeps (a ``Path``) is still named."""
    import logging

    from transformers import DataCollatorWithPadding

    from shmloader import Config, ShmLoader

    tok = tiny_tokenizer()
    ds = Sentences(tok, n=6)
    pad = DataCollatorWithPadding(tok, return_tensors="pt")

    said = {}
    for name, collate in (("padding", pad), ("path", WithPath(pad))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shmloader"):
            loader = ShmLoader(
                lambda collate=collate: torch.utils.data.DataLoader(
                    ds, batch_size=3, collate_fn=collate, num_workers=2
                ),
                None,
                config=Config(enabled=False),
            )
            assert len(list(loader)) == 2
            loader.close()
        said[name] = [
            r.getMessage() for r in caplog.records if "would be refused" in r.getMessage()
        ]
    assert said["padding"] == [], said["padding"]
    assert len(said["path"]) == 1 and "batch['src']" in said["path"][0], said["path"]


def collators_rank(rank: int, world: int) -> dict:
    """Each collator, sharing on and off (padding in workers, masking in the main process)."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    from shmloader import Config, ShmLoader
    from tests.support.harness import capture_warnings
    from tests.support.ranks import sp_groups

    warnings = capture_warnings()
    group, _ = sp_groups(world, 2)
    tok = tiny_tokenizer()
    ds = Sentences(tok)
    collators = {
        "padding": DataCollatorWithPadding(tok, return_tensors="pt"),
        "mlm": DataCollatorForLanguageModeling(tok, mlm_probability=0.3, return_tensors="pt"),
    }
    out: dict = {}
    for name, collate in collators.items():
        for workers in {"padding": (2,), "mlm": (0,)}[name]:
            for share in (True, False):

                def make(collate=collate, workers=workers) -> torch.utils.data.DataLoader:
                    sampler = torch.utils.data.DistributedSampler(
                        ds, num_replicas=world // 2, rank=rank // 2, shuffle=True, seed=3
                    )
                    return torch.utils.data.DataLoader(
                        ds, batch_size=3, sampler=sampler, collate_fn=collate, num_workers=workers
                    )

                torch.manual_seed(7)  # the same masks on every rank with sharing off
                loader = ShmLoader(make, group, config=Config.from_env(enabled=share))
                batches, states = [], []
                for batch in loader:
                    batches.append(
                        (
                            type(batch).__qualname__,
                            batch.encodings,
                            {k: v.clone() for k, v in batch.items()},
                        )
                    )
                    states.append(torch.get_rng_state())  # what the step's dropout draws from
                    torch.rand(5)  # the step's own draws
                loader.close()
                out[(name, workers, share)] = batches
                out[("rng", name, workers, share)] = states
    out["said"] = list(warnings.messages)
    return out


@pytest.mark.timeout(300)
def test_transformers_collators_through_real_ranks_sharing_on_and_off() -> None:
    pytest.importorskip("transformers")
    out = run_ranks(collators_rank, 4, timeout=280)
    for rank in range(4):
        said = out[rank].pop("said")
        # sharing off with workers sees pickled copies: no refusal it cannot know of;
        # the MLM collator's main-process draws are counted: nothing unmirrorable
        assert not [m for m in said if "would be refused" in m], said
        assert not [m for m in said if "cannot replay" in m], said
        runs = {key[1:]: out[rank].pop(key) for key in list(out[rank]) if key[0] == "rng"}
        for (name, workers, share), states in runs.items():
            off = runs[(name, workers, False)]
            assert len(states) == len(off) == 4, (name, workers, share)
            differ = [i for i, (a, b) in enumerate(zip(states, off, strict=True)) if not a.equal(b)]
            assert differ == [], f"rank {rank} {name}: torch's generator differs at steps {differ}"
    for rank in range(4):
        for key, batches in out[rank].items():
            name, workers, _ = key
            assert len(batches) == 4, key
            off = out[rank][(name, workers, False)]
            peer = out[rank ^ 1][key]  # the other rank of this SP group
            for (kind, encodings, values), (_, _, want), (_, _, theirs) in zip(
                batches, off, peer, strict=True
            ):
                assert kind == "BatchEncoding" and encodings is None, key
                assert list(values) == list(want), key
                if name == "mlm":
                    assert "labels" in values, key
                for k in values:
                    assert torch.equal(values[k], want[k]), (rank, key, k)
                    assert torch.equal(values[k], theirs[k]), (rank, key, k)
        masked = [b[2]["labels"] for key, run in out[rank].items() if key[0] == "mlm" for b in run]
        assert any((labels != -100).any() for labels in masked)  # the collator masked something

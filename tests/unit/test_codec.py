"""Pure tests of the codec: batch -> (metadata, payload) -> batch.

Every comparison is by bytes (or by exact type and value), never by ``==`` on
floats alone, so NaN payloads, -0.0 and dtypes without arithmetic count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmloader._proto import codec
from shmloader.errors import ProtocolError, UnsupportedBatchError

pytestmark = [
    pytest.mark.timeout(60),
    # complex32 and quantized tensors are exercised on purpose.
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
]

# ------------------------------------------------------------------ helpers

# Same-size integer dtypes: reading any tensor's bits through them needs no
# dtype-specific kernel (uint1..7 have none).
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s values in row-major order, whatever its strides and dtype."""
    t = t.resolve_conj().resolve_neg()
    if t.element_size() == 16:  # complex128
        r = torch.view_as_real(t).view(torch.int64)
    else:
        r = t.view(_RAW[t.element_size()])
    return r.contiguous().numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` filled with random bytes (NaN payloads and all)."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:  # torch.from_numpy of an empty array has stride 0: view(dtype) refuses it
        return torch.empty(shape, dtype=dtype)
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return torch.from_numpy(data).view(dtype).reshape(shape)


def roundtrip(batch: Any, **kw: Any) -> tuple[Any, codec.Encoded, np.ndarray]:
    """Encode, write into a buffer of exactly the payload size, decode."""
    enc = codec.encode(batch, **kw)
    buf = np.zeros(enc.nbytes, np.uint8)
    codec.write_payload(enc, buf)
    return codec.decode(enc.meta, buf, **kw), enc, buf


def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """Deep equality: exact types, dict key order, tensor/array bytes, float bits."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert raw_bytes(a) == raw_bytes(b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype.str == b.dtype.str and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, np.generic):
        assert a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes(), where
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), where
    elif isinstance(a, dict):
        assert len(a) == len(b), f"{where}: keys {list(a)} != {list(b)}"
        for ka, kb in zip(a, b, strict=True):  # same keys, same order, same key types
            assert_same(ka, kb, f"{where} key {_short(ka)}")
        for (ka, va), vb in zip(a.items(), b.values(), strict=True):
            assert_same(va, vb, f"{where}[{_short(ka)}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _short(x: Any) -> str:
    """repr() that survives ints too long for text."""
    return f"<int of {x.bit_length()} bits>" if type(x) is int else repr(x)[:40]


def meta_of(tree: Any, leaves: list | None = None, n: int = 0, v: Any = 1) -> bytes:
    return json.dumps({"v": v, "n": n, "L": leaves or [], "t": tree}).encode()


# Module-level containers: followers import them by name.
Point = namedtuple("Point", "x y")


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclass
class Sample:
    image: Any
    label: Any
    meta: Any = None


@dataclass(frozen=True)
class Frozen:
    a: Any
    b: Any


@dataclass
class Derived:
    a: int
    twice: int = field(init=False)

    def __post_init__(self) -> None:
        self.twice = 2 * self.a


@dataclass(slots=True)
class Slotted:
    a: Any


class Plain:
    """Neither a namedtuple nor a dataclass."""


# ------------------------------------------------------------ torch dtypes

SHAPES = [(), (0, 3), (7,), (2, 1, 3, 1, 2), (1, 2, 1, 2, 1, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(codec._TORCH_DTYPES))
def test_every_torch_dtype_and_shape_round_trips_bytes(name: str, shape: tuple) -> None:
    dtype = codec._TORCH_DTYPES[name]
    src = random_tensor(dtype, shape, seed=len(name))
    out, enc, _ = roundtrip({"x": src})
    t = out["x"]
    assert type(t) is torch.Tensor
    assert t.dtype == dtype and t.shape == src.shape
    assert raw_bytes(t) == raw_bytes(src)
    assert enc.leaves[0].nbytes == src.numel() * dtype.itemsize


def test_dtype_table_covers_the_design() -> None:
    want = {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    }
    assert want <= set(codec._TORCH_DTYPES)
    assert not any(k.startswith(("qint", "quint")) for k in codec._TORCH_DTYPES)


@pytest.mark.parametrize("name", sorted(codec._TORCH_DTYPES))
def test_every_torch_dtype_non_contiguous(name: str) -> None:
    dtype = codec._TORCH_DTYPES[name]
    base = random_tensor(dtype, (4, 6), seed=7)
    views = [base.t(), base[::2, 1::3], base[1:, :][:, 2:4], base[:1].expand(3, 6)]
    out, _, _ = roundtrip(views)
    for src, got in zip(views, out, strict=True):
        assert got.shape == src.shape and got.is_contiguous()
        assert raw_bytes(got) == raw_bytes(src)


def test_non_contiguous_values_preserved() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    c = torch.randn(3, 4, dtype=torch.complex64)
    views = {
        "transposed": x.transpose(0, 2),
        "permuted": x.permute(1, 2, 0),
        "strided": x[:, ::2, 1::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "offset": x[1, 2],
        "zero-d view": x[1, 2, 3],
        "conj": c.conj(),
        "conj transposed": c.t().conj(),
        "neg bit": c.conj().imag,
        "diagonal": torch.arange(16.0).reshape(4, 4).diagonal(),
    }
    assert views["conj"].is_conj() and views["neg bit"].is_neg()
    out, _, _ = roundtrip(views)
    for key, src in views.items():
        got = out[key]
        assert got.shape == src.shape, key
        assert not got.is_conj() and not got.is_neg(), key
        assert torch.equal(got, src.resolve_conj().resolve_neg()), key


def test_zero_size_only_batch_decodes_from_an_empty_payload() -> None:
    # The loader hands decode np.empty(0) when a batch has no payload bytes.
    batch = {"a": torch.zeros(0, 3), "b": torch.zeros((2, 0), dtype=torch.float64)}
    enc = codec.encode(batch)
    assert enc.nbytes == 0
    out = codec.decode(enc.meta, np.empty(0, np.uint8))
    assert out["a"].shape == (0, 3) and out["a"].dtype == torch.float32
    assert out["b"].shape == (2, 0) and out["b"].dtype == torch.float64


def test_too_many_dimensions_refused_on_encode() -> None:
    ok = torch.zeros([1] * codec.MAX_NDIM)
    out, _, _ = roundtrip(ok)
    assert out.shape == ok.shape
    with pytest.raises(UnsupportedBatchError, match=r"batch\[0\].*dimensions"):
        codec.encode([torch.zeros([1] * (codec.MAX_NDIM + 1))])


# -------------------------------------------------------------------- numpy

NUMPY_DTYPES = [
    "?",
    "i1",
    "u1",
    "<i2",
    "<u2",
    "<i4",
    "<u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    "<f8",
    "<c8",
    "<c16",
    ">i4",
    ">f8",
    ">c8",
    "<M8[ns]",
    "<M8[D]",
    "<m8[s]",
    "S5",
    "<U3",
    ">U3",
    np.dtype(np.longdouble).str,
    np.dtype(np.clongdouble).str,
]


@pytest.mark.parametrize("shape", [(), (0, 3), (5,), (2, 3, 1, 2)], ids=str)
@pytest.mark.parametrize("dt", NUMPY_DTYPES)
def test_numpy_arrays_come_back_as_numpy(dt: str, shape: tuple) -> None:
    dtype = np.dtype(dt)
    raw = np.random.default_rng(3).integers(0, 256, math.prod(shape) * dtype.itemsize, np.uint8)
    if dtype.kind == "U":  # must be valid code points
        raw = np.frombuffer(
            np.full(math.prod(shape) * (dtype.itemsize // 4), ord("é"), dtype.byteorder + "u4"),
            np.uint8,
        )
    src = raw.view(dtype).reshape(shape)
    out, enc, _ = roundtrip({"a": src})
    got = out["a"]
    assert type(got) is np.ndarray
    assert got.dtype == dtype and got.dtype.str == dtype.str and got.shape == src.shape
    assert got.tobytes() == src.tobytes()
    assert enc.leaves[0].kind == "a"


def test_numpy_non_contiguous() -> None:
    a = np.arange(60, dtype=">i4").reshape(3, 4, 5)
    views = [a[::-1], a.T, a[:, ::2, 1::2], np.broadcast_to(np.arange(3.0), (4, 3))]
    out, _, _ = roundtrip(views)
    for src, got in zip(views, out, strict=True):
        assert got.dtype.str == src.dtype.str
        np.testing.assert_array_equal(got, src)


def test_numpy_memmap_subclass_arrives_as_ndarray(tmp_path) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype="<f4", mode="w+", shape=(4,))
    mm[:] = [1, 2, 3, 4]
    out, _, _ = roundtrip([mm[1:]])
    assert type(out[0]) is np.ndarray
    np.testing.assert_array_equal(out[0], [2, 3, 4])
    del mm


@pytest.mark.parametrize(
    "value",
    [
        np.float32(1.5),
        np.float64(-0.0),
        np.float16(np.inf),
        np.int64(-3),
        np.uint64(2**64 - 1),
        np.int8(-128),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.datetime64("2020-01-01T00:00"),
        np.timedelta64(5, "s"),
        np.str_("héllo"),
        np.bytes_(b"ab\x01"),
        np.longdouble(1) / 3,
        np.clongdouble(1 - 2j) / 3,
        np.longdouble("nan"),
    ],
    ids=repr,
)
def test_numpy_scalars(value: np.generic) -> None:
    out, enc, _ = roundtrip({"s": value})
    got = out["s"]
    assert type(got) is type(value)
    assert got.dtype.str == value.dtype.str
    assert enc.leaves[0].kind == "s"
    if isinstance(value, np.longdouble | np.clongdouble):
        # NOTE [platform-dependent numpy types]: by value; padding is undefined
        assert (got == value) or (np.isnan(got) and np.isnan(value))
        assert _significant(got) == _significant(value)
    else:
        assert got.tobytes() == value.tobytes()


def _significant(x: np.generic) -> list[bytes]:
    """The value bytes of a long double (scalar), per component, padding dropped."""
    parts = [x.real, x.imag] if np.iscomplexobj(x) else [x]
    used = 10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize
    return [np.longdouble(p).tobytes()[:used] for p in parts]


def test_long_double_arrays_keep_their_padding_bits() -> None:
    """Arrays travel bit for bit, the undefined padding of a long double included."""
    for dt in (np.longdouble, np.clongdouble):
        raw = np.random.default_rng(5).integers(0, 256, 7 * np.dtype(dt).itemsize, np.uint8)
        src = raw.view(dt)[::2]  # non-contiguous too
        out, _, _ = roundtrip({"a": src})
        assert out["a"].dtype == src.dtype
        assert out["a"].tobytes() == src.tobytes()


# --------------------------------------------------------------- containers


def test_dict_key_order_and_non_str_keys() -> None:
    batch = {
        "zeta": 1,
        "alpha": 2,
        3: "three",
        (1, "t"): None,
        -1.5: [1],
        None: "none",
        False: "false",
        (2, (3, 4)): "nested tuple key",
    }
    out, _, _ = roundtrip(batch)
    assert [(type(k), k) for k in out] == [(type(k), k) for k in batch]
    assert list(out.values()) == list(batch.values())


def test_nested_containers_keep_their_types() -> None:
    t = torch.arange(6).reshape(2, 3)
    batch = {
        "list": [1, [2, (3, 4)], []],
        "tuple": (t, (), ("a",)),
        "point": Point(torch.ones(2), Point(1, "y")),
        "pair": Pair(first=[Sample(t, 3)], second={"k": Frozen(1.5, b"xy")}),
        "sample": Sample(image=np.zeros((2, 2), np.uint8), label=7, meta={"id": "x"}),
        "frozen": Frozen(a=None, b=Point(x=(), y=[])),
        "slotted": Slotted([1, 2]),
    }
    out, _, _ = roundtrip(batch)
    assert_same(out, batch)
    assert type(out["point"]) is Point and type(out["point"].y) is Point
    assert type(out["pair"]) is Pair and out["pair"]._fields == ("first", "second")
    with pytest.raises(dataclasses.FrozenInstanceError):
        out["frozen"].a = 1  # still frozen


def test_dataclass_with_init_false_field_keeps_the_leaders_value() -> None:
    d = Derived(3)
    d.twice = 99  # changed after __post_init__: the follower must see 99, not 6
    out, _, _ = roundtrip([d])
    assert type(out[0]) is Derived
    assert out[0].a == 3 and out[0].twice == 99


def test_locally_defined_containers_are_refused_before_writing() -> None:
    Local = namedtuple("Local", "a")

    @dataclass
    class LocalDC:
        a: int

    for obj, what in ((Local(1), "namedtuple"), (LocalDC(1), "dataclass")):
        with pytest.raises(UnsupportedBatchError, match=rf"batch\['x'\].*{what}.*module level"):
            codec.encode({"x": obj})


PY_LEAVES = [
    0,
    -1,
    2**63,
    -(2**200),
    10**5000,  # more digits than Python converts to text by default
    -(10**5000) + 7,
    1.5,
    -0.0,
    0.1,
    5e-324,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
    True,
    False,
    "",
    "héllo wörld ✓ 🚀 \x00 \n \"'",
    "\ud800 lone surrogate",
    b"",
    b"\x00\xff\x80\x04",
    None,
]


@pytest.mark.parametrize(
    "value", PY_LEAVES, ids=[f"{i}-{type(v).__name__}" for i, v in enumerate(PY_LEAVES)]
)
def test_python_leaves(value: Any) -> None:
    keyable = not isinstance(value, bytes)  # bytes keys are refused by design
    batch = {"v": value, "in list": [value], "as key": {value: 1} if keyable else {}}
    out, _, _ = roundtrip(batch)
    for got in (out["v"], out["in list"][0], *out["as key"]):
        assert type(got) is type(value)
        assert_same(got, value)


def test_bool_stays_bool_and_int_stays_int() -> None:
    out, _, _ = roundtrip([True, 1, False, 0, 1.0])
    assert [type(v) for v in out] == [bool, int, bool, int, float]


# -------------------------------------------------------------------- alias


def test_same_tensor_twice_is_one_object_after_decode() -> None:
    t = torch.arange(5.0)
    other = t.clone()
    batch = {"a": t, "b": [t, other], "c": (t, {"d": t}), "e": t[1:]}
    out, enc, _ = roundtrip(batch)
    assert len(enc.leaves) == 3  # t, other, t[1:] (a different view object)
    assert out["a"] is out["b"][0] is out["c"][0] is out["c"][1]["d"]
    assert out["b"][1] is not out["a"]
    out["a"][0] = 42.0
    assert out["c"][1]["d"][0] == 42.0 and out["b"][1][0] == 0.0


def test_same_numpy_array_and_bytes_twice_is_one_object() -> None:
    a = np.arange(4, dtype=np.int16)
    b = b"payload" * 3
    out, enc, _ = roundtrip([a, {"again": a}, b, (b,)])
    assert len(enc.leaves) == 2
    assert out[0] is out[1]["again"]
    assert out[2] is out[3][0]


def test_aliasing_is_by_identity_not_by_address() -> None:
    """Other objects over the same memory (same address, even same shape) stay apart:
    merging them by address would change the dtype of one, or make two tensors that
    the user keeps apart one object."""
    t = torch.arange(6.0)
    same_bytes = t.view(6)  # another tensor object: same address, shape and dtype
    as_int = t.view(torch.int32)  # same address, another dtype
    a = np.arange(3)
    a_view = a.view()
    batch = {"t": t, "v": same_bytes, "i": as_int, "a": a, "av": a_view, "t2": t}
    out, enc, _ = roundtrip(batch)
    assert len(enc.leaves) == 5
    assert out["t"] is out["t2"]
    assert out["t"] is not out["v"] and out["a"] is not out["av"]
    assert out["i"].dtype == torch.int32 and out["v"].dtype == torch.float32
    out["t"][0] = 7.0
    assert out["v"][0] == 0.0, "two objects on the leader are two objects here"


def test_small_leaves_are_owned_copies_large_ones_views() -> None:
    """NOTE [small leaves]: keeping a small leaf keeps nothing of the payload."""
    small = torch.arange(16)  # 128 bytes
    batch = {"big": torch.zeros(4096), "labels": small, "again": small, "np": np.ones(4)}
    enc = codec.encode(batch)
    buf = np.zeros(enc.nbytes, np.uint8)
    codec.write_payload(enc, buf)
    out = codec.decode(enc.meta, buf, own_below=1024)
    assert np.shares_memory(out["big"].numpy(), buf)
    assert not np.shares_memory(out["labels"].numpy(), buf)
    assert not np.shares_memory(out["np"], buf)
    assert out["labels"] is out["again"] and torch.equal(out["labels"], small)
    plain = codec.decode(enc.meta, buf)  # default: every leaf a view
    assert np.shares_memory(plain["labels"].numpy(), buf)


# ------------------------------------------------------------------- layout


def test_decoded_tensors_are_views_into_the_payload() -> None:
    batch = {"t": torch.zeros(4, dtype=torch.int32), "a": np.zeros(3, np.int64)}
    out, enc, buf = roundtrip(batch)
    lt, la = enc.leaves
    buf[lt.offset : lt.offset + 4] = [1, 0, 0, 0]
    buf[la.offset + 8 : la.offset + 16] = np.frombuffer(np.int64(7).tobytes(), np.uint8)
    assert out["t"][0].item() == 1
    assert out["a"][1] == 7
    out["t"][3] = -1
    assert buf[lt.offset + 12 : lt.offset + 16].tolist() == [255] * 4
    base = buf.ctypes.data
    assert base <= out["t"].data_ptr() < base + buf.nbytes


def test_offsets_aligned_in_first_seen_order_and_no_overlap() -> None:
    batch = [
        torch.ones(3, dtype=torch.int8),
        np.ones(5, np.float64),
        b"abc",
        torch.ones((2, 7), dtype=torch.float16),
        torch.ones(0),
        np.float32(1),
        torch.ones(1, dtype=torch.complex128),
    ]
    enc = codec.encode(batch)
    assert [lf.kind for lf in enc.leaves] == ["t", "a", "b", "t", "t", "s", "t"]
    end = 0
    for lf in enc.leaves:
        assert lf.offset % codec.ALIGN == 0
        assert lf.offset >= end
        end = lf.offset + lf.nbytes
    assert enc.nbytes == end
    doc = json.loads(enc.meta)
    assert doc["n"] == enc.nbytes
    assert [tuple(e[3:]) for e in doc["L"]] == [(lf.offset, lf.nbytes) for lf in enc.leaves]


def test_write_payload_checks_its_destination() -> None:
    enc = codec.encode(torch.ones(4))
    with pytest.raises(ValueError, match="needs 16"):
        codec.write_payload(enc, np.zeros(15, np.uint8))
    with pytest.raises(TypeError):
        codec.write_payload(enc, np.zeros(16, np.int8))
    with pytest.raises(TypeError):
        codec.decode(enc.meta, np.zeros((4, 4), np.uint8))


def test_write_payload_leaves_padding_and_tail_alone() -> None:
    enc = codec.encode([torch.ones(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)])
    buf = np.full(200, 0xAB, np.uint8)
    codec.write_payload(enc, buf)
    assert buf[0] == 1 and buf[64] == 1
    assert (buf[1:64] == 0xAB).all() and (buf[65:] == 0xAB).all()


# -------------------------------------------------------------- unsupported


def _file_handle():
    return open(os.devnull)  # closed by the test


UNSUPPORTED = {
    "lambda": (lambda: lambda: 0, "function"),
    "file": (_file_handle, "TextIOWrapper"),
    "object": (object, "builtins.object"),
    "set": (lambda: {1, 2}, "builtins.set"),
    "Parameter": (lambda: torch.nn.Parameter(torch.ones(2)), "Parameter"),
    "requires_grad": (lambda: torch.ones(2, requires_grad=True), "requires_grad"),
    "sparse": (lambda: torch.ones(2).to_sparse(), "layout"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
        "quint8",
    ),
    "meta device": (lambda: torch.empty(2, device="meta"), "meta"),
    "object array": (lambda: np.array([object()], dtype=object), "object"),
    "structured array": (lambda: np.zeros(2, dtype=[("a", "<i4")]), "numpy dtype"),
    "masked array": (lambda: np.ma.masked_array([1, 2], [0, 1]), "MaskedArray"),
    "bytearray": (lambda: bytearray(b"x"), "bytearray"),
    "plain class": (Plain, "Plain"),
    "dataclass type": (lambda: Sample, "type"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_leaf_named_by_path_and_nothing_written(case: str) -> None:
    make, type_text = UNSUPPORTED[case]
    bad = make()
    try:
        batch = {"first": torch.full((8,), 7, dtype=torch.uint8), "meta": [0, "x", 2.0, bad]}
        sentinel = np.full(4096, 0x5A, np.uint8)
        with pytest.raises(UnsupportedBatchError) as info:
            codec.write_payload(codec.encode(batch), sentinel)
        assert (sentinel == 0x5A).all()  # encode raised: nothing can have been written
        msg = str(info.value)
        assert "batch['meta'][3]" in msg
        assert info.value.path == "batch['meta'][3]"
        assert type_text in msg
        assert isinstance(info.value, TypeError)
    finally:
        if hasattr(bad, "close"):
            bad.close()


def test_unsupported_paths_through_every_container() -> None:
    bad = object()
    cases = {
        "batch[1][0]": [0, (bad,)],
        "batch['k'].x": {"k": Point(bad, 1)},
        "batch.label": Sample(1, bad),
        "batch[2]['n'][0]": [1, 2, {"n": [bad]}],
    }
    for path, batch in cases.items():
        with pytest.raises(UnsupportedBatchError) as info:
            codec.encode(batch)
        assert info.value.path == path
    with pytest.raises(UnsupportedBatchError, match="a key"):
        codec.encode({frozenset({1}): 1})


def test_allow_pickle_carries_unknown_objects() -> None:
    batch = {"meta": [0, 1, 2, {3, 4}], "t": torch.ones(2), "plain": Plain}
    out, enc, buf = roundtrip(batch, allow_pickle=True)
    assert out["meta"][3] == {3, 4} and out["plain"] is Plain
    assert torch.equal(out["t"], torch.ones(2))
    assert {lf.kind for lf in enc.leaves} == {"p", "t"}
    with pytest.raises(ProtocolError, match="allow_pickle"):
        codec.decode(enc.meta, buf)  # the receiver must opt in too
    with pytest.raises(UnsupportedBatchError, match="pickling failed"):
        codec.encode([lambda: 0], allow_pickle=True)


def test_metadata_is_json_never_pickle() -> None:
    batch = {
        "t": torch.ones(2, 2),
        "a": np.ones(3),
        "s": np.float32(2),
        "p": Point(1, [2.5, math.inf]),
        "d": Sample("x", b"bytes", None),
        "k": {(1, 2): True},
    }
    enc = codec.encode(batch)
    assert b"\x80\x04" not in enc.meta and b"\x80\x05" not in enc.meta
    assert b"pickle" not in enc.meta and b"\x80" not in enc.meta
    doc = json.loads(enc.meta.decode("utf-8"))
    assert doc["v"] == codec.FORMAT_VERSION
    assert set(doc) == {"v", "n", "L", "t"}
    assert {e[0] for e in doc["L"]} == {"t", "a", "s", "b"}  # no "p" leaf without opt-in


# ------------------------------------------------------------ hostile input

GOOD_LEAF = ["t", "float32", [2], 0, 8]


@pytest.mark.parametrize(
    "meta",
    [
        meta_of(None, v=2),
        meta_of(None, v=0),
        meta_of(None, v="1"),
        meta_of(None, v=True),
        meta_of(None, v=1.0),
        json.dumps({"n": 0, "L": [], "t": None}).encode(),
        b"",
        b"{",
        b"\xff\xfe{}",
        b"[]",
        b"null",
        b'"v"',
        b"NaN",
        meta_of(None)[:-1],
        b'{"v":1,"n":' + b"9" * 5000 + b',"L":[],"t":null}',
        json.dumps({"v": 1, "n": -1, "L": [], "t": None}).encode(),
        json.dumps({"v": 1, "n": 0, "L": {}, "t": None}).encode(),
        json.dumps({"v": 1, "n": "0", "L": [], "t": None}).encode(),
    ],
    ids=lambda m: repr(m[:40]),
)
def test_corrupt_metadata(meta: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode(meta, np.zeros(64, np.uint8))


@pytest.mark.parametrize(
    "leaf, n",
    [
        (["t", "float32", [2], 60, 8], 64),  # past the declared payload
        (["t", "float32", [2], 0, 8], 1 << 20),  # declared payload past the buffer
        (["t", "float32", [2, 3], 0, 20], 64),  # nbytes != shape x itemsize
        (["t", "float32", [2, 3], 0, 28], 64),
        (["t", "float32", [-2], 0, 8], 64),
        (["t", "float32", [2.0], 0, 8], 64),
        (["t", "float32", [True, 2], 0, 8], 64),
        (["t", "float32", [1] * 65, 0, 4], 64),
        (["t", "float32", 2, 0, 8], 64),
        (["t", "float32", [0, 10**30], 0, 0], 0),  # zero-size, absurd dims
        (["t", "float64", [0, 2**62, 2**62], 0, 0], 0),
        (["a", "<f4", [0, 2**62, 2**62], 0, 0], 0),
        (["t", "float32", [2], -8, 8], 64),
        (["t", "float32", [2], 0.0, 8], 64),
        (["t", "float32", [2], 0, -8], 64),
        (["t", "float99", [2], 0, 8], 64),
        (["t", "qint8", [2], 0, 2], 64),
        (["t", 5, [2], 0, 8], 64),
        (["x", "float32", [2], 0, 8], 64),
        (["a", "O", [2], 0, 16], 64),
        (["a", "V8", [2], 0, 16], 64),
        (["a", "i4,i4", [2], 0, 16], 64),
        (["a", "no such dtype", [2], 0, 16], 64),
        (["a", "S0", [3], 0, 0], 64),
        (["b", "float32", [8], 0, 8], 64),
        (["t", "float32", [2], 0], 64),
        ("leaf", 64),
    ],
    ids=str,
)
def test_bad_leaf_table(leaf: Any, n: int) -> None:
    for size in (64, 0):  # an empty payload is what a zero-byte batch is decoded from
        with pytest.raises(ProtocolError):
            codec.decode(meta_of(["@", 0], [leaf], n=n), np.zeros(size, np.uint8))


def test_good_leaf_table_reference_decodes() -> None:
    # The baseline the bad cases above mutate.
    out = codec.decode(meta_of(["@", 0], [GOOD_LEAF], n=64), np.zeros(64, np.uint8))
    assert out.shape == (2,) and out.dtype == torch.float32


def _nest(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = ["L", [node]]
    return node


@pytest.mark.parametrize(
    "tree",
    [
        ["X", 1],
        ["@"],
        ["@", 1],
        ["@", -1],
        ["@", True],
        ["@", 0.0],
        ["@", 0, 0],
        ["L"],
        ["L", 1],
        ["L", [1], 2],
        ["D", [[1]]],
        ["D", [1, 2]],
        ["D", [[["L", []], 1]]],  # unhashable key
        ["D", [[["@", 0], 1]]],  # the leaf is a numpy array: unhashable
        ["F", "1.5"],
        ["F", 1.5],
        ["I", 12],
        ["I", "zz"],
        ["N", "os:path", []],
        ["N", "os.path:join", []],
        ["N", "collections:OrderedDict", []],
        ["N", "no_such_module_xyz:T", []],
        ["N", "", []],
        ["N", ":T", []],
        ["N", "a:b:c", []],
        ["N", 5, []],
        ["N", "tests.unit.test_codec:Point", [1]],  # wrong arity
        ["N", "tests.unit.test_codec:Point", "xy"],
        ["N", "tests.unit.test_codec:Sample", [1, 2]],  # a dataclass, not a namedtuple
        ["C", "tests.unit.test_codec:Point", []],  # a namedtuple, not a dataclass
        ["C", "tests.unit.test_codec:Plain", []],
        ["C", "tests.unit.test_codec:Sample", [["__dict__", ["D", []]]]],
        ["C", "tests.unit.test_codec:Sample", [["nope", 1]]],
        ["C", "tests.unit.test_codec:Slotted", [["zzz", 1]]],
        ["C", "tests.unit.test_codec:Sample", [[1, 1]]],
        [],
        [1, 2],
        {"a": 1},
        _nest(codec.MAX_DEPTH + 5),
    ],
    ids=lambda t: repr(t)[:50],
)
def test_bad_tree(tree: Any) -> None:
    leaves = [["a", "<f4", [2], 0, 8]]
    with pytest.raises(ProtocolError):
        codec.decode(meta_of(tree, leaves, n=8), np.zeros(8, np.uint8))


def test_tree_at_max_depth_is_fine() -> None:
    assert codec.decode(meta_of(_nest(codec.MAX_DEPTH)), np.zeros(0, np.uint8)) == _nest_value(
        codec.MAX_DEPTH
    )


def _nest_value(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def test_json_nesting_beyond_the_recursion_limit() -> None:
    meta = b'{"v":1,"n":0,"L":[],"t":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(ProtocolError):
        codec.decode(meta, np.zeros(0, np.uint8))


def test_oversized_metadata_refused_before_parsing(monkeypatch) -> None:
    monkeypatch.setattr(codec, "MAX_META_BYTES", 100)
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.decode(meta_of("x" * 200), np.zeros(0, np.uint8))


# --------------------------------------------------------------- hypothesis

_DTYPE_NAMES = sorted(codec._TORCH_DTYPES)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = codec._TORCH_DTYPES[draw(st.sampled_from(_DTYPE_NAMES))]
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=draw(st.sampled_from([2, 4, 7])))))
    t = random_tensor(dtype, shape, seed=draw(st.integers(0, 2**32 - 1)))
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)
    return t


_keys = st.one_of(
    st.text(max_size=8), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=3))
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    tensors(),
)
batches = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
        st.builds(Point, children, children),
        st.builds(Sample, children, children, children),
    ),
    max_leaves=12,
)


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_fuzz_random_batches_round_trip(batch: Any) -> None:
    out, enc, _ = roundtrip(batch)
    assert_same(out, batch)
    json.loads(enc.meta)


@functools.cache
def _valid_meta() -> tuple[bytes, int]:
    enc = codec.encode(
        {
            "t": torch.ones(2, 3),
            "a": np.arange(3, dtype=">i2"),
            "s": np.float64(1),
            "b": b"xyz",
            "p": Point(1.5, [math.nan, 10**5000]),
            "c": Sample(True, None, ("k",)),
            "k": {(1, 2): "v"},
        }
    )
    return enc.meta, enc.nbytes


_names = st.sampled_from(
    [
        "tests.unit.test_codec:Point",
        "tests.unit.test_codec:Sample",
        "tests.unit.test_codec:Slotted",
        "os:path",
        "collections:OrderedDict",
        "json:JSONDecodeError",
        "@",
        "L",
        "T",
        "D",
        "N",
        "C",
        "F",
        "I",
        "t",
        "a",
        "s",
        "b",
        "p",
        "float32",
        "<f4",
        "O",
        "nan",
        "inf",
        "ff",
    ]
)
_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**65), 2**65),
        st.floats(allow_nan=False),
        _names,
        st.text(alphabet="abc:.@LTDNC", max_size=6),
    ),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.sampled_from("vnLt"), c, max_size=4),
    max_leaves=10,
)


def _mutate_json(doc: Any, path: list[int], value: Any) -> Any:
    """Replace the node reached by following ``path`` (indices mod len) with ``value``."""
    if not path or not isinstance(doc, list | dict) or not doc:
        return value
    if isinstance(doc, dict):
        key = list(doc)[path[0] % len(doc)]
        return {**doc, key: _mutate_json(doc[key], path[1:], value)}
    i = path[0] % len(doc)
    return [*doc[:i], _mutate_json(doc[i], path[1:], value), *doc[i + 1 :]]


def _decode_only_protocol_errors(meta: bytes, payload: np.ndarray) -> None:
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        codec.decode(meta, payload)


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_only_protocol_error(meta: bytes) -> None:
    _decode_only_protocol_errors(meta, np.zeros(64, np.uint8))


@settings(deadline=None, max_examples=300)
@given(
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from("xid")),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 128),
)
def test_fuzz_byte_mutations_of_valid_metadata(edits, extra: int) -> None:
    valid, size = _valid_meta()
    meta = bytearray(valid)
    for pos, byte, op in edits:
        pos %= len(meta) + 1
        if op == "x" and pos < len(meta):
            meta[pos] = byte
        elif op == "i":
            meta[pos:pos] = bytes([byte])
        elif pos < len(meta):
            del meta[pos]
    _decode_only_protocol_errors(bytes(meta), np.zeros(max(size - 64, 0) + extra, np.uint8))


@settings(deadline=None, max_examples=600)
@given(st.lists(st.integers(0, 50), max_size=7), _json, st.integers(-64, 64))
def test_fuzz_structural_mutations_of_valid_metadata(path, value, size_delta) -> None:
    valid, size = _valid_meta()
    doc = _mutate_json(json.loads(valid), path, value)
    meta = json.dumps(doc).encode()
    _decode_only_protocol_errors(meta, np.zeros(max(size + size_delta, 0), np.uint8))


# ------------------------------------------------------- refusals and boundaries


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_is_refused_by_path(layout) -> None:
    nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=layout)
    with pytest.raises(UnsupportedBatchError, match=r"batch\['x'\]\[1\] .*nested tensors") as info:
        codec.encode({"x": [torch.zeros(1), nt]})
    assert "unbind()" in str(info.value)


def test_lazily_conjugated_or_negated_views_are_never_placed_as_raw_bits() -> None:
    """NOTE [placed leaves]: a conj/neg view's memory holds the unconjugated
    bits; placing it where it lies would deliver the wrong values."""
    dest = np.zeros(4096, np.uint8)
    base = torch.from_numpy(dest[:256]).view(torch.complex64)  # lies in dest at offset 0
    base[:] = torch.arange(32, dtype=torch.float32) + 1j * torch.arange(32, dtype=torch.float32)
    lazy = {
        "plain": (base, False),  # the control: a plain view that lies there is placed
        "conj": (base.conj(), True),
        "neg": (torch._neg_view(torch.view_as_real(base)), True),  # what .conj().imag makes
    }
    for key, (view, is_lazy) in lazy.items():
        assert (view.is_conj() or view.is_neg()) is is_lazy, key
        offset = view.data_ptr() - dest.__array_interface__["data"][0]
        enc = codec.encode({"z": view}, placed=lambda obj, n, at=offset: at, start=512)
        assert (enc.sources[0] is not None) is is_lazy, f"{key}: placed as its raw bits"
        want = view.resolve_conj().resolve_neg().clone()
        codec.write_payload(enc, dest)
        assert torch.equal(codec.decode(enc.meta, dest)["z"], want), key


@pytest.mark.parametrize("limit", [64, 4096, 64 << 10])
def test_a_leaf_of_exactly_the_small_copy_size_is_copied(limit) -> None:
    """``own_below`` (``SHMLOADER_SMALL_COPY``) is inclusive: exactly that many
    bytes is an owned copy, one element more is a view of the payload."""
    at_limit = torch.ones(limit // 4, dtype=torch.int32)
    over = torch.ones(limit // 4 + 1, dtype=torch.int32)
    arr = np.ones(limit // 8, np.float64)
    enc = codec.encode({"at": at_limit, "over": over, "arr": arr})
    buf = np.zeros(enc.nbytes, np.uint8)
    codec.write_payload(enc, buf)
    out = codec.decode(enc.meta, buf, own_below=limit)
    assert not np.shares_memory(out["at"].numpy(), buf)
    assert not np.shares_memory(out["arr"], buf)
    assert np.shares_memory(out["over"].numpy(), buf)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_passes_through_with_sharing_off(caplog) -> None:
    """NOTE [sharing off is plain torch] (local): delivered as made, with one warning
    naming what sharing would refuse."""
    from shmloader import Config, ShmLoader

    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    loader = ShmLoader(lambda: [{"x": nt}], None, config=Config(enabled=False))
    try:
        with caplog.at_level("WARNING", logger="shmloader"):
            batch = next(iter(loader))
        assert batch["x"] is nt
        assert any("batch['x']" in r.getMessage() and "nested" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
    finally:
        loader.close()

"""The codec: a batch <-> (small metadata, payload layout).

Pure: no I/O. It owns the metadata format (UTF-8 JSON, never pickle, versioned)
and the payload layout (aligned offsets, one flat buffer:
docs/internals/wire.md): ``encode`` walks a batch once and refuses what it
cannot carry before a byte is written, ``write_payload`` copies leaves into any
writable buffer (NOTE [placed leaves]), ``decode`` rebuilds the batch as views
of a buffer, validating untrusted metadata, and ``rebuild_mapping`` is the one
rebuild of a mapping (NOTE [mappings]); how a batch's types are named and looked
up is ``typenames``' (NOTE [no imports from metadata]). It touches only the buffers
it is given and imports only ``typenames`` and ``errors``; the ring and the
cross-node path take its output as a value.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import json
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch

from ..errors import ProtocolError, UnsupportedBatchError
from .typenames import name_of, resolve, resolves_back

FORMAT_VERSION = 1
ALIGN = 64
#: Refuse trees deeper than this on decode (a hostile or corrupt message must
#: not exhaust the stack).
MAX_DEPTH = 64
MAX_META_BYTES = 64 << 20
#: Most dimensions of a leaf (numpy's own limit); enforced on encode as well as
#: on decode, so the leader refuses what no follower could rebuild.
MAX_NDIM = 64
#: Why a tensor that requires grad is refused, and what to do instead (pickling
#: would not help: an autograd graph does not cross processes).
_REQUIRES_GRAD = (
    "it requires grad (requires_grad=True), and an autograd graph cannot be shared "
    "between processes",
    "Detach it in your collate_fn (tensor.detach(), or build it under torch.no_grad()); "
    "if your model needs it to require grad, call requires_grad_() on the delivered "
    "batch. Config.from_env(allow_pickle=True) does not change this.",
)
#: Ints longer than this many bits travel as hex (["I", ...]): Python refuses
#: to convert ints of more than ``sys.get_int_max_str_digits()`` (>= 640)
#: decimal digits to or from text, which a plain JSON number would need.
_MAX_JSON_INT_BITS = 2000
# NOTE [platform-dependent numpy types]
#     ``np.longdouble`` / ``np.clongdouble`` (``float128``, ``complex256``) are
#     the x87 80-bit extended type in 12 or 16 bytes on x86, IEEE quad on
#     aarch64 and plain double elsewhere; the bytes past the 80 bits are
#     padding whose content is undefined. Arrays are copied bit for bit (a void
#     view, never numpy's value loops, which may skip the padding), so an array
#     arrives byte-identical. A *scalar* round-trips by value: numpy itself
#     builds a scalar from a value, so its padding bytes are whatever numpy
#     left there. Ranks must share the platform's long double format (the
#     dtype string, e.g. ``<f16``, is checked on decode).
#: Leaves of these item sizes are copied as raw integers of the same size:
#: some dtypes (uint1..7, int1..7) have no copy kernel at all, and bytes are
#: bytes whatever the dtype.
#: NOTE [platform-dependent numpy types]: copied as bits, not values.
_PADDED = (np.longdouble, np.clongdouble)
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _torch_dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for name in dir(torch):
        d = getattr(torch, name)
        if not isinstance(d, torch.dtype):
            continue
        key = str(d).removeprefix("torch.")
        if key.startswith(("qint", "quint")):
            continue  # quantized tensors carry scales: not plain bytes
        try:
            if d.itemsize < 1:
                continue  # sub-byte dtypes have no byte-addressable layout
        except (AttributeError, RuntimeError):
            continue
        table[key] = d
    return table


_TORCH_DTYPES = _torch_dtype_table()
_NUMPY_KINDS = set("biufcMmSU?")  # no object, void/structured
_PY_LEAVES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Leaf:
    """One array-like leaf in the payload: where it lives and how to view it."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Encoded:
    """What ``encode`` returns: metadata bytes plus the sources to copy.

    ``meta`` is what travels (ZeroMQ, broadcast); ``leaves`` and ``nbytes`` are
    the layout; ``sources[i]`` is the object whose bytes go at
    ``leaves[i].offset``.
    """

    meta: bytes
    nbytes: int
    leaves: tuple[Leaf, ...]
    sources: tuple[Any, ...]  # None: the leaf already lies in place (NOTE [placed leaves])


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


# --------------------------------------------------------------------- encode


# NOTE [placed leaves]
#     A writer that made some leaves directly inside the destination buffer (a
#     DataLoader worker whose collate stacked into its ring slot, see
#     ``collate``) passes ``placed=``: a leaf whose bytes already lie there,
#     contiguous and ``ALIGN``-aligned, keeps that offset and is not copied
#     again (its source in ``Encoded`` is ``None``); the other leaves follow
#     from ``start`` on, in first-seen order. Placed leaves never overlap one
#     another (a second view of the same bytes is copied like any other leaf),
#     so readers see the same independent leaves either way; the gaps between
#     leaves are never read. Decoders need nothing new: every leaf carries its
#     offset.
#: ``placed(obj, nbytes)``: the offset at which ``obj``'s bytes already lie in
#: the destination, or None (NOTE [placed leaves]).
Placed = Callable[[Any, int], "int | None"]


class _Encoder:
    def __init__(self, allow_pickle: bool, placed: Placed | None = None, start: int = 0) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        self.sources: list[Any] = []
        self.seen: dict[int, int] = {}  # id(obj) -> leaf index, for aliases
        self.keep: list[Any] = []  # keep ids stable while encoding
        self.offset = start  # where the next copied leaf goes
        self.end = 0  # end of the last byte of any leaf
        self.placed = placed
        self.spans: list[tuple[int, int]] = []  # placed leaves' [start, end)

    def leaf(self, obj: Any, kind: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> list:
        index = self.seen.get(id(obj))
        if index is None:
            index = len(self.leaves)
            self.seen[id(obj)] = index
            self.keep.append(obj)
            offset = self.in_place(obj, kind, nbytes)
            source = None if offset is not None else obj
            if offset is None:
                offset = align(self.offset)
                self.offset = offset + nbytes
            self.leaves.append(Leaf(kind, dtype, shape, offset, nbytes))
            self.sources.append(source)
            self.end = max(self.end, offset + nbytes)
        return ["@", index]

    def in_place(self, obj: Any, kind: str, nbytes: int) -> int | None:
        """``obj``'s offset in the destination when it already lies there (NOTE [placed leaves])."""
        if self.placed is None or kind not in ("t", "a") or nbytes == 0:
            return None
        if kind == "t" and (not obj.is_contiguous() or obj.is_conj() or obj.is_neg()):
            return None
        if kind == "a" and not obj.flags.c_contiguous:
            return None
        offset = self.placed(obj, nbytes)
        if offset is None or offset % ALIGN:
            return None
        end = offset + nbytes
        if any(a < end and offset < b for a, b in self.spans):
            return None  # another view of bytes already placed: copy this one
        self.spans.append((offset, end))
        return offset

    def node(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t in _PY_LEAVES:
            if t is float and not math.isfinite(obj):
                return ["F", repr(obj)]  # JSON has no inf/nan
            if t is int and obj.bit_length() > _MAX_JSON_INT_BITS:
                return ["I", format(obj, "x")]  # json.dumps would raise ValueError
            return obj
        if t is torch.Tensor or isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, np.ndarray):
            if isinstance(obj, np.ma.MaskedArray | np.matrix):
                # Would arrive as a plain ndarray: the mask (or matrix
                # semantics) silently lost.
                raise UnsupportedBatchError(
                    path, obj, "numpy array subclasses other than memmap are not carried"
                )
            return self.ndarray(obj, path, "a")
        if isinstance(obj, np.generic):
            return self.ndarray(np.asarray(obj), path, "s")
        if t is bytes:
            return self.leaf(obj, "b", "uint8", (len(obj),), len(obj))
        if t is list:
            return ["L", [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]]
        if t is tuple:
            return ["T", [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]]
        if t is dict:
            return [
                "D",
                [
                    [self.key(k, path), self.node(v, f"{path}[{_key_text(k)}]")]
                    for k, v in obj.items()
                ],
            ]
        if isinstance(obj, tuple) and hasattr(t, "_fields"):
            items = [self.node(getattr(obj, f), f"{path}.{f}") for f in t._fields]
            return ["N", self.type_name(t, obj, path, "namedtuple"), items]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = [
                [f.name, self.node(getattr(obj, f.name), f"{path}.{f.name}")]
                for f in dataclasses.fields(obj)
            ]
            return ["C", self.type_name(t, obj, path, "dataclass"), fields]
        if isinstance(obj, collections.abc.Mapping):
            why = _unrebuildable(obj)
            if why is None:
                return self.mapping(obj, path)
            if not self.allow_pickle:
                raise UnsupportedBatchError(
                    path,
                    obj,
                    f"{why}, so a rebuilt {t.__qualname__} would differ from this one "
                    "(NOTE [mappings] in shmloader/_proto/codec.py)",
                    "Return a plain dict of its items from your collate_fn (dict(m)), or opt in "
                    "to pickling it whole with ShmLoader(..., config=Config.from_env("
                    "allow_pickle=True)) on every rank.",
                )
        if self.allow_pickle:
            try:
                blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise UnsupportedBatchError(path, obj, f"pickling failed: {exc}") from exc
            return self.leaf(blob, "p", "uint8", (len(blob),), len(blob))
        raise UnsupportedBatchError(path, obj)

    def type_name(self, t: type, obj: Any, path: str, what: str) -> str:
        """``t``'s importable name; refuse (before anything is written) a type
        that followers could not import by that name, e.g. one defined inside a
        function: they would otherwise drop every batch as malformed."""
        name = name_of(t)
        if not resolves_back(name, what, t):
            raise UnsupportedBatchError(
                path,
                obj,
                f"the {what} type {name} cannot be imported by that name on another rank; "
                "define it at module level of an importable module",
            )
        return name

    def mapping(self, obj: collections.abc.Mapping, path: str) -> list:
        t = type(obj)
        node: list[Any] = [
            "M",
            self.type_name(t, obj, path, "mapping"),
            [[self.key(k, path), self.node(v, f"{path}[{_key_text(k)}]")] for k, v in obj.items()],
        ]
        if isinstance(obj, collections.defaultdict):  # _unrebuildable checked its factory
            factory = obj.default_factory
            name = None if factory is None else _FACTORY_NAMES[factory]
            node.append(name)
        return node

    def key(self, key: Any, path: str) -> Any:
        if type(key) in _PY_LEAVES or type(key) is tuple:
            return self.node(key, f"{path} (a key)")
        raise UnsupportedBatchError(
            f"{path} (a key {key!r})", key, "dict keys must be str/int/float/bool/None/tuple"
        )

    def tensor(self, t: torch.Tensor, path: str) -> list:
        if t.is_nested:  # before anything asks its sizes, which a nested tensor has none of
            raise UnsupportedBatchError(
                path,
                t,
                "nested tensors are not carried; return t.unbind() (a list of tensors) or "
                "t.to_padded_tensor(0) from collate_fn",
            )
        if type(t) is not torch.Tensor:
            raise UnsupportedBatchError(
                path, t, "tensor subclasses are not carried; pass a plain tensor"
            )
        if t.device.type != "cpu":
            raise UnsupportedBatchError(
                path,
                t,
                f"a tensor on {t.device}; keep batches on the CPU and move them after delivery",
            )
        if t.layout != torch.strided:
            raise UnsupportedBatchError(path, t, f"layout {t.layout}; densify it (t.to_dense())")
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise UnsupportedBatchError(path, t, f"dtype {t.dtype} has no plain byte layout")
        if t.requires_grad:
            raise UnsupportedBatchError(path, t, *_REQUIRES_GRAD)
        if t.dim() > MAX_NDIM:  # decode refuses these: refuse them here, before writing
            raise UnsupportedBatchError(path, t, f"{t.dim()} dimensions; at most {MAX_NDIM}")
        return self.leaf(t, "t", name, tuple(t.shape), t.numel() * t.element_size())

    def ndarray(self, a: np.ndarray, path: str, kind: str) -> list:
        if a.dtype.kind not in _NUMPY_KINDS or a.dtype.fields is not None:
            raise UnsupportedBatchError(path, a, f"numpy dtype {a.dtype} is not a plain value type")
        return self.leaf(a, kind, a.dtype.str, tuple(a.shape), a.nbytes)


# NOTE [mappings]
#     A ``Mapping`` that is not a plain ``dict`` (``OrderedDict``, ``Counter``,
#     a ``UserDict`` subclass such as transformers' ``BatchEncoding``, any
#     importable mapping type) travels as its type's name and its items, and is
#     rebuilt as ``type(m)(items)``, the way ``default_collate`` rebuilds an
#     immutable mapping (a ``defaultdict`` as ``defaultdict(factory, items)``,
#     its factory ``None`` or a builtin type named in ``_FACTORIES``). A
#     mutable mapping's extra state (``default_collate`` keeps it with
#     ``copy.copy``) cannot travel without pickle, so the leader checks that the
#     rebuild loses none: the first time it meets a type, that ``type(m)(items)``
#     holds the same keys in the same order with the very same values; for
#     every batch, that each instance attribute and slot equals a fresh
#     ``type(m)({})``'s, but the one that holds the items (a ``UserDict``'s
#     ``data``, else the first dict of the very same items).
#     A ``BatchEncoding`` from ``tokenizer.pad`` (every padding collator)
#     passes; one from calling a fast tokenizer holds ``_encodings`` and is
#     refused, naming the attribute, before anything is written (or pickled
#     whole with ``allow_pickle``). The follower looks the type up as it does a
#     namedtuple's (NOTE [no imports from metadata]) and constructs it only if
#     it is a ``Mapping`` class other than ``dict``. ``rebuild_mapping`` is the
#     one rebuild every stage that walks a batch uses.
#: The ``default_factory`` values a ``defaultdict`` may carry (NOTE [mappings]):
#: builtin types only, so a peer never names a callable to run here.
_FACTORIES: dict[str, type] = {
    f.__name__: f
    for f in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)
}
_FACTORY_NAMES: dict[object, str] = {f: name for name, f in _FACTORIES.items()}
#: Per mapping type: the attributes and slots of a fresh ``type(m)({})``, once
#: its rebuild was checked (NOTE [mappings]).
_TEMPLATES: dict[type, dict[str, Any]] = {}
_ABSENT = object()


def rebuild_mapping(cls: type[Any], items: dict, factory: Any = None) -> Any:
    """A ``cls`` holding ``items``: the one rebuild of a mapping (NOTE [mappings])."""
    if issubclass(cls, collections.defaultdict):
        return cls(factory, items)
    return cls(items)


def rebuildable(obj: collections.abc.Mapping) -> bool:
    """Whether ``rebuild_mapping`` gives ``obj`` back (NOTE [mappings])."""
    return _unrebuildable(obj) is None


def _state(obj: Any) -> dict[str, Any]:
    """``obj``'s instance attributes and slots."""
    state = dict(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                state[name] = getattr(obj, name, _ABSENT)
    return state


def _storage(obj: collections.abc.Mapping, state: dict[str, Any]) -> str | None:
    """The one attribute that holds ``obj``'s items: a ``UserDict``'s ``data``, else the
    first dict of the very same items (NOTE [mappings])."""
    if isinstance(obj, collections.UserDict):
        return "data"
    items = None
    for name, value in state.items():
        if type(value) is dict and len(value) == len(obj):
            items = items if items is not None else [(k, id(v)) for k, v in obj.items()]
            if [(k, id(v)) for k, v in value.items()] == items:
                return name
    return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a tensor's == is no bool; anything else may raise anything
        return False


def _unrebuildable(obj: collections.abc.Mapping) -> str | None:
    """Why ``rebuild_mapping`` would not give back ``obj``, or None (NOTE [mappings])."""
    t = type(obj)
    factory = None
    if isinstance(obj, collections.defaultdict):
        factory = obj.default_factory
        if factory is not None and factory not in _FACTORY_NAMES:
            return (
                f"its default_factory {factory!r} cannot be named to another rank (only None or "
                f"one of {', '.join(sorted(_FACTORIES))} can)"
            )
    template = _TEMPLATES.get(t)
    if template is None:
        items = dict(obj.items())
        try:
            fresh = rebuild_mapping(t, {}, factory)
            again = rebuild_mapping(t, items, factory)
        except Exception as exc:
            return f"{t.__qualname__}(dict) raised {type(exc).__name__}: {exc}"
        if type(again) is not t or [(k, id(v)) for k, v in again.items()] != [
            (k, id(v)) for k, v in items.items()
        ]:
            return f"{t.__qualname__}(dict) does not hold the same items in the same order"
        template = _TEMPLATES[t] = _state(fresh)
    state = _state(obj)
    storage = _storage(obj, state)
    for name in [*state, *(k for k in template if k not in state)]:
        if name == storage:
            continue
        if not _same(state.get(name, _ABSENT), template.get(name, _ABSENT)):
            held = type(state.get(name)).__name__
            return f"its attribute {name} ({held}) is state beyond its items, which would be lost"
    return None


def _key_text(key: Any) -> str:
    """``repr(key)`` for a path; an int key of > 4300 digits has no repr (ValueError)."""
    try:
        return repr(key)
    except ValueError:
        return f"<{type(key).__name__} key>"


def encode(
    batch: Any, *, allow_pickle: bool = False, placed: Placed | None = None, start: int = 0
) -> Encoded:
    """Describe ``batch``: metadata bytes, payload layout and the sources to copy.

    ``placed`` and ``start``: leaves that already lie in the destination keep
    their offsets, the others go from ``start`` on (NOTE [placed leaves]).
    Raises :class:`UnsupportedBatchError` naming the path of the first leaf it
    cannot carry; nothing has been written anywhere when it does.
    """
    enc = _Encoder(allow_pickle, placed, start)
    tree = enc.node(batch, "batch")
    table = [[lf.kind, lf.dtype, list(lf.shape), lf.offset, lf.nbytes] for lf in enc.leaves]
    doc = {"v": FORMAT_VERSION, "n": enc.end, "L": table, "t": tree}
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        meta = text.encode()
    except UnicodeEncodeError:  # a str holding lone surrogates: escape it as \udXXX
        meta = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return Encoded(meta, enc.end, tuple(enc.leaves), tuple(enc.sources))


def write_payload(encoded: Encoded, dest: np.ndarray) -> None:
    """Copy every leaf of ``encoded`` into ``dest`` (a writable uint8 array).

    One pass per leaf, straight from the source's memory into ``dest``: a
    contiguous leaf is one memcpy, a non-contiguous tensor is gathered by
    ``copy_`` without an intermediate contiguous copy.
    """
    if dest.dtype != np.uint8 or dest.ndim != 1:
        raise TypeError(f"dest must be a 1-D uint8 array, got {dest.dtype} with shape {dest.shape}")
    if dest.nbytes < encoded.nbytes:
        raise ValueError(f"dest holds {dest.nbytes} bytes; the payload needs {encoded.nbytes}")
    for leaf, src in zip(encoded.leaves, encoded.sources, strict=True):
        if leaf.nbytes == 0 or src is None:  # nothing, or already in place
            continue
        window = dest[leaf.offset : leaf.offset + leaf.nbytes]
        if leaf.kind == "t":
            src = src.resolve_conj().resolve_neg()
            if src.is_contiguous():  # one plain memcpy: faster than copy_'s kernels
                np.copyto(window, src.reshape(-1).view(torch.uint8).numpy())
                continue
            out = torch.from_numpy(window).view(_TORCH_DTYPES[leaf.dtype]).view(leaf.shape)
            raw = _RAW_DTYPES.get(src.element_size())
            if raw is not None:  # copy the bits: uint1..7/int1..7 have no copy kernel
                out, src = out.view(raw), src.view(raw)
            out.copy_(src)
        elif leaf.kind in ("a", "s"):
            out = window.view(src.dtype).reshape(src.shape)
            if src.dtype.type in _PADDED:  # NOTE [platform-dependent numpy types]
                void = np.dtype(f"V{src.dtype.itemsize}")
                out, src = out.view(void), src.view(void)
            np.copyto(out, src, casting="no")
        else:  # bytes, pickle
            window[:] = np.frombuffer(src, dtype=np.uint8)


# --------------------------------------------------------------------- decode


def parse_meta(
    meta: bytes | memoryview, payload_size: int | None = None
) -> tuple[dict, list[Leaf]]:
    """Validate metadata; return the document and its leaf table.

    Checks the version, every field's type, that each leaf's ``nbytes`` is
    exactly its shape times its item size, and (when ``payload_size`` is
    given) that every leaf lies inside the payload. Raises
    :class:`ProtocolError` on anything else: corrupt metadata never reaches a
    memory access.
    """
    if len(meta) > MAX_META_BYTES:
        raise ProtocolError(f"metadata of {len(meta)} bytes exceeds {MAX_META_BYTES}")
    try:
        doc = json.loads(bytes(meta))
    except (ValueError, RecursionError) as exc:  # ValueError: also ints of > 4300 digits
        raise ProtocolError(f"metadata is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not _is_int(doc.get("v")) or doc["v"] != FORMAT_VERSION:
        version = doc.get("v") if isinstance(doc, dict) else None
        raise ProtocolError(
            f"metadata format version {version!r}; this build reads {FORMAT_VERSION}"
        )
    n, table = doc.get("n"), doc.get("L")
    if not _is_int(n) or n < 0 or not isinstance(table, list):
        raise ProtocolError("metadata lacks a valid payload size or leaf table")
    if payload_size is not None and n > payload_size:
        raise ProtocolError(f"metadata says {n} payload bytes; the buffer holds {payload_size}")
    leaves = [_parse_leaf(entry, n) for entry in table]
    return doc, leaves


def _is_int(x: Any) -> TypeGuard[int]:
    return type(x) is int


def _parse_leaf(entry: Any, payload_size: int) -> Leaf:
    if not (isinstance(entry, list) and len(entry) == 5):
        raise ProtocolError(f"bad leaf entry {entry!r:.80}")
    kind, dtype, shape, offset, nbytes = entry
    if kind not in ("t", "a", "s", "b", "p") or not isinstance(dtype, str):
        raise ProtocolError(f"bad leaf kind/dtype {kind!r}/{dtype!r:.40}")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"bad leaf shape {shape!r:.80}")
    if not (_is_int(offset) and _is_int(nbytes) and offset >= 0 and nbytes >= 0):
        raise ProtocolError(f"bad leaf offset/nbytes {offset!r}/{nbytes!r}")
    if offset + nbytes > payload_size:
        raise ProtocolError(
            f"leaf [{offset}, {offset + nbytes}) lies outside the {payload_size}-byte payload"
        )
    itemsize = _itemsize(kind, dtype)
    if math.prod(shape) * itemsize != nbytes:
        raise ProtocolError(f"leaf nbytes {nbytes} != shape {shape} x itemsize {itemsize}")
    # A zero-size leaf passes the check above whatever its other dims are;
    # torch and numpy fail (RuntimeError, OverflowError) on strides past int64.
    if math.prod(max(d, 1) for d in shape) * max(itemsize, 1) >= 1 << 63:
        raise ProtocolError(f"leaf shape {shape!r:.80} is too large")
    return Leaf(kind, dtype, tuple(shape), offset, nbytes)


def _itemsize(kind: str, dtype: str) -> int:
    if kind == "t":
        d = _TORCH_DTYPES.get(dtype)
        if d is None:
            raise ProtocolError(f"unknown torch dtype {dtype!r:.40}")
        return d.itemsize
    if kind in ("a", "s"):
        try:
            nd = np.dtype(dtype)
        except TypeError:
            raise ProtocolError(f"unknown numpy dtype {dtype!r:.40}") from None
        if nd.kind not in _NUMPY_KINDS or nd.fields is not None:
            raise ProtocolError(f"numpy dtype {dtype!r:.40} is not a plain value type")
        return nd.itemsize
    if dtype != "uint8":
        raise ProtocolError(f"bytes leaf with dtype {dtype!r:.40}")
    return 1


class _Decoder:
    def __init__(
        self, leaves: list[Leaf], payload: np.ndarray, allow_pickle: bool, own_below: int = 0
    ) -> None:
        self.leaves = leaves
        self.payload = payload
        self.allow_pickle = allow_pickle
        self.own_below = own_below
        self.built: dict[int, Any] = {}

    def leaf(self, index: Any) -> Any:
        if not _is_int(index) or not 0 <= index < len(self.leaves):
            raise ProtocolError(f"leaf reference {index!r:.40} out of range")
        if index in self.built:
            return self.built[index]
        lf = self.leaves[index]
        window = self.payload[lf.offset : lf.offset + lf.nbytes]
        if lf.kind in ("t", "a") and 0 < lf.nbytes <= self.own_below:
            window = window.copy()  # owned: keeping it keeps nothing of the payload
        if lf.kind == "t" and lf.nbytes == 0:
            # torch.from_numpy of an empty payload has stride 0, which view(dtype)
            # refuses: a zero-size tensor needs no bytes of the payload anyway.
            obj: Any = torch.empty(lf.shape, dtype=_TORCH_DTYPES[lf.dtype])
        elif lf.kind == "t":
            obj = torch.from_numpy(window).view(_TORCH_DTYPES[lf.dtype]).view(lf.shape)
        elif lf.kind == "a":
            obj = window.view(np.dtype(lf.dtype)).reshape(lf.shape)
        elif lf.kind == "s":
            obj = window.view(np.dtype(lf.dtype)).reshape(lf.shape)[()].copy()
        elif lf.kind == "b":
            obj = window.tobytes()
        else:
            if not self.allow_pickle:
                raise ProtocolError(
                    "batch holds a pickled leaf but allow_pickle is off on this rank"
                )
            obj = pickle.loads(window.tobytes())
        self.built[index] = obj
        return obj

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"batch tree deeper than {MAX_DEPTH}")
        if node is None or type(node) in (bool, int, float, str):
            return node
        if not (isinstance(node, list) and node and isinstance(node[0], str)):
            raise ProtocolError(f"bad tree node {node!r:.80}")
        tag, args = node[0], node[1:]
        try:
            if tag == "@":
                (index,) = args
                return self.leaf(index)
            if tag == "L":
                (items,) = args
                return [self.node(v, depth + 1) for v in _list(items)]
            if tag == "T":
                (items,) = args
                return tuple(self.node(v, depth + 1) for v in _list(items))
            if tag == "D":
                (items,) = args
                return {self.node(k, depth + 1): self.node(v, depth + 1) for k, v in _pairs(items)}
            if tag == "F":
                (text,) = args
                if text not in ("inf", "-inf", "nan"):
                    raise ProtocolError(f"bad float {text!r:.20}")
                return float(text)
            if tag == "I":
                (text,) = args
                if not isinstance(text, str):
                    raise ProtocolError(f"bad long int {text!r:.20}")
                return int(text, 16)
            if tag == "N":
                name, items = args
                cls = resolve(name, "namedtuple")
                return cls(*(self.node(v, depth + 1) for v in _list(items)))
            if tag == "M":
                name, items, *rest = args
                cls = resolve(name, "mapping")
                factory = None
                if issubclass(cls, collections.defaultdict):
                    (fname,) = rest
                    factory = None if fname is None else _FACTORIES.get(fname)
                    if fname is not None and factory is None:
                        raise ProtocolError(f"bad defaultdict factory {fname!r:.40}")
                elif rest:
                    raise ProtocolError(f"mapping node of {name} has {len(args)} fields")
                plain = {self.node(k, depth + 1): self.node(v, depth + 1) for k, v in _pairs(items)}
                try:
                    return rebuild_mapping(cls, plain, factory)
                except Exception as exc:  # the type's own constructor: it may raise anything
                    raise ProtocolError(
                        f"cannot rebuild the mapping type {name} on this rank "
                        f"({type(exc).__name__}: {exc})"
                    ) from None
            if tag == "C":
                name, items = args
                cls = resolve(name, "dataclass")
                obj: Any = object.__new__(cls)
                names = {f.name for f in dataclasses.fields(cls)}
                for field, value in _pairs(items):
                    # Only the class's own fields: any other name could replace
                    # __dict__, or raise AttributeError on a slots dataclass.
                    if not isinstance(field, str) or field not in names:
                        raise ProtocolError(f"bad dataclass field {field!r:.40}")
                    object.__setattr__(obj, field, self.node(value, depth + 1))
                return obj
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"malformed {tag!r} node: {exc}") from None
        raise ProtocolError(f"unknown tree tag {tag!r:.20}")


def _list(items: Any) -> list:
    if not isinstance(items, list):
        raise ProtocolError(f"expected a list, got {type(items).__name__}")
    return items


def _pairs(items: Any) -> Iterator[tuple[Any, Any]]:
    for pair in _list(items):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ProtocolError(f"expected a [key, value] pair, got {pair!r:.60}")
        yield pair[0], pair[1]


def decode(
    meta: bytes | memoryview,
    payload: np.ndarray,
    *,
    allow_pickle: bool = False,
    own_below: int = 0,
) -> Any:
    """Rebuild the batch described by ``meta`` with tensors viewing ``payload``.

    ``payload`` is a 1-D uint8 numpy array (a mapping of a ring slot, or a
    received buffer). Tensors and arrays are views into it: no payload byte is
    copied, except that tensors and arrays of at most ``own_below`` bytes are
    owned copies (keeping one keeps nothing of ``payload`` alive). Leaves that
    were one object on the leader are one object here.
    """
    if payload.dtype != np.uint8 or payload.ndim != 1:
        raise TypeError(f"payload must be a 1-D uint8 array, got {payload.dtype} {payload.shape}")
    doc, leaves = parse_meta(meta, payload.nbytes)
    return _Decoder(leaves, payload, allow_pickle, own_below).node(doc.get("t"), 0)


def owned_copy(batch: Any) -> Any:
    """Replace shared views by owned copies (``SHMLOADER_COPY=1``).

    A module-level recursion with an explicit memo, not a nested closure: a
    closure that refers to itself is a reference cycle, which would keep the
    copies (and through them nothing else, but still memory) alive until the
    cycle collector runs.
    """
    return _clone(batch, {})


def _clone(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor | np.ndarray):
        if id(obj) not in memo:  # aliases stay aliases
            memo[id(obj)] = obj.clone() if isinstance(obj, torch.Tensor) else obj.copy()
        return memo[id(obj)]
    if isinstance(obj, list):
        return [_clone(v, memo) for v in obj]
    if type(obj) is tuple:
        return tuple(_clone(v, memo) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_clone(v, memo) for v in obj))
    if type(obj) is dict:
        return {k: _clone(v, memo) for k, v in obj.items()}
    if isinstance(obj, collections.abc.Mapping) and rebuildable(obj):
        # as the codec rebuilt it (NOTE [mappings]); one it could not came unpickled, owned
        items = {k: _clone(v, memo) for k, v in obj.items()}
        return rebuild_mapping(type(obj), items, getattr(obj, "default_factory", None))
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        new = copy.copy(obj)
        for name in obj.__dataclass_fields__:
            object.__setattr__(new, name, _clone(getattr(obj, name), memo))
        return new
    return obj

"""Pure tests of the signalling messages: frames() <-> parse()."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmloader._proto import wire
from shmloader._proto.wire import SCHEMA, Kind
from shmloader.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)

_HEADER = struct.Struct("<2sBBQ")


def valid_body(kind: Kind) -> dict[str, Any]:
    """A body with every field of ``kind``: distinct ints, non-ASCII strs."""
    return {
        name: (i + 3 if typ is int else f"/shml-é-{name}")
        for i, (name, typ) in enumerate(SCHEMA[kind].items())
    }


def header(kind: int = Kind.ACK, seq: int = 0, magic: bytes = b"SL", version: int = 1) -> bytes:
    return _HEADER.pack(magic, version, kind, seq)


def body_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def test_schema_covers_every_kind() -> None:
    assert set(SCHEMA) == set(Kind)
    assert [k.value for k in Kind] == list(range(1, len(Kind) + 1))  # zero stays invalid


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@pytest.mark.parametrize("seq", [0, 1, 2**64 - 1])
def test_round_trip_every_kind(kind: Kind, seq: int) -> None:
    body = valid_body(kind)
    parts = wire.frames(kind, seq, **body)
    assert len(parts) == 2
    assert all(isinstance(p, bytes) for p in parts)
    msg = wire.parse(parts)
    assert msg == wire.Message(kind, seq, body, b"")
    for name, value in body.items():
        assert msg[name] == value and type(msg[name]) is type(value)


@pytest.mark.parametrize("blob", [b"", b'{"v":1}', bytes(range(256)) * 10])
def test_round_trip_with_blob(blob: bytes) -> None:
    body = valid_body(Kind.BATCH)
    parts = wire.frames(Kind.BATCH, 7, blob=memoryview(blob), **body)
    assert len(parts) == 3
    msg = wire.parse([bytes(p) for p in parts])
    assert msg.blob == blob and type(msg.blob) is bytes
    assert msg.kind is Kind.BATCH and msg.seq == 7 and msg.body == body


def test_batch_slot_minus_one_is_allowed() -> None:
    # slot -1: a batch without payload bytes (nothing to map).
    body = {**valid_body(Kind.BATCH), "slot": -1, "nbytes": 0}
    assert wire.parse(wire.frames(Kind.BATCH, **body))["slot"] == -1


def test_extra_fields_are_ignored_but_kept() -> None:
    parts = [header(Kind.ACK), body_bytes({"rank": 1, "future": [1, 2]})]
    assert wire.parse(parts).body == {"rank": 1, "future": [1, 2]}


def test_header_layout() -> None:
    parts = wire.frames(Kind.BYE, 0x0102030405060708, rank=0)
    assert parts[0] == b"SL\x01\x09\x08\x07\x06\x05\x04\x03\x02\x01"


# ------------------------------------------------------------------ rejects

GOOD = [header(Kind.ACK, 5), body_bytes({"rank": 1})]


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [GOOD[0]],
        [*GOOD, b"", b""],
        [*GOOD, b"", b"", b""],
    ],
    ids=len,
)
def test_wrong_frame_count(parts: list[bytes]) -> None:
    with pytest.raises(ProtocolError, match="frames"):
        wire.parse(parts)


@pytest.mark.parametrize(
    "hdr, match",
    [
        (b"", "header"),
        (GOOD[0][:-1], "header"),
        (GOOD[0] + b"\x00", "header"),
        (header(magic=b"LS"), "magic"),
        (header(magic=b"\x00\x00"), "magic"),
        (header(version=0), "version"),
        (header(version=2), "version"),
        (header(version=255), "version"),
        (header(kind=0), "kind"),
        (header(kind=len(Kind) + 1), "kind"),
        (header(kind=255), "kind"),
    ],
    ids=repr,
)
def test_bad_header(hdr: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.parse([hdr, GOOD[1]])


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"\xff\xfe", b"{'rank': 1}", b'{"rank": NaN', b"[" * 100_000],
    ids=lambda r: repr(r[:12]),
)
def test_body_not_json(raw: bytes) -> None:
    with pytest.raises(ProtocolError, match="not JSON"):
        wire.parse([GOOD[0], raw])


@pytest.mark.parametrize("raw", [b"[]", b"[1]", b"1", b"null", b'"rank"', b"true"])
def test_body_not_an_object(raw: bytes) -> None:
    with pytest.raises(ProtocolError, match="not an object"):
        wire.parse([GOOD[0], raw])


def test_body_with_an_int_too_long_for_python() -> None:
    raw = b'{"rank": ' + b"7" * 5000 + b"}"
    with pytest.raises(ProtocolError):
        wire.parse([GOOD[0], raw])


_FIELDS = [(kind, name) for kind in Kind for name in SCHEMA[kind]]


@pytest.mark.parametrize("kind, name", _FIELDS, ids=lambda x: getattr(x, "name", x))
def test_missing_field(kind: Kind, name: str) -> None:
    body = valid_body(kind)
    del body[name]
    with pytest.raises(ProtocolError, match=f"{kind.name}.{name}"):
        wire.parse([header(kind), body_bytes(body)])
    with pytest.raises(ProtocolError):  # the sender checks too
        wire.frames(kind, **body)


_WRONG = {int: [True, False, 1.0, "1", None, [1], {"a": 1}], str: [1, None, True, ["x"], {}]}


@pytest.mark.parametrize("kind, name", _FIELDS, ids=lambda x: getattr(x, "name", x))
def test_wrong_typed_field(kind: Kind, name: str) -> None:
    for bad in _WRONG[SCHEMA[kind][name]]:
        body = {**valid_body(kind), name: bad}
        with pytest.raises(ProtocolError, match=f"{kind.name}.{name}"):
            wire.parse([header(kind), body_bytes(body)])
        with pytest.raises(ProtocolError):
            wire.frames(kind, **body)


@pytest.mark.parametrize(
    "field, value", [("nbytes", -1), ("slot", -2), ("gen", -1), ("nbytes", -(2**70))]
)
def test_batch_with_negative_sizes(field: str, value: int) -> None:
    body = {**valid_body(Kind.BATCH), field: value}
    with pytest.raises(ProtocolError, match="negative"):
        wire.parse([header(Kind.BATCH), body_bytes(body)])


def test_oversized_body_and_blob(monkeypatch) -> None:
    monkeypatch.setattr(wire, "MAX_BODY", 20)
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.parse([GOOD[0], body_bytes({"rank": 1, "pad": "x" * 30})])
    monkeypatch.setattr(wire, "MAX_BLOB", 10)
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.parse([*GOOD, b"x" * 11])
    assert wire.parse([*GOOD, b"x" * 10]).blob == b"x" * 10


# --------------------------------------------------------------- hypothesis


def _parse_only_protocol_errors(parts: list[bytes]) -> None:
    try:
        msg = wire.parse(parts)
    except ProtocolError:
        return
    # Whatever parses satisfies the schema exactly.
    for name, typ in SCHEMA[msg.kind].items():
        assert type(msg.body[name]) is typ


@settings(deadline=None, max_examples=300)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_fuzz_random_frames(parts: list[bytes]) -> None:
    _parse_only_protocol_errors(parts)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)
_field_names = st.sampled_from(sorted({n for s in SCHEMA.values() for n in s}))


@settings(deadline=None, max_examples=300)
@given(
    st.integers(0, 255),
    st.integers(0, 2),
    st.integers(0, 2**64 - 1),
    st.dictionaries(_field_names, _json, max_size=8),
    st.sampled_from([None, b"", b"blob"]),
    st.booleans(),
)
def test_fuzz_near_valid_messages(kind, version, seq, body, blob, start_valid) -> None:
    if start_valid and kind in Kind._value2member_map_:
        body = {**valid_body(Kind(kind)), **body}
    parts = [_HEADER.pack(b"SL", version, kind, seq), json.dumps(body).encode()]
    if blob is not None:
        parts.append(blob)
    _parse_only_protocol_errors(parts)


# ------------------------------------------------------- the cross-node header


def test_the_cross_node_header_carries_the_events_kind_as_on_a_node() -> None:
    """One vocabulary (issue 39): the first word of a cross-node header is the ``Kind``
    number a node message carries, and only the four cross-node kinds are accepted."""
    from shmloader._proto.wire import CROSS_KINDS

    assert {Kind.BATCH, Kind.END, Kind.ERROR, Kind.STOP} == CROSS_KINDS
    assert [int(k) for k in sorted(CROSS_KINDS)] == [2, 6, 7, 8]


@pytest.mark.parametrize("kind", [Kind.BATCH, Kind.END, Kind.ERROR, Kind.STOP])
def test_the_cross_node_header_is_eight_int64_words_in_field_order(kind) -> None:
    import torch

    from shmloader._proto.wire import CrossHeader

    head = CrossHeader(kind, it=3, nbytes=5, meta_len=7, draws=11, crc=0xFFFFFFFF, epoch=13, pos=17)
    words = [int(kind), 3, 5, 7, 11, 0xFFFFFFFF, 13, 17]
    assert head.pack() == torch.tensor(words, dtype=torch.int64).numpy().tobytes()
    assert CrossHeader.unpack(head.pack()) == head
    assert CrossHeader.unpack(torch.tensor(words, dtype=torch.int64).numpy().tobytes()).kind is kind


@pytest.mark.parametrize(
    "words",
    [
        [0, 1, 0, 0, 0, -1, 0, 0],
        [int(Kind.HELLO), 1, 0, 0, 0, -1, 0, 0],  # a node message's kind, not an event's
        [int(Kind.BATCH), 1, -1, 0, 0, -1, 0, 0],
    ],
)
def test_a_cross_node_header_of_an_unknown_kind_or_size_is_refused(words) -> None:
    from shmloader._proto.wire import CrossHeader

    with pytest.raises(ProtocolError, match="bad cross-node header"):
        CrossHeader.unpack(struct.pack("=8q", *words))

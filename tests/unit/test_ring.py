"""Segments and the ring, in one process: no ranks, no sockets.

The suite fixture fails any test that leaves a ``shml-*`` name in /dev/shm,
so every test here also proves its own cleanup.
"""

from __future__ import annotations

import errno
import gc
import json
import mmap
import os
import stat
import struct
import sys
import threading
import time

import numpy as np
import pytest
import torch

from shmloader._node import mapping, ring, segment
from shmloader._node.ring import (
    GRANULE,
    RingReader,
    RingWriter,
    SlotState,
    control_stem,
    new_token,
    slot_capacity_for,
    slot_stem,
)
from shmloader._node.segment import (
    HEADER_SIZE,
    HEADER_VERSION,
    KIND_CONTROL,
    KIND_DATA,
    KIND_PROBE,
    MAGIC,
    MY_START,
    PAGE,
    Header,
    Segment,
)
from shmloader._proto import codec
from shmloader.errors import ConfigError, ProtocolError, ShmCapacityError

pytestmark = pytest.mark.timeout(60)


def names(token: str) -> set[str]:
    """What of ring ``token`` is named in /dev/shm (as ``/shml-...``)."""
    return {"/" + n for n in os.listdir(segment.SHM_DIR) if n.startswith(f"shml-{token}-")}


@pytest.fixture
def token() -> str:
    return new_token()


@pytest.fixture
def made(token):
    """Create segments of ``token``; closed and unlinked at teardown."""
    segs: list[Segment] = []

    def make(suffix: str = "x", kind: int = KIND_DATA, capacity: int = PAGE) -> Segment:
        seg = Segment.create(f"/shml-{token}-{suffix}", kind, token, capacity)
        segs.append(seg)
        return seg

    yield make
    for seg in segs:
        seg.unlink()
        seg.close()


@pytest.fixture
def writer(token):
    """A ring writer with readers 1 and 2; closed at teardown."""
    writers: list[RingWriter] = []

    def make(readers=frozenset({1, 2}), **kw) -> RingWriter:
        w = RingWriter(token, frozenset(readers), {"job": "test", "token": token}, **kw)
        writers.append(w)
        return w

    yield make
    for w in writers:
        w.close()


# ------------------------------------------------------------------ segment


def test_create_makes_a_0600_segment_with_a_valid_header(made, token) -> None:
    seg = made("a", capacity=10_000)
    path = segment.shm_path(seg.name)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert seg.capacity == 12_288 and seg.capacity % PAGE == 0
    assert st.st_size == HEADER_SIZE + seg.capacity
    with open(path, "rb") as f:
        assert f.read(8) == MAGIC
    h = segment.read_header(seg.name)
    assert h == seg.header
    assert (h.kind, h.uid, h.token, h.pid, h.start) == (
        KIND_DATA,
        os.geteuid(),
        token,
        os.getpid(),
        MY_START,
    )
    assert h.capacity == seg.capacity and h.kind_name == "data"
    assert seg.name in segment.list_segments()


def test_create_under_a_permissive_umask_is_still_0600(made) -> None:
    old = os.umask(0)
    try:
        seg = made("umask")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(segment.shm_path(seg.name)).st_mode) == 0o600


def test_attach_validates_and_reads_the_same_bytes(made, token) -> None:
    seg = made("a")
    mm = seg.map_shared()
    mm[HEADER_SIZE : HEADER_SIZE + 5] = b"hello"
    other = Segment.attach(seg.name, kind=KIND_DATA, token=token)
    try:
        assert other.header == seg.header
        priv = other.map_private(5)
        assert priv[:5] == b"hello"
        priv.close()
    finally:
        other.close()
    mm.close()


def test_attach_refuses_wrong_kind_and_token(made, token) -> None:
    seg = made("a", kind=KIND_PROBE)
    with pytest.raises(ProtocolError, match="probe segment, expected data"):
        Segment.attach(seg.name, kind=KIND_DATA, token=token)
    with pytest.raises(ProtocolError, match="token"):
        Segment.attach(seg.name, kind=KIND_PROBE, token=new_token())
    Segment.attach(seg.name, kind=None, token=None).close()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666, 0o660, 0o601])
def test_attach_refuses_a_permissive_mode(made, token, mode) -> None:
    seg = made("a")
    os.chmod(segment.shm_path(seg.name), mode)
    with pytest.raises(ProtocolError, match="mode"):
        Segment.attach(seg.name, kind=KIND_DATA, token=token)
    with pytest.raises(ProtocolError, match="mode"):
        segment.read_header(seg.name)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another uid")
def test_attach_refuses_a_segment_of_another_uid(made, token) -> None:
    seg = made("a")
    os.chown(segment.shm_path(seg.name), 65534, -1)
    with pytest.raises(ProtocolError, match="belongs to uid 65534"):
        Segment.attach(seg.name, kind=KIND_DATA, token=token)


def test_attach_refuses_a_missing_segment(token) -> None:
    with pytest.raises(ProtocolError, match="does not exist"):
        Segment.attach(f"/shml-{token}-none", kind=KIND_DATA, token=token)


def _forge(token: str, suffix: str, content: bytes, mode: int = 0o600) -> str:
    name = f"/shml-{token}-{suffix}"
    fd = os.open(segment.shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, content)
    finally:
        os.close(fd)
    return name


def _header_bytes(token: str, **changes) -> bytes:
    fields = dict(
        kind=KIND_DATA,
        uid=os.geteuid(),
        token=token,
        pid=os.getpid(),
        start=MY_START,
        capacity=PAGE,
        created_ns=1,
    )
    fields.update(changes)
    return Header(**fields).pack()


def _raw_header(token: str, magic=MAGIC, version=HEADER_VERSION, kind=KIND_DATA, tok=None) -> bytes:
    tok = token.encode() if tok is None else tok
    return struct.pack("<8sHHI16sQQQQ", magic, version, kind, os.geteuid(), tok, 1, 1, PAGE, 1)


@pytest.mark.parametrize(
    "case, match",
    [
        ("garbage", "magic"),
        ("empty", "too short"),
        ("short", "too short"),
        ("version", "version 3; this build reads version 2"),
        ("version 1", "version 1; this build reads version 2"),
        ("payload offset", r"payload at byte \d+; this process maps payloads at \d+"),
        ("kind", "kind"),
        ("token bytes", "ASCII"),
        ("uid", "uid"),
        ("truncated payload", "promises"),
    ],
)
def test_attach_refuses_forged_or_corrupt_segments(token, case, match) -> None:
    pad = bytes(HEADER_SIZE + PAGE)
    content = {
        "garbage": os.urandom(HEADER_SIZE + PAGE),
        "empty": b"",
        "short": MAGIC + b"\x01\x00",
        "version": _raw_header(token, version=3).ljust(len(pad), b"\0"),
        "version 1": _raw_header(token, version=1).ljust(len(pad), b"\0"),
        "payload offset": _header_bytes(token, payload_at=2 * HEADER_SIZE).ljust(len(pad), b"\0"),
        "kind": _raw_header(token, kind=9).ljust(len(pad), b"\0"),
        "token bytes": _raw_header(token, tok=b"\xff" * 16).ljust(len(pad), b"\0"),
        "uid": _header_bytes(token, uid=os.geteuid() + 1).ljust(len(pad), b"\0"),
        "truncated payload": _header_bytes(token).ljust(HEADER_SIZE + PAGE - 1, b"\0"),
    }[case]
    name = _forge(token, "forged", content)
    try:
        with pytest.raises(ProtocolError, match=match):
            Segment.attach(name, kind=KIND_DATA, token=token)
    finally:
        segment.unlink_name(name)


def test_a_forged_but_well_formed_segment_is_accepted(token) -> None:
    # The baseline of the cases above: the forging helper itself is right.
    name = _forge(token, "forged", _header_bytes(token).ljust(HEADER_SIZE + PAGE, b"\0"))
    try:
        Segment.attach(name, kind=KIND_DATA, token=token).close()
    finally:
        segment.unlink_name(name)


def test_truncating_a_real_segment_is_refused(made, token) -> None:
    seg = made("a", capacity=4 * PAGE)
    os.truncate(segment.shm_path(seg.name), HEADER_SIZE + PAGE)
    with pytest.raises(ProtocolError, match="promises"):
        Segment.attach(seg.name, kind=KIND_DATA, token=token)
    os.truncate(segment.shm_path(seg.name), 10)
    with pytest.raises(ProtocolError, match="too short"):
        Segment.attach(seg.name, kind=KIND_DATA, token=token)


def test_create_is_exclusive_and_leaves_the_existing_one_alone(made, token) -> None:
    seg = made("a")
    with pytest.raises(ProtocolError, match="already exists") as info:
        Segment.create(seg.name, KIND_DATA, token, PAGE)
    assert "gc" in str(info.value)
    assert segment.read_header(seg.name) == seg.header  # not unlinked by the failure


def test_process_identity() -> None:
    me = os.getpid()
    assert segment.proc_start_time(me) == MY_START != 0
    assert segment.process_alive(me, MY_START)
    assert segment.process_alive(me, 0)  # start unknown: the pid alone
    assert not segment.process_alive(me, MY_START + 1)
    assert not segment.process_alive(me, MY_START - 1)
    assert not segment.process_alive(0, 0)
    assert not segment.process_alive(-1, 0)
    with open("/proc/sys/kernel/pid_max") as f:
        never = int(f.read())  # pids are < pid_max
    assert segment.proc_start_time(never) is None
    assert not segment.process_alive(never, 0)
    assert not segment.process_alive(10**30, 0)


def test_posix_fallocate_enospc_is_a_capacity_error(token, monkeypatch) -> None:
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = f"/shml-{token}-big"
    with pytest.raises(ShmCapacityError) as info:
        Segment.create(name, KIND_DATA, token, 10 * PAGE)
    msg = str(info.value)
    needed = HEADER_SIZE + 10 * PAGE
    assert info.value.needed == needed and f"{needed} bytes" in msg
    assert "free" in msg and "--shm-size" in msg and "SHMLOADER_SLOTS" in msg
    assert isinstance(info.value, MemoryError)
    assert names(token) == set()  # nothing left behind


def test_other_fallocate_errors_propagate_and_clean_up(token, monkeypatch) -> None:
    def broken(fd, offset, length):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError) as info:
        Segment.create(f"/shml-{token}-x", KIND_DATA, token, PAGE)
    assert info.value.errno == errno.EIO and not isinstance(info.value, ShmCapacityError)
    assert names(token) == set()


def test_private_mapping_is_copy_on_write(made) -> None:
    seg = made("a", capacity=2 * PAGE)
    shared = seg.map_shared()
    shared[HEADER_SIZE : HEADER_SIZE + 4] = b"abcd"
    priv = seg.map_private(4)
    assert len(priv) == PAGE  # whole pages
    priv[0:4] = b"WXYZ"
    assert shared[HEADER_SIZE : HEADER_SIZE + 4] == b"abcd"
    assert priv[0:4] == b"WXYZ"
    with pytest.raises(ProtocolError):
        seg.map_private(seg.capacity + 1)
    priv.close()
    shared.close()


def test_unlink_and_close_are_idempotent(made) -> None:
    seg = made("a")
    seg.unlink()
    seg.unlink()
    assert not os.path.exists(segment.shm_path(seg.name))
    assert not segment.unlink_name(seg.name)
    seg.close()
    seg.close()
    assert seg.fd == -1


def test_touch_faults_every_page(made) -> None:
    seg = made("a", capacity=8 * PAGE)
    mm = seg.map_shared()
    mm[HEADER_SIZE : HEADER_SIZE + 3] = b"abc"
    mapping.touch(mm)  # MADV_POPULATE_WRITE, or a write per page: contents unchanged
    assert mm[HEADER_SIZE : HEADER_SIZE + 3] == b"abc"
    assert mm[:8] == MAGIC
    mm.close()


def test_touch_without_madvise_populate_keeps_header_and_data(made, monkeypatch) -> None:
    """Kernels before 5.14 refuse MADV_POPULATE_WRITE: the per-page fallback must not write."""
    monkeypatch.setattr(mapping, "LIBC_MADVISE", lambda addr, length, advice: -1)
    seg = made("old", capacity=8 * PAGE)
    mm = mmap.mmap(seg.fd, HEADER_SIZE + 8 * PAGE, flags=mmap.MAP_SHARED)
    mm[HEADER_SIZE + PAGE : HEADER_SIZE + PAGE + 3] = b"xyz"
    mapping.touch(mm)
    assert mm[:8] == MAGIC and mm[HEADER_SIZE + PAGE : HEADER_SIZE + PAGE + 3] == b"xyz"
    mm.close()
    assert segment.read_header(seg.name) == seg.header


def test_touch_lets_other_threads_run(made) -> None:
    """NOTE [touch off the GIL] (mapping): another thread makes progress while a
    big slot's pages fault in. The switch interval is raised so that this thread
    never hands the GIL over by itself: the counter moves during the touch only
    if the touch releases it (with ``mmap.madvise`` it stays where it was)."""
    seg = made("big", capacity=256 << 20)
    mm = seg.map_shared()
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # a blocking call: gives the GIL back every iteration

    spinner = threading.Thread(target=spin)
    interval = sys.getswitchinterval()
    spinner.start()
    try:
        while count[0] == 0:  # the spinner runs
            time.sleep(0.001)
        sys.setswitchinterval(1000.0)
        time.sleep(0.01)  # the spinner's next wait for the GIL reads the new interval
        before = count[0]
        mapping.touch(mm)
        during = count[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        spinner.join(30)
        mm.close()
    assert during > 0, "no other thread ran while 256 MiB were touched: the touch held the GIL"


# --------------------------------------------------------------------- ring


def control_name(token: str) -> str:
    """The ring's control segment: the one name ``<control stem>.<random>``."""
    found = [n for n in names(token) if n.startswith(control_stem(token) + ".")]
    assert len(found) == 1, found
    return found[0]


def _ctl_description(token: str) -> dict:
    h = segment.read_header(control_name(token))
    assert h.kind == KIND_CONTROL
    with open(segment.shm_path(control_name(token)), "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<I", raw, HEADER_SIZE)
    return json.loads(raw[HEADER_SIZE + 4 : HEADER_SIZE + 4 + n])


def _ctl_counters(token: str) -> dict[str, int]:
    with open(segment.shm_path(control_name(token)), "rb") as f:
        raw = f.read(HEADER_SIZE)
    values = struct.unpack_from("<8Q", raw, 64)
    return dict(zip(ring.COUNTER_FIELDS, values, strict=True))


def test_writer_creates_a_control_segment_with_its_description(writer, token) -> None:
    w = writer()
    assert names(token) == {control_name(token)}
    assert _ctl_description(token) == {"job": "test", "token": token}
    w.describe({"x": "y" * (ring.CONTROL_CAPACITY + 10)})  # too big: truncated, still JSON
    assert _ctl_description(token) == {"truncated": True, "token": token}


def test_slot_sizes() -> None:
    assert slot_capacity_for(1) == GRANULE
    assert slot_capacity_for(GRANULE) == 2 * GRANULE  # headroom
    for n in (1, 1000, GRANULE + 1, 10**7):
        cap = slot_capacity_for(n)
        assert cap % GRANULE == 0 and cap >= n * ring.HEADROOM


def test_publish_reuse_and_growth(writer, token) -> None:
    w = writer()
    s0 = w.acquire(1000)
    assert (s0.index, s0.gen, s0.state) == (0, 0, SlotState.FREE)
    assert s0.segment.name.startswith(slot_stem(token, 0, 0) + ".")
    assert s0.segment.name in names(token)
    assert s0.payload.nbytes == s0.capacity >= 1000
    assert w.acquire(1000) is s0  # still FREE: the same slot
    w.hold_for_readers(s0, seq=1, nbytes=1000, publish_ns=5)
    assert s0.state == SlotState.HELD and s0.holders == {1, 2}
    s1 = w.acquire(1000)  # every slot HELD: the ring grows
    assert s1 is not s0 and (s1.index, s1.gen) == (1, 0)
    w.hold_for_readers(s1, seq=2, nbytes=10, publish_ns=5)
    w.release(1, 0, 0)
    assert s0.state == SlotState.HELD
    w.release(2, 0, 0)
    assert s0.state == SlotState.FREE
    assert w.acquire(500) is s0  # FREE again: reused, no growth
    assert len(w.slots) == 2
    assert [s.holders for s in w.slots] == [set(), {1, 2}]
    c = _ctl_counters(token)
    assert c["published"] == 2 and c["bytes_published"] == 1010 and c["publish_ns_total"] == 10
    assert c["slots"] == 2 and c["ring_bytes"] == w.total_bytes and c["readers"] == 2


def test_publishing_a_held_slot_is_a_bug(writer) -> None:
    w = writer()
    s = w.acquire(10)
    w.hold_for_readers(s, 1, 10, 0)
    with pytest.raises(AssertionError):
        w.hold_for_readers(s, 2, 10, 0)


def test_release_checks_holder_and_generation(writer) -> None:
    w = writer()
    s = w.acquire(10)
    w.hold_for_readers(s, 1, 10, 0)
    with pytest.raises(ProtocolError):
        w.release(3, 0, 0)  # not a holder
    with pytest.raises(ProtocolError):
        w.release(1, 0, 1)  # wrong generation
    with pytest.raises(ProtocolError):
        w.release(1, 5, 0)  # no such slot
    w.release(1, 0, 0)
    with pytest.raises(ProtocolError):
        w.release(1, 0, 0)  # twice
    assert s.state == SlotState.HELD


def test_best_fit_among_free_slots(writer) -> None:
    w = writer()
    big = w.acquire(10 * GRANULE)
    w.hold_for_readers(big, 1, 1, 0)
    small = w.acquire(10)
    assert small is not big
    for r in (1, 2):
        w.release(r, big.index, big.gen)
    assert w.acquire(10) is small
    assert w.acquire(2 * GRANULE) is big


def test_regrow_a_too_small_free_slot(writer, token) -> None:
    w = writer()
    s = w.acquire(10)
    old_name, old_cap = s.segment.name, s.capacity
    grown = w.acquire(old_cap * 3)
    assert (grown.index, grown.gen) == (0, 1)
    assert grown.capacity >= old_cap * 3
    assert s.state == SlotState.RETIRED
    assert old_name not in names(token)
    assert grown.segment.name.startswith(slot_stem(token, 0, 1) + ".")
    assert grown.segment.name in names(token)
    assert w.slots == [grown]
    # A late ATTACHED for the retired segment is harmless.
    w.attached(1, old_name)
    # Releases of the old generation are refused; the new one is independent.
    with pytest.raises(ProtocolError):
        w.release(1, 0, 0)


def test_a_slot_grown_for_one_large_batch_is_retired_once_batches_are_small(writer) -> None:
    """NOTE [ring shrink]: never while HELD; after SHRINK_WINDOW much smaller batches."""
    w = writer(readers=frozenset({1}))
    big_n, small_n = 16 << 20, 64 << 10
    small = w.acquire(small_n)
    w.hold_for_readers(small, 0, small_n, 1)
    big = w.acquire(big_n)  # the small one is HELD: the ring grows a large slot
    w.hold_for_readers(big, 1, big_n, 1)
    w.release(1, small.index, small.gen)
    peak = w.total_bytes
    assert peak > big_n
    for seq in range(2, 2 + ring.SHRINK_WINDOW):  # the large batch is still held
        s = w.acquire(small_n)
        assert s is small and big.state == SlotState.HELD
        w.hold_for_readers(s, seq, small_n, 1)
        w.release(1, s.index, s.gen)
    assert w.total_bytes == peak
    w.release(1, big.index, big.gen)  # now FREE, and the last batches were all small
    s = w.acquire(small_n)
    assert big.state == SlotState.RETIRED and big.segment.fd == -1  # memory given back
    assert w.total_bytes == ring.slot_capacity_for(small_n) and peak > 100 * w.total_bytes
    # the retired index comes back, right-sized, when the ring needs a second slot
    w.hold_for_readers(s, 99, small_n, 1)
    again = w.acquire(small_n)
    assert (again.index, again.gen) == (big.index, big.gen + 1)
    assert again.capacity == ring.slot_capacity_for(small_n)


def test_batches_that_vary_within_the_ratio_never_retire_a_slot(writer) -> None:
    w = writer(readers=frozenset({1}))
    sizes = [1 << 20, 3 << 20] * ring.SHRINK_WINDOW
    slots = set()
    for seq, n in enumerate(sizes):
        s = w.acquire(n)
        slots.add((s.index, s.gen))
        w.hold_for_readers(s, seq, n, 1)
        w.release(1, s.index, s.gen)
    assert all(s.state != SlotState.RETIRED for s in w.slots)
    assert len(slots) <= 2, slots  # at most one regrow, never a retire


def test_attach_of_every_reader_unlinks_the_data_name(writer, token) -> None:
    w = writer()
    s = w.acquire(10)
    name = s.segment.name
    w.attached(1, name)
    assert name in names(token)
    w.attached(1, name)  # again: still waiting for rank 2
    assert name in names(token)
    w.attached(2, name)
    assert name not in names(token)
    assert names(token) == {control_name(token)}  # the control segment stays named
    s.payload[:3] = [1, 2, 3]  # the mapping outlives the name
    with pytest.raises(ProtocolError):
        w.attached(1, f"/shml-{token}-9.9")


def test_without_readers_data_segments_are_never_named(writer, token) -> None:
    w = writer(readers=frozenset(), self_rank=0)
    s = w.acquire(10)
    assert names(token) == {control_name(token)}
    w.hold_for_readers(s, 1, 10, 0)
    assert s.holders == {0} and s.state == SlotState.HELD
    w.release(0, 0, 0)
    assert s.state == SlotState.FREE


def test_nobody_holding_a_published_slot_leaves_it_free(writer) -> None:
    w = writer(readers=frozenset())
    s = w.acquire(10)
    w.hold_for_readers(s, 1, 10, 0)
    assert s.state == SlotState.FREE


def test_drop_reader_frees_its_slots(writer) -> None:
    w = writer()
    a, b = w.acquire(10), None
    w.hold_for_readers(a, 1, 10, 0)
    b = w.acquire(10)
    w.hold_for_readers(b, 2, 10, 0)
    w.release(1, a.index, a.gen)
    w.drop_reader(2)
    assert a.state == SlotState.FREE and b.state == SlotState.HELD and b.holders == {1}


def test_close_unlinks_everything_and_is_idempotent(writer, token) -> None:
    w = writer()
    for _ in range(3):
        s = w.acquire(100)
        w.hold_for_readers(s, 0, 1, 0)
    assert len(names(token)) == 4
    keep = w.slots[0].payload  # an exported view must not stop close()
    w.close()
    assert names(token) == set()
    assert all(s.state == SlotState.RETIRED for s in w.slots)
    w.close()
    del keep


def test_a_dropped_unclosed_writer_unlinks_its_names(token) -> None:
    w = RingWriter(token, frozenset({1}), {})
    w.acquire(10)
    assert len(names(token)) == 2
    del w
    gc.collect()
    assert names(token) == set()


def test_a_failing_constructor_leaves_nothing(token) -> None:
    with pytest.raises(TypeError):
        RingWriter(token, frozenset({1}), {"not json": object()})
    gc.collect()
    assert names(token) == set()


class FakeDaemon:
    """The part of DaemonClient a ring writer uses: admission, adoption, bookkeeping."""

    def __init__(self, refuse_after: int = 1) -> None:
        self.asked: list[int] = []
        self.refuse_after = refuse_after
        self.segments: dict[str, int] = {}

    def admit(self, token: str, n: int) -> None:
        self.asked.append(n)
        if len(self.asked) > self.refuse_after:
            raise ShmCapacityError(n, 0, "node budget")

    def adopt(self, token: str, name: str, n: int) -> int | None:
        return None  # an empty warm pool

    def check_ring_dir(self, directory: str) -> None:
        pass  # watched

    def add_segment(self, token: str, name: str, n: int) -> None:
        self.segments[name] = n

    def remove_segment(self, token: str, name: str) -> None:
        self.segments.pop(name)


def test_admit_is_asked_before_a_slot_is_made(writer, token) -> None:
    daemon = FakeDaemon()
    w = writer(daemon=daemon)
    s = w.acquire(10)
    w.hold_for_readers(s, 1, 1, 0)
    with pytest.raises(ShmCapacityError):
        w.acquire(10)
    assert daemon.asked == [GRANULE + HEADER_SIZE] * 2
    assert len(w.slots) == 1 and len(names(token)) == 2
    assert daemon.segments == {s.segment.name: GRANULE + HEADER_SIZE}


def test_a_warm_pool_segment_is_adopted_instead_of_created(writer, token) -> None:
    class Pool(FakeDaemon):
        def adopt(self, token: str, name: str, n: int) -> int | None:
            made = Segment.create(name, KIND_DATA, token, n)  # what the daemon renames in
            made.close()
            return n

    daemon = Pool(refuse_after=0)  # admission would refuse: adoption must not ask it
    w = writer(daemon=daemon)
    s = w.acquire(10)
    assert daemon.asked == [] and s.capacity == GRANULE
    assert s.segment.name in daemon.segments


def test_shm_capacity_error_instead_of_sigbus(writer, token, monkeypatch) -> None:
    w = writer()
    monkeypatch.setattr(ring, "shm_free_bytes", lambda: 1000)
    with pytest.raises(ShmCapacityError) as info:
        w.acquire(1 << 20)
    msg = str(info.value)
    needed = slot_capacity_for(1 << 20) + HEADER_SIZE
    assert info.value.needed == needed and info.value.free == 1000
    assert f"{needed} bytes" in msg and "1000 B" in msg
    assert "--shm-size" in msg and "SHMLOADER_SLOTS" in msg
    assert names(token) == {control_name(token)} and w.slots == []


def test_real_fallocate_failure_in_the_ring(writer, token, monkeypatch) -> None:
    w = writer()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ShmCapacityError, match="SHMLOADER_SLOTS"):
        w.acquire(1 << 20)
    assert names(token) == {control_name(token)} and w.slots == []
    monkeypatch.undo()
    assert w.acquire(10).state == SlotState.FREE  # recovers once there is room


# ------------------------------------------------------------------- reader


def test_reader_sees_the_batch_and_release_follows_garbage(writer, token) -> None:
    w = writer()
    batch = {"x": torch.arange(1000, dtype=torch.int32), "y": [np.ones(3), b"raw"]}
    enc = codec.encode(batch)
    s = w.acquire(enc.nbytes)
    codec.write_payload(enc, s.payload)
    w.hold_for_readers(s, 1, enc.nbytes, 0)

    r = RingReader(token)
    try:
        assert r.open(s.segment.name) is True
        assert r.open(s.segment.name) is False
        w.attached(1, s.segment.name)
        released: list[int] = []
        view = r.view(s.segment.name, enc.nbytes, lambda: released.append(1))
        got = codec.decode(enc.meta, view)
        del view
        gc.collect()
        assert released == []  # the batch still holds the mapping
        assert torch.equal(got["x"], batch["x"]) and got["y"][1] == b"raw"
        x = got["x"]
        del got
        gc.collect()
        assert released == []  # one tensor of it is enough
        del x
        gc.collect()
        assert released == [1]
    finally:
        r.close()


def test_reader_writes_stay_private(writer, token) -> None:
    w = writer()
    s = w.acquire(100)
    s.payload[:100] = 7
    r = RingReader(token)
    try:
        r.open(s.segment.name)
        a = r.view(s.segment.name, 100, lambda: None)
        b = r.view(s.segment.name, 100, lambda: None)
        t = torch.from_numpy(a)
        t[:] = 99  # a follower modifies its batch in place
        assert (s.payload[:100] == 7).all()  # the writer's bytes are untouched
        assert (b == 7).all()  # so is another holder's view
        assert (a == 99).all()
        del t, a, b
    finally:
        r.close()


def test_reader_refuses_foreign_and_unopened_segments(writer, token, made) -> None:
    w = writer()
    s = w.acquire(10)
    r = RingReader(token)
    try:
        with pytest.raises(ProtocolError, match="never opened"):
            r.view(s.segment.name, 10, lambda: None)
        with pytest.raises(ProtocolError, match="does not belong"):
            r.open(f"/shml-{new_token()}-0.0")
        probe = made("0.7.abc", kind=KIND_PROBE)  # our token, wrong kind
        with pytest.raises(ProtocolError, match="probe"):
            r.open(probe.name)
        r.open(s.segment.name)
        with pytest.raises(ProtocolError):
            r.view(s.segment.name, s.capacity + 1, lambda: None)
    finally:
        r.close()
    assert r.segments == {}


def test_reader_mapping_survives_unlink_and_close(writer, token) -> None:
    w = writer()
    s = w.acquire(10)
    s.payload[:4] = [1, 2, 3, 4]
    r = RingReader(token)
    r.open(s.segment.name)
    view = r.view(s.segment.name, 4, lambda: None)
    w.attached(1, s.segment.name)
    w.attached(2, s.segment.name)  # the name is gone
    r.forget(s.segment.name)  # and the descriptor
    assert view.tolist() == [1, 2, 3, 4]
    r.close()


def test_a_stale_segment_of_a_dead_owner_is_never_reused(made, token) -> None:
    """Names are random (NOTE [unpredictable names]): a name taken, even by a dead
    owner's segment, is refused by ``create`` and skipped by ``create_unique``."""
    import dataclasses
    import subprocess

    seg = made("stale.0")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = dataclasses.replace(seg.header, pid=dead.pid, start=1)
    os.pwrite(seg.fd, stale.pack(), 0)
    with pytest.raises(ProtocolError, match="already exists"):
        Segment.create(seg.name, KIND_DATA, token, PAGE)
    assert segment.read_header(seg.name).pid == dead.pid  # left for gc, untouched
    fresh = Segment.create_unique(f"/shml-{token}-stale", KIND_DATA, token, PAGE)
    try:
        assert fresh.name != seg.name and fresh.name.startswith(f"/shml-{token}-stale.")
        assert segment.read_header(fresh.name).pid == os.getpid()
    finally:
        fresh.unlink()
        fresh.close()


def test_a_reader_closes_older_generations_when_a_slot_regrows(writer, token) -> None:
    w = writer(readers={1})
    r = RingReader(token)
    try:
        old = w.acquire(10)
        assert r.open(old.segment.name)
        w.hold_for_readers(old, 0, 10, 0)
        w.release(1, old.index, old.gen)
        grown = w.acquire(4 * GRANULE)  # the free slot is too small: regrown as gen 1
        assert (grown.index, grown.gen) == (old.index, old.gen + 1)
        assert r.open(grown.segment.name)
        assert list(r.segments) == [grown.segment.name], "gen 0's descriptor must be closed"
    finally:
        r.close()


def test_a_reader_that_left_is_no_longer_waited_for(writer, token) -> None:
    w = writer(readers={1, 2})
    w.drop_reader(2)
    s = w.acquire(10)
    w.hold_for_readers(s, 0, 10, 0)
    assert s.holders == {1}
    w.attached(1, s.segment.name)
    assert not s.segment.linked, "unlinked once every *live* reader attached"
    w.release(1, s.index, s.gen)
    assert s.state == SlotState.FREE


@pytest.mark.parametrize("order", ["dies-then-attach", "attach-then-dies"])
def test_a_reader_that_dies_before_mapping_leaves_no_name_once_the_others_opened(
    writer, token, order
) -> None:
    """Readers 1 and 2 are told about a slot; 2 dies before opening it. Once 1 opened
    it the name must go: nobody else will ever attach, and nobody would unlink it."""
    w = writer()
    slot = w.acquire(1000)
    w.hold_for_readers(slot, 0, 1000, 0)
    name = slot.segment.name
    steps = [lambda: w.drop_reader(2), lambda: w.attached(1, name)]
    for step in steps if order == "dies-then-attach" else steps[::-1]:
        step()
    assert not slot.segment.linked
    assert name not in names(token)


# ------------------------------------------------------- links and header size


def test_read_header_and_attach_refuse_a_symlink_at_a_segment_name(made, token) -> None:
    """O_NOFOLLOW: a link planted at a name is refused, even one that points
    at a valid segment of ours (it could be swapped for anything)."""
    real = made("real")
    link = f"/shml-{token}-link"
    os.symlink(segment.shm_path(real.name), segment.shm_path(link))
    try:
        with pytest.raises(ProtocolError, match="cannot open"):
            segment.read_header(link)
        with pytest.raises(ProtocolError, match="cannot open"):
            Segment.attach(link, kind=KIND_DATA, token=token)
        assert segment.read_header(real.name).token == token  # the target itself is fine
    finally:
        os.unlink(segment.shm_path(link))


_GRANULE_SCRIPT = r"""
import json, os, sys
import numpy as np
from shmloader._node import segment
from shmloader.errors import ProtocolError
from shmloader._node.ring import RingReader, RingWriter, new_token
from shmloader._node.views import map_shared_readonly

out = {"header": segment.HEADER_SIZE}
token = new_token()
w = RingWriter(token, frozenset({1}), {"job": "t"})
r = RingReader(token)
try:
    slot = w.acquire(100_000)
    data = np.arange(100_000, dtype=np.uint8) * 7
    slot.payload[:100_000] = data
    r.open(slot.segment.name)
    view = r.view(slot.segment.name, 100_000, lambda: None)
    out["private"] = bool((view == data).all())
    mm, at = map_shared_readonly(slot.segment)
    shared = np.frombuffer(mm, dtype=np.uint8)
    out["at"] = at
    out["readonly"] = bool((shared[at : at + 100_000] == data).all())
    out["recorded"] = segment.read_header(slot.segment.name).payload_at
    del shared, view
    mm.close()
    try:
        segment.read_header(sys.argv[1])
        out["other"] = "accepted"
    except ProtocolError as exc:
        out["other"] = str(exc)
finally:
    r.close()
    w.close()
print(json.dumps(out))
"""


@pytest.mark.timeout(60)
def test_a_64k_header_maps_every_view_and_refuses_other_layouts(made) -> None:
    """NOTE [header granule]: with a 64 KiB header (aarch64 with 64 KiB pages;
    a valid mmap offset on x86 too) every view of a payload maps and reads
    the right bytes, and a segment laid out for another header size is
    refused by name before anything is mapped."""
    import subprocess
    import sys

    other = made("4k")
    env = dict(os.environ, SHMLOADER_HEADER_SIZE=str(64 << 10))
    proc = subprocess.run(
        [sys.executable, "-c", _GRANULE_SCRIPT, other.name],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["header"] == out["at"] == out["recorded"] == 64 << 10
    assert out["private"] and out["readonly"]
    assert f"payload at byte {HEADER_SIZE}" in out["other"]
    assert "maps payloads at 65536" in out["other"]


def test_header_size_setting() -> None:
    granule = max(4096, mmap.ALLOCATIONGRANULARITY)
    assert segment.header_size("") == granule == HEADER_SIZE
    assert segment.header_size(str(16 * granule)) == 16 * granule
    for bad in ("100", str(granule + 1), "-4096", "0", "lots", str(1 << 30)):
        with pytest.raises(ConfigError, match="SHMLOADER_HEADER_SIZE"):
            segment.header_size(bad)

"""Set-up never hangs silently: every rank's mark in the process group's store
(NOTE [set-up marks] in ``shmloader._setup.arrival``).

Pure tests drive ``Arrival`` over an in-process ``HashStore`` with peers'
marks written by hand; two real multi-process runs check the whole path under
gloo: a rank that marked and died, ranks that never construct, a rank with
sharing off, and ranks that disagree on settings.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time

import pytest
import torch.distributed as dist

from shmloader import Config, ShmLoader
from shmloader._setup import arrival
from shmloader.errors import ConfigError, ConfigMismatchError, PeerLostError
from tests.faults.scenarios import outcome
from tests.support.harness import Warnings, run_ranks

pytestmark = pytest.mark.timeout(120)

#: the ConfigError raised for ranks that disagree (a subclass: ``except ConfigError`` holds)
MISMATCH = "ConfigMismatchError"
assert issubclass(ConfigMismatchError, ConfigError)

AGREED = {
    "accumulation_steps": 1,
    "device": "cpu",
    "prefetch": 2,
    "slots": 2,
    "copy": False,
    "verify": False,
    "allow_pickle": False,
    "small_copy_bytes": 65536,
    "shm_dir": "/dev/shm",
}


def _mark(
    rank: int, *, sharing: bool = True, boot: str | None = None, pid: int | None = None, **agreed
) -> arrival.Mark:
    mine = arrival.Mark.mine(rank, node="n", sharing=sharing, agreed={**AGREED, **agreed})
    changes = {}
    if boot is not None:
        changes["boot"] = boot
    if pid is not None:
        changes["pid"], changes["start"] = pid, 0
    return arrival.Mark(**{**mine.__dict__, **changes})


def _arrival(store, me: int, ranks: list[int], **agreed) -> arrival.Arrival:
    return arrival.Arrival(store, me, ranks, _mark(me, **agreed), n=1)


def _plant(store, rank: int, mark: arrival.Mark, ranks: list[int]) -> None:
    """A peer's mark, as that peer's Arrival would set it."""
    store.set(arrival.Arrival(store, rank, ranks, mark, n=1).key(rank), mark.to_bytes())


class StepClock:
    """The clock of ``Arrival.wait`` in the pure tests: each reading is ``step``
    seconds after the one before, however slow the machine, so that what a wait
    does by its clock (when it logs, when a heartbeat is stale, at which look it
    raises) is exact. ``reads`` counts the readings: one at the start, then one
    per look at the store. ``on_read`` runs at every reading."""

    def __init__(self, step: float, on_read=None) -> None:
        self.now, self.step, self.reads, self.on_read = 0.0, step, 0, on_read

    def __call__(self) -> float:
        self.reads += 1
        if self.on_read is not None:
            self.on_read()
        t, self.now = self.now, self.now + self.step
        return t


# ---------------------------------------------------------------- pure tests


def test_a_peer_with_sharing_off_is_a_config_error_naming_it_and_shmloader():
    store = dist.HashStore()
    _plant(store, 1, _mark(1, sharing=False), [0, 1])
    clock = StepClock(1.0)
    with pytest.raises(ConfigError) as info:
        _arrival(store, 0, [0, 1]).wait(timeout=30, clock=clock)
    assert clock.reads == 1, "not raised at the first look at the store (no wait)"
    assert "SHMLOADER" in str(info.value) and "rank 1" in str(info.value), info.value


@pytest.mark.parametrize(
    "name, theirs",
    [
        ("accumulation_steps", 4),
        ("prefetch", 3),
        ("slots", 4),
        ("copy", True),
        ("verify", True),
        ("allow_pickle", True),
        ("small_copy_bytes", 0),
        ("shm_dir", "/mnt/shmloader"),
    ],
)
def test_every_agreed_setting_that_differs_is_named_with_both_values(name, theirs):
    store = dist.HashStore()
    _plant(store, 1, _mark(1, **{name: theirs}), [0, 1])
    with pytest.raises(ConfigError) as info:
        _arrival(store, 0, [0, 1]).wait(timeout=30)
    text = str(info.value)
    assert name in text and repr(theirs) in text and repr(AGREED[name]) in text, text
    assert info.value.name == name


def test_a_group_that_mixes_host_and_gpu_delivery_is_named_in_a_warning(caplog):
    """Mixing is supported (auto on ranks with and without GPUs); a launcher slip shows."""
    store = dist.HashStore()
    _plant(store, 1, _mark(1, device="cuda"), [0, 1])
    with caplog.at_level(logging.WARNING, logger="shmloader"):
        assert sorted(_arrival(store, 0, [0, 1]).wait(timeout=5)) == [0, 1]
    told = [r.getMessage() for r in caplog.records if "mixes host and GPU" in r.getMessage()]
    assert len(told) == 1 and "'cpu'" in told[0] and "'cuda'" in told[0], told


def test_a_dead_peer_on_this_host_is_lost_at_once():
    store = dist.HashStore()
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    _plant(store, 1, _mark(1, pid=gone), [0, 1, 2])
    clock = StepClock(1.0)
    with pytest.raises(PeerLostError) as info:
        _arrival(store, 0, [0, 1, 2]).wait(timeout=30, clock=clock)
    assert clock.reads == 2, "not lost at the first look at the store (a later poll)"
    assert info.value.rank == 1 and str(gone) in str(info.value)


def test_a_peer_on_another_host_is_judged_by_its_heartbeat(monkeypatch):
    monkeypatch.setattr(arrival, "HEARTBEAT_STALE_S", 0.5)
    # alive: its heartbeat moves (once per clock step of 0.05 s), so only the missing
    # rank 2 is named, at the timeout: three times the stale bound
    store = dist.HashStore()
    peer = _arrival(store, 1, [0, 1, 2])
    _plant(store, 1, _mark(1, boot="another-host"), [0, 1, 2])
    beating = StepClock(0.05, on_read=lambda: store.add(f"{peer.prefix}hb/1", 1))
    with pytest.raises(PeerLostError) as info:
        _arrival(store, 0, [0, 1, 2]).wait(timeout=1.5, clock=beating)
    assert info.value.rank is None and "rank 2" in str(info.value), info.value
    # dead: the heartbeat stands still; lost after HEARTBEAT_STALE_S, long before the timeout
    clock = StepClock(1 / 16)  # exact in binary: the looks fall on the stale bound
    with pytest.raises(PeerLostError) as info:
        _arrival(store, 0, [0, 1, 2]).wait(timeout=30, clock=clock)
    assert info.value.rank == 1 and "heartbeat" in str(info.value)
    # first seen at the first look (clock 1/16 s), lost at the look 0.5 s later by the clock
    raised_at = clock.now - clock.step
    assert raised_at - clock.step == arrival.HEARTBEAT_STALE_S, raised_at


def test_waiting_is_logged_naming_the_missing_ranks_and_since_when(monkeypatch, caplog):
    monkeypatch.setattr(arrival, "WAIT_LOG_EVERY_S", 1.0)
    store = dist.HashStore()
    clock = StepClock(0.25)  # 16 looks: at 1, 2 and 3 s by the clock a warning, at 4 s the end
    with caplog.at_level(logging.WARNING, logger="shmloader"), pytest.raises(PeerLostError) as info:
        _arrival(store, 0, [0, 1, 2]).wait(timeout=4.0, clock=clock)
    waits = [r.getMessage() for r in caplog.records if "has waited since" in r.getMessage()]
    assert len(waits) == 3, waits
    assert all("ranks 1, 2" in m for m in waits), waits
    assert "ranks 1, 2" in str(info.value) and "not constructed" in str(info.value)


def test_all_marks_present_returns_them_and_sharing_off_warns_once(caplog):
    store = dist.HashStore()
    _plant(store, 1, _mark(1), [0, 1])
    got = _arrival(store, 0, [0, 1])
    assert sorted(got.wait(timeout=5)) == [0, 1]
    # a third rank with sharing off over the same construction: one set, one warning
    off = arrival.Arrival(store, 2, [0, 1], _mark(2, sharing=False), n=1)
    with caplog.at_level(logging.WARNING, logger="shmloader"):
        assert off.leave_mark() is True
    assert json.loads(store.get(off.key(2)))["sharing"] is False
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "sharing off" in msgs[0] and "rank 0" in msgs[0], msgs
    # nobody with sharing on: no warning
    quiet = arrival.Arrival(dist.HashStore(), 0, [0, 1], _mark(0, sharing=False), n=1)
    assert quiet.leave_mark() is False


def test_each_construction_over_the_same_ranks_has_its_own_keys():
    store = dist.HashStore()
    a = arrival.Arrival(store, 0, [5, 6], _mark(5))
    b = arrival.Arrival(store, 0, [6, 5], _mark(5))
    c = arrival.Arrival(store, 0, [5, 7], _mark(5))
    assert a.prefix != b.prefix and a.prefix.rsplit("/", 2)[0] == b.prefix.rsplit("/", 2)[0]
    assert c.prefix.split("/")[2] == "5-7"


# ---------------------------------------------------------------- real ranks

#: The set-up timeout of the real-rank tests where a rank must fail fast: far
#: beyond a liveness check, so that failing within a fraction of it was not the
#: timeout, on any machine.
LONG_TIMEOUT_S = 40.0
#: The second construction's timeout in ``lost_and_missing``: it must wait that long.
SHORT_TIMEOUT_S = 5.0


def lost_and_missing(rank: int, world: int, *, stamp: str) -> dict:
    """Rank 1 marks and dies; rank 2 never constructs. Rank 0 constructs twice."""
    arrival.WAIT_LOG_EVERY_S = 1.0
    if rank == 2:
        return {"ok": True}  # exits before constructing
    if rank == 1:

        def die():
            time.sleep(1.0)
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os._exit(0)

        threading.Thread(target=die, daemon=True).start()
    warnings = Warnings()
    logging.getLogger("shmloader").addHandler(warnings)
    cfg = Config.from_env(enabled=True, timeout=LONG_TIMEOUT_S)
    first = outcome(lambda: ShmLoader(lambda: [1], dist.group.WORLD, config=cfg))
    first["at"] = time.time()
    cfg = Config.from_env(enabled=True, timeout=SHORT_TIMEOUT_S)
    second = outcome(lambda: ShmLoader(lambda: [1], dist.group.WORLD, config=cfg))
    return {"first": first, "second": second, "warnings": warnings.messages}


def test_a_rank_that_died_after_marking_or_never_came_is_named(tmp_path):
    stamp = str(tmp_path / "died")
    out = run_ranks(lost_and_missing, 3, kwargs={"stamp": stamp}, expect_failure=True, timeout=90)
    with open(stamp) as f:
        died = float(f.read())
    first, second = out[0]["first"], out[0]["second"]
    assert first["type"] == "PeerLostError" and "rank 1" in first["message"], first
    # by liveness, long before the 40 s timeout it would otherwise wait
    assert first["at"] - died < LONG_TIMEOUT_S / 4, (first, died)
    assert second["type"] == "PeerLostError", second
    assert "ranks 1, 2" in second["message"] and "not constructed" in second["message"]
    # its own 5 s timeout: not less, and not the first construction's 40 s
    assert SHORT_TIMEOUT_S - 0.5 < second["seconds"] < LONG_TIMEOUT_S / 4, second
    waits = [m for m in out[0]["warnings"] if "has waited since" in m]
    # one warning a second (WAIT_LOG_EVERY_S = 1 here), each naming who is missing then
    assert len([m for m in waits if "for ranks 1, 2 " in m]) >= 2, out[0]["warnings"]


def mixed_settings(rank: int, world: int) -> dict:
    """Rank 2 runs with SHMLOADER=0; then settings that differ; then all agree."""
    warnings = Warnings()
    warnings.setLevel(logging.INFO)
    logger = logging.getLogger("shmloader")
    logger.addHandler(warnings)
    logger.setLevel(logging.INFO)
    out: dict = {}
    if rank == 2:
        # its peers marked first: it sees them at construction (NOTE [set-up marks])
        n = arrival._CONSTRUCTIONS.get((0, 1, 2), 0) + 1
        on = f"shmloader/setup/0-1-2/{n}/on"
        arrival.default_store().wait([on], datetime.timedelta(seconds=60))
        loader = ShmLoader(lambda: list(range(4)), dist.group.WORLD)
        out["sharing_off"] = {"role": loader.role, "got": list(loader) + list(loader)}
        loader.close()
    else:
        out["sharing_off"] = outcome(lambda: ShmLoader(lambda: [1], dist.group.WORLD))
    for name, kwargs in [
        ("accumulation", {"accumulation_steps": 2 if rank == 1 else 1}),
        ("prefetch", {"config": Config.from_env(enabled=True, prefetch=3 if rank == 2 else 2)}),
    ]:
        kwargs.setdefault("config", Config.from_env(enabled=True))
        out[name] = outcome(
            lambda kwargs=kwargs: ShmLoader(lambda: [1], dist.group.WORLD, **kwargs)
        )
    loader = ShmLoader(lambda: [7, 8], dist.group.WORLD, config=Config.from_env(enabled=True))
    out["agreed"] = {"role": loader.role, "got": list(loader)}
    loader.close()
    out["log"] = warnings.messages
    return out


def test_sharing_off_on_one_rank_and_settings_that_differ_fail_in_seconds():
    out = run_ranks(
        mixed_settings,
        3,
        env={"SHMLOADER": "1", "SHMLOADER_TIMEOUT": str(LONG_TIMEOUT_S)},
        rank_env={2: {"SHMLOADER": "0"}},
    )
    # "in seconds": as soon as the other rank's mark is read, long before the 40 s timeout
    for rank in (0, 1):
        o = out[rank]["sharing_off"]
        assert o["type"] == MISMATCH and o["seconds"] < LONG_TIMEOUT_S / 4, o
        assert "rank 2" in o["message"] and "SHMLOADER" in o["message"], o
    off = out[2]["sharing_off"]
    assert off == {"role": "local", "got": [0, 1, 2, 3] * 2}, off
    told = [m for m in out[2]["log"] if "has sharing off" in m]
    assert len(told) == 1 and ("rank 0" in told[0] or "rank 1" in told[0]), out[2]["log"]
    for rank, o in enumerate(out):
        acc = o["accumulation"]
        assert acc["type"] == MISMATCH and acc["seconds"] < LONG_TIMEOUT_S / 4, (rank, acc)
        assert "accumulation_steps" in acc["message"] and "2" in acc["message"], acc
        pre = o["prefetch"]
        assert pre["type"] == MISMATCH and "prefetch" in pre["message"], (rank, pre)
        assert o["agreed"]["got"] == [7, 8], o
    assert [o["agreed"]["role"] for o in out] == ["leader", "follower", "follower"]
    for rank, o in enumerate(out):
        roles = [m for m in o["log"] if m.startswith(f"shmloader: rank {rank} ")]
        assert any("sharing on" in m and o["agreed"]["role"] in m for m in roles), o["log"]
    assert any("sharing off" in m for m in out[2]["log"] if m.startswith("shmloader: rank 2 l"))


def leader_dies_building(rank: int, world: int) -> dict:
    """The leader dies inside make_loader, after every rank marked."""

    def make():
        time.sleep(1.0)
        os._exit(0)

    cfg = Config.from_env(enabled=True, timeout=LONG_TIMEOUT_S)
    got = outcome(lambda: ShmLoader(make, dist.group.WORLD, config=cfg))
    return got


def test_a_leader_that_dies_building_its_loader_is_named_in_seconds():
    out = run_ranks(leader_dies_building, 2, expect_failure=True, timeout=90, gc_after=True)
    # the set-up exchange breaks with the leader's connection (it dies 1 s in): long
    # before the 40 s set-up timeout, or the group's 60 s (harness) gloo would wait
    assert out[1]["type"] == "PeerLostError", out[1]
    assert out[1]["seconds"] < LONG_TIMEOUT_S / 4, out[1]


def slots_from_the_environment(rank: int, world: int) -> dict:
    """Every rank's config from its own environment (``SHMLOADER_SLOTS`` differs)."""

    def build() -> list:
        loader = ShmLoader(lambda: [1], dist.group.WORLD)
        try:
            return list(loader)
        finally:
            loader.close()

    return outcome(build)


def test_each_rank_marks_its_own_slots_so_ranks_that_differ_only_in_slots_are_refused():
    """The mark carries the rank's own ``Config.slots`` (``arrival.agreed_settings``),
    not a default: SHMLOADER_SLOTS=4 on one rank is named on both, with both values."""
    out = run_ranks(
        slots_from_the_environment,
        2,
        env={"SHMLOADER": "1", "SHMLOADER_TIMEOUT": "30", "SHMLOADER_SLOTS": "3"},
        rank_env={1: {"SHMLOADER_SLOTS": "4"}},
    )
    for rank, o in enumerate(out):
        assert o.get("type") == MISMATCH, (rank, o)
        text = o["message"]
        assert "slots" in text and "rank 0: 3" in text and "rank 1: 4" in text, (rank, text)
        assert "SHMLOADER_SLOTS" in text, (rank, text)

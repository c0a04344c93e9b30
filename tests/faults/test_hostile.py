"""Capacity, integrity, isolation, hostile input and bad configuration."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import zmq

from shmloader import Config, ShmLoader
from shmloader._node.rundir import (
    check_private_dir,
    make_private_dir,
    remove_private_dir,
    socket_path,
)
from shmloader._proto import wire
from shmloader._transport.channel import Hub
from shmloader.errors import ConfigError, ProtocolError
from tests.faults.scenarios import outcome
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

# ------------------------------------------------------------------ rank code


def big_batch(rank: int, world: int) -> dict:
    big = {"video": torch.zeros(100 << 20, dtype=torch.uint8)}  # 100 MiB
    loader = ShmLoader(lambda: [big], dist.group.WORLD, config=Config.from_env(enabled=True))
    out = outcome(lambda: sum(1 for _ in loader))
    loader.close()
    return out


def verified(rank: int, world: int, *, corrupt: bool) -> dict:
    import shmloader._node.ring as ring_module

    if corrupt and rank == 2:
        real = ring_module.RingReader.view

        def flipped(self, name, nbytes, on_release, *words):
            payload = real(self, name, nbytes, on_release, *words)
            payload[nbytes // 2] ^= 0xFF  # a bit flipped between write and read
            return payload

        ring_module.RingReader.view = flipped
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=8),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, verify=True),
    )
    out = outcome(lambda: [ranks.to_plain(b) for b in loader])
    loader.close()
    return out


def destroyed_group(rank: int, world: int) -> dict:
    g = dist.new_group([0, 1])
    # both ranks connected before either tears down: a rank that destroys its group while
    # its peer still connects breaks the peer's gloo mesh (seen once under load)
    dist.barrier(group=g)
    dist.destroy_process_group(g)
    return outcome(lambda: ShmLoader(lambda: [1], g, config=Config.from_env(enabled=True)))


# ------------------------------------------------------------------ tests


def test_shm_too_small_is_a_clean_capacity_error_on_every_rank():
    """Docker's default 64 MiB /dev/shm and a 100 MiB batch: no SIGBUS, a typed error."""
    out = run_ranks(big_batch, 2, nodes=[1, 1], node_shm_size="64m", expect_failure=True)
    lead, follower = out
    assert lead["type"] == "ShmCapacityError", lead
    assert "needed" in lead["message"] and "--shm-size" in lead["message"]
    assert "SHMLOADER_SLOTS" in lead["message"]
    assert (
        follower["type"] == "LeaderError"
        and follower["attrs"]["original_type"] == "ShmCapacityError"
    )
    assert "--shm-size" in follower["message"]


def test_verify_checksums_end_to_end_and_catches_corruption():
    good = run_ranks(verified, 3, kwargs={"corrupt": False})
    assert all(o["ok"] for o in good)
    for o in good[1:]:
        assert len(o["value"]) == len(good[0]["value"]) == 4
    bad = run_ranks(verified, 3, kwargs={"corrupt": True}, expect_failure=True)
    assert bad[2]["type"] == "ProtocolError" and "CRC-32" in bad[2]["message"], bad[2]


def test_a_group_that_is_not_part_of_the_world_is_a_config_error():
    out = run_ranks(destroyed_group, 2)
    for o in out:
        assert o["type"] == "ConfigError" and "group" in o["message"], o


def test_runtime_dir_of_another_user_is_refused():
    """The fixed ``shmloader-<uid>`` of earlier versions can be squatted; a
    private directory cannot, and one not ours or open to others is refused."""
    # a short base, not tmp_path: under xdist its long name pushed the socket path
    # in the private directory past sun_path's 107 bytes
    base = tempfile.mkdtemp(prefix="shl", dir="/tmp")
    try:
        squat = os.path.join(base, f"shmloader-{os.geteuid()}")
        os.mkdir(squat, 0o700)
        os.chown(squat, 12345, 12345)
        mine = make_private_dir(base)  # the squat is irrelevant
        check_private_dir(mine)
        os.chown(mine, 12345, 12345)
        with pytest.raises(ProtocolError, match="uid 12345"):
            check_private_dir(mine)
        os.chown(mine, os.geteuid(), os.getegid())
        os.chmod(mine, 0o755)
        with pytest.raises(ProtocolError, match="mode 0700"):
            check_private_dir(mine)
        remove_private_dir(mine, os.getpid())
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_garbage_frames_are_dropped_and_logged_never_a_crash(no_leaks, caplog):
    path = socket_path(make_private_dir(no_leaks))
    hub = Hub(path)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.ROUTING_ID, b"r1")
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"ipc://{path}")
    hostile = [
        [b"garbage"],
        [b"\x00" * 12, b"{}"],
        [b"SL\x01\x03" + b"\x00" * 8, b"not json"],
        [b"SL\x09\x01" + b"\x00" * 8, b"{}"],  # unknown version
        wire.frames(
            wire.Kind.BATCH,
            0,
            b"",
            it=1,
            epoch=0,
            pos=0,
            slot=-5,
            gen=0,
            seg="",
            nbytes=-1,
            draws=0,
            crc=-1,
        ),
        [b"SL\x01\x05" + b"\x00" * 8, b'{"rank": 1, "slot": "x", "gen": 0}'],  # wrong type
    ]
    try:
        with caplog.at_level(logging.WARNING, logger="shmloader._transport.channel"):
            for parts in hostile:
                peer.send_multipart(parts)
            peer.send_multipart(wire.frames(wire.Kind.HELLO, rank=1, pid=os.getpid(), start=0))
            got = None
            for _ in range(50):
                got = hub.receive(0.1)
                if got is not None:
                    break
        assert got is not None and got[0].kind == wire.Kind.HELLO and got[1] == 1
        assert sum("dropped a malformed message" in r.message for r in caplog.records) == len(
            hostile
        )
    finally:
        peer.close(0)
        hub.close()


def test_a_runtime_dir_too_long_for_an_ipc_socket_is_a_config_error(tmp_path):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(ConfigError, match="SHMLOADER_RUNTIME_DIR") as info:
        make_private_dir(str(deep))
    assert "107" in str(info.value)
    assert os.listdir(deep) == []  # the too-long directory was not left behind

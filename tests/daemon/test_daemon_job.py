"""A real multi-rank job against a real daemon: registration, stat, daemon death."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader
from shmloader._node import inventory
from shmloader.errors import human_bytes
from shmloader.tools import stat as stat_cli
from tests.daemon.test_daemon import daemons  # noqa: F401 - the fixture
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def run_stat(*args: str) -> str:
    """What ``shmloader stat ARGS`` prints, run by this rank within 30 s.

    The command's own entry point (``shmloader.tools.cli.main``) in the rank:
    as a new interpreter it imported torch again (the demo's module), 2 s of
    CPU a call; what it reads (the daemon's socket, the ring directories) is
    the same from any process.
    """

    def too_long(*_: object) -> None:
        raise TimeoutError("shmloader stat ran past 30 s")

    from shmloader.tools import cli

    buf = io.StringIO()
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(30)
    try:
        with contextlib.redirect_stdout(buf):
            code = cli.main(["stat", *args])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 0, (code, buf.getvalue())
    return buf.getvalue()


def job(rank: int, world: int, *, kill_daemon: int | None) -> dict:
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=16), dist.group.WORLD, config=Config.from_env(enabled=True)
    )
    seen, stat = [], None
    for i, batch in enumerate(loader):
        seen.append(ranks.to_plain(batch))
        if i == 2:
            if rank == 0 and kill_daemon is not None:
                os.kill(kill_daemon, signal.SIGKILL)
            elif rank == 0:
                stat = json.loads(run_stat("--json"))
        dist.barrier()
    token = loader.topology.ring_token
    loader.close()
    return {"seen": seen, "stat": stat, "token": token, "role": loader.role}


def test_stat_json_during_a_live_job_comes_from_the_daemon(daemons):  # noqa: F811
    d = daemons.start()
    env = {"SHMLOADER": "1", "SHMLOADER_DAEMON": d.path, "SHMLOADER_JOB": "ci-stat-7"}
    out = run_ranks(job, 3, kwargs={"kill_daemon": None}, env=env)
    stat = out[0]["stat"]
    assert stat["schema"] == inventory.SCHEMA and stat["source"] == "daemon"
    jobs = {j["token"]: j for j in stat["jobs"]}
    mine = jobs[out[0]["token"]]
    assert mine["registered"] and mine["writer_alive"] and mine["state"] == "live"
    assert mine["group"] == [0, 1, 2] and mine["readers"] == 2
    assert mine["published"] >= 3 and mine["ring_bytes"] > 0
    assert mine["job"] == "ci-stat-7" and mine["age_s"] >= 0
    followers = mine["followers"]
    assert {"1", "2"} <= set(followers)
    assert all(isinstance(followers[r]["consumed"], int) for r in ("1", "2"))  # reported 1/s
    ranks = mine["ranks"]
    assert ranks["0"]["role"] == "leader" and ranks["0"]["batches"] >= 1
    assert ranks["0"]["wait_ms_p50"] is not None and 0 <= ranks["0"]["wait_share"] <= 1
    for r in ("1", "2"):  # only the daemon knows a follower's own wait
        assert ranks[r]["role"] == "follower" and ranks[r]["wait_ms_p50"] is not None
        assert 0 <= ranks[r]["wait_share"] <= 1 and ranks[r]["traffic_bytes"] > 0
        p50, p95, p99 = (ranks[r][f"wait_ms_{p}"] for p in ("p50", "p95", "p99"))
        assert p50 <= p95 <= p99
    # after the job: unregistered, nothing left
    after = {j["token"] for j in d.stats()["jobs"]}
    assert out[0]["token"] not in after


def test_daemon_killed_mid_job_never_breaks_the_job(daemons):  # noqa: F811
    d = daemons.start()
    out = run_ranks(
        job,
        3,
        kwargs={"kill_daemon": d.proc.pid},
        env={"SHMLOADER": "1", "SHMLOADER_DAEMON": d.path},
    )
    d.proc.wait(5)
    assert d.proc.returncode == -signal.SIGKILL
    lengths = {len(o["seen"]) for o in out}
    assert lengths == {8}, "every rank got every batch after the daemon died"
    for a, b in zip(out[0]["seen"], out[1]["seen"], strict=True):
        assert a["meta"] == b["meta"]


class _SlowSource:
    """Batches that take 0.25 s each to make: the job waits for data."""

    def __len__(self) -> int:
        return 8

    def __iter__(self):
        for i in range(8):
            time.sleep(0.25)
            yield {"x": torch.full((1024,), i)}


def starved_job(rank: int, world: int) -> dict:
    loader = ShmLoader(_SlowSource, dist.group.WORLD, config=Config.from_env(enabled=True))
    slowest = 0.0  # the longest next() as this rank saw it: what stat's waits are bounded by
    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        if next(batches, None) is None:
            break
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.01)  # a short training step
    doc = inventory.scan() if rank == 0 else None  # no daemon: what the writer described
    dist.barrier()
    token = loader.topology.ring_token
    loader.close()
    return {"doc": doc, "token": token, "slowest_ms": slowest * 1e3}


def test_stat_without_daemon_says_which_job_waits_for_data():
    # no SHMLOADER_JOB (the suite sets one): the launcher's id names the job
    env = {"SHMLOADER": "1", "TORCHELASTIC_RUN_ID": "elastic-42", "SHMLOADER_JOB": ""}
    out = run_ranks(starved_job, 3, env=env)
    doc, token = out[0]["doc"], out[0]["token"]
    job = next(j for j in doc["jobs"] if j["token"] == token)
    assert job["job"] == "elastic-42" and job["age_s"] >= 1.0
    leader = job["ranks"]["0"]
    assert leader["role"] == "leader" and leader["batches"] >= 4
    assert leader["wait_ms_p50"] > 150, leader  # about 250 ms per batch
    assert leader["wait_ms_p50"] <= leader["wait_ms_p95"] <= leader["wait_ms_p99"]
    # no recorded wait is longer than the longest next() the rank itself timed (within
    # the histogram's 19 % bucket step): waits are per batch, not summed or since the start
    assert leader["wait_ms_p99"] <= 1.2 * out[0]["slowest_ms"], (leader, out[0]["slowest_ms"])
    assert leader["wait_share"] > 0.6, leader  # data is the bottleneck, and stat says so
    for r in ("1", "2"):
        row = job["ranks"][r]
        assert row["role"] == "follower" and row["batches"] >= 3 and row["lag"] is not None
        assert row["wait_ms_p50"] is None  # only the daemon hears a follower's own waits
    text = stat_cli.format_table(doc)
    assert "elastic-42" in text and "leader" in text
    # ranks 1 and 2 among those listed: other jobs on the node (another test's) add theirs
    listed = re.search(r"note: followers' waits for data \(ranks ([0-9,.]+)\) are reported "
                       r"only to shmloaderd", text)  # fmt: skip
    assert listed and {"1", "2"} <= set(listed[1].split(",")), text


# ------------------------------------------------------------------ device delivery


def device_job(rank: int, world: int) -> dict:
    """A job delivering on a fake device per rank (rank 2's registration refused).

    After one whole epoch (its copies settled, so its counters are final) rank 0
    runs ``shmloader stat`` and ``stat --json`` while every rank still holds its
    loader.
    """
    from tests.support.fake_device import FakeOps

    refuse = "cudaHostRegister: error 999 (refused by a fake)" if rank == 2 else None
    ops = FakeOps(auto=True, device=f"cuda:{rank}", refuse=refuse)
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=16),
        dist.group.WORLD,
        # every leaf a view of its slot, so that the copies can read the registered ring
        config=Config.from_env(enabled=True, small_copy_bytes=0),
        device=ops,
    )
    for _ in loader:
        pass
    dist.barrier()
    out: dict = {"token": loader.topology.ring_token, "stats": loader.stats()}
    if rank == 0:
        for flag in ("--json", None):
            out["json" if flag else "text"] = run_stat(*([flag] if flag else []))
    dist.barrier()
    loader.close()
    return out


def _job_block(text: str, token: str) -> str:
    """The lines ``stat`` prints under job ``token``: another test's live job on the node
    (the other pytest worker runs this module's other device test) prints its own."""
    block, inside = [], False
    for line in text.splitlines():
        if not line.startswith(" "):
            inside = line.split()[:1] == [token]
        elif inside:
            block.append(line)
    return "\n".join(block)


def _check_device_rows(out: list[dict], *, every_rank: bool) -> None:
    doc = json.loads(out[0]["json"])
    assert doc["schema"] == inventory.SCHEMA
    job = next(j for j in doc["jobs"] if j["token"] == out[0]["token"])
    text = _job_block(out[0]["text"], out[0]["token"])
    assert text, out[0]["text"]
    described = range(3) if every_rank else [0]  # without a daemon: the writer's own row
    for rank in range(3):
        row, mine = job["ranks"][str(rank)], out[rank]["stats"]
        if rank not in described:
            assert all(row[k] is None for k in inventory.DEVICE_KEYS), row
            assert f"cuda:{rank}:" not in text
            continue
        assert mine["device_bytes"] > 0 and mine["device_batches"] == 8
        assert row["device"] == f"cuda:{rank}"
        for key in ("device_batches", "device_bytes", "device_copy_ms_total"):
            assert row[key] == mine[key], (rank, key, row, mine)
        assert row["device_copy_ms_total"] == 2.0 * 8  # the fake's 2 ms per batch
        assert row["device_bandwidth_gbs"] == pytest.approx(mine["device_bandwidth_gbs"], abs=1e-3)
        assert row["device_registered"] is (rank != 2)
        assert (row["device_registration_refused"] is not None) is (rank == 2)
        ring = (
            "ring registered" if rank != 2 else "ring NOT registered (cudaHostRegister: error 999"
        )
        line = (
            f"cuda:{rank}: copied {human_bytes(mine['device_bytes'])} in 16.00 ms "
            f"({mine['device_bandwidth_gbs']:.2f} GB/s), {ring}"
        )
        assert line in text, f"rank {rank}: {line!r} not in\n{text}"
    assert text.count(" copied ") == len(described)


def test_stat_shows_the_writers_device_delivery_without_daemon():
    out = run_ranks(device_job, 3, env={"SHMLOADER": "1"})
    _check_device_rows(out, every_rank=False)


def test_stat_shows_every_ranks_device_delivery_from_the_daemon(daemons):  # noqa: F811
    d = daemons.start()
    out = run_ranks(device_job, 3, env={"SHMLOADER": "1", "SHMLOADER_DAEMON": d.path})
    assert json.loads(out[0]["json"])["source"] == "daemon"
    _check_device_rows(out, every_rank=True)


# ------------------------------------------------------- stat's bytes are /dev/shm's


def shm_held(token: str, pids: list[int]) -> tuple[int, int]:
    """(bytes, files) of ring ``token`` in /dev/shm, measured without shmloader's code:
    its names in /dev/shm, and the unlinked files any of ``pids`` or their
    children still map (tmpfs frees a file's pages only when the last mapping goes)."""
    files: dict[int, int] = {}
    prefix = f"shml-{token}-"
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(f"/dev/shm/{name}")
                files[st.st_ino] = st.st_blocks * 512
    every = set(pids)
    for pid in pids:  # DataLoader workers are the ranks' children
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
            every |= {int(c) for c in f.read().split()}
    for pid in sorted(every):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                if f"/dev/shm/{prefix}" not in line or "(deleted)" not in line:
                    continue
                fields = line.split()
                inode = int(fields[4])
                if inode not in files:
                    st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")  # root: the file itself
                    files[inode] = st.st_blocks * 512
    return sum(files.values()), len(files)


class _TwoMiB(torch.utils.data.Dataset):
    """2 MiB samples: DataLoader workers grow their pool slots (and the leader asks the
    daemon to admit the pool at that size, more than the slots grown so far)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((512 * 1024,), float(i))


def _two_mib_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_TwoMiB(), batch_size=1, num_workers=2)


def bytes_job(rank: int, world: int) -> dict:
    loader = ShmLoader(_two_mib_loader, dist.group.WORLD, config=Config.from_env(enabled=True))
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out = []
    for i, _batch in enumerate(loader):
        if i in (1, 6):
            time.sleep(1.2)  # every rank's report and the ring's description are fresh
            dist.barrier()  # every rank holds its batch: nothing changes in /dev/shm now
            if rank == 0:
                token = loader.topology.ring_token
                truth, files = shm_held(token, pids)
                scan = next(j for j in inventory.scan()["jobs"] if j["token"] == token)
                doc = stat_cli.get_stats(os.environ["SHMLOADER_DAEMON"])[0]
                daemon = next(j for j in doc["jobs"] if j["token"] == token)
                out.append({"truth": truth, "files": files, "scan": scan, "daemon": daemon})
            dist.barrier()
    loader.close()
    return {"seen": out}


def test_stat_bytes_are_what_dev_shm_holds_for_the_job(daemons):  # noqa: F811
    """Held bytes, from the daemon and from a scan, against /dev/shm measured apart,
    twice while the job runs (DataLoader workers growing and writing pool slots)."""
    d = daemons.start()
    env = {"SHMLOADER": "1", "SHMLOADER_DAEMON": d.path}
    out = run_ranks(bytes_job, 3, env=env)
    for seen in out[0]["seen"]:
        truth, page = seen["truth"], 4096 * seen["files"]
        for source in ("scan", "daemon"):
            held = seen[source]["bytes"]
            assert abs(held - truth) <= page, (
                f"{source}: stat says {human_bytes(held)} ({held}), /dev/shm holds "
                f"{human_bytes(truth)} ({truth}) in {seen['files']} files: "
                + str({k: seen[source][k] for k in ("segment_bytes", "granted_pending_bytes")})
            )

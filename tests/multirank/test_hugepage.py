"""The ring directory (SHMLOADER_SHM_DIR) and the huge-page ring it makes possible.

A tmpfs mounted with ``huge=within_size`` in a private mount namespace
(``huge_dir`` in conftest: root only, skipped with the reason otherwise)
stands for an operator's huge-page mount. NOTE [huge-page ring] in
``shmloader._node.ringdir``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader

from shmloader import Config
from shmloader._node import forks, inventory, mapping, reaping, ring, ringdir, segment, views
from shmloader.errors import ConfigError
from shmloader.tools import stat as stat_cli
from tests.support import ranks
from tests.support.harness import run_ranks

HUGE = ringdir.HUGE


# ---------------------------------------------------------------- which directory


@pytest.fixture
def dirs(tmp_path):
    """Directories of every kind ``ringdir.check`` judges."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, 65534, 65534)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # writable by all, no sticky bit
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    a_file = tmp_path / "file"
    a_file.write_text("")
    return {
        "mine": str(mine),
        "foreign": str(foreign),
        "open": str(open_dir),
        "sticky": str(sticky),
        "file": str(a_file),
        "missing": str(tmp_path / "missing"),
    }


@pytest.mark.parametrize(
    "which,says",
    [
        ("missing", "No such file"),
        ("file", "not a directory"),
        ("foreign", "belongs to uid 65534"),
        ("open", "mode 0777"),
    ],
)
def test_a_directory_not_ours_is_refused_naming_the_variable(dirs, which, says):
    env = {"SHMLOADER_SHM_DIR": dirs[which]}
    with pytest.raises(ConfigError, match=says) as info:
        Config.from_env(env)
    assert info.value.name == "SHMLOADER_SHM_DIR" and info.value.value == dirs[which]
    assert str(info.value).startswith(f"SHMLOADER_SHM_DIR={dirs[which]!r}")
    with pytest.raises(ConfigError, match=says) as info:
        Config(shm_dir=dirs[which])
    assert info.value.name == "shm_dir"


def test_relative_and_unwritable_directories_are_refused(dirs, monkeypatch):
    with pytest.raises(ConfigError, match="SHMLOADER_SHM_DIR='shm'"):
        Config.from_env({"SHMLOADER_SHM_DIR": "shm"})
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as a user without write access
    with pytest.raises(ConfigError, match="cannot create files in it"):
        Config.from_env({"SHMLOADER_SHM_DIR": dirs["mine"]})


def test_our_own_and_sticky_directories_are_accepted(dirs):
    assert Config.from_env({}).shm_dir == "/dev/shm"
    for which in ("mine", "sticky"):
        assert Config.from_env({"SHMLOADER_SHM_DIR": dirs[which]}).shm_dir == dirs[which]


def test_a_directory_on_disk_is_not_called_huge(dirs):
    facts = ringdir.describe(dirs["mine"])
    assert not facts.huge and facts.mode == "0700" and facts.owner == os.geteuid()
    if facts.fs != "tmpfs":
        assert "not a tmpfs" in facts.why


# ------------------------------------------------------------ the huge-page tmpfs


def test_huge_tmpfs_is_detected_and_slots_are_whole_huge_pages(huge_dir, monkeypatch):
    facts = ringdir.describe(huge_dir)
    assert (facts.fs, facts.huge_option, facts.mode) == ("tmpfs", "within_size", "1777")
    if not facts.huge:
        pytest.skip(f"the kernel gives this tmpfs no huge pages: {facts.why}")
    assert "huge=within_size" in facts.why and not facts.advise
    monkeypatch.setattr(segment, "SHM_DIR", huge_dir)
    for nbytes in (1, 3 << 20, (256 << 20) - 7):
        cap = ring.slot_capacity_for(nbytes)
        assert cap >= nbytes and (segment.HEADER_SIZE + cap) % HUGE == 0, nbytes
    token = ring.new_token()
    seg = segment.Segment.create_unique(
        f"/shml-{token}-0.0", segment.KIND_DATA, token, ring.slot_capacity_for(5 << 20)
    )
    try:
        writer = seg.map_shared()
        mapping.touch(writer)
        # several views alive at once (wherever the kernel would put them next):
        # file offset 0 of each on a 2 MiB boundary, its payload HEADER_SIZE past one
        views = [seg.map_private(n) for n in (1 << 20, 3 << 20, 5 << 20)]
        assert [forks.address(v) % HUGE for v in views] == [segment.HEADER_SIZE] * 3
        view = views.pop()
        for v in views:
            v.close()
        addr = forks.address(view)
        assert (segment.HEADER_SIZE + len(view)) % HUGE == 0, "the view ends on a huge page"
        assert sum(memoryview(view)[::4096]) == 0  # read every page
        assert ranks.pmd_mapped_kb(addr) >= 4096, "2 MiB pages mapped with 2 MiB entries"
        view.close()
        writer.close()
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.timeout(120)
def test_ranks_share_through_a_huge_page_ring(huge_dir):
    """Real ranks over gloo, DataLoader workers writing the slots, ring in huge_dir."""
    if not ringdir.describe(huge_dir).huge:
        pytest.skip(f"no huge pages here: {ringdir.describe(huge_dir).why}")
    expected = [b[:, 0].tolist() for b in DataLoader(ranks.Big(), batch_size=2)]
    out = run_ranks(
        ranks.huge_ring, 2, kwargs={"num_workers": 2}, env={"SHMLOADER_SHM_DIR": huge_dir}
    )
    assert [o["role"] for o in out] == ["leader", "follower"]
    for o in out:
        assert o["dir"] == huge_dir
        assert o["firsts"] == expected
        assert o["job"] == {"shm_dir": huge_dir, "huge_pages": True, "state": "live"}
        assert o["in_dev_shm"] == [], "nothing of the ring in /dev/shm"
        # 4 MiB batches in 6 MiB slots: the huge pages past the first are 2 MiB entries
        assert min(o["pmd_kb"]) >= 2048, o["pmd_kb"]


def test_a_batch_view_maps_whole_huge_pages_from_the_first(huge_dir, monkeypatch):
    """A batch's copy-on-write view (``views.private_view``, every rank's) maps each
    2 MiB page of the slot with one entry, the first too: it starts at the file's
    first byte, so the huge page holding the header and the payload's start is
    whole (from offset HEADER_SIZE, 2044 of its kB took 4 KiB entries)."""
    if not ringdir.describe(huge_dir).huge:
        pytest.skip(f"no huge pages here: {ringdir.describe(huge_dir).why}")
    monkeypatch.setattr(segment, "SHM_DIR", huge_dir)
    token = ring.new_token()
    nbytes = (5 << 20) + 12345
    seg = segment.Segment.create_unique(
        f"/shml-{token}-0.0", segment.KIND_DATA, token, ring.slot_capacity_for(nbytes)
    )
    try:
        writer = seg.map_shared()
        mapping.touch(writer)
        writer[segment.HEADER_SIZE : segment.HEADER_SIZE + 4] = b"abcd"
        released = []
        view = views.private_view(seg, nbytes, lambda: released.append(1))
        assert len(view) == nbytes and bytes(view[:4]) == b"abcd", "the payload, not the header"
        assert int(view[::4096].sum()) + int(view[-1]) == ord("a")  # every page read
        kb = ranks.mapping_kb(view.ctypes.data)
        assert kb["rss"] == kb["pmd"] >= nbytes >> 10, kb
        assert kb["pmd"] % (HUGE >> 10) == 0 and kb["anon"] == 0, kb
        view[0] = ord("A")  # a write stays this view's own (copy-on-write)
        assert writer[segment.HEADER_SIZE] == ord("a")
        assert ranks.mapping_kb(view.ctypes.data)["anon"] > 0
        del view
        assert released == [1]
        writer.close()
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", sorted(ranks.HUGE_PATHS))
def test_every_rank_maps_whole_huge_pages_on_every_path(huge_dir, path):
    """Leader and follower, slots written by the leader's main process, by a worker's
    collate, or by a worker copying its sample in: every batch each rank was handed
    is mapped in whole 2 MiB pages once read (smaps, not time)."""
    if not ringdir.describe(huge_dir).huge:
        pytest.skip(f"no huge pages here: {ringdir.describe(huge_dir).why}")
    out = run_ranks(ranks.huge_paths, 2, kwargs={"path": path}, env={"SHMLOADER_SHM_DIR": huge_dir})
    assert [o["role"] for o in out] == ["leader", "follower"]
    batch_size, workers = ranks.HUGE_PATHS[path]
    batches = len(ranks.Big()) // (batch_size or 1)
    assert out[0]["worker_written"] == (batches if workers else 0), "the path under test"
    for o in out:
        assert len(o["maps"]) == batches
        for kb in o["maps"]:
            assert kb["rss"] == kb["pmd"] > kb["batch"], (o["role"], path, o["maps"])
            assert kb["anon"] == 0, (o["role"], path, o["maps"])


_CHILD = """
import os, signal, sys, time
from shmloader._node import ring, segment
token = ring.new_token()
segs = [
    segment.Segment.create_unique(f"/shml-{token}-{i}.0", segment.KIND_DATA, token, 3 << 20)
    for i in range(2)
]
print(token, segment.SHM_DIR, *[s.name for s in segs], flush=True)
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _child(huge_dir: str, how: str) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, "SHMLOADER_SHM_DIR": huge_dir}
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, how], stdout=subprocess.PIPE, text=True, env=env
    )
    token, where, *names = p.stdout.readline().split()
    assert where == huge_dir
    assert all(os.path.exists(huge_dir + n) for n in names)
    assert not any(os.path.exists("/dev/shm" + n) for n in names)
    return p, token, names


def test_sigterm_removes_names_in_the_ring_directory(huge_dir):
    p, _token, names = _child(huge_dir, "wait")
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == -signal.SIGTERM
    p.stdout.close()
    assert not any(os.path.exists(huge_dir + n) for n in names), "SIGTERM left them"


def test_stat_gc_and_the_daemon_follow_the_ring_directory(huge_dir, monkeypatch, caplog):
    from daemon.shmloaderd.__main__ import check_shm_dirs
    from daemon.shmloaderd.server import Daemon

    p, token, names = _child(huge_dir, "die")
    assert p.wait(10) == -signal.SIGKILL
    p.stdout.close()
    try:
        monkeypatch.setenv("SHMLOADER_SHM_DIR", huge_dir)  # stat and gc scan it too
        doc = inventory.scan()
        job = next(j for j in doc["jobs"] if j["token"] == token)
        assert (job["state"], job["shm_dir"], len(job["segments"])) == ("dead", huge_dir, 2)
        assert job["huge_pages"] is ringdir.describe(huge_dir).huge
        row = next(r for r in doc["node"]["shm_dirs"] if r["path"] == huge_dir)
        assert row["huge_option"] == "within_size" and row["free_bytes"] > 0
        assert f"ring dir {huge_dir}: tmpfs huge=within_size" in stat_cli.format_table(doc)
        listed = reaping.collect_garbage(dry_run=True, owners={p.pid})
        assert sorted(i["name"] for i in listed if i["type"] == "segment") == sorted(names)

        # the daemon, told the directory: checks it, says what it found, reaps there
        monkeypatch.delenv("SHMLOADER_SHM_DIR")
        monkeypatch.setattr(segment, "SHM_DIR", segment.SHM_DIR)  # check_shm_dirs sets it
        with pytest.raises(ConfigError, match="--shm-dir"):
            check_shm_dirs([huge_dir + "/missing"])
        with caplog.at_level(logging.INFO, logger="shmloaderd"):  # the second of two
            shm_dirs = check_shm_dirs(["/dev/shm", huge_dir])
        assert shm_dirs == ["/dev/shm", huge_dir]
        assert f"ring directory {huge_dir}: tmpfs on {huge_dir}, huge=within_size, mode 1777" in (
            caplog.text
        )
        daemon = Daemon("/nonexistent/sock", shm_dirs=shm_dirs)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shmloaderd"):
            daemon.reap_pass()
        assert not any(os.path.exists(huge_dir + n) for n in names), "the daemon left them"
        # each of ours reaped once; /dev/shm may hold another test's dead job (an xdist
        # worker beside this one kills ranks too): the same pass reaps it, rightly
        reaped = [r.args[0] for r in caplog.records if str(r.msg).startswith("reaped ")]
        assert daemon.reaped_segments == len(reaped)
        ours = {n.lstrip("/") for n in names}
        assert sorted(n.lstrip("/") for n in reaped if n.lstrip("/") in ours) == sorted(ours)
        rows = daemon.stats()["node"]["shm_dirs"]
        assert [r["path"] for r in rows] == ["/dev/shm", huge_dir]
    finally:
        for n in names:
            if os.path.exists(huge_dir + n):
                os.unlink(huge_dir + n)


@pytest.mark.parametrize("mode", [0o770, 0o775, 0o730, 0o777, 0o722])
def test_a_directory_its_group_or_others_may_write_without_sticky_bit_is_refused(tmp_path, mode):
    """Writable by its group alone is as unsafe as by everyone: a member of the
    group could remove or replace our segments. The sticky bit makes it safe."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}"):
        ringdir.check(str(d))
    os.chmod(d, mode | 0o1000)
    assert ringdir.check(str(d)) == str(d)
    os.chmod(d, 0o750)  # readable by the group, writable by us only
    assert ringdir.check(str(d)) == str(d)

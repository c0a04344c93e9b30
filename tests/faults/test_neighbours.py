"""Hostile neighbours, forks and signals.

- another local user plants objects at the names we want, or squats the
  runtime directory: no hang, no failure (NOTE [unpredictable names],
  NOTE [private runtime directory]);
- a forked child neither cleans up its parent's resources nor inherits slot
  mappings (NOTE [creator-only cleanup]);
- SIGTERM leaves nothing named, and chains to the application's handler
  (NOTE [SIGTERM]); dead leftovers are reaped when a loader starts and by gc;
- liveness across pid namespaces (NOTE [liveness across pid namespaces]);
- metadata never makes a rank import a module (NOTE [no imports from
  metadata]); peer-supplied counts are bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shmloader import Config, ShmLoader
from shmloader import _rng as rng
from shmloader._node import cleanup, forks, inventory, reaping, segment
from shmloader._node.ring import RingReader, RingWriter, new_token
from shmloader._node.rundir import SOCKET_NAME, make_private_dir, rundir_prefix, socket_path
from shmloader._node.segment import KIND_DATA, KIND_PROBE, PAGE, Segment
from shmloader._proto import codec, typenames
from shmloader._transport.channel import Hub, Peer, Spoke
from shmloader.errors import ProtocolError
from tests.faults.scenarios import outcome
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def names(token: str) -> set[str]:
    return {n for n in os.listdir(segment.SHM_DIR) if n.startswith(f"shml-{token}-")}


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def run_script(code: str, *, timeout: float = 40, env: dict | None = None, **kw):
    """Run ``code`` in a fresh interpreter with this worktree on the path."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "daemon")]))
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@contextlib.contextmanager
def planted(path: str, what: str):
    """A FIFO or a plain file at ``path`` (what another local user could plant)."""
    if what == "fifo":
        os.mkfifo(path, 0o666)
    else:
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ------------------------------------------------------------------ item 1


@pytest.mark.timeout(20)
def test_a_planted_fifo_is_refused_without_blocking() -> None:
    """Every open is O_NONBLOCK and type-checked: a FIFO never hangs us."""
    token = new_token()
    name = f"/shml-{token}-ctl.0"
    with planted(segment.shm_path(name), "fifo"):
        # An open that blocks waits forever for a writer nobody starts: this test's
        # 20 s timeout is the check, there is no latency bound.
        with pytest.raises(ProtocolError, match="not a regular file"):
            segment.read_header(name)
        with pytest.raises(ProtocolError, match="not a regular file"):
            Segment.attach(name, kind=KIND_DATA, token=token)
        entry = inventory.inspect(name)  # stat / gc too
        assert entry is not None and entry.header is None and entry.error


@pytest.mark.timeout(20)
@pytest.mark.parametrize("what", ["fifo", "file"])
def test_objects_planted_at_the_names_a_ring_wants_mean_other_names(what, monkeypatch) -> None:
    """A planted object at the (old, predictable) names and at a drawn random
    name: the ring draws another name; it neither blocks nor fails."""
    token = new_token()
    draws = iter(["0" * 16, "1" * 16])
    real = segment.secrets.token_hex

    def predictable(n: int) -> str:  # the first draws land on the planted names
        return next(draws, None) or real(n)

    monkeypatch.setattr(segment.secrets, "token_hex", predictable)
    plants = [
        f"shml-{token}-ctl",  # what earlier versions used: visible token + fixed suffix
        f"shml-{token}-0.0",
        f"shml-{token}-probe",
        f"shml-{token}-ctl.{'0' * 16}",  # and the first random draws
        f"shml-{token}-0.0.{'1' * 16}",
    ]
    with contextlib.ExitStack() as stack:
        for p in plants:
            stack.enter_context(planted(os.path.join(segment.SHM_DIR, p), what))
        w = RingWriter(token, frozenset({1}), {"job": "t"})
        try:
            slot = w.acquire(100)
            assert slot.segment.name.lstrip("/") not in plants
            assert w.control.name.lstrip("/") not in plants
            r = RingReader(token)
            r.open(slot.segment.name)
            r.close()
        finally:
            w.close()
        assert names(token) == set(plants)  # theirs untouched, ours gone


@pytest.mark.timeout(20)
def test_names_carry_a_random_part_nobody_can_derive_from_the_token() -> None:
    token = new_token()
    w = RingWriter(token, frozenset({1}), {"job": "t"})
    try:
        a, b = w.acquire(10), w.acquire(10)  # b: a is FREE, reused; force a second slot
        w.hold_for_readers(a, 0, 10, 0)
        b = w.acquire(10)
        stems = {f"/shml-{token}-ctl", f"/shml-{token}-0.0", f"/shml-{token}-1.0"}
        for seg in (w.control, a.segment, b.segment):
            stem, _, rand = seg.name.rpartition(".")
            assert stem in stems and len(rand) == 16 and int(rand, 16) >= 0
    finally:
        w.close()


@pytest.mark.timeout(20)
def test_a_squatted_runtime_base_does_not_stop_us(no_leaks) -> None:
    """Another user owning ``<base>/shmloader-<uid>`` (the fixed name earlier
    versions used) does not matter: each process makes a private directory."""
    base = no_leaks
    squat = os.path.join(base, f"shmloader-{os.geteuid()}")
    os.mkdir(squat, 0o777)
    if os.geteuid() == 0:
        os.chown(squat, 65534, 65534)
    try:
        d = make_private_dir(base)
        st = os.lstat(d)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
        assert os.path.basename(d).startswith(f"shml-{os.getpid():x}.")
        hub = Hub(socket_path(d))
        spoke = Spoke(socket_path(d), 1)
        spoke.close()
        hub.close()
        assert not os.path.exists(d)  # the hub removed its socket and directory
    finally:
        os.rmdir(squat)


@pytest.mark.timeout(20)
def test_a_reader_refuses_a_runtime_directory_open_to_others(no_leaks) -> None:
    d = make_private_dir(no_leaks)
    try:
        os.chmod(d, 0o755)
        with pytest.raises(ProtocolError, match="0700"):
            Spoke(socket_path(d), 1)
    finally:
        os.rmdir(d)


def listed(obj):
    """A delivered batch as nested Python lists (comparable with ==)."""
    if isinstance(obj, torch.Tensor | np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: listed(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [listed(v) for v in obj]
    return obj


def squatted_world(rank: int, world: int) -> dict:
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=6), dist.group.WORLD, config=Config.from_env(enabled=True)
    )
    out = outcome(lambda: [listed(b) for b in loader])
    loader.close()
    return out


@pytest.mark.timeout(120)
def test_a_job_runs_with_a_squatted_runtime_base(no_leaks) -> None:
    squat = os.path.join(no_leaks, f"shmloader-{os.geteuid()}")
    os.mkdir(squat, 0o777)
    if os.geteuid() == 0:
        os.chown(squat, 65534, 65534)
    try:
        results = run_ranks(squatted_world, 2)
    finally:
        os.rmdir(squat)
    assert [r["ok"] for r in results] == [True, True], results
    assert results[0]["value"] == results[1]["value"]


# ------------------------------------------------------------------ item 2

_FORK_EXIT = """
    import os, sys
    from shmloader._node.rundir import make_private_dir, socket_path
    from shmloader._transport.channel import Hub
    from shmloader._node.ring import RingWriter, new_token
    token = new_token()
    w = RingWriter(token, frozenset({1}), {"job": "t"})
    slot = w.acquire(1000)  # named until rank 1 attaches
    hub = Hub(socket_path(make_private_dir(None)))
    keep = [w.control.name, slot.segment.name]
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal interpreter exit: atexit and finalizers run here
    os.waitpid(pid, 0)
    left = [n for n in keep if os.path.exists("/dev/shm" + n)]
    print(len(left), len(keep), int(os.path.exists(hub.path)), flush=True)
    hub.close()
    w.close()
"""


@pytest.mark.timeout(60)
def test_a_forked_child_exiting_normally_removes_nothing_of_its_parent(no_leaks) -> None:
    p = run_script(_FORK_EXIT, env={"SHMLOADER_RUNTIME_DIR": no_leaks})
    out, err = p.communicate(timeout=50)
    assert p.returncode == 0, err
    left, kept, sock = (int(x) for x in out.split())
    assert (left, sock) == (kept, 1), "the child's exit unlinked its parent's names"


def _mapped_shml(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "/dev/shm/shml-" in line]


def _unreserved() -> int:
    """Live DONTFORK mappings whose range no inaccessible anonymous mapping holds here."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if fields[1] == "---p" and len(fields) == 5:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
    live = [(a, n) for a, (ref, n) in forks.NOT_FORKED.items() if ref() and not ref().closed]
    return sum(not any(lo <= a and a + n <= hi for lo, hi in spans) for a, n in live)


@pytest.mark.timeout(30)
def test_forked_children_inherit_no_slot_mapping() -> None:
    """MADV_DONTFORK: the writer's shared mappings do not reach a forked child,
    and a reader's private view reaches it only as an anonymous copy (NOTE
    [batches cross a fork]): no mapping of a slot is left to pin it."""
    token = new_token()
    w = RingWriter(token, frozenset({1}), {"job": "t"})
    r = RingReader(token)
    try:
        slot = w.acquire(1 << 20)
        r.open(slot.segment.name)
        view = r.view(slot.segment.name, 1 << 20, lambda: None)
        assert len(_mapped_shml()) >= 2  # both mappings are here in the parent
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.write(wfd, f"{len(_mapped_shml())} {_unreserved()}".encode())
            finally:
                os._exit(0)
        os.close(wfd)
        inherited, unreserved = (int(x) for x in os.read(rfd, 64).split())
        os.close(rfd)
        os.waitpid(pid, 0)
        assert inherited == 0, f"a forked child inherited {inherited} slot mapping(s)"
        # ... and their address ranges are held, so the child's copies of the
        # mmap objects can never unmap something else the child put there.
        assert unreserved == 0, f"{unreserved} range(s) left free in the child"
        del view
    finally:
        r.close()
        w.close()


@pytest.mark.timeout(30)
def test_a_worker_maps_a_slot_itself_to_write_it() -> None:
    from shmloader._node.ring import open_slot_for_worker

    token = new_token()
    w = RingWriter(token, frozenset({1}), {"job": "t"})
    try:
        slot = w.acquire(100)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                seg, mm = open_slot_for_worker(slot.segment.name, token)
                mm[segment.HEADER_SIZE : segment.HEADER_SIZE + 3] = b"abc"
                mm.close()
                seg.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bytes(slot.payload[:3]) == b"abc"
        with pytest.raises(ProtocolError):
            open_slot_for_worker(f"/shml-{new_token()}-0.0.00", token)
    finally:
        w.close()


# ------------------------------------------------------------------ item 6

_SIGTERM = """
    import os, signal, sys, time
    from shmloader._node.rundir import make_private_dir, socket_path
    from shmloader._transport.channel import Hub
    from shmloader._node.ring import RingWriter
    mode = sys.argv[1] if len(sys.argv) > 1 else "default"
    carried = []  # "carry-on": the signals its handler saw
    if mode == "chained":
        def app(signum, frame):
            print("app handler ran", flush=True)
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, app)
    elif mode == "carry-on":
        def app(signum, frame):
            print("carrying on", flush=True)
            carried.append(signum)
        signal.signal(signal.SIGTERM, app)
    w = RingWriter("{token}", frozenset({{1}}), {{"job": "t"}})
    slot = w.acquire(1000)  # named: rank 1 never attached
    if mode == "grown":  # a forked worker grows a pool slot in our name (WorkerSlots._grow)
        import dataclasses
        from shmloader._node.segment import KIND_DATA, MY_START, Segment
        parent, start = os.getpid(), MY_START
        child = os.fork()
        if child == 0:
            seg = Segment.create_unique("/shml-{token}-7.1", KIND_DATA, "{token}", 4096)
            header = dataclasses.replace(seg.header, pid=parent, start=start)
            header.write(seg.fd)
            os._exit(0)
        os.waitpid(child, 0)
    hub = Hub(socket_path(make_private_dir(None)))
    from shmloader._node.segment import SHM_DIR
    def held():
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("shml-{token}-"))
    named = held()
    print("ready", flush=True)
    for _ in range(200):  # the other modes die of the signal in here
        if carried:  # carried on: 1 s more, then the ring must still be whole
            time.sleep(1.0)
            break
        time.sleep(0.1)
    if held() == named:
        print("ring kept", flush=True)
    print("still here", flush=True)
    hub.close()
    w.close()
"""


def _sigterm_run(token: str, runtime: str, mode: str) -> tuple[int, str, set[str], list[str]]:
    code = textwrap.dedent(_SIGTERM).format(token=token)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "daemon")]),
        SHMLOADER_RUNTIME_DIR=runtime,
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, mode], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        named, rundirs = names(token), [n for n in os.listdir(runtime) if n.startswith("shml-")]
        assert len(named) == (3 if mode == "grown" else 2) and len(rundirs) == 1
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    left_dirs = [n for n in os.listdir(runtime) if n.startswith("shml-")]
    return p.returncode, out, names(token), left_dirs


@pytest.mark.timeout(60)
def test_sigterm_leaves_nothing_and_dies_of_the_signal(no_leaks) -> None:
    token = new_token()
    code, out, left, dirs = _sigterm_run(token, no_leaks, "default")
    assert code == -signal.SIGTERM, (code, out)
    assert left == set() and dirs == [], (left, dirs)


@pytest.mark.timeout(60)
def test_sigterm_removes_segments_a_forked_worker_made_in_our_name(no_leaks) -> None:
    """A DataLoader worker that grew a pool slot wrote the leader's pid into its
    header; the leader's SIGTERM must remove it although it never named it."""
    token = new_token()
    code, out, left, dirs = _sigterm_run(token, no_leaks, "grown")
    assert code == -signal.SIGTERM, (code, out)
    assert left == set() and dirs == [], (left, dirs)


@pytest.mark.timeout(30)
def test_a_worker_stopped_by_sigterm_leaves_the_slot_it_handed_to_the_leader(no_leaks) -> None:
    """A DataLoader worker grows a pool slot and writes the leader into its header
    (``WorkerSlots._grow``); the DataLoader stops a worker slow to exit with SIGTERM.
    Its cleanup must not unlink that slot: the leader's later workers open it by
    name. What still names the worker goes."""
    token = new_token()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker
        code = 1
        try:
            os.close(read)
            parent = os.getppid()
            start = segment.proc_start_time(parent)
            handed = Segment.create_unique(f"/shml-{token}-7.1", KIND_DATA, token, 4096)
            header = dataclasses.replace(handed.header, pid=parent, start=start)
            header.write(handed.fd)
            mine = Segment.create_unique(f"/shml-{token}-8.1", KIND_DATA, token, 4096)
            os.write(write, f"{handed.name} {mine.name}".encode())
            cleanup.remove_owned()  # what the SIGTERM handler runs
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        handed_name, mine_name = f.read().split()
    _, status = os.waitpid(child, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
        assert segment.read_header(handed_name).pid == os.getpid()
        assert not os.path.exists(segment.shm_path(mine_name)), "its own name must go"
    finally:
        segment.unlink_name(handed_name)
        segment.unlink_name(mine_name)


@pytest.mark.timeout(60)
def test_sigterm_chains_to_the_applications_handler(no_leaks) -> None:
    token = new_token()
    code, out, left, dirs = _sigterm_run(token, no_leaks, "chained")
    assert code == 3 and "app handler ran" in out, (code, out)
    assert left == set() and dirs == []


@pytest.mark.timeout(60)
def test_an_application_that_carries_on_after_sigterm_keeps_its_ring(no_leaks) -> None:
    token = new_token()
    code, out, left, dirs = _sigterm_run(token, no_leaks, "carry-on")
    assert code == 0 and "carrying on" in out and "still here" in out, (code, out)
    assert "ring kept" in out, out  # SIGTERM took nothing from a process that carried on
    assert left == set() and dirs == []  # removed by its own close() at the end


@pytest.fixture
def private_shm(tmp_path, monkeypatch) -> str:
    """A private segment directory: other runs' ``gc`` on this machine cannot
    remove this test's dead-owner segments under it."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(segment, "SHM_DIR", str(d))
    return str(d)


@pytest.mark.timeout(30)
def test_reaping_at_start_removes_our_dead_leftovers_only(
    no_leaks, private_shm, monkeypatch
) -> None:
    import dataclasses

    token = new_token()
    dead = dead_pid()
    made = []

    def seg(stem: str, **header) -> Segment:
        s = Segment.create_unique(f"/shml-{token}-{stem}", KIND_DATA, token, PAGE)
        os.pwrite(s.fd, dataclasses.replace(s.header, **header).pack(), 0)
        made.append(s)
        return s

    gone = seg("0.0", pid=dead)  # dead owner in our pid namespace
    foreign = seg("1.0", pid=dead, pidns=segment.MY_PIDNS + 1)  # another namespace
    live = seg("2.0")
    dead_dir = os.path.join(no_leaks, rundir_prefix(dead, 1, segment.MY_PIDNS) + "abc")
    foreign_dir = os.path.join(no_leaks, rundir_prefix(dead, 1, 1) + "abc")
    live_dir = make_private_dir(no_leaks)
    for d in (dead_dir, foreign_dir):
        os.mkdir(d, 0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(dead_dir, SOCKET_NAME))
    try:
        monkeypatch.setenv("SHMLOADER_REAP", "0")
        assert reaping.reap_own(no_leaks) == 0 and os.path.exists(dead_dir)
        monkeypatch.setenv("SHMLOADER_REAP", "1")
        dry = reaping.collect_garbage(dry_run=True, runtime_dir=no_leaks, owners={dead})
        assert {i["name"] for i in dry} == {gone.name, dead_dir}
        assert reaping.reap_own(no_leaks) >= 2
        assert not os.path.exists(segment.shm_path(gone.name))
        assert not os.path.exists(dead_dir)
        for kept in (foreign.name, live.name):
            assert os.path.exists(segment.shm_path(kept))
        assert os.path.exists(foreign_dir) and os.path.exists(live_dir)
    finally:
        for s in made:
            s.unlink()
            s.close()
        for d in (foreign_dir, live_dir, dead_dir):
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(d)


@pytest.mark.timeout(30)
def test_gc_cli_removes_dead_runtime_directories_and_scopes_by_token(
    no_leaks, private_shm, capsys
) -> None:
    import dataclasses

    from shmloader.tools import cli

    dead = dead_pid()
    dead_dir = os.path.join(no_leaks, rundir_prefix(dead, 1, segment.MY_PIDNS) + "xyz")
    os.mkdir(dead_dir, 0o700)
    mine, other = new_token(), new_token()
    segs = []
    for tok in (mine, other):
        s = Segment.create_unique(f"/shml-{tok}-0.0", KIND_DATA, tok, PAGE)
        os.pwrite(s.fd, dataclasses.replace(s.header, pid=dead).pack(), 0)
        segs.append(s)
    try:
        os.environ["SHMLOADER_RUNTIME_DIR"] = no_leaks  # set by the fixture too
        assert cli.main(["gc", "--verbose", "--token", mine]) == 0
        out = capsys.readouterr().out
        assert segs[0].name in out and segs[1].name not in out
        assert os.path.exists(segment.shm_path(segs[1].name))  # another job's: untouched
        assert os.path.exists(dead_dir)  # --token scopes to segments
        assert cli.main(["gc", "--owner-pid", str(dead)]) == 0
        out = capsys.readouterr().out
        assert f"removed runtime directory {dead_dir}" in out
        assert not os.path.exists(dead_dir)
    finally:
        for s in segs:
            s.unlink()
            s.close()
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(dead_dir)


# ------------------------------------------------------------------ item 7

_OTHER_PIDNS = """
    import fcntl, os, sys, time
    from shmloader._node.segment import KIND_PROBE, MY_PIDNS, Segment
    probe = Segment.create_unique("/shml-{token}-probe", KIND_PROBE, "{token}", 0)
    fcntl.flock(probe.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print(probe.name, os.getpid(), MY_PIDNS, probe.header.start, flush=True)
    sys.stdin.readline()
    probe.unlink()
"""


@pytest.mark.timeout(30)
@pytest.mark.skipif(os.geteuid() != 0, reason="a new pid namespace needs root")
def test_a_peer_in_another_pid_namespace_is_judged_by_its_life_lock() -> None:
    token = new_token()
    code = textwrap.dedent(_OTHER_PIDNS).format(token=token)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "daemon")]))
    p = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline().split()
        name, pid, pidns, start = line[0], int(line[1]), int(line[2]), int(line[3])
        assert pidns != segment.MY_PIDNS and pid == 1  # really another namespace
        seg = Segment.attach(name, kind=KIND_PROBE, token=token)
        peer = Peer(1, "leader", pid, start, pidns=pidns, life_fd=seg.fd)
        for _ in range(3):
            assert peer.alive(), "a live peer of another pid namespace was called dead"
            time.sleep(0.05)
        assert not Peer(1, "leader", pid, start).alive()  # what a raw pid test concludes
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(10)
        deadline = time.monotonic() + 30  # a hang guard: the process has exited
        while peer.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not peer.alive(), "a dead peer of another pid namespace still counts as alive"
        seg.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        segment.unlink_name(f"/shml-{token}-probe")


def other_pidns(rank: int, world: int, *, die: bool) -> dict:
    """Rank 1 reports itself as a process of another pid namespace: its pid
    means nothing to rank 0 (here: a pid that is not running)."""
    if rank == 1:
        fake = int(os.environ["FAKE_PID"])
        os.getpid = lambda: fake  # what the other namespace calls this process
        segment.MY_PIDNS = segment.MY_PIDNS + 12345
    loader = ShmLoader(
        ranks.make_loader_factory(0, n=24 if die else 12),
        dist.group.WORLD,
        config=Config.from_env(enabled=True),
    )
    if rank == 1 and die:
        it = iter(loader)
        held = next(it)  # held: rank 0 cannot finish its 12 batches without us
        os._exit(0 if held is not None else 1)  # dies without a word: only the life lock tells

    def slowly() -> list:  # rank 0 waits for rank 1 across several liveness checks
        got = []
        for b in loader:
            got.append(listed(b))
            if rank == 1:
                time.sleep(0.6)
        return got

    t0 = time.monotonic()
    out = outcome(slowly)
    out["seconds"] = time.monotonic() - t0
    loader.close()
    return out


@pytest.mark.timeout(120)
def test_ranks_in_different_pid_namespaces_share_a_ring() -> None:
    results = run_ranks(
        other_pidns,
        2,
        kwargs={"die": False},
        env={"FAKE_PID": str(dead_pid()), "SHMLOADER_SLOTS": "2"},
    )
    assert [r["ok"] for r in results] == [True, True], results
    assert results[0]["value"] == results[1]["value"]


#: SHMLOADER_TIMEOUT of the dead-peer test: what the leader would wait without
#: the life lock telling it the peer died.
DEAD_PEER_TIMEOUT_S = 100


@pytest.mark.timeout(150)
def test_a_dead_peer_of_another_pid_namespace_is_detected_fast() -> None:
    env = {"FAKE_PID": str(dead_pid()), "SHMLOADER_SLOTS": "2"}
    env["SHMLOADER_TIMEOUT"] = str(DEAD_PEER_TIMEOUT_S)
    results = run_ranks(
        other_pidns, 2, kwargs={"die": True}, env=env, expect_failure=True, timeout=130
    )
    leader = results[0]
    assert isinstance(leader, dict), leader
    assert not leader["ok"] and leader["type"] == "PeerLostError", leader
    # told by the life lock, long before the 100 s timeout it would otherwise wait
    assert "died" in leader["message"], leader
    assert leader["seconds"] < DEAD_PEER_TIMEOUT_S / 4, leader


# ------------------------------------------------------------------ item 10


@pytest.mark.timeout(30)
def test_metadata_never_imports_a_module(tmp_path, monkeypatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "shml_planted_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class Box:\n"
        "    x: int\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shml_planted_mod", raising=False)
    meta = json.dumps(
        {"v": codec.FORMAT_VERSION, "n": 0, "L": [], "t": ["C", "shml_planted_mod:Box", [["x", 1]]]}
    ).encode()
    payload = np.zeros(0, np.uint8)
    with pytest.raises(ProtocolError, match="has not imported"):
        codec.decode(meta, payload)
    assert not marker.exists(), "decoding imported a module named in the metadata"
    import shml_planted_mod  # noqa: F401  imported by the program itself: now resolvable

    try:
        assert marker.exists()
        box = codec.decode(meta, payload)
        assert type(box).__name__ == "Box"
    finally:
        sys.modules.pop("shml_planted_mod", None)


@pytest.mark.timeout(30)
def test_an_allowed_module_may_be_imported_by_name(tmp_path, monkeypatch) -> None:
    (tmp_path / "shml_allowed_mod.py").write_text(
        "import collections\nPair = collections.namedtuple('Pair', 'a b')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(typenames, "_ALLOWED_MODULES", {"shml_allowed_mod"})
    meta = json.dumps(
        {"v": codec.FORMAT_VERSION, "n": 0, "L": [], "t": ["N", "shml_allowed_mod:Pair", [1, 2]]}
    ).encode()
    try:
        out = codec.decode(meta, np.zeros(0, np.uint8))
        assert tuple(out) == (1, 2) and type(out).__module__ == "shml_allowed_mod"
    finally:
        sys.modules.pop("shml_allowed_mod", None)


@pytest.mark.timeout(10)
def test_peer_counts_are_bounded() -> None:
    state = torch.get_rng_state()
    for n in (-1, rng.MAX_MIRRORED_DRAWS + 1, 1 << 62):
        with pytest.raises(ProtocolError, match="draws"):
            rng.mirror_draws(n)
    assert torch.equal(torch.get_rng_state(), state)
    rng.mirror_draws(rng.MAX_MIRRORED_DRAWS)  # the bound itself is fine


@pytest.mark.timeout(10)
def test_a_cross_node_header_with_a_huge_meta_len_is_refused_before_allocating() -> None:
    from shmloader._proto.wire import Kind
    from shmloader._transport import xnode

    class Fake(xnode.CrossNode):
        def __init__(self, head: list[int]) -> None:
            super().__init__(None, 0, (0,))  # type: ignore[arg-type]  # no gloo: _recv below
            self.head = head

        def _recv(self, tensor: torch.Tensor) -> None:
            if tensor.numel() != len(self.head):
                raise AssertionError(f"asked to receive {tensor.numel()} bytes of metadata")
            tensor.copy_(torch.tensor(self.head, dtype=torch.int64))

    for head in (
        # kind, it, nbytes, meta_len, draws, crc, epoch, pos
        [int(Kind.BATCH), 1, 0, 1 << 50, 0, -1, 0, 0],
        [int(Kind.BATCH), 1, 0, 0, 1 << 40, -1, 0, 0],
        [int(Kind.END), 1, 0, 0, -5, -1, 0, 0],
    ):
        fake = Fake(head)
        with pytest.raises(ProtocolError, match="out of bounds"):
            fake.receive_header()
        fake.close()  # its link ends


def nothing(rank: int, world: int) -> int:
    return rank


_SUITE_GC = """
    import dataclasses, os, subprocess
    from shmloader._node import segment
    from shmloader._node.ring import new_token
    from shmloader._node.segment import KIND_DATA, PAGE, Segment
    from tests.support.harness import run_ranks
    from tests.faults.test_neighbours import nothing

    token = new_token()
    other = Segment.create_unique(f"/shml-{token}-ctl", KIND_DATA, token, PAGE)
    gone = subprocess.Popen(["true"])
    gone.wait()
    os.pwrite(other.fd, dataclasses.replace(other.header, pid=gone.pid).pack(), 0)
    assert run_ranks(nothing, 2, gc_after=True) == [0, 1]
    print(int(os.path.exists(segment.shm_path(other.name))), flush=True)
    other.unlink()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm needs root")
def test_the_suites_gc_leaves_other_runs_leftovers_alone() -> None:
    """``run_ranks(gc_after=True)`` collects what its ranks left, not what a
    dead process of another run (or job) left in ``/dev/shm``. Run in a
    private ``/dev/shm``, where no other run's gc can interfere."""
    code = textwrap.dedent(_SUITE_GC)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "daemon")]))
    shell = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"'
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, sys.executable, code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1", "the suite's gc removed another run's leftover"


@pytest.mark.timeout(30)
def test_a_forked_child_does_not_keep_its_parents_life_lock() -> None:
    """A DataLoader worker outliving its dead parent must not make the parent
    look alive to peers of another pid namespace."""
    import fcntl

    from shmloader._topology import _Held
    from shmloader._transport.channel import life_lock_held

    token = new_token()
    probe = Segment.create_unique(f"/shml-{token}-probe", KIND_PROBE, token, 0)
    fcntl.flock(probe.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held = _Held(probe, "")
    tester = Segment.attach(probe.name, kind=KIND_PROBE, token=token)
    rfd, wfd = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: lives on until told
        os.write(ready_w, b"r")  # the fork handlers have run by now
        os.read(rfd, 1)
        os._exit(0)
    os.close(rfd)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"r"
        os.close(ready_r)
        assert life_lock_held(tester.fd)
        held.free()  # the parent's last descriptor goes, as at its death
        assert not life_lock_held(tester.fd), "the forked child kept the life lock"
    finally:
        os.write(wfd, b"x")
        os.close(wfd)
        os.waitpid(pid, 0)
        tester.close()

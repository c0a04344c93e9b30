"""Suite-wide fixtures: every test fails if it leaks a segment, a socket or a process.

NOTE [only our own segments]
    Other jobs, and other runs of this suite, may share the node's
    /dev/shm. The leak check judges, and removes, only what this run made:
    a segment whose owner (header pid and start time) is alive counts when
    that owner descends from this pytest process; one whose owner is dead
    counts only when its ring's control segment names this run's job
    (``RUN_JOB``: every ring of the run carries it, as ``SHMLOADER_JOB``,
    in its description). A dead owner or an unreadable header alone proves
    nothing: counting those as ours deleted other jobs' shared memory and
    failed tests whenever another run's segments appeared. Every ring
    directory is checked: /dev/shm, ``SHMLOADER_SHM_DIR`` (as the test left
    it) and the huge-page tmpfs of ``huge_dir`` once a test asked for it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time

import pytest

#: Ring directories the leak check looks in besides /dev/shm and SHMLOADER_SHM_DIR.
RING_DIRS: list[str] = []
#: This run's job name: in the description of every ring it makes (NOTE [only our own segments]).
RUN_JOB = f"pytest-{os.getpid()}-{secrets.token_hex(4)}"
os.environ["SHMLOADER_JOB"] = RUN_JOB  # inherited by every rank and daemon the tests start


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return int(raw[raw.rindex(b")") + 2 :].split()[1])


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid and pid != 1:
        if pid == me:
            return True
        parent = _ppid(pid)
        if parent is None:
            return False
        pid = parent
    return False


def ring_dirs() -> list[str]:
    """Where this run's segments can be: /dev/shm, SHMLOADER_SHM_DIR, ``RING_DIRS``."""
    from shmloader._node.inventory import ring_dirs as dirs

    return dirs(RING_DIRS)


def run_jobs() -> dict[str, str | None]:
    """Ring token -> the job its control segment describes, for every control segment."""
    from shmloader._node.inventory import scan_entries
    from shmloader._node.segment import KIND_CONTROL

    out: dict[str, str | None] = {}
    for entry in scan_entries(dirs=ring_dirs()):
        if entry.header is not None and entry.header.kind == KIND_CONTROL:
            job = (entry.description or {}).get("job")
            out[entry.header.token] = job if isinstance(job, str) else None
    return out


def ours(name: str, jobs: dict[str, str | None] | None = None, directory: str = "") -> bool:
    """Whether this run made segment ``name`` (NOTE [only our own segments]).

    ``directory``: the ring directory it is in (this process's by default).
    """
    from shmloader._node.segment import in_dir, read_header, ring_dir
    from shmloader.errors import ProtocolError

    try:
        with in_dir(directory or ring_dir()):
            header = read_header("/" + name.lstrip("/"))
    except (OSError, ProtocolError):
        header = None
    return judge(header, run_jobs() if jobs is None else jobs)


def judge(header, jobs: dict[str, str | None]) -> bool:
    """The rule of :func:`ours` for one segment header (None: unreadable)."""
    from shmloader._node.segment import owner_alive

    if header is None:
        return False  # nobody can say whose it is
    if owner_alive(header):
        return _descends_from_us(header.pid)
    return jobs.get(header.token) == RUN_JOB


def _shm_entries() -> set[tuple[str, str]]:
    """(ring directory, name) of every ``shml-`` entry of every ring directory."""
    out = set()
    for d in ring_dirs():
        with contextlib.suppress(FileNotFoundError):
            out |= {(d, n) for n in os.listdir(d) if n.startswith("shml-")}
    return out


def _children() -> set[int]:
    """Live (non-zombie) child processes of this pytest process, and its ranks.

    Ranks are forked by the warm forkserver (NOTE [warm ranks] in
    tests/support/harness.py), so they are its children, not ours: the harness lists
    every one it started (``STARTED``), and those still alive count too.
    """
    from tests.support.harness import STARTED

    # Our children as the kernel lists them per thread (no scan of every
    # process on the node: reading another process's cmdline is slow).
    candidates = set(STARTED)
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            candidates |= {int(pid) for pid in f.read().split()}
    out = set()
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        state = raw[raw.rindex(b")") + 2 :].split()[0]
        helper = b"resource_tracker" in cmd or b"multiprocessing.forkserver" in cmd
        if state != b"Z" and (pid in STARTED or not helper):
            out.add(pid)
    return out


#: Names whose use makes a test start other processes (marker ``procs``).
PROCESS_STARTERS = frozenset(
    {
        *("run_ranks", "Popen", "subprocess", "get_context", "Process", "Daemon"),
        *("num_workers", "multiprocessing_context"),  # DataLoader workers
    }
)


def _starts_processes(fn, module, seen: set) -> bool:
    """Whether ``fn``, or a function or class of ``module`` it names, starts processes.

    Followed through the module's own functions, classes and methods, so a
    test that calls a helper calling ``run_ranks`` counts too.
    """
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = set(code.co_names) | set(code.co_varnames)
    stack = [code]
    while stack:  # nested functions and comprehensions; keyword names of calls
        inner = stack.pop()
        names |= set(inner.co_names) | set(inner.co_varnames)
        for const in inner.co_consts:
            if hasattr(const, "co_names"):
                stack.append(const)
            elif isinstance(const, tuple):
                names |= {c for c in const if isinstance(c, str)}
    if names & PROCESS_STARTERS:
        return True
    for name in names:
        obj = getattr(module, name, None)
        if isinstance(obj, type) and getattr(obj, "__module__", None) == module.__name__:
            if any(_starts_processes(m, module, seen) for m in vars(obj).values()):
                return True
        elif (
            getattr(obj, "__module__", None) == module.__name__
            and callable(obj)
            and _starts_processes(obj, module, seen)
        ):
            return True
    return False


def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``procs`` every test that starts processes (itself or through its fixtures).

    ``pytest -m "not procs"`` is the fast inner loop: pure and in-process tests.
    """
    for item in items:
        fn = getattr(item, "function", None)
        module = getattr(item, "module", None)
        if fn is None or module is None:
            continue
        fixtures = getattr(item, "_fixtureinfo", None)
        funcs = [fn]
        if fixtures is not None:
            for defs in fixtures.name2fixturedefs.values():
                funcs += [d.func for d in defs]
        if any(
            _starts_processes(f, sys.modules.get(getattr(f, "__module__", "")) or module, set())
            for f in funcs
        ):
            item.add_marker(pytest.mark.procs)
    # The longest tests first: with two workers (the README's command), one of
    # them left for the end of a worker's queue would keep the run waiting on it.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config) -> None:
    from tests.support.harness import WARM_MODULES, fork_safe_workers

    # This process starts DataLoader workers too (tests/multirank/test_forks.py); its
    # forkserver is also the one ranks are forked from (NOTE [warm ranks]).
    fork_safe_workers(WARM_MODULES)


@pytest.fixture(autouse=True)
def no_leaks(monkeypatch):
    """Fail the test if it leaves a shml- segment, a socket file or a child process."""
    runtime = tempfile.mkdtemp(prefix="shmlrt-", dir="/tmp")
    monkeypatch.setenv("SHMLOADER_RUNTIME_DIR", runtime)
    # Loaders reap dead leftovers of our uid when they start; a test run must
    # never touch other runs' (tests of reaping switch it back on).
    monkeypatch.setenv("SHMLOADER_REAP", "0")
    before_shm = _shm_entries()
    before_children = _children()
    yield runtime
    deadline = time.monotonic() + 3.0  # let exiting processes finish unlinking
    while True:
        new = _shm_entries() - before_shm
        jobs = run_jobs() if new else {}
        leaked_shm = {(d, n) for d, n in new if ours(n, jobs, d)}
        leaked_children = _children() - before_children
        sockets = [os.path.join(d, f) for d, _, files in os.walk(runtime) for f in files]
        sockets += [os.path.join(runtime, n) for n in os.listdir(runtime) if n.startswith("shml-")]
        if not (leaked_shm or leaked_children or sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    shutil.rmtree(runtime, ignore_errors=True)
    problems = []
    if leaked_shm:
        shown = sorted(os.path.join(d, n) for d, n in leaked_shm)
        problems.append(f"shared memory segments left: {shown}")
        for d, name in leaked_shm:  # do not cascade into later tests
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))
    if sockets:
        problems.append(f"sockets or directories left in the runtime directory: {sockets}")
    if leaked_children:
        problems.append(f"child processes left running: {sorted(leaked_children)}")
        for pid in leaked_children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(scope="session")
def huge_dir():
    """A tmpfs mounted with ``huge=within_size`` (a huge-page ring directory).

    Mounted in a private mount namespace that this process's main thread
    enters (``unshare(CLONE_NEWNS)``; ranks and helpers it starts inherit
    it), so nothing of it is visible outside the test run and the kernel
    frees it when the run ends. Skipped, with the reason, when not root or
    when the mount fails; the leak check covers it (``RING_DIRS``).
    """
    from tests.support.harness import huge_tmpfs

    try:
        path = huge_tmpfs()
    except OSError as exc:
        pytest.skip(f"cannot mount a huge=within_size tmpfs in a private mount namespace: {exc}")
    RING_DIRS.append(path)
    yield path
    import ctypes

    ctypes.CDLL(None, use_errno=True).umount2(path.encode(), 2)  # MNT_DETACH
    with contextlib.suppress(OSError):
        os.rmdir(path)

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
    failed tests whenever another run's segments appeared.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time

import pytest

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


def run_jobs() -> dict[str, str | None]:
    """Ring token -> the job its control segment describes, for every control segment."""
    from shmloader.admin import inspect
    from shmloader.segment import KIND_CONTROL, list_segments

    out: dict[str, str | None] = {}
    for name in list_segments():
        entry = inspect(name)
        if entry is not None and entry.header is not None and entry.header.kind == KIND_CONTROL:
            job = (entry.description or {}).get("job")
            out[entry.header.token] = job if isinstance(job, str) else None
    return out


def ours(name: str, jobs: dict[str, str | None] | None = None) -> bool:
    """Whether this run made segment ``name`` (NOTE [only our own segments])."""
    from shmloader.errors import ProtocolError
    from shmloader.segment import read_header

    try:
        header = read_header("/" + name.lstrip("/"))
    except (OSError, ProtocolError):
        header = None
    return judge(header, run_jobs() if jobs is None else jobs)


def judge(header, jobs: dict[str, str | None]) -> bool:
    """The rule of :func:`ours` for one segment header (None: unreadable)."""
    from shmloader.segment import owner_alive

    if header is None:
        return False  # nobody can say whose it is
    if owner_alive(header):
        return _descends_from_us(header.pid)
    return jobs.get(header.token) == RUN_JOB


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("shml-")}
    except FileNotFoundError:
        return set()


def _children() -> set[int]:
    """Live (non-zombie) child processes of this pytest process."""
    me = os.getpid()
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(b")") + 2 :].split()
        helper = b"resource_tracker" in cmd or b"multiprocessing.forkserver" in cmd
        if int(fields[1]) == me and fields[0] != b"Z" and not helper:
            out.add(int(entry))
    return out


def pytest_configure(config) -> None:
    from tests.harness import fork_safe_workers

    fork_safe_workers()  # this process starts DataLoader workers too (tests/test_forks.py)


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
        leaked_shm = {n for n in new if ours(n, jobs)}
        leaked_children = _children() - before_children
        sockets = [os.path.join(d, f) for d, _, files in os.walk(runtime) for f in files]
        sockets += [os.path.join(runtime, n) for n in os.listdir(runtime) if n.startswith("shml-")]
        if not (leaked_shm or leaked_children or sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    shutil.rmtree(runtime, ignore_errors=True)
    problems = []
    if leaked_shm:
        problems.append(f"shared memory segments left in /dev/shm: {sorted(leaked_shm)}")
        for name in leaked_shm:  # do not cascade into later tests
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
    if sockets:
        problems.append(f"sockets or directories left in the runtime directory: {sockets}")
    if leaked_children:
        problems.append(f"child processes left running: {sorted(leaked_children)}")
        for pid in leaked_children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    if problems:
        pytest.fail("; ".join(problems))

"""Suite-wide fixtures: every test fails if it leaks a segment, a socket or a process."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import pytest


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return int(raw[raw.rindex(b")") + 2 :].split()[1])


def _ours(name: str) -> bool:
    """A segment counts against this test unless a live process outside our tree owns it.

    (Other test runs may share the machine; CI runs one suite at a time.)
    """
    from shmloader.errors import ProtocolError
    from shmloader.segment import read_header

    try:
        pid = read_header("/" + name).pid
    except (OSError, ProtocolError):
        return True
    me = os.getpid()
    while pid and pid != 1:
        if pid == me:
            return True
        parent = _ppid(pid)
        if parent is None:
            return True  # dead owner: a leak
        pid = parent
    return False


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
        leaked_shm = {n for n in _shm_entries() - before_shm if _ours(n)}
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

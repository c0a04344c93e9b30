"""CPU time and memory of processes, read from ``/proc`` (no psutil).

- CPU: ``utime + stime`` of a process plus ``cutime + cstime`` (its children
  that exited and were waited for, e.g. DataLoader workers after shutdown),
  plus the same of its live children. Seconds, resolution one clock tick.
- Memory: PSS (proportional set size) from ``/proc/<pid>/smaps_rollup``. A
  page shared by k processes counts 1/k in each, so the sum over processes
  counts it once. ``Pss_Shmem`` is the part that is shared memory (tmpfs:
  ``/dev/shm`` segments, torch worker buffers); shared memory nobody maps is
  in no PSS but in the ``/dev/shm`` usage, so node memory is
  ``sum(Pss - Pss_Shmem) + /dev/shm used``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")
SHM_DIR = "/dev/shm"


def shm_dirs() -> list[str]:
    """/dev/shm and the ring directory (``SHMLOADER_SHM_DIR``) when it is another filesystem."""
    out, seen = [], set()
    for d in (SHM_DIR, os.environ.get("SHMLOADER_SHM_DIR", "").strip()):
        try:
            dev = os.stat(d).st_dev if d else None
        except OSError:
            continue
        if dev is not None and dev not in seen:
            seen.add(dev)
            out.append(d)
    return out


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (field 3 is index 0)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2 :].split()


def children(pid: int) -> list[int]:
    """Live, non-zombie children of ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (DataLoader workers and anything they started)."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def cpu_seconds(pid: int, *, with_dead_children: bool = True) -> float:
    """User + system CPU seconds of ``pid`` (and of its waited-for dead children)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # utime, stime, cutime, cstime are fields 14-17 of stat (indices 11-14 here)
    ticks = int(fields[11]) + int(fields[12])
    if with_dead_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``, its dead children and its live descendants."""
    return cpu_seconds(pid) + sum(cpu_seconds(c) for c in descendants(pid))


@dataclass
class Memory:
    """Memory of a set of processes, bytes. ``pss`` includes ``pss_shmem``."""

    pss: int = 0
    pss_shmem: int = 0
    processes: int = 0

    def __add__(self, other: Memory) -> Memory:
        return Memory(
            self.pss + other.pss,
            self.pss_shmem + other.pss_shmem,
            self.processes + other.processes,
        )

    @property
    def private(self) -> int:
        """PSS that is not shared memory (anonymous and file pages)."""
        return self.pss - self.pss_shmem


def memory(pid: int) -> Memory:
    """PSS of one process from ``smaps_rollup`` (zero if it is gone)."""
    out = Memory(processes=1)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "Pss":
                    out.pss = int(rest.split()[0]) * 1024
                elif key == "Pss_Shmem":
                    out.pss_shmem = int(rest.split()[0]) * 1024
    except OSError:
        return Memory()
    return out


def tree_memory(pid: int) -> Memory:
    """PSS of ``pid`` and every live descendant."""
    total = memory(pid)
    for c in descendants(pid):
        total = total + memory(c)
    return total


def shm_used() -> int:
    """Bytes in use on ``/dev/shm`` and the ring directory (named and unlinked-but-open
    files alike)."""
    total = 0
    for d in shm_dirs():
        st = os.statvfs(d)
        total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


def shm_free() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def library() -> dict[str, object]:
    """Which shmloader was measured: its path, a hash of its sources, the git state.

    Outside a git checkout (a copy taken so that concurrent edits cannot
    change the library mid-run), ``SHMLOADER_BENCH_ORIGIN`` says where the
    copy came from.
    """
    import hashlib
    import subprocess

    import shmloader

    root = os.path.dirname(os.path.abspath(shmloader.__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    out: dict[str, object] = {"path": root, "sources_sha256": digest.hexdigest()[:16]}
    try:
        git = ["git", "-C", os.path.dirname(root)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "shmloader"], capture_output=True, text=True
        )
        if head.returncode == 0:
            out["git_head"] = head.stdout.strip()
            out["uncommitted_library_changes"] = bool(dirty.stdout.strip())
    except OSError:
        pass
    if "git_head" not in out and os.environ.get("SHMLOADER_BENCH_ORIGIN"):
        out["origin"] = os.environ["SHMLOADER_BENCH_ORIGIN"]  # e.g. a copy of a clean checkout
    return out


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    import numpy
    import torch

    st = os.statvfs(SHM_DIR)
    info = meminfo()
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": info.get("MemTotal", 0),
        "ram_available_bytes": info.get("MemAvailable", 0),
        "shm_bytes": st.f_blocks * st.f_frsize,
        "shm_free_bytes": st.f_bavail * st.f_frsize,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "loadavg_start": list(os.getloadavg()),
        "shmloader": library(),
    }

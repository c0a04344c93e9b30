"""What every results file records about the run that made it.

A figure is only worth what it says about how to get it again, so each
benchmark's results file opens with the same two lines (``crossnode``'s ends
with them, after its table)::

    Command: `python -m benchmarks.run --sizes 256 --sp 2 --out DIR` (153 s).
    Recorded: commit f9cf7fe, 2026-12-01 10:02 UTC; 2 cores (AMD EPYC), 23.5 GiB RAM,
    23.5 GiB /dev/shm, Linux 6.18.44; load average 0.81 / 1.92 / 2.51 (1 / 5 / 15 min)
    at the start, 6.59 / 3.75 / 3.09 at the end.

The command is the one as run: the module and every argument it was given
(``sys.argv``, or the list a caller passed to ``main``), so the flags that
chose the sizes, ways and SP are never lost. ``recorded_command`` reads it
back; the docs test compares it with the command each page cites.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import time
from typing import Any

from . import procstat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The line a results file records its command on; ``recorded_command`` reads it.
COMMAND = re.compile(r"^Command: `([^`]+)`", re.MULTILINE)


def command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module>`` and the arguments as run (``sys.argv[1:]`` when ``argv`` is None)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", "-m", module, *args])


def commit() -> str:
    """The checkout's short commit, and ``+ uncommitted changes to shmloader/`` (or
    ``benchmarks/``) where the library or the benchmarks differ from it; outside a git
    checkout ``SHMLOADER_BENCH_ORIGIN`` (where a copy came from) or ``unknown``."""
    git = ["git", "-C", REPO]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            [
                *git,
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "shmloader",
                "benchmarks",
            ],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return os.environ.get("SHMLOADER_BENCH_ORIGIN", "unknown")
    changed = sorted({line[3:].split("/")[0] for line in dirty.stdout.splitlines() if line[3:]})
    return head.stdout.strip() + "".join(f" + uncommitted changes to {d}/" for d in changed)


def machine() -> dict[str, Any]:
    """Cores, CPU, memory, kernel and ``/dev/shm`` of this machine (no torch import)."""
    st = os.statvfs(procstat.SHM_DIR)
    return {
        "cores": os.cpu_count(),
        "cpu_model": procstat.cpu_model(),
        "ram_bytes": procstat.meminfo().get("MemTotal", 0),
        "shm_bytes": st.f_blocks * st.f_frsize,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def start(module: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The record of a run that starts now: command, commit, date, machine, load."""
    return {
        "command": command(module, argv),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "loadavg_start": list(os.getloadavg()),
        "started": time.monotonic(),
    }


def finish(record: dict[str, Any]) -> dict[str, Any]:
    """The load at the end and the wall time, added to ``record`` (returned)."""
    record["loadavg_end"] = list(os.getloadavg())
    record["wall_s"] = time.monotonic() - record.pop("started", time.monotonic())
    return record


def _load(values: list[float] | None) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "not recorded"


def header(record: dict[str, Any]) -> list[str]:
    """The two Markdown lines a results file opens with (see the module's docstring)."""
    m = record["machine"]
    wall = f" ({record['wall_s']:.0f} s)" if "wall_s" in record else ""
    return [
        f"Command: `{record['command']}`{wall}.",
        "",
        f"Recorded: commit {record['commit']}, {record['date']}; {m['cores']} cores "
        f"({m['cpu_model']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"{m['shm_bytes'] / 2**30:.1f} GiB /dev/shm, Linux {m['kernel']}, Python {m['python']}; "
        f"load average {_load(record['loadavg_start'])} (1 / 5 / 15 min) at the start, "
        f"{_load(record.get('loadavg_end'))} at the end.",
    ]


def recorded_command(text: str) -> str | None:
    """The command a results file's ``Command:`` line records, or None."""
    m = COMMAND.search(text)
    return m.group(1) if m else None

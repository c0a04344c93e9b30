"""``shmloader demo``: what it measures, side by side, and its identity check."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _row(out: str, name: str) -> tuple[str, str]:
    m = re.search(rf"^  {re.escape(name)}\s+(\S+(?: \S+)?)\s{{2,}}(\S+(?: \S+)?)$", out, re.M)
    assert m, f"no row {name!r} in:\n{out}"
    return m.group(1), m.group(2)


def _value(cell: str) -> float:
    number, _, unit = cell.partition(" ")
    scale = {"": 1, "s": 1, "ms": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    return float(number) * scale[unit]


def test_the_demo_measures_processes_cpu_memory_and_first_batch_beside_unshared():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["--ranks", "2", "--sp", "2", "--steps", "3", "--seq-len", "1024"]
    args += ["--images", "2", "--image-size", "64", "--workers", "1", "--timeout", "100"]
    run = subprocess.run(
        [sys.executable, "-m", "shmloader", "demo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert out.rstrip().endswith("OK: every SP peer received identical batches"), out
    # counted from the ranks' live child processes, not from the arguments
    assert _row(out, "DataLoaders running") == ("1", "2"), out
    assert _row(out, "worker processes started") == ("1", "2"), out
    for name in ("CPU seconds, every process", "time to a usable batch"):
        shared, alone = (_value(c) for c in _row(out, name))
        assert shared > 0 and alone > 0, (name, out)
    # the unshared run loads every sample twice: its workers alone cost more CPU
    shared, alone = (_value(c) for c in _row(out, "CPU seconds, every process"))
    assert alone > shared, out
    shared, alone = (_value(c) for c in _row(out, "node memory of loading, peak"))
    assert 0 < shared < alone, out
    # the per-batch times say what they time, on which thread, and under what load
    assert re.search(
        r"^  follower receive, mean +\d+\.\d\d ms  per batch, on its loop's thread", out, re.M
    ), out
    assert "next() (ACK, map, fault every page in, decode)" in out, out
    assert re.search(
        r"^  leader publish, mean +\d+\.\d\d ms  per batch and SP group, ", out, re.M
    ), out
    load = re.search(
        r"^  load average \(1 min\) +\d+\.\d\d at the start, \d+\.\d\d at the end, (\d+) cores$",
        out,
        re.M,
    )
    assert load and int(load.group(1)) == os.cpu_count(), out

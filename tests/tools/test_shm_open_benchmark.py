"""Smoke test of ``python -m benchmarks.shm_open`` at a tiny size.

The benchmark runs end to end and writes well-formed JSON and Markdown (the
provenance lines, every table); no timing is asserted, and no fact either:
what each way guarantees is the benchmark's finding, recorded in
``benchmarks/results/shm_open/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import shm_open
from benchmarks.provenance import recorded_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("posix_ipc")  # the test extra installs it (./setup.sh)


def test_tiny_run_writes_json_and_markdown(tmp_path):
    out = tmp_path / "shm_open"
    args = ["--n", "20", "--mib", "1", "--trips", "20", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.shm_open", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("shm_open.json", "shm_open.md"):
        assert f"wrote {out / name}\n" in proc.stderr, proc.stderr[-4000:]

    result = json.loads((out / "shm_open.json").read_text())
    assert result["n"] == 20 and result["trips"] == 20
    got = {(r["op"], r["way"]) for r in result["rows"]}
    for op in shm_open.OPS:
        for way in ("posix_ipc", "open+ftruncate", "shmloader"):
            assert (op, way) in got, (op, way)
    for r in result["rows"]:
        assert r["mib"] == 1 and r["n"] >= 10
        assert 0 < r["p50_us"] <= r["p90_us"], r
    questions = [f["question"] for f in result["facts"]["facts"]]
    assert len(questions) == 9, questions
    for f in result["facts"]["facts"]:
        assert f["posix_ipc"] and f["shmloader"], f
    jobs = {(r["job"], r["way"]) for r in result["signalling"]}
    assert len(jobs) == 5 and all(r["n"] == 20 for r in result["signalling"])
    assert set(result["killed_holder"]) == {"fcntl.lockf", "posix_ipc.Semaphore"}

    md = (out / "shm_open.md").read_text()
    assert recorded_command(md) == "python -m benchmarks.shm_open " + " ".join(args)
    assert "\nRecorded: commit " in md
    assert "| operation | MiB | way | p50 us | p90 us | mean us | n |" in md
    assert "| question | posix_ipc | shmloader |" in md
    assert "| job | way | p50 us | p90 us | mean us | n |" in md
    assert md.count("\n| create | 1 | ") == 4

"""Smoke tests of the benchmark tools that ``test_benchmarks.py`` does not run.

``benchmarks.breakdown`` wraps library internals by name, so it rots silently
when one is renamed (it once failed with ``AttributeError``): it runs here
at a tiny size (``benchmarks.crossnode`` runs in ``test_bench_args.py``).
No timing is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "daemon")]))
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_breakdown_times_only_steps_that_exist() -> None:
    from benchmarks import breakdown

    assert breakdown.missing_targets() == []


#: A hang guard for one benchmark tool's run (under a minute on 2 quiet cores).
TOOL_GUARD_S = 840


@pytest.mark.slow  # a whole program end to end (README: selections)
@pytest.mark.timeout(TOOL_GUARD_S + 60)
def test_breakdown_runs_at_a_tiny_size(tmp_path) -> None:
    out = tmp_path / "bd"
    args = ["benchmarks.breakdown", "--sp", "2", "--size", "1", "--steps", "2", "--warmup", "1"]
    args += ["--warm-ranks"]  # no cold interpreters: the library's steps are timed the same
    proc = _run([*args, "--no-cache-effect", "--out", str(out)], TOOL_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "not timed" not in proc.stderr, proc.stderr[-2000:]
    # the workload's DataLoader has workers: they write the ring (zero-copy publish), so the
    # leader's main process shows _publish but no RingWriter.acquire / codec.write_payload
    assert "follower: codec.decode" in proc.stdout and "leader: _publish (all)" in proc.stdout
    assert (out / "breakdown_sp2_1mib.json").exists()


@pytest.mark.timeout(60)
def test_pagetables_times_each_step_of_a_view_in_each_directory(tmp_path) -> None:
    import json

    proc = _run(["benchmarks.pagetables", "--mib", "2", "--reps", "2", "--out", str(tmp_path)], 50)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "pagetables.json").read_text())
    done = {row["directory"]: row for row in result["rows"]}
    skipped = {s["directory"] for s in result["skipped"]}
    assert set(done) | skipped == {"/dev/shm", "huge-page tmpfs"} and "/dev/shm" in done
    for row in done.values():
        assert all(len(row[step]) == 2 for step in ("mmap", "populate", "munmap")), row
    # a standing mapping's recycle: where the ring keeps one (4 KiB pages)
    assert len(done["/dev/shm"]["recycle"]) == 2 and len(done["/dev/shm"]["recycle 1/64"]) == 2
    assert "| /dev/shm | 4 KiB |" in (tmp_path / "pagetables.md").read_text()

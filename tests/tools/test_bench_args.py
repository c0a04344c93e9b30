"""The benchmark entry points parse their arguments and never overwrite committed results."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import crossnode, hugedir, run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(60)
def test_crossnode_help_prints_usage_and_runs_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.crossnode", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0 and "--sizes" in proc.stdout and "--out" in proc.stdout
    assert "| batch MiB" not in proc.stdout  # the benchmark did not start
    args = crossnode.parse_args([])
    assert args.sizes == [16, 64, 256] and args.steps == 6 and args.out is None
    with pytest.raises(SystemExit):
        crossnode.parse_args(["--sizes", "0"])
    with pytest.raises(SystemExit):
        crossnode.parse_args(["--steps", "1"])


@pytest.mark.timeout(120)
def test_crossnode_small_run_writes_its_table(tmp_path) -> None:
    out = tmp_path / "crossnode.md"
    assert (
        crossnode.main(["--sizes", "1", "--steps", "2", "--node-shm", "64m", "--out", str(out)])
        == 0
    )
    lines = out.read_text().splitlines()
    assert lines[0].startswith("| batch MiB") and lines[2].startswith("| 1 | ")


def test_quick_benchmark_defaults_to_a_temporary_directory() -> None:
    quick = run.parse_args(["--quick"])
    assert os.path.isdir(quick.out)
    assert os.path.realpath(quick.out) != os.path.realpath(run.DEFAULT_OUT)
    os.rmdir(quick.out)
    assert run.parse_args(["--quick", "--out", "/x"]).out == "/x"
    assert run.parse_args([]).out == run.DEFAULT_OUT


def test_only_the_huge_page_way_runs_in_the_huge_page_ring() -> None:
    """The /dev/shm ways keep /dev/shm: a ring in the huge tmpfs made them measure
    huge pages (touching a 256 MiB batch 1.8 ms on "/dev/shm" instead of ~25 ms)."""
    args = run.parse_args(["--runs", "transport", "--sizes", "1", "--sp", "2"])
    cases = run.in_ring_dirs(run.plan(args), "/mnt/huge")
    dirs = {c.mode: c.shm_dir for c in cases}
    assert dirs["shmloader-huge"] == "/mnt/huge"
    assert all(d == "" for mode, d in dirs.items() if mode != "shmloader-huge"), dirs


def test_hugedir_touch_benchmark_defaults_and_refusals() -> None:
    args = hugedir.parse_args([])
    assert (args.mib, args.batches, args.paths) == (256.0, 8, ["main", "collate", "copy"])
    assert args.rings == ["huge", "shm"] and args.modes == ["quiet", "lockstep", "free"]
    assert os.path.isdir(args.out), "a run never writes into committed results by default"
    os.rmdir(args.out)
    for bad in (["--mib", "0"], ["--batches", "0"], ["--paths", "disk"]):
        with pytest.raises(SystemExit):
            hugedir.parse_args(bad)

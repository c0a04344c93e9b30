"""Smoke test of the step benchmark: ``python -m benchmarks.step --quick``.

The harness runs end to end and its outputs are well formed (JSON, the
Markdown table, the plot); no timing is asserted: the numbers are for
``benchmarks/README.md``, not for pass/fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import step

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = os.geteuid() == 0


@pytest.mark.slow  # a whole program end to end (README: selections)
@pytest.mark.timeout(300)
def test_quick_step_benchmark_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "step"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.startswith(
        f"benchmarks.step: 2 configurations x {len(step.MODES)} ways; results go to {out}\n"
    ), proc.stderr[:2000]
    for name in ("step.json", "step.md", "step.png"):
        assert f"wrote {out / name}\n" in proc.stderr, proc.stderr[-4000:]

    result = json.loads((out / "step.json").read_text())
    assert result["failed"] == [], result["failed"]
    assert result["compute"] == "sleep" and result["page"] == 64 << 10
    rows = result["rows"]
    ran = {(r["topology"], r["mode"], r["rank"]) for r in rows}
    skipped = {(s["config"], s["mode"]): s["reason"] for s in result["skipped"]}
    for topology in ("1node-sp2", "2nodes-sp2"):
        for mode in step.MODES:
            if (topology, mode, 0) in ran:
                assert (topology, mode, 1) in ran  # every rank of the group reports
            else:  # a way that did not run says why
                assert skipped.get((f"{topology} 4MiB", mode)), (topology, mode, skipped)
    for mode in ("base", "broadcast", "shmloader"):
        assert ("1node-sp2", mode, 1) in ran, mode
        if ROOT:  # two simulated nodes need root; otherwise skipped (above)
            assert ("2nodes-sp2", mode, 1) in ran, mode
    if not ROOT:
        assert "needs root" in skipped[("2nodes-sp2 4MiB", "base")]

    configs = {c["topology"]: c for c in result["configs"]}
    for c in configs.values():  # C covers twice the measured production and transfer
        cal = c["calibration"]
        need = 2 * (cal["produce_ms_p50"] + cal["transfer_ms_p50_slowest"])
        assert c["compute_ms"] >= max(20.0, need), c
    for row in rows:
        assert row["mib"] == 4.0 and row["sp"] == 2 and row["steps"] == 5
        assert row["compute_ms"] == configs[row["topology"]]["compute_ms"]
        assert 0 < row["next_ms_p50"] <= row["next_ms_p90"]
        assert row["above_ms_p50"] <= row["above_ms_p90"]
        assert row["role"] == ("leader" if row["rank"] == 0 else step.role(row["topology"], 1))
    for entry in result["raw"]:
        for r in entry["ranks"]:
            assert len(r["records"]) == 5
            for rec in r["records"]:  # a step is next + drop + read + compute + all_reduce
                parts = ("next_ms", "drop_ms", "read_ms", "compute_ms", "allreduce_ms")
                assert rec["step_ms"] >= sum(rec[k] for k in parts) - 1e-3
    if ROOT:
        # the two-node shmloader run really crossed nodes: node 1's rank received it
        (two,) = [
            e
            for e in result["raw"]
            if e["config"] == "2nodes-sp2 4MiB" and e["mode"] == "shmloader"
        ]
        stats = two["ranks"][1]["loader_stats"]
        assert stats["role"] == "node leader" and stats["bytes_received"] > 0, stats
        huge = [e for e in result["raw"] if e["mode"] == "shmloader-huge"]
        for entry in huge:  # every rank names one path; each node sees its own directory
            rings = [r["ring"] for r in entry["ranks"]]
            assert len({ring["dir"] for ring in rings}) == 1 and all(g["huge"] for g in rings)
            inodes = {ring["ino"] for ring in rings}
            assert len(inodes) == (2 if entry["config"].startswith("2nodes") else 1), rings

    mount = re.search(r" at (/\S+): ", result["huge_ring"])
    if mount:  # the huge-page tmpfs's mount point is gone with the run (shared /tmp)
        assert not os.path.exists(mount.group(1)), mount.group(1)

    md = (out / "step.md").read_text()
    assert md.startswith("# shmloader step benchmark")
    table = [line for line in md.splitlines() if line.startswith(("| 1node-sp2 | 4 |", "| 2nodes"))]
    assert len([t for t in table if t.count("|") == 15]) == len(rows)  # 14 columns
    assert "## Targets (worst rank" in md
    data = (out / "step.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_step_arguments_quick_and_full_plans(tmp_path):
    quick = step.parse_args(["--quick", "--out", str(tmp_path)])
    assert quick.topologies == ["1node-sp2", "2nodes-sp2"] and quick.sizes == [4.0]
    assert quick.steps == 5 and quick.modes == list(step.MODES)
    full = step.parse_args(["--out", str(tmp_path)])
    assert [(c.topology, c.mib) for c in step.plan(full)][:3] == [
        ("1node-sp2", 16.0),
        ("1node-sp2", 64.0),
        ("1node-sp2", 256.0),
    ]
    assert len(step.plan(full)) == 15 and full.compute == "sleep"
    for bad in (["--steps", "0"], ["--sizes", "0"], ["--compute-ms", "-1"]):
        with pytest.raises(SystemExit):
            step.parse_args([*bad, "--out", str(tmp_path)])


def test_compute_is_twice_production_plus_the_slowest_transfer():
    args = step.parse_args(["--out", "/nonexistent-never-written"])
    cal = [
        {"produce_ms": [10.0, 12.0, 11.0], "transfer_ms": [30.0, 31.0, 29.0]},
        {"produce_ms": [], "transfer_ms": [40.0, 44.0, 42.0]},
    ]
    c, how = step.compute_for(cal, args)
    assert how == {"produce_ms_p50": 11.0, "transfer_ms_p50_slowest": 42.0}
    assert c == 110.0  # 2 x (11 + 42) = 106, rounded up to 10 ms
    small = [{"produce_ms": [0.1], "transfer_ms": [0.2]}]
    assert step.compute_for(small, args)[0] == 20.0  # --min-compute-ms


def test_roles_and_targets():
    assert [step.role("2nodes-sp4", r) for r in range(4)] == [
        "leader",
        "follower",
        "node leader",
        "follower",
    ]
    assert step.role("1node-sp2", 1) == "follower"

    def row(topology, mode, rank, next_ms, read_ms=0.3):
        return {
            "topology": topology,
            "mib": 16.0,
            "mode": mode,
            "rank": rank,
            "next_ms_p50": next_ms,
            "next_read_ms_p50": next_ms + read_ms,
        }

    rows = [
        row("1node-sp2", "base", 0, 8.0),
        row("1node-sp2", "base", 1, 9.0),
        row("1node-sp2", "shmloader", 0, 0.5),
        row("1node-sp2", "shmloader", 1, 0.9, read_ms=0.05),
        row("2nodes-sp2", "shmloader", 0, 0.6),
        row("2nodes-sp2", "shmloader", 1, 1.2),
    ]
    verdicts = {(t["target"], t["where"]): t["verdict"] for t in step.targets(rows)}
    assert verdicts == {
        ("shmloader next() p50 <= 1 ms on every rank", "1node-sp2, 16 MiB"): "met",
        ("shmloader next() p50 <= base's", "1node-sp2, 16 MiB"): "met",
        ("shmloader next() p50 <= 1 ms on every rank", "2nodes-sp2, 16 MiB"): "MISSED",
        # the worst rank's next() with its read: 0.9 + 0.05 and 1.2 + 0.3
        ("shmloader next()+read p50 <= 1 ms on every rank", "1node-sp2, 16 MiB"): "met",
        ("shmloader next()+read p50 <= 1 ms on every rank", "2nodes-sp2, 16 MiB"): "MISSED",
        (
            "shmloader next() p50 over two nodes <= 1.1x one node (SP2)",
            "2nodes-sp2, 16 MiB",
        ): "MISSED",  # 1.2 > 1.1 x 0.9 (worst rank against worst rank)
    }


@pytest.mark.timeout(60)
def test_step_help_runs_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0 and "--compute" in proc.stdout and "--quick" in proc.stdout
    assert "configurations" not in proc.stderr


def test_without_root_two_nodes_and_the_huge_ring_are_skipped_with_the_reason(monkeypatch):
    """No launch at all: the two-node configuration is skipped before calibrating."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(step, "launch", lambda *a, **k: pytest.fail("launched ranks"))
    args = step.parse_args(["--quick", "--out", "/nonexistent-never-written"])
    result = {"skipped": [], "failed": [], "configs": [], "rows": [], "raw": []}
    huge = {"dir": None, "why": "needs root (a tmpfs mounted in a private mount namespace)"}
    step.run_config(step.Config("2nodes-sp2", 4.0), args, huge, result)
    assert [s["mode"] for s in result["skipped"]] == list(step.MODES)
    assert all("needs root" in s["reason"] for s in result["skipped"])
    one = step.Config("1node-sp2", 4.0)
    assert step.skip_reason(one, "shmloader-huge", args, huge) == huge["why"]
    assert step.skip_reason(one, "shmloader", args, huge) is None  # 4 MiB fits anywhere

"""Smoke test of the benchmark harness: ``python -m benchmarks.run --quick``.

Checks that the harness runs end to end and writes well-formed results. It
asserts no timings: CI machines are too noisy for that, and the numbers are
for ``benchmarks/README.md``, not for pass/fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import report, workload
from benchmarks.transports import join, split

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: A hang guard for the whole ``--quick`` run (about 20 s on 2 quiet cores,
#: several on a loaded machine; each configuration has its own 120 s guard).
QUICK_GUARD_S = 840


@pytest.mark.slow  # a whole program end to end (README: selections)
@pytest.mark.timeout(QUICK_GUARD_S + 60)
def test_quick_benchmark_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=QUICK_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # where it writes, said first and with every file at the end; a line per configuration
    assert proc.stderr.startswith(f"benchmarks.run: 12 configurations; results go to {out}\n")
    for name in ("results.json", "results.md", "delivery.png", "e2e.png"):
        assert f"wrote {out / name}\n" in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("] transport sp2 ") == 8, proc.stderr[-4000:]

    result = json.loads((out / "results.json").read_text())
    assert result["failed"] == []
    rows = result["rows"]
    seen = {(r["run"], r["mode"], r["target_mib"]) for r in rows}
    for mode in ("base", "broadcast", "shmloader"):
        for mib in (1.0, 16.0):
            assert ("transport", mode, mib) in seen, (mode, mib)
    assert ("transport", "objlist", 1.0) in seen and ("transport", "shmloader-1copy", 16.0) in seen
    for mode in ("base", "shmloader"):
        assert any(r["run"] == "realistic" and r["mode"] == mode for r in rows), mode
    # equal CPU budget: as many worker processes on the node either way
    budget = {r["mode"]: r for r in rows if r["run"] == "budget"}
    assert budget["shmloader"]["workers"] == 2 * budget["base"]["workers"]
    assert budget["shmloader"]["steps_per_s"] > 0 and budget["base"]["steps_per_s"] > 0
    for row in rows:
        assert row["sp"] == 2
        assert row["cpu_s"] > 0
        assert row["node_mem_mib"] is not None and row["node_mem_mib"] > 0
        assert all(code == 0 for code in row["exit_codes"]), row["exit_codes"]
        if row["run"] == "transport":
            assert row["follower_n"] > 0
            assert row["follower_ms_p50"] > 0
            assert row["steps_per_s"] > 0
            if row["mode"] != "base":
                assert row["e2e_ms_p50"] > 0
            if row["mode"] == "shmloader":
                assert row["publish_ms_p50"] > 0 and row["memcpy_cold_ms"] > 0
            assert row["build_ms_p50"] > 0  # the loading worker's write, every way
    assert result["machine"]["cores"] >= 1
    assert len(result["machine"]["loadavg_start"]) == 3
    verdicts = {t["verdict"] for t in result["targets"]}
    assert verdicts <= {"met", "MISSED", "-"}, result["targets"]  # only what it measured
    assert any("16 MiB" in t["target"] for t in result["targets"]), result["targets"]

    md = (out / "results.md").read_text()
    assert md.startswith("# shmloader benchmark results")
    assert "## Targets" in md and "| 2 | shmloader |" in md
    table = [line for line in md.splitlines() if line.startswith("| 2 | ")]
    assert len(table) == len(rows)
    for png in ("delivery.png", "e2e.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, png


def test_batch_spec_hits_the_requested_size():
    for mib in (1, 16, 64, 256, 1024):
        spec = workload.BatchSpec.for_bytes(mib * workload.MiB)
        assert 0.9 * mib * workload.MiB <= spec.nbytes <= mib * workload.MiB
        assert 32_768 <= spec.tokens <= 524_288


def test_templated_batch_is_shaped_like_the_spec_with_an_alias():
    spec = workload.BatchSpec.for_bytes(workload.MiB)
    batch = workload.build(workload.TemplatedBatches(spec, 1)[0])
    assert batch["labels"] is batch["input_ids"]
    assert batch["build_ms"] > 0
    assert workload.payload_bytes(batch) == spec.nbytes
    assert len(batch["meta"]) == workload.SAMPLES
    assert batch["pixel_values"].shape == (spec.image_patches, workload.PATCH_DIM)


def test_realistic_batch_packs_samples():
    spec = workload.BatchSpec.for_bytes(workload.MiB)
    ds = workload.RealisticSamples(spec, 1, decode_scale=1)
    batch = workload.pack([ds[i] for i in range(workload.SAMPLES)])
    assert batch["labels"] is batch["input_ids"]
    assert batch["input_ids"].shape == (1, spec.tokens)
    assert batch["pixel_values"].shape == (spec.image_patches, workload.PATCH_DIM)
    assert int(batch["cu_seqlens"][-1]) == spec.tokens


def test_broadcast_skeleton_round_trip_keeps_aliases():
    spec = workload.BatchSpec.for_bytes(workload.MiB)
    batch = workload.TemplatedBatches(spec, 1).batch(0)
    skeleton, found = split(batch)
    assert len(found) == len(workload.tensors(batch)) == 7
    back = join(skeleton, found)
    assert back["labels"] is back["input_ids"]
    assert back["meta"] == batch["meta"]


def test_targets_list_only_what_was_measured():
    assert report.targets([]) == []
    assert {t["verdict"] for t in report.all_targets([])} <= {"not measured", "-"}


def _row(run: str, mode: str, sp: int, **fields) -> dict:
    return {"run": run, "mode": mode, "sp": sp, "target_mib": 4.0, **fields}


@pytest.mark.parametrize(
    "sp, ratio, verdict",
    [(2, 0.6, "met"), (2, 0.75, "MISSED"), (4, 0.34, "met"), (4, 0.4, "MISSED")],
)
def test_the_cpu_target_is_reachable_at_every_sp(sp, ratio, verdict):
    """1/SP is the floor (one loading rank instead of SP): the target is 1.4/SP."""
    rows = [
        _row("realistic", "base", sp, cpu_s=10.0),
        _row("realistic", "shmloader", sp, cpu_s=10.0 * ratio),
    ]
    (cpu,) = [t for t in report.targets(rows) if t["target"].startswith("summed CPU")]
    assert cpu["verdict"] == verdict, cpu
    assert f"<= {1.4 / sp:.2f}x" in cpu["target"] and f"1/SP = {1 / sp:.2f}" in cpu["measured"]
    assert report.cpu_target(sp) > 1 / sp


def test_quick_keeps_one_configuration_per_question():
    from benchmarks import run

    quick = run.plan(run.parse_args(["--quick"]))
    assert len(quick) == 12, [c.label for c in quick]
    full = run.plan(run.parse_args([]))
    assert {c.mode for c in quick} == {c.mode for c in full} - {"shmloader-huge"}
    assert {c.run for c in quick} == {c.run for c in full}


# --------------------------------------------- what a results file records of its run


def _quiet_env(monkeypatch) -> None:
    """The variables the benchmarks' mains set for their ranks, put back after the test."""
    for name in ("OMP_NUM_THREADS", "SHMLOADER_AHEAD", "SHMLOADER_QUIET"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))


def test_the_command_is_the_module_and_every_argument_as_run(monkeypatch):
    from benchmarks import provenance

    assert provenance.command("benchmarks.run", ["--sp", "2", "4", "--out", "a b"]) == (
        "python -m benchmarks.run --sp 2 4 --out 'a b'"
    )
    monkeypatch.setattr(sys, "argv", ["benchmarks/step.py", "--sizes", "16", "--quick"])
    assert provenance.command("benchmarks.step") == "python -m benchmarks.step --sizes 16 --quick"
    record = provenance.finish(provenance.start("benchmarks.step", ["--quick"]))
    text = "\n".join(provenance.header(record))
    assert provenance.recorded_command(text) == "python -m benchmarks.step --quick"
    for word in ("Recorded: commit ", " UTC; ", " cores (", "GiB RAM", "GiB /dev/shm", "Linux "):
        assert word in text, text
    assert "at the start" in text and "at the end" in text, text  # the load, both ends


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tool", ["run", "step", "balance", "hugedir", "crossnode"])
def test_every_results_file_records_the_command_with_its_flags(tool, tmp_path, monkeypatch):
    """Each writer, run with flags that change what it measures (nothing launched: the
    plan is empty or the ranks are stood in for), records them all in its file."""
    import tests.support.harness as harness
    from benchmarks import balance, crossnode, hugedir, provenance, run, step

    _quiet_env(monkeypatch)
    out = tmp_path / tool
    if tool == "run":
        monkeypatch.setattr(run, "plan", lambda args: [])
        argv = ["--sp", "2", "8", "--sizes", "256", "--runs", "transport", "--out", str(out)]
        run.main(argv)
        written = out / "results.md"
    elif tool == "step":
        monkeypatch.setattr(step, "plan", lambda args: [])
        argv = ["--modes", "base", "shmloader", "--sizes", "16", "--out", str(out)]
        step.main(argv)
        written = out / "step.md"
    elif tool == "balance":
        argv = ["--samples", "400", "--dp", "2", "--windows", "1", "--out", str(out)]
        balance.main(argv)
        written = out / "balance.md"
    elif tool == "hugedir":

        def no_ranks(*args, **kwargs):
            raise harness.RankFailure("stood in: no ranks")

        monkeypatch.setattr(harness, "run_ranks", no_ranks)
        argv = ["--rings", "shm", "--modes", "quiet", "--paths", "main", "--out", str(out)]
        hugedir.main(argv)
        written = out / "hugedir.md"
    else:
        stats = {"cross_node_bytes_sent": 1 << 20, "published": 1}
        monkeypatch.setattr(
            harness, "run_ranks", lambda *a, **k: [{"shm": 1e-3, "plain": 2e-3, "stats": stats}]
        )
        written = tmp_path / "crossnode.md"
        argv = ["--sizes", "16", "--steps", "3", "--out", str(written)]
        crossnode.main(argv)
    text = written.read_text()
    assert provenance.recorded_command(text) == provenance.command(f"benchmarks.{tool}", argv)
    assert "\nRecorded: commit " in text and "load average" in text, text[:600]

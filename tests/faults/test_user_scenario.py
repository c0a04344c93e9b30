"""A user's training script, end to end under a real torchrun.

Three ranks share one group's batches (SHMLOADER=1). Every rank iterates its
ShmLoader (a DataLoader with two persistent workers) from a background
prefetch thread, keeps every batch's ``labels`` for an epoch-level metric, and
one rank raises in the middle of epoch 2, so that torchrun's elastic agent
sends SIGTERM to the others. The job must end (no hang), the ring must not
have grown past its depth although labels were kept (small leaves are owned
copies, NOTE [small leaves] in ``_roles.base``), and nothing of the job may be
left: no segment in /dev/shm, nothing in the runtime directory, no process.
The helper script is tests/support/user_scenario.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from shmloader._node.segment import list_segments, proc_start_time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "user_scenario.py")
#: The prefetch queue (2) and the thread's batch waiting to be put are kept
#: batches the user asked for: the ring's depth must cover them, the labels not.
SLOTS = 4
#: The job must end (7-8 s on 2 quiet cores): a hang guard, far below the
#: 30 min SHMLOADER_TIMEOUT (the process group's, torchrun's default) that a
#: hung rank would wait, and within the test's own timeout.
JOB_LIMIT_S = 150

pytestmark = pytest.mark.timeout(200)


def _alive(pid: int) -> bool:
    return proc_start_time(pid) is not None


def _kill_listed(path: str) -> None:
    """SIGKILL the ranks and workers a hung job listed (never leave them running)."""
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(line), signal.SIGKILL)


@pytest.mark.parametrize("fail_rank", [2, 0], ids=["follower-fails", "leader-fails"])
def test_prefetch_thread_persistent_workers_kept_labels_and_sigterm_leave_nothing(
    no_leaks: str, fail_rank: int
):
    runtime = no_leaks  # this test's private SHMLOADER_RUNTIME_DIR
    with tempfile.TemporaryDirectory() as out:
        env = {
            **os.environ,
            "SHMLOADER": "1",
            "SHMLOADER_SLOTS": str(SLOTS),
            "SHMLOADER_JOB": f"user-scenario-{os.getpid()}",
            "SHMLOADER_RUNTIME_DIR": runtime,
            "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "daemon")]),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("SHMLOADER_DAEMON", None)  # no daemon: the job alone must clean up
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "3", SCRIPT, "--out", out, "--fail-rank", str(fail_rank)]
        began = time.monotonic()
        # its own session: a hung job is killed whole, not leaving orphaned ranks behind
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=JOB_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            # torchrun starts each rank in its own session; they hold the pipes open
            _kill_listed(os.path.join(out, "pids"))
            stdout, stderr = proc.communicate(timeout=10)
            pytest.fail(f"the job hung for {JOB_LIMIT_S} s:\n{stdout[-3000:]}{stderr[-6000:]}")
        took = time.monotonic() - began
        logs = stdout[-4000:] + stderr[-6000:]
        reports = []
        for rank in range(3):
            path = os.path.join(out, f"rank{rank}.json")
            assert os.path.exists(path), f"rank {rank} did not finish epoch 1:\n{logs}"
            with open(path) as f:
                reports.append(json.load(f))
        with open(os.path.join(out, "pids")) as f:
            pids = [int(line) for line in f if line.strip()]

    # The job failed (one rank raised) and ended well within the limit: no hang.
    assert proc.returncode != 0, logs
    assert "fails in the middle of epoch 2 (as planned)" in stderr, logs
    assert took < JOB_LIMIT_S, logs
    assert "(SIGTERM)" in stderr, f"torchrun stopped no rank with SIGTERM:\n{logs}"

    # Every rank received the whole first epoch and kept its labels.
    for r in reports:
        assert r["labels"] == list(range(48)), (r["rank"], logs)

    # The ring stayed within its depth although every batch's labels were kept.
    # (Its slots are the DataLoader workers' pool, sized once for the workers'
    # prefetch and the ranks' depth: kept views would pin them all and stall
    # the workers, or grow the ring, and the writer would name them.)
    leader = next(r for r in reports if r["stats"]["role"] == "leader")
    first, last = leader["first_stats"], leader["stats"]
    assert last["ring_slots"] == first["ring_slots"], (first, last, logs)
    assert "past its depth" not in stderr, logs

    # Nothing of the job is left: segments, runtime directory, processes.
    assert len(pids) >= 3 + 2, f"expected 3 ranks and the leader's 2 workers: {pids}"
    tokens = {t for r in reports for t in r["tokens"]}
    assert tokens, f"the leader owned no segment: was sharing on?\n{logs}"
    deadline = time.monotonic() + 30.0  # a guard: what is left is left for good
    while True:
        left = [n for n in list_segments() if any(n.startswith(f"/shml-{t}-") for t in tokens)]
        in_runtime = sorted(os.listdir(runtime))
        running = [p for p in pids if _alive(p)]
        if not (left or in_runtime or running) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"segments of the job left in /dev/shm: {left}\n{logs}"
    assert not in_runtime, f"left in the runtime directory {runtime}: {in_runtime}\n{logs}"
    assert not running, f"processes of the job still running: {running}\n{logs}"

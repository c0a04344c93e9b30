"""examples/train_sp.py, run briefly on CPU through torchrun as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_sp.py")


def _run(share: bool, log: str, *extra: str) -> list[dict]:
    env = {**os.environ, "SHMLOADER": "1" if share else "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [SCRIPT, "--sp", "2", "--samples", "24", "--workers", "1", "--losses", log, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(log) as f:
        lines = [json.loads(line) for line in f]
    os.unlink(log)
    return lines


@pytest.mark.slow  # a whole program end to end (README: selections)
@pytest.mark.timeout(400)
def test_train_sp_losses_equal_shared_unshared_and_across_a_resume():
    with tempfile.TemporaryDirectory() as tmp:
        log, ckpt = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "ckpt")
        alone = _run(False, log)
        shared = _run(True, log)
        # preempted after 7 micro-batches: 3 optimizer steps and half of the 4th
        first = _run(True, log, "--ckpt", ckpt, "--exit-after", "7")
        second = _run(True, log, "--ckpt", ckpt, "--resume")
    assert [r["step"] for r in alone] == list(range(1, 7))
    assert shared == alone, "sharing changed the losses"
    assert [r["step"] for r in first] == [1, 2, 3]
    assert first + second == alone, "the resumed run diverged from the uninterrupted one"

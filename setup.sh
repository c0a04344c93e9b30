#!/usr/bin/env bash
# Create .venv with everything shmloader, its tests, benchmarks and documentation need.
# Torch goes first, pinned to the CPU build these machines carry on disk: a
# bare "torch" requirement with no torch installed would pull a multi-GB CUDA
# build. The package itself only asks for a range that admits it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,docs]"
# torchtitan for tests/multirank/test_torchtitan.py, without its dependencies:
# torchtitan 0.3.0 requires wandb, tensorboard, datasets, spmd_types, torch_checkpointing
# and more, none of which its dataloader and checkpoint modules (all that
# shmloader.integrations.torchtitan and the test import) need. Those import
# torchdata and tyro only, which the test extra installs.
.venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0"

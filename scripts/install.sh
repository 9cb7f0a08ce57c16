#!/usr/bin/env bash
# Create .venv and install fedllm for CPU (torch pinned to the CPU wheel; GPU users: see README).
# bitsandbytes and DeepSpeed (the "gpu" extra) come too: both run their tested paths on CPU (4/8-bit
# QLoRA rounds, a one-process ZeRO-2/3 engine); DS_BUILD_OPS=0: no CUDA kernels at install. Flower (the
# "flower" extra, with Ray) runs the cross-silo app and its tests; scikit-learn ("reproduce") brings the
# digits that `fedllm reproduce perfedavg-digits` runs on.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev,track,gpu,flower,reproduce]"

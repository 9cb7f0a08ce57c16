#!/usr/bin/env bash
# Short check of the GPU-only paths on a CUDA machine (about 5-10 minutes):
# bitsandbytes 4/8-bit QLoRA rounds on CUDA, bf16 from the single-GPU accelerate config,
# 2-GPU client- and data-parallel launches, DeepSpeed ZeRO-2/3 through the shipped configs,
# then the scaling benchmark. Multi-GPU parts skip with fewer than 2 GPUs.
#
#   bash scripts/gpu_check.sh            # uses .venv (installs it with the GPU extras if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/fedllm ] || bash scripts/install.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible: this script checks the GPU paths"
print("torch", torch.__version__, "| GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
python -m pytest -q -rs -m gpu tests/test_gpu.py
n=$(python -c "import torch; print(min(torch.cuda.device_count(), 8))")
python scripts/bench_scaling.py --rounds 2 --local-steps 40 --processes $(seq 1 "$n" | awk '$1==1||$1==2||$1==4||$1==8')

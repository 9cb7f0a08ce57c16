#!/usr/bin/env bash
# The GPU paths in one prepared run of at most 10 minutes, ending with one JSON object (its last line):
#   gpu_tests     bitsandbytes 4/8-bit QLoRA rounds, bf16, 2-GPU client- and data-parallel equivalence
#                 (skipped with fewer than 2 GPUs), DeepSpeed ZeRO-2/3 through the shipped configs
#                 (pytest -m gpu tests/test_gpu.py)
#   real_shapes   a TinyLlama-shaped round at real size (scripts/bench_real_shapes.py)
#   client_batch  client-batched training, K = 1, 2, 4, 8 (scripts/bench_client_batch.py)
#   mmlu          MMLU scoring throughput against one forward per choice (scripts/bench_mmlu.py)
# Each part has its own time limit; peak memory is in each benchmark's JSON. Without a GPU the parts that
# need one are reported as such ("needs a GPU") and the others run on the CPU.
#
# It installs nothing from a package index. On the lent GPU machine (no index; its own python3 3.12 with
# torch, transformers, peft, accelerate) run `python scripts/gpu_prepare.py` here first: it puts the wheels
# the check needs that the machine lacks into .whl/ (ignored; carried with the call: carry [".whl"]), and
# the check installs them offline into /tmp/fedllm-site and runs with the machine's own torch:
#
#   bash scripts/gpu_check.sh                     # .whl/ there: python3 + the wheels; else .venv
#   FEDLLM_GPU_PYTHON=python3.12 bash scripts/gpu_check.sh --install-only   # rehearse the install step
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  PY=${FEDLLM_GPU_PYTHON:-python3}
  site=${FEDLLM_GPU_SITE:-/tmp/fedllm-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site for $("$PY" --version)"
elif [ -x .venv/bin/python ]; then
  PY=${FEDLLM_GPU_PYTHON:-.venv/bin/python}
else
  echo "gpu_check: no .whl/ and no .venv: run 'python scripts/gpu_prepare.py' on a machine that reaches the" \
    "package index (or 'bash scripts/install.sh' where this one does)" >&2
  exit 1
fi
[ "${1:-}" = "--install-only" ] && exit 0
"$PY" - <<'PY'
import json, subprocess, sys, time

import torch

gpu = torch.cuda.is_available()
gpus = torch.cuda.device_count()
layers = "22" if gpu else "1"
parts = [  # name, command, needs a GPU, seconds allowed (570 s in all: the run stays under 10 minutes)
    ("gpu_tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/test_gpu.py"], True, 240),
    ("real_shapes", [sys.executable, "scripts/bench_real_shapes.py", "--layers", layers, "--clients", "2",
                     "--steps", "2", "--seq-len", "256" if gpu else "64"], False, 120),
    ("client_batch", [sys.executable, "scripts/bench_client_batch.py", "--local-steps", "10", "--tiny-steps", "2"]
     + (["--clients", "8", "--layers", "2"] if gpu else ["--clients", "4", "--ks", "1", "4", "--skip-tinyllama"]),
     False, 120 if gpu else 240),  # a CPU takes 70-120 s for it (no gpu_tests there: their 240 s are free)
    ("mmlu", [sys.executable, "scripts/bench_mmlu.py", "--per-subject", "20" if gpu else "8", "--subjects", "2",
              "--shots", "5" if gpu else "1"], False, 90),
]
out = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "gpus": gpus, "torch": torch.__version__,
       "parts": {}}
for name, cmd, needs_gpu, limit in parts:
    if needs_gpu and not gpu:
        out["parts"][name] = {"status": "needs a GPU: not run"}
        print(f"{name}: needs a GPU, not run", flush=True)
        continue
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        lines = (res.stdout or "").strip().splitlines()
        entry = {"status": "ok" if res.returncode == 0 else f"failed (exit {res.returncode})"}
        try:
            entry["result"] = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else lines[-1:]
        except json.JSONDecodeError:
            entry["result"] = lines[-1:]
        if res.returncode != 0:
            entry["error"] = (res.stderr or res.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        entry = {"status": f"timed out after {limit} s"}
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    out["parts"][name] = entry
    print(f"{name}: {entry['status']} in {entry['seconds']} s", flush=True)
print(json.dumps(out))
PY

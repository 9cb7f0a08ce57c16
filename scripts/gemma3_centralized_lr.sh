#!/usr/bin/env bash
# The follow-up check of docs/which-method.md ("A follow-up check on centralized"): Gemma 3's centralized
# reference at a quarter of the table's learning rate, seeds 0-2. Not a row of the table: its own folder.
# Run it from a checkout of the table's commit (80087a8), like scripts/which_method_gemma3.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gemma3_centralized_lr}
exec fedllm compare --config configs/compare_sharegpt_gemma3.yaml --seeds 3 --output-dir "$OUT" \
  --variant centralized_lr4:federation.num_clients=1,federation.clients_per_round=1,client.local_steps=24,lora.ranks=[64],eval.personalized=false,client.lr=0.000125

#!/usr/bin/env bash
# Gemma 3's rows of docs/which-method.md (8 rows x 3 seeds; FedSVD added after SmolLM2's table, before Gemma's
# first run: see there), after SmolLM2's table: resumes from OUT (default runs/which_method_gemma3): finished
# runs of the same code are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/which_method_gemma3}
exec fedllm compare --config configs/compare_sharegpt_gemma3.yaml --seeds 3 --output-dir "$OUT" \
  --variant fedit:aggregation.name=fedit --variant flora:aggregation.name=flora \
  --variant flexlora:aggregation.name=flexlora --variant florist:aggregation.name=florist \
  --variant floral:aggregation.name=floral,aggregation.floral.num_adaptors=4,lora.ranks=[8] \
  --variant local:aggregation.name=local,aggregation.local.score=own \
  --variant centralized:federation.num_clients=1,federation.clients_per_round=1,client.local_steps=24,lora.ranks=[64],eval.personalized=false \
  --variant fedsvd:aggregation.name=fedsvd \
  --reference local --reference centralized

#!/usr/bin/env bash
# The comparison of docs/which-method.md (SmolLM2 on ShareGPT, 12 rows x 5 seeds, about 7 hours on 2 cores):
# resumes from OUT (default runs/which_method_smollm2): finished runs of the same code are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/which_method_smollm2}
exec fedllm compare --config configs/compare_sharegpt_smollm2.yaml --seeds 5 --output-dir "$OUT" \
  --variant fedit:aggregation.name=fedit --variant flora:aggregation.name=flora \
  --variant flexlora:aggregation.name=flexlora --variant florist:aggregation.name=florist \
  --variant fedex:aggregation.name=fedex --variant hetlora:aggregation.name=hetlora \
  --variant fedsvd:aggregation.name=fedsvd --variant rolora:aggregation.name=rolora \
  --variant floral:aggregation.name=floral,aggregation.floral.num_adaptors=4,lora.ranks=[8] \
  --variant local:aggregation.name=local,aggregation.local.score=own \
  --variant centralized:federation.num_clients=1,federation.clients_per_round=1,client.local_steps=24,lora.ranks=[64],eval.personalized=false \
  --variant flexlora_clip2:aggregation.name=flexlora,aggregation.clip_norm_ratio=2 \
  --reference local --reference centralized --reference flexlora_clip2

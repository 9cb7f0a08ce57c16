#!/usr/bin/env bash
# The tuned comparison of docs/which-method.md (SmolLM2 on ShareGPT): every row at its own learning rate,
# chosen on the validation split, then the table over seeds 0-9. Both stages resume from OUT (default
# runs/which_method_tuned_smollm2): finished runs of the same code are reused.
#   bash scripts/which_method_tuned.sh OUT tune     # every row's grid on tuning seeds 1000, 1001 (halving)
#   bash scripts/which_method_tuned.sh OUT table    # the table: the primary rows, the candidates the
#                                                   # "close to the best" rule admits, the references
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/which_method_tuned_smollm2}
STAGE=${2:-tune}
COMMON=(--config configs/compare_sharegpt_smollm2.yaml --output-dir "$OUT"
  --tune client.lr=2.5e-4,5e-4,1e-3,2e-3 --tune floral:aggregation.floral.router_lr=0.1,1
  --tune-seeds 1000,1001 --tune-halving --tune-extend 1
  --reference local --reference centralized --references-apart
  data.validation_size=64 eval.generate_size=0 eval.benchmark=none)
PRIMARY=(--variant fedit:aggregation.name=fedit --variant flora:aggregation.name=flora
  --variant flexlora:aggregation.name=flexlora --variant florist:aggregation.name=florist
  --variant floral:aggregation.name=floral,aggregation.floral.num_adaptors=4,lora.ranks=[8],aggregation.floral.router_optimizer=sgd
  --variant fedsvd:aggregation.name=fedsvd)
REFERENCES=(--variant local:aggregation.name=local,aggregation.local.score=own
  --variant centralized:federation.num_clients=1,federation.clients_per_round=1,client.local_steps=24,lora.ranks=[64],eval.personalized=false)
declare -A CANDIDATE=([fedex]=aggregation.name=fedex [hetlora]=aggregation.name=hetlora [rolora]=aggregation.name=rolora)
if [ "$STAGE" = tune ]; then
  exec fedllm compare "${COMMON[@]}" --tune-only "${PRIMARY[@]}" \
    $(for c in fedex hetlora rolora; do echo --variant "$c:${CANDIDATE[$c]}"; done) "${REFERENCES[@]}"
fi
[ "$STAGE" = table ] || { echo "stage: tune or table, not $STAGE" >&2; exit 2; }
JOIN=$(python scripts/tuning_choice.py "$OUT" --baseline fedit --candidates fedex hetlora rolora \
  --references local centralized --close 0.02 | tail -n 1 |
  python -c 'import json, sys; print(" ".join(n for n, j in json.load(sys.stdin)["joins"].items() if j))')
echo "candidates within 0.02 of the best: ${JOIN:-none}" >&2
exec fedllm compare "${COMMON[@]}" --seeds 10 "${PRIMARY[@]}" \
  $(for c in $JOIN; do echo --variant "$c:${CANDIDATE[$c]}"; done) "${REFERENCES[@]}"

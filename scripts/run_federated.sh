#!/usr/bin/env bash
# Launch a federated run through `accelerate launch` with one of the shipped configs.
#
#   scripts/run_federated.sh ACCELERATE_CONFIG [fedllm run arguments...]
#
#   scripts/run_federated.sh configs/accelerate/single_gpu.yaml --config configs/dolly_tinyllama.yaml
#   scripts/run_federated.sh configs/accelerate/multi_gpu.yaml --config configs/dolly_tinyllama.yaml
#   NUM_PROCESSES=4 scripts/run_federated.sh configs/accelerate/deepspeed_zero3.yaml --config ... eval.personalized=false
#   MACHINE_RANK=1 MAIN_PROCESS_IP=10.0.0.1 scripts/run_federated.sh configs/accelerate/multi_node.yaml --config ...
#
# Environment overrides of the config file: NUM_PROCESSES, NUM_MACHINES, MACHINE_RANK,
# MAIN_PROCESS_IP, MAIN_PROCESS_PORT, MIXED_PRECISION (no|bf16|fp16).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 ACCELERATE_CONFIG [fedllm run arguments...]  (configs in configs/accelerate/)" >&2
  [ $# -ge 1 ] && echo "error: accelerate config file '$1' not found" >&2
  exit 2
fi
config=$1
shift
extra=()
[ -n "${NUM_PROCESSES:-}" ] && extra+=(--num_processes "$NUM_PROCESSES")
[ -n "${NUM_MACHINES:-}" ] && extra+=(--num_machines "$NUM_MACHINES")
[ -n "${MACHINE_RANK:-}" ] && extra+=(--machine_rank "$MACHINE_RANK")
[ -n "${MAIN_PROCESS_IP:-}" ] && extra+=(--main_process_ip "$MAIN_PROCESS_IP")
[ -n "${MAIN_PROCESS_PORT:-}" ] && extra+=(--main_process_port "$MAIN_PROCESS_PORT")
[ -n "${MIXED_PRECISION:-}" ] && extra+=(--mixed_precision "$MIXED_PRECISION")
exec accelerate launch --config_file "$config" "${extra[@]}" -m fedllm.cli run "$@"

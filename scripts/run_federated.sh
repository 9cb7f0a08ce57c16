#!/usr/bin/env bash
# Launch a federated run through `accelerate launch` with one of the shipped configs.
#
#   scripts/run_federated.sh ACCELERATE_CONFIG [fedllm run arguments...]
#
#   scripts/run_federated.sh configs/accelerate/single_gpu.yaml --config configs/dolly_tinyllama.yaml
#   scripts/run_federated.sh configs/accelerate/multi_gpu.yaml --config configs/dolly_tinyllama.yaml
#   NUM_PROCESSES=4 scripts/run_federated.sh configs/accelerate/deepspeed_zero3.yaml --config ... eval.personalized=false
#   MACHINE_RANK=1 MAIN_PROCESS_IP=10.0.0.1 scripts/run_federated.sh configs/accelerate/multi_node.yaml --config ...
#   ACCELERATE_USE_CPU=1 NUM_PROCESSES=2 scripts/run_federated.sh configs/accelerate/multi_gpu.yaml   # CPU processes
#
# Environment overrides of the config file: NUM_PROCESSES, NUM_MACHINES, MACHINE_RANK,
# MAIN_PROCESS_IP, MAIN_PROCESS_PORT, MIXED_PRECISION (no|bf16|fp16). The shipped configs are for
# GPUs: on a machine without one the launch is refused with the fix, unless ACCELERATE_USE_CPU=1
# asks for CPU processes (gloo), which DeepSpeed cannot use.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 ACCELERATE_CONFIG [fedllm run arguments...]  (configs in configs/accelerate/)" >&2
  [ $# -ge 1 ] && echo "error: accelerate config file '$1' not found" >&2
  exit 2
fi
config=$1
shift
setting() { sed -n "s/^$1: *//p" "$config" | head -n 1; }
kind=$(setting distributed_type)
processes=${NUM_PROCESSES:-$(setting num_processes)}
processes=${processes:-1}
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "${ACCELERATE_USE_CPU:-0}" = "1" ]; then
  if [ "$kind" = "DEEPSPEED" ]; then
    echo "error: $config uses DeepSpeed, which does not run on CPU processes; use configs/accelerate/multi_gpu.yaml" >&2
    exit 2
  fi
elif [ "$gpus" -eq 0 ]; then
  echo "error: no GPU found, and $config launches $processes GPU process(es). For CPU processes run:" >&2
  echo "  ACCELERATE_USE_CPU=1 NUM_PROCESSES=2 $0 $config $*" >&2
  echo "(or one process without accelerate: fedllm run $*)" >&2
  exit 2
elif [ "${NUM_MACHINES:-$(setting num_machines)}" = "1" ] && [ "$processes" -gt "$gpus" ]; then
  echo "error: $config launches $processes processes but this machine has $gpus GPU(s): set NUM_PROCESSES=$gpus" >&2
  exit 2
fi
extra=()
[ -n "${NUM_PROCESSES:-}" ] && extra+=(--num_processes "$NUM_PROCESSES")
[ -n "${NUM_MACHINES:-}" ] && extra+=(--num_machines "$NUM_MACHINES")
[ -n "${MACHINE_RANK:-}" ] && extra+=(--machine_rank "$MACHINE_RANK")
[ -n "${MAIN_PROCESS_IP:-}" ] && extra+=(--main_process_ip "$MAIN_PROCESS_IP")
[ -n "${MAIN_PROCESS_PORT:-}" ] && extra+=(--main_process_port "$MAIN_PROCESS_PORT")
[ -n "${MIXED_PRECISION:-}" ] && extra+=(--mixed_precision "$MIXED_PRECISION")
exec accelerate launch --config_file "$config" "${extra[@]}" -m fedllm.cli run "$@"

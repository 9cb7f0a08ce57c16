#!/usr/bin/env bash
# Install (if needed) and run the federated job on the built-in offline default.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/fedllm ] || bash scripts/install.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
fedllm run "$@"

#!/usr/bin/env bash
# Install (if needed) and run the offline test suite: the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/fedllm ] || bash scripts/install.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check .
ruff format --check .
mypy  # strict on fedllm/aggregation, server, config, protocol.py, options.py ([tool.mypy] in pyproject.toml)
python -m pytest -q "$@"

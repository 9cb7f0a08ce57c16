#!/usr/bin/env bash
# Create .venv and install fedllm for CPU (torch pinned to the CPU wheel; GPU users: see README).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,track]"

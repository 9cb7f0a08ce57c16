#!/usr/bin/env bash
# The fedllm Flower app on Flower's Simulation Engine, the safe way (what `flwr run .` should do here).
#
#   scripts/run_flower_simulation.sh CONFIG|default [--run-dir DIR] [key=value ...]
#
# A bare `flwr run .` in Flower 1.42 uses ~/.flwr/config.toml (it migrates pyproject's legacy
# [tool.flwr.federations] there), starts a local SuperLink in the background that outlives the command,
# and that SuperLink installs the app's dependencies with `uv sync` (another torch, gigabytes) because the
# CLI starts it without --disable-runtime-dependency-installation. This script instead:
#   - uses a project-local FLWR_HOME (.flwr/, git-ignored) with one local simulation connection, and
#     --federation-config num-supernodes = the config's federation.num_clients (one Ray worker CPU each);
#   - sets FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 (the SuperLink reads it: the app runs in this
#     venv), with telemetry and update checks off;
#   - runs the app with the config, streams its log, prints the run's summary, and stops the SuperLink it
#     started (by PID) when the run ends or the script is stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: $0 CONFIG|default [--run-dir DIR] [key=value ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
config=$1; shift
run_dir=""; overrides=()
while [ $# -gt 0 ]; do
  case $1 in
    --run-dir) run_dir=$2; shift ;;
    *=*) overrides+=("$1") ;;
    *) usage ;;
  esac
  shift
done
[ "$config" = default ] || [ -f "$config" ] || { echo "error: config file '$config' not found" >&2; exit 2; }
command -v flwr >/dev/null || { echo "error: Flower is not installed: pip install -e '.[flower]'" >&2; exit 2; }
cfg_path=$([ "$config" = default ] && echo "" || echo "$(cd "$(dirname "$config")" && pwd)/$(basename "$config")")
# the config is checked (and its client count read) before anything starts
read -r n shared < <(python -c "import sys; from fedllm.config import load_config, token_modules; \
c = load_config(sys.argv[1] or None, sys.argv[2:]); print(c.federation.num_clients, int(bool(token_modules(c))))" \
  "$cfg_path" "${overrides[@]}")
if [ "$shared" = 1 ]; then  # one machine, one trust domain: accept it, and say so
  overrides=(flower.share_token_modules=true "${overrides[@]}")
  echo "note: the config shares token-indexed modules (embed_tokens/lm_head); accepted here (every site is this" \
       "machine); across organizations they reveal which tokens each site's data holds"
fi
run_dir=$(python -c "import sys, os; print(os.path.abspath(sys.argv[1]))" "${run_dir:-runs/flower-sim-$(date +%Y%m%d-%H%M%S)}")
free_port() { python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
export FLWR_HOME=$PWD/.flwr
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-$(free_port)}
export FLWR_LOCAL_CONTROL_API_PORT=${FLWR_LOCAL_CONTROL_API_PORT:-$(free_port)}
export TOKENIZERS_PARALLELISM=false
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "fedllm-sim"

[superlink.fedllm-sim]
address = ":local:"
TOML
stop() {  # the SuperLink `flwr run` started for this port, and its children
  pkill -f "flower-superlink.*--port $FLWR_LOCAL_SUPERLINK_HTTP_API_PORT" 2>/dev/null || true
}
trap stop EXIT INT TERM
echo "Flower Simulation Engine: $n clients, FLWR_HOME $FLWR_HOME (SuperLink log: $FLWR_HOME/local-superlink/superlink.log), run $run_dir"
flwr run . fedllm-sim --stream \
  --federation-config "num-supernodes=$n client-resources-num-cpus=1 client-resources-num-gpus=0.0" --run-config \
  "config='$cfg_path' run-dir='$run_dir' overrides='${overrides[*]}'"
[ -f "$run_dir/summary.json" ] || { echo "error: the run did not finish (see the log above)" >&2; exit 1; }
python -c "import json, sys; from fedllm.cli import print_summary; print_summary(json.load(open(sys.argv[1])))" \
  "$run_dir/summary.json"

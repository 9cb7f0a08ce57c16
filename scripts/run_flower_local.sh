#!/usr/bin/env bash
# A cross-silo run on this machine through Flower's Deployment Engine: one SuperLink, N SuperNodes
# (one per site, each with its own partition of the data in its own folder), the fedllm app run with
# `flwr run`. Every process started here is stopped by PID when the run ends (or the script is stopped).
#
#   scripts/run_flower_local.sh CONFIG|default [N] [--tls] [--run-dir DIR] [key=value ...]
#
#   scripts/run_flower_local.sh default 4 federation.rounds=2          # the built-in default, 4 sites
#   scripts/run_flower_local.sh configs/builtin_fedit.yaml 4 --tls      # TLS + SuperNode authentication
#
# --tls makes a local CA and certificates (openssl) for the SuperLink, and an ECDSA key per SuperNode,
# registered with the SuperLink (`flwr supernode register`): an unregistered node is refused. Runtime
# dependency installation, telemetry and update checks are off. Work files (site data, state, keys,
# logs) go to $FLOWER_WORKDIR (default: a new folder under /tmp); the run to --run-dir (default:
# runs/flower-<time>). Ports: $SUPERLINK_PORT (default 8000) and $SUPERNODE_PORT + k (default 9094).
# Each site gets $SITE_THREADS torch threads (default: the cores divided among the sites).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: $0 CONFIG|default [N] [--tls] [--run-dir DIR] [key=value ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
config=$1; shift
n=""; tls=0; run_dir=""; overrides=()
while [ $# -gt 0 ]; do
  case $1 in
    --tls) tls=1 ;;
    --run-dir) run_dir=$2; shift ;;
    [0-9]*) n=$1 ;;
    *=*) overrides+=("$1") ;;
    *) usage ;;
  esac
  shift
done
[ "$config" = default ] || [ -f "$config" ] || { echo "error: config file '$config' not found" >&2; exit 2; }
command -v flower-superlink >/dev/null || { echo "error: Flower is not installed: pip install -e '.[flower]'" >&2; exit 2; }
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export TOKENIZERS_PARALLELISM=false
work=${FLOWER_WORKDIR:-$(mktemp -d /tmp/fedllm-flower.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
export FLWR_HOME=$work/flwr-home
run_dir=$(python -c "import sys, os; print(os.path.abspath(sys.argv[1]))" "${run_dir:-runs/flower-$(date +%Y%m%d-%H%M%S)}")
link_port=${SUPERLINK_PORT:-8000}
node_port=${SUPERNODE_PORT:-9094}
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT INT TERM

# 1. Each site's data in its own folder, and the resolved config every site will train with.
cfg_path=$([ "$config" = default ] && echo default || echo "$(cd "$(dirname "$config")" && pwd)/$(basename "$config")")
n=$(python scripts/flower_sites.py "$work" "$cfg_path" "${overrides[@]}" ${n:+federation.num_clients=$n})
echo "sites: $n, work folder $work, run $run_dir"

# 2. TLS material (a local CA, the SuperLink's certificate) and the SuperNodes' keys.
link_tls=(--insecure); node_tls=(--insecure); conn_tls="insecure = true"
if [ $tls = 1 ]; then
  cd "$work"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=fedllm-local-ca" -keyout ca.key -out ca.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
  printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" > san.ext
  openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext \
    -out server.pem 2>/dev/null
  for k in $(seq 0 $((n - 1))); do ssh-keygen -q -t ecdsa -b 384 -N "" -f "site-$k/node-key" <<<y >/dev/null; done
  cd - >/dev/null
  link_tls=(--ssl-ca-certfile "$work/ca.crt" --ssl-certfile "$work/server.pem" --ssl-keyfile "$work/server.key"
            --enable-supernode-auth)
  node_tls=(--root-certificates "$work/ca.crt")
  conn_tls="root-certificates = \"$work/ca.crt\""
fi
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "fedllm-local"

[superlink.fedllm-local]
address = "127.0.0.1:$link_port"
$conn_tls
TOML

# 3. The SuperLink, then one SuperNode per site (the sites share this machine's cores).
cores=$(nproc)
site_threads=${SITE_THREADS:-$(( cores / n > 0 ? cores / n : 1 ))}
flower-superlink "${link_tls[@]}" --disable-runtime-dependency-installation --port "$link_port" \
  > "$work/superlink.log" 2>&1 &
pids+=($!)
python - "$link_port" <<'PY'
import socket, sys, time
deadline = time.time() + 60
while time.time() < deadline:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("the SuperLink did not open its port within 60 s (see superlink.log)")
PY
for k in $(seq 0 $((n - 1))); do
  auth=()
  if [ $tls = 1 ]; then
    flwr supernode register "$work/site-$k/node-key.pub" fedllm-local > "$work/site-$k/register.log" 2>&1
    auth=(--auth-supernode-private-key "$work/site-$k/node-key")
  fi
  OMP_NUM_THREADS=$site_threads flower-supernode "${node_tls[@]}" "${auth[@]}" --superlink "127.0.0.1:$link_port" --port $((node_port + k)) \
    --node-config "client-id=$k data-path='$work/site-$k/data.jsonl' state-dir='$work/site-$k/state'" \
    > "$work/site-$k/supernode.log" 2>&1 &
  pids+=($!)
  echo "$!" > "$work/site-$k/supernode.pid"
done

# 4. The app: the server waits for every site's handshake, then runs the rounds.
flwr run . fedllm-local --stream --run-config \
  "config='$work/config.yaml' run-dir='$run_dir'" > "$work/run.log" 2>&1 &
pids+=($!)
echo "$!" > "$work/run.pid"
while [ ! -f "$run_dir/summary.json" ]; do
  kill -0 "$!" 2>/dev/null || { echo "error: the run stopped early (see $work/run.log)" >&2; exit 1; }
  sleep 2
done
python -c "import json, sys; s = json.load(open(sys.argv[1])); print('held-out loss', s.get('loss_before'), '->', \
s.get('loss_after'), '| accuracy', s.get('accuracy_before'), '->', s.get('accuracy_after'))" "$run_dir/summary.json"
echo "run directory: $run_dir"

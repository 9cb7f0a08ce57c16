#!/usr/bin/env bash
# A cross-silo run on this machine through Flower's Deployment Engine, set up as a real deployment should
# be: one SuperLink, N SuperNodes (one per site, each with its own partition of the data in its own
# folder), the fedllm app run with `flwr run`. Every process started here is stopped by PID when the run
# ends (or the script is stopped).
#
#   scripts/run_flower_local.sh CONFIG|default [N] [--insecure] [--run-dir DIR] [key=value ...]
#
#   scripts/run_flower_local.sh default 4 federation.rounds=2          # the built-in default, 4 sites
#   scripts/run_flower_local.sh configs/builtin_fedit.yaml 4 lora.trainable_modules=[]
#   scripts/run_flower_local.sh default 4 flower.secure_aggregation=true secagg.clip_norm=10   # SecAgg+
#
# By default (the secure setup):
#   - TLS everywhere: a local CA (openssl) signs one certificate for the SuperLink and its proxy;
#   - the SuperLink listens on 127.0.0.1:$SUPERLINK_LOCAL_PORT only (the operator's side: `flwr run`,
#     node registration, the ServerApp's Runtime API); the sites reach it through nginx on
#     127.0.0.1:$SUPERLINK_PORT, which forwards /v1/fleet/ and answers 403 to everything else
#     (configs/flower/nginx-fleet-only.conf), so nobody on the sites' side can start a run;
#   - SuperNode authentication: an ECDSA key per site, registered with the SuperLink;
#   - a registry (flower.registry) binding each site's key to its client id, so no node answers for
#     another site, and every reply signed with the site's key (the server refuses another key's);
#   - the proxy caps request bodies and rates and refuses unsigned Fleet requests before the SuperLink
#     reads them.
# --insecure: plain HTTP, no proxy, no node authentication, no registry (prints what it leaves open).
# --tls is accepted and means the default. Runtime dependency installation, telemetry and update checks
# are off. Work files (site data, state, keys, logs) go to $FLOWER_WORKDIR (default: a new folder under
# /tmp), private to this user (umask 077, the folder 0700 whatever it was); private keys are removed when
# the run ends (--keep-keys keeps them); the run goes to --run-dir (default: runs/flower-<time>). Ports:
# $SUPERLINK_PORT and $SUPERNODE_PORT (the first site's; site K uses +K) are checked free before anything
# starts (a clear refusal naming the port); unset, free ones are picked and printed. The app package is
# built from the files git tracks (never an untracked file of the operator's). Each site gets $SITE_THREADS torch threads
# (default: the cores divided among the sites). Needs nginx for the default mode (Debian: apt-get install
# nginx-light).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: $0 CONFIG|default [N] [--insecure] [--keep-keys] [--run-dir DIR] [key=value ...]" >&2; exit 2; }
umask 077  # every file this deployment writes (site data, logs, keys, the registry) is this user's only
[ $# -ge 1 ] || usage
config=$1; shift
n=""; tls=1; run_dir=""; overrides=(); keep_keys=0
while [ $# -gt 0 ]; do
  case $1 in
    --tls) tls=1 ;;
    --insecure) tls=0 ;;
    --keep-keys) keep_keys=1 ;;
    --run-dir) run_dir=$2; shift ;;
    [0-9]*) n=$1 ;;
    *=*) overrides+=("$1") ;;
    *) usage ;;
  esac
  shift
done
[ "$config" = default ] || [ -f "$config" ] || { echo "error: config file '$config' not found" >&2; exit 2; }
command -v flower-superlink >/dev/null || { echo "error: Flower is not installed: pip install -e '.[flower]'" >&2; exit 2; }
if [ $tls = 1 ] && ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "error: the secure setup puts nginx in front of the SuperLink: install it (apt-get install nginx-light)" \
       "or pass --insecure" >&2
  exit 2
fi
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export TOKENIZERS_PARALLELISM=false
work=${FLOWER_WORKDIR:-$(mktemp -d /tmp/fedllm-flower.XXXXXX)}
mkdir -p "$work"
chmod 700 "$work"
work=$(cd "$work" && pwd)
export FLWR_HOME=$work/flwr-home
run_dir=$(python -c "import sys, os; print(os.path.abspath(sys.argv[1]))" "${run_dir:-runs/flower-$(date +%Y%m%d-%H%M%S)}")
free_port() { python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
port_is_free() { python -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null; }
need_port() {  # port, what it is for: refuse at once, naming it, when another process holds it
  port_is_free "$1" || { echo "error: port $1 ($2) is in use on 127.0.0.1 (another deployment?): set $2 to a free port, or leave it unset to pick one" >&2; exit 2; }
}
link_port=${SUPERLINK_PORT:-$(free_port)}                # what the sites connect to
local_port=${SUPERLINK_LOCAL_PORT:-$(free_port)}         # the SuperLink itself (operator's side)
[ $tls = 1 ] || local_port=$link_port
node_port=${SUPERNODE_PORT:-}
pids=()
descendants() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do descendants "$c"; echo "$c"; done; }
stop() {  # every process started here and everything they started (the SuperLink's ServerApp process too)
  local all=()
  for p in "${pids[@]}"; do all+=($(descendants "$p") "$p"); done
  [ ${#all[@]} -eq 0 ] || kill "${all[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  if [ $keep_keys = 0 ]; then  # private keys live only as long as the deployment
    rm -f "$work/ca.key" "$work/server.key" "$work"/site-*/node-key "$work/superexec-token" 2>/dev/null || true
  fi
}
trap stop EXIT INT TERM

if [ "$config" = default ]; then  # the built-in default shares embed_tokens and lm_head
  overrides=(flower.share_token_modules=true "${overrides[@]}")
  echo "note: the built-in default shares embed_tokens and lm_head; the rows a site changes are the tokens of" \
       "its data, which the server (and anyone who reads the run folder) sees. Real sites: use a config with" \
       "lora.trainable_modules=[]."
fi

# 0. Ports: the ones asked for must be free (checked now, not after a 600 s wait); the others are picked.
need_port "$link_port" SUPERLINK_PORT
[ $tls = 0 ] || need_port "$local_port" SUPERLINK_LOCAL_PORT
echo "ports: sites connect to 127.0.0.1:$link_port$([ $tls = 1 ] && echo ", the SuperLink listens on 127.0.0.1:$local_port")"

# 1. Each site's data in its own folder, and the resolved config every site will train with.
cfg_path=$([ "$config" = default ] && echo default || echo "$(cd "$(dirname "$config")" && pwd)/$(basename "$config")")
# (--bound in the secure setup: each site's node config names its key and the registry, and pins it to
# secure aggregation where the run asks for it: site-K/node-config)
n=$(python scripts/flower_sites.py "$work" "$cfg_path" $([ $tls = 1 ] && echo --bound) "${overrides[@]}" \
  ${n:+federation.num_clients=$n})
echo "sites: $n; logs and site folders in $work (run.log: the server; site-K/supernode.log: site K); run $run_dir"

# 2. TLS material (a local CA, one certificate for the SuperLink and its proxy), the sites' keys and the
#    registry that binds each key to its client id.
link_tls=(--insecure); node_tls=(--insecure); conn_tls="insecure = true"; run_overrides=""
if [ $tls = 1 ]; then
  (
    cd "$work"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=fedllm-local-ca" -keyout ca.key -out ca.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
    {  # a leaf certificate for a TLS server, and nothing else
      printf "basicConstraints=critical,CA:FALSE\n"
      printf "keyUsage=critical,digitalSignature,keyEncipherment\n"
      printf "extendedKeyUsage=serverAuth\n"
      printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    } > san.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext \
      -out server.pem 2>/dev/null
    : > registry.txt
    for k in $(seq 0 $((n - 1))); do
      ssh-keygen -q -t ecdsa -b 384 -N "" -f "site-$k/node-key" <<<y >/dev/null
      echo "$k: site-$k/node-key.pub" >> registry.txt
    done
  )
  link_tls=(--ssl-ca-certfile "$work/ca.crt" --ssl-certfile "$work/server.pem" --ssl-keyfile "$work/server.key"
            --enable-supernode-auth)
  node_tls=(--root-certificates "$work/ca.crt")
  conn_tls="root-certificates = \"$work/ca.crt\""
  run_overrides="flower.registry=$work/registry.txt"
else
  echo "WARNING: --insecure: no TLS (factors and configs travel in clear), no SuperNode authentication (any" \
       "process that reaches 127.0.0.1:$link_port joins as a node and may claim a free client id), and the" \
       "Control API is open on the same port (anyone who reaches it can run their own code on every site)."
fi
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "fedllm-local"

[superlink.fedllm-local]
address = "127.0.0.1:$local_port"
$conn_tls
TOML

wait_port() {  # port, what, log
  python - "$1" "$2" "$3" <<'PY'
import socket, sys, time
deadline = time.time() + 60
while time.time() < deadline:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit(f"{sys.argv[2]} did not open port {sys.argv[1]} within 60 s (see {sys.argv[3]})")
PY
}

# 3. The SuperLink on the operator's side, the proxy the sites see, then one SuperNode per site.
cores=$(nproc)
site_threads=${SITE_THREADS:-$(( cores / n > 0 ? cores / n : 1 ))}
flower-superlink "${link_tls[@]}" --disable-runtime-dependency-installation --host 127.0.0.1 --port "$local_port" \
  > "$work/superlink.log" 2>&1 &
pids+=($!)
wait_port "$local_port" "the SuperLink" "$work/superlink.log"
if [ $tls = 1 ]; then
  mkdir -p "$work/nginx"
  sed -e "s#@LISTEN@#127.0.0.1:$link_port#" -e "s#@LINK_PORT@#$local_port#" -e "s#@CERT@#$work/server.pem#" \
      -e "s#@KEY@#$work/server.key#" -e "s#@CA@#$work/ca.crt#" -e "s#@WORK@#$work/nginx#" \
      configs/flower/nginx-fleet-only.conf > "$work/nginx/nginx.conf"
  "$nginx_bin" -p "$work/nginx" -c "$work/nginx/nginx.conf" -e "$work/nginx/error.log" > "$work/nginx/stdout.log" 2>&1 &
  pids+=($!)
  wait_port "$link_port" "nginx" "$work/nginx/error.log"
fi
for k in $(seq 0 $((n - 1))); do
  auth=()
  if [ $tls = 1 ]; then
    flwr supernode register "$work/site-$k/node-key.pub" fedllm-local > "$work/site-$k/register.log" 2>&1
    auth=(--auth-supernode-private-key "$work/site-$k/node-key")
    # the site signs every reply (and its secure aggregation keys and round statements) with the key it
    # authenticates with, and checks its neighbours' against the federation's registry (a copy each site
    # holds, not the server's): site-K/node-config (scripts/flower_sites.py --bound)
  fi
  if [ -n "$node_port" ]; then port=$((node_port + k)); need_port "$port" "SUPERNODE_PORT (+$k)"; else port=$(free_port); fi
  OMP_NUM_THREADS=$site_threads flower-supernode "${node_tls[@]}" "${auth[@]}" --superlink "127.0.0.1:$link_port" --port "$port" \
    --node-config "$(cat "$work/site-$k/node-config")" \
    > "$work/site-$k/supernode.log" 2>&1 &
  pids+=($!)
  echo "$!" > "$work/site-$k/supernode.pid"
done

# 4. The app, packaged from the files git tracks (or, outside a checkout, the code alone): the server waits
#    for every site's handshake, then runs the rounds; its round lines are shown here as they come.
app="$work/app"
mkdir -p "$app"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z -- pyproject.toml fedllm data_prep eval | xargs -0 cp --parents -t "$app"
else
  cp -r pyproject.toml fedllm data_prep eval "$app"/
fi
flwr run "$app" fedllm-local --stream --run-config \
  "config='$work/config.yaml' run-dir='$run_dir' overrides='$run_overrides'" > "$work/run.log" 2>&1 &
run_pid=$!
pids+=($run_pid)
echo "$run_pid" > "$work/run.pid"
tail -n +1 -F "$work/run.log" 2>/dev/null \
  | grep --line-buffered -E "sites connected|before round 1|round [0-9]+: |refused|left out|unusable|error" &
pids+=($!)
while [ ! -f "$run_dir/summary.json" ]; do
  kill -0 "$run_pid" 2>/dev/null || { echo "error: the run stopped early (see $work/run.log)" >&2; exit 1; }
  sleep 2
done
python -c "import json, sys; from fedllm.cli import print_summary; print_summary(json.load(open(sys.argv[1])))" \
  "$run_dir/summary.json"
echo "logs: $work (run.log, superlink.log, site-K/supernode.log$([ $tls = 1 ] && echo ", nginx/access.log"))"

#!/usr/bin/env bash
# One executable per rank, chosen by the launcher's rank: the mpirun / torchrun form of a Spade cluster.
#
#   Serve (the OpenAI API on the coordinator's --http-port, until SIGINT/SIGTERM):
#     mpirun -np $((1 + 2*N)) deploy/spade_rank.sh --model DIR [--http-port 8000] [--metrics-port-base 9100]
#                                                  [--role-map c,i,k,...] [sparse flags]
#   One prompt (rank 0 submits it, prints the text, shuts the cluster down):
#     mpirun -np 3 deploy/spade_rank.sh --model DIR --prompt TEXT [--max-tokens N --temperature T ...]
#   torchrun-style: any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (and LOCAL_RANK) per process.
#   Layer shards: --cache-ranks-per-inference K (default 1) gives each inference rank K cache ranks
#     (mpirun -np $((1 + N*(1+K))); inference #i pairs with cache #(i*K + s), s = 0..K-1).
#
# Roles: rank 0 the coordinator, ranks 1..N inference ranks, the rest (N*K) cache ranks (N = (WORLD_SIZE-1)/(1+K)),
# or the explicit --role-map (c = coordinator, i = inference, k = cache; one letter per rank), which every rank also
# checks (its cache ranks must be a multiple of its inference ranks).
# The rank comes from OMPI_COMM_WORLD_RANK/SIZE (Open MPI) or RANK/WORLD_SIZE. MASTER_ADDR defaults to 127.0.0.1, MASTER_PORT
# to 29500 (set it when several clusters share a host). With --metrics-port-base B, rank r serves /metrics,
# /health and /ready on port B + r (inference and cache ranks; the coordinator serves them on --http-port).
#
# Security (docs/DEPLOY.md, "Security model"): every rank authenticates to the coordinator with one cluster secret.
# SPADE_CLUSTER_SECRET_FILE (a 0600 file present on every host) or SPADE_CLUSTER_SECRET, when set, is used as given;
# the launcher must hand it to every rank (mpirun -x SPADE_CLUSTER_SECRET_FILE). Without one, on a single host
# (MASTER_ADDR a loopback address), rank 0 draws a fresh secret for this launch into a private directory
# (${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/spade-<uid>-port<MASTER_PORT>, 0700) and the other ranks read it there; across
# hosts a secret is required. The control port listens on loopback for a single host, else on
# SPADE_COORDINATOR_HOST (default 0.0.0.0); the HTTP API on --http-host (default 127.0.0.1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
rank="${OMPI_COMM_WORLD_RANK:-${RANK:-}}"
world="${OMPI_COMM_WORLD_SIZE:-${WORLD_SIZE:-}}"
[ -n "$rank" ] && [ -n "$world" ] || { echo "spade_rank: no rank/world size (run under mpirun or set RANK, WORLD_SIZE)" >&2; exit 2; }
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"  # UCX warnings would land in the text on stdout

model="" ; prompt="" ; have_prompt=0 ; role_map="" ; http_port=8000 ; http_host=127.0.0.1 ; metrics_base=0 ; per_inf=1
gen=() ; inf=() ; cache=() ; coord=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --prompt) prompt="$2"; have_prompt=1; shift 2 ;;
    --role-map) role_map="$2"; shift 2 ;;
    --cache-ranks-per-inference) per_inf="$2"; shift 2 ;;
    --http-port) http_port="$2"; shift 2 ;;
    --http-host) http_host="$2"; shift 2 ;;
    --metrics-port-base) metrics_base="$2"; shift 2 ;;
    --served-model-name|--max-num-requests|--max-model-len|--chat-template) coord+=("$1" "$2"); shift 2 ;;
    --max-tokens|--temperature|--top-p|--top-k|--seed) gen+=("$1" "$2"); shift 2 ;;
    --token-budget|--local-window|--sink-tokens|--query-window|--ridge-eps|--gqa-rule|--predictor|--successor-expand) inf+=("$1" "$2"); cache+=("$1" "$2"); shift 2 ;;
    --selection|--sparse-threshold|--layers-per-pack|--selection-deadline-ms|--page-size|--max-num-seqs) inf+=("$1" "$2"); shift 2 ;;
    --overlap-sample-every|--kv-pages) cache+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "spade_rank: unknown flag $1" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "spade_rank: --model DIR is required" >&2; exit 2; }

if [ -n "$role_map" ]; then
  IFS=, read -r -a roles <<<"$role_map"
  [ "${#roles[@]}" -eq "$world" ] || { echo "spade_rank: --role-map has ${#roles[@]} entries for world size $world" >&2; exit 2; }
  role="${roles[$rank]}"
  [ "$per_inf" = 1 ] || { echo "spade_rank: --cache-ranks-per-inference with --role-map: the role map's counts set it" >&2; exit 2; }
  common=(--role-map "$role_map")
else
  [[ "$per_inf" =~ ^[1-9][0-9]*$ ]] || { echo "spade_rank: --cache-ranks-per-inference must be >= 1, got '$per_inf'" >&2; exit 2; }
  if [ "$per_inf" -eq 1 ]; then
    [ $(( (world - 1) % 2 )) -eq 0 ] && [ "$world" -ge 3 ] || { echo "spade_rank: world size $world must be 1 + 2N (N >= 1)" >&2; exit 2; }
  else
    [ $(( (world - 1) % (1 + per_inf) )) -eq 0 ] && [ "$world" -ge $((2 + per_inf)) ] || {
      echo "spade_rank: world size $world must be 1 + N x (1 + $per_inf) (N >= 1 inference ranks with" \
           "--cache-ranks-per-inference $per_inf cache ranks each)" >&2; exit 2; }
  fi
  n=$(( (world - 1) / (1 + per_inf) ))
  if [ "$rank" -eq 0 ]; then role=c; elif [ "$rank" -le "$n" ]; then role=i; else role=k; fi
  common=(--num-inference "$n" --num-cache "$((n * per_inf))")
fi
case "$role" in
  c|coordinator|i|inference|k|cache) ;;
  *) echo "spade_rank: rank $rank has unknown role '$role' in --role-map $role_map (c, i or k)" >&2; exit 2 ;;
esac
metrics=()
[ "$metrics_base" -gt 0 ] && metrics=(--metrics-port $((metrics_base + rank)))

# The cluster secret (see the header) and the control port's address.
case "$MASTER_ADDR" in 127.*|localhost|::1) one_host=1 ;; *) one_host=0 ;; esac
coord_host=127.0.0.1
[ "$one_host" -eq 1 ] || coord_host="${SPADE_COORDINATOR_HOST:-0.0.0.0}"
if [ -z "${SPADE_CLUSTER_SECRET_FILE:-}${SPADE_CLUSTER_SECRET:-}" ]; then
  [ "$one_host" -eq 1 ] || { echo "spade_rank: MASTER_ADDR=$MASTER_ADDR: a world across hosts needs a cluster secret:" \
    "set SPADE_CLUSTER_SECRET_FILE (a 0600 file on every host) for every rank (mpirun -x SPADE_CLUSTER_SECRET_FILE)" >&2; exit 2; }
  secret_dir="${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/spade-$(id -u)-port$MASTER_PORT"
  if [ "$role" = c ] || [ "$role" = coordinator ]; then
    # A previous launch's directory on this port is stale: this launch's coordinator is about to take the port.
    rm -rf "$secret_dir"
    mkdir -m 700 "$secret_dir" || { echo "spade_rank: cannot create $secret_dir" >&2; exit 2; }
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret_dir/secret.tmp") &&
      mv "$secret_dir/secret.tmp" "$secret_dir/cluster.secret"
    echo $$ >"$secret_dir/owner.tmp" && mv "$secret_dir/owner.tmp" "$secret_dir/owner"  # $$ = the coordinator (exec)
  else
    # Wait for this launch's secret: the directory is ours and private, and its owner (rank 0) is alive.
    found=0
    for _ in $(seq 600); do
      owner="$(cat "$secret_dir/owner" 2>/dev/null || true)"
      if [ -O "$secret_dir" ] && [ "$(stat -c %a "$secret_dir")" = 700 ] && [ -f "$secret_dir/cluster.secret" ] &&
         [[ "$owner" =~ ^[1-9][0-9]*$ ]] && kill -0 "$owner" 2>/dev/null; then
        found=1; break
      fi
      sleep 0.1
    done
    [ "$found" -eq 1 ] || { echo "spade_rank: no cluster secret from rank 0 in $secret_dir within 60 s (is rank 0 on" \
      "this host? across hosts set SPADE_CLUSTER_SECRET_FILE)" >&2; exit 2; }
  fi
  export SPADE_CLUSTER_SECRET_FILE="$secret_dir/cluster.secret"
fi

case "$role" in
  c|coordinator)
    if [ "$have_prompt" -eq 1 ]; then
      "$build/coordinator/coordinator" --host "$coord_host" --port "$MASTER_PORT" "${common[@]}" --http-port 0 \
        --log-level warn &
      cpid=$!
      trap 'kill $cpid 2>/dev/null || true' EXIT
      "$build/coordinator/spade_submit" --master-addr 127.0.0.1 --master-port "$MASTER_PORT" --prompt "$prompt" \
        --shutdown-after "${gen[@]}" && rc=0 || rc=$?
      wait "$cpid" || true
      exit $rc
    fi
    exec "$build/coordinator/coordinator" --host "$coord_host" --port "$MASTER_PORT" "${common[@]}" --model "$model" \
      --http-host "$http_host" --http-port "$http_port" "${coord[@]}" ;;
  i|inference)
    exec "$build/inference_rank/inference_rank" --serve --model "$model" "${common[@]}" --log-level warn \
      "${metrics[@]}" "${inf[@]}" ;;
  k|cache)
    exec "$build/cache_rank/cache_rank" --model "$model" "${common[@]}" --log-level warn "${metrics[@]}" "${cache[@]}" ;;
esac

#!/usr/bin/env bash
# One executable per rank, chosen by the launcher's rank: the mpirun / torchrun form of deploy/launch_local.sh.
#
#   mpirun -np $((1 + 2*N)) deploy/spade_rank.sh --model DIR --prompt TEXT [--max-tokens N ...] [sparse flags]
#   (torchrun-style: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set per process by any launcher)
#
# Rank 0 runs the coordinator and, once the world is up, submits the prompt and prints the text (then shuts the
# cluster down); ranks 1..N are inference ranks, N+1..2N cache ranks (the default role map; N = (WORLD_SIZE-1)/2).
# Reads OMPI_COMM_WORLD_RANK/SIZE (Open MPI) or RANK/WORLD_SIZE. MASTER_ADDR defaults to 127.0.0.1 and MASTER_PORT
# to 29500 (set it when several clusters share a host).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
rank="${OMPI_COMM_WORLD_RANK:-${RANK:-}}"
world="${OMPI_COMM_WORLD_SIZE:-${WORLD_SIZE:-}}"
[ -n "$rank" ] && [ -n "$world" ] || { echo "spade_rank: no rank/world size (run under mpirun or set RANK, WORLD_SIZE)" >&2; exit 2; }
[ $(( (world - 1) % 2 )) -eq 0 ] && [ "$world" -ge 3 ] || { echo "spade_rank: world size $world must be 1 + 2N (N >= 1)" >&2; exit 2; }
n=$(( (world - 1) / 2 ))
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"  # UCX warnings would land in the text on stdout

model="" ; prompt="" ; gen=() ; inf=() ; cache=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --max-tokens|--temperature|--top-p|--top-k|--seed) gen+=("$1" "$2"); shift 2 ;;
    --token-budget|--local-window|--sink-tokens|--query-window|--ridge-eps|--gqa-rule) inf+=("$1" "$2"); cache+=("$1" "$2"); shift 2 ;;
    --selection|--sparse-threshold|--layers-per-pack|--selection-deadline-ms|--page-size|--max-num-seqs) inf+=("$1" "$2"); shift 2 ;;
    *) echo "spade_rank: unknown flag $1" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "spade_rank: --model DIR is required" >&2; exit 2; }
common=(--num-inference "$n" --num-cache "$n")

if [ "$rank" -eq 0 ]; then
  "$build/coordinator/coordinator" --port "$MASTER_PORT" "${common[@]}" --log-level warn &
  coord=$!
  trap 'kill $coord 2>/dev/null || true' EXIT
  "$build/coordinator/spade_submit" --master-addr 127.0.0.1 --master-port "$MASTER_PORT" --prompt "$prompt" \
    --shutdown-after "${gen[@]}" && rc=0 || rc=$?
  wait "$coord" || true
  exit $rc
elif [ "$rank" -le "$n" ]; then
  exec "$build/inference_rank/inference_rank" --serve --model "$model" "${common[@]}" --log-level warn "${inf[@]}"
else
  exec "$build/cache_rank/cache_rank" --model "$model" "${common[@]}" --log-level warn "${cache[@]}"
fi

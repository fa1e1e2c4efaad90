#!/usr/bin/env bash
# Starts a whole Spade cluster on this host — coordinator, I inference ranks, C cache ranks — and either serves the
# OpenAI-compatible API until Ctrl-C (no --prompt) or submits one prompt and prints the generated text on stdout;
# tears every process down on exit, Ctrl-C or the death of the coordinator or an inference rank (a cache rank's death
# is logged, its inference rank goes on decoding densely, and the cache rank is restarted with the same index: it
# rejoins the world and the pair decodes sparsely again).
#
#   deploy/launch_local.sh --model DIR [--http-port 8000] [--no-metrics] [--restart-cache-rank N]
#       serve: the API and the coordinator's /metrics on --http-port; inference #i serves /metrics on 8100+i and cache
#       #i on 8200+i (the ports deploy/prometheus/prometheus.yml scrapes); a cache rank that dies is restarted up to N
#       times (default 3 when serving, 0 with --prompt; 0 = never)
#   deploy/launch_local.sh --model DIR --prompt TEXT [--max-tokens N --temperature T --top-p P --top-k K --seed S]
#                          [--chat] [--selection dense|oracle|predicted --sparse-threshold N --token-budget K
#                                    --layers-per-pack P --local-window R --sink-tokens S --query-window W]
#                          [--num-inference I --num-cache C]
#       C = N x I (default C = I): inference #i pairs with cache #(i*N + s), s = 0..N-1, its N layer shards
#       (docs/ARCHITECTURE.md, "Sharding over N cache ranks"); a dead cache rank is restarted with the same index
#       --chat: send TEXT as one user message through the coordinator's OpenAI API (/v1/chat/completions, the
#       checkpoint's chat template) instead of as raw text through spade_submit
# Env: SPADE_BUILD_DIR (binaries, default build/), SPADE_LOG_DIR (rank logs, default a fresh temp dir),
#      MASTER_PORT (default: a free port), SPADE_CLUSTER_SECRET_FILE (default: a fresh secret in the log dir).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
logs="${SPADE_LOG_DIR:-$(mktemp -d /tmp/spade-cluster.XXXXXX)}"
mkdir -p "$logs"

model="" ; prompt="" ; have_prompt=0 ; chat=0 ; n_inf=1 ; n_cache=1 ; http_port="" ; metrics=1 ; restarts=
gen_flags=() ; rank_flags=() ; cache_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --prompt) prompt="$2"; have_prompt=1; shift 2 ;;
    --num-inference) n_inf="$2"; shift 2 ;;
    --num-cache) n_cache="$2"; shift 2 ;;
    --http-port) http_port="$2"; shift 2 ;;
    --no-metrics) metrics=0; shift ;;
    --restart-cache-rank) restarts="$2"; shift 2 ;;
    --chat) chat=1; shift ;;
    --max-tokens|--temperature|--top-p|--top-k|--seed) gen_flags+=("$1" "$2"); shift 2 ;;
    --token-budget|--local-window|--sink-tokens|--query-window|--ridge-eps|--gqa-rule|--predictor|--successor-expand)
      rank_flags+=("$1" "$2"); cache_flags+=("$1" "$2"); shift 2 ;;
    --selection|--sparse-threshold|--layers-per-pack|--selection-deadline-ms|--page-size|--max-num-seqs)
      rank_flags+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "launch_local: unknown flag $1" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "launch_local: --model DIR is required" >&2; exit 2; }
[ -n "$http_port" ] || { [ $have_prompt -eq 1 ] && http_port=0 || http_port=8000; }
[ -n "$restarts" ] || { [ $have_prompt -eq 1 ] && restarts=0 || restarts=3; }
[[ "$restarts" =~ ^[0-9]+$ ]] || { echo "launch_local: --restart-cache-rank must be a count >= 0, got '$restarts'" >&2; exit 2; }
[ $chat -eq 0 ] || [ $have_prompt -eq 1 ] || { echo "launch_local: --chat needs --prompt" >&2; exit 2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
[ $chat -eq 0 ] || [ "$http_port" != 0 ] || http_port="$(free_port)"  # --chat goes through the HTTP API
for b in coordinator/coordinator inference_rank/inference_rank cache_rank/cache_rank coordinator/spade_submit; do
  [ -x "$build/$b" ] || { echo "launch_local: $build/$b not built (cmake --build $build)" >&2; exit 2; }
done
[[ "$n_inf" =~ ^[1-9][0-9]*$ ]] || { echo "launch_local: --num-inference must be a count >= 1, got '$n_inf'" >&2; exit 2; }
[[ "$n_cache" =~ ^[1-9][0-9]*$ ]] && [ $((n_cache % n_inf)) -eq 0 ] || {
  echo "launch_local: --num-cache ($n_cache) must be a multiple N >= 1 of --num-inference ($n_inf): each inference" \
       "rank takes N cache ranks, its layer shards" >&2; exit 2; }
per_inf=$((n_cache / n_inf))  # N: cache #k serves inference #(k / N) as shard k mod N

port="${MASTER_PORT:-$(free_port)}"
world=$((1 + n_inf + n_cache))
export MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" WORLD_SIZE="$world"
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"
# A fresh cluster secret per launch (docs/DEPLOY.md, "Security model"), unless one is given: every process of the
# cluster (and spade_submit) reads it from this 0600 file and authenticates its control connection with it.
if [ -z "${SPADE_CLUSTER_SECRET_FILE:-}${SPADE_CLUSTER_SECRET:-}" ]; then
  rm -f "$logs/cluster.secret"
  (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$logs/cluster.secret")
  export SPADE_CLUSTER_SECRET_FILE="$logs/cluster.secret"
fi
pids=()
cleanup() {
  trap - EXIT INT TERM
  # Restarted cache ranks were started by the watchdog, which records them in restarted.pids.
  [ -f "$logs/restarted.pids" ] && mapfile -t -O "${#pids[@]}" pids <"$logs/restarted.pids"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.2
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'echo "launch_local: interrupted" >&2; exit 130' INT TERM

# Metrics ports (serve mode): inference #i 8100+i, cache #i 8200+i.
metrics_flag() { [ "$metrics" -eq 1 ] && [ $have_prompt -eq 0 ] && echo "--metrics-port $(($1 + $2))" || true; }
RANK=0 "$build/coordinator/coordinator" --port "$port" --num-inference "$n_inf" --num-cache "$n_cache" \
  --rendezvous-timeout-ms 60000 --model "$model" --http-port "$http_port" >"$logs/coordinator.log" 2>&1 &
pids+=($!)
for ((i = 0; i < n_inf; i++)); do
  RANK=$((1 + i)) "$build/inference_rank/inference_rank" --serve --model "$model" --num-inference "$n_inf" \
    --num-cache "$n_cache" --log-level info $(metrics_flag 8100 "$i") "${rank_flags[@]}" >"$logs/inference_$i.log" 2>&1 &
  pids+=($!)
done
# Cache rank #$1 in the background (its log appended to: a restart keeps the previous run's lines).
start_cache() {
  RANK=$((1 + n_inf + $1)) "$build/cache_rank/cache_rank" --model "$model" --num-inference "$n_inf" \
    --num-cache "$n_cache" $(metrics_flag 8200 "$1") "${cache_flags[@]}" >>"$logs/cache_$1.log" 2>&1 &
}
for ((i = 0; i < n_cache; i++)); do
  start_cache "$i"
  pids+=($!)
done

# Watchdog: the coordinator's or an inference rank's death takes the cluster (and this script) down. A cache rank's
# does not: its inference rank decodes every request densely (the dense fallback), and the cache rank is restarted
# with the same index (--restart-cache-rank times): the coordinator admits it as a replacement, the pair
# re-handshakes, and new requests decode sparsely again (docs/ARCHITECTURE.md, "Failure handling").
self=$$
( watched=("${pids[@]}")  # coordinator, inference #0..n_inf-1, cache #0..n_cache-1
  declare -A restarted=()
  while sleep 0.5; do
    for i in "${!watched[@]}"; do
      p="${watched[$i]}"
      kill -0 "$p" 2>/dev/null && continue
      if [ "$i" -gt "$n_inf" ]; then
        k=$((i - 1 - n_inf))
        r=${restarted[$k]:-0}
        if [ "$r" -lt "$restarts" ]; then
          restarted[$k]=$((r + 1))
          start_cache "$k"
          watched[$i]=$!
          echo "$!" >>"$logs/restarted.pids"
          echo "launch_local: cache rank #$k (pid $p) exited; restarted it as pid $! (restart $((r + 1)) of $restarts):" \
               "inference rank #$((k / per_inf)) serves densely until it rejoins (logs in $logs)" >&2
          continue
        fi
        echo "launch_local: cache rank #$k (pid $p) exited; inference rank #$((k / per_inf)) keeps serving, densely" \
             "(logs in $logs)" >&2
        unset "watched[$i]"
        continue
      fi
      echo "launch_local: a cluster process (pid $p) exited; tearing down (logs in $logs)" >&2
      kill -TERM "$self" 2>/dev/null; exit 0
    done
  done ) &
watchdog=$!

if [ $have_prompt -eq 0 ]; then
  # Serve until Ctrl-C (the INT trap exits; the EXIT trap stops every process) or a rank dies (the watchdog).
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$http_port/ready" >/dev/null 2>&1 && break
    sleep 0.1
  done
  echo "launch_local: serving $(basename "$model") on http://127.0.0.1:$http_port/v1 (metrics: /metrics; logs in $logs); Ctrl-C stops" >&2
  wait "$watchdog"
  exit 0
fi

set +e
if [ $chat -eq 0 ]; then
  "$build/coordinator/spade_submit" --master-addr 127.0.0.1 --master-port "$port" --prompt "$prompt" \
    --shutdown-after "${gen_flags[@]}"
  rc=$?
else
  # One streamed chat completion (stdlib Python); the text goes to stdout, the [spade] line as spade_submit's to stderr.
  python3 - "$http_port" "$prompt" "${gen_flags[@]}" <<'PY'
import http.client, json, sys, time
port, prompt, flags = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
names = {"--max-tokens": ("max_tokens", int), "--temperature": ("temperature", float), "--top-p": ("top_p", float),
         "--top-k": ("top_k", int), "--seed": ("seed", int)}
body = {"max_tokens": 128, "temperature": 0.0}  # spade_submit's defaults
for flag, value in zip(flags[::2], flags[1::2]):
    body[names[flag][0]] = names[flag][1](value)
def get(path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read()
deadline = time.monotonic() + 60
while True:  # the API answers once every rank has registered
    try:
        if get("/ready")[0] == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("launch_local: the cluster was not ready within 60 s")
    time.sleep(0.1)
body.update(model=json.loads(get("/v1/models")[1])["data"][0]["id"], messages=[{"role": "user", "content": prompt}],
            stream=True, stream_options={"include_usage": True})
c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
t0 = time.monotonic()
c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
r = c.getresponse()
if r.status != 200:
    sys.exit(f"launch_local: /v1/chat/completions answered {r.status}: {r.read().decode(errors='replace')}")
first = last = None
usage, rc = {}, 0
for raw in r:
    line = raw.decode().strip()
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        continue
    ev = json.loads(line[5:])
    if "error" in ev:
        print(f"launch_local: request failed: {ev['error'].get('message')}", file=sys.stderr)
        rc = 1
    for choice in ev.get("choices") or []:
        text = (choice.get("delta") or {}).get("content")
        if text:
            last = time.monotonic()
            first = first or last
            sys.stdout.write(text)
            sys.stdout.flush()
    usage = ev.get("usage") or usage
print()
n = usage.get("completion_tokens", 0)
print(f"[spade] prompt_tokens={usage.get('prompt_tokens', 0)} generated_tokens={n} "
      f"ttft_ms={(first - t0) * 1e3 if first else 0:.3f} "
      f"tpot_ms={(last - first) * 1e3 / (n - 1) if first and n > 1 else 0:.3f} "
      f"tokens_per_s={n / (last - t0) if first else 0:.1f}", file=sys.stderr)
sys.exit(rc)
PY
  rc=$?
  kill "$watchdog" 2>/dev/null || true
  kill -TERM "${pids[0]}" 2>/dev/null || true  # the coordinator shuts the cluster down (as --shutdown-after)
fi
set -e
kill "$watchdog" 2>/dev/null || true
# Let the ranks finish their clean shutdown and log their summaries.
for p in "${pids[@]}"; do
  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
done
grep -h "sparse sequence-steps\|updates," "$logs"/*.log >&2 || true
[ $rc -eq 0 ] || echo "launch_local: request failed; rank logs in $logs" >&2
exit $rc

#!/usr/bin/env bash
# The README's main command: builds Spade (installing missing Debian packages) and runs the disaggregated cluster on
# this host — coordinator + inference rank + cache rank as three processes, asynchronous token-level sparse decoding
# (AsyncSpade, --selection predicted) — through deploy/launch_local.sh.
#
# With no --model and no --prompt it runs the pass-key demo: the vendored trained model models/longctx-7m answers
# line N (--passkey-line N, default 1) of models/longctx-7m/passkey_demo.jsonl, sent as a chat user message, with a
# token budget far below the context; it prints the question, the answer and the expected key, and exits 0 on MATCH,
# 1 on NO MATCH, 2 when the cluster fails. Otherwise it only generates (text on stdout) with the given checkpoint /
# prompt. Any other argument goes to launch_local.sh:
#   deploy/run_demo.sh --passkey-line 3
#   deploy/run_demo.sh --model ../shared/data/models/stories260K --prompt "" --max-tokens 200
# Env: SPADE_BUILD_DIR (default build/; configured here only when it has no CMakeCache.txt), SPADE_JOBS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
jobs="${SPADE_JOBS:-$(nproc)}"
demo_model="$root/models/longctx-7m"
demo_prompts="$demo_model/passkey_demo.jsonl"

args=() ; passkey_line=""
while [ $# -gt 0 ]; do
  case "$1" in
    --passkey-line) passkey_line="${2:?--passkey-line needs a line number}"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
have() { for a in "${args[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
value() {  # value FLAG DEFAULT: the argument after the last FLAG in args
  local v="$2" i
  for ((i = 0; i + 1 < ${#args[@]}; i++)); do [ "${args[i]}" = "$1" ] && v="${args[i + 1]}"; done
  echo "$v"
}
passkey=0
if ! have --prompt && { ! have --model || [ -n "$passkey_line" ]; }; then passkey=1; fi
if [ -n "$passkey_line" ] && [ $passkey -eq 0 ]; then
  echo "run_demo: --passkey-line chooses the prompt; it does not go with --prompt" >&2; exit 2
fi

"$root/deploy/scripts/setup_deps.sh" >&2
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
[ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" "${gen[@]}" >&2
cmake --build "$build" -j "$jobs" --target inference_rank cache_rank coordinator spade_submit make_demo_checkpoint >&2

have --model || args+=(--model "$demo_model")
if [ $passkey -eq 0 ]; then
  # Plain generation with the given checkpoint / prompt.
  have --prompt || args+=(--prompt "Once upon a time")
  have --max-tokens || args+=(--max-tokens 96)
  have --selection || args+=(--selection predicted)
  have --sparse-threshold || args+=(--sparse-threshold 32)
  have --token-budget || args+=(--token-budget 32)
  have --layers-per-pack || args+=(--layers-per-pack 2)
  SPADE_BUILD_DIR="$build" exec "$root/deploy/launch_local.sh" "${args[@]}"
fi

# The pass-key demo.
n="${passkey_line:-1}"
lines=$(grep -c . "$demo_prompts")
[[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$lines" ] ||
  { echo "run_demo: --passkey-line must be 1..$lines ($demo_prompts)" >&2; exit 2; }
line="$(sed -n "${n}p" "$demo_prompts")"
field() { python3 -c 'import json, sys; sys.stdout.write(str(json.loads(sys.argv[1])[sys.argv[2]]))' "$line" "$1"; }
prompt="$(field prompt; printf x)"; prompt="${prompt%x}"
expect="$(field expect)"
question="$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["prompt"].rstrip().splitlines()[-1])' "$line")"
pbytes=$(printf %s "$prompt" | wc -c)
needles="$(field needles)"
have --chat || args+=(--chat)
have --max-tokens || args+=(--max-tokens 40)
have --temperature || args+=(--temperature 0)
have --selection || args+=(--selection predicted)
have --sparse-threshold || args+=(--sparse-threshold 256)
have --token-budget || args+=(--token-budget 128)
have --layers-per-pack || args+=(--layers-per-pack 2)
budget="$(value --token-budget 128)"

tmp="$(mktemp -d /tmp/spade-demo.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
model="$(value --model "$demo_model")"
echo "run_demo: pass-key prompt $n of ${demo_prompts#"$root"/}, ${model#"$root"/}, $(value --selection predicted)" \
  "selection, token budget $budget: generating (a CPU prefill of thousands of tokens takes a while)" >&2
set +e
SPADE_BUILD_DIR="$build" "$root/deploy/launch_local.sh" --prompt "$prompt" "${args[@]}" >"$tmp/answer" 2>"$tmp/log"
rc=$?
set -e
cat "$tmp/log" >&2
[ $rc -eq 0 ] || { echo "run_demo: the cluster failed (launch_local.sh exit $rc)" >&2; exit 2; }
answer="$(cat "$tmp/answer")"
ptok="$(sed -n 's/.*\[spade\] prompt_tokens=\([0-9]*\).*/\1/p' "$tmp/log" | tail -n 1)"
[ "$needles" = 1 ] && ns="needle" || ns="needles"
echo "question: $question   ($pbytes-byte prompt, $needles pass-key $ns; $(basename "$demo_prompts") line $n)"
if [ -n "$ptok" ] && [ "$ptok" -gt 0 ] && [ "$(value --selection predicted)" != dense ]; then
  # Per layer and KV head a decode step attends to the budget's tokens the cache rank selected + sinks + local window.
  frac="$(python3 -c 'import sys; b, p = map(int, sys.argv[1:]); print(f"{100 * b / p:.1f} % (1/{p / b:.0f})")' \
    "$budget" "$ptok")"
  sinks="$(value --sink-tokens 0)"
  [ "$sinks" = 0 ] && extra="" || extra="$sinks sink + "
  echo "sparse:   $ptok prompt tokens, token budget $budget = $frac per layer and KV head" \
    "(+ ${extra}$(value --local-window 32) recent tokens)"
fi
echo "answer:   $answer"
if [[ "$answer" == *"$expect"* ]]; then
  echo "expected: $expect  -> MATCH"
  exit 0
fi
echo "expected: $expect  -> NO MATCH"
exit 1

#!/usr/bin/env bash
# The README's main command: builds Spade (installing missing Debian packages), writes the embedded demo checkpoint
# (deterministic random weights, Qwen3 architecture) when no --model is given, and generates text with the
# disaggregated cluster on this host — coordinator + inference rank + cache rank as three processes, asynchronous
# token-level sparse decoding (AsyncSpade) — through deploy/launch_local.sh. Extra arguments go to launch_local.sh:
#   deploy/run_demo.sh --model ../shared/data/models/stories260K --prompt "" --max-tokens 200
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
jobs="${SPADE_JOBS:-$(nproc)}"

"$root/deploy/scripts/setup_deps.sh" >&2
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" >&2
cmake --build "$build" -j "$jobs" --target inference_rank cache_rank coordinator spade_submit make_demo_checkpoint >&2

args=("$@")
have() { for a in "${args[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
if ! have --model; then
  demo="$build/demo_model"
  [ -f "$demo/model.safetensors" ] || "$build/inference_rank/make_demo_checkpoint" --out "$demo" >&2
  args+=(--model "$demo")
  echo "run_demo: using the embedded demo checkpoint $demo (random weights: the text is noise; pass --model DIR)" >&2
fi
have --prompt || args+=(--prompt "Once upon a time")
have --max-tokens || args+=(--max-tokens 96)
have --selection || args+=(--selection predicted)
have --sparse-threshold || args+=(--sparse-threshold 32)
have --token-budget || args+=(--token-budget 32)
have --layers-per-pack || args+=(--layers-per-pack 2)
SPADE_BUILD_DIR="$build" exec "$root/deploy/launch_local.sh" "${args[@]}"

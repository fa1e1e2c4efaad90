#!/usr/bin/env bash
# The README's main command: builds Spade (installing missing Debian packages), writes the embedded demo checkpoint
# (deterministic random weights, Qwen3 architecture) when no --model is given, and generates text with
# inference_rank on the CPU. Extra arguments go to inference_rank, e.g.
#   deploy/run_demo.sh --model ../shared/data/models/stories260K --prompt "" --max-tokens 200
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
jobs="${SPADE_JOBS:-$(nproc)}"

"$root/deploy/scripts/setup_deps.sh" >&2
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" >&2
cmake --build "$build" -j "$jobs" --target inference_rank make_demo_checkpoint >&2

args=("$@")
have_model=0; have_prompt=0
for a in "${args[@]}"; do
  case "$a" in --model|--model=*) have_model=1 ;; --prompt|--prompt=*) have_prompt=1 ;; esac
done
if [ $have_model -eq 0 ]; then
  demo="$build/demo_model"
  [ -f "$demo/model.safetensors" ] || "$build/inference_rank/make_demo_checkpoint" --out "$demo"
  args+=(--model "$demo")
  echo "run_demo: using the embedded demo checkpoint $demo (random weights: the text is noise; pass --model DIR)" >&2
fi
[ $have_prompt -eq 1 ] || args+=(--prompt "Once upon a time")
[[ " ${args[*]} " == *" --max-tokens"* ]] || args+=(--max-tokens 64)
exec "$build/inference_rank/inference_rank" "${args[@]}"

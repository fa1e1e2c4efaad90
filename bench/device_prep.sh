#!/usr/bin/env bash
# Prepares build-device-deps/ on the development machine for a call on a lent GPU machine (carry
# ["build-device-deps"]; bench/run_gpu.sh reads it there):
#   deps.tar.xz          Spade's Debian build dependencies (bench/pack_device_deps.sh; made once)
#   shared-data.tar.xz   the parts of ../shared/data the gpu tests and benches read (configs, the models named by
#                        SPADE_DEVICE_MODELS, the Qwen2 tokenizer, the AIME24 and pass-key prompts): ../shared does not
#                        travel with the tree, and a device call carries at most 64 MiB, so only what a run needs
#   COMMIT               this checkout's commit (+ "-dirty" with uncommitted changes): the device's .git may be stale
#   FILES, TREE          the tracked files and a hash of their contents: run_gpu.sh trusts COMMIT only when the tree it
#                        runs on hashes the same (a COMMIT left over from an earlier device_prep is not used)
# Usage (repo root): bench/device_prep.sh        Environment: SPADE_DATA_DIR (default ../shared/data),
#   SPADE_DEVICE_MODELS (default "stories260K tiny-random-qwen3 tiny-random-qwen3_5": the gpu tests' models; longctx-7m,
#   the demo model, is in the repo under models/), SPADE_DEVICE_BIG_MODELS (default "longctx-22m"): packed apart, one
#   .tar.xz each in build-device-models/ (43 MB of bf16 weights, 31 MB packed: with the dependencies and the tree
#   they exceed a call's 64 MiB, so a second call on the still-warm machine carries ["build-device-models"]; run_gpu.sh unpacks
#   whatever is there into the data folder).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${ROOT}/build-device-deps"
DATA="${SPADE_DATA_DIR:-${ROOT}/../shared/data}"
mkdir -p "${OUT_DIR}"
[ -f "${OUT_DIR}/deps.tar.xz" ] || "${ROOT}/bench/pack_device_deps.sh"
[ -d "${DATA}/configs" ] || { echo "device_prep: no test data at ${DATA} (set SPADE_DATA_DIR)" >&2; exit 1; }
DATA="$(cd "${DATA}" && pwd)"
MODELS=()
for m in ${SPADE_DEVICE_MODELS:-stories260K tiny-random-qwen3 tiny-random-qwen3_5}; do
  [ -d "${DATA}/models/${m}" ] || { echo "device_prep: no model ${DATA}/models/${m}" >&2; exit 1; }
  MODELS+=("$(basename "${DATA}")/models/${m}")
done
tar -cJf "${OUT_DIR}/shared-data.tar.xz" -C "$(dirname "${DATA}")" --transform "s|^$(basename "${DATA}")|data|" \
  "$(basename "${DATA}")/README.md" "$(basename "${DATA}")/configs" "${MODELS[@]}" \
  "$(basename "${DATA}")/prompts/aime24.jsonl" "$(basename "${DATA}")/prompts/passkey_public.jsonl" \
  "$(basename "${DATA}")/prompts/heldout_code_py.txt" "$(basename "${DATA}")/tokenizers"
mkdir -p "${ROOT}/build-device-models"
for m in ${SPADE_DEVICE_BIG_MODELS-longctx-22m}; do
  [ -d "${DATA}/models/${m}" ] || { echo "device_prep: no model ${DATA}/models/${m}" >&2; exit 1; }
  [ -f "${ROOT}/build-device-models/${m}.tar.xz" ] || tar -cJf "${ROOT}/build-device-models/${m}.tar.xz" -C "${DATA}/models" "${m}"
done
commit="$(git -C "${ROOT}" rev-parse HEAD)"
[ -z "$(git -C "${ROOT}" status --porcelain --untracked-files=no)" ] || commit="${commit}-dirty"
echo "${commit}" >"${OUT_DIR}/COMMIT"
git -C "${ROOT}" ls-files >"${OUT_DIR}/FILES"
# The same function is in bench/run_gpu.sh.
tree_hash() { (cd "$1" && while IFS= read -r f; do [ -f "$f" ] && sha256sum "$f"; done <"$2" | sha256sum | cut -c1-64); }
tree_hash "${ROOT}" "${OUT_DIR}/FILES" >"${OUT_DIR}/TREE"
du -sh "${OUT_DIR}"/* "${ROOT}"/build-device-models/* 2>/dev/null | sed 's/^/device_prep: /'

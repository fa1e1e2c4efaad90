#!/usr/bin/env bash
# Prepares build-device-deps/ on the development machine for a call on a lent GPU machine (carry
# ["build-device-deps"]; bench/run_gpu.sh reads it there):
#   deps.tar.gz          Spade's Debian build dependencies (bench/pack_device_deps.sh; made once)
#   shared-data.tar.xz   the parts of ../shared/data the gpu tests and benches read (configs, tiny models,
#                        the Qwen2 tokenizer, the AIME24 prompts): ../shared does not travel with the tree
#   COMMIT               this checkout's commit (+ "-dirty" with uncommitted changes): the device's .git may be stale
#   FILES, TREE          the tracked files and a hash of their contents: run_gpu.sh trusts COMMIT only when the tree it
#                        runs on hashes the same (a COMMIT left over from an earlier device_prep is not used)
# Usage (repo root): bench/device_prep.sh        Environment: SPADE_DATA_DIR (default ../shared/data).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${ROOT}/build-device-deps"
DATA="${SPADE_DATA_DIR:-${ROOT}/../shared/data}"
mkdir -p "${OUT_DIR}"
[ -f "${OUT_DIR}/deps.tar.gz" ] || "${ROOT}/bench/pack_device_deps.sh"
[ -d "${DATA}/configs" ] || { echo "device_prep: no test data at ${DATA} (set SPADE_DATA_DIR)" >&2; exit 1; }
DATA="$(cd "${DATA}" && pwd)"
tar -cJf "${OUT_DIR}/shared-data.tar.xz" -C "$(dirname "${DATA}")" --transform "s|^$(basename "${DATA}")|data|" \
  "$(basename "${DATA}")/README.md" "$(basename "${DATA}")/configs" "$(basename "${DATA}")/models" \
  "$(basename "${DATA}")/prompts/aime24.jsonl" "$(basename "${DATA}")/tokenizers"
commit="$(git -C "${ROOT}" rev-parse HEAD)"
[ -z "$(git -C "${ROOT}" status --porcelain --untracked-files=no)" ] || commit="${commit}-dirty"
echo "${commit}" >"${OUT_DIR}/COMMIT"
git -C "${ROOT}" ls-files >"${OUT_DIR}/FILES"
# The same function is in bench/run_gpu.sh.
tree_hash() { (cd "$1" && while IFS= read -r f; do [ -f "$f" ] && sha256sum "$f"; done <"$2" | sha256sum | cut -c1-64); }
tree_hash "${ROOT}" "${OUT_DIR}/FILES" >"${OUT_DIR}/TREE"
du -sh "${OUT_DIR}"/* | sed 's/^/device_prep: /'

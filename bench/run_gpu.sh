#!/usr/bin/env bash
# THE GPU script: configures and builds Spade on a GPU machine, runs the gpu-labelled tests (ctest -L gpu),
# compute-sanitizer memcheck on the kernel test binaries, the kernel benchmarks and the PyTorch SDPA peer, and writes
# JSON + logs to $OUT (default bench/results/run-<UTC date>) and copies the JSON to bench/results/.
#
# Usage (repo root):  bench/run_gpu.sh [all|build|test|memcheck|racecheck|bench|profile]...   (default: all =
#                     build test memcheck racecheck bench; "profile" (Nsight Compute on the main kernels) is opt-in)
# Environment:
#   OUT                   output folder (the device tool's $OUT when run there)
#   SPADE_GPU_BUILD_DIR   build folder (default build-gpu)
#   SPADE_COMMIT          commit id recorded in the JSON (default: git rev-parse HEAD, else a hash of the sources)
#   SPADE_BENCH_QUICK=1   fewer benchmark shapes
#   SPADE_BENCH_SWEEP=1   also time the paged decode at forced split counts
#   SPADE_BENCH_SWEEP_HPC=1  also time the paged decode at forced (KV heads per CTA, split count) pairs
#   SPADE_PREBUILT_DIR    folder with prebuilt kernels_test_*_gpu and bench_kernels binaries (e.g. built on the
#                         development machine and carried): test / memcheck / bench use them, the build step is
#                         skipped unless "bgbuild" is asked for (a low-priority build in the background, checked at
#                         the end, so the device build is still verified while the prebuilt binaries run)
#   SPADE_CTEST_REGEX     only the gpu tests whose ctest name matches (ctest -R; default: all); the build builds those
#   SPADE_CTEST_EXCLUDE   leave out the gpu tests whose ctest name matches (ctest -E)
#   SPADE_CTEST_TIMEOUT   per-test timeout of the gpu tests in seconds (default 1800; set at configure time as
#                         SPADE_GPU_TEST_TIMEOUT, the tests' TIMEOUT property, which ctest --timeout cannot override)
#   SPADE_BENCHES         benchmarks to run (default "kernels gdn": bench_kernels + SDPA peer, bench_gdn; "tpot":
#                         bench_tpot, the issue-#7 TPOT table -- dense / oracle on GPU 0, AsyncSpade over GPUs 0+1
#                         (on a one-GPU machine both ranks on GPU 0 over CUDA IPC), with and without delta transfer)
#                         "serve": inference_rank --device cuda dense vs --selection predicted (in-process GPU
#                         cache rank), TPOT lines in serve_demo.txt
#                         "samples": bench_samples, n = 8 samples of one 8k prompt against 8 separate requests on
#                         the GPU pair (one GPU, the cache rank in this process; Qwen3-8B shape, random weights)
#                         "fidelity": pass-key accuracy of the GPU path on the trained long-context models
#                         (bench/fidelity/passkey_gpu.py; SPADE_FIDELITY_MODELS, SPADE_FIDELITY_BUDGETS,
#                         SPADE_FIDELITY_ARGS)
#   SPADE_TPOT_ARGS       extra bench_tpot arguments for every configuration (e.g. "--steps 64")
#   SPADE_TPOT_NO_INT8    set: leave out the int8-scoring-keys run of 8b-b8 / 8b-b8-solo (--score-keys int8, P 12)
#   SPADE_TPOT_CHURN      the selection churn of the async rows (bench_tpot --churn; default 0.313, the testbed's;
#                         0: the random model's own)
#   SPADE_TPOT_CONFIGS    which bench_tpot configurations (default with two GPUs "8b-b8 8b-b16 8b-b32 32b-b8"; one GPU
#                         "8b-b8-solo 8b-b16-solo 8b-b8-16k-ipc": dense / oracle baselines, each async rank alone
#                         (the projection of the two-GPU table) and both ranks over CUDA IPC; also "8b-b8-1gpu";
#                         with four GPUs "8b-b8-shards 8b-b32-shards 8b-b48-shards": one inference rank over
#                         N = 1, 2, 3 cache ranks (--cache-ranks))
#   SPADE_MEMCHECK_FILTER gtest filter under compute-sanitizer (default: skip the *Long* cases, which only repeat
#                         the same code paths at 128k tokens and take minutes under the sanitizer)
# Dependencies: on a machine without Spade's Debian packages (the lent GPU machines), carry build-device-deps/
# (made by bench/device_prep.sh: the packages via bench/pack_device_deps.sh, the test data, the commit id); the
# packages are unpacked into a private prefix, never into /, the data into /tmp/spade-data.
# A device call (the tool's run, carry ["build-device-deps"]):   bench/run_gpu.sh build test bench
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-${ROOT}/bench/results/run-$(date -u +%Y%m%dT%H%M%SZ)}"
BUILD="${SPADE_GPU_BUILD_DIR:-${ROOT}/build-gpu}"
mkdir -p "${OUT}" "${ROOT}/bench/results"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(all)
want() {
  for s in "${STEPS[@]}"; do
    if [ "$s" = "$1" ] || { [ "$s" = all ] && [ "$1" != profile ]; }; then return 0; fi
  done
  return 1
}
log() { echo "[run_gpu $(date -u +%H:%M:%S)] $*"; }
STATUS=0
CTEST_R=()
[ -n "${SPADE_CTEST_REGEX:-}" ] && CTEST_R=(-R "${SPADE_CTEST_REGEX}")
[ -n "${SPADE_CTEST_EXCLUDE:-}" ] && CTEST_R+=(-E "${SPADE_CTEST_EXCLUDE}")
# Tests labelled gpu2 need two GPUs (NCCL across processes); on a one-GPU machine they are left out, loudly.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${NGPU:-0}" -lt 2 ]; then
  CTEST_R+=(-LE gpu2)
  echo "[run_gpu] ${NGPU:-0} GPU(s): tests labelled gpu2 (two GPUs) are NOT run here; run on nvidia-h200-x2"
fi
BENCHES="${SPADE_BENCHES:-kernels gdn}"
bench_wanted() { case " ${BENCHES} " in *" $1 "*) return 0 ;; esac; return 1; }

# The device copy of the tree may carry a stale .git: bench/device_prep.sh records the development machine's commit.
# The same function is in bench/device_prep.sh.
tree_hash() { (cd "$1" && while IFS= read -r f; do [ -f "$f" ] && sha256sum "$f"; done <"$2" | sha256sum | cut -c1-64); }
DEPDIR="${ROOT}/build-device-deps"
if [ -z "${SPADE_COMMIT:-}" ] && [ -f "${DEPDIR}/COMMIT" ]; then
  if [ -f "${DEPDIR}/FILES" ] && [ "$(tree_hash "${ROOT}" "${DEPDIR}/FILES")" = "$(cat "${DEPDIR}/TREE" 2>/dev/null)" ]; then
    SPADE_COMMIT="$(cat "${DEPDIR}/COMMIT")"
  else
    echo "[run_gpu] build-device-deps/COMMIT does not describe this tree (run bench/device_prep.sh after committing)"
    SPADE_COMMIT="unknown-stale-device-prep-of-$(cat "${DEPDIR}/COMMIT")"
  fi
fi
# Test data: ../shared/data does not travel to the device; bench/device_prep.sh packs what the tests and benches read.
if [ -z "${SPADE_DATA_DIR:-}" ] && [ ! -d "${ROOT}/../shared/data" ] && [ -f "${ROOT}/build-device-deps/shared-data.tar.xz" ]; then
  mkdir -p /tmp/spade-data && tar -xJf "${ROOT}/build-device-deps/shared-data.tar.xz" -C /tmp/spade-data
  export SPADE_DATA_DIR=/tmp/spade-data/data
  echo "[run_gpu] test data from build-device-deps/shared-data.tar.xz (SPADE_DATA_DIR=${SPADE_DATA_DIR})"
fi
# Models packed apart by device_prep.sh (build-device-models/NAME.tar.xz, carried beside build-device-deps):
# unpacked into the data folder when it does not have them.
for t in "${ROOT}"/build-device-models/*.tar "${ROOT}"/build-device-models/*.tar.xz; do
  [ -f "$t" ] || continue
  m="$(basename "$(basename "$t" .xz)" .tar)"
  if [ -n "${SPADE_DATA_DIR:-}" ] && [ ! -d "${SPADE_DATA_DIR}/models/${m}" ]; then
    tar -xf "$t" -C "${SPADE_DATA_DIR}/models" && echo "[run_gpu] model ${m} from ${t}"
  fi
done
if [ -z "${SPADE_COMMIT:-}" ]; then
  SPADE_COMMIT="$(git -C "${ROOT}" rev-parse --verify -q HEAD 2>/dev/null || true)"
  if [ -n "${SPADE_COMMIT}" ] && [ -n "$(git -C "${ROOT}" status --porcelain -- kernels bench tests/kernels 2>/dev/null)" ]; then
    SPADE_COMMIT="${SPADE_COMMIT}+uncommitted-kernels-changes"
  fi
  if [ -z "${SPADE_COMMIT}" ]; then
    SPADE_COMMIT="uncommitted-src-sha256:$(cd "${ROOT}" && find kernels bench tests/kernels -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' -o -name '*.py' -o -name '*.sh' -o -name '*.cmake' -o -name 'CMakeLists.txt' \) | sort | xargs cat | sha256sum | cut -c1-16)"
  fi
fi
export SPADE_COMMIT
log "commit ${SPADE_COMMIT}; out ${OUT}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1 || true

# ---- private dependency prefix (lent GPU machines lack Spade's -dev packages) ----
DEPLIB=""
if [ -f "${ROOT}/build-device-deps/deps.tar.xz" ] && ! pkg-config --exists libpcre2-8 2>/dev/null; then
  DEPS=/tmp/spade-deps
  if [ ! -d "${DEPS}/usr" ]; then
    mkdir -p "${DEPS}" && tar -xJf "${ROOT}/build-device-deps/deps.tar.xz" -C "${DEPS}"
    sed -i "s|^prefix=/usr|prefix=${DEPS}/usr|" "${DEPS}"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc 2>/dev/null || true
  fi
  export CMAKE_PREFIX_PATH="${DEPS}/usr${CMAKE_PREFIX_PATH:+:${CMAKE_PREFIX_PATH}}"
  export PKG_CONFIG_PATH="${DEPS}/usr/lib/x86_64-linux-gnu/pkgconfig:${DEPS}/usr/share/pkgconfig"
  export PATH="${PATH}:${DEPS}/usr/bin"
  DEPLIB="${DEPS}/usr/lib/x86_64-linux-gnu"
  log "using carried dependency prefix ${DEPS}"
fi
with_deps() { if [ -n "${DEPLIB}" ]; then LD_LIBRARY_PATH="${DEPLIB}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" "$@"; else "$@"; fi; }

# ---- configure + build ----
do_build() {
  log "configure"
  with_deps cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPADE_ENABLE_CUDA=ON \
    -DSPADE_ENABLE_UCX=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DSPADE_GPU_TEST_TIMEOUT="${SPADE_CTEST_TIMEOUT:-1800}" >"${OUT}/build.log" 2>&1 || { tail -40 "${OUT}/build.log"; exit 1; }
  # The build targets of the selected gpu tests (bench/gpu_test_targets.py: also on a fresh build folder, and for a
  # ctest entry that runs another entry's binary with a gtest filter).
  GPU_TESTS=$(cd "${BUILD}" && ctest --show-only=json-v1 -L gpu ${CTEST_R[@]+"${CTEST_R[@]}"} |
    python3 "${ROOT}/bench/gpu_test_targets.py") || { log "cannot list the gpu test targets"; return 1; }
  log "build: bench_kernels bench_gdn bench_tpot bench_samples ${GPU_TESTS//$'\n'/ }"
  # shellcheck disable=SC2086
  with_deps cmake --build "${BUILD}" -j "$(nproc)" --target bench_kernels bench_gdn bench_tpot bench_samples ${GPU_TESTS} >>"${OUT}/build.log" 2>&1 \
    || { grep -E "error|FAILED" "${OUT}/build.log" | head -40; return 1; }
  log "build done"
}
PREBUILT="${SPADE_PREBUILT_DIR:-}"
BG_BUILD_PID=""
if [ -n "${PREBUILT}" ]; then
  log "using prebuilt binaries from ${PREBUILT}"
  TEST_BINS=("${PREBUILT}"/kernels_test_*_gpu)
  BENCH_BIN="${PREBUILT}/bench_kernels"
  if want bgbuild; then
    (nice -n 19 bash -c "$(declare -f log with_deps do_build); OUT='${OUT}' BUILD='${BUILD}' ROOT='${ROOT}' DEPLIB='${DEPLIB}' do_build" \
      >/dev/null 2>&1) &
    BG_BUILD_PID=$!
  fi
else
  if want build; then do_build || exit 1; fi
  TEST_BINS=()
  for t in "${BUILD}"/tests/kernels/kernels_test_*_gpu; do
    if [ -z "${SPADE_CTEST_REGEX:-}" ] || [[ "$(basename "$t")" =~ ${SPADE_CTEST_REGEX} ]]; then TEST_BINS+=("$t"); fi
  done
  BENCH_BIN="${BUILD}/bench/bench_kernels"
fi

# ---- gpu tests ----
if want test; then
  if [ -z "${PREBUILT}" ]; then
    log "ctest -L gpu"
    (cd "${BUILD}" && with_deps ctest -L gpu ${CTEST_R[@]+"${CTEST_R[@]}"} --output-on-failure) \
      >"${OUT}/tests.log" 2>&1 || STATUS=1
    grep -E "tests passed|Passed|Failed|\*\*\*|Total Test" "${OUT}/tests.log" | tail -30
  else
    : >"${OUT}/tests.log"
    for t in "${TEST_BINS[@]}"; do
      log "test $(basename "$t")"
      with_deps "$t" >>"${OUT}/tests.log" 2>&1
      rc=$?
      echo "== $(basename "$t") rc=${rc}" | tee -a "${OUT}/tests.log"
      [ $rc -eq 0 ] || STATUS=1
    done
    grep -E "^\[  (PASSED|FAILED) |^\[       OK|FAILED  \]" "${OUT}/tests.log" | tail -60
  fi
fi

# Number of tests of binary $1 that gtest filter $2 selects (sanitizers fail on a binary that runs none).
count_tests() { with_deps "$1" --gtest_list_tests --gtest_filter="$2" 2>/dev/null | grep -c '^  '; }

# compute-sanitizer tool $1 on every kernel test binary with a test that gtest filter $2 selects; the options after
# $2 go to compute-sanitizer. Output in ${OUT}/$1.log; a failing binary sets STATUS=1.
sanitize() {
  local tool="$1" filter="$2" t rc
  shift 2
  : >"${OUT}/${tool}.log"
  log "${tool} --gtest_filter=${filter}"
  for t in "${TEST_BINS[@]}"; do
    [ -x "$t" ] || continue
    [ "$(count_tests "$t" "${filter}")" -gt 0 ] || { log "${tool} $(basename "$t"): no test matches, skipped"; continue; }
    log "${tool} $(basename "$t")"
    with_deps compute-sanitizer --tool "${tool}" --error-exitcode 97 "$@" "$t" --gtest_filter="${filter}" \
      >>"${OUT}/${tool}.log" 2>&1
    rc=$?
    echo "== $(basename "$t") ${tool} rc=${rc}" | tee -a "${OUT}/${tool}.log"
    [ $rc -eq 0 ] || STATUS=1
  done
}

# ---- compute-sanitizer memcheck on the kernel test binaries ----
if want memcheck; then
  sanitize memcheck "${SPADE_MEMCHECK_FILTER:--*Long*}" --leak-check full
  grep -E "ERROR SUMMARY|memcheck rc" "${OUT}/memcheck.log"
fi

# ---- compute-sanitizer racecheck (shared-memory hazards) on a subset of the kernel tests ----
if want racecheck; then
  sanitize racecheck "${SPADE_RACECHECK_FILTER:-PagedDecodeGpu.MatchesReference/*_splits64:PagedDecodeGpu.MatchesReference/fp16_D128_page32_hkv2_group8_*:SparsePackedDecodeGpu.*:PagedPrefillGpu.MatchesReference/bf16_D256_*:PredictGpu.*:TopkGpu.MatchesReference/*_levels16_specials:ScoreGpu.MatchesReference/fp16_D64_*:DeltaGpu.StreamMatchesReference/rows40_k512_cap37_*:DeltaGpu.Refuses*:Gdn*_tilegroups2:GdnParallelVerifyGpu.MatchesReference/bf16_k2_v2_dk64_dv64_drafts2_*:GdnChunkwiseGpu.MatchesReference/*_seqs5_steps40_ragged}"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|racecheck rc" "${OUT}/racecheck.log"
fi

# ---- the background device build must finish before timing (CPU contention delays launches) ----
if [ -n "${BG_BUILD_PID}" ]; then
  log "waiting for the background device build"
  wait "${BG_BUILD_PID}" && log "background device build OK" || { log "background device build FAILED"; STATUS=1; }
  tail -3 "${OUT}/build.log"
fi

# ---- benchmarks + SDPA peer ----
if want bench; then
  QUICK=()
  [ "${SPADE_BENCH_QUICK:-0}" = 1 ] && QUICK=(--quick)
  SWEEP=()
  [ "${SPADE_BENCH_SWEEP:-0}" = 1 ] && SWEEP=(--sweep)
  [ "${SPADE_BENCH_SWEEP_HPC:-0}" = 1 ] && SWEEP+=(--sweep-hpc)
  if bench_wanted gdn; then
    GDN_BIN="$(dirname "${BENCH_BIN}")/bench_gdn"
    log "bench_gdn"
    with_deps "${GDN_BIN}" --out "${OUT}/bench_gdn.json" "${QUICK[@]}" | tee "${OUT}/bench_gdn.txt" || STATUS=1
    [ -f "${OUT}/bench_gdn.json" ] && cp "${OUT}/bench_gdn.json" "${ROOT}/bench/results/bench_gdn-$(date -u +%Y%m%dT%H%M%SZ).json"
  fi
fi
if want bench && bench_wanted tpot; then
  TPOT_BIN="$(dirname "${BENCH_BIN}")/bench_tpot"
  DATA="${SPADE_DATA_DIR:-${ROOT}/../shared/data}"
  read -r -a TPOT_EXTRA <<<"${SPADE_TPOT_ARGS:-}"
  # Two GPUs: the issue-#7 table; one GPU: the baselines with each async rank alone (the projection of that table)
  # and the pipeline with both ranks on the GPU over CUDA IPC.
  if [ "${NGPU:-0}" -ge 2 ]; then TPOT_DEFAULT="8b-b8 8b-b16 8b-b32 32b-b8"; else TPOT_DEFAULT="8b-b8-solo 8b-b16-solo 8b-b8-16k-ipc"; fi
  # The selection churn every async row runs at (bench_tpot --churn): the trained testbed's, about a third of the
  # selection entering per step (docs/FIDELITY.md, the GPU teacher-forced table: 0.313 at budget 1/16); the delta
  # capacity is the serving default at that churn, half the budget (docs/FIDELITY.md, "Delta capacity at the
  # measured churn"). SPADE_TPOT_CHURN=0 runs at the random model's own churn (about 0.9).
  CHURN=(--churn "${SPADE_TPOT_CHURN:-0.313}")
  [ "${SPADE_TPOT_CHURN:-0.313}" = 0 ] && CHURN=()
  for c in ${SPADE_TPOT_CONFIGS:-${TPOT_DEFAULT}}; do
    # int8: a second run of the configuration with the cache rank scoring the compact int8 keys (--score-keys int8),
    # at its best pack size (later flags override the first run's).
    int8=()
    case "$c" in
      8b-b8) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b8-32k --batch 8 --context 32768 --budget 2048 --packs 4,6,12 --delta-capacity 0,1024)
        int8=(--modes async --packs 12 --score-keys int8) ;;
      8b-b16) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b16-16k --batch 16 --context 16384 --budget 1024 --packs 6 --delta-capacity 0,512) ;;
      8b-b32) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b32-8k --batch 32 --context 8192 --budget 1024 --packs 12 --delta-capacity 0,512 --modes dense,async) ;;
      32b-b8) args=(--config "${DATA}/configs/qwen3-32b" --label qwen3-32b-b8-32k --batch 8 --context 32768 --budget 2048 --packs 8 --delta-capacity 0,1024) ;;
      # One-GPU variants (nvidia-h100-x1): the 32k baselines (dense, oracle) fit beside the weights; the async
      # pipeline holds the KV twice on one GPU (inference rank + cache rank), so it runs at 16k over CUDA IPC.
      8b-b8-1gpu) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b8-32k-1gpu --batch 8 --context 32768 --budget 2048 --modes dense,oracle) ;;
      8b-b8-16k-ipc) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b8-16k-ipc --batch 8 --context 16384 --budget 1024 --packs 6 --delta-capacity 0,512 --link ipc) ;;
      # Each async rank alone on GPU 0 (--modes solo, null link) beside the dense / oracle baselines: the one-GPU
      # projection of the two-GPU table (max of the two ranks' step times; a lower bound, the link's cost left out).
      8b-b8-solo) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b8-32k-solo --batch 8 --context 32768 --budget 2048 --packs 4,6,12 --delta-capacity 0,1024 --modes dense,oracle,solo)
        int8=(--modes solo --packs 12 --score-keys int8) ;;
      8b-b16-solo) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b16-16k-solo --batch 16 --context 16384 --budget 1024 --packs 6 --delta-capacity 0,512 --modes dense,oracle,solo) ;;
      # One inference rank over N = 1, 2, 3 cache ranks (GPUs 1..N; four GPUs: nvidia-h200-x4): layer packs round
      # robin over the cache ranks, each holding its packs' layers. P 6 splits the 36 layers evenly over 2 and 3.
      8b-b8-shards) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b8-32k-shards --batch 8 --context 32768 --budget 2048 --packs 6,12 --delta-capacity 1024 --modes dense,async --cache-ranks 1,2,3 --score-keys bf16,int8) ;;
      8b-b32-shards) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b32-8k-shards --batch 32 --context 8192 --budget 1024 --packs 6,12 --delta-capacity 512 --modes dense,async --cache-ranks 1,2,3 --score-keys bf16,int8) ;;
      # A batch whose KV (every layer) outgrows one GPU: dense and N = 1 report the bytes they would need.
      8b-b48-shards) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b48-32k-shards --batch 48 --context 32768 --budget 2048 --packs 6 --delta-capacity 1024 --modes dense,async --cache-ranks 1,2,3 --score-keys int8,bf16) ;;
      # The same on 80 GB GPUs (nvidia-h100-x4): B24 32k is 117 GB of KV.
      8b-b24-shards) args=(--config "${DATA}/configs/qwen3-8b" --label qwen3-8b-b24-32k-shards --batch 24 --context 32768 --budget 2048 --packs 6 --delta-capacity 1024 --modes dense,async --cache-ranks 1,2,3 --score-keys int8,bf16) ;;
      *) log "unknown SPADE_TPOT_CONFIGS entry $c"; STATUS=1; continue ;;
    esac
    log "bench_tpot $c"
    with_deps "${TPOT_BIN}" "${args[@]}" "${CHURN[@]}" "${TPOT_EXTRA[@]}" --out "${OUT}/bench_tpot.jsonl" | tee -a "${OUT}/bench_tpot.txt" \
      || STATUS=1
    if [ "${#int8[@]}" -gt 0 ] && [ -z "${SPADE_TPOT_NO_INT8:-}" ]; then
      log "bench_tpot $c (int8 scoring keys)"
      with_deps "${TPOT_BIN}" "${args[@]}" "${int8[@]}" "${CHURN[@]}" "${TPOT_EXTRA[@]}" --out "${OUT}/bench_tpot.jsonl" \
        | tee -a "${OUT}/bench_tpot.txt" || STATUS=1
    fi
  done
  [ -f "${OUT}/bench_tpot.jsonl" ] && cp "${OUT}/bench_tpot.jsonl" "${ROOT}/bench/results/bench_tpot-$(date -u +%Y%m%dT%H%M%SZ).jsonl"
fi
# "samples": n samples of one prompt against n separate requests on the GPU pair (bench/bench_samples.cpp): TTFT,
# decode throughput, each rank's peak KV, the tokens shipped to the cache rank.
if want bench && bench_wanted samples; then
  SAMPLES_BIN="$(dirname "${BENCH_BIN}")/bench_samples"
  DATA="${SPADE_DATA_DIR:-${ROOT}/../shared/data}"
  log "bench_samples"
  with_deps "${SAMPLES_BIN}" --config "${DATA}/configs/qwen3-8b" --label qwen3-8b-8k-n8 --prompt 8192 --samples 8 \
    --tokens 128 --token-budget 512 --out "${OUT}/bench_samples.jsonl" | tee -a "${OUT}/bench_samples.txt" || STATUS=1
  [ -f "${OUT}/bench_samples.jsonl" ] && cp "${OUT}/bench_samples.jsonl" "${ROOT}/bench/results/bench_samples-$(date -u +%Y%m%dT%H%M%SZ).jsonl"
fi
# "serve": the inference rank's own GPU path end to end (inference_rank --device cuda, Qwen3-8B shape with random
# weights, 8 long prompts, 1024 generated tokens each): dense, then AsyncSpade with the GPU cache rank in the same
# process (cache_rank/gpu_local.h). The TPOT / tokens/s lines of both go to serve_demo.txt, the whole logs to
# serve.log. One GPU shared by both
# ranks: a functional end-to-end run, not the overlap measurement (bench_tpot is).
if want bench && bench_wanted serve; then
  IR_BIN="${BUILD}/inference_rank/inference_rank"
  DATA="${SPADE_DATA_DIR:-${ROOT}/../shared/data}"
  PROMPT="$(python3 -c 'import json,sys; print(" ".join(json.loads(l)["problem"] for l in list(open(sys.argv[1]))[:12]))' "${DATA}/prompts/aime24.jsonl" 2>/dev/null || echo "Solve the following problem step by step.")"
  demo=(--model "${DATA}/configs/qwen3-8b" --random-weights --tokenizer "${DATA}/tokenizers/qwen2" --device cuda
        --max-tokens 1024 --ignore-eos --temperature 0 --max-num-seqs 8 --max-num-batched-tokens 2048 --kv-cache-gib 8 --log-level info)
  for i in 1 2 3 4 5 6 7 8; do demo+=(--prompt "${PROMPT}"); done
  { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) | $(date -u +%Y-%m-%dT%H:%MZ) | commit ${SPADE_COMMIT}"
    echo "# inference_rank ${demo[*]//"${PROMPT}"/<prompt>} --sparse-threshold 512 --token-budget 256 --local-window 64 --delta-capacity 64"; } >"${OUT}/serve_demo.txt"
  : >"${OUT}/serve.log"
  for sel in dense predicted; do
    log "inference_rank --device cuda --selection ${sel}"
    with_deps "${IR_BIN}" "${demo[@]}" --selection "${sel}" --sparse-threshold 512 --token-budget 256 \
      --local-window 64 --delta-capacity 64 2>&1 >/dev/null | sed "s/^/${sel}: /" | tee -a "${OUT}/serve.log" \
      | grep -E ': \[spade\]|error' | tee -a "${OUT}/serve_demo.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || STATUS=1
  done
fi
# "fidelity": pass-key accuracy of the GPU path (bf16) on the trained long-context models (bench/fidelity/
# passkey_gpu.py over inference_rank --device cuda): every public prompt, dense and the predicted variants at absolute
# and fractional budgets, and the delta capacity's effect. SPADE_FIDELITY_MODELS (default "longctx-22m longctx-7m").
if want bench && bench_wanted fidelity; then
  IR_BIN="${BUILD}/inference_rank/inference_rank"
  stamp="$(date -u +%Y%m%dT%H%M%SZ)"
  for m in ${SPADE_FIDELITY_MODELS:-longctx-22m longctx-7m}; do
    mdir="${SPADE_DATA_DIR:-${ROOT}/../shared/data}/models/${m}"
    [ -d "${mdir}" ] || mdir="${ROOT}/models/${m}"
    log "passkey_gpu ${m}"
    with_deps env SPADE_COMMIT="${SPADE_COMMIT}" python3 "${ROOT}/bench/fidelity/passkey_gpu.py" --inference-rank "${IR_BIN}" \
      --model "${mdir}" --budgets "${SPADE_FIDELITY_BUDGETS:-64,128,256,512,1024,1/8,1/16,1/32,1/64}" \
      ${SPADE_FIDELITY_ARGS:-} --json-out "${OUT}/passkey_gpu-${m}.json" --md-out "${OUT}/passkey_gpu-${m}.md" \
      2>&1 | tee -a "${OUT}/passkey_gpu.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || STATUS=1
    for f in json md; do
      [ -f "${OUT}/passkey_gpu-${m}.${f}" ] && cp "${OUT}/passkey_gpu-${m}.${f}" "${ROOT}/bench/results/passkey_gpu-${m}-${stamp}.${f}"
    done
  done
fi
if want bench && bench_wanted kernels; then
  QUICK=()
  [ "${SPADE_BENCH_QUICK:-0}" = 1 ] && QUICK=(--quick)
  SWEEP=()
  [ "${SPADE_BENCH_SWEEP:-0}" = 1 ] && SWEEP=(--sweep)
  [ "${SPADE_BENCH_SWEEP_HPC:-0}" = 1 ] && SWEEP+=(--sweep-hpc)
  log "bench_kernels"
  with_deps "${BENCH_BIN}" --out "${OUT}/bench_kernels.json" "${QUICK[@]}" "${SWEEP[@]}" || STATUS=1
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv 2>&1 || true
  log "sdpa peer"
  PYTHONUNBUFFERED=1 python3 "${ROOT}/bench/sdpa_peer.py" --out "${OUT}/sdpa_peer.json" "${QUICK[@]}" || STATUS=1
  if [ -f "${OUT}/bench_kernels.json" ]; then
    python3 "${ROOT}/bench/report.py" "${OUT}/bench_kernels.json" "${OUT}/sdpa_peer.json" \
      --json "${OUT}/summary.json" >"${OUT}/summary.md" && cat "${OUT}/summary.md"
    stamp="$(date -u +%Y%m%dT%H%M%SZ)"
    for f in bench_kernels sdpa_peer summary; do
      [ -f "${OUT}/${f}.json" ] && cp "${OUT}/${f}.json" "${ROOT}/bench/results/${f}-${stamp}.json"
    done
  fi
fi
# ---- Nsight Compute on the main kernels (first launch of each; opt-in) ----
if want profile; then
  : >"${OUT}/ncu.txt"
  for k in decode_kernel score_kernel predict_kernel topk_kernel gather_kernel prefill_kernel; do
    log "ncu ${k}"
    with_deps ncu --kernel-name "regex:${k}" --launch-count 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
      "${BENCH_BIN}" --out /tmp/ncu_bench.json --iters 50 --warmup 1 --quick --only selection,prefill,decode \
      >>"${OUT}/ncu.txt" 2>&1 || STATUS=1
  done
fi
log "done, status ${STATUS}"
exit ${STATUS}

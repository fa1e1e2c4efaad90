#!/usr/bin/env bash
# Builds Spade and runs the test suite: the README's test command, and what CI runs (.ci/run).
#   deploy/run_tests.sh [extra ctest args]
# Env: SPADE_BUILD_DIR (default build), SPADE_DATA_DIR (default ../shared/data beside the repo),
#      SPADE_JOBS (default nproc), SPADE_CMAKE_ARGS (extra configure flags).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPADE_BUILD_DIR:-$root/build}"
jobs="${SPADE_JOBS:-$(nproc)}"
export SPADE_DATA_DIR="${SPADE_DATA_DIR:-$root/../shared/data}"

"$root/deploy/scripts/setup_deps.sh"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" "${gen[@]}" -DSPADE_WERROR=ON ${SPADE_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"

if [ ! -d "$SPADE_DATA_DIR" ]; then
  echo "run_tests: shared test data not found at $SPADE_DATA_DIR (set SPADE_DATA_DIR)" >&2
  exit 1
fi
# GPU tests carry the label `gpu`; this machine runs the rest and says how many it left to the GPU machine.
gpu_tests=$(cd "$build" && ctest -N -L gpu | sed -n 's/^Total Tests: //p')
if [ "${gpu_tests:-0}" != "0" ]; then
  echo "run_tests: ${gpu_tests} gpu-labelled tests are NOT run here (no GPU); run bench/run_gpu.sh on a GPU machine."
fi
cd "$build"
# ctest runs one test per core, and the multi-process tests start three ranks each: OpenBLAS's OpenMP threads (one per
# core by default, spin-waiting between GEMMs) would oversubscribe the cores several times over and slow a 260K-param
# model's decode steps tenfold, past the tests' latency bounds. One BLAS thread per process unless the caller says so.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ctest --output-on-failure -LE gpu -j "$jobs" --timeout 900 "$@"

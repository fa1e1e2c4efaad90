#!/usr/bin/env bash
# Installs Spade's build and test dependencies from Debian 12 packages when they are missing.
# Idempotent: a package that is already installed is not touched. Needs root (or sudo) for apt-get.
set -euo pipefail
# --build-only: only what building the programs needs (the container images' build stage, deploy/docker/): no test
# or benchmark tools, no npm modules. The image build runs this script alone, without the source tree.
build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; fi

PKGS=(
  build-essential cmake ninja-build pkg-config git python3
  libboost-dev libboost-system-dev          # Boost.Asio / Beast (header-only + system)
  libprotobuf-dev protobuf-compiler         # wire messages
  libspdlog-dev libfmt-dev                  # logging
  nlohmann-json3-dev libcli11-dev           # JSON, flags
  libpcre2-dev                              # tokenizer pre-tokenization regex
  libopenblas-openmp-dev                    # CPU GEMMs (kernels/linear_ref.h), OpenMP threads
  libucx-dev                                # UCX host-memory transport
  libssl-dev                                # OpenSSL libcrypto: control-plane authentication (HMAC-SHA256)
  prometheus-cpp-dev                        # metrics registry + text serializer (core; common/metrics.h)
)
if [ "$build_only" -eq 0 ]; then
  PKGS+=(
    libgtest-dev libgmock-dev libbenchmark-dev
    openmpi-bin                             # mpirun launch form (deploy/spade_rank.sh)
    prometheus                              # promtool + the real server the metrics tests scrape with
    python3-yaml                            # tests/deploy: parses the rendered Kubernetes manifests
  )
  # Tools that may come from outside Debian (NodeSource's nodejs ships npm; kubectl from the Kubernetes repository):
  # asked from apt only when the command is missing.
  command -v kubectl >/dev/null || PKGS+=(kubectl)   # renders deploy/k8s (kubectl kustomize)
  command -v node >/dev/null || PKGS+=(nodejs)       # the official openai client test
  command -v npm >/dev/null || PKGS+=(npm)
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

install_node_modules() {
  # The openai npm client of the API test, pinned by its package-lock.json (registry.npmjs.org).
  [ "$build_only" -eq 0 ] || return 0
  local dir
  dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/tests/coordinator/openai_client"
  if [ ! -f "$dir/node_modules/openai/package.json" ]; then
    echo "setup_deps: npm ci in $dir"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup_deps: all ${#PKGS[@]} packages present"
  install_node_modules
  exit 0
fi

echo "setup_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_node_modules

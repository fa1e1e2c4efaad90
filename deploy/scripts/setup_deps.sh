#!/usr/bin/env bash
# Installs Spade's build and test dependencies from Debian 12 packages when they are missing.
# Idempotent: a package that is already installed is not touched. Needs root (or sudo) for apt-get.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git python3
  libboost-dev libboost-system-dev          # Boost.Asio / Beast (header-only + system)
  libprotobuf-dev protobuf-compiler         # wire messages
  libspdlog-dev libfmt-dev                  # logging
  nlohmann-json3-dev libcli11-dev           # JSON, flags
  libgtest-dev libgmock-dev libbenchmark-dev
  libpcre2-dev                              # tokenizer pre-tokenization regex
  libucx-dev                                # UCX host-memory transport
  openmpi-bin                               # mpirun launch form (deploy/spade_rank.sh)
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup_deps: all ${#PKGS[@]} packages present"
  exit 0
fi

echo "setup_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

#!/usr/bin/env bash
# Packs Spade's Debian-packaged build dependencies (headers, libraries, CMake/pkg-config files) from THIS machine into
# build-device-deps/deps.tar.xz (xz: a third smaller than gzip; a device call carries at most 64 MiB), so that bench/run_gpu.sh can configure the whole project on the GPU machine, which
# has CUDA, CMake and ninja but none of these packages and no network.
#
# Usage (on the development machine, repo root):   bench/pack_device_deps.sh
# Then carry "build-device-deps" with the device call; bench/run_gpu.sh unpacks it into a private prefix
# (never into /) and points CMAKE_PREFIX_PATH / PKG_CONFIG_PATH / LD_LIBRARY_PATH at it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${ROOT}/build-device-deps"
mkdir -p "${OUT_DIR}"

# The -dev packages of deploy/scripts/setup_deps.sh (minus build tools and UCX, which the device build turns off)
# plus the runtime libraries their .so links point at, and pkgconf (the device image may lack pkg-config).
PKGS=(
  libboost1.74-dev libboost-system1.74-dev libboost-system1.74.0
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 protobuf-compiler libprotoc32
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
  libssl-dev libssl3
  prometheus-cpp-dev libprometheus-cpp-core1.0   # core only: the build links prometheus-cpp-core (pkg-config)
  libopenblas-openmp-dev libopenblas0-openmp libgfortran5 libquadmath0
  pkgconf pkgconf-bin libpkgconf3
)

LIST="$(mktemp)"
trap 'rm -f "${LIST}"' EXIT
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "${p}" 2>/dev/null | grep -q "install ok installed"; then
    echo "pack_device_deps: package ${p} is not installed here (run deploy/scripts/setup_deps.sh)" >&2
    exit 1
  fi
  # Regular files and symlinks only; documentation and man pages are not needed.
  dpkg -L "${p}" | while read -r f; do
    case "${f}" in
      /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/*) continue ;;
      */libgtest*.a | */libgmock*.a | */libbenchmark*.a) ;;  # static-only libraries: kept
      *.a | */openblas*/liblapack*) continue ;;  # the build links the shared libraries; LAPACK is not used
    esac
    if [ -f "${f}" ] || [ -L "${f}" ]; then
      echo "${f#/}"
    fi
  done >>"${LIST}"
done
sort -u -o "${LIST}" "${LIST}"
tar -C / -cf - -T "${LIST}" | xz -T0 -9 >"${OUT_DIR}/deps.tar.xz"
rm -f "${OUT_DIR}/deps.tar.gz"
echo "pack_device_deps: $(wc -l <"${LIST}") files -> ${OUT_DIR}/deps.tar.xz ($(du -h "${OUT_DIR}/deps.tar.xz" | cut -f1))"

#!/usr/bin/env bash
# Prints, one per line and sorted, the Debian/Ubuntu packages that own the shared libraries the given executables
# load (ldd + dpkg-query -S). The image build runs it in the build stage so that the runtime stage installs exactly
# what the binaries link, whatever the distribution release names its library packages (libfmt9, libucx0, ...).
#
#   runtime-packages.sh BINARY... > packages.txt
#
# Libraries that no package owns are an error, except those named in SPADE_RUNTIME_PROVIDED (a space-separated
# list of sonames the runtime base image or the container runtime provides, e.g. libcuda.so.1, which the NVIDIA
# container toolkit mounts from the host driver). libc6 (the loader, libc, libm) comes with every base image and
# is left out.
set -euo pipefail
me="runtime-packages"
[ $# -ge 1 ] || { echo "usage: $me BINARY..." >&2; exit 2; }
provided=" ${SPADE_RUNTIME_PROVIDED:-} "

declare -A lib_of=()   # resolved library path -> "soname (needed by BINARY)"
status=0
for b in "$@"; do
  [ -x "$b" ] || { echo "$me: error: $b is not an executable" >&2; exit 2; }
  ldd_out="$(ldd "$b")" || { echo "$me: error: ldd $b failed" >&2; exit 2; }
  while read -r line; do
    soname="${line%% *}"
    [[ "$provided" == *" $soname "* ]] && continue
    case "$line" in
      *"=> not found"*) echo "$me: error: $b needs $soname, which is not installed" >&2; status=2 ;;
      *"=> /"*) path="${line#*=> }"; lib_of["${path%% (*}"]="$soname (needed by $b)" ;;
    esac  # other lines: linux-vdso, the loader itself
  done <<<"$ldd_out"
done
[ "$status" -eq 0 ] || exit "$status"
[ ${#lib_of[@]} -gt 0 ] || exit 0

# dpkg knows a file under the name its package shipped it as: the ldd path, its real path, or their /usr-merged
# twins (/lib/... vs /usr/lib/...). Ask for all spellings at once.
declare -A candidates=()
for p in "${!lib_of[@]}"; do
  r="$(readlink -f "$p")"
  candidates["$p"]="$p $r ${p#/usr} /usr$p ${r#/usr} /usr$r"
done
declare -A owner=()
# shellcheck disable=SC2046,SC2048,SC2086  # word splitting of the candidate lists is intended
while IFS= read -r line; do
  case "$line" in diversion*) continue ;; esac
  pkgs="${line%%: /*}"; file="/${line#*: /}"
  owner["$file"]="${pkgs%%,*}"
done < <(dpkg-query -S $(printf '%s\n' ${candidates[*]} | sort -u) 2>/dev/null || true)

declare -A pkgs=()
for p in "${!lib_of[@]}"; do
  pkg=""
  for q in ${candidates[$p]}; do
    if [ -n "${owner[$q]:-}" ]; then pkg="${owner[$q]}"; break; fi
  done
  if [ -z "$pkg" ]; then
    echo "$me: error: $p (${lib_of[$p]}) belongs to no package (add its soname to SPADE_RUNTIME_PROVIDED if" \
         "the runtime base image has it)" >&2
    status=2
    continue
  fi
  pkg="${pkg%%:*}"   # "libfmt9:amd64" -> "libfmt9"
  case "$pkg" in libc6|libc6-*) continue ;; esac
  pkgs["$pkg"]=1
done
[ "$status" -eq 0 ] || exit "$status"
printf '%s\n' "${!pkgs[@]}" | sort

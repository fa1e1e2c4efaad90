#!/usr/bin/env bash
# spade-entrypoint: starts one Spade process in a container and gives it its place in the world (global rank,
# world size, role counts) from the pod's identity. Installed in the images as /opt/spade/bin/spade-entrypoint.
#
#   spade-entrypoint coordinator [coordinator flags...]
#   spade-entrypoint inference   [inference_rank flags...]   (pass --serve yourself: it is a cluster rank)
#   spade-entrypoint cache       [cache_rank flags...]
#
# Rank rule (the default role map of coordinator/launch_env.h, N = SPADE_NUM_PAIRS, C = SPADE_NUM_CACHE, a multiple
# of N, default N; K = C / N cache ranks per inference rank):
#   coordinator             -> rank 0
#   inference, pod index i  -> rank 1 + i          (inference #i, 0 <= i < N)
#   cache,     pod index c  -> rank 1 + N + c      (cache #c, shard c mod K of inference #(c / K), 0 <= c < C)
#   world size = 1 + N + C
# and the binary is started as  BINARY --rank R --world-size W --num-inference N --num-cache C [flags...].
#
# Pod index: SPADE_POD_INDEX (Kubernetes: downward API of the label apps.kubernetes.io/pod-index that StatefulSet
# pods carry since 1.28), else the ordinal suffix of POD_NAME (StatefulSet pods are named <statefulset>-<ordinal>;
# downward API metadata.name). When both are set they must agree.
#
# Reads: SPADE_NUM_PAIRS SPADE_NUM_CACHE SPADE_POD_INDEX POD_NAME SPADE_BIN_DIR SPADE_ENTRYPOINT_DRY_RUN
#   SPADE_NUM_PAIRS           N, inference ranks (pairs) in the world (the spade-config ConfigMap)
#   SPADE_NUM_CACHE           C, cache ranks in the world: N x the cache ranks per inference rank (default N)
#   SPADE_BIN_DIR             where the binaries are (default: this script's directory)
#   SPADE_ENTRYPOINT_DRY_RUN  1: print the command (one NUL-terminated argument each) instead of running it
# The identity flags (--rank, --world-size, --num-inference, --num-cache, --role-map) belong to this script: giving
# them as arguments is an error. Exit status 2 on bad identity or arguments, else the binary's.
set -euo pipefail

me="spade-entrypoint"
die() { echo "$me: error: $*" >&2; exit 2; }

bin_dir="${SPADE_BIN_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
[ $# -ge 1 ] || die "usage: $me coordinator|inference|cache [flags...]"
role="$1"; shift

case "$role" in
  coordinator) binary="coordinator" ;;
  inference) binary="inference_rank" ;;
  cache) binary="cache_rank" ;;
  *) die "unknown role '$role' (expected coordinator, inference or cache)" ;;
esac

for a in "$@"; do
  case "$a" in
    --rank|--rank=*|--world-size|--world-size=*|--num-inference|--num-inference=*|--num-cache|--num-cache=*|--role-map|--role-map=*)
      die "argument '$a': the rank identity is derived from SPADE_NUM_PAIRS, SPADE_NUM_CACHE and the pod index; do not pass it" ;;
  esac
done

is_uint() { [[ "$1" =~ ^(0|[1-9][0-9]{0,8})$ ]]; }

n="${SPADE_NUM_PAIRS:-}"
[ -n "$n" ] || die "SPADE_NUM_PAIRS is not set (number of inference/cache pairs; key of the spade-config ConfigMap)"
{ is_uint "$n" && [ "$n" -ge 1 ]; } || die "SPADE_NUM_PAIRS='$n' is not a positive integer"
c="${SPADE_NUM_CACHE:-$n}"
{ is_uint "$c" && [ "$c" -ge 1 ]; } || die "SPADE_NUM_CACHE='$c' is not a positive integer"
[ $((c % n)) -eq 0 ] || die "SPADE_NUM_CACHE=$c is not a multiple of SPADE_NUM_PAIRS=$n: each inference rank takes the same number of cache ranks (its layer shards)"
world=$((1 + n + c))

pod_index() {
  local from_label="${SPADE_POD_INDEX:-}" from_name=""
  if [ -n "${POD_NAME:-}" ]; then
    [[ "$POD_NAME" =~ -([0-9]+)$ ]] ||
      die "POD_NAME='$POD_NAME' has no -<ordinal> suffix (is this pod part of a StatefulSet?)"
    from_name="${BASH_REMATCH[1]}"
    is_uint "$from_name" || die "POD_NAME='$POD_NAME': ordinal '$from_name' is not a valid index"
  fi
  if [ -n "$from_label" ]; then
    is_uint "$from_label" || die "SPADE_POD_INDEX='$from_label' is not a non-negative integer"
    if [ -n "$from_name" ] && [ "$from_name" != "$from_label" ]; then
      die "SPADE_POD_INDEX=$from_label (label apps.kubernetes.io/pod-index) disagrees with POD_NAME='$POD_NAME'"
    fi
    echo "$from_label"
  elif [ -n "$from_name" ]; then
    echo "$from_name"
  else
    die "role $role needs a pod index: set SPADE_POD_INDEX (label apps.kubernetes.io/pod-index) or POD_NAME"
  fi
}

case "$role" in
  coordinator) rank=0 ;;
  inference|cache)
    idx="$(pod_index)"
    if [ "$role" = inference ]; then count=$n; key=SPADE_NUM_PAIRS; else count=$c; key=SPADE_NUM_CACHE; fi
    [ "$idx" -lt "$count" ] ||
      die "$role pod index $idx is out of range for $key=$count (scale the StatefulSet and $key together)"
    if [ "$role" = inference ]; then rank=$((1 + idx)); else rank=$((1 + n + idx)); fi ;;
esac

path="$bin_dir/$binary"
cmd=("$path" --rank "$rank" --world-size "$world" --num-inference "$n" --num-cache "$c" "$@")
if [ "${SPADE_ENTRYPOINT_DRY_RUN:-0}" = 1 ]; then
  printf '%s\0' "${cmd[@]}"
  exit 0
fi
[ -x "$path" ] || die "$path is not an executable (SPADE_BIN_DIR=$bin_dir)"
echo "$me: $role rank $rank of world size $world ($n inference, $c cache ranks): ${cmd[*]}" >&2
exec "${cmd[@]}"

#!/bin/bash
# device: the churn rows (8B B8 32k, B16 16k, B32 8k, 32B B8) after build; CTAS="8 16" sweeps --nccl-ctas-delta
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/tmp/spade-deps/usr/lib/x86_64-linux-gnu SPADE_COMMIT=$(cat build-device-deps/COMMIT)
D=/tmp/spade-data/data/configs
B=build-gpu/bench/bench_tpot
for spec in "$@"; do
  case "$spec" in
    b8) a=(--config $D/qwen3-8b --label qwen3-8b-b8-32k-churn --batch 8 --context 32768 --budget 2048 --packs 12 --modes dense,quest,async --delta-capacity 2048,1024,768,512,256) ;;
    b8a) a=(--config $D/qwen3-8b --label qwen3-8b-b8-32k-churn --batch 8 --context 32768 --budget 2048 --packs 12 --modes async --delta-capacity 1024,512) ;;
    b16a) a=(--config $D/qwen3-8b --label qwen3-8b-b16-16k-churn --batch 16 --context 16384 --budget 1024 --packs 6 --modes async --delta-capacity 512,256) ;;
    b32a) a=(--config $D/qwen3-8b --label qwen3-8b-b32-8k-churn --batch 32 --context 8192 --budget 1024 --packs 12 --modes async --delta-capacity 512,256) ;;
    b16) a=(--config $D/qwen3-8b --label qwen3-8b-b16-16k-churn --batch 16 --context 16384 --budget 1024 --packs 6,12 --modes dense,async --delta-capacity 1024,512,256,128) ;;
    b32) a=(--config $D/qwen3-8b --label qwen3-8b-b32-8k-churn --batch 32 --context 8192 --budget 1024 --packs 12 --modes dense,async --delta-capacity 1024,512,256,128) ;;
    32b) a=(--config $D/qwen3-32b --label qwen3-32b-b8-32k-churn --batch 8 --context 32768 --budget 2048 --packs 8 --modes dense,async --delta-capacity 1024,512) ;;
  esac
  for c in ${CTAS:-8}; do
    echo "=== $spec ctas $c"
    timeout 280 $B "${a[@]}" --score-keys int8 --steps 128 --churn ${CHURN:-0.31} --nccl-ctas-delta $c --out $OUT/bench_tpot.jsonl 2>&1
  done
done

// Selection, top-k stage: exact radix top-k per score row (topk_ref's order and tie rule, kernels/selection_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>


#include "kernels/launch_util.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Top-k: one CTA (1024 threads = 32 warps) per row. Radix select on order-preserving uint32 keys with four 8-bit
// digits finds the exact k-th key (threshold) and how many threshold-equal elements to keep. Histograms are
// privatised per warp (no inter-warp atomic contention: scores cluster in a few high digits; __match_any_sync
// aggregation measured slower than plain shared atomics here). Rows of up to kTopkSmemKeys keys are loaded once into shared memory; longer
// rows are re-read (L2) on each pass. The final pass gives each warp a contiguous segment of positions: per-warp
// counts, a scan over the 32 warps, then an ordered walk with ballots writes the selected positions in ascending
// order, keeping the EARLIEST threshold-equal elements (topk_ref's tie rule).
// Successor expansion (TopkArgs::successor) only changes the key read: entry i > 0 ranks by max(key(s[i]),
// key(s[i-1])), entry 0 by its own key. The cached load takes the predecessor's key from the previous lane (lane 0
// reads it); the uncached path reads both scores (adjacent: the same L2 lines).
// =====================================================================================================================

constexpr int kTopkThreads = 1024;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkSmemKeys = 44 * 1024;
constexpr size_t kTopkSmemBytes = size_t{kTopkSmemKeys} * 4 + size_t{kTopkWarps} * 256 * 4 + 256 * 4;

struct TopkArgs {
  const float* scores;
  const int32_t* row_lens;
  int32_t* indices;
  int32_t* counts;
  int rows_per_batch;
  int score_stride;
  int k;
  int successor;  // rank entry i > 0 by max(key(s[i]), key(s[i-1]))
};

__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const TopkArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint32_t* skeys = reinterpret_cast<uint32_t*>(smem_raw);                     // [kTopkSmemKeys]
  int* whist = reinterpret_cast<int*>(skeys + kTopkSmemKeys);                   // [32 warps][256]
  int* hist = whist + kTopkWarps * 256;                                         // [256]
  __shared__ int s_digit, s_above;
  __shared__ int s_wgt[kTopkWarps], s_weq[kTopkWarps];
  const int row = blockIdx.x;
  const int b = row / a.rows_per_batch;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int n = max(0, min(a.row_lens[b], a.score_stride));
  const float* s = a.scores + static_cast<size_t>(row) * a.score_stride;
  int32_t* out = a.indices + static_cast<size_t>(row) * a.k;
  if (n <= a.k) {
    for (int i = tid; i < a.k; i += kTopkThreads) out[i] = i < n ? i : -1;
    if (a.counts != nullptr && tid == 0) a.counts[row] = n;
    return;
  }
  const bool cached = n <= kTopkSmemKeys;
  const bool succ = a.successor != 0;
  if (cached && !succ) {
#pragma unroll 8
    for (int i = tid; i < n; i += kTopkThreads) skeys[i] = topk_key_dev(__ldcg(s + i));
  } else if (cached) {
    // Every lane runs every iteration (the loop bound is CTA-uniform) so the shuffle sees the whole warp.
#pragma unroll 8
    for (int i0 = 0; i0 < n; i0 += kTopkThreads) {
      const int i = i0 + tid;
      const uint32_t own = i < n ? topk_key_dev(__ldcg(s + i)) : 0u;
      uint32_t prev = __shfl_up_sync(0xffffffffu, own, 1);
      if (lane == 0) prev = (i > 0 && i <= n) ? topk_key_dev(__ldcg(s + i - 1)) : 0u;
      if (i < n) skeys[i] = i > 0 ? max(own, prev) : own;
    }
  }
  auto key_at = [&](int i) -> uint32_t {
    if (cached) return skeys[i];
    const uint32_t own = topk_key_dev(__ldcg(s + i));
    return succ && i > 0 ? max(own, topk_key_dev(__ldcg(s + i - 1))) : own;
  };

  uint32_t prefix = 0;
  uint32_t mask = 0;
  int kr = a.k;  // still to take among the keys that match `prefix` on the digits fixed so far
#pragma unroll 1
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kTopkWarps * 256; i += kTopkThreads) whist[i] = 0;
    __syncthreads();
    int* my = whist + warp * 256;
    for (int i0 = 0; i0 < n; i0 += 8 * kTopkThreads) {
      uint32_t keys[8];  // 8 independent loads in flight before any is used
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = i0 + u * kTopkThreads + tid;
        keys[u] = i < n ? key_at(i) : 0u;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const bool take = i0 + u * kTopkThreads + tid < n && (keys[u] & mask) == prefix;
        const uint32_t dig = (keys[u] >> shift) & 0xFFu;
        if (take) atomicAdd(my + dig, 1);
      }
    }
    __syncthreads();
    if (tid < 256) {  // bin totals, descending digit order: thread t holds bin 255 - t
      int c = 0;
#pragma unroll 8
      for (int w = 0; w < kTopkWarps; ++w) c += whist[w * 256 + 255 - tid];
      hist[tid] = c;
    }
    __syncthreads();
    radix_select_digit(hist, shift, prefix, mask, kr, s_digit, s_above);
  }

  // prefix is the k-th largest key: take every key above it and the first kr keys equal to it.
  const int seg = ((n + kTopkWarps - 1) / kTopkWarps + 31) & ~31;
  const int lo = min(n, warp * seg);
  const int hi = min(n, lo + seg);
  int gt = 0, eq = 0;
#pragma unroll 8
  for (int i = lo + lane; i < hi; i += 32) {
    const uint32_t key = key_at(i);
    gt += key > prefix ? 1 : 0;
    eq += key == prefix ? 1 : 0;
  }
  gt = __reduce_add_sync(0xffffffffu, gt);
  eq = __reduce_add_sync(0xffffffffu, eq);
  if (lane == 0) {
    s_wgt[warp] = gt;
    s_weq[warp] = eq;
  }
  __syncthreads();
  int base_gt = 0, base_eq = 0;
  for (int w = 0; w < warp; ++w) {
    base_gt += s_wgt[w];
    base_eq += s_weq[w];
  }
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int i0 = lo; i0 < hi; i0 += 32) {
    const int i = i0 + lane;
    const uint32_t key = i < hi ? key_at(i) : 0u;
    const bool g = i < hi && key > prefix;
    const bool e = i < hi && key == prefix;
    const unsigned mg = __ballot_sync(0xffffffffu, g);
    const unsigned me = __ballot_sync(0xffffffffu, e);
    const int eq_before = base_eq + __popc(me & lt_mask);
    if (g || (e && eq_before < kr)) out[base_gt + __popc(mg & lt_mask) + min(eq_before, kr)] = i;
    base_gt += __popc(mg);
    base_eq += __popc(me);
  }
  if (a.counts != nullptr && tid == 0) a.counts[row] = a.k;
}

cudaError_t topk_smem_attribute() {
  return ensure_smem_attribute<topk_kernel>(kTopkSmemBytes);
}

}  // namespace
}  // namespace detail

cudaError_t topk_select(const TopkParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "topk_select";
  if (p.scores == nullptr || p.row_lens == nullptr || p.indices == nullptr) {
    return invalid_argument(what, "scores, row_lens and indices must be set");
  }
  if (p.batch <= 0 || p.rows_per_batch <= 0 || p.score_stride <= 0) {
    return invalid_argument(what, "batch ", p.batch, " / rows_per_batch ", p.rows_per_batch, " / score_stride ",
                            p.score_stride, " must be > 0");
  }
  if (p.k < 1) return invalid_argument(what, "k ", p.k, " must be >= 1");
  const TopkArgs a{p.scores,       p.row_lens,     p.indices, p.counts,
                   p.rows_per_batch, p.score_stride, p.k,       p.successor ? 1 : 0};
  const cudaError_t e = topk_smem_attribute();
  if (e != cudaSuccess) return e;
  topk_kernel<<<p.batch * p.rows_per_batch, kTopkThreads, kTopkSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t prepare_selection_kernels() {
  cudaError_t e = detail::topk_smem_attribute();
  if (e == cudaSuccess) e = detail::prepare_predict_kernels();
  if (e == cudaSuccess) e = detail::prepare_score_kernels();
  return e;
}

}  // namespace spade::kernels

// Internal header of the selection kernels (kernels/selection_*.cu, nvcc only): device helpers shared by several units
// and the per-unit shared-memory setup that prepare_selection_kernels (selection_topk.cu) calls.
// Math and conventions: kernels/selection_ref.h, kernels/selection_delta_ref.h (the CPU references the GPU tests
// compare against).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace spade::kernels::detail {

/// Order-preserving uint32 key of a score (topk_ref's topk_key): top-k (selection_topk.cu) and the overflow radix
/// select of delta transfer (selection_delta.cu).
__device__ __forceinline__ uint32_t topk_key_dev(float x) {
  const uint32_t u = __float_as_uint(x);
  if (isnan(x)) return 0u;
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

/// One digit pass of the CTA-wide MSB-first 8-bit radix select of the kr-th largest key (top-k, selection_topk.cu;
/// the overflow select of delta transfer, selection_delta.cu), once the pass's histogram is complete and visible
/// (after a barrier) in hist_desc[256]: bin i counts the keys that match `prefix` under `mask` and have digit 255 - i
/// at bit `shift`. Warp 0 finds the digit at which the count from the largest digit down reaches kr (1 <= kr <= the
/// histogram's total); then every thread fixes that digit into prefix / mask and drops the keys above it from kr.
/// Called by every thread of the CTA (two barriers); s_digit / s_above are __shared__ scratch.
__device__ __forceinline__ void radix_select_digit(const int* hist_desc, int shift, uint32_t& prefix, uint32_t& mask,
                                                   int& kr, int& s_digit, int& s_above) {
  if (threadIdx.x < 32) {  // warp 0: exclusive scan of the 256 bins, 8 per lane
    const int lane = threadIdx.x;
    int c[8];
    int local = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      c[j] = hist_desc[lane * 8 + j];
      local += c[j];
    }
    int incl = local;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int nb = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += nb;
    }
    int excl = incl - local;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (excl < kr && excl + c[j] >= kr) {
        s_digit = 255 - (lane * 8 + j);
        s_above = excl;
      }
      excl += c[j];
    }
  }
  __syncthreads();
  prefix |= static_cast<uint32_t>(s_digit) << shift;
  mask |= 0xFFu << shift;
  kr -= s_above;
  __syncthreads();
}

// The dynamic shared-memory limits of every instantiation of the predictor (selection_predict.cu) and scoring
// (selection_score.cu) kernels on the current device, set once; prepare_selection_kernels (selection_topk.cu) calls
// them.
cudaError_t prepare_predict_kernels();
cudaError_t prepare_score_kernels();

}  // namespace spade::kernels::detail

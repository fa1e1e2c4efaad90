// Internal header of the selection kernels (kernels/selection_*.cu, nvcc only): device helpers shared by several units
// and the shared-memory limit setters that prepare_selection_kernels (selection_topk.cu) calls in other units.
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

// The dynamic shared-memory limits of the predictor and scoring kernels on the current device, set once (launch or
// prepare). Defined, and instantiated for every SPADE_FOR_EACH_HEAD_DIM, in selection_predict.cu (TW: float,
// __nv_bfloat16, __half) and selection_score.cu (T: __nv_bfloat16, __half).
template <typename TW, int D>
cudaError_t predict_smem_attribute();
template <typename T, int D>
cudaError_t score_smem_attribute();

}  // namespace spade::kernels::detail

// Internal header of the per-layer ops of the GPU inference rank (kernels/layer_ops_*.cu, nvcc only): the helpers
// shared by several units. Public API and semantics: kernels/layer_ops.cuh. Design notes: docs/KERNELS.md, "Layer ops
// for the GPU inference rank". Element types: the one list is `dispatch_elem` below (bf16, fp16); logits types:
// `dispatch_logits` (layer_ops_sampling.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "kernels/kernel_common.cuh"
#include "kernels/layer_ops.cuh"

namespace spade::kernels::detail {

// ---------------------------------------------------------------------------------------------------------------
// Element-type dispatch: the one place where the bf16 / fp16 instantiations are listed.
// ---------------------------------------------------------------------------------------------------------------

template <typename F>
cudaError_t dispatch_elem(DType t, F&& f) {
  switch (t) {
    case DType::BF16:
      return f(__nv_bfloat16{});
    case DType::F16:
      return f(__half{});
    default:
      return cudaErrorInvalidValue;
  }
}

/// Norm weight element i as fp32 (F32 or the activation type T), with the (1 + w) convention applied in fp32.
template <typename T>
__device__ __forceinline__ float norm_weight(const void* w, bool w_f32, bool unit_offset, int i) {
  const float v = w_f32 ? static_cast<const float*>(w)[i] : to_f(static_cast<const T*>(w)[i]);
  return unit_offset ? __fadd_rn(1.0f, v) : v;
}

/// The reference's normalisation factor: 1 / sqrt(ss / dim + eps), IEEE operations.
__device__ __forceinline__ float rms_inv(float ss, int dim, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(dim)), eps)));
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

/// Per-lane registers of one head held by one warp (per-head RMSNorm, q/k-norm + RoPE).
constexpr int kHeadRegs = kMaxLayerOpsHeadDim / 32;

// ---------------------------------------------------------------------------------------------------------------
// Validation helpers
// ---------------------------------------------------------------------------------------------------------------

inline bool is_elem(DType t) { return t == DType::BF16 || t == DType::F16; }

}  // namespace spade::kernels::detail

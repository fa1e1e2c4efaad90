// Internal header of the per-layer ops of the GPU inference rank (kernels/layer_ops_*.cu, nvcc only): the helpers
// shared by several units. Public API and semantics: kernels/layer_ops.cuh. Design notes: docs/KERNELS.md, "Layer ops
// for the GPU inference rank". Element types: `dispatch_elem` (kernel_common.cuh: bf16, fp16); logits types:
// `dispatch_logits` (layer_ops_sampling.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/layer_ops.cuh"

namespace spade::kernels::detail {

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

/// What every layer-op launcher checks first: dtype an element type (BF16 or F16) and its row / token count `count`
/// (the params field `count_name`) >= 0.
inline cudaError_t check_elem_count(const char* what, DType dtype, const char* count_name, long long count) {
  if (!is_elem(dtype)) return invalid_argument(what, "dtype must be BF16 or F16");
  if (count < 0) return invalid_argument(what, count_name, " = ", count, " < 0");
  return cudaSuccess;
}

/// A norm weight's (or residual's) dtype `t` (the params field `name`): F32 or the activation dtype.
inline cudaError_t check_f32_or_elem(const char* what, const char* name, DType t, DType dtype) {
  if (t != DType::F32 && t != dtype) return invalid_argument(what, name, " must be F32 or equal to dtype");
  return cudaSuccess;
}

/// The head_dim of the per-head ops (a head in one warp's registers, rotated in halves): even, 2..kMaxLayerOpsHeadDim.
inline cudaError_t check_head_dim(const char* what, int head_dim) {
  if (head_dim < 2 || head_dim > kMaxLayerOpsHeadDim || head_dim % 2 != 0)
    return invalid_argument(what, "head_dim = ", head_dim, " must be even and in 2..", kMaxLayerOpsHeadDim);
  return cudaSuccess;
}

}  // namespace spade::kernels::detail

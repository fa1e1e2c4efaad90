// Elementwise tensor utilities of the GPU inference rank: deterministic random initialisation (--random-weights,
// benchmarks) and dtype conversion (bf16 / fp16 activations -> fp32 for the selection kernels' queries).
//
// Conventions as attention.cuh: plain params struct + cudaStream_t; asynchronous on `stream`; cudaSuccess,
// cudaErrorInvalidValue (launch_error_detail() names the field) or the launch's CUDA error; n == 0 is a no-op.
// Pointers are device pointers. Plain C++ header: includable from host code compiled by g++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.cuh"  // launch_error_detail()

namespace spade::kernels {

/// out[i] = offset + scale * u(seed, i), u uniform in [-sqrt(3), sqrt(3)) (zero mean, unit variance): a pure
/// function of (seed, i) (splitmix64 of i * golden + seed, top 24 bits), so any tensor of any size is reproducible
/// on any device and launch geometry. A weight initialised with scale = 1/sqrt(fan_in) has the variance of
/// N(0, 1/fan_in) (weights.h random_source's recipe), uniform instead of normal: the benchmarks need the shapes and
/// O(1) activations, not the distribution's tails.
struct RandomFillParams {
  DType dtype = DType::BF16;  // BF16, F16 or F32.
  void* out = nullptr;        // [n] dtype.
  size_t n = 0;
  uint64_t seed = 0;
  float scale = 1.f;
  float offset = 0.f;
};

cudaError_t random_fill(const RandomFillParams& p, cudaStream_t stream);

/// out[i] = float(in[i]) converted to out_dtype with round-to-nearest-even. in and out must not overlap unless equal
/// with equal dtypes (then a no-op).
struct CastParams {
  DType in_dtype = DType::BF16;   // BF16, F16 or F32.
  DType out_dtype = DType::F32;   // BF16, F16 or F32.
  const void* in = nullptr;       // [n] in_dtype.
  void* out = nullptr;            // [n] out_dtype.
  size_t n = 0;
};

cudaError_t cast(const CastParams& p, cudaStream_t stream);

/// out[i] = min(max(in[i] + offset, lo), hi) over int32 (e.g. selectable lengths seq_lens - local_window, or the
/// packed-token count min(that, budget)), on the device so a captured step derives them from the step's seq_lens.
/// in == out allowed. Requires lo <= hi.
struct OffsetClampParams {
  const int32_t* in = nullptr;  // [n] int32.
  int32_t* out = nullptr;       // [n] int32.
  int n = 0;
  int offset = 0;
  int lo = 0;
  int hi = 0x7fffffff;
};

cudaError_t offset_clamp(const OffsetClampParams& p, cudaStream_t stream);

}  // namespace spade::kernels

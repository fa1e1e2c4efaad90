// Helpers shared by the CUDA benchmarks (bench_kernels.cu, bench_gdn.cu): checked CUDA calls, device allocation and
// upload, deterministic pseudo-random fills (never all zero: METHOD.md "never time on zeros").
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/attention.cuh"  // launch_error_detail()

/// Exits with file, line, the expression, the CUDA error and the launcher's detail when `expr` fails.
#define CK(expr)                                                                                               \
  do {                                                                                                         \
    const cudaError_t e_ = (expr);                                                                             \
    if (e_ != cudaSuccess) {                                                                                   \
      std::fprintf(stderr, "%s:%d %s failed: %s (%s)\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_),    \
                   ::spade::kernels::launch_error_detail());                                                   \
      std::exit(1);                                                                                            \
    }                                                                                                          \
  } while (0)

namespace spade::bench {

/// Deterministic pseudo-random value in [-1, 1) of element i.
__device__ __forceinline__ float hash_unit(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (1ll << 23)) / static_cast<float>(1ll << 23);
}
static __global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    p[i] = __float2bfloat16(scale * hash_unit(i, seed));
}
static __global__ void fill_f32_kernel(float* p, size_t n, uint64_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    p[i] = offset + scale * hash_unit(i, seed);
}

/// n bf16 values scale * hash in [-scale, scale).
inline void fill16(void* p, size_t n, uint64_t seed, float scale = 1.f) {
  fill_bf16_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CK(cudaGetLastError());
}
/// n fp32 values uniform in [lo, hi).
inline void fill32(float* p, size_t n, uint64_t seed, float lo, float hi) {
  fill_f32_kernel<<<1024, 256>>>(p, n, seed, 0.5f * (hi - lo), 0.5f * (hi + lo));
  CK(cudaGetLastError());
}

/// cudaMalloc of at least 16 bytes (checked).
inline void* dmalloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  return p;
}
template <typename T>
T* dalloc(size_t n) {
  return static_cast<T*>(dmalloc(n * sizeof(T)));
}
template <typename T>
T* upload(const std::vector<T>& h) {
  T* d = dalloc<T>(h.size());
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace spade::bench

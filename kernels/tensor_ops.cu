// Elementwise tensor utilities (kernels/tensor_ops.cuh).
#include "kernels/tensor_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"

namespace spade::kernels {
namespace {

__device__ __forceinline__ float unit_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  // top 24 bits -> [-1, 1), times sqrt(3): unit variance.
  const float u = static_cast<float>(static_cast<int32_t>(x >> 40) - (1 << 23)) * (1.f / static_cast<float>(1 << 23));
  return 1.7320508075688772f * u;
}

template <typename T>
__global__ void random_fill_kernel(T* out, size_t n, uint64_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = detail::from_f<T>(offset + scale * unit_uniform(i, seed));
}

template <typename In, typename Out>
__global__ void cast_kernel(const In* in, Out* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = detail::from_f<Out>(detail::to_f(in[i]));
}

__global__ void offset_clamp_kernel(const int32_t* in, int32_t* out, int n, int offset, int lo, int hi) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const long long v = static_cast<long long>(in[i]) + offset;
    out[i] = static_cast<int32_t>(v < lo ? lo : (v > hi ? hi : v));
  }
}

int grid_for(size_t n) {
  const size_t blocks = (n + 255) / 256;
  const size_t cap = static_cast<size_t>(detail::current_sm_count() > 0 ? detail::current_sm_count() : 132) * 8;
  return static_cast<int>(blocks < cap ? blocks : cap);
}

}  // namespace

cudaError_t random_fill(const RandomFillParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.out == nullptr) return detail::invalid_argument("random_fill", "out is null");
  const int grid = grid_for(p.n);
  const cudaError_t e = detail::dispatch_float_types(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    random_fill_kernel<<<grid, 256, 0, stream>>>(static_cast<T*>(p.out), p.n, p.seed, p.scale, p.offset);
    return cudaSuccess;
  });
  if (e != cudaSuccess) return detail::invalid_argument("random_fill", "dtype must be BF16, F16 or F32");
  return cudaGetLastError();
}

cudaError_t cast(const CastParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.in == nullptr || p.out == nullptr) return detail::invalid_argument("cast", "in / out is null");
  if (p.in == p.out) {
    if (p.in_dtype == p.out_dtype) return cudaSuccess;
    return detail::invalid_argument("cast", "in and out alias with different dtypes");
  }
  const int grid = grid_for(p.n);
  const cudaError_t e = detail::dispatch_float_types(p.in_dtype, [&](auto in_tag) {
    return detail::dispatch_float_types(p.out_dtype, [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      cast_kernel<<<grid, 256, 0, stream>>>(static_cast<const In*>(p.in), static_cast<Out*>(p.out), p.n);
      return cudaSuccess;
    });
  });
  if (e != cudaSuccess) return detail::invalid_argument("cast", "in_dtype / out_dtype must be BF16, F16 or F32");
  return cudaGetLastError();
}

cudaError_t offset_clamp(const OffsetClampParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.n < 0) return detail::invalid_argument("offset_clamp", "n = ", p.n, " is negative");
  if (p.in == nullptr || p.out == nullptr) return detail::invalid_argument("offset_clamp", "in / out is null");
  if (p.lo > p.hi) return detail::invalid_argument("offset_clamp", "lo ", p.lo, " > hi ", p.hi);
  offset_clamp_kernel<<<grid_for(static_cast<size_t>(p.n)), 256, 0, stream>>>(p.in, p.out, p.n, p.offset, p.lo, p.hi);
  return cudaGetLastError();
}

}  // namespace spade::kernels

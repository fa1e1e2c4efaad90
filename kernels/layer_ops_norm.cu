// Layer ops of the inference rank: RMSNorm, plain / fused residual / per head (Zhang & Sennrich 2019; rmsnorm_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>

#include <cstdint>
#include <type_traits>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/layer_ops.cuh"
#include "kernels/layer_ops_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =================================================================================================================
// 2. RMSNorm: one CTA per row, two passes over the row (the second re-reads from L1/L2). Thread j always owns the
// same elements in both passes, so in-place (out == x) and the residual read-back are race-free.
// =================================================================================================================

constexpr int kNormThreads = 256;

enum class ResMode { kNone, kSame, kF32 };

template <typename T, bool kVec, ResMode kRes>
__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const T* x, const void* __restrict__ weight, T* out,
                                                                void* residual, int dim, int x_stride,
                                                                int out_stride, float eps, bool w_f32,
                                                                bool unit_offset) {
  using RT = typename std::conditional<kRes == ResMode::kF32, float, T>::type;
  const int r = blockIdx.x;
  const T* xr = x + static_cast<size_t>(r) * x_stride;
  T* yr = out + static_cast<size_t>(r) * out_stride;
  RT* res = kRes == ResMode::kNone ? nullptr : static_cast<RT*>(residual) + static_cast<size_t>(r) * dim;
  // Pass 1 with a residual: residual += x, rounded to RT and stored back; the norm reads the stored value.
  auto add_residual = [](RT& rv, const T& xv) -> float {
    const RT stored = from_f<RT>(__fadd_rn(to_f(rv), to_f(xv)));
    rv = stored;
    return to_f(stored);
  };
  float ss = 0.f;
  if constexpr (kVec) {
    for (int j = threadIdx.x; j < dim / 8; j += kNormThreads) {
      const Vec8<T> xv = reinterpret_cast<const Vec8<T>*>(xr)[j];
      float v[8];
      if constexpr (kRes == ResMode::kNone) {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = to_f(xv.v[e]);
      } else {
        Vec8<RT> rv = reinterpret_cast<Vec8<RT>*>(res)[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = add_residual(rv.v[e], xv.v[e]);
        reinterpret_cast<Vec8<RT>*>(res)[j] = rv;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = __fadd_rn(ss, __fmul_rn(v[e], v[e]));
    }
  } else {
    for (int j = threadIdx.x; j < dim; j += kNormThreads) {
      const float v = kRes == ResMode::kNone ? to_f(xr[j]) : add_residual(res[j], xr[j]);
      ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
  }
  using Reduce = cub::BlockReduce<float, kNormThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float s_inv;
  const float total = Reduce(tmp).Sum(ss);
  if (threadIdx.x == 0) s_inv = rms_inv(total, dim, eps);
  __syncthreads();
  const float inv = s_inv;
  if constexpr (kVec) {
    for (int j = threadIdx.x; j < dim / 8; j += kNormThreads) {
      float v[8];
      if constexpr (kRes == ResMode::kNone) {
        const Vec8<T> xv = reinterpret_cast<const Vec8<T>*>(xr)[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = to_f(xv.v[e]);
      } else {
        const Vec8<RT> rv = reinterpret_cast<const Vec8<RT>*>(res)[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = to_f(rv.v[e]);
      }
      Vec8<T> yv;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        yv.v[e] = from_f<T>(__fmul_rn(norm_weight<T>(weight, w_f32, unit_offset, 8 * j + e), __fmul_rn(v[e], inv)));
      reinterpret_cast<Vec8<T>*>(yr)[j] = yv;
    }
  } else {
    for (int j = threadIdx.x; j < dim; j += kNormThreads) {
      const float v = kRes == ResMode::kNone ? to_f(xr[j]) : to_f(res[j]);
      yr[j] = from_f<T>(__fmul_rn(norm_weight<T>(weight, w_f32, unit_offset, j), __fmul_rn(v, inv)));
    }
  }
}

// =================================================================================================================
// Per-head RMSNorm: one warp per (token, head); the head lives in the lane's registers.
// =================================================================================================================

constexpr int kHeadNormThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kHeadNormThreads) rmsnorm_heads_kernel(const T* x, const void* __restrict__ weight,
                                                                          T* out, long long rows, int num_heads,
                                                                          int head_dim, int token_stride,
                                                                          int out_token_stride, float eps, bool w_f32,
                                                                          bool unit_offset) {
  const long long row = static_cast<long long>(blockIdx.x) * (kHeadNormThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const long long t = row / num_heads;
  const int h = static_cast<int>(row - t * num_heads);
  const T* src = x + t * token_stride + static_cast<long long>(h) * head_dim;
  T* dst = out + t * out_token_stride + static_cast<long long>(h) * head_dim;
  float v[kHeadRegs];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kHeadRegs; ++k) {
    const int d = lane + 32 * k;
    v[k] = d < head_dim ? to_f(src[d]) : 0.f;
    ss = __fadd_rn(ss, __fmul_rn(v[k], v[k]));
  }
  ss = warp_sum_xor(ss, 1, 16);
  const float inv = rms_inv(ss, head_dim, eps);
#pragma unroll
  for (int k = 0; k < kHeadRegs; ++k) {
    const int d = lane + 32 * k;
    if (d < head_dim) dst[d] = from_f<T>(__fmul_rn(norm_weight<T>(weight, w_f32, unit_offset, d), __fmul_rn(v[k], inv)));
  }
}

}  // namespace
}  // namespace detail

using detail::invalid_argument;

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------

cudaError_t rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  const char* w = "rmsnorm";
  cudaError_t e = detail::check_elem_count(w, p.dtype, "rows", p.rows);
  if (e == cudaSuccess) e = detail::check_f32_or_elem(w, "weight_dtype", p.weight_dtype, p.dtype);
  if (e == cudaSuccess && p.residual != nullptr)
    e = detail::check_f32_or_elem(w, "residual_dtype", p.residual_dtype, p.dtype);
  if (e != cudaSuccess) return e;
  if (p.dim <= 0 || p.dim > 65536) return invalid_argument(w, "dim = ", p.dim, " must be in 1..65536");
  const int xs = p.x_stride == 0 ? p.dim : p.x_stride;
  const int os = p.out_stride == 0 ? p.dim : p.out_stride;
  if (xs < p.dim) return invalid_argument(w, "x_stride = ", xs, " < dim = ", p.dim);
  if (os < p.dim) return invalid_argument(w, "out_stride = ", os, " < dim = ", p.dim);
  if (!(p.eps > 0.f)) return invalid_argument(w, "eps = ", p.eps, " must be > 0");
  if (p.rows == 0) return cudaSuccess;
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return invalid_argument(w, "x, weight and out must be set");
  if (p.residual != nullptr && p.residual == p.out) return invalid_argument(w, "out must not alias residual");
  const bool w_f32 = p.weight_dtype == DType::F32;
  return detail::dispatch_elem(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(p.x);
    T* out = static_cast<T*>(p.out);
    const bool vec = p.dim % 8 == 0 && xs % 8 == 0 && os % 8 == 0 && detail::aligned16(p.x) &&
                     detail::aligned16(p.out) && (p.residual == nullptr || detail::aligned16(p.residual));
    auto launch = [&](auto kernel) {
      kernel<<<p.rows, detail::kNormThreads, 0, stream>>>(x, p.weight, out, p.residual, p.dim, xs, os, p.eps, w_f32,
                                                          p.unit_offset);
      return cudaGetLastError();
    };
    using detail::ResMode;
    if (p.residual == nullptr) {
      return vec ? launch(detail::rmsnorm_kernel<T, true, ResMode::kNone>)
                 : launch(detail::rmsnorm_kernel<T, false, ResMode::kNone>);
    }
    if (p.residual_dtype == DType::F32) {
      return vec ? launch(detail::rmsnorm_kernel<T, true, ResMode::kF32>)
                 : launch(detail::rmsnorm_kernel<T, false, ResMode::kF32>);
    }
    return vec ? launch(detail::rmsnorm_kernel<T, true, ResMode::kSame>)
               : launch(detail::rmsnorm_kernel<T, false, ResMode::kSame>);
  });
}

cudaError_t rmsnorm_heads(const RmsNormHeadsParams& p, cudaStream_t stream) {
  const char* w = "rmsnorm_heads";
  cudaError_t e = detail::check_elem_count(w, p.dtype, "tokens", p.tokens);
  if (e == cudaSuccess) e = detail::check_f32_or_elem(w, "weight_dtype", p.weight_dtype, p.dtype);
  if (e == cudaSuccess) e = detail::check_head_dim(w, p.head_dim);
  if (e != cudaSuccess) return e;
  if (p.num_heads <= 0) return invalid_argument(w, "num_heads = ", p.num_heads, " must be > 0");
  const long long row = static_cast<long long>(p.num_heads) * p.head_dim;
  if (row > 0x7fffffff) return invalid_argument(w, "num_heads * head_dim too large");
  const int ts = p.token_stride == 0 ? static_cast<int>(row) : p.token_stride;
  const int os = p.out_token_stride == 0 ? static_cast<int>(row) : p.out_token_stride;
  if (ts < row) return invalid_argument(w, "token_stride = ", ts, " < num_heads * head_dim = ", row);
  if (os < row) return invalid_argument(w, "out_token_stride = ", os, " < num_heads * head_dim = ", row);
  if (!(p.eps > 0.f)) return invalid_argument(w, "eps = ", p.eps, " must be > 0");
  if (p.tokens == 0) return cudaSuccess;
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return invalid_argument(w, "x, weight and out must be set");
  const long long rows = static_cast<long long>(p.tokens) * p.num_heads;
  const long long blocks = (rows + detail::kHeadNormThreads / 32 - 1) / (detail::kHeadNormThreads / 32);
  if (blocks > 0x7fffffff) return invalid_argument(w, "tokens * num_heads too large");
  return detail::dispatch_elem(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    detail::rmsnorm_heads_kernel<T><<<static_cast<unsigned>(blocks), detail::kHeadNormThreads, 0, stream>>>(
        static_cast<const T*>(p.x), p.weight, static_cast<T*>(p.out), rows, p.num_heads, p.head_dim, ts, os, p.eps,
        p.weight_dtype == DType::F32, p.unit_offset);
    return cudaGetLastError();
  });
}

}  // namespace spade::kernels

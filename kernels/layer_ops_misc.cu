// Layer ops of the GPU inference rank: embedding gather and SwiGLU (Shazeer 2020; kernels/swiglu_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/layer_ops.cuh"
#include "kernels/layer_ops_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =================================================================================================================
// 1. Embedding gather: one CTA per token.
// =================================================================================================================

constexpr int kEmbedThreads = 128;

template <typename T, bool kVec>
__global__ void __launch_bounds__(kEmbedThreads) embedding_kernel(const int32_t* __restrict__ ids,
                                                                   const T* __restrict__ table, T* __restrict__ out,
                                                                   int32_t* error_flag, int vocab, int hidden) {
  const int t = blockIdx.x;
  const int id = ids[t];
  const bool ok = id >= 0 && id < vocab;
  if (!ok && error_flag != nullptr && threadIdx.x == 0) *error_flag = 1;
  T* dst = out + static_cast<size_t>(t) * hidden;
  const T* src = table + static_cast<size_t>(ok ? id : 0) * hidden;
  if constexpr (kVec) {
    const int nv = hidden / 8;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < nv; i += kEmbedThreads) d4[i] = ok ? __ldg(s4 + i) : make_uint4(0, 0, 0, 0);
  } else {
    for (int i = threadIdx.x; i < hidden; i += kEmbedThreads) dst[i] = ok ? src[i] : from_f<T>(0.f);
  }
}

// =================================================================================================================
// 4. SwiGLU: flat grid-stride loop over (row, 8-element group) or (row, element).
// =================================================================================================================

constexpr int kSwigluThreads = 256;

__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_kernel(const T* __restrict__ gu, T* __restrict__ out,
                                                                 int rows, int inter, int gu_stride, int out_stride) {
  const int per_row = kVec ? inter / 8 : inter;
  const long long n = static_cast<long long>(rows) * per_row;
  for (long long i = static_cast<long long>(blockIdx.x) * kSwigluThreads + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kSwigluThreads) {
    const long long r = i / per_row;
    const int c = static_cast<int>(i - r * per_row);
    const T* g = gu + r * gu_stride;
    T* o = out + r * out_stride;
    if constexpr (kVec) {
      const Vec8<T> gv = reinterpret_cast<const Vec8<T>*>(g)[c];
      const Vec8<T> uv = reinterpret_cast<const Vec8<T>*>(g + inter)[c];
      Vec8<T> ov;
#pragma unroll
      for (int e = 0; e < 8; ++e) ov.v[e] = from_f<T>(silu_mul(to_f(gv.v[e]), to_f(uv.v[e])));
      reinterpret_cast<Vec8<T>*>(o)[c] = ov;
    } else {
      o[c] = from_f<T>(silu_mul(to_f(g[c]), to_f(g[inter + c])));
    }
  }
}

int grid_cap(long long blocks) { return static_cast<int>(blocks < (1 << 20) ? (blocks < 1 ? 1 : blocks) : (1 << 20)); }

}  // namespace
}  // namespace detail

using detail::invalid_argument;

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------

cudaError_t embedding_gather(const EmbeddingParams& p, cudaStream_t stream) {
  const char* w = "embedding_gather";
  if (const cudaError_t e = detail::check_elem_count(w, p.dtype, "num_tokens", p.num_tokens); e != cudaSuccess)
    return e;
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.vocab_size <= 0) return invalid_argument(w, "vocab_size = ", p.vocab_size, " must be > 0");
  if (p.hidden <= 0) return invalid_argument(w, "hidden = ", p.hidden, " must be > 0");
  if (p.token_ids == nullptr || p.table == nullptr || p.out == nullptr)
    return invalid_argument(w, "token_ids, table and out must be set");
  return detail::dispatch_elem(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = p.hidden % 8 == 0 && detail::aligned16(p.table) && detail::aligned16(p.out);
    if (vec) {
      detail::embedding_kernel<T, true><<<p.num_tokens, detail::kEmbedThreads, 0, stream>>>(
          p.token_ids, static_cast<const T*>(p.table), static_cast<T*>(p.out), p.error_flag, p.vocab_size, p.hidden);
    } else {
      detail::embedding_kernel<T, false><<<p.num_tokens, detail::kEmbedThreads, 0, stream>>>(
          p.token_ids, static_cast<const T*>(p.table), static_cast<T*>(p.out), p.error_flag, p.vocab_size, p.hidden);
    }
    return cudaGetLastError();
  });
}

cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream) {
  const char* w = "swiglu";
  if (const cudaError_t e = detail::check_elem_count(w, p.dtype, "rows", p.rows); e != cudaSuccess) return e;
  if (p.inter <= 0 || p.inter > 0x3fffffff) return invalid_argument(w, "inter = ", p.inter, " must be > 0");
  const int gs = p.gate_up_stride == 0 ? 2 * p.inter : p.gate_up_stride;
  const int os = p.out_stride == 0 ? p.inter : p.out_stride;
  if (gs < 2 * p.inter) return invalid_argument(w, "gate_up_stride = ", gs, " < 2 * inter = ", 2 * p.inter);
  if (os < p.inter) return invalid_argument(w, "out_stride = ", os, " < inter = ", p.inter);
  if (p.rows == 0) return cudaSuccess;
  if (p.gate_up == nullptr || p.out == nullptr) return invalid_argument(w, "gate_up and out must be set");
  return detail::dispatch_elem(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = p.inter % 8 == 0 && gs % 8 == 0 && os % 8 == 0 && detail::aligned16(p.gate_up) &&
                     detail::aligned16(p.out);
    const long long n = static_cast<long long>(p.rows) * (vec ? p.inter / 8 : p.inter);
    const int blocks = detail::grid_cap((n + detail::kSwigluThreads - 1) / detail::kSwigluThreads);
    if (vec) {
      detail::swiglu_kernel<T, true><<<blocks, detail::kSwigluThreads, 0, stream>>>(
          static_cast<const T*>(p.gate_up), static_cast<T*>(p.out), p.rows, p.inter, gs, os);
    } else {
      detail::swiglu_kernel<T, false><<<blocks, detail::kSwigluThreads, 0, stream>>>(
          static_cast<const T*>(p.gate_up), static_cast<T*>(p.out), p.rows, p.inter, gs, os);
    }
    return cudaGetLastError();
  });
}

}  // namespace spade::kernels

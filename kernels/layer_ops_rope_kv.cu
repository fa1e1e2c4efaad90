// Layer ops of the GPU inference rank: q/k-norm + RoPE (rotate_half, rope_ref.h) + paged KV append (kv_append_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/layer_ops.cuh"
#include "kernels/layer_ops_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =================================================================================================================
// 3. q/k norm + RoPE + KV append: one CTA per token. cos/sin of the token's angles are computed once into shared
// memory; each warp then takes whole heads (q heads, then k heads: k starts at column Hq*D, so head hh of either is
// at column hh*D), normalises in registers, stages the head in shared memory for the rotate_half partner, and writes
// q_out or the k cache slot; v heads are copied to the v cache unchanged.
// =================================================================================================================

constexpr int kRopeThreads = 128;
constexpr int kRopeWarps = kRopeThreads / 32;

struct InvFreq {
  float v[kMaxLayerOpsHeadDim / 2];
};

template <typename T>
struct RopeArgs {
  const T* qkv;
  T* q_out;
  T* k_cache;
  T* v_cache;
  const int32_t* positions;
  const int32_t* seq_idx;
  const int32_t* block_table;
  const void* q_norm;
  const void* k_norm;
  int32_t* error_flag;
  T* row_out;
  int row_out_stride;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int rot_dim;
  int qkv_stride;
  int batch;
  int max_pages;
  int page_size;
  int num_pages;
  float eps;
  bool norm_f32;
  bool unit_offset;
};

// Grid (tokens, head blocks + 1): block y < gridDim.y - 1 normalises, rotates and writes q/k heads
// [y * kRopeWarps, (y + 1) * kRopeWarps), one per warp; the last y block copies the token's V heads. A decode step's
// few tokens thus spread over (heads / 4 + 1) CTAs each instead of looping over every head in one CTA (32 us -> a few
// us per layer at batch 8 on an H100).
template <typename T>
__global__ void __launch_bounds__(kRopeThreads) rope_kv_append_kernel(const RopeArgs<T> a, const InvFreq freq) {
  __shared__ float s_cos[kMaxLayerOpsHeadDim / 2];
  __shared__ float s_sin[kMaxLayerOpsHeadDim / 2];
  __shared__ float s_head[kRopeWarps][kMaxLayerOpsHeadDim];
  __shared__ long long s_kv_row;  // element offset of the token's cache row, or -1: no KV write
  const int t = blockIdx.x;
  const bool v_block = blockIdx.y == gridDim.y - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int D = a.head_dim, half = v_block ? 0 : a.rot_dim / 2;
  const int pos = a.positions[t];
  const float fpos = static_cast<float>(pos);
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    float s, c;
    sincosf(__fmul_rn(fpos, freq.v[i]), &s, &c);
    s_cos[i] = c;
    s_sin[i] = s;
  }
  if (threadIdx.x == 0) {
    long long row = -1;
    bool bad = false;
    const int b = a.seq_idx[t];
    if (b < 0 || b >= a.batch || pos < 0 || static_cast<long long>(pos) >= static_cast<long long>(a.max_pages) * a.page_size) {
      bad = true;
    } else {
      const int page = a.block_table[static_cast<size_t>(b) * a.max_pages + pos / a.page_size];
      if (page >= 0 && page < a.num_pages) {
        row = (static_cast<long long>(page) * a.page_size + pos % a.page_size) * a.num_kv_heads * D;
      } else if (page != -1) {
        bad = true;
      }
    }
    if (bad && a.error_flag != nullptr && blockIdx.y == 0) *a.error_flag = 1;
    s_kv_row = row;
  }
  __syncthreads();
  const long long kv_row = s_kv_row;
  const T* src_row = a.qkv + static_cast<size_t>(t) * a.qkv_stride;
  float* buf = s_head[warp];
  const int heads = a.num_q_heads + a.num_kv_heads;
  const T* vsrc = src_row + static_cast<size_t>(heads) * D;
  if (v_block) {
    const int n = a.num_kv_heads * D;
    if (kv_row >= 0) {
      T* vdst = a.v_cache + kv_row;
      for (int i = threadIdx.x; i < n; i += kRopeThreads) vdst[i] = vsrc[i];
    }
    if (a.row_out != nullptr) {
      T* vrow = a.row_out + static_cast<size_t>(t) * a.row_out_stride + static_cast<size_t>(heads) * D;
      for (int i = threadIdx.x; i < n; i += kRopeThreads) vrow[i] = vsrc[i];
    }
    return;
  }
  const int hh = blockIdx.y * kRopeWarps + warp;
  const bool is_q = hh < a.num_q_heads;
  if (hh < heads && (is_q || kv_row >= 0 || a.row_out != nullptr)) {  // warp-uniform
    const T* src = src_row + static_cast<size_t>(hh) * D;
    float v[kHeadRegs];
#pragma unroll
    for (int k = 0; k < kHeadRegs; ++k) {
      const int d = lane + 32 * k;
      v[k] = d < D ? to_f(src[d]) : 0.f;
    }
    const void* nw = is_q ? a.q_norm : a.k_norm;
    if (nw != nullptr) {
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < kHeadRegs; ++k) ss = __fadd_rn(ss, __fmul_rn(v[k], v[k]));
      ss = warp_sum_xor(ss, 1, 16);
      const float inv = rms_inv(ss, D, a.eps);
#pragma unroll
      for (int k = 0; k < kHeadRegs; ++k) {
        const int d = lane + 32 * k;
        if (d < D) v[k] = __fmul_rn(norm_weight<T>(nw, a.norm_f32, a.unit_offset, d), __fmul_rn(v[k], inv));
      }
    }
#pragma unroll
    for (int k = 0; k < kHeadRegs; ++k) {
      const int d = lane + 32 * k;
      if (d < D) buf[d] = v[k];
    }
    __syncwarp();
    T* dst = is_q ? a.q_out + (static_cast<size_t>(t) * a.num_q_heads + hh) * D
                  : (kv_row >= 0 ? a.k_cache + kv_row + static_cast<long long>(hh - a.num_q_heads) * D : nullptr);
    T* row = a.row_out != nullptr ? a.row_out + static_cast<size_t>(t) * a.row_out_stride + static_cast<size_t>(hh) * D
                                  : nullptr;
#pragma unroll
    for (int k = 0; k < kHeadRegs; ++k) {
      const int d = lane + 32 * k;
      if (d >= D) continue;
      float y = v[k];
      if (d < half) {  // x0 = buf[d], x1 = buf[d + half]: x0 c - x1 s (rope_ref's order, never fused)
        y = __fsub_rn(__fmul_rn(buf[d], s_cos[d]), __fmul_rn(buf[d + half], s_sin[d]));
      } else if (d < 2 * half) {  // x1 = buf[d], x0 = buf[d - half]: x1 c + x0 s
        y = __fadd_rn(__fmul_rn(buf[d], s_cos[d - half]), __fmul_rn(buf[d - half], s_sin[d - half]));
      }
      const T out = from_f<T>(y);
      if (dst != nullptr) dst[d] = out;
      if (row != nullptr) row[d] = out;
    }
  }
}

}  // namespace
}  // namespace detail

using detail::invalid_argument;

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------

cudaError_t rope_kv_append(const RopeKvAppendParams& p, cudaStream_t stream) {
  const char* w = "rope_kv_append";
  cudaError_t e = detail::check_elem_count(w, p.dtype, "tokens", p.tokens);
  if (e == cudaSuccess) e = detail::check_head_dim(w, p.head_dim);
  if (e != cudaSuccess) return e;
  if (p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return invalid_argument(w, "num_q_heads = ", p.num_q_heads, " must be a positive multiple of num_kv_heads = ",
                            p.num_kv_heads);
  if (p.rot_dim < 0 || p.rot_dim > p.head_dim || p.rot_dim % 2 != 0)
    return invalid_argument(w, "rot_dim = ", p.rot_dim, " must be even and in 0..head_dim = ", p.head_dim);
  const long long row = static_cast<long long>(p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  if (row > 0x7fffffff) return invalid_argument(w, "qkv row too large");
  const int qs = p.qkv_stride == 0 ? static_cast<int>(row) : p.qkv_stride;
  if (qs < row) return invalid_argument(w, "qkv_stride = ", qs, " < (num_q_heads + 2 * num_kv_heads) * head_dim = ", row);
  const int os = p.row_out_stride == 0 ? static_cast<int>(row) : p.row_out_stride;
  if (os < row) return invalid_argument(w, "row_out_stride = ", os, " < ", row);
  if (p.batch <= 0) return invalid_argument(w, "batch = ", p.batch, " must be > 0");
  if (p.max_pages_per_seq <= 0) return invalid_argument(w, "max_pages_per_seq = ", p.max_pages_per_seq, " must be > 0");
  if (p.page_size <= 0) return invalid_argument(w, "page_size = ", p.page_size, " must be > 0");
  if (p.num_pages <= 0) return invalid_argument(w, "num_pages = ", p.num_pages, " must be > 0");
  if (!(p.theta > 0.0) || !std::isfinite(p.theta)) return invalid_argument(w, "theta = ", p.theta, " must be > 0");
  if ((p.q_norm_weight == nullptr) != (p.k_norm_weight == nullptr))
    return invalid_argument(w, "q_norm_weight and k_norm_weight must be both set or both null");
  if (p.q_norm_weight != nullptr) {
    e = detail::check_f32_or_elem(w, "norm_weight_dtype", p.norm_weight_dtype, p.dtype);
    if (e != cudaSuccess) return e;
    if (!(p.norm_eps > 0.f)) return invalid_argument(w, "norm_eps = ", p.norm_eps, " must be > 0");
  }
  if (p.tokens == 0) return cudaSuccess;
  if (p.qkv == nullptr || p.q_out == nullptr || p.k_cache == nullptr || p.v_cache == nullptr ||
      p.positions == nullptr || p.seq_idx == nullptr || p.block_table == nullptr)
    return invalid_argument(w, "qkv, q_out, k_cache, v_cache, positions, seq_idx and block_table must be set");
  // inv_freq exactly as kernels/rope_ref.cpp computes it (host fp32 powf and division).
  detail::InvFreq freq{};
  const int half = p.rot_dim / 2;
  for (int i = 0; i < half; ++i)
    freq.v[i] = 1.0f / std::pow(static_cast<float>(p.theta), static_cast<float>(2 * i) / static_cast<float>(p.rot_dim));
  return detail::dispatch_elem(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    detail::RopeArgs<T> a{};
    a.qkv = static_cast<const T*>(p.qkv);
    a.q_out = static_cast<T*>(p.q_out);
    a.k_cache = static_cast<T*>(p.k_cache);
    a.v_cache = static_cast<T*>(p.v_cache);
    a.positions = p.positions;
    a.seq_idx = p.seq_idx;
    a.block_table = p.block_table;
    a.q_norm = p.q_norm_weight;
    a.k_norm = p.k_norm_weight;
    a.error_flag = p.error_flag;
    a.row_out = static_cast<T*>(p.row_out);
    a.row_out_stride = os;
    a.num_q_heads = p.num_q_heads;
    a.num_kv_heads = p.num_kv_heads;
    a.head_dim = p.head_dim;
    a.rot_dim = p.rot_dim;
    a.qkv_stride = qs;
    a.batch = p.batch;
    a.max_pages = p.max_pages_per_seq;
    a.page_size = p.page_size;
    a.num_pages = p.num_pages;
    a.eps = p.norm_eps;
    a.norm_f32 = p.norm_weight_dtype == DType::F32;
    a.unit_offset = p.norm_unit_offset;
    const int head_blocks = (p.num_q_heads + p.num_kv_heads + detail::kRopeWarps - 1) / detail::kRopeWarps;
    detail::rope_kv_append_kernel<T><<<dim3(p.tokens, head_blocks + 1), detail::kRopeThreads, 0, stream>>>(a, freq);
    return cudaGetLastError();
  });
}

}  // namespace spade::kernels

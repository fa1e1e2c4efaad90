// Per-layer ops of the GPU inference rank: embedding gather, RMSNorm (plain / fused residual / per head),
// q/k-norm + RoPE + paged KV append, SwiGLU, greedy and temperature/top-k/top-p sampling.
// Public API and semantics: kernels/layer_ops.cuh. Design notes: docs/KERNELS.md, "Layer ops for the GPU inference
// rank". Element types: the one list is `dispatch_elem` below (bf16, fp16); logits types: `dispatch_logits`.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/layer_ops.cuh"
#include "kernels/sampling_ref.h"

namespace spade::kernels {
namespace detail {
namespace {

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

/// Logits: fp32, bf16, fp16 (kernel_common.cuh dispatch_float_types; to_f / from_f convert elements).
template <typename F>
cudaError_t dispatch_logits(DType t, F&& f) {
  return dispatch_float_types(t, std::forward<F>(f));
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

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
        for (int e = 0; e < 8; ++e) {
          const RT stored = from_f<RT>(__fadd_rn(to_f(rv.v[e]), to_f(xv.v[e])));
          rv.v[e] = stored;
          v[e] = to_f(stored);
        }
        reinterpret_cast<Vec8<RT>*>(res)[j] = rv;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = __fadd_rn(ss, __fmul_rn(v[e], v[e]));
    }
  } else {
    for (int j = threadIdx.x; j < dim; j += kNormThreads) {
      float v;
      if constexpr (kRes == ResMode::kNone) {
        v = to_f(xr[j]);
      } else {
        const RT stored = from_f<RT>(__fadd_rn(to_f(res[j]), to_f(xr[j])));
        res[j] = stored;
        v = to_f(stored);
      }
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
      float v;
      if constexpr (kRes == ResMode::kNone) {
        v = to_f(xr[j]);
      } else {
        v = to_f(res[j]);
      }
      yr[j] = from_f<T>(__fmul_rn(norm_weight<T>(weight, w_f32, unit_offset, j), __fmul_rn(v, inv)));
    }
  }
}

// =================================================================================================================
// Per-head RMSNorm: one warp per (token, head); the head lives in the lane's registers.
// =================================================================================================================

constexpr int kHeadNormThreads = 256;
constexpr int kHeadRegs = kMaxLayerOpsHeadDim / 32;

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

// =================================================================================================================
// 5. Sampling. Loads of V consecutive logits per lane (V = 4 when the row is 4-element aligned).
// =================================================================================================================

template <typename LT, int V>
__device__ __forceinline__ void load_logits(const LT* row, long long i0, int vocab, float c[V]) {
  if (V == 4 && i0 + 4 <= vocab) {
    if constexpr (sizeof(LT) == 4) {
      const float4 q = *reinterpret_cast<const float4*>(row + i0);
      c[0] = q.x;
      c[1] = q.y;
      c[2] = q.z;
      c[3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2*>(row + i0);
      const LT* e = reinterpret_cast<const LT*>(&q);
#pragma unroll
      for (int k = 0; k < V; ++k) c[k] = to_f(e[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) c[k] = i0 + k < vocab ? to_f(row[i0 + k]) : __int_as_float(0xff800000u);
  }
#pragma unroll
  for (int k = 0; k < V; ++k) c[k] = sample_canonical(c[k]);
}

struct ArgPair {
  float v;
  int i;
};
struct ArgPairMax {
  __device__ __forceinline__ ArgPair operator()(const ArgPair& a, const ArgPair& b) const {
    return (a.v > b.v || (a.v == b.v && a.i < b.i)) ? a : b;
  }
};

constexpr int kArgmaxThreads = 1024;

template <typename LT, int V>
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const LT* __restrict__ logits, int32_t* out, int vocab,
                                                                 long long stride) {
  const LT* row = logits + blockIdx.x * stride;
  ArgPair best{__int_as_float(0xff800000u), INT_MAX};
  for (long long i0 = static_cast<long long>(threadIdx.x) * V; i0 < vocab; i0 += static_cast<long long>(kArgmaxThreads) * V) {
    float c[V];
    load_logits<LT, V>(row, i0, vocab, c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (i0 + k < vocab && (best.i == INT_MAX || c[k] > best.v)) best = {c[k], static_cast<int>(i0 + k)};
    }
  }
  using Reduce = cub::BlockReduce<ArgPair, kArgmaxThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const ArgPair r = Reduce(tmp).Reduce(best, ArgPairMax{});
  if (threadIdx.x == 0) out[blockIdx.x] = r.i;
}

constexpr int kSampleThreads = 512;
constexpr int kSampleWarps = kSampleThreads / 32;

/// Float of an order-preserving key (inverse of sample_key for canonical floats).
__device__ __forceinline__ float key_to_float(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ unsigned long long warp_incl_scan(unsigned long long v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}
__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct SampleShared {
  unsigned long long hist[kSampleWarps][256];
  unsigned long long bins[256];
  unsigned long long warp_tot[kSampleWarps];
  // results broadcast by one thread
  int sel_digit;
  unsigned long long sel_above;
  unsigned long long sel_bin;
  int sel_warp;
  unsigned long long sel_base;
  long long found;
};

/// One CTA per row; warp w owns the contiguous segment [w * seg, (w + 1) * seg) of the row and walks it in steps of
/// 32 * V elements (lane l: elements base + l * V .. + V - 1), so a warp's traversal is in index order.
template <typename LT, int V>
class RowSampler {
 public:
  __device__ RowSampler(const LT* row, int vocab, int seg, SampleShared& sh)
      : row_(row), vocab_(vocab), sh_(sh), warp_(threadIdx.x / 32), lane_(threadIdx.x & 31) {
    begin_ = static_cast<long long>(warp_) * seg;
    end_ = begin_ + seg < vocab ? begin_ + seg : vocab;
  }

  /// Calls f(index, canonical logit) for every element of this thread (warp-uniform trip count; valid elements only).
  template <typename F>
  __device__ __forceinline__ void for_each(F&& f) const {
    for (long long base = begin_; base < end_; base += 32 * V) {
      const long long i0 = base + static_cast<long long>(lane_) * V;
      float c[V] = {};
      if (i0 < end_) load_logits<LT, V>(row_, i0, vocab_, c);
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (i0 + k < end_) f(i0 + k, c[k]);
    }
  }

  /// Digit-by-digit descent (MSB first, 8-bit digits) to the key K where the running `value` (count or mass) of the
  /// elements with pred(i, key) taken in descending key order first reaches `target` (>= 1, <= the total):
  /// value(key > K) < target <= value(key >= K). Returns K; *above = value(key > K); *at = value(key == K).
  template <typename Pred, typename Val>
  __device__ uint32_t descend(unsigned long long target, Pred&& pred, Val&& value, unsigned long long* above,
                              unsigned long long* at) {
    uint32_t prefix = 0, mask = 0;
    unsigned long long rem = target, above_total = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < kSampleWarps * 256; b += kSampleThreads) (&sh_.hist[0][0])[b] = 0;
      __syncthreads();
      for_each([&](long long i, float c) {
        const uint32_t key = sample_key(c);
        if ((key & mask) != prefix || !pred(i, key)) return;
        const unsigned long long v = value(c);
        if (v != 0) atomicAdd(&sh_.hist[warp_][(key >> shift) & 255u], v);
      });
      __syncthreads();
      for (int b = threadIdx.x; b < 256; b += kSampleThreads) {
        unsigned long long s = 0;
#pragma unroll
        for (int w = 0; w < kSampleWarps; ++w) s += sh_.hist[w][b];
        sh_.bins[b] = s;
      }
      __syncthreads();
      if (warp_ == 0) {  // lane l owns bins 255 - 8l .. 248 - 8l (descending)
        unsigned long long lane_sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) lane_sum += sh_.bins[255 - 8 * lane_ - j];
        const unsigned long long incl = warp_incl_scan(lane_sum, lane_);
        const unsigned long long excl = incl - lane_sum;
        if (excl < rem && rem <= incl) {
          unsigned long long cum = excl;
          for (int j = 0; j < 8; ++j) {
            const int d = 255 - 8 * lane_ - j;
            const unsigned long long bv = sh_.bins[d];
            if (cum + bv >= rem) {
              sh_.sel_digit = d;
              sh_.sel_above = cum;
              sh_.sel_bin = bv;
              break;
            }
            cum += bv;
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<uint32_t>(sh_.sel_digit) << shift;
      mask |= 255u << shift;
      rem -= sh_.sel_above;
      above_total += sh_.sel_above;
      *at = sh_.sel_bin;
      __syncthreads();  // sh_ is rewritten by the next digit
    }
    *above = above_total;
    return prefix;
  }

  /// First index (ascending) whose inclusive prefix sum of value(i, c) exceeds r; `fallback` if none.
  template <typename Val>
  __device__ long long ordered_find(unsigned long long r, Val&& value, long long fallback) {
    unsigned long long mine = 0;
    for_each([&](long long i, float c) { mine += value(i, c); });
    mine = warp_sum_u64(mine);
    if (lane_ == 0) sh_.warp_tot[warp_] = mine;
    if (threadIdx.x == 0) sh_.found = fallback;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long excl = 0;
      sh_.sel_warp = -1;
      for (int w = 0; w < kSampleWarps; ++w) {
        if (r < excl + sh_.warp_tot[w]) {
          sh_.sel_warp = w;
          sh_.sel_base = excl;
          break;
        }
        excl += sh_.warp_tot[w];
      }
    }
    __syncthreads();
    if (warp_ == sh_.sel_warp) {
      unsigned long long running = sh_.sel_base;
      for (long long base = begin_; base < end_; base += 32 * V) {
        const long long i0 = base + static_cast<long long>(lane_) * V;
        float c[V] = {};
        unsigned long long vals[V];
        unsigned long long lane_sum = 0;
        if (i0 < end_) load_logits<LT, V>(row_, i0, vocab_, c);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          vals[k] = i0 + k < end_ ? value(i0 + k, c[k]) : 0ull;
          lane_sum += vals[k];
        }
        const unsigned long long incl = warp_incl_scan(lane_sum, lane_);
        const unsigned long long step_total = __shfl_sync(0xffffffffu, incl, 31);
        if (running + step_total > r) {
          const unsigned ballot = __ballot_sync(0xffffffffu, running + incl > r);
          const int hit = __ffs(ballot) - 1;
          if (lane_ == hit) {
            unsigned long long cum = running + incl - lane_sum;
            for (int k = 0; k < V; ++k) {
              cum += vals[k];
              if (cum > r) {
                sh_.found = i0 + k;
                break;
              }
            }
          }
          break;
        }
        running += step_total;
      }
    }
    __syncthreads();
    const long long res = sh_.found;
    __syncthreads();
    return res;
  }

 private:
  const LT* row_;
  int vocab_;
  SampleShared& sh_;
  int warp_, lane_;
  long long begin_, end_;
};

template <typename LT, int V>
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const LT* __restrict__ logits, long long stride,
                                                                int vocab, int seg, const float* temperature,
                                                                const int32_t* top_k, const float* top_p,
                                                                const uint64_t* seeds, const uint64_t* steps,
                                                                int32_t* out) {
  __shared__ SampleShared sh;
  using Reduce = cub::BlockReduce<ArgPair, kSampleThreads>;
  __shared__ typename Reduce::TempStorage red;
  __shared__ ArgPair s_best;
  const int r = blockIdx.x;
  RowSampler<LT, V> rs(logits + r * stride, vocab, seg, sh);

  // Greedy token and the maximum.
  ArgPair best{__int_as_float(0xff800000u), INT_MAX};
  rs.for_each([&](long long i, float c) {
    if (best.i == INT_MAX || c > best.v) best = {c, static_cast<int>(i)};
  });
  const ArgPair b = Reduce(red).Reduce(best, ArgPairMax{});
  if (threadIdx.x == 0) s_best = b;
  __syncthreads();
  const ArgPair mx = s_best;
  const float temp = temperature[r];
  const int k = top_k[r];
  if (!(temp > 0.f) || k == 1) {
    if (threadIdx.x == 0) out[r] = mx.i;
    return;
  }
  const float inv_t = __fdiv_rn(1.0f, temp);
  const float m = __fmul_rn(mx.v, inv_t);
  if (!isfinite(m)) {
    if (threadIdx.x == 0) out[r] = mx.i;
    return;
  }
  auto mass = [&](float c) -> unsigned long long { return sample_mass(c, inv_t, m); };

  // top-k: threshold key kk; ties at kk kept up to index ik.
  uint32_t kk = 0;
  long long ik = LLONG_MAX;
  if (k > 0 && k < vocab) {
    unsigned long long above = 0, at = 0;
    kk = rs.descend(static_cast<unsigned long long>(k), [](long long, uint32_t) { return true; },
                    [](float) -> unsigned long long { return 1ull; }, &above, &at);
    const unsigned long long need = static_cast<unsigned long long>(k) - above;
    if (need < at) {
      ik = rs.ordered_find(need - 1, [&](long long, float c) -> unsigned long long { return sample_key(c) == kk; },
                           LLONG_MAX);
    }
  }
  auto cand = [&](long long i, uint32_t key) { return key > kk || (key == kk && i <= ik); };

  // Candidate mass (integer: exact and order-independent).
  unsigned long long mine = 0;
  rs.for_each([&](long long i, float c) {
    if (cand(i, sample_key(c))) mine += mass(c);
  });
  mine = warp_sum_u64(mine);
  if ((threadIdx.x & 31) == 0) sh.warp_tot[threadIdx.x / 32] = mine;
  __syncthreads();
  unsigned long long cand_total = 0;
#pragma unroll
  for (int w = 0; w < kSampleWarps; ++w) cand_total += sh.warp_tot[w];
  __syncthreads();

  // top-p: threshold key kp; ties at kp (equal masses q) kept up to index ip.
  uint32_t kp = 0;
  long long ip = LLONG_MAX;
  unsigned long long kept_total = cand_total;
  const float pp = top_p[r];
  if (pp < 1.0f) {
    const unsigned long long target = sample_top_p_target(pp, cand_total);
    unsigned long long above = 0, at = 0;
    kp = rs.descend(target, cand, mass, &above, &at);
    unsigned long long q = mass(key_to_float(kp));
    if (q == 0) q = 1;  // unreachable (the tie bin holds mass >= rem >= 1); keeps the division defined
    const unsigned long long rem = target - above;
    const unsigned long long need = (rem + q - 1) / q;
    kept_total = above + need * q;
    if (need * q < at) {
      ip = rs.ordered_find(need - 1, [&](long long i, float c) -> unsigned long long {
        const uint32_t key = sample_key(c);
        return key == kp && cand(i, key);
      }, LLONG_MAX);
    }
  }

  // Draw and walk the kept tokens in index order.
  const uint64_t rr = sample_scale_draw(sample_random_word(seeds[r], steps[r]), kept_total);
  const long long tok = rs.ordered_find(rr, [&](long long i, float c) -> unsigned long long {
    const uint32_t key = sample_key(c);
    if (!cand(i, key) || !(key > kp || (key == kp && i <= ip))) return 0ull;
    return mass(c);
  }, mx.i);
  if (threadIdx.x == 0) out[r] = static_cast<int32_t>(tok);
}

// ---------------------------------------------------------------------------------------------------------------
// Validation helpers
// ---------------------------------------------------------------------------------------------------------------

bool is_elem(DType t) { return t == DType::BF16 || t == DType::F16; }

int grid_cap(long long blocks) { return static_cast<int>(blocks < (1 << 20) ? (blocks < 1 ? 1 : blocks) : (1 << 20)); }

}  // namespace
}  // namespace detail

using detail::invalid_argument;

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------

cudaError_t embedding_gather(const EmbeddingParams& p, cudaStream_t stream) {
  const char* w = "embedding_gather";
  if (!detail::is_elem(p.dtype)) return invalid_argument(w, "dtype must be BF16 or F16");
  if (p.num_tokens < 0) return invalid_argument(w, "num_tokens = ", p.num_tokens, " < 0");
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

cudaError_t rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  const char* w = "rmsnorm";
  if (!detail::is_elem(p.dtype)) return invalid_argument(w, "dtype must be BF16 or F16");
  if (p.weight_dtype != DType::F32 && p.weight_dtype != p.dtype)
    return invalid_argument(w, "weight_dtype must be F32 or equal to dtype");
  if (p.residual != nullptr && p.residual_dtype != DType::F32 && p.residual_dtype != p.dtype)
    return invalid_argument(w, "residual_dtype must be F32 or equal to dtype");
  if (p.rows < 0) return invalid_argument(w, "rows = ", p.rows, " < 0");
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
  if (!detail::is_elem(p.dtype)) return invalid_argument(w, "dtype must be BF16 or F16");
  if (p.weight_dtype != DType::F32 && p.weight_dtype != p.dtype)
    return invalid_argument(w, "weight_dtype must be F32 or equal to dtype");
  if (p.tokens < 0) return invalid_argument(w, "tokens = ", p.tokens, " < 0");
  if (p.num_heads <= 0) return invalid_argument(w, "num_heads = ", p.num_heads, " must be > 0");
  if (p.head_dim < 2 || p.head_dim > kMaxLayerOpsHeadDim || p.head_dim % 2 != 0)
    return invalid_argument(w, "head_dim = ", p.head_dim, " must be even and in 2..", kMaxLayerOpsHeadDim);
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

cudaError_t rope_kv_append(const RopeKvAppendParams& p, cudaStream_t stream) {
  const char* w = "rope_kv_append";
  if (!detail::is_elem(p.dtype)) return invalid_argument(w, "dtype must be BF16 or F16");
  if (p.tokens < 0) return invalid_argument(w, "tokens = ", p.tokens, " < 0");
  if (p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return invalid_argument(w, "num_q_heads = ", p.num_q_heads, " must be a positive multiple of num_kv_heads = ",
                            p.num_kv_heads);
  if (p.head_dim < 2 || p.head_dim > kMaxLayerOpsHeadDim || p.head_dim % 2 != 0)
    return invalid_argument(w, "head_dim = ", p.head_dim, " must be even and in 2..", kMaxLayerOpsHeadDim);
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
    if (p.norm_weight_dtype != DType::F32 && p.norm_weight_dtype != p.dtype)
      return invalid_argument(w, "norm_weight_dtype must be F32 or equal to dtype");
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

cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream) {
  const char* w = "swiglu";
  if (!detail::is_elem(p.dtype)) return invalid_argument(w, "dtype must be BF16 or F16");
  if (p.rows < 0) return invalid_argument(w, "rows = ", p.rows, " < 0");
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

namespace {

/// 4-wide logits loads need the row starts 4-element aligned (16 bytes for fp32, 8 for 16-bit types).
bool logits_vec4(const void* logits, int stride, size_t elem) {
  return stride % 4 == 0 && (reinterpret_cast<uintptr_t>(logits) % (4 * elem)) == 0;
}

cudaError_t check_logits(const char* w, DType t, const void* logits, int rows, int vocab, int stride,
                         const int32_t* out) {
  if (t != DType::F32 && t != DType::BF16 && t != DType::F16)
    return invalid_argument(w, "logits_dtype must be F32, BF16 or F16");
  if (rows < 0) return invalid_argument(w, "rows = ", rows, " < 0");
  if (vocab <= 0) return invalid_argument(w, "vocab = ", vocab, " must be > 0");
  if (stride < vocab) return invalid_argument(w, "logits_stride = ", stride, " < vocab = ", vocab);
  if (rows > 0 && (logits == nullptr || out == nullptr)) return invalid_argument(w, "logits and out_tokens must be set");
  return cudaSuccess;
}

}  // namespace

cudaError_t argmax_rows(const ArgmaxParams& p, cudaStream_t stream) {
  const int stride = p.logits_stride == 0 ? p.vocab : p.logits_stride;
  if (const cudaError_t e = check_logits("argmax_rows", p.logits_dtype, p.logits, p.rows, p.vocab, stride,
                                         p.out_tokens);
      e != cudaSuccess)
    return e;
  if (p.rows == 0) return cudaSuccess;
  return detail::dispatch_logits(p.logits_dtype, [&](auto tag) {
    using LT = decltype(tag);
    const LT* lg = static_cast<const LT*>(p.logits);
    if (logits_vec4(p.logits, stride, sizeof(LT))) {
      detail::argmax_kernel<LT, 4><<<p.rows, detail::kArgmaxThreads, 0, stream>>>(lg, p.out_tokens, p.vocab, stride);
    } else {
      detail::argmax_kernel<LT, 1><<<p.rows, detail::kArgmaxThreads, 0, stream>>>(lg, p.out_tokens, p.vocab, stride);
    }
    return cudaGetLastError();
  });
}

cudaError_t sample_rows(const SampleParams& p, cudaStream_t stream) {
  const char* w = "sample_rows";
  const int stride = p.logits_stride == 0 ? p.vocab : p.logits_stride;
  if (const cudaError_t e = check_logits(w, p.logits_dtype, p.logits, p.rows, p.vocab, stride, p.out_tokens);
      e != cudaSuccess)
    return e;
  if (p.rows == 0) return cudaSuccess;
  if (p.temperature == nullptr || p.top_k == nullptr || p.top_p == nullptr || p.seeds == nullptr ||
      p.steps == nullptr)
    return invalid_argument(w, "temperature, top_k, top_p, seeds and steps must be set");
  return detail::dispatch_logits(p.logits_dtype, [&](auto tag) {
    using LT = decltype(tag);
    const LT* lg = static_cast<const LT*>(p.logits);
    auto launch = [&](auto kernel, int v) {
      // Warp segments: a multiple of one warp step (32 * V elements).
      const long long step = 32LL * v;
      const long long per_warp = (static_cast<long long>(p.vocab) + detail::kSampleWarps - 1) / detail::kSampleWarps;
      const int seg = static_cast<int>((per_warp + step - 1) / step * step);
      kernel<<<p.rows, detail::kSampleThreads, 0, stream>>>(lg, stride, p.vocab, seg, p.temperature, p.top_k, p.top_p,
                                                             p.seeds, p.steps, p.out_tokens);
      return cudaGetLastError();
    };
    return logits_vec4(p.logits, stride, sizeof(LT)) ? launch(detail::sample_kernel<LT, 4>, 4)
                                                      : launch(detail::sample_kernel<LT, 1>, 1);
  });
}

}  // namespace spade::kernels

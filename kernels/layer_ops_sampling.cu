// Layer ops of the GPU inference rank: greedy argmax, temperature / top-k / top-p sampling and the sampled tokens'
// logprobs (kernels/sampling_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>

#include <climits>
#include <cstdint>
#include <utility>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/layer_ops.cuh"
#include "common/sampling.h"  // kMaxTopLogprobs
#include "kernels/sampling_ref.h"

namespace spade::kernels {
namespace detail {
namespace {

/// Logits: fp32, bf16, fp16 (kernel_common.cuh dispatch_float_types; to_f / from_f convert elements).
template <typename F>
cudaError_t dispatch_logits(DType t, F&& f) {
  return dispatch_float_types(t, std::forward<F>(f));
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

// Elements of the vocabulary each of a row's kSampleWarps warps scans: a multiple of one warp step (32 lanes x `vec`
// elements), so that every warp but the last starts on a whole step.
inline int warp_segment(int vocab, int vec) {
  const long long step = 32LL * vec;
  const long long per_warp = (static_cast<long long>(vocab) + kSampleWarps - 1) / kSampleWarps;
  return static_cast<int>((per_warp + step - 1) / step * step);
}

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

// =================================================================================================================
// 6. Logprobs of the sampled tokens (raw: log-softmax of the canonical logits) and the top n <= kMaxTopLogprobs.
// =================================================================================================================

template <typename LT, int V>
__global__ void __launch_bounds__(kSampleThreads) logprob_kernel(const LT* __restrict__ logits, long long stride,
                                                                 int vocab, int seg, const int32_t* tokens,
                                                                 const int32_t* top_n, const int32_t* out_offset,
                                                                 LogprobEntry* out) {
  const int r = blockIdx.x;
  const int want = top_n[r];
  if (want < 0) return;
  __shared__ SampleShared sh;
  using Reduce = cub::BlockReduce<ArgPair, kSampleThreads>;
  __shared__ typename Reduce::TempStorage red;
  __shared__ float s_max;
  __shared__ float s_sum[kSampleWarps];
  __shared__ int s_count;
  __shared__ LogprobEntry s_top[kMaxTopLogprobs];
  const LT* row = logits + r * stride;
  RowSampler<LT, V> rs(row, vocab, seg, sh);

  // The maximum m, then S = sum of (c == m ? 1 : expf(c - m)) in fp32 (warp shuffles, then the warps in order).
  ArgPair best{__int_as_float(0xff800000u), INT_MAX};
  rs.for_each([&](long long i, float c) {
    if (best.i == INT_MAX || c > best.v) best = {c, static_cast<int>(i)};
  });
  const ArgPair b = Reduce(red).Reduce(best, ArgPairMax{});
  if (threadIdx.x == 0) s_max = b.v;
  __syncthreads();
  const float m = s_max;
  auto term = [m](float c) { return c == m ? 1.0f : expf(__fsub_rn(c, m)); };
  float part = 0.f;
  rs.for_each([&](long long, float c) { part += term(c); });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if ((threadIdx.x & 31) == 0) s_sum[threadIdx.x / 32] = part;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kSampleWarps; ++w) total += s_sum[w];
  const float log_s = logf(total);
  auto logprob = [&](float c) { return (c == m ? 0.f : __fsub_rn(c, m)) - log_s; };

  LogprobEntry* o = out + out_offset[r];
  if (threadIdx.x == 0) {
    const int tok = tokens[r];
    if (tok >= 0 && tok < vocab) {
      o[0] = {logprob(sample_canonical(to_f(row[tok]))), tok};
    } else {
      o[0] = {__int_as_float(0x7fc00000), -1};
    }
  }
  int n = want < kMaxTopLogprobs ? want : kMaxTopLogprobs;
  if (n > vocab) n = vocab;
  if (n == 0) return;

  // The n-th largest key kk (descending order; ties by lower index): keys above it, then the first `need` at it.
  unsigned long long above = 0, at = 0;
  const uint32_t kk = rs.descend(static_cast<unsigned long long>(n), [](long long, uint32_t) { return true; },
                                 [](float) -> unsigned long long { return 1ull; }, &above, &at);
  const unsigned long long need = static_cast<unsigned long long>(n) - above;
  long long ik = LLONG_MAX;
  if (need < at)
    ik = rs.ordered_find(need - 1, [&](long long, float c) -> unsigned long long { return sample_key(c) == kk; },
                         LLONG_MAX);
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  rs.for_each([&](long long i, float c) {
    const uint32_t key = sample_key(c);
    if (key > kk || (key == kk && i <= ik)) {
      const int slot = atomicAdd(&s_count, 1);
      if (slot < kMaxTopLogprobs) s_top[slot] = {c, static_cast<int32_t>(i)};
    }
  });
  __syncthreads();
  if (threadIdx.x == 0) {  // exactly n selected: insertion sort by (logit descending, id ascending)
    const int cnt = s_count < n ? s_count : n;
    for (int a = 1; a < cnt; ++a) {
      const LogprobEntry e = s_top[a];
      int j = a;
      while (j > 0 && (s_top[j - 1].logprob < e.logprob || (s_top[j - 1].logprob == e.logprob && s_top[j - 1].id > e.id))) {
        s_top[j] = s_top[j - 1];
        --j;
      }
      s_top[j] = e;
    }
    for (int a = 0; a < cnt; ++a) o[1 + a] = {logprob(s_top[a].logprob), s_top[a].id};
  }
}

}  // namespace
}  // namespace detail

using detail::invalid_argument;

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------

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
      const int seg = detail::warp_segment(p.vocab, v);
      kernel<<<p.rows, detail::kSampleThreads, 0, stream>>>(lg, stride, p.vocab, seg, p.temperature, p.top_k, p.top_p,
                                                             p.seeds, p.steps, p.out_tokens);
      return cudaGetLastError();
    };
    return logits_vec4(p.logits, stride, sizeof(LT)) ? launch(detail::sample_kernel<LT, 4>, 4)
                                                      : launch(detail::sample_kernel<LT, 1>, 1);
  });
}

cudaError_t logprob_rows(const LogprobParams& p, cudaStream_t stream) {
  const char* w = "logprob_rows";
  const int stride = p.logits_stride == 0 ? p.vocab : p.logits_stride;
  if (p.rows > 0 && p.tokens == nullptr) return invalid_argument(w, "tokens must be set");
  if (const cudaError_t e = check_logits(w, p.logits_dtype, p.logits, p.rows, p.vocab, stride, p.tokens);
      e != cudaSuccess)
    return e;
  if (p.rows == 0) return cudaSuccess;
  if (p.top_n == nullptr || p.out_offset == nullptr || p.out == nullptr)
    return invalid_argument(w, "top_n, out_offset and out must be set");
  return detail::dispatch_logits(p.logits_dtype, [&](auto tag) {
    using LT = decltype(tag);
    const LT* lg = static_cast<const LT*>(p.logits);
    auto launch = [&](auto kernel, int v) {
      const int seg = detail::warp_segment(p.vocab, v);
      kernel<<<p.rows, detail::kSampleThreads, 0, stream>>>(lg, stride, p.vocab, seg, p.tokens, p.top_n,
                                                             p.out_offset, p.out);
      return cudaGetLastError();
    };
    return logits_vec4(p.logits, stride, sizeof(LT)) ? launch(detail::logprob_kernel<LT, 4>, 4)
                                                      : launch(detail::logprob_kernel<LT, 1>, 1);
  });
}

}  // namespace spade::kernels

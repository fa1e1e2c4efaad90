// Selection, prompt anchors: the GPU cache rank's select_anchors_ref and apply_anchor_spans_ref
// (kernels/selection_ref.h, "Prompt anchors").
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/paged_kv.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Anchor pick: one CTA per (sequence, KV head). Warp w takes the anchor queries i = w, w + 8, ... in turn;
// its lanes take the keys of the query's causal context 32 at a time, each lane one key against the G heads
// of the group (the queries in shared memory as fp32). Pass 1: per-lane online max / sum per head, merged
// over the warp (the softmax normalisers). Pass 2: each key's probability, the max over the group's heads, is
// a candidate when >= kAnchorMinMass and inside [begin, end). A query head puts >= 0.1 on at most 10 keys, so
// a query brings at most 10 G candidates. Then kMaxAnchors greedy rounds over the candidates (best
// probability first, ties to the earlier position, none within `span` of an anchor already taken), as
// select_anchors_ref.
// =====================================================================================================================

constexpr int kAnchorThreads = 256;
constexpr int kAnchorWarps = kAnchorThreads / 32;
constexpr int kCandidatesPerHead = 10;  // floor(1 / kAnchorMinMass)

struct AnchorArgs {
  PagedKv kv;
  const uint16_t* windows;
  const int32_t* window_idx;
  const int32_t* num_queries;
  const int32_t* context_len;
  const int32_t* anchor_rows;
  int32_t* anchors;
  int num_windows, hq, group, capacity, begin, local_window, span;
  float scale;
};

__host__ __device__ constexpr size_t anchor_smem_bytes(int group, int head_dim, int capacity) {
  return static_cast<size_t>(kAnchorWarps) * group * head_dim * sizeof(float) +
         static_cast<size_t>(capacity) * group * kCandidatesPerHead * (sizeof(int32_t) + sizeof(float));
}

// s[g] = q[g] . krow for the group's heads g < group (<= kMaxGqaGroup; the loops unroll over kMaxGqaGroup so
// s stays in registers).
template <typename T, int D>
__device__ __forceinline__ void dot_group(const T* krow, const float* q, int group, float* s) {
#pragma unroll
  for (int g = 0; g < kMaxGqaGroup; ++g) s[g] = 0.f;
#pragma unroll 2
  for (int d = 0; d < D; d += 8) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(krow + d));
    const T* e = reinterpret_cast<const T*>(&raw);
    float k8[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) k8[j] = ElemTraits<T>::to_float(e[j]);
#pragma unroll
    for (int g = 0; g < kMaxGqaGroup; ++g) {
      if (g >= group) break;
      const float* qg = q + g * D + d;
      float acc = s[g];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc = fmaf(qg[j], k8[j], acc);
      s[g] = acc;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kAnchorThreads) select_anchors_kernel(const AnchorArgs a) {
  extern __shared__ float anchor_smem[];
  const int kvh = blockIdx.x, b = blockIdx.y, G = a.group;
  const int w = __ldg(a.window_idx + b);
  const int ctx = __ldg(a.context_len + b);
  const int nq = min(min(__ldg(a.num_queries + b), a.capacity), ctx);
  if (nq <= 0 || w < 0 || w >= a.num_windows) return;  // this row's anchors stay as they are
  int32_t* out =
      a.anchors +
      static_cast<size_t>(__ldg(a.anchor_rows + static_cast<size_t>(b) * a.kv.hkv + kvh)) * kMaxAnchors;
  const int first_pos = ctx - nq;
  const int end = min(max(a.begin, ctx - max(a.local_window, nq)), ctx);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q_s = anchor_smem + static_cast<size_t>(warp) * G * D;  // the warp's query, [G][D] fp32
  const int cap = nq * G * kCandidatesPerHead;
  int32_t* cand_t = reinterpret_cast<int32_t*>(anchor_smem + static_cast<size_t>(kAnchorWarps) * G * D);
  float* cand_p = reinterpret_cast<float*>(cand_t + static_cast<size_t>(a.capacity) * G * kCandidatesPerHead);
  __shared__ int s_count;
  __shared__ float s_best_p[kAnchorWarps];
  __shared__ int s_best_t[kAnchorWarps];
  __shared__ int s_taken[kMaxAnchors];
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  const T* kbase = a.kv.k_head<T, D>(kvh);
  const int32_t* table = a.kv.table_row(b);
  if (end > a.begin) {
    for (int i = warp; i < nq; i += kAnchorWarps) {
      // The window holds its entries oldest first: entry i of the last nq is at position first_pos + i.
      for (int g = 0; g < G; ++g) {
        const uint16_t* src =
            a.windows + ((static_cast<size_t>(w) * a.hq + kvh * G + g) * a.capacity + i) * D;
        for (int d = lane; d < D; d += 32) {
          const uint16_t bits = src[d];
          q_s[g * D + d] = ElemTraits<T>::to_float(*reinterpret_cast<const T*>(&bits));
        }
      }
      __syncwarp();
      const int n = first_pos + i + 1;  // causal context of query i
      float m[kMaxGqaGroup], z[kMaxGqaGroup], s[kMaxGqaGroup];
#pragma unroll
      for (int g = 0; g < kMaxGqaGroup; ++g) {
        m[g] = -FLT_MAX;
        z[g] = 0.f;
      }
      for (int t = lane; t < n; t += 32) {
        const int page = table[a.kv.page_of(t)];
        dot_group<T, D>(kbase + a.kv.slot(page, t) * a.kv.row_stride<D>(), q_s, G, s);
#pragma unroll
        for (int g = 0; g < kMaxGqaGroup; ++g) {
          if (g >= G) break;
          const float x = s[g] * a.scale;
          if (x > m[g]) {
            z[g] = z[g] * expf(m[g] - x) + 1.f;
            m[g] = x;
          } else {
            z[g] += expf(x - m[g]);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxGqaGroup; ++g) {  // merge the lanes' (max, sum)
        if (g >= G) break;
        for (int off = 16; off > 0; off >>= 1) {
          const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
          const float zo = __shfl_xor_sync(0xffffffffu, z[g], off);
          const float mx = fmaxf(m[g], mo);
          z[g] = (z[g] > 0.f ? z[g] * expf(m[g] - mx) : 0.f) + (zo > 0.f ? zo * expf(mo - mx) : 0.f);
          m[g] = mx;
        }
      }
      for (int t = a.begin + lane; t < min(end, n); t += 32) {
        const int page = table[a.kv.page_of(t)];
        dot_group<T, D>(kbase + a.kv.slot(page, t) * a.kv.row_stride<D>(), q_s, G, s);
        float p = 0.f;
#pragma unroll
        for (int g = 0; g < kMaxGqaGroup; ++g)
          if (g < G) p = fmaxf(p, expf(s[g] * a.scale - m[g]) / z[g]);
        if (p >= kAnchorMinMass) {
          const int at = atomicAdd(&s_count, 1);
          if (at < cap) {
            cand_t[at] = t;
            cand_p[at] = p;
          }
        }
      }
      __syncwarp();  // q_s is rewritten for the warp's next query
    }
  }
  __syncthreads();
  const int count = min(s_count, cap);
  // kMaxAnchors greedy rounds: the best candidate not within span of a taken anchor.
  int taken = 0;
  for (int r = 0; r < kMaxAnchors; ++r) {
    float bp = -1.f;
    int bt = INT32_MAX;
    for (int c = threadIdx.x; c < count; c += kAnchorThreads) {
      const int t = cand_t[c];
      const float p = cand_p[c];
      bool near = false;
      for (int j = 0; j < taken; ++j) near = near || abs(t - s_taken[j]) < a.span;
      if (!near && (p > bp || (p == bp && t < bt))) {
        bp = p;
        bt = t;
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float po = __shfl_xor_sync(0xffffffffu, bp, off);
      const int to = __shfl_xor_sync(0xffffffffu, bt, off);
      if (po > bp || (po == bp && to < bt)) {
        bp = po;
        bt = to;
      }
    }
    if (lane == 0) {
      s_best_p[warp] = bp;
      s_best_t[warp] = bt;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float p = -1.f;
      int t = INT32_MAX;
      for (int j = 0; j < kAnchorWarps; ++j)
        if (s_best_p[j] > p || (s_best_p[j] == p && s_best_t[j] < t)) {
          p = s_best_p[j];
          t = s_best_t[j];
        }
      s_taken[r] = p >= 0.f ? t : -1;
    }
    __syncthreads();
    if (s_taken[r] < 0) break;
    taken = r + 1;
  }
  if (threadIdx.x < kMaxAnchors)
    out[threadIdx.x] = static_cast<int>(threadIdx.x) < taken ? s_taken[threadIdx.x] : -1;
}

// =====================================================================================================================
// Anchor spans: one CTA per score row; anchor_span_positions' rule (kernels/selection_ref.cpp).
// =====================================================================================================================

constexpr int kSpanThreads = 128;

__global__ void __launch_bounds__(kSpanThreads) apply_anchor_spans_kernel(const ApplyAnchorSpansParams p) {
  const int row = blockIdx.x;
  const int b = row / p.rows_per_batch;
  const int n = min(__ldg(p.row_lens + b), p.score_stride);
  const int32_t* anchors = p.anchors + static_cast<size_t>(__ldg(p.anchor_rows + row)) * kMaxAnchors;
  float* scores = p.scores + static_cast<size_t>(row) * p.score_stride;
  const int cap = p.budget / 4, cost = p.span + (p.successor ? 1 : 0);
  int used = 0;
  for (int j = 0; j < kMaxAnchors; ++j) {
    const int t0 = __ldg(anchors + j);
    if (t0 < 0 || used + cost > cap) break;
    used += cost;
    const int lo = max(t0, p.first_pos), hi = min(t0 + p.span, p.first_pos + n);
    for (int t = lo + static_cast<int>(threadIdx.x); t < hi; t += kSpanThreads)
      scores[t - p.first_pos] = INFINITY;
  }
}

}  // namespace

// The kernels' dynamic shared-memory limit: the largest size a launch can ask (GQA group kMaxGqaGroup, a full
// anchor window); the kernel also has a few static __shared__ words, so the device's whole opt-in cannot be
// given.
template <typename T, int D>
cudaError_t anchor_smem_attribute() {
  return ensure_smem_attribute<select_anchors_kernel<T, D>>(
      anchor_smem_bytes(kMaxGqaGroup, D, kMaxAnchorWindow));
}

cudaError_t prepare_anchor_kernels() {
  return for_each_type_head_dim<__nv_bfloat16, __half>(
      [](auto tag, auto dim) { return anchor_smem_attribute<decltype(tag), decltype(dim)::value>(); });
}

}  // namespace detail

size_t select_anchors_smem_bytes(int group, int head_dim, int window_capacity) {
  return detail::anchor_smem_bytes(group, head_dim, window_capacity);
}

cudaError_t select_anchors(const SelectAnchorsParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "select_anchors";
  cudaError_t e = check_paged_gqa(what, p);
  if (e != cudaSuccess) return e;
  if (p.k_cache == nullptr || p.block_table == nullptr || p.windows == nullptr || p.window_idx == nullptr ||
      p.num_queries == nullptr || p.context_len == nullptr || p.anchor_rows == nullptr ||
      p.anchors == nullptr) {
    return invalid_argument(
        what,
        "k_cache, block_table, windows, window_idx, num_queries, context_len, anchor_rows "
        "and anchors must be set");
  }
  if (p.num_windows < 1 || p.window_capacity < 1 || p.window_capacity > kMaxAnchorWindow || p.span < 1 ||
      p.begin < 0 || p.local_window < 0) {
    return invalid_argument(what, "num_windows ", p.num_windows, " / window_capacity ", p.window_capacity,
                            " (1..", kMaxAnchorWindow, ") / span ", p.span, " / begin ", p.begin,
                            " / local_window ", p.local_window, " invalid");
  }
  const AnchorArgs a{paged_kv(p, p.k_cache, nullptr),
                     static_cast<const uint16_t*>(p.windows),
                     p.window_idx,
                     p.num_queries,
                     p.context_len,
                     p.anchor_rows,
                     p.anchors,
                     p.num_windows,
                     p.num_q_heads,
                     p.num_q_heads / p.num_kv_heads,
                     p.window_capacity,
                     p.begin,
                     p.local_window,
                     p.span,
                     1.f / sqrtf(static_cast<float>(p.head_dim))};
  const size_t smem = anchor_smem_bytes(a.group, p.head_dim, p.window_capacity);
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    auto kernel = select_anchors_kernel<decltype(tag), decltype(dim)::value>;
    cudaError_t err = anchor_smem_attribute<decltype(tag), decltype(dim)::value>();
    if (err != cudaSuccess) return err;
    kernel<<<dim3(p.num_kv_heads, p.batch), kAnchorThreads, smem, stream>>>(a);
    return cudaGetLastError();
  });
}

cudaError_t apply_anchor_spans(const ApplyAnchorSpansParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "apply_anchor_spans";
  if (p.rows < 0 || p.rows_per_batch < 1 || p.score_stride < 0 || p.first_pos < 0 || p.span < 1 ||
      p.budget < 0) {
    return invalid_argument(what, "rows ", p.rows, " / rows_per_batch ", p.rows_per_batch, " / score_stride ",
                            p.score_stride, " / first_pos ", p.first_pos, " / span ", p.span, " / budget ",
                            p.budget, " invalid");
  }
  if (p.rows == 0) return cudaSuccess;
  if (p.scores == nullptr || p.row_lens == nullptr || p.anchors == nullptr || p.anchor_rows == nullptr) {
    return invalid_argument(what, "scores, row_lens, anchors and anchor_rows must be set");
  }
  apply_anchor_spans_kernel<<<p.rows, kSpanThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace spade::kernels

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
// Anchor pick, in two kernels (select_anchors_ref's rule):
// 1. Candidates: one CTA per (anchor query i, KV head, sequence), 256 threads. The query's G heads sit in shared
//    memory as fp32; each thread takes keys t = tid, tid + 256, ... of the query's causal context, one key against
//    the G heads. Pass 1: per-thread online max / sum per head, merged over the warp and then the CTA (the softmax
//    normalisers). Pass 2: each key's probability, the max over the group's heads, is a candidate when
//    >= kAnchorMinMass and inside [begin, end). A query head puts >= 0.1 on at most 10 keys, so query i brings at
//    most 10 G candidates: they go to its own region of the workspace, with their count.
// 2. Pick: one CTA per (KV head, sequence) gathers the candidates of its nq queries into shared memory and makes
//    kMaxAnchors greedy rounds over them (best probability first, ties to the earlier position, none within `span`
//    of an anchor already taken). The result does not depend on the order in which the candidates were gathered.
// =====================================================================================================================

constexpr int kAnchorThreads = 256;
constexpr int kAnchorWarps = kAnchorThreads / 32;
constexpr int kCandidatesPerHead = 10;  // floor(1 / kAnchorMinMass)
constexpr int kMaxCandidatesPerQuery = kMaxGqaGroup * kCandidatesPerHead;
constexpr int kMaxCandidates = kMaxAnchorWindow * kMaxCandidatesPerQuery;  // per (sequence, KV head)

struct AnchorArgs {
  PagedKv kv;
  const uint16_t* windows;
  const int32_t* window_idx;
  const int32_t* num_queries;
  const int32_t* context_len;
  const int32_t* anchor_rows;
  int32_t* anchors;
  int32_t* cand_count;  // workspace: [batch][hkv][capacity]
  int32_t* cand_pos;    // workspace: [batch][hkv][capacity][group * kCandidatesPerHead]
  float* cand_prob;     // workspace: as cand_pos
  int num_windows, hq, group, capacity, begin, local_window, span;
  float scale;
};

// The workspace layout (AnchorArgs' cand_*): counts first, then positions, then probabilities.
__host__ __device__ constexpr size_t anchor_regions(int batch, int num_kv_heads, int capacity) {
  return static_cast<size_t>(batch) * num_kv_heads * capacity;
}
__host__ __device__ constexpr size_t anchor_workspace_bytes(int batch, int num_kv_heads, int group, int capacity) {
  return anchor_regions(batch, num_kv_heads, capacity) *
         (sizeof(int32_t) + static_cast<size_t>(group) * kCandidatesPerHead * (sizeof(int32_t) + sizeof(float)));
}

// Row b's valid anchor queries: nq = min(num_queries[b], capacity, context_len[b]); 0 when the row is skipped
// (no queries, or a window index outside [0, num_windows)).
__device__ __forceinline__ int anchor_queries(const AnchorArgs& a, int b) {
  const int w = __ldg(a.window_idx + b);
  if (w < 0 || w >= a.num_windows) return 0;
  return max(0, min(min(__ldg(a.num_queries + b), a.capacity), __ldg(a.context_len + b)));
}

// Anchors may come from [begin, end): end = min(max(begin, ctx - max(local_window, nq)), ctx).
__device__ __forceinline__ int anchor_end(const AnchorArgs& a, int ctx, int nq) {
  return min(max(a.begin, ctx - max(a.local_window, nq)), ctx);
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

// (m, z) <- the merge of two online-softmax states (max, sum of exp(x - max)).
__device__ __forceinline__ void merge_softmax(float& m, float& z, float mo, float zo) {
  const float mx = fmaxf(m, mo);
  z = (z > 0.f ? z * expf(m - mx) : 0.f) + (zo > 0.f ? zo * expf(mo - mx) : 0.f);
  m = mx;
}

template <typename T, int D>
__global__ void __launch_bounds__(kAnchorThreads) anchor_candidates_kernel(const AnchorArgs a) {
  __shared__ float q_s[kMaxGqaGroup * D];  // the query's heads, [G][D] fp32
  __shared__ float s_m[kAnchorWarps][kMaxGqaGroup], s_z[kAnchorWarps][kMaxGqaGroup];
  __shared__ int s_count;
  const int i = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = a.group;
  const int nq = anchor_queries(a, b);
  if (i >= nq) return;  // no region is read for i >= nq
  const int w = __ldg(a.window_idx + b), ctx = __ldg(a.context_len + b);
  const size_t region = (static_cast<size_t>(b) * a.kv.hkv + kvh) * a.capacity + i;
  const int per_query = G * kCandidatesPerHead;
  const int end = anchor_end(a, ctx, nq);
  if (end <= a.begin) {  // no position may be an anchor
    if (threadIdx.x == 0) a.cand_count[region] = 0;
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The window holds its entries oldest first: entry i of the last nq is at position ctx - nq + i.
  for (int e = threadIdx.x; e < G * D; e += kAnchorThreads) {
    const int g = e / D, d = e % D;
    const uint16_t bits = a.windows[((static_cast<size_t>(w) * a.hq + kvh * G + g) * a.capacity + i) * D + d];
    q_s[e] = ElemTraits<T>::to_float(*reinterpret_cast<const T*>(&bits));
  }
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  const T* kbase = a.kv.k_head<T, D>(kvh);
  const int32_t* table = a.kv.table_row(b);
  const int n = ctx - nq + i + 1;  // causal context of query i
  float m[kMaxGqaGroup], z[kMaxGqaGroup], s[kMaxGqaGroup];
#pragma unroll
  for (int g = 0; g < kMaxGqaGroup; ++g) {
    m[g] = -FLT_MAX;
    z[g] = 0.f;
  }
  for (int t = threadIdx.x; t < n; t += kAnchorThreads) {  // pass 1: the softmax normalisers
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
  for (int g = 0; g < kMaxGqaGroup; ++g) {  // merge over the warp, then over the CTA
    if (g >= G) break;
    for (int off = 16; off > 0; off >>= 1)
      merge_softmax(m[g], z[g], __shfl_xor_sync(0xffffffffu, m[g], off), __shfl_xor_sync(0xffffffffu, z[g], off));
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_z[warp][g] = z[g];
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kMaxGqaGroup; ++g) {
    if (g >= G) break;
    m[g] = s_m[0][g];
    z[g] = s_z[0][g];
    for (int j = 1; j < kAnchorWarps; ++j) merge_softmax(m[g], z[g], s_m[j][g], s_z[j][g]);
  }
  int32_t* pos_out = a.cand_pos + region * per_query;
  float* prob_out = a.cand_prob + region * per_query;
  for (int t = a.begin + static_cast<int>(threadIdx.x); t < min(end, n); t += kAnchorThreads) {  // pass 2
    const int page = table[a.kv.page_of(t)];
    dot_group<T, D>(kbase + a.kv.slot(page, t) * a.kv.row_stride<D>(), q_s, G, s);
    float p = 0.f;
#pragma unroll
    for (int g = 0; g < kMaxGqaGroup; ++g)
      if (g < G) p = fmaxf(p, expf(s[g] * a.scale - m[g]) / z[g]);
    if (p >= kAnchorMinMass) {
      const int at = atomicAdd(&s_count, 1);
      if (at < per_query) {
        pos_out[at] = t;
        prob_out[at] = p;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) a.cand_count[region] = min(s_count, per_query);
}

__global__ void __launch_bounds__(kAnchorThreads) pick_anchors_kernel(const AnchorArgs a) {
  __shared__ int32_t cand_t[kMaxCandidates];
  __shared__ float cand_p[kMaxCandidates];
  __shared__ int s_count;
  __shared__ float s_best_p[kAnchorWarps];
  __shared__ int s_best_t[kAnchorWarps];
  __shared__ int s_taken[kMaxAnchors];
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int nq = anchor_queries(a, b);
  if (nq <= 0) return;  // this row's anchors stay as they are
  int32_t* out =
      a.anchors +
      static_cast<size_t>(__ldg(a.anchor_rows + static_cast<size_t>(b) * a.kv.hkv + kvh)) * kMaxAnchors;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_query = a.group * kCandidatesPerHead;
  const size_t region0 = (static_cast<size_t>(b) * a.kv.hkv + kvh) * a.capacity;
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < nq * per_query; e += kAnchorThreads) {  // gather the nq queries' candidates
    const int i = e / per_query, j = e % per_query;
    if (j < __ldg(a.cand_count + region0 + i)) {
      const int at = atomicAdd(&s_count, 1);
      cand_t[at] = __ldg(a.cand_pos + (region0 + i) * per_query + j);
      cand_p[at] = __ldg(a.cand_prob + (region0 + i) * per_query + j);
    }
  }
  __syncthreads();
  const int count = s_count;
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

}  // namespace detail

size_t select_anchors_workspace_bytes(int batch, int num_q_heads, int num_kv_heads, int window_capacity) {
  if (batch < 0 || num_kv_heads < 1 || num_q_heads < num_kv_heads || window_capacity < 0) return 0;
  return detail::anchor_workspace_bytes(batch, num_kv_heads, num_q_heads / num_kv_heads, window_capacity);
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
        what, "k_cache, block_table, windows, window_idx, num_queries, context_len, anchor_rows and anchors must be set");
  }
  if (p.num_windows < 1 || p.window_capacity < 1 || p.window_capacity > kMaxAnchorWindow || p.span < 1 ||
      p.begin < 0 || p.local_window < 0) {
    return invalid_argument(what, "num_windows ", p.num_windows, " / window_capacity ", p.window_capacity,
                            " (1..", kMaxAnchorWindow, ") / span ", p.span, " / begin ", p.begin,
                            " / local_window ", p.local_window, " invalid");
  }
  const size_t need = select_anchors_workspace_bytes(p.batch, p.num_q_heads, p.num_kv_heads, p.window_capacity);
  if (p.workspace == nullptr || p.workspace_bytes < need) {
    return invalid_argument(what, "workspace ", p.workspace == nullptr ? "unset" : "set", ", workspace_bytes ",
                            p.workspace_bytes, " < ", need, " (select_anchors_workspace_bytes)");
  }
  if (p.batch > 65535) return invalid_argument(what, "batch ", p.batch, " > 65535");
  const int group = p.num_q_heads / p.num_kv_heads;
  const size_t regions = anchor_regions(p.batch, p.num_kv_heads, p.window_capacity);
  auto* count = static_cast<int32_t*>(p.workspace);
  auto* pos = count + regions;
  auto* prob = reinterpret_cast<float*>(pos + regions * group * kCandidatesPerHead);
  const AnchorArgs a{paged_kv(p, p.k_cache, nullptr),
                     static_cast<const uint16_t*>(p.windows),
                     p.window_idx,
                     p.num_queries,
                     p.context_len,
                     p.anchor_rows,
                     p.anchors,
                     count,
                     pos,
                     prob,
                     p.num_windows,
                     p.num_q_heads,
                     group,
                     p.window_capacity,
                     p.begin,
                     p.local_window,
                     p.span,
                     1.f / sqrtf(static_cast<float>(p.head_dim))};
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    anchor_candidates_kernel<decltype(tag), decltype(dim)::value>
        <<<dim3(p.window_capacity, p.num_kv_heads, p.batch), kAnchorThreads, 0, stream>>>(a);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    pick_anchors_kernel<<<dim3(p.num_kv_heads, p.batch), kAnchorThreads, 0, stream>>>(a);
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

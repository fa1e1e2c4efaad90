// Selection, synchronous baselines with the true query: Quest-style page selection (quest_select) and the gather of
// a step's decode queries as fp32 (gather_query_rows). The rules: kernels/selection_ref.h (quest_page_scores_ref,
// quest_pick_ref).
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/paged_kv.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

constexpr int kQuestThreads = 256;
constexpr int kQuestWarps = kQuestThreads / 32;
constexpr int kQuestColsPerWarp = 8;                                 // page columns a scoring warp takes (<= 32)
constexpr int kQuestScoreCols = kQuestWarps * kQuestColsPerWarp;     // page columns of a scoring CTA
constexpr int kQuestMaxRanked = 1024;                                // columns the pick ranks among themselves
constexpr int kQuestKeysPerThread = kMaxQuestPages / kQuestThreads;  // score keys a pick thread holds
static_assert(kQuestColsPerWarp <= 32, "a scoring warp's lanes read its columns' pages");
static_assert(kMaxQuestPages % kQuestThreads == 0, "the pick holds every column's key in registers");

struct QuestArgs {
  PagedKv kv;
  GqaHeads heads;
  const void* summary;  // optional [num_pages, 2, hkv, D]: min, max per page (QuestSelectParams::k_summary)
  const float* q;
  const int32_t* num_tokens;
  float* page_scores;
  int32_t* indices;
  int k;
  int begin;
  int rule_max;
};

// The candidate columns of row b: block-table columns first .. first + count - 1 cover [begin, end), end =
// num_tokens[b] clamped to the block-table row (a documented precondition, enforced here so that no value read from
// the device addresses outside the table or the pick's shared `taken`).
struct QuestColumnsDev {
  int end, first, count;
};
__device__ __forceinline__ QuestColumnsDev quest_columns_dev(const QuestArgs& a, int b) {
  const int ps = a.kv.page_size, end = min(a.num_tokens[b], a.kv.max_pages * ps), first = a.begin / ps;
  return QuestColumnsDev{end, first, end > a.begin ? (end - 1) / ps - first + 1 : 0};
}

// Page scores. Grid (ceil(max_pages / kQuestScoreCols), KV head, sequence): CTA x takes block-table columns
// [x * kQuestScoreCols, (x + 1) * kQuestScoreCols) of the candidate ones, warp w of them the columns x *
// kQuestScoreCols + w + kQuestWarps * i (i < kQuestColsPerWarp). One warp per column, lanes over head_dim (lane l
// holds dims l + 32 i): the candidate keys' element-wise min / max (a whole page with summaries: its summary), then
// per query head of the group sum_d max(q*min, q*max) (per-lane sum over i, then the warp sum), combined by the rule
// in head order; written to page_scores. Columns without a candidate are not written.
template <typename T, int D>
__global__ void __launch_bounds__(kQuestThreads) quest_score_kernel(const QuestArgs a) {
  constexpr int kPerLane = D / 32;
  __shared__ float sq[kMaxGqaGroup * D];  // the group's queries, head-major
  const int kvh = blockIdx.y, b = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const QuestColumnsDev cols = quest_columns_dev(a, b);
  const int base = blockIdx.x * kQuestScoreCols;
  const int lo = max(cols.first, base), hi = min(cols.first + cols.count, base + kQuestScoreCols);
  if (lo >= hi) return;  // the same for the whole CTA
  const int ps = a.kv.page_size, group = a.heads.group;
  const float* qg = a.q + (static_cast<size_t>(b) * a.heads.hq + static_cast<size_t>(kvh) * group) * D;
  for (int i = threadIdx.x; i < group * D; i += kQuestThreads) sq[i] = qg[i];
  const size_t row = static_cast<size_t>(b) * a.kv.hkv + kvh;
  float* scores = a.page_scores + row * a.kv.max_pages;
  const int32_t* table = a.kv.table_row(b);
  const T* k_head = a.kv.k_head<T, D>(kvh);
  // Lane i reads the page of the warp's column i.
  const int jl = base + warp + kQuestWarps * lane;
  const int32_t page_l = lane < kQuestColsPerWarp && jl >= lo && jl < hi ? table[jl] : 0;
  __syncthreads();
#pragma unroll 1
  for (int ci = 0; ci < kQuestColsPerWarp; ++ci) {
    const int j = base + warp + kQuestWarps * ci;
    const int32_t page = __shfl_sync(0xffffffffu, page_l, ci);
    if (j < lo || j >= hi) continue;  // the same for the whole warp
    const int t0 = max(a.begin, j * ps), t1 = min(cols.end, (j + 1) * ps);
    float mn[kPerLane], mx[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      mn[i] = __int_as_float(0x7f800000);   // +inf
      mx[i] = __int_as_float(0xff800000);   // -inf
    }
    if (a.summary != nullptr && t0 == j * ps && t1 == (j + 1) * ps) {  // a whole page: its summary
      const T* sm = static_cast<const T*>(a.summary) + (static_cast<size_t>(page) * 2 * a.kv.hkv + kvh) * D;
      const T* sx = sm + static_cast<size_t>(a.kv.hkv) * D;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        mn[i] = to_f(sm[lane + 32 * i]);
        mx[i] = to_f(sx[lane + 32 * i]);
      }
    } else {
      for (int t = t0; t < t1; ++t) {
        const T* kr = k_head + a.kv.slot(page, t) * a.kv.row_stride<D>();
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const float x = to_f(kr[lane + 32 * i]);
          mn[i] = fminf(mn[i], x);
          mx[i] = fmaxf(mx[i], x);
        }
      }
    }
    float combined = a.rule_max ? __int_as_float(0xff800000) : 0.f;
    for (int g = 0; g < group; ++g) {
      const float* q = sq + g * D;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const float qd = q[lane + 32 * i];
        s += fmaxf(qd * mn[i], qd * mx[i]);
      }
      s = warp_sum_xor(s, 1, 16);
      combined = a.rule_max ? fmaxf(combined, s) : combined + s / group;
    }
    if (lane == 0) scores[j] = combined;
  }
}

// The pick, one CTA per (KV head, sequence), over the scores quest_score_kernel wrote. Each column's rank (score key
// descending, ties: the earlier column) counts the candidate tokens of the better columns; a column takes min(its
// tokens, k - those) from its start; its output offset is the sum of the tokens taken by the columns before it.
// Only the columns among the M = ceil(k / ps) + 2 best can take tokens (the M best hold at least M - 2 whole pages,
// k tokens or more; every column ranked below them takes none). T = the M-th largest key (CTA radix select over the
// keys, held in registers: column threadIdx.x + kQuestThreads * i); the columns with key >= T (M of them unless keys
// tie at T) rank among themselves. More than kQuestMaxRanked such columns (a tie at T over many pages): every column
// ranks among all. The offsets: each thread sums the tokens taken by a contiguous run of ceil(count / kQuestThreads)
// columns, a block-wide exclusive scan of those sums gives each run's first offset, and the thread writes its run's
// positions from there, ascending; -1 after the total.
__global__ void __launch_bounds__(kQuestThreads) quest_pick_kernel(const QuestArgs a) {
  using Scan = cub::BlockScan<int, kQuestThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  extern __shared__ int32_t taken[];  // [columns]: tokens taken
  __shared__ int hist[256];
  __shared__ int s_digit, s_above, s_ranked;
  __shared__ int ranked_col[kQuestMaxRanked];
  __shared__ uint32_t ranked_key[kQuestMaxRanked];
  const int kvh = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const QuestColumnsDev cols = quest_columns_dev(a, b);
  const int ps = a.kv.page_size, end = cols.end, first = cols.first, count = cols.count;
  const size_t row = static_cast<size_t>(b) * a.kv.hkv + kvh;
  int32_t* out = a.indices + row * a.k;
  const float* scores = a.page_scores + row * a.kv.max_pages;
  uint32_t key[kQuestKeysPerThread];
#pragma unroll
  for (int i = 0; i < kQuestKeysPerThread; ++i) {
    const int c = tid + kQuestThreads * i;
    key[i] = c < count ? topk_key_dev(scores[first + c]) : 0u;
  }
  for (int c = tid; c < count; c += kQuestThreads) taken[c] = 0;
  uint32_t prefix = 0, mask = 0;
  if (count > 0) {  // the same for the whole CTA
    int kr = min(count, (a.k + ps - 1) / ps + 2);
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kQuestThreads) hist[i] = 0;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kQuestKeysPerThread; ++i) {
        if (tid + kQuestThreads * i < count && (key[i] & mask) == prefix)
          atomicAdd(&hist[255 - ((key[i] >> shift) & 0xFFu)], 1);
      }
      __syncthreads();
      radix_select_digit(hist, shift, prefix, mask, kr, s_digit, s_above);
    }
  }
  if (tid == 0) s_ranked = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kQuestKeysPerThread; ++i) {
    const int c = tid + kQuestThreads * i;
    if (c >= count || key[i] < prefix) continue;
    const int r = atomicAdd(&s_ranked, 1);
    if (r < kQuestMaxRanked) {
      ranked_col[r] = c;
      ranked_key[r] = key[i];
    }
  }
  __syncthreads();
  const int ns = s_ranked;
  const bool all = ns > kQuestMaxRanked;
  for (int i = tid; i < (all ? count : ns); i += kQuestThreads) {
    const int c = all ? i : ranked_col[i], j = first + c;
    const uint32_t k1 = all ? topk_key_dev(scores[j]) : ranked_key[i];
    int better = 0;  // candidate tokens of the columns ranked before this one
    for (int i2 = 0; i2 < (all ? count : ns); ++i2) {
      const int j2 = first + (all ? i2 : ranked_col[i2]);
      const uint32_t k2 = all ? topk_key_dev(scores[j2]) : ranked_key[i2];
      if (k2 > k1 || (k2 == k1 && j2 < j)) better += min(end, (j2 + 1) * ps) - max(a.begin, j2 * ps);
    }
    const int own = min(end, (j + 1) * ps) - max(a.begin, j * ps);
    taken[c] = max(0, min(own, a.k - better));
  }
  __syncthreads();
  const int run = (count + kQuestThreads - 1) / kQuestThreads;
  const int c0 = min(count, tid * run), c1 = min(count, c0 + run);
  int sum = 0;
  for (int c = c0; c < c1; ++c) sum += taken[c];
  int off = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(sum, off, total);
  for (int c = c0; c < c1; ++c) {
    const int n = taken[c], t0 = max(a.begin, (first + c) * ps);
    for (int i = 0; i < n; ++i) out[off + i] = t0 + i;
    off += n;
  }
  for (int i = total + tid; i < a.k; i += kQuestThreads) out[i] = -1;
}

// One warp per (page column, KV head) of a row: lanes over head_dim, the element-wise min / max of the page's keys,
// written back in the cache's type (exact: min / max of values of that type).
template <typename T, int D>
__global__ void __launch_bounds__(kQuestThreads) quest_summary_kernel(const PagedKv kv, const int32_t* num_tokens,
                                                                      T* summary, int pages_back) {
  constexpr int kPerLane = D / 32;
  const int b = blockIdx.y, lane = threadIdx.x & 31;
  const int full = min(num_tokens[b], kv.max_pages * kv.page_size) / kv.page_size;
  const int first = max(0, full - pages_back), count = full - first;
  const int item = blockIdx.x * kQuestWarps + (threadIdx.x >> 5);  // (column, KV head)
  if (item >= count * kv.hkv) return;
  const int j = first + item / kv.hkv, kvh = item % kv.hkv;
  const int32_t page = kv.table_row(b)[j];
  const T* k_head = kv.k_head<T, D>(kvh);
  float mn[kPerLane], mx[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    mn[i] = __int_as_float(0x7f800000);
    mx[i] = __int_as_float(0xff800000);
  }
  for (int t = j * kv.page_size; t < (j + 1) * kv.page_size; ++t) {
    const T* kr = k_head + kv.slot(page, t) * kv.row_stride<D>();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float x = to_f(kr[lane + 32 * i]);
      mn[i] = fminf(mn[i], x);
      mx[i] = fmaxf(mx[i], x);
    }
  }
  T* sm = summary + (static_cast<size_t>(page) * 2 * kv.hkv + kvh) * D;
  T* sx = sm + static_cast<size_t>(kv.hkv) * D;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    sm[lane + 32 * i] = from_f<T>(mn[i]);
    sx[lane + 32 * i] = from_f<T>(mx[i]);
  }
}

template <typename T>
__global__ void gather_query_rows_kernel(const T* q, const int32_t* q_rows, float* out, int batch, int row_elems) {
  const int b = blockIdx.y;
  const int src = q_rows == nullptr ? b : q_rows[b];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < row_elems; i += gridDim.x * blockDim.x)
    out[static_cast<size_t>(b) * row_elems + i] = src < 0 ? 0.f : to_f(q[static_cast<size_t>(src) * row_elems + i]);
}

}  // namespace
}  // namespace detail

cudaError_t quest_select(const QuestSelectParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "quest_select";
  if (p.q == nullptr || p.k_cache == nullptr || p.block_table == nullptr || p.num_tokens == nullptr ||
      p.page_scores == nullptr || p.indices == nullptr) {
    return invalid_argument(what, "q, k_cache, block_table, num_tokens, page_scores and indices must be set");
  }
  const cudaError_t e = check_paged_gqa(what, p);
  if (e != cudaSuccess) return e;
  if (p.k < 1) return invalid_argument(what, "k ", p.k, " must be >= 1");
  if (p.begin < 0) return invalid_argument(what, "begin ", p.begin, " must be >= 0");
  if (p.max_pages_per_seq > kMaxQuestPages) {
    return invalid_argument(what, "max_pages_per_seq ", p.max_pages_per_seq, " exceeds kMaxQuestPages = ",
                            kMaxQuestPages);
  }
  QuestArgs a{};
  a.kv = paged_kv(p, p.k_cache, nullptr);
  a.heads = gqa_heads(p);
  a.summary = p.k_summary;
  a.q = p.q;
  a.num_tokens = p.num_tokens;
  a.page_scores = p.page_scores;
  a.indices = p.indices;
  a.k = p.k;
  a.begin = p.begin;
  a.rule_max = p.rule == GqaScoreRule::kMax ? 1 : 0;
  const dim3 score_grid(ceil_div(p.max_pages_per_seq, kQuestScoreCols), p.num_kv_heads, p.batch);
  const cudaError_t se = dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    quest_score_kernel<decltype(tag), decltype(dim)::value><<<score_grid, kQuestThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
  if (se != cudaSuccess) return se;
  const size_t smem = static_cast<size_t>(p.max_pages_per_seq) * sizeof(int32_t);
  quest_pick_kernel<<<dim3(p.num_kv_heads, p.batch), kQuestThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t quest_page_summaries(const QuestPageSummariesParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "quest_page_summaries";
  if (p.batch == 0) return cudaSuccess;
  if (p.k_cache == nullptr || p.block_table == nullptr || p.num_tokens == nullptr || p.k_summary == nullptr) {
    return invalid_argument(what, "k_cache, block_table, num_tokens and k_summary must be set");
  }
  const cudaError_t e = check_paged_kv(what, p);
  if (e != cudaSuccess) return e;
  if (p.pages_back < 1) return invalid_argument(what, "pages_back ", p.pages_back, " must be >= 1");
  const int columns = p.pages_back < p.max_pages_per_seq ? p.pages_back : p.max_pages_per_seq;
  const dim3 grid(ceil_div(columns * p.num_kv_heads, kQuestWarps), p.batch);
  const PagedKv kv = paged_kv(p, p.k_cache, nullptr);
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    quest_summary_kernel<T, decltype(dim)::value>
        <<<grid, kQuestThreads, 0, stream>>>(kv, p.num_tokens, static_cast<T*>(p.k_summary), p.pages_back);
    return cudaGetLastError();
  });
}

cudaError_t gather_query_rows(const GatherQueryRowsParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "gather_query_rows";
  if (p.batch == 0) return cudaSuccess;
  if (p.q == nullptr || p.out == nullptr) return invalid_argument(what, "q and out must be set");
  if (p.batch < 0 || p.row_elems <= 0) {
    return invalid_argument(what, "batch ", p.batch, " / row_elems ", p.row_elems, " out of range");
  }
  const dim3 grid(ceil_div(p.row_elems, 256), p.batch);
  return dispatch_elem(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    gather_query_rows_kernel<T><<<grid, 256, 0, stream>>>(static_cast<const T*>(p.q), p.q_rows, p.out, p.batch,
                                                          p.row_elems);
    return cudaGetLastError();
  });
}

}  // namespace spade::kernels

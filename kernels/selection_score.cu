// Selection, score stage: GQA-batched token scoring of predicted queries on tensor cores (kernels/selection_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/paged_kv.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Scoring: grid (split, kv_head, sequence), 4 warps, each streaming 16-token key tiles through a private cp.async
// pipeline (same structure as the decode kernel). S^T[16 tokens x 8 cols] = K_tile . Qhat^T on tensor cores where the
// columns hold the hi and lo halves of each group head's fp32 query (hi = round(q), lo = round(q - hi)), so
// k . hi + k . lo carries ~16 mantissa bits of q and is accumulated in fp32. G <= 4: one mma per k-step (cols
// 0..G-1 hi, G..2G-1 lo); G in 5..8: two mmas.
// =====================================================================================================================

constexpr int kScoreWarps = 4;
constexpr int kScoreThreads = kScoreWarps * 32;
constexpr int kScoreTable = 2048;

template <int D>
struct ScoreConfig {
  // K only (half the bytes per stage of the decode kernel): deeper pipeline to keep as many bytes in flight.
  static constexpr int kStages = D == 256 ? 3 : 6;
  static constexpr int kChunks = D / 8;
  static constexpr int kChunksPerLane = 16 * kChunks / 32;
  static constexpr int kTileElems = 16 * D;
  static constexpr int kScratch = 2 * 16 * 9;  // floats per warp
  static constexpr size_t kSmemBytes =
      kScoreTable * 4 + size_t{kScoreWarps} * kStages * kTileElems * 2 + size_t{kScoreWarps} * kScratch * 4;
};

struct ScoreArgs {
  PagedKv kv;  // K only (kv.v unused)
  GqaHeads heads;
  const float* q_hat;
  const int32_t* num_tokens;
  float* scores;
  int score_stride;
  int chunk;
  int rule_max;
};

template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const ScoreArgs a) {
  using Tr = ElemTraits<T>;
  using Cfg = ScoreConfig<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw);
  T* stage_base = reinterpret_cast<T*>(smem_raw + kScoreTable * 4);
  float* scratch_base = reinterpret_cast<float*>(stage_base + size_t{kScoreWarps} * Cfg::kStages * Cfg::kTileElems);

  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int G = a.heads.group;
  const int L = a.num_tokens[b];
  const int begin = split * a.chunk;
  if (begin >= L) return;
  const int end = min(L, begin + a.chunk);

  const int p0 = a.kv.page_of(begin);
  {
    const int np = a.kv.page_of(end - 1) - p0 + 1;
    const int32_t* bt = a.kv.table_row(b) + p0;
    for (int i = tid; i < np; i += kScoreThreads) tab[i] = bt[i];
  }
  __syncthreads();

  const size_t row_stride = a.kv.row_stride<D>();
  const T* kc = a.kv.k_head<T, D>(kvh);
  T* my_stages = stage_base + static_cast<size_t>(warp) * Cfg::kStages * Cfg::kTileElems;
  float* scratch = scratch_base + warp * Cfg::kScratch;
  auto issue = [&](int tile_start, int stage) {
    T* sk = my_stages + stage * Cfg::kTileElems;
    for_each_tile_chunk<Cfg::kChunks, Cfg::kChunksPerLane, 32>(lane, tile_start, end, [&](int tok, int col, int v,
                                                                                         bool valid) {
      const T* gk = kc;
      if (valid) gk = kc + a.kv.slot(tab[a.kv.page_of(v) - p0], v) * row_stride;
      cp_async_16(sk + swz(tok, col, Cfg::kChunks), gk + col * 8, valid);
    });
  };

  // B operands: column n = lane / 4 of Qhat^T, rows d = 16ks + 2c (+1, +8, +9).
  const int n = lane >> 2;
  const int c4 = lane & 3;
  const bool two = 2 * G > 8;
  int head0 = -1;
  bool lo0 = false;
  if (n < G) {
    head0 = n;
  } else if (!two && n < 2 * G) {
    head0 = n - G;
    lo0 = true;
  }
  const int head1 = (two && n < G) ? n : -1;
  const float* qbase = a.q_hat + (static_cast<size_t>(b) * a.heads.hq + kvh * G) * D;
  auto part = [&](int head, bool lo, int d) -> float {
    if (head < 0) return 0.f;
    const float q = qbase[static_cast<size_t>(head) * D + d];
    return lo ? q - Tr::to_float(Tr::from_float(q)) : q;
  };
  uint32_t qf0[D / 16][2];
  uint32_t qf1[D / 16][2];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int d = ks * 16 + 2 * c4;
    qf0[ks][0] = Tr::pack2(part(head0, lo0, d), part(head0, lo0, d + 1));
    qf0[ks][1] = Tr::pack2(part(head0, lo0, d + 8), part(head0, lo0, d + 9));
    qf1[ks][0] = Tr::pack2(part(head1, true, d), part(head1, true, d + 1));
    qf1[ks][1] = Tr::pack2(part(head1, true, d + 8), part(head1, true, d + 9));
  }

  const int n_tiles = (end - begin + 15) / 16;
  const int nj = warp < n_tiles ? (n_tiles - warp + kScoreWarps - 1) / kScoreWarps : 0;
  auto tile_begin = [&](int j) { return begin + (warp + kScoreWarps * j) * 16; };
  float* out = a.scores + (static_cast<size_t>(b) * a.kv.hkv + kvh) * a.score_stride;

  auto issue_tile = [&](int j, int stage) { issue(tile_begin(j), stage); };
  warp_cp_async_pipeline<Cfg::kStages>(nj, issue_tile, [&](int j, int stage) {
    const T* sk = my_stages + stage * Cfg::kTileElems;
    float s0[4] = {0.f, 0.f, 0.f, 0.f};
    float s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t af[4];
      const int i = lane >> 3;
      const int tok = (lane & 7) + ((i & 1) << 3);
      ldmatrix_x4(af, sk + swz(tok, 2 * ks + (i >> 1), Cfg::kChunks));
      Tr::mma(s0, af, qf0[ks], s0);
      if (two) Tr::mma(s1, af, qf1[ks], s1);
    }
    const int g = lane >> 2;
    scratch[g * 9 + 2 * c4] = s0[0];
    scratch[g * 9 + 2 * c4 + 1] = s0[1];
    scratch[(g + 8) * 9 + 2 * c4] = s0[2];
    scratch[(g + 8) * 9 + 2 * c4 + 1] = s0[3];
    if (two) {
      scratch[144 + g * 9 + 2 * c4] = s1[0];
      scratch[144 + g * 9 + 2 * c4 + 1] = s1[1];
      scratch[144 + (g + 8) * 9 + 2 * c4] = s1[2];
      scratch[144 + (g + 8) * 9 + 2 * c4 + 1] = s1[3];
    }
    __syncwarp();
    const int t0 = tile_begin(j);
    if (lane < 16 && t0 + lane < end) {
      const float* r0 = scratch + lane * 9;
      float best = -INFINITY;
      float sum = 0.f;
      for (int h = 0; h < G; ++h) {
        const float v = two ? r0[h] + r0[144 + h] : r0[h] + r0[G + h];
        best = fmaxf(best, v);
        sum += v;
      }
      out[t0 + lane] = a.rule_max ? best : sum / static_cast<float>(G);
    }
    __syncwarp();
  });
}

// The dynamic shared-memory limit of score_kernel<T, D> on the current device, set once (launch or prepare).
template <typename T, int D>
cudaError_t score_smem_attribute() {
  return ensure_smem_attribute<score_kernel<T, D>>(ScoreConfig<D>::kSmemBytes);
}

template <typename T, int D>
cudaError_t launch_score_typed(ScoreArgs a, int batch, int page_size, int max_len, cudaStream_t stream) {
  using Cfg = ScoreConfig<D>;
  auto kernel = score_kernel<T, D>;
  cudaError_t e = score_smem_attribute<T, D>();
  if (e != cudaSuccess) return e;
  int occ = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kScoreThreads, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const long long slots = static_cast<long long>(std::max(1, current_sm_count())) * std::max(1, occ);
  const long long cap = static_cast<long long>(kScoreTable - 2) * page_size;
  const int splits =
      choose_splits(static_cast<long long>(batch) * a.kv.hkv, slots, max_len, 256, ceil_div(max_len, cap), 1 << 20);
  a.chunk = ceil_div(ceil_div(max_len, splits), 16) * 16;
  const dim3 grid(ceil_div(max_len, a.chunk), a.kv.hkv, batch);
  kernel<<<grid, kScoreThreads, Cfg::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t prepare_score_kernels() {
  return for_each_type_head_dim<__nv_bfloat16, __half>([](auto tag, auto dim) {
    return score_smem_attribute<decltype(tag), decltype(dim)::value>();
  });
}

}  // namespace detail

cudaError_t score_tokens(const ScoreTokensParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "score_tokens";
  if (p.q_hat == nullptr || p.k_cache == nullptr || p.block_table == nullptr || p.num_tokens == nullptr ||
      p.scores == nullptr) {
    return invalid_argument(what, "q_hat, k_cache, block_table, num_tokens and scores must be set");
  }
  const cudaError_t e = check_paged_gqa(what, p);
  if (e != cudaSuccess) return e;
  if (p.score_stride <= 0) return invalid_argument(what, "score_stride ", p.score_stride, " must be > 0");
  ScoreArgs a{};
  a.kv = paged_kv(p, p.k_cache, nullptr);
  a.heads = gqa_heads(p);
  a.q_hat = p.q_hat;
  a.num_tokens = p.num_tokens;
  a.scores = p.scores;
  a.score_stride = p.score_stride;
  a.rule_max = p.rule == GqaScoreRule::kMax ? 1 : 0;
  const int max_len = static_cast<int>(std::min<long long>(
      p.score_stride, static_cast<long long>(p.max_pages_per_seq) * p.page_size));
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    return launch_score_typed<decltype(tag), decltype(dim)::value>(a, p.batch, p.page_size, max_len, stream);
  });
}

}  // namespace spade::kernels

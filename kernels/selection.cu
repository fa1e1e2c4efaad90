// Selection kernels of the cache rank: next-query predictor, GQA-batched token scoring, radix top-k, K/V gather,
// and delta transfer (the slot plan of a selection against the holder's table, and the holder's apply).
// Math and conventions: kernels/selection_ref.h, kernels/selection_delta_ref.h (the CPU references the GPU tests
// compare against).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/selection.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Predictor: one CTA per (sequence, head). Gram matrix of the regressors ordered newest first (Q_{t-1}, Q_{t-2}, ...)
// in fp64; then the k x k Gram of window size k is the leading k x k block, so ONE Cholesky factor L of the
// W x W matrix serves every window size: y = L^{-1} H q_t and X = L^{-1} are prefix-consistent, and the weights of
// window size k, w^(k) = L_k^{-T} y[:k], are prefix sums over t of X[t][i] y_t. Warp 0 does all of it in registers
// (lane i owns row i; shuffles only), so the solve has no shared-memory round trips on its critical path.
// The Gram matrix is built without eps; the solving warp adds eps to the diagonal when it loads the rows: eps itself
// (kPaper), or eps times the mean of the raw diagonal, i.e. of the m regressors' squared norms (kRidge), one value
// for every window size so the leading blocks stay nested. kPaper softmaxes each window size's weights before the
// pooling; kRidge pools the raw weights. kLastQuery skips all of it (q_hat = Q_t).
// =====================================================================================================================

constexpr int kPredThreads = 128;
constexpr int kLd = kMaxPredictorWindow + 1;  // padded row length of the fp64 matrices

struct PredictArgs {
  const void* window;
  const int32_t* window_len;
  float* q_hat;
  int num_heads;
  int capacity;
  int max_reg;
  double eps;
  int rows;
  int per_cta;
  PredictorKind kind;
};

template <typename TW>
__device__ __forceinline__ float load_f32(const TW* p) {
  if constexpr (std::is_same_v<TW, float>) {
    return *p;
  } else {
    return ElemTraits<TW>::to_float(*p);
  }
}

// Per problem slot in shared memory: the Gram / Cholesky factor, H q_t, the pooled weights, two ints (n, meff), and
// the window rows stored with a stride of D + 1 floats (the Gram threads read the same d of different rows, which
// would otherwise all hit one shared-memory bank).
template <int D>
struct PredictSlot {
  static constexpr int kWS = D + 1;
  static constexpr size_t kDoubles = size_t{kMaxPredictorWindow} * kLd + 2 * kMaxPredictorWindow + 2;
  static constexpr size_t kBytes = kDoubles * 8 + ((size_t{kMaxPredictorWindow + 1} * kWS * 4 + 15) & ~size_t{15});
};

// Problems per CTA: 1 while the rows fit in about two CTAs per SM (lowest latency: all 128 threads build the one
// Gram matrix); up to kPredMaxPerCta for larger batches (e.g. a layer pack in one launch), one solving warp each,
// so more solves run concurrently per SM (the solve is a latency-bound fp64 chain on one warp).
constexpr int kPredMaxPerCta = 4;

template <typename TW, int D>
__global__ void __launch_bounds__(kPredThreads) predict_kernel(const PredictArgs a) {
  using Slot = PredictSlot<D>;
  constexpr int WS = Slot::kWS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int row0 = blockIdx.x * a.per_cta;
  const int np = min(a.per_cta, a.rows - row0);
  auto slot_A = [&](int p) { return reinterpret_cast<double*>(smem_raw + static_cast<size_t>(p) * Slot::kBytes); };
  auto slot_win = [&](int p) {
    return reinterpret_cast<float*>(smem_raw + static_cast<size_t>(p) * Slot::kBytes + Slot::kDoubles * 8);
  };

  // Phase 1 (all threads, problem after problem): window rows -> shared memory, Gram matrix and H q_t in fp64.
  for (int pb = 0; pb < np; ++pb) {
    const int row = row0 + pb;
    double* A = slot_A(pb);                      // [32][kLd] Gram -> Cholesky factor (lower)
    double* yv = A + kMaxPredictorWindow * kLd;  // [32] H q_t
    int* ints = reinterpret_cast<int*>(yv + 2 * kMaxPredictorWindow);  // n, meff
    float* win = slot_win(pb);
    const int n = min(a.window_len[row / a.num_heads], a.capacity);
    if (tid == 0) ints[0] = n;
    if (n <= 1 || a.kind == PredictorKind::kLastQuery) continue;  // uniform across the CTA
    const TW* src = static_cast<const TW*>(a.window) + static_cast<size_t>(row) * a.capacity * D;
    for (int i = tid; i < n * D; i += kPredThreads) win[(i / D) * WS + i % D] = load_f32(src + i);
    const int m = min(n - 1, a.max_reg);
    __syncthreads();

    // Gram entries A[i][j] = r_i . r_j (j <= i < m) and yv[i] = r_i . q_t, r_i = slot n-2-i.
    const int npairs = m * (m + 1) / 2;
    for (int p = tid; p < npairs + m; p += kPredThreads) {
      int i;
      int j;
      const float* x;
      const float* y;
      if (p < npairs) {
        i = static_cast<int>((sqrt(8.0 * p + 1.0) - 1.0) * 0.5);
        while ((i + 1) * (i + 2) / 2 <= p) ++i;
        while (i * (i + 1) / 2 > p) --i;
        j = p - i * (i + 1) / 2;
        x = win + (n - 2 - i) * WS;
        y = win + (n - 2 - j) * WS;
      } else {
        i = p - npairs;
        j = -1;
        x = win + (n - 2 - i) * WS;
        y = win + (n - 1) * WS;
      }
      double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
#pragma unroll 4
      for (int d = 0; d < D; d += 4) {
        s0 = fma(static_cast<double>(x[d]), static_cast<double>(y[d]), s0);
        s1 = fma(static_cast<double>(x[d + 1]), static_cast<double>(y[d + 1]), s1);
        s2 = fma(static_cast<double>(x[d + 2]), static_cast<double>(y[d + 2]), s2);
        s3 = fma(static_cast<double>(x[d + 3]), static_cast<double>(y[d + 3]), s3);
      }
      const double s = (s0 + s1) + (s2 + s3);
      if (j < 0) {
        yv[i] = s;
      } else {
        A[i * kLd + j] = s;  // eps is added to the diagonal in phase 2
      }
    }
  }
  __syncthreads();

  // Phase 2: warp p solves problem p.
  if (warp < np) {
    double* A = slot_A(warp);
    double* yv = A + kMaxPredictorWindow * kLd;
    double* coef = yv + kMaxPredictorWindow;
    int* ints = reinterpret_cast<int*>(yv + 2 * kMaxPredictorWindow);
    const int n = ints[0];
    const int m = (n <= 1 || a.kind == PredictorKind::kLastQuery) ? 0 : min(n - 1, a.max_reg);
    if (m == 0) {
      if (lane == 0) ints[1] = 0;
    } else {
      // Everything below lives in registers of this warp; lane i owns row i (fully unrolled, compile-time indices).
      constexpr unsigned kFull = 0xffffffffu;
      double lrow[kMaxPredictorWindow];  // row `lane` of the regularised Gram, then of its Cholesky factor L
#pragma unroll
      for (int j = 0; j < kMaxPredictorWindow; ++j) lrow[j] = (lane < m && j <= lane) ? A[lane * kLd + j] : 0.0;
      // eps on the diagonal: absolute (kPaper), or relative to the regressors' mean squared norm (kRidge: the mean of
      // the raw Gram diagonal over the m regressors, the same eps for every window size).
      double eps = a.eps;
      if (a.kind == PredictorKind::kRidge) {
        double sq = lane < m ? A[lane * kLd + lane] : 0.0;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(kFull, sq, off);
        eps = a.eps * (sq / m);
      }
#pragma unroll
      for (int j = 0; j < kMaxPredictorWindow; ++j) {
        if (lane < m && j == lane) lrow[j] += eps;
      }
      double diag_inv = 1.0;  // 1 / L[lane][lane]
      int meff = m;
      // Right-looking Cholesky. A non-positive pivot at step k drops window sizes > k (their Gram contains it).
      // rsqrt instead of sqrt + divide: one fp64 sequence on the critical path per step.
#pragma unroll
      for (int k = 0; k < kMaxPredictorWindow; ++k) {
        if (k < meff) {
          const double dkk = __shfl_sync(kFull, lrow[k], k);
          if (!(dkk > 0.0) || !isfinite(dkk)) {
            meff = k;
          } else {
            const double inv = rsqrt(dkk);
            if (lane == k) {
              lrow[k] = dkk * inv;
              diag_inv = inv;
            } else if (lane > k) {
              lrow[k] *= inv;
            }
#pragma unroll
            for (int j = k + 1; j < kMaxPredictorWindow; ++j) {
              const double ljk = __shfl_sync(kFull, lrow[k], j);
              if (j <= lane) lrow[j] -= lrow[k] * ljk;
            }
          }
        }
      }
      // y = L^{-1} (H q_t); lane i holds y_i.
      double y = lane < meff ? yv[lane] : 0.0;
#pragma unroll
      for (int k = 0; k < kMaxPredictorWindow; ++k) {
        if (k < meff) {
          const double yk = __shfl_sync(kFull, y, k) * __shfl_sync(kFull, diag_inv, k);
          if (lane == k) {
            y = yk;
          } else if (lane > k) {
            y -= lrow[k] * yk;
          }
        }
      }
      // X = L^{-1} (lower triangular, leading blocks are the inverses of the leading blocks of L); lane i: row i.
      double x[kMaxPredictorWindow];
#pragma unroll
      for (int j = 0; j < kMaxPredictorWindow; ++j) x[j] = (j == lane) ? 1.0 : 0.0;
#pragma unroll
      for (int k = 0; k < kMaxPredictorWindow; ++k) {
        if (k < meff) {
          if (lane == k) {
#pragma unroll
            for (int j = 0; j <= k; ++j) x[j] *= diag_inv;
          }
#pragma unroll
          for (int j = 0; j <= k; ++j) {
            const double xkj = __shfl_sync(kFull, x[j], k);
            if (lane > k) x[j] -= lrow[k] * xkj;
          }
        }
      }
      // Window size k solves L_k^T w = y[:k]: w^(k)_i = sum_{t=i}^{k-1} X[t][i] y_t, an inclusive prefix sum over
      // lanes t of c_t[i] = X[t][i] y_t. After the scan lane l holds w^(l+1) (entries i <= l).
#pragma unroll
      for (int i = 0; i < kMaxPredictorWindow; ++i) {
        double v = lane < meff ? x[i] * y : 0.0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const double nb = __shfl_up_sync(kFull, v, off);
          if (lane >= off) v += nb;
        }
        x[i] = v;
      }
      if (a.kind == PredictorKind::kPaper) {
        // Softmax of each window size's weights (lane l: entries 0..l); exponentials and pooling in fp32 (the weights
        // are in [0, 1]; the fp64 part above is where cancellation can happen).
        double mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < kMaxPredictorWindow; ++i) {
          if (i <= lane) mx = fmax(mx, x[i]);
        }
        float e[kMaxPredictorWindow];
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxPredictorWindow; ++i) {
          e[i] = (i <= lane) ? __expf(static_cast<float>(x[i] - mx)) : 0.f;
          sum += e[i];
        }
        const float scale = lane < meff ? 1.f / (sum * static_cast<float>(meff)) : 0.f;
        // Average pooling: the shifted slot n-1-i gets (1/meff) sum_{k > i} w^(k)_i = sum over lanes l >= i.
#pragma unroll
        for (int i = 0; i < kMaxPredictorWindow; ++i) {
          float v = e[i] * scale;
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
          if (lane == 0) coef[i] = v;
        }
      } else {
        // kRidge: the raw weights, pooled in fp64 (they can be large and of both signs): the shifted slot n-1-i gets
        // (1/meff) sum_{k > i} w^(k)_i = the sum over lanes l >= i (lane l holds w^(l+1), entries i <= l).
#pragma unroll
        for (int i = 0; i < kMaxPredictorWindow; ++i) {
          double v = (i <= lane && lane < meff) ? x[i] : 0.0;
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
          if (lane == 0) coef[i] = meff > 0 ? v / static_cast<double>(meff) : 0.0;
        }
      }
      if (lane == 0) ints[1] = meff;
    }
  }
  __syncthreads();

  // Phase 3: q_hat = sum_i coef_i * Q_{t+1-i}  (n == 0: zeros; no regression possible or kLastQuery: Q_t).
  for (int p = 0; p < np; ++p) {
    const double* coef = slot_A(p) + kMaxPredictorWindow * kLd + kMaxPredictorWindow;
    const int* ints = reinterpret_cast<const int*>(coef + kMaxPredictorWindow);
    const int n = ints[0];
    const int meff = ints[1];
    const float* win = slot_win(p);
    float* out = a.q_hat + static_cast<size_t>(row0 + p) * D;
    for (int d = tid; d < D; d += kPredThreads) {
      if (n <= 0) {
        out[d] = 0.f;
      } else if (n == 1 || meff == 0) {
        // n == 1 and kLastQuery did not stage the window in shared memory: Q_t from global memory.
        out[d] = (n == 1 || a.kind == PredictorKind::kLastQuery)
                     ? load_f32(static_cast<const TW*>(a.window) +
                                (static_cast<size_t>(row0 + p) * a.capacity + (n - 1)) * D + d)
                     : win[(n - 1) * WS + d];
      } else {
        double acc = 0.0;
        for (int i = 0; i < meff; ++i) acc += coef[i] * static_cast<double>(win[(n - 1 - i) * WS + d]);
        out[d] = static_cast<float>(acc);
      }
    }
  }
}

// The dynamic shared-memory limits of the selection kernels on the current device, set once (launch or prepare).
template <typename TW, int D>
cudaError_t predict_smem_attribute() {
  static std::atomic<uint64_t> done{0};
  return ensure_smem_attribute(predict_kernel<TW, D>, kPredMaxPerCta * PredictSlot<D>::kBytes, done);
}

template <typename TW, int D>
cudaError_t launch_predict_typed(PredictArgs a, int rows, cudaStream_t stream) {
  using Slot = PredictSlot<D>;
  auto kernel = predict_kernel<TW, D>;
  cudaError_t e = predict_smem_attribute<TW, D>();
  if (e != cudaSuccess) return e;
  const int two_per_sm = 2 * std::max(1, current_sm_count());
  a.rows = rows;
  a.per_cta = rows <= two_per_sm ? 1 : std::min(kPredMaxPerCta, ceil_div(rows, two_per_sm));
  kernel<<<ceil_div(rows, a.per_cta), kPredThreads, a.per_cta * Slot::kBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename TW>
cudaError_t launch_predict(const PredictArgs& a, int rows, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
#define SPADE_PREDICT_CASE(D) \
  case D:                     \
    return launch_predict_typed<TW, D>(a, rows, stream);
    SPADE_FOR_EACH_HEAD_DIM(SPADE_PREDICT_CASE)
#undef SPADE_PREDICT_CASE
    default:
      return invalid_argument("predict_next_query", "head_dim ", head_dim, " is not compiled");
  }
}

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
  const float* q_hat;
  const void* k_cache;
  const int32_t* block_table;
  const int32_t* num_tokens;
  float* scores;
  int hq;
  int hkv;
  int group;
  int page_size;
  int log2_ps;
  int max_pages;
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
  const int G = a.group;
  const int L = a.num_tokens[b];
  const int begin = split * a.chunk;
  if (begin >= L) return;
  const int end = min(L, begin + a.chunk);

  const int p0 = begin >> a.log2_ps;
  {
    const int np = ((end - 1) >> a.log2_ps) - p0 + 1;
    const int32_t* bt = a.block_table + static_cast<size_t>(b) * a.max_pages + p0;
    for (int i = tid; i < np; i += kScoreThreads) tab[i] = bt[i];
  }
  __syncthreads();

  const size_t row_stride = static_cast<size_t>(a.hkv) * D;
  const T* kc = static_cast<const T*>(a.k_cache) + static_cast<size_t>(kvh) * D;
  const int ps_mask = a.page_size - 1;
  T* my_stages = stage_base + static_cast<size_t>(warp) * Cfg::kStages * Cfg::kTileElems;
  float* scratch = scratch_base + warp * Cfg::kScratch;
  auto issue = [&](int tile_start, int stage) {
    T* sk = my_stages + stage * Cfg::kTileElems;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksPerLane; ++i) {
      const int c = lane + 32 * i;
      const int tok = c / Cfg::kChunks;
      const int col = c % Cfg::kChunks;
      const int v = tile_start + tok;
      const bool valid = v < end;
      const T* gk = kc;
      if (valid) {
        const size_t row = static_cast<size_t>(tab[(v >> a.log2_ps) - p0]) * a.page_size + (v & ps_mask);
        gk = kc + row * row_stride;
      }
      cp_async_16(sk + swz(tok, col, Cfg::kChunks), gk + col * 8, valid);
    }
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
  const float* qbase = a.q_hat + (static_cast<size_t>(b) * a.hq + kvh * G) * D;
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
  float* out = a.scores + (static_cast<size_t>(b) * a.hkv + kvh) * a.score_stride;

#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < nj) issue(tile_begin(s), s);
    cp_async_commit();
  }
  for (int j = 0; j < nj; ++j) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncwarp();
    {
      const int jn = j + Cfg::kStages - 1;
      if (jn < nj) issue(tile_begin(jn), jn % Cfg::kStages);
      cp_async_commit();
    }
    const T* sk = my_stages + (j % Cfg::kStages) * Cfg::kTileElems;
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
  }
  cp_async_wait<0>();
}

template <typename T, int D>
cudaError_t score_smem_attribute() {
  static std::atomic<uint64_t> done{0};
  return ensure_smem_attribute(score_kernel<T, D>, ScoreConfig<D>::kSmemBytes, done);
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
      choose_splits(static_cast<long long>(batch) * a.hkv, slots, max_len, 256, ceil_div(max_len, cap), 1 << 20);
  a.chunk = ceil_div(ceil_div(max_len, splits), 16) * 16;
  const dim3 grid(ceil_div(max_len, a.chunk), a.hkv, batch);
  kernel<<<grid, kScoreThreads, Cfg::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

// =====================================================================================================================
// Top-k: one CTA (1024 threads = 32 warps) per row. Radix select on order-preserving uint32 keys with four 8-bit
// digits finds the exact k-th key (threshold) and how many threshold-equal elements to keep. Histograms are
// privatised per warp (no inter-warp atomic contention: scores cluster in a few high digits; __match_any_sync
// aggregation measured slower than plain shared atomics here). Rows of up to kTopkSmemKeys keys are loaded once into shared memory; longer
// rows are re-read (L2) on each pass. The final pass gives each warp a contiguous segment of positions: per-warp
// counts, a scan over the 32 warps, then an ordered walk with ballots writes the selected positions in ascending
// order, keeping the EARLIEST threshold-equal elements (topk_ref's tie rule).
// Successor expansion (TopkArgs::successor) only changes the key read: entry i > 0 ranks by max(key(s[i]),
// key(s[i-1])), entry 0 by its own key. The cached load takes the predecessor's key from the previous lane (lane 0
// reads it); the uncached path reads both scores (adjacent: the same L2 lines).
// =====================================================================================================================

constexpr int kTopkThreads = 1024;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkSmemKeys = 44 * 1024;
constexpr size_t kTopkSmemBytes = size_t{kTopkSmemKeys} * 4 + size_t{kTopkWarps} * 256 * 4 + 256 * 4;

struct TopkArgs {
  const float* scores;
  const int32_t* row_lens;
  int32_t* indices;
  int32_t* counts;
  int rows_per_batch;
  int score_stride;
  int k;
  int successor;  // rank entry i > 0 by max(key(s[i]), key(s[i-1]))
};

__device__ __forceinline__ uint32_t topk_key_dev(float x) {
  const uint32_t u = __float_as_uint(x);
  if (isnan(x)) return 0u;
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const TopkArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint32_t* skeys = reinterpret_cast<uint32_t*>(smem_raw);                     // [kTopkSmemKeys]
  int* whist = reinterpret_cast<int*>(skeys + kTopkSmemKeys);                   // [32 warps][256]
  int* hist = whist + kTopkWarps * 256;                                         // [256]
  __shared__ int s_digit, s_above;
  __shared__ int s_wgt[kTopkWarps], s_weq[kTopkWarps];
  const int row = blockIdx.x;
  const int b = row / a.rows_per_batch;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int n = max(0, min(a.row_lens[b], a.score_stride));
  const float* s = a.scores + static_cast<size_t>(row) * a.score_stride;
  int32_t* out = a.indices + static_cast<size_t>(row) * a.k;
  if (n <= a.k) {
    for (int i = tid; i < a.k; i += kTopkThreads) out[i] = i < n ? i : -1;
    if (a.counts != nullptr && tid == 0) a.counts[row] = n;
    return;
  }
  const bool cached = n <= kTopkSmemKeys;
  const bool succ = a.successor != 0;
  if (cached && !succ) {
#pragma unroll 8
    for (int i = tid; i < n; i += kTopkThreads) skeys[i] = topk_key_dev(__ldcg(s + i));
  } else if (cached) {
    // Every lane runs every iteration (the loop bound is CTA-uniform) so the shuffle sees the whole warp.
#pragma unroll 8
    for (int i0 = 0; i0 < n; i0 += kTopkThreads) {
      const int i = i0 + tid;
      const uint32_t own = i < n ? topk_key_dev(__ldcg(s + i)) : 0u;
      uint32_t prev = __shfl_up_sync(0xffffffffu, own, 1);
      if (lane == 0) prev = (i > 0 && i <= n) ? topk_key_dev(__ldcg(s + i - 1)) : 0u;
      if (i < n) skeys[i] = i > 0 ? max(own, prev) : own;
    }
  }
  auto key_at = [&](int i) -> uint32_t {
    if (cached) return skeys[i];
    const uint32_t own = topk_key_dev(__ldcg(s + i));
    return succ && i > 0 ? max(own, topk_key_dev(__ldcg(s + i - 1))) : own;
  };

  uint32_t prefix = 0;
  uint32_t mask = 0;
  int kr = a.k;  // still to take among the keys that match `prefix` on the digits fixed so far
#pragma unroll 1
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kTopkWarps * 256; i += kTopkThreads) whist[i] = 0;
    __syncthreads();
    int* my = whist + warp * 256;
    for (int i0 = 0; i0 < n; i0 += 8 * kTopkThreads) {
      uint32_t keys[8];  // 8 independent loads in flight before any is used
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = i0 + u * kTopkThreads + tid;
        keys[u] = i < n ? key_at(i) : 0u;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const bool take = i0 + u * kTopkThreads + tid < n && (keys[u] & mask) == prefix;
        const uint32_t dig = (keys[u] >> shift) & 0xFFu;
        if (take) atomicAdd(my + dig, 1);
      }
    }
    __syncthreads();
    if (tid < 256) {  // bin totals, descending digit order: thread t holds bin 255 - t
      int c = 0;
#pragma unroll 8
      for (int w = 0; w < kTopkWarps; ++w) c += whist[w * 256 + 255 - tid];
      hist[tid] = c;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of 256 bins, 8 per lane
      int c[8];
      int local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[lane * 8 + j];
        local += c[j];
      }
      int incl = local;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int nb = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += nb;
      }
      int excl = incl - local;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (excl < kr && excl + c[j] >= kr) {
          s_digit = 255 - (lane * 8 + j);
          s_above = excl;
        }
        excl += c[j];
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s_digit) << shift;
    mask |= 0xFFu << shift;
    kr -= s_above;
    __syncthreads();
  }

  // prefix is the k-th largest key: take every key above it and the first kr keys equal to it.
  const int seg = ((n + kTopkWarps - 1) / kTopkWarps + 31) & ~31;
  const int lo = min(n, warp * seg);
  const int hi = min(n, lo + seg);
  int gt = 0, eq = 0;
#pragma unroll 8
  for (int i = lo + lane; i < hi; i += 32) {
    const uint32_t key = key_at(i);
    gt += key > prefix ? 1 : 0;
    eq += key == prefix ? 1 : 0;
  }
  gt = __reduce_add_sync(0xffffffffu, gt);
  eq = __reduce_add_sync(0xffffffffu, eq);
  if (lane == 0) {
    s_wgt[warp] = gt;
    s_weq[warp] = eq;
  }
  __syncthreads();
  int base_gt = 0, base_eq = 0;
  for (int w = 0; w < warp; ++w) {
    base_gt += s_wgt[w];
    base_eq += s_weq[w];
  }
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int i0 = lo; i0 < hi; i0 += 32) {
    const int i = i0 + lane;
    const uint32_t key = i < hi ? key_at(i) : 0u;
    const bool g = i < hi && key > prefix;
    const bool e = i < hi && key == prefix;
    const unsigned mg = __ballot_sync(0xffffffffu, g);
    const unsigned me = __ballot_sync(0xffffffffu, e);
    const int eq_before = base_eq + __popc(me & lt_mask);
    if (g || (e && eq_before < kr)) out[base_gt + __popc(mg & lt_mask) + min(eq_before, kr)] = i;
    base_gt += __popc(mg);
    base_eq += __popc(me);
  }
  if (a.counts != nullptr && tid == 0) a.counts[row] = a.k;
}

// =====================================================================================================================
// Gather: one thread per 16-byte chunk of a selected row; K and V in the same thread.
// =====================================================================================================================

constexpr int kGatherThreads = 256;

struct GatherArgs {
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_table;
  const int32_t* indices;
  void* packed_k;
  void* packed_v;
  int hkv;
  int page_size;
  int log2_ps;
  int max_pages;
  int k;
  int head_dim;
};

__global__ void __launch_bounds__(kGatherThreads) gather_kernel(const GatherArgs a) {
  const int chunks = a.head_dim / 8;
  const int idx = blockIdx.x * kGatherThreads + threadIdx.x;
  if (idx >= a.k * chunks) return;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int i = idx / chunks;
  const int col = idx - i * chunks;
  const size_t row = static_cast<size_t>(b) * a.hkv + kvh;
  const int pos = a.indices[row * a.k + i];
  uint4 kv = make_uint4(0u, 0u, 0u, 0u);
  uint4 vv = kv;
  if (pos >= 0) {
    const int page = a.block_table[static_cast<size_t>(b) * a.max_pages + (pos >> a.log2_ps)];
    const size_t off = ((static_cast<size_t>(page) * a.page_size + (pos & (a.page_size - 1))) * a.hkv + kvh) *
                           a.head_dim +
                       col * 8;
    kv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.k_cache) + off));
    vv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.v_cache) + off));
  }
  const size_t dst = (row * a.k + i) * a.head_dim + col * 8;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.packed_k) + dst) = kv;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.packed_v) + dst) = vv;
}


// =====================================================================================================================
// Delta transfer (selection_delta_ref's rule). One CTA of 256 threads per row; the row's selection, the free slots
// by rank, a kept bitmap over the selection and a class per slot (kept / empty / stale) live in shared memory
// (36.5 KB at k = 4096). Ranks come from block-wide exclusive scans in 256-element chunks with running totals; the
// free slots' scan carries two counters packed in one int (empty in the low 16 bits, stale in the high ones:
// a 256-element chunk adds at most 256 to either). A row with more entering tokens than `capacity` finds the capacity-th best entering key with a
// 4-pass 8-bit radix select (a shared 256-bin histogram), then keeps the keys above it and the earliest equal ones
// (topk's tie rule).
// =====================================================================================================================

constexpr int kDeltaThreads = 256;

struct DeltaArgs {
  const int32_t* indices;
  const float* scores;
  int32_t* mirror;
  const int32_t* mirror_rows;
  int32_t* delta_slots;
  int32_t* delta_positions;
  int32_t* row_info;
  unsigned long long* totals;
  int k;
  int capacity;
  int score_stride;
};

constexpr size_t delta_smem_bytes(int k) {
  return static_cast<size_t>(k) * 4 * 2 + static_cast<size_t>((k + 31) / 32) * 4 + static_cast<size_t>(k);
}

__device__ __forceinline__ int lower_bound_i32(const int32_t* a, int n, int32_t x) {
  int lo = 0;
  int hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const DeltaArgs a) {
  using Scan = cub::BlockScan<int, kDeltaThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ int s_n, s_kept, s_empty, s_digit, s_above;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int k = a.k;
  int32_t* sel = reinterpret_cast<int32_t*>(smem_raw);                      // [k] the new selection
  int32_t* free_slot = sel + k;                                               // [k] free slots by rank
  uint32_t* kept_bits = reinterpret_cast<uint32_t*>(free_slot + k);           // [ceil(k / 32)] over sel
  uint8_t* cls = reinterpret_cast<uint8_t*>(kept_bits + (k + 31) / 32);       // [k] 0 kept, 1 empty, 2 stale
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int32_t* in = a.indices + static_cast<size_t>(row) * k;
  const int mrow = a.mirror_rows != nullptr ? __ldg(a.mirror_rows + row) : row;
  int32_t* mir = a.mirror + static_cast<size_t>(mrow < 0 ? 0 : mrow) * k;
  int32_t* ds = a.delta_slots + static_cast<size_t>(row) * a.capacity;
  int32_t* dp = a.delta_positions + static_cast<size_t>(row) * a.capacity;
  int32_t* info = a.row_info + static_cast<size_t>(row) * kDeltaInfoFields;
  if (mrow < 0) {  // no mirror row: refused (block-uniform)
    for (int j = tid; j < a.capacity; j += kDeltaThreads) {
      ds[j] = -1;
      dp[j] = -1;
    }
    if (tid == 0) {
      info[kDeltaCount] = 0;
      info[kDeltaEntering] = -1;
      info[kDeltaEntries] = 0;
      info[kDeltaHoles] = 0;
      if (a.totals != nullptr) atomicAdd(a.totals + kDeltaInfoFields, 1ull);
    }
    return;
  }

  if (tid == 0) {
    s_n = 0;
    s_kept = 0;
    s_empty = 0;
  }
  for (int i = tid; i < (k + 31) / 32; i += kDeltaThreads) kept_bits[i] = 0u;
  __syncthreads();
  int cnt = 0;
  for (int i = tid; i < k; i += kDeltaThreads) {
    const int32_t v = __ldg(in + i);
    sel[i] = v;
    cnt += v >= 0 ? 1 : 0;
  }
  atomicAdd(&s_n, cnt);
  __syncthreads();
  const int n = s_n;
  // "ascending positions, then -1": the first n entries are the non-negative ones, strictly increasing.
  int bad = 0;
  for (int i = tid; i < k; i += kDeltaThreads) {
    const int32_t v = sel[i];
    if (i < n ? (v < 0 || (i > 0 && v <= sel[i - 1])) : v != -1) bad = 1;
  }
  // Classify the slots below n; a token held twice, or a value below -1, means the mirror is corrupt.
  int kept = 0;
  int empty = 0;
  for (int s = tid; s < n; s += kDeltaThreads) {
    const int32_t pos = mir[s];
    uint8_t c = 2;
    if (pos < -1) {
      bad = 1;
    } else if (pos < 0) {
      c = 1;
      ++empty;
    } else {
      const int i = lower_bound_i32(sel, n, pos);
      if (i < n && sel[i] == pos) {
        const uint32_t bit = 1u << (i & 31);
        if ((atomicOr(&kept_bits[i >> 5], bit) & bit) != 0u) bad = 1;
        c = 0;
        ++kept;
      }
    }
    cls[s] = c;
  }
  atomicAdd(&s_kept, kept);
  atomicAdd(&s_empty, empty);
  // Refusal (block-uniform; the mirror is still untouched): no entries, E = -1, counted in totals.
  auto refuse = [&] {
    for (int j = tid; j < a.capacity; j += kDeltaThreads) {
      ds[j] = -1;
      dp[j] = -1;
    }
    if (tid == 0) {
      info[kDeltaCount] = n;
      info[kDeltaEntering] = -1;
      info[kDeltaEntries] = 0;
      info[kDeltaHoles] = 0;
      if (a.totals != nullptr) atomicAdd(a.totals + kDeltaInfoFields, 1ull);
    }
  };
  if (__syncthreads_or(bad)) {
    refuse();
    return;
  }
  const int n_empty = s_empty;
  const int E = n - s_kept;
  const int m = min(E, a.capacity);

  // Free slots by rank: the empty ones ascending, then the stale ones ascending.
  {
    int run_e = 0;
    int run_s = 0;
    for (int base = 0; base < n; base += kDeltaThreads) {
      const int s = base + tid;
      const int c = s < n ? cls[s] : 0;
      const int flag = (c == 1 ? 1 : 0) | (c == 2 ? (1 << 16) : 0);
      int rank = 0;
      int total = 0;
      Scan(scan_tmp).ExclusiveSum(flag, rank, total);
      if (c == 1) free_slot[run_e + (rank & 0xFFFF)] = s;
      if (c == 2) free_slot[n_empty + run_s + (rank >> 16)] = s;
      run_e += total & 0xFFFF;
      run_s += total >> 16;
      __syncthreads();  // scan_tmp reuse
    }
  }

  // Overflow: the capacity-th best key among the entering tokens (radix select), and how many equal keys to keep.
  const float* sc = a.scores + static_cast<size_t>(row) * a.score_stride;
  auto key_of = [&](int32_t pos) -> uint32_t { return pos < a.score_stride ? topk_key_dev(__ldg(sc + pos)) : 0u; };
  auto entering = [&](int i) { return i < n && (kept_bits[i >> 5] & (1u << (i & 31))) == 0u; };
  uint32_t thr = 0;
  int kr = 0;
  const bool overflow = E > a.capacity;
  if (overflow) {
    // The scores row must cover every entering position (the reference's check); else refuse the row.
    for (int i = tid; i < n; i += kDeltaThreads) bad |= entering(i) && sel[i] >= a.score_stride ? 1 : 0;
    if (__syncthreads_or(bad)) {
      refuse();
      return;
    }
    uint32_t prefix = 0;
    uint32_t mask = 0;
    kr = a.capacity;
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[tid] = 0;  // kDeltaThreads == 256 bins
      __syncthreads();
      for (int i = tid; i < n; i += kDeltaThreads) {
        if (!entering(i)) continue;
        const uint32_t key = key_of(sel[i]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFFu], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int above = 0;
        for (int d = 255; d >= 0; --d) {
          if (above + hist[d] >= kr) {
            s_digit = d;
            s_above = above;
            break;
          }
          above += hist[d];
        }
      }
      __syncthreads();
      prefix |= static_cast<uint32_t>(s_digit) << shift;
      mask |= 0xFFu << shift;
      kr -= s_above;
      __syncthreads();
    }
    thr = prefix;
  }

  // Sent tokens in ascending position order take the free slots in rank order.
  {
    int run_eq = 0;
    int run_sent = 0;
    for (int base = 0; base < n; base += kDeltaThreads) {
      const int i = base + tid;
      const bool ent = entering(i);
      bool take = ent;
      if (overflow) {
        const uint32_t key = ent ? key_of(sel[i]) : 0u;
        const int eq = ent && key == thr ? 1 : 0;
        int eq_rank = 0;
        int eq_total = 0;
        Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
        __syncthreads();
        take = ent && (key > thr || (eq != 0 && run_eq + eq_rank < kr));
        run_eq += eq_total;
      }
      int rank = 0;
      int total = 0;
      Scan(scan_tmp).ExclusiveSum(take ? 1 : 0, rank, total);
      if (take) {
        const int j = run_sent + rank;
        const int slot = free_slot[j];
        ds[j] = slot;
        dp[j] = sel[i];
        mir[slot] = sel[i];
      }
      run_sent += total;
      __syncthreads();
    }
  }
  for (int j = m + tid; j < a.capacity; j += kDeltaThreads) {
    ds[j] = -1;
    dp[j] = -1;
  }
  for (int s = n + tid; s < k; s += kDeltaThreads) mir[s] = -1;
  if (tid == 0) {
    const int holes = max(0, n_empty - m);
    info[kDeltaCount] = n;
    info[kDeltaEntering] = E;
    info[kDeltaEntries] = m;
    info[kDeltaHoles] = holes;
    if (a.totals != nullptr) {
      atomicAdd(a.totals + kDeltaCount, static_cast<unsigned long long>(n));
      atomicAdd(a.totals + kDeltaEntering, static_cast<unsigned long long>(E));
      atomicAdd(a.totals + kDeltaEntries, static_cast<unsigned long long>(m));
      atomicAdd(a.totals + kDeltaHoles, static_cast<unsigned long long>(holes));
    }
  }
}

// Apply: one thread per 16-byte chunk of an entry's K and V rows.
constexpr int kApplyThreads = 256;

struct ApplyArgs {
  const int32_t* delta_slots;
  const int32_t* delta_positions;
  const void* delta_k;
  const void* delta_v;
  void* held_k;
  void* held_v;
  int32_t* held_positions;
  const int32_t* held_rows;
  int k;
  int capacity;
  int head_dim;
  int row0;  // first row of this launch (grid.y is at most 65535 rows)
};

__global__ void __launch_bounds__(kApplyThreads) apply_delta_kernel(const ApplyArgs a) {
  const int chunks = a.head_dim / 8;
  const int idx = blockIdx.x * kApplyThreads + threadIdx.x;
  if (idx >= a.capacity * chunks) return;
  const int row = a.row0 + static_cast<int>(blockIdx.y);
  const int j = idx / chunks;
  const int col = idx - j * chunks;
  const size_t e = static_cast<size_t>(row) * a.capacity + j;
  const int slot = __ldg(a.delta_slots + e);
  if (slot < 0 || slot >= a.k) return;
  const int hrow = a.held_rows != nullptr ? __ldg(a.held_rows + row) : row;
  if (hrow < 0) return;
  const size_t src = e * a.head_dim + col * 8;
  const size_t dst = (static_cast<size_t>(hrow) * a.k + slot) * a.head_dim + col * 8;
  const uint4 kv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.delta_k) + src));
  const uint4 vv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.delta_v) + src));
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.held_k) + dst) = kv;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.held_v) + dst) = vv;
  if (a.held_positions != nullptr && col == 0)
    a.held_positions[static_cast<size_t>(hrow) * a.k + slot] = __ldg(a.delta_positions + e);
}


// =====================================================================================================================
// Query windows: one CTA per row; each thread owns a few columns of every entry of every head, so the in-place shift
// (entry e takes entry e + drop, e ascending) never reads an entry it already overwrote.
// =====================================================================================================================

constexpr int kWindowThreads = 128;

struct WindowArgs {
  uint16_t* windows;
  int32_t* window_len;
  const int32_t* window_idx;
  const uint16_t* q;
  const int32_t* cu_tokens;
  const int32_t* reset;
  int num_windows, num_heads, capacity, head_dim;
};

__global__ void __launch_bounds__(kWindowThreads) push_window_kernel(const WindowArgs a) {
  const int r = blockIdx.x;
  const int w = __ldg(a.window_idx + r);
  if (w < 0 || w >= a.num_windows) return;
  const int t0 = __ldg(a.cu_tokens + r);
  const int n = max(0, __ldg(a.cu_tokens + r + 1) - t0);
  int len = (a.reset != nullptr && __ldg(a.reset + r) != 0) ? 0 : a.window_len[w];
  len = min(max(len, 0), a.capacity);
  const int keep = min(a.capacity, len + n);
  const int drop = len + n - keep;  // leading entries of [window | new queries] that fall out
  const int D = a.head_dim;
  __syncthreads();  // every thread read window_len before thread 0 rewrites it
  for (int h = 0; h < a.num_heads; ++h) {
    uint16_t* win = a.windows + (static_cast<size_t>(w) * a.num_heads + h) * a.capacity * D;
    for (int e = 0; e < keep; ++e) {
      const int src = drop + e;  // index into [window (len) | new queries (n)]
      for (int d = threadIdx.x; d < D; d += kWindowThreads) {
        const uint16_t v = src < len ? win[static_cast<size_t>(src) * D + d]
                                     : a.q[(static_cast<size_t>(t0 + src - len) * a.num_heads + h) * D + d];
        win[static_cast<size_t>(e) * D + d] = v;
      }
    }
  }
  if (threadIdx.x == 0) a.window_len[w] = keep;
}

cudaError_t topk_smem_attribute() {
  static std::atomic<uint64_t> done{0};
  return ensure_smem_attribute(topk_kernel, kTopkSmemBytes, done);
}

}  // namespace
}  // namespace detail

cudaError_t predict_next_query(const PredictQueryParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "predict_next_query";
  if (p.window == nullptr || p.window_len == nullptr || p.q_hat == nullptr) {
    return invalid_argument(what, "window, window_len and q_hat must be set");
  }
  if (p.batch <= 0 || p.num_heads <= 0) {
    return invalid_argument(what, "batch ", p.batch, " / num_heads ", p.num_heads, " must be > 0");
  }
  if (p.window_capacity < 1 || p.window_capacity > kMaxPredictorWindow + 1) {
    return invalid_argument(what, "window_capacity ", p.window_capacity, " outside 1..", kMaxPredictorWindow + 1);
  }
  if (p.max_regressors < 1 || p.max_regressors > kMaxPredictorWindow) {
    return invalid_argument(what, "max_regressors ", p.max_regressors, " outside 1..", kMaxPredictorWindow);
  }
  if (!(p.eps > 0.f) || !std::isfinite(p.eps)) return invalid_argument(what, "eps ", p.eps, " must be > 0");
  if (!is_supported_head_dim(p.head_dim)) return invalid_argument(what, "head_dim ", p.head_dim, " not supported");
  if (p.kind != PredictorKind::kRidge && p.kind != PredictorKind::kPaper && p.kind != PredictorKind::kLastQuery) {
    return invalid_argument(what, "kind ", static_cast<int>(p.kind), " is not kRidge, kPaper or kLastQuery");
  }
  PredictArgs a{p.window,      p.window_len,    p.q_hat, p.num_heads, p.window_capacity, p.max_regressors,
                static_cast<double>(p.eps), 0,   1,       p.kind};
  const int rows = p.batch * p.num_heads;
  switch (p.window_dtype) {
    case DType::F32:
      return launch_predict<float>(a, rows, p.head_dim, stream);
    case DType::BF16:
      return launch_predict<__nv_bfloat16>(a, rows, p.head_dim, stream);
    case DType::F16:
      return launch_predict<__half>(a, rows, p.head_dim, stream);
  }
  return invalid_argument(what, "window_dtype is not F32, BF16 or F16");
}

cudaError_t score_tokens(const ScoreTokensParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "score_tokens";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.q_hat == nullptr || p.k_cache == nullptr || p.block_table == nullptr || p.num_tokens == nullptr ||
      p.scores == nullptr) {
    return invalid_argument(what, "q_hat, k_cache, block_table, num_tokens and scores must be set");
  }
  if (p.batch <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads <= 0) {
    return invalid_argument(what, "batch ", p.batch, ", num_q_heads ", p.num_q_heads, ", num_kv_heads ",
                            p.num_kv_heads, " invalid");
  }
  if (p.num_q_heads / p.num_kv_heads > kMaxGqaGroup) {
    return invalid_argument(what, "GQA group ", p.num_q_heads / p.num_kv_heads, " exceeds ", kMaxGqaGroup);
  }
  if (!is_supported_head_dim(p.head_dim)) return invalid_argument(what, "head_dim ", p.head_dim, " not supported");
  if (!is_pow2(p.page_size)) return invalid_argument(what, "page_size ", p.page_size, " must be a power of two");
  if (p.max_pages_per_seq <= 0 || p.score_stride <= 0) {
    return invalid_argument(what, "max_pages_per_seq ", p.max_pages_per_seq, " / score_stride ", p.score_stride,
                            " must be > 0");
  }
  ScoreArgs a{};
  a.q_hat = p.q_hat;
  a.k_cache = p.k_cache;
  a.block_table = p.block_table;
  a.num_tokens = p.num_tokens;
  a.scores = p.scores;
  a.hq = p.num_q_heads;
  a.hkv = p.num_kv_heads;
  a.group = p.num_q_heads / p.num_kv_heads;
  a.page_size = p.page_size;
  a.log2_ps = log2_int(p.page_size);
  a.max_pages = p.max_pages_per_seq;
  a.score_stride = p.score_stride;
  a.rule_max = p.rule == GqaScoreRule::kMax ? 1 : 0;
  const int max_len = static_cast<int>(std::min<long long>(
      p.score_stride, static_cast<long long>(p.max_pages_per_seq) * p.page_size));
  if (p.dtype == DType::BF16) {
    switch (p.head_dim) {
#define SPADE_SCORE_CASE(D) \
  case D:                   \
    return launch_score_typed<__nv_bfloat16, D>(a, p.batch, p.page_size, max_len, stream);
      SPADE_FOR_EACH_HEAD_DIM(SPADE_SCORE_CASE)
#undef SPADE_SCORE_CASE
      default:
        break;
    }
  } else {
    switch (p.head_dim) {
#define SPADE_SCORE_CASE(D) \
  case D:                   \
    return launch_score_typed<__half, D>(a, p.batch, p.page_size, max_len, stream);
      SPADE_FOR_EACH_HEAD_DIM(SPADE_SCORE_CASE)
#undef SPADE_SCORE_CASE
      default:
        break;
    }
  }
  return invalid_argument(what, "head_dim ", p.head_dim, " is not compiled");
}

cudaError_t topk_select(const TopkParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "topk_select";
  if (p.scores == nullptr || p.row_lens == nullptr || p.indices == nullptr) {
    return invalid_argument(what, "scores, row_lens and indices must be set");
  }
  if (p.batch <= 0 || p.rows_per_batch <= 0 || p.score_stride <= 0) {
    return invalid_argument(what, "batch ", p.batch, " / rows_per_batch ", p.rows_per_batch, " / score_stride ",
                            p.score_stride, " must be > 0");
  }
  if (p.k < 1) return invalid_argument(what, "k ", p.k, " must be >= 1");
  const TopkArgs a{p.scores,       p.row_lens,     p.indices, p.counts,
                   p.rows_per_batch, p.score_stride, p.k,       p.successor ? 1 : 0};
  const cudaError_t e = topk_smem_attribute();
  if (e != cudaSuccess) return e;
  topk_kernel<<<p.batch * p.rows_per_batch, kTopkThreads, kTopkSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t gather_kv(const GatherKvParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "gather_kv";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.block_table == nullptr || p.indices == nullptr ||
      p.packed_k == nullptr || p.packed_v == nullptr) {
    return invalid_argument(what, "all pointers must be set");
  }
  if (p.batch <= 0 || p.num_kv_heads <= 0 || p.k <= 0 || p.max_pages_per_seq <= 0) {
    return invalid_argument(what, "batch ", p.batch, " / num_kv_heads ", p.num_kv_heads, " / k ", p.k,
                            " / max_pages_per_seq ", p.max_pages_per_seq, " must be > 0");
  }
  if (!is_supported_head_dim(p.head_dim)) return invalid_argument(what, "head_dim ", p.head_dim, " not supported");
  if (!is_pow2(p.page_size)) return invalid_argument(what, "page_size ", p.page_size, " must be a power of two");
  const GatherArgs a{p.k_cache, p.v_cache, p.block_table,        p.indices, p.packed_k,
                     p.packed_v, p.num_kv_heads, p.page_size, log2_int(p.page_size), p.max_pages_per_seq,
                     p.k,         p.head_dim};
  const dim3 grid(ceil_div(static_cast<long long>(p.k) * (p.head_dim / 8), kGatherThreads), p.num_kv_heads,
                  p.batch);
  gather_kernel<<<grid, kGatherThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t selection_delta(const SelectionDeltaParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "selection_delta";
  if (p.indices == nullptr || p.mirror == nullptr || p.delta_slots == nullptr || p.delta_positions == nullptr ||
      p.row_info == nullptr) {
    return invalid_argument(what, "indices, mirror, delta_slots, delta_positions and row_info must be set");
  }
  if (p.rows < 0 || p.k < 1 || p.k > kMaxDeltaBudget || p.capacity < 1 || p.capacity > p.k) {
    return invalid_argument(what, "rows ", p.rows, " / k ", p.k, " / capacity ", p.capacity,
                            " invalid (k in 1..", kMaxDeltaBudget, ", capacity in 1..k)");
  }
  if (p.capacity < p.k && (p.scores == nullptr || p.score_stride < 1)) {
    return invalid_argument(what, "capacity ", p.capacity, " < k needs scores and score_stride >= 1");
  }
  if (p.rows == 0) return cudaSuccess;
  const DeltaArgs a{p.indices, p.scores,   p.mirror,      p.mirror_rows, p.delta_slots, p.delta_positions,
                    p.row_info, p.totals,  p.k,           p.capacity,    p.score_stride};
  delta_kernel<<<p.rows, kDeltaThreads, delta_smem_bytes(p.k), stream>>>(a);
  return cudaGetLastError();
}

cudaError_t apply_selection_delta(const ApplySelectionDeltaParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "apply_selection_delta";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.delta_slots == nullptr || p.delta_k == nullptr || p.delta_v == nullptr || p.held_k == nullptr ||
      p.held_v == nullptr || (p.held_positions != nullptr && p.delta_positions == nullptr)) {
    return invalid_argument(what, "delta_slots, delta_k, delta_v, held_k, held_v (and delta_positions with "
                            "held_positions) must be set");
  }
  if (p.rows < 0 || p.k < 1 || p.capacity < 1) {
    return invalid_argument(what, "rows ", p.rows, " / k ", p.k, " / capacity ", p.capacity, " invalid");
  }
  if (!is_supported_head_dim(p.head_dim)) return invalid_argument(what, "head_dim ", p.head_dim, " not supported");
  if (p.rows == 0) return cudaSuccess;
  ApplyArgs a{p.delta_slots, p.delta_positions, p.delta_k,  p.delta_v,   p.held_k,   p.held_v,
              p.held_positions, p.held_rows,    p.k,        p.capacity,  p.head_dim, 0};
  constexpr int kMaxGridY = 65535;
  for (int r0 = 0; r0 < p.rows; r0 += kMaxGridY) {
    a.row0 = r0;
    const dim3 grid(ceil_div(static_cast<long long>(p.capacity) * (p.head_dim / 8), kApplyThreads),
                    std::min(kMaxGridY, p.rows - r0));
    apply_delta_kernel<<<grid, kApplyThreads, 0, stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t push_query_window(const PushQueryWindowParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "push_query_window";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.rows < 0 || p.num_windows < 1 || p.num_heads < 1 || p.capacity < 1 ||
      p.capacity > kMaxPredictorWindow + 1 || p.head_dim < 2 || p.head_dim % 2 != 0) {
    return invalid_argument(what, "rows ", p.rows, " / num_windows ", p.num_windows, " / num_heads ", p.num_heads,
                            " / capacity ", p.capacity, " / head_dim ", p.head_dim, " invalid");
  }
  if (p.rows == 0) return cudaSuccess;
  if (p.windows == nullptr || p.window_len == nullptr || p.window_idx == nullptr || p.q == nullptr ||
      p.cu_tokens == nullptr) {
    return invalid_argument(what, "windows, window_len, window_idx, q and cu_tokens must be set");
  }
  const WindowArgs a{static_cast<uint16_t*>(p.windows), p.window_len, p.window_idx, static_cast<const uint16_t*>(p.q),
                     p.cu_tokens, p.reset, p.num_windows, p.num_heads, p.capacity, p.head_dim};
  push_window_kernel<<<p.rows, kWindowThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t prepare_selection_kernels() {
  using namespace detail;
  cudaError_t e = topk_smem_attribute();
#define SPADE_PREPARE_CASE(D)                                                  \
  if (e == cudaSuccess) e = predict_smem_attribute<float, D>();                \
  if (e == cudaSuccess) e = predict_smem_attribute<__nv_bfloat16, D>();        \
  if (e == cudaSuccess) e = predict_smem_attribute<__half, D>();               \
  if (e == cudaSuccess) e = score_smem_attribute<__nv_bfloat16, D>();          \
  if (e == cudaSuccess) e = score_smem_attribute<__half, D>();
  SPADE_FOR_EACH_HEAD_DIM(SPADE_PREPARE_CASE)
#undef SPADE_PREPARE_CASE
  return e;
}

}  // namespace spade::kernels

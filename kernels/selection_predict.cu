// Selection, predict stage: query windows + next-query predictor (AsyncSpade Algorithm 1; kernels/selection_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Predictor: one problem per (sequence, head), 1..kPredMaxPerCta problems per CTA. Gram matrix of the regressors
// ordered newest first (Q_{t-1}, Q_{t-2}, ...) in fp64; then the k x k Gram of window size k is the leading k x k
// block, so ONE Cholesky factor L of the W x W matrix serves every window size: y = L^{-1} H q_t and X = L^{-1} are
// prefix-consistent, and the weights of window size k, w^(k) = L_k^{-T} y[:k], are prefix sums over t of
// X[t][i] y_t. One warp does all of it in registers (lane i owns row i; shuffles only), so the solve has no
// shared-memory round trips on its critical path.
// The Gram matrix is built without eps; the solving warp adds eps to the diagonal when it loads the rows: eps itself
// (kPaper), or eps times the mean of the raw diagonal, i.e. of the m regressors' squared norms (kRidge), one value
// for every window size so the leading blocks stay nested. kPaper softmaxes each window size's weights before the
// pooling; kRidge pools the raw weights. kLastQuery skips all of it (q_hat = Q_t).
// =====================================================================================================================

constexpr int kPredThreads = 128;
// Compile-time bound W of the regressors (max_regressors <= W): the launcher picks kPredSmallW when max_regressors
// allows, so the slots in shared memory and the solving warp's register rows are sized for it (more problems per SM
// for the latency-bound solve), else kMaxPredictorWindow. Both compute the same numbers for max_regressors <= 8.
constexpr int kPredSmallW = 8;

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

// Per problem slot in shared memory: the Gram / Cholesky factor ([W][kLd] fp64), H q_t, the pooled weights, two ints
// (n, meff), and the m + 1 window rows the problem reads (Q_{t-m} .. Q_t, m = min(n - 1, max_regressors) <= W) stored
// with a stride of D + 1 floats (the Gram threads read the same d of different rows, which would otherwise all hit
// one shared-memory bank).
template <int D, int W>
struct PredictSlot {
  static constexpr int kLd = W + 1;  // padded row length of the fp64 matrices
  static constexpr int kWS = D + 1;
  static constexpr size_t kDoubles = size_t{W} * kLd + 2 * W + 2;
  static constexpr size_t kBytes = kDoubles * 8 + ((size_t{W + 1} * kWS * 4 + 15) & ~size_t{15});
};

// Problems per CTA: 1 while the rows fit in about two CTAs per SM (lowest latency: all 128 threads build the one
// Gram matrix); up to kPredMaxPerCta for larger batches (e.g. a layer pack in one launch), one solving warp each,
// so more solves run concurrently per SM (the solve is a latency-bound fp64 chain on one warp).
constexpr int kPredMaxPerCta = 4;

template <typename TW, int D, int W>
__global__ void __launch_bounds__(kPredThreads) predict_kernel(const PredictArgs a) {
  using Slot = PredictSlot<D, W>;
  constexpr int WS = Slot::kWS;
  constexpr int kLd = Slot::kLd;
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
    double* A = slot_A(pb);      // [W][kLd] Gram -> Cholesky factor (lower)
    double* yv = A + W * kLd;    // [W] H q_t
    int* ints = reinterpret_cast<int*>(yv + 2 * W);  // n, meff
    float* win = slot_win(pb);  // staged row r: window slot n-1-m+r (Q_t at row m)
    const int n = min(a.window_len[row / a.num_heads], a.capacity);
    if (tid == 0) ints[0] = n;
    if (n <= 1 || a.kind == PredictorKind::kLastQuery) continue;  // uniform across the CTA
    const int m = min(n - 1, a.max_reg);
    const TW* src = static_cast<const TW*>(a.window) + (static_cast<size_t>(row) * a.capacity + (n - 1 - m)) * D;
    for (int i = tid; i < (m + 1) * D; i += kPredThreads) win[(i / D) * WS + i % D] = load_f32(src + i);
    __syncthreads();

    // Gram entries A[i][j] = r_i . r_j (j <= i < m) and yv[i] = r_i . q_t, r_i = window slot n-2-i = staged row
    // m-1-i.
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
        x = win + (m - 1 - i) * WS;
        y = win + (m - 1 - j) * WS;
      } else {
        i = p - npairs;
        j = -1;
        x = win + (m - 1 - i) * WS;
        y = win + m * WS;
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
    double* yv = A + W * kLd;
    double* coef = yv + W;
    int* ints = reinterpret_cast<int*>(yv + 2 * W);
    const int n = ints[0];
    const int m = (n <= 1 || a.kind == PredictorKind::kLastQuery) ? 0 : min(n - 1, a.max_reg);
    if (m == 0) {
      if (lane == 0) ints[1] = 0;
    } else {
      // Everything below lives in registers of this warp; lane i owns row i (fully unrolled, compile-time indices).
      constexpr unsigned kFull = 0xffffffffu;
      double lrow[W];  // row `lane` of the regularised Gram, then of its Cholesky factor L
#pragma unroll
      for (int j = 0; j < W; ++j) lrow[j] = (lane < m && j <= lane) ? A[lane * kLd + j] : 0.0;
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
      for (int j = 0; j < W; ++j) {
        if (lane < m && j == lane) lrow[j] += eps;
      }
      double diag_inv = 1.0;  // 1 / L[lane][lane]
      int meff = m;
      // Right-looking Cholesky. A non-positive pivot at step k drops window sizes > k (their Gram contains it).
      // rsqrt instead of sqrt + divide: one fp64 sequence on the critical path per step.
#pragma unroll
      for (int k = 0; k < W; ++k) {
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
            for (int j = k + 1; j < W; ++j) {
              const double ljk = __shfl_sync(kFull, lrow[k], j);
              if (j <= lane) lrow[j] -= lrow[k] * ljk;
            }
          }
        }
      }
      // y = L^{-1} (H q_t); lane i holds y_i.
      double y = lane < meff ? yv[lane] : 0.0;
#pragma unroll
      for (int k = 0; k < W; ++k) {
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
      double x[W];
#pragma unroll
      for (int j = 0; j < W; ++j) x[j] = (j == lane) ? 1.0 : 0.0;
#pragma unroll
      for (int k = 0; k < W; ++k) {
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
      for (int i = 0; i < W; ++i) {
        double v = lane < meff ? x[i] * y : 0.0;
#pragma unroll
        for (int off = 1; off < W; off <<= 1) {
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
        for (int i = 0; i < W; ++i) {
          if (i <= lane) mx = fmax(mx, x[i]);
        }
        float e[W];
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < W; ++i) {
          e[i] = (i <= lane) ? __expf(static_cast<float>(x[i] - mx)) : 0.f;
          sum += e[i];
        }
        const float scale = lane < meff ? 1.f / (sum * static_cast<float>(meff)) : 0.f;
        // Average pooling: the shifted slot n-1-i gets (1/meff) sum_{k > i} w^(k)_i = sum over lanes l >= i.
#pragma unroll
        for (int i = 0; i < W; ++i) {
          float v = e[i] * scale;
#pragma unroll
          for (int off = W / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
          if (lane == 0) coef[i] = v;
        }
      } else {
        // kRidge: the raw weights, pooled in fp64 (they can be large and of both signs): the shifted slot n-1-i gets
        // (1/meff) sum_{k > i} w^(k)_i = the sum over lanes l >= i (lane l holds w^(l+1), entries i <= l).
#pragma unroll
        for (int i = 0; i < W; ++i) {
          double v = (i <= lane && lane < meff) ? x[i] : 0.0;
#pragma unroll
          for (int off = W / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
          if (lane == 0) coef[i] = meff > 0 ? v / static_cast<double>(meff) : 0.0;
        }
      }
      if (lane == 0) ints[1] = meff;
    }
  }
  __syncthreads();

  // Phase 3: q_hat = sum_i coef_i * Q_{t+1-i}  (n == 0: zeros; no regression possible or kLastQuery: Q_t).
  for (int p = 0; p < np; ++p) {
    const double* coef = slot_A(p) + W * kLd + W;
    const int* ints = reinterpret_cast<const int*>(coef + W);
    const int n = ints[0];
    const int meff = ints[1];
    const int top = min(n - 1, a.max_reg);  // staged row of Q_t (when the window was staged)
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
                     : win[top * WS + d];
      } else {
        double acc = 0.0;
        for (int i = 0; i < meff; ++i) acc += coef[i] * static_cast<double>(win[(top - i) * WS + d]);
        out[d] = static_cast<float>(acc);
      }
    }
  }
}

// The dynamic shared-memory limit of predict_kernel<TW, D, W> on the current device, set once (launch or prepare).
template <typename TW, int D, int W>
cudaError_t predict_smem_attribute() {
  return ensure_smem_attribute<predict_kernel<TW, D, W>>(kPredMaxPerCta * PredictSlot<D, W>::kBytes);
}

template <typename TW, int D, int W>
cudaError_t launch_predict_typed(PredictArgs a, int rows, cudaStream_t stream) {
  using Slot = PredictSlot<D, W>;
  auto kernel = predict_kernel<TW, D, W>;
  cudaError_t e = predict_smem_attribute<TW, D, W>();
  if (e != cudaSuccess) return e;
  const int two_per_sm = 2 * std::max(1, current_sm_count());
  a.rows = rows;
  a.per_cta = rows <= two_per_sm ? 1 : std::min(kPredMaxPerCta, ceil_div(rows, two_per_sm));
  kernel<<<ceil_div(rows, a.per_cta), kPredThreads, a.per_cta * Slot::kBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t prepare_predict_kernels() {
  return for_each_type_head_dim<float, __nv_bfloat16, __half>([](auto tw, auto dim) {
    const cudaError_t e = predict_smem_attribute<decltype(tw), decltype(dim)::value, kPredSmallW>();
    return e != cudaSuccess ? e : predict_smem_attribute<decltype(tw), decltype(dim)::value, kMaxPredictorWindow>();
  });
}

namespace {

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
  if (p.window_dtype != DType::F32 && p.window_dtype != DType::BF16 && p.window_dtype != DType::F16) {
    return invalid_argument(what, "window_dtype is not F32, BF16 or F16");
  }
  const int rows = p.batch * p.num_heads;
  return dispatch_float_types(p.window_dtype, [&](auto tw) {
    return dispatch_head_dim(what, p.head_dim, [&](auto dim) {
      using TW = decltype(tw);
      constexpr int D = decltype(dim)::value;
      return p.max_regressors <= kPredSmallW ? launch_predict_typed<TW, D, kPredSmallW>(a, rows, stream)
                                             : launch_predict_typed<TW, D, kMaxPredictorWindow>(a, rows, stream);
    });
  });
}

cudaError_t push_query_window(const PushQueryWindowParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "push_query_window";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.rows < 0 || p.num_windows < 1 || p.num_heads < 1 || p.capacity < 1 ||
      p.capacity > std::max(kMaxPredictorWindow + 1, kMaxAnchorWindow) || p.head_dim < 2 || p.head_dim % 2 != 0) {
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

}  // namespace spade::kernels

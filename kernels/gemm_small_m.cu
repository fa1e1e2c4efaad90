// Small-M split-K GEMM of the decode steps (small_m_gemm, kernels/gemm.cuh states the contract). Tested against
// kernels/linear_ref (tests/kernels/test_gemm.cu).
//
// Fragment trick: the mma.m16n8k16 A fragment (kernel_common.cuh) gives lane (g, c) the W elements of rows g and g+8
// at logical K columns 2c, 2c+1, 2c+8, 2c+9, and the B fragment the x elements of token g at the same logical rows.
// A dot product does not care about the order of K, so logical column 2c+{0,1} of the first mma of a 32-element
// K block maps to physical column 8c+{0,1}, 2c+8+{0,1} to 8c+{2,3}, and the second mma takes 8c+{4..7}: every lane
// reads 16 contiguous bytes of its W row and 16 of its x row per block, straight into the fragment registers.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm.cuh"
#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"

namespace spade::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerCta = 32;  // two m16 tiles of W rows (output features)
constexpr int kKBlock = 32;      // K elements per lane-quad per step: 4 lanes x 8 elements
constexpr int kUnroll = 2;       // K blocks in flight per warp

/// 16 bytes of streamed W: read once per call, not kept in L1.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

template <typename OutT>
__device__ __forceinline__ float load_bias(const OutT* bias, int i) {
  if constexpr (std::is_same_v<OutT, float>) {
    return bias[i];
  } else {
    return detail::ElemTraits<OutT>::to_float(bias[i]);
  }
}

template <typename OutT>
__device__ __forceinline__ OutT to_out(float v) {
  if constexpr (std::is_same_v<OutT, float>) {
    return v;
  } else {
    return detail::ElemTraits<OutT>::from_float(v);
  }
}

// Grid (ceil(n / 32), splits); NT = ceil(m / 8) token tiles. Split s covers K [s * k_per_split, min(k, +k_per_split)).
template <typename T, typename OutT, int NT>
__global__ void __launch_bounds__(kThreads, 4)
    small_m_gemm_kernel(const T* __restrict__ x, const T* __restrict__ w, const OutT* __restrict__ bias,
                        OutT* __restrict__ y, float* __restrict__ partials, int* __restrict__ counters, int m, int n,
                        int k, int k_per_split) {
  __shared__ float red[kWarps][NT * 8][kRowsPerCta];
  __shared__ int s_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int row0 = blockIdx.x * kRowsPerCta, split = blockIdx.y, splits = gridDim.y;
  const int k_begin = split * k_per_split, k_end = min(k, k_begin + k_per_split);
  const int blocks = k_end > k_begin ? (k_end - k_begin) / kKBlock : 0;
  const T* wr[2][2];  // [m16 tile][row g / g + 8], rows past n clamped (loaded, never written)
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row0 + mt * 16 + h * 8 + g, n - 1);
      wr[mt][h] = w + static_cast<size_t>(r) * k + k_begin + c * 8;
    }
  }
  const T* xr[NT];
  bool x_ok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + g;
    x_ok[nt] = tok < m;
    xr[nt] = x + static_cast<size_t>(min(tok, m - 1)) * k + k_begin + c * 8;
  }
  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
    }
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int b0 = warp; b0 < blocks; b0 += kWarps * kUnroll) {
    uint4 wv[kUnroll][2][2], xv[kUnroll][NT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int b = b0 + u * kWarps;
      const bool ok = b < blocks;
      const size_t off = static_cast<size_t>(b) * kKBlock;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][mt][h] = ok ? load_stream(wr[mt][h] + off) : zero;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        xv[u][nt] = ok && x_ok[nt] ? __ldg(reinterpret_cast<const uint4*>(xr[nt] + off)) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t a0[4] = {wv[u][mt][0].x, wv[u][mt][1].x, wv[u][mt][0].y, wv[u][mt][1].y};
        const uint32_t a1[4] = {wv[u][mt][0].z, wv[u][mt][1].z, wv[u][mt][0].w, wv[u][mt][1].w};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint32_t b0f[2] = {xv[u][nt].x, xv[u][nt].y};
          const uint32_t b1f[2] = {xv[u][nt].z, xv[u][nt].w};
          detail::ElemTraits<T>::mma(acc[mt][nt], a0, b0f, acc[mt][nt]);
          detail::ElemTraits<T>::mma(acc[mt][nt], a1, b1f, acc[mt][nt]);
        }
      }
    }
  }
  // C fragment: c0 c1 = (row g, tokens 2c, 2c+1), c2 c3 = (row g + 8, same tokens).
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r = mt * 16 + g, t = nt * 8 + 2 * c;
      red[warp][t][r] = acc[mt][nt][0];
      red[warp][t + 1][r] = acc[mt][nt][1];
      red[warp][t][r + 8] = acc[mt][nt][2];
      red[warp][t + 1][r + 8] = acc[mt][nt][3];
    }
  }
  __syncthreads();
  const int outs = m * kRowsPerCta;  // (token, row) pairs, row fastest: y's rows are contiguous in n
  for (int i = threadIdx.x; i < outs; i += kThreads) {
    const int t = i / kRowsPerCta, r = i % kRowsPerCta, col = row0 + r;
    if (col >= n) continue;
    float v = red[0][t][r];
#pragma unroll
    for (int wi = 1; wi < kWarps; ++wi) v += red[wi][t][r];
    if (splits == 1) {
      if (bias != nullptr) v += load_bias(bias, col);
      y[static_cast<size_t>(t) * n + col] = to_out<OutT>(v);
    } else {
      partials[(static_cast<size_t>(split) * m + t) * n + col] = v;
    }
  }
  if (splits == 1) return;
  // The last CTA of this column block to arrive sums the partials in split order (threadFenceReduction pattern).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&counters[blockIdx.x], 1) == splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < outs; i += kThreads) {
    const int t = i / kRowsPerCta, col = row0 + i % kRowsPerCta;
    if (col >= n) continue;
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += __ldcg(&partials[(static_cast<size_t>(s) * m + t) * n + col]);
    if (bias != nullptr) v += load_bias(bias, col);
    y[static_cast<size_t>(t) * n + col] = to_out<OutT>(v);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next call (or graph replay)
}

template <typename T, typename OutT>
cudaError_t launch_typed(const GemmParams& p, int splits, const SmallMGemmWorkspace& ws, cudaStream_t stream) {
  const int kb = p.k / kKBlock;
  const int k_per_split = ((kb + splits - 1) / splits) * kKBlock;
  const dim3 grid((p.n + kRowsPerCta - 1) / kRowsPerCta, splits);
  const auto* x = static_cast<const T*>(p.x);
  const auto* w = static_cast<const T*>(p.w);
  const auto* bias = static_cast<const OutT*>(p.bias);
  auto* y = static_cast<OutT*>(p.y);
  if (p.m <= 8) {
    small_m_gemm_kernel<T, OutT, 1><<<grid, kThreads, 0, stream>>>(x, w, bias, y, ws.partials, ws.counters, p.m, p.n,
                                                                    p.k, k_per_split);
  } else if (p.m <= 16) {
    small_m_gemm_kernel<T, OutT, 2><<<grid, kThreads, 0, stream>>>(x, w, bias, y, ws.partials, ws.counters, p.m, p.n,
                                                                    p.k, k_per_split);
  } else {
    small_m_gemm_kernel<T, OutT, 4><<<grid, kThreads, 0, stream>>>(x, w, bias, y, ws.partials, ws.counters, p.m, p.n,
                                                                    p.k, k_per_split);
  }
  return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

bool small_m_gemm_supports(const GemmParams& p, int splits, const SmallMGemmWorkspace& ws) {
  if (p.in_dtype != DType::BF16 && p.in_dtype != DType::F16) return false;
  if (p.out_dtype != p.in_dtype && p.out_dtype != DType::F32) return false;
  if (p.m < 1 || p.m > kSmallMMaxRows || p.n < 1 || p.k < kKBlock || p.k % kKBlock != 0) return false;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr || !aligned16(p.x) || !aligned16(p.w)) return false;
  if (splits < 1 || splits > p.k / kKBlock) return false;
  if (splits == 1) return true;
  return ws.partials != nullptr && ws.counters != nullptr &&
         static_cast<size_t>(splits) * p.m * p.n <= ws.partial_elems &&
         (p.n + kRowsPerCta - 1) / kRowsPerCta <= ws.num_counters && splits <= 65535;
}

cudaError_t small_m_gemm(const GemmParams& p, int splits, const SmallMGemmWorkspace& ws, cudaStream_t stream) {
  if (!small_m_gemm_supports(p, splits, ws)) {
    return detail::invalid_argument("small_m_gemm", "m=", p.m, " n=", p.n, " k=", p.k, " splits=", splits,
                                    ": not supported (needs bf16/f16 in, out = in or f32, 1 <= m <= ",
                                    kSmallMMaxRows, ", k % 32 == 0, 16-byte aligned x and w, splits <= k / 32, "
                                    "and for splits > 1 splits * m * n floats and ceil(n / 32) counters)");
  }
  if (p.in_dtype == DType::BF16) {
    return p.out_dtype == DType::F32 ? launch_typed<__nv_bfloat16, float>(p, splits, ws, stream)
                                     : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, splits, ws, stream);
  }
  return p.out_dtype == DType::F32 ? launch_typed<__half, float>(p, splits, ws, stream)
                                   : launch_typed<__half, __half>(p, splits, ws, stream);
}

}  // namespace spade::kernels

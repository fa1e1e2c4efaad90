// Device helpers shared by the CUDA kernel translation units of kernels/ (internal; compiled by nvcc only).
//
// Tensor-core fragments follow the PTX ISA "mma.m16n8k16" layouts (lane = threadIdx.x % 32, g = lane / 4,
// c = lane % 4):
//   A (16x16, row):  a0a1 = A[g][2c..2c+1], a2a3 = A[g+8][2c..], a4a5 = A[g][2c+8..], a6a7 = A[g+8][2c+8..]
//   B (16x8, col):   b0b1 = B[2c..2c+1][g], b2b3 = B[2c+8..][g]
//   C (16x8, fp32):  c0c1 = C[g][2c..2c+1], c2c3 = C[g+8][2c..]
// Shared-memory tiles of 16-byte chunks are XOR-swizzled (chunk ^ (row & 7)) so ldmatrix reads are conflict-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/dtype.h"

namespace spade::kernels::detail {

/// Element type traits: bf16 and fp16 share every kernel through these.
template <typename T>
struct ElemTraits;

// One specialization per element type T (T2: its packed pair type): its DType, the float conversions (round to
// nearest) and the tensor-core mma.m16n8k16 with fp32 accumulation on PTX element type PTX ("bf16" / "f16").
#define SPADE_ELEM_TRAITS(T, T2, DTYPE, PACK2, TO_FLOAT, FROM_FLOAT, PTX)                                              \
  template <>                                                                                                          \
  struct ElemTraits<T> {                                                                                               \
    static constexpr DType kDType = DTYPE;                                                                             \
    __device__ static __forceinline__ uint32_t pack2(float lo, float hi) {                                             \
      T2 v = PACK2(lo, hi);                                                                                            \
      return *reinterpret_cast<uint32_t*>(&v);                                                                         \
    }                                                                                                                  \
    __device__ static __forceinline__ float to_float(T x) { return TO_FLOAT(x); }                                      \
    __device__ static __forceinline__ T from_float(float x) { return FROM_FLOAT(x); }                                  \
    __device__ static __forceinline__ void mma(float d[4], const uint32_t a[4], const uint32_t b[2],                   \
                                               const float c[4]) {                                                     \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "          \
                   "{%8,%9}, {%10,%11,%12,%13};\n"                                                                     \
                   : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                    \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),           \
                     "f"(c[2]), "f"(c[3]));                                                                            \
    }                                                                                                                  \
  };

SPADE_ELEM_TRAITS(__nv_bfloat16, __nv_bfloat162, DType::BF16, __floats2bfloat162_rn, __bfloat162float,
                  __float2bfloat16_rn, "bf16")
SPADE_ELEM_TRAITS(__half, __half2, DType::F16, __floats2half2_rn, __half2float, __float2half_rn, "f16")
#undef SPADE_ELEM_TRAITS

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// 16-byte global->shared async copy (L2 only). When !valid the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
/// L2 cache policy for data read exactly once (evict first), for the `cp_async_16_stream` cache hint.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
/// cp_async_16 for streamed data: L2 cache policy `pol` (l2_evict_first_policy) and 128-byte L2 fetches.
__device__ __forceinline__ void cp_async_16_stream(void* smem, const void* gmem, bool valid, uint64_t pol) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes), "l"(pol));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

/// Transposes the 8x8 b16 matrix held by the warp in C-fragment order (thread: row g, columns 2c, 2c+1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

/// 2^x (approximate, flush-to-zero; ex2.approx has ~2 ulp error). exp2_approx(-inf) == 0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max_xor(float v, int first_mask, int last_mask) {
  for (int m = first_mask; m <= last_mask; m <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ float warp_sum_xor(float v, int first_mask, int last_mask) {
  for (int m = first_mask; m <= last_mask; m <<= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

/// Per-warp cp.async pipeline of kStages shared-memory stages over the warp's tiles 0..nj-1 (no CTA barrier):
/// issue(j, stage) starts tile j's copies into `stage` (tile j goes to stage j % kStages), consume(j, stage) runs once
/// they have landed. kStages - 1 tiles stay in flight; one commit group per tile, empty ones past the end.
template <int kStages, typename Issue, typename Consume>
__device__ __forceinline__ void warp_cp_async_pipeline(int nj, Issue&& issue, Consume&& consume) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nj) issue(s, s);
    cp_async_commit();
  }
  for (int j = 0; j < nj; ++j) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    {
      const int jn = j + kStages - 1;
      if (jn < nj) issue(jn, jn % kStages);
      cp_async_commit();
    }
    consume(j, j % kStages);
  }
  cp_async_wait<0>();
}

/// The kPerThread 16-byte chunks that thread t of kThreads copies of a tile of token rows with kChunks chunks per row
/// (chunk c = t + kThreads * i is row c / kChunks, column c % kChunks): calls f(row, col, v, valid) for each, with
/// v = first + row the token of the row and valid = v < end (the cp.async issue loops of the paged-KV kernels).
template <int kChunks, int kPerThread, int kThreads, typename F>
__device__ __forceinline__ void for_each_tile_chunk(int t, int first, int end, F&& f) {
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int c = t + kThreads * i;
    const int row = c / kChunks;
    const int col = c % kChunks;
    const int v = first + row;
    f(row, col, v, v < end);
  }
}

/// Offset in elements of logical 16-byte chunk `chunk` of row `row` in a swizzled tile with `chunks_per_row` chunks.
__device__ __forceinline__ int swz(int row, int chunk, int chunks_per_row) {
  return row * chunks_per_row * 8 + ((chunk ^ (row & 7)) << 3);
}

/// The mma A fragment of k-step `ks` (16 rows x two 16-byte chunks, 2 ks and 2 ks + 1) of a row-major tile in shared
/// memory, by ldmatrix x4: lane l addresses row (l & 7) + 8 ((l >> 3) & 1), chunk 2 ks + (l >> 4).
/// `offset(row, chunk)` is the tile's swizzle, in elements of `tile`.
template <typename T, typename Swizzle>
__device__ __forceinline__ void ldmatrix_tile_a(uint32_t af[4], const T* tile, int lane, int ks, Swizzle offset) {
  const int i = lane >> 3;
  const int row = (lane & 7) + ((i & 1) << 3);
  ldmatrix_x4(af, tile + offset(row, 2 * ks + (i >> 1)));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int log2_int(int x) {
  int r = 0;
  while ((1 << r) < x) ++r;
  return r;
}

/// fp32 image of an element of type T (fp32, bf16, fp16) and the round-to-nearest-even conversion back.
template <typename T>
__device__ __forceinline__ float to_f(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return ElemTraits<T>::to_float(x);
}
template <typename T>
__device__ __forceinline__ T from_f(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return ElemTraits<T>::from_float(x);
}

/// DType of the element type T (fp32, bf16, fp16).
template <typename T>
inline constexpr DType kDTypeOf = ElemTraits<T>::kDType;
template <>
inline constexpr DType kDTypeOf<float> = DType::F32;

/// Element-type dispatch over the types Ts: calls f(T{}) for the T of Ts whose DType is `t` (only those
/// instantiations are compiled) and returns its result, cudaErrorInvalidValue for any other `t`. Host code
/// (templates instantiated by the launchers).
template <typename... Ts, typename F>
cudaError_t dispatch_dtype(DType t, F&& f) {
  cudaError_t e = cudaErrorInvalidValue;
  (void)((kDTypeOf<Ts> == t && ((e = f(Ts{})), true)) || ...);
  return e;
}

/// The activation / KV types of the kernels: bf16 and fp16.
template <typename F>
cudaError_t dispatch_elem(DType t, F&& f) {
  return dispatch_dtype<__nv_bfloat16, __half>(t, std::forward<F>(f));
}

/// fp32, bf16 and fp16 (logits, casts, fills).
template <typename F>
cudaError_t dispatch_float_types(DType t, F&& f) {
  return dispatch_dtype<float, __nv_bfloat16, __half>(t, std::forward<F>(f));
}

}  // namespace spade::kernels::detail

// Dense layer GEMM of the GPU inference rank through cuBLASLt: y[m, n] = x[m, k] · W[n, k]^T (+ bias[n]), the
// PyTorch nn.Linear layout, bf16 / fp16 inputs, fp32 accumulation, output bf16 / fp16 (same as the inputs) or fp32
// (e.g. logits for the sampler). Reference: kernels/linear_ref.h (fp32).
//
// Mapping: cuBLASLt is column-major, so the row-major product is computed as its transpose,
// Y^T[n, m] = W[k, n]^T · X^T[k, m] -- A = W (op T), B = x (op N), D = y with leading dimension n: the "TN" GEMM
// cuBLASLt's tensor-core kernels prefer; no copy or transpose of any operand.
//
// Algorithm choice: cublasLtMatmulAlgoGetHeuristic's first answer for each distinct (m, n, k, dtypes, bias,
// operand alignments) is cached in the GemmRunner, so steady-state calls only launch. The heuristic is told the
// actual pointer alignments (up to 256 bytes), so sliced operands are safe. It is deterministic: a run's numerics do
// not depend on timings. At the decode shapes it is within a few percent of the small-M split-K kernel below, whose
// best split count bench_kernels measures beside it (its "gemm" group), so the runtime keeps cuBLASLt.
//
// Errors: every call returns cudaSuccess, cudaErrorInvalidValue for inconsistent parameters, cudaErrorNotSupported
// when cuBLASLt has no algorithm for the shape, or the mapped cuBLASLt / CUDA error; launch_error_detail()
// (attention.cuh) then reads e.g. "gemm m=7 n=151936 k=4096 bf16->f32: cublasLtMatmul: CUBLAS_STATUS_...".
// Plain C++ header: includable from host code compiled by g++ (needs the CUDA runtime headers only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

#include "common/dtype.h"
#include "kernels/attention.cuh"  // launch_error_detail()

namespace spade::kernels {

struct GemmParams {
  DType in_dtype = DType::BF16;   // BF16 or F16: element type of x and w.
  DType out_dtype = DType::BF16;  // equal to in_dtype, or F32.
  const void* x = nullptr;        // [m, k] in_dtype, row-major, contiguous (row stride k).
  const void* w = nullptr;        // [n, k] in_dtype, row-major, contiguous (row i = weights of output i).
  const void* bias = nullptr;     // optional [n] out_dtype, added to every row (cuBLASLt BIAS epilogue).
  void* y = nullptr;              // [m, n] out_dtype, row-major, contiguous; written completely.
  int m = 0;  // rows of x and y (tokens); 0 is a no-op.
  int n = 0;  // output features (> 0).
  int k = 0;  // input features (> 0).
};

/// Default cuBLASLt workspace: 32 MiB (what cuBLAS recommends for Hopper).
inline constexpr size_t kDefaultGemmWorkspaceBytes = size_t{32} << 20;

/// Largest row count (tokens) the small-M kernel takes: decode batches.
inline constexpr int kSmallMMaxRows = 32;

/// Device scratch of small_m_gemm: split-K partial sums and one arrival counter per 32-row output block.
struct SmallMGemmWorkspace {
  float* partials = nullptr;    // [splits, m, n] fp32 (capacity partial_elems); unused when splits == 1.
  size_t partial_elems = 0;
  int* counters = nullptr;      // [num_counters] int32, all zero between calls (each call leaves them zero).
  int num_counters = 0;         // >= ceil(n / 32) when splits > 1.
};

/// Small-M split-K GEMM for decode, y = x · W^T (+ bias), the GemmParams contract, on the tensor cores
/// (mma.m16n8k16, fp32 accumulation). W streams from memory once: a CTA of 4 warps owns 32 output features
/// (2 m16 tiles of W rows) and one of `splits` equal K ranges; each thread loads 16 bytes of a W row and of an x row
/// per 32-element K block (the mma's K order is permuted the same way on both operands, so no shared-memory staging),
/// the tokens are the mma's n8 columns (ceil(m / 8) tiles). The 4 warps' sums meet in shared memory; with splits > 1
/// each CTA writes its fp32 partial and the last of a column's CTAs to arrive (a counter) adds them in split order,
/// adds the bias and writes y -- the result does not depend on arrival order. Source: the split-K GEMV pattern of
/// decode kernels (e.g. TensorRT-LLM / Marlin-style small-batch GEMMs), without quantization.
/// Supported (small_m_gemm_supports): in_dtype BF16 / F16, out_dtype = in_dtype or F32, 1 <= m <= kSmallMMaxRows,
/// k % 32 == 0, x and w 16-byte aligned, 1 <= splits <= k / 32, and for splits > 1 a workspace of splits * m * n
/// floats and ceil(n / 32) counters. Errors: cudaErrorInvalidValue (detail in launch_error_detail()) when not
/// supported, or the launch's error.
bool small_m_gemm_supports(const GemmParams& p, int splits, const SmallMGemmWorkspace& ws);
cudaError_t small_m_gemm(const GemmParams& p, int splits, const SmallMGemmWorkspace& ws, cudaStream_t stream);

/// cuBLASLt handle + device workspace + per-shape algorithm cache. One per device and stream: calls are
/// asynchronous on the given stream and share the workspace, so two streams must not use one runner concurrently
/// (and it is not thread-safe). Calls are CUDA-graph capturable once a shape's plan exists (the first call of a
/// shape runs the heuristic on the host, which is also legal during capture).
class GemmRunner {
 public:
  GemmRunner();
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  /// Creates the handle on the current device and allocates the workspace (cudaMalloc). Call once before run().
  cudaError_t init(size_t workspace_bytes = kDefaultGemmWorkspaceBytes);

  /// y = x · w^T (+ bias) on `stream`.
  cudaError_t run(const GemmParams& p, cudaStream_t stream);

  /// Start-up pass over every row count m in [1, max_m] of the GEMM `p` describes (p.m is ignored; x and y must
  /// hold max_m rows): plans each shape on the host (the heuristic, cached as run() caches it) and launches it once
  /// on `stream` when its cuBLASLt algorithm (with its dtypes and epilogue) has not run on this runner yet. A
  /// cuBLASLt kernel's first launch sets its function attributes, which synchronises with the copies pending on the
  /// device; in a process whose streams wait on another thread's progress (both ranks in one process, CudaIpcLink)
  /// that first launch must not happen mid-step. `launches` (optional): how many GEMMs ran. Errors as run().
  cudaError_t warm_up_rows(const GemmParams& p, int max_m, cudaStream_t stream, int* launches = nullptr);
  /// cuBLASLt's algorithm for the plan of `p`'s shape, e.g. "cublasLt algo 66 tile 10 splitK 1"; "" when the shape
  /// has no plan yet.
  std::string plan_name(const GemmParams& p) const;
  /// Number of cached shape plans (tests / diagnostics).
  size_t cached_plans() const;
  /// Number of distinct (dtypes, epilogue, algorithm) combinations launched so far (tests / diagnostics).
  size_t launched_algorithms() const;

 private:
  cudaError_t run_impl(const GemmParams& p, cudaStream_t stream, bool launch_only_if_new, bool* fresh);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spade::kernels

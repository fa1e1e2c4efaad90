// CPU dense layer y = x · Wᵀ + b (PyTorch nn.Linear layout), fp32: one SGEMM of the system's BLAS (OpenBLAS, OpenMP
// build: its threads come from the OpenMP pool, and a call made inside an OpenMP parallel region runs on the calling
// thread), then the bias. The reference the CUDA GEMM paths are tested against and the CPU data path's GEMM.
#pragma once

namespace spade::kernels {

/// x: [m, k] fp32; w: [n, k] fp32 (row i = weights of output i); bias: [n] fp32 or nullptr; y: [m, n] fp32, written
/// completely. m, n, k >= 0 (an empty product writes nothing; k == 0 writes the bias).
void linear_ref(const float* x, const float* w, const float* bias, float* y, int m, int n, int k);

/// The BLAS in use, e.g. "OpenBLAS 0.3.21 (Haswell, OpenMP, 2 threads)": for benchmark records.
const char* blas_description();

}  // namespace spade::kernels

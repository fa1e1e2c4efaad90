// CPU reference: dense layer y = x · Wᵀ + b (PyTorch nn.Linear layout), fp32, parallel over output rows when
// OpenMP is available.
#pragma once

namespace spade::kernels {

/// x: [m, k] fp32; w: [n, k] fp32 (row i = weights of output i); bias: [n] fp32 or nullptr; y: [m, n] fp32.
void linear_ref(const float* x, const float* w, const float* bias, float* y, int m, int n, int k);

}  // namespace spade::kernels

// CPU reference: RMSNorm (Zhang & Sennrich 2019), as Hugging Face's LlamaRMSNorm / Qwen3RMSNorm compute it in fp32:
//   y = x * rsqrt(mean(x^2) + eps) * weight
#pragma once

namespace spade::kernels {

/// x: [rows, dim] fp32; weight: [dim] fp32; y: [rows, dim] fp32 (may alias x).
void rmsnorm_ref(const float* x, const float* weight, float* y, int rows, int dim, float eps);

}  // namespace spade::kernels

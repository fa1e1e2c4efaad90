// CPU reference: gated RMSNorm, "norm before gate" — the output norm of Gated DeltaNet layers as transformers'
// Qwen3_5RMSNormGated / Qwen3NextRMSNormGated (and FLA's FusedRMSNormGated) compute it in fp32:
//   y = weight * (x * rsqrt(mean(x^2) + eps)) * silu(z),   silu(z) = z * sigmoid(z)
// Note the plain `weight` (ones-initialised), not the (1 + weight) of Qwen3.5's other RMSNorms.
#pragma once

namespace spade::kernels {

/// x, z: [rows, dim] fp32 (z = the gate, in_proj_z's output); weight: [dim] fp32; y: [rows, dim] fp32 (may alias x
/// or z). Normalises each row of x over `dim` (one GDN value head: dim = head_v_dim).
void gated_rmsnorm_ref(const float* x, const float* z, const float* weight, float* y, int rows, int dim, float eps);

}  // namespace spade::kernels

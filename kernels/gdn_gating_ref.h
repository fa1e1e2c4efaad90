// CPU reference: the gating of a Gated DeltaNet layer (transformers Qwen3_5GatedDeltaNet.forward / Qwen3NextGatedDeltaNet):
// from the in_proj_b and in_proj_a outputs b, a of each token and value head,
//   beta = sigmoid(b)                                   (write strength, in (0, 1))
//   g    = -exp(A_log) * softplus(a + dt_bias)          (log decay, <= 0; softplus(x) = log(1 + e^x))
// in fp32, as transformers computes it (A_log.float(), dt_bias added before softplus).
#pragma once

namespace spade::kernels {

/// b, a: [tokens, num_v_heads] fp32 (the in_proj_b / in_proj_a outputs; row stride `stride` elements, so they may be
/// columns of the fused in_proj output); a_log, dt_bias: [num_v_heads] fp32; beta, g: [tokens, num_v_heads] fp32
/// (contiguous). Throws spade::Error for null pointers or non-positive sizes.
void gdn_gating_ref(const float* b, const float* a, int stride, const float* a_log, const float* dt_bias, float* beta,
                    float* g, int tokens, int num_v_heads);

/// softplus(x) = log(1 + e^x), computed as torch does (x for x > 20).
float softplus_ref(float x);
/// sigmoid(x) = 1 / (1 + e^-x).
float sigmoid_ref(float x);

}  // namespace spade::kernels

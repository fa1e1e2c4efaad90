// CPU reference: rotary position embedding, rotate_half convention (GPT-NeoX / Hugging Face Llama, Qwen).
//   inv_freq[i] = theta^(-2i/rot_dim), i < rot_dim/2;  angle = pos * inv_freq[i]
//   out[i]          = x[i] cos - x[i + rot_dim/2] sin
//   out[i+rot_dim/2] = x[i + rot_dim/2] cos + x[i] sin
// Dimensions >= rot_dim (partial RoPE) pass through unchanged.
#pragma once

#include <cstdint>

namespace spade::kernels {

/// x: [tokens, num_heads, head_dim] fp32, rotated in place; positions: [tokens] int32 absolute positions.
/// rot_dim: number of leading dims rotated (== head_dim for full RoPE), even.
void rope_ref(float* x, const int32_t* positions, int tokens, int num_heads, int head_dim, int rot_dim, double theta);

}  // namespace spade::kernels

// CPU reference: the sigmoid output gate of Qwen3.5's full-attention layers (transformers Qwen3_5Attention.forward:
// attn_output = attn_output * torch.sigmoid(gate), where q_proj emits [q_h | gate_h] per head and the gate is laid out
// like the attention output [tokens, num_q_heads * head_dim]).
#pragma once

namespace spade::kernels {

/// out: [tokens, dim] fp32 in place (row stride dim); gate: [tokens, dim] with row stride `gate_stride` elements.
/// out[t][i] *= sigmoid(gate[t][i]). Throws spade::Error for null pointers or sizes out of range.
void output_gate_ref(float* out, const float* gate, int gate_stride, int tokens, int dim);

}  // namespace spade::kernels

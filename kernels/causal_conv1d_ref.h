// CPU reference: causal depthwise conv1d with a carried state, over a ragged batch of sequences — the short
// convolution of Gated DeltaNet / Mamba layers as transformers' Qwen3.5 / Qwen3-Next compute it
// (causal_conv1d_fn for a prefill, causal_conv1d_update for decode; models/qwen3_5/modeling_qwen3_5.py).
//
// Per sequence b with tokens t = 0..n-1 (n = cu_tokens[b+1] - cu_tokens[b]) and its state s = the last K-1 inputs
// before this step (oldest first, zero for a fresh sequence), the extended input is xx = [s_0 .. s_{K-2}, x_0 .. x_{n-1}]
// and for every channel c
//     out[t, c] = act( bias[c] + sum_{j=0}^{K-1} weight[c, j] * xx[t + j, c] )
// (PyTorch Conv1d cross-correlation with padding K-1, truncated to the first n outputs; weight[c, K-1] multiplies
// the current token). Afterwards the state holds the last K-1 entries of xx, so splitting a sequence into chunks
// gives the same outputs as one pass. act = SiLU (x * sigmoid(x)) or identity.
#pragma once

#include <cstdint>

namespace spade::kernels {

struct CausalConv1dParams {
  const float* x = nullptr;        // x: [total_tokens, channels] fp32 (row t = token t of the ragged batch)
  const float* weight = nullptr;   // weight: [channels, kernel] fp32 (nn.Conv1d weight [channels, 1, kernel] squeezed)
  const float* bias = nullptr;     // bias: [channels] fp32 or nullptr
  float* out = nullptr;            // out: [total_tokens, channels] fp32, written completely; must not alias x
  float* state_pool = nullptr;     // state_pool: [num_state_slots, channels, kernel - 1] fp32, oldest input first
  int num_state_slots = 0;
  const int32_t* state_slots = nullptr;  // state_slots: [batch] int32 slot of sequence b (distinct), read + written
  const int32_t* cu_tokens = nullptr;    // cu_tokens: [batch + 1] int32 non-decreasing, cu_tokens[0] = 0
  int batch = 0;
  int channels = 0;                // >= 1
  int kernel = 0;                  // K >= 1 (K = 1 keeps no state)
  bool silu = true;                // apply SiLU to the output (Qwen3.5: activation = hidden_act = silu)
};

/// Runs the convolution and updates each sequence's state in place. Throws spade::Error naming the field for null
/// pointers, non-positive sizes, a cu_tokens that does not start at 0 or decreases, slots outside the pool or a slot
/// used by two sequences.
void causal_conv1d_ref(const CausalConv1dParams& p);

}  // namespace spade::kernels

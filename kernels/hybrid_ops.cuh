// CUDA layer ops of the hybrid Qwen3.5 / Qwen3-Next decoder on the GPU inference rank, around the Gated
// DeltaNet kernels of gdn.cuh: the short causal conv1d with its per-sequence state, the GDN gating (beta, g), the
// gated RMSNorm of the GDN output, the sigmoid output gate of the full-attention layers, and the reset of a fresh
// sequence's states. The layer they serve: transformers models/qwen3_5/modeling_qwen3_5.py (Qwen3_5GatedDeltaNet,
// Qwen3_5Attention); the CPU path: inference_rank/model.cpp.
//
// Each op computes what its CPU reference computes (kernels/causal_conv1d_ref.h, gdn_gating_ref.h,
// gated_rmsnorm_ref.h, output_gate_ref.h; the reset is GdnStatePool::reset), in fp32 with one rounding to the
// element type at each 16-bit output; states are fp32. Conventions as layer_ops.cuh: plain params struct +
// cudaStream_t, asynchronous, cudaSuccess / cudaErrorInvalidValue (launch_error_detail() of attention.cuh names the
// field) / the launch's CUDA error; zero tokens or sequences is a no-op; device pointers; `dtype` BF16 or F16.
// Device-side slots are the caller's contract; a slot outside [0, num_state_slots) (e.g. -1 for the padding rows of
// a CUDA-graph bucket) is never read or written: its sequence's outputs use a zero state. Plain C++ header: includable from host code compiled by g++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.cuh"  // launch_error_detail()

namespace spade::kernels {

/// Widest conv kernel causal_conv1d supports (Qwen3.5 / Qwen3-Next use 4).
inline constexpr int kMaxConvKernel = 8;

/// Causal depthwise conv1d over a ragged batch with a carried state (causal_conv1d_ref's math), then SiLU. Runs as
/// two launches: the outputs of every (token, channel) from the old states, then each sequence's new state (the last
/// K-1 inputs of state ++ its tokens).
struct CausalConv1dGpuParams {
  DType dtype = DType::BF16;             // BF16 or F16: x and the outputs.
  const void* x = nullptr;               // [total_tokens, x_stride] dtype; channel c at column c.
  int x_stride = 0;                      // elements between token rows, >= channels.
  const float* weight = nullptr;         // [channels, kernel] fp32 (weight[c][kernel-1] multiplies the current token).
  const float* bias = nullptr;           // optional [channels] fp32.
  // The output split by channel ranges, each a contiguous [total_tokens, width] dtype tensor: channels
  // [0, split[0]) -> out[0], [split[0], split[1]) -> out[1], [split[1], channels) -> out[2] (Qwen3.5: q | k | v,
  // the GDN kernels' inputs). 0 < split[0] <= split[1] <= channels; an empty range's pointer may be null.
  void* out[3] = {nullptr, nullptr, nullptr};
  int split[2] = {0, 0};
  float* state_pool = nullptr;           // [num_state_slots, channels, kernel - 1] fp32, oldest input first.
  int num_state_slots = 0;
  const int32_t* state_slots = nullptr;  // [batch] int32 slot of sequence b (distinct).
  const int32_t* cu_tokens = nullptr;    // [batch + 1] int32 prefix sums of tokens, cu_tokens[0] = 0.
  const int32_t* seq_idx = nullptr;      // [total_tokens] int32 sequence of each token (consistent with cu_tokens).
  int total_tokens = 0;
  int batch = 0;
  int channels = 0;
  int kernel = 0;                        // 1..kMaxConvKernel (1 keeps no state).
  bool silu = true;
};

cudaError_t causal_conv1d(const CausalConv1dGpuParams& p, cudaStream_t stream);

/// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) per (token, value head), in fp32 (gdn_gating_ref).
struct GdnGatingParams {
  DType dtype = DType::BF16;     // BF16 or F16: b and a (columns of the fused in_proj output).
  const void* b = nullptr;       // [tokens, stride] dtype: head h at column h.
  const void* a = nullptr;       // [tokens, stride] dtype.
  int stride = 0;                // elements between token rows, >= num_v_heads.
  const float* a_log = nullptr;  // [num_v_heads] fp32.
  const float* dt_bias = nullptr;  // [num_v_heads] fp32.
  float* beta = nullptr;         // [tokens, num_v_heads] fp32.
  float* g = nullptr;            // [tokens, num_v_heads] fp32.
  int tokens = 0;
  int num_v_heads = 0;
};

cudaError_t gdn_gating(const GdnGatingParams& p, cudaStream_t stream);

/// y = weight * rmsnorm(x) * silu(z) per (token, head) row of `dim` (gated_rmsnorm_ref; plain weight), one warp per
/// row.
struct GatedRmsNormParams {
  DType dtype = DType::BF16;     // BF16 or F16: x, z, y.
  const void* x = nullptr;       // [tokens, heads, dim] dtype, contiguous (the GDN output).
  const void* z = nullptr;       // [tokens, z_stride] dtype: head h's gate at columns h * dim .. (in_proj_z output).
  int z_stride = 0;              // >= heads * dim.
  const float* weight = nullptr; // [dim] fp32.
  void* y = nullptr;             // [tokens, heads, dim] dtype, contiguous (out_proj's input); may alias x.
  int tokens = 0;
  int heads = 0;
  int dim = 0;                   // 1..1024.
  float eps = 1e-6f;
};

cudaError_t gated_rmsnorm(const GatedRmsNormParams& p, cudaStream_t stream);

/// out[t][i] *= sigmoid(gate[t][i]) (output_gate_ref): Qwen3.5's full-attention output gate.
struct OutputGateParams {
  DType dtype = DType::BF16;  // BF16 or F16: out and gate.
  void* out = nullptr;        // [tokens, dim] dtype, contiguous, in place.
  const void* gate = nullptr; // [tokens, gate_stride] dtype (the gate columns of the fused q/k/v/gate projection).
  int gate_stride = 0;        // >= dim.
  int tokens = 0;
  int dim = 0;                // a multiple of 2.
};

cudaError_t output_gate(const OutputGateParams& p, cudaStream_t stream);

/// Zeroes the conv and recurrent states of every sequence that starts in this step (its context length equals its
/// query tokens: seq_lens[b] == cu_tokens[b+1] - cu_tokens[b]), in every GDN layer (GdnStatePool::reset). Run once
/// at the start of a step, so a reused slot never carries its previous owner's state.
struct GdnResetStatesParams {
  float* conv_pool = nullptr;            // [layers, num_state_slots, conv_elems] fp32.
  size_t conv_elems = 0;                 // channels * (kernel - 1) per (layer, slot); 0: no conv state.
  float* recurrent_pool = nullptr;       // [layers, num_state_slots, recurrent_elems] fp32.
  size_t recurrent_elems = 0;            // num_v_heads * head_k_dim * head_v_dim per (layer, slot).
  int layers = 0;
  int num_state_slots = 0;
  const int32_t* state_slots = nullptr;  // [batch] int32.
  const int32_t* cu_tokens = nullptr;    // [batch + 1] int32.
  const int32_t* seq_lens = nullptr;     // [batch] int32 context length after this step.
  int batch = 0;
};

cudaError_t gdn_reset_states(const GdnResetStatesParams& p, cudaStream_t stream);

}  // namespace spade::kernels

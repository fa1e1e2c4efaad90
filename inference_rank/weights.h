// Model weights in fp32 on the host, loaded from a Hugging Face checkpoint or generated deterministically.
//
// Tensor names follow Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM:
//   model.embed_tokens.weight [vocab, hidden], model.norm.weight [hidden], lm_head.weight [vocab, hidden] (absent
//   when tie_word_embeddings), and per layer i under model.layers.{i}.:
//   input_layernorm.weight [hidden], self_attn.{q,k,v}_proj.weight [{q,kv,kv}_dim, hidden] (+ .bias for qwen2 or
//   attention_bias), self_attn.o_proj.weight [hidden, q_dim], self_attn.{q,k}_norm.weight [head_dim] (qwen3),
//   post_attention_layernorm.weight [hidden], mlp.{gate,up}_proj.weight [intermediate, hidden],
//   mlp.down_proj.weight [hidden, intermediate].
//
// Qwen3.5 (Qwen3_5ForCausalLM, transformers models/qwen3_5/modeling_qwen3_5.py; prefix cfg.weight_prefix =
// "model." or "model.language_model." for the multimodal Qwen3_5ForConditionalGeneration):
//   full_attention layers: self_attn.q_proj.weight [2 * q_dim, hidden] holds per head h the rows
//     [q_h (head_dim) | gate_h (head_dim)] (the output gate); k_proj/v_proj/o_proj as above, q_norm/k_norm [head_dim].
//   linear_attention layers (Qwen3_5GatedDeltaNet) under linear_attn.:
//     in_proj_qkv.weight [conv_dim, hidden] (rows q: key_dim, k: key_dim, v: value_dim), in_proj_z.weight
//     [value_dim, hidden], in_proj_b.weight / in_proj_a.weight [Hv, hidden], conv1d.weight [conv_dim, 1, K],
//     A_log [Hv], dt_bias [Hv], norm.weight [d_v] (gated RMSNorm), out_proj.weight [hidden, value_dim].
//   Every RMSNorm weight except linear_attn.norm is stored zero-centred (the norm multiplies by 1 + w); the loader
//   stores 1 + w (fp32), so the forward pass uses the plain x * w' RMSNorm (kernels/rmsnorm_ref.h), bit-identical to
//   transformers' x_normed * (1 + w).
// Tensors a checkpoint holds beyond these (Qwen3.5's vision tower "model.visual.*", MTP heads "mtp.*") are not read.
#pragma once

#include <chrono>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/config.h"

namespace spade {

class Checkpoint;

struct LayerWeights {
  LayerType type = LayerType::FullAttention;
  std::vector<float> attn_norm;  // [hidden] (input_layernorm; 1 + w when cfg.norm_unit_offset)
  // ---- full_attention layers ----
  std::vector<float> qkv_w;      // [q_dim + 2 * kv_dim (+ q_dim), hidden]: q rows, k rows, v rows (then the output
                                 // gate rows, head-major like q, when cfg.attn_output_gate)
  std::vector<float> qkv_b;      // [rows of qkv_w] or empty
  std::vector<float> q_norm;     // [head_dim] (qwen3) or empty
  std::vector<float> k_norm;     // [head_dim] (qwen3) or empty
  std::vector<float> o_w;        // [hidden, q_dim]
  std::vector<float> o_b;        // [hidden] or empty
  // ---- linear_attention (Gated DeltaNet) layers ----
  std::vector<float> in_proj_w;  // [conv_dim + value_dim + 2 * Hv, hidden]: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  std::vector<float> conv1d_w;   // [conv_dim, K] depthwise causal conv weights
  std::vector<float> A_log;      // [Hv] log of the decay rate A (g = -exp(A_log) * softplus(a + dt_bias))
  std::vector<float> dt_bias;    // [Hv]
  std::vector<float> gated_norm; // [d_v] gated RMSNorm weight (plain w)
  std::vector<float> out_proj_w; // [hidden, value_dim]
  // ---- MLP ----
  std::vector<float> mlp_norm;   // [hidden] (post_attention_layernorm; 1 + w when cfg.norm_unit_offset)
  std::vector<float> gate_up_w;  // [2 * intermediate, hidden]: gate rows, then up rows
  std::vector<float> gate_up_b;  // [2 * intermediate] or empty
  std::vector<float> down_w;     // [hidden, intermediate]
  std::vector<float> down_b;     // [hidden] or empty
};

struct ModelWeights {
  std::vector<float> embed;       // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden] (1 + w when cfg.norm_unit_offset)
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tied (embed is used)
};

/// Returns a tensor by name with the given expected shape as fp32. Throws spade::Error naming the tensor.
using TensorSource = std::function<std::vector<float>(const std::string& name, const std::vector<int64_t>& shape)>;

/// Every tensor name and shape a checkpoint of `cfg` must hold, in a fixed order.
std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const ModelConfig& cfg);

/// Loads all weights of `cfg` through `src` (shapes checked), fusing q/k/v(/gate), gate/up and the GDN input
/// projections, and folding zero-centred norm weights into 1 + w. Throws spade::Error naming the tensor (from `src`)
/// or, for a malformed cfg, the field (layer_types size, non-positive GDN sizes); before allocating, when the fp32
/// weights of `cfg` would exceed this host's physical memory (naming hidden_size, intermediate_size,
/// num_hidden_layers, vocab_size); and, instead of a bare std::bad_alloc, naming the tensor that ran out of memory.
ModelWeights load_weights(const ModelConfig& cfg, const TensorSource& src);

/// Checks a checkpoint against `cfg` before anything is allocated for its weights. `cfg_src` names the config in
/// messages ("<dir>/config.json"). Throws spade::Error naming the config field whose value the tensors contradict:
/// vocab_size / hidden_size (embed_tokens), num_hidden_layers (more layers than the checkpoint holds: names the first
/// missing tensor, so 2^31-1 layers costs one lookup per real layer), num_attention_heads x head_dim (q_proj rows, x 2
/// with an output gate), num_key_value_heads x head_dim (k_proj), head_dim (q_norm), intermediate_size (gate_proj),
/// the linear_* fields (in_proj_qkv, A_log, norm, conv1d); then naming any tensor of expected_tensors(cfg) that is
/// missing or has another shape. Extra layers in the checkpoint are logged and not used.
void check_checkpoint(const ModelConfig& cfg, const Checkpoint& ckpt, const std::string& cfg_src);

/// Loads a checkpoint's weights safely: check_checkpoint, then refuses non-finite weights (Checkpoint::check_finite
/// over every tensor the model reads, raw bits, in parallel; throws naming the tensor and its NaN / Inf counts; logs
/// how long the scan took), then load_weights(cfg, checkpoint_source(ckpt)).
ModelWeights load_checkpoint_weights(const ModelConfig& cfg, const Checkpoint& ckpt, const std::string& cfg_src);

/// A TensorSource reading a Checkpoint (fp32/fp16/bf16 converted to fp32).
TensorSource checkpoint_source(const Checkpoint& ckpt);

/// Loading progress of a checkpoint: bytes read of the total, the rate and the time left. On a terminal (stderr a
/// tty) one line redrawn in place at most 5 times a second; otherwise an info log line every 10 s. finish() clears
/// the line and logs the total (bytes, seconds, MiB/s). Not thread-safe: one loader calls add().
class LoadProgress {
 public:
  using Clock = std::chrono::steady_clock;
  /// `what`: named in every line (e.g. the checkpoint directory); total_bytes: bytes that add() will count.
  LoadProgress(std::string what, size_t total_bytes, bool terminal);
  /// `bytes` more were loaded.
  void add(size_t bytes);
  void finish();
  /// "DIR: loading 1.20 / 16.38 GiB (7%), 850 MiB/s, ETA 18 s".
  std::string status(Clock::time_point now) const;

 private:
  std::string what_;
  size_t total_ = 0, done_ = 0;
  bool terminal_ = false, drew_ = false;
  Clock::time_point start_, last_;
};

/// A deterministic random TensorSource: each tensor is a pure function of (seed, name, shape).
/// Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + 0.1 N(0, 1), biases ~ 0.1 N(0, 1)
/// (the tiny-random fixtures' recipe), so activations stay O(1) at any size. GDN tensors: conv1d.weight
/// ~ N(0, 1/K), dt_bias ~ 1 + 0.1 N(0, 1), A_log ~ log U(0.01, 16) (transformers' init).
TensorSource random_source(uint64_t seed);

}  // namespace spade

// Model and generation configuration read from a Hugging Face checkpoint directory.
//
// Supported `model_type`s (decoder-only, dense MLP):
//   llama  — RMSNorm, RoPE (rotate_half), GQA, SwiGLU; optional attention_bias / mlp_bias.
//   qwen2  — llama + q/k/v projection bias (attention_bias is implied true).
//   qwen3  — llama + per-head RMSNorm on q and k before RoPE (q_norm / k_norm), no bias by default.
//   qwen3_5_text — hybrid Qwen3.5 text model (transformers Qwen3_5TextConfig / Qwen3_5ForCausalLM): `layer_types`
//            mixes "linear_attention" (Gated DeltaNet: causal conv1d over q|k|v, l2-normalised q/k, gated delta
//            rule, gated RMSNorm output) and "full_attention" (q/k RMSNorm, partial RoPE, sigmoid output gate from
//            q_proj). Every RMSNorm except the GDN output norm computes x * (1 + w) ("zero-centred" weights).
//   qwen3_5 — the multimodal Qwen3.5 wrapper (Qwen3_5Config): its `text_config` is read as qwen3_5_text and the
//            text tensors are under model.language_model.*; the vision tower is not loaded (text-only serving).
// Rejected with an error naming the field: MoE variants (qwen3_5_moe_text / qwen3_5_moe, qwen3_next, or any
// num_experts > 0), any other model_type, RoPE scaling other than none/"default", hidden_act other than silu.
// Source of the hybrid fields and defaults: transformers 5.17 models/qwen3_5/configuration_qwen3_5.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spade {

enum class ModelArch { Llama, Qwen2, Qwen3, Qwen3_5 };

/// Token mixer of one decoder layer (transformers `layer_types`; the legacy spellings "attention" and "mamba" are
/// accepted as transformers' remap_legacy_layer_types does).
enum class LayerType {
  FullAttention,    // "full_attention": softmax attention over the paged KV cache
  LinearAttention,  // "linear_attention": Gated DeltaNet with a per-sequence conv state and recurrent (SSM) state
};
const char* layer_type_name(LayerType t);  // "full_attention" / "linear_attention"

struct ModelConfig {
  std::string model_type;        // as in config.json
  ModelArch arch = ModelArch::Llama;
  int hidden_size = 0;           // d_model
  int intermediate_size = 0;     // SwiGLU inner width
  int num_layers = 0;            // num_hidden_layers
  int num_q_heads = 0;           // num_attention_heads
  int num_kv_heads = 0;          // num_key_value_heads (defaults to num_attention_heads)
  int head_dim = 0;              // defaults to hidden_size / num_attention_heads
  int vocab_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;   // rope_theta or rope_parameters.rope_theta
  bool tie_word_embeddings = false;
  bool attention_bias = false;   // q/k/v (and o for llama's attention_bias) bias
  bool o_proj_bias = false;      // llama attention_bias also biases o_proj; qwen2 does not
  bool mlp_bias = false;
  bool qk_norm = false;          // qwen3
  std::vector<int> eos_token_ids;  // from config.json eos_token_id (int or list)
  int bos_token_id = -1;
  std::string torch_dtype;       // "float32", "bfloat16", ... (informational)

  // ---- RoPE extent and Qwen3.5 attention/norm conventions ----
  int rotary_dim = 0;            // leading dims of each q/k head that RoPE rotates: int(head_dim *
                                 // partial_rotary_factor) (transformers' default rope init); 0 = head_dim
  bool attn_output_gate = false; // q_proj emits [q | gate] per head; attention output *= sigmoid(gate) (qwen3_5)
  bool norm_unit_offset = false; // RMSNorm multiplies by (1 + w) instead of w (Qwen3_5RMSNorm; not the GDN's norm)
  std::string weight_prefix = "model.";  // tensor name prefix of the decoder ("model.language_model." for qwen3_5)

  // ---- Hybrid linear-attention models (qwen3_5_text): empty / 0 for dense models ----
  std::vector<LayerType> layer_types;  // [num_layers]; empty means every layer is FullAttention
  int linear_conv_kernel_dim = 0;      // K: causal depthwise conv1d kernel width over the concatenated q|k|v
  int linear_num_key_heads = 0;        // GDN query/key heads
  int linear_num_value_heads = 0;      // GDN value heads (= state heads), a multiple of linear_num_key_heads
  int linear_key_head_dim = 0;         // d_k
  int linear_value_head_dim = 0;       // d_v

  int gqa_group() const { return num_q_heads / num_kv_heads; }
  int q_dim() const { return num_q_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  /// Dims RoPE rotates per head (rotary_dim, or head_dim when 0).
  int rope_dim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }

  /// Whether any layer is a linear-attention (GDN) layer.
  bool is_hybrid() const;
  LayerType layer_type(int layer) const {
    return layer_types.empty() ? LayerType::FullAttention : layer_types[static_cast<size_t>(layer)];
  }
  /// Full-attention layers (the ones with KV cache pages).
  int num_attention_layers() const;
  /// Linear-attention (GDN) layers (the ones with a recurrent state).
  int num_linear_layers() const;
  /// GDN widths: key_dim = Hk * d_k, value_dim = Hv * d_v, conv_dim = 2 * key_dim + value_dim (the conv1d channels).
  int linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
  /// The model as its attention backend sees it: the same head geometry with num_layers = num_attention_layers()
  /// and no layer_types. Attention backends, the KV cache and the cache rank index layers 0..num_attention_layers()-1
  /// (the i-th full-attention layer). Equal to *this for dense models.
  ModelConfig attention_view() const;
};

/// Most decoder layers a config may declare. Only a sanity bound for what the parser itself allocates per layer
/// (layer_types) and for ranks that size per-layer tables from the config alone (the cache rank); the real bound is the
/// checkpoint: loading weights refuses a config with more layers than its tensors hold (inference_rank/weights.h).
inline constexpr int kMaxHiddenLayers = 1 << 16;

/// Most positions max_position_embeddings may declare (2^30), so that positions and page counts derived from it stay
/// far from int overflow.
inline constexpr int kMaxPositionEmbeddings = 1 << 30;

/// Parses `<dir>/config.json` (a regular file, common/file_read.h; a FIFO or directory in its place is refused without
/// blocking). Throws spade::Error naming the file and the field: missing required field
/// ("…/config.json: required field 'hidden_size' is missing"), wrong type, a number out of range (1e999, an integer
/// past 2^31-1), unknown model_type, non-positive sizes, num_hidden_layers above kMaxHiddenLayers,
/// max_position_embeddings <= 0 or above kMaxPositionEmbeddings, rms_norm_eps or rope_theta (top level or
/// rope_parameters.rope_theta) not finite and > 0, num_attention_heads not a multiple of num_key_value_heads, odd
/// head_dim, projection widths (heads * head_dim, 2 * intermediate_size) past 2^31-1, a token id (eos_token_id,
/// bos_token_id) outside 0 .. 2^31-1, unsupported rope_scaling/hidden_act. Hybrid models additionally: a missing
/// linear_* field, layer_types not a list of num_hidden_layers strings, an unknown layer type, linear_num_value_heads
/// not a multiple of linear_num_key_heads, a partial_rotary_factor giving an odd or zero rotary dim, MoE fields
/// (num_experts > 0). Whether the sizes match the checkpoint's tensors is checked when the weights load.
ModelConfig load_model_config(const std::string& dir);

/// Parses a config.json text (for tests and --random-weights); `source` names it in errors.
ModelConfig parse_model_config(const std::string& json_text, const std::string& source);

/// Defaults from `<dir>/generation_config.json` (optional file).
struct GenerationConfig {
  std::vector<int> eos_token_ids;  // union of generation_config and config eos ids
  int bos_token_id = -1;
  bool do_sample = false;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int top_k = 0;
};

/// Reads generation_config.json when present (a regular file, as config.json) and merges the eos ids of `model` into
/// it. Throws spade::Error naming the file and the field for a malformed value: temperature not finite and >= 0, top_p
/// outside [0, 1], top_k < 0, a token id outside 0 .. 2^31-1.
GenerationConfig load_generation_config(const std::string& dir, const ModelConfig& model);

}  // namespace spade

// Model and generation configuration read from a Hugging Face checkpoint directory.
//
// Supported `model_type`s (decoder-only, dense, full attention):
//   llama  — RMSNorm, RoPE (rotate_half), GQA, SwiGLU; optional attention_bias / mlp_bias.
//   qwen2  — llama + q/k/v projection bias (attention_bias is implied true).
//   qwen3  — llama + per-head RMSNorm on q and k before RoPE (q_norm / k_norm), no bias by default.
// Anything else (including hybrid qwen3_5 / qwen3_next) is rejected with an error naming model_type.
// RoPE scaling other than none/"default" is rejected (the field is named in the error).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spade {

enum class ModelArch { Llama, Qwen2, Qwen3 };

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

  int gqa_group() const { return num_q_heads / num_kv_heads; }
  int q_dim() const { return num_q_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
};

/// Parses `<dir>/config.json`. Throws spade::Error naming the file and the field: missing required field
/// ("…/config.json: required field 'hidden_size' is missing"), wrong type, unknown model_type, inconsistent shapes
/// (num_attention_heads not a multiple of num_key_value_heads, non-positive sizes), unsupported rope_scaling/hidden_act.
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

/// Reads generation_config.json when present and merges the eos ids of `model` into it.
GenerationConfig load_generation_config(const std::string& dir, const ModelConfig& model);

}  // namespace spade

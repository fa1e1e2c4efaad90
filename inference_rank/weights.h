// Model weights in fp32 on the host, loaded from a Hugging Face checkpoint or generated deterministically.
//
// Tensor names follow Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM:
//   model.embed_tokens.weight [vocab, hidden], model.norm.weight [hidden], lm_head.weight [vocab, hidden] (absent
//   when tie_word_embeddings), and per layer i under model.layers.{i}.:
//   input_layernorm.weight [hidden], self_attn.{q,k,v}_proj.weight [{q,kv,kv}_dim, hidden] (+ .bias for qwen2 or
//   attention_bias), self_attn.o_proj.weight [hidden, q_dim], self_attn.{q,k}_norm.weight [head_dim] (qwen3),
//   post_attention_layernorm.weight [hidden], mlp.{gate,up}_proj.weight [intermediate, hidden],
//   mlp.down_proj.weight [hidden, intermediate].
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/config.h"

namespace spade {

class Checkpoint;

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> qkv_w;      // [q_dim + 2 * kv_dim, hidden]: q rows, then k rows, then v rows
  std::vector<float> qkv_b;      // [q_dim + 2 * kv_dim] or empty
  std::vector<float> q_norm;     // [head_dim] (qwen3) or empty
  std::vector<float> k_norm;     // [head_dim] (qwen3) or empty
  std::vector<float> o_w;        // [hidden, q_dim]
  std::vector<float> o_b;        // [hidden] or empty
  std::vector<float> mlp_norm;   // [hidden]
  std::vector<float> gate_up_w;  // [2 * intermediate, hidden]: gate rows, then up rows
  std::vector<float> gate_up_b;  // [2 * intermediate] or empty
  std::vector<float> down_w;     // [hidden, intermediate]
  std::vector<float> down_b;     // [hidden] or empty
};

struct ModelWeights {
  std::vector<float> embed;       // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tied (embed is used)
};

/// Returns a tensor by name with the given expected shape as fp32. Throws spade::Error naming the tensor.
using TensorSource = std::function<std::vector<float>(const std::string& name, const std::vector<int64_t>& shape)>;

/// Every tensor name and shape a checkpoint of `cfg` must hold, in a fixed order.
std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const ModelConfig& cfg);

/// Loads all weights of `cfg` through `src` (shapes checked), fusing q/k/v and gate/up.
ModelWeights load_weights(const ModelConfig& cfg, const TensorSource& src);

/// A TensorSource reading a Checkpoint (fp32/fp16/bf16 converted to fp32).
TensorSource checkpoint_source(const Checkpoint& ckpt);

/// A deterministic random TensorSource: each tensor is a pure function of (seed, name, shape).
/// Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + 0.1 N(0, 1), biases ~ 0.1 N(0, 1)
/// (the tiny-random fixtures' recipe), so activations stay O(1) at any size.
TensorSource random_source(uint64_t seed);

}  // namespace spade

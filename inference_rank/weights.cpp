#include "inference_rank/weights.h"

#include <cmath>

#include "common/error.h"
#include "common/safetensors.h"

namespace spade {
namespace {

void append(std::vector<float>& dst, const std::vector<float>& src) { dst.insert(dst.end(), src.begin(), src.end()); }

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const ModelConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, H}});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t.push_back({p + "input_layernorm.weight", {H}});
    t.push_back({p + "self_attn.q_proj.weight", {Q, H}});
    t.push_back({p + "self_attn.k_proj.weight", {KV, H}});
    t.push_back({p + "self_attn.v_proj.weight", {KV, H}});
    if (c.attention_bias) {
      t.push_back({p + "self_attn.q_proj.bias", {Q}});
      t.push_back({p + "self_attn.k_proj.bias", {KV}});
      t.push_back({p + "self_attn.v_proj.bias", {KV}});
    }
    if (c.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    t.push_back({p + "self_attn.o_proj.weight", {H, Q}});
    if (c.o_proj_bias) t.push_back({p + "self_attn.o_proj.bias", {H}});
    t.push_back({p + "post_attention_layernorm.weight", {H}});
    t.push_back({p + "mlp.gate_proj.weight", {I, H}});
    t.push_back({p + "mlp.up_proj.weight", {I, H}});
    t.push_back({p + "mlp.down_proj.weight", {H, I}});
    if (c.mlp_bias) {
      t.push_back({p + "mlp.gate_proj.bias", {I}});
      t.push_back({p + "mlp.up_proj.bias", {I}});
      t.push_back({p + "mlp.down_proj.bias", {H}});
    }
  }
  t.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, H}});
  return t;
}

ModelWeights load_weights(const ModelConfig& c, const TensorSource& src) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  ModelWeights w;
  w.embed = src("model.embed_tokens.weight", {c.vocab_size, H});
  w.layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& L = w.layers[i];
    L.attn_norm = src(p + "input_layernorm.weight", {H});
    L.qkv_w = src(p + "self_attn.q_proj.weight", {Q, H});
    append(L.qkv_w, src(p + "self_attn.k_proj.weight", {KV, H}));
    append(L.qkv_w, src(p + "self_attn.v_proj.weight", {KV, H}));
    if (c.attention_bias) {
      L.qkv_b = src(p + "self_attn.q_proj.bias", {Q});
      append(L.qkv_b, src(p + "self_attn.k_proj.bias", {KV}));
      append(L.qkv_b, src(p + "self_attn.v_proj.bias", {KV}));
    }
    if (c.qk_norm) {
      L.q_norm = src(p + "self_attn.q_norm.weight", {c.head_dim});
      L.k_norm = src(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    L.o_w = src(p + "self_attn.o_proj.weight", {H, Q});
    if (c.o_proj_bias) L.o_b = src(p + "self_attn.o_proj.bias", {H});
    L.mlp_norm = src(p + "post_attention_layernorm.weight", {H});
    L.gate_up_w = src(p + "mlp.gate_proj.weight", {I, H});
    append(L.gate_up_w, src(p + "mlp.up_proj.weight", {I, H}));
    L.down_w = src(p + "mlp.down_proj.weight", {H, I});
    if (c.mlp_bias) {
      L.gate_up_b = src(p + "mlp.gate_proj.bias", {I});
      append(L.gate_up_b, src(p + "mlp.up_proj.bias", {I}));
      L.down_b = src(p + "mlp.down_proj.bias", {H});
    }
  }
  w.final_norm = src("model.norm.weight", {H});
  if (!c.tie_word_embeddings) w.lm_head = src("lm_head.weight", {c.vocab_size, H});
  return w;
}

TensorSource checkpoint_source(const Checkpoint& ckpt) {
  return [&ckpt](const std::string& name, const std::vector<int64_t>& shape) { return ckpt.load_f32(name, shape); };
}

TensorSource random_source(uint64_t seed) {
  return [seed](const std::string& name, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> out(static_cast<size_t>(n));
    uint64_t s = seed ^ fnv1a(name);
    auto normal = [&s]() {  // Box-Muller on two 53-bit uniforms
      const double u1 = (static_cast<double>(splitmix64(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
      const double u2 = static_cast<double>(splitmix64(s) >> 11) * (1.0 / 9007199254740992.0);
      return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    };
    const bool is_norm = ends_with(name, "norm.weight");
    const bool is_bias = ends_with(name, ".bias");
    const bool is_embed = name == "model.embed_tokens.weight";
    const double std_dev = shape.size() == 2 && !is_embed ? 1.0 / std::sqrt(static_cast<double>(shape[1])) : 1.0;
    for (auto& v : out) {
      const double g = normal();
      v = static_cast<float>(is_norm ? 1.0 + 0.1 * g : is_bias ? 0.1 * g : std_dev * g);
    }
    return out;
  };
}

}  // namespace spade

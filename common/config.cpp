#include "common/config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace spade {
namespace {

using nlohmann::json;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("{}: cannot open", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json parse_json(const std::string& text, const std::string& source) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) fail("{}: top level is not a JSON object", source);
    return j;
  } catch (const json::parse_error& e) {
    fail("{}: not valid JSON ({})", source, e.what());
  }
}

int req_int(const json& j, const char* key, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("{}: required field '{}' is missing", src, key);
  if (!it->is_number_integer()) fail("{}: field '{}' must be an integer, got {}", src, key, it->dump());
  const auto v = it->get<int64_t>();
  if (v <= 0 || v > (1LL << 31) - 1) fail("{}: field '{}' must be a positive integer, got {}", src, key, v);
  return static_cast<int>(v);
}

int opt_int(const json& j, const char* key, int def, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number_integer()) fail("{}: field '{}' must be an integer, got {}", src, key, it->dump());
  return it->get<int>();
}

double opt_num(const json& j, const char* key, double def, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number()) fail("{}: field '{}' must be a number, got {}", src, key, it->dump());
  return it->get<double>();
}

bool opt_bool(const json& j, const char* key, bool def, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) fail("{}: field '{}' must be a boolean, got {}", src, key, it->dump());
  return it->get<bool>();
}

std::vector<int> id_list(const json& j, const char* key, const std::string& src) {
  auto it = j.find(key);
  std::vector<int> out;
  if (it == j.end() || it->is_null()) return out;
  if (it->is_number_integer()) {
    out.push_back(it->get<int>());
  } else if (it->is_array()) {
    for (const auto& v : *it) {
      if (!v.is_number_integer()) fail("{}: field '{}' must hold integers, got {}", src, key, v.dump());
      out.push_back(v.get<int>());
    }
  } else {
    fail("{}: field '{}' must be an integer or a list of integers, got {}", src, key, it->dump());
  }
  return out;
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& src) {
  const json j = parse_json(json_text, src);
  ModelConfig c;
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) fail("{}: required field 'model_type' is missing or not a string", src);
  c.model_type = mt->get<std::string>();
  if (c.model_type == "llama") {
    c.arch = ModelArch::Llama;
  } else if (c.model_type == "qwen2") {
    c.arch = ModelArch::Qwen2;
  } else if (c.model_type == "qwen3") {
    c.arch = ModelArch::Qwen3;
  } else {
    fail("{}: model_type '{}' is not supported (supported: llama, qwen2, qwen3)", src, c.model_type);
  }
  c.hidden_size = req_int(j, "hidden_size", src);
  c.intermediate_size = req_int(j, "intermediate_size", src);
  c.num_layers = req_int(j, "num_hidden_layers", src);
  c.num_q_heads = req_int(j, "num_attention_heads", src);
  c.vocab_size = req_int(j, "vocab_size", src);
  c.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? req_int(j, "num_key_value_heads", src)
                       : c.num_q_heads;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = req_int(j, "head_dim", src);
  } else {
    if (c.hidden_size % c.num_q_heads != 0)
      fail("{}: hidden_size {} is not divisible by num_attention_heads {} and head_dim is not given", src,
           c.hidden_size, c.num_q_heads);
    c.head_dim = c.hidden_size / c.num_q_heads;
  }
  if (c.num_q_heads % c.num_kv_heads != 0)
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", src, c.num_q_heads,
         c.num_kv_heads);
  if (c.head_dim % 2 != 0) fail("{}: head_dim {} must be even for RoPE", src, c.head_dim);
  c.max_position_embeddings = opt_int(j, "max_position_embeddings", 4096, src);
  if (c.max_position_embeddings <= 0)
    fail("{}: field 'max_position_embeddings' must be positive, got {}", src, c.max_position_embeddings);
  c.rms_norm_eps = static_cast<float>(opt_num(j, "rms_norm_eps", 1e-6, src));
  c.tie_word_embeddings = opt_bool(j, "tie_word_embeddings", false, src);

  // RoPE: transformers >= 5 writes rope_parameters {rope_theta, rope_type}; older files rope_theta + rope_scaling.
  c.rope_theta = opt_num(j, "rope_theta", 10000.0, src);
  if (auto rp = j.find("rope_parameters"); rp != j.end() && !rp->is_null()) {
    if (!rp->is_object()) fail("{}: field 'rope_parameters' must be an object", src);
    c.rope_theta = opt_num(*rp, "rope_theta", c.rope_theta, src + " rope_parameters");
    if (auto t = rp->find("rope_type"); t != rp->end() && t->is_string() && *t != "default")
      fail("{}: rope_parameters.rope_type '{}' is not supported (only 'default')", src, t->get<std::string>());
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    std::string type = rs->is_object() ? rs->value("rope_type", rs->value("type", std::string("?"))) : "?";
    if (type != "default") fail("{}: rope_scaling type '{}' is not supported (only none/default)", src, type);
  }
  if (auto act = j.find("hidden_act"); act != j.end() && act->is_string() && *act != "silu")
    fail("{}: hidden_act '{}' is not supported (only silu)", src, act->get<std::string>());

  const bool attn_bias = opt_bool(j, "attention_bias", false, src);
  switch (c.arch) {
    case ModelArch::Llama:
      c.attention_bias = attn_bias;
      c.o_proj_bias = attn_bias;
      break;
    case ModelArch::Qwen2:
      c.attention_bias = true;  // Qwen2 always has q/k/v bias, never o_proj bias
      c.o_proj_bias = false;
      break;
    case ModelArch::Qwen3:
      c.attention_bias = attn_bias;
      c.o_proj_bias = attn_bias;
      c.qk_norm = true;
      break;
  }
  c.mlp_bias = opt_bool(j, "mlp_bias", false, src);
  c.eos_token_ids = id_list(j, "eos_token_id", src);
  c.bos_token_id = opt_int(j, "bos_token_id", -1, src);
  if (auto d = j.find("torch_dtype"); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  if (auto d = j.find("dtype"); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  return c;
}

ModelConfig load_model_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!std::filesystem::exists(path)) fail("{}: not found (is '{}' a Hugging Face checkpoint directory?)", path, dir);
  return parse_model_config(slurp(path), path);
}

GenerationConfig load_generation_config(const std::string& dir, const ModelConfig& model) {
  GenerationConfig g;
  g.eos_token_ids = model.eos_token_ids;
  g.bos_token_id = model.bos_token_id;
  const std::string path = dir + "/generation_config.json";
  if (std::filesystem::exists(path)) {
    const json j = parse_json(slurp(path), path);
    for (int id : id_list(j, "eos_token_id", path))
      if (std::find(g.eos_token_ids.begin(), g.eos_token_ids.end(), id) == g.eos_token_ids.end())
        g.eos_token_ids.push_back(id);
    g.bos_token_id = opt_int(j, "bos_token_id", g.bos_token_id, path);
    g.do_sample = opt_bool(j, "do_sample", false, path);
    g.temperature = static_cast<float>(opt_num(j, "temperature", 1.0, path));
    g.top_p = static_cast<float>(opt_num(j, "top_p", 1.0, path));
    g.top_k = opt_int(j, "top_k", 0, path);
  }
  return g;
}

}  // namespace spade

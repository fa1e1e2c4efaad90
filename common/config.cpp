#include "common/config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>

#include "common/error.h"
#include "common/file_read.h"

namespace spade {
namespace {

using nlohmann::json;

json parse_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number such as 1e999
    fail("{}: not valid JSON ({})", source, e.what());
  }
  if (!j.is_object()) fail("{}: top level is not a JSON object", source);
  return j;
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
  if (it->is_number_unsigned() ? it->get<uint64_t>() > static_cast<uint64_t>(INT_MAX)
                               : it->get<int64_t>() < INT_MIN || it->get<int64_t>() > INT_MAX)
    fail("{}: field '{}' = {} does not fit a 32-bit integer", src, key, it->dump());
  return it->get<int>();
}

double opt_num(const json& j, const char* key, double def, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number()) fail("{}: field '{}' must be a number, got {}", src, key, it->dump());
  return it->get<double>();
}

// A number that must be finite and > 0 (rms_norm_eps, rope_theta); `name` is the field as the message spells it.
double check_positive_finite(double v, const std::string& name, const std::string& src) {
  if (!std::isfinite(v) || v <= 0) fail("{}: field '{}' must be a finite number > 0, got {}", src, name, v);
  return v;
}

// An integer token id: 0 .. 2^31-1.
int token_id(const json& v, const char* key, const std::string& src) {
  if (!v.is_number_integer()) fail("{}: field '{}' must hold integers, got {}", src, key, v.dump());
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(INT_MAX) : v.get<int64_t>() < 0)
    fail("{}: field '{}' holds {}, not a token id (0 .. 2^31-1)", src, key, v.dump());
  return v.get<int>();
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
    out.push_back(token_id(*it, key, src));
  } else if (it->is_array()) {
    for (const auto& v : *it) out.push_back(token_id(v, key, src));
  } else {
    fail("{}: field '{}' must be an integer or a list of integers, got {}", src, key, it->dump());
  }
  return out;
}

// bos_token_id: a token id, or absent / null (def).
int bos_id(const json& j, int def, const std::string& src) {
  auto it = j.find("bos_token_id");
  if (it == j.end() || it->is_null()) return def;
  return token_id(*it, "bos_token_id", src);
}

}  // namespace

namespace {

bool is_moe_model_type(const std::string& t) {
  return t == "qwen3_next" || t == "qwen3_5_moe" || t == "qwen3_5_moe_text";
}

// transformers' remap_legacy_layer_types: "attention" -> "full_attention", "mamba" -> "linear_attention".
LayerType parse_layer_type(const json& v, size_t i, const std::string& src) {
  if (!v.is_string()) fail("{}: layer_types[{}] must be a string, got {}", src, i, v.dump());
  const std::string t = v.get<std::string>();
  if (t == "full_attention" || t == "attention") return LayerType::FullAttention;
  if (t == "linear_attention" || t == "mamba") return LayerType::LinearAttention;
  fail("{}: layer_types[{}] '{}' is not supported (supported: full_attention, linear_attention)", src, i, t);
}

// The partial_rotary_factor transformers' default RoPE init uses: rope_parameters first, then the top level.
double partial_rotary_factor(const json& j, double def, const std::string& src) {
  double f = opt_num(j, "partial_rotary_factor", def, src);
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object())
    f = opt_num(*rp, "partial_rotary_factor", f, src + " rope_parameters");
  return f;
}

// Parses one decoder config object (the whole file, or a multimodal wrapper's text_config).
ModelConfig parse_decoder(const json& j, const std::string& src, const std::string& model_type) {
  ModelConfig c;
  c.model_type = model_type;
  if (c.model_type == "llama") {
    c.arch = ModelArch::Llama;
  } else if (c.model_type == "qwen2") {
    c.arch = ModelArch::Qwen2;
  } else if (c.model_type == "qwen3") {
    c.arch = ModelArch::Qwen3;
  } else if (c.model_type == "qwen3_5_text") {
    c.arch = ModelArch::Qwen3_5;
  } else if (is_moe_model_type(c.model_type)) {
    fail("{}: model_type '{}' is not supported: it is a mixture-of-experts model and only dense MLPs are implemented "
         "(supported: llama, qwen2, qwen3, qwen3_5_text, qwen3_5)",
         src, c.model_type);
  } else {
    fail("{}: model_type '{}' is not supported (supported: llama, qwen2, qwen3, qwen3_5_text, qwen3_5)", src,
         c.model_type);
  }
  const bool hybrid_arch = c.arch == ModelArch::Qwen3_5;
  c.hidden_size = req_int(j, "hidden_size", src);
  c.intermediate_size = req_int(j, "intermediate_size", src);
  c.num_layers = req_int(j, "num_hidden_layers", src);
  if (c.num_layers > kMaxHiddenLayers)
    fail("{}: field 'num_hidden_layers' = {} is more than {} layers; no decoder checkpoint has that many", src,
         c.num_layers, kMaxHiddenLayers);
  c.num_q_heads = req_int(j, "num_attention_heads", src);
  c.vocab_size = req_int(j, "vocab_size", src);
  c.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? req_int(j, "num_key_value_heads", src)
                       : c.num_q_heads;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = req_int(j, "head_dim", src);
  } else if (hybrid_arch) {
    c.head_dim = 256;  // Qwen3_5TextConfig.head_dim default (not hidden / heads)
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
  if (c.max_position_embeddings > kMaxPositionEmbeddings)
    fail("{}: field 'max_position_embeddings' = {} is more than {} positions", src, c.max_position_embeddings,
         kMaxPositionEmbeddings);
  // rms_norm_eps is added to the mean square before the reciprocal square root: <= 0 divides by zero on a zero
  // row (and a negative one takes the root of a negative number); checked again after the cast, which can round
  // to 0 or inf.
  const double eps = check_positive_finite(opt_num(j, "rms_norm_eps", 1e-6, src), "rms_norm_eps", src);
  c.rms_norm_eps = static_cast<float>(eps);
  if (!std::isfinite(c.rms_norm_eps) || c.rms_norm_eps <= 0)
    fail("{}: field 'rms_norm_eps' = {} does not fit a float (it becomes {})", src, eps, c.rms_norm_eps);
  c.tie_word_embeddings = opt_bool(j, "tie_word_embeddings", false, src);

  // RoPE: transformers >= 5 writes rope_parameters {rope_theta, rope_type}; older files rope_theta + rope_scaling.
  c.rope_theta = check_positive_finite(opt_num(j, "rope_theta", 10000.0, src), "rope_theta", src);
  if (auto rp = j.find("rope_parameters"); rp != j.end() && !rp->is_null()) {
    if (!rp->is_object()) fail("{}: field 'rope_parameters' must be an object", src);
    c.rope_theta = check_positive_finite(opt_num(*rp, "rope_theta", c.rope_theta, src + " rope_parameters"),
                                         "rope_parameters.rope_theta", src);
    if (auto t = rp->find("rope_type"); t != rp->end() && t->is_string() && *t != "default")
      fail("{}: rope_parameters.rope_type '{}' is not supported (only 'default')", src, t->get<std::string>());
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    std::string type = rs->is_object() ? rs->value("rope_type", rs->value("type", std::string("?"))) : "?";
    if (type != "default") fail("{}: rope_scaling type '{}' is not supported (only none/default)", src, type);
  }
  if (auto act = j.find("hidden_act"); act != j.end() && act->is_string() && *act != "silu")
    fail("{}: hidden_act '{}' is not supported (only silu)", src, act->get<std::string>());

  // Partial RoPE: Qwen3.5 defaults to 0.25 (Qwen3_5TextConfig.__post_init__); the dense families rotate everything.
  const double prf = partial_rotary_factor(j, hybrid_arch ? 0.25 : 1.0, src);
  if (!(prf > 0.0 && prf <= 1.0)) fail("{}: partial_rotary_factor {} must be in (0, 1]", src, prf);
  if (!hybrid_arch && prf != 1.0)
    fail("{}: partial_rotary_factor {} is not supported for model_type '{}' (only 1.0)", src, prf, c.model_type);
  c.rotary_dim = static_cast<int>(c.head_dim * prf);  // int(head_dim * partial_rotary_factor), as transformers
  if (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0)
    fail("{}: partial_rotary_factor {} gives a rotary dim of {} for head_dim {}; it must be even and positive", src,
         prf, c.rotary_dim, c.head_dim);

  // The fused projection widths are ints everywhere (ModelConfig::q_dim() ...): refuse products past 2^31-1 here,
  // naming the fields, rather than let them wrap.
  const int64_t q_rows = int64_t{c.num_q_heads} * c.head_dim * (hybrid_arch ? 2 : 1);  // + the output gate rows
  if (q_rows + 2 * int64_t{c.num_kv_heads} * c.head_dim > INT_MAX)
    fail("{}: num_attention_heads {} and num_key_value_heads {} times head_dim {} give q/k/v projections of more "
         "than 2^31-1 rows",
         src, c.num_q_heads, c.num_kv_heads, c.head_dim);
  if (2 * int64_t{c.intermediate_size} > INT_MAX)
    fail("{}: field 'intermediate_size' = {} is too large (the fused gate/up projection has 2 * intermediate_size "
         "rows, at most 2^31-1)",
         src, c.intermediate_size);

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
    case ModelArch::Qwen3_5:
      c.attention_bias = attn_bias;  // Qwen3_5Attention: q/k/v/o_proj all take bias=config.attention_bias
      c.o_proj_bias = attn_bias;
      c.qk_norm = true;
      c.attn_output_gate = true;
      c.norm_unit_offset = true;
      break;
  }
  // Qwen3_5MLP has no bias whatever the config says; the others honour mlp_bias.
  c.mlp_bias = hybrid_arch ? false : opt_bool(j, "mlp_bias", false, src);

  // Layer types. Dense families may list them (transformers 5 writes "full_attention" per layer); only full
  // attention is implemented there (no sliding window).
  if (auto lt = j.find("layer_types"); lt != j.end() && !lt->is_null()) {
    if (!lt->is_array()) fail("{}: field 'layer_types' must be a list of strings, got {}", src, lt->dump());
    if (lt->size() != static_cast<size_t>(c.num_layers))
      fail("{}: layer_types has {} entries but num_hidden_layers is {}", src, lt->size(), c.num_layers);
    for (size_t i = 0; i < lt->size(); ++i) c.layer_types.push_back(parse_layer_type((*lt)[i], i, src));
  } else if (hybrid_arch) {
    // Qwen3_5TextConfig.__post_init__: every full_attention_interval-th layer is full attention (default 4).
    const int interval = opt_int(j, "full_attention_interval", 4, src);
    if (interval <= 0) fail("{}: field 'full_attention_interval' must be positive, got {}", src, interval);
    for (int i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back((i + 1) % interval != 0 ? LayerType::LinearAttention : LayerType::FullAttention);
  }
  if (!hybrid_arch) {
    for (size_t i = 0; i < c.layer_types.size(); ++i)
      if (c.layer_types[i] != LayerType::FullAttention)
        fail("{}: layer_types[{}] '{}' is not supported for model_type '{}' (only full_attention)", src, i,
             layer_type_name(c.layer_types[i]), c.model_type);
    c.layer_types.clear();  // dense: every layer is full attention
  } else {
    if (opt_int(j, "num_experts", 0, src) > 0)
      fail("{}: num_experts {} > 0: mixture-of-experts layers are not supported (dense MLP only)", src,
           opt_int(j, "num_experts", 0, src));
    // Required although transformers has defaults: a config saved by transformers always writes them, so a missing
    // one means a hand-edited file, and guessing 128-dim heads would load garbage or fail later on a shape.
    c.linear_conv_kernel_dim = req_int(j, "linear_conv_kernel_dim", src);
    c.linear_num_key_heads = req_int(j, "linear_num_key_heads", src);
    c.linear_num_value_heads = req_int(j, "linear_num_value_heads", src);
    c.linear_key_head_dim = req_int(j, "linear_key_head_dim", src);
    c.linear_value_head_dim = req_int(j, "linear_value_head_dim", src);
    if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
      fail("{}: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}", src,
           c.linear_num_value_heads, c.linear_num_key_heads);
    // The GDN input projection fuses q|k|v, z, b and a: 2 Hk dk + 2 Hv dv + 2 Hv rows, all ints.
    const int64_t key_dim = int64_t{c.linear_num_key_heads} * c.linear_key_head_dim;
    const int64_t value_dim = int64_t{c.linear_num_value_heads} * c.linear_value_head_dim;
    if (2 * key_dim + 2 * value_dim + 2 * int64_t{c.linear_num_value_heads} > INT_MAX)
      fail("{}: linear_num_key_heads {} x linear_key_head_dim {} and linear_num_value_heads {} x "
           "linear_value_head_dim {} give a linear-attention input projection of more than 2^31-1 rows",
           src, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim);
  }
  c.eos_token_ids = id_list(j, "eos_token_id", src);
  c.bos_token_id = bos_id(j, -1, src);
  if (auto d = j.find("torch_dtype"); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  if (auto d = j.find("dtype"); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  return c;
}

}  // namespace

const char* layer_type_name(LayerType t) {
  switch (t) {
    case LayerType::FullAttention: return "full_attention";
    case LayerType::LinearAttention: return "linear_attention";
  }
  return "?";
}

bool ModelConfig::is_hybrid() const { return num_linear_layers() > 0; }

int ModelConfig::num_linear_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::LinearAttention));
}

int ModelConfig::num_attention_layers() const { return num_layers - num_linear_layers(); }

ModelConfig ModelConfig::attention_view() const {
  ModelConfig v = *this;
  v.num_layers = num_attention_layers();
  v.layer_types.clear();
  return v;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& src) {
  const json j = parse_json(json_text, src);
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) fail("{}: required field 'model_type' is missing or not a string", src);
  const std::string model_type = mt->get<std::string>();
  if (model_type != "qwen3_5") return parse_decoder(j, src, model_type);

  // Qwen3_5Config (Qwen3_5ForConditionalGeneration): the language model is text_config, its tensors are
  // model.language_model.*, lm_head.weight stays at the top. tie_word_embeddings and the token ids of the wrapper
  // apply when present.
  auto tc = j.find("text_config");
  if (tc == j.end() || !tc->is_object())
    fail("{}: model_type 'qwen3_5' needs a 'text_config' object (the language model's config)", src);
  const std::string tsrc = src + " text_config";
  std::string text_type = "qwen3_5_text";
  if (auto tt = tc->find("model_type"); tt != tc->end() && !tt->is_null()) {
    if (!tt->is_string()) fail("{}: field 'model_type' must be a string", tsrc);
    text_type = tt->get<std::string>();
  }
  if (text_type != "qwen3_5_text")
    fail("{}: model_type '{}' inside a qwen3_5 config is not supported (expected qwen3_5_text)", tsrc, text_type);
  ModelConfig c = parse_decoder(*tc, tsrc, text_type);
  c.model_type = model_type;
  c.weight_prefix = "model.language_model.";
  c.tie_word_embeddings = opt_bool(j, "tie_word_embeddings", c.tie_word_embeddings, src);
  if (auto ids = id_list(j, "eos_token_id", src); !ids.empty()) c.eos_token_ids = ids;
  c.bos_token_id = bos_id(j, c.bos_token_id, src);
  if (auto d = j.find("dtype"); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  return c;
}

ModelConfig load_model_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!std::filesystem::exists(path)) fail("{}: not found (is '{}' a Hugging Face checkpoint directory?)", path, dir);
  return parse_model_config(read_regular_file(path, "config.json", kMaxCheckpointJsonBytes), path);
}

GenerationConfig load_generation_config(const std::string& dir, const ModelConfig& model) {
  GenerationConfig g;
  g.eos_token_ids = model.eos_token_ids;
  g.bos_token_id = model.bos_token_id;
  const std::string path = dir + "/generation_config.json";
  if (std::filesystem::exists(path)) {
    const json j = parse_json(read_regular_file(path, "generation_config.json", kMaxCheckpointJsonBytes), path);
    for (int id : id_list(j, "eos_token_id", path))
      if (std::find(g.eos_token_ids.begin(), g.eos_token_ids.end(), id) == g.eos_token_ids.end())
        g.eos_token_ids.push_back(id);
    g.bos_token_id = bos_id(j, g.bos_token_id, path);
    g.do_sample = opt_bool(j, "do_sample", false, path);
    g.temperature = static_cast<float>(opt_num(j, "temperature", 1.0, path));
    if (!std::isfinite(g.temperature) || g.temperature < 0)
      fail("{}: field 'temperature' must be a finite number >= 0, got {}", path, g.temperature);
    g.top_p = static_cast<float>(opt_num(j, "top_p", 1.0, path));
    if (!(g.top_p >= 0 && g.top_p <= 1)) fail("{}: field 'top_p' must be in [0, 1], got {}", path, g.top_p);
    g.top_k = opt_int(j, "top_k", 0, path);
    if (g.top_k < 0) fail("{}: field 'top_k' must be >= 0, got {}", path, g.top_k);
  }
  return g;
}

}  // namespace spade

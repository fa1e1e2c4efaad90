#include "inference_rank/weights.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <new>
#include <tuple>

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

namespace {

std::string layer_prefix(const ModelConfig& c, int i) { return c.weight_prefix + "layers." + std::to_string(i) + "."; }

// Shapes of the GDN tensors of one layer, validated once.
struct GdnShapes {
  int64_t H, conv_dim, value_dim, Hv, dv, K;
};

GdnShapes gdn_shapes(const ModelConfig& c) {
  SPADE_CHECK(c.linear_conv_kernel_dim > 0 && c.linear_num_key_heads > 0 && c.linear_num_value_heads > 0 &&
                  c.linear_key_head_dim > 0 && c.linear_value_head_dim > 0,
              "model config '{}': a linear_attention layer needs positive linear_conv_kernel_dim, "
              "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim",
              c.model_type);
  SPADE_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0,
              "model config '{}': linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
              c.model_type, c.linear_num_value_heads, c.linear_num_key_heads);
  return {c.hidden_size, c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads, c.linear_value_head_dim,
          c.linear_conv_kernel_dim};
}

void check_layer_types(const ModelConfig& c) {
  SPADE_CHECK(c.layer_types.empty() || c.layer_types.size() == static_cast<size_t>(c.num_layers),
              "model config '{}': layer_types has {} entries but num_layers is {}", c.model_type,
              c.layer_types.size(), c.num_layers);
}

// (1 + w) for zero-centred RMSNorm weights (Qwen3_5RMSNorm), computed in fp32 like transformers' 1.0 + weight.float().
std::vector<float> norm_weight(const ModelConfig& c, std::vector<float> w) {
  if (c.norm_unit_offset)
    for (float& x : w) x = 1.0f + x;
  return w;
}

// q_proj of a gated attention: per head [q (D) | gate (D)] rows -> all q rows, then all gate rows.
std::pair<std::vector<float>, std::vector<float>> split_q_gate(const std::vector<float>& w, int heads, int D,
                                                               int64_t cols) {
  std::vector<float> q, g;
  q.reserve(w.size() / 2);
  g.reserve(w.size() / 2);
  const size_t block = static_cast<size_t>(D) * cols;
  for (int h = 0; h < heads; ++h) {
    const float* base = w.data() + 2 * block * h;
    q.insert(q.end(), base, base + block);
    g.insert(g.end(), base + block, base + 2 * block);
  }
  return {std::move(q), std::move(g)};
}

}  // namespace

namespace {

// Calls t.push_back({name, shape}) for every tensor a checkpoint of `c` holds, in load order; `T` is a vector of
// pairs (expected_tensors) or anything with a push_back of a pair (a running sum).
template <typename T>
void visit_expected_tensors(const ModelConfig& c, T& t) {
  check_layer_types(c);
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  const int64_t QP = c.attn_output_gate ? 2 * Q : Q;  // q_proj rows
  t.push_back({c.weight_prefix + "embed_tokens.weight", {c.vocab_size, H}});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = layer_prefix(c, i);
    t.push_back({p + "input_layernorm.weight", {H}});
    if (c.layer_type(i) == LayerType::LinearAttention) {
      const GdnShapes g = gdn_shapes(c);
      const std::string a = p + "linear_attn.";
      t.push_back({a + "in_proj_qkv.weight", {g.conv_dim, H}});
      t.push_back({a + "in_proj_z.weight", {g.value_dim, H}});
      t.push_back({a + "in_proj_b.weight", {g.Hv, H}});
      t.push_back({a + "in_proj_a.weight", {g.Hv, H}});
      t.push_back({a + "conv1d.weight", {g.conv_dim, 1, g.K}});
      t.push_back({a + "A_log", {g.Hv}});
      t.push_back({a + "dt_bias", {g.Hv}});
      t.push_back({a + "norm.weight", {g.dv}});
      t.push_back({a + "out_proj.weight", {H, g.value_dim}});
    } else {
      t.push_back({p + "self_attn.q_proj.weight", {QP, H}});
      t.push_back({p + "self_attn.k_proj.weight", {KV, H}});
      t.push_back({p + "self_attn.v_proj.weight", {KV, H}});
      if (c.attention_bias) {
        t.push_back({p + "self_attn.q_proj.bias", {QP}});
        t.push_back({p + "self_attn.k_proj.bias", {KV}});
        t.push_back({p + "self_attn.v_proj.bias", {KV}});
      }
      if (c.qk_norm) {
        t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
        t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
      }
      t.push_back({p + "self_attn.o_proj.weight", {H, Q}});
      if (c.o_proj_bias) t.push_back({p + "self_attn.o_proj.bias", {H}});
    }
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
  t.push_back({c.weight_prefix + "norm.weight", {H}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, H}});
}

// Elements of every weight tensor of `c` (as a double: a malformed config can ask for more than 2^64).
struct ElementCount {
  double elements = 0;
  void push_back(const std::pair<std::string, std::vector<int64_t>>& t) {
    double n = 1;
    for (int64_t d : t.second) n *= static_cast<double>(d);
    elements += n;
  }
};

double host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

// Refuses a config whose fp32 host weights cannot fit this host's memory, naming the fields (before anything of that
// size is allocated: without a checkpoint, --random-weights, this is the only bound on the sizes).
void check_fits_host_memory(const ModelConfig& c) {
  ElementCount n;
  visit_expected_tensors(c, n);
  const double bytes = n.elements * 4, host = host_memory_bytes();
  if (host > 0 && bytes > host)
    fail("model config '{}': hidden_size {}, intermediate_size {}, num_hidden_layers {} and vocab_size {} give {:.3g} "
         "parameters, {:.1f} GiB as fp32, more than this host's {:.1f} GiB of memory",
         c.model_type, c.hidden_size, c.intermediate_size, c.num_layers, c.vocab_size, n.elements,
         bytes / (1 << 30), host / (1 << 30));
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const ModelConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;
  visit_expected_tensors(c, t);
  return t;
}

namespace {

template <typename Src>
ModelWeights load_weights_unchecked(const ModelConfig& c, const Src& src) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  const int64_t QP = c.attn_output_gate ? 2 * Q : Q;
  ModelWeights w;
  w.embed = src(c.weight_prefix + "embed_tokens.weight", {c.vocab_size, H});
  w.layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = layer_prefix(c, i);
    LayerWeights& L = w.layers[i];
    L.type = c.layer_type(i);
    L.attn_norm = norm_weight(c, src(p + "input_layernorm.weight", {H}));
    if (L.type == LayerType::LinearAttention) {
      const GdnShapes g = gdn_shapes(c);
      const std::string a = p + "linear_attn.";
      L.in_proj_w = src(a + "in_proj_qkv.weight", {g.conv_dim, H});
      append(L.in_proj_w, src(a + "in_proj_z.weight", {g.value_dim, H}));
      append(L.in_proj_w, src(a + "in_proj_b.weight", {g.Hv, H}));
      append(L.in_proj_w, src(a + "in_proj_a.weight", {g.Hv, H}));
      L.conv1d_w = src(a + "conv1d.weight", {g.conv_dim, 1, g.K});  // [C, 1, K] row-major == [C, K]
      L.A_log = src(a + "A_log", {g.Hv});
      L.dt_bias = src(a + "dt_bias", {g.Hv});
      L.gated_norm = src(a + "norm.weight", {g.dv});  // Qwen3_5RMSNormGated: plain w
      L.out_proj_w = src(a + "out_proj.weight", {H, g.value_dim});
    } else {
      std::vector<float> qw = src(p + "self_attn.q_proj.weight", {QP, H});
      std::vector<float> gate_w, gate_b;
      if (c.attn_output_gate) std::tie(qw, gate_w) = split_q_gate(qw, c.num_q_heads, c.head_dim, H);
      L.qkv_w = std::move(qw);
      append(L.qkv_w, src(p + "self_attn.k_proj.weight", {KV, H}));
      append(L.qkv_w, src(p + "self_attn.v_proj.weight", {KV, H}));
      append(L.qkv_w, gate_w);
      if (c.attention_bias) {
        std::vector<float> qb = src(p + "self_attn.q_proj.bias", {QP});
        if (c.attn_output_gate) std::tie(qb, gate_b) = split_q_gate(qb, c.num_q_heads, c.head_dim, 1);
        L.qkv_b = std::move(qb);
        append(L.qkv_b, src(p + "self_attn.k_proj.bias", {KV}));
        append(L.qkv_b, src(p + "self_attn.v_proj.bias", {KV}));
        append(L.qkv_b, gate_b);
      }
      if (c.qk_norm) {
        L.q_norm = norm_weight(c, src(p + "self_attn.q_norm.weight", {c.head_dim}));
        L.k_norm = norm_weight(c, src(p + "self_attn.k_norm.weight", {c.head_dim}));
      }
      L.o_w = src(p + "self_attn.o_proj.weight", {H, Q});
      if (c.o_proj_bias) L.o_b = src(p + "self_attn.o_proj.bias", {H});
    }
    L.mlp_norm = norm_weight(c, src(p + "post_attention_layernorm.weight", {H}));
    L.gate_up_w = src(p + "mlp.gate_proj.weight", {I, H});
    append(L.gate_up_w, src(p + "mlp.up_proj.weight", {I, H}));
    L.down_w = src(p + "mlp.down_proj.weight", {H, I});
    if (c.mlp_bias) {
      L.gate_up_b = src(p + "mlp.gate_proj.bias", {I});
      append(L.gate_up_b, src(p + "mlp.up_proj.bias", {I}));
      L.down_b = src(p + "mlp.down_proj.bias", {H});
    }
  }
  w.final_norm = norm_weight(c, src(c.weight_prefix + "norm.weight", {H}));
  if (!c.tie_word_embeddings) w.lm_head = src("lm_head.weight", {c.vocab_size, H});
  return w;
}

}  // namespace

ModelWeights load_weights(const ModelConfig& c, const TensorSource& load) {
  check_layer_types(c);
  check_fits_host_memory(c);
  std::string current;  // the tensor being loaded, for an out-of-memory message
  auto src = [&](const std::string& name, const std::vector<int64_t>& shape) {
    current = name + " " + format_shape(shape);
    return load(name, shape);
  };
  try {
    return load_weights_unchecked(c, src);
  } catch (const std::bad_alloc&) {
    fail("model config '{}': out of host memory loading tensor {} as fp32", c.model_type, current);
  }
}

namespace {

// "tensor 'x' (in file) is [2, 3]" for messages.
std::string describe_tensor(const TensorView& t) {
  return fmt::format("tensor '{}' (in {}) is {}", t.name, t.file, format_shape(t.shape));
}

// The checkpoint's tensor `name` (never null: it lives as long as `ckpt`), or an error naming it and what in the
// config asks for it. A pointer, not a reference: callers pass temporary names, which GCC 13's -Wdangling-reference
// would take for the referent.
const TensorView* need(const Checkpoint& ckpt, const std::string& name, const std::string& cfg_src,
                       const std::string& why) {
  if (!ckpt.has(name)) fail("{}: tensor '{}' not found; {} needs it ({})", ckpt.dir(), name, cfg_src, why);
  return &ckpt.get(name);
}

// Dimension `dim` of `t` must be `want`, which the config fields `fields` give; the error names the fields.
void check_dim(const TensorView& t, size_t dim, int64_t want, const std::string& cfg_src, const std::string& fields) {
  if (t.shape.size() <= dim || t.shape[dim] != want)
    fail("{}: {} = {} but {} (dimension {} should be {})", cfg_src, fields, want, describe_tensor(t), dim, want);
}

}  // namespace

void check_checkpoint(const ModelConfig& c, const Checkpoint& ckpt, const std::string& cfg_src) {
  check_layer_types(c);
  const std::string& pre = c.weight_prefix;
  // The embedding fixes vocab_size and hidden_size.
  const TensorView& emb = *need(ckpt, pre + "embed_tokens.weight", cfg_src, "the token embedding");
  if (emb.shape.size() != 2)
    fail("{}: {}, expected [vocab_size, hidden_size] = [{}, {}]", ckpt.dir(), describe_tensor(emb), c.vocab_size,
         c.hidden_size);
  check_dim(emb, 0, c.vocab_size, cfg_src, "vocab_size");
  check_dim(emb, 1, c.hidden_size, cfg_src, "hidden_size");

  // Layer count: every layer 0 .. num_hidden_layers-1 must be there. The loop ends at the first missing layer, so a
  // config asking for 2^31-1 layers costs as many lookups as the checkpoint has layers.
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string n = layer_prefix(c, i) + "input_layernorm.weight";
    if (!ckpt.has(n))
      fail("{}: num_hidden_layers = {} but the checkpoint in {} holds {} layer{}: tensor '{}' is missing", cfg_src,
           c.num_layers, ckpt.dir(), i, i == 1 ? "" : "s", n);
  }
  if (ckpt.has(layer_prefix(c, c.num_layers) + "input_layernorm.weight"))
    spdlog::warn("{}: the checkpoint holds more than num_hidden_layers = {} layers; the others are not used", cfg_src,
                 c.num_layers);

  // The head geometry, from the first layer of each kind, naming the fields that give each width.
  bool seen_attn = false, seen_linear = false;
  for (int i = 0; i < c.num_layers && !(seen_attn && seen_linear); ++i) {
    const std::string p = layer_prefix(c, i);
    if (c.layer_type(i) == LayerType::FullAttention && !seen_attn) {
      seen_attn = true;
      const std::string why = fmt::format("layer {} is a full-attention layer", i);
      const TensorView& q = *need(ckpt, p + "self_attn.q_proj.weight", cfg_src, why);
      check_dim(q, 0, (c.attn_output_gate ? 2 : 1) * int64_t{c.q_dim()}, cfg_src,
                fmt::format("{}num_attention_heads {} x head_dim {}", c.attn_output_gate ? "2 (output gate) x " : "",
                            c.num_q_heads, c.head_dim));
      const TensorView& k = *need(ckpt, p + "self_attn.k_proj.weight", cfg_src, why);
      check_dim(k, 0, c.kv_dim(), cfg_src,
                fmt::format("num_key_value_heads {} x head_dim {}", c.num_kv_heads, c.head_dim));
      if (c.qk_norm)
        check_dim(*need(ckpt, p + "self_attn.q_norm.weight", cfg_src, "qk-norm of model_type " + c.model_type), 0,
                  c.head_dim, cfg_src, "head_dim");
    }
    if (c.layer_type(i) == LayerType::LinearAttention && !seen_linear) {
      seen_linear = true;
      const std::string why = fmt::format("layer {} is a linear-attention layer", i), a = p + "linear_attn.";
      check_dim(*need(ckpt, a + "in_proj_qkv.weight", cfg_src, why), 0, c.linear_conv_dim(), cfg_src,
                fmt::format("2 x linear_num_key_heads {} x linear_key_head_dim {} + linear_num_value_heads {} x "
                            "linear_value_head_dim {}",
                            c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads,
                            c.linear_value_head_dim));
      check_dim(*need(ckpt, a + "A_log", cfg_src, why), 0, c.linear_num_value_heads, cfg_src,
                "linear_num_value_heads");
      check_dim(*need(ckpt, a + "norm.weight", cfg_src, why), 0, c.linear_value_head_dim, cfg_src,
                "linear_value_head_dim");
      check_dim(*need(ckpt, a + "conv1d.weight", cfg_src, why), 2, c.linear_conv_kernel_dim, cfg_src,
                "linear_conv_kernel_dim");
    }
  }
  if (c.num_layers > 0)
    check_dim(*need(ckpt, layer_prefix(c, 0) + "mlp.gate_proj.weight", cfg_src, "the MLP of layer 0"), 0,
              c.intermediate_size, cfg_src, "intermediate_size");

  // Then every tensor, name and shape (the layer count is bounded by the checkpoint now).
  for (const auto& [name, shape] : expected_tensors(c)) {
    const std::string why = name == "lm_head.weight"    ? "tie_word_embeddings is false"
                            : name.ends_with(".bias")   ? "attention_bias / mlp_bias of model_type " + c.model_type
                                                        : "model_type " + c.model_type;
    const TensorView& t = *need(ckpt, name, cfg_src, why);
    if (t.shape != shape)
      fail("{}: {}, but {} gives {}", ckpt.dir(), describe_tensor(t), cfg_src, format_shape(shape));
  }
}

ModelWeights load_checkpoint_weights(const ModelConfig& c, const Checkpoint& ckpt, const std::string& cfg_src) {
  check_checkpoint(c, ckpt, cfg_src);
  std::vector<std::string> names;
  size_t bytes = 0;
  for (const auto& [name, shape] : expected_tensors(c)) {
    names.push_back(name);
    bytes += ckpt.get(name).nbytes;
  }
  const auto t0 = std::chrono::steady_clock::now();
  ckpt.check_finite(names);
  spdlog::info("{}: {} tensors ({:.1f} MiB) free of NaN/Inf, checked in {:.1f} ms", ckpt.dir(), names.size(),
               static_cast<double>(bytes) / (1 << 20),
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  LoadProgress progress(ckpt.dir(), bytes, isatty(STDERR_FILENO) != 0);
  const TensorSource source = checkpoint_source(ckpt);
  ModelWeights w = load_weights(c, [&](const std::string& name, const std::vector<int64_t>& shape) {
    std::vector<float> t = source(name, shape);
    progress.add(ckpt.get(name).nbytes);
    return t;
  });
  progress.finish();
  return w;
}

LoadProgress::LoadProgress(std::string what, size_t total_bytes, bool terminal)
    : what_(std::move(what)), total_(total_bytes), terminal_(terminal), start_(Clock::now()), last_(start_) {}

void LoadProgress::add(size_t bytes) {
  done_ += bytes;
  const auto now = Clock::now();
  // A terminal gets a line redrawn at most 5 times a second; a log gets a line every 10 s.
  if (now - last_ < (terminal_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(10000))) return;
  last_ = now;
  const std::string line = status(now);
  if (terminal_) {
    std::fprintf(stderr, "\r%s\033[K", line.c_str());
    std::fflush(stderr);
    drew_ = true;
  } else {
    spdlog::info("{}", line);
  }
}

void LoadProgress::finish() {
  if (drew_) std::fprintf(stderr, "\r\033[K");
  const double s = std::chrono::duration<double>(Clock::now() - start_).count();
  spdlog::info("{}: loaded {:.1f} MiB in {:.2f} s ({:.0f} MiB/s)", what_, static_cast<double>(done_) / (1 << 20), s,
               s > 0 ? static_cast<double>(done_) / (1 << 20) / s : 0.0);
}

std::string LoadProgress::status(Clock::time_point now) const {
  const double s = std::chrono::duration<double>(now - start_).count();
  const double rate = s > 0 ? static_cast<double>(done_) / s : 0.0;  // bytes/s
  const double left = rate > 0 ? static_cast<double>(total_ - std::min(done_, total_)) / rate : 0.0;
  return fmt::format("{}: loading {:.2f} / {:.2f} GiB ({:.0f}%), {:.0f} MiB/s, ETA {:.0f} s", what_,
                     static_cast<double>(done_) / (1 << 30), static_cast<double>(total_) / (1 << 30),
                     total_ > 0 ? 100.0 * static_cast<double>(done_) / static_cast<double>(total_) : 100.0,
                     rate / (1 << 20), left);
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
    const bool is_norm = ends_with(name, "norm.weight") || ends_with(name, "dt_bias");
    const bool is_bias = ends_with(name, ".bias");
    const bool is_embed = ends_with(name, "embed_tokens.weight");
    const bool is_conv = ends_with(name, "conv1d.weight");  // [C, 1, K]: fan_in K
    if (ends_with(name, "A_log")) {  // transformers: A ~ U(0.01, 16), A_log = log A
      for (auto& v : out) {
        const double u = static_cast<double>(splitmix64(s) >> 11) * (1.0 / 9007199254740992.0);
        v = static_cast<float>(std::log(0.01 + u * (16.0 - 0.01)));
      }
      return out;
    }
    const double std_dev = is_conv                             ? 1.0 / std::sqrt(static_cast<double>(shape.back()))
                           : shape.size() == 2 && !is_embed ? 1.0 / std::sqrt(static_cast<double>(shape[1]))
                                                            : 1.0;
    for (auto& v : out) {
      const double g = normal();
      v = static_cast<float>(is_norm ? 1.0 + 0.1 * g : is_bias ? 0.1 * g : std_dev * g);
    }
    return out;
  };
}

}  // namespace spade

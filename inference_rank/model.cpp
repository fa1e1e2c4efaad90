#include "inference_rank/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "common/error.h"
#include "common/safetensors.h"
#include "kernels/causal_conv1d_ref.h"
#include "kernels/gated_rmsnorm_ref.h"
#include "kernels/gdn_gating_ref.h"
#include "kernels/gdn_ref.h"
#include "kernels/output_gate_ref.h"
#include "kernels/linear_ref.h"
#include "kernels/paged_attention_ref.h"
#include "kernels/rmsnorm_ref.h"
#include "kernels/rope_ref.h"
#include "kernels/swiglu_ref.h"

namespace spade {

KvCache::KvCache(const ModelConfig& cfg, int num_pages, int page_size) : num_pages_(num_pages), page_size_(page_size) {
  SPADE_CHECK(num_pages > 0 && page_size > 0, "KvCache: num_pages {} and page_size {} must be positive", num_pages,
              page_size);
  const size_t n = static_cast<size_t>(num_pages) * page_size * cfg.kv_dim();
  const int layers = cfg.num_attention_layers();
  for (int l = 0; l < layers; ++l) {
    k_.emplace_back(new float[n]);
    v_.emplace_back(new float[n]);
  }
  bytes_ = 2 * n * sizeof(float) * layers;
}

size_t KvCache::page_bytes(const ModelConfig& cfg, int page_size) {
  return 2 * sizeof(float) * static_cast<size_t>(page_size) * cfg.kv_dim() * cfg.num_attention_layers();
}

// ---- GdnStatePool ----

GdnStatePool::GdnStatePool(const ModelConfig& cfg, int num_slots) : num_slots_(num_slots) {
  SPADE_CHECK(num_slots >= 1, "GdnStatePool: num_slots {} must be >= 1", num_slots);
  const int layers = cfg.num_linear_layers();
  if (layers > 0) {
    SPADE_CHECK(cfg.linear_conv_kernel_dim >= 1 && cfg.linear_conv_dim() > 0 && cfg.linear_value_dim() > 0,
                "GdnStatePool: model '{}' has linear_attention layers but non-positive GDN sizes", cfg.model_type);
    conv_floats_ = static_cast<size_t>(cfg.linear_conv_dim()) * (cfg.linear_conv_kernel_dim - 1);
    ssm_floats_ = static_cast<size_t>(cfg.linear_num_value_heads) * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
  }
  slot_bytes_ = (conv_floats_ + ssm_floats_) * sizeof(float) * static_cast<size_t>(layers);
  for (int l = 0; l < layers; ++l) {
    conv_.emplace_back(new float[std::max<size_t>(1, conv_floats_ * num_slots)]);
    ssm_.emplace_back(new float[ssm_floats_ * num_slots]);
  }
  used_.assign(static_cast<size_t>(num_slots), 0);
  seq_len_.assign(static_cast<size_t>(num_slots), -1);
  for (int s = num_slots - 1; s >= 0; --s) free_.push_back(s);
}

size_t GdnStatePool::slot_bytes(const ModelConfig& cfg) {
  const size_t layers = static_cast<size_t>(cfg.num_linear_layers());
  if (layers == 0) return 0;
  const size_t conv = static_cast<size_t>(cfg.linear_conv_dim()) * (cfg.linear_conv_kernel_dim - 1);
  const size_t ssm = static_cast<size_t>(cfg.linear_num_value_heads) * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
  return (conv + ssm) * sizeof(float) * layers;
}

bool GdnStatePool::in_use(int slot) const {
  return slot >= 0 && slot < num_slots_ && used_[static_cast<size_t>(slot)] != 0;
}

int GdnStatePool::allocate() {
  SPADE_CHECK(!free_.empty(), "GdnStatePool: all {} recurrent-state slots are in use", num_slots_);
  const int s = free_.back();
  free_.pop_back();
  used_[static_cast<size_t>(s)] = 1;
  seq_len_[static_cast<size_t>(s)] = -1;
  return s;
}

void GdnStatePool::release(int slot) {
  SPADE_CHECK(in_use(slot), "GdnStatePool: release of slot {} that is not in use", slot);
  used_[static_cast<size_t>(slot)] = 0;
  seq_len_[static_cast<size_t>(slot)] = -1;
  // Keep free_ sorted descending so allocate() hands out the lowest id (deterministic reuse).
  free_.insert(std::upper_bound(free_.begin(), free_.end(), slot, std::greater<int32_t>()), slot);
}

int64_t GdnStatePool::seq_len(int slot) const {
  SPADE_CHECK(slot >= 0 && slot < num_slots_, "GdnStatePool: slot {} outside 0..{}", slot, num_slots_ - 1);
  return seq_len_[static_cast<size_t>(slot)];
}

void GdnStatePool::reset(int slot) {
  SPADE_CHECK(in_use(slot), "GdnStatePool: reset of slot {} that is not in use", slot);
  for (auto& c : conv_) std::fill_n(c.get() + conv_floats_ * slot, conv_floats_, 0.f);
  for (auto& m : ssm_) std::fill_n(m.get() + ssm_floats_ * slot, ssm_floats_, 0.f);
  seq_len_[static_cast<size_t>(slot)] = 0;
}

void GdnStatePool::set_seq_len(int slot, int64_t len) {
  SPADE_CHECK(in_use(slot), "GdnStatePool: slot {} is not in use", slot);
  seq_len_[static_cast<size_t>(slot)] = len;
}

void write_kv_pages(const ForwardBatch& batch, const float* k, const float* v, float* k_cache, float* v_cache,
                    int page_size, int kv_dim) {
  for (int b = 0; b < batch.batch(); ++b) {
    const int q0 = batch.cu_q_lens[b];
    const int q_len = batch.cu_q_lens[b + 1] - q0;
    const int32_t* pages = batch.block_table.data() + static_cast<size_t>(b) * batch.max_pages;
    for (int i = 0; i < q_len; ++i) {
      const int pos = batch.seq_lens[b] - q_len + i;
      const size_t slot = (static_cast<size_t>(pages[pos / page_size]) * page_size + pos % page_size) * kv_dim;
      std::memcpy(k_cache + slot, k + static_cast<size_t>(q0 + i) * kv_dim, kv_dim * sizeof(float));
      std::memcpy(v_cache + slot, v + static_cast<size_t>(q0 + i) * kv_dim, kv_dim * sizeof(float));
    }
  }
}

void DensePagedAttention::attend(int layer, const ForwardBatch& batch, const float* q, const float* k,
                                 const float* v, float* out) {
  write_kv_pages(batch, k, v, cache_.k(layer), cache_.v(layer), cache_.page_size(), cfg_.kv_dim());
  kernels::paged_attention_ref(paged_attention_params(cfg_, cache_, layer, batch, q, out));
}

kernels::PagedAttentionParams paged_attention_params(const ModelConfig& cfg, const KvCache& cache, int layer,
                                                     const ForwardBatch& batch, const float* q, float* out) {
  kernels::PagedAttentionParams p;
  p.q = q;
  p.k_cache = cache.k(layer);
  p.v_cache = cache.v(layer);
  p.block_table = batch.block_table.data();
  p.cu_q_lens = batch.cu_q_lens.data();
  p.seq_lens = batch.seq_lens.data();
  p.out = out;
  p.batch = batch.batch();
  p.num_q_heads = cfg.num_q_heads;
  p.num_kv_heads = cfg.num_kv_heads;
  p.head_dim = cfg.head_dim;
  p.page_size = cache.page_size();
  p.max_pages_per_seq = batch.max_pages;
  p.scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
  return p;
}

Model::Model(ModelConfig cfg, ModelWeights w) : cfg_(std::move(cfg)), w_(std::move(w)) {
  SPADE_CHECK(cfg_.layer_types.empty() || cfg_.layer_types.size() == static_cast<size_t>(cfg_.num_layers),
              "model '{}': layer_types has {} entries but num_layers is {}", cfg_.model_type, cfg_.layer_types.size(),
              cfg_.num_layers);
  SPADE_CHECK(w_.layers.size() == static_cast<size_t>(cfg_.num_layers), "model '{}': {} layer weights for {} layers",
              cfg_.model_type, w_.layers.size(), cfg_.num_layers);
  for (int l = 0; l < cfg_.num_layers; ++l)
    SPADE_CHECK(w_.layers[l].type == cfg_.layer_type(l), "model '{}': layer {} weights are {} but the config says {}",
                cfg_.model_type, l, layer_type_name(w_.layers[l].type), layer_type_name(cfg_.layer_type(l)));
  SPADE_CHECK(cfg_.rope_dim() > 0 && cfg_.rope_dim() <= cfg_.head_dim && cfg_.rope_dim() % 2 == 0,
              "model '{}': rotary dim {} must be even and in 1..head_dim {}", cfg_.model_type, cfg_.rope_dim(),
              cfg_.head_dim);
}

std::unique_ptr<Model> Model::load(const std::string& dir) {
  ModelConfig cfg = load_model_config(dir);
  Checkpoint ckpt = Checkpoint::open_dir(dir);
  ModelWeights w = load_checkpoint_weights(cfg, ckpt, dir + "/config.json");  // shapes, NaN/Inf, sizes checked
  return std::make_unique<Model>(std::move(cfg), std::move(w));
}

std::unique_ptr<Model> Model::random(const ModelConfig& cfg, uint64_t seed) {
  return std::make_unique<Model>(cfg, load_weights(cfg, random_source(seed)));
}

size_t Model::num_params() const {
  size_t n = w_.embed.size() + w_.final_norm.size() + w_.lm_head.size();
  for (const auto& L : w_.layers)
    n += L.attn_norm.size() + L.qkv_w.size() + L.qkv_b.size() + L.q_norm.size() + L.k_norm.size() + L.o_w.size() +
         L.o_b.size() + L.in_proj_w.size() + L.conv1d_w.size() + L.A_log.size() + L.dt_bias.size() +
         L.gated_norm.size() + L.out_proj_w.size() + L.mlp_norm.size() + L.gate_up_w.size() + L.gate_up_b.size() +
         L.down_w.size() + L.down_b.size();
  return n;
}

// Full attention: out = o_proj(attn(q, k, v) [* sigmoid(gate)]), h = the normed input [T, hidden].
void Model::attention_layer(int layer, int attn_layer, const ForwardBatch& batch, AttentionBackend& attention,
                            const float* h, float* out) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int T = batch.total_tokens(), H = cfg_.hidden_size, D = cfg_.head_dim;
  const int Q = cfg_.q_dim(), KV = cfg_.kv_dim(), G = cfg_.attn_output_gate ? Q : 0, QKV = Q + 2 * KV + G;
  std::vector<float> qkv(static_cast<size_t>(T) * QKV), q(static_cast<size_t>(T) * Q), k(static_cast<size_t>(T) * KV),
      v(static_cast<size_t>(T) * KV), attn(static_cast<size_t>(T) * Q);
  kernels::linear_ref(h, L.qkv_w.data(), L.qkv_b.empty() ? nullptr : L.qkv_b.data(), qkv.data(), T, QKV, H);
  for (int t = 0; t < T; ++t) {
    const float* row = &qkv[static_cast<size_t>(t) * QKV];
    std::memcpy(&q[static_cast<size_t>(t) * Q], row, Q * sizeof(float));
    std::memcpy(&k[static_cast<size_t>(t) * KV], row + Q, KV * sizeof(float));
    std::memcpy(&v[static_cast<size_t>(t) * KV], row + Q + KV, KV * sizeof(float));
  }
  if (cfg_.qk_norm) {  // Qwen3 / Qwen3.5: per-head RMSNorm of q and k before RoPE
    kernels::rmsnorm_ref(q.data(), L.q_norm.data(), q.data(), T * cfg_.num_q_heads, D, cfg_.rms_norm_eps);
    kernels::rmsnorm_ref(k.data(), L.k_norm.data(), k.data(), T * cfg_.num_kv_heads, D, cfg_.rms_norm_eps);
  }
  kernels::rope_ref(q.data(), batch.positions.data(), T, cfg_.num_q_heads, D, cfg_.rope_dim(), cfg_.rope_theta);
  kernels::rope_ref(k.data(), batch.positions.data(), T, cfg_.num_kv_heads, D, cfg_.rope_dim(), cfg_.rope_theta);
  attention.attend(attn_layer, batch, q.data(), k.data(), v.data(), attn.data());
  if (G > 0)  // Qwen3.5: attn_output * sigmoid(gate), gate laid out like the attention output [T, heads, D]
    kernels::output_gate_ref(attn.data(), qkv.data() + Q + 2 * KV, QKV, T, Q);
  kernels::linear_ref(attn.data(), L.o_w.data(), L.o_b.empty() ? nullptr : L.o_b.data(), out, T, H, Q);
}

// Gated DeltaNet (transformers Qwen3_5GatedDeltaNet.forward): in_proj -> causal conv1d + SiLU over q|k|v (conv state)
// -> gated delta rule with l2-normalised q/k (recurrent state) -> gated RMSNorm with z -> out_proj.
void Model::gdn_layer(int layer, int gdn_idx, const ForwardBatch& batch, GdnStatePool& states, const float* h,
                      float* out) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int T = batch.total_tokens(), H = cfg_.hidden_size;
  const int Hv = cfg_.linear_num_value_heads, dv = cfg_.linear_value_head_dim;
  const int key_dim = cfg_.linear_key_dim(), value_dim = cfg_.linear_value_dim(), C = cfg_.linear_conv_dim();
  const int P = C + value_dim + 2 * Hv;  // in_proj rows: qkv | z | b | a
  std::vector<float> proj(static_cast<size_t>(T) * P), mixed(static_cast<size_t>(T) * C),
      conv(static_cast<size_t>(T) * C), q(static_cast<size_t>(T) * key_dim), k(static_cast<size_t>(T) * key_dim),
      v(static_cast<size_t>(T) * value_dim), z(static_cast<size_t>(T) * value_dim), g(static_cast<size_t>(T) * Hv),
      beta(static_cast<size_t>(T) * Hv), core(static_cast<size_t>(T) * value_dim);
  kernels::linear_ref(h, L.in_proj_w.data(), nullptr, proj.data(), T, P, H);
  for (int t = 0; t < T; ++t) {
    const float* row = &proj[static_cast<size_t>(t) * P];
    std::memcpy(&mixed[static_cast<size_t>(t) * C], row, C * sizeof(float));
    std::memcpy(&z[static_cast<size_t>(t) * value_dim], row + C, value_dim * sizeof(float));
  }
  // beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), in fp32 as transformers computes them
  kernels::gdn_gating_ref(proj.data() + C + value_dim, proj.data() + C + value_dim + Hv, P, L.A_log.data(),
                          L.dt_bias.data(), beta.data(), g.data(), T, Hv);

  kernels::CausalConv1dParams cp;
  cp.x = mixed.data();
  cp.weight = L.conv1d_w.data();
  cp.out = conv.data();
  cp.state_pool = states.conv_states(gdn_idx);
  cp.num_state_slots = states.num_slots();
  cp.state_slots = batch.state_slots.data();
  cp.cu_tokens = batch.cu_q_lens.data();
  cp.batch = batch.batch();
  cp.channels = C;
  cp.kernel = cfg_.linear_conv_kernel_dim;
  cp.silu = true;  // activation = hidden_act (silu; config.cpp rejects anything else)
  kernels::causal_conv1d_ref(cp);
  for (int t = 0; t < T; ++t) {
    const float* row = &conv[static_cast<size_t>(t) * C];
    std::memcpy(&q[static_cast<size_t>(t) * key_dim], row, key_dim * sizeof(float));
    std::memcpy(&k[static_cast<size_t>(t) * key_dim], row + key_dim, key_dim * sizeof(float));
    std::memcpy(&v[static_cast<size_t>(t) * value_dim], row + 2 * key_dim, value_dim * sizeof(float));
  }

  kernels::GdnRecurrentParams rp;
  rp.dims = {cfg_.linear_num_key_heads, Hv, cfg_.linear_key_head_dim, dv};
  rp.opt = {};  // use_qk_l2norm_in_kernel=True, eps 1e-6, scale 1/sqrt(d_k)
  rp.tok.q = q.data();
  rp.tok.k = k.data();
  rp.tok.v = v.data();
  rp.tok.g = g.data();
  rp.tok.beta = beta.data();
  rp.tok.cu_tokens = batch.cu_q_lens.data();
  rp.tok.batch = batch.batch();
  rp.out = core.data();
  rp.state_pool = states.recurrent_states(gdn_idx);
  rp.num_state_slots = states.num_slots();
  rp.state_slots = batch.state_slots.data();
  kernels::gdn_recurrent_ref(rp);

  kernels::gated_rmsnorm_ref(core.data(), z.data(), L.gated_norm.data(), core.data(), T * Hv, dv, cfg_.rms_norm_eps);
  kernels::linear_ref(core.data(), L.out_proj_w.data(), nullptr, out, T, H, value_dim);
}

void Model::forward(const ForwardBatch& batch, AttentionBackend& attention, std::vector<float>& logits,
                    GdnStatePool* states) const {
  const int T = batch.total_tokens(), B = batch.batch();
  const int H = cfg_.hidden_size, I = cfg_.intermediate_size;
  SPADE_CHECK(static_cast<int>(batch.positions.size()) == T, "forward: {} positions for {} tokens",
              batch.positions.size(), T);
  SPADE_CHECK(static_cast<int>(batch.cu_q_lens.size()) == B + 1 && batch.cu_q_lens[0] == 0 &&
                  batch.cu_q_lens[static_cast<size_t>(B)] == T,
              "forward: cu_q_lens must have batch + 1 = {} entries from 0 to {} tokens", B + 1, T);
  for (int t = 0; t < T; ++t) {
    SPADE_CHECK(batch.tokens[t] >= 0 && batch.tokens[t] < cfg_.vocab_size,
                "forward: token id {} is outside the vocabulary [0, {})", batch.tokens[t], cfg_.vocab_size);
    SPADE_CHECK(batch.positions[t] >= 0 && batch.positions[t] < cfg_.max_position_embeddings,
                "forward: position {} is past max_position_embeddings {}", batch.positions[t],
                cfg_.max_position_embeddings);
  }
  const bool hybrid = cfg_.is_hybrid();
  if (hybrid) {
    SPADE_CHECK(states != nullptr, "forward: model '{}' has linear_attention layers and needs a GdnStatePool",
                cfg_.model_type);
    SPADE_CHECK(static_cast<int>(batch.state_slots.size()) == B, "forward: {} state_slots for a batch of {}",
                batch.state_slots.size(), B);
    std::vector<int32_t> seen(batch.state_slots);
    std::sort(seen.begin(), seen.end());
    SPADE_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(),
                "forward: two sequences of the batch share a recurrent-state slot");
    for (int b = 0; b < B; ++b) {
      const int slot = batch.state_slots[b];
      SPADE_CHECK(states->in_use(slot), "forward: sequence {} uses recurrent-state slot {} which is not allocated",
                  b < static_cast<int>(batch.seq_ids.size()) ? batch.seq_ids[b] : static_cast<uint64_t>(b), slot);
      const int start = batch.seq_lens[b] - (batch.cu_q_lens[b + 1] - batch.cu_q_lens[b]);
      if (start == 0) continue;  // a fresh sequence: reset below
      SPADE_CHECK(states->seq_len(slot) == start,
                  "forward: sequence {} continues at position {} but its recurrent state (slot {}) holds {} tokens",
                  b < static_cast<int>(batch.seq_ids.size()) ? batch.seq_ids[b] : static_cast<uint64_t>(b), start,
                  slot, states->seq_len(slot));
    }
    // Invalidate first: if a layer throws, the slots' states are half-updated and must not be continued.
    for (int b = 0; b < B; ++b) {
      const int slot = batch.state_slots[b];
      const int start = batch.seq_lens[b] - (batch.cu_q_lens[b + 1] - batch.cu_q_lens[b]);
      if (start == 0) states->reset(slot);
      states->set_seq_len(slot, -1);
    }
  }

  std::vector<float> x(static_cast<size_t>(T) * H), h(static_cast<size_t>(T) * H), proj(static_cast<size_t>(T) * H);
  std::vector<float> gu(static_cast<size_t>(T) * 2 * I), act(static_cast<size_t>(T) * I);

  for (int t = 0; t < T; ++t)
    std::memcpy(&x[static_cast<size_t>(t) * H], &w_.embed[static_cast<size_t>(batch.tokens[t]) * H], H * sizeof(float));

  int attn_idx = 0, gdn_idx = 0;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& L = w_.layers[l];
    // --- token mixer: full attention or Gated DeltaNet ---
    kernels::rmsnorm_ref(x.data(), L.attn_norm.data(), h.data(), T, H, cfg_.rms_norm_eps);
    if (L.type == LayerType::LinearAttention) {
      gdn_layer(l, gdn_idx++, batch, *states, h.data(), proj.data());
    } else {
      attention_layer(l, attn_idx++, batch, attention, h.data(), proj.data());
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    // --- MLP block ---
    kernels::rmsnorm_ref(x.data(), L.mlp_norm.data(), h.data(), T, H, cfg_.rms_norm_eps);
    kernels::linear_ref(h.data(), L.gate_up_w.data(), L.gate_up_b.empty() ? nullptr : L.gate_up_b.data(), gu.data(), T,
                        2 * I, H);
    for (int t = 0; t < T; ++t) {
      const float* g = &gu[static_cast<size_t>(t) * 2 * I];
      kernels::swiglu_ref(g, g + I, &act[static_cast<size_t>(t) * I], 1, I);
    }
    kernels::linear_ref(act.data(), L.down_w.data(), L.down_b.empty() ? nullptr : L.down_b.data(), proj.data(), T, H,
                        I);
    for (size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
  }
  if (hybrid)
    for (int b = 0; b < B; ++b) states->set_seq_len(batch.state_slots[b], batch.seq_lens[b]);

  // Final norm + LM head only for the rows whose logits are wanted.
  const int R = static_cast<int>(batch.logit_rows.size());
  std::vector<float> sel(static_cast<size_t>(R) * H);
  for (int r = 0; r < R; ++r) {
    const int t = batch.logit_rows[r];
    SPADE_CHECK(t >= 0 && t < T, "forward: logit row {} outside the batch of {} tokens", t, T);
    std::memcpy(&sel[static_cast<size_t>(r) * H], &x[static_cast<size_t>(t) * H], H * sizeof(float));
  }
  kernels::rmsnorm_ref(sel.data(), w_.final_norm.data(), sel.data(), R, H, cfg_.rms_norm_eps);
  logits.resize(static_cast<size_t>(R) * cfg_.vocab_size);
  const float* head = w_.lm_head.empty() ? w_.embed.data() : w_.lm_head.data();
  kernels::linear_ref(sel.data(), head, nullptr, logits.data(), R, cfg_.vocab_size, H);
}

}  // namespace spade

#include "inference_rank/model.h"

#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/safetensors.h"
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
  for (int l = 0; l < cfg.num_layers; ++l) {
    k_.emplace_back(new float[n]);
    v_.emplace_back(new float[n]);
  }
  bytes_ = 2 * n * sizeof(float) * cfg.num_layers;
}

size_t KvCache::page_bytes(const ModelConfig& cfg, int page_size) {
  return 2 * sizeof(float) * static_cast<size_t>(page_size) * cfg.kv_dim() * cfg.num_layers;
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
  kernels::PagedAttentionParams p;
  p.q = q;
  p.k_cache = cache_.k(layer);
  p.v_cache = cache_.v(layer);
  p.block_table = batch.block_table.data();
  p.cu_q_lens = batch.cu_q_lens.data();
  p.seq_lens = batch.seq_lens.data();
  p.out = out;
  p.batch = batch.batch();
  p.num_q_heads = cfg_.num_q_heads;
  p.num_kv_heads = cfg_.num_kv_heads;
  p.head_dim = cfg_.head_dim;
  p.page_size = cache_.page_size();
  p.max_pages_per_seq = batch.max_pages;
  p.scale = 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  kernels::paged_attention_ref(p);
}

std::unique_ptr<Model> Model::load(const std::string& dir) {
  ModelConfig cfg = load_model_config(dir);
  Checkpoint ckpt = Checkpoint::open_dir(dir);
  ModelWeights w = load_weights(cfg, checkpoint_source(ckpt));
  return std::make_unique<Model>(std::move(cfg), std::move(w));
}

std::unique_ptr<Model> Model::random(const ModelConfig& cfg, uint64_t seed) {
  return std::make_unique<Model>(cfg, load_weights(cfg, random_source(seed)));
}

size_t Model::num_params() const {
  size_t n = w_.embed.size() + w_.final_norm.size() + w_.lm_head.size();
  for (const auto& L : w_.layers)
    n += L.attn_norm.size() + L.qkv_w.size() + L.qkv_b.size() + L.q_norm.size() + L.k_norm.size() + L.o_w.size() +
         L.o_b.size() + L.mlp_norm.size() + L.gate_up_w.size() + L.gate_up_b.size() + L.down_w.size() +
         L.down_b.size();
  return n;
}

void Model::forward(const ForwardBatch& batch, AttentionBackend& attention, std::vector<float>& logits) const {
  const int T = batch.total_tokens();
  const int H = cfg_.hidden_size, I = cfg_.intermediate_size, D = cfg_.head_dim;
  const int Q = cfg_.q_dim(), KV = cfg_.kv_dim(), QKV = Q + 2 * KV;
  SPADE_CHECK(static_cast<int>(batch.positions.size()) == T, "forward: {} positions for {} tokens",
              batch.positions.size(), T);
  for (int t = 0; t < T; ++t) {
    SPADE_CHECK(batch.tokens[t] >= 0 && batch.tokens[t] < cfg_.vocab_size,
                "forward: token id {} is outside the vocabulary [0, {})", batch.tokens[t], cfg_.vocab_size);
    SPADE_CHECK(batch.positions[t] >= 0 && batch.positions[t] < cfg_.max_position_embeddings,
                "forward: position {} is past max_position_embeddings {}", batch.positions[t],
                cfg_.max_position_embeddings);
  }

  std::vector<float> x(static_cast<size_t>(T) * H), h(static_cast<size_t>(T) * H);
  std::vector<float> qkv(static_cast<size_t>(T) * QKV), q(static_cast<size_t>(T) * Q), k(static_cast<size_t>(T) * KV),
      v(static_cast<size_t>(T) * KV), attn(static_cast<size_t>(T) * Q), proj(static_cast<size_t>(T) * H);
  std::vector<float> gu(static_cast<size_t>(T) * 2 * I), act(static_cast<size_t>(T) * I);

  for (int t = 0; t < T; ++t)
    std::memcpy(&x[static_cast<size_t>(t) * H], &w_.embed[static_cast<size_t>(batch.tokens[t]) * H], H * sizeof(float));

  for (int l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& L = w_.layers[l];
    // --- attention block ---
    kernels::rmsnorm_ref(x.data(), L.attn_norm.data(), h.data(), T, H, cfg_.rms_norm_eps);
    kernels::linear_ref(h.data(), L.qkv_w.data(), L.qkv_b.empty() ? nullptr : L.qkv_b.data(), qkv.data(), T, QKV, H);
    for (int t = 0; t < T; ++t) {
      const float* row = &qkv[static_cast<size_t>(t) * QKV];
      std::memcpy(&q[static_cast<size_t>(t) * Q], row, Q * sizeof(float));
      std::memcpy(&k[static_cast<size_t>(t) * KV], row + Q, KV * sizeof(float));
      std::memcpy(&v[static_cast<size_t>(t) * KV], row + Q + KV, KV * sizeof(float));
    }
    if (cfg_.qk_norm) {  // Qwen3: per-head RMSNorm of q and k before RoPE
      kernels::rmsnorm_ref(q.data(), L.q_norm.data(), q.data(), T * cfg_.num_q_heads, D, cfg_.rms_norm_eps);
      kernels::rmsnorm_ref(k.data(), L.k_norm.data(), k.data(), T * cfg_.num_kv_heads, D, cfg_.rms_norm_eps);
    }
    kernels::rope_ref(q.data(), batch.positions.data(), T, cfg_.num_q_heads, D, D, cfg_.rope_theta);
    kernels::rope_ref(k.data(), batch.positions.data(), T, cfg_.num_kv_heads, D, D, cfg_.rope_theta);
    attention.attend(l, batch, q.data(), k.data(), v.data(), attn.data());
    kernels::linear_ref(attn.data(), L.o_w.data(), L.o_b.empty() ? nullptr : L.o_b.data(), proj.data(), T, H, Q);
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

// The CPU forward pass (fp32) of dense decoder-only transformers: Llama, Qwen2, Qwen3.
//
// One forward() runs a ragged batch: any mix of prefill chunks and single-token decode steps of different
// sequences (continuous batching). New K/V are written into a paged KV cache (common/page_allocator.h layout)
// before attention, so a sequence's prefill can be split into chunks.
//
// Attention is delegated per layer to an AttentionBackend so the sparse path (inference rank ⇄ cache rank,
// docs/ARCHITECTURE.md) can replace dense paged attention without touching the rest of the layer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "inference_rank/weights.h"

namespace spade {

/// KV storage for every layer: k(layer), v(layer) are [num_pages, page_size, num_kv_heads, head_dim] fp32.
class KvCache {
 public:
  KvCache(const ModelConfig& cfg, int num_pages, int page_size);
  int num_pages() const { return num_pages_; }
  int page_size() const { return page_size_; }
  float* k(int layer) { return k_[layer].get(); }
  float* v(int layer) { return v_[layer].get(); }
  const float* k(int layer) const { return k_[layer].get(); }
  const float* v(int layer) const { return v_[layer].get(); }
  /// Bytes of KV storage (both K and V, all layers).
  size_t bytes() const { return bytes_; }
  /// Bytes one page takes across all layers (K and V).
  static size_t page_bytes(const ModelConfig& cfg, int page_size);

 private:
  int num_pages_;
  int page_size_;
  size_t bytes_ = 0;
  // Uninitialised on purpose: the OS maps pages on first touch, so a large pool costs nothing until used.
  std::vector<std::unique_ptr<float[]>> k_, v_;
};

/// One ragged batch. Sequence b contributes tokens[cu_q_lens[b] .. cu_q_lens[b+1]) at positions
/// seq_lens[b] - q_len .. seq_lens[b] - 1; its pages are block_table[b * max_pages ..].
struct ForwardBatch {
  std::vector<int32_t> tokens;       // [total_tokens] input ids
  std::vector<int32_t> positions;    // [total_tokens] absolute positions
  std::vector<int32_t> cu_q_lens;    // [batch + 1]
  std::vector<int32_t> seq_lens;     // [batch] context length after this step
  std::vector<int32_t> block_table;  // [batch, max_pages]
  std::vector<uint64_t> seq_ids;     // [batch] request ids (for backends that keep per-sequence state)
  int max_pages = 0;
  std::vector<int32_t> logit_rows;   // token indices (into tokens) whose logits are wanted, in output order
  int batch() const { return static_cast<int>(seq_lens.size()); }
  int total_tokens() const { return static_cast<int>(tokens.size()); }
};

/// Per-layer attention. q: [total_tokens, num_q_heads, head_dim], k/v: [total_tokens, num_kv_heads, head_dim]
/// (RoPE applied to q and k); out: [total_tokens, num_q_heads, head_dim].
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
                      float* out) = 0;
  /// Called when a sequence leaves the batch (finished, aborted or failed), so per-sequence state can be freed.
  virtual void on_release(uint64_t /*seq_id*/) {}
  /// Sequences the backend could not serve in the last forward (e.g. their cache rank died), with the reason. The
  /// engine ends them with FinishReason::Error and discards their logits.
  virtual std::vector<std::pair<uint64_t, std::string>> take_failures() { return {}; }
  /// Token range [begin, end) of `seq_id` that this backend will never read locally again, for a context that has
  /// reached `seq_len` (sparse sequences: everything between the sink tokens and the next step's local window).
  /// The engine frees the pages inside it. Default: nothing.
  virtual std::pair<int, int> droppable_range(uint64_t /*seq_id*/, int /*seq_len*/) { return {0, 0}; }
};

/// Dense attention: appends k/v into the paged KvCache, then kernels::paged_attention_ref over the full context.
class DensePagedAttention : public AttentionBackend {
 public:
  DensePagedAttention(const ModelConfig& cfg, KvCache& cache) : cfg_(cfg), cache_(cache) {}
  void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
              float* out) override;

 private:
  const ModelConfig& cfg_;
  KvCache& cache_;
};

/// Writes the batch's new k/v rows ([total_tokens, num_kv_heads, head_dim]) into one layer's paged K/V storage.
void write_kv_pages(const ForwardBatch& batch, const float* k, const float* v, float* k_cache, float* v_cache,
                    int page_size, int kv_dim);

class Model {
 public:
  /// Loads config.json + safetensors from a Hugging Face checkpoint directory. Throws spade::Error naming the file.
  static std::unique_ptr<Model> load(const std::string& dir);
  /// A model of `cfg` with deterministic random weights (weights.h random_source).
  static std::unique_ptr<Model> random(const ModelConfig& cfg, uint64_t seed);
  Model(ModelConfig cfg, ModelWeights w) : cfg_(std::move(cfg)), w_(std::move(w)) {}

  const ModelConfig& config() const { return cfg_; }
  /// Parameters (elements), embeddings included once when tied.
  size_t num_params() const;

  /// Runs the batch through every layer. logits: resized to [batch.logit_rows.size(), vocab] fp32.
  /// Throws spade::Error for token ids outside the vocabulary or positions past max_position_embeddings.
  void forward(const ForwardBatch& batch, AttentionBackend& attention, std::vector<float>& logits) const;

 private:
  ModelConfig cfg_;
  ModelWeights w_;
};

}  // namespace spade

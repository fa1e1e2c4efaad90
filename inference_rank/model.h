// The CPU forward pass (fp32) of decoder-only transformers: dense Llama, Qwen2, Qwen3, and the hybrid Qwen3.5 text
// model (Gated DeltaNet "linear_attention" layers + gated "full_attention" layers, dense MLP; common/config.h).
//
// One forward() runs a ragged batch: any mix of prefill chunks and single-token decode steps of different
// sequences (continuous batching). New K/V are written into a paged KV cache (common/page_allocator.h layout)
// before attention, so a sequence's prefill can be split into chunks.
//
// Attention is delegated per full-attention layer to an AttentionBackend so the sparse path (inference rank ⇄ cache
// rank, docs/ARCHITECTURE.md) can replace dense paged attention without touching the rest of the layer. Backends and
// the KvCache see ModelConfig::attention_view(): layer index i = the i-th full-attention layer.
//
// Linear-attention (GDN) layers keep per-sequence state in a GdnStatePool slot instead of KV pages: the conv state
// (the last K-1 inputs of the causal conv1d) and the recurrent state S [Hv, d_k, d_v] fp32, updated in place by each
// step (kernels/causal_conv1d_ref.h, kernels/gdn_ref.h gdn_recurrent_ref). A chunk starting at position 0 starts from
// a zero state; a later chunk continues the state the previous step of the same slot left, so chunked prefill and
// decode give the same outputs as one pass (docs/GDN.md "Model path").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "inference_rank/weights.h"
#include "kernels/paged_attention_ref.h"

namespace spade {

class PageAllocator;  // common/page_allocator.h

/// KV storage for every full-attention layer: k(layer), v(layer) are [num_pages, page_size, num_kv_heads, head_dim]
/// fp32, layer = the attention-layer index 0..cfg.num_attention_layers()-1 (all layers of a dense model).
class KvCache {
 public:
  /// `cfg`: the model config or its attention_view() (both give the same cache).
  KvCache(const ModelConfig& cfg, int num_pages, int page_size);
  int num_pages() const { return num_pages_; }
  int page_size() const { return page_size_; }
  float* k(int layer) { return k_[layer].get(); }
  float* v(int layer) { return v_[layer].get(); }
  const float* k(int layer) const { return k_[layer].get(); }
  const float* v(int layer) const { return v_[layer].get(); }
  /// Bytes of KV storage (both K and V, all layers).
  size_t bytes() const { return bytes_; }
  /// Bytes one page takes across all full-attention layers (K and V); 0 for a model without attention layers.
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
  std::vector<int32_t> state_slots;  // [batch] GdnStatePool slot of each sequence (hybrid models; empty otherwise)
  int max_pages = 0;
  std::vector<int32_t> logit_rows;   // token indices (into tokens) whose logits are wanted, in output order
  int batch() const { return static_cast<int>(seq_lens.size()); }
  int total_tokens() const { return static_cast<int>(tokens.size()); }
};

/// Per-layer attention. q: [total_tokens, num_q_heads, head_dim], k/v: [total_tokens, num_kv_heads, head_dim]
/// (RoPE applied to q and k); out: [total_tokens, num_q_heads, head_dim]. `layer` is the attention-layer index
/// (0..num_attention_layers()-1; every layer of a dense model).
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
                      float* out) = 0;
  /// Called when a sequence leaves the batch (finished, aborted or failed), so per-sequence state can be freed.
  virtual void on_release(uint64_t /*seq_id*/) {}
  /// Called when `child` starts holding every page of `parent` (n samples: once per sample after the group's shared
  /// prefill, before the group's on_release), so a backend that keeps per-sequence state elsewhere can share it.
  virtual void on_fork(uint64_t /*parent*/, uint64_t /*child*/) {}
  /// Sequences the backend could not serve in the last forward (e.g. their cache rank died), with the reason. The
  /// engine ends them with FinishReason::Error and discards their logits.
  virtual std::vector<std::pair<uint64_t, std::string>> take_failures() { return {}; }
  /// Token range [begin, end) of `seq_id` that this backend will never read locally again, for a context that has
  /// reached `seq_len` (sparse sequences: everything between the sink tokens and the next step's local window).
  /// The engine frees the pages inside it. Default: nothing.
  virtual std::pair<int, int> droppable_range(uint64_t /*seq_id*/, int /*seq_len*/) { return {0, 0}; }
  /// The engine's page allocator (block tables, reference counts, page serials), given by the engine once, before its
  /// first step; not owned, it outlives the backend's steps. A backend that ships KV elsewhere uses it to tell which
  /// sequences share pages (the sparse backend's shared INIT). Default: ignored.
  virtual void set_page_allocator(const PageAllocator* /*pages*/) {}
  /// Prefix cache: of the cached pages `pages` (in token order) that a new sequence `seq_id`'s prompt matches, the
  /// tokens this backend can serve from the start (whole pages; the engine reuses at most that many and computes the
  /// rest). A backend whose KV lives elsewhere answers what that place still holds (the GPU pair: a prefix its cache
  /// rank retained). Default: all of them.
  virtual int reusable_prefix_tokens(uint64_t /*seq_id*/, const std::vector<int32_t>& /*pages*/) { return 1 << 30; }
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

/// The arguments of kernels::paged_attention_ref for `layer` of `cache`, the sequences of `batch` (q [total_tokens,
/// num_q_heads, head_dim] fp32 -> out, same shape): the model's heads and head_dim, softmax scale 1/sqrt(head_dim),
/// the layer's K/V pages, `batch`'s block table, q lengths and context lengths. A caller attending a subset points
/// q / out / cu_q_lens / seq_lens / block_table / batch at it.
kernels::PagedAttentionParams paged_attention_params(const ModelConfig& cfg, const KvCache& cache, int layer,
                                                     const ForwardBatch& batch, const float* q, float* out);

/// Writes the batch's new k/v rows ([total_tokens, num_kv_heads, head_dim]) into one layer's paged K/V storage.
void write_kv_pages(const ForwardBatch& batch, const float* k, const float* v, float* k_cache, float* v_cache,
                    int page_size, int kv_dim);

/// Per-sequence recurrent state of every linear-attention (GDN) layer, in slots (one per running sequence), host
/// fp32. Per GDN layer i (0..cfg.num_linear_layers()-1, in layer order):
///   conv_states(i):      [num_slots, conv_dim, K - 1]  the last K-1 conv inputs, oldest first (causal_conv1d_ref.h)
///   recurrent_states(i): [num_slots, Hv, d_k, d_v]      the gated-delta-rule state S (gdn_ref.h, transformers layout)
/// Lifecycle: allocate() when a sequence is admitted, release() when it leaves. A slot's state is defined only after
/// a forward step starting at position 0 (which zeroes it); the pool tracks how many tokens each slot has consumed
/// and Model::forward rejects a step that does not continue exactly there, so a state can never be carried into
/// another request or skip tokens. Memory is allocated uninitialised (touched on first use). Not thread-safe.
class GdnStatePool {
 public:
  /// Throws spade::Error when num_slots < 1.
  GdnStatePool(const ModelConfig& cfg, int num_slots);
  int num_slots() const { return num_slots_; }
  int num_free() const { return static_cast<int>(free_.size()); }
  bool in_use(int slot) const;
  /// Takes the lowest free slot; its state is undefined until a step at position 0. Throws spade::Error when every
  /// slot is in use.
  int allocate();
  /// Returns a slot to the pool. Throws spade::Error for a slot that is not in use.
  void release(int slot);
  /// Tokens the slot's state has consumed (its context length); -1 before the first step or after a failed one.
  int64_t seq_len(int slot) const;
  /// Model::forward bookkeeping: zero the state of `slot` in every layer (a sequence at position 0) / record the
  /// context length its state now reflects (-1 = undefined).
  void reset(int slot);
  void set_seq_len(int slot, int64_t len);
  float* conv_states(int gdn_layer) { return conv_[static_cast<size_t>(gdn_layer)].get(); }
  float* recurrent_states(int gdn_layer) { return ssm_[static_cast<size_t>(gdn_layer)].get(); }
  /// Floats of one slot's conv state / recurrent state in one layer.
  size_t conv_floats() const { return conv_floats_; }
  size_t recurrent_floats() const { return ssm_floats_; }
  /// Bytes of one slot across all GDN layers (conv + recurrent state).
  static size_t slot_bytes(const ModelConfig& cfg);
  size_t bytes() const { return slot_bytes_ * static_cast<size_t>(num_slots_); }

 private:
  int num_slots_;
  size_t conv_floats_ = 0, ssm_floats_ = 0, slot_bytes_ = 0;
  std::vector<std::unique_ptr<float[]>> conv_, ssm_;
  std::vector<int32_t> free_;    // free slots, highest first (allocate pops the lowest)
  std::vector<uint8_t> used_;
  std::vector<int64_t> seq_len_;
};

class Model {
 public:
  /// Loads config.json + safetensors from a Hugging Face checkpoint directory (weights.h load_checkpoint_weights: only
  /// regular files, config fields checked against the tensors, no NaN / Inf). Throws spade::Error naming the file,
  /// field or tensor.
  static std::unique_ptr<Model> load(const std::string& dir);
  /// A model of `cfg` with deterministic random weights (weights.h random_source).
  static std::unique_ptr<Model> random(const ModelConfig& cfg, uint64_t seed);
  /// Throws spade::Error when `w` does not match `cfg` (layer count, layer types).
  Model(ModelConfig cfg, ModelWeights w);

  const ModelConfig& config() const { return cfg_; }
  /// The host fp32 weights (e.g. to upload them to the GPU path).
  const ModelWeights& weights() const { return w_; }
  /// Parameters (elements), embeddings included once when tied.
  size_t num_params() const;

  /// Runs the batch through every layer. logits: resized to [batch.logit_rows.size(), vocab] fp32.
  /// `states`: the recurrent-state pool, required for hybrid models (cfg.is_hybrid()), with batch.state_slots
  /// naming each sequence's slot; a chunk starting at position 0 starts from a zero state, any other chunk must
  /// continue at its slot's seq_len(). Throws spade::Error for token ids outside the vocabulary, positions past
  /// max_position_embeddings, a hybrid batch without a pool / state_slots, a slot not in use, used twice, or whose
  /// state does not end where the chunk starts.
  void forward(const ForwardBatch& batch, AttentionBackend& attention, std::vector<float>& logits,
               GdnStatePool* states = nullptr) const;

 private:
  void attention_layer(int layer, int attn_layer, const ForwardBatch& batch, AttentionBackend& attention,
                       const float* h, float* out) const;
  void gdn_layer(int layer, int gdn_layer, const ForwardBatch& batch, GdnStatePool& states, const float* h,
                 float* out) const;

  ModelConfig cfg_;
  ModelWeights w_;
};

}  // namespace spade

// The GPU forward pass of the inference rank (dense Llama / Qwen2 / Qwen3 decoders): bf16 weights and activations on
// one GPU, cuBLASLt GEMMs (kernels/gemm.cuh), the fused layer ops (kernels/layer_ops.cuh: embedding, fused-residual
// RMSNorm, q/k-norm + RoPE + paged KV append, SwiGLU, argmax) and a per-layer attention hook (GpuAttention) that is
// dense paged flash-decoding / prefill (GpuDenseAttention) or the token-sparse paths of the benchmark and the
// disaggregated pipeline (bench/bench_tpot.cu, docs/ARCHITECTURE.md "GPU path").
//
// One forward() runs a ragged batch (continuous batching: any mix of prefill chunks and decode tokens); every
// argument lives in device memory (GpuBatch), nothing is synchronised with the host and no memory is allocated, so
// a decode step can be captured in a CUDA graph (GpuGraph) and replayed with new data copied into the same buffers
// (GpuStepBuffers). Numerics: bf16 storage, fp32 accumulation; the residual stream is fp32 (kernels/layer_ops.cuh
// rmsnorm with residual_dtype F32), norm weights fp32; logits fp32. Agrees with the CPU fp32 path (model.h) to bf16
// round-off (tests/inference_rank/test_gpu_model.cu states the bounds).
//
// Hybrid Qwen3.5 (qwen3_5_text) runs too: Gated DeltaNet layers (in_proj GEMM, GDN gating, causal conv1d with its
// per-sequence state, the recurrent form of kernels/gdn.cuh, gated RMSNorm, out_proj) and gated full-attention layers
// (partial RoPE, sigmoid output gate), with the conv and recurrent states of every GDN layer in fp32 pools on the GPU,
// indexed by GpuBatch::state_slots (a sequence whose step starts at position 0 gets zeroed states first). The KV pool
// then holds the full-attention layers only (GpuKvPool of attention_view().num_layers). The GDN head dims must be
// kernels/gdn.cuh's kGdnHeadDims (64, 128), the attention head dim one of the attention kernels'.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/dtype.h"
#include "kernels/device.h"
#include "kernels/paged_shape.h"
#include "inference_rank/weights.h"

namespace spade {

namespace kernels {
struct SparsePackedDecodeParams;
}  // namespace kernels

/// One ragged step, all pointers device memory. Sequence b owns rows cu_q_lens[b] .. cu_q_lens[b+1]-1 of the token
/// arrays, at positions seq_lens[b] - q_len_b .. seq_lens[b] - 1, and pages block_table[b * max_pages ..].
struct GpuBatch {
  const int32_t* tokens = nullptr;      // [num_tokens] int32 input ids (< vocab; others give zero rows + error flag).
  const int32_t* positions = nullptr;   // [num_tokens] int32 absolute positions.
  const int32_t* seq_idx = nullptr;     // [num_tokens] int32 sequence (block_table row) of each token.
  const int32_t* cu_q_lens = nullptr;   // [batch + 1] int32 prefix sums of query tokens.
  const int32_t* seq_lens = nullptr;    // [batch] int32 context length after this step.
  const int32_t* block_table = nullptr; // [batch, max_pages] int32 page ids (-1 = no page: padding rows).
  const int32_t* logit_rows = nullptr;  // [num_logit_rows] int32 token rows whose logits are computed, in order.
  const int32_t* state_slots = nullptr; // [batch] int32 GDN state slot of each sequence (hybrid models; else null);
                                        // -1: a padding row without state (zero state in, nothing stored).
  int32_t* error_flag = nullptr;        // [1] int32, set to 1 by a bad token id / position / page (zero it first).
  int num_tokens = 0;
  int batch = 0;
  int max_pages = 0;
  int num_logit_rows = 0;
  int max_q_len = 0;    // host bound of the query lengths (1 for a decode-only step).
  int max_seq_len = 0;  // host bound of seq_lens (sizes the split-K grid; a graph uses its bucket's bound).
  bool decode_only() const { return max_q_len == 1 && num_tokens == batch; }
};

/// Host-side image of a step, as the engine builds it (model.h ForwardBatch plus the bounds).
struct GpuStepHost {
  std::vector<int32_t> tokens, positions, seq_idx, cu_q_lens, seq_lens, block_table, logit_rows;
  std::vector<int32_t> state_slots;  // [batch] for hybrid models, else empty
  int max_pages = 0;
  int max_seq_len = 0;  // 0: max(seq_lens)
};

/// Fixed device buffers of steps of up to max_tokens tokens / max_batch sequences over a KV pool of num_pages pages,
/// and a pinned host staging copy: upload() writes a step into the same device addresses every time (so a captured
/// graph reads the new step). num_state_slots > 0: steps carry distinct state_slots in [0, num_state_slots), or -1
/// for padding rows (hybrid models).
class GpuStepBuffers {
 public:
  GpuStepBuffers(int max_tokens, int max_batch, int max_pages, int max_logit_rows, int num_pages,
                 int num_state_slots = 0);
  ~GpuStepBuffers();
  GpuStepBuffers(const GpuStepBuffers&) = delete;
  GpuStepBuffers& operator=(const GpuStepBuffers&) = delete;
  /// Copies `h` (validated: sizes, bounds, page ids in [-1, num_pages); throws spade::Error naming the field) with
  /// one async H2D copy on `stream` and returns the device view. The pinned staging buffer is reused: upload first
  /// waits (host) for the previous upload's copy to finish, never for anything else on the stream.
  GpuBatch upload(const GpuStepHost& h, cudaStream_t stream);
  int32_t* error_flag() const;

 private:
  int max_tokens_, max_batch_, max_pages_, max_logit_rows_, num_pages_, num_state_slots_;
  size_t words_ = 0;
  DeviceBuffer dev_;
  int32_t* pinned_ = nullptr;
  cudaEvent_t copied_ = nullptr;  // recorded after each upload's copy
  bool pending_ = false;
};

/// Device pointers of one layer's step, handed to the attention hook.
struct GpuLayerStep {
  int layer = 0;                // attention-layer index (every layer of a dense model)
  const void* qkv = nullptr;    // [num_tokens, qkv_stride] bf16: the raw fused projection (before q/k norm and
                                // RoPE), q | k | v in the first (Hq + 2 Hkv) * D columns (then Qwen3.5's output
                                // gate): what the disaggregated path ships to the cache rank
  int qkv_stride = 0;           // elements between rows of qkv
  const void* q = nullptr;      // [num_tokens, Hq, D] bf16 after q-norm and RoPE
  void* k_cache = nullptr;      // this layer's [num_pages, page_size, Hkv, D] bf16 (the step's K/V already appended)
  void* v_cache = nullptr;
  void* out = nullptr;          // [num_tokens, Hq, D] bf16, to be written completely by the hook
};

/// Per-layer attention of GpuModel::forward: called after the layer's K/V were appended to the pool, on the model's
/// stream. Implementations must stay asynchronous and graph-capturable (no host sync, no allocation).
class GpuAttention {
 public:
  virtual ~GpuAttention() = default;
  virtual void attend(const GpuLayerStep& step, const GpuBatch& batch, cudaStream_t stream) = 0;
  /// Optional, called (host, while enqueuing) right before full-attention layer `layer`'s q/k norm + RoPE + append:
  /// where that kernel also writes each token's processed q | k | v row (RopeKvAppendParams::row_out), e.g. a layer
  /// pack's send buffer of the disaggregated path, with `*stride` elements between rows (0 = packed). The hook may
  /// enqueue waits on `stream` (the buffer's previous send). Default: nowhere.
  virtual void* rows_out(int layer, cudaStream_t stream, int* stride) {
    (void)layer;
    (void)stream;
    *stride = 0;
    return nullptr;
  }
};

/// The paged-KV geometry of a step's attention-layer launches: the step's sequences and block-table width, the
/// model's heads, the KV pool's page size (tokens).
inline kernels::PagedAttentionShape attention_shape(const ModelConfig& cfg, const GpuBatch& b, int page_size) {
  kernels::PagedAttentionShape shape;
  shape.batch = b.batch;
  shape.num_q_heads = cfg.num_q_heads;
  shape.num_kv_heads = cfg.num_kv_heads;
  shape.head_dim = cfg.head_dim;
  shape.page_size = page_size;
  shape.max_pages_per_seq = b.max_pages;
  return shape;
}

/// Fills the fields the paged attention launchers share (kernels/attention.cuh PagedDecodeParams,
/// PagedPrefillParams, SparsePackedDecodeParams) from a layer step: q, caches, block table, seq_lens, out, the
/// step's attention_shape and the 1/sqrt(head_dim) softmax scale.
template <typename Params>
void fill_attention_params(Params& p, const ModelConfig& cfg, const GpuLayerStep& s, const GpuBatch& b,
                           int page_size) {
  p.q = s.q;
  p.k_cache = s.k_cache;
  p.v_cache = s.v_cache;
  p.block_table = b.block_table;
  p.seq_lens = b.seq_lens;
  p.out = s.out;
  p.attention_shape() = attention_shape(cfg, b, page_size);
  p.scale = 1.f / std::sqrt(static_cast<float>(cfg.head_dim));
}

/// The attention of a step with sparse rows that read gathered K/V (the caller set `a`'s packed_k / packed_v /
/// num_packed / local_windows / packed_rows / packed_capacity / workspace; this fills the rest): in a decode-only step
/// one sparse_decode_attention_packed launch over the whole batch (a dense row has num_packed 0 and its whole context
/// as window); in a mixed step the causal prefill kernel serves every row but the sparse ones (`skip` [batch] int32,
/// non-zero: not served) and the packed kernel only those, at their token rows (`q_rows` [batch] int32, -1: not a
/// sparse row). Which row goes where is data, not launch structure. `local_window`: R. `what` names the caller in a
/// launch error (spade::Error).
void attend_packed_rows(kernels::SparsePackedDecodeParams& a, const ModelConfig& cfg, const GpuLayerStep& s,
                        const GpuBatch& b, int page_size, int local_window, const int32_t* q_rows,
                        const int32_t* skip, cudaStream_t stream, const char* what);

/// Dense attention over the whole paged context: split-K flash-decoding for decode-only steps, the causal
/// FlashAttention-2-style kernel otherwise (kernels/attention.cuh).
class GpuDenseAttention : public GpuAttention {
 public:
  GpuDenseAttention(const ModelConfig& cfg, int page_size, int max_batch);
  void attend(const GpuLayerStep& step, const GpuBatch& batch, cudaStream_t stream) override;

 private:
  ModelConfig cfg_;
  int page_size_, max_batch_;
  DeviceBuffer workspace_;
};

struct GpuModelOptions {
  int max_tokens = 512;      // largest num_tokens of a step (activation buffers are sized by it)
  int max_logit_rows = 256;  // largest num_logit_rows
  int max_state_slots = 0;   // hybrid models: GDN state slots (sequences running at once + scratch), >= 1
};

class GpuModel {
 public:
  /// Uploads host fp32 weights (weights.h load_weights) as bf16 (norm weights fp32). Throws spade::Error for an
  /// architecture the GPU path does not run, a head_dim the attention kernels lack, a tensor whose size does not
  /// match `cfg` (named), or an allocation failure.
  static std::unique_ptr<GpuModel> upload(const ModelConfig& cfg, const ModelWeights& w, GpuModelOptions opts);
  /// Deterministic random bf16 weights generated on the GPU (--random-weights): matrices uniform with the variance
  /// of N(0, 1/fan_in), embeddings unit variance, norm weights 1 + 0.1 u, biases 0.1 u (kernels/tensor_ops.cuh
  /// random_fill; not the same numbers as weights.h random_source). Any config size the GPU memory holds.
  static std::unique_ptr<GpuModel> random(const ModelConfig& cfg, uint64_t seed, GpuModelOptions opts);
  ~GpuModel();

  const ModelConfig& config() const { return cfg_; }
  const GpuModelOptions& options() const { return opts_; }
  /// Bytes of all weights on the GPU (the allocation).
  size_t weight_bytes() const { return weight_bytes_; }
  /// Weight bytes one decode step of `rows` sequences reads: every weight once, except an untied embed_tokens table,
  /// of which only the `rows` gathered rows (bf16) are read (a tied table is read whole as the LM head).
  size_t decode_weight_bytes(int rows) const {
    return weight_bytes_ - untied_embed_bytes_ +
           (untied_embed_bytes_ > 0 ? static_cast<size_t>(rows) * cfg_.hidden_size * 2 : 0);
  }

  /// Runs the step through every layer: appends each full-attention layer's K/V to `kv` (positions / block table of
  /// `batch`), calls `attention` per full-attention layer (GpuLayerStep::layer = its index among them), runs the GDN
  /// layers on the state slots of `batch`, and writes logits() for batch.logit_rows. Asynchronous on `stream`.
  /// Throws spade::Error when the batch exceeds the options, max_seq_len exceeds the block table's reach
  /// (max_pages * page_size), the KV pool's geometry does not match the model, or a hybrid batch has no
  /// state_slots.
  void forward(const GpuBatch& batch, GpuKvPool& kv, GpuAttention& attention, cudaStream_t stream);
  /// Launches each cuBLASLt kernel that any step of up to max_tokens rows (max_logit_rows for lm_head) would use
  /// once, on the activation buffers (kernels/gemm.cuh GemmRunner::warm_up_rows: a first launch mid-step may stall
  /// while another rank of this process has a receive pending), and waits for `stream`. Returns the launches.
  int warm_up_gemms(cudaStream_t stream);
  /// [max_logit_rows, vocab] fp32; the first batch.num_logit_rows rows hold the last forward's logits.
  const float* logits() const { return logits_.as<float>(); }
  /// Greedy tokens of the last forward's logit rows into out[rows] (device int32).
  void argmax(int rows, int32_t* out, cudaStream_t stream) const;
  /// Bytes of the GDN state pools (0 for a dense model).
  size_t state_bytes() const { return conv_pool_.bytes() + rec_pool_.bytes(); }

 private:
  struct Layer {
    LayerType type = LayerType::FullAttention;
    int index = 0;  // among the layers of its type (attention layer / GDN layer)
    // GDN layers
    void* in_proj_w = nullptr;   // [conv_dim + value_dim + 2 Hv, hidden] bf16
    float* conv_w = nullptr;     // [conv_dim, K] fp32
    float* a_log = nullptr;      // [Hv] fp32
    float* dt_bias = nullptr;    // [Hv] fp32
    float* gated_norm = nullptr; // [d_v] fp32
    void* out_proj_w = nullptr;  // [hidden, value_dim] bf16
    // every layer
    float* attn_norm = nullptr;
    float* mlp_norm = nullptr;
    float* q_norm = nullptr;
    float* k_norm = nullptr;
    void* qkv_w = nullptr;
    void* qkv_b = nullptr;
    void* o_w = nullptr;
    void* o_b = nullptr;
    void* gate_up_w = nullptr;
    void* gate_up_b = nullptr;
    void* down_w = nullptr;
    void* down_b = nullptr;
  };
  GpuModel(const ModelConfig& cfg, GpuModelOptions opts);
  void allocate_weights();
  void allocate_activations();
  // A full-attention layer after its qkv projection: q/k norm + RoPE + KV append, the attention hook, the output gate.
  void kv_layer(const Layer& L, const GpuBatch& b, GpuKvPool& kv, GpuAttention& attention, int qkv_cols,
                cudaStream_t stream);

  ModelConfig cfg_;
  GpuModelOptions opts_;
  size_t weight_bytes_ = 0;
  size_t untied_embed_bytes_ = 0;  // the embed_tokens table's allocation when the LM head has its own, else 0
  DeviceBuffer weights_;  // every tensor, sub-allocated (256-byte aligned)
  std::vector<Layer> layers_;
  void* embed_ = nullptr;
  void* lm_head_ = nullptr;  // == embed_ when tied
  float* final_norm_ = nullptr;
  // activations
  DeviceBuffer residual_, x_, h_, qkv_, q_, attn_, gate_up_, act_, sel_, logits_;
  // GDN layers: fused in_proj output, conv outputs q / k / v, beta / g, core output, its gated norm; state pools
  // [gdn layers, max_state_slots, ...] fp32
  DeviceBuffer gproj_, gq_, gk_, gv_, gbeta_, gg_, gcore_, gnormed_, conv_pool_, rec_pool_;
  struct Gemm;
  std::unique_ptr<Gemm> gemm_;
};

/// A CUDA graph of one captured stream sequence, replayed with launch(). The captured work must only read and
/// write fixed device addresses (GpuStepBuffers, the model's buffers).
class GpuGraph {
 public:
  GpuGraph() = default;
  ~GpuGraph();
  GpuGraph(const GpuGraph&) = delete;
  GpuGraph& operator=(const GpuGraph&) = delete;
  /// Captures `work(stream)` (cudaStreamCaptureModeThreadLocal) and instantiates it. Throws spade::Error.
  void capture(cudaStream_t stream, const std::function<void(cudaStream_t)>& work);
  void launch(cudaStream_t stream) const;
  /// Uploads the instantiated graph's work to the device ahead of its first launch on `stream` (cudaGraphUpload), so
  /// that the first launch does no set-up of its own. Throws spade::Error.
  void upload(cudaStream_t stream) const;
  bool captured() const { return exec_ != nullptr; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace spade

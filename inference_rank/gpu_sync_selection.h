// The synchronous selection references on the GPU path: `inference_rank --device cuda --selection oracle|quest`.
// The fidelity baselines the asynchronous (predicted) selection is measured against, with the CPU path's semantics
// (inference_rank/sparse_attention.h) and no cache rank: at each sparse decode step, every full-attention layer
// selects with the TRUE query of this step, then attends the selection plus the local window.
//   oracle: exact token top-k per KV head (kernels/selection.cuh score_tokens on the bf16 cache + topk_select, with
//           the pair's GQA rule and successor expansion; no prompt anchors, they are the prediction's);
//   quest:  Quest-style page top-k (kernels/selection.cuh quest_select: per-page min / max keys scored with the true
//           query, the best pages whole up to the budget; Tang et al., ICML 2024).
// The selected K/V rows are gathered into [max_batch, num_kv_heads, token_budget, head_dim] bf16 and attended with
// the local window by the kernel the predicted path uses (attention.cuh sparse_decode_attention_packed).
//
// Which row is sparse when: SparseStepPlanner's phases (sparse_planner.h), as for the predicted path: a sequence turns
// sparse at its first decode step at or past the threshold (that step still dense, as the predicted path's first
// selection is computed during it) and attends sparsely from the next step on, in decode-only and mixed steps alike;
// the candidates are [0, context - local_window) (no sink tokens, as the GPU path has none). Nothing is dropped: the
// references read the whole context from this rank's pages, which therefore hold every context in full (and may be
// shared: prefix cache, n samples).
//
// Cost: a reference, not a serving mode. Sparse steps run eagerly (no CUDA graph); per layer the selection reads
// every candidate key of every sparse row. Scratch: [max_batch, num_kv_heads, max_model_len] fp32 token scores
// (oracle) or per-page scores (quest), and the gathered rows.
// Errors: the constructor throws spade::Error for options out of range (a budget of 0, sink tokens, a model context
// of more than kMaxQuestPages pages in quest mode) or an allocation failure; a launch failure throws from the step.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "inference_rank/gpu_step_attention.h"
#include "inference_rank/model.h"
#include "inference_rank/selection_mode.h"
#include "inference_rank/sparse_planner.h"

namespace spade {

class GpuSyncSelection : public AttentionBackend, public GpuStepAttention {
 public:
  /// `attn_cfg`: the model's attention view. `opts` (copied): gpu_sparse_options of the pair's settings and the
  /// engine's options (its threshold, budget k, local window R, max_first_per_step, GQA rule, successor expansion;
  /// not its delta capacity or pack size). `mode`: SelectionMode::Oracle or SelectionMode::Quest. `page_size`,
  /// `max_batch`, `max_model_len`: the engine's (GpuEngineForward::max_batch()).
  GpuSyncSelection(const ModelConfig& attn_cfg, const GpuSparseOptions& opts, SelectionMode mode, int page_size,
                   int max_batch, int max_model_len);
  ~GpuSyncSelection() override;
  GpuSyncSelection(const GpuSyncSelection&) = delete;
  GpuSyncSelection& operator=(const GpuSyncSelection&) = delete;

  // ---- Engine side (AttentionBackend) ----
  /// Not used: the GPU forward pass attends through GpuAttention. Throws.
  void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
              float* out) override;
  void on_release(uint64_t seq_id) override;
  /// Per-request overrides, set before the request's first step: `force_dense` keeps it dense; `sparse_threshold`
  /// > 0 replaces the rank's.
  void set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold);

  // ---- GPU forward side (GpuStepAttention) ----
  void begin_step(const ForwardBatch& fb, cudaStream_t stream) override;
  void attend(const GpuLayerStep& step, const GpuBatch& batch, cudaStream_t stream) override;
  void end_step(cudaStream_t stream) override { (void)stream; }
  /// Dense steps only (no sparse row this step).
  bool graph_safe(const ForwardBatch& fb) const override;
  /// True when this step attends sparsely somewhere.
  bool sparse_this_step() const { return sparse_now_; }
  /// (sequence, step) pairs attended sparsely so far, and sequences switched to sparse.
  uint64_t sparse_seq_steps() const { return sparse_seq_steps_; }
  uint64_t switches() const { return switches_; }

 private:
  struct State;
  std::unique_ptr<State> st_;
  bool sparse_now_ = false;
  uint64_t sparse_seq_steps_ = 0, switches_ = 0;
};

}  // namespace spade

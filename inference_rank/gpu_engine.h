// The GPU forward pass behind the continuous-batching Engine (engine.h ForwardFn): `inference_rank --device cuda`.
//
// Each engine step (a ragged ForwardBatch of prefill chunks and decode tokens, block tables from the engine's
// PageAllocator) is uploaded with one copy (GpuStepBuffers), run by GpuModel::forward with dense paged attention
// over a GpuKvPool of the engine's num_pages pages, and its fp32 logits are copied back for the engine's sampler.
// The host waits once per step, for the logits. Decode-only steps replay a CUDA graph captured per batch-size bucket
// (1, 2, 4, ... max_num_seqs): the bucket's padding rows are sequences of one token on a scratch page, so the
// graph's shapes are fixed while the batch's lengths, positions and pages are data. Mixed / prefill steps run eagerly.
// sample() samples on the device (kernels::sample_rows, after the graph) and returns only token ids (plus, for rows
// that ask, the logprobs kernels::logprob_rows computes from the same logits: n + 1 pairs per row).
// Errors (bad token id / position / page flagged on the device, CUDA failures) throw spade::Error naming the step.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <vector>

#include "inference_rank/engine.h"
#include "inference_rank/gpu_model.h"
#include "inference_rank/gpu_step_attention.h"
#include "kernels/sampling_ref.h"  // kernels::LogprobEntry

namespace spade {

struct GpuEngineOptions {
  // The engine's options, normalised (Engine::options(): num_pages and max_model_len set). Read: num_pages (the KV
  // pool, plus one scratch page), page_size, max_num_seqs (graph buckets, GDN state slots), max_num_batched_tokens
  // (activation rows) and max_model_len (the block tables and the graphs' split-K grids).
  EngineOptions engine;
  bool cuda_graphs = true;        // capture decode steps per batch bucket
  // Also decode steps with link operations (a sparse controller whose link is up). Leave it off when the cache rank
  // runs in this process (cache_rank/gpu_local.h): capturing a new graph mid-run may synchronise the context, i.e.
  // wait for the in-process cache rank's pending receive, whose data this thread has yet to send (measured: 5 s
  // link deadline stalls, about one run in two). Two processes do not share a context.
  bool link_graphs = true;
};

/// The GPU options of an engine's options (pass Engine::options(): the normalised num_pages / max_model_len), with
/// link_graphs on.
GpuEngineOptions gpu_engine_options(const EngineOptions& engine, bool cuda_graphs = true);

class GpuEngineForward {
 public:
  /// The activation bounds `model` must have been created with (GpuModel::upload / random).
  static GpuModelOptions model_options(const GpuEngineOptions& opt);
  /// Allocates the KV pool (plus one scratch page for graph padding) and the step buffers on the current device.
  /// Throws spade::Error when a bound is missing.
  GpuEngineForward(std::unique_ptr<GpuModel> model, const GpuEngineOptions& opt);
  ~GpuEngineForward();
  GpuEngineForward(const GpuEngineForward&) = delete;
  GpuEngineForward& operator=(const GpuEngineForward&) = delete;
  /// engine.h ForwardFn: the step's fp32 logits come back to the host.
  void operator()(const ForwardBatch& batch, std::vector<float>& logits);
  /// engine.h ForwardSampleFn: the step, then kernels::sample_rows over its logits on the device; only the sampled
  /// token ids (4 bytes per row) come back, and for rows with RowSampling::logprobs = n >= 0 their logprobs from
  /// kernels::logprob_rows over the same logits (n + 1 pairs of 8 bytes; `logprobs` [rows], others left empty).
  /// What `inference_rank --device cuda` runs.
  void sample(const ForwardBatch& batch, const std::vector<RowSampling>& rows, std::vector<int32_t>& tokens,
              std::vector<TokenLogprobs>& logprobs);
  /// The step attention the forward passes attend with (gpu_step_attention.h), not owned; nullptr = dense. Set before
  /// the first step. Sparse decoding through a cache rank (GpuSparseController, gpu_sparse.h): while its link is up,
  /// decode-only steps with a plan replay a graph per (bucket, controller variant): the controller's waits and
  /// pack-end records are external event nodes inside it, and the sends are enqueued after the launch
  /// (ship_graph_step); mixed and prefill steps run eagerly. After a link failure the controller attends densely and
  /// the dense graphs resume, from the first step without a sequence whose pages were dropped (graph_safe). The
  /// synchronous references (GpuSyncSelection) run their sparse steps eagerly. Replacing one step attention by another
  /// (a replaced cache rank re-paired) drops every captured graph: they bake the old one's buffers and events. Waits
  /// for this engine's stream first.
  void set_sparse(GpuStepAttention* sparse);
  /// Start-up pass (vLLM's profile run, in spirit): every cuBLASLt kernel a step of 1..max_num_batched_tokens rows
  /// can pick, launched once (GpuModel::warm_up_gemms), one eager step of max_num_batched_tokens prompt tokens, then one
  /// decode step per graph bucket (capturing its graph when graphs are on), all on the scratch page, so that every
  /// library's first-use set-up (cuBLASLt kernels and their attributes for these shapes) happens before a cache
  /// rank shares the process: once a cache rank's receive is pending, a call that synchronises with pending copies
  /// stalls until that receive's deadline. Call before set_sparse and before the pair hello. Writes only the scratch
  /// page (the KV pool's extra page) and no GDN state (slot -1). Returns the number of steps run.
  int warm_up();
  const GpuModel& model() const { return *model_; }
  /// Rows of the largest step it runs (max_num_seqs rounded up to its graph bucket): the `max_batch` of a
  /// GpuSparseController paired with it.
  int max_batch() const;
  size_t kv_bytes() const { return kv_.bytes(); }
  /// Decode steps served by a captured graph / run eagerly (tests, stats).
  uint64_t graph_steps() const { return graph_steps_; }
  /// Of graph_steps(): steps with link operations (a plan to the cache rank) replayed as graphs.
  uint64_t link_graph_steps() const { return link_graph_steps_; }
  uint64_t eager_steps() const { return eager_steps_; }

 private:
  void run(const ForwardBatch& batch);     // upload + forward (graph or eager) on stream_
  void finish(const ForwardBatch& batch);  // error flag, wait for the step
  std::unique_ptr<GpuModel> model_;
  GpuEngineOptions opt_;
  int max_rows_ = 0;
  DeviceBuffer sample_params_, sampled_, logprob_entries_;
  std::vector<uint8_t> sample_host_;
  std::vector<kernels::LogprobEntry> logprob_host_;
  int max_pages_;
  GpuKvPool kv_;
  GpuDenseAttention attention_;
  GpuStepAttention* sparse_ = nullptr;
  GpuStepBuffers steps_;
  cudaStream_t stream_ = nullptr;
  std::map<int, std::unique_ptr<GpuGraph>> graphs_;  // by batch bucket
  uint64_t graph_steps_ = 0, eager_steps_ = 0, link_graph_steps_ = 0;
};

}  // namespace spade

// Sparse decoding on the GPU inference rank (AsyncSpade Sec. 4.1): the inference rank's half of the GPU data
// plane of pair/gpu_plan.h, paired with a GpuCacheServer over a GpuLink.
//
// GpuSparseController plugs into the GPU engine in two roles:
//   * GpuAttention of GpuModel::forward: rows_out() puts each full-attention layer's processed q | k | v rows
//     straight into its layer pack's send buffer; attend() serves the sparse rows with
//     kernels/attention.cuh sparse_decode_attention_packed (a sparse sequence attends its held selection + the last
//     local_window tokens): in decode-only steps one launch over the whole batch (per-sequence windows and packed
//     rows; a dense sequence attends its whole context), in mixed prefill + decode steps the prefill kernel for
//     every other row (`skip` leaves the sparse rows out) plus the packed kernel for the sparse rows only, at their
//     token rows (`q_rows`). The routing is per-row data uploaded by begin_step, not launch structure. Steps
//     without sparse rows attend densely. After a pack's last layer it ships the pack.
//   * AttentionBackend of the Engine (on_release, take_failures, droppable_range) and the per-step hooks
//     GpuEngineForward calls: begin_step() decides every sequence's phase, sends the step's plan and uploads the
//     per-row arrays; end_step() posts the receives of the selections the cache rank computes during this step (for
//     the next one) and, on the receive stream, applies each pack's deltas to the held tables once this step's pack
//     has read them.
//
// Per sequence: dense while its context is below the sparse threshold (prefill is always dense); on its first decode
// step at or past it, the plan asks for a full ("first") selection, and from the next step on it decodes sparsely
// (in decode-only and mixed steps alike), with a steady delta (capacity C) per step. At most max_first_per_step
// sequences switch per step, and at most max_sparse_seqs are sparse at once (their held tables: [table slot][layer]
// [KV head][budget][head_dim] K and V). Every token of every sequence is shipped, so the cache rank holds every
// context in full.
//
// Page dropping: from the step that requests its first selection on, droppable_range() hands the engine
// [0, len + 1 - local_window) of a sparse sequence (the CPU path's rule without sink tokens): the engine frees the
// pages inside it (Engine::step), so this rank keeps only the local window of a sparse sequence (its block-table
// entries of dropped pages are -1, and the freed pages go to other requests). A dropped sequence is never attended
// densely again: the dense kernels never see its rows (prefill `skip`, or the packed kernel in decode-only steps,
// which reads only the window's pages).
//
// Failure: when the link fails (also in the middle of a step: a send or receive that throws is caught), every sparse
// (or switching) sequence fails with the link's reason (take_failures); the others, and all later requests, decode
// densely; no plan is sent any more. A step that overlapped the failure waits at most the link's op_timeout (its
// streams are released). Rows of dropped sequences in that last step attend only their local window (packed kernel,
// in-bounds reads only; their logits are discarded). close() fails the sparse sequences the same way.
//
// Layer shards (pair/gpu_shard.h): with N links (one per GPU cache rank), every link gets every plan, model pack
// p's rows go to links[p mod N] and its selections come back from it, all on the same up and down streams in pack
// order as with one link (each shard sees its packs as its own packs 0..n-1). One shard's link failing fails the
// pair as one link does (every sparse sequence has KV on every shard); the other shards' links are aborted with it,
// so that none is left in the middle of a step.
//
// n samples (Engine::submit_samples): the samples hold the group prefill's prompt pages here and fork its slot on the
// cache rank (sparse_planner.h, Forks), so the prompt is computed, shipped and stored once on both ranks. Prefix
// caching (the engine's, with GpuSparseOptions::max_retained_prefix_tokens > 0): the cache rank retains the prefixes
// of ended sequences and a prompt that hits the prefix cache forks one (sparse_planner.h, Retained prefixes); a
// cached prefix the cache rank does not hold is computed again.
//
// Lifetime on the link: send_hello() first, then one plan per step (and, between steps with the engine idle, the
// flush plans of idle_flush()), then close() (the close plan), after which the cache rank leaves nothing pending.
//
// CUDA graphs: a decode-only step with a plan on a healthy link runs as a graph per (batch bucket, per-row arrays'
// parity, sparse or dense attention). Inside it, the waits for a pack buffer's previous send and for this step's
// selections, and the pack-end records, are external event nodes that act at every replay; the engine then enqueues
// the sends (ship_graph_step). Which rows are sparse, their windows and selection sizes are per-row data. Mixed and
// prefill steps run eagerly. The engine does this only when the cache rank is another process
// (GpuEngineOptions::link_graphs).
//
// Limits (docs/ARCHITECTURE.md): sink tokens are not special-cased (they compete in the top-k and are dropped like any other token); the token budget is the
// rank's for every request.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pair/gpu_plan.h"
#include "inference_rank/engine.h"
#include "inference_rank/gpu_model.h"
#include "inference_rank/gpu_step_attention.h"
#include "inference_rank/model.h"
#include "inference_rank/sparse_planner.h"
#include "transport/gpu_link.h"

namespace spade {

struct GpuSparseStats {
  uint64_t steps = 0;
  uint64_t sparse_steps = 0;          // steps that attended some row sparsely (decode-only or mixed)
  uint64_t sparse_seq_steps = 0;      // (sequence, step) pairs decoded sparsely
  uint64_t switches = 0;              // first selections requested
  uint64_t failed_seqs = 0;           // sequences failed with the link (or by close())
  uint64_t dropped_seqs = 0;          // sequences whose KV outside the local window was handed to the engine to free
                                      // (the pages it freed: EngineStats::dropped_pages)
  uint64_t bytes_sent = 0, bytes_received = 0;
  uint64_t retained_reused_tokens = 0;  // prompt tokens started from a retained prefix (not shipped again)
  uint64_t idle_flushes = 0;            // flush plans sent between steps (idle_flush)
};

class GpuSparseController : public AttentionBackend, public GpuStepAttention {
 public:
  /// `attn_cfg`: the model's attention view. `opts` (copied): gpu_sparse_options of the pair's settings and the
  /// engine's options. `link`: the inference side of the pair, kept alive by the caller. `page_size`, `max_batch`: the
  /// engine's (dense attention and workspace sizing). Throws spade::Error for bad options (a budget above
  /// kernels::kMaxDeltaBudget, sink tokens, ...) or an allocation failure.
  GpuSparseController(const ModelConfig& attn_cfg, const GpuSparseOptions& opts, transport::GpuLink& link,
                      int page_size, int max_batch);
  /// Layer shards: `links[s]` goes to the cache rank of shard s (pair/gpu_shard.h), all on one GPU, kept alive by
  /// the caller. Throws spade::Error as above, and for no link, a null link, links on different GPUs, or more links
  /// than layer packs (naming --layers-per-pack).
  GpuSparseController(const ModelConfig& attn_cfg, const GpuSparseOptions& opts,
                      std::vector<transport::GpuLink*> links, int page_size, int max_batch);
  ~GpuSparseController() override;

  // ---- Engine side (AttentionBackend) ----
  /// Not used: the GPU forward pass attends through GpuAttention. Throws.
  void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
              float* out) override;
  void on_release(uint64_t seq_id) override;
  std::vector<std::pair<uint64_t, std::string>> take_failures() override;
  /// [0, seq_len + 1 - local_window) (clamped at 0) for a sequence whose first selection was requested (it decodes
  /// sparsely from its next step on), else {0, 0}; nothing once the link failed or was closed. The engine frees the
  /// pages entirely inside it; from then on the sequence is never attended densely (gpu_sparse.h, page dropping).
  std::pair<int, int> droppable_range(uint64_t seq_id, int seq_len) override;
  /// n samples: the sample starts from the group's prompt on the cache rank too (sparse_planner.h, Forks): the
  /// next plan forks it there, and its prompt is not shipped again.
  void on_fork(uint64_t parent, uint64_t child) override;
  /// The engine's allocator: the planner records pages for retained prefixes (sparse_planner.h).
  void set_page_allocator(const PageAllocator* pages) override;
  /// Prefix caching (sparse_planner.h, Retained prefixes): what a retained prefix on the cache rank still holds of
  /// `pages`; 0 with retention off; everything once the link failed.
  int reusable_prefix_tokens(uint64_t seq_id, const std::vector<int32_t>& pages) override;
  /// Retained prefixes: the planner's counters (sparse_planner.h).
  const SparseStepPlanner::RetentionStats& retention_stats() const;
  /// Retained prefixes: the distinct pages the cache rank holds for them once the planned retains and drops are
  /// applied (SparseStepPlanner::retained_pages).
  int retained_pages() const;
  /// Per-request overrides, set before the request's first step: `force_dense` keeps it dense; `sparse_threshold`
  /// > 0 replaces the rank's.
  void set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold);
  /// A sequence the engine ran before this controller's cache rank was paired (rejoin): dense to its end, and the
  /// new cache rank holds only its tokens from its next step on (SparseStepPlanner::detach).
  void detach(uint64_t seq_id);

  /// Sends the pair hello (make_gpu_pair_hello) as the link's first message and waits until it left (at most the
  /// link's op_timeout); with layer shards each link gets pair::shard_gpu_hello (its shard's layer count), one after
  /// the other, and a failure aborts every link. Call once, after construction and before the first step: every CUDA call that synchronises
  /// the whole device (allocation of this controller included) must happen before the cache rank can post its first
  /// receive when both ranks share a process. Throws spade::Error naming the peer if the link fails.
  void send_hello(const pair::GpuPairHello& hello);
  /// Ends the stream (the close plan) so that the cache rank posts nothing more, and waits for this side's
  /// transfers. Idempotent; a no-op on a failed link; the destructor calls it. The sparse sequences still running
  /// fail (take_failures: "... failed: the link to it was closed"), as their dropped pages are gone; later steps
  /// decode densely.
  void close();
  /// Between steps, with the engine idle: sends the flush plan (pair/gpu_plan.h) when releases, retains or drops wait
  /// for the next plan, so the cache rank frees ended sequences' pages now rather than at the next request's first
  /// step. Does not wait for the send. A no-op with nothing waiting, a fork waiting (its child has a row to come), no
  /// hello yet, or a failed or closed link; a send that fails fails the link as a step's would (take_failures).
  void idle_flush();

  // ---- GPU forward side ----
  /// Before the step's forward (and its upload): phases, the plan (sent on the link's up stream), the per-row arrays
  /// (uploaded on `stream`). `fb` is the engine's step.
  void begin_step(const ForwardBatch& fb, cudaStream_t stream) override;
  /// After begin_step: true when this decode-only step has a plan on a healthy link, so the engine may run it as a
  /// CUDA graph (graph_variant() says which) followed by ship_graph_step().
  bool link_graph_ok(const ForwardBatch& fb) const override;
  /// The graph a link step needs besides its batch bucket: the per-row arrays' parity (their device address) x
  /// sparse (packed kernel) or dense attention; 0..3.
  int graph_variant() const override;
  /// Rows per layer in the pack send buffers: the step's padded row count when it runs as a graph (default: its
  /// tokens). Call after begin_step, before the forward.
  void set_layout_rows(int rows) override;
  /// While the engine captures a link step's graph: the waits for a pack buffer's previous send and for this step's
  /// selections, and the pack-end records, become external event nodes (they act at each replay), and the sends are
  /// left to ship_graph_step().
  void set_capturing(bool on) override;
  /// After a link step's graph launch: per pack, on the up stream, wait for the graph's pack-end event, compact the
  /// pack's rows to the step's tokens (padding rows dropped) and send them; record the pack's send event. A send
  /// that throws fails the link (take_failures), as in an eager step.
  void ship_graph_step() override;
  void attend(const GpuLayerStep& step, const GpuBatch& batch, cudaStream_t stream) override;
  void* rows_out(int layer, cudaStream_t stream, int* stride) override;
  /// After the step's forward was enqueued: the receives and applies of the next step's selections.
  void end_step(cudaStream_t stream) override;
  /// True when this step attends sparsely somewhere.
  bool sparse_this_step() const { return sparse_now_; }
  /// Whether the step `fb` may run as (or be captured into) a dense CUDA graph (no link operations): once the link
  /// has failed (no plan, no per-step uploads) and no sequence of `fb` had pages dropped (those rows need this
  /// step's per-row arrays).
  bool graph_safe(const ForwardBatch& fb) const override;

  /// True once a link (any shard's) failed.
  bool link_failed() const;
  /// The first failed link's failure() (naming its cache rank); "" while every link is healthy.
  std::string link_failure() const;
  /// Links (layer shards) this controller drives.
  int num_shards() const;
  /// Layer shards: the cache rank of each link, in shard order, as failures name them (default: the links'
  /// peer_name(), which a CUDA IPC link offered before its peer was known does not know). Throws spade::Error for
  /// another count than the links.
  void set_shard_names(std::vector<std::string> names);
  const GpuSparseStats& stats() const { return stats_; }

 private:
  struct State;
  void fail_link(const std::string& why);
  /// A link failed (or refused an operation): with layer shards, aborts every other link; then fail_link(why).
  void link_failure_seen(const std::string& why);
  /// Encodes `plan` into the pinned buffer (after the previous plan's copy) and copies it to the device plan buffer
  /// on the up stream, ready for the links' sends.
  void upload_plan(const pair::GpuStepPlan& plan);
  /// On the up stream: wait for pack p's end, compact its rows (graph steps), send it, record its send event. A send
  /// that throws fails the link and deactivates the step.
  void ship_pack(int p);
  std::unique_ptr<State> st_;
  GpuSparseStats stats_;
  bool sparse_now_ = false;
};

}  // namespace spade

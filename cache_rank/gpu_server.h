// The GPU cache rank (AsyncSpade Sec. 4.1-4.3, Algorithm 1): the full paged KV cache, the query windows and
// the selection pipeline of one inference rank's sequences on one GPU, driven step by step by the plans the inference
// rank sends over a GpuLink (protocol: pair/gpu_plan.h).
//
// Per step (serve_step):
//   1. the plan arrives (this host waits for it; the inference rank never waits for this host);
//   2. bookkeeping: the plan's retains keep a slot's leading pages as a retained prefix (prefix caching); its forks
//      give a child slot the parent slot's pages (n samples), shared by reference count, and its query / anchor
//      windows (copied on the work stream after the upload), or a retained prefix's pages with empty windows (a
//      prefix-cache hit); its drops forget retained prefixes; released / fresh slots lose their pages, windows and
//      mirrors; every row's new tokens get pages (GpuSlotBook, gpu_slot_book.h: a PageAllocator keyed by slot, over a
//      pool of the inference rank's size, so it never runs out where the inference rank did not); one upload of the
//      step's arrays;
//   3. per layer pack p, once its rows arrived: per layer, the rows are appended to the pool (no rotation: they come
//      normed and rotated) and their queries pushed into the (slot, layer) windows; for the plan's SELECT rows, in
//      two groups (steady rows: delta capacity C; first rows: the full budget): their windows gathered, next-query
//      prediction, scoring of every selectable key (positions < context + 1 - local window: the next step's), top-k,
//      the slot plan against the per-slot mirrors (selection_delta), the gather of the entries, one message per
//      non-empty group;
//   4. the next plan's receive is posted (not after the close plan, which ends the stream).
// A flush plan (between the inference rank's steps, pair/gpu_plan.h) has only step 2's retains, drops and released
// slots; no pack follows it, and step 4 comes right after.
// Everything of a step is enqueued without waiting on the GPU (one host wait: the plan). Streams: `up` (receives),
// `work` (append, windows, prediction), `score` (scoring, low priority), `sel` (top-k, delta, gather, mirror resets;
// high priority), `down` (sends); events order them (GpuCacheOptions::pipeline; without it score = sel = work).
//
// The selection follows SelectionConfig as the CPU cache rank (cache_rank/selector.h) does: predictor kind, ridge eps,
// query window, GQA rule, successor expansion, prompt anchors (anchor_queries > 0: each slot's queries go to an anchor
// window [slots][L][Hq][anchor_queries][D] bf16 until its first selection, which picks the anchors from it with
// kernels::select_anchors on the score stream; every selection then sets the anchor spans to +inf before its top-k,
// kernels::apply_anchor_spans on the sel stream; a later FIRST row of the same sequence keeps them).
// Differences from it, as on the GPU benchmark path: sink tokens are not special-cased (they compete in the top-k, and successor expansion starts at position 0, not at the first token
// after the sinks); one token budget for every sequence (the hello's; no per-request budget); the selection is exact
// top-k on the GPU scores (bf16 keys and fp32 queries split hi + lo, or with SelectionConfig::score_keys int8 the
// compact int8 copy of the keys, written per layer on append and read only by the scoring, the K/V sent staying the
// pool's bf16: near-ties may rank differently); a steady row with
// more entering tokens than the delta capacity C sends the C best by their own score (selection_delta's rule, not
// successor-expanded), the rest on later steps.
//
// Sampling (SparseConfig::overlap_sample_every = N > 0): at every step whose number is a multiple of N, per layer
// pack, the steady rows of one new token are measured: their true query (this step's, gathered from the received
// rows on the work stream) scores the candidates the prediction for this step had (positions < context - local
// window) with the cache's bf16 keys (exact, also when the rank scores with int8 keys: the overlap then counts the
// quantisation's misses too) and the same GQA rule, exact top-k with the same successor expansion, no anchors (the
// CPU OverlapSampler's oracle); selection_delta of that top-k against a copy of the held tables (the selection the
// inference rank attends this step) counts what the prediction missed: overlap = 1 - entering / count (Eq. 1).
// The steady rows' own delta gives the churn: entering / count. Both are copied to pinned memory after the pack's
// delta and summed per (layer, KV head) on the host one or more steps later (GpuCacheStats::head_samples). The
// scoring pass runs on the score stream before the prediction's, in its scores buffer; the sampled step's only
// host wait is for the copies of the sampled step two samples back. Errors (spade::Error naming the peer): a malformed plan, a link failure, a CUDA error. The server
// is then unusable (the inference rank fails its sparse sequences and goes on densely).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pair/gpu_plan.h"
#include "cache_rank/selection_overlap.h"
#include "cache_rank/selector.h"
#include "common/config.h"
#include "transport/gpu_link.h"

namespace spade::cache {

using pair::GpuPairHello;

struct GpuCacheOptions {
  int device = 0;
  // The pair's settings (pair/selection_config.h). Read: the selection (budget k and local window R from the hello;
  // query window W, predictor, ridge eps, GQA rule, successor expansion, score keys, overlap_sample_every the cache
  // rank's own; sink tokens unused), layers_per_pack P and C = effective_delta_capacity(), entries per steady row of a step (P and C
  // from the hello).
  pair::SparseConfig sparse;
  int max_slots = 64;            // sequences at once: the inference rank's max_num_seqs (plan slots 0..max_slots-1)
  int max_step_tokens = 2048;    // tokens per step: its max_num_batched_tokens
  int num_pages = 0;             // KV pool pages per layer: its KV pool's (> 0)
  int page_size = 16;
  int max_pages_per_seq = 0;     // ceil(max_model_len / page_size) (> 0)
  // Pipelined selection: scoring (bandwidth-bound) on its own low-priority stream, top-k / delta / gather
  // (latency-bound) on a high-priority one, so one pack's top-k runs beside the next pack's scoring. Costs a second
  // set of predicted queries and scores (max_slots x P x num_kv_heads x max_pages_per_seq x page_size x 4 bytes).
  // false: every stage in order on one stream.
  bool pipeline = true;
};

struct GpuCacheStats {
  uint64_t steps = 0;
  uint64_t tokens_appended = 0;
  uint64_t selections = 0;        // (sequence, step) selections computed
  uint64_t first_selections = 0;  // of them, full ones
  uint64_t bytes_received = 0, bytes_sent = 0;
  uint64_t forks = 0;            // plan forks applied (n samples starting from a group's prompt)
  uint64_t retained_prefixes = 0;    // retained prefixes held after the last step (prefix caching)
  uint64_t retained_hits = 0;        // sequences forked from a retained prefix
  uint64_t retained_hit_tokens = 0;  // their tokens not shipped again
  // After the last plan's bookkeeping (a sequence that ended is released by the next step's plan, or by the idle
  // flush when the inference rank has no step to run):
  uint64_t sequences = 0;        // live sequences (plan slots) held; retained prefixes apart
  uint64_t pages_held = 0;       // KV pages (per layer) held, by sequences and retained prefixes; shared pages once
  uint64_t peak_pages_held = 0;  // the most pages_held has been
  uint64_t pool_pages = 0;       // the KV pool's pages (per layer): the hello's num_pages
  uint64_t idle_flushes = 0;   // flush plans served (pair/gpu_plan.h): bookkeeping between steps
  uint64_t sampled_steps = 0;  // steps whose steady rows were sampled (file comment: Sampling)
  // [layer * num_kv_heads + KV head]: the sampled overlap ratios and churn (empty when sampling is off).
  std::vector<SelectionSampleStats> head_samples;
};

class GpuCacheServer {
 public:
  /// `attn_cfg`: the model's attention view (full-attention layers only). `link`: the cache side of the pair, kept
  /// alive by the caller. `peer`: names the inference rank in errors. Throws spade::Error for bad options (named) or
  /// an allocation failure (the bytes wanted).
  GpuCacheServer(const ModelConfig& attn_cfg, GpuCacheOptions opts, transport::GpuLink& link, std::string peer);
  ~GpuCacheServer();
  GpuCacheServer(const GpuCacheServer&) = delete;
  GpuCacheServer& operator=(const GpuCacheServer&) = delete;

  /// Waits up to `wait` for the next plan; false if none came or it was the close plan (nothing enqueued; see
  /// closed()). Otherwise enqueues the whole step (a flush plan: its bookkeeping only) and returns true without
  /// waiting for the GPU. Throws spade::Error (see the file comment).
  bool serve_step(std::chrono::milliseconds wait);
  /// Waits until everything enqueued has run (tests, shutdown).
  void synchronize();
  /// True once the inference rank's close plan came (gpu_plan.h): serve_step returns false from then on and nothing
  /// is pending on the link. Until then a receive of the next plan is always posted, with no deadline.
  bool closed() const;

  const GpuCacheStats& stats() const { return stats_; }
  /// The overlap ratios measured since the last call, one per sampled (sequence, layer): the mean over its KV heads
  /// (the CPU OverlapSampler::take's; cache_rank's spade_selection_overlap_ratio histogram).
  std::vector<double> take_overlap_ratios();
  /// Bytes of device memory the server holds.
  size_t device_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> st_;
  GpuCacheStats stats_;
};

/// Device bytes one KV page costs the GPU cache rank across the layers of `attn_cfg` (its pool's share of
/// device_bytes()): bf16 K and V, plus with `keys` int8 the compact scoring copy, head_dim + 4 bytes per (token,
/// KV head) (kernels/selection_ref.h: +26 % at head_dim 128). A memory budget for the pool divides by this.
size_t gpu_cache_page_bytes(const ModelConfig& attn_cfg, int page_size, kernels::ScoreKeys keys);

/// The pair's first exchange (gpu_plan.h GpuPairHello); the inference side sends it with
/// GpuSparseController::send_hello (inference_rank/gpu_sparse.h).
/// Cache side: receives the hello, waiting up to `timeout` for the inference rank, and validates it against
/// `attn_cfg` (decode_gpu_hello). Throws spade::Error naming `peer` (timeout, link failure, invalid hello).
GpuPairHello recv_gpu_hello(transport::GpuLink& link, const ModelConfig& attn_cfg, const std::string& peer,
                            std::chrono::milliseconds timeout);
/// The server options a hello implies, on `device`. `own` (the cache rank's parsed settings) supplies the cache
/// rank's own knobs (query window, predictor, ridge eps, GQA rule, successor expansion, score keys); the budget,
/// local window, layers per pack, delta capacity and every limit come from the hello.
GpuCacheOptions gpu_cache_options(const GpuPairHello& hello, const pair::SparseConfig& own, int device);

}  // namespace spade::cache

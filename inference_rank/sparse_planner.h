// The host-side bookkeeping of GPU sparse decoding (AsyncSpade Sec. 4.1): which sequences are dense, which
// switch to sparse this step, which decode sparsely, their plan slots and held-table slots, and the step's plan for
// the cache rank (pair/gpu_plan.h); and the options of GPU sparse decoding (GpuSparseOptions, filled in one place:
// gpu_sparse_options). Pure host code, unit-tested on the CPU; GpuSparseController (gpu_sparse.h) turns each
// StepDecision into uploads, sends and launches.
//
// Per sequence (Phase):
//   Dense  -> below its threshold, a prefill step, force_dense, or no free table / switch allowance this step;
//   Sparse -> from its first decode step at or past the threshold: that step's plan row asks for a FIRST selection
//             (the full budget) and the sequence owns a held table; every later step's row asks for a steady
//             selection, and from the next step on every step (decode-only or mixed with prefill chunks) attends its
//             table + the local window (a "sparse row", served by the packed sparse decode kernel);
//   Failed -> its cache rank failed while it was sparse (it is reported once through fail_all, then decodes nothing
//             more: the engine ends it).
// A row that starts over at position 0 (fresh) loses its table and is Dense again. Only a row whose last token is
// sampled (a logit row of the step) switches: a group prefill's last chunk is not a decode step.
//
// Forks (n samples sharing one prompt, Engine::submit_samples): on_fork(parent, child) for each sample of a group
// prefill, before the group's on_release. The first sample takes over the group's plan slot (the cache rank holds
// the prompt there already; nothing is copied); every further sample gets a slot of its own and a fork in the next
// plan (pair/gpu_plan.h GpuPlanFork: the cache rank shares the prompt's pages and copies its windows). A sample
// released before that plan takes its fork back.
//
// Retained prefixes (prefix caching on the pair; GpuSparseOptions::max_retained_prefix_tokens > 0 and an engine page
// allocator with prefix caching, set_page_allocator): the planner records each sequence's full pages as (page, page
// serial) while it holds them. When a sequence ends, the leading run of them still published in the prefix cache
// (at most the bound) is retained on the cache rank under a new id (a retain in the next plan, before the slot's
// release); a prefix another retained one covers is not retained twice, and one it covers is dropped, as is a stale
// one (its first page reused by the engine since: no hit can reach it). Beyond the bound (tokens over all retained
// prefixes) the least recently used are dropped; a prefix that would need pinned ones dropped, or more drops than the
// next plan carries, is not retained (the cache rank's pool holds the bound). The engine asks
// reusable_prefix_tokens() before it reuses cached pages: the longest retained prefix that still holds them (same
// page and serial, page by page) bounds the reuse, and the sequence's first row then forks from it
// (kForkFromRetained); until then the prefix is pinned (never dropped). A group whose whole shared part was such a hit
// never has a row: each of its samples forks the retained prefix instead. A sequence that starts past position 0
// without a hit (a group prefill running when its cache rank was replaced) starts over on the cache rank and stays
// dense, as a detached one. Once the cache rank failed, every cached page may be reused (the sequences decode
// densely).
//
// Page dropping: once a sequence is Sparse with its first selection requested, droppable_range() gives the engine
// [0, len + 1 - local_window), the tokens no later step of it reads locally (the selection comes from the cache
// rank), and marks it `dropped`. A dropped sequence is never routed to dense attention again: while Sparse it is a
// sparse row; if its cache rank fails (fail_all, or local_step() once the link is gone) its last step attends only
// its local window (its logits are discarded: it is failed). Only a fresh row (the engine restarting it at position
// 0 with a new block table) clears the mark.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pair/gpu_plan.h"
#include "pair/selection_config.h"
#include "inference_rank/engine.h"
#include "inference_rank/model.h"

namespace spade {

/// The options of GPU sparse decoding on the inference rank (this planner and GpuSparseController, gpu_sparse.h):
/// the pair's sparse settings plus the limits and names the engine implies. Host-only, so CPU tests build them.
struct GpuSparseOptions {
  // The pair's settings (pair/selection_config.h). The planner reads sparse_threshold, the budget k, the local window
  // R and max_first_per_step; the controller also P (layers_per_pack) and C (effective_delta_capacity()), and sends
  // them in the pair hello. Sink tokens must be 0: the GPU path has none of its own (they compete in the top-k).
  pair::SparseConfig sparse;
  int max_sparse_seqs = 16;    // sequences sparse at once (held tables)
  int max_slots = 64;          // plan slots, sequences at once: the engine's max_num_seqs (the cache rank's max_slots)
  int max_step_tokens = 2048;  // tokens per step: the engine's max_num_batched_tokens
  // Retained prefixes (sparse_planner.h): tokens over all of them the cache rank keeps of ended sequences, for the
  // engine's prefix cache to reuse; 0: none (then no cached prefix is reused while the cache rank is up). The
  // inference rank's --max-retained-prefix-tokens (SparseOptions), when its prefix caching is on.
  int max_retained_prefix_tokens = 0;
  std::string cache_name = "its cache rank";  // names the cache rank in the errors of the requests it fails
};

/// The GPU sparse options of an engine with the normalised options `engine` (Engine::options()) and the pair's
/// settings `sparse`, whose cache rank is called `cache_name` in errors: every running sequence may hold a table
/// (max_sparse_seqs = max_slots = engine.max_num_seqs) and a step has at most engine.max_num_batched_tokens tokens.
/// `sparse` is copied as is (sparse.max_first_per_step switches per step; the held tables bound them too).
/// `max_retained_prefix_tokens`: the rank's bound (SparseOptions), kept only when engine.enable_prefix_caching.
GpuSparseOptions gpu_sparse_options(const pair::SparseConfig& sparse, const EngineOptions& engine,
                                    std::string cache_name, int max_retained_prefix_tokens = 0);

/// The pair hello (pair/gpu_plan.h) for a controller (GpuSparseController, gpu_sparse.h) with options `o`
/// (gpu_sparse_options) behind an engine with the normalised options `engine` (Engine::options()): send it on the
/// link (pair/gpu_plan.h encode_gpu_hello) before the controller's first step. It carries P, k, R and
/// C = o.sparse.effective_delta_capacity() of the pair's settings, and the limits. The cache rank's KV pool (the
/// hello's num_pages) is engine.max_context_pages (the engine's bound on the running sequences' full contexts, which
/// page dropping lets exceed num_pages), or engine.num_pages for options that were not normalised, plus the retained
/// prefixes' bound (o.max_retained_prefix_tokens) in whole pages.
pair::GpuPairHello make_gpu_pair_hello(const ModelConfig& attn_cfg, const GpuSparseOptions& o,
                                        const EngineOptions& engine);

/// What one engine step does, per batch row and per selection group.
struct StepDecision {
  pair::GpuStepPlan plan;           // rows in batch order
  std::vector<int32_t> num_packed;   // [batch] held-table entries attended (0: dense or window-only row)
  std::vector<int32_t> windows;      // [batch] local window (a dense row: its whole context)
  std::vector<int32_t> tables;       // [batch] held-table slot of a sparse row, else -1
  std::vector<int32_t> q_rows;       // [batch] token row of the query of a row the packed sparse decode kernel serves
                                     // (a sparse row, or a dropped sequence's window-only row), else -1 (dense)
  std::vector<int> group_tables[2];  // held-table slot of each steady / first selection row, plan order
  bool sparse_now = false;           // some row is served by the packed sparse kernel (any q_rows[b] >= 0)
  int switches = 0;                  // rows switching to sparse this step
};

class SparseStepPlanner {
 public:
  /// Reads o.sparse (threshold, budget, local window, max_first_per_step), o.max_sparse_seqs and o.max_slots. Throws
  /// spade::Error naming the option when one is out of range.
  explicit SparseStepPlanner(const GpuSparseOptions& o);
  /// Per request, before its first step: force_dense keeps it dense; threshold > 0 replaces the rank's.
  void set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold);
  /// A sequence the engine already ran before this planner's cache rank was paired (a replacement cache rank,
  /// rejoin): that rank holds none of its tokens. It stays dense to its end, and its plan rows count from its next
  /// step as if it started there (the first one kRowFresh, ctx_len minus the tokens before it), so the cache rank
  /// keeps a consistent (never selected) slot for it instead of refusing a row that continues past what it holds.
  void detach(uint64_t seq_id);
  /// The step `fb` (the engine's batch; seq_ids required). `step` numbers the plan. Throws spade::Error when more
  /// than max_slots sequences are live at once.
  StepDecision plan_step(const ForwardBatch& fb, int64_t step);
  /// Released slots, retains or drops wait for the next plan.
  bool has_news() const { return !pending_release_.empty() || !pending_retains_.empty() || !pending_drops_.empty(); }
  /// The idle flush (pair/gpu_plan.h, step -2): a plan with no rows that carries the waiting released slots, retains
  /// and drops, as the next plan_step would; forks keep waiting for the rows of their children. Send it only between
  /// steps (the engine idle). Takes no step number.
  pair::GpuStepPlan flush_plan();
  /// The step `fb` when there is no plan (the link failed or was closed): no plan rows, no state change; rows of
  /// dropped sequences attend their local window only (packed kernel, nothing held), every other row densely.
  /// Throws spade::Error if a dropped sequence has more than one token in the step.
  StepDecision local_step(const ForwardBatch& fb) const;
  /// The engine's page-dropping hook (AttentionBackend::droppable_range) for a context of `seq_len` tokens:
  /// [0, seq_len + 1 - local_window) (clamped at 0) once the sequence is Sparse with a selection requested (it
  /// decodes sparsely from its next step on), and the sequence is marked dropped; else {0, 0} (also after fail_all).
  std::pair<int, int> droppable_range(uint64_t seq_id, int seq_len);
  /// True when some sequence of `fb` had pages dropped (its rows must not be attended densely).
  bool any_dropped(const ForwardBatch& fb) const;
  /// Sequences marked dropped so far (each counted once, at its first droppable range).
  uint64_t dropped_seqs() const { return dropped_seqs_; }
  /// The sequence left (finished, aborted, failed): its slot is released in the next plan, its table freed, a fork
  /// of it not yet planned dropped.
  void on_release(uint64_t seq_id);
  /// `child` starts from every token `parent` holds on the cache rank (file comment: Forks), or from the retained
  /// prefix chosen for a parent that never had a row; call before the parent's on_release. Nothing once the cache
  /// rank failed. Throws spade::Error for a parent with neither, or with a selection, a child that already has a
  /// slot, or no free slot.
  void on_fork(uint64_t parent, uint64_t child);
  /// Forks waiting for the next plan.
  int pending_forks() const { return static_cast<int>(pending_forks_.size()); }
  /// The engine's page allocator (AttentionBackend::set_page_allocator); not owned. Retention needs one with prefix
  /// caching on.
  void set_page_allocator(const PageAllocator* pages) { pages_ = pages; }
  /// AttentionBackend::reusable_prefix_tokens (file comment: Retained prefixes): the tokens of the cached `pages` that
  /// a retained prefix still holds, 0 with none (or retention off); everything once the cache rank failed. Records
  /// the choice for `seq_id`'s first row and pins that prefix until then (or until its release).
  int reusable_prefix_tokens(uint64_t seq_id, const std::vector<int32_t>& pages);
  /// Retained prefixes are kept (options, allocator and a healthy cache rank).
  bool retention_on() const;
  int num_retained() const { return static_cast<int>(retained_.size()); }
  int64_t retained_tokens() const { return retained_tokens_; }
  /// Distinct pages (page, serial) over the retained prefixes: what the cache rank holds for them (a prefix that
  /// started from another one's pages shares them there as it does here).
  int retained_pages() const;
  struct RetentionStats {
    uint64_t retained = 0;       // prefixes retained
    uint64_t dropped = 0;        // retained prefixes dropped (bound, covered, stale)
    uint64_t reused = 0;         // sequences that started from a retained prefix
    uint64_t reused_tokens = 0;  // tokens they did not ship
  };
  const RetentionStats& retention_stats() const { return retention_stats_; }
  /// The cache rank is gone: every Sparse sequence turns Failed and is returned (once); tables are freed; no
  /// sequence switches any more.
  std::vector<uint64_t> fail_all();
  int free_tables() const { return static_cast<int>(free_tables_.size()); }
  int free_slots() const { return static_cast<int>(free_slots_.size()); }
  const GpuSparseOptions& options() const { return o_; }

 private:
  enum class Phase { Dense, Sparse, Failed };
  struct Seq {
    int slot = -1;
    int table = -1;
    Phase phase = Phase::Dense;
    bool sel_requested = false;  // the previous plan asked for its selection of this step
    bool dropped = false;        // droppable_range() handed out a range: never attend densely again
    bool force_dense = false;
    int threshold = 0;
    bool rebase = false;  // detach()ed: its next row starts it over on the cache rank
    int offset = 0;       // tokens the cache rank does not hold (before its rebased row)
    int len = 0;          // tokens the cache rank holds of it (its last row's ctx_len)
    int fork_slot = -1;   // a group whose first sample took its slot: the slot further samples fork from
    bool rows_sent = false;  // a plan row of it went out (its slot is live on the cache rank)
    bool recording = true;   // its full pages are still recorded (stops at a dropped page)
    std::vector<std::pair<int32_t, uint64_t>> pages;  // its full pages (page, serial), while retention is on
  };
  struct Retained {
    std::vector<std::pair<int32_t, uint64_t>> pages;  // (page, serial) of its whole pages
    uint64_t used = 0;                                // LRU clock
    int pins = 0;                                     // sequences about to fork from it
  };
  void retain(const Seq& s);
  void drop_retained(int32_t id);
  void unpin_hit(uint64_t seq_id);
  int take_slot();  // a free plan slot, no longer released in the next plan (a fork empties it itself)
  void take_news(pair::GpuStepPlan& p);  // the waiting released slots, retains and drops into `p`
  struct PendingFork {
    uint64_t child = 0;
    pair::GpuPlanFork fork;
  };
  GpuSparseOptions o_;
  std::unordered_map<uint64_t, Seq> seqs_;
  std::vector<int> free_slots_, free_tables_;
  std::vector<int32_t> pending_release_;
  std::vector<PendingFork> pending_forks_;
  const PageAllocator* pages_ = nullptr;
  std::map<int32_t, Retained> retained_;
  std::vector<pair::GpuPlanRetain> pending_retains_;
  std::vector<int32_t> pending_drops_;
  std::unordered_map<uint64_t, std::pair<int32_t, int>> pending_hits_;  // sequence -> (retained id, tokens)
  int32_t next_retained_id_ = 0;
  int64_t retained_tokens_ = 0;
  uint64_t use_clock_ = 0;
  RetentionStats retention_stats_;
  bool failed_ = false;
  uint64_t dropped_seqs_ = 0;
};

}  // namespace spade

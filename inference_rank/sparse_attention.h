// Sparse decoding on the inference rank (AsyncSpade Sec. 4.1): an AttentionBackend that, for every sequence whose
// context reached the sparse threshold, attends over
//     sink tokens ∪ (KV selected for this step) ∪ local window
// (in ascending position order, de-duplicated: the selection never contains sinks or window tokens), and ships the
// step's q/k/v to the cache rank once per layer pack.
//
// Modes (--selection):
//   dense      full attention for everyone (the baseline; the backend only counts).
//   oracle     synchronous token-level top-k with the TRUE current query, computed inline by an in-process
//              selector (TOVA/Quest-style at token level): the accuracy ceiling of token selection, no overlap.
//   quest      synchronous page-level selection with the TRUE current query (Quest, Tang et al. 2024; the paper's
//              main peer): per page the min/max keys are scored, the best pages are attended whole up to the token
//              budget (cache::Selector::select_pages). The same inline selector as oracle.
//   predicted  AsyncSpade: the cache rank predicts q̂(t+1) from its query window (Algorithm 1) and sends the
//              selection for step t+1 while the inference rank is still computing step t. If the answer for a pack
//              is not there when that pack starts, the rank waits up to the selection deadline and counts a stall.
//
// Per-sequence life cycle: dense while context < sparse_threshold (prefill is always dense); on the first decode step
// at or past the threshold the step is still dense and each pack's update carries the sequence's whole KV and last
// W+1 queries (INIT, the bulk ship); from the next step on it is sparse and each update carries the step's q/k/v
// (APPEND). If the cache rank fails, every sequence in sparse mode fails with an error naming it (take_failures),
// and every other sequence, new ones included, continues densely (a dense fallback).
//
// Shared INIT (predicted mode, with the engine's page allocator: set_page_allocator): a switching sequence whose
// leading full pages are the very pages (same page id and PageAllocator::page_serial, so the same KV) that a sequence
// the cache rank holds had at its own INIT — n samples of one prompt, or a prompt that hit the prefix cache while such
// a sequence runs — ships only the tokens past them and names that sequence (pair::SeqUpdate::shared_from); the cache
// rank shares its pages. The source is one already sparse, or switching earlier in the same update; the longest
// shared run wins (ties: the lowest id). What the cache rank stores and selects is unchanged, bit for bit.
// Retained prefixes (predicted mode, with a page allocator that caches prefixes; over a pair::ShardedLink every shard
// keeps its layers of them): when a sparse sequence ends, the leading run of its INIT's full pages that is still
// published in the prefix cache with the same page_serial (P tokens, at most max_retained_prefix_tokens) is kept on the
// cache rank under the sequence's id (pair::PackUpdate::retained, sent with its release). The retained prefix is a
// share source like a live sequence, so a later request whose prompt hits those cached pages ships only what follows
// them. This rank alone decides: before each step (and each idle flush) it re-checks every retained prefix's pages, and
// one whose page was evicted or reused here is shortened to the pages still valid, or dropped (PackUpdate::dropped), in
// the step's first update, ahead of any INIT that could share from it. A retained prefix that another one covers is not
// kept; past the token bound the least recently used are dropped. A failed or replaced link forgets them all.
// Requires every running decode sequence in every step (max_num_batched_tokens >= max_num_seqs).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_rank/pack_server.h"
#include "pair/link.h"
#include "inference_rank/model.h"
#include "inference_rank/selection_mode.h"

namespace spade {

/// The sparse settings of this inference rank: the pair's (pair::SparseConfig: selection, sparse_threshold,
/// layers_per_pack, ...; declared and defaulted there) plus how this rank uses them. The CPU backend reads the
/// selection, sparse_threshold and layers_per_pack; the GPU path (serve.cpp, main.cpp) passes the SparseConfig part
/// to gpu_sparse_options (sparse_planner.h).
struct SparseOptions : pair::SparseConfig {
  SelectionMode mode = SelectionMode::Predicted;
  std::chrono::milliseconds selection_deadline{10000};  // longest wait for a late selection before failing
  /// --max-retained-prefix-tokens: tokens (over all retained prefixes, header comment) the cache rank may keep of
  /// ended sequences whose prefix stays in this rank's prefix cache; beyond it the least recently used are dropped.
  /// 0 = keep none. The CPU cache rank's --kv-pages must hold this rank's KV pool plus these tokens. >= 0.
  int max_retained_prefix_tokens = 65536;

  /// Prompt tokens a sequence computes itself instead of taking them from shared or prefix-cached pages
  /// (EngineOptions::prefix_recompute_tokens): its switch to sparse ships the queries of its last W + 1 tokens and of
  /// the anchor_queries prompt anchors, which only a computed token has. 1 with mode Dense.
  int prefix_recompute_tokens() const;
};

struct SparseStats {
  uint64_t steps = 0;             // forward passes
  uint64_t sparse_seq_steps = 0;  // (sequence, step) pairs decoded sparsely
  uint64_t switches = 0;          // sequences that entered sparse mode (bulk ships)
  uint64_t stalls = 0;            // pack selections that were not there when the pack started
  double stall_ms = 0;            // time spent waiting for them
  uint64_t failed_seqs = 0;       // sequences failed because the cache rank failed
  uint64_t dense_fallbacks = 0;   // sequences past the threshold decoded densely because no cache rank was usable
  uint64_t dropped_answers = 0;   // selections read and dropped after a step that ended with an error
  std::vector<uint64_t> stalls_per_step;  // stalls of each forward pass (predicted mode)
  uint64_t init_tokens = 0;         // context tokens of the INIT ships (each sequence once, not per layer)
  uint64_t init_shared_tokens = 0;  // of those, tokens not shipped: shared from a sequence the cache rank holds
  uint64_t shared_inits = 0;        // INITs that shared tokens
  uint64_t retained_prefixes = 0;      // ended sequences whose prefix the cache rank was told to keep
  uint64_t retained_reused_tokens = 0;  // of init_shared_tokens, those shared from a retained prefix (not re-shipped)
  uint64_t retained_dropped = 0;       // retained prefixes dropped (a page evicted here, the bound, a covering one)
};

class SparseAttention : public AttentionBackend {
 public:
  /// `opt` is copied. `link`: the cache rank (predicted mode); ignored (may be null) for dense and oracle. Throws
  /// spade::Error naming the setting when `opt` is out of range (validate(const pair::SparseConfig&)).
  SparseAttention(const ModelConfig& cfg, KvCache& cache, const SparseOptions& opt,
                  std::unique_ptr<pair::CacheRankLink> link);
  void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
              float* out) override;
  void on_release(uint64_t seq_id) override;
  std::vector<std::pair<uint64_t, std::string>> take_failures() override;
  /// Sparse (and switched) sequences: [sink_tokens, seq_len + 1 - local_window) — their cache rank holds those
  /// tokens; the local KV keeps only the sinks and the local window.
  std::pair<int, int> droppable_range(uint64_t seq_id, int seq_len) override;
  /// Enables the shared INIT (the header comment); nullptr turns it off.
  void set_page_allocator(const PageAllocator* pages) override { pages_ = pages; }

  /// Per-request overrides (the API's `spade` fields), set right after Engine::submit and before the request's
  /// first step: `force_dense` keeps it dense for its whole life; `sparse_threshold` > 0 replaces the rank's;
  /// `token_budget` > 0 selects that many tokens per layer and KV head instead of the rank's token budget (it must
  /// not exceed it: the selection buffers are sized by the rank's). The budget may also change between steps (a
  /// per-step budget; bench/fidelity's GrowingBudgetSparse): it applies to the selections made from then on — in
  /// oracle / quest mode this step's, in predicted mode the one the cache rank makes with this step's update, used
  /// by the next step. Throws spade::Error for values out of range.
  void set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold, int token_budget = 0);
  /// For the scheduler when no request is running: receives the selections still in flight (their sequences are
  /// gone) and sends the pending releases with a release-only update, waiting (selection_deadline) for its answer,
  /// so the cache rank frees the KV of requests that ended — finished, aborted or cancelled — even when no further
  /// step runs. A failing link is recorded like in a step (link_failed()). No-op in dense / oracle mode.
  void idle_flush();
  /// Sequences that ended whose release the cache rank has not been sent yet (and retained-prefix changes not sent).
  size_t pending_releases() const { return released_.size() + retain_out_.size() + drop_out_.size(); }
  /// Retained prefixes the cache rank holds (or is about to, with the next update), and their tokens.
  size_t num_retained() const { return retained_.size(); }
  int64_t retained_tokens() const { return retained_tokens_; }

  const SparseStats& stats() const { return stats_; }
  const SparseOptions& options() const { return opt_; }
  pair::CacheRankLink* link() { return link_.get(); }
  bool link_failed() const { return !link_error_.empty(); }
  /// Predicted mode: takes `link` to a replacement cache rank, which holds nothing of the old one's. A link not yet
  /// failed is failed first ("<peer> was replaced": its sparse sequences end with that error). Sequences already known
  /// stay as they are (a failed one dense to its end); pending releases are dropped (their KV died with the old cache
  /// rank). New sequences may switch to sparse again. Throws spade::Error for a null link or another mode.
  void replace_link(std::unique_ptr<pair::CacheRankLink> link);

 private:
  enum class Phase { Dense, Switching, Sparse, Failed };
  /// Oracle and Quest: selection inline, with the true query (no cache rank).
  bool synchronous() const { return opt_.mode == SelectionMode::Oracle || opt_.mode == SelectionMode::Quest; }
  struct SeqState {
    Phase phase = Phase::Dense;
    std::vector<std::vector<float>> queries;  // per layer: last W+1 query rows [n, q_dim], oldest first
    std::vector<pair::LayerSelection> sel;   // per layer: selection for the current step (sparse phase)
    int sel_context_len = 0;
    bool dropped = false;  // local pages of the middle were freed: dense attention is no longer possible
    bool force_dense = false;
    int sparse_threshold = 0;  // 0: opt_.sparse_threshold
    int token_budget = 0;      // 0: opt_.selection.token_budget
    // The full pages (page id, page serial) of the context at the INIT: what the cache rank holds for tokens
    // [0, page_size * init_pages.size()) of this sequence. Empty without a page allocator.
    std::vector<std::pair<int32_t, uint64_t>> init_pages;
    int shared_tokens = 0;     // the INIT's shared prefix (decided at its first pack)
    uint64_t shared_from = 0;
  };
  /// At the INIT of `id` (context `len`, block table `pages`): records its init_pages and picks the sequence the cache
  /// rank holds that shares the longest run of them (shared_tokens / shared_from; 0 tokens when none).
  void choose_shared_prefix(uint64_t id, SeqState& s, const int32_t* pages, int len);
  // Retained prefixes (header comment): the cache rank holds the first `tokens` (= pages.size() * page size) tokens
  // of an ended sequence; `pages` are their (page id, page serial) at its INIT; `used`: LRU clock.
  struct Retained {
    std::vector<std::pair<int32_t, uint64_t>> pages;
    int tokens = 0;
    uint64_t used = 0;
  };
  bool retention_on() const;
  void retain_prefix(uint64_t id, const std::vector<std::pair<int32_t, uint64_t>>& pages);
  void shorten_retained(uint64_t id, int pages);  // 0 pages: drop
  void check_retained();    // shortens or drops those whose pages changed here
  void forget_retained();   // the cache rank's state is gone (link failed or replaced)
  bool has_pair_news() const { return !released_.empty() || !retain_out_.empty() || !drop_out_.empty(); }
  void take_pair_news(pair::PackUpdate& u);  // moves released_, retain_out_, drop_out_ into u
  void begin_step(const ForwardBatch& batch);
  void drop_unread_answers();
  void fail_link(const std::string& why);
  void receive_pack(int pack);

  const ModelConfig& cfg_;
  KvCache& cache_;
  const PageAllocator* pages_ = nullptr;  // the engine's (shared INIT); not owned
  SparseOptions opt_;
  std::unique_ptr<pair::CacheRankLink> link_;
  std::unique_ptr<cache::InProcessLink> oracle_;  // oracle mode's inline selector
  std::string link_error_;
  int num_packs_;
  int64_t step_ = 0;
  std::unordered_map<uint64_t, SeqState> seqs_;
  std::vector<Phase> phase_;                  // per batch row, this step
  std::vector<bool> expect_reply_;            // per pack: an update of the previous step awaits its selection
  std::vector<bool> expect_now_;              // per pack: sent during this step
  std::vector<uint64_t> released_;
  std::unordered_map<uint64_t, Retained> retained_;
  std::vector<pair::Retain> retain_out_;  // retained-prefix entries for the next update (with released_)
  std::vector<uint64_t> drop_out_;
  int64_t retained_tokens_ = 0;
  uint64_t use_clock_ = 0;
  pair::PackUpdate pending_;                 // update being assembled for the current pack
  std::vector<std::pair<uint64_t, std::string>> failures_;
  SparseStats stats_;
  std::vector<float> scores_;
  std::vector<const float*> k_rows_, v_rows_;
  std::vector<int> order_;
};

}  // namespace spade

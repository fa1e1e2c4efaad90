// The cache rank's per-sequence state and token selection (AsyncSpade Sec. 4.1-4.2, Algorithm 1).
//
// For every tracked sequence the Selector holds the full KV of every layer in a paged store
// ([num_layers][num_pages, page_size, num_kv_heads, head_dim] fp32, common/page_allocator.h), and per layer a window of
// the last W+1 query states of every query head. select() predicts the next query with the assembled ridge
// regression (kernels::predict_next_query_ref) — or takes a given query (the oracle baseline) — scores the candidate
// tokens per KV head (GQA rule: SelectionConfig::gqa_rule, default max over the group: a token is kept if any query
// head of the group attends to it strongly; a mean would let one head's sharp peak be averaged away), takes the
// token-level top-k (the token budget) and gathers their K/V.
//
// Candidates: positions [sink_tokens, context_len - local_window) of the step that will use the selection; the sink
// tokens and the local window are attended by the inference rank from its own KV, so they are never sent.
// Prompt anchors (SelectionConfig::anchor_queries > 0, kernels::select_anchors_ref): the last anchor_queries queries
// given to init_layer pick per (layer, KV head) up to kernels::kMaxAnchors tokens, computed at the first predicted
// select; every predicted selection (query == nullptr) then holds [a, a + anchor_span) of its best anchors, as many
// whole spans as fit in a quarter of its budget, and fills the rest by score.
// Not thread-safe; one owner thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/config.h"
#include "common/page_allocator.h"
#include "kernels/selection_ref.h"
#include "pair/selection_config.h"

namespace spade::cache {

using pair::LayerSelection;
using pair::SelectionConfig;

/// A shared INIT (pair::SeqUpdate::shared_from): the first `tokens` tokens of the new sequence are the same KV as
/// those of sequence `from`, which the selector holds. tokens == 0: nothing shared.
struct SharedPrefix {
  uint64_t from = 0;
  int tokens = 0;
};

class Selector {
 public:
  /// `num_pages` × `page_size` bounds the tokens held over all sequences. `layers`: the layers whose KV this
  /// selector holds (a layer shard, pair/sharded_link.h shard_layers; indices in [0, cfg.num_layers)); empty = every
  /// layer. A layer not held is refused by name (spade::Error) by init_layer, append_layer and select.
  Selector(const ModelConfig& cfg, SelectionConfig sc, int num_pages, int page_size,
           const std::vector<int>& layers = {});

  const SelectionConfig& config() const { return sc_; }
  bool tracks(uint64_t seq) const { return seqs_.count(seq) != 0; }
  /// Tokens held for `seq` (throws for an unknown sequence).
  int seq_len(uint64_t seq) const;

  /// Starts (or continues) tracking `seq` with its existing KV of one layer: k, v [len - share.tokens, kv_dim] (the
  /// tokens from share.tokens on); queries [num_queries, q_dim], oldest first, the last one at position len - 1 (at
  /// most W+1 are kept in the predictor's window, at most anchor_queries pick the prompt anchors). All layers of a
  /// sequence must be given the same len and share. With share.tokens > 0 the sequence holds the pages of
  /// share.from that cover those tokens (reference counts; a partly shared last page is copied, layer by layer, as each
  /// layer is initialised), so `from`'s layer must have been initialised before. Throws spade::Error when the pool is
  /// full ("cache rank KV pool exhausted ..."), lengths or shares disagree, or `from` is not held, is shorter, or has
  /// not initialised this layer yet (each names the sequence and `from`).
  void init_layer(uint64_t seq, int layer, int len, const float* k, const float* v, int num_queries,
                  const float* queries, const SharedPrefix& share = {});
  /// Appends one token of one layer at position `pos` (== current length, or == length - 1 when another layer of
  /// the same step already appended): q [q_dim] joins the query window, k, v [kv_dim] the KV store.
  void append_layer(uint64_t seq, int layer, int pos, const float* q, const float* k, const float* v);
  /// Selects for the step whose context length is `context_len`. `query`: [q_dim] true query (oracle) or nullptr
  /// (predict the next query from the window, Algorithm 1). `budget`: tokens per KV head for this sequence, 0 = the
  /// configured token_budget, else 1..token_budget (a request's own budget); `out` keeps the configured layout.
  void select(uint64_t seq, int layer, int context_len, const float* query, LayerSelection& out, int budget = 0);
  /// Quest-style page selection (Tang et al. 2024; the AsyncSpade paper's main peer): every page of the candidates
  /// [S, context_len - R) is scored with `query` [q_dim] (the true query) against its per-channel min/max keys,
  /// score = Σ_d max(q_d·min_d, q_d·max_d) combined over the GQA group by the configured rule, and the best pages
  /// are taken until `budget` tokens (0 = token_budget) are selected; positions per KV head, ascending. Pages are
  /// the allocator's (page_size tokens, the first and last candidate pages partial). The min/max summaries are
  /// computed from the keys at each call (a reference: a serving Quest keeps them per page).
  void select_pages(uint64_t seq, int layer, int context_len, const float* query, LayerSelection& out,
                    int budget = 0);
  /// The predicted next query of (seq, layer): [q_dim] (for fidelity reports).
  void predict(uint64_t seq, int layer, float* q_hat);
  /// Forgets `seq` (a live sequence or a retained prefix) and frees its pages; unknown sequences are ignored.
  void release(uint64_t seq);
  /// Keeps the first `tokens` tokens of `seq` as a retained prefix (pair::PackUpdate::retained): a live sequence (it
  /// ended on the inference rank) loses its query windows, anchors and every page past those tokens; a retained
  /// prefix is shortened. A later init_layer may share from it (SharedPrefix) as from a live sequence; init_layer and
  /// append_layer of `seq` itself are refused. Throws spade::Error naming the sequence when it is not held here or
  /// `tokens` is outside [1, the tokens it holds].
  void retain(uint64_t seq, int tokens);
  /// Frees the retained prefix `seq` (pair::PackUpdate::dropped). Throws spade::Error naming it when `seq` is not a
  /// retained prefix held here (unknown, or a live sequence).
  void drop_retained(uint64_t seq);
  bool is_retained(uint64_t seq) const;
  /// Retained prefixes held, and the tokens they hold (their pages count in num_used_pages; a page a retained prefix
  /// shares with a live sequence counts once).
  size_t num_retained() const { return num_retained_; }
  int64_t retained_tokens() const;

  int num_free_pages() const { return alloc_.num_free_pages(); }
  /// Pages held (a page shared by several sequences counts once).
  int num_used_pages() const { return alloc_.num_pages() - alloc_.num_free_pages(); }
  /// Sequences tracked (holding KV here): live sequences and retained prefixes (num_retained).
  size_t num_sequences() const { return seqs_.size(); }
  int num_pages() const { return alloc_.num_pages(); }
  /// The page allocator (reference counts and block tables; tests).
  const PageAllocator& pages() const { return alloc_; }

 private:
  struct SeqState {
    std::vector<std::vector<float>> window;  // per layer [num_q_heads, W+1, head_dim], oldest first
    std::vector<int> window_len;             // per layer
    // Prompt anchors: per layer the queries that pick them ([anchor_q_len, q_dim], the last at position
    // anchor_pos_end - 1; freed once the anchors are computed) and the anchors ([num_kv_heads, kMaxAnchors]).
    std::vector<std::vector<float>> anchor_q;
    std::vector<int> anchor_pos_end;
    std::vector<std::vector<int32_t>> anchors;
    std::vector<uint8_t> layer_ready;  // per layer: its KV of the INIT was written (a later shared INIT may read it)
    SharedPrefix share;                // the INIT's shared prefix (every layer must give the same)
    std::vector<PageAllocator::PageCopy> init_copies;  // copy-on-write of a shared partial page, done per layer
    bool retained = false;  // a retained prefix: KV only (no window, anchors or selection), shared by later INITs
  };
  /// Copies token slots of pages (PageAllocator::PageCopy) in the K and V of the held layers among [first, last].
  void copy_pages(const std::vector<PageAllocator::PageCopy>& copies, int first, int last);
  /// Marks the anchor spans of (seq, layer) in `scores_` ([num_kv_heads, n] over the candidates [S, S + n)) with
  /// +inf, as many whole spans per head as fit in budget / 4.
  void apply_anchors(uint64_t seq, SeqState& s, int layer, int n, int budget);
  SeqState& state(uint64_t seq);
  /// Throws spade::Error unless `layer`'s KV is held here.
  void check_held(int layer) const;
  void push_query(SeqState& s, int layer, const float* q);
  void write_token(uint64_t seq, int layer, int pos, const float* k, const float* v);
  /// An empty selection: [num_kv_heads, token_budget] positions -1, zero K / V rows, count 0.
  void clear_selection(LayerSelection& out) const;
  /// The fields every scoring reference reads for (seq, layer) over the candidates [.., *end): the held keys, the
  /// sequence's block table, the model's heads, the GQA rule (kernels/selection_ref.h ScoreTokensRefParams,
  /// QuestPageScoresRefParams).
  template <class P>
  void set_paged(P& p, uint64_t seq, int layer, const int* end) const;
  /// Fills out.k / out.v from out.positions ([num_kv_heads, token_budget], -1 = zero row).
  void gather(uint64_t seq, int layer, LayerSelection& out) const;
  /// Sequence `seq`'s pages as a one-sequence launch of the references sees them (its block table's width).
  kernels::PagedAttentionShape seq_shape(uint64_t seq) const;

  ModelConfig cfg_;
  SelectionConfig sc_;
  int window_cap_;
  PageAllocator alloc_;
  std::vector<std::unique_ptr<float[]>> k_, v_;  // per layer [num_pages, page_size, kv_dim]; null: not held
  std::unordered_map<uint64_t, SeqState> seqs_;
  size_t num_retained_ = 0;
  std::vector<float> scores_;                    // scratch
  std::vector<int32_t> idx_;                     // scratch
};

}  // namespace spade::cache

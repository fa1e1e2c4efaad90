#include "cache_rank/selector.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "common/error.h"

namespace spade::cache {

Selector::Selector(const ModelConfig& cfg, SelectionConfig sc, int num_pages, int page_size,
                   const std::vector<int>& layers)
    : cfg_(cfg), sc_(sc), window_cap_(sc.query_window + 1), alloc_(num_pages, page_size) {
  validate(sc_);
  const size_t n = static_cast<size_t>(num_pages) * page_size * cfg.kv_dim();
  k_.resize(static_cast<size_t>(cfg.num_layers));
  v_.resize(static_cast<size_t>(cfg.num_layers));
  for (int l = 0; l < cfg.num_layers; ++l) {
    if (!layers.empty() && std::find(layers.begin(), layers.end(), l) == layers.end()) continue;
    k_[static_cast<size_t>(l)].reset(new float[n]);
    v_[static_cast<size_t>(l)].reset(new float[n]);
  }
  for (int l : layers)
    SPADE_CHECK(l >= 0 && l < cfg.num_layers, "cache rank: layer {} to hold is outside 0..{}", l, cfg.num_layers - 1);
}

void Selector::check_held(int layer) const {
  SPADE_CHECK(layer >= 0 && layer < cfg_.num_layers, "cache rank: layer {} outside 0..{}", layer, cfg_.num_layers - 1);
  if (!k_[static_cast<size_t>(layer)]) {
    std::string held;
    for (int l = 0; l < cfg_.num_layers; ++l)
      if (k_[static_cast<size_t>(l)]) held += (held.empty() ? "" : ",") + std::to_string(l);
    fail("cache rank: layer {} is not held by this shard (it holds layers {}): the inference rank's layer packs and "
         "this rank's shard disagree",
         layer, held);
  }
}

Selector::SeqState& Selector::state(uint64_t seq) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "cache rank: unknown sequence {}", seq);
  return it->second;
}

int Selector::seq_len(uint64_t seq) const { return alloc_.seq_len(seq); }

void Selector::push_query(SeqState& s, int layer, const float* q) {
  const int H = cfg_.num_q_heads, D = cfg_.head_dim, cap = window_cap_;
  float* w = s.window[layer].data();
  int& n = s.window_len[layer];
  if (n == cap) {  // drop the oldest: shift every head's slots left by one
    for (int h = 0; h < H; ++h) std::memmove(w + (h * cap) * D, w + (h * cap + 1) * D, (cap - 1) * D * sizeof(float));
    --n;
  }
  for (int h = 0; h < H; ++h) std::memcpy(w + (h * cap + n) * D, q + h * D, D * sizeof(float));
  ++n;
}

void Selector::write_token(uint64_t seq, int layer, int pos, const float* k, const float* v) {
  check_held(layer);
  const auto [page, slot] = alloc_.locate(seq, pos);
  const size_t off = (static_cast<size_t>(page) * alloc_.page_size() + slot) * cfg_.kv_dim();
  std::memcpy(k_[layer].get() + off, k, cfg_.kv_dim() * sizeof(float));
  std::memcpy(v_[layer].get() + off, v, cfg_.kv_dim() * sizeof(float));
}

void Selector::copy_pages(const std::vector<PageAllocator::PageCopy>& copies, int first, int last) {
  const size_t row = static_cast<size_t>(cfg_.kv_dim()), page = static_cast<size_t>(alloc_.page_size()) * row;
  for (const PageAllocator::PageCopy& c : copies)
    for (int l = first; l <= last; ++l) {
      if (!k_[static_cast<size_t>(l)]) continue;  // a layer this shard does not hold
      std::memcpy(k_[l].get() + c.dst * page, k_[l].get() + c.src * page, c.slots * row * sizeof(float));
      std::memcpy(v_[l].get() + c.dst * page, v_[l].get() + c.src * page, c.slots * row * sizeof(float));
    }
}

void Selector::init_layer(uint64_t seq, int layer, int len, const float* k, const float* v, int num_queries,
                          const float* queries, const SharedPrefix& share) {
  check_held(layer);
  SPADE_CHECK(len > 0, "cache rank: sequence {} initialised with {} tokens", seq, len);
  SPADE_CHECK(share.tokens >= 0 && share.tokens < len,
              "cache rank: sequence {} initialised with {} tokens shares {} tokens of sequence {}", seq, len,
              share.tokens, share.from);
  // A shared INIT reads `from`'s KV of this layer: it must be held and have written this layer.
  auto check_from = [&] {
    auto src = seqs_.find(share.from);
    SPADE_CHECK(src != seqs_.end() && share.from != seq,
                "cache rank: sequence {} shares its first {} tokens with sequence {}, which this cache rank does not "
                "hold",
                seq, share.tokens, share.from);
    SPADE_CHECK(alloc_.seq_len(share.from) >= share.tokens,
                "cache rank: sequence {} shares its first {} tokens with sequence {}, which holds only {}", seq,
                share.tokens, share.from, alloc_.seq_len(share.from));
    SPADE_CHECK(src->second.layer_ready[static_cast<size_t>(layer)] != 0,
                "cache rank: sequence {} shares the KV of layer {} of sequence {} before that sequence initialised it "
                "(its INIT must come first)",
                seq, layer, share.from);
  };
  if (!seqs_.count(seq)) {
    if (share.tokens > 0) {
      check_from();
      alloc_.fork_prefix(share.from, seq, share.tokens);
    } else {
      alloc_.admit(seq);
    }
    if (!alloc_.append(seq, len - share.tokens)) {
      alloc_.release(seq);
      (void)alloc_.take_copies();
      fail("cache rank KV pool exhausted: sequence {} needs {} pages, {} of {} free{}{}", seq, alloc_.pages_for(len),
           alloc_.num_free_pages(), alloc_.num_pages(),
           share.tokens > 0 ? fmt::format(" (its first {} tokens shared with sequence {})", share.tokens, share.from)
                            : std::string(),
           num_retained_ > 0 ? fmt::format("; {} retained prefixes hold {} tokens (size the cache rank's --kv-pages for "
                                           "the inference rank's pool plus its --max-retained-prefix-tokens)",
                                           num_retained_, retained_tokens())
                             : std::string());
    }
    SeqState s;
    s.window.assign(cfg_.num_layers, std::vector<float>(static_cast<size_t>(cfg_.num_q_heads) * window_cap_ * cfg_.head_dim));
    s.window_len.assign(cfg_.num_layers, 0);
    s.anchor_q.assign(cfg_.num_layers, {});
    s.anchor_pos_end.assign(cfg_.num_layers, 0);
    s.anchors.assign(cfg_.num_layers, {});
    s.layer_ready.assign(cfg_.num_layers, 0);
    s.share = share;
    s.init_copies = alloc_.take_copies();  // a shared partial page: copied layer by layer below
    seqs_.emplace(seq, std::move(s));
  }
  SeqState& s = state(seq);
  SPADE_CHECK(!s.retained, "cache rank: INIT of sequence {}, which is a retained prefix here (an ended sequence)", seq);
  SPADE_CHECK(alloc_.seq_len(seq) == len, "cache rank: sequence {} layer {} initialised with {} tokens, other layers {}",
              seq, layer, len, alloc_.seq_len(seq));
  SPADE_CHECK(s.share.tokens == share.tokens && (share.tokens == 0 || s.share.from == share.from),
              "cache rank: sequence {} layer {} initialised sharing {} tokens of sequence {}, other layers {} of {}",
              seq, layer, share.tokens, share.from, s.share.tokens, s.share.from);
  if (share.tokens > 0) {
    check_from();
    copy_pages(s.init_copies, layer, layer);
  }
  for (int t = share.tokens; t < len; ++t) {
    const size_t i = static_cast<size_t>(t - share.tokens) * cfg_.kv_dim();
    write_token(seq, layer, t, k + i, v + i);
  }
  s.layer_ready[static_cast<size_t>(layer)] = 1;
  s.window_len[layer] = 0;
  const int first = std::max(0, num_queries - window_cap_);
  for (int i = first; i < num_queries; ++i) push_query(s, layer, queries + static_cast<size_t>(i) * cfg_.q_dim());
  const int na = std::min(num_queries, sc_.anchor_queries);
  s.anchor_q[layer].assign(queries + static_cast<size_t>(num_queries - na) * cfg_.q_dim(),
                           queries + static_cast<size_t>(num_queries) * cfg_.q_dim());
  s.anchor_pos_end[layer] = len;
  s.anchors[layer].clear();
}

void Selector::apply_anchors(uint64_t seq, SeqState& s, int layer, int n, int budget) {
  const int Hkv = cfg_.num_kv_heads, span = sc_.anchor_span, S = sc_.sink_tokens;
  auto& anchors = s.anchors[layer];
  if (anchors.empty()) {  // first predicted selection of this layer: pick the anchors
    anchors.assign(static_cast<size_t>(Hkv) * kernels::kMaxAnchors, -1);
    const auto& q = s.anchor_q[layer];
    const int nq = static_cast<int>(q.size() / cfg_.q_dim());
    if (nq > 0) {
      const auto& bt = alloc_.block_table(seq);
      kernels::SelectAnchorsRefParams ap;
      ap.queries = q.data();
      ap.k_cache = k_[layer].get();
      ap.block_table = bt.data();
      ap.anchors = anchors.data();
      ap.num_queries = nq;
      ap.first_pos = s.anchor_pos_end[layer] - nq;
      ap.num_q_heads = cfg_.num_q_heads;
      ap.num_kv_heads = Hkv;
      ap.head_dim = cfg_.head_dim;
      ap.page_size = alloc_.page_size();
      ap.max_pages_per_seq = static_cast<int>(bt.size());
      // Not the prompt's first tokens (attention sinks: every query scores them high, so the prediction keeps them
      // anyway) nor the span of the anchor queries themselves (recent: the prediction's own ground).
      ap.begin = std::max(S, span);
      ap.end = std::max(ap.begin, s.anchor_pos_end[layer] - std::max(sc_.local_window, nq));
      ap.span = span;
      kernels::select_anchors_ref(ap);
    }
    std::vector<float>().swap(s.anchor_q[layer]);
  }
  // Rows [KV head] of the candidates [S, S + n): the spans within a quarter of the budget become +inf.
  const std::vector<int32_t> lens(static_cast<size_t>(Hkv), n);
  kernels::ApplyAnchorSpansRefParams ap;
  ap.scores = scores_.data();
  ap.row_lens = lens.data();
  ap.anchors = anchors.data();
  ap.rows = Hkv;
  ap.score_stride = n;
  ap.first_pos = S;
  ap.span = span;
  ap.budget = budget;
  ap.successor = sc_.successor_expand;
  kernels::apply_anchor_spans_ref(ap);
}

void Selector::append_layer(uint64_t seq, int layer, int pos, const float* q, const float* k, const float* v) {
  check_held(layer);
  SeqState& s = state(seq);
  SPADE_CHECK(!s.retained, "cache rank: APPEND to sequence {}, which is a retained prefix here (an ended sequence)",
              seq);
  const int len = alloc_.seq_len(seq);
  if (pos == len) {
    if (!alloc_.append(seq, 1))
      fail("cache rank KV pool exhausted while appending to sequence {} ({} pages in all)", seq, alloc_.num_pages());
    // Copy-on-write of a last page shared with another sequence: every layer's tokens so far are written.
    copy_pages(alloc_.take_copies(), 0, cfg_.num_layers - 1);
  } else {
    SPADE_CHECK(pos == len - 1, "cache rank: sequence {} layer {} appends position {} but holds {} tokens", seq, layer,
                pos, len);
  }
  write_token(seq, layer, pos, k, v);
  push_query(s, layer, q);
}

void Selector::predict(uint64_t seq, int layer, float* q_hat) {
  SeqState& s = state(seq);
  kernels::PredictQueryRefParams p;
  p.window = s.window[layer].data();
  p.window_len = &s.window_len[layer];
  p.q_hat = q_hat;
  p.batch = 1;
  p.num_heads = cfg_.num_q_heads;
  p.window_capacity = window_cap_;
  p.head_dim = cfg_.head_dim;
  p.max_regressors = sc_.query_window;
  p.eps = sc_.ridge_eps;
  p.kind = sc_.predictor;
  kernels::predict_next_query_ref(p);
}

void Selector::clear_selection(LayerSelection& out) const {
  const size_t rows = static_cast<size_t>(cfg_.num_kv_heads) * sc_.token_budget;
  out.positions.assign(rows, -1);
  out.k.assign(rows * cfg_.head_dim, 0.f);
  out.v.assign(rows * cfg_.head_dim, 0.f);
  out.count = 0;
}

kernels::PagedAttentionShape Selector::seq_shape(uint64_t seq) const {
  kernels::PagedAttentionShape shape;
  shape.batch = 1;
  shape.num_q_heads = cfg_.num_q_heads;
  shape.num_kv_heads = cfg_.num_kv_heads;
  shape.head_dim = cfg_.head_dim;
  shape.page_size = alloc_.page_size();
  shape.max_pages_per_seq = static_cast<int>(alloc_.block_table(seq).size());
  return shape;
}

template <class P>
void Selector::set_paged(P& p, uint64_t seq, int layer, const int* end) const {
  p.k_cache = k_[layer].get();
  p.block_table = alloc_.block_table(seq).data();
  p.num_tokens = end;
  p.attention_shape() = seq_shape(seq);
  p.rule = sc_.gqa_rule;
}

void Selector::select(uint64_t seq, int layer, int context_len, const float* query, LayerSelection& out, int budget) {
  check_held(layer);
  const int Hkv = cfg_.num_kv_heads, K = sc_.token_budget;
  SPADE_CHECK(budget >= 0 && budget <= K, "sequence {}: token budget {} outside [1, {}] (0 = the rank's)", seq, budget,
              K);
  const int Ke = budget > 0 ? budget : K;  // this sequence's budget; rows keep stride K
  const int len = alloc_.seq_len(seq);
  std::vector<float> q_hat;
  const bool predicted = query == nullptr;
  if (!query) {
    q_hat.resize(cfg_.q_dim());
    predict(seq, layer, q_hat.data());
    query = q_hat.data();
  }
  const int end = std::min(len, context_len - sc_.local_window);  // candidates [S, end)
  clear_selection(out);
  if (end <= sc_.sink_tokens) return;
  scores_.assign(static_cast<size_t>(Hkv) * end, 0.f);
  kernels::ScoreTokensRefParams sp;
  set_paged(sp, seq, layer, &end);
  sp.q_hat = query;
  sp.scores = scores_.data();
  sp.score_stride = end;
  kernels::score_tokens_ref(sp);
  // Scores of the candidates [S, end) only: shift the rows so the sinks are not candidates at all.
  const int n = end - sc_.sink_tokens;
  for (int h = 0; h < Hkv; ++h)
    std::memmove(&scores_[static_cast<size_t>(h) * n], &scores_[static_cast<size_t>(h) * end + sc_.sink_tokens],
                 n * sizeof(float));
  if (predicted && sc_.anchor_queries > 0) apply_anchors(seq, state(seq), layer, n, Ke);
  idx_.assign(static_cast<size_t>(Hkv) * Ke, -1);
  kernels::TopkRefParams tp;
  tp.scores = scores_.data();
  tp.row_lens = &n;
  tp.indices = idx_.data();
  tp.batch = 1;
  tp.rows_per_batch = Hkv;
  tp.score_stride = n;
  tp.k = Ke;
  tp.successor = sc_.successor_expand;
  kernels::topk_ref(tp);
  out.count = std::min(Ke, n);
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < Ke; ++j) {
      const int32_t t = idx_[static_cast<size_t>(h) * Ke + j];
      if (t >= 0) out.positions[static_cast<size_t>(h) * K + j] = t + sc_.sink_tokens;
    }
  gather(seq, layer, out);
}

void Selector::select_pages(uint64_t seq, int layer, int context_len, const float* query, LayerSelection& out,
                            int budget) {
  const int Hkv = cfg_.num_kv_heads, K = sc_.token_budget;
  check_held(layer);
  SPADE_CHECK(query != nullptr, "sequence {}: page selection needs the true query", seq);
  SPADE_CHECK(budget >= 0 && budget <= K, "sequence {}: token budget {} outside [1, {}] (0 = the rank's)", seq, budget,
              K);
  const int Ke = budget > 0 ? budget : K;
  const int len = alloc_.seq_len(seq);
  const int begin = sc_.sink_tokens;
  const int end = std::min(len, context_len - sc_.local_window);  // candidates [S, end)
  clear_selection(out);
  if (end <= begin) return;
  // Quest (kernels/selection_ref.h quest_page_scores_ref, quest_pick_ref): the rule the GPU's quest_select runs.
  const int max_pages = static_cast<int>(alloc_.block_table(seq).size());
  scores_.assign(static_cast<size_t>(Hkv) * max_pages, 0.f);
  kernels::QuestPageScoresRefParams sp;
  set_paged(sp, seq, layer, &end);
  sp.q = query;
  sp.page_scores = scores_.data();
  sp.begin = begin;
  kernels::quest_page_scores_ref(sp);
  idx_.assign(static_cast<size_t>(Hkv) * Ke, -1);
  kernels::QuestPickRefParams pp;
  pp.page_scores = scores_.data();
  pp.num_tokens = &end;
  pp.indices = idx_.data();
  pp.batch = 1;
  pp.num_kv_heads = Hkv;
  pp.page_size = alloc_.page_size();
  pp.max_pages_per_seq = max_pages;
  pp.k = Ke;
  pp.begin = begin;
  kernels::quest_pick_ref(pp);
  for (int h = 0; h < Hkv; ++h)
    std::copy_n(&idx_[static_cast<size_t>(h) * Ke], Ke, &out.positions[static_cast<size_t>(h) * K]);
  out.count = std::min(Ke, end - begin);
  gather(seq, layer, out);
}

void Selector::gather(uint64_t seq, int layer, LayerSelection& out) const {
  kernels::GatherKvRefParams gp;
  gp.k_cache = k_[layer].get();
  gp.v_cache = v_[layer].get();
  gp.block_table = alloc_.block_table(seq).data();
  gp.indices = out.positions.data();
  gp.packed_k = out.k.data();
  gp.packed_v = out.v.data();
  gp.kv_shape() = seq_shape(seq);
  gp.k = sc_.token_budget;
  kernels::gather_kv_ref(gp);
}

void Selector::release(uint64_t seq) {
  alloc_.release(seq);
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  num_retained_ -= it->second.retained ? 1 : 0;
  seqs_.erase(it);
}

void Selector::retain(uint64_t seq, int tokens) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "cache rank: retained prefix of sequence {} ({} retained tokens): this cache rank "
              "does not hold that sequence", seq, tokens);
  const int held = alloc_.seq_len(seq);
  SPADE_CHECK(tokens >= 1 && tokens <= held,
              "cache rank: retained prefix of sequence {}: retained tokens = {} outside 1..{} (the tokens it holds)",
              seq, tokens, held);
  SeqState& s = it->second;
  if (!s.retained) {
    s.retained = true;
    ++num_retained_;
    // KV only from here on: a later INIT shares it (layer_ready stays as it is).
    std::vector<std::vector<float>>().swap(s.window);
    std::vector<std::vector<float>>().swap(s.anchor_q);
    std::vector<std::vector<int32_t>>().swap(s.anchors);
    s.window_len.assign(s.window_len.size(), 0);
  }
  alloc_.truncate(seq, tokens);
}

void Selector::drop_retained(uint64_t seq) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end() && it->second.retained,
              "cache rank: dropped retained prefix {}: {}", seq,
              it == seqs_.end() ? "this cache rank does not hold that sequence" : "it is a live sequence, not a retained prefix");
  release(seq);
}

bool Selector::is_retained(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it != seqs_.end() && it->second.retained;
}

int64_t Selector::retained_tokens() const {
  int64_t n = 0;
  for (const auto& [id, s] : seqs_)
    if (s.retained) n += alloc_.seq_len(id);
  return n;
}

}  // namespace spade::cache

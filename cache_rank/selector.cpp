#include "cache_rank/selector.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace spade::cache {

Selector::Selector(const ModelConfig& cfg, SelectionConfig sc, int num_pages, int page_size)
    : cfg_(cfg), sc_(sc), window_cap_(sc.query_window + 1), alloc_(num_pages, page_size) {
  validate(sc_);
  const size_t n = static_cast<size_t>(num_pages) * page_size * cfg.kv_dim();
  for (int l = 0; l < cfg.num_layers; ++l) {
    k_.emplace_back(new float[n]);
    v_.emplace_back(new float[n]);
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
  const auto [page, slot] = alloc_.locate(seq, pos);
  const size_t off = (static_cast<size_t>(page) * alloc_.page_size() + slot) * cfg_.kv_dim();
  std::memcpy(k_[layer].get() + off, k, cfg_.kv_dim() * sizeof(float));
  std::memcpy(v_[layer].get() + off, v, cfg_.kv_dim() * sizeof(float));
}

void Selector::init_layer(uint64_t seq, int layer, int len, const float* k, const float* v, int num_queries,
                          const float* queries) {
  SPADE_CHECK(layer >= 0 && layer < cfg_.num_layers, "cache rank: layer {} outside 0..{}", layer, cfg_.num_layers - 1);
  SPADE_CHECK(len > 0, "cache rank: sequence {} initialised with {} tokens", seq, len);
  if (!seqs_.count(seq)) {
    alloc_.admit(seq);
    if (!alloc_.append(seq, len)) {
      alloc_.release(seq);
      fail("cache rank KV pool exhausted: sequence {} needs {} pages, {} of {} free", seq, alloc_.pages_for(len),
           alloc_.num_free_pages(), alloc_.num_pages());
    }
    SeqState s;
    s.window.assign(cfg_.num_layers, std::vector<float>(static_cast<size_t>(cfg_.num_q_heads) * window_cap_ * cfg_.head_dim));
    s.window_len.assign(cfg_.num_layers, 0);
    s.anchor_q.assign(cfg_.num_layers, {});
    s.anchor_pos_end.assign(cfg_.num_layers, 0);
    s.anchors.assign(cfg_.num_layers, {});
    seqs_.emplace(seq, std::move(s));
  }
  SPADE_CHECK(alloc_.seq_len(seq) == len, "cache rank: sequence {} layer {} initialised with {} tokens, other layers {}",
              seq, layer, len, alloc_.seq_len(seq));
  for (int t = 0; t < len; ++t)
    write_token(seq, layer, t, k + static_cast<size_t>(t) * cfg_.kv_dim(), v + static_cast<size_t>(t) * cfg_.kv_dim());
  SeqState& s = state(seq);
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
  const int cap = budget / 4;
  for (int h = 0; h < Hkv; ++h) {
    int used = 0;
    for (int a = 0; a < kernels::kMaxAnchors; ++a) {
      const int32_t t0 = anchors[static_cast<size_t>(h) * kernels::kMaxAnchors + a];
      // A span costs span tokens, one more with successor expansion (the token after it inherits +inf).
      const int cost = span + (sc_.successor_expand ? 1 : 0);
      if (t0 < 0 || used + cost > cap) break;
      used += cost;
      for (int t = std::max(t0, S); t < std::min(t0 + span, S + n); ++t)
        scores_[static_cast<size_t>(h) * n + (t - S)] = std::numeric_limits<float>::infinity();
    }
  }
}

void Selector::append_layer(uint64_t seq, int layer, int pos, const float* q, const float* k, const float* v) {
  SeqState& s = state(seq);
  const int len = alloc_.seq_len(seq);
  if (pos == len) {
    if (!alloc_.append(seq, 1))
      fail("cache rank KV pool exhausted while appending to sequence {} ({} pages in all)", seq, alloc_.num_pages());
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

void Selector::select(uint64_t seq, int layer, int context_len, const float* query, LayerSelection& out, int budget) {
  const int Hkv = cfg_.num_kv_heads, D = cfg_.head_dim, K = sc_.token_budget;
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
  out.positions.assign(static_cast<size_t>(Hkv) * K, -1);
  out.k.assign(static_cast<size_t>(Hkv) * K * D, 0.f);
  out.v.assign(static_cast<size_t>(Hkv) * K * D, 0.f);
  out.count = 0;
  if (end <= sc_.sink_tokens) return;
  const auto& bt = alloc_.block_table(seq);
  const int max_pages = static_cast<int>(bt.size());
  scores_.assign(static_cast<size_t>(Hkv) * end, 0.f);
  kernels::ScoreTokensRefParams sp;
  sp.q_hat = query;
  sp.k_cache = k_[layer].get();
  sp.block_table = bt.data();
  sp.num_tokens = &end;
  sp.scores = scores_.data();
  sp.batch = 1;
  sp.num_q_heads = cfg_.num_q_heads;
  sp.num_kv_heads = Hkv;
  sp.head_dim = D;
  sp.page_size = alloc_.page_size();
  sp.max_pages_per_seq = max_pages;
  sp.score_stride = end;
  sp.rule = sc_.gqa_rule;
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
  const int Hkv = cfg_.num_kv_heads, Hq = cfg_.num_q_heads, D = cfg_.head_dim, K = sc_.token_budget;
  const int G = Hq / Hkv, P = alloc_.page_size();
  SPADE_CHECK(query != nullptr, "sequence {}: page selection needs the true query", seq);
  SPADE_CHECK(budget >= 0 && budget <= K, "sequence {}: token budget {} outside [1, {}] (0 = the rank's)", seq, budget,
              K);
  const int Ke = budget > 0 ? budget : K;
  const int len = alloc_.seq_len(seq);
  const int begin = sc_.sink_tokens;
  const int end = std::min(len, context_len - sc_.local_window);  // candidates [S, end)
  out.positions.assign(static_cast<size_t>(Hkv) * K, -1);
  out.k.assign(static_cast<size_t>(Hkv) * K * D, 0.f);
  out.v.assign(static_cast<size_t>(Hkv) * K * D, 0.f);
  out.count = 0;
  if (end <= begin) return;
  const auto& bt = alloc_.block_table(seq);
  const int first_page = begin / P, last_page = (end - 1) / P, npages = last_page - first_page + 1;
  const float* kc = k_[layer].get();
  std::vector<float> mn(D), mx(D);
  std::vector<std::pair<float, int>> page_scores(npages);
  std::vector<int> counts(Hkv, 0);
  for (int h = 0; h < Hkv; ++h) {
    for (int pi = 0; pi < npages; ++pi) {
      const int pg = first_page + pi;
      const int t0 = std::max(begin, pg * P), t1 = std::min(end, (pg + 1) * P);
      std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      for (int t = t0; t < t1; ++t) {
        const float* kr = kc + ((static_cast<size_t>(bt[t / P]) * P + t % P) * Hkv + h) * D;
        for (int d = 0; d < D; ++d) {
          mn[d] = std::min(mn[d], kr[d]);
          mx[d] = std::max(mx[d], kr[d]);
        }
      }
      float combined = sc_.gqa_rule == kernels::GqaScoreRule::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
      for (int g = 0; g < G; ++g) {
        const float* q = query + static_cast<size_t>(h * G + g) * D;
        float sc = 0.f;
        for (int d = 0; d < D; ++d) sc += std::max(q[d] * mn[d], q[d] * mx[d]);
        combined = sc_.gqa_rule == kernels::GqaScoreRule::kMax ? std::max(combined, sc) : combined + sc / G;
      }
      page_scores[pi] = {combined, pg};
    }
    // Best pages first (ties: earlier page), taken whole until the budget is reached (the last one cut).
    std::sort(page_scores.begin(), page_scores.end(),
              [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
    std::vector<int32_t> pos;
    for (const auto& [score, pg] : page_scores) {
      (void)score;
      for (int t = std::max(begin, pg * P); t < std::min(end, (pg + 1) * P) && static_cast<int>(pos.size()) < Ke; ++t)
        pos.push_back(t);
      if (static_cast<int>(pos.size()) >= Ke) break;
    }
    std::sort(pos.begin(), pos.end());
    for (size_t j = 0; j < pos.size(); ++j) out.positions[static_cast<size_t>(h) * K + j] = pos[j];
    counts[h] = static_cast<int>(pos.size());
  }
  out.count = counts[0];
  gather(seq, layer, out);
}

void Selector::gather(uint64_t seq, int layer, LayerSelection& out) const {
  const auto& bt = alloc_.block_table(seq);
  kernels::GatherKvRefParams gp;
  gp.k_cache = k_[layer].get();
  gp.v_cache = v_[layer].get();
  gp.block_table = bt.data();
  gp.indices = out.positions.data();
  gp.packed_k = out.k.data();
  gp.packed_v = out.v.data();
  gp.batch = 1;
  gp.num_kv_heads = cfg_.num_kv_heads;
  gp.head_dim = cfg_.head_dim;
  gp.page_size = alloc_.page_size();
  gp.max_pages_per_seq = static_cast<int>(bt.size());
  gp.k = sc_.token_budget;
  kernels::gather_kv_ref(gp);
}

void Selector::release(uint64_t seq) {
  alloc_.release(seq);
  seqs_.erase(seq);
}

}  // namespace spade::cache

#include "inference_rank/sparse_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/page_allocator.h"
#include "kernels/paged_attention_ref.h"

namespace spade {

SelectionMode parse_selection_mode(const std::string& s) {
  if (s == "dense") return SelectionMode::Dense;
  if (s == "oracle") return SelectionMode::Oracle;
  if (s == "predicted") return SelectionMode::Predicted;
  if (s == "quest") return SelectionMode::Quest;
  fail("unknown selection mode '{}' (dense | oracle | predicted | quest)", s);
}

const char* selection_mode_name(SelectionMode m) {
  switch (m) {
    case SelectionMode::Dense: return "dense";
    case SelectionMode::Oracle: return "oracle";
    case SelectionMode::Predicted: return "predicted";
    case SelectionMode::Quest: return "quest";
  }
  return "?";
}

SparseAttention::SparseAttention(const ModelConfig& cfg, KvCache& cache, const SparseOptions& opt,
                                 std::unique_ptr<pair::CacheRankLink> link)
    : cfg_(cfg), cache_(cache), opt_(opt), link_(std::move(link)) {
  pair::validate(static_cast<const pair::SparseConfig&>(opt_));
  SPADE_CHECK(opt_.max_retained_prefix_tokens >= 0, "--max-retained-prefix-tokens must be >= 0, got {}",
              opt_.max_retained_prefix_tokens);
  num_packs_ = (cfg.num_layers + opt_.layers_per_pack - 1) / opt_.layers_per_pack;
  expect_reply_.assign(num_packs_, false);
  expect_now_.assign(num_packs_, false);
  if (opt_.mode == SelectionMode::Predicted && !link_)
    fail("selection mode 'predicted' needs a cache rank link");
  if (synchronous())
    oracle_ = std::make_unique<cache::InProcessLink>(cfg, opt_.selection, cache.num_pages(), cache.page_size());
}

int SparseOptions::prefix_recompute_tokens() const {
  if (mode == SelectionMode::Dense) return 1;
  return std::max({1, selection.query_window + 1, selection.anchor_queries});
}

void SparseAttention::fail_link(const std::string& why) {
  if (!link_error_.empty()) return;
  link_error_ = why;
  for (auto& [id, s] : seqs_) {
    if (s.phase == Phase::Sparse || s.phase == Phase::Switching) {
      s.phase = Phase::Failed;
      failures_.emplace_back(id, why);
      ++stats_.failed_seqs;
    }
  }
  std::fill(expect_reply_.begin(), expect_reply_.end(), false);
  std::fill(expect_now_.begin(), expect_now_.end(), false);
  forget_retained();
}

bool SparseAttention::retention_on() const {
  return opt_.mode == SelectionMode::Predicted && opt_.max_retained_prefix_tokens > 0 && pages_ != nullptr &&
         pages_->prefix_caching() && link_error_.empty() && link_ != nullptr;
}

void SparseAttention::retain_prefix(uint64_t id, const std::vector<std::pair<int32_t, uint64_t>>& pages) {
  const int page = cache_.page_size();
  const int run = std::min(pages_->published_run(pages), opt_.max_retained_prefix_tokens / page);
  if (run == 0) return;
  // One retained prefix covering another is enough: keep the longer.
  std::vector<uint64_t> covered;
  for (auto& [rid, r] : retained_) {
    size_t common = 0;
    while (common < r.pages.size() && common < static_cast<size_t>(run) && r.pages[common] == pages[common]) ++common;
    if (common >= static_cast<size_t>(run)) {  // this one holds it all already
      r.used = ++use_clock_;
      return;
    }
    if (common == r.pages.size()) covered.push_back(rid);
  }
  for (uint64_t rid : covered) {
    shorten_retained(rid, 0);
    ++stats_.retained_dropped;
  }
  Retained r;
  r.pages.assign(pages.begin(), pages.begin() + run);
  r.tokens = run * page;
  r.used = ++use_clock_;
  retained_tokens_ += r.tokens;
  retain_out_.push_back({id, r.tokens});
  retained_.emplace(id, std::move(r));
  ++stats_.retained_prefixes;
  while (retained_tokens_ > opt_.max_retained_prefix_tokens) {  // the bound: least recently used first
    auto lru = std::min_element(retained_.begin(), retained_.end(),
                                [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
    shorten_retained(lru->first, 0);
    ++stats_.retained_dropped;
  }
}

void SparseAttention::shorten_retained(uint64_t id, int pages) {
  auto it = retained_.find(id);
  SPADE_CHECK(it != retained_.end(), "retained prefix {}: not held", id);
  Retained& r = it->second;
  const int tokens = pages * cache_.page_size();
  retained_tokens_ -= r.tokens - tokens;
  // Not sent yet (its release travels with it): change the pending entry instead of adding one.
  auto pending = std::find_if(retain_out_.begin(), retain_out_.end(), [&](const pair::Retain& e) { return e.seq_id == id; });
  if (pages == 0) {
    const bool releasing = std::find(released_.begin(), released_.end(), id) != released_.end();
    if (pending != retain_out_.end()) retain_out_.erase(pending);
    if (!releasing) drop_out_.push_back(id);  // else its pending release frees it
    retained_.erase(it);
    return;
  }
  r.pages.resize(static_cast<size_t>(pages));
  r.tokens = tokens;
  if (pending != retain_out_.end())
    pending->tokens = tokens;
  else
    retain_out_.push_back({id, tokens});
}

void SparseAttention::check_retained() {
  if (retained_.empty()) return;
  std::vector<std::pair<uint64_t, int>> changed;
  for (const auto& [id, r] : retained_) {
    const int run = pages_->published_run(r.pages);
    if (run < static_cast<int>(r.pages.size())) changed.emplace_back(id, run);
  }
  for (const auto& [id, run] : changed) {
    shorten_retained(id, run);
    stats_.retained_dropped += run == 0;
  }
}

void SparseAttention::forget_retained() {
  retained_.clear();
  retain_out_.clear();
  drop_out_.clear();
  retained_tokens_ = 0;
}

void SparseAttention::take_pair_news(pair::PackUpdate& u) {
  u.released.swap(released_);
  u.retained.swap(retain_out_);
  u.dropped.swap(drop_out_);
  released_.clear();
  retain_out_.clear();
  drop_out_.clear();
}

void SparseAttention::drop_unread_answers() {
  if (opt_.mode != SelectionMode::Predicted || !link_error_.empty()) {
    std::fill(expect_reply_.begin(), expect_reply_.end(), false);
    return;
  }
  for (int p = 0; p < num_packs_; ++p) {
    if (!expect_reply_[p]) continue;
    expect_reply_[p] = false;
    try {
      bool waited = false;
      pair::PackSelection stale = link_->receive(transport::Clock::now() + opt_.selection_deadline, &waited);
      SPADE_CHECK(stale.pack == p, "cache rank {}: unread answer for pack {} arrived where pack {} was expected",
                  link_->peer(), stale.pack, p);
      ++stats_.dropped_answers;
      // The engine failed the step's batch, so its sequences are gone; one that is not has lost its selection (and,
      // with delta transfer, its slot table would no longer match the cache rank's mirror): fail it.
      for (const pair::SeqSelection& e : stale.seqs) {
        auto it = seqs_.find(e.seq_id);
        if (it == seqs_.end()) continue;
        SeqState& s = it->second;
        if (s.phase == Phase::Sparse || s.phase == Phase::Switching) {
          s.phase = Phase::Failed;
          failures_.emplace_back(e.seq_id, "its selection for the next step was lost: the step ended with an error");
          ++stats_.failed_seqs;
        }
      }
    } catch (const Error& e) {
      fail_link(e.what());
      return;
    }
  }
}

void SparseAttention::begin_step(const ForwardBatch& batch) {
  ++step_;
  ++stats_.steps;
  stats_.stalls_per_step.push_back(0);
  // A step that ended early (an exception in the forward pass fails its batch) left the previous step's answers for
  // the packs it never reached unread; they come first on the link.
  drop_unread_answers();
  // A link its transport already knows to be dead (a PeerDown aborted it while no operation was pending) fails now,
  // so that no sequence starts switching to sparse over it: they all decode densely.
  if (opt_.mode == SelectionMode::Predicted && link_error_.empty() && link_)
    if (std::string why = link_->failure(); !why.empty()) fail_link(why);
  expect_reply_ = expect_now_;
  std::fill(expect_now_.begin(), expect_now_.end(), false);
  phase_.assign(batch.batch(), Phase::Dense);
  const bool can_go_sparse = opt_.mode != SelectionMode::Dense && link_error_.empty();
  for (int b = 0; b < batch.batch(); ++b) {
    const uint64_t id = batch.seq_ids[b];
    SeqState& s = seqs_[id];
    if (s.queries.empty()) s.queries.assign(cfg_.num_layers, {});
    const int q_len = batch.cu_q_lens[b + 1] - batch.cu_q_lens[b];
    const int L = batch.seq_lens[b];
    if (s.phase == Phase::Switching) s.phase = Phase::Sparse;  // INIT went out last step
    const int threshold = s.sparse_threshold > 0 ? s.sparse_threshold : opt_.sparse_threshold;
    if (s.phase == Phase::Dense && !s.force_dense && q_len == 1 && L >= threshold) {
      if (can_go_sparse) {
        s.phase = Phase::Switching;
        ++stats_.switches;
      } else if (opt_.mode != SelectionMode::Dense) {
        ++stats_.dense_fallbacks;
        s.phase = Phase::Failed;  // never retried: decoded densely until it ends
      }
    }
    if (s.phase == Phase::Sparse) {
      SPADE_CHECK(q_len == 1, "sparse sequence {} got {} tokens in one step", id, q_len);
      ++stats_.sparse_seq_steps;
    }
    phase_[b] = s.phase;
  }
  // Retained prefixes whose pages this step's admissions and appends evicted are shortened or dropped in the step's
  // first update, ahead of every INIT that could share from them.
  if (opt_.mode == SelectionMode::Predicted && link_error_.empty()) check_retained();
  // Sequences that left the batch are released on the cache rank with the next update.
  if (opt_.mode == SelectionMode::Predicted && link_error_.empty() && has_pair_news()) {
    bool any = false;
    for (Phase p : phase_) any = any || p == Phase::Sparse || p == Phase::Switching;
    if (!any) {  // no update would carry them this step: send a release-only update for pack 0
      pair::PackUpdate u;
      u.step = step_;
      u.pack = 0;
      u.first_layer = 0;
      u.num_layers = 0;
      take_pair_news(u);
      try {
        link_->send(std::move(u));
        expect_now_[0] = true;
      } catch (const Error& e) {
        fail_link(e.what());
      }
    }
  }
}

void SparseAttention::set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold, int token_budget) {
  SPADE_CHECK(sparse_threshold >= 0, "sparse_threshold must be >= 0, got {}", sparse_threshold);
  SPADE_CHECK(token_budget >= 0 && token_budget <= opt_.selection.token_budget,
              "token_budget {} is above this rank's --token-budget {}", token_budget, opt_.selection.token_budget);
  SeqState& s = seqs_[seq_id];
  s.force_dense = force_dense;
  s.sparse_threshold = sparse_threshold;
  s.token_budget = token_budget;
}

void SparseAttention::replace_link(std::unique_ptr<pair::CacheRankLink> link) {
  SPADE_CHECK(opt_.mode == SelectionMode::Predicted, "replace_link: selection mode {} uses no cache rank",
              selection_mode_name(opt_.mode));
  SPADE_CHECK(link != nullptr, "replace_link: no link");
  // The old link's sequences cannot go on over the new one: fail them (their requests end with this error), as a
  // failing link would.
  if (link_error_.empty()) fail_link(link_ ? link_->peer() + " was replaced" : std::string("the link was replaced"));
  link_ = std::move(link);
  link_error_.clear();
  released_.clear();
  forget_retained();
  std::fill(expect_reply_.begin(), expect_reply_.end(), false);
  std::fill(expect_now_.begin(), expect_now_.end(), false);
}

void SparseAttention::idle_flush() {
  if (opt_.mode != SelectionMode::Predicted || !link_error_.empty()) {
    released_.clear();
    forget_retained();
    return;
  }
  drop_unread_answers();
  if (!link_error_.empty()) {
    released_.clear();
    forget_retained();
    return;
  }
  check_retained();
  try {
    for (size_t pack = 0; pack < expect_now_.size(); ++pack) {  // answers for sequences that have all ended
      if (!expect_now_[pack]) continue;
      expect_now_[pack] = false;
      bool waited = false;
      (void)link_->receive(transport::Clock::now() + opt_.selection_deadline, &waited);
    }
    if (!has_pair_news()) return;
    pair::PackUpdate u;
    u.step = ++step_;
    u.pack = 0;
    u.first_layer = 0;
    u.num_layers = 0;
    take_pair_news(u);
    link_->send(std::move(u));
    bool waited = false;
    (void)link_->receive(transport::Clock::now() + opt_.selection_deadline, &waited);
  } catch (const Error& e) {
    fail_link(e.what());
  }
}

void SparseAttention::receive_pack(int pack) {
  if (!expect_reply_[pack] || !link_error_.empty()) return;
  expect_reply_[pack] = false;
  try {
    bool waited = false;
    const auto t0 = std::chrono::steady_clock::now();
    pair::PackSelection p = link_->receive(transport::Clock::now() + opt_.selection_deadline, &waited);
    if (waited) {
      ++stats_.stalls;
      ++stats_.stalls_per_step.back();
      stats_.stall_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    SPADE_CHECK(p.pack == pack, "cache rank {}: answer for pack {} arrived where pack {} was expected", link_->peer(),
                p.pack, pack);
    for (pair::SeqSelection& e : p.seqs) {
      auto it = seqs_.find(e.seq_id);
      if (it == seqs_.end()) continue;  // finished meanwhile
      SeqState& s = it->second;
      if (s.sel.empty()) s.sel.resize(cfg_.num_layers);
      const int first = pack * opt_.layers_per_pack;
      if (p.delta) {
        // Delta transfer: update the held slot tables in place (pair/delta.h).
        SPADE_CHECK(first + e.deltas.size() <= s.sel.size(), "cache rank {}: delta for {} layers from layer {}",
                    link_->peer(), e.deltas.size(), first);
        for (size_t i = 0; i < e.deltas.size(); ++i)
          pair::apply_delta(e.deltas[i], s.sel[first + i], cfg_.num_kv_heads, opt_.selection.token_budget,
                             cfg_.head_dim, link_->peer());
      } else {
        for (size_t i = 0; i < e.layers.size(); ++i) s.sel[first + i] = std::move(e.layers[i]);
      }
      s.sel_context_len = e.context_len;
    }
  } catch (const Error& e) {
    fail_link(e.what());
  }
}

void SparseAttention::choose_shared_prefix(uint64_t id, SeqState& s, const int32_t* pages, int len) {
  s.init_pages.clear();
  s.shared_tokens = 0;
  s.shared_from = 0;
  if (!pages_) return;
  const int page = cache_.page_size();
  for (int i = 0; i < len / page && pages[i] >= 0; ++i) s.init_pages.emplace_back(pages[i], pages_->page_serial(pages[i]));
  // A source must be held by the cache rank when this INIT arrives there: sparse already (its INIT went out in an
  // earlier step), or switching with its INIT earlier in this update.
  int best = 0;
  // The longest common page run wins; among equal runs the lowest id.
  auto consider = [&](uint64_t xid, const auto& x_pages) {
    int run = 0;
    const size_t n = std::min(s.init_pages.size(), x_pages.size());
    while (static_cast<size_t>(run) < n && s.init_pages[run] == x_pages[run]) ++run;
    if (run > best || (run == best && run > 0 && xid < s.shared_from)) {
      best = run;
      s.shared_from = xid;
    }
  };
  for (const auto& [xid, x] : seqs_) {
    if (xid == id || x.init_pages.empty()) continue;
    bool held = x.phase == Phase::Sparse;
    if (x.phase == Phase::Switching)
      for (const pair::SeqUpdate& e : pending_.seqs) held = held || (e.seq_id == xid && e.init);
    if (held) consider(xid, x.init_pages);
  }
  // Retained prefixes (ended sequences; check_retained ran at this step's start, so their pages are still valid).
  for (const auto& [xid, x] : retained_) consider(xid, x.pages);
  // The current token (position len - 1) is this sequence's own: never shared.
  s.shared_tokens = std::min(best * page, (len - 1) / page * page);
  if (s.shared_tokens == 0) s.shared_from = 0;
  if (auto r = retained_.find(s.shared_from); s.shared_tokens > 0 && r != retained_.end()) {
    r->second.used = ++use_clock_;
    stats_.retained_reused_tokens += static_cast<uint64_t>(s.shared_tokens);
  }
}

void SparseAttention::attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
                             float* out) {
  if (layer == 0) begin_step(batch);
  const int Hq = cfg_.num_q_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim, G = cfg_.gqa_group();
  const int Q = cfg_.q_dim(), KV = cfg_.kv_dim(), P = opt_.layers_per_pack;
  const int pack = layer / P, first = pack * P, last = std::min(cfg_.num_layers, first + P) - 1;
  const int page = cache_.page_size();
  const size_t page_stride = static_cast<size_t>(page) * KV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto& sc = opt_.selection;

  write_kv_pages(batch, k, v, cache_.k(layer), cache_.v(layer), page, KV);
  if (opt_.mode == SelectionMode::Predicted && layer == first) receive_pack(pack);
  if (layer == first) {
    pending_ = pair::PackUpdate{};
    pending_.step = step_;
    pending_.pack = pack;
    pending_.first_layer = first;
    pending_.num_layers = last - first + 1;
  }

  const int W1 = opt_.prefix_recompute_tokens();  // the predictor's window; the prompt anchors
  for (int b = 0; b < batch.batch(); ++b) {
    const uint64_t id = batch.seq_ids[b];
    SeqState& s = seqs_[id];
    const int q0 = batch.cu_q_lens[b], q_len = batch.cu_q_lens[b + 1] - q0, L = batch.seq_lens[b];
    const int32_t* pages = batch.block_table.data() + static_cast<size_t>(b) * batch.max_pages;
    auto row = [&](const float* base, int pos, int kvh) {
      return base + pages[pos / page] * page_stride + static_cast<size_t>(pos % page) * KV + static_cast<size_t>(kvh) * D;
    };
    // Remember the last W+1 queries of this layer (the INIT ship needs them).
    auto& qw = s.queries[layer];
    for (int i = std::max(0, q_len - W1); i < q_len; ++i)
      qw.insert(qw.end(), q + static_cast<size_t>(q0 + i) * Q, q + static_cast<size_t>(q0 + i + 1) * Q);
    if (qw.size() > static_cast<size_t>(W1) * Q) qw.erase(qw.begin(), qw.end() - static_cast<long>(W1) * Q);

    Phase ph = phase_[b];
    // A sequence past the threshold without a cache rank (dense fallback) is attended densely: its local KV is
    // complete. A sequence failed by the link has lost the middle of its KV: its output is discarded by the engine.
    if (s.phase == Phase::Failed) {
      if (s.dropped) {
        std::fill(out + static_cast<size_t>(q0) * Q, out + static_cast<size_t>(q0 + q_len) * Q, 0.f);
        continue;
      }
      ph = Phase::Dense;
    }

    // Oracle: inline selection with the true query; the selector holds its own copy of the KV.
    const pair::LayerSelection* sel = nullptr;
    pair::LayerSelection oracle_sel;
    if (synchronous() && (ph == Phase::Switching || ph == Phase::Sparse)) {
      cache::Selector& os = oracle_->selector();
      const float* qr = q + static_cast<size_t>(q0) * Q;
      if (ph == Phase::Switching) {
        std::vector<float> kk(static_cast<size_t>(L) * KV), vv(kk.size());
        for (int t = 0; t < L; ++t) {
          std::memcpy(&kk[static_cast<size_t>(t) * KV], row(cache_.k(layer), t, 0), KV * sizeof(float));
          std::memcpy(&vv[static_cast<size_t>(t) * KV], row(cache_.v(layer), t, 0), KV * sizeof(float));
        }
        os.init_layer(id, layer, L, kk.data(), vv.data(), static_cast<int>(qw.size() / Q), qw.data());
      } else {
        os.append_layer(id, layer, L - 1, qr, k + static_cast<size_t>(q0) * KV, v + static_cast<size_t>(q0) * KV);
        if (opt_.mode == SelectionMode::Quest)
          os.select_pages(id, layer, L, qr, oracle_sel, s.token_budget);
        else
          os.select(id, layer, L, qr, oracle_sel, s.token_budget);
        sel = &oracle_sel;
      }
    } else if (ph == Phase::Sparse) {
      SPADE_CHECK(!s.sel.empty() && s.sel_context_len == L,
                  "sparse sequence {}: no selection for context length {} (have {})", id, L, s.sel_context_len);
      sel = &s.sel[layer];
    }

    // Predicted: queue this layer's part of the pack update.
    if (opt_.mode == SelectionMode::Predicted && (ph == Phase::Switching || ph == Phase::Sparse)) {
      if (layer == first) {
        pair::SeqUpdate u;
        u.seq_id = id;
        u.context_len = L;
        u.init = ph == Phase::Switching;
        u.num_queries = u.init ? static_cast<int>(qw.size() / Q) : 1;
        u.token_budget = s.token_budget;
        if (u.init) {
          if (pack == 0) {  // decided once per INIT; every pack's update carries the same share
            choose_shared_prefix(id, s, pages, L);
            stats_.init_tokens += static_cast<uint64_t>(L);
            stats_.init_shared_tokens += static_cast<uint64_t>(s.shared_tokens);
            stats_.shared_inits += s.shared_tokens > 0;
          }
          u.shared_tokens = s.shared_tokens;
          u.shared_from = s.shared_from;
        }
        pending_.seqs.push_back(std::move(u));
      }
      pair::SeqUpdate* u = nullptr;
      for (auto& e : pending_.seqs)
        if (e.seq_id == id) u = &e;
      if (u->init) {
        u->q.insert(u->q.end(), qw.end() - static_cast<long>(u->num_queries) * Q, qw.end());
        for (int t = u->shared_tokens; t < L; ++t) {
          u->k.insert(u->k.end(), row(cache_.k(layer), t, 0), row(cache_.k(layer), t, 0) + KV);
          u->v.insert(u->v.end(), row(cache_.v(layer), t, 0), row(cache_.v(layer), t, 0) + KV);
        }
      } else {
        u->q.insert(u->q.end(), q + static_cast<size_t>(q0) * Q, q + static_cast<size_t>(q0 + 1) * Q);
        u->k.insert(u->k.end(), k + static_cast<size_t>(q0) * KV, k + static_cast<size_t>(q0 + 1) * KV);
        u->v.insert(u->v.end(), v + static_cast<size_t>(q0) * KV, v + static_cast<size_t>(q0 + 1) * KV);
      }
    }

    // A prefill chunk without a selection: the dense path's tiled prefill attention (DensePagedAttention's
    // kernels::paged_attention_ref over this sequence alone), so prefill costs and computes what it does densely.
    // Decode rows keep the two-pass rows below, the arithmetic a sparse step uses.
    if (sel == nullptr && q_len > 1) {
      const int32_t cu[2] = {0, q_len};
      kernels::PagedAttentionParams p = paged_attention_params(cfg_, cache_, layer, batch,
                                                               q + static_cast<size_t>(q0) * Q,
                                                               out + static_cast<size_t>(q0) * Q);
      p.block_table = pages;
      p.cu_q_lens = cu;
      p.seq_lens = &batch.seq_lens[b];
      p.batch = 1;
      kernels::paged_attention_ref(p);
      continue;
    }
    // Attention, per KV head: rows in ascending position order.
    for (int kvh = 0; kvh < Hkv; ++kvh) {
      for (int i = 0; i < q_len; ++i) {
        const int pos = L - q_len + i;
        k_rows_.clear();
        v_rows_.clear();
        if (sel) {
          const int win_begin = std::max(0, L - sc.local_window);
          const int sink_end = std::min(sc.sink_tokens, win_begin);
          for (int t = 0; t < sink_end; ++t) {
            k_rows_.push_back(row(cache_.k(layer), t, kvh));
            v_rows_.push_back(row(cache_.v(layer), t, kvh));
          }
          const size_t base = static_cast<size_t>(kvh) * sc.token_budget;
          // Ascending position order (a delta-updated slot table is in slot order), so the sum runs in the same
          // order as with a full transfer and the result is bit-identical.
          const int32_t* pos_of = sel->positions.data() + base;
          order_.resize(sel->count);
          for (int j = 0; j < sel->count; ++j) order_[j] = j;
          if (!std::is_sorted(pos_of, pos_of + sel->count))
            std::sort(order_.begin(), order_.end(), [&](int x, int y) { return pos_of[x] < pos_of[y]; });
          for (int j : order_) {
            k_rows_.push_back(sel->k.data() + (base + j) * D);
            v_rows_.push_back(sel->v.data() + (base + j) * D);
          }
          for (int t = std::max(win_begin, sink_end); t <= pos; ++t) {
            k_rows_.push_back(row(cache_.k(layer), t, kvh));
            v_rows_.push_back(row(cache_.v(layer), t, kvh));
          }
        } else {
          for (int t = 0; t <= pos; ++t) {
            k_rows_.push_back(row(cache_.k(layer), t, kvh));
            v_rows_.push_back(row(cache_.v(layer), t, kvh));
          }
        }
        scores_.resize(k_rows_.size());
        for (int h = kvh * G; h < (kvh + 1) * G; ++h) {
          const size_t r = static_cast<size_t>(q0 + i) * Hq + h;
          kernels::attention_over_rows_ref(q + r * D, k_rows_.data(), v_rows_.data(), static_cast<int>(k_rows_.size()),
                                           D, scale, scores_.data(), out + r * D);
        }
      }
    }
  }

  // The releases and retained-prefix changes ride the step's first update, taken only now: a forward pass that throws
  // before this send leaves them for the next update. The cache rank applies them before the update's entries.
  if (opt_.mode == SelectionMode::Predicted && layer == last && link_error_.empty() && pack == 0)
    take_pair_news(pending_);
  if (opt_.mode == SelectionMode::Predicted && layer == last && link_error_.empty() &&
      (!pending_.seqs.empty() || !pending_.released.empty() || !pending_.retained.empty() ||
       !pending_.dropped.empty())) {
    try {
      link_->send(std::move(pending_));
      expect_now_[pack] = true;
    } catch (const Error& e) {
      fail_link(e.what());
    }
  }
}

void SparseAttention::on_release(uint64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  const Phase ph = it->second.phase;
  std::vector<std::pair<int32_t, uint64_t>> init_pages = std::move(it->second.init_pages);
  seqs_.erase(it);
  if (ph == Phase::Sparse || ph == Phase::Switching) {
    if (opt_.mode == SelectionMode::Predicted) released_.push_back(seq_id);
    // Sparse: every pack's INIT reached the cache rank (a switching one's may not have, if its step failed).
    if (ph == Phase::Sparse && retention_on() && !init_pages.empty()) retain_prefix(seq_id, init_pages);
    if (synchronous()) oracle_->selector().release(seq_id);
  }
}

std::pair<int, int> SparseAttention::droppable_range(uint64_t seq_id, int seq_len) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return {0, 0};
  SeqState& s = it->second;
  // Switching: the INIT ship of this step carried the whole KV; from the next step on only sinks + window are read.
  if (s.phase != Phase::Sparse && s.phase != Phase::Switching) return {0, 0};
  if (synchronous()) return {0, 0};  // the inline selector reads its own copy; keep it simple
  s.dropped = true;
  return {opt_.selection.sink_tokens, seq_len + 1 - opt_.selection.local_window};
}

std::vector<std::pair<uint64_t, std::string>> SparseAttention::take_failures() {
  std::vector<std::pair<uint64_t, std::string>> f;
  f.swap(failures_);
  return f;
}

}  // namespace spade

// The overlap probe (ProbeBackend) and the measurements it shares with the sparse runs: budgets, the
// variants' selection settings, attention-mass recall. Every selection is cache::Selector's (see
// fidelity_report.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bench/fidelity/fidelity_report.h"
#include "cache_rank/selection_overlap.h"
#include "common/error.h"

namespace spade::fidelity::report {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

const char* rule_name(GqaScoreRule r) {
  return r == GqaScoreRule::kMax ? "max" : "mean";
}

int growing_budget(double frac, int n) {
  if (n <= 0) return 0;
  return std::clamp(static_cast<int>(std::ceil(frac * n)), 1, n);
}

std::string frac_name(double f) {
  const double inv = 1.0 / f;
  if (std::abs(inv - std::round(inv)) < 1e-9) return fmt::format("1/{}", static_cast<int>(std::round(inv)));
  return fmt::format("{:g}", f);
}

int fixed_budget(const Variant& v, int last_context) {
  return std::max(1, growing_budget(v.frac, last_context - v.R - v.S));
}

pair::SelectionConfig selection_config(const Variant& v, int token_budget) {
  pair::SelectionConfig sc;
  sc.token_budget = std::max(1, token_budget);
  sc.local_window = v.R;
  sc.sink_tokens = v.S;
  sc.query_window = v.W;
  sc.ridge_eps = v.eps;
  sc.gqa_rule = v.rule;
  sc.predictor = kernels::PredictorKind::kPaper;
  sc.successor_expand = false;
  return sc;
}

Mean pooled(const std::vector<Mean>& v) {
  Mean m;
  for (const auto& x : v) m.add(x);
  return m;
}

void VariantStats::init(int layers, int prompts) {
  for (auto* v : {&pred, &reuse, &lastq, &chance, &pred_fixed, &reuse_fixed, &chance_fixed, &mass_pred,
                  &mass_reuse, &mass_lastq, &mass_true})
    v->assign(layers, {});
  pred_per_prompt.assign(prompts, {});
  reuse_per_prompt.assign(prompts, {});
}

void QueryHistory::push(const float* q, int dim, int cap) {
  q_dim = dim;
  rows.insert(rows.end(), q, q + dim);
  if (rows.size() > static_cast<size_t>(cap) * dim)
    rows.erase(rows.begin(), rows.end() - static_cast<long>(cap) * dim);
}

void gather_context(const ModelConfig& cfg, const KvCache& kv, int layer, const int32_t* block_table, int len,
                    std::vector<float>& k, std::vector<float>& v) {
  const int KV = cfg.kv_dim(), page = kv.page_size();
  k.resize(static_cast<size_t>(len) * KV);
  v.resize(k.size());
  for (int t = 0; t < len; ++t) {
    const size_t off = (static_cast<size_t>(block_table[t / page]) * page + t % page) * KV;
    std::memcpy(&k[static_cast<size_t>(t) * KV], kv.k(layer) + off, KV * sizeof(float));
    std::memcpy(&v[static_cast<size_t>(t) * KV], kv.v(layer) + off, KV * sizeof(float));
  }
}

void attention_probs(const ModelConfig& cfg, const KvCache& kv, int layer, const int32_t* bt,
                     const float* q_t, int L, std::vector<double>& probs) {
  const int Hq = cfg.num_q_heads, D = cfg.head_dim, G = cfg.gqa_group(), KV = cfg.kv_dim(),
            page = kv.page_size();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  probs.resize(static_cast<size_t>(Hq) * L);
  for (int h = 0; h < Hq; ++h) {
    const float* qh = q_t + static_cast<size_t>(h) * D;
    double* p = &probs[static_cast<size_t>(h) * L];
    double mx = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < L; ++j) {
      const float* kr = kv.k(layer) + (static_cast<size_t>(bt[j / page]) * page + j % page) * KV +
                        static_cast<size_t>(h / G) * D;
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += static_cast<double>(qh[d]) * kr[d];
      p[j] = dot * scale;
      mx = std::max(mx, p[j]);
    }
    double z = 0;
    for (int j = 0; j < L; ++j) z += (p[j] = std::exp(p[j] - mx));
    for (int j = 0; j < L; ++j) p[j] /= z;
  }
}

double mass_recall(const ModelConfig& cfg, const std::vector<double>& probs, int h, int L,
                   const LayerSelection& x, int S, int R) {
  const double* p = &probs[static_cast<size_t>(h) * L];
  double cand = 0, sel = 0;
  for (int j = S; j < L - R; ++j) cand += p[j];
  const size_t stride = x.positions.size() / cfg.num_kv_heads;
  const int32_t* pos = x.positions.data() + static_cast<size_t>(h / cfg.gqa_group()) * stride;
  for (int i = 0; i < x.count; ++i) sel += p[pos[i]];
  return cand > 0 ? sel / cand : kNaN;
}

namespace {

/// The positions of `from` (its k / v rows are not needed once measured).
void keep_positions(const LayerSelection& from, LayerSelection& to) {
  to.count = from.count;
  to.positions = from.positions;
}

}  // namespace

ProbeBackend::ProbeBackend(const ModelConfig& cfg, KvCache& kv, const std::vector<Variant>& vars,
                           std::vector<VariantStats>& stats, int threshold, int last_context, int prompt)
    : cfg_(cfg),
      kv_(kv),
      dense_(cfg, kv),
      vars_(vars),
      stats_(stats),
      threshold_(threshold),
      last_context_(last_context),
      prompt_(prompt) {
  for (const auto& v : vars_) max_w_ = std::max(max_w_, v.W);
}

void ProbeBackend::attend(int layer, const ForwardBatch& batch, const float* q, const float* k,
                          const float* v, float* out) {
  dense_.attend(layer, batch, q, k, v, out);  // writes this step's K/V into the paged cache, then attends
  const int Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  if (layer == 0) {
    for (int b = 0; b < batch.batch(); ++b) {
      const int q_len = batch.cu_q_lens[b + 1] - batch.cu_q_lens[b];
      if (q_len == 1 && batch.seq_lens[b] >= threshold_) {
        for (size_t i = 0; i < vars_.size(); ++i) ++stats_[i].steps;
      }
    }
  }
  for (int b = 0; b < batch.batch(); ++b) {
    Seq& s = seqs_[batch.seq_ids[b]];
    if (s.hist.empty()) s.hist.resize(cfg_.num_layers);
    const int q0 = batch.cu_q_lens[b], q_len = batch.cu_q_lens[b + 1] - q0;
    if (q_len == 1) {
      measure(layer, batch, b, q + static_cast<size_t>(q0) * Q, k + static_cast<size_t>(q0) * KV,
              v + static_cast<size_t>(q0) * KV, s);
    }
    for (int i = std::max(0, q_len - (max_w_ + 1)); i < q_len; ++i)
      s.hist[layer].push(q + static_cast<size_t>(q0 + i) * Q, Q, max_w_ + 1);
  }
}

// The growing-budget predicted selection is the top-k of Selector::predict's q̂; the fixed one is the cache
// rank's own call, select(query = nullptr): they must agree at the same budget.
void ProbeBackend::check_predicted(VariantStats& st, const LayerSelection& nullptr_path,
                                   const LayerSelection& predict_path, int layer, int L) {
  ++st.selector_compares;
  if (nullptr_path.count == predict_path.count && nullptr_path.positions == predict_path.positions) return;
  if (st.selector_mismatches++ == 0)
    st.first_mismatch = fmt::format(
        "predicted selection, layer {}, context {}: select(query = nullptr) kept {} tokens, "
        "select(predict()) {}",
        layer, L, nullptr_path.count, predict_path.count);
}

// The Selectors are fed as the cache rank is (INIT, then appends): the K/V rows a selection gathers from the
// Selector's copy must be the engine's KV at those positions.
void ProbeBackend::check_gathered_kv(VariantStats& st, const LayerSelection& sel, int layer, int L,
                                     const int32_t* bt) {
  ++st.selector_compares;
  const int Hkv = cfg_.num_kv_heads, D = cfg_.head_dim, KV = cfg_.kv_dim(), page = kv_.page_size();
  const size_t stride = sel.positions.size() / Hkv;
  bool same = true;
  for (int h = 0; h < Hkv && same; ++h) {
    for (int j = 0; j < sel.count && same; ++j) {
      const size_t slot = static_cast<size_t>(h) * stride + j;
      const int32_t p = sel.positions[slot];
      const size_t off =
          (static_cast<size_t>(bt[p / page]) * page + p % page) * KV + static_cast<size_t>(h) * D;
      same = std::memcmp(sel.k.data() + slot * D, kv_.k(layer) + off, D * sizeof(float)) == 0 &&
             std::memcmp(sel.v.data() + slot * D, kv_.v(layer) + off, D * sizeof(float)) == 0;
    }
  }
  if (same) return;
  if (st.selector_mismatches++ == 0)
    st.first_mismatch = fmt::format(
        "true-query selection, layer {}, context {}: the K/V rows Selector::select gathered differ from the "
        "engine's",
        layer, L);
}

void ProbeBackend::measure(int layer, const ForwardBatch& batch, int b, const float* q_t, const float* k_t,
                           const float* v_t, Seq& s) {
  const uint64_t id = batch.seq_ids[b];
  const int L = batch.seq_lens[b], Hkv = cfg_.num_kv_heads;
  const int32_t* bt = batch.block_table.data() + static_cast<size_t>(b) * batch.max_pages;
  if (s.vars.empty()) {
    const int pages = (last_context_ + 1 + kPageSize - 1) / kPageSize + 1;
    s.vars.resize(vars_.size());
    for (size_t i = 0; i < vars_.size(); ++i) {
      PerVariant& pv = s.vars[i];
      pv.sel = std::make_unique<cache::Selector>(
          cfg_, selection_config(vars_[i], fixed_budget(vars_[i], last_context_)), pages, kPageSize);
      pv.prev.assign(cfg_.num_layers, {});
      pv.prev_fixed.assign(cfg_.num_layers, {});
      pv.have_prev.assign(cfg_.num_layers, false);
    }
  }
  QueryHistory& hist = s.hist[layer];
  if (!s.inited) {  // the cache rank's INIT, every layer at once: the KV before this step and the recent
                    // queries
    for (int l = 0; l < cfg_.num_layers; ++l) {
      gather_context(cfg_, kv_, l, bt, L - 1, kbuf_, vbuf_);
      for (auto& pv : s.vars)
        pv.sel->init_layer(id, l, L - 1, kbuf_.data(), vbuf_.data(), s.hist[l].count(),
                           s.hist[l].rows.data());
    }
    s.inited = true;
  }
  const bool measured = L >= threshold_;
  bool probs_ready = false;
  true_cache_.clear();
  // The true-query top-k depends on (S, R, k, GQA rule) only — every variant's Selector holds the same KV —
  // so the first variant that needs one selects it for all.
  auto true_sel = [&](const Variant& v, cache::Selector& sel, int k) -> const LayerSelection& {
    const TrueKey key{v.S, v.R, k, v.rule};
    for (auto& [kk, ls] : true_cache_)
      if (kk == key) return ls;
    true_cache_.emplace_back(key, LayerSelection{});
    sel.select(id, layer, L, q_t, true_cache_.back().second, k);
    return true_cache_.back().second;
  };
  q_hat_.resize(cfg_.q_dim());
  for (size_t i = 0; i < vars_.size(); ++i) {
    const Variant& v = vars_[i];
    PerVariant& pv = s.vars[i];
    cache::Selector& sel = *pv.sel;
    VariantStats& st = stats_[i];
    const int n = L - v.R - v.S;
    const int kt = growing_budget(v.frac, n);
    const int K = fixed_budget(v, last_context_);
    const bool m = measured && n > 0;
    // Predicted selection for this step: the window ends at q_{t-1} (the state after the previous step's
    // append).
    if (m) {
      sel.predict(id, layer, q_hat_.data());
      sel.select(id, layer, L, q_hat_.data(), pred_, kt);
      if (v.fixed) {
        sel.select(id, layer, L, nullptr, pred_fixed_);
        sel.select(id, layer, L, q_hat_.data(), pred_check_, K);
        check_predicted(st, pred_fixed_, pred_check_, layer, L);
      }
    }
    sel.append_layer(id, layer, L - 1, q_t, k_t, v_t);
    if (!m) {
      pv.have_prev[layer] = false;
      continue;
    }
    const LayerSelection& T = true_sel(v, sel, kt);
    if (v.lastq) sel.select(id, layer, L, hist.last(), lastq_, kt);
    const double chance = static_cast<double>(kt) / n;
    for (int h = 0; h < Hkv; ++h) {
      const double o = cache::head_overlap_ratio(pred_, T, h, Hkv);
      st.pred[layer].add(o);
      st.pred_per_prompt[prompt_].add(o);
      st.chance[layer].add(chance);
      if (pv.have_prev[layer]) {
        const double r = cache::head_overlap_ratio(pv.prev[layer], T, h, Hkv);
        st.reuse[layer].add(r);
        st.reuse_per_prompt[prompt_].add(r);
      }
      if (v.lastq) st.lastq[layer].add(cache::head_overlap_ratio(lastq_, T, h, Hkv));
    }
    if (v.lastq) {  // attention-mass recall of each selection
      if (!probs_ready) {
        attention_probs(cfg_, kv_, layer, bt, q_t, L, probs_);
        probs_ready = true;
      }
      for (int h = 0; h < cfg_.num_q_heads; ++h) {
        auto add = [&](Mean& acc, const LayerSelection& x) {
          const double r = mass_recall(cfg_, probs_, h, L, x, v.S, v.R);
          if (!std::isnan(r)) acc.add(r);
        };
        add(st.mass_pred[layer], pred_);
        add(st.mass_lastq[layer], lastq_);
        add(st.mass_true[layer], T);
        if (pv.have_prev[layer]) add(st.mass_reuse[layer], pv.prev[layer]);
      }
    }
    if (v.fixed) {
      const LayerSelection& Tf = true_sel(v, sel, K);
      check_gathered_kv(st, Tf, layer, L, bt);
      const double chance_f = static_cast<double>(std::min(K, n)) / n;
      for (int h = 0; h < Hkv; ++h) {
        st.pred_fixed[layer].add(cache::head_overlap_ratio(pred_fixed_, Tf, h, Hkv));
        st.chance_fixed[layer].add(chance_f);
        if (pv.have_prev[layer])
          st.reuse_fixed[layer].add(cache::head_overlap_ratio(pv.prev_fixed[layer], Tf, h, Hkv));
      }
      keep_positions(Tf, pv.prev_fixed[layer]);
    }
    keep_positions(T, pv.prev[layer]);
    pv.have_prev[layer] = true;
  }
}

}  // namespace spade::fidelity::report

// Sparse decoding for the agreement and teacher-forced measurements: GrowingBudgetSparse (the production
// SparseAttention with a per-step budget), greedy generation through the Engine, teacher forcing, KL
// divergence.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "bench/fidelity/fidelity_report.h"
#include "common/error.h"
#include "kernels/paged_attention_ref.h"
#include "pair/link.h"

namespace spade::fidelity::report {

const char* select_by_name(SelectBy b) {
  static constexpr const char* kNames[] = {"oracle", "predicted", "last-query"};  // in SelectBy's order
  return kNames[static_cast<int>(b)];
}

SelectBy select_by(SelectionMode m) {
  SPADE_CHECK(m == SelectionMode::Oracle || m == SelectionMode::Predicted,
              "the oracle or predicted mode is needed, got {}", selection_mode_name(m));
  return m == SelectionMode::Oracle ? SelectBy::TrueQuery : SelectBy::Predicted;
}

// ---- GrowingBudgetSparse ----------------------------------------------------------------------------------

/// The in-process cache rank, remembering the positions of every selection it answers with (per sequence and
/// layer, with the context length of the step that uses it): the selection SparseAttention attends in the
/// predicted modes.
class GrowingBudgetSparse::RecordingLink : public pair::CacheRankLink {
 public:
  RecordingLink(const ModelConfig& cfg, const pair::SelectionConfig& sc, int num_pages, int page_size,
                int layers_per_pack)
      : link_(cfg, sc, num_pages, page_size),
        num_layers_(cfg.num_layers),
        layers_per_pack_(layers_per_pack) {}
  void send(pair::PackUpdate&& u) override { link_.send(std::move(u)); }
  pair::PackSelection receive(transport::Deadline deadline, bool* waited) override {
    pair::PackSelection p = link_.receive(deadline, waited);
    SPADE_CHECK(!p.delta, "the fidelity link answers full selections");
    for (const pair::SeqSelection& e : p.seqs) {
      Seq& s = seqs_[e.seq_id];
      s.sel.resize(num_layers_);
      s.context_len.resize(num_layers_, 0);
      for (size_t i = 0; i < e.layers.size(); ++i) {
        const size_t layer = static_cast<size_t>(p.pack) * layers_per_pack_ + i;
        s.sel[layer].count = e.layers[i].count;
        s.sel[layer].positions = e.layers[i].positions;
        s.context_len[layer] = e.context_len;
      }
    }
    return p;
  }
  size_t in_flight() const override { return link_.in_flight(); }
  const pair::LinkStats& stats() const override { return link_.stats(); }
  std::string peer() const override { return link_.peer(); }

  /// The selection answered for (seq, layer) at context `context_len`.
  const LayerSelection& selection(uint64_t seq, int layer, int context_len) const {
    auto it = seqs_.find(seq);
    SPADE_CHECK(it != seqs_.end() && static_cast<size_t>(layer) < it->second.sel.size() &&
                    it->second.context_len[layer] == context_len,
                "sequence {} layer {}: no selection was answered for context {}", seq, layer, context_len);
    return it->second.sel[layer];
  }
  void forget(uint64_t seq) { seqs_.erase(seq); }

 private:
  struct Seq {
    std::vector<LayerSelection> sel;  // [layer] positions and count only
    std::vector<int> context_len;     // [layer]
  };
  cache::InProcessLink link_;
  int num_layers_, layers_per_pack_;
  std::unordered_map<uint64_t, Seq> seqs_;
};

GrowingBudgetSparse::GrowingBudgetSparse(const ModelConfig& cfg, KvCache& kv, SelectBy by, const Variant& v,
                                         int threshold, int layers_per_pack, int fixed_k, int last_context)
    : cfg_(cfg), kv_(kv), by_(by), v_(v), fixed_k_(fixed_k) {
  // The largest budget asked for: the last step's (the predicted modes select one context further).
  rank_budget_ = fixed_k > 0 ? fixed_k : std::max(1, growing_budget(v.frac, last_context + 1 - v.R - v.S));
  SparseOptions so;
  so.mode = by == SelectBy::TrueQuery ? SelectionMode::Oracle : SelectionMode::Predicted;
  so.sparse_threshold = threshold;
  so.layers_per_pack = layers_per_pack;
  so.selection = selection_config(v, rank_budget_);
  if (by == SelectBy::LastQuery) so.selection.predictor = kernels::PredictorKind::kLastQuery;
  std::unique_ptr<pair::CacheRankLink> link;
  if (so.mode == SelectionMode::Predicted) {
    auto rec =
        std::make_unique<RecordingLink>(cfg, so.selection, kv.num_pages(), kv.page_size(), layers_per_pack);
    recorder_ = rec.get();
    link = std::move(rec);
  } else {
    oracle_ = std::make_unique<cache::Selector>(cfg, so.selection, kv.num_pages(), kv.page_size());
  }
  inner_ = std::make_unique<SparseAttention>(cfg, kv, so, std::move(link));
}

GrowingBudgetSparse::~GrowingBudgetSparse() = default;

void GrowingBudgetSparse::attend(int layer, const ForwardBatch& batch, const float* q, const float* k,
                                 const float* v, float* out) {
  SPADE_CHECK(batch.batch() == 1, "GrowingBudgetSparse runs one sequence per forward pass, got {}",
              batch.batch());
  const uint64_t id = batch.seq_ids[0];
  const int L = batch.seq_lens[0];
  if (layer == 0) {
    // The budget of the selection this step makes: for its own context (oracle) or the next one (predicted).
    const int context = by_ == SelectBy::TrueQuery ? L : L + 1;
    const int kk = fixed_k_ > 0 ? fixed_k_ : growing_budget(v_.frac, context - v_.R - v_.S);
    budget_ = std::clamp(kk, 1, rank_budget_);
    inner_->set_request_options(id, /*force_dense=*/false, /*sparse_threshold=*/0, budget_);
    sparse_before_ = inner_->stats().sparse_seq_steps;
  }
  inner_->attend(layer, batch, q, k, v, out);
  if (inner_->stats().sparse_seq_steps == sparse_before_) return;  // not a sparse step
  const int q0 = batch.cu_q_lens[0];
  const float* q_t = q + static_cast<size_t>(q0) * cfg_.q_dim();
  const LayerSelection& sel = selection_used(layer, batch, q_t, k + static_cast<size_t>(q0) * cfg_.kv_dim(),
                                             v + static_cast<size_t>(q0) * cfg_.kv_dim());
  selected_.add(sel.count);
  if (diagnostics_) diagnose(layer, batch, q_t, out + static_cast<size_t>(q0) * cfg_.q_dim(), sel);
}

const LayerSelection& GrowingBudgetSparse::selection_used(int layer, const ForwardBatch& batch,
                                                          const float* q_t, const float* k_t,
                                                          const float* v_t) {
  const uint64_t id = batch.seq_ids[0];
  const int L = batch.seq_lens[0];
  if (recorder_) return recorder_->selection(id, layer, L);
  // Oracle: SparseAttention's inline selector holds the KV from the switch on and selects with the true
  // query; this one starts at the first sparse step from the engine's KV (complete: oracle mode frees no
  // page).
  if (oracle_layer_inited_.empty()) oracle_layer_inited_.assign(cfg_.num_layers, false);
  if (!oracle_layer_inited_[layer]) {
    gather_context(cfg_, kv_, layer, batch.block_table.data(), L, kbuf_, vbuf_);
    oracle_->init_layer(id, layer, L, kbuf_.data(), vbuf_.data(), 0, nullptr);
    oracle_layer_inited_[layer] = true;
  } else {
    oracle_->append_layer(id, layer, L - 1, q_t, k_t, v_t);
  }
  oracle_->select(id, layer, L, q_t, oracle_sel_, budget_);
  return oracle_sel_;
}

void GrowingBudgetSparse::diagnose(int layer, const ForwardBatch& batch, const float* q_t, const float* out_t,
                                   const LayerSelection& sel) {
  const int Hq = cfg_.num_q_heads, D = cfg_.head_dim, L = batch.seq_lens[0];
  attention_probs(cfg_, kv_, layer, batch.block_table.data(), q_t, L, probs_);
  // Dense attention of the same query over the same run's KV (the arithmetic SparseAttention's rows use).
  dense_out_.resize(static_cast<size_t>(Hq) * D);
  const int32_t cu[2] = {0, 1};
  kernels::PagedAttentionParams p = paged_attention_params(cfg_, kv_, layer, batch, q_t, dense_out_.data());
  p.cu_q_lens = cu;
  p.seq_lens = &L;
  p.batch = 1;
  kernels::paged_attention_ref(p);
  for (int h = 0; h < Hq; ++h) {
    const double r = mass_recall(cfg_, probs_, h, L, sel, v_.S, v_.R);
    if (!std::isnan(r)) recall_.add(r);
    const float* o = out_t + static_cast<size_t>(h) * D;
    const float* d = dense_out_.data() + static_cast<size_t>(h) * D;
    double num2 = 0, den2 = 0;
    for (int i = 0; i < D; ++i) {
      num2 += (static_cast<double>(o[i]) - d[i]) * (static_cast<double>(o[i]) - d[i]);
      den2 += static_cast<double>(d[i]) * d[i];
    }
    if (den2 > 0) out_error_.add(std::sqrt(num2 / den2));
  }
}

void GrowingBudgetSparse::on_release(uint64_t seq_id) {
  inner_->on_release(seq_id);
  if (recorder_) recorder_->forget(seq_id);
  if (oracle_) oracle_->release(seq_id);
  oracle_layer_inited_.clear();
}

std::pair<int, int> GrowingBudgetSparse::droppable_range(uint64_t seq_id, int seq_len) {
  if (diagnostics_) return {0, 0};
  return inner_->droppable_range(seq_id, seq_len);
}

// ---- generation -------------------------------------------------------------------------------------------

std::vector<int32_t> generate(const Model& m, const std::vector<int32_t>& prompt, int max_tokens,
                              int max_model_len, const BackendFactory& f,
                              const std::function<void(AttentionBackend&)>& inspect) {
  EngineOptions eo;
  eo.page_size = kPageSize;
  eo.max_num_seqs = 1;
  eo.max_model_len = max_model_len;
  eo.max_num_batched_tokens = 2048;
  Engine e(m, eo, f);
  GenerateRequest r;
  r.prompt_ids = prompt;
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.ignore_eos = true;
  std::vector<int32_t> ids;
  FinishReason reason = FinishReason::None;
  std::string error;
  e.submit(r, [&](const TokenEvent& ev) {
    if (ev.token >= 0) ids.push_back(ev.token);
    if (ev.finished) {
      reason = ev.reason;
      error = ev.error;
    }
  });
  e.run_until_idle();
  SPADE_CHECK(reason == FinishReason::Length && static_cast<int>(ids.size()) == max_tokens,
              "generation ended with '{}' after {} of {} tokens: {}", finish_reason_name(reason), ids.size(),
              max_tokens, error);
  if (inspect) inspect(e.attention());
  return ids;
}

std::vector<int32_t> generate_sparse(const Model& m, const std::vector<int32_t>& prompt, int max_tokens,
                                     int max_model_len, SelectionMode mode, int threshold,
                                     int layers_per_pack, const pair::SelectionConfig& selection,
                                     uint64_t* sparse_steps) {
  SparseOptions so;
  so.mode = mode;
  so.sparse_threshold = threshold;
  so.layers_per_pack = layers_per_pack;
  so.selection = selection;
  return generate(
      m, prompt, max_tokens, max_model_len,
      [&](const ModelConfig& c, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
        std::unique_ptr<pair::CacheRankLink> link;
        if (so.mode == SelectionMode::Predicted)
          link = std::make_unique<cache::InProcessLink>(c, so.selection, kv.num_pages(), kv.page_size());
        return std::make_unique<SparseAttention>(c, kv, so, std::move(link));
      },
      [&](AttentionBackend& be) {
        *sparse_steps = dynamic_cast<SparseAttention&>(be).stats().sparse_seq_steps;
      });
}

Agreement agreement(const std::vector<int32_t>& dense, const std::vector<int32_t>& sparse, int prompt_len,
                    int threshold) {
  Agreement a;
  const int N = static_cast<int>(dense.size());
  // Generated token i (i >= 1) is sampled by the decode step of context prompt_len + i. The switch step is
  // the first decode step with context >= threshold and is still dense; later steps are sparse.
  const int switch_i = std::max(1, threshold - prompt_len);
  a.first_sparse = std::min(N, switch_i + 1);
  for (int i = 0; i < a.first_sparse; ++i) a.pre_sparse_equal = a.pre_sparse_equal && dense[i] == sparse[i];
  a.sparse_tokens = N - a.first_sparse;
  bool diverged = false;
  for (int i = a.first_sparse; i < N; ++i) {
    const bool eq = dense[i] == sparse[i];
    a.matches += eq;
    diverged = diverged || !eq;
    if (!diverged) ++a.prefix;
  }
  return a;
}

std::vector<float> teacher_forced(const Model& m, const std::vector<int32_t>& prompt,
                                  const std::vector<int32_t>& forced,
                                  const std::function<std::unique_ptr<AttentionBackend>(KvCache&)>& make,
                                  const std::function<void(AttentionBackend&)>& inspect) {
  const ModelConfig& cfg = m.config();
  const int P = static_cast<int>(prompt.size()), N = static_cast<int>(forced.size());
  const int pages = (P + N + kPageSize - 1) / kPageSize;
  KvCache kv(cfg, pages, kPageSize);
  std::unique_ptr<AttentionBackend> be = make(kv);
  std::vector<float> all(static_cast<size_t>(N) * cfg.vocab_size), logits;
  ForwardBatch fb;
  fb.max_pages = pages;
  for (int i = 0; i < pages; ++i) fb.block_table.push_back(i);
  fb.seq_ids = {1};
  for (int i = 0; i < N; ++i) {
    if (i == 0) {
      fb.tokens = prompt;
      fb.positions.resize(P);
      for (int t = 0; t < P; ++t) fb.positions[t] = t;
    } else {
      fb.tokens = {forced[i - 1]};
      fb.positions = {P + i - 1};
    }
    const int q_len = fb.total_tokens();
    fb.cu_q_lens = {0, q_len};
    fb.seq_lens = {P + i};
    fb.logit_rows = {q_len - 1};
    m.forward(fb, *be, logits);
    std::copy(logits.begin(), logits.end(), all.begin() + static_cast<size_t>(i) * cfg.vocab_size);
  }
  if (inspect) inspect(*be);
  return all;
}

double kl_divergence(const float* p, const float* q, int n) {
  const float mp = *std::max_element(p, p + n), mq = *std::max_element(q, q + n);
  double zp = 0, zq = 0;
  for (int i = 0; i < n; ++i) {
    zp += std::exp(static_cast<double>(p[i]) - mp);
    zq += std::exp(static_cast<double>(q[i]) - mq);
  }
  const double lzp = std::log(zp) + mp, lzq = std::log(zq) + mq;
  double kl = 0;
  for (int i = 0; i < n; ++i) {
    const double lp = p[i] - lzp, lq = q[i] - lzq;
    kl += std::exp(lp) * (lp - lq);
  }
  return std::max(0.0, kl);
}

}  // namespace spade::fidelity::report

// fidelity_report: how well AsyncSpade's predicted-query token selection matches the true-query selection on
// real input, and what sparse decoding does to greedy output. CPU, fp32. Method and numbers:
// docs/FIDELITY.md. Source: AsyncSpade (../shared/papers/asyncspade-async-sparse-decoding.txt), Sec. 3
// (overlap ratio, Eq. 1) and Sec. 4.2 (next-query prediction, Algorithm 1).
//
// Every selection, prediction and sparse attention is the library's: cache::Selector (select with a true,
// predicted or previous query and any budget up to its token_budget; predict), cache::InProcessLink (the
// cache rank in the process), SparseAttention (the inference rank's sparse decode), cache::head_overlap_ratio
// (Eq. 1). What the tool adds is where it measures and what it counts.
//
// Models:
//   stories260K      the real trained TinyStories model (Llama, 5 layers, GQA 8q/4kv, head_dim 8, 512
//                    positions) on TinyStories-style story openings (the opening of
//                    expected_greedy_200tok.txt plus eight written for this report, kStoryPrompts).
//   qwen3-synthetic  a Qwen3-shaped model with deterministic random weights (qwen3-0.6b's config.json with
//                    smaller hidden/layers, the full 151,936-token vocabulary) on real prompts (AIME24,
//                    MATH500, GSM8K few-shot contexts and ShareGPT first turns) tokenized by the Qwen2
//                    tokenizer. Random weights have no learnt attention structure: its overlaps show the
//                    pipeline runs at realistic shapes, not fidelity, and greedy agreement is not measured.
//
// 1. Overlap probe (ProbeBackend, fidelity_probe.cpp). Every prompt is decoded greedily with dense
//    attention; at every decode step t whose context L_t (tokens after appending the current one) reaches
//    --sparse-threshold, for every layer and KV head, over the candidates [S, L_t - R) (S sink tokens and the
//    R-token local window are attended anyway and never selected — the definition of
//    cache::Selector::select):
//      T_t  top-k by the TRUE query q_t (what oracle / Quest-style synchronous selection uses);
//      P_t  top-k by the PREDICTED query q̂_t = Algorithm 1 on the query window ending at q_{t-1}, i.e.
//           cache::Selector::predict / select(query = nullptr) after the previous step's append — what the
//           cache rank sends for step t while step t-1 is still running;
//      R_t  T_{t-1}: the previous step's true selection reused as is ("no prediction, reuse last selection");
//      Q_t  top-k by the previous query q_{t-1} over the current candidates ("no prediction, last query").
//    The overlap ratio (Eq. 1) of X with T_t is |X ∩ T_t| / |T_t|, per KV head; reported per layer as the
//    mean over (step, prompt, KV head). Token budget k_t = ceil(frac * n_t), n_t = L_t - R - S candidates (a
//    fixed fraction of the growing cache, as the paper's Fig. 4/5 select 1/8 of the KV cache). For the main
//    variants the fixed budget K = ceil(frac * n_last) (n_last: candidates at the sequence's last step) is
//    measured too, through the cache rank's own call (select(query = nullptr)). Also the attention-mass
//    recall of each selection: Σ_{j ∈ X} p_h(j) / Σ_{j ∈ candidates} p_h(j), p_h the true (dense) attention
//    distribution of query head h — which tokens are missed matters, the overlap ratio ignores it.
// 2. Greedy agreement (stories260K; fidelity_stories.cpp): each prompt decoded densely, and sparsely in
//    predicted (AsyncSpade) and oracle (true-query) mode, with the growing budget (GrowingBudgetSparse:
//    SparseAttention whose per-sequence budget follows the context) and the fixed budget K (plain
//    SparseAttention). Over the tokens produced by sparse steps: the fraction before the first token that
//    differs from dense decoding, and the fraction of positions with the dense token. And teacher-forced
//    (every step fed the dense prefix, so one flipped token does not derail the rest): next-token top-1
//    agreement, KL(dense || sparse), and inside the sparse run the selection's mass recall and the relative
//    L2 error of the attention output.
// 3. Checks (exit status 1 when any fails; 2 on an error such as missing data): the probe's dense tokens
//    equal the engine's dense tokens; the probe's Selectors agree with the cache rank's path and hold the
//    engine's KV (select(predict()) == select(nullptr); the K/V rows a selection gathers equal the engine's);
//    GrowingBudgetSparse with the fixed budget K reproduces SparseAttention's tokens exactly (so its per-step
//    budget changes nothing else); SparseAttention (predicted and oracle) with a token budget >= the context
//    reproduces dense greedy decoding exactly and actually decodes sparsely (plumbing); teacher-forced dense
//    argmax equals the dense greedy tokens.
//
// Files: fidelity_report.cpp (CLI), fidelity_probe.cpp (the overlap probe and the measurements it shares),
// fidelity_sparse.cpp (growing-budget sparse decoding, generation, teacher forcing), fidelity_output.cpp
// (variants, tables, JSON), fidelity_stories.cpp and fidelity_qwen.cpp (the two models' runs).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache_rank/pack_server.h"
#include "cache_rank/selector.h"
#include "common/config.h"
#include "inference_rank/engine.h"
#include "inference_rank/model.h"
#include "inference_rank/sparse_attention.h"
#include "kernels/selection_ref.h"

namespace spade::fidelity::report {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using kernels::GqaScoreRule;
using pair::LayerSelection;

inline constexpr int kPageSize = 16;
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double seconds_since(Clock::time_point t0);

// ---- options and measured variants ------------------------------------------------------------------------

struct Options {
  std::string data_dir;
  std::string out_dir;
  std::string models = "all";
  bool quick = false;
  int threshold = 128;
  int sinks = 4, local_window = 32, layers_per_pack = 2;
  std::vector<double> budgets = {0.125, 0.25};
  int stories_prompts = 9, stories_max_tokens = 360;
  int qwen_max_tokens = 64, qwen_plumbing_prompts = 2, qwen_plumbing_tokens = 16;
  int qwen_hidden = 128, qwen_intermediate = 384, qwen_layers = 4, qwen_heads = 8, qwen_kv_heads = 4,
      qwen_head_dim = 64;
  uint64_t qwen_seed = 0;
  bool sweep = true;
};

/// One selection configuration whose overlaps the probe measures.
struct Variant {
  std::string name;
  std::string group;    // "main", "sweep", "gqa", "paper"
  double frac = 0.125;  // token budget as a fraction of the candidates
  int W = 8;            // query window (regressors) of the predictor
  float eps = 1e-3f;    // ridge epsilon
  GqaScoreRule rule = GqaScoreRule::kMax;
  int S = 4;           // sink tokens
  int R = 32;          // local window
  bool fixed = false;  // also measure at the fixed budget K through the cache rank's call (and cross-check)
  bool lastq = false;  // also measure the last-query baseline
};

/// The main variants (one per budget, fixed K and last query measured too), the W x eps sweep (with o.sweep),
/// the GQA mean rule and the paper's candidates (S = 0, R = 1), the last three at the first budget.
std::vector<Variant> make_variants(const Options& o);

const char* rule_name(GqaScoreRule r);
/// k_t = ceil(frac * n) clamped to 1..n; 0 when there is no candidate.
int growing_budget(double frac, int n);
/// "1/8" for 0.125, else "%g".
std::string frac_name(double f);
/// Fixed budget K of a sequence whose last decode step has context `last_context`.
int fixed_budget(const Variant& v, int last_context);
/// The variant's selection settings with `token_budget`: AsyncSpade's Algorithm 1 (the paper predictor) and
/// plain token top-k (no successor expansion); the runtime's defaults are measured by passkey_fidelity.
pair::SelectionConfig selection_config(const Variant& v, int token_budget);

// ---- statistics -------------------------------------------------------------------------------------------

struct Mean {
  double sum = 0;
  uint64_t n = 0;
  void add(double x) {
    sum += x;
    ++n;
  }
  void add(const Mean& m) {
    sum += m.sum;
    n += m.n;
  }
  double get() const { return n ? sum / static_cast<double>(n) : kNaN; }
};

/// The pooled mean of per-layer (or per-prompt) means.
Mean pooled(const std::vector<Mean>& v);

/// Overlap statistics of one variant over all prompts of a model.
struct VariantStats {
  std::vector<Mean> pred, reuse, lastq, chance;  // [layer], growing budget
  // [layer] attention-mass recall (growing budget): share of the true attention probability over the
  // candidates that the selection covers, per query head — what the overlap ratio does not see (which tokens
  // are missed).
  std::vector<Mean> mass_pred, mass_reuse, mass_lastq, mass_true;
  std::vector<Mean> pred_fixed, reuse_fixed, chance_fixed;  // [layer], fixed budget K (the cache rank's call)
  std::vector<Mean> pred_per_prompt, reuse_per_prompt;      // [prompt], over layers, steps, KV heads
  uint64_t steps = 0;                                       // (prompt, step) pairs measured
  uint64_t selector_compares = 0, selector_mismatches = 0;  // the probe's consistency checks (fixed variants)
  std::string first_mismatch;
  void init(int layers, int prompts);
};

struct Checks {
  json items = json::array();
  bool ok = true;
  /// Records a check; a failed one is printed to stderr as "CHECK FAILED: name: detail".
  void add(const std::string& name, bool pass, const std::string& detail);
};

/// The per-variant checks after a model's probe runs: the probe's consistency (fixed variants) and
/// "measured".
void add_probe_checks(Checks& checks, const std::vector<Variant>& vars,
                      const std::vector<VariantStats>& stats);

// ---- measurements over the engine's paged KV --------------------------------------------------------------

/// The last `cap` query rows [q_dim] of one layer, oldest first.
struct QueryHistory {
  std::vector<float> rows;
  int q_dim = 0;
  void push(const float* q, int dim, int cap);
  int count() const { return q_dim ? static_cast<int>(rows.size() / q_dim) : 0; }
  const float* last() const { return rows.data() + rows.size() - q_dim; }
};

/// Copies positions [0, len) of one layer's paged K and V into contiguous [len, kv_dim] buffers
/// (Selector::init_layer's input).
void gather_context(const ModelConfig& cfg, const KvCache& kv, int layer, const int32_t* block_table, int len,
                    std::vector<float>& k, std::vector<float>& v);

/// The true attention distribution of q_t ([num_q_heads, head_dim]) over the whole context [0, L) of one
/// layer, per query head: probs[h * L + j] = softmax_j(q_t,h · k_j / sqrt(head_dim)), in fp64.
void attention_probs(const ModelConfig& cfg, const KvCache& kv, int layer, const int32_t* bt,
                     const float* q_t, int L, std::vector<double>& probs);

/// Attention-mass recall of selection x for query head h: Σ_{j ∈ x} p_h(j) / Σ_{j ∈ [S, L - R)} p_h(j) (NaN
/// when the candidates carry no mass). x's rows have stride positions.size() / num_kv_heads.
double mass_recall(const ModelConfig& cfg, const std::vector<double>& probs, int h, int L,
                   const LayerSelection& x, int S, int R);

// ---- the overlap probe ------------------------------------------------------------------------------------

/// Dense attention (DensePagedAttention, the production dense path) plus, at every decode step past the
/// threshold, the selections of every variant. One cache::Selector per (sequence, variant) holds the cache
/// rank's state (KV and query window, fed as the cache rank is: INIT at the first decode step, then one
/// append per step); every selection is its select() — with the predicted, true or previous query, at the
/// growing budget k_t or the fixed K.
class ProbeBackend : public AttentionBackend {
 public:
  ProbeBackend(const ModelConfig& cfg, KvCache& kv, const std::vector<Variant>& vars,
               std::vector<VariantStats>& stats, int threshold, int last_context, int prompt);
  void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
              float* out) override;
  void on_release(uint64_t seq_id) override { seqs_.erase(seq_id); }

 private:
  struct PerVariant {
    std::unique_ptr<cache::Selector> sel;
    // [layer] the previous step's true selection (positions only)
    std::vector<LayerSelection> prev, prev_fixed;
    std::vector<bool> have_prev;
  };
  struct Seq {
    std::vector<QueryHistory> hist;  // [layer]
    std::vector<PerVariant> vars;
    bool inited = false;
  };
  struct TrueKey {
    int S, R, k;
    GqaScoreRule rule;
    bool operator==(const TrueKey& o) const { return S == o.S && R == o.R && k == o.k && rule == o.rule; }
  };

  void measure(int layer, const ForwardBatch& batch, int b, const float* q_t, const float* k_t,
               const float* v_t, Seq& s);
  void check_predicted(VariantStats& st, const LayerSelection& nullptr_path,
                       const LayerSelection& predict_path, int layer, int L);
  void check_gathered_kv(VariantStats& st, const LayerSelection& sel, int layer, int L, const int32_t* bt);

  const ModelConfig& cfg_;
  KvCache& kv_;
  DensePagedAttention dense_;
  const std::vector<Variant>& vars_;
  std::vector<VariantStats>& stats_;
  int threshold_, last_context_, prompt_;
  int max_w_ = 1;
  std::unordered_map<uint64_t, Seq> seqs_;
  // This step's true-query selections by key; a deque: references stay valid while it grows.
  std::deque<std::pair<TrueKey, LayerSelection>> true_cache_;
  std::vector<float> kbuf_, vbuf_, q_hat_;
  std::vector<double> probs_;
  LayerSelection pred_, pred_fixed_, pred_check_, lastq_;
};

// ---- sparse decoding with a growing budget ----------------------------------------------------------------

/// Which query scores the tokens of a sparse step t.
enum class SelectBy {
  TrueQuery,  // q_t: oracle (SelectionMode::Oracle)
  Predicted,  // q̂_t from the window ending at q_{t-1}: AsyncSpade (SelectionMode::Predicted)
  // q_{t-1}: one step ahead without prediction (SelectionMode::Predicted, PredictorKind::kLastQuery)
  LastQuery,
};
const char* select_by_name(SelectBy b);
SelectBy select_by(SelectionMode m);

/// Sparse decoding through the production SparseAttention — with an in-process cache rank
/// (cache::InProcessLink) in the predicted and last-query modes, its inline selector in oracle mode — whose
/// token budget follows the context: before every step the budget of the selection that step makes is set for
/// the sequence (SparseAttention::set_request_options) to k = ceil(frac * n) of that selection's candidates,
/// or to a fixed K (then it is plain SparseAttention). The selection made during a predicted step of context
/// L is for context L + 1; an oracle step selects for its own context. Records the selection attended at
/// every sparse (step, layer): in the predicted modes from the link's answers, in oracle mode from a
/// cache::Selector fed as SparseAttention's inline selector is. One sequence per forward pass (the tool's
/// runs decode one at a time).
class GrowingBudgetSparse : public AttentionBackend {
 public:
  GrowingBudgetSparse(const ModelConfig& cfg, KvCache& kv, SelectBy by, const Variant& v, int threshold,
                      int layers_per_pack, int fixed_k, int last_context);
  ~GrowingBudgetSparse() override;
  void attend(int layer, const ForwardBatch& batch, const float* q, const float* k, const float* v,
              float* out) override;
  void on_release(uint64_t seq_id) override;
  std::vector<std::pair<uint64_t, std::string>> take_failures() override { return inner_->take_failures(); }
  std::pair<int, int> droppable_range(uint64_t seq_id, int seq_len) override;

  uint64_t sparse_seq_steps() const { return inner_->stats().sparse_seq_steps; }
  /// Tokens selected per KV head, per sparse (step, layer).
  const Mean& selected_tokens() const { return selected_; }
  /// Also measure, at every sparse step, the selection's attention-mass recall and the relative L2 error of
  /// the sparse attention output against dense attention over the same run's KV (per query head). Needs the
  /// whole KV: no page of the run may be freed (droppable_range then frees none).
  void enable_diagnostics() { diagnostics_ = true; }
  const Mean& mass_recall_in_run() const { return recall_; }
  const Mean& attention_output_error() const { return out_error_; }

 private:
  class RecordingLink;
  /// The selection SparseAttention attended at this sparse step of `layer`.
  const LayerSelection& selection_used(int layer, const ForwardBatch& batch, const float* q_t,
                                       const float* k_t, const float* v_t);
  void diagnose(int layer, const ForwardBatch& batch, const float* q_t, const float* out_t,
                const LayerSelection& sel);

  const ModelConfig& cfg_;
  KvCache& kv_;
  SelectBy by_;
  Variant v_;
  int fixed_k_, rank_budget_;
  RecordingLink* recorder_ = nullptr;  // owned by inner_ (predicted modes)
  std::unique_ptr<SparseAttention> inner_;
  // Oracle mode: makes the selection SparseAttention's inline selector made (which it does not expose).
  std::unique_ptr<cache::Selector> oracle_;
  std::vector<bool> oracle_layer_inited_;
  int budget_ = 0;  // the budget set for the current step
  uint64_t sparse_before_ = 0;
  Mean selected_, recall_, out_error_;
  bool diagnostics_ = false;
  std::vector<double> probs_;
  std::vector<float> dense_out_, kbuf_, vbuf_;
  LayerSelection oracle_sel_;
};

// ---- generation -------------------------------------------------------------------------------------------

/// Greedy decoding of one prompt (max_tokens tokens, EOS ignored) through an Engine with the given backend.
/// `inspect` sees the backend after the run. Throws spade::Error when the request fails.
std::vector<int32_t> generate(const Model& m, const std::vector<int32_t>& prompt, int max_tokens,
                              int max_model_len, const BackendFactory& f,
                              const std::function<void(AttentionBackend&)>& inspect = nullptr);

/// generate() through the production SparseAttention in `mode` with `selection` (an in-process cache rank,
/// cache::InProcessLink, in predicted mode); `*sparse_steps` gets its (sequence, step) pairs decoded
/// sparsely.
std::vector<int32_t> generate_sparse(const Model& m, const std::vector<int32_t>& prompt, int max_tokens,
                                     int max_model_len, SelectionMode mode, int threshold,
                                     int layers_per_pack, const pair::SelectionConfig& selection,
                                     uint64_t* sparse_steps);

/// Agreement of a sparse run with the dense run over the tokens produced by sparse steps (generated index >=
/// first).
struct Agreement {
  int first_sparse = 0;          // generated index of the first token sampled after a sparse step
  int sparse_tokens = 0;         // tokens from sparse steps
  int prefix = 0;                // of them, before the first difference
  int matches = 0;               // of them, equal to the dense token at the same index
  bool pre_sparse_equal = true;  // tokens before the first sparse step equal (they must)
};
Agreement agreement(const std::vector<int32_t>& dense, const std::vector<int32_t>& sparse, int prompt_len,
                    int threshold);

/// Teacher-forced decoding: the prompt as one prefill, then the dense tokens one decode step each, through
/// the backend `make` returns. Returns the logits that predict generated token i, for i in [0,
/// forced.size()): [N, vocab].
std::vector<float> teacher_forced(const Model& m, const std::vector<int32_t>& prompt,
                                  const std::vector<int32_t>& forced,
                                  const std::function<std::unique_ptr<AttentionBackend>(KvCache&)>& make,
                                  const std::function<void(AttentionBackend&)>& inspect = nullptr);

/// KL(softmax(p) || softmax(q)) in nats over `n` logits.
double kl_divergence(const float* p, const float* q, int n);

// ---- output -----------------------------------------------------------------------------------------------

/// A number rounded to 6 decimals, null for NaN.
json num(double x);
/// The overlap, mass-recall, sweep and GQA / paper-candidate tables of one model.
void print_overlaps(const std::string& model, const std::vector<Variant>& vars,
                    const std::vector<VariantStats>& st, int layers, int kv_heads);
/// The model's attention shape: layers, q_heads, kv_heads, head_dim (the report's "model_info").
json model_shape_json(const ModelConfig& cfg);
/// Tool, model, date, commit, machine and parameters: the head of every JSON report.
json common_header(const Options& o, const std::string& model);
/// Adds the variants, the checks and the runtime to `j`, then writes o.out_dir/fidelity_<name>.json (nothing
/// without an out dir).
void finish_report(const Options& o, const std::string& name, const std::vector<Variant>& vars,
                   const std::vector<VariantStats>& stats, const Checks& checks, double total_s, json& j);
/// A whole text file; throws spade::Error when it cannot be read.
std::string read_text(const std::string& path);

// ---- the two models ---------------------------------------------------------------------------------------

/// Probe, greedy agreement and teacher forcing on stories260K; returns whether every check passed.
bool run_stories(const Options& o);
/// Probe and plumbing on the random-weight Qwen3 shape; returns whether every check passed.
bool run_qwen(const Options& o);

}  // namespace spade::fidelity::report

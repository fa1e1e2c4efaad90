// The pieces of bench/fidelity/fidelity_report: the overlap ratio (cache_rank/selection_overlap.h),
// GrowingBudgetSparse (SparseAttention with a per-step budget) and the overlap probe, on the real stories260K
// model.
#include <gtest/gtest.h>

#include <cmath>

#include "bench/fidelity/fidelity_report.h"
#include "cache_rank/selection_overlap.h"
#include "common/tokenizer.h"
#include "tests/test_util.h"

namespace spade::fidelity::report {
namespace {

LayerSelection selection(int count, std::vector<int32_t> positions) {
  LayerSelection s;
  s.count = count;
  s.positions = std::move(positions);
  return s;
}

TEST(SelectionOverlap, CommonPositionsOfAscendingLists) {
  const int32_t a[] = {1, 3, 5, 7, 9}, b[] = {2, 3, 4, 7, 10, 11};
  EXPECT_EQ(cache::common_positions(a, 5, b, 6), 2);
  EXPECT_EQ(cache::common_positions(a, 5, a, 5), 5);
  EXPECT_EQ(cache::common_positions(a, 0, b, 6), 0);
  EXPECT_EQ(cache::common_positions(a, 2, b, 2), 1);  // {1, 3} and {2, 3}
}

TEST(SelectionOverlap, PerKvHeadWithDifferentBudgets) {
  // Two KV heads; x has stride 4 (count 3), ref stride 2 (count 2); padding -1 is never read.
  const LayerSelection x = selection(3, {1, 2, 5, -1, /*head 1*/ 0, 4, 6, -1});
  const LayerSelection ref = selection(2, {2, 5, /*head 1*/ 3, 6});
  EXPECT_DOUBLE_EQ(cache::head_overlap_ratio(x, ref, 0, 2), 1.0);
  EXPECT_DOUBLE_EQ(cache::head_overlap_ratio(x, ref, 1, 2), 0.5);
  EXPECT_DOUBLE_EQ(cache::head_overlap_ratio(ref, x, 0, 2), 2.0 / 3);  // |x ∩ ref| / |x|
  EXPECT_TRUE(std::isnan(cache::head_overlap_ratio(x, selection(0, {-1, -1}), 0, 2)));
}

struct Stories {
  std::unique_ptr<Model> model = Model::load(test::data_path("models/stories260K"));
  std::vector<int32_t> ids =
      Tokenizer::from_dir(test::data_path("models/stories260K"))
          .encode(
              "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
              true);
  int max_len() const { return model->config().max_position_embeddings; }
};

constexpr int kThreshold = 48, kTokens = 64;

Variant variant(double frac) {
  Variant v;
  v.frac = frac;
  v.S = 4;
  v.R = 16;
  return v;
}

std::vector<int32_t> growing(const Stories& s, SelectBy by, const Variant& v, int fixed_k, uint64_t* steps,
                             Mean* selected) {
  const int last_context = static_cast<int>(s.ids.size()) + kTokens - 1;
  return generate(
      *s.model, s.ids, kTokens, s.max_len(),
      [&](const ModelConfig& c, KvCache& kv) {
        return std::make_unique<GrowingBudgetSparse>(c, kv, by, v, kThreshold, 2, fixed_k, last_context);
      },
      [&](AttentionBackend& be) {
        auto& g = dynamic_cast<GrowingBudgetSparse&>(be);
        *steps = g.sparse_seq_steps();
        *selected = g.selected_tokens();
      });
}

TEST(GrowingBudgetSparse, WithAFixedBudgetIsSparseAttention) {
  const Stories s;
  const Variant v = variant(0.125);
  const int K = fixed_budget(v, static_cast<int>(s.ids.size()) + kTokens - 1);
  for (SelectionMode mode : {SelectionMode::Predicted, SelectionMode::Oracle}) {
    uint64_t steps = 0, mine_steps = 0;
    const auto ref = generate_sparse(*s.model, s.ids, kTokens, s.max_len(), mode, kThreshold, 2,
                                     selection_config(v, K), &steps);
    Mean selected;
    const auto mine = growing(s, select_by(mode), v, K, &mine_steps, &selected);
    EXPECT_EQ(mine, ref) << selection_mode_name(mode);
    EXPECT_GT(steps, 0u);
    EXPECT_EQ(mine_steps, steps);
    EXPECT_DOUBLE_EQ(selected.get(), K);  // K <= the candidates of every sparse step here
  }
}

TEST(GrowingBudgetSparse, SelectsCeilFracOfTheCandidatesAtEveryStep) {
  const Stories s;
  const Variant v = variant(0.25);
  const int P = static_cast<int>(s.ids.size());
  // Sparse steps: contexts kThreshold + 1 .. P + kTokens - 1 (the switch step at kThreshold is dense).
  Mean expected;
  for (int L = kThreshold + 1; L <= P + kTokens - 1; ++L) expected.add(growing_budget(v.frac, L - v.R - v.S));
  for (SelectBy by : {SelectBy::Predicted, SelectBy::LastQuery, SelectBy::TrueQuery}) {
    uint64_t steps = 0;
    Mean selected;
    (void)growing(s, by, v, 0, &steps, &selected);
    EXPECT_EQ(steps, expected.n) << select_by_name(by);
    EXPECT_EQ(selected.n, expected.n * s.model->config().num_layers) << select_by_name(by);
    EXPECT_NEAR(selected.get(), expected.get(), 1e-12) << select_by_name(by);
  }
}

TEST(GrowingBudgetSparse, EveryCandidateSelectedIsDenseAttention) {
  const Stories s;
  const Variant v = variant(1.0);
  std::vector<int32_t> dense;
  for (int i = 0; i < kTokens; ++i) dense.push_back(i % 7 + 1);  // any forced tokens
  const int last_context = static_cast<int>(s.ids.size()) + kTokens - 1;
  for (SelectBy by : {SelectBy::Predicted, SelectBy::TrueQuery}) {
    Mean recall, error;
    (void)teacher_forced(
        *s.model, s.ids, dense,
        [&](KvCache& kv) -> std::unique_ptr<AttentionBackend> {
          auto be = std::make_unique<GrowingBudgetSparse>(s.model->config(), kv, by, v, kThreshold, 2, 0,
                                                          last_context);
          be->enable_diagnostics();
          return be;
        },
        [&](AttentionBackend& be) {
          const auto& g = dynamic_cast<const GrowingBudgetSparse&>(be);
          recall = g.mass_recall_in_run();
          error = g.attention_output_error();
        });
    ASSERT_GT(recall.n, 0u) << select_by_name(by);
    EXPECT_NEAR(recall.get(), 1.0, 1e-12) << select_by_name(by);
    EXPECT_EQ(error.get(), 0.0) << select_by_name(by);  // the same rows in the same order: bit-identical
  }
}

TEST(ProbeBackend, MeasuresAlongTheDenseTrajectory) {
  const Stories s;
  Options o;
  o.sinks = 4;
  o.local_window = 16;
  o.budgets = {0.125, 1.0};
  o.sweep = false;
  const std::vector<Variant> vars = make_variants(o);
  std::vector<VariantStats> stats(vars.size());
  const int L = s.model->config().num_layers;
  for (auto& st : stats) st.init(L, 1);
  const int last_context = static_cast<int>(s.ids.size()) + kTokens - 1;
  const auto dense = generate(*s.model, s.ids, kTokens, s.max_len(), nullptr);
  const auto probe = generate(*s.model, s.ids, kTokens, s.max_len(), [&](const ModelConfig& c, KvCache& kv) {
    return std::make_unique<ProbeBackend>(c, kv, vars, stats, kThreshold, last_context, 0);
  });
  EXPECT_EQ(probe, dense);
  const uint64_t steps = static_cast<uint64_t>(last_context - kThreshold + 1);
  for (size_t i = 0; i < vars.size(); ++i) {
    const VariantStats& st = stats[i];
    EXPECT_EQ(st.steps, steps) << vars[i].name;
    EXPECT_EQ(pooled(st.pred).n, steps * L * s.model->config().num_kv_heads) << vars[i].name;
    const double p = pooled(st.pred).get();
    EXPECT_GE(p, 0.0);
    EXPECT_LE(p, 1.0);
    if (vars[i].fixed) {
      EXPECT_EQ(st.selector_mismatches, 0u) << st.first_mismatch;
      EXPECT_EQ(st.selector_compares, 2 * steps * L) << vars[i].name;
    }
  }
  // Budget 1: every selection holds every candidate.
  const VariantStats& all = stats[1];
  EXPECT_DOUBLE_EQ(pooled(all.pred).get(), 1.0);
  EXPECT_DOUBLE_EQ(pooled(all.lastq).get(), 1.0);
  EXPECT_DOUBLE_EQ(pooled(all.chance).get(), 1.0);
  EXPECT_NEAR(pooled(all.mass_pred).get(), 1.0, 1e-12);
  EXPECT_NEAR(pooled(all.mass_true).get(), 1.0, 1e-12);
  // At 1/8 the oracle covers more attention mass than the prediction, and both more than the budget's share.
  const VariantStats& eighth = stats[0];
  EXPECT_GE(pooled(eighth.mass_true).get(), pooled(eighth.mass_pred).get());
  EXPECT_GT(pooled(eighth.pred).get(), pooled(eighth.chance).get());
}

}  // namespace
}  // namespace spade::fidelity::report

#include "pair/selection_flags.h"

#include "common/error.h"

namespace spade::pair {

void add_selection_flags(CLI::App& app, SelectionConfig& sc, SelectionFlagText& text) {
  app.add_option("--token-budget", sc.token_budget, "selected tokens per layer and KV head")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--local-window", sc.local_window, "most recent tokens the inference rank attends from its own KV")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--sink-tokens", sc.sink_tokens, "first tokens the inference rank attends from its own KV")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--query-window", sc.query_window, "W: queries the predictor regresses on (1..32)")
      ->capture_default_str();
  app.add_option("--ridge-eps", sc.ridge_eps,
                 "ridge regularisation: relative to the queries' mean squared norm (ridge), absolute (paper)")
      ->capture_default_str();
  app.add_option("--gqa-rule", text.gqa_rule, "how a KV head combines its query heads' scores: max | mean")
      ->capture_default_str();
  app.add_option("--predictor", text.predictor,
                 "next-query predictor: ridge (ridge regression, relative eps) | paper (AsyncSpade Algorithm 1: "
                 "softmax over the ridge coefficients) | last (the current query, no prediction)")
      ->capture_default_str();
  app.add_option("--successor-expand", sc.successor_expand,
                 "a token ranks by the higher of its own and its predecessor's score (a selected token brings the "
                 "next one)")
      ->capture_default_str();
}

void resolve_selection_flags(const SelectionFlagText& text, SelectionConfig& sc) {
  if (text.gqa_rule == "max") {
    sc.gqa_rule = kernels::GqaScoreRule::kMax;
  } else if (text.gqa_rule == "mean") {
    sc.gqa_rule = kernels::GqaScoreRule::kMean;
  } else {
    fail("--gqa-rule must be max or mean, got '{}'", text.gqa_rule);
  }
  if (text.predictor == "ridge" || text.predictor == "paper" || text.predictor == "last") {
    sc.predictor = kernels::parse_predictor_kind(text.predictor.c_str());
  } else {
    fail("--predictor must be ridge, paper or last, got '{}'", text.predictor);
  }
  validate(sc);
}

}  // namespace spade::pair

// The pair's sparse settings (pair/selection_config.h SparseConfig) and their flags (pair/selection_flags.h): the
// groups a binary registers, parsing and validation, the delta capacity rule, and the refusal by name of a flag
// the user gave that a mode ignores.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "pair/selection_flags.h"

namespace spade::pair {
namespace {

using ::testing::HasSubstr;

// Parses `args` (after the program name) into `c` with the groups `groups`; returns the app for refuse_flags.
void parse(CLI::App& app, SparseConfig& c, SparseFlagText& t, unsigned groups, std::vector<std::string> args) {
  add_sparse_flags(app, c, t, groups);
  std::vector<const char*> argv = {"prog"};
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  resolve_sparse_flags(t, c);
}

TEST(SparseConfig, DefaultsAreDeclaredOnceAndValid) {
  const SparseConfig c;
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.sparse_threshold, 256);
  EXPECT_EQ(c.layers_per_pack, 4);
  EXPECT_EQ(c.delta_capacity, 0);
  EXPECT_TRUE(c.delta_transfer);
  EXPECT_EQ(c.max_first_per_step, 4);
  EXPECT_EQ(c.selection.token_budget, SelectionConfig{}.token_budget);
}

TEST(SparseConfig, DeltaCapacityZeroIsHalfTheBudgetAboveTheBudgetIsTheBudget) {
  SparseConfig c;
  c.selection.token_budget = 128;
  c.delta_capacity = 0;
  EXPECT_EQ(c.effective_delta_capacity(), 64);
  c.selection.token_budget = 7;  // rounded up: never 0
  EXPECT_EQ(c.effective_delta_capacity(), 4);
  c.selection.token_budget = 1;
  EXPECT_EQ(c.effective_delta_capacity(), 1);
  c.selection.token_budget = 128;
  c.delta_capacity = 32;
  EXPECT_EQ(c.effective_delta_capacity(), 32);
  c.delta_capacity = 128;
  EXPECT_EQ(c.effective_delta_capacity(), 128);
  c.delta_capacity = 4096;
  EXPECT_EQ(c.effective_delta_capacity(), 128);
}

TEST(SparseConfig, ValidateNamesTheSetting) {
  auto msg = [](SparseConfig c) {
    try {
      validate(c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  SparseConfig c;
  c.sparse_threshold = 0;
  EXPECT_THAT(msg(c), HasSubstr("sparse threshold"));
  c = SparseConfig{};
  c.layers_per_pack = 0;
  EXPECT_THAT(msg(c), HasSubstr("layers per pack"));
  c = SparseConfig{};
  c.delta_capacity = -1;
  EXPECT_THAT(msg(c), HasSubstr("delta capacity"));
  c = SparseConfig{};
  c.max_first_per_step = 0;
  EXPECT_THAT(msg(c), HasSubstr("first selections"));
  c = SparseConfig{};
  c.selection.local_window = 0;
  EXPECT_THAT(msg(c), HasSubstr("local window"));
}

TEST(SparseFlags, EachGroupRegistersItsFlagsOnly) {
  CLI::App app;
  SparseConfig c;
  SparseFlagText t;
  add_sparse_flags(app, c, t, kSelectionFlags | kDeltaTransferFlag);
  for (const char* f : {"--token-budget", "--local-window", "--sink-tokens", "--query-window", "--ridge-eps",
                        "--gqa-rule", "--predictor", "--successor-expand", "--delta-transfer"})
    EXPECT_NE(app.get_option_no_throw(f), nullptr) << f;
  for (const char* f : {"--sparse-threshold", "--layers-per-pack", "--delta-capacity"})
    EXPECT_EQ(app.get_option_no_throw(f), nullptr) << f;
}

TEST(SparseFlags, ParseIntoTheOneConfig) {
  CLI::App app;
  SparseConfig c;
  SparseFlagText t;
  parse(app, c, t, kSelectionFlags | kScheduleFlags | kDeltaCapacityFlag | kDeltaTransferFlag,
        {"--token-budget", "64", "--local-window", "8", "--sink-tokens", "2", "--query-window", "4", "--ridge-eps",
         "0.5", "--gqa-rule", "mean", "--predictor", "paper", "--successor-expand", "false", "--sparse-threshold",
         "100", "--layers-per-pack", "3", "--delta-capacity", "16", "--delta-transfer", "false"});
  EXPECT_EQ(c.selection.token_budget, 64);
  EXPECT_EQ(c.selection.local_window, 8);
  EXPECT_EQ(c.selection.sink_tokens, 2);
  EXPECT_EQ(c.selection.query_window, 4);
  EXPECT_FLOAT_EQ(c.selection.ridge_eps, 0.5f);
  EXPECT_EQ(c.selection.gqa_rule, kernels::GqaScoreRule::kMean);
  EXPECT_EQ(c.selection.predictor, kernels::PredictorKind::kPaper);
  EXPECT_FALSE(c.selection.successor_expand);
  EXPECT_EQ(c.sparse_threshold, 100);
  EXPECT_EQ(c.layers_per_pack, 3);
  EXPECT_EQ(c.delta_capacity, 16);
  EXPECT_FALSE(c.delta_transfer);
}

TEST(SparseFlags, BadTextValuesAreRefusedByName) {
  {
    CLI::App app;
    SparseConfig c;
    SparseFlagText t;
    EXPECT_THROW(
        {
          try {
            parse(app, c, t, kSelectionFlags, {"--gqa-rule", "median"});
          } catch (const Error& e) {
            EXPECT_THAT(e.what(), HasSubstr("--gqa-rule"));
            throw;
          }
        },
        Error);
  }
  {
    CLI::App app;
    SparseConfig c;
    SparseFlagText t;
    EXPECT_THROW(parse(app, c, t, kSelectionFlags, {"--query-window", "99"}), Error);
  }
}

TEST(SparseFlags, PromptAnchorsParseValidateAndCanBeTurnedOff) {
  EXPECT_EQ(SelectionConfig{}.anchor_queries, kMaxAnchorQueries);  // on by default
  {
    CLI::App app;
    SparseConfig c;
    SparseFlagText t;
    parse(app, c, t, kSelectionFlags, {"--anchor-queries", "0", "--anchor-span", "24"});
    EXPECT_EQ(c.selection.anchor_queries, 0);  // off: the earlier default
    EXPECT_EQ(c.selection.anchor_span, 24);
  }
  for (const char* bad : {"65", "-1"}) {
    CLI::App app;
    SparseConfig c;
    SparseFlagText t;
    try {
      parse(app, c, t, kSelectionFlags, {"--anchor-queries", bad});
      ADD_FAILURE() << bad << " accepted";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), HasSubstr("anchor queries")) << bad;
    }
  }
  SelectionConfig sc;
  sc.anchor_span = 0;
  EXPECT_THROW(validate(sc), Error);
}

TEST(SparseFlags, PromptAnchorsAreOnByDefaultAndTakeTheGivenCount) {
  {
    CLI::App app;
    SparseConfig c;
    SparseFlagText t;
    parse(app, c, t, kSelectionFlags, {"--anchor-span", "8"});
    EXPECT_EQ(c.selection.anchor_queries, kMaxAnchorQueries);  // both paths' default
    EXPECT_EQ(c.selection.anchor_span, 8);
  }
  for (const char* given : {"0", "32"}) {
    CLI::App app;
    SparseConfig c;
    SparseFlagText t;
    parse(app, c, t, kSelectionFlags, {"--anchor-queries", given});
    EXPECT_EQ(c.selection.anchor_queries, std::stoi(given));
  }
}

TEST(FlagRefusals, NamesEveryGivenFlagOnceAndIgnoresDefaults) {
  CLI::App app;
  SparseConfig c;
  SparseFlagText t;
  parse(app, c, t, kSelectionFlags | kDeltaTransferFlag,
        {"--token-budget", "64", "--sink-tokens", "0", "--delta-transfer", "true"});
  FlagRefusals r(app);
  r.refuse("--device cuda", {"--token-budget", "--local-window", "--sink-tokens"}, "from the hello");
  r.refuse("--device cuda", {"--sink-tokens", "--delta-transfer"}, "no sinks, always deltas");
  r.refuse_if(false, "never shown");
  try {
    r.check();
    FAIL() << "given flags were accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_THAT(m, HasSubstr("--token-budget does not apply to --device cuda (from the hello)"));
    EXPECT_THAT(m, HasSubstr("--sink-tokens does not apply to --device cuda (from the hello)"));
    EXPECT_THAT(m, HasSubstr("--delta-transfer does not apply to --device cuda (no sinks, always deltas)"));
    EXPECT_EQ(m.find("--sink-tokens", m.find("--sink-tokens") + 1), std::string::npos) << "named once: " << m;
    EXPECT_EQ(m.find("--local-window"), std::string::npos) << "not given, not refused: " << m;
    EXPECT_EQ(m.find("never shown"), std::string::npos) << m;
  }
  FlagRefusals ok(app);
  ok.refuse("--device cuda", {"--local-window", "--predictor"}, "unused");
  EXPECT_NO_THROW(ok.check());
  FlagRefusals by_value(app);
  by_value.refuse_if(true, "--sink-tokens 4 does not apply to --device cuda");
  EXPECT_THROW(by_value.check(), Error);
  EXPECT_THROW(ok.refuse("--device cuda", {"--no-such-flag"}, "a typo"), Error);
}

}  // namespace
}  // namespace spade::pair

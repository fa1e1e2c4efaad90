// The GPU cache rank's --score-keys flag (pair/selection_flags.h kScoreKeysFlag): registered only with its
// group, parsed into SelectionConfig::score_keys, its default the config's, a bad value refused naming the
// flag.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "pair/selection_flags.h"

namespace spade::pair {
namespace {

using ::testing::HasSubstr;

void parse(CLI::App& app, SparseConfig& c, SparseFlagText& t, unsigned groups,
           std::vector<std::string> args) {
  add_sparse_flags(app, c, t, groups);
  std::vector<const char*> argv = {"prog"};
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  resolve_sparse_flags(t, c);
}

TEST(ScoreKeysFlag, ParsesIntoTheSelectionConfig) {
  CLI::App app;
  SparseConfig c;
  SparseFlagText t;
  parse(app, c, t, kSelectionFlags | kScoreKeysFlag, {"--score-keys", "int8"});
  EXPECT_EQ(c.selection.score_keys, kernels::ScoreKeys::kInt8);
}

TEST(ScoreKeysFlag, DefaultIsTheConfigsAndOnlyItsGroupRegistersIt) {
  CLI::App app;
  SparseConfig c;
  SparseFlagText t;
  parse(app, c, t, kScoreKeysFlag, {});
  EXPECT_EQ(c.selection.score_keys, SelectionConfig{}.score_keys);
  CLI::App other;
  SparseConfig c2;
  SparseFlagText t2;
  EXPECT_THROW(parse(other, c2, t2, kSelectionFlags | kScheduleFlags, {"--score-keys", "int8"}),
               CLI::ParseError);
  // A config whose text was never registered keeps its value.
  SparseConfig c3;
  c3.selection.score_keys = kernels::ScoreKeys::kInt8;
  resolve_sparse_flags(SparseFlagText{}, c3);
  EXPECT_EQ(c3.selection.score_keys, kernels::ScoreKeys::kInt8);
}

TEST(ScoreKeysFlag, BadValueIsRefusedByName) {
  CLI::App app;
  SparseConfig c;
  SparseFlagText t;
  try {
    parse(app, c, t, kScoreKeysFlag, {"--score-keys", "fp8"});
    FAIL() << "fp8 accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("--score-keys must be bf16 or int8, got 'fp8'"));
  }
}

}  // namespace
}  // namespace spade::pair

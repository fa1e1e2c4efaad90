// bench/churn_search.h: the rho search of bench_tpot --churn reaches a target churn in kChurnPhases phases for a
// churn that falls with rho, and ends at the ends of its range when the target lies outside it.
#include "bench/churn_search.h"

#include <gtest/gtest.h>

#include <cmath>

namespace spade::tpot {
namespace {

// A churn that falls with rho like the measured one (bench/results/bench_tpot-h100x2-20261128-churn.txt: about 0.9
// at rho 0, 0.31 at rho 0.953).
double model_churn(double rho) { return 0.9 * std::pow(1.0 - rho, 0.35); }

double search(double target) {
  ChurnSearch s(target);
  for (int i = 0; i < kChurnPhases; ++i) s.observe(model_churn(s.rho()));
  return s.rho();
}

TEST(ChurnSearch, ReachesTargetsInsideItsRange) {
  for (double target : {0.05, 0.1, 0.313, 0.5, 0.8}) {
    const double rho = search(target);
    EXPECT_NEAR(model_churn(rho), target, 0.01 * target + 0.002) << "target " << target << ", rho " << rho;
  }
}

TEST(ChurnSearch, HigherTargetsGetSmallerRho) {
  EXPECT_GT(search(0.1), search(0.313));
  EXPECT_GT(search(0.313), search(0.6));
}

TEST(ChurnSearch, TargetsOutsideItsRangeEndAtTheEnds) {
  // Above the model's own churn (rho 0): the search runs down to rho ~ 0.
  EXPECT_LT(ChurnSearch::x_of(search(0.95)), 0.01);
  // Below the churn at rho = 1 - 1e-4: it runs up to the top of its range.
  EXPECT_GT(ChurnSearch::x_of(search(0.01)), 3.99);
}

TEST(ChurnSearch, RhoAndXConvert) {
  EXPECT_EQ(ChurnSearch::rho_of(0), 0.0);
  EXPECT_EQ(ChurnSearch::rho_of(-1), 0.0);
  EXPECT_NEAR(ChurnSearch::rho_of(2), 0.99, 1e-12);
  for (double rho : {0.0, 0.5, 0.9, 0.95323, 0.9999}) EXPECT_NEAR(ChurnSearch::rho_of(ChurnSearch::x_of(rho)), rho, 1e-12);
  EXPECT_NEAR(ChurnSearch(0.3).rho(), 0.99, 1e-12) << "the first phase runs at the middle of the range";
}

}  // namespace
}  // namespace spade::tpot

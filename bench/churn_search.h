// The rho search of bench_tpot --churn F (bench/tpot_common.h Opts::churn): the cache rank pushes
// q' = rho q'_prev + sqrt(1 - rho^2) q into its query windows, and the selection's churn (the share of each
// selection that entered it that step) falls as rho grows. A bisection on x in rho = 1 - 10^-x, x in [0, 4]
// (rho 0 .. 0.9999), one measured phase per step of the search. No CUDA: unit-tested on the CPU
// (tests/bench/test_churn_search.cpp).
#pragma once

#include <cmath>

namespace spade::tpot {

/// Bisection phases of a calibration run (each query_window + 4 decode steps: the windows turn over, then 4 steps
/// of selections are counted): the search interval of x shrinks to 4 / 2^10.
inline constexpr int kChurnPhases = 10;

class ChurnSearch {
 public:
  /// target: the churn to reach, in (0, 1).
  explicit ChurnSearch(double target) : target_(target) {}
  /// rho of a given x (x <= 0: rho 0, the model's own queries).
  static double rho_of(double x) { return x <= 0 ? 0.0 : 1.0 - std::pow(10.0, -x); }
  /// x of a given rho in [0, 1).
  static double x_of(double rho) { return rho <= 0 ? 0.0 : -std::log10(1.0 - rho); }
  /// The rho to run the next phase at.
  double rho() const { return rho_of(x_); }
  /// One phase's churn, measured at rho(): more than the target raises rho, less lowers it.
  void observe(double churn) {
    (churn > target_ ? lo_ : hi_) = x_;
    x_ = (lo_ + hi_) / 2;
  }

 private:
  double target_;
  double x_ = 2, lo_ = 0, hi_ = 4;
};

}  // namespace spade::tpot

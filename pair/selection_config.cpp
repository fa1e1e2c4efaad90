#include "pair/selection_config.h"

#include "common/error.h"

namespace spade::pair {

void validate(const SelectionConfig& c) {
  SPADE_CHECK(c.token_budget > 0, "token budget must be positive, got {}", c.token_budget);
  SPADE_CHECK(c.local_window >= 1, "local window must be >= 1 (the current token), got {}", c.local_window);
  SPADE_CHECK(c.sink_tokens >= 0, "sink tokens must be >= 0, got {}", c.sink_tokens);
  SPADE_CHECK(c.query_window >= 1 && c.query_window <= kernels::kMaxPredictorWindow,
              "query window must be in 1..{}, got {}", kernels::kMaxPredictorWindow, c.query_window);
  SPADE_CHECK(c.ridge_eps > 0, "ridge epsilon must be positive, got {}", c.ridge_eps);
}

}  // namespace spade::pair

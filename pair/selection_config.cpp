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
  SPADE_CHECK(c.anchor_queries >= 0 && c.anchor_queries <= kMaxAnchorQueries,
              "anchor queries must be in 0..{} (0 = off), got {}", kMaxAnchorQueries, c.anchor_queries);
  SPADE_CHECK(c.anchor_span >= 1, "anchor span must be >= 1, got {}", c.anchor_span);
}

void validate(const SparseConfig& c) {
  validate(c.selection);
  SPADE_CHECK(c.sparse_threshold >= 1, "sparse threshold must be >= 1, got {}", c.sparse_threshold);
  SPADE_CHECK(c.layers_per_pack >= 1, "layers per pack must be >= 1, got {}", c.layers_per_pack);
  SPADE_CHECK(c.delta_capacity >= 0, "delta capacity must be >= 0 (0 = the token budget), got {}", c.delta_capacity);
  SPADE_CHECK(c.overlap_sample_every >= 0, "overlap sample interval must be >= 0 (0 = off), got {}",
              c.overlap_sample_every);
  SPADE_CHECK(c.max_first_per_step >= 1, "max first selections per step must be >= 1, got {}", c.max_first_per_step);
}

}  // namespace spade::pair

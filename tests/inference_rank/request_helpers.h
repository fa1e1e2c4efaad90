// Requests and sparse settings the in-process inference-rank tests share: a synthetic prompt, a greedy request
// (greedy_request.h) and the stories260K sparse configuration of the in-process pair tests.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"
#include "tests/inference_rank/greedy_request.h"

namespace spade::test {

/// `n` token ids: BOS (1), then a deterministic sequence in [3, vocab) that `salt` varies.
inline std::vector<int32_t> prompt(int n, int salt, int vocab = 503) {
  std::vector<int32_t> p = {1};
  for (int i = 1; i < n; ++i) p.push_back(static_cast<int32_t>(3 + (i * 37 + salt * 11) % (vocab - 3)));
  return p;
}

/// Predicted selection from 24 tokens on, packs of 2 layers, budget 16, local window 8, no sinks, query window 4.
inline SparseOptions stories_sparse() {
  SparseOptions so;
  so.mode = SelectionMode::Predicted;
  so.sparse_threshold = 24;
  so.layers_per_pack = 2;
  so.selection.token_budget = 16;
  so.selection.local_window = 8;
  so.selection.sink_tokens = 0;
  so.selection.query_window = 4;
  return so;
}

}  // namespace spade::test

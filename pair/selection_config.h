// The selection settings an inference rank and its cache rank share (AsyncSpade Sec. 4.1-4.2, Algorithm 1) and the
// selection of one (sequence, layer) as both ranks hold it. Declared once here; parsed from the command line once
// (pair/selection_flags.h); carried on the wire in the pair hello (pair/gpu_plan.h) and the CPU pack (pair/pack.h).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/selection_ref.h"

namespace spade::pair {

struct SelectionConfig {
  int token_budget = 256;  // k: tokens selected per (sequence, layer, KV head)
  int local_window = 32;   // R: most recent tokens the inference rank attends from its own KV
  // S: first tokens the inference rank attends from its own KV. 0 by default on both paths: the GPU path has no sink
  // tokens (they compete in the top-k), and on the CPU path 0 and 4 answered the same pass-key prompts
  // (docs/FIDELITY.md).
  int sink_tokens = 0;
  int query_window = 8;    // W: predictor regressors (window sizes 1..W), 1..kernels::kMaxPredictorWindow
  // ε added to the Gram diagonal: relative to the regressors' mean squared norm for the ridge predictor, absolute
  // for the paper's (kernels/selection_ref.h).
  float ridge_eps = 1e-2f;
  kernels::GqaScoreRule gqa_rule = kernels::GqaScoreRule::kMax;
  kernels::PredictorKind predictor = kernels::PredictorKind::kRidge;
  bool successor_expand = true;  // a token ranks by max(own score, predecessor's score) (kernels/selection_ref.h)
};

/// Throws spade::Error naming the field when a value is out of range.
void validate(const SelectionConfig& c);

/// The selection of one (sequence, layer): `count` positions per KV head (ascending; the same count for every head),
/// padded to the budget with -1 / zero rows.
struct LayerSelection {
  int count = 0;
  std::vector<int32_t> positions;  // [num_kv_heads, token_budget]
  std::vector<float> k;            // [num_kv_heads, token_budget, head_dim]
  std::vector<float> v;            // [num_kv_heads, token_budget, head_dim]
};

}  // namespace spade::pair

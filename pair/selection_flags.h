// The selection settings' command-line flags (pair::SelectionConfig), declared once for every binary that selects
// or attends sparsely: inference_rank, cache_rank and the fidelity harness register the same flags with the same
// meaning and parse them the same way.
//
//   --token-budget K  --local-window R  --sink-tokens S  --query-window W  --ridge-eps E
//   --gqa-rule max|mean  --predictor ridge|paper|last  --successor-expand true|false
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "pair/selection_config.h"

namespace spade::pair {

/// The flags' text values that need parsing after CLI11 has run (resolve_selection_flags).
struct SelectionFlagText {
  std::string gqa_rule = "max";
  std::string predictor = "ridge";
};

/// Registers the selection flags on `app`, writing into `sc` (its values are the defaults shown) and `text`.
void add_selection_flags(CLI::App& app, SelectionConfig& sc, SelectionFlagText& text);
/// Parses `text` into `sc` and validates it. Throws spade::Error naming the flag for a bad value.
void resolve_selection_flags(const SelectionFlagText& text, SelectionConfig& sc);

}  // namespace spade::pair

// INTERNAL to the tokenizer (common/tokenizer*.cpp); not public API. Generated Unicode 14.0.0 character
// data for canonical normalization (UAX #15), used by tokenizer_normalize.cpp. The tables are defined in
// tokenizer_unicode_data.cpp, whose comment gives the source (Python 3.11 unicodedata) and the generator.
#pragma once

#include <cstdint>
#include <span>

namespace spade::tokenizer_detail {

// One canonical decomposition mapping, one step (not applied recursively).
struct Decomposition {
  uint32_t cp, first, second;  // second == 0: singleton
};
// A range of code points sharing one non-zero canonical combining class.
struct CccRange {
  uint32_t first, last;
  uint8_t ccc;
};

// Canonical (not compatibility) decompositions of every code point that has one, sorted by cp.
extern const std::span<const Decomposition> kDecompositions;
// Canonical combining classes: sorted, disjoint ranges; code points not covered have class 0.
extern const std::span<const CccRange> kCccRanges;
// Composition_Exclusions.txt entries (script-specific and post-composition-version exclusions), sorted.
extern const std::span<const uint32_t> kCompositionExclusions;

}  // namespace spade::tokenizer_detail

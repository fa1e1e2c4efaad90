// The sparse-decoding flags (pair::SparseConfig), declared once for every binary that selects or attends sparsely:
// inference_rank, cache_rank and the fidelity harness register the groups they use, with the same names, meaning,
// defaults and parsing. And the refusal, by name, of a flag the user gave that the binary's current mode ignores.
//
//   selection        --token-budget K  --local-window R  --sink-tokens S  --query-window W  --ridge-eps E
//                    --gqa-rule max|mean  --predictor ridge|paper|last  --successor-expand true|false
//                    --anchor-queries N  --anchor-span A
//   schedule         --sparse-threshold N  --layers-per-pack P      (the inference rank's)
//   delta capacity   --delta-capacity C                             (the GPU inference rank's)
//   delta transfer   --delta-transfer true|false                    (the CPU cache rank's)
//   score keys       --score-keys bf16|int8                         (the GPU cache rank's)
//   overlap sampling --overlap-sample-every N                       (the cache rank's, either device)
#pragma once

#include <CLI/CLI.hpp>

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "pair/selection_config.h"

namespace spade::pair {

/// The flag groups add_sparse_flags registers (bit flags; or them together).
enum SparseFlagGroup : unsigned {
  kSelectionFlags = 1u,      // the SelectionConfig fields
  kScheduleFlags = 2u,       // sparse_threshold, layers_per_pack
  kDeltaCapacityFlag = 4u,   // delta_capacity
  kDeltaTransferFlag = 8u,   // delta_transfer
  kScoreKeysFlag = 16u,      // selection.score_keys
  kOverlapSampleFlag = 32u,  // overlap_sample_every
};

/// The flags' text values that need parsing after CLI11 has run (resolve_sparse_flags).
struct SparseFlagText {
  std::string gqa_rule = "max";
  std::string predictor = "ridge";
  std::string score_keys;  // set from the config's default by add_sparse_flags
};

/// Registers the flags of `groups` (SparseFlagGroup bits) on `app`, writing into `c` (its values are the defaults
/// shown in --help) and `text`.
void add_sparse_flags(CLI::App& app, SparseConfig& c, SparseFlagText& text, unsigned groups);
/// After CLI11 has parsed: parses `text` into `c` and validates `c` (validate(const SparseConfig&)). Throws
/// spade::Error naming the flag for a bad value.
void resolve_sparse_flags(const SparseFlagText& text, SparseConfig& c);

/// The refusal, by name, of the flags a binary's current mode would ignore. After CLI11 has parsed `app`, record
/// each rule, then check(): a misconfigured rank stops at once, naming every such flag. Use it before anything needs
/// a GPU, a model or a peer, so that CPU-only builds run (and test) the refusals of every mode.
class FlagRefusals {
 public:
  /// `app`: parsed; must outlive this object.
  explicit FlagRefusals(const CLI::App& app) : app_(app) {}
  /// Refuses each of `flags` (long names as registered, e.g. "--sink-tokens") that the user passed (a default value
  /// does not count): "--sink-tokens does not apply to <mode> (<why>)". A flag already refused is not repeated. A
  /// name `app` does not know is a programming error (spade::Error, at once).
  void refuse(std::string_view mode, std::initializer_list<std::string_view> flags, std::string_view why);
  /// Refuses by a value rather than by presence: records `message`, which names the flag, when `refused`.
  void refuse_if(bool refused, std::string message);
  /// Throws spade::Error listing every refusal, one per line, if there is any.
  void check() const;

 private:
  const CLI::App& app_;
  std::vector<std::string> flags_, lines_;
};

}  // namespace spade::pair

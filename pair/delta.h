// Delta transfer of selections (beyond the AsyncSpade paper): consecutive decode steps select mostly the
// same tokens, so the cache rank sends only the tokens that entered the selection, each with the slot it replaces.
//
// The inference rank holds, per (sequence, layer), the selected K/V of the current step in a slot table: per KV head
// `token_budget` slots, of which the first `count` are live (LayerSelection, pair/selection_config.h, with positions in
// slot order instead of ascending order). The cache rank keeps a mirror of every slot table (SelectionMirror). For a
// new selection S of n tokens per head, kernels/selection_delta_ref.h plans the slots (the one rule the CPU path and
// the GPU kernels share):
//   kept     = slots s < n whose token is in S (they stay where they are),
//   free     = the other slots s < n (empty ones first, then those holding a token that left S),
//   entering = tokens of S not kept,      |entering| == |free|,
// and entering[j] (ascending) goes to free[j]. Slots >= n are dropped. Here every entering token is sent (the
// capacity is the budget); the GPU path bounds the entries per row (selection.cuh selection_delta). Applying the delta to the inference rank's
// table leaves exactly S in slots [0, n) — the same set as a full transfer; attention over it is order-free, and
// SparseAttention attends in ascending position order so the result is bit-identical.
//
// Both ends apply every selection message in order (the link fails as a whole otherwise), which keeps the mirror
// exact. A sequence's mirror is reset when its INIT update arrives (it (re)enters sparse mode: the delta then carries
// all n tokens) and dropped when it is released.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "pair/selection_config.h"

namespace spade::pair {

struct PackUpdate;
struct PackSelection;

/// The change of one (sequence, layer) selection. Entries are grouped by KV head (head 0 first).
struct LayerDelta {
  int count = 0;                   // live slots per KV head after applying (== LayerSelection::count)
  std::vector<int32_t> changed;    // [num_kv_heads] entries of each head
  std::vector<int32_t> slots;      // [entries] slot written, in [0, count)
  std::vector<int32_t> positions;  // [entries] token position now in that slot
  std::vector<float> k, v;         // [entries, head_dim] fp32
  size_t entries() const { return slots.size(); }
};

/// Counters of a mirror since construction: rows (one token of one KV head of one layer) a full transfer would have
/// sent, and rows the deltas sent. Bytes saved = (selected_rows - sent_rows) × (2 × head_dim × 4 + 4) minus the
/// 4 bytes of slot per sent row.
struct DeltaStats {
  uint64_t selected_rows = 0;
  uint64_t sent_rows = 0;
  uint64_t layer_selections = 0;
};

/// The cache rank's mirror of its inference rank's slot tables. Not thread-safe; one owner (the serving loop).
class SelectionMirror {
 public:
  SelectionMirror(int num_kv_heads, int token_budget, int head_dim);

  /// The delta that turns the mirrored table of (seq, layer) into `full` (positions ascending per head, as
  /// Selector::select produces), and updates the mirror. Throws spade::Error when `full` does not have this mirror's
  /// shape or its count exceeds the budget.
  LayerDelta diff(uint64_t seq, int layer, const LayerSelection& full);

  /// Applies the update's releases and INIT resets, then replaces every full selection of `p` by its delta
  /// (p.delta = true, SeqSelection::deltas filled, SeqSelection::layers cleared). `p` with an error is left alone.
  void to_delta(const PackUpdate& u, PackSelection& p);

  void release(uint64_t seq) { seqs_.erase(seq); }
  void reset(uint64_t seq) { seqs_.erase(seq); }
  size_t num_sequences() const { return seqs_.size(); }
  const DeltaStats& stats() const { return stats_; }

 private:
  int heads_, budget_, head_dim_;
  // seq -> layer -> [num_kv_heads, token_budget] position per slot (-1 = empty)
  std::unordered_map<uint64_t, std::unordered_map<int, std::vector<int32_t>>> seqs_;
  DeltaStats stats_;
  std::vector<int32_t> slots_, positions_, info_;  // scratch: the slot plan of one layer (selection_delta_ref)
};

/// The inference rank's side: writes `d` into its slot table `held` (positions / k / v of [num_kv_heads,
/// token_budget(, head_dim)]; sized and filled with -1 / 0 on first use) and sets held.count. Throws spade::Error
/// naming `peer` when the delta is malformed (slot outside [0, count), entry counts that do not add up; `held` is
/// then untouched) or leaves a live slot empty (the mirror is out of sync; `held` is then partly updated and must be
/// discarded — the inference rank fails the link).
void apply_delta(const LayerDelta& d, LayerSelection& held, int num_kv_heads, int token_budget, int head_dim,
                 const std::string& peer);

}  // namespace spade::pair

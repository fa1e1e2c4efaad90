// CPU reference of delta transfer of selections (beyond the AsyncSpade paper): the cache rank sends, per
// (sequence, layer, KV head) row, only the tokens that entered the selection, each with the slot of the inference
// rank's table it goes to, instead of the whole selected K/V. Consecutive decode steps select mostly the same tokens
// (docs/ARCHITECTURE.md "The data plane wire" measured 7-25 % of the rows entering on stories260K), so the bytes on
// the link drop by about the same factor.
//
// The holder (inference rank) keeps per row a slot table of `k` slots (k = the token budget): slot s holds the K/V of
// one token, and sparse decode attends over slots [0, n) (attention is order-free). The cache rank keeps an exact
// mirror of every table: mirror[r][s] = the position held in slot s, -1 = empty. Both ends apply every delta, in
// order, so the mirror stays exact.
//
// ---- selection_delta_ref: the delta of row r (cache rank) ----
// The new selection S = indices[r][0..n): ascending positions followed by -1 (topk_ref's output), n = its count.
//   kept     = slots s < n with mirror[r][s] in S; they stay where they are;
//   free     = the other slots s < n, ordered: the EMPTY ones ascending first, then the STALE ones ascending (a stale
//              slot holds a token of an earlier selection that S no longer has);
//   entering = the tokens of S no slot < n holds, |entering| == |free| == E.
// The delta sends m = min(E, capacity) tokens: all entering tokens when E <= capacity; otherwise the `capacity` best
// by (topk_key(scores[r][pos]) descending, position ascending), the ranking and tie rule of topk_ref. The sent tokens,
// in ascending position order, take free[0..m) in order. Slots free[m..E) keep what they held: a stale token (the
// holder attends over it one more step) or nothing (a HOLE: the slot is empty below n). Empty slots are filled first
// so that holes appear only when more than `capacity` slots are empty at once (a row's first selection, or n growing
// by more than `capacity` in one step); a caller that must not attend over a hole sends such rows in full.
// Finally the mirror's slots >= n are emptied (the holder's are never read).
// Outputs per row: delta_slots[r][j], delta_positions[r][j] for j < m and -1 for m <= j < capacity (the positions
// row is gather_kv's index row: -1 gathers a zero row), row_info[r] = {n, E, m, holes}.
// Errors (spade::Error naming the row): indices not ascending / -1 inside the count; a mirror slot < n below -1
// or two slots < n holding the same token (the mirror is corrupt); bad parameters.
//
// ---- apply_selection_delta_ref: the holder's side ----
// For every row r and j < capacity with delta_slots[r][j] >= 0: held_k[h][slot] = delta_k[r][j] with h = held_rows[r]
// (or r), likewise V, and held_positions[h][slot] = delta_positions[r][j] when held_positions is set. Errors: a
// slot >= k, a negative held row.
//
// Row order is the caller's; the GPU kernels (selection.cuh selection_delta / apply_selection_delta) take rows as
// [layer-batched sequence][KV head], the order of topk_select / gather_kv.
#pragma once

#include <cstdint>

namespace spade::kernels {

/// Fields of selection_delta's per-row info record: row_info[r * kDeltaInfoFields + field].
inline constexpr int kDeltaInfoFields = 4;
enum DeltaInfoField : int { kDeltaCount = 0, kDeltaEntering = 1, kDeltaEntries = 2, kDeltaHoles = 3 };

struct SelectionDeltaRefParams {
  const int32_t* indices = nullptr;    // [rows, k] int32 new selection: ascending positions, then -1.
  const float* scores = nullptr;       // [rows, score_stride] fp32 scores the selection ranked; read only for rows
                                       // with more entering tokens than `capacity` (may be null if none has).
  int32_t* mirror = nullptr;           // [mirror rows, k] int32 in/out: position held in each slot, -1 empty.
  const int32_t* mirror_rows = nullptr;  // optional [rows] int32: the mirror row of row r (default r; e.g. per-slot
                                         // mirrors [slot][layer][KV head] of a serving cache rank).
  int32_t* delta_slots = nullptr;      // [rows, capacity] int32 out: slot of entry j, -1 past the entries.
  int32_t* delta_positions = nullptr;  // [rows, capacity] int32 out: token position of entry j, -1 past the entries.
  int32_t* row_info = nullptr;         // [rows, kDeltaInfoFields] int32 out: {n, E, m, holes}.
  int rows = 0;
  int k = 0;             // slots per row (the token budget), >= 1.
  int capacity = 0;      // entries per row of the delta, 1..k.
  int score_stride = 0;  // row stride of scores (> every selected position).
};

/// The delta of every row against the mirror (see the header comment); updates the mirror.
void selection_delta_ref(const SelectionDeltaRefParams& p);

struct ApplySelectionDeltaRefParams {
  const int32_t* delta_slots = nullptr;      // [rows, capacity] int32, -1 = no entry.
  const int32_t* delta_positions = nullptr;  // [rows, capacity] int32 (read only when held_positions is set).
  const float* delta_k = nullptr;            // [rows, capacity, head_dim] fp32.
  const float* delta_v = nullptr;            // [rows, capacity, head_dim] fp32.
  float* held_k = nullptr;                   // [rows, k, head_dim] fp32 in/out: the holder's slot table.
  float* held_v = nullptr;                   // [rows, k, head_dim] fp32 in/out.
  int32_t* held_positions = nullptr;         // optional [held rows, k] int32 in/out.
  const int32_t* held_rows = nullptr;        // optional [rows] int32: the held-table row of delta row r (default r;
                                             // e.g. per-slot tables [slot][layer][KV head]).
  int rows = 0;
  int k = 0;
  int capacity = 0;
  int head_dim = 0;
};

/// Writes every row's entries into the holder's table.
void apply_selection_delta_ref(const ApplySelectionDeltaRefParams& p);

}  // namespace spade::kernels

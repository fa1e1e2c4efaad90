// CPU reference: the cache rank's query windows (AsyncSpade Algorithm 1's Q_cache: the last W + 1 queries of each
// (sequence, layer, query head), the predictor's input, kernels/selection_ref.h predict_next_query_ref).
//
// push_query_window_ref: row r of a step (one (layer, sequence) pair) brings the queries of its n_r tokens
// (q rows cu_tokens[r] .. cu_tokens[r+1]-1, in position order). Its window w = window_idx[r] (every head of it) becomes
// the last min(capacity, len + n_r) entries of [its len valid entries | the n_r new queries], oldest first, and
// window_len[w] that count. reset[r] != 0 empties the window first (a fresh sequence, or a slot taken over).
#pragma once

#include <cstdint>

namespace spade::kernels {

struct PushQueryWindowRefParams {
  float* windows = nullptr;            // [num_windows, num_heads, capacity, head_dim] fp32 in/out, oldest first.
  int32_t* window_len = nullptr;       // [num_windows] int32 in/out: valid entries (0..capacity).
  const int32_t* window_idx = nullptr; // [rows] int32 window of row r (distinct).
  const float* q = nullptr;            // [tokens, num_heads, head_dim] fp32 queries of the step's tokens.
  const int32_t* cu_tokens = nullptr;  // [rows + 1] int32 token ranges of the rows in q.
  const int32_t* reset = nullptr;      // optional [rows] int32: non-zero empties the window first.
  int num_windows = 0;
  int rows = 0;
  int num_heads = 0;
  int capacity = 0;                    // >= 1
  int head_dim = 0;
};

/// Updates the windows of every row (see the header comment). Throws spade::Error for null pointers, sizes out of
/// range, a window index outside [0, num_windows) or used twice, a window_len outside [0, capacity], or cu_tokens
/// that decrease.
void push_query_window_ref(const PushQueryWindowRefParams& p);

}  // namespace spade::kernels

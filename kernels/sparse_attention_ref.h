// CPU reference: token-sparse decode attention (AsyncSpade Sec. 4.1: the inference rank attends over the K/V the
// cache rank selected, plus the local window). Oracle of attention.cuh's sparse_decode_attention_indexed /
// sparse_decode_attention_packed, and the CPU data path of the inference rank's sparse decode.
//
// Both variants compute, per sequence b and query head h (KV head h / (num_q_heads / num_kv_heads)),
//   out = sum_j softmax_j(scale * q . k_j) v_j,  lse = ln sum_j exp(scale * q . k_j)
// over a token list; with an empty list out = 0 and lse = -inf. fp32 throughout; host pointers.
// The paged layout is kernels/paged_attention_ref.h's.
#pragma once

#include <cstdint>

#include "kernels/paged_shape.h"

namespace spade::kernels {

struct SparseIndexAttentionRefParams : PagedAttentionShape {
  const float* q = nullptr;              // [batch, num_q_heads, head_dim] fp32.
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const float* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* indices = nullptr;      // [batch, num_kv_heads, index_stride] int32 token positions.
  const int32_t* num_indices = nullptr;  // [batch] valid entries per (sequence, KV head).
  float* out = nullptr;                  // [batch, num_q_heads, head_dim] fp32.
  float* lse = nullptr;                  // optional [batch, num_q_heads] fp32.
  int index_stride = 0;
  float scale = 0.f;
};

/// Attention of each sequence's query over the listed token positions of its KV head.
/// Throws spade::Error on a negative position, a position past max_pages_per_seq * page_size or a page id < 0.
void sparse_index_attention_ref(const SparseIndexAttentionRefParams& p);

struct SparsePackedAttentionRefParams : PagedAttentionShape {
  const float* q = nullptr;              // [batch, num_q_heads, head_dim] fp32.
  const float* packed_k = nullptr;       // [batch, num_kv_heads, packed_capacity, head_dim] fp32.
  const float* packed_v = nullptr;       // [batch, num_kv_heads, packed_capacity, head_dim] fp32.
  const int32_t* num_packed = nullptr;   // [batch] valid packed rows per (sequence, KV head).
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32 (local window).
  const float* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* seq_lens = nullptr;     // [batch] context length.
  float* out = nullptr;                  // [batch, num_q_heads, head_dim] fp32.
  float* lse = nullptr;                  // optional [batch, num_q_heads] fp32.
  int packed_capacity = 0;
  int local_window = 0;  // the last min(local_window, seq_len) positions come from the paged cache.
  float scale = 0.f;
  // Optional per-sequence variants (a serving batch mixing sparse and dense sequences):
  const int32_t* local_windows = nullptr;  // [batch] window of sequence b (>= 0), overriding local_window; a dense
                                           // sequence: num_packed 0 and window seq_len.
  const int32_t* packed_rows = nullptr;    // [batch] row of packed_k / packed_v holding sequence b's selection
                                           // (default b: packed_k is then [rows, num_kv_heads, packed_capacity,
                                           // head_dim] with rows > every packed_rows[b]).
  // Optional, for the decode rows of a mixed (prefill + decode) step:
  const int32_t* q_rows = nullptr;  // [batch] int32 row of q / out / lse holding sequence b's query (default b): q
                                    // and out are then [rows, num_q_heads, head_dim], lse [rows, num_q_heads], rows
                                    // > every q_rows[b]; only the rows named are written. q_rows[b] < 0: sequence b
                                    // is skipped (nothing of it read, nothing written).
};

/// Attention over the packed rows followed by the local window of the paged cache. Only the window's positions
/// are looked up in the block table (entries of dropped pages outside it may be -1). Throws spade::Error naming
/// the field for a required pointer missing, num_packed / local_windows / packed_rows out of range, a window page
/// id < 0, or two sequences naming the same q_rows entry.
void sparse_packed_attention_ref(const SparsePackedAttentionRefParams& p);

}  // namespace spade::kernels

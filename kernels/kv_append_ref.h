// CPU reference: append the K/V rows of a ragged batch of tokens to the paged KV cache (the write half of
// kernels/layer_ops.cuh rope_kv_append; layout contract of kernels/paged_attention_ref.h).
//
// Token t of sequence seq_idx[t] at absolute position positions[t] goes to page
// block_table[seq_idx[t] * max_pages_per_seq + positions[t] / page_size], slot positions[t] % page_size.
#pragma once

#include <cstdint>

#include "kernels/paged_shape.h"

namespace spade::kernels {

struct KvAppendRefParams : PagedKvShape {
  const float* k = nullptr;              // [tokens, num_kv_heads, head_dim] fp32 (RoPE applied).
  const float* v = nullptr;              // [tokens, num_kv_heads, head_dim] fp32.
  const int32_t* positions = nullptr;    // [tokens] int32 absolute positions.
  const int32_t* seq_idx = nullptr;      // [tokens] int32 row of block_table.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32 page ids.
  float* k_cache = nullptr;              // [num_pages, page_size, num_kv_heads, head_dim] fp32, updated.
  float* v_cache = nullptr;              // [num_pages, page_size, num_kv_heads, head_dim] fp32, updated.
  int tokens = 0;
  int num_pages = 0;
};

/// Writes every token's rows. A page id of -1 (padding token) is skipped. Returns the number of tokens that were
/// skipped for an invalid slot (seq_idx outside [0, batch), position < 0 or past max_pages_per_seq * page_size,
/// page id outside [0, num_pages) other than -1) -- the GPU kernel raises its error flag for exactly these.
int kv_append_ref(const KvAppendRefParams& p);

}  // namespace spade::kernels

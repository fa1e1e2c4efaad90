// CPU reference: causal GQA attention over a paged KV cache (prefill chunks and decode steps, ragged batches).
//
// This is the oracle the CUDA paged split-K flash-decoding kernel is tested against, and the CPU data path of the
// inference rank. Source: Flash-Decoding with paged KV (../shared/papers/flash-decoding-paged-kv.txt); the paged
// layout is vLLM's PagedAttention layout with the KV-head axis inside the page slot.
//
// Paged KV layout (shared by CPU references, CUDA kernels, inference rank and cache rank):
//   k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim], row-major.
//   block_table:      [batch, max_pages_per_seq] int32; token t of sequence b lives in page block_table[b][t/page_size],
//                     slot t % page_size. Entries past ceil(seq_len/page_size) are ignored (may be -1).
// GQA: query head h reads KV head h / (num_q_heads / num_kv_heads) (consecutive query heads share a KV head, as in
// Hugging Face's repeat_kv).
#pragma once

#include <cstdint>

#include "kernels/paged_shape.h"

namespace spade::kernels {

struct PagedAttentionParams : PagedAttentionShape {
  // q: [total_q_tokens, num_q_heads, head_dim] fp32. Queries of all sequences, concatenated; RoPE already applied.
  const float* q = nullptr;
  // k_cache: [num_pages, page_size, num_kv_heads, head_dim] fp32 (keys, RoPE applied), including this step's tokens.
  const float* k_cache = nullptr;
  // v_cache: [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const float* v_cache = nullptr;
  // block_table: [batch, max_pages_per_seq] int32 page ids.
  const int32_t* block_table = nullptr;
  // cu_q_lens: [batch + 1] int32 prefix sums of query tokens per sequence (decode: 0,1,2,...,batch).
  const int32_t* cu_q_lens = nullptr;
  // seq_lens: [batch] int32 context length of each sequence after this step (the new tokens are its last q_len).
  const int32_t* seq_lens = nullptr;
  // out: [total_q_tokens, num_q_heads, head_dim] fp32, written completely.
  float* out = nullptr;
  // lse: optional [total_q_tokens, num_q_heads] fp32 natural log-sum-exp of the scaled scores (nullptr: not written).
  float* lse = nullptr;
  // scale: softmax scale applied to q·k, normally 1/sqrt(head_dim).
  float scale = 0.f;
  // skip: optional [batch] int32; nonzero = sequence b is skipped: its seq_lens / block_table / K / V are not read
  // and its out / lse rows are left as they are (another kernel serves them: the sparse decode rows of a mixed step,
  // whose dropped pages are -1 in the block table). cu_q_lens still spans its rows. nullptr: none is skipped.
  const int32_t* skip = nullptr;
};

/// Attention of one query over an explicit list of K/V rows, in list order: two passes (max, then exp-sum and
/// weighted V sum) in fp32 — the arithmetic paged_attention_ref uses, so dense and sparse paths that visit the same
/// rows in the same order give bit-identical results.
/// q: [head_dim]; k_rows[i], v_rows[i]: [head_dim] fp32 rows; scores: scratch of n floats; out: [head_dim].
/// Returns the natural log-sum-exp of the scaled scores (-inf when n == 0, out = 0).
float attention_over_rows_ref(const float* q, const float* const* k_rows, const float* const* v_rows, int n,
                              int head_dim, float scale, float* scores, float* out);

/// Causal attention: query i of sequence b (absolute position seq_lens[b] - q_len_b + i) attends to tokens
/// 0..its position. Accumulates in fp32 with a running max (online softmax). Sequences flagged in `skip` are left
/// out. Throws spade::Error on inconsistent parameters (num_q_heads not a multiple of num_kv_heads, q_len > seq_len,
/// a page id < 0 inside the context of a sequence that is not skipped).
void paged_attention_ref(const PagedAttentionParams& p);

}  // namespace spade::kernels

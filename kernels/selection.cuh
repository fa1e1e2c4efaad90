// CUDA selection kernels of the cache rank (AsyncSpade Sec. 4.2-4.3, Appendix C Algorithm 1): next-query
// prediction, GQA-batched token scoring over the paged cache, exact top-k per (sequence, KV head), and the gather of
// the selected K/V into the packed buffer that the inference rank's sparse decode reads
// (attention.cuh sparse_decode_attention_packed); and delta transfer of selections (selection_delta on the cache
// rank, apply_selection_delta on the inference rank; kernels/selection_delta_ref.h states the rule).
//
// Each kernel computes exactly what its CPU reference in kernels/selection_ref.h computes (that header documents the
// math, the GQA rule, the tie rule and the reading of the paper's Algorithm 1); the GPU tests compare them.
// Launchers are asynchronous on `stream` and return cudaSuccess, cudaErrorInvalidValue (launch_error_detail() in
// attention.cuh names the field), or the launch's CUDA error. Pointers are device pointers.
// Plain C++ header: includable from host code compiled by g++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.cuh"
#include "kernels/paged_shape.h"
#include "kernels/query_window_ref.h"
#include "kernels/selection_delta_ref.h"
#include "kernels/selection_ref.h"

namespace spade::kernels {

/// Next-query prediction for a batch of (sequence, head) query windows: predict_next_query_ref's math (AsyncSpade
/// Algorithm 1 as read in kernels/selection_ref.h, with its three PredictorKinds), Gram matrix and Cholesky solve in
/// fp64. kPaper: softmax over each window size's ridge coefficients, eps absolute. kRidge: the raw coefficients, eps
/// relative (eps * the mean squared norm of the largest window's regressors, the same for every window size).
/// kLastQuery: q_hat = Q_t. Every kind: n == 1 -> Q_t, n == 0 -> zeros. Rows = batch * num_heads.
/// The solve is a latency-bound fp64 chain per row; for many rows several share a CTA, so launching a whole layer
/// pack at once (batch = layers x sequences, window_len repeated per layer) is cheaper per layer than one launch per
/// layer (docs/KERNELS.md has the measurements).
struct PredictQueryParams {
  DType window_dtype = DType::F32;       // F32, BF16 or F16.
  const void* window = nullptr;          // [batch, num_heads, window_capacity, head_dim] window_dtype, oldest first.
  const int32_t* window_len = nullptr;   // [batch] int32 valid slots 0..window_len-1 (the last is Q_t).
  float* q_hat = nullptr;                // [batch, num_heads, head_dim] fp32 predicted Q_{t+1}.
  int batch = 0;
  int num_heads = 0;
  int window_capacity = 0;   // 1..kMaxPredictorWindow + 1 slots.
  int head_dim = 0;          // any of kSupportedHeadDims.
  int max_regressors = kMaxPredictorWindow;  // W: regression window sizes 1..W (1..kMaxPredictorWindow).
  float eps = 0.f;           // ridge epsilon (> 0): absolute (kPaper) or relative (kRidge); unused by kLastQuery.
  PredictorKind kind = PredictorKind::kRidge;  // predictor (kernels/selection_ref.h).
};

cudaError_t predict_next_query(const PredictQueryParams& p, cudaStream_t stream);

/// Token scores of predicted queries against the paged keys (score_tokens_ref's math), GQA-batched on tensor
/// cores: each CTA reads a KV head's keys once for the whole group.
/// keys == kBf16: the cache's keys; q_hat is split into hi + lo halves of the cache dtype so the scores keep ~fp32
/// accuracy. keys == kInt8: the compact copy (quantize_keys; half the bytes of bf16 keys plus 4 per row), scored
/// against the dequantised keys (selection_ref.h); each head's q_hat is carried as two int8 parts, hi + lo / 254 in
/// steps of a = max_d |q_hat[d]| / 127, so |score - score on the dequantised keys| <= k_scale[t] * sum_d |k_int8[d]| *
/// a / 508 per query head, plus fp32 rounding (integer dot products on tensor cores, exact).
struct ScoreTokensParams : PagedAttentionShape {
  DType dtype = DType::BF16;             // BF16 or F16: element type of k_cache (kBf16 only).
  ScoreKeys keys = ScoreKeys::kBf16;     // which keys are read: k_cache, or k_int8 + k_scale.
  const float* q_hat = nullptr;          // [batch, num_q_heads, head_dim] fp32.
  const void* k_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype (kBf16).
  const int8_t* k_int8 = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] int8 (kInt8).
  const float* k_scale = nullptr;        // [num_pages, page_size, num_kv_heads] fp32 (kInt8).
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* num_tokens = nullptr;   // [batch] int32 positions scored: 0..num_tokens-1.
  float* scores = nullptr;  // [batch, num_kv_heads, score_stride] fp32; entries >= num_tokens[b] not written.
  int score_stride = 0;  // row stride of scores; host-side bound of num_tokens.
  GqaScoreRule rule = GqaScoreRule::kMax;
};

cudaError_t score_tokens(const ScoreTokensParams& p, cudaStream_t stream);

/// The compact scoring copy of keys (quantize_keys_ref's rule, bit for bit) for the cache rows of `tokens` tokens:
/// the rows an append (rope_kv_append) just wrote, addressed as it addresses them (positions, seq_idx, block_table;
/// a token whose row, position or page is outside the table or the pool is skipped), or, with positions ==
/// nullptr, cache rows 0..tokens-1 (a whole pool). One warp per (token, KV head). tokens == 0 launches nothing.
struct QuantizeKeysParams : PagedKvShape {
  DType dtype = DType::BF16;             // BF16 or F16: element type of k_cache.
  const void* k_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  int8_t* k_int8 = nullptr;              // [num_pages, page_size, num_kv_heads, head_dim] int8 out.
  float* k_scale = nullptr;              // [num_pages, page_size, num_kv_heads] fp32 out.
  const int32_t* positions = nullptr;    // [tokens] int32 positions in their sequences, or nullptr (cache rows).
  const int32_t* seq_idx = nullptr;      // [tokens] int32 block-table row of each token (with positions).
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32 (with positions).
  // batch (a PagedKvShape field): with positions: block-table rows (a token's seq_idx outside: skipped).
  int tokens = 0;                        // >= 0: tokens, or cache rows (<= num_pages * page_size)
  // head_dim (a PagedKvShape field): any of kSupportedHeadDims.
  // page_size (a PagedKvShape field): a power of two.
  // max_pages_per_seq (a PagedKvShape field): with positions: block-table row length (> 0).
  int num_pages = 0;                     // pages of the pool (> 0).
};

cudaError_t quantize_keys(const QuantizeKeysParams& p, cudaStream_t stream);

/// Exact top-k per score row with topk_ref's order and tie rule (radix select, one CTA per row); with `successor`,
/// topk_ref's successor expansion: entry i > 0 of a row ranks by max(topk_key(s[i]), topk_key(s[i-1])), entry 0 by
/// its own key (ties at the threshold still go to the earliest positions).
struct TopkParams {
  const float* scores = nullptr;        // [rows, score_stride] fp32, rows = batch * rows_per_batch.
  const int32_t* row_lens = nullptr;    // [batch] int32 valid entries of each row of that sequence.
  int32_t* indices = nullptr;           // [rows, k] int32 positions ascending; -1 past the row's count.
  int32_t* counts = nullptr;            // optional [rows] int32 min(k, row_len).
  int batch = 0;
  int rows_per_batch = 0;  // e.g. num_kv_heads.
  int score_stride = 0;
  int k = 0;               // >= 1 (any size; rows longer than 44k keys are re-read from L2 on each pass).
  bool successor = false;  // successor expansion (kernels/selection_ref.h).
};

cudaError_t topk_select(const TopkParams& p, cudaStream_t stream);

/// Gather of selected K/V rows from the paged cache into the packed send buffer (gather_kv_ref's layout).
struct GatherKvParams : PagedKvShape {
  DType dtype = DType::BF16;             // BF16 or F16.
  const void* k_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const void* v_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* indices = nullptr;      // [batch, num_kv_heads, k] int32 positions; -1 = padding (zero row).
  void* packed_k = nullptr;              // [batch, num_kv_heads, k, head_dim] dtype.
  void* packed_v = nullptr;              // [batch, num_kv_heads, k, head_dim] dtype.
  int k = 0;
};

cudaError_t gather_kv(const GatherKvParams& p, cudaStream_t stream);

/// The cache rank's query windows: push_query_window_ref's rule (kernels/query_window_ref.h) on the device, one CTA
/// per row; the elements are moved as 16-bit words (no conversion).
struct PushQueryWindowParams {
  DType dtype = DType::BF16;            // BF16 or F16: windows and q.
  void* windows = nullptr;              // [num_windows, num_heads, capacity, head_dim] dtype in/out, oldest first.
  int32_t* window_len = nullptr;        // [num_windows] int32 in/out.
  const int32_t* window_idx = nullptr;  // [rows] int32 window of row r (distinct; outside [0, num_windows): skipped).
  const void* q = nullptr;              // [tokens, num_heads, head_dim] dtype.
  const int32_t* cu_tokens = nullptr;   // [rows + 1] int32 token ranges of the rows in q.
  const int32_t* reset = nullptr;       // optional [rows] int32: non-zero empties the window first.
  int num_windows = 0;
  int rows = 0;                         // >= 0 (0: nothing is launched)
  int num_heads = 0;
  int capacity = 0;                     // 1..max(kMaxPredictorWindow + 1, kMaxAnchorWindow)
  int head_dim = 0;                     // even
};

cudaError_t push_query_window(const PushQueryWindowParams& p, cudaStream_t stream);

/// Prompt anchors on the device (select_anchors_ref's rule, kernels/selection_ref.h "Prompt anchors"), for a batch of
/// sequences whose last queries sit in anchor windows (push_query_window with capacity <= kMaxAnchorWindow): row b
/// reads entries 0..nq-1 of window window_idx[b], nq = min(num_queries[b], window_capacity, context_len[b]), entry i
/// being the query at position context_len[b] - nq + i (its causal context: keys 0..that position); anchors are taken
/// from [begin, end), end = min(max(begin, context_len[b] - max(local_window, nq)), context_len[b]). Writes kMaxAnchors
/// int32 (best first, -1 padding) per (b, KV head) to row anchor_rows[b][kvh] of `anchors`; a row with nq == 0 (or a
/// window index outside [0, num_windows)) is left as it is. Two kernels on `stream`: one CTA per (anchor query,
/// KV head, sequence) finds that query's candidates (probability >= kAnchorMinMass) into `workspace`, then one CTA per
/// (KV head, sequence) makes the greedy picks. The softmax in fp32 (the reference's in fp64), so a probability within
/// ~1e-6 of kAnchorMinMass, or two within ~1e-6 of each other, may decide differently. Cost: each anchor query reads
/// its whole causal context twice (once at a sequence's switch). Errors (cudaErrorInvalidValue, detail in
/// launch_error_detail()): a pointer unset, workspace_bytes < select_anchors_workspace_bytes(...), a size out of range.
struct SelectAnchorsParams : PagedAttentionShape {
  DType dtype = DType::BF16;             // BF16 or F16: k_cache and windows.
  const void* windows = nullptr;         // [num_windows, num_q_heads, window_capacity, head_dim] dtype, oldest first.
  const int32_t* window_idx = nullptr;   // [batch] int32 window of each sequence.
  const int32_t* num_queries = nullptr;  // [batch] int32 valid window entries (0: the row is skipped).
  const int32_t* context_len = nullptr;  // [batch] int32 tokens in the cache (the last window entry is the last one's).
  const void* k_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* anchor_rows = nullptr;  // [batch, num_kv_heads] int32 row of `anchors` each (b, KV head) writes.
  int32_t* anchors = nullptr;            // [*, kMaxAnchors] int32 out.
  int num_windows = 0;
  int window_capacity = 0;               // 1..kMaxAnchorWindow
  int begin = 0;                         // first position an anchor may take (the CPU cache rank: max(sinks, span))
  int local_window = 0;                  // R
  int span = 1;                          // >= 1: anchors of one KV head are at least `span` apart
  void* workspace = nullptr;             // device scratch of workspace_bytes, 4-byte aligned; nothing kept in it
  size_t workspace_bytes = 0;            // >= select_anchors_workspace_bytes(batch, hq, hkv, window_capacity)
};

cudaError_t select_anchors(const SelectAnchorsParams& p, cudaStream_t stream);

/// Device scratch (bytes) select_anchors needs: per (sequence, KV head, anchor query) a count and up to
/// 10 * (num_q_heads / num_kv_heads) candidates (int32 position + fp32 probability). 0 for sizes out of range.
size_t select_anchors_workspace_bytes(int batch, int num_q_heads, int num_kv_heads, int window_capacity);

/// apply_anchor_spans_ref on the device: score row r (of rows = batch * rows_per_batch) takes the spans of anchors
/// row anchor_rows[r], with row_lens[r / rows_per_batch] scored columns.
struct ApplyAnchorSpansParams {
  float* scores = nullptr;               // [rows, score_stride] fp32 in/out.
  const int32_t* row_lens = nullptr;     // [rows / rows_per_batch] int32.
  const int32_t* anchors = nullptr;      // [*, kMaxAnchors] int32 (select_anchors').
  const int32_t* anchor_rows = nullptr;  // [rows] int32 anchors row of each score row.
  int rows = 0;
  int rows_per_batch = 1;                // e.g. num_kv_heads
  int score_stride = 0;
  int first_pos = 0;                     // position of column 0
  int span = 1;
  int budget = 0;                        // token budget k: the spans take at most k / 4 tokens
  bool successor = false;
};

cudaError_t apply_anchor_spans(const ApplyAnchorSpansParams& p, cudaStream_t stream);

/// Quest-style page selection with the TRUE query on the device, the synchronous page-level fidelity baseline:
/// quest_page_scores_ref then quest_pick_ref (kernels/selection_ref.h states the rule), as two kernels on `stream`: the
/// scoring (one warp per page column, a CTA per run of columns of a (sequence, KV head)) writes page_scores, then the
/// pick (one CTA per (sequence, KV head)) reads them back and writes indices. The page scores are fp32 sums over
/// head_dim in another order than the reference's (a score may differ by fp32 rounding, so two pages within ~1e-6 of
/// each other may rank differently); the pick given the written scores is the reference's exactly. A row with
/// num_tokens[b] <= begin gets -1 only. Errors (cudaErrorInvalidValue, detail in launch_error_detail()): a pointer
/// unset, k < 1, begin < 0, max_pages_per_seq > kMaxQuestPages, sizes out of range.
struct QuestSelectParams : PagedAttentionShape {
  DType dtype = DType::BF16;             // BF16 or F16: element type of k_cache.
  const float* q = nullptr;              // [batch, num_q_heads, head_dim] fp32 true queries (gather_query_rows).
  const void* k_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* num_tokens = nullptr;   // [batch] int32 end of the candidates (<= max_pages_per_seq * page_size).
  float* page_scores = nullptr;          // [batch, num_kv_heads, max_pages_per_seq] fp32 out (scratch; the columns
                                         // with a candidate are written, then read by the pick).
  int32_t* indices = nullptr;            // [batch, num_kv_heads, k] int32 out: ascending positions, -1 padding.
  // max_pages_per_seq (a PagedKvShape field): 1..kMaxQuestPages
  int k = 0;                             // >= 1 tokens per (sequence, KV head)
  int begin = 0;                         // first candidate position
  GqaScoreRule rule = GqaScoreRule::kMax;
  // Optional page summaries (quest_page_summaries, as Quest keeps them): [num_pages, 2, num_kv_heads, head_dim] dtype,
  // per page its keys' element-wise min then max. When set, a column whose page lies wholly inside the candidates
  // reads its summary (2 rows instead of page_size) and the partial columns at begin / num_tokens[b] read their keys:
  // the same min / max, so the same scores and pick as without. Every such page must be summarized after its last
  // token was written.
  const void* k_summary = nullptr;
};
/// Largest block-table row quest_select takes (its pick keeps one int32 per page in shared memory and one score key
/// per page in registers).
inline constexpr int kMaxQuestPages = 8192;
cudaError_t quest_select(const QuestSelectParams& p, cudaStream_t stream);

/// Quest's page summaries (quest_page_summaries_ref): for each sequence b, the full pages j of its block-table row in
/// [max(0, full - pages_back), full), full = num_tokens[b] / page_size, get k_summary[page] = the element-wise min and
/// max of the page's page_size keys per KV head. One warp per (page, KV head). A decode step calls it with
/// pages_back = 1 after appending (the page that just filled; an older one is unchanged), a prefill with the pages it
/// wrote. Errors (cudaErrorInvalidValue, detail in launch_error_detail()): a pointer unset, pages_back < 1, sizes out
/// of range. batch == 0 launches nothing.
struct QuestPageSummariesParams : PagedKvShape {
  DType dtype = DType::BF16;             // BF16 or F16: element type of k_cache and k_summary.
  const void* k_cache = nullptr;         // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* num_tokens = nullptr;   // [batch] int32 tokens written (<= max_pages_per_seq * page_size).
  void* k_summary = nullptr;             // [num_pages, 2, num_kv_heads, head_dim] dtype out (the pages named only).
  int pages_back = 1;                    // >= 1: the last full pages of each row to summarize
};
cudaError_t quest_page_summaries(const QuestPageSummariesParams& p, cudaStream_t stream);
/// out[b] = fp32(q[q_rows[b]]) per sequence b, one row of row_elems elements (e.g. a step's decode queries
/// [num_q_heads * head_dim] at their token rows, as the selection kernels' fp32 queries); q_rows[b] < 0 writes zeros.
/// q_rows == nullptr: row b. batch == 0 launches nothing.
struct GatherQueryRowsParams {
  DType dtype = DType::BF16;            // BF16 or F16: element type of q.
  const void* q = nullptr;              // [rows, row_elems] dtype, rows > every q_rows[b].
  const int32_t* q_rows = nullptr;      // optional [batch] int32.
  float* out = nullptr;                 // [batch, row_elems] fp32.
  int batch = 0;
  int row_elems = 0;                    // > 0
};
cudaError_t gather_query_rows(const GatherQueryRowsParams& p, cudaStream_t stream);
/// Largest token budget (slots per row) selection_delta supports.
inline constexpr int kMaxDeltaBudget = 4096;
/// Fields of selection_delta's `totals`: the sums of row_info's {n, E, m, holes} over the rows, then the number of
/// rows refused as corrupt.
inline constexpr int kDeltaTotalsFields = kDeltaInfoFields + 1;

/// Delta of each row's new selection against the mirror of the holder's slot table, with at most `capacity` entries
/// per row (selection_delta_ref's rule exactly, one CTA per row). The entries' positions are gather_kv's index rows
/// (k = capacity), so the cache rank sends rows x capacity K/V rows instead of rows x k. A row whose selection is
/// not "ascending, then -1", whose mirror is corrupt (a value below -1, or a token in two slots < n), or that
/// overflows with an entering position >= score_stride is refused on the device: row_info = {n, -1, 0, 0}, its
/// entries -1, its mirror unchanged, totals[kDeltaInfoFields] += 1. rows == 0 launches nothing.
struct SelectionDeltaParams {
  const int32_t* indices = nullptr;     // [rows, k] int32 topk_select output: ascending positions, then -1.
  const float* scores = nullptr;        // [rows, score_stride] fp32 topk_select's input; read for overflowing rows.
  int32_t* mirror = nullptr;            // [mirror rows, k] int32 in/out: position held in each slot, -1 empty.
  const int32_t* mirror_rows = nullptr; // optional [rows] int32: mirror row of row r (default r); must be distinct.
  int32_t* delta_slots = nullptr;       // [rows, capacity] int32 out: slot of entry j, -1 past the entries.
  int32_t* delta_positions = nullptr;   // [rows, capacity] int32 out: position of entry j, -1 past the entries.
  int32_t* row_info = nullptr;          // [rows, kDeltaInfoFields] int32 out: {n, E, m, holes} (E = -1: refused).
  unsigned long long* totals = nullptr; // optional [kDeltaTotalsFields] u64, accumulated (atomicAdd; zero it first).
  int rows = 0;          // >= 0
  int k = 0;             // slots per row, 1..kMaxDeltaBudget.
  int capacity = 0;      // entries per row, 1..k.
  int score_stride = 0;  // > every selected position (>= 1).
};

cudaError_t selection_delta(const SelectionDeltaParams& p, cudaStream_t stream);

/// The holder's side (apply_selection_delta_ref): copies every entry's K/V row into its slot of the holder's table,
/// which sparse_decode_attention_packed then reads as packed_k / packed_v (rows = [sequence][KV head] of one layer,
/// k = packed_capacity). Entries with a slot outside [0, k) are skipped.
struct ApplySelectionDeltaParams {
  DType dtype = DType::BF16;                 // BF16 or F16: element type of delta_k/v and held_k/v.
  const int32_t* delta_slots = nullptr;      // [rows, capacity] int32, -1 = no entry.
  const int32_t* delta_positions = nullptr;  // [rows, capacity] int32; read only when held_positions is set.
  const void* delta_k = nullptr;             // [rows, capacity, head_dim] dtype.
  const void* delta_v = nullptr;             // [rows, capacity, head_dim] dtype.
  void* held_k = nullptr;                    // [rows, k, head_dim] dtype in/out.
  void* held_v = nullptr;                    // [rows, k, head_dim] dtype in/out.
  int32_t* held_positions = nullptr;         // optional [held rows, k] int32 in/out.
  const int32_t* held_rows = nullptr;        // optional [rows] int32: held-table row of delta row r (default r;
                                             // negative: the row is skipped).
  int rows = 0;
  int k = 0;
  int capacity = 0;
  int head_dim = 0;  // any of kSupportedHeadDims.
};

cudaError_t apply_selection_delta(const ApplySelectionDeltaParams& p, cudaStream_t stream);

/// One-time setup of the selection kernels (predict, score, top-k) on the CURRENT device: their dynamic
/// shared-memory limits, otherwise set on first launch. Call it at start-up, before the cache rank posts any
/// receive (see prepare_decode_attention_kernels in kernels/attention.cuh for why). Idempotent and thread-safe.
/// Returns the first CUDA error.
cudaError_t prepare_selection_kernels();

}  // namespace spade::kernels

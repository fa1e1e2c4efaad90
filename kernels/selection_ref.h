// CPU reference of the cache rank's token selection (AsyncSpade, ../shared/papers/asyncspade-async-sparse-decoding.txt
// Sec. 4.2-4.3 and Appendix C Algorithm 1): next-query prediction, token scoring, exact top-k, gather.
//
// These functions are the oracle of the CUDA kernels in kernels/selection.cuh AND the CPU cache rank's
// implementation in the CPU build: batched, fp32 in/out (fp64 inside the predictor's solve), no framework types.
// All pointers are host pointers. Invalid parameters throw spade::Error naming the field.
//
// ---- Next-query predictor (predict_next_query_ref) ----
// Three predictors (PredictorKind). kPaper is Algorithm 1 as read below. kRidge (the default of the runtime) is the
// same nested ridge regressions and shifted application WITHOUT the softmax (the raw ridge coefficients weight the
// shifted window) and with eps RELATIVE to the regressors' scale: eps' = eps * (1/m) sum_{i=1..m} |Q_{t-i}|^2, one
// eps' for every window size (so the Gram matrices stay nested leading blocks). Why: the softmax is taken over ridge
// coefficients of magnitude ~0.2, so it is nearly uniform and turns the prediction into a moving average of the last
// W queries that drifts toward the head's mean as W grows; and an absolute eps of 1e-3 against |q|^2 ~ 1e2 is no
// regularisation once the softmax is gone (docs/FIDELITY.md has the measurements). kLastQuery returns Q_t (no
// prediction: the one-step-stale true query).
// Per (sequence, head) the window holds the n most recent query states, oldest first: slot n-1 is the current
// query Q_t, slot n-1-i is Q_{t-i}. With m = min(n - 1, W) regressors, for every window size k = 1..m:
//   1. regressors Q_{t-1}, ..., Q_{t-k} (the k queries before Q_t), target Q_t;
//   2. ridge regression in closed form: omega = (H H^T + eps I)^{-1} H Q_t, H = [Q_{t-1}; ...; Q_{t-k}] (k x D)
//      (Algorithm 1 lines 14-16; Gram and solve in fp64, Cholesky);
//   3. softmax normalisation: w = softmax(omega) (Eq. 3);
//   4. single-token shift (Eq. 4): the weight of regressor Q_{t-i} is applied to its successor Q_{t+1-i}:
//      Qhat^(k)_{t+1} = sum_{i=1..k} w_{t-i} Q_{t+1-i};
// then average pooling over the m candidates (Eq. 5): Qhat_{t+1} = (1/m) sum_k Qhat^(k)_{t+1}.
// Edge cases: n == 1 -> Qhat = Q_t (no regression possible); n == 0 -> zeros. If the Cholesky factorisation of
// window size k fails (non-positive pivot, only possible for eps ~ 0), window sizes >= k are dropped (m = k - 1).
// Reading of the paper (ambiguities resolved as stated):
//   * Eq. 2 places the softmax inside the least-squares objective (no closed form); Algorithm 1 solves the plain
//     ridge problem in closed form and applies the softmax afterwards. We implement Algorithm 1's closed form.
//   * Algorithm 1 line 16 writes softmax(-G^{-1} b); the minus sign would give the LARGEST weight to the regressor
//     with the most negative ridge coefficient, contradicting Eq. 3 and Sec. 4.2 (omega "reflects its
//     contribution"). We use softmax(+omega).
//   * Algorithm 1 solves one ridge problem on the W-1 oldest window entries, then builds each window size's weights
//     by masking that single solution (multiplying by a 0/1 mask before a softmax, which would leak weight to masked
//     entries), and indexes Q_cache[-1-j:-1] (which leaves the current query out of the "shifted" window). Sec. 4.2
//     states instead one ridge regression per window size on the k most recent predecessors of Q_t, with the
//     weights applied to the one-token-shifted window that ends at Q_t. We implement Sec. 4.2 (one solve per k);
//     the CUDA kernel shares one Cholesky factor across k (the Gram matrices are nested leading blocks when the
//     regressors are ordered newest first), which is the same math.
//   * kPaper: eps is absolute (added to the Gram diagonal as in Algorithm 1 line 14), not scaled by the query norms.
//
// ---- Scoring (score_tokens_ref) ----
// score[b][kvh][t] = combine_{h in GQA group of kvh} ( qhat[b][h] . K[b][t][kvh] ) for t < num_tokens[b], raw dot
// products (no 1/sqrt(D): ranking only). GQA rule (the paper's Fig. 8 computes the group's logits as one GEMM but
// does not say how a KV head's selection combines them): kMax = max over the group's query heads (a token is kept if
// any head of the group wants it), kMean = mean over the group (equivalent to scoring with the mean query).
// To keep the local window out of the selection, pass num_tokens = seq_len - local_window.
//
// Compact scoring keys (ScoreKeys::kInt8, the GPU cache rank's --score-keys int8): the scoring reads an int8 copy of
// the keys instead of the cache's bf16 keys (half the bytes), written when keys are appended; the K/V that is gathered
// and sent stays the cache's, exact. Per (cache row, KV head): scale = max_d |K[d]| / 127 (fp32 division), and
// k_int8[d] = round_half_even(K[d] / scale) clamped to [-127, 127]; an all-zero row has scale 0 and k_int8 0
// (quantize_keys_ref). Its scores are score_tokens_ref's on the dequantised keys k_int8[d] * scale
// (dequantize_keys_ref); the CUDA kernel's bound against them is in kernels/selection.cuh (ScoreTokensParams).
//
// ---- Top-k (topk_ref) ----
// For each row r (sequence b = r / rows_per_batch) over its first n = row_lens[b] scores: the k best by
// (topk_key(score) descending, position ascending), i.e. ties at the threshold go to the EARLIER positions; output
// sorted by position ascending; if n <= k all n positions are returned and the rest of the row is -1.
// topk_key maps fp32 to an order-preserving uint32 (-0.0 < +0.0; every NaN ranks lowest, as key 0).
// Successor expansion (TopkRefParams::successor): entry i > 0 of a row ranks by max(key(s[i]), key(s[i-1])), entry 0
// by its own key — a token whose predecessor scores high is selected with it. A retrieval / induction head that read
// position p at step t reads p + 1 at step t + 1, with a query that depends on the token sampled at t, which the
// cache rank never sees; a one-step-stale token-level selection misses p + 1, page-level selection gets it for free.
//
// ---- Prompt anchors (select_anchors_ref) ----
// A retrieval head can fire at one decode step out of nowhere: on longctx-22m the head that reads a pass key puts
// ~0 attention on the needle at every reply step before the key and 0.9 at the step that writes its first digit, a
// jump no query of earlier steps predicts (docs/FIDELITY.md). The same head read the needle line while the PROMPT's
// question was prefilled. So at the switch to sparse decoding the cache rank takes the prompt's last queries (up to
// SelectionConfig::anchor_queries), and per KV head keeps as anchors the candidate tokens that some query head of
// its group attended most (softmax probability over the query's causal context, scale 1/sqrt(head_dim)): best first,
// at least kAnchorMinMass, at most kMaxAnchors, each at least `span` positions from the ones kept before, from the
// range [begin, end) the caller gives (the Selector leaves out the first `span` tokens — attention sinks, which the
// prediction keeps anyway — and the anchor queries' own recent span). Each predicted selection then holds
// [a, a + span) of its best anchors (up to a quarter of its budget, Selector).
//
// ---- Gather (gather_kv_ref) ----
// packed_k[b][kvh][i] = K[b][indices[b][kvh][i]][kvh] (likewise V) for i < k; index -1 gives a zero row.
//
// ---- Quest page selection (quest_page_scores_ref, quest_pick_ref) ----
// The synchronous page-level baseline (Quest: Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context
// LLM Inference", ICML 2024, Sec. 3.2-3.3): each page keeps the element-wise min and max of its keys, an upper bound
// of q . k over the page scored with the TRUE current query, and the best pages are attended whole. Per (sequence b,
// KV head h), over the candidate positions [begin, end_b), end_b = num_tokens[b]: block-table column j covers
// [max(begin, j P), min(end_b, (j + 1) P)) (P = page_size); a column with a candidate scores
//   combine_{query heads g of h's GQA group} sum_d max(q_g[d] * min_d, q_g[d] * max_d)
// (min / max over its candidate keys; combine: the GQA rule, kMax = max, kMean = the running sum of score / group in
// head order). The pick takes pages best first (score descending, ties: the earlier page), whole, until k tokens are
// taken (the last page taken is cut to its first tokens), and writes the positions ascending, -1 after the last.
// The summaries as Quest keeps them (quest_page_summaries_ref): per full page, min then max of its keys per KV head,
// so that a step reads 2 rows per page instead of page_size; a page wholly inside the candidates scores the same
// from its summary as from its keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/paged_shape.h"

namespace spade::kernels {

/// Most regressors (window sizes) of the predictor; the window buffer holds up to kMaxPredictorWindow + 1 queries.
inline constexpr int kMaxPredictorWindow = 32;

/// How the next query is predicted from the query window (see the header comment).
enum class PredictorKind : uint8_t { kRidge = 0, kPaper = 1, kLastQuery = 2 };
/// "ridge" | "paper" | "last"; throws spade::Error listing them otherwise.
PredictorKind parse_predictor_kind(const char* s);
const char* predictor_kind_name(PredictorKind k);

/// How a KV head combines the scores of its GQA group's query heads (see the header comment).
enum class GqaScoreRule : uint8_t { kMax = 0, kMean = 1 };

/// Which keys the scoring reads (see the header comment, "Compact scoring keys"): the cache's own (kBf16) or the int8
/// copy with one fp32 scale per (token, KV head) (kInt8).
enum class ScoreKeys : uint8_t { kBf16 = 0, kInt8 = 1 };
/// "bf16" | "int8"; throws spade::Error listing them otherwise.
ScoreKeys parse_score_keys(const char* s);
const char* score_keys_name(ScoreKeys k);

struct PredictQueryRefParams {
  const float* window = nullptr;         // [batch, num_heads, window_capacity, head_dim] fp32, oldest first.
  const int32_t* window_len = nullptr;   // [batch] valid slots (0..window_capacity); slot window_len-1 is Q_t.
  float* q_hat = nullptr;                // [batch, num_heads, head_dim] fp32 output.
  int batch = 0;
  int num_heads = 0;
  int window_capacity = 0;               // 1..kMaxPredictorWindow + 1.
  int head_dim = 0;
  int max_regressors = kMaxPredictorWindow;  // W in 1..kMaxPredictorWindow.
  float eps = 0.f;                       // ridge epsilon, > 0 (absolute for kPaper, relative for kRidge).
  PredictorKind kind = PredictorKind::kRidge;
};

/// AsyncSpade next-query prediction (see the header comment for the exact math).
void predict_next_query_ref(const PredictQueryRefParams& p);

struct ScoreTokensRefParams : PagedAttentionShape {
  const float* q_hat = nullptr;          // [batch, num_q_heads, head_dim] fp32.
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* num_tokens = nullptr;   // [batch] positions scored, 0..score_stride.
  float* scores = nullptr;               // [batch, num_kv_heads, score_stride] fp32; entries >= num_tokens untouched.
  int score_stride = 0;
  GqaScoreRule rule = GqaScoreRule::kMax;
};

/// Scores every candidate token of every (sequence, KV head) with the group's predicted queries.
void score_tokens_ref(const ScoreTokensRefParams& p);

struct TopkRefParams {
  const float* scores = nullptr;      // [batch * rows_per_batch, score_stride] fp32.
  const int32_t* row_lens = nullptr;  // [batch] valid entries per row of that sequence (0..score_stride).
  int32_t* indices = nullptr;         // [batch * rows_per_batch, k] int32 output, ascending positions, -1 padding.
  int32_t* counts = nullptr;          // optional [batch * rows_per_batch] int32 output: min(k, row_len).
  int batch = 0;
  int rows_per_batch = 0;
  int score_stride = 0;
  int k = 0;                          // >= 1.
  bool successor = false;             // successor expansion (see the header comment)
};

/// Exact top-k per row with the documented tie rule.
void topk_ref(const TopkRefParams& p);

struct GatherKvRefParams : PagedKvShape {
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const float* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* indices = nullptr;      // [batch, num_kv_heads, k] int32 positions, -1 = padding.
  float* packed_k = nullptr;             // [batch, num_kv_heads, k, head_dim] fp32 output.
  float* packed_v = nullptr;             // [batch, num_kv_heads, k, head_dim] fp32 output.
  int k = 0;
};

/// Copies the selected K/V rows into the packed layout the sparse decode reads.
void gather_kv_ref(const GatherKvRefParams& p);

struct QuantizeKeysRefParams {
  const float* k = nullptr;   // [rows, head_dim] fp32 keys (a row: one token's KV head).
  int8_t* k_int8 = nullptr;   // [rows, head_dim] int8 output.
  float* k_scale = nullptr;   // [rows] fp32 output.
  size_t rows = 0;
  int head_dim = 0;           // > 0
};

/// The compact scoring copy of `rows` key rows (see the header comment: absmax / 127 per row, round half to even).
/// A non-finite key gives a non-finite scale (the row then scores NaN, which ranks lowest).
void quantize_keys_ref(const QuantizeKeysRefParams& p);

/// k[r][d] = k_int8[r][d] * k_scale[r] (fp32): the keys the int8 scoring scores with. Same params (k written).
void dequantize_keys_ref(const int8_t* k_int8, const float* k_scale, size_t rows, int head_dim, float* k);

/// Anchors per KV head at most, and the attention probability an anchor needs (see the header comment).
inline constexpr int kMaxAnchors = 8;
inline constexpr float kAnchorMinMass = 0.1f;

struct SelectAnchorsRefParams {
  const float* queries = nullptr;        // [num_queries, num_q_heads, head_dim] fp32, query i at position first_pos + i.
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32, one sequence.
  const int32_t* block_table = nullptr;  // [max_pages_per_seq] int32.
  int32_t* anchors = nullptr;            // [num_kv_heads, kMaxAnchors] int32 output, best first, -1 padding.
  int num_queries = 0;
  int first_pos = 0;                     // the keys [0, first_pos + i] are query i's context.
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 0;
  int max_pages_per_seq = 0;
  int begin = 0, end = 0;                // anchors are taken from the positions [begin, end).
  int span = 1;                          // >= 1: anchors of one head are at least `span` apart.
};

/// The prompt anchors of one sequence (see the header comment).
void select_anchors_ref(const SelectAnchorsRefParams& p);

/// Most anchor queries a query window holds (the GPU cache rank's anchor windows, push_query_window's capacity).
inline constexpr int kMaxAnchorWindow = 64;

/// The positions of the anchor spans of one score row, in the order they are taken: [a, a + span) of the row's
/// anchors best first, as many whole spans as fit in a quarter of `budget` (a span costs `span` tokens, one more with
/// successor expansion, whose successor inherits the span's +inf), clipped to the scored positions
/// [first_pos, first_pos + row_len). anchors: [kMaxAnchors] int32, best first, -1 padding. Throws spade::Error for a
/// span < 1 or a negative budget / row_len.
std::vector<int32_t> anchor_span_positions(const int32_t* anchors, int span, int budget, bool successor, int first_pos,
                                           int row_len);

struct ApplyAnchorSpansRefParams {
  float* scores = nullptr;               // [rows, score_stride] fp32 in/out; column c scores position first_pos + c.
  const int32_t* row_lens = nullptr;     // [rows] int32 scored columns of each row.
  const int32_t* anchors = nullptr;      // [rows, kMaxAnchors] int32 (select_anchors_ref's, per row), -1 padding.
  int rows = 0;
  int score_stride = 0;
  int first_pos = 0;                     // position of column 0 (the CPU cache rank: its sink tokens; the GPU: 0).
  int span = 1;                          // >= 1
  int budget = 0;                        // the row's token budget k (the spans take at most k / 4)
  bool successor = false;                // successor expansion in the top-k that follows
};

/// Sets the scores of every anchor_span_positions() of each row to +inf, so the top-k that follows keeps them (the
/// prompt anchors of a predicted selection; see the header comment).
void apply_anchor_spans_ref(const ApplyAnchorSpansRefParams& p);

struct QuestPageScoresRefParams : PagedAttentionShape {
  const float* q = nullptr;              // [batch, num_q_heads, head_dim] fp32: the true current queries.
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* num_tokens = nullptr;   // [batch] int32 end of the candidates, 0..max_pages_per_seq * page_size.
  float* page_scores = nullptr;          // [batch, num_kv_heads, max_pages_per_seq] fp32 out: the columns with a
                                         // candidate are written, the others untouched.
  int begin = 0;                         // first candidate position (the sink tokens are not candidates)
  GqaScoreRule rule = GqaScoreRule::kMax;
};

/// Quest's page scores with the true query (see the header comment). Throws spade::Error naming a bad field.
void quest_page_scores_ref(const QuestPageScoresRefParams& p);

struct QuestPageSummariesRefParams : PagedKvShape {
  const float* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] fp32.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32.
  const int32_t* num_tokens = nullptr;   // [batch] int32 tokens written, 0..max_pages_per_seq * page_size.
  float* k_summary = nullptr;            // [num_pages, 2, num_kv_heads, head_dim] fp32 out: the pages named only.
  int pages_back = 1;                    // the last full pages of each row, >= 1
};

/// For each row b, the full pages j in [max(0, full - pages_back), full), full = num_tokens[b] / page_size: the
/// element-wise min (k_summary[page][0]) and max ([page][1]) of the page's keys per KV head. Throws spade::Error
/// naming a bad field.
void quest_page_summaries_ref(const QuestPageSummariesRefParams& p);

struct QuestPickRefParams {
  const float* page_scores = nullptr;   // [batch, num_kv_heads, max_pages_per_seq] fp32 (quest_page_scores_ref's).
  const int32_t* num_tokens = nullptr;  // [batch] int32 end of the candidates (as scored).
  int32_t* indices = nullptr;           // [batch, num_kv_heads, k] int32 out: ascending positions, -1 padding.
  int batch = 0;
  int num_kv_heads = 0;
  int page_size = 0;
  int max_pages_per_seq = 0;
  int k = 0;                            // >= 1 tokens per (sequence, KV head)
  int begin = 0;                        // as scored
};

/// Quest's pick: whole pages, best first, up to k tokens (see the header comment). Throws spade::Error naming a bad
/// field.
void quest_pick_ref(const QuestPickRefParams& p);

/// Order-preserving map fp32 -> uint32 used by the top-k (larger float -> larger key; NaN -> 0).
uint32_t topk_key(float x);

}  // namespace spade::kernels

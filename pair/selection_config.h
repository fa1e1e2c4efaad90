// The sparse-decoding settings an inference rank and its cache rank share (AsyncSpade Sec. 4.1-4.2, Algorithm 1):
// the selection (SelectionConfig) and how the pair runs it (SparseConfig), and the selection of one (sequence, layer)
// as both ranks hold it. Every setting is declared once here, with its default; the command line is parsed into a
// SparseConfig once per binary (pair/selection_flags.h) and the config is passed by reference into the rank-side
// options (inference_rank/sparse_attention.h SparseOptions, inference_rank/sparse_planner.h GpuSparseOptions,
// cache_rank/gpu_server.h GpuCacheOptions), which add only limits and names. On the wire the pair hello
// (pair/gpu_plan.h) and the CPU pack shape (pair/pack.h) carry their own copies of the fields the peer needs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/selection_ref.h"

namespace spade::pair {

/// Most prompt queries shipped at the switch (pair/pack.cpp checks the same bound on the wire).
inline constexpr int kMaxAnchorQueries = 64;
static_assert(kMaxAnchorQueries <= kernels::kMaxAnchorWindow, "the GPU cache rank's anchor windows hold them all");

struct SelectionConfig {
  int token_budget = 256;  // k: tokens selected per (sequence, layer, KV head)
  int local_window = 32;   // R: most recent tokens the inference rank attends from its own KV
  // S: first tokens the inference rank attends from its own KV. 0 by default on both paths: the GPU path has no sink
  // tokens (they compete in the top-k), and on the CPU path 0 and 4 answered the same pass-key prompts
  // (docs/FIDELITY.md).
  int sink_tokens = 0;
  int query_window = 8;    // W: predictor regressors (window sizes 1..W), 1..kernels::kMaxPredictorWindow
  // ε added to the Gram diagonal: relative to the regressors' mean squared norm for the ridge predictor, absolute
  // for the paper's (kernels/selection_ref.h).
  float ridge_eps = 1e-2f;
  kernels::GqaScoreRule gqa_rule = kernels::GqaScoreRule::kMax;
  kernels::PredictorKind predictor = kernels::PredictorKind::kRidge;
  bool successor_expand = true;  // a token ranks by max(own score, predecessor's score) (kernels/selection_ref.h)
  // Prompt anchors (kernels/selection_ref.h select_anchors_ref): the prompt's last `anchor_queries` queries (CPU
  // pair: shipped with the INIT at the switch to sparse decoding; GPU pair: kept by the cache rank from the rows it
  // receives) pick per KV head up to kernels::kMaxAnchors tokens they attended most; each predicted selection holds
  // [a, a + anchor_span) of the best ones, within a quarter of its budget. 0 = off (the earlier default); at most
  // kMaxAnchorQueries (the pack's limit on shipped queries, the GPU cache rank's anchor-window capacity).
  int anchor_queries = 64;
  int anchor_span = 16;
  // GPU cache rank only: the keys its scoring reads, the cache's bf16 keys or a compact int8 copy with one fp32 scale
  // per (token, KV head) written on append (kernels/selection_ref.h, "Compact scoring keys"). The K/V it gathers and
  // sends stays bf16 and exact either way; int8 reads about half the bytes per step and costs 26 % more memory per
  // page at head_dim 128 (cache_rank/gpu_server.h gpu_cache_page_bytes). The cache rank's own setting (not in the
  // pair hello). int8 by default: on longctx-7m it answered the same pass-key prompts as bf16 at budgets 1/16 and
  // 1/32, in a shorter cache-rank step (measured in bench/results/score_keys-*).
  kernels::ScoreKeys score_keys = kernels::ScoreKeys::kInt8;
};

/// Throws spade::Error naming the field when a value is out of range.
void validate(const SelectionConfig& c);

/// The sparse-decoding settings of an inference rank and its cache rank: the selection, and when and in which pieces
/// the inference rank hands its sequences to the cache rank. Not every setting applies to every rank and device; a
/// rank refuses by name the flags it would ignore (inference_rank/rank_flags.cpp, cache_rank/rank_flags.cpp).
struct SparseConfig {
  SelectionConfig selection;
  int sparse_threshold = 256;  // context length (tokens) at which a sequence switches to sparse decoding (>= 1)
  int layers_per_pack = 4;     // P: consecutive layers per pack message (>= 1)
  // C, GPU pair only: selection entries a steady step may change per (layer, KV head); a token that enters beyond C
  // is sent at a later step (the held table lags). 0 (the default) = half the budget, rounded up; C >= the budget =
  // the budget, lossless by construction (effective_delta_capacity). Half the budget is where a trained model's
  // churn (about a third of the selection enters per step) puts a lossless delta; smaller C costs bits per token
  // (measured in docs/FIDELITY.md, "Delta capacity at the measured churn").
  int delta_capacity = 0;
  // CPU cache rank only: send only the tokens that entered each selection, with the slot they replace (pair/delta.h);
  // the inference rank's output is bit-identical to a full transfer. The GPU pair always sends deltas (capacity C).
  bool delta_transfer = true;
  // The cache rank's: every N-th step it measures its predicted selections against the top-k of the true query
  // (the overlap ratio, AsyncSpade Eq. 1, per layer and KV head) and the selection churn (0 = off). CPU cache rank:
  // cache_rank/pack_server.h OverlapSampler (churn only at N = 1); GPU cache rank: GpuCacheServer (both, at every
  // sampled step; cache_rank/gpu_server.h). One extra scoring pass per sampled step.
  int overlap_sample_every = 16;
  // GPU inference rank only: sequences that may switch to sparse decoding in one step (>= 1). A switching sequence
  // asks for a first selection, a full-budget message per (layer, KV head) instead of a delta of C entries, so this
  // bounds the extra bytes and cache-rank work of one step. Not a flag. The held tables (GpuSparseOptions::
  // max_sparse_seqs) bound the switches of a step too.
  int max_first_per_step = 4;

  /// The delta capacity the GPU pair runs with (1..token_budget for a valid config): delta_capacity, ceil(budget / 2)
  /// when it is 0, the budget when it is above the budget.
  int effective_delta_capacity() const {
    if (delta_capacity <= 0) return (selection.token_budget + 1) / 2;
    return std::min(delta_capacity, selection.token_budget);
  }
};

/// validate(c.selection), then the pair's own settings. Throws spade::Error naming the field when a value is out of
/// range.
void validate(const SparseConfig& c);

/// The selection of one (sequence, layer): `count` positions per KV head (ascending; the same count for every head),
/// padded to the budget with -1 / zero rows.
struct LayerSelection {
  int count = 0;
  std::vector<int32_t> positions;  // [num_kv_heads, token_budget]
  std::vector<float> k;            // [num_kv_heads, token_budget, head_dim]
  std::vector<float> v;            // [num_kv_heads, token_budget, head_dim]
};

}  // namespace spade::pair

// Pieces of bench_tpot (bench/bench_tpot.cpp) that its single-GPU modes (dense, oracle) and the async pipeline
// share: the command-line options (Opts), TPOT statistics, CUDA event timing, the copy-bandwidth probe, the run's
// sequence plan (Plan), sparse attention over a packed selection, the selection stages (Selector) and the result row.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "bench/churn_search.h"
#include "common/config.h"
#include "common/dtype.h"
#include "common/error.h"
#include "inference_rank/gpu_model.h"
#include "kernels/attention.cuh"
#include "kernels/device.h"
#include "kernels/selection.cuh"
#include "kernels/tensor_ops.cuh"
#include "pair/selection_config.h"
#include "transport/link_factory.h"

namespace spade::tpot {

using json = nlohmann::json;

struct Opts {
  std::string config;
  std::string label;
  std::string out;
  std::string modes = "dense,oracle,quest,async";
  std::vector<int> packs = {4, 6, 12};
  int batch = 8;
  int context = 32768;
  int steps = 256;
  int warmup = 16;
  int page_size = 16;
  // The selection (pair::SelectionConfig, its defaults: local window, query window W, predictor, ridge eps,
  // successor expansion; sink tokens unused) with this benchmark's token budget, 2048 (--budget).
  pair::SelectionConfig selection = [] {
    pair::SelectionConfig s;
    s.token_budget = 2048;
    return s;
  }();
  int budget() const { return selection.token_budget; }  // k
  int local_window() const { return selection.local_window; }  // R
  uint64_t seed = 1;
  // CTAs (channels) NCCL may use for the selected-KV communicator (down; the qkv one, up, takes one): each holds an SM
  // of BOTH GPUs for the whole transfer. Full transfer (--nccl-ctas) and delta transfer (--nccl-ctas-delta) default
  // to the serving path's (transport::LinkOptions::nccl_max_ctas_down). At a trained model's churn (--churn 0.31)
  // the delta message at capacity k/2 is half a full transfer; 8 channels then stalled the inference rank on most packs
  // at 8B B8 32k and 16 or 32 did not (bench/results/bench_tpot-h100x2-20261128-churn.txt). 0 = NCCL's default.
  int nccl_ctas = transport::LinkOptions{}.nccl_max_ctas_down;
  int nccl_ctas_delta = transport::LinkOptions{}.nccl_max_ctas_down;
  // Delta transfer (kernels/selection_delta_ref.h): entries per (layer, sequence, KV head) row of each step's
  // message; 0 = the full selection every step. One async run per (pack size, capacity).
  std::vector<int> delta_capacities = {0};
  // The keys the async cache rank scores with (pair::SelectionConfig::score_keys): one async run per entry, the
  // run's value in selection.score_keys. int8: the compact copy, quantized from the pool at start and on every append.
  std::vector<kernels::ScoreKeys> score_keys = {kernels::ScoreKeys::kBf16};
  // auto: NCCL with two GPUs, else CUDA IPC on GPU 0; nccl; ipc; ipc-peer: CUDA IPC between GPU 0 and GPU 1
  std::string link = "auto";
  bool ipc_peer() const { return link == "ipc-peer"; }
  // Async inference rank: steps from the second on replay a CUDA graph per receive-buffer parity (captured before
  // the cache rank starts), with the pack waits / pack ends as external event nodes and the sends enqueued after
  // the launch, as the serving path does (inference_rank/gpu_sparse.h). 0: every step eagerly.
  bool async_graphs = true;
  // Cache rank streams: 3 pipelines the packs' selections (append + predict | score | top-k + delta + gather, the
  // last at high priority, scratch double-buffered), so the latency-bound stages of one pack run beside the
  // bandwidth-bound scoring of the next; 1 runs every stage of every pack in order on one stream.
  int cache_streams = 3;
  // Cache ranks of the async pipeline (one inference rank over N cache ranks): N = 1 is the pair; N > 1 puts cache
  // rank s on GPU 1 + s, layer pack p on cache rank p mod N (pair::shard_of_pack, the serving map) and each cache rank
  // holds the KV and does the selection of its packs' layers only. One async run per entry.
  std::vector<int> cache_ranks = {1};
  bool cache_ranks_set = false;  // --cache-ranks given (refused with the modes it does not apply to)
  // Selection churn (--churn F, 0 < F < 1): the share of each steady selection that was not in the same row's
  // selection one step before. 0: the random model's own queries, nearly independent step to step (about 0.9 of
  // the selection enters per step). F > 0: the cache rank pushes q' = rho q'_prev + sqrt(1 - rho^2) q into its query
  // windows instead of q (an AR(1) process driven by the model's queries; the variance is kept), with rho searched
  // by one lossless delta run (capacity = budget) before the timed runs so that the measured churn is F
  // (churn_calibration_steps). The trained testbed's churn is in docs/FIDELITY.md (about 0.31 at budget 1/16).
  double churn = 0;
  double query_rho = 0;          // rho the cache ranks apply (the calibration's result; 0 = the model's queries)
  bool calibrate_churn = false;  // this run searches rho for `churn` over its warm-up steps
};

/// --churn: steps of each phase of the rho search (bench/churn_search.h): the windows turn over, then 4 steps of
/// selections are counted.
inline int churn_phase_steps(const Opts& o) { return o.selection.query_window + 4; }
/// Warm-up steps of the calibration run: every phase, then one phase at the rho found.
inline int churn_calibration_steps(const Opts& o) { return (kChurnPhases + 1) * churn_phase_steps(o); }

struct Stats {
  double median = 0, p99 = 0, mean = 0;
};
inline Stats stats(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, static_cast<size_t>(std::ceil(0.99 * v.size())) - 1)];
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  return s;
}

inline float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.f;
  cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  return ms;
}

/// A grid of timing events [rows][cols], created on the current device.
struct EventGrid {
  std::vector<cudaEvent_t> ev;
  int cols = 0;
  EventGrid(int rows, int c) : ev(static_cast<size_t>(rows) * c), cols(c) {
    for (auto& e : ev) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~EventGrid() {
    for (auto& e : ev) cudaEventDestroy(e);
  }
  cudaEvent_t operator()(int r, int c) const { return ev[static_cast<size_t>(r) * cols + c]; }
};

inline double measure_copy_gbps() {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer x(bytes, "copy src"), y(bytes, "copy dst");
  cuda_check(kernels::random_fill({DType::BF16, x.get(), bytes / 2, 7, 1.f, 0.f}, nullptr), "fill");
  cudaEvent_t e0, e1;
  cuda_check(cudaEventCreate(&e0), "event");
  cuda_check(cudaEventCreate(&e1), "event");
  std::vector<double> ms;
  for (int i = 0; i < 23; ++i) {
    cuda_check(cudaEventRecord(e0), "record");
    cuda_check(cudaMemcpyAsync(y.get(), x.get(), bytes, cudaMemcpyDeviceToDevice), "copy");
    cuda_check(cudaEventRecord(e1), "record");
    cuda_check(cudaEventSynchronize(e1), "sync");
    if (i >= 3) ms.push_back(elapsed_ms(e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * bytes / (stats(ms).median * 1e6);
}

/// Host-side description of the run's sequences: batch sequences at context `context` growing by one token per step,
/// pages of each sequence interleaved across the pool (seq b's i-th page = i * batch + b).
struct Plan {
  const Opts& o;
  const ModelConfig& cfg;
  int total_steps;  // warmup + steps
  int max_len;      // longest context of the run
  int max_pages;    // block-table width
  explicit Plan(const Opts& opts, const ModelConfig& c)
      : o(opts), cfg(c), total_steps(opts.warmup + opts.steps), max_len(opts.context + total_steps + 1),
        max_pages((max_len + opts.page_size - 1) / opts.page_size) {}
  int seq_len(int step) const { return o.context + step + 1; }  // context after step `step` (its token appended)
  /// Full block table (dense / oracle / cache rank): every page of every sequence.
  std::vector<int32_t> full_table() const {
    std::vector<int32_t> bt(static_cast<size_t>(o.batch) * max_pages);
    for (int b = 0; b < o.batch; ++b)
      for (int i = 0; i < max_pages; ++i) bt[static_cast<size_t>(b) * max_pages + i] = i * o.batch + b;
    return bt;
  }
  int full_pages() const { return max_pages * o.batch; }
  /// Window-only block table (the async inference rank): pages from the first local-window position of step 0 on,
  /// -1 before (never read or written by it).
  int first_window_page() const { return std::max(0, o.context + 1 - o.local_window()) / o.page_size; }
  std::vector<int32_t> window_table() const {
    const int first = first_window_page();
    std::vector<int32_t> bt(static_cast<size_t>(o.batch) * max_pages, -1);
    for (int b = 0; b < o.batch; ++b)
      for (int i = first; i < max_pages; ++i) bt[static_cast<size_t>(b) * max_pages + i] = (i - first) * o.batch + b;
    return bt;
  }
  int window_pages() const { return (max_pages - first_window_page()) * o.batch; }
  GpuStepHost step(int s, const std::vector<int32_t>& table) const {
    GpuStepHost h;
    const int B = o.batch;
    for (int b = 0; b < B; ++b) {
      h.tokens.push_back(static_cast<int32_t>((static_cast<uint64_t>(s) * 7919u + b * 104729u + 17u) % cfg.vocab_size));
      h.positions.push_back(seq_len(s) - 1);
      h.seq_idx.push_back(b);
      h.cu_q_lens.push_back(b);
      h.seq_lens.push_back(seq_len(s));
      h.logit_rows.push_back(b);
    }
    h.cu_q_lens.push_back(B);
    h.block_table = table;
    h.max_pages = max_pages;
    h.max_seq_len = max_len;
    return h;
  }
};

/// Sparse attention over a packed selection + the local window (attention.cuh sparse_decode_attention_packed).
inline void packed_attention(const ModelConfig& cfg, const Opts& o, const GpuLayerStep& s, const GpuBatch& b,
                             const void* packed_k, const void* packed_v, const int32_t* num_packed,
                             DeviceBuffer& ws, cudaStream_t stream) {
  kernels::SparsePackedDecodeParams p;
  fill_attention_params(p, cfg, s, b, o.page_size);
  p.packed_k = packed_k;
  p.packed_v = packed_v;
  p.num_packed = num_packed;
  p.packed_capacity = o.budget();
  p.local_window = o.local_window();
  p.workspace = {ws.get(), ws.bytes()};
  cuda_check(kernels::sparse_decode_attention_packed(p, stream), "sparse packed attention");
}

inline DeviceBuffer decode_workspace(const ModelConfig& cfg, int batch) {
  DeviceBuffer ws(kernels::decode_workspace_bytes(batch, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim),
                  "decode workspace");
  cuda_check(kernels::decode_workspace_init({ws.get(), ws.bytes()}, nullptr), "workspace init");
  return ws;
}

/// Selection of `rows` (layer, sequence) rows: score with fp32 queries, top-k per KV head, gather into packed K/V.
/// k_cache / v_cache are the pool bases and block_table addresses pages of the right layer (layer-batched rows).
struct Selector {
  const ModelConfig& cfg;
  const Opts& o;
  int max_rows, stride;
  DeviceBuffer scores, indices;
  Selector(const ModelConfig& c, const Opts& opts, int rows, int score_stride)
      : cfg(c), o(opts), max_rows(rows), stride(score_stride),
        scores(static_cast<size_t>(rows) * c.num_kv_heads * score_stride * 4, "selection scores"),
        indices(static_cast<size_t>(rows) * c.num_kv_heads * opts.budget() * 4, "selection indices") {}
  // The paged cache's geometry in a selection kernel's parameters `p`: `rows` rows of the model's KV heads, the page
  // size and block-table rows of `max_pages`.
  template <typename Params>
  void set_geometry(Params& p, int rows, int max_pages) const {
    p.batch = rows;
    p.num_kv_heads = cfg.num_kv_heads;
    p.head_dim = cfg.head_dim;
    p.page_size = o.page_size;
    p.max_pages_per_seq = max_pages;
  }
  // Scores and top-k of `rows` rows into `scores` / `indices` ([rows, Hkv, budget], ascending, -1 padded).
  // after_score: optional event recorded between the stages (stage timing).
  void score_topk(int rows, const float* q_hat, const void* k_cache, const int32_t* block_table, int max_pages,
                  const int32_t* sel_lens, cudaStream_t stream, cudaEvent_t after_score = nullptr) {
    score(rows, q_hat, k_cache, block_table, max_pages, sel_lens, stream);
    if (after_score != nullptr) cuda_check(cudaEventRecord(after_score, stream), "record");
    topk(rows, sel_lens, stream);
  }
  // k_int8 / k_scale: the compact keys (o.selection.score_keys int8), addressed as k_cache; null: k_cache's.
  void score(int rows, const float* q_hat, const void* k_cache, const int32_t* block_table, int max_pages,
             const int32_t* sel_lens, cudaStream_t stream, const int8_t* k_int8 = nullptr,
             const float* k_scale = nullptr) {
    kernels::ScoreTokensParams sp;
    sp.q_hat = q_hat;
    sp.k_cache = k_cache;
    if (k_int8 != nullptr) {
      sp.keys = kernels::ScoreKeys::kInt8;
      sp.k_int8 = k_int8;
      sp.k_scale = k_scale;
    }
    sp.block_table = block_table;
    sp.num_tokens = sel_lens;
    sp.scores = scores.as<float>();
    sp.num_q_heads = cfg.num_q_heads;
    set_geometry(sp, rows, max_pages);
    sp.score_stride = stride;
    cuda_check(kernels::score_tokens(sp, stream), "score_tokens");
  }
  void topk(int rows, const int32_t* sel_lens, cudaStream_t stream) {
    kernels::TopkParams tp;
    tp.scores = scores.as<float>();
    tp.row_lens = sel_lens;
    tp.indices = indices.as<int32_t>();
    tp.batch = rows;
    tp.rows_per_batch = cfg.num_kv_heads;
    tp.score_stride = stride;
    tp.k = o.budget();
    tp.successor = o.selection.successor_expand;
    cuda_check(kernels::topk_select(tp, stream), "topk_select");
  }
  // Gathers the K/V rows at `idx` ([rows, Hkv, k] positions, -1 = zero row) into packed [rows, Hkv, k, D].
  void gather(int rows, const int32_t* idx, int k, const void* k_cache, const void* v_cache,
              const int32_t* block_table, int max_pages, void* packed_k, void* packed_v, cudaStream_t stream) {
    kernels::GatherKvParams gp;
    gp.k_cache = k_cache;
    gp.v_cache = v_cache;
    gp.block_table = block_table;
    gp.indices = idx;
    gp.packed_k = packed_k;
    gp.packed_v = packed_v;
    set_geometry(gp, rows, max_pages);
    gp.k = k;
    cuda_check(kernels::gather_kv(gp, stream), "gather_kv");
  }
  // The full selection: score, top-k, gather of all `budget` tokens per (row, KV head).
  void run(int rows, const float* q_hat, const void* k_cache, const void* v_cache, const int32_t* block_table,
           int max_pages, const int32_t* sel_lens, void* packed_k, void* packed_v, cudaStream_t stream,
           cudaEvent_t after_score = nullptr, cudaEvent_t after_topk = nullptr) {
    score_topk(rows, q_hat, k_cache, block_table, max_pages, sel_lens, stream, after_score);
    if (after_topk != nullptr) cuda_check(cudaEventRecord(after_topk, stream), "record");
    gather(rows, indices.as<int32_t>(), o.budget(), k_cache, v_cache, block_table, max_pages, packed_k, packed_v,
           stream);
  }
};

inline json result_row(const Opts& o, const ModelConfig& cfg, const std::string& mode,
                        const std::vector<double>& tpot_ms) {
  const Stats s = stats(tpot_ms);
  json r;
  r["label"] = o.label;
  r["mode"] = mode;
  r["batch"] = o.batch;
  r["context"] = o.context;
  r["budget"] = o.budget();
  r["local_window"] = o.local_window();
  r["layers"] = cfg.num_layers;
  r["steps"] = static_cast<int>(tpot_ms.size());
  r["tpot_median_ms"] = s.median;
  r["tpot_p99_ms"] = s.p99;
  r["tpot_mean_ms"] = s.mean;
  return r;
}

// Bytes one decode step must read at least: KV of the attended tokens (K and V, every layer).
inline double kv_bytes(const ModelConfig& cfg, const Opts& o, double tokens_per_seq) {
  return 2.0 * cfg.num_layers * o.batch * cfg.num_kv_heads * cfg.head_dim * 2.0 * tokens_per_seq;
}

}  // namespace spade::tpot

// bench_tpot: decode TPOT of a real-shaped model (config.json + deterministic random bf16 weights on the GPU) in
// three modes, the issue-#7 benchmark:
//   dense   full paged attention on one GPU (our split-K flash-decoding), eager and CUDA graph;
//   oracle  synchronous token-level selection with the TRUE query on one GPU, inline in every layer (score every
//           key with q, top-k per KV head, gather, sparse attention over the selection + the local window):
//           Quest/TOVA-style selection with exact queries, the upper bound of inline selection;
//   async   AsyncSpade disaggregated over two GPUs (Algorithm 1, Sec. 4): GPU 0 runs the inference rank, GPU 1 the
//           cache rank, joined by NCCL point-to-point (NcclLink); on a one-GPU machine both ranks run on GPU 0 joined
//           by CudaIpcLink (checks the pipeline; its timing is not the disaggregated one). After each layer pack
//           the inference rank sends the pack's q | k | v rows, normed and rotated as it appended them (its q/k
//           norm + RoPE kernel writes them straight into the send buffer); the cache rank appends K/V, pushes the
//           query into its window, predicts the next query (ridge regression), scores every key, selects top-k per
//           KV head, gathers and sends the selected K/V for the NEXT step. The inference rank attends over what it
//           received plus its local window, which is all the KV it holds.
// Both ranks run in this process as two threads, one per GPU, with two NCCL communicators (up: qkv, down: selected
// KV) so that neither direction queues behind the other; no host synchronisation inside a step on either side
// (the inference thread waits once per step for the step's end event, as a server waits for the sampled tokens).
// async steps from the second on replay a CUDA graph per receive-buffer parity (--async-graphs 1, the default; 0:
// eager), captured before the cache rank starts: the pack waits and pack ends are external event nodes and the sends
// are enqueued after each launch, as on the serving path (inference_rank/gpu_sparse.h).
// async-delta: the same with delta transfer (--delta-capacity C): the cache rank mirrors the inference rank's slot
// tables and sends per (layer, sequence, KV head) only C entries (the tokens that entered the selection, the best
// scored first: kernels/selection.cuh selection_delta); the inference rank applies them to its slot tables on the
// receive stream (apply_selection_delta) and attends over the tables. The first selection goes in full.
//
// async over N cache ranks (--cache-ranks N, one issue-#22 run per entry): the inference rank on GPU 0, cache rank
// s on GPU 1 + s, one NCCL link pair each; layer pack p goes to cache rank p mod N (pair::shard_of_pack, the serving
// map) and each cache rank holds the KV of its packs' layers only, so N cache GPUs hold N times the KV. A cache rank
// whose KV does not fit its GPU gives a "skipped" row with the bytes it needs; so does a dense / oracle run whose KV
// outgrows GPU 0.
//
// solo: each rank of the async pipeline alone on GPU 0 with a null link (its peer never late, the link free): the
// inference rank's TPOT and the cache rank's time per step with the GPU to itself, and their max, the projection of
// the two-GPU TPOT that a one-GPU machine can give (a lower bound: the link's cost is left out).
// Reports per configuration: TPOT median / p99 / mean over the timed steps (time between consecutive step-end
// events, so host gaps count), the AsyncSpade Table-2 breakdown (inference time per pack, cache-management time per
// pack, bytes per step each way, required vs achieved link bandwidth), stalls (packs whose received KV arrived after
// the inference rank was ready for it, > 20 us), and the floor: (weight bytes + KV bytes the step must read) /
// measured copy bandwidth. Token ids of each step come from the host (random weights: content does not change the
// timing); the greedy argmax over the logits is inside the timed step.
//
// Usage: bench_tpot --config DIR [--batch 8] [--context 32768] [--budget 2048] [--packs 4,6,12] [--steps 256]
//                   [--modes dense,oracle,async,solo] [--nccl-ctas 16] [--nccl-ctas-delta 8] [--delta-capacity 0,256]
//                   [--link auto|nccl|ipc] [--async-graphs 1|0] [--cache-streams 3|1] [--score-keys bf16,int8]
//                   [--predictor ridge|paper|last] [--ridge-eps E] [--successor-expand 1|0] [--cache-ranks 1,2,3]
//                   [--label NAME] [--out results.json] (appends a JSON document per run).
// The selection's local window, query window, predictor, ridge eps and successor expansion default to the pair's
// (pair::SelectionConfig, one Opts::selection); the oracle mode's top-k expands successors as the async cache rank's
// does.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/run_stamp.h"
#include "pair/gpu_plan.h"
#include "pair/sharded_link.h"
#include "cache_rank/selector.h"
#include "common/config.h"
#include "common/error.h"
#include "inference_rank/gpu_model.h"
#include "kernels/attention.cuh"
#include "kernels/layer_ops.cuh"
#include "kernels/selection.cuh"
#include "kernels/tensor_ops.cuh"
#include "transport/cuda_ipc/cuda_ipc_link.h"
#include "transport/nccl/nccl_link.h"

namespace spade {
namespace {

using json = nlohmann::json;
using transport::CudaIpcLink;
using transport::CudaIpcLinkOptions;
using transport::GpuLink;
using transport::GpuLinkCounters;
using transport::NcclLink;
using transport::NcclLinkOptions;
using transport::NcclRole;
using transport::PairRole;

struct Opts {
  std::string config;
  std::string label;
  std::string out;
  std::string modes = "dense,oracle,async";
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
  // CTAs (channels) NCCL may use per communicator: each holds an SM of BOTH GPUs for the whole transfer, so fewer
  // leave more SMs to scoring on the cache rank (measured: 16 of the default 32 on H200 NVLink gives the best TPOT;
  // 8 halves the link bandwidth). 0 = NCCL's default.
  int nccl_ctas = 16;
  // The same for the selected-KV link with delta transfer (about 8x fewer bytes: fewer channels leave SMs to the
  // scoring on the cache rank and to the model on the inference rank).
  int nccl_ctas_delta = 8;
  // Delta transfer (kernels/selection_delta_ref.h): entries per (layer, sequence, KV head) row of each step's
  // message; 0 = the full selection every step. One async run per (pack size, capacity).
  std::vector<int> delta_capacities = {0};
  // The keys the async cache rank scores with (pair::SelectionConfig::score_keys): one async run per entry, the
  // run's value in selection.score_keys. int8: the compact copy, quantized from the pool at start and on every append.
  std::vector<kernels::ScoreKeys> score_keys = {kernels::ScoreKeys::kBf16};
  std::string link = "auto";  // auto: NCCL with two GPUs, else CUDA IPC on GPU 0; nccl; ipc
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
};

struct Stats {
  double median = 0, p99 = 0, mean = 0;
};
Stats stats(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, static_cast<size_t>(std::ceil(0.99 * v.size())) - 1)];
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  return s;
}

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
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

double measure_copy_gbps() {
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
void packed_attention(const ModelConfig& cfg, const Opts& o, const GpuLayerStep& s, const GpuBatch& b,
                      const void* packed_k, const void* packed_v, const int32_t* num_packed, DeviceBuffer& ws,
                      cudaStream_t stream) {
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

DeviceBuffer decode_workspace(const ModelConfig& cfg, int batch) {
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
    sp.batch = rows;
    sp.num_q_heads = cfg.num_q_heads;
    sp.num_kv_heads = cfg.num_kv_heads;
    sp.head_dim = cfg.head_dim;
    sp.page_size = o.page_size;
    sp.max_pages_per_seq = max_pages;
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
    gp.batch = rows;
    gp.num_kv_heads = cfg.num_kv_heads;
    gp.head_dim = cfg.head_dim;
    gp.page_size = o.page_size;
    gp.max_pages_per_seq = max_pages;
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

/// Mode 2: synchronous selection with the true query, inline in every layer, on the inference GPU.
class OracleAttention : public GpuAttention {
 public:
  OracleAttention(const ModelConfig& cfg, const Opts& o, int score_stride)
      : cfg_(cfg), o_(o), sel_(cfg, o, o.batch, score_stride),
        qf_(static_cast<size_t>(o.batch) * cfg.q_dim() * 4, "oracle q fp32"),
        lens_(static_cast<size_t>(o.batch) * 2 * 4, "oracle lengths"),
        packed_(static_cast<size_t>(o.batch) * cfg.num_kv_heads * o.budget() * cfg.head_dim * 2 * 2,
                "oracle packed KV"),
        ws_(decode_workspace(cfg, o.batch)) {}
  void attend(const GpuLayerStep& s, const GpuBatch& b, cudaStream_t stream) override {
    int32_t* sel_lens = lens_.as<int32_t>();
    int32_t* num_packed = sel_lens + o_.batch;
    cuda_check(kernels::offset_clamp({b.seq_lens, sel_lens, b.batch, -o_.local_window(), 0, 0x7fffffff}, stream),
               "selectable lengths");
    cuda_check(kernels::offset_clamp({b.seq_lens, num_packed, b.batch, -o_.local_window(), 0, o_.budget()}, stream),
               "packed counts");
    cuda_check(kernels::cast({DType::BF16, DType::F32, s.q, qf_.get(), static_cast<size_t>(b.batch) * cfg_.q_dim()},
                             stream),
               "q to fp32");
    const size_t half = static_cast<size_t>(o_.batch) * cfg_.num_kv_heads * o_.budget() * cfg_.head_dim;
    void* pk = packed_.get();
    void* pv = packed_.as<uint16_t>() + half;
    sel_.run(b.batch, qf_.as<float>(), s.k_cache, s.v_cache, b.block_table, b.max_pages, sel_lens, pk, pv, stream);
    packed_attention(cfg_, o_, s, b, pk, pv, num_packed, ws_, stream);
  }

 private:
  const ModelConfig& cfg_;
  const Opts& o_;
  Selector sel_;
  DeviceBuffer qf_, lens_, packed_, ws_;
};

json result_row(const Opts& o, const ModelConfig& cfg, const std::string& mode, const std::vector<double>& tpot_ms) {
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
double kv_bytes(const ModelConfig& cfg, const Opts& o, double tokens_per_seq) {
  return 2.0 * cfg.num_layers * o.batch * cfg.num_kv_heads * cfg.head_dim * 2.0 * tokens_per_seq;
}

/// Modes 1 and 2 on the current GPU: eager and CUDA-graph TPOT.
std::vector<json> run_single_gpu(const Opts& o, const ModelConfig& cfg, GpuModel& model, const std::string& mode,
                                 double copy_gbps) {
  const Plan plan(o, cfg);
  GpuKvPool pool(cfg.num_layers, plan.full_pages(), o.page_size, cfg.num_kv_heads, cfg.head_dim);
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  pool.fill_random(o.seed + 11, 1.f, stream);
  std::unique_ptr<GpuAttention> attn;
  if (mode == "dense") {
    attn = std::make_unique<GpuDenseAttention>(cfg, o.page_size, o.batch);
  } else {
    attn = std::make_unique<OracleAttention>(cfg, o, plan.max_len);
  }
  GpuStepBuffers buffers(o.batch, o.batch, plan.max_pages, o.batch, plan.full_pages());
  DeviceBuffer tokens_out(static_cast<size_t>(o.batch) * 4, "sampled tokens");
  const std::vector<int32_t> table = plan.full_table();
  std::vector<json> rows;
  for (const bool graph : {false, true}) {
    GpuGraph g;
    EventGrid ends(plan.total_steps, 1);
    auto body = [&](const GpuBatch& b, cudaStream_t st) {
      model.forward(b, pool, *attn, st);
      model.argmax(o.batch, tokens_out.as<int32_t>(), st);
    };
    for (int t = 0; t < plan.total_steps; ++t) {
      const GpuBatch b = buffers.upload(plan.step(t, table), stream);
      if (graph) {
        if (!g.captured()) g.capture(stream, [&](cudaStream_t st) { body(b, st); });
        g.launch(stream);
      } else {
        body(b, stream);
      }
      cuda_check(cudaEventRecord(ends(t, 0), stream), "record");
      cuda_check(cudaEventSynchronize(ends(t, 0)), "step sync");
    }
    std::vector<double> tpot;
    for (int t = o.warmup; t < plan.total_steps; ++t) tpot.push_back(elapsed_ms(ends(t - 1, 0), ends(t, 0)));
    json r = result_row(o, cfg, mode, tpot);
    r["cuda_graph"] = graph;
    const double attended = mode == "dense" ? o.context + o.warmup + o.steps / 2.0 : o.budget() + o.local_window();
    const double floor_bytes = model.decode_weight_bytes(o.batch) + kv_bytes(cfg, o, attended);
    r["weight_bytes"] = model.decode_weight_bytes(o.batch);
    r["floor_bytes"] = floor_bytes;
    r["floor_ms"] = floor_bytes / (copy_gbps * 1e6);
    r["tpot_over_floor"] = r["tpot_median_ms"].get<double>() / r["floor_ms"].get<double>();
    if (mode == "oracle")
      r["note"] = "floor counts only the selected KV; the oracle also reads every key to score it (" +
                  std::to_string(kv_bytes(cfg, o, o.context) / 2 / 1e9) + " GB/step)";
    std::printf("  %-7s %-5s TPOT median %8.3f ms  p99 %8.3f ms  floor %7.3f ms (%.2fx)\n", mode.c_str(),
                graph ? "graph" : "eager", r["tpot_median_ms"].get<double>(), r["tpot_p99_ms"].get<double>(),
                r["floor_ms"].get<double>(), r["tpot_over_floor"].get<double>());
    rows.push_back(r);
  }
  cuda_check(cudaStreamDestroy(stream), "stream");
  return rows;
}

// ---------------------------------------------------------------------------------------------------------------
// Mode 3: AsyncSpade disaggregated: two GPUs joined by NcclLink, or (one GPU) both ranks on GPU 0 joined by
// CudaIpcLink, which checks the pipeline but not its speed (the ranks then share the GPU's SMs and HBM).
// ---------------------------------------------------------------------------------------------------------------

/// One layer pack's delta message: pair/gpu_plan.h DeltaLayout (the serving protocol's layout).
using pair::DeltaLayout;

struct AsyncShared {
  int P = 0, packs = 0;
  size_t up_bytes_pack = 0;     // one layer pack's qkv rows
  size_t down_bytes_layer = 0;  // one layer's packed K + V (full transfer)
  int cap = 0;                  // delta transfer: entries per (layer, sequence, KV head) row; 0 = full transfer
  size_t rows_pack = 0;         // P x batch x KV heads
  DeltaLayout delta, init;      // per pack: steady-state delta (cap entries), first selection (budget entries)
  // Cache rank s runs on cache_devices[s] and serves the packs p with pair::shard_of_pack(p, shards) == s.
  int shards = 1;
  std::vector<int> cache_devices = {1};
  int shard(int pack) const { return pair::shard_of_pack(pack, shards); }
  // Sets of qkv receive buffers the cache rank cycles through, step by step: 1; a solo cache rank (nothing is
  // received) appends 8 different random sets, so its queries, predictions and selections change as in a real run.
  int up_variants = 1;
  std::atomic<bool> failed{false};
  // The first failure of any rank's thread (the others abort their links and end).
  void fail(const std::string& what) {
    std::lock_guard lk(error_mu);
    if (error.empty()) error = what;
    failed = true;
  }
  std::string first_error() const {
    std::lock_guard lk(error_mu);
    return error;
  }
  // Bytes of step t's down message of one pack.
  size_t down_bytes(int t) const {
    if (cap == 0) return static_cast<size_t>(P) * down_bytes_layer;
    return t == 0 ? init.bytes : delta.bytes;
  }

 private:
  mutable std::mutex error_mu;
  std::string error;
};

/// Inference-rank attention: waits for the pack's selected KV, attends over it + the local window, copies the
/// layer's qkv rows into the pack's send buffer and ships the pack after its last layer. With delta transfer it keeps
/// the selected K/V of every layer in slot tables (held_k / held_v, [layer][seq][KV head][budget][D]) and applies
/// each received delta on the receive stream once the previous step's pack no longer reads the table.
class AsyncInferenceAttention : public GpuAttention {
 public:
  /// links[s]: the link to cache rank s (AsyncShared::shard).
  AsyncInferenceAttention(const ModelConfig& cfg, const Opts& o, AsyncShared& sh, std::vector<GpuLink*> links,
                          int total_steps)
      : cfg_(cfg), o_(o), sh_(sh), links_(std::move(links)),
        up_(static_cast<size_t>(sh.packs) * sh.up_bytes_pack, "qkv send buffers"),
        down_(2 * static_cast<size_t>(sh.packs) * sh.down_bytes(1), "selected KV receive buffers"),
        init_(sh.cap > 0 ? static_cast<size_t>(sh.packs) * sh.init.bytes : 0, "first-selection receive buffers"),
        held_(sh.cap > 0 ? 2 * table_elems() * 2 : 0, "held selections (slot tables)"),
        lens_(static_cast<size_t>(o.batch) * 4, "packed counts"), ws_(decode_workspace(cfg, o.batch)),
        arrive_(total_steps + 1, sh.packs), ready_(total_steps + 1, sh.packs), pack_end_(total_steps + 1, sh.packs),
        recv_done_(total_steps + 1, sh.packs), sent_(total_steps + 1, sh.packs) {
    cuda_check(cudaStreamCreateWithFlags(&up_stream_, cudaStreamNonBlocking), "stream");
    cuda_check(cudaStreamCreateWithFlags(&down_stream_, cudaStreamNonBlocking), "stream");
  }
  ~AsyncInferenceAttention() override {
    cudaStreamDestroy(up_stream_);
    cudaStreamDestroy(down_stream_);
  }
  void set_step(int t) { step_ = t; }
  /// The rank alone (NullLink, nothing is received): fills every receive buffer with a message it can use, so each
  /// step does the work of a real one. Full transfer: zero K/V. Delta transfer: entry j of every row goes to slot j
  /// (the apply copies `capacity` rows per table row, as in steady state).
  void fill_solo_messages() {
    cuda_check(cudaMemset(down_.get(), 0, down_.bytes()), "solo messages");
    if (sh_.cap == 0) {
      cuda_check(cudaDeviceSynchronize(), "solo messages");
      return;
    }
    cuda_check(cudaMemset(init_.get(), 0, init_.bytes()), "solo messages");
    auto fill = [&](char* m, const DeltaLayout& l) {
      std::vector<int32_t> slots(l.rows * static_cast<size_t>(l.cap));
      for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i % static_cast<size_t>(l.cap));
      cuda_check(cudaMemcpy(m + l.slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice), "solo slots");
      cuda_check(cudaMemcpy(m + l.positions, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice), "solo slots");
    };
    for (int p = 0; p < sh_.packs; ++p) {
      fill(recv_buf(0, p), sh_.init);
      fill(recv_buf(1, p), sh_.delta);
      fill(recv_buf(2, p), sh_.delta);
    }
    // Done before the non-blocking streams that read them start.
    cuda_check(cudaDeviceSynchronize(), "solo messages");
  }
  /// Graph mode: the step-indexed events use rows t % 2 (a graph bakes its event handles), so the pack times of step
  /// t are read (collect) right after it ended. `capturing`: waits and pack-end records become external event nodes
  /// and the sends are left to ship().
  void set_graph_mode(bool on) { graph_mode_ = on; }
  void set_capturing(bool on) { capturing_ = on; }
  /// Graph mode, after the launch of step t: per pack, the up stream waits for the graph's pack end and sends.
  void ship(int t) {
    for (int p = 0; p < sh_.packs; ++p) {
      cuda_check(cudaStreamWaitEvent(up_stream_, pack_end_(row(t), p), 0), "wait");
      link(p).send(up_.as<char>() + p * sh_.up_bytes_pack, sh_.up_bytes_pack, up_stream_, "qkv rows of a pack");
      cuda_check(cudaEventRecord(sent_(row(t), p), up_stream_), "record");
    }
  }
  /// Reads step t's pack times (its events are reused two steps later in graph mode). Call after step t ended.
  void collect(int t) {
    if (times_.empty()) times_.assign(2 * static_cast<size_t>(arrive_.ev.size()), 0.0);
    for (int p = 0; p < sh_.packs; ++p) {
      const size_t i = 2 * (static_cast<size_t>(t) * sh_.packs + p);
      times_[i] = elapsed_ms(arrive_(row(t), p), ready_(row(t), p));
      times_[i + 1] = elapsed_ms(ready_(row(t), p), pack_end_(row(t), p));
    }
  }
  char* recv_buf(int t, int p) const {
    if (sh_.cap > 0 && t == 0) return init_.as<char>() + static_cast<size_t>(p) * sh_.init.bytes;
    return down_.as<char>() + (static_cast<size_t>(t % 2) * sh_.packs + p) * sh_.down_bytes(1);
  }
  /// Posts the receives of step t's selected KV (sent by the cache rank during step t - 1); with delta transfer,
  /// the apply of each into the slot tables after step t - 1's pack has read them.
  void post_recvs(int t) {
    for (int p = 0; p < sh_.packs; ++p) {
      if (t >= 2) cuda_check(cudaStreamWaitEvent(down_stream_, pack_end_(row(t - 2), p), 0), "wait");  // buffer reuse
      link(p).recv(recv_buf(t, p), sh_.down_bytes(t), down_stream_, "selected K/V of a pack");
      if (sh_.cap > 0) {
        if (t >= 1) cuda_check(cudaStreamWaitEvent(down_stream_, pack_end_(row(t - 1), p), 0), "wait");
        apply(t, p);
      }
      cuda_check(cudaEventRecord(recv_done_(row(t), p), down_stream_), "record");
    }
  }
  void attend(const GpuLayerStep& s, const GpuBatch& b, cudaStream_t stream) override {
    const int p = s.layer / sh_.P, j = s.layer % sh_.P, t = step_;
    if (s.layer == 0)
      cuda_check(kernels::offset_clamp({b.seq_lens, lens_.as<int32_t>(), b.batch, -o_.local_window(), 0, o_.budget()},
                                       stream),
                 "packed counts");
    if (j == 0) {
      record(arrive_(row(t), p), stream);
      cuda_check(cudaStreamWaitEvent(stream, recv_done_(row(t), p), capturing_ ? cudaEventWaitExternal : 0), "wait");
      record(ready_(row(t), p), stream);
    }
    const char *pk = nullptr, *pv = nullptr;
    if (sh_.cap > 0) {
      pk = held_.as<char>() + static_cast<size_t>(s.layer) * layer_elems() * 2;
      pv = pk + table_elems() * 2;
    } else {
      const size_t half = sh_.P * sh_.down_bytes_layer / 2, layer_half = sh_.down_bytes_layer / 2;
      pk = recv_buf(t, p) + j * layer_half;
      pv = recv_buf(t, p) + half + j * layer_half;
    }
    packed_attention(cfg_, o_, s, b, pk, pv, lens_.as<int32_t>(), ws_, stream);
    if (j == sh_.P - 1 || s.layer == cfg_.num_layers - 1) {
      record(pack_end_(row(t), p), stream);
      if (!capturing_) {
        cuda_check(cudaStreamWaitEvent(up_stream_, pack_end_(row(t), p), 0), "wait");
        link(p).send(up_.as<char>() + p * sh_.up_bytes_pack, sh_.up_bytes_pack, up_stream_, "qkv rows of a pack");
        cuda_check(cudaEventRecord(sent_(row(t), p), up_stream_), "record");
      }
    }
  }
  // The layer's processed q | k | v rows (after q/k norm and RoPE, as appended here) go straight into the pack's
  // send buffer; its first layer waits for the previous step's send of that buffer.
  void* rows_out(int layer, cudaStream_t stream, int* stride) override {
    const int p = layer / sh_.P, j = layer % sh_.P, t = step_;
    if (j == 0 && t >= 1)  // buffer reuse
      cuda_check(cudaStreamWaitEvent(stream, sent_(row(t - 1), p), capturing_ ? cudaEventWaitExternal : 0), "wait");
    *stride = 0;
    return up_.as<char>() + p * sh_.up_bytes_pack + j * (sh_.up_bytes_pack / sh_.P);
  }
  // Per (step, pack): stall (ms the pack waited for its KV), inference time (ready -> pack end).
  void pack_times(int t, int p, double* stall_ms, double* infer_ms) const {
    const size_t i = 2 * (static_cast<size_t>(t) * sh_.packs + p);
    *stall_ms = times_[i];
    *infer_ms = times_[i + 1];
  }

 private:
  GpuLink& link(int pack) const { return *links_[static_cast<size_t>(sh_.shard(pack))]; }
  int row(int t) const { return graph_mode_ ? t % 2 : t; }
  void record(cudaEvent_t e, cudaStream_t stream) const {
    cuda_check(capturing_ ? cudaEventRecordWithFlags(e, stream, cudaEventRecordExternal) : cudaEventRecord(e, stream),
               "record");
  }
  size_t layer_elems() const {
    return static_cast<size_t>(o_.batch) * cfg_.num_kv_heads * o_.budget() * cfg_.head_dim;
  }
  size_t table_elems() const { return static_cast<size_t>(cfg_.num_layers) * layer_elems(); }
  int pack_layers(int p) const { return std::min(sh_.P, cfg_.num_layers - p * sh_.P); }
  // Writes the entries of step t's pack-p message into the slot tables of the pack's layers (down stream).
  void apply(int t, int p) {
    const DeltaLayout& l = t == 0 ? sh_.init : sh_.delta;
    const char* m = recv_buf(t, p);
    kernels::ApplySelectionDeltaParams a;
    a.delta_slots = reinterpret_cast<const int32_t*>(m + l.slots);
    a.delta_k = m + l.k;
    a.delta_v = m + l.v;
    a.held_k = held_.as<char>() + static_cast<size_t>(p) * sh_.P * layer_elems() * 2;
    a.held_v = static_cast<char*>(a.held_k) + table_elems() * 2;
    a.rows = pack_layers(p) * o_.batch * cfg_.num_kv_heads;
    a.k = o_.budget();
    a.capacity = t == 0 ? o_.budget() : sh_.cap;
    a.head_dim = cfg_.head_dim;
    cuda_check(kernels::apply_selection_delta(a, down_stream_), "apply_selection_delta");
  }

  const ModelConfig& cfg_;
  const Opts& o_;
  AsyncShared& sh_;
  std::vector<GpuLink*> links_;
  DeviceBuffer up_, down_, init_, held_, lens_, ws_;
  EventGrid arrive_, ready_, pack_end_, recv_done_, sent_;
  cudaStream_t up_stream_ = nullptr, down_stream_ = nullptr;
  int step_ = 0;
  bool graph_mode_ = false, capturing_ = false;
  std::vector<double> times_;  // per (step, pack): stall ms, inference ms
};

/// One cache rank of the benchmark (GPU 1 + shard, or GPU 0 with the IPC link): the KV pool of its packs' layers
/// (every layer with one cache rank), query windows, selection one step ahead for its packs. With delta transfer it
/// keeps the mirror of every slot table ([layer][seq][KV head][budget] positions) and sends per pack only the entries
/// selection_delta plans (the first selection: all of them).
class AsyncCacheRank {
 public:
  /// shard: this cache rank's index in [0, sh.shards); it serves the packs AsyncShared::shard maps to it.
  AsyncCacheRank(const ModelConfig& cfg, const Opts& o, AsyncShared& sh, GpuLink& link, const Plan& plan, int shard)
      : cfg_(cfg), o_(o), sh_(sh), link_(link), plan_(plan), L_(cfg.num_layers), B_(o.batch),
        cap_(o.selection.query_window + 1), shard_(shard), mine_(shard_packs(sh, shard)),
        layers_(pair::shard_layers(shard, sh.shards, cfg.num_layers, sh.P)), local_(local_index(layers_, L_)),
        nl_(static_cast<int>(layers_.size())),
        pool_(nl_, plan.full_pages(), o.page_size, cfg.num_kv_heads, cfg.head_dim),
        int8_keys_(o.selection.score_keys == kernels::ScoreKeys::kInt8),
        kq_(int8_keys_ ? pool_rows() * cfg.head_dim : 0, "int8 scoring keys"),
        kscale_(int8_keys_ ? pool_rows() * 4 : 0, "int8 key scales"),
        up_(static_cast<size_t>(sh.up_variants) * sh.packs * sh.up_bytes_pack, "qkv receive buffers"),
        send_(2 * mine_.size() * sh.down_bytes(1), "selected KV send buffers"),
        init_(sh.cap > 0 ? mine_.size() * sh.init.bytes : 0, "first-selection send buffers"),
        mirror_(sh.cap > 0 ? static_cast<size_t>(L_) * B_ * cfg.num_kv_heads * o.budget() * 4 : 0,
                "slot table mirrors"),
        totals_(sh.cap > 0 ? kernels::kDeltaTotalsFields * 8 : 0, "delta totals"),
        window_(2 * static_cast<size_t>(L_) * B_ * cfg.q_dim() * cap_ * 2, "query windows"),
        window_len_(static_cast<size_t>(sh.P) * B_ * 4, "window lengths"),
        q_tmp_(static_cast<size_t>(sh.P) * B_ * cfg.q_dim() * 2, "roped q of a pack"),
        append_pos_(static_cast<size_t>(plan.total_steps) * sh.P * B_ * 4, "append positions"),
        append_rows_(static_cast<size_t>(sh.P) * B_ * 4, "append rows"),
        lbt_(static_cast<size_t>(L_) * B_ * plan.max_pages * 4, "layer-batched block table"),
        sel_lens_(static_cast<size_t>(plan.total_steps + 1) * sh.P * B_ * 4, "selectable lengths"),
        steps_(plan.o.batch, plan.o.batch, plan.max_pages, plan.o.batch, plan.full_pages()),
        qkv_ready_(plan.total_steps + 1, sh.packs), cm_start_(plan.total_steps + 1, sh.packs),
        cm_end_(plan.total_steps + 1, sh.packs), send_start_(plan.total_steps + 1, sh.packs),
        send_end_(plan.total_steps + 1, sh.packs), after_append_(plan.total_steps + 1, sh.packs),
        after_predict_(plan.total_steps + 1, sh.packs), after_score_(plan.total_steps + 1, sh.packs),
        after_topk_(plan.total_steps + 1, sh.packs), table_(plan.full_table()) {
    for (auto* s : {&stream_, &up_stream_, &down_stream_})
      cuda_check(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), "stream");
    score_stream_ = sel_stream_ = stream_;
    if (o.cache_streams == 3) {
      int least = 0, greatest = 0;
      cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
      cuda_check(cudaStreamCreateWithPriority(&score_stream_, cudaStreamNonBlocking, least), "score stream");
      cuda_check(cudaStreamCreateWithPriority(&sel_stream_, cudaStreamNonBlocking, greatest), "selection stream");
    }
    for (int i = 0; i < 2; ++i) {
      q_hat_[i] = DeviceBuffer(static_cast<size_t>(sh.P) * B_ * cfg.q_dim() * 4, "predicted queries");
      sel_[i] = std::make_unique<Selector>(cfg, o, sh.P * B_, plan.max_len);
    }
    cuda_check(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming), "event");
    pool_.fill_random(o.seed + 11, 1.f, stream_);
    if (int8_keys_) {  // the compact copy of the whole pool, as a prefill's appends would have written it
      kernels::QuantizeKeysParams qk;
      qk.k_cache = pool_.k(0);
      qk.k_int8 = kq_.as<int8_t>();
      qk.k_scale = kscale_.as<float>();
      qk.tokens = pool_.num_pages() * nl_ * o.page_size;
      qk.num_kv_heads = cfg.num_kv_heads;
      qk.head_dim = cfg.head_dim;
      qk.page_size = o.page_size;
      qk.num_pages = pool_.num_pages() * nl_;
      cuda_check(kernels::quantize_keys(qk, stream_), "int8 keys of the pool");
    }
    cuda_check(kernels::random_fill({DType::BF16, window_.get(), window_.bytes() / 2, o.seed + 13, 1.f, 0.f}, stream_),
               "window fill");
    // Rows a solo run never receives (NullLink) are appended as they are: random, like the model's.
    cuda_check(kernels::random_fill({DType::BF16, up_.get(), up_.bytes() / 2, o.seed + 19, 1.f, 0.f}, stream_),
               "qkv rows fill");
    if (sh.cap > 0) cuda_check(cudaMemsetAsync(mirror_.get(), 0xFF, mirror_.bytes(), stream_), "mirror init");
    std::vector<int32_t> wl(static_cast<size_t>(sh.P) * B_, cap_);
    cuda_check(cudaMemcpy(window_len_.get(), wl.data(), wl.size() * 4, cudaMemcpyHostToDevice), "upload");
    // Layer-batched block table: row (l, b) addresses layer l's pages from the pool base (global page i * pages + page
    // for the shard's i-th layer); the rows of layers another cache rank holds are -1 (never read here).
    const std::vector<int32_t>& table = table_;
    std::vector<int32_t> lbt(static_cast<size_t>(L_) * B_ * plan.max_pages, -1);
    for (int l : layers_)
      for (size_t i = 0; i < table.size(); ++i)
        lbt[static_cast<size_t>(l) * table.size() + i] = table[i] + local_[static_cast<size_t>(l)] * plan.full_pages();
    cuda_check(cudaMemcpy(lbt_.get(), lbt.data(), lbt.size() * 4, cudaMemcpyHostToDevice), "upload");
    // The pack's append rows (layer j, sequence b) = row j * B + b of the layer-batched block table; each step's
    // token position repeated for every layer of the pack.
    std::vector<int32_t> rows_idx(static_cast<size_t>(sh.P) * B_), pos;
    for (size_t i = 0; i < rows_idx.size(); ++i) rows_idx[i] = static_cast<int32_t>(i);
    for (int t = 0; t < plan.total_steps; ++t)
      for (int r = 0; r < sh.P * B_; ++r) pos.push_back(plan.seq_len(t) - 1);
    cuda_check(cudaMemcpy(append_rows_.get(), rows_idx.data(), rows_idx.size() * 4, cudaMemcpyHostToDevice), "upload");
    cuda_check(cudaMemcpy(append_pos_.get(), pos.data(), pos.size() * 4, cudaMemcpyHostToDevice), "upload");
    // Selectable lengths of the step each selection is for: positions < seq_len(step) - local_window.
    std::vector<int32_t> sl;
    for (int t = 0; t <= plan.total_steps; ++t)
      for (int r = 0; r < sh.P * B_; ++r) sl.push_back(std::max(0, plan.seq_len(t) - o.local_window()));
    cuda_check(cudaMemcpy(sel_lens_.get(), sl.data(), sl.size() * 4, cudaMemcpyHostToDevice), "upload");
    cuda_check(cudaStreamSynchronize(stream_), "cache rank init");
  }
  ~AsyncCacheRank() {
    for (auto s : {stream_, up_stream_, down_stream_}) cudaStreamDestroy(s);
    if (score_stream_ != stream_) cudaStreamDestroy(score_stream_);
    if (sel_stream_ != stream_) cudaStreamDestroy(sel_stream_);
    cudaEventDestroy(uploaded_);
  }

  void run() {
    for (int p : mine_) select_and_send(/*for_step=*/0, p);  // as after the prefill
    for (int t = 0; t < plan_.total_steps && !sh_.failed.load(); ++t) {
      const GpuBatch b = steps_.upload(plan_.step(t, table_), stream_);
      cuda_check(cudaEventRecord(uploaded_, stream_), "record");
      // Delta statistics count the timed steps' selections only.
      if (sh_.cap > 0 && t + 1 == o_.warmup)
        cuda_check(cudaMemsetAsync(totals_.get(), 0, totals_.bytes(), sel_stream_), "delta totals reset");
      for (int p : mine_) {
        // The buffer's previous rows were appended (after_append_ of the selection made after appending them).
        if (t + 1 >= sh_.up_variants) {
          const int prev = t + 1 - sh_.up_variants;
          cuda_check(cudaStreamWaitEvent(up_stream_, after_append_(prev, p), 0), "wait");
        }
        link_.recv(up_rows(t, p), sh_.up_bytes_pack, up_stream_, "qkv rows of a pack");
        cuda_check(cudaEventRecord(qkv_ready_(t, p), up_stream_), "record");
      }
      for (int p : mine_) {
        cuda_check(cudaStreamWaitEvent(stream_, qkv_ready_(t, p), 0), "wait");
        cuda_check(cudaEventRecord(cm_start_(t + 1, p), stream_), "record");
        append_pack(t, p, b);
        select_and_send(t + 1, p);
      }
      // The staging buffer of steps_ is reused by the next upload: wait for this step's copy.
      cuda_check(cudaEventSynchronize(uploaded_), "cache step sync");
    }
    for (cudaStream_t x : {down_stream_, sel_stream_, score_stream_, stream_})
      cuda_check(cudaStreamSynchronize(x), "cache rank drain");
  }
  /// ms of cache management (append + predict + score + top-k + gather) and of the send, for the selection of step t.
  void pack_times(int t, int p, double* cm_ms, double* send_ms, double stage_ms[5]) const {
    SPADE_CHECK(sh_.shard(p) == shard_, "pack {} is not served by cache rank {}", p, shard_);
    *cm_ms = elapsed_ms(cm_start_(t, p), cm_end_(t, p));
    *send_ms = elapsed_ms(send_start_(t, p), send_end_(t, p));
    stage_ms[0] = elapsed_ms(cm_start_(t, p), after_append_(t, p));  // K/V append + window push
    stage_ms[1] = elapsed_ms(after_append_(t, p), after_predict_(t, p));
    stage_ms[2] = elapsed_ms(after_predict_(t, p), after_score_(t, p));
    stage_ms[3] = elapsed_ms(after_score_(t, p), after_topk_(t, p));
    stage_ms[4] = elapsed_ms(after_topk_(t, p), cm_end_(t, p));  // gather (with delta transfer: plan + gather)
  }
  /// ms the cache rank spent on step t (t >= 1): between the ends of the last pack's selections for steps t and t + 1.
  double step_ms(int t) const { return elapsed_ms(cm_end_(t, mine_.back()), cm_end_(t + 1, mine_.back())); }
  /// The packs this cache rank serves, ascending.
  const std::vector<int>& packs() const { return mine_; }
  /// Bytes of its KV pool (K and V of its layers).
  size_t pool_bytes() const { return pool_.bytes(); }
  /// Delta transfer: sums over the timed selections of {selected n, entering E, sent m, holes, refused rows}.
  std::vector<unsigned long long> delta_totals() const {
    std::vector<unsigned long long> h(kernels::kDeltaTotalsFields, 0ull);
    if (sh_.cap > 0) cuda_check(cudaMemcpy(h.data(), totals_.get(), totals_.bytes(), cudaMemcpyDeviceToHost), "totals");
    return h;
  }

 private:
  static std::vector<int> shard_packs(const AsyncShared& sh, int shard) {
    std::vector<int> v;
    for (int p = 0; p < sh.packs; ++p)
      if (sh.shard(p) == shard) v.push_back(p);
    SPADE_CHECK(!v.empty(), "cache rank {} of {} serves no layer pack ({} packs)", shard, sh.shards, sh.packs);
    return v;
  }
  // [layer] -> index among the shard's layers, -1 for another cache rank's layer.
  static std::vector<int> local_index(const std::vector<int>& layers, int num_layers) {
    std::vector<int> v(static_cast<size_t>(num_layers), -1);
    for (size_t i = 0; i < layers.size(); ++i) v[static_cast<size_t>(layers[i])] = static_cast<int>(i);
    return v;
  }
  int pack_layers(int p) const { return std::min(sh_.P, L_ - p * sh_.P); }
  size_t pool_rows() const {  // (token, KV head) rows of the whole pool, every layer
    return static_cast<size_t>(pool_.num_pages()) * nl_ * o_.page_size * cfg_.num_kv_heads;
  }
  char* up_rows(int t, int p) const {
    return up_.as<char>() + (static_cast<size_t>(t % sh_.up_variants) * sh_.packs + p) * sh_.up_bytes_pack;
  }
  char* window(int parity, int layer) const {
    return window_.as<char>() + ((static_cast<size_t>(parity) * L_ + layer) * B_ * cfg_.q_dim() * cap_) * 2;
  }
  // Step t's K/V append and query-window push for the layers of pack p (window parity (t+1) % 2 becomes current), in
  // three launches for the whole pack: its (layer, sequence) rows are one RoPE + append over the layer-batched block
  // table (global page l * pages + page), and its windows one contiguous block of (layer, sequence, head) rows.
  void append_pack(int t, int p, const GpuBatch& b) {
    const int Hq = cfg_.num_q_heads, D = cfg_.head_dim, n = pack_layers(p), rows = n * B_;
    kernels::RopeKvAppendParams r;
    r.qkv = up_rows(t, p);  // [P][B][qkv] rows of the pack
    r.q_out = q_tmp_.get();
    r.k_cache = pool_.k(0);
    r.v_cache = pool_.v(0);
    r.positions = append_pos_.as<int32_t>() + static_cast<size_t>(t) * sh_.P * B_;
    r.seq_idx = append_rows_.as<int32_t>();
    r.block_table = lbt_.as<int32_t>() + static_cast<size_t>(p) * sh_.P * B_ * plan_.max_pages;
    r.tokens = rows;
    r.num_q_heads = Hq;
    r.num_kv_heads = cfg_.num_kv_heads;
    r.head_dim = D;
    r.rot_dim = 0;  // the rows arrive normed and rotated (the inference rank's rows_out): a plain append
    r.batch = rows;
    r.max_pages_per_seq = b.max_pages;
    r.page_size = o_.page_size;
    r.num_pages = pool_.num_pages() * nl_;
    r.theta = cfg_.rope_theta;
    cuda_check(kernels::rope_kv_append(r, stream_), "cache rank KV append");
    if (int8_keys_) {  // the appended keys' compact copy, addressed as the append
      kernels::QuantizeKeysParams qk;
      qk.k_cache = pool_.k(0);
      qk.k_int8 = kq_.as<int8_t>();
      qk.k_scale = kscale_.as<float>();
      qk.positions = r.positions;
      qk.seq_idx = r.seq_idx;
      qk.block_table = r.block_table;
      qk.batch = rows;
      qk.tokens = rows;
      qk.num_kv_heads = cfg_.num_kv_heads;
      qk.head_dim = D;
      qk.page_size = o_.page_size;
      qk.max_pages_per_seq = b.max_pages;
      qk.num_pages = r.num_pages;
      cuda_check(kernels::quantize_keys(qk, stream_), "cache rank int8 keys");
    }
    const size_t row = static_cast<size_t>(cap_) * D * 2;  // one (layer, sequence, head) window
    char* src = window(t % 2, p * sh_.P);
    char* dst = window((t + 1) % 2, p * sh_.P);
    const size_t wrows = static_cast<size_t>(rows) * Hq;
    cuda_check(cudaMemcpy2DAsync(dst, row, src + D * 2, row, (cap_ - 1) * D * 2, wrows, cudaMemcpyDeviceToDevice,
                                 stream_),
               "window shift");
    cuda_check(cudaMemcpy2DAsync(dst + (cap_ - 1) * D * 2, row, q_tmp_.get(), D * 2, D * 2, wrows,
                                 cudaMemcpyDeviceToDevice, stream_),
               "window push");
  }
  // Predict, score, top-k and gather the selection of step `for_step` for pack p, then send it. Streams (the same
  // one with --cache-streams 1): predict on stream_ after the append; score on score_stream_; top-k, delta and
  // gather on sel_stream_ (high priority: its latency-bound kernels take SMs as the next pack's score frees them).
  // Scratch set seq % 2 (q_hat, scores, indices) is reused by the selection two after this one: predict waits for
  // that one's score to have read q_hat, score for its end (cm_end) to have read scores and indices.
  void select_and_send(int for_step, int p) {
    const int n = pack_layers(p), rows = n * B_, mine = static_cast<int>(mine_.size());
    const int idx = static_cast<int>(std::find(mine_.begin(), mine_.end(), p) - mine_.begin());
    const int seq = for_step * mine + idx, buf = seq % 2;  // this rank's selections in order
    Selector& sel = *sel_[buf];
    float* q_hat = q_hat_[buf].as<float>();
    auto two_back = [&](const EventGrid& g) {
      return g((seq - 2) / mine, mine_[static_cast<size_t>((seq - 2) % mine)]);
    };
    if (for_step == 0) cuda_check(cudaEventRecord(cm_start_(0, p), stream_), "record");
    cuda_check(cudaEventRecord(after_append_(for_step, p), stream_), "record");
    if (seq >= 2) cuda_check(cudaStreamWaitEvent(stream_, two_back(after_score_), 0), "wait");
    kernels::PredictQueryParams pq;
    pq.window_dtype = DType::BF16;
    pq.window = window(for_step % 2, p * sh_.P);
    pq.window_len = window_len_.as<int32_t>();
    pq.q_hat = q_hat;
    pq.batch = rows;
    pq.num_heads = cfg_.num_q_heads;
    pq.window_capacity = cap_;
    pq.head_dim = cfg_.head_dim;
    pq.max_regressors = o_.selection.query_window;
    pq.eps = o_.selection.ridge_eps;
    pq.kind = o_.selection.predictor;
    cuda_check(kernels::predict_next_query(pq, stream_), "predict_next_query");
    cuda_check(cudaEventRecord(after_predict_(for_step, p), stream_), "record");
    const int32_t* lens = sel_lens_.as<int32_t>() + static_cast<size_t>(for_step) * sh_.P * B_;
    const int32_t* bt = lbt_.as<int32_t>() + static_cast<size_t>(p) * sh_.P * B_ * plan_.max_pages;
    cuda_check(cudaStreamWaitEvent(score_stream_, after_predict_(for_step, p), 0), "wait");
    if (seq >= 2) cuda_check(cudaStreamWaitEvent(score_stream_, two_back(cm_end_), 0), "wait");
    sel.score(rows, q_hat, pool_.k(0), bt, plan_.max_pages, lens, score_stream_,
              int8_keys_ ? kq_.as<int8_t>() : nullptr, int8_keys_ ? kscale_.as<float>() : nullptr);
    cuda_check(cudaEventRecord(after_score_(for_step, p), score_stream_), "record");
    cuda_check(cudaStreamWaitEvent(sel_stream_, after_score_(for_step, p), 0), "wait");
    sel.topk(rows, lens, sel_stream_);
    cuda_check(cudaEventRecord(after_topk_(for_step, p), sel_stream_), "record");
    const int par = for_step % 2;
    const size_t bytes = sh_.down_bytes(for_step);
    char* out = sh_.cap > 0 && for_step == 0 ? init_.as<char>() + static_cast<size_t>(idx) * sh_.init.bytes
                                             : send_.as<char>() + (static_cast<size_t>(par) * mine + idx) * bytes;
    if (for_step >= 2) cuda_check(cudaStreamWaitEvent(sel_stream_, send_end_(for_step - 2, p), 0), "wait");
    if (sh_.cap == 0) {
      sel.gather(rows, sel.indices.as<int32_t>(), o_.budget(), pool_.k(0), pool_.v(0), bt, plan_.max_pages, out,
                 out + sh_.P * sh_.down_bytes_layer / 2, sel_stream_);
    } else {
      const DeltaLayout& l = for_step == 0 ? sh_.init : sh_.delta;
      const int cap = for_step == 0 ? o_.budget() : sh_.cap;
      kernels::SelectionDeltaParams d;
      d.indices = sel.indices.as<int32_t>();
      d.scores = sel.scores.as<float>();
      d.mirror = mirror_.as<int32_t>() + static_cast<size_t>(p) * sh_.rows_pack * o_.budget();
      d.delta_slots = reinterpret_cast<int32_t*>(out + l.slots);
      d.delta_positions = reinterpret_cast<int32_t*>(out + l.positions);
      d.row_info = reinterpret_cast<int32_t*>(out + l.info);
      d.totals = totals_.as<unsigned long long>();
      d.rows = rows * cfg_.num_kv_heads;
      d.k = o_.budget();
      d.capacity = cap;
      d.score_stride = sel.stride;
      cuda_check(kernels::selection_delta(d, sel_stream_), "selection_delta");
      sel.gather(rows, d.delta_positions, cap, pool_.k(0), pool_.v(0), bt, plan_.max_pages, out + l.k, out + l.v,
                 sel_stream_);
    }
    cuda_check(cudaEventRecord(cm_end_(for_step, p), sel_stream_), "record");
    cuda_check(cudaStreamWaitEvent(down_stream_, cm_end_(for_step, p), 0), "wait");
    cuda_check(cudaEventRecord(send_start_(for_step, p), down_stream_), "record");
    link_.send(out, bytes, down_stream_, "selected K/V of a pack");
    cuda_check(cudaEventRecord(send_end_(for_step, p), down_stream_), "record");
  }

  const ModelConfig& cfg_;
  const Opts& o_;
  AsyncShared& sh_;
  GpuLink& link_;
  const Plan& plan_;
  int L_, B_, cap_;
  int shard_;
  std::vector<int> mine_;    // the packs it serves
  std::vector<int> layers_;  // their layers, ascending
  std::vector<int> local_;   // [layer] -> index in layers_ (the pool's layer), -1 if another cache rank's
  int nl_;                   // layers_.size()
  GpuKvPool pool_;           // [nl_] layers
  bool int8_keys_;
  DeviceBuffer kq_, kscale_;  // the compact scoring keys (int8 only): [L * pages][page][Hkv][D] int8, fp32 scales
  DeviceBuffer up_, send_, init_, mirror_, totals_, window_, window_len_, q_tmp_, append_pos_, append_rows_, lbt_,
      sel_lens_;
  DeviceBuffer q_hat_[2];                // predicted queries of scratch set 0 / 1
  std::unique_ptr<Selector> sel_[2];     // scores and top-k indices of scratch set 0 / 1
  GpuStepBuffers steps_;
  EventGrid qkv_ready_, cm_start_, cm_end_, send_start_, send_end_;
  EventGrid after_append_, after_predict_, after_score_, after_topk_;  // stage boundaries inside cm_start..cm_end
  std::vector<int32_t> table_;
  cudaStream_t stream_ = nullptr, up_stream_ = nullptr, down_stream_ = nullptr;
  cudaStream_t score_stream_ = nullptr, sel_stream_ = nullptr;  // = stream_ with --cache-streams 1
  cudaEvent_t uploaded_ = nullptr;
};

/// The link of a rank measured alone (--modes solo): send and receive enqueue nothing and complete at once, so the
/// rank runs at the speed it would have with its peer on another GPU that is never late and a link that costs
/// nothing. It counts the bytes it was asked to move.
class NullLink : public GpuLink {
 public:
  NullLink(PairRole role, int device) : role_(role), device_(device) {}
  void send(const void* buf, size_t bytes, cudaStream_t, const char* what, std::chrono::milliseconds) override {
    SPADE_CHECK(buf != nullptr && bytes > 0, "null link: empty send of {}", what);
    ++c_.sends;
    c_.bytes_sent += bytes;
  }
  void recv(void* buf, size_t bytes, cudaStream_t, const char* what, std::chrono::milliseconds) override {
    SPADE_CHECK(buf != nullptr && bytes > 0, "null link: empty receive of {}", what);
    ++c_.recvs;
    c_.bytes_received += bytes;
  }
  void abort(const std::string& reason) override {
    if (failure_.empty()) failure_ = reason;
  }
  bool failed() const override { return !failure_.empty(); }
  std::string failure() const override { return failure_; }
  void on_failure(std::function<void(const std::string&)>) override {}
  GpuLinkCounters counters() const override { return c_; }
  size_t in_flight() const override { return 0; }
  PairRole role() const override { return role_; }
  int device() const override { return device_; }
  const std::string& peer_name() const override { return peer_; }

 private:
  PairRole role_;
  int device_;
  GpuLinkCounters c_;
  std::string failure_;
  std::string peer_ = "no peer (rank measured alone)";
};

/// The pair's link ends, made on the two ranks' threads. NCCL (two GPUs): one CTA for the qkv rows (~100 KB per
/// pack) and at most `nccl_ctas` for the selected K/V (0 = NCCL default); both ends construct concurrently.
/// CUDA IPC (one GPU): the inference end creates, the cache end opens what it created.
struct LinkPair {
  bool ipc = false;
  bool null_links = false;  // solo runs: NullLink ends
  int nccl_ctas = 0;
  int cache_device = 1;     // the cache end's GPU (peer names)
  int shard = 0;            // the cache rank's index (peer names)
  std::string nccl_address;
  std::unique_ptr<GpuLink> end[2];  // [0] inference, [1] cache
  std::atomic<GpuLink*> live[2] = {nullptr, nullptr};  // for aborting the other thread's end on failure
  std::mutex mu;
  std::condition_variable cv;
  std::string ipc_address;  // set by the inference end once created

  void make(PairRole role, int device) {
    const int i = static_cast<int>(role);
    if (null_links) {
      end[i] = std::make_unique<NullLink>(role, device);
      live[i] = end[i].get();
      return;
    }
    const std::string peer = role == PairRole::kInference
                                 ? fmt::format("cache rank {} (GPU {})", shard, cache_device)
                                 : "inference rank (GPU 0)";
    if (!ipc) {
      NcclLinkOptions lo;
      lo.device = device;
      lo.max_ctas_up = 1;
      lo.max_ctas_down = nccl_ctas;
      end[i] = std::make_unique<NcclLink>(nccl_address, role, peer, lo);
    } else if (role == PairRole::kInference) {
      CudaIpcLinkOptions lo;
      lo.device = device;
      lo.chunk_bytes = size_t{16} << 20;
      auto l = CudaIpcLink::create(peer, lo);
      CudaIpcLink* raw = l.get();
      end[i] = std::move(l);
      {
        std::lock_guard lk(mu);
        ipc_address = raw->address();
      }
      cv.notify_all();
      raw->connect();
    } else {
      std::unique_lock lk(mu);
      SPADE_CHECK(cv.wait_for(lk, std::chrono::seconds(60), [&] { return !ipc_address.empty(); }),
                  "cache rank: the inference end made no CUDA IPC link within 60 s");
      const std::string a = ipc_address;
      lk.unlock();
      CudaIpcLinkOptions lo;
      lo.device = device;
      end[i] = CudaIpcLink::open(a, peer, lo);
    }
    live[i] = end[i].get();
  }
};

/// Which rank a solo run measures (--modes solo): each alone on GPU 0 with a NullLink, the other not running.
enum class Solo { kNone, kInference, kCache };

/// One async run: the inference rank on GPU 0 and `shards` cache ranks on GPUs 1..shards (GPU 0 with ipc or solo,
/// which take one cache rank only). Returns the result row; a cache rank whose KV does not fit its GPU's free memory
/// gives a "skipped" row (with the bytes it needs) instead of an allocation failure.
json run_async(const Opts& o, const ModelConfig& cfg, GpuModel& model, int pack, int delta_cap, bool ipc,
               double copy_gbps, Solo solo = Solo::kNone, int shards = 1) {
  const Plan plan(o, cfg);
  AsyncShared sh;
  SPADE_CHECK(shards >= 1 && (shards == 1 || (!ipc && solo == Solo::kNone)),
              "--cache-ranks {}: more than one cache rank needs the NCCL link and a GPU each (not --link ipc or solo)",
              shards);
  sh.P = pack;
  sh.packs = (cfg.num_layers + pack - 1) / pack;
  sh.up_bytes_pack = static_cast<size_t>(pack) * o.batch * (cfg.q_dim() + 2 * cfg.kv_dim()) * 2;
  sh.down_bytes_layer = static_cast<size_t>(o.batch) * cfg.num_kv_heads * o.budget() * cfg.head_dim * 2 * 2;
  sh.cap = delta_cap;
  sh.rows_pack = static_cast<size_t>(pack) * o.batch * cfg.num_kv_heads;
  if (delta_cap > 0) {
    SPADE_CHECK(delta_cap <= o.budget() && o.budget() <= kernels::kMaxDeltaBudget,
                "--delta-capacity {} must be <= --budget {} <= {}", delta_cap, o.budget(), kernels::kMaxDeltaBudget);
    sh.delta = DeltaLayout(sh.rows_pack, delta_cap, cfg.head_dim);
    sh.init = DeltaLayout(sh.rows_pack, o.budget(), cfg.head_dim);
  }
  sh.shards = shards;
  sh.cache_devices.clear();
  for (int s = 0; s < shards; ++s) sh.cache_devices.push_back(ipc || solo != Solo::kNone ? 0 : 1 + s);
  SPADE_CHECK(sh.packs >= shards, "--cache-ranks {} needs at least as many layer packs: {} layers in packs of {} "
              "make {}", shards, cfg.num_layers, pack, sh.packs);
  if (solo == Solo::kCache) sh.up_variants = 8;
  // Each cache rank's KV pool (its packs' layers, every page of every sequence) must fit its GPU: a batch whose KV
  // outgrows the cache GPUs is reported with the bytes it needs, not run.
  const double layer_kv = 2.0 * plan.full_pages() * o.page_size * cfg.num_kv_heads * cfg.head_dim * 2.0;
  std::vector<double> shard_kv;
  for (int s = 0; s < shards; ++s) {
    const double layers = static_cast<double>(pair::shard_layers(s, shards, cfg.num_layers, pack).size());
    int own = 0;
    for (int p = 0; p < sh.packs; ++p) own += sh.shard(p) == s ? 1 : 0;
    shard_kv.push_back(layer_kv * layers);
    if (solo == Solo::kInference) continue;
    // Its largest buffers: the pool, the int8 scoring keys (D + 4 bytes per key), the send buffers of its packs;
    // 2 GB for the rest (windows, scores, mirrors).
    const double int8_keys = o.selection.score_keys == kernels::ScoreKeys::kInt8
                                 ? layer_kv * layers / 2 * (cfg.head_dim + 4.0) / (2.0 * cfg.head_dim)
                                 : 0.0;
    const double need = layer_kv * layers + int8_keys + own * (2.0 * sh.down_bytes(1) + (sh.cap > 0 ? sh.init.bytes : 0));
    size_t free_b = 0, total_b = 0;
    cuda_check(cudaSetDevice(sh.cache_devices[static_cast<size_t>(s)]), "cudaSetDevice (cache rank)");
    cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    if (need + 2e9 > static_cast<double>(free_b)) {
      cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
      const std::string why = fmt::format("cache rank {} does not fit GPU {}: its KV of {} of {} layers is {:.1f} GB, "
                                          "{:.1f} GB with its scoring keys and send buffers ({:.1f} GB free of {:.1f})",
                                          s, sh.cache_devices[static_cast<size_t>(s)], layers, cfg.num_layers,
                                          layer_kv * layers / 1e9, need / 1e9, free_b / 1e9, total_b / 1e9);
      std::printf("  async P=%d C=%d cache ranks %d: skipped: %s\n", pack, delta_cap, shards, why.c_str());
      return {{"label", o.label}, {"mode", delta_cap > 0 ? "async-delta" : "async"}, {"pack", pack},
              {"delta_capacity", delta_cap}, {"cache_ranks", shards}, {"batch", o.batch}, {"context", o.context},
              {"score_keys", kernels::score_keys_name(o.selection.score_keys)},
              {"kv_bytes_per_cache_rank", shard_kv}, {"kv_bytes_all_layers", layer_kv * cfg.num_layers},
              {"cache_gpu_total_bytes", static_cast<double>(total_b)}, {"skipped", why}};
    }
  }
  cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
  std::vector<std::unique_ptr<LinkPair>> links;
  for (int s = 0; s < shards; ++s) {
    auto l = std::make_unique<LinkPair>();
    l->ipc = ipc;
    l->null_links = solo != Solo::kNone;
    l->nccl_ctas = delta_cap > 0 ? o.nccl_ctas_delta : o.nccl_ctas;
    l->cache_device = sh.cache_devices[static_cast<size_t>(s)];
    l->shard = s;
    if (!ipc && solo == Solo::kNone) l->nccl_address = NcclLink::new_address();
    links.push_back(std::move(l));
  }
  std::vector<std::unique_ptr<AsyncCacheRank>> caches(static_cast<size_t>(shards));
  std::vector<double> cm, sendms;
  std::vector<double> stage[5];
  // Every kernel's first-use set-up (shared-memory limits, cuBLASLt kernels for these row counts) before the ranks
  // start: a first launch may synchronise the context, i.e. wait for the other rank's pending receive in this
  // process (the serving path's GpuEngineForward::warm_up does the same).
  cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
  cuda_check(kernels::prepare_decode_attention_kernels(), "prepare attention kernels");
  cuda_check(kernels::prepare_selection_kernels(), "prepare selection kernels");
  model.warm_up_gemms(nullptr);
  cuda_check(cudaDeviceSynchronize(), "warm-up");
  // Graph mode: the inference side captures its graphs before the cache rank posts its first operation (a capture
  // may synchronise the context, i.e. wait for a pending receive of the other rank in this process).
  std::atomic<bool> captured{false};
  std::vector<std::thread> cache_threads;
  for (int s = 0; s < shards && solo != Solo::kInference; ++s) {
    cache_threads.emplace_back([&, s] {
      const int dev = sh.cache_devices[static_cast<size_t>(s)];
      try {
        cuda_check(cudaSetDevice(dev), "cudaSetDevice (cache rank)");
        cuda_check(kernels::prepare_selection_kernels(), "prepare selection kernels (cache rank)");
        cuda_check(kernels::prepare_decode_attention_kernels(), "prepare attention kernels (cache rank)");
        LinkPair& lp = *links[static_cast<size_t>(s)];
        lp.make(PairRole::kCache, dev);
        caches[static_cast<size_t>(s)] = std::make_unique<AsyncCacheRank>(cfg, o, sh, *lp.end[1], plan, s);
        while (!captured.load() && !sh.failed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (sh.failed.load()) return;
        caches[static_cast<size_t>(s)]->run();
      } catch (const std::exception& e) {
        sh.fail(fmt::format("cache rank {} (GPU {}): {}", s, dev, e.what()));
      }
    });
  }
  json r;
  std::vector<double> tpot, stalls, infer;
  int stall_count = 0;
  try {
    if (solo == Solo::kCache) captured = true;  // the cache rank alone
    if (solo != Solo::kCache) {
      cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
      std::vector<GpuLink*> link_ends;
      for (auto& l : links) {  // in shard order; each cache rank's thread makes its end concurrently
        l->make(PairRole::kInference, 0);
        link_ends.push_back(l->end[0].get());
      }
      GpuKvPool local(cfg.num_layers, plan.window_pages(), o.page_size, cfg.num_kv_heads, cfg.head_dim);
      cudaStream_t stream;
      cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      local.fill_random(o.seed + 17, 1.f, stream);
      AsyncInferenceAttention attn(cfg, o, sh, link_ends, plan.total_steps);
      if (solo == Solo::kInference) attn.fill_solo_messages();
      GpuStepBuffers buffers(o.batch, o.batch, plan.max_pages, o.batch, plan.window_pages());
      DeviceBuffer tokens_out(static_cast<size_t>(o.batch) * 4, "sampled tokens");
      const std::vector<int32_t> table = plan.window_table();
      EventGrid ends(plan.total_steps, 1);
      auto body = [&](const GpuBatch& b, cudaStream_t st) {
        model.forward(b, local, attn, st);
        model.argmax(o.batch, tokens_out.as<int32_t>(), st);
      };
      // Graph mode: step 0 reads the first selection's buffers and runs eagerly; steps t >= 1 replay graph[t % 2]
      // (the receive buffers of parity t % 2), both captured and uploaded here, before the cache rank starts. Eager
      // mode captures them too, unused: the capture runs every launcher's first-use set-up (e.g. shared-memory
      // limits) before the cache rank posts anything (an eager-only run stalled at its first step without it).
      GpuGraph graphs[2];
      {
        attn.set_graph_mode(o.async_graphs);
        for (int t : {1, 2}) {
          const GpuBatch b = buffers.upload(plan.step(t, table), stream);
          attn.set_step(t);
          attn.set_capturing(true);
          graphs[t % 2].capture(stream, [&](cudaStream_t st) { body(b, st); });
          attn.set_capturing(false);
          graphs[t % 2].upload(stream);
        }
        cuda_check(cudaStreamSynchronize(stream), "graph upload");
        captured = true;
      }
      attn.post_recvs(0);
      for (int t = 0; t < plan.total_steps; ++t) {
        SPADE_CHECK(!sh.failed.load(), "{}", sh.first_error());
        const GpuBatch b = buffers.upload(plan.step(t, table), stream);
        attn.set_step(t);
        if (o.async_graphs && t >= 1) {
          graphs[t % 2].launch(stream);
          attn.ship(t);
        } else {
          body(b, stream);
        }
        cuda_check(cudaEventRecord(ends(t, 0), stream), "record");
        if (t + 1 <= plan.total_steps) attn.post_recvs(t + 1);
        cuda_check(cudaEventSynchronize(ends(t, 0)), "step sync");
        attn.collect(t);
      }
      cuda_check(cudaDeviceSynchronize(), "drain");
      for (int t = o.warmup; t < plan.total_steps; ++t) {
        tpot.push_back(elapsed_ms(ends(t - 1, 0), ends(t, 0)));
        for (int p = 0; p < sh.packs; ++p) {
          double s = 0, i = 0;
          attn.pack_times(t, p, &s, &i);
          stalls.push_back(s);
          infer.push_back(i);
          if (s > 0.020) ++stall_count;
        }
      }
      cuda_check(cudaStreamDestroy(stream), "stream");
    }
  } catch (const std::exception& e) {
    sh.fail(std::string("inference rank (GPU 0): ") + e.what());
  }
  if (sh.failed.load()) {
    // Unblock the peers: fail every end (a cache rank's watchdog would do it after op_timeout).
    for (auto& lp : links)
      for (auto& l : lp->live)
        if (GpuLink* p = l.load(); p != nullptr) p->abort(sh.first_error());
  }
  for (auto& t : cache_threads) t.join();
  SPADE_CHECK(!sh.failed.load(), "async run failed: {}", sh.first_error());
  std::vector<double> cache_step;  // solo cache rank: ms per step (between the last packs' ends)
  std::vector<unsigned long long> dt(kernels::kDeltaTotalsFields, 0ull);
  std::vector<double> pool_bytes;  // each cache rank's KV pool
  if (caches[0] != nullptr) {
    for (int t = o.warmup; t < plan.total_steps; ++t) {
      for (int p = 0; p < sh.packs; ++p) {
        double c = 0, s = 0, st5[5];
        caches[static_cast<size_t>(sh.shard(p))]->pack_times(t, p, &c, &s, st5);
        cm.push_back(c);
        sendms.push_back(s);
        for (int i = 0; i < 5; ++i) stage[i].push_back(st5[i]);
      }
      cache_step.push_back(caches[0]->step_ms(t));
    }
    for (auto& c : caches) {
      const std::vector<unsigned long long> d = c->delta_totals();
      for (size_t i = 0; i < dt.size(); ++i) dt[i] += d[i];
      pool_bytes.push_back(static_cast<double>(c->pool_bytes()));
    }
  }
  for (int s = 0; s < shards; ++s) {
    cuda_check(cudaSetDevice(sh.cache_devices[static_cast<size_t>(s)]), "cudaSetDevice (cache rank)");
    caches[static_cast<size_t>(s)].reset();
  }
  GpuLinkCounters lc;
  for (auto& lp : links) {
    if (lp->end[0] != nullptr) {
      const GpuLinkCounters c = lp->end[0]->counters();
      lc.bytes_sent += c.bytes_sent;
      lc.bytes_received += c.bytes_received;
    } else if (lp->end[1] != nullptr) {  // the cache rank alone: its sends are the down bytes
      const GpuLinkCounters c = lp->end[1]->counters();
      lc.bytes_sent += c.bytes_received;
      lc.bytes_received += c.bytes_sent;
    }
  }
  // Both ends of every link tear down concurrently (as separate processes would).
  std::vector<std::thread> closers;
  for (int s = 0; s < shards; ++s)
    closers.emplace_back([&, s] {
      cudaSetDevice(sh.cache_devices[static_cast<size_t>(s)]);
      links[static_cast<size_t>(s)]->end[1].reset();
    });
  cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
  for (auto& lp : links) lp->end[0].reset();
  for (auto& t : closers) t.join();
  cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");

  std::string mode = delta_cap > 0 ? "async-delta" : "async";
  if (solo == Solo::kInference) mode = delta_cap > 0 ? "solo-inference-delta" : "solo-inference";
  if (solo == Solo::kCache) mode = delta_cap > 0 ? "solo-cache-delta" : "solo-cache";
  if (solo != Solo::kInference && o.selection.score_keys == kernels::ScoreKeys::kInt8) mode += "-int8";
  // A solo cache rank has no TPOT: its row's "TPOT" is its time per step (the step rate it can sustain).
  r = result_row(o, cfg, mode, solo == Solo::kCache ? cache_step : tpot);
  if (solo != Solo::kNone)
    r["solo"] = solo == Solo::kCache
                    ? "the cache rank alone on GPU 0 (null link): tpot_* = its time per step (last packs' ends)"
                    : "the inference rank alone on GPU 0 (null link: every selection is there when asked for)";
  r["pack"] = pack;
  r["cuda_graph"] = o.async_graphs;
  r["link"] = solo != Solo::kNone ? "none (rank alone)"
              : ipc                 ? "cuda_ipc (both ranks on GPU 0: checks the pipeline, not its speed)"
                                    : "nccl";
  if (!ipc && solo == Solo::kNone) r["nccl_max_ctas"] = links[0]->nccl_ctas;
  r["cache_ranks"] = shards;
  r["cache_gpus"] = sh.cache_devices;
  r["kv_bytes_all_layers"] = layer_kv * cfg.num_layers;  // the KV pool one cache rank would hold
  r["kv_bytes_per_cache_rank"] = shard_kv;
  if (!pool_bytes.empty()) r["kv_pool_bytes_per_cache_rank"] = pool_bytes;
  r["packs"] = sh.packs;
  r["link_bytes_up_measured"] = lc.bytes_sent;        // whole run, incl. warm-up
  r["link_bytes_down_measured"] = lc.bytes_received;
  const double down_pack = static_cast<double>(sh.down_bytes(1));
  const double full_pack = static_cast<double>(sh.P) * sh.down_bytes_layer;
  const Stats inf = stats(infer), cms = stats(cm), snd = stats(sendms), st = stats(stalls);
  r["inference_ms_per_pack"] = inf.median;
  r["cache_ms_per_pack"] = cms.median;
  r["send_ms_per_pack"] = snd.median;
  const char* stage_names[5] = {"append", "predict", "score", "topk", "gather"};
  json stages;
  for (int i = 0; i < 5; ++i) stages[stage_names[i]] = stats(stage[i]).median;
  r["cache_stage_ms_per_pack"] = stages;
  r["bytes_up_per_step"] = static_cast<double>(sh.up_bytes_pack) * sh.packs;
  r["bytes_down_per_step"] = down_pack * sh.packs;
  r["bytes_down_per_step_full_transfer"] = full_pack * sh.packs;
  r["required_gbps"] = down_pack / (inf.median * 1e6);
  r["achieved_gbps"] = down_pack / (snd.median * 1e6);
  r["stalls"] = stall_count;
  r["stall_checks"] = static_cast<int>(stalls.size());
  r["stall_ms_median"] = st.median;
  r["stall_ms_p99"] = st.p99;
  r["weight_bytes"] = model.decode_weight_bytes(o.batch);
  // Each rank's floor at the measured copy bandwidth. Inference rank: the weights a decode step reads, plus the
  // selected and local-window KV it attends. Cache rank: every selectable key read once to score it, plus the
  // selected K/V it gathers. The slower of the two bounds the pipelined step.
  const double floor_bytes = model.decode_weight_bytes(o.batch) + kv_bytes(cfg, o, o.budget() + o.local_window());
  r["floor_bytes"] = floor_bytes;
  r["floor_ms"] = floor_bytes / (copy_gbps * 1e6);
  r["tpot_over_floor"] = r["tpot_median_ms"].get<double>() / r["floor_ms"].get<double>();
  // Keys scored: bf16 K (half of kv_bytes), or the int8 copy: D + 4 bytes per (token, KV head) instead of 2 D.
  const bool int8_keys = o.selection.score_keys == kernels::ScoreKeys::kInt8;
  const double score_bytes = kv_bytes(cfg, o, o.context + o.warmup + o.steps / 2.0) / 2 *
                             (int8_keys ? (cfg.head_dim + 4.0) / (2.0 * cfg.head_dim) : 1.0);
  r["score_keys"] = kernels::score_keys_name(o.selection.score_keys);
  r["score_bytes_per_step"] = score_bytes;
  // Per cache rank: the keys of its layers and the selections of its packs, each at its own GPU's bandwidth; the
  // slowest cache rank is the cache side's floor.
  std::vector<double> rank_floor_ms;
  double cache_floor_bytes = 0;
  for (int s = 0; s < shards; ++s) {
    const double lay = static_cast<double>(pair::shard_layers(s, shards, cfg.num_layers, pack).size());
    int own = 0;
    for (int p = 0; p < sh.packs; ++p) own += sh.shard(p) == s ? 1 : 0;
    const double b = score_bytes * lay / cfg.num_layers + down_pack * own;
    rank_floor_ms.push_back(b / (copy_gbps * 1e6));
    cache_floor_bytes = std::max(cache_floor_bytes, b);
  }
  r["cache_floor_bytes"] = cache_floor_bytes;  // of the cache rank with the most to read
  r["cache_floor_ms"] = cache_floor_bytes / (copy_gbps * 1e6);
  r["cache_floor_ms_per_rank"] = rank_floor_ms;
  r["bound_by"] = r["cache_floor_ms"].get<double>() > r["floor_ms"].get<double>() ? "cache rank" : "inference rank";
  if (delta_cap > 0 && solo != Solo::kInference) {
    // Per (layer, sequence, KV head) row over the timed steps: how many tokens entered the selection, how many the
    // capacity let through, and the fraction of a full transfer's rows sent. Random weights make the selection churn
    // far more than a trained model's (docs/ARCHITECTURE.md: ~1 of 16-64 tokens per step on stories260K), so this is
    // the worst case for the capacity; the TPOT does not depend on it (the message size is fixed).
    const double selected = static_cast<double>(dt[kernels::kDeltaCount]);
    json d;
    d["capacity"] = delta_cap;
    d["selected_rows"] = dt[kernels::kDeltaCount];
    d["entering_rows"] = dt[kernels::kDeltaEntering];
    d["sent_rows"] = dt[kernels::kDeltaEntries];
    d["holes"] = dt[kernels::kDeltaHoles];
    d["refused_rows"] = dt[kernels::kDeltaTotalsFields - 1];
    d["entering_fraction"] = selected > 0 ? dt[kernels::kDeltaEntering] / selected : 0.0;
    d["unsent_entering_fraction"] =
        dt[kernels::kDeltaEntering] > 0
            ? 1.0 - static_cast<double>(dt[kernels::kDeltaEntries]) / static_cast<double>(dt[kernels::kDeltaEntering])
            : 0.0;
    d["bytes_ratio_to_full_transfer"] = down_pack / full_pack;
    r["delta"] = d;
    SPADE_CHECK(dt[kernels::kDeltaTotalsFields - 1] == 0, "selection_delta refused {} rows (mirror out of sync)",
                dt[kernels::kDeltaTotalsFields - 1]);
    // Attention reads slots [0, n) of the held tables: an empty one (a hole) would be read as garbage. The first
    // selection goes in full and n grows by at most one per step, so there must be none.
    SPADE_CHECK(dt[kernels::kDeltaHoles] == 0, "delta transfer left {} holes in the held tables",
                dt[kernels::kDeltaHoles]);
  }
  if (solo == Solo::kInference) {  // no cache rank, no link: no cache, send or link-rate figures
    for (const char* k : {"cache_ms_per_pack", "send_ms_per_pack", "cache_stage_ms_per_pack", "required_gbps",
                          "achieved_gbps", "link_bytes_up_measured", "link_bytes_down_measured", "cache_floor_bytes",
                          "cache_floor_ms", "cache_floor_ms_per_rank", "bound_by"})
      r.erase(k);
    std::printf("  %-20s %-5s P=%-3d TPOT median %8.3f ms  p99 %8.3f ms  floor %7.3f ms (%.2fx) | per pack: infer %.3f ms"
                " | down %.1f MB/step\n",
                mode.c_str(), o.async_graphs ? "graph" : "eager", pack, r["tpot_median_ms"].get<double>(),
                r["tpot_p99_ms"].get<double>(), r["floor_ms"].get<double>(), r["tpot_over_floor"].get<double>(),
                inf.median, down_pack * sh.packs / 1e6);
    return r;
  }
  if (solo == Solo::kCache) {
    for (const char* k : {"floor_bytes", "floor_ms", "tpot_over_floor", "required_gbps", "achieved_gbps", "stalls",
                          "stall_checks", "stall_ms_median", "stall_ms_p99", "inference_ms_per_pack", "bound_by"})
      r.erase(k);  // no inference rank: its floor, stalls and link rates do not apply
    std::printf("  %-20s       P=%-3d step  median %8.3f ms  p99 %8.3f ms  floor %7.3f ms (%.2fx; keys scored + "
                "selection gathered) | per pack: cache %.3f ms | down %.1f MB/step\n",
                mode.c_str(), pack, r["tpot_median_ms"].get<double>(), r["tpot_p99_ms"].get<double>(),
                r["cache_floor_ms"].get<double>(),
                r["tpot_median_ms"].get<double>() / r["cache_floor_ms"].get<double>(), cms.median,
                down_pack * sh.packs / 1e6);
  } else {
    std::printf("  %-11s %-5s P=%-3d N=%d TPOT median %8.3f ms  p99 %8.3f ms  floors: inference %7.3f ms (%.2fx), "
                "cache %7.3f ms, bound by the %s | per pack: infer %.3f ms, cache %.3f ms, send %.3f ms | down %.1f "
                "MB/step, need %.0f GB/s, got %.0f GB/s | stalls %d/%d\n",
                mode.c_str(), o.async_graphs ? "graph" : "eager", pack, shards, r["tpot_median_ms"].get<double>(),
                r["tpot_p99_ms"].get<double>(), r["floor_ms"].get<double>(), r["tpot_over_floor"].get<double>(),
                r["cache_floor_ms"].get<double>(), r["bound_by"].get<std::string>().c_str(), inf.median, cms.median,
                snd.median, down_pack * sh.packs / 1e6, r["required_gbps"].get<double>(),
                r["achieved_gbps"].get<double>(), stall_count, static_cast<int>(stalls.size()));
  }
  // With three streams a stage's interval also holds its wait behind the other packs' stages on that stream: only
  // the step time and TPOT are then the pipeline's; --cache-streams 1 gives the stages' own times.
  r["cache_stage_times"] = o.cache_streams == 1 ? "serial: each stage's own time"
                                                : "pipelined (3 streams): intervals include queueing behind other packs";
  std::printf("              cache stages per pack (ms)%s: append %.3f predict %.3f score %.3f topk %.3f gather %.3f\n",
              o.cache_streams == 1 ? "" : " [3 streams: queue-inclusive]", stages["append"].get<double>(),
              stages["predict"].get<double>(), stages["score"].get<double>(), stages["topk"].get<double>(),
              stages["gather"].get<double>());
  if (delta_cap > 0)
    std::printf("              delta: capacity %d, %.1f%% of the selection entered per step, %.1f%% of those not sent, "
                "%.1f%% of the full transfer's bytes\n",
                delta_cap, 100.0 * r["delta"]["entering_fraction"].get<double>(),
                100.0 * r["delta"]["unsent_entering_fraction"].get<double>(), 100.0 * down_pack / full_pack);
  return r;
}

std::vector<kernels::ScoreKeys> parse_score_keys_list(const std::string& s) {
  std::vector<kernels::ScoreKeys> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(kernels::parse_score_keys(x.c_str()));
  SPADE_CHECK(!v.empty(), "--score-keys: give bf16, int8 or both (bf16,int8)");
  return v;
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(std::stoi(x));
  return v;
}

int main_impl(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      SPADE_CHECK(i + 1 < argc, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--config") o.config = next();
    else if (a == "--label") o.label = next();
    else if (a == "--out") o.out = next();
    else if (a == "--modes") o.modes = next();
    else if (a == "--packs") o.packs = parse_ints(next());
    else if (a == "--batch") o.batch = std::stoi(next());
    else if (a == "--context") o.context = std::stoi(next());
    else if (a == "--budget") o.selection.token_budget = std::stoi(next());
    else if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--local-window") o.selection.local_window = std::stoi(next());
    else if (a == "--nccl-ctas") o.nccl_ctas = std::stoi(next());
    else if (a == "--nccl-ctas-delta") o.nccl_ctas_delta = std::stoi(next());
    else if (a == "--delta-capacity") o.delta_capacities = parse_ints(next());
    else if (a == "--score-keys") o.score_keys = parse_score_keys_list(next());
    else if (a == "--link") o.link = next();
    else if (a == "--async-graphs") o.async_graphs = std::stoi(next()) != 0;
    else if (a == "--cache-streams") o.cache_streams = std::stoi(next());
    else if (a == "--predictor") o.selection.predictor = kernels::parse_predictor_kind(next().c_str());
    else if (a == "--ridge-eps") o.selection.ridge_eps = std::stof(next());
    else if (a == "--successor-expand") o.selection.successor_expand = std::stoi(next()) != 0;
    else if (a == "--cache-ranks") {
      o.cache_ranks = parse_ints(next());
      o.cache_ranks_set = true;
    }
    else fail("unknown argument {} (see the header of bench/bench_tpot.cpp)", a);
  }
  SPADE_CHECK(!o.config.empty(), "--config DIR (a config.json directory) is required");
  SPADE_CHECK(o.warmup >= 1 && o.steps >= 2, "--warmup >= 1 and --steps >= 2");
  SPADE_CHECK(o.cache_streams == 1 || o.cache_streams == 3, "--cache-streams {}: 1 or 3", o.cache_streams);
  for (int n : o.cache_ranks) SPADE_CHECK(n >= 1, "--cache-ranks {}: each entry must be >= 1", n);
  // --cache-ranks applies to the async mode only (dense / oracle run on one GPU; solo measures one cache rank).
  SPADE_CHECK(!o.cache_ranks_set || (o.modes.find("async") != std::string::npos && o.modes.find("solo") == std::string::npos),
              "--cache-ranks applies to --modes async only (got --modes {})", o.modes);
  SPADE_CHECK(!o.cache_ranks_set || o.link != "ipc", "--cache-ranks: --link ipc runs one cache rank on GPU 0");
  pair::validate(o.selection);  // names the setting: budget, local window, ridge eps
  SPADE_CHECK(std::isfinite(o.selection.ridge_eps), "--ridge-eps {} must be finite", o.selection.ridge_eps);
  const ModelConfig cfg = load_model_config(o.config);
  SPADE_CHECK(!cfg.is_hybrid(), "bench_tpot runs dense decoders (the pipeline ships every layer's q|k|v rows); '{}' "
              "has Gated DeltaNet layers", cfg.model_type);
  if (o.label.empty()) o.label = cfg.model_type;
  int ngpu = 0;
  cuda_check(cudaGetDeviceCount(&ngpu), "cudaGetDeviceCount");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, 0), "device properties");
  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  const double copy_gbps = measure_copy_gbps();
  std::printf("%s: %s x%d, copy %.0f GB/s; %s batch %d context %d budget %d window %d, %d+%d steps\n",
              o.label.c_str(), prop.name, ngpu, copy_gbps, cfg.model_type.c_str(), o.batch, o.context, o.budget(),
              o.local_window(), o.warmup, o.steps);
  GpuModelOptions mo;
  mo.max_tokens = o.batch;
  mo.max_logit_rows = o.batch;
  auto model = GpuModel::random(cfg, o.seed, mo);
  std::printf("  weights %.2f GB\n", model->weight_bytes() / 1e9);
  std::vector<json> rows;
  bool any_failed = false;  // an async run failed: reported in the rows, and the exit status is 1
  auto has = [&](const char* m) { return o.modes.find(m) != std::string::npos; };
  for (const char* m : {"dense", "oracle"}) {
    if (!has(m)) continue;
    try {
      for (auto& r : run_single_gpu(o, cfg, *model, m, copy_gbps)) rows.push_back(r);
    } catch (const Error& e) {
      // E.g. a batch whose KV outgrows one GPU: the row gives what one GPU would need (weights + every layer's KV).
      const double need = model->weight_bytes() + kv_bytes(cfg, o, o.context + o.warmup + o.steps + 1.0);
      std::printf("  %s: skipped (one GPU would need %.1f GB: weights + KV): %s\n", m, need / 1e9, e.what());
      rows.push_back({{"label", o.label}, {"mode", m}, {"skipped", e.what()}, {"one_gpu_bytes_needed", need},
                      {"gpu_total_bytes", static_cast<double>(prop.totalGlobalMem)}});
    }
  }
  if (has("async")) {
    const bool ipc = o.link == "ipc" || (o.link == "auto" && ngpu < 2);
    SPADE_CHECK(o.link == "auto" || o.link == "ipc" || o.link == "nccl", "--link {}: auto, nccl or ipc", o.link);
    if (!ipc && ngpu < 2) {
      std::printf("  async: skipped: --link nccl needs two GPUs (found %d)\n", ngpu);
      rows.push_back({{"label", o.label}, {"mode", "async"}, {"skipped", "needs two GPUs"}});
    } else {
      if (ipc)
        std::printf("  async: both ranks on GPU 0 over CudaIpcLink (%d GPU%s): checks the pipeline, not its speed\n",
                    ngpu, ngpu == 1 ? "" : "s");
      for (int N : o.cache_ranks)
        for (int P : o.packs)
          for (int cap : o.delta_capacities)
            for (kernels::ScoreKeys keys : o.score_keys) {
              if (!ipc && N + 1 > ngpu) {  // loudly: a row that says why, not a silent omission
                std::printf("  async N=%d: skipped: %d cache ranks need %d GPUs (found %d)\n", N, N, N + 1, ngpu);
                rows.push_back({{"label", o.label}, {"mode", "async"}, {"cache_ranks", N},
                                {"skipped", fmt::format("needs {} GPUs, found {}", N + 1, ngpu)}});
                continue;
              }
              Opts ok = o;
              ok.selection.score_keys = keys;
              try {  // a failed run (e.g. out of memory with both ranks on one GPU) keeps the rows already measured
                rows.push_back(run_async(ok, cfg, *model, P, cap, ipc, copy_gbps, Solo::kNone, N));
              } catch (const Error& e) {
                std::printf("  async N=%d P=%d C=%d keys %s: failed: %s\n", N, P, cap, kernels::score_keys_name(keys),
                            e.what());
                any_failed = true;
                rows.push_back({{"label", o.label}, {"mode", "async"}, {"cache_ranks", N}, {"pack", P},
                                {"delta_capacity", cap}, {"score_keys", kernels::score_keys_name(keys)},
                                {"failed", e.what()}});
              }
            }
    }
  }
  if (has("solo")) {
    // Each rank alone on GPU 0: what each sustains with the whole GPU to itself, as on two GPUs. The disaggregated
    // TPOT cannot be below the slower of the two; the link's cost (NCCL CTAs on both GPUs, its bandwidth) comes on
    // top, so this is a projection and a lower bound, not a two-GPU measurement.
    auto median_of = [&](const std::string& mode, bool graph) {
      for (const json& x : rows)
        if (x.value("mode", "") == mode && x.value("cuda_graph", !graph) == graph && x.contains("tpot_median_ms"))
          return x["tpot_median_ms"].get<double>();
      return 0.0;
    };
    // Against the baselines timed as the solo inference rank is (graphs or eager: --async-graphs).
    const double dense = median_of("dense", o.async_graphs), oracle = median_of("oracle", o.async_graphs);
    const char* timing = o.async_graphs ? "graph" : "eager";
    for (int P : o.packs)
      for (int cap : o.delta_capacities) {
        const json inf = run_async(o, cfg, *model, P, cap, false, copy_gbps, Solo::kInference);
        rows.push_back(inf);
        for (kernels::ScoreKeys keys : o.score_keys) {
          Opts ok = o;
          ok.selection.score_keys = keys;
          const json cache = run_async(ok, cfg, *model, P, cap, false, copy_gbps, Solo::kCache);
          rows.push_back(cache);
          const char* kn = kernels::score_keys_name(keys);
          const double a = inf["tpot_median_ms"].get<double>(), c = cache["tpot_median_ms"].get<double>();
          json j = {{"label", o.label}, {"mode", cap > 0 ? "solo-projection-delta" : "solo-projection"}, {"pack", P},
                    {"delta_capacity", cap}, {"score_keys", kn}, {"inference_alone_ms", a}, {"cache_alone_ms", c},
                    {"projected_tpot_ms", std::max(a, c)}, {"bound", a >= c ? "inference rank" : "cache rank"},
                    {"note", "max of the two ranks alone on one GPU; a lower bound of the two-GPU TPOT (no link cost)"}};
          std::printf("  projection P=%d%s keys %s: max(inference alone %.3f, cache rank alone %.3f) = %.3f ms "
                      "(%s-bound)",
                      P, cap > 0 ? " delta" : "", kn, a, c, std::max(a, c), a >= c ? "inference" : "cache");
          if (dense > 0) {
            j[std::string("over_dense_") + timing] = std::max(a, c) / dense;
            std::printf(", %.2fx dense %s", std::max(a, c) / dense, timing);
          }
          if (oracle > 0) {
            j[std::string("over_oracle_") + timing] = std::max(a, c) / oracle;
            std::printf(", %.2fx oracle %s", std::max(a, c) / oracle, timing);
          }
          std::printf("\n");
          rows.push_back(j);
        }
      }
  }
  json doc;
  doc["benchmark"] = "bench_tpot";
  doc["device"] = prop.name;
  doc["gpus"] = ngpu;
  bench::stamp_run(doc);
  doc["copy_gbps"] = copy_gbps;
  doc["config"] = o.config;
  doc["label"] = o.label;
  doc["predictor"] = kernels::predictor_kind_name(o.selection.predictor);
  doc["ridge_eps"] = o.selection.ridge_eps;
  doc["successor_expand"] = o.selection.successor_expand;
  doc["timing"] = "TPOT = time between consecutive step-end CUDA events (host gaps included), after warm-up; "
                  "floor = (weight bytes a decode step reads + attended KV bytes) / measured copy bandwidth; async rows also give the cache rank's floor (keys scored + selection gathered) and which rank bounds the step";
  doc["results"] = rows;
  if (!o.out.empty()) {
    std::ofstream f(o.out, std::ios::app);
    f << doc.dump() << "\n";
    std::printf("  appended to %s\n", o.out.c_str());
  }
  return any_failed ? 1 : 0;
}

}  // namespace
}  // namespace spade

int main(int argc, char** argv) {
  // One process, one GPU (--link ipc): the cache rank's and the inference rank's streams wait on each other through
  // stream memory operations, which CUDA's scheduler does not see; streams sharing one of the default 8 hardware
  // queues could then block each other. 32 queues keep every stream of this process on its own (before CUDA starts).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // ... and load every kernel up front: a lazy first launch may synchronise the context, waiting for the other
  // rank's pending receive (cuda_ipc_link.h).
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  try {
    return spade::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tpot: %s\n", e.what());
    return 1;
  }
}

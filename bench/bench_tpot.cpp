// bench_tpot: decode TPOT of a real-shaped model (config.json + deterministic random bf16 weights on the GPU) in
// three modes, the issue-#7 benchmark:
//   dense   full paged attention on one GPU (our split-K flash-decoding), eager and CUDA graph;
//   oracle  synchronous token-level selection with the TRUE query on one GPU, inline in every layer (score every
//           key with q, top-k per KV head, gather, sparse attention over the selection + the local window):
//           TOVA-style selection with exact queries, the upper bound of inline selection;
//   quest   Quest (Tang et al., ICML 2024), the paper's synchronous page-level peer on one GPU, inline in every layer:
//           per-page min / max key summaries kept as pages fill, every page's summary scored with the TRUE query,
//           the best pages whole up to the same token budget gathered and attended with the local window;
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
//                   [--modes dense,oracle,quest,async,solo] [--nccl-ctas 16] [--nccl-ctas-delta 16] [--delta-capacity 0,1024]
//                   [--link auto|nccl|ipc|ipc-peer] [--async-graphs 1|0] [--cache-streams 3|1] [--score-keys bf16,int8]
//                   [--predictor ridge|paper|last] [--ridge-eps E] [--successor-expand 1|0] [--cache-ranks 1,2,3]
//                   [--churn F] [--label NAME] [--out results.json] (appends a JSON document per run).
// --churn F (async / solo): the selection's churn, the share of each steady selection that entered it that step
// (tpot_common.h Opts::churn). Without it the random model's queries make the selection churn almost completely
// (about 0.9 per step), far above a trained model's (docs/FIDELITY.md: about 0.31 on the testbed at 1/16); with
// it a first lossless delta run finds the query process that gives F (row "churn-calibration") and every async
// row runs with it, so a delta capacity's unsent share (row "delta") is the one that churn gives.
// The selection's local window, query window, predictor, ridge eps and successor expansion default to the pair's
// (pair::SelectionConfig, one Opts::selection); the oracle mode's top-k expands successors as the async cache rank's
// does.
// The pieces both kinds of run share are in bench/tpot_common.h, the async pipeline's ranks and links in
// bench/tpot_async.h.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/run_stamp.h"
#include "bench/tpot_async.h"
#include "bench/tpot_common.h"
#include "pair/gpu_plan.h"
#include "pair/sharded_link.h"
#include "cache_rank/selector.h"
#include "common/config.h"
#include "common/error.h"
#include "inference_rank/gpu_model.h"
#include "kernels/attention.cuh"
#include "kernels/selection.cuh"
#include "kernels/tensor_ops.cuh"
#include "transport/cuda_ipc/cuda_ipc_link.h"
#include "transport/nccl/nccl_link.h"

namespace spade::tpot {
namespace {

/// What the synchronous selections with the true query (modes 2 and 2b) share, inline in every layer on the inference
/// GPU: the step's fp32 queries, the selectable and attended lengths, the packed K/V of the selection and its
/// attention with the local window.
class InlineSelectionAttention : public GpuAttention {
 public:
  InlineSelectionAttention(const ModelConfig& cfg, const Opts& o, int score_stride, const char* name)
      : cfg_(cfg), o_(o), sel_(cfg, o, o.batch, score_stride),
        qf_(static_cast<size_t>(o.batch) * cfg.q_dim() * 4, (std::string(name) + " q fp32").c_str()),
        lens_(static_cast<size_t>(o.batch) * 2 * 4, (std::string(name) + " lengths").c_str()),
        packed_(static_cast<size_t>(o.batch) * cfg.num_kv_heads * o.budget() * cfg.head_dim * 2 * 2,
                (std::string(name) + " packed KV").c_str()),
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
    select(s, b, sel_lens, pk, pv, stream);
    packed_attention(cfg_, o_, s, b, pk, pv, num_packed, ws_, stream);
  }

 protected:
  /// Selects with the true queries qf_ among the positions < sel_lens[b] and gathers the selection into packed_k / v
  /// ([batch, Hkv, budget, D] bf16).
  virtual void select(const GpuLayerStep& s, const GpuBatch& b, const int32_t* sel_lens, void* packed_k,
                      void* packed_v, cudaStream_t stream) = 0;
  const ModelConfig& cfg_;
  const Opts& o_;
  Selector sel_;
  DeviceBuffer qf_, lens_, packed_, ws_;
};

/// Mode 2: token-level selection with the true query (score every key, top-k per KV head, gather).
class OracleAttention : public InlineSelectionAttention {
 public:
  OracleAttention(const ModelConfig& cfg, const Opts& o, int score_stride)
      : InlineSelectionAttention(cfg, o, score_stride, "oracle") {}

 private:
  void select(const GpuLayerStep& s, const GpuBatch& b, const int32_t* sel_lens, void* pk, void* pv,
              cudaStream_t stream) override {
    sel_.run(b.batch, qf_.as<float>(), s.k_cache, s.v_cache, b.block_table, b.max_pages, sel_lens, pk, pv, stream);
  }
};

/// Mode 2b: Quest (Tang et al., ICML 2024, Sec. 3), the paper's synchronous page-level peer: the page that just filled
/// gets its min / max summary (quest_page_summaries, 2 rows per page, kept for every page from the first step on),
/// the TRUE query scores every candidate page's summary (quest_select with k_summary; the partial pages at the ends
/// read their keys), the best pages whole up to the budget are gathered and attended with the local window.
class QuestAttention : public InlineSelectionAttention {
 public:
  QuestAttention(const ModelConfig& cfg, const Opts& o, int num_pages, int max_pages)
      : InlineSelectionAttention(cfg, o, 1, "quest"),
        layer_summary_elems_(static_cast<size_t>(num_pages) * 2 * cfg.num_kv_heads * cfg.head_dim),
        summary_(static_cast<size_t>(cfg.num_layers) * layer_summary_elems_ * 2, "quest page summaries"),
        page_scores_(static_cast<size_t>(o.batch) * cfg.num_kv_heads * max_pages * 4, "quest page scores"),
        summarized_(static_cast<size_t>(cfg.num_layers), 0) {}

 private:
  void select(const GpuLayerStep& s, const GpuBatch& b, const int32_t* sel_lens, void* pk, void* pv,
              cudaStream_t stream) override {
    void* summary = summary_.as<uint16_t>() + static_cast<size_t>(s.layer) * layer_summary_elems_;
    kernels::QuestPageSummariesParams sp;
    sp.k_cache = s.k_cache;
    sp.block_table = b.block_table;
    sp.num_tokens = b.seq_lens;
    sp.k_summary = summary;
    sel_.set_geometry(sp, b.batch, b.max_pages);
    // The first step summarizes every full page (the prompt's), each later one the page that just filled.
    sp.pages_back = summarized_[static_cast<size_t>(s.layer)] ? 1 : b.max_pages;
    summarized_[static_cast<size_t>(s.layer)] = 1;
    cuda_check(kernels::quest_page_summaries(sp, stream), "quest page summaries");
    kernels::QuestSelectParams qp;
    qp.q = qf_.as<float>();
    qp.k_cache = s.k_cache;
    qp.k_summary = summary;
    qp.block_table = b.block_table;
    qp.num_tokens = sel_lens;
    qp.page_scores = page_scores_.as<float>();
    qp.indices = sel_.indices.as<int32_t>();
    qp.num_q_heads = cfg_.num_q_heads;
    sel_.set_geometry(qp, b.batch, b.max_pages);
    qp.k = o_.budget();
    qp.rule = o_.selection.gqa_rule;
    cuda_check(kernels::quest_select(qp, stream), "quest_select");
    sel_.gather(b.batch, sel_.indices.as<int32_t>(), o_.budget(), s.k_cache, s.v_cache, b.block_table, b.max_pages,
                pk, pv, stream);
  }
  size_t layer_summary_elems_;
  DeviceBuffer summary_, page_scores_;
  std::vector<char> summarized_;  // per layer: its prompt pages are summarized (host state; graphs replay pages_back 1)
};

/// Modes 1, 2 and 2b on the current GPU: eager and CUDA-graph TPOT.
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
  } else if (mode == "quest") {
    attn = std::make_unique<QuestAttention>(cfg, o, plan.full_pages(), plan.max_pages);
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
    // Quest also reads its page summaries: 2 key rows per page of the context.
    const double summary_bytes = mode == "quest" ? kv_bytes(cfg, o, o.context) / 2 * 2.0 / o.page_size : 0.0;
    const double floor_bytes = model.decode_weight_bytes(o.batch) + kv_bytes(cfg, o, attended) + summary_bytes;
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
  // --link ipc-peer: the CUDA IPC link between GPU 0 and GPU 1 (its rings on GPU 0, the cache rank's copies over
  // peer access by the copy engines: no SM of either GPU moves the bytes).
  const bool ipc_peer = ipc && o.ipc_peer();
  for (int s = 0; s < shards; ++s)
    sh.cache_devices.push_back((ipc && !ipc_peer) || solo != Solo::kNone ? 0 : 1 + s);
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
    // Its largest buffers: the pool, the int8 scoring keys (D + 4 bytes per key), the send buffers of its packs,
    // the scores and windows; 2 GB for the rest (mirrors, tables).
    const double int8_keys = o.selection.score_keys == kernels::ScoreKeys::kInt8
                                 ? layer_kv * layers / 2 * (cfg.head_dim + 4.0) / (2.0 * cfg.head_dim)
                                 : 0.0;
    // Its scores (two scratch sets) and query windows are sized for a pack / every layer.
    const double scratch = 2.0 * pack * o.batch * cfg.num_kv_heads * plan.max_len * 4.0 +
                           2.0 * cfg.num_layers * o.batch * cfg.q_dim() * (o.selection.query_window + 1) * 2.0;
    const double need = layer_kv * layers + int8_keys + scratch +
                        own * (2.0 * sh.down_bytes(1) + (sh.cap > 0 ? sh.init.bytes : 0));
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
  // --churn: the rho the query windows were driven with, and the calibration run's search.
  double query_rho = o.query_rho;
  json churn_calibration;
  if (caches[0] != nullptr) {
    query_rho = caches[0]->query_rho();
    json phases = json::array();
    for (const auto& [rho, churn] : caches[0]->churn_phases()) phases.push_back({{"rho", rho}, {"churn", churn}});
    churn_calibration["phases"] = phases;
    if (o.calibrate_churn && !caches[0]->entering_per_row().empty()) {
      // Tokens entering one (layer, sequence, KV head) row per step, as shares of the budget: a delta capacity of
      // at least the largest sends every entering token the step it enters at this churn.
      std::vector<double> e;
      for (int x : caches[0]->entering_per_row()) e.push_back(static_cast<double>(x) / o.budget());
      std::sort(e.begin(), e.end());
      auto q = [&](double f) { return e[std::min(e.size() - 1, static_cast<size_t>(f * (e.size() - 1) + 0.5))]; };
      churn_calibration["entering_per_row_over_budget"] = {{"rows", e.size()}, {"p50", q(0.5)}, {"p90", q(0.9)},
                                                           {"p99", q(0.99)}, {"p999", q(0.999)}, {"max", e.back()}};
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
              : ipc_peer            ? "cuda_ipc over peer access (rings on GPU 0, copy engines, cache rank on GPU 1)"
              : ipc                 ? "cuda_ipc (both ranks on GPU 0: checks the pipeline, not its speed)"
                                    : "nccl";
  if (!ipc && solo == Solo::kNone) r["nccl_max_ctas"] = links[0]->nccl_ctas;
  r["cache_ranks"] = shards;
  r["cache_gpus"] = sh.cache_devices;
  r["churn_target"] = o.churn;  // 0: the random model's own queries
  r["query_rho"] = query_rho;
  if (o.calibrate_churn) r["churn_calibration"] = churn_calibration;
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
    else if (a == "--churn") o.churn = std::stod(next());
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
  SPADE_CHECK(!o.cache_ranks_set || (o.link != "ipc" && !o.ipc_peer()),
              "--cache-ranks: --link ipc / ipc-peer run one cache rank");
  SPADE_CHECK(o.churn == 0 || (o.churn > 0 && o.churn < 1), "--churn {}: a share of the selection in (0, 1)",
              o.churn);
  // --churn drives the cache rank's query windows: async and solo only; its calibration is a lossless delta run.
  SPADE_CHECK(o.churn == 0 || o.modes.find("async") != std::string::npos || o.modes.find("solo") != std::string::npos,
              "--churn applies to --modes async or solo (the cache rank's queries); got --modes {}", o.modes);
  SPADE_CHECK(o.churn == 0 || o.budget() <= kernels::kMaxDeltaBudget,
              "--churn is calibrated with delta transfer: --budget {} must be <= {}", o.budget(),
              kernels::kMaxDeltaBudget);
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
  for (const char* m : {"dense", "oracle", "quest"}) {
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
  const bool ipc = o.link == "ipc" || o.ipc_peer() || (o.link == "auto" && ngpu < 2);
  SPADE_CHECK(o.link == "auto" || o.link == "ipc" || o.link == "nccl" || o.link == "ipc-peer",
              "--link {}: auto, nccl, ipc or ipc-peer", o.link);
  SPADE_CHECK(!o.ipc_peer() || ngpu >= 2, "--link ipc-peer needs two GPUs (found {})", ngpu);
  if (o.churn > 0) {
    // One lossless delta run (capacity = budget: every entering token is sent, so the held tables equal the last
    // selection and "entering" is the churn) searches rho over its warm-up; every later run uses that rho. The
    // async pipeline where it runs, else the cache rank alone (the rank whose queries are driven).
    Opts oc = o;
    oc.calibrate_churn = true;
    oc.warmup = churn_calibration_steps(o);
    oc.steps = 32;
    const bool pair_run = has("async") && (ipc || ngpu >= 2);
    json c = run_async(oc, cfg, *model, o.packs.front(), o.budget(), pair_run && ipc, copy_gbps,
                       pair_run ? Solo::kNone : Solo::kCache, 1);
    SPADE_CHECK(c.contains("delta"), "churn calibration: the run gave no delta totals ({})", c.dump());
    o.query_rho = c["query_rho"].get<double>();
    const double got = c["delta"]["entering_fraction"].get<double>();
    std::printf("  churn calibration (%s, P=%d, capacity = budget): target %.3f, rho %.5f, measured %.3f over %d "
                "steps%s\n",
                pair_run ? "async" : "cache rank alone", o.packs.front(), o.churn, o.query_rho, got, oc.steps,
                std::abs(got - o.churn) > 0.02 ? " (more than 0.02 off the target: the rho search's range ends)" : "");
    SPADE_CHECK(c["churn_calibration"].contains("entering_per_row_over_budget"),
                "churn calibration: no row infos were recorded");
    const json& er = c["churn_calibration"]["entering_per_row_over_budget"];
    std::printf("  entering per (layer, sequence, KV head) row and step, share of the budget: p50 %.3f p90 %.3f p99 %.3f "
                "p99.9 %.3f max %.3f (a delta capacity >= max x budget loses nothing at this churn)\n",
                er["p50"].get<double>(), er["p90"].get<double>(), er["p99"].get<double>(), er["p999"].get<double>(),
                er["max"].get<double>());
    c["mode"] = "churn-calibration";
    rows.push_back(c);
  }
  if (has("async")) {
    if (!ipc && ngpu < 2) {
      std::printf("  async: skipped: --link nccl needs two GPUs (found %d)\n", ngpu);
      rows.push_back({{"label", o.label}, {"mode", "async"}, {"skipped", "needs two GPUs"}});
    } else {
      if (o.ipc_peer())
        std::printf("  async: CudaIpcLink between GPU 0 and GPU 1 (rings on GPU 0, copies by the copy engines)\n");
      else if (ipc)
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
  // The median TPOT of a one-GPU row (dense, oracle, quest) timed with or without CUDA graphs; 0 if it did not run.
  auto median_of = [&](const std::string& mode, bool graph) {
    for (const json& x : rows)
      if (x.value("mode", "") == mode && x.value("cuda_graph", !graph) == graph && x.contains("tpot_median_ms"))
        return x["tpot_median_ms"].get<double>();
    return 0.0;
  };
  if (has("solo")) {
    // Each rank alone on GPU 0: what each sustains with the whole GPU to itself, as on two GPUs. The disaggregated
    // TPOT cannot be below the slower of the two; the link's cost (NCCL CTAs on both GPUs, its bandwidth) comes on
    // top, so this is a projection and a lower bound, not a two-GPU measurement.
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
  {
    // Each async row against the one-GPU rows timed as it is (CUDA graphs or eager): dense, and Quest, the paper's
    // peer at the same token budget (> 1 means the peer is slower).
    const char* timing = o.async_graphs ? "graph" : "eager";
    const double dense = median_of("dense", o.async_graphs), quest = median_of("quest", o.async_graphs);
    for (json& x : rows) {
      const std::string mode = x.value("mode", "");
      if (mode.rfind("async", 0) != 0 || !x.contains("tpot_median_ms")) continue;
      const double a = x["tpot_median_ms"].get<double>();
      std::printf("  %-20s P=%-3d N=%d keys %s: %.3f ms", mode.c_str(), x.value("pack", 0), x.value("cache_ranks", 1),
                  x.value("score_keys", "").c_str(), a);
      if (dense > 0) {
        x[std::string("over_dense_") + timing] = a / dense;
        std::printf(", %.3fx dense %s", a / dense, timing);
      }
      if (quest > 0) {
        x[std::string("quest_over_async_") + timing] = quest / a;
        std::printf(", Quest %s %.2fx slower", timing, quest / a);
      }
      std::printf("\n");
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
}  // namespace spade::tpot

int main(int argc, char** argv) {
  // One process, one GPU (--link ipc): the cache rank's and the inference rank's streams wait on each other through
  // stream memory operations, which CUDA's scheduler does not see; streams sharing one of the default 8 hardware
  // queues could then block each other. 32 queues keep every stream of this process on its own (before CUDA starts).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // ... and load every kernel up front: a lazy first launch may synchronise the context, waiting for the other
  // rank's pending receive (cuda_ipc_link.h).
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  try {
    return spade::tpot::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tpot: %s\n", e.what());
    return 1;
  }
}

// Spade kernel benchmarks on one GPU (bench/run_gpu.sh runs this; docs/KERNELS.md reports the numbers).
//
// Every case: inputs filled with random (never zero) data on the device, several input sets rotated when one set
// is small enough to live in L2, warm-up launches, then >= 50 launches each timed with its own pair of CUDA events;
// we report the median (and p10 / p90 / min) in microseconds, the bytes the kernel must move (each input read once,
// each output written once), GB/s = bytes / median, and the ratio to the device-to-device copy bandwidth measured
// in the same run ((read + write bytes) / time of a 1 GiB cudaMemcpyAsync).
//
// Decode and sparse cases are timed twice: "plain" (above: one event pair per launch, launches issued back to back
// from the host) and "graph" (--graph-calls N back-to-back launches captured in one CUDA graph; >= 50 replays after
// warm-up, each timed with its own event pair; time per call = replay time / N), which takes host launch overhead
// out of the measurement. bench/sdpa_peer.py times PyTorch SDPA both ways with the same N and input rotation.
//
// Page placement of the paged cases (the block tables; docs/KERNELS.md sections 6 and 7.1):
//   shuffled   (layout "pagedN"): a random permutation of the pool's pages (worst case: no locality at all);
//   ascending  ("pagedNascending"): each sequence owns a random subset of the pool, listed in ascending order;
//   allocator  ("pagedNallocator"): the block tables that common/page_allocator (run-aware placement) hands out
//              under a serving workload simulated with the engine's scheduling rules (FIFO admission with full
//              reservation, decode tokens first, chunked prefill of 2048 tokens per step, <= 64 running sequences,
//              log-uniform prompts, sparse sequences dropping the pages between sinks and window) in a pool twice the
//              measured sequences' size, run until 4 pools' worth of pages were handed out before the B measured
//              sequences arrive behind the background requests;
//   contiguous ("contiguous"): one page per sequence ([B, T, kv_heads, D]);
//   region-shuffled ("pagedNregionshuffled", diagnostic): each sequence's pages are contiguous up to a random
//              permutation within each 2 MiB of cache (the fewest 2 MiB regions, no page order).
// Each paged row also records placement statistics (contiguous / ascending neighbour pairs, 2 MiB regions touched).
//
// Usage: bench_kernels --out results.json [--iters N] [--warmup N] [--graph-calls N] [--quick] [--sweep]
//                      [--sweep-hpc] [--only g1,g2] [--placement-stats]
// --sweep times the paged decode at forced split counts, --sweep-hpc at forced (KV heads per CTA, split count);
// --placement-stats prints the allocator placement statistics of the benchmark shapes and exits (no GPU needed).
// The JSON also carries device, date, commit ($SPADE_COMMIT, else "unknown").
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_util.cuh"
#include "bench/page_placement.h"
#include "bench/run_stamp.h"
#include "kernels/attention.cuh"
#include "kernels/gemm.cuh"
#include "kernels/selection.cuh"

namespace {

using nlohmann::json;
using namespace spade::kernels;
using namespace spade::bench;
using spade::DType;


struct Options {
  std::string out = "bench_kernels.json";
  int iters = 100;
  int warmup = 10;
  int graph_calls = 20;  // launches per captured CUDA graph (graph timing)
  bool quick = false;
  bool sweep = false;
  bool sweep_hpc = false;
  std::string only;  // comma-separated groups to run: decode, gemm, sparse, selection, prefill (empty: all)
  bool run(const char* group) const {
    return only.empty() || ("," + only + ",").find("," + std::string(group) + ",") != std::string::npos;
  }
};

struct Timing {
  double median_us = 0, p10_us = 0, p90_us = 0, min_us = 0;
  int iters = 0;
};

// Times `iters` runs of run(i), each between an event pair on stream `st` (nullptr: the legacy default stream, and
// the wait is for the whole device), as `calls` calls each: the statistics are of the per-call times.
Timing time_events(int iters, cudaStream_t st, int calls, const std::function<void(int)>& run) {
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i], st));
    run(i);
    CK(cudaEventRecord(ev[2 * i + 1], st));
  }
  CK(st == nullptr ? cudaDeviceSynchronize() : cudaStreamSynchronize(st));
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = 1000.0 * ms / calls;
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  std::sort(us.begin(), us.end());
  Timing t;
  t.iters = iters;
  t.median_us = us[us.size() / 2];
  t.p10_us = us[us.size() / 10];
  t.p90_us = us[(us.size() * 9) / 10];
  t.min_us = us.front();
  return t;
}

// Times fn(set) for `iters` launches (set = i % sets) after `warmup` launches; one event pair per launch.
Timing time_it(const Options& o, int sets, const std::function<void(int)>& fn) {
  for (int i = 0; i < o.warmup; ++i) fn(i % sets);
  CK(cudaDeviceSynchronize());
  return time_events(o.iters, nullptr, 1, [&](int i) { fn(i % sets); });
}

// Times fn(set, stream) captured o.graph_calls times back to back (set = i % sets) in one CUDA graph: warm-up
// (o.warmup plain launches, then 3 replays), then o.iters replays each timed with its own event pair; the times are
// per call (replay time / graph_calls).
Timing time_graph(const Options& o, int sets, cudaStream_t st, const std::function<void(int, cudaStream_t)>& fn) {
  for (int i = 0; i < o.warmup; ++i) fn(i % sets, st);
  CK(cudaStreamSynchronize(st));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < o.graph_calls; ++i) fn(i % sets, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  const Timing t = time_events(o.iters, st, o.graph_calls, [&](int) { CK(cudaGraphLaunch(exec, st)); });
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return t;
}

// Input sets to rotate so that the total working set is >= 4x L2 (inputs do not stay cache-resident).
int rotation_sets(size_t bytes_per_set, size_t l2_bytes) {
  const size_t want = 4 * l2_bytes;
  return static_cast<int>(std::clamp<size_t>((want + bytes_per_set - 1) / std::max<size_t>(bytes_per_set, 1), 1, 8));
}

struct Ctx {
  Options opt;
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;  // graph capture / replay stream (plain timing uses the legacy default stream)
  double copy_gbps = 0;
  json results = json::array();
};

json timing_json(const Timing& t, double bytes, double copy_gbps) {
  json j;
  j["median_us"] = t.median_us;
  j["p10_us"] = t.p10_us;
  j["p90_us"] = t.p90_us;
  j["min_us"] = t.min_us;
  j["iters"] = t.iters;
  j["bytes"] = bytes;
  j["gb_per_s"] = bytes / (t.median_us * 1e3);
  j["ratio_to_copy"] = (bytes / (t.median_us * 1e3)) / copy_gbps;
  return j;
}

// The graph-timed numbers of a row: r["graph"] = {median_us, p10_us, p90_us, min_us, iters, calls_per_graph, ...}.
json graph_json(const Timing& t, double bytes, double copy_gbps, int calls) {
  json j = timing_json(t, bytes, copy_gbps);
  j["calls_per_graph"] = calls;
  j["timing"] = "CUDA graph of calls_per_graph back-to-back launches; median over iters replays of replay time / calls";
  return j;
}

void log_line(const json& r) {
  std::printf("%-50s %10.1f us  %8.1f GB/s  %5.1f%% of copy", r["name"].get<std::string>().c_str(),
              r["median_us"].get<double>(), r["gb_per_s"].get<double>(), 100.0 * r["ratio_to_copy"].get<double>());
  if (r.contains("graph")) std::printf("  | graph %8.1f us", r["graph"]["median_us"].get<double>());
  std::printf("\n");
  std::fflush(stdout);
}

// Adds row `r` to the results and prints it.
void record(Ctx& c, const json& r) {
  c.results.push_back(r);
  log_line(r);
}

double measure_copy(Ctx& c) {
  const size_t bytes = size_t{1} << 30;
  void* a = dmalloc(bytes);
  void* b = dmalloc(bytes);
  fill16(a, bytes / 2, 1);
  const Timing t = time_it(c.opt, 1, [&](int) { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
  CK(cudaFree(a));
  CK(cudaFree(b));
  const double moved = 2.0 * bytes;
  const double gbps = moved / (t.median_us * 1e3);
  json r = timing_json(t, moved, gbps);
  r["name"] = "copy_d2d_1GiB";
  r["kind"] = "copy";
  r["note"] = "cudaMemcpyAsync device-to-device of 1 GiB; bytes = read + write";
  record(c, r);
  return gbps;
}

// A paged KV cache of `batch` sequences of `len` tokens placed as `pl` (page_size < len), or one page per sequence
// (page_size == len: the contiguous [batch, len, hkv, D] layout).
struct KvSet {
  void* k = nullptr;
  void* v = nullptr;
  int32_t* bt = nullptr;
  int max_pages = 0;
  json stats;  // placement statistics (placement_stats + the simulation's info for kAllocator)
};

KvSet make_kv(int batch, int len, int ps, int hkv, int D, uint64_t seed, Placement pl = Placement::kShuffled) {
  KvSet s;
  s.max_pages = (len + ps - 1) / ps;
  Tables t = plan_tables(batch, len, ps, hkv, D, seed, pl);
  s.stats = t.stats;
  const size_t n = static_cast<size_t>(t.num_pages) * ps * hkv * D;
  s.k = dmalloc(n * 2);
  s.v = dmalloc(n * 2);
  fill16(s.k, n, seed);
  fill16(s.v, n, seed + 1);
  s.bt = upload(t.table);  // row b = table[b * max_pages ...]
  return s;
}

void free_kv(KvSet& s) {
  CK(cudaFree(s.k));
  CK(cudaFree(s.v));
  CK(cudaFree(s.bt));
}

// Points a kernel's parameters `p` at input set `s`: its paged K and V cache and its block table.
template <typename Params>
void set_kv(Params& p, const KvSet& s) {
  p.k_cache = s.k;
  p.v_cache = s.v;
  p.block_table = s.bt;
}

constexpr int kHq = 32, kHkv = 8, kD = 128;  // Qwen3-8B attention

// The paged cache's geometry in a kernel's parameters `p`: the bench's KV heads (kHkv x kD), page size `ps` and
// block-table rows of `max_pages`.
template <typename Params>
void set_cache_geometry(Params& p, int ps, int max_pages) {
  p.num_kv_heads = kHkv;
  p.head_dim = kD;
  p.page_size = ps;
  p.max_pages_per_seq = max_pages;
}

// A decode step's buffers for `batch` sequences of context `len`: q (random bf16/fp16 bits, seed `seed`), out,
// seq_lens (all `len`) and an initialised split-K workspace.
struct DecodeIo {
  void* q = nullptr;
  void* out = nullptr;
  int32_t* lens = nullptr;
  DecodeWorkspace ws;
};

DecodeIo make_decode_io(int batch, int len, uint64_t seed) {
  DecodeIo d;
  d.q = dmalloc(size_t{2} * batch * kHq * kD);
  fill16(d.q, static_cast<size_t>(batch) * kHq * kD, seed);
  d.out = dmalloc(size_t{2} * batch * kHq * kD);
  d.lens = upload(std::vector<int32_t>(batch, len));
  d.ws.bytes = decode_workspace_bytes(batch, kHq, kHkv, kD);
  d.ws.ptr = dmalloc(d.ws.bytes);
  CK(decode_workspace_init(d.ws, nullptr));
  return d;
}

void free_decode_io(DecodeIo& d) {
  for (void* ptr : {d.q, d.out, static_cast<void*>(d.lens), d.ws.ptr}) CK(cudaFree(ptr));
}

// The fields every decode-attention parameter struct (PagedDecodeParams, SparseIndexDecodeParams,
// SparsePackedDecodeParams) shares, for the bench's heads (kHq, kHkv, kD): batch rows of q / out (`io`), the cache's
// page geometry, the softmax scale 1/sqrt(kD) and the split-K workspace.
template <typename Params>
void set_decode_common(Params& p, DType dtype, const DecodeIo& io, int batch, int ps, int max_pages) {
  p.dtype = dtype;
  p.q = io.q;
  p.out = io.out;
  p.batch = batch;
  p.num_q_heads = kHq;
  set_cache_geometry(p, ps, max_pages);
  p.scale = 1.f / std::sqrt(static_cast<float>(kD));
  p.workspace = io.ws;
}

// A decode case's timing row: `launch(set, stream)` timed over the `sets` input sets (and, with `graph`, as a CUDA
// graph: r["graph"]), moving `bytes` per call. The caller adds name, kind, dtype and shape, then record()s it.
json time_decode(Ctx& c, int sets, const std::function<void(int, cudaStream_t)>& launch, double bytes, bool graph) {
  const Timing t = time_it(c.opt, sets, [&](int s) { launch(s, nullptr); });
  json r = timing_json(t, bytes, c.copy_gbps);
  if (graph) r["graph"] = graph_json(time_graph(c.opt, sets, c.stream, launch), bytes, c.copy_gbps, c.opt.graph_calls);
  r["input_sets"] = sets;
  return r;
}

// `layout`: "contiguous" (page_size == len) or "paged<ps>[ascending|allocator]" (placement, header comment).
// `graph`: also time the case as a CUDA graph of back-to-back launches (r["graph"]).
void bench_paged_decode(Ctx& c, DType dtype, int batch, int len, int ps, const char* layout, int splits = 0,
                        int heads_per_cta = 0, bool graph = false) {
  const double kv_bytes = 2.0 * batch * len * kHkv * kD * 2;
  const double bytes = kv_bytes + 2.0 * batch * kHq * kD * 2 + batch * ((len + ps - 1) / ps) * 4.0;
  const int sets = rotation_sets(static_cast<size_t>(kv_bytes), c.prop.l2CacheSize);
  std::vector<KvSet> kv;
  const std::string lay(layout);
  const Placement pl = lay.find("ascending") != std::string::npos   ? Placement::kAscending
                       : lay.find("allocator") != std::string::npos ? Placement::kAllocator
                       : lay.find("regionshuf") != std::string::npos ? Placement::kRegionShuffled
                                                                    : Placement::kShuffled;
  for (int s = 0; s < sets; ++s) kv.push_back(make_kv(batch, len, ps, kHkv, kD, 100 + 7 * s, pl));
  DecodeIo io = make_decode_io(batch, len, 5);
  PagedDecodeParams p;
  set_decode_common(p, dtype, io, batch, ps, kv[0].max_pages);
  p.seq_lens = io.lens;
  p.max_seq_len = len;
  p.num_splits = splits;
  p.kv_heads_per_cta = heads_per_cta;
  auto launch = [&](int s, cudaStream_t st) {
    set_kv(p, kv[s]);
    CK(paged_decode_attention(p, st));
  };
  json r = time_decode(c, sets, launch, bytes, graph);
  r["name"] = std::string("paged_decode_") + (dtype == DType::BF16 ? "bf16" : "fp16") + "_B" +
              std::to_string(batch) + "_T" + std::to_string(len) + "_" + layout +
              (splits > 0 ? "_splits" + std::to_string(splits) : std::string()) +
              (heads_per_cta > 0 ? "_hpc" + std::to_string(heads_per_cta) : std::string());
  r["kind"] = heads_per_cta > 0 ? "paged_decode_hpc_sweep"
                                : (splits > 0 ? "paged_decode_split_sweep" : "paged_decode");
  r["num_splits"] = splits;
  r["kv_heads_per_cta"] = heads_per_cta;
  r["dtype"] = dtype == DType::BF16 ? "bf16" : "fp16";
  r["layout"] = layout;
  r["placement"] = ps == len ? "contiguous" : placement_name(pl);
  r["placement_stats"] = kv[0].stats;
  r["shape"] = {{"batch", batch}, {"seq_len", len}, {"num_q_heads", kHq}, {"num_kv_heads", kHkv},
                {"head_dim", kD}, {"page_size", ps}};
  record(c, r);
  for (auto& s : kv) free_kv(s);
  free_decode_io(io);
}

// Sorted random token positions in [0, limit) per (sequence, KV head): what the top-k emits.
std::vector<int32_t> random_indices(int rows, int k, int limit, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> all(limit), out;
  std::iota(all.begin(), all.end(), 0);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < k; ++i) std::swap(all[i], all[i + rng() % (limit - i)]);
    std::vector<int32_t> sel(all.begin(), all.begin() + k);
    std::sort(sel.begin(), sel.end());
    out.insert(out.end(), sel.begin(), sel.end());
  }
  return out;
}

void bench_sparse(Ctx& c, int batch, int len, int ps, int k, int window) {
  const double sel_bytes = 2.0 * batch * kHkv * k * kD * 2;
  const int sets = rotation_sets(static_cast<size_t>(sel_bytes), c.prop.l2CacheSize);
  std::vector<KvSet> kv;
  std::vector<int32_t*> idx;
  std::vector<void*> pk, pv;
  for (int s = 0; s < sets; ++s) {
    kv.push_back(make_kv(batch, len, ps, kHkv, kD, 300 + 11 * s));
    idx.push_back(upload(random_indices(batch * kHkv, k, len - window, 40 + s)));
    pk.push_back(dmalloc(static_cast<size_t>(sel_bytes / 2)));
    pv.push_back(dmalloc(static_cast<size_t>(sel_bytes / 2)));
    fill16(pk.back(), static_cast<size_t>(sel_bytes / 4), 50 + s);
    fill16(pv.back(), static_cast<size_t>(sel_bytes / 4), 60 + s);
  }
  DecodeIo io = make_decode_io(batch, len, 6);
  int32_t* counts = upload(std::vector<int32_t>(batch, k));
  const json shape = {{"batch", batch},       {"seq_len", len},  {"selected", k}, {"num_q_heads", kHq},
                      {"num_kv_heads", kHkv}, {"head_dim", kD},  {"page_size", ps}};
  {
    SparseIndexDecodeParams p;
    set_decode_common(p, DType::BF16, io, batch, ps, kv[0].max_pages);
    p.num_indices = counts;
    p.index_stride = k;
    auto launch = [&](int s, cudaStream_t st) {
      set_kv(p, kv[s]);
      p.indices = idx[s];
      CK(sparse_decode_attention_indexed(p, st));
    };
    json r = time_decode(c, sets, launch, sel_bytes + batch * kHkv * k * 4.0 + 2.0 * batch * kHq * kD * 2, true);
    r["name"] = "sparse_decode_indexed_bf16_B" + std::to_string(batch) + "_k" + std::to_string(k) + "_ps" +
                std::to_string(ps);
    r["kind"] = "sparse_decode_indexed";
    r["dtype"] = "bf16";
    r["shape"] = shape;
    record(c, r);
  }
  {
    SparsePackedDecodeParams p;
    set_decode_common(p, DType::BF16, io, batch, ps, kv[0].max_pages);
    p.num_packed = counts;
    p.seq_lens = io.lens;
    p.packed_capacity = k;
    p.local_window = window;
    auto launch = [&](int s, cudaStream_t st) {
      set_kv(p, kv[s]);
      p.packed_k = pk[s];
      p.packed_v = pv[s];
      CK(sparse_decode_attention_packed(p, st));
    };
    json r = time_decode(c, sets, launch, 2.0 * batch * kHkv * (k + window) * kD * 2 + 2.0 * batch * kHq * kD * 2,
                         true);
    r["name"] = "sparse_decode_packed_bf16_B" + std::to_string(batch) + "_k" + std::to_string(k) + "_w" +
                std::to_string(window);
    r["kind"] = "sparse_decode_packed";
    r["dtype"] = "bf16";
    json sh = shape;
    sh["local_window"] = window;
    r["shape"] = sh;
    record(c, r);
  }
  for (int s = 0; s < sets; ++s) {
    free_kv(kv[s]);
    CK(cudaFree(idx[s]));
    CK(cudaFree(pk[s]));
    CK(cudaFree(pv[s]));
  }
  free_decode_io(io);
  CK(cudaFree(counts));
}

// The cache rank's default predictor (pair::SelectionConfig: ridge, relative eps 1e-2) over `rows` rows (sequences,
// or layers x sequences) of kHq heads, each with a full window of window_cap random fp32 queries (seed `seed`): the
// window, its lengths and q_hat are allocated here and appended to `owned` (the caller frees them).
PredictQueryParams make_predict(int rows, int window_cap, uint64_t seed, std::vector<void*>& owned) {
  float* win = static_cast<float*>(dmalloc(sizeof(float) * rows * kHq * window_cap * kD));
  fill32(win, static_cast<size_t>(rows) * kHq * window_cap * kD, seed, -3.f, 3.f);
  CK(cudaGetLastError());
  int32_t* wlen = upload(std::vector<int32_t>(rows, window_cap));
  float* qhat = static_cast<float*>(dmalloc(sizeof(float) * rows * kHq * kD));
  owned.insert(owned.end(), {win, wlen, qhat});
  PredictQueryParams pp;
  pp.window_dtype = DType::F32;
  pp.window = win;
  pp.window_len = wlen;
  pp.q_hat = qhat;
  pp.batch = rows;
  pp.num_heads = kHq;
  pp.window_capacity = window_cap;
  pp.head_dim = kD;
  pp.max_regressors = window_cap - 1;
  pp.eps = 1e-2f;
  pp.kind = PredictorKind::kRidge;
  return pp;
}

// One layer of cache-rank selection: predict + score + top-k + gather (AsyncSpade Table 2 setting).
void bench_selection(Ctx& c, int batch, int len, int ps, int k, int window_cap) {
  KvSet kv = make_kv(batch, len, ps, kHkv, kD, 500);
  std::vector<void*> owned;
  const PredictQueryParams pp = make_predict(batch, window_cap, 7, owned);
  float* qhat = pp.q_hat;
  int32_t* lens = upload(std::vector<int32_t>(batch, len));
  float* scores = static_cast<float*>(dmalloc(sizeof(float) * batch * kHkv * len));
  int32_t* idx = static_cast<int32_t*>(dmalloc(sizeof(int32_t) * batch * kHkv * k));
  int32_t* cnt = static_cast<int32_t*>(dmalloc(sizeof(int32_t) * batch * kHkv));
  void* pk = dmalloc(size_t{2} * batch * kHkv * k * kD);
  void* pv = dmalloc(size_t{2} * batch * kHkv * k * kD);

  ScoreTokensParams sp;
  sp.dtype = DType::BF16;
  sp.q_hat = qhat;
  sp.k_cache = kv.k;
  sp.block_table = kv.bt;
  sp.num_tokens = lens;
  sp.scores = scores;
  sp.batch = batch;
  sp.num_q_heads = kHq;
  set_cache_geometry(sp, ps, kv.max_pages);
  sp.score_stride = len;
  TopkParams tp;
  tp.scores = scores;
  tp.row_lens = lens;
  tp.indices = idx;
  tp.counts = cnt;
  tp.batch = batch;
  tp.rows_per_batch = kHkv;
  tp.score_stride = len;
  tp.k = k;
  tp.successor = true;  // the cache rank's default (pair::SelectionConfig::successor_expand)
  GatherKvParams gp;
  gp.dtype = DType::BF16;
  set_kv(gp, kv);
  gp.indices = idx;
  gp.packed_k = pk;
  gp.packed_v = pv;
  gp.batch = batch;
  set_cache_geometry(gp, ps, kv.max_pages);
  gp.k = k;
  CK(predict_next_query(pp, nullptr));
  CK(score_tokens(sp, nullptr));
  CK(topk_select(tp, nullptr));
  CK(gather_kv(gp, nullptr));
  CK(cudaDeviceSynchronize());

  const json shape = {{"batch", batch},        {"seq_len", len}, {"selected", k},   {"num_q_heads", kHq},
                      {"num_kv_heads", kHkv}, {"head_dim", kD}, {"page_size", ps}, {"window", window_cap}};
  const double win_bytes = 4.0 * batch * kHq * window_cap * kD + 4.0 * batch * kHq * kD;
  const double key_bytes = 2.0 * batch * kHkv * len * kD;
  const double score_bytes = 4.0 * batch * kHkv * len;
  const double gather_bytes = 2.0 * (2.0 * batch * kHkv * k * kD * 2) + 4.0 * batch * kHkv * k;
  struct Part {
    const char* name;
    double bytes;
    std::function<void()> fn;
  };
  const std::vector<Part> parts = {
      {"predict", win_bytes, [&] { CK(predict_next_query(pp, nullptr)); }},
      {"score", key_bytes + score_bytes + 4.0 * batch * kHq * kD, [&] { CK(score_tokens(sp, nullptr)); }},
      {"topk", score_bytes + 4.0 * batch * kHkv * k, [&] { CK(topk_select(tp, nullptr)); }},
      {"gather", gather_bytes, [&] { CK(gather_kv(gp, nullptr)); }},
      {"layer_total", win_bytes + key_bytes + 2 * score_bytes + gather_bytes, [&] {
         CK(predict_next_query(pp, nullptr));
         CK(score_tokens(sp, nullptr));
         CK(topk_select(tp, nullptr));
         CK(gather_kv(gp, nullptr));
       }}};
  for (const Part& part : parts) {
    const Timing t = time_it(c.opt, 1, [&](int) { part.fn(); });
    json r = timing_json(t, part.bytes, c.copy_gbps);
    r["name"] = std::string("selection_") + part.name + "_B" + std::to_string(batch) + "_T" + std::to_string(len) +
                "_k" + std::to_string(k);
    r["kind"] = std::string("selection_") + part.name;
    r["dtype"] = "bf16";
    r["shape"] = shape;
    r["floor_us_at_copy_bw"] = part.bytes / (c.copy_gbps * 1e3);
    record(c, r);
  }
  free_kv(kv);
  owned.insert(owned.end(), {lens, scores, idx, cnt, pk, pv});
  for (void* p : owned) CK(cudaFree(p));
}

// The predictor is latency-bound (one fp64 solve per (sequence, head) on one warp): a layer pack of `layers` layers
// in ONE launch (rows = layers x batch x heads) costs about as much as one layer. `max_reg` W (0: window_cap - 1);
// with window_cap = W + 1 (the cache rank's windows) and W <= 8 the launcher runs its small-W kernel, and the same
// problems with max_regressors W + 1 (the same m = W regressors, the same numbers) run on the general kernel: that
// run is recorded beside it as its peer ("<name>_general_kernel", and "speedup_vs_general_kernel").
void bench_predict_pack(Ctx& c, int batch, int layers, int window_cap, int max_reg = 0) {
  const int rows_batch = layers * batch;
  std::vector<void*> owned;
  PredictQueryParams pp = make_predict(rows_batch, window_cap, 9, owned);
  if (max_reg > 0) pp.max_regressors = max_reg;
  const double bytes = 4.0 * rows_batch * kHq * window_cap * kD + 4.0 * rows_batch * kHq * kD;
  std::string name = "selection_predict_pack" + std::to_string(layers) + "_B" + std::to_string(batch);
  if (max_reg > 0) name += "_W" + std::to_string(max_reg);
  const auto row = [&](const std::string& n, int reg) {
    pp.max_regressors = reg;
    const Timing t = time_it(c.opt, 1, [&](int) { CK(predict_next_query(pp, nullptr)); });
    json r = timing_json(t, bytes, c.copy_gbps);
    r["name"] = n;
    r["kind"] = "selection_predict_pack";
    r["shape"] = {{"batch", batch},   {"layers", layers},        {"num_heads", kHq},
                  {"head_dim", kD},   {"window", window_cap},    {"max_regressors", reg}};
    r["per_layer_us"] = t.median_us / layers;
    r["floor_us_at_copy_bw"] = bytes / (c.copy_gbps * 1e3);
    return r;
  };
  json r = row(name, pp.max_regressors);
  if (max_reg > 0 && max_reg < kMaxPredictorWindow && window_cap == max_reg + 1) {
    json peer = row(name + "_general_kernel", max_reg + 1);
    r["speedup_vs_general_kernel"] = peer["median_us"].get<double>() / r["median_us"].get<double>();
    record(c, peer);
  }
  record(c, r);
  for (void* p : owned) CK(cudaFree(p));
}

void bench_prefill(Ctx& c, int len, int ps) {
  KvSet kv = make_kv(1, len, ps, kHkv, kD, 700);
  void* q = dmalloc(size_t{2} * len * kHq * kD);
  fill16(q, static_cast<size_t>(len) * kHq * kD, 8);
  void* out = dmalloc(size_t{2} * len * kHq * kD);
  int32_t* cu = upload(std::vector<int32_t>{0, len});
  int32_t* lens = upload(std::vector<int32_t>{len});
  PagedPrefillParams p;
  p.dtype = DType::BF16;
  p.q = q;
  set_kv(p, kv);
  p.cu_q_lens = cu;
  p.seq_lens = lens;
  p.out = out;
  p.batch = 1;
  p.num_q_heads = kHq;
  set_cache_geometry(p, ps, kv.max_pages);
  p.max_q_len = len;
  p.scale = 1.f / std::sqrt(static_cast<float>(kD));
  const Timing t = time_it(c.opt, 1, [&](int) { CK(paged_prefill_attention(p, nullptr)); });
  const double bytes = 2.0 * len * kHkv * kD * 2 + 2.0 * 2 * len * kHq * kD;
  json r = timing_json(t, bytes, c.copy_gbps);
  const double flops = 4.0 * kHq * kD * (static_cast<double>(len) * (len + 1) / 2.0);  // causal QK^T + PV
  r["name"] = "prefill_bf16_B1_T" + std::to_string(len) + "_ps" + std::to_string(ps);
  r["kind"] = "prefill";
  r["dtype"] = "bf16";
  r["shape"] = {{"batch", 1}, {"q_len", len}, {"seq_len", len}, {"num_q_heads", kHq}, {"num_kv_heads", kHkv},
                {"head_dim", kD}, {"page_size", ps}};
  r["flops"] = flops;
  r["tflop_per_s"] = flops / (t.median_us * 1e6);
  c.results.push_back(r);
  std::printf("%-44s %10.1f us  %8.1f TFLOP/s\n", r["name"].get<std::string>().c_str(), t.median_us,
              r["tflop_per_s"].get<double>());
  free_kv(kv);
  for (void* ptr : std::vector<void*>{q, out, cu, lens}) CK(cudaFree(ptr));
}

}  // namespace

// --placement-stats: the placement statistics of the paged benchmark shapes (CPU only).
int print_placement_stats() {
  for (auto [b, len] : std::vector<std::pair<int, int>>{{8, 2048}, {8, 8192}, {8, 32768}, {8, 131072}, {1, 32768},
                                                       {32, 4096}}) {
    for (Placement pl :
         {Placement::kShuffled, Placement::kAscending, Placement::kAllocator, Placement::kRegionShuffled}) {
      const auto t0 = std::chrono::steady_clock::now();
      const Tables t = plan_tables(b, len, 16, kHkv, kD, 100, pl);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("B=%-2d T=%-6d %-9s %s (%.2f s)\n", b, len, placement_name(pl), t.stats.dump().c_str(), sec);
    }
  }
  return 0;
}

// Decode-shape dense layer GEMMs (kernels/gemm.cuh), y[m, n] = x[m, k] · W[n, k]^T bf16: the runtime's GemmRunner
// (cuBLASLt's first heuristic answer) beside the small-M split-K kernel (small_m_gemm) at its best split count of
// {1, 2, 4, 8, 16, 32} (each graph-timed, the fastest kept), weights rotated over sets >= 4x L2 (a decode step never
// finds a layer's weights in L2). Bytes = W + x + y; floor = bytes / copy bandwidth.
void bench_gemm(Ctx& c, const char* model, const char* proj, int m, int n, int k, DType out) {
  const size_t w_bytes = static_cast<size_t>(n) * k * 2;
  const int sets = rotation_sets(w_bytes, c.prop.l2CacheSize);
  const size_t out_elem = out == DType::F32 ? 4 : 2;
  std::vector<void*> ws(sets);
  for (int i = 0; i < sets; ++i) {
    ws[i] = dmalloc(w_bytes);
    fill16(ws[i], w_bytes / 2, 1000 + i, 1.f / std::sqrt(static_cast<float>(k)));
  }
  void* x = dmalloc(static_cast<size_t>(m) * k * 2);
  void* y = dmalloc(static_cast<size_t>(m) * n * out_elem);
  fill16(x, static_cast<size_t>(m) * k, 77);
  SmallMGemmWorkspace sw;
  sw.partial_elems = size_t{16} << 20;  // 64 MiB of fp32 partials
  sw.partials = static_cast<float*>(dmalloc(sw.partial_elems * sizeof(float)));
  sw.num_counters = 8192;
  sw.counters = static_cast<int*>(dmalloc(sizeof(int) * sw.num_counters));
  CK(cudaMemset(sw.counters, 0, sizeof(int) * sw.num_counters));
  GemmRunner runner;
  CK(runner.init());
  const GemmParams p{.out_dtype = out, .x = x, .w = ws[0], .y = y, .m = m, .n = n, .k = k};
  const Timing tc = time_graph(c.opt, sets, c.stream, [&](int set, cudaStream_t st) {
    GemmParams q = p;
    q.w = ws[set];
    CK(runner.run(q, st));
  });
  Timing ts;
  int best_split = 0;
  for (int s : {1, 2, 4, 8, 16, 32}) {
    if (!small_m_gemm_supports(p, s, sw)) continue;
    const Timing t = time_graph(c.opt, sets, c.stream, [&](int set, cudaStream_t st) {
      GemmParams q = p;
      q.w = ws[set];
      CK(small_m_gemm(q, s, sw, st));
    });
    if (best_split == 0 || t.median_us < ts.median_us) {
      ts = t;
      best_split = s;
    }
  }
  const double bytes = static_cast<double>(w_bytes) + static_cast<double>(m) * k * 2 + double(m) * n * out_elem;
  json r = graph_json(tc, bytes, c.copy_gbps, c.opt.graph_calls);  // top level: what the runtime runs
  r["name"] = std::string("gemm_") + model + "_" + proj + "_m" + std::to_string(m);
  r["kind"] = "gemm";
  r["model"] = model;
  r["proj"] = proj;
  r["m"] = m;
  r["n"] = n;
  r["k"] = k;
  r["out_dtype"] = out == DType::F32 ? "f32" : "bf16";
  r["plan"] = runner.plan_name(p);
  r["floor_us"] = bytes / (c.copy_gbps * 1e3);
  if (best_split > 0) {
    r["small_m"] = graph_json(ts, bytes, c.copy_gbps, c.opt.graph_calls);
    r["small_m"]["splits"] = best_split;
    r["cublaslt_over_small_m"] = tc.median_us / ts.median_us;
  }
  r["note"] = "graph-timed per call; top level: the runtime's cuBLASLt plan; small_m: small_m_gemm at its best split";
  c.results.push_back(r);
  std::printf("%-30s cuBLASLt %7.1f us (%5.1f%% of copy) [%s] | small-M %7.1f us (%5.1f%%, %d splits) | floor %.1f us\n",
              r["name"].get<std::string>().c_str(), tc.median_us, 100.0 * r["ratio_to_copy"].get<double>(),
              r["plan"].get<std::string>().c_str(), best_split > 0 ? ts.median_us : 0.0,
              best_split > 0 ? 100.0 * r["small_m"]["ratio_to_copy"].get<double>() : 0.0, best_split,
              r["floor_us"].get<double>());
  std::fflush(stdout);
  for (void* w : ws) CK(cudaFree(w));
  CK(cudaFree(x));
  CK(cudaFree(y));
  CK(cudaFree(sw.partials));
  CK(cudaFree(sw.counters));
}

// The decode GEMMs of Qwen3-8B and Qwen3-32B (fused qkv and gate_up, as the inference rank runs them) at the
// batches of bench_tpot's configs.
void bench_gemms(Ctx& c) {
  struct Shape {
    const char* model;
    const char* proj;
    int n, k;
    DType out;
  };
  const std::vector<Shape> shapes = {
      {"qwen3-8b", "qkv", 6144, 4096, DType::BF16},      {"qwen3-8b", "o", 4096, 4096, DType::BF16},
      {"qwen3-8b", "gate_up", 24576, 4096, DType::BF16}, {"qwen3-8b", "down", 4096, 12288, DType::BF16},
      {"qwen3-8b", "lm_head", 151936, 4096, DType::F32}, {"qwen3-32b", "qkv", 10240, 5120, DType::BF16},
      {"qwen3-32b", "o", 5120, 8192, DType::BF16},       {"qwen3-32b", "gate_up", 51200, 5120, DType::BF16},
      {"qwen3-32b", "down", 5120, 25600, DType::BF16},
  };
  for (int m : {8, 16, 32}) {
    for (const Shape& s : shapes) {
      if (c.opt.quick && (m != 8 || std::string(s.model) != "qwen3-8b")) continue;
      bench_gemm(c, s.model, s.proj, m, s.n, s.k, s.out);
    }
  }
}

int main(int argc, char** argv) {
  Ctx c;
  bool placement_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      c.opt.out = argv[++i];
    } else if (a == "--iters" && i + 1 < argc) {
      c.opt.iters = std::max(50, std::atoi(argv[++i]));
    } else if (a == "--warmup" && i + 1 < argc) {
      c.opt.warmup = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--graph-calls" && i + 1 < argc) {
      c.opt.graph_calls = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--placement-stats") {
      placement_only = true;
    } else if (a == "--quick") {
      c.opt.quick = true;
    } else if (a == "--sweep") {
      c.opt.sweep = true;
    } else if (a == "--sweep-hpc") {
      c.opt.sweep_hpc = true;
    } else if (a == "--only" && i + 1 < argc) {
      c.opt.only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--out file.json] [--iters N>=50] [--warmup N] [--graph-calls N] [--quick] [--sweep]"
                   " [--sweep-hpc] [--only g1,g2] [--placement-stats]\n",
                   argv[0]);
      return 2;
    }
  }
  if (placement_only) return print_placement_stats();
  int dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&c.prop, dev));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));
  std::printf("device: %s, %d SMs, L2 %d MB\n", c.prop.name, c.prop.multiProcessorCount, c.prop.l2CacheSize >> 20);

  CK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
  c.copy_gbps = measure_copy(c);
  // Paged decode, Qwen3-8B head shape, bf16: the issue's targets (B=8, T=2k/32k; paged vs contiguous).
  if (c.opt.run("decode")) {
    // Placements: paged16 = shuffled (worst case), paged16allocator = common/page_allocator after serving churn.
    for (int len : {2048, 8192, 32768}) {
      bench_paged_decode(c, DType::BF16, 8, len, 16, "paged16", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 8, len, 16, "paged16allocator", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 8, len, len, "contiguous", 0, 0, true);
    }
    if (!c.opt.quick) {
      bench_paged_decode(c, DType::BF16, 8, 32768, 32, "paged32");
      bench_paged_decode(c, DType::BF16, 8, 32768, 64, "paged64");
      bench_paged_decode(c, DType::F16, 8, 32768, 16, "paged16", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 1, 32768, 16, "paged16", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 1, 32768, 16, "paged16allocator", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 32, 4096, 16, "paged16", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 32, 4096, 16, "paged16allocator", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 8, 131072, 16, "paged16", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 8, 131072, 16, "paged16allocator", 0, 0, true);
      bench_paged_decode(c, DType::BF16, 8, 32768, 16, "paged16ascending");
      bench_paged_decode(c, DType::BF16, 8, 32768, 16, "paged16regionshuffled");
      bench_paged_decode(c, DType::BF16, 8, 131072, 16, "paged16ascending");
    }
  }
  if (c.opt.sweep) {  // forced split counts (the heuristic's evidence; docs/KERNELS.md)
    for (auto [b, len] : std::vector<std::pair<int, int>>{{8, 2048}, {8, 32768}, {1, 32768}, {8, 131072}}) {
      for (int s : {2, 4, 8, 16, 24, 33, 48, 64}) bench_paged_decode(c, DType::BF16, b, len, 16, "paged16", s);
    }
  }
  if (c.opt.sweep_hpc) {  // forced KV heads per CTA x split counts whose grid is 0.4..4 waves of one CTA per SM
    const int sms = c.prop.multiProcessorCount;
    for (auto [b, len] : std::vector<std::pair<int, int>>{
             {8, 2048}, {8, 8192}, {8, 32768}, {1, 32768}, {32, 4096}, {8, 131072}}) {
      for (int hpc : {1, 2, 4, 8}) {
        const int rows = b * kHkv / hpc;
        for (int s : {1, 2, 3, 4, 6, 8, 12, 14, 16, 24, 32, 33, 48, 64}) {
          const long long ctas = static_cast<long long>(rows) * s;
          if (ctas < (2 * sms) / 5 || ctas > 4 * sms || s * 128 > len || (len + s - 1) / s > 4094 * 16) continue;
          bench_paged_decode(c, DType::BF16, b, len, 16, "paged16", s, hpc);
        }
      }
    }
  }
  if (c.opt.run("gemm")) bench_gemms(c);
  if (c.opt.run("sparse")) bench_sparse(c, 8, 32768, 16, 2048, 64);
  if (c.opt.run("selection")) {
    bench_selection(c, 8, 32768, 16, 2048, 33);
    bench_predict_pack(c, 8, 6, 33);
    // The cache rank's predictor (W 8, windows of W + 1) over 12-layer packs at the TPOT table's batches.
    for (int b : {8, 16, 32}) bench_predict_pack(c, b, 12, 9, 8);
  }
  if (c.opt.run("prefill")) {
    bench_prefill(c, 2048, 16);
    if (!c.opt.quick) bench_prefill(c, 8192, 16);
  }

  json doc;
  doc["device"] = c.prop.name;
  doc["sm_count"] = c.prop.multiProcessorCount;
  doc["l2_bytes"] = c.prop.l2CacheSize;
  doc["cuda_driver"] = driver;
  doc["cuda_runtime"] = runtime;
  spade::bench::stamp_run(doc);
  doc["copy_gb_per_s"] = c.copy_gbps;
  doc["iters"] = c.opt.iters;
  doc["warmup"] = c.opt.warmup;
  doc["graph_calls"] = c.opt.graph_calls;
  doc["timing"] = "plain: median of per-launch CUDA event pairs after warm-up; graph (row['graph']): median over "
                  "replays of a CUDA graph of graph_calls back-to-back launches, per call; inputs rotated over sets "
                  ">= 4x L2";
  doc["results"] = c.results;
  std::ofstream f(c.opt.out);
  f << doc.dump(2) << "\n";
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", c.opt.out.c_str());
    return 1;
  }
  std::printf("wrote %s\n", c.opt.out.c_str());
  CK(cudaStreamDestroy(c.stream));
  return 0;
}

// The async pipeline of bench_tpot (bench/bench_tpot.cpp, --modes async / solo): the state its ranks share
// (AsyncShared), the inference rank's attention (AsyncInferenceAttention), the cache rank (AsyncCacheRank), the solo
// runs' link (NullLink), the pair's link ends (LinkPair) and the solo selector (Solo).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bench/tpot_common.h"
#include "common/config.h"
#include "common/dtype.h"
#include "common/error.h"
#include "inference_rank/gpu_model.h"
#include "kernels/device.h"
#include "kernels/layer_ops.cuh"
#include "kernels/selection.cuh"
#include "kernels/tensor_ops.cuh"
#include "pair/gpu_plan.h"
#include "pair/sharded_link.h"
#include "transport/cuda_ipc/cuda_ipc_link.h"
#include "transport/gpu_link.h"
#include "transport/nccl/nccl_link.h"

namespace spade::tpot {

using transport::CudaIpcLink;
using transport::CudaIpcLinkOptions;
using transport::GpuLink;
using transport::GpuLinkCounters;
using transport::NcclLink;
using transport::NcclLinkOptions;
using transport::NcclRole;
using transport::PairRole;

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
    if (o.calibrate_churn || o.query_rho > 0) {
      lt_check(cublasLtCreate(&lt_), "cublasLtCreate");
      lt_check(cublasLtMatrixTransformDescCreate(&blend_, CUDA_R_32F), "cublasLtMatrixTransformDescCreate");
      rho_ = o.calibrate_churn ? churn_search_.rho() : o.query_rho;
    }
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
    if (blend_ != nullptr) cublasLtMatrixTransformDescDestroy(blend_);
    if (lt_ != nullptr) cublasLtDestroy(lt_);
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
      if (o_.calibrate_churn && t < kChurnPhases * churn_phase_steps(o_)) calibrate_churn(t);
      if (o_.calibrate_churn && t + 1 >= o_.warmup) record_entering(t + 1);
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
  /// --churn: the rho its query windows were driven with (0: the model's queries), and with calibrate_churn each
  /// phase's {rho, measured churn}.
  double query_rho() const { return rho_; }
  const std::vector<std::pair<double, double>>& churn_phases() const { return churn_phases_; }
  /// Calibration run: the tokens that entered each (layer, sequence, KV head) row's selection per timed step.
  const std::vector<int>& entering_per_row() const { return entering_; }
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
  static void lt_check(cublasStatus_t st, const char* what) {
    SPADE_CHECK(st == CUBLAS_STATUS_SUCCESS, "cache rank: {} failed: {}", what, cublasLtGetStatusString(st));
  }
  // The rho search of a calibration run (Opts::churn), at the end of step t of its warm-up: phase i holds rho for
  // churn_phase_steps() steps; once the query windows hold only queries pushed at that rho (W steps) the totals are
  // reset, and the phase's last 4 steps of selections give its churn (entering / selected: the capacity is the
  // budget, so every entering token is sent and the held tables equal the previous selection); ChurnSearch moves rho.
  void calibrate_churn(int t) {
    const int len = churn_phase_steps(o_), pos = t % len;
    if (pos != o_.selection.query_window - 1 && pos != len - 1) return;
    cuda_check(cudaStreamSynchronize(sel_stream_), "churn calibration sync");
    if (pos == len - 1) {
      const std::vector<unsigned long long> d = delta_totals();
      const double churn = d[kernels::kDeltaCount] > 0 ? static_cast<double>(d[kernels::kDeltaEntering]) /
                                                             static_cast<double>(d[kernels::kDeltaCount])
                                                       : 0.0;
      churn_phases_.emplace_back(rho_, churn);
      churn_search_.observe(churn);
      rho_ = churn_search_.rho();
    } else {
      cuda_check(cudaMemsetAsync(totals_.get(), 0, totals_.bytes(), sel_stream_), "delta totals reset");
      cuda_check(cudaStreamSynchronize(sel_stream_), "churn calibration sync");
    }
  }
  // Calibration run: every row's E of the steady selections for step `for_step` (their messages' row infos), for the
  // capacity a lossless delta needs at this churn (the largest E).
  void record_entering(int for_step) {
    cuda_check(cudaStreamSynchronize(sel_stream_), "churn calibration sync");
    const int mine = static_cast<int>(mine_.size());
    for (int idx = 0; idx < mine; ++idx) {
      const size_t rows = static_cast<size_t>(pack_layers(mine_[static_cast<size_t>(idx)])) * B_ * cfg_.num_kv_heads;
      const char* out = send_.as<char>() + (static_cast<size_t>(for_step % 2) * mine + idx) * sh_.down_bytes(for_step);
      std::vector<int32_t> info(rows * kernels::kDeltaInfoFields);
      cuda_check(cudaMemcpy(info.data(), out + sh_.delta.info, info.size() * 4, cudaMemcpyDeviceToHost), "row infos");
      for (size_t r = 0; r < rows; ++r) entering_.push_back(info[r * kernels::kDeltaInfoFields + 1]);
    }
  }
  // The query window push with --churn: the `wrows` new last slots = rho * the previous last slots + sqrt(1 - rho^2)
  // * the pushed queries (bf16, fp32 scale; one cuBLASLt matrix transform over [head_dim, wrows] views).
  void blend_push(char* dst_last, const char* src_last, size_t wrows, cudaStream_t stream) {
    const uint64_t D = static_cast<uint64_t>(cfg_.head_dim), n = wrows;
    const int64_t ld_win = static_cast<int64_t>(cap_) * cfg_.head_dim;
    cublasLtMatrixLayout_t win = nullptr, q = nullptr;
    lt_check(cublasLtMatrixLayoutCreate(&win, CUDA_R_16BF, D, n, ld_win), "cublasLtMatrixLayoutCreate");
    lt_check(cublasLtMatrixLayoutCreate(&q, CUDA_R_16BF, D, n, static_cast<int64_t>(D)), "cublasLtMatrixLayoutCreate");
    const float a = static_cast<float>(rho_), b = static_cast<float>(std::sqrt(1.0 - rho_ * rho_));
    const cublasStatus_t st =
        cublasLtMatrixTransform(lt_, blend_, &a, src_last, win, &b, q_tmp_.get(), q, dst_last, win, stream);
    cublasLtMatrixLayoutDestroy(win);
    cublasLtMatrixLayoutDestroy(q);
    lt_check(st, "cublasLtMatrixTransform (query blend)");
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
    if (rho_ > 0)
      blend_push(dst + (cap_ - 1) * D * 2, src + (cap_ - 1) * D * 2, wrows, stream_);
    else
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
  // --churn: the query blend (cuBLASLt matrix transform) and the rho search's state.
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatrixTransformDesc_t blend_ = nullptr;
  double rho_ = 0;
  ChurnSearch churn_search_{o_.churn};
  std::vector<std::pair<double, double>> churn_phases_;
  std::vector<int> entering_;
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

}  // namespace spade::tpot

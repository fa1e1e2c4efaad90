// The CPU sparse pair in one process, for bench_cpu's --sparse-samples: an inference rank's Engine whose sparse
// backend (inference_rank/sparse_attention.h, predicted selection) talks over a loopback transport to a cache rank
// served by a thread (cache::serve_cache_rank, pair::TransportLink): the CPU pair's wire (pair/pack.h, framed), as
// between an inference_rank and a cache_rank process, with the transport's copy in memory instead of UCX. Counts on
// the cache rank's side what it stored and what crossed the wire each way.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "cache_rank/pack_server.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"
#include "pair/delta.h"
#include "pair/link.h"
#include "transport/loopback.h"

namespace spade::bench {

/// What the cache rank saw, counted by its serving thread. Bytes are wire bytes: each message's payload and its
/// 16-byte frame prefix (pair/pack.h FramePrefix). init_bytes + append_bytes == to_cache_bytes.
struct CacheRankTally {
  int peak_pages = 0;            // most KV pages its Selector held at once, after any update (a shared page once)
  uint64_t updates = 0;          // PackUpdates answered (one per layer pack and step, plus release-only ones)
  uint64_t to_cache_bytes = 0;   // inference -> cache: every update
  uint64_t init_bytes = 0;       // of those, the INIT entries' q, k and v rows (the bulk ship at the switch), fp32
  uint64_t append_bytes = 0;     // the rest: APPEND rows, entry and update headers, frame prefixes, releases
  uint64_t to_inference_bytes = 0;  // cache -> inference: the selections (deltas with delta transfer)
};

/// An Engine over `model` with a SparseAttention backend (opt.mode must be Predicted) whose cache rank is a
/// cache::Selector of the engine's KV pool size (pages of the engine's page size, as the standalone inference_rank's
/// in-process cache rank), served by a thread over a loopback transport, with delta transfer when
/// opt.delta_transfer. `shared_init` false turns the shared INIT off (set_page_allocator(nullptr): every switching
/// sequence ships and stores its whole context). Engine options are used as given, except prefix_recompute_tokens,
/// raised to the queries the backend ships at the switch (as inference_rank/main.cpp does). Throws spade::Error when
/// the transport does not connect within 5 s.
class LoopbackSparsePair {
 public:
  LoopbackSparsePair(const Model& model, EngineOptions eo, const SparseOptions& opt, bool shared_init) {
    SPADE_CHECK(opt.mode == SelectionMode::Predicted, "LoopbackSparsePair: selection must be predicted, got {}",
                selection_mode_name(opt.mode));
    pair::validate(opt);  // before the cache rank's thread starts
    eo.prefix_recompute_tokens = std::max(eo.prefix_recompute_tokens, opt.prefix_recompute_tokens());
    try {
      engine_ = std::make_unique<Engine>(model, eo, [&](const ModelConfig& cfg, KvCache& kv) {
        auto link = start_cache_rank(cfg, opt, kv.num_pages(), kv.page_size());
        return std::unique_ptr<AttentionBackend>(std::make_unique<SparseAttention>(cfg, kv, opt, std::move(link)));
      });
    } catch (...) {
      stop_cache_rank();  // no destructor runs for a throwing constructor
      throw;
    }
    sparse_ = dynamic_cast<SparseAttention*>(&engine_->attention());
    SPADE_CHECK(sparse_ != nullptr, "LoopbackSparsePair: the engine's backend is not SparseAttention");
    if (!shared_init) sparse_->set_page_allocator(nullptr);
  }
  LoopbackSparsePair(const LoopbackSparsePair&) = delete;
  LoopbackSparsePair& operator=(const LoopbackSparsePair&) = delete;
  ~LoopbackSparsePair() { stop_cache_rank(); }

  Engine& engine() { return *engine_; }
  const SparseAttention& sparse() const { return *sparse_; }

  /// Once the engine is idle: sends the last releases (the rank's idle loop does the same), stops the cache rank
  /// and returns its tally. Throws spade::Error naming the cache rank if it stopped with an error or still holds
  /// a live sequence, or pages beyond its retained prefixes (a release that did not arrive).
  const CacheRankTally& finish() {
    SPADE_CHECK(engine_->idle(), "LoopbackSparsePair::finish: the engine still has requests");
    sparse_->idle_flush();
    stop_cache_rank();
    SPADE_CHECK(served_error_.empty(), "cache rank 1 (loopback) stopped with an error: {}", served_error_);
    SPADE_CHECK(selector_->num_sequences() == selector_->num_retained() &&
                    (selector_->num_retained() > 0 || selector_->num_used_pages() == 0),
                "cache rank 1 (loopback) still holds {} pages of {} sequences ({} retained prefixes) after the releases",
                selector_->num_used_pages(), selector_->num_sequences(), selector_->num_retained());
    return tally_;
  }

 private:
  std::unique_ptr<pair::CacheRankLink> start_cache_rank(const ModelConfig& cfg, const SparseOptions& opt,
                                                        int num_pages, int page_size) {
    const auto deadline = transport::Clock::now() + std::chrono::seconds(5);
    std::unique_ptr<transport::Endpoint> ep_inf;
    std::thread peer([&] { ep_cache_ = t_cache_->connect(t_inf_->local_address(), "inference rank 0", deadline); });
    try {
      ep_inf = t_inf_->connect(t_cache_->local_address(), "cache rank 1 (loopback)", deadline);
    } catch (...) {
      peer.join();
      throw;
    }
    peer.join();
    selector_ = std::make_unique<cache::Selector>(cfg, opt.selection, num_pages, page_size);
    if (opt.delta_transfer)
      mirror_ = std::make_unique<pair::SelectionMirror>(cfg.num_kv_heads, opt.selection.token_budget, cfg.head_dim);
    const pair::PackShape shape = pair::pack_shape(cfg, opt.selection);
    cache::ServeHooks hooks;
    hooks.mirror = mirror_.get();
    hooks.on_pack = [this](const pair::PackUpdate& u, const pair::PackSelection&, size_t in, size_t out) {
      tally_.updates += 1;
      tally_.to_cache_bytes += in;
      tally_.to_inference_bytes += out;
      for (const auto& e : u.seqs)
        if (e.init) tally_.init_bytes += (e.q.size() + e.k.size() + e.v.size()) * sizeof(float);
      tally_.append_bytes = tally_.to_cache_bytes - tally_.init_bytes;
      tally_.peak_pages = std::max(tally_.peak_pages, selector_->num_used_pages());
    };
    thread_ = std::thread([this, shape, hooks] {
      served_error_ = cache::serve_cache_rank(*ep_cache_, *selector_, shape, stop_, &stats_,
                                              std::chrono::milliseconds(20), hooks);
    });
    return std::make_unique<pair::TransportLink>(std::move(ep_inf), shape);
  }
  void stop_cache_rank() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  std::shared_ptr<transport::LoopbackFabric> fabric_ = transport::LoopbackFabric::create();
  std::unique_ptr<transport::Transport> t_inf_ = fabric_->make_transport("inference rank 0");
  std::unique_ptr<transport::Transport> t_cache_ = fabric_->make_transport("cache rank 1 (loopback)");
  std::unique_ptr<transport::Endpoint> ep_cache_;
  std::unique_ptr<cache::Selector> selector_;
  std::unique_ptr<pair::SelectionMirror> mirror_;
  std::atomic<bool> stop_{false};
  std::string served_error_;
  pair::LinkStats stats_;
  CacheRankTally tally_;  // written by thread_ only; read once it has joined
  std::thread thread_;
  std::unique_ptr<Engine> engine_;  // last: destroyed first (its link's endpoint before the transports)
  SparseAttention* sparse_ = nullptr;
};

}  // namespace spade::bench

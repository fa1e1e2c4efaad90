// A CPU cache rank served by a thread of the test process (cache::serve_cache_rank over a Selector) behind an
// in-process loopback transport, and the inference side's pair::TransportLink to it: the pair's wire format (framing,
// encode / decode, delta transfer) without processes.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "cache_rank/pack_server.h"
#include "cache_rank/selector.h"
#include "inference_rank/sparse_attention.h"
#include "pair/delta.h"
#include "pair/link.h"
#include "transport/loopback.h"

namespace spade::test {

struct LoopbackCacheRank {
  std::shared_ptr<transport::LoopbackFabric> fabric = transport::LoopbackFabric::create();
  std::unique_ptr<transport::Transport> t_inf = fabric->make_transport("inference rank 0");
  std::unique_ptr<transport::Transport> t_cache = fabric->make_transport("cache rank 1");
  std::unique_ptr<transport::Endpoint> ep_cache;
  std::unique_ptr<cache::Selector> sel;
  std::atomic<bool> stop{false};
  std::thread th;
  std::string served_error;  // what serve_cache_rank returned ("" = a clean stop)
  pair::LinkStats stats;
  std::unique_ptr<pair::SelectionMirror> mirror;  // delta transfer when set

  /// Connects both ends, starts the serving thread over a pool of `num_pages` × 16-token pages and returns the
  /// inference side's link. `delta`: answer with selection deltas (pair::SelectionMirror).
  std::unique_ptr<pair::CacheRankLink> start(const ModelConfig& cfg, const SparseOptions& o, bool delta = false,
                                             int num_pages = 4096) {
    const auto dl = transport::Clock::now() + std::chrono::seconds(5);
    std::unique_ptr<transport::Endpoint> ep_inf;
    std::thread c([&] { ep_cache = t_cache->connect(t_inf->local_address(), "inference rank 0", dl); });
    ep_inf = t_inf->connect(t_cache->local_address(), "cache rank 1", dl);
    c.join();
    sel = std::make_unique<cache::Selector>(cfg, o.selection, num_pages, 16);
    const pair::PackShape shape = pair::pack_shape(cfg, o.selection);
    if (delta) mirror = std::make_unique<pair::SelectionMirror>(cfg.num_kv_heads, o.selection.token_budget, cfg.head_dim);
    th = std::thread([this, shape] {
      cache::ServeHooks hooks;
      hooks.mirror = mirror.get();
      served_error = cache::serve_cache_rank(*ep_cache, *sel, shape, stop, &stats, std::chrono::milliseconds(50), hooks);
    });
    return std::make_unique<pair::TransportLink>(std::move(ep_inf), shape);
  }
  /// Stops the serving thread (after the current update) and waits for it.
  void join() {
    stop = true;
    if (th.joinable()) th.join();
  }
  ~LoopbackCacheRank() { join(); }
};

}  // namespace spade::test

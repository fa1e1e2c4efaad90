// What the cache_rank binary's two serving loops (--device cpu: serve_cpu below; --device cuda: serve_gpu in main.cpp)
// share: this rank's place in the world and its status (Rank), the rendezvous with the paired inference rank
// (Paired), and the layer shard it holds for it (Shard).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "cache_rank/rank_flags.h"
#include "common/config.h"
#include "common/metrics.h"
#include "common/status_endpoint.h"
#include "coordinator/client.h"

namespace spade::cache_rank_cli {

/// The world after the rendezvous, and the inference rank this cache rank serves (named for errors and logs).
struct Paired {
  spade::proto::ClusterView view;
  std::string peer_name;
};

/// What both serving loops share: the attention view of the model, this rank's place in the world and its status.
struct Rank {
  spade::ModelConfig cfg;  // attention layers only (hybrid models: the full-attention layers)
  spade::coord::LaunchEnv env;
  std::string self;  // "cache rank R (#i)"
  spade::metrics::Registry& registry;
  spade::LoopHeartbeat& heartbeat;
  std::atomic<bool>& connected;  // /ready: paired and serving
  std::atomic<bool>& stop;       // the process's stop (SIGINT / SIGTERM, the world's shutdown); outlives the loops
};

/// The histogram of sampled overlap ratios (--overlap-sample-every; both devices observe it).
spade::metrics::Histogram& overlap_ratio_histogram(spade::metrics::Registry& registry);

/// The KV-pool gauges of a cache rank, both devices: spade_cache_sequences (live sequences whose KV it holds),
/// spade_cache_retained_prefixes (prompt prefixes of ended sequences kept for later requests),
/// spade_cache_kv_usage_perc (used fraction of the pool, 0..1) and spade_cache_kv_pages_used (pages held, a shared
/// page once).
struct CachePoolGauges {
  spade::metrics::Gauge& sequences;
  spade::metrics::Gauge& retained;
  spade::metrics::Gauge& kv_usage;
  spade::metrics::Gauge& kv_pages;
  /// `pages_used` of a pool of `pages_total` pages (> 0).
  void set(double live_sequences, double retained_prefixes, double pages_used, double pages_total);
  void clear() { set(0, 0, 0, 1); }  // no pool (no paired inference rank)
};
CachePoolGauges cache_pool_gauges(spade::metrics::Registry& registry);

/// "inference rank R (#i) on HOST": how errors and logs name `peer`.
std::string inference_name(const spade::proto::RankInfo& peer);

/// Registers with the coordinator through `cc` and waits (up to `deadline`) for the world; `self` names this rank in
/// errors. Throws spade::Error when the coordinator paired no inference rank with it (or the rendezvous fails).
Paired rendezvous_with_inference(spade::coord::CoordinatorClient& cc, spade::coord::Deadline deadline,
                                 const std::string& self);

/// The layers (and pool pages) this cache rank holds for inference rank `peer`: all of them (and --kv-pages) when it
/// is the only cache rank of its inference rank; else its shard's (pair/sharded_link.h: the layers of the packs
/// p mod N == shard, with the inference rank's --layers-per-pack), in a pool of the same memory (more pages).
struct Shard {
  uint32_t index = 0, count = 1;
  std::vector<int> layers;  // empty: every layer
  int pages = 0;
};
/// `kv_pages`: --kv-pages. Throws spade::Error (naming `self` and `peer_name`) when `peer` registered no
/// --layers-per-pack while this rank is one of several shards, or when its shard would hold no layer.
Shard shard_for(const spade::proto::ClusterView& view, const spade::proto::RankInfo& peer,
                const spade::ModelConfig& cfg, int kv_pages, const std::string& self, const std::string& peer_name);

/// --device cpu: the CPU selector (cache::Selector) serving the paired inference rank's layer packs over UCX, one
/// session per incarnation of it (a replacement is waited for up to --rejoin-timeout-ms). Returns the exit code: the
/// coordinator's verdict when the world stops, 1 when no replacement came.
int serve_cpu(const Flags& f, const Rank& r);

}  // namespace spade::cache_rank_cli

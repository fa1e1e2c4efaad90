// The cache_rank binary's rendezvous and layer shards (rank_serve.h).
#include "cache_rank/rank_serve.h"

#include <algorithm>

#include "common/error.h"
#include "pair/sharded_link.h"

namespace spade::cache_rank_cli {

spade::metrics::Histogram& overlap_ratio_histogram(spade::metrics::Registry& registry) {
  return registry
      .histogram("spade_selection_overlap_ratio",
                 "Sampled overlap of the predicted top-k with the true-query top-k (AsyncSpade Eq. 1).",
                 spade::metrics::linear_buckets(0.1, 0.1, 10))
      .with();
}

CachePoolGauges cache_pool_gauges(spade::metrics::Registry& registry) {
  return CachePoolGauges{
      registry
          .gauge("spade_cache_sequences",
                 "Live sequences whose KV this cache rank holds (retained prefixes are counted apart).")
          .with(),
      registry
          .gauge("spade_cache_retained_prefixes",
                 "Prompt prefixes of ended sequences this cache rank keeps for later requests to share (their pages "
                 "count in spade_cache_kv_pages_used).")
          .with(),
      registry.gauge("spade_cache_kv_usage_perc", "Used fraction of the cache rank's KV pool (0..1).").with(),
      registry.gauge("spade_cache_kv_pages_used", "KV pages this cache rank holds (a page its sequences share counts once).")
          .with()};
}

void CachePoolGauges::set(double live_sequences, double retained_prefixes, double pages_used, double pages_total) {
  sequences.set(live_sequences);
  retained.set(retained_prefixes);
  kv_usage.set(pages_total > 0 ? 1.0 - (pages_total - pages_used) / pages_total : 0.0);  // as the engine's usage()
  kv_pages.set(pages_used);
}

std::string inference_name(const spade::proto::RankInfo& peer) {
  return fmt::format("inference rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
}

Shard shard_for(const spade::proto::ClusterView& view, const spade::proto::RankInfo& peer,
                const spade::ModelConfig& cfg, int kv_pages, const std::string& self, const std::string& peer_name) {
  Shard s;
  s.index = view.self().shard();
  s.count = std::max<uint32_t>(1, view.cache_ranks_per_inference());
  s.pages = kv_pages;
  if (s.count == 1) return s;
  SPADE_CHECK(peer.layers_per_pack() >= 1,
              "{}: {} registered no --layers-per-pack, and this rank is shard {} of {} of its layer packs", self,
              peer_name, s.index, s.count);
  s.layers = spade::pair::shard_layers(static_cast<int>(s.index), static_cast<int>(s.count), cfg.num_layers,
                                       static_cast<int>(peer.layers_per_pack()));
  SPADE_CHECK(!s.layers.empty(),
              "{}: shard {} of {} holds no layer: the model has {} attention layers in packs of {} (--layers-per-pack "
              "of {}), fewer packs than cache ranks; start fewer cache ranks per inference rank or pass a smaller "
              "--layers-per-pack",
              self, s.index, s.count, cfg.num_layers, peer.layers_per_pack(), peer_name);
  s.pages = spade::pair::shard_pool_pages(kv_pages, cfg.num_layers, static_cast<int>(s.layers.size()));
  return s;
}

Paired rendezvous_with_inference(spade::coord::CoordinatorClient& cc, spade::coord::Deadline deadline,
                                 const std::string& self) {
  Paired p{cc.rendezvous(deadline), {}};
  SPADE_CHECK(p.view.peers_size() > 0, "{}: the coordinator paired no inference rank with us", self);
  const spade::proto::RankInfo& peer = p.view.peers(0);
  p.peer_name = inference_name(peer);
  return p;
}

}  // namespace spade::cache_rank_cli

// One inference rank, N cache ranks: a CacheRankLink that shards the layer packs over N links (one per cache rank).
//
// Layer pack p goes to shard p mod N (round robin), so the packs of one step are served by the N cache ranks in
// parallel while the pipeline walks the packs in order, and each cache rank holds the KV of its packs' layers only
// (its capacity adds to the others'). Selection is per layer and KV head (AsyncSpade Algorithm 1, token-level top-k),
// so a sharded pair selects exactly what one cache rank holding every layer would.
//
// Ordering: receive() answers the oldest update not yet received, as CacheRankLink promises: the shard of each
// update is remembered in send order and the answer is taken from that shard (each shard answers its own updates in
// order). Released sequences are forwarded to every shard: the released ids of an update are sent with it to its
// shard and queued for the other shards' next updates (a shard frees them at its next update); an update that
// carries releases only (no layer, no sequence: the idle flush) goes to every shard at once, and its one answer is
// taken once every shard has answered.
//
// Errors: a failed shard fails the whole link (spade::Error naming the shard's cache rank): the inference rank then
// fails or densifies the affected requests as for one cache rank.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "pair/link.h"

namespace spade::pair {

/// Which shard serves layer pack `pack` when `num_shards` cache ranks share an inference rank (pack mod N).
/// Throws spade::Error if num_shards < 1 or pack < 0.
int shard_of_pack(int pack, int num_shards);

/// The layers a shard holds: every layer of the packs it serves. `layers_per_pack` >= 1, layers >= 1.
/// Returns the sorted layer indices (empty when the shard serves no pack: more shards than packs).
std::vector<int> shard_layers(int shard, int num_shards, int num_layers, int layers_per_pack);

/// The KV pool of a shard holding `shard_layers` of `num_layers` layers, in pages, from `full_pages`, the pages a
/// pool holding every layer would have in the same memory (the cache rank's --kv-pages): full_pages * num_layers /
/// shard_layers, rounded down (N shards of equal size hold N times the tokens of one). Throws spade::Error when
/// full_pages < 1, shard_layers is outside [1, num_layers], or the result overflows int.
int shard_pool_pages(int full_pages, int num_layers, int shard_layers);

class ShardedLink : public CacheRankLink {
 public:
  /// `shards`: one link per cache rank, in shard order (shard i serves packs p with p mod N == i). At least one;
  /// none may be null (spade::Error otherwise).
  explicit ShardedLink(std::vector<std::unique_ptr<CacheRankLink>> shards);
  void send(PackUpdate&& u) override;
  PackSelection receive(transport::Deadline deadline, bool* waited) override;
  size_t in_flight() const override { return order_.size(); }
  /// Sums over the shards (refreshed by send / receive).
  const LinkStats& stats() const override;
  /// "name0,name1,...".
  std::string peer() const override;
  /// The first shard's failure, "" while every shard is usable.
  std::string failure() const override;
  int num_shards() const { return static_cast<int>(shards_.size()); }
  CacheRankLink& shard(int i) { return *shards_.at(static_cast<size_t>(i)); }

 private:
  std::vector<std::unique_ptr<CacheRankLink>> shards_;
  std::vector<std::vector<uint64_t>> pending_released_;  // per shard: released ids not yet sent to it
  static constexpr int kAllShards = -1;                  // order_ entry of a releases-only update sent to every shard
  std::deque<int> order_;                                // shard of each update not yet received, oldest first
  mutable LinkStats stats_;
};

}  // namespace spade::pair

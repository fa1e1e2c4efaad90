// One inference rank, N cache ranks: a CacheRankLink that shards the layer packs over N links (one per cache rank).
//
// Layer pack p goes to shard p mod N (round robin), so the packs of one step are served by the N cache ranks in
// parallel while the pipeline walks the packs in order, and each cache rank holds the KV of its packs' layers only
// (its capacity adds to the others'). Selection is per layer and KV head (AsyncSpade Algorithm 1, token-level top-k),
// so a sharded pair selects exactly what one cache rank holding every layer would.
//
// Ordering: receive() answers the oldest update not yet received, as CacheRankLink promises: the shard of each
// update is remembered in send order and the answer is taken from that shard (each shard answers its own updates in
// order). Released sequences, retained prefixes and their drops (PackUpdate::released / retained / dropped: each shard
// holds its layers of every sequence, so each keeps its layers of a retained prefix) are forwarded to every shard:
// those of an update are sent with it to its shard and queued for the other shards' next updates, ahead of those
// updates' entries (so an INIT sharing from a retained prefix finds it there). Queued entries are merged as the
// inference rank merges its own: a later retain of the same id replaces the earlier (a shortened prefix), and a drop
// of a prefix whose release is still queued cancels its retain (the release frees it). An update that carries such
// news only (no layer, no sequence: the idle flush) goes to every shard at once, and its one answer is taken once
// every shard has answered. News is queued for every shard before any is sent, so a shard whose send fails (its cache
// rank is down) leaves the others' news queued, and a replacement's clean-up stays consistent with what they hold.
//
// Errors: a failed shard fails the whole link (spade::Error naming the shard's cache rank): the inference rank then
// fails or densifies the affected requests as for one cache rank.
//
// Rejoin: a replacement of one shard's cache rank (a new process, holding nothing) is checked with probe_shard() and
// swapped in with replaced(): the other shards keep their links and their pools; the sequences they still hold (every
// sequence known before the swap: those the failure ended and those still running, which stay dense to their end)
// are released on them with their next update, and their retained prefixes dropped (the inference rank forgets its
// retained prefixes when it takes the new link: SparseAttention::replace_link).
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/config.h"
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

/// "0,2,4": a layer list for messages.
std::string layer_list(const std::vector<int>& layers);

/// What a replacement cache rank is, as the coordinator announces it (its RankInfo in the PeerReplaced).
struct ShardClaim {
  bool cache = true;  // its role is cache rank
  uint32_t rank = 0, role_index = 0, shard = 0;
};

/// Why the replacement `claim` (named `name` in the reason) cannot be re-paired as layer shard `shard` of
/// `num_shards`, whose cache rank is cache #`role_index` (holding the layers of the shard's packs: `num_layers` in
/// packs of `layers_per_pack`): a role other than cache rank, another role index or another shard. "" when it can.
/// The reason names the replacement, its claim, and the shard with its layers.
std::string shard_claim_error(const ShardClaim& claim, const std::string& name, int shard, int num_shards,
                              uint32_t role_index, int num_layers, int layers_per_pack);

/// The sequence id of probe_shard()'s probe (no engine sequence has it).
inline constexpr uint64_t kProbeSeqId = ~uint64_t{0};

/// Checks that the cache rank behind `link` (just connected, nothing in flight) serves layer shard `shard` of
/// `num_shards` for a model of `attn_cfg` (the attention layers) in packs of `layers_per_pack`: for each of the
/// shard's packs it sends the INIT of a one-token probe sequence (kProbeSeqId, zero q/k/v) and reads the answer, then
/// releases the probe with one more update. Leaves nothing on the cache rank and nothing in flight. Throws
/// spade::Error naming the link's peer, the shard and the layers it must hold when an answer is an error (a cache
/// rank holding other layers: another shard's, or another model's) or does not come by `deadline`.
void probe_shard(CacheRankLink& link, int shard, int num_shards, const ModelConfig& attn_cfg, int layers_per_pack,
                 transport::Deadline deadline);

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
  /// Shard i's link. Throws spade::Error for an index out of range or once replaced() took the links.
  CacheRankLink& shard(int i);
  /// Sequences sent to the shards (in an update's entries) and not released since.
  size_t live_sequences() const { return live_.size(); }
  /// Retained prefixes sent or queued to the shards and not dropped since.
  size_t retained_prefixes() const { return retained_.size(); }

  /// Shard `s`'s cache rank was replaced: returns a sharded link over this link's other shards and `link` (to the
  /// replacement, probed, nothing in flight) as shard s. The answers the other shards still owe (updates sent before
  /// the failure; an answer carrying an error is dropped like the others) are received by `deadline`; every sequence
  /// they hold (live_sequences(), and releases not yet sent) is released with their next update. Another shard whose
  /// transport failed is left as it is (the returned link fails naming it until that shard is replaced in turn).
  /// Shard s's old link is destroyed. This link is left without shards: it still answers peer(), failure() and
  /// stats() (zero), nothing else. Throws spade::Error for `s` out of range or a null `link`, and naming the shard
  /// when another shard's owed answer does not come by `deadline` or its transport fails meanwhile (this link keeps
  /// its shards then, and is unusable).
  std::unique_ptr<ShardedLink> replaced(int s, std::unique_ptr<CacheRankLink> link, transport::Deadline deadline);

 private:
  std::vector<std::unique_ptr<CacheRankLink>> shards_;  // empty once replaced() took them
  std::string peers_;                                    // peer(), kept for a link replaced() emptied
  // Releases, retained prefixes and drops not yet sent to one shard (they ride its next update).
  struct News {
    std::vector<uint64_t> released;
    std::vector<Retain> retained;
    std::vector<uint64_t> dropped;
  };
  // Appends the news of a later update to `q`, merged (a retain replaces an earlier one of its id; a drop cancels a
  // queued retain, and is left out when the id's release is queued too).
  static void merge(News& q, const std::vector<uint64_t>& released, const std::vector<Retain>& retained,
                    const std::vector<uint64_t>& dropped);
  std::unordered_set<uint64_t> live_;      // sequences sent and not released
  std::unordered_set<uint64_t> retained_;  // retained prefixes sent or queued, not dropped
  std::vector<News> pending_;              // per shard: news not yet sent to it
  static constexpr int kAllShards = -1;                  // order_ entry of a releases-only update sent to every shard
  std::deque<int> order_;                                // shard of each update not yet received, oldest first
  mutable LinkStats stats_;
};

}  // namespace spade::pair

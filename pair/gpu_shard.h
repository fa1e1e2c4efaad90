// Layer shards on the GPU pair: one inference rank, N GPU cache ranks, one GpuLink each (pair/gpu_plan.h protocol on
// every link). The packs are sharded as on the CPU path (pair/sharded_link.h): model layer pack p goes to shard
// p mod N. A shard's GpuCacheServer is the one-cache-rank server, built from the attention view with num_layers = the
// shard's layer count; it sees its packs as its own packs 0..n-1, in model order:
//
//   model pack p  <->  local pack p / N on shard p mod N
//
// Every model pack has layers_per_pack (P) layers except possibly the model's last pack, which is the last pack of
// its shard; so on every shard the local packs are P layers each except possibly the last, exactly the packs a
// server with the shard's layer count and the same P cuts (gpu_shard_view checks this). Each link carries the step's
// plan (the same plan to every shard), the rows of its packs and their selections (steady / first messages) in pack
// order, so every receive one side posts has a send of the same size on the other.
//
// The inference rank registers one transport address for its N links: join_shard_addresses() packs the N offers'
// addresses, shard_address() gives each cache rank its own (the coordinator forwards the bytes verbatim).
#pragma once

#include <string>
#include <vector>

#include "pair/gpu_plan.h"

namespace spade::pair {

/// What shard `shard` of `num_shards` holds of a model with `num_layers` attention layers in packs of
/// `layers_per_pack`.
struct GpuShardView {
  int shard = 0, num_shards = 1;
  std::vector<int> packs;        // the model packs it serves, ascending (p mod N == shard); local pack j = packs[j]
  std::vector<int> layers;       // the model layers of those packs, ascending (pair::shard_layers)
  std::vector<int> pack_layers;  // layers of local pack j (= of model pack packs[j])
  /// The shard's layer count: the num_layers of its attention view and of its pair hello.
  int num_layers() const { return static_cast<int>(layers.size()); }
};

/// Local pack index of model pack `pack` on its shard (pack / N). Throws spade::Error for pack < 0 or N < 1.
int local_pack_of(int pack, int num_shards);

/// The shard's view, checked against the one-cache-rank server's pack cut of num_layers() layers in packs of
/// layers_per_pack (local pack j has min(P, num_layers() - j P) layers). Throws spade::Error naming --layers-per-pack
/// when the shard would hold no pack (more shards than packs), for arguments out of range, or if the cut differs.
GpuShardView gpu_shard_view(int shard, int num_shards, int num_layers, int layers_per_pack);

/// The hello shard `shard` of `num_shards` gets from the pair hello `h` (made for every layer): num_layers = the
/// shard's layer count; every other field unchanged (the pool's num_pages is the engine's bound on full contexts,
/// in pages of the shard's layers: a shard's pool takes num_layers() / L of one cache rank's memory). Throws
/// spade::Error as gpu_shard_view.
GpuPairHello shard_gpu_hello(const GpuPairHello& h, int shard, int num_shards);

/// One transport address for N shard links: with one address, that address unchanged (the one-cache-rank wire);
/// with more, a tagged list of them. Throws spade::Error for an empty list.
std::string join_shard_addresses(const std::vector<std::string>& addresses);
/// Shard `shard`'s address from `joined` (join_shard_addresses of `num_shards` addresses); with num_shards 1,
/// `joined` itself. Throws spade::Error naming `peer` (the inference rank) for a list that is malformed or holds
/// another number of addresses.
std::string shard_address(const std::string& joined, int shard, int num_shards, const std::string& peer);

}  // namespace spade::pair

// Layer shards on the GPU pair (see gpu_shard.h).
#include "pair/gpu_shard.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/error.h"
#include "pair/sharded_link.h"

namespace spade::pair {

namespace {
constexpr char kShardMagic[] = "SPADE-GPU-SHARDS/1";  // followed by u32 count, then per address u32 length + bytes
constexpr size_t kMagicLen = sizeof(kShardMagic) - 1;

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
}  // namespace

int local_pack_of(int pack, int num_shards) {
  SPADE_CHECK(num_shards >= 1 && pack >= 0, "GPU layer shards: pack {} of {} shards", pack, num_shards);
  return pack / num_shards;
}

GpuShardView gpu_shard_view(int shard, int num_shards, int num_layers, int layers_per_pack) {
  SPADE_CHECK(num_shards >= 1 && shard >= 0 && shard < num_shards && num_layers >= 1 && layers_per_pack >= 1,
              "GPU layer shards: shard {} of {}, {} layers in packs of {}", shard, num_shards, num_layers,
              layers_per_pack);
  const int packs = (num_layers + layers_per_pack - 1) / layers_per_pack;
  SPADE_CHECK(packs >= num_shards,
              "GPU layer shards: {} cache ranks but only {} layer packs ({} attention layers, --layers-per-pack {}): "
              "shard {} would hold no layer; pass a smaller --layers-per-pack or start fewer cache ranks",
              num_shards, packs, num_layers, layers_per_pack, shard);
  GpuShardView v;
  v.shard = shard;
  v.num_shards = num_shards;
  for (int p = shard; p < packs; p += num_shards) {
    v.packs.push_back(p);
    v.pack_layers.push_back(std::min(num_layers, (p + 1) * layers_per_pack) - p * layers_per_pack);
  }
  v.layers = shard_layers(shard, num_shards, num_layers, layers_per_pack);
  // The one-cache-rank server over num_layers() layers cuts them into packs of P, the last one partial: the same
  // packs, in the same order, as the model packs this shard serves.
  const int local_layers = v.num_layers();
  const int local_packs = (local_layers + layers_per_pack - 1) / layers_per_pack;
  SPADE_CHECK(local_packs == static_cast<int>(v.packs.size()),
              "GPU layer shards: shard {} of {} serves {} packs but its {} layers cut into {}", shard, num_shards,
              v.packs.size(), local_layers, local_packs);
  for (int j = 0; j < local_packs; ++j) {
    const int local = std::min(layers_per_pack, local_layers - j * layers_per_pack);
    SPADE_CHECK(local == v.pack_layers[static_cast<size_t>(j)],
                "GPU layer shards: shard {} of {}: local pack {} has {} layers, model pack {} has {}", shard,
                num_shards, j, local, v.packs[static_cast<size_t>(j)], v.pack_layers[static_cast<size_t>(j)]);
    SPADE_CHECK(local_pack_of(v.packs[static_cast<size_t>(j)], num_shards) == j,
                "GPU layer shards: model pack {} is not local pack {} of shard {}", v.packs[static_cast<size_t>(j)], j,
                shard);
  }
  return v;
}

GpuPairHello shard_gpu_hello(const GpuPairHello& h, int shard, int num_shards) {
  GpuPairHello s = h;
  s.num_layers = gpu_shard_view(shard, num_shards, h.num_layers, h.layers_per_pack).num_layers();
  return s;
}

std::string join_shard_addresses(const std::vector<std::string>& addresses) {
  SPADE_CHECK(!addresses.empty(), "GPU layer shards: no link address");
  if (addresses.size() == 1) return addresses.front();
  std::string s(kShardMagic, kMagicLen);
  put_u32(s, static_cast<uint32_t>(addresses.size()));
  for (const std::string& a : addresses) {
    put_u32(s, static_cast<uint32_t>(a.size()));
    s += a;
  }
  return s;
}

std::string shard_address(const std::string& joined, int shard, int num_shards, const std::string& peer) {
  SPADE_CHECK(num_shards >= 1 && shard >= 0 && shard < num_shards, "GPU layer shards: shard {} of {}", shard,
              num_shards);
  const bool tagged = joined.size() >= kMagicLen && std::memcmp(joined.data(), kShardMagic, kMagicLen) == 0;
  if (num_shards == 1) {
    SPADE_CHECK(!tagged, "{} offers links to several layer shards, but this world gives it one cache rank", peer);
    return joined;
  }
  SPADE_CHECK(tagged,
              "{} offers one GPU link, but this world gives each inference rank {} cache ranks (layer shards): start "
              "it with the same --num-cache / --num-inference",
              peer, num_shards);
  size_t off = kMagicLen;
  const auto get_u32 = [&](const char* what) {
    SPADE_CHECK(off + 4 <= joined.size(), "{}: its address list ends inside {} ({} bytes)", peer, what,
                joined.size());
    uint32_t v = 0;
    std::memcpy(&v, joined.data() + off, 4);
    off += 4;
    return v;
  };
  const uint32_t count = get_u32("the address count");
  SPADE_CHECK(count == static_cast<uint32_t>(num_shards),
              "{} offers links to {} layer shards, but this world gives each inference rank {} cache ranks", peer,
              count, num_shards);
  std::string mine;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t len = get_u32("an address length");
    SPADE_CHECK(len <= joined.size() - off, "{}: address {} of its list claims {} bytes, {} are left", peer, i, len,
                joined.size() - off);
    if (i == static_cast<uint32_t>(shard)) mine = joined.substr(off, len);
    off += len;
  }
  SPADE_CHECK(off == joined.size(), "{}: {} trailing bytes after its {} addresses", peer, joined.size() - off, count);
  return mine;
}

}  // namespace spade::pair

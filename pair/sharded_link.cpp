#include "pair/sharded_link.h"

#include <fmt/format.h>

#include <cstdint>

#include "common/error.h"

namespace spade::pair {

int shard_of_pack(int pack, int num_shards) {
  SPADE_CHECK(num_shards >= 1, "sharded link: {} shards (need at least 1)", num_shards);
  SPADE_CHECK(pack >= 0, "sharded link: negative pack index {}", pack);
  return pack % num_shards;
}

std::vector<int> shard_layers(int shard, int num_shards, int num_layers, int layers_per_pack) {
  SPADE_CHECK(num_shards >= 1 && shard >= 0 && shard < num_shards, "sharded link: shard {} of {}", shard, num_shards);
  SPADE_CHECK(num_layers >= 1 && layers_per_pack >= 1, "sharded link: {} layers, {} per pack", num_layers,
              layers_per_pack);
  std::vector<int> layers;
  const int packs = (num_layers + layers_per_pack - 1) / layers_per_pack;
  for (int p = shard; p < packs; p += num_shards)
    for (int l = p * layers_per_pack; l < std::min(num_layers, (p + 1) * layers_per_pack); ++l) layers.push_back(l);
  return layers;
}

int shard_pool_pages(int full_pages, int num_layers, int shard_layers) {
  SPADE_CHECK(full_pages >= 1, "sharded KV pool: {} pages (need at least 1)", full_pages);
  SPADE_CHECK(shard_layers >= 1 && shard_layers <= num_layers, "sharded KV pool: a shard of {} of {} layers",
              shard_layers, num_layers);
  const int64_t pages = int64_t{full_pages} * num_layers / shard_layers;
  SPADE_CHECK(pages <= INT32_MAX, "sharded KV pool: {} pages x {} layers / {} overflows", full_pages, num_layers,
              shard_layers);
  return static_cast<int>(pages);
}

ShardedLink::ShardedLink(std::vector<std::unique_ptr<CacheRankLink>> shards)
    : shards_(std::move(shards)), pending_released_(shards_.size()) {
  SPADE_CHECK(!shards_.empty(), "sharded link: no cache rank link");
  for (size_t i = 0; i < shards_.size(); ++i) SPADE_CHECK(shards_[i] != nullptr, "sharded link: shard {} is null", i);
}

void ShardedLink::send(PackUpdate&& u) {
  if (u.seqs.empty() && u.num_layers == 0) {  // releases only (an idle flush): every shard frees them now
    for (size_t i = 0; i < shards_.size(); ++i) {
      PackUpdate c;
      c.step = u.step;
      c.pack = u.pack;
      c.first_layer = u.first_layer;
      c.num_layers = 0;
      c.released.swap(pending_released_[i]);
      c.released.insert(c.released.end(), u.released.begin(), u.released.end());
      shards_[i]->send(std::move(c));
    }
    order_.push_back(kAllShards);
    return;
  }
  const int s = shard_of_pack(u.pack, num_shards());
  // Releases reach every shard: this update carries them to its shard, the others get them with their next update.
  for (size_t i = 0; i < shards_.size(); ++i)
    if (static_cast<int>(i) != s)
      pending_released_[i].insert(pending_released_[i].end(), u.released.begin(), u.released.end());
  auto& mine = pending_released_[static_cast<size_t>(s)];
  if (!mine.empty()) {
    u.released.insert(u.released.begin(), mine.begin(), mine.end());
    mine.clear();
  }
  shards_[static_cast<size_t>(s)]->send(std::move(u));
  order_.push_back(s);
}

PackSelection ShardedLink::receive(transport::Deadline deadline, bool* waited) {
  SPADE_CHECK(!order_.empty(), "sharded link ({}): receive without a pending update", peer());
  const int s = order_.front();
  if (s == kAllShards) {  // one answer per shard, all for this update (the earlier ones were received first)
    PackSelection first;
    bool any_waited = false;
    for (size_t i = 0; i < shards_.size(); ++i) {
      bool w = false;
      PackSelection p = shards_[i]->receive(deadline, &w);
      any_waited = any_waited || w;
      if (i == 0) first = std::move(p);
    }
    if (waited) *waited = any_waited;
    order_.pop_front();
    return first;
  }
  PackSelection p = shards_[static_cast<size_t>(s)]->receive(deadline, waited);
  order_.pop_front();
  return p;
}

const LinkStats& ShardedLink::stats() const {
  stats_ = LinkStats{};
  for (const auto& l : shards_) {
    const LinkStats& s = l->stats();
    stats_.bytes_sent += s.bytes_sent;
    stats_.bytes_received += s.bytes_received;
    stats_.updates += s.updates;
    stats_.cache_select_ms += s.cache_select_ms;
  }
  return stats_;
}

std::string ShardedLink::peer() const {
  std::string names;
  for (const auto& l : shards_) names += (names.empty() ? "" : ",") + l->peer();
  return names;
}

std::string ShardedLink::failure() const {
  for (const auto& l : shards_)
    if (std::string f = l->failure(); !f.empty()) return f;
  return "";
}

}  // namespace spade::pair

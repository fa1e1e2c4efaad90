#include "pair/sharded_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "common/error.h"

namespace spade::pair {

namespace {

// Reads every answer in flight on `link`; an answer carrying the cache rank's error is consumed like the others.
// on_error(e, consumed) sees each error; consumed false (the transport failed or the deadline passed: the answer is
// still in flight) ends the drain.
template <typename OnError>
void drain_answers(CacheRankLink& link, transport::Deadline deadline, OnError on_error) {
  while (link.in_flight() > 0) {
    const size_t before = link.in_flight();
    bool waited = false;
    try {
      (void)link.receive(deadline, &waited);
    } catch (const Error& e) {
      const bool consumed = link.in_flight() != before;
      on_error(e, consumed);
      if (!consumed) return;
    }
  }
}

}  // namespace

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

std::string layer_list(const std::vector<int>& layers) {
  std::string s;
  for (int l : layers) s += (s.empty() ? "" : ",") + std::to_string(l);
  return s;
}

std::string shard_claim_error(const ShardClaim& claim, const std::string& name, int shard, int num_shards,
                              uint32_t role_index, int num_layers, int layers_per_pack) {
  if (claim.cache && claim.role_index == role_index && claim.shard == static_cast<uint32_t>(shard)) return "";
  return fmt::format("the replacement {} is refused: it claims layer shard {} as {} #{}, but rank {} is layer shard {} "
                     "of {} (cache #{}, layers {}); not re-paired",
                     name, claim.shard, claim.cache ? "cache" : "a non-cache rank", claim.role_index, claim.rank, shard,
                     num_shards, role_index, layer_list(shard_layers(shard, num_shards, num_layers, layers_per_pack)));
}

void probe_shard(CacheRankLink& link, int shard, int num_shards, const ModelConfig& attn_cfg, int layers_per_pack,
                 transport::Deadline deadline) {
  const std::vector<int> layers = shard_layers(shard, num_shards, attn_cfg.num_layers, layers_per_pack);
  SPADE_CHECK(!layers.empty(), "{}: layer shard {} of {} holds no layer ({} layers in packs of {})", link.peer(), shard,
              num_shards, attn_cfg.num_layers, layers_per_pack);
  SPADE_CHECK(link.in_flight() == 0, "{}: probed with {} updates in flight", link.peer(), link.in_flight());
  const int packs = (attn_cfg.num_layers + layers_per_pack - 1) / layers_per_pack;
  try {
    for (int p = shard; p < packs; p += num_shards) {
      PackUpdate u;
      u.pack = p;
      u.first_layer = p * layers_per_pack;
      u.num_layers = std::min(attn_cfg.num_layers, (p + 1) * layers_per_pack) - u.first_layer;
      SeqUpdate e;
      e.seq_id = kProbeSeqId;
      e.context_len = 1;
      e.init = true;
      e.num_queries = 1;
      e.q.assign(static_cast<size_t>(u.num_layers) * attn_cfg.q_dim(), 0.0f);
      e.k.assign(static_cast<size_t>(u.num_layers) * attn_cfg.kv_dim(), 0.0f);
      e.v = e.k;
      u.seqs.push_back(std::move(e));
      link.send(std::move(u));
    }
    PackUpdate release;  // releases only: the probe leaves nothing behind
    release.pack = shard;
    release.first_layer = shard * layers_per_pack;
    release.released.push_back(kProbeSeqId);
    link.send(std::move(release));
    // Every answer is read (an error answer is consumed too), so that a failed probe leaves nothing in flight either.
    std::string first_error;
    drain_answers(link, deadline, [&](const Error& e, bool) {
      if (first_error.empty()) first_error = e.what();
    });
    if (!first_error.empty()) fail("{}", first_error);
  } catch (const Error& e) {
    fail("{} does not serve layer shard {} of {} (layers {} of {}, --layers-per-pack {}): {}", link.peer(), shard,
         num_shards, layer_list(layers), attn_cfg.num_layers, layers_per_pack, e.what());
  }
}

ShardedLink::ShardedLink(std::vector<std::unique_ptr<CacheRankLink>> shards)
    : shards_(std::move(shards)), pending_(shards_.size()) {
  SPADE_CHECK(!shards_.empty(), "sharded link: no cache rank link");
  for (size_t i = 0; i < shards_.size(); ++i) SPADE_CHECK(shards_[i] != nullptr, "sharded link: shard {} is null", i);
  for (const auto& l : shards_) peers_ += (peers_.empty() ? "" : ",") + l->peer();
}

CacheRankLink& ShardedLink::shard(int i) {
  SPADE_CHECK(i >= 0 && i < num_shards(), "sharded link ({}): no shard {} ({} shards)", peers_, i, num_shards());
  return *shards_[static_cast<size_t>(i)];
}

std::unique_ptr<ShardedLink> ShardedLink::replaced(int s, std::unique_ptr<CacheRankLink> link,
                                                   transport::Deadline deadline) {
  SPADE_CHECK(s >= 0 && s < num_shards(), "sharded link ({}): no shard {} to replace ({} shards)", peers_, s,
              num_shards());
  SPADE_CHECK(link != nullptr, "sharded link ({}): a null link for shard {}", peers_, s);
  // The other shards' answers to updates sent before the failure come first on their links: read and drop them.
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (static_cast<int>(i) == s) continue;
    CacheRankLink& l = *shards_[i];
    if (!l.failure().empty()) continue;  // down as well: its own replacement swaps it in turn
    drain_answers(l, deadline, [&](const Error& e, bool consumed) {
      if (!consumed)
        fail("sharded link: layer shard {} ({}) failed while shard {} was replaced: {}", i, l.peer(), s, e.what());
    });
  }
  // The other shards free what they hold: the sequences, and the retained prefixes (the inference rank forgets its
  // own when it takes the new link).
  const std::vector<uint64_t> live(live_.begin(), live_.end()), kept(retained_.begin(), retained_.end());
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (static_cast<int>(i) == s) continue;
    merge(pending_[i], live, {}, kept);
  }
  pending_[static_cast<size_t>(s)] = News{};  // the replacement holds nothing
  shards_[static_cast<size_t>(s)] = std::move(link);
  auto next = std::make_unique<ShardedLink>(std::move(shards_));
  next->pending_ = std::move(pending_);
  shards_.clear();
  pending_.clear();
  order_.clear();
  live_.clear();
  retained_.clear();
  return next;
}

void ShardedLink::merge(News& q, const std::vector<uint64_t>& released, const std::vector<Retain>& retained,
                        const std::vector<uint64_t>& dropped) {
  q.released.insert(q.released.end(), released.begin(), released.end());
  for (const Retain& r : retained) {
    auto it = std::find_if(q.retained.begin(), q.retained.end(), [&](const Retain& e) { return e.seq_id == r.seq_id; });
    if (it != q.retained.end())
      it->tokens = r.tokens;
    else
      q.retained.push_back(r);
  }
  for (uint64_t id : dropped) {
    auto it = std::find_if(q.retained.begin(), q.retained.end(), [&](const Retain& e) { return e.seq_id == id; });
    if (it != q.retained.end()) {
      q.retained.erase(it);
      if (std::find(q.released.begin(), q.released.end(), id) != q.released.end()) continue;  // the release frees it
    }
    q.dropped.push_back(id);
  }
}

void ShardedLink::send(PackUpdate&& u) {
  SPADE_CHECK(!shards_.empty(), "sharded link ({}): used after a shard was replaced", peers_);
  for (const SeqUpdate& e : u.seqs) live_.insert(e.seq_id);
  for (uint64_t id : u.released) live_.erase(id);
  for (const Retain& r : u.retained) retained_.insert(r.seq_id);
  for (uint64_t id : u.dropped) retained_.erase(id);
  // The news reaches every shard: queued for each first, then taken by the updates sent. A shard whose send throws
  // (its cache rank is down; it is replaced by one that holds nothing) leaves the others' queues as they are, so
  // their next update, or a replacement's release of what they hold, still carries it.
  for (News& q : pending_) merge(q, u.released, u.retained, u.dropped);
  auto take = [&](size_t i, PackUpdate& c) {
    News q = std::move(pending_[i]);
    pending_[i] = News{};
    c.released = std::move(q.released);
    c.retained = std::move(q.retained);
    c.dropped = std::move(q.dropped);
  };
  if (u.seqs.empty() && u.num_layers == 0) {  // news only (an idle flush): every shard applies it now
    for (size_t i = 0; i < shards_.size(); ++i) {
      PackUpdate c;
      c.step = u.step;
      c.pack = u.pack;
      c.first_layer = u.first_layer;
      c.num_layers = 0;
      take(i, c);
      shards_[i]->send(std::move(c));
    }
    order_.push_back(kAllShards);
    return;
  }
  const int s = shard_of_pack(u.pack, num_shards());
  take(static_cast<size_t>(s), u);  // its queue holds this update's news last
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
  if (shards_.empty()) return peers_;
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

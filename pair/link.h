// How an inference rank reaches its cache rank: send one PackUpdate per layer pack and step, receive the matching
// PackSelection later (one step ahead). Implementations: TransportLink here — a transport::Endpoint to a cache_rank
// process (UCX on CPU hosts), framed as in pair/pack.h — and cache::InProcessLink (cache_rank/pack_server.h), a
// Selector in the same process (tests, the fidelity tools, the oracle baseline). The cache rank's side of the wire is
// cache::serve_cache_rank (cache_rank/pack_server.h).
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "pair/pack.h"
#include "transport/transport.h"

namespace spade::pair {

struct LinkStats {
  uint64_t bytes_sent = 0;      // inference -> cache payload bytes
  uint64_t bytes_received = 0;  // cache -> inference payload bytes
  uint64_t updates = 0;
  double cache_select_ms = 0;   // sum of PackSelection::select_ms
};

class CacheRankLink {
 public:
  virtual ~CacheRankLink() = default;
  /// Posts an update; never blocks on the cache rank's work. Throws spade::Error if the link has failed.
  virtual void send(PackUpdate&& u) = 0;
  /// Returns the selection answering the oldest update not yet received. `*waited` is set when the answer was not
  /// there yet. Throws spade::Error naming the cache rank on failure or when `deadline` passes (a late answer).
  virtual PackSelection receive(transport::Deadline deadline, bool* waited) = 0;
  /// Updates sent but not yet received.
  virtual size_t in_flight() const = 0;
  virtual const LinkStats& stats() const = 0;
  /// "in-process" or the peer's name.
  virtual std::string peer() const = 0;
  /// Why the link can no longer be used, naming the cache rank, as soon as its transport knows (the peer died, or
  /// the endpoint was aborted on the coordinator's PeerDown) — also before an operation on it failed; "" while it
  /// is usable. Thread-safe.
  virtual std::string failure() const { return ""; }
};

class TransportLink : public CacheRankLink {
 public:
  TransportLink(std::unique_ptr<transport::Endpoint> ep, PackShape shape);
  ~TransportLink() override;
  void send(PackUpdate&& u) override;
  PackSelection receive(transport::Deadline deadline, bool* waited) override;
  size_t in_flight() const override { return pending_recvs_.size(); }
  const LinkStats& stats() const override { return stats_; }
  std::string peer() const override { return ep_->peer_name(); }
  std::string failure() const override;
  /// Tells the cache rank to stop serving this link (best effort, bounded wait).
  void shutdown();

 private:
  struct OutMsg {
    FramePrefix prefix;
    std::vector<uint8_t> payload;
    transport::SendHandle h1, h2;
  };
  struct InMsg {
    FramePrefix prefix;
    transport::RecvHandle h;
  };
  void reap_sends();
  std::unique_ptr<transport::Endpoint> ep_;
  PackShape shape_;
  std::deque<std::unique_ptr<OutMsg>> sends_;
  std::deque<std::unique_ptr<InMsg>> pending_recvs_;
  LinkStats stats_;
};

/// Tags of the link's FIFO channels (transport/tags.h kinds; step and pack travel in the payload). Prefixes and
/// payloads use separate tags so that prefix receives can be posted ahead while payload receives are posted once
/// their size is known.
uint64_t link_up_prefix_tag();
uint64_t link_up_tag();
uint64_t link_down_prefix_tag();
uint64_t link_down_tag();

}  // namespace spade::pair

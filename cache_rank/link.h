// How an inference rank reaches its cache rank: send one PackUpdate per layer pack and step, receive the matching
// PackSelection later (one step ahead). Two implementations:
//   InProcessLink  — a Selector in the same process (tests, the fidelity report, and the oracle baseline);
//   TransportLink  — a transport::Endpoint to a cache_rank process (UCX on CPU hosts), framed as in cache_rank/pack.h.
// And the cache rank's side of the wire: serve_cache_rank() answers updates until shutdown or peer failure.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cache_rank/pack.h"
#include "transport/transport.h"

namespace spade::cache {

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
};

class InProcessLink : public CacheRankLink {
 public:
  /// `delta`: answer with deltas against the held selections (delta transfer, cache_rank/delta.h), as a cache_rank
  /// process does by default.
  InProcessLink(const ModelConfig& cfg, const SelectionConfig& sc, int num_pages, int page_size, bool delta = false);
  void send(PackUpdate&& u) override;
  PackSelection receive(transport::Deadline deadline, bool* waited) override;
  size_t in_flight() const override { return done_.size(); }
  const LinkStats& stats() const override { return stats_; }
  std::string peer() const override { return "in-process cache rank"; }
  Selector& selector() { return sel_; }
  /// Online overlap / churn sampling of every answered update (pack.h OverlapSampler); not owned, nullptr = off.
  void set_sampler(OverlapSampler* s) { sampler_ = s; }
  /// The delta-transfer mirror, or null when `delta` was false.
  const SelectionMirror* mirror() const { return mirror_.get(); }

 private:
  Selector sel_;
  std::unique_ptr<SelectionMirror> mirror_;
  std::deque<PackSelection> done_;
  LinkStats stats_;
  OverlapSampler* sampler_ = nullptr;
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

/// The cache rank's loop for one inference rank: receive an update, process_pack, send the selection; until a
/// shutdown frame, `stop`, or a failure of the endpoint (returns its message; empty on a clean shutdown).
/// `poll` bounds how long one wait blocks before `stop` is checked again.
/// `sampler` (optional): online overlap-ratio sampling (pack.h). `on_pack` (optional): called after each answered
/// update with the selection and the payload bytes received / sent (metrics).
struct ServeHooks {
  OverlapSampler* sampler = nullptr;
  SelectionMirror* mirror = nullptr;  // delta transfer (cache_rank/delta.h) when set; full selections otherwise
  std::function<void(const PackUpdate&, const PackSelection&, size_t bytes_in, size_t bytes_out)> on_pack;
  std::function<void()> on_poll;  // called at least every `poll` while serving (main-loop liveness)
};
std::string serve_cache_rank(transport::Endpoint& ep, Selector& sel, const PackShape& shape,
                             const std::atomic<bool>& stop, LinkStats* stats,
                             std::chrono::milliseconds poll = std::chrono::milliseconds(100),
                             const ServeHooks& hooks = {});

}  // namespace spade::cache

// Internal to the coordinator server: the world's membership. Holds the ranks table (one Member per global
// rank, from the role map), checks RegisterRequests against it, completes the world and sends every rank its
// ClusterView (pairing: launch_env.h pairing_rule, inference #i with its N cache ranks), tracks heartbeats and
// their deadline, declares ranks dead (PeerDown to the paired peer), admits a replacement for a dead rank (a new
// incarnation of its slot: the live peer gets PeerReplaced and the pair re-handshakes) and snapshots it all for
// StatusReply and health.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/proto/coordinator.pb.h"
#include "coordinator/server_connection.h"
#include "coordinator/server_internal.h"

namespace spade::coord {

struct Member {
  proto::RankInfo info;  // role/rank/role_index from the role map; the rest from the RegisterRequest
  proto::RankState state = proto::MISSING;
  ConnPtr conn;
  Clock::time_point last_seen{};
  uint64_t heartbeat_seq = 0;
  std::map<std::string, double> stats;
  std::string dead_reason;
  bool view_sent = false;  // this incarnation has its ClusterView (a replacement cache rank: once its peer offered)
};

/// What Membership reports upward (implemented by CoordinatorServer::Impl). Called on the io thread.
class MembershipEvents {
 public:
  virtual ~MembershipEvents() = default;
  /// Every rank has registered. Called once, just before the ranks are sent their ClusterViews.
  virtual void on_world_complete() = 0;
  /// Rank `rank` was declared dead after the world was complete (its peer has been sent PeerDown).
  /// `why` reads "<rank description> died: <reason>".
  virtual void on_rank_dead(uint32_t rank, const std::string& why) = 0;
};

/// The ranks table and the registration / heartbeat protocol. Io thread only (the constructor excepted).
class Membership {
 public:
  /// Builds the table from ctx.opts.role_map, which must be valid (one coordinator, the cache ranks a multiple N of
  /// the inference ranks):
  /// every rank MISSING but the coordinator's own, ALIVE with this host, pid and device "cpu". Keeps
  /// references to all three arguments; they must outlive this object.
  Membership(ServerContext& ctx, Connections& conns, MembershipEvents& events);

  // ---- queries

  uint32_t world_size() const { return static_cast<uint32_t>(members_.size()); }
  uint32_t num_inference() const { return num_inference_; }
  uint32_t num_cache() const { return num_cache_; }
  /// N: the cache ranks (layer shards) of each inference rank.
  uint32_t cache_per_inference() const { return cache_per_inference_; }
  /// Every rank has registered (stays true once set, even when ranks die later).
  bool world_complete() const { return world_complete_; }
  /// The row of global rank `r` (< world_size()).
  const Member& member(uint32_t r) const { return members_[r]; }
  /// "inference rank 1 (#0) at 127.0.0.1:4242 [host h pid 7]" (the endpoint and host only when known).
  std::string describe(uint32_t r) const;
  /// What log lines append to a connection's endpoint: " (<describe(rank)>)", " (client)" or "".
  std::string conn_label(const Conn& c) const;
  /// The role map as "c,i,k" (coordinator, inference, cache).
  std::string role_map_string() const;
  /// Global ranks of the inference ranks that are alive and connected, ascending.
  std::vector<uint32_t> live_inference_ranks() const;
  /// Alive and connected inference and cache ranks.
  void count_live(uint32_t* inference, uint32_t* cache) const;
  /// "r (role #i)" for every rank not alive, ascending (what the rendezvous deadline reports).
  std::vector<std::string> missing_ranks() const;
  /// "" while every rank is alive and paired, else why the world is degraded ("cache rank 2 (#0) is dead: ...;
  /// ..."): a dead rank whose replacement has not registered, or a replacement not yet re-paired.
  std::string degraded() const;
  /// The world snapshot of a StatusReply (every rank but the coordinator; ages in ms).
  proto::StatusReply build_status() const;

  // ---- protocol (io thread)

  /// Any frame from a registered rank's current connection refreshes its heartbeat deadline.
  void touch(const ConnPtr& c);
  /// RegisterRequest from `c`: registers a client or a rank, or replies with an error and closes `c`.
  /// Completes the world when the last rank registers.
  void on_register(const ConnPtr& c, const proto::RegisterRequest& req);
  /// Heartbeat from `c`: from a rank records seq and stats and acks; from a client only acks. Before
  /// registration it is a protocol error: `c` is closed.
  void on_heartbeat(const ConnPtr& c, const proto::Heartbeat& hb);
  /// A member's connection `c` closed for `why`: the rank is lost when `c` was its live connection.
  void on_connection_closed(const ConnPtr& c, const std::string& why);
  /// Declares lost every live rank silent for longer than heartbeat_timeout.
  void check_heartbeats();
  /// PairOffer from inference rank `c` for its replacement cache rank: records the new address and sends the
  /// replacement its ClusterView. A stale offer (another incarnation, not the paired rank) is logged and ignored.
  void on_pair_offer(const ConnPtr& c, const proto::PairOffer& offer);

 private:
  uint32_t role_index_of(uint32_t r) const;
  std::vector<uint32_t> paired_ranks(uint32_t r) const;
  void reject_registration(const ConnPtr& c, const std::string& error);
  void send_register_reply(const ConnPtr& c);
  void register_client(const ConnPtr& c, const proto::RankInfo& self);
  // Why the rank registration `req` (announced as `who`) cannot be accepted; "" when it can.
  std::string rank_registration_error(const proto::RegisterRequest& req, const std::string& who) const;
  void register_rank(const ConnPtr& c, const proto::RankInfo& self);
  // After the world is complete: `r` replaces a dead incarnation; re-pairs it with its live peer(s).
  void pair_replacement(uint32_t r);
  // Sends inference rank `r` (waiting for its view) and its waiting cache ranks their views once all are alive.
  void pair_inference(uint32_t r);
  void maybe_complete();
  void send_cluster_view(uint32_t r);
  void on_member_lost(uint32_t r, const std::string& why);
  void free_slot(uint32_t r, const std::string& why);
  void declare_dead(uint32_t r, const std::string& why);
  void send_peer_down(uint32_t r, const std::string& why);

  ServerContext& ctx_;
  Connections& conns_;
  MembershipEvents& events_;
  uint32_t num_inference_ = 0;
  uint32_t num_cache_ = 0;
  uint32_t cache_per_inference_ = 0;
  std::vector<Member> members_;  // indexed by global rank
  bool world_complete_ = false;
};

}  // namespace spade::coord

// Coordinator client: what an inference rank, a cache rank or a submitting client links to talk to the
// coordinator.
//
// Typical rank life cycle:
//   CoordinatorClient cc(opts);                       // opts from LaunchEnv + this rank's transport address
//   proto::ClusterView view = cc.rendezvous(deadline); // connect (retrying) and authenticate, register,
//   start
//                                                      // heartbeats, wait view
//   ... connect the data plane to view.peers(0).transport() ...
//   while (auto ev = cc.next_event(deadline)) ...     // PeerDown / PeerReplaced / Shutdown / CoordinatorLost
//
// Threading: the client owns one background io thread that reads frames, sends heartbeats every
// heartbeat_interval (taken from the coordinator's RegisterReply unless set here) and fills the queues below.
// Every public method is thread-safe. The optional event callback runs on that io thread and must not block.
// Every wait takes a deadline and throws spade::Error on expiry; every error names the coordinator endpoint
// and this rank (role, rank, role index).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/proto/coordinator.pb.h"
#include "common/proto/framing.h"
#include "coordinator/launch_env.h"

namespace spade::coord {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

/// GenerateRequest.n (samples of one prompt) at most this: the coordinator refuses a request with more (one
/// FINISH_ERROR chunk naming `n`), the OpenAI API answers 400. An inference rank also refuses n above its
/// max_num_seqs.
inline constexpr uint32_t kMaxSamplesPerRequest = 64;

/// How many FINISH_ERROR chunks refuse `request` before it runs (the coordinator's or an inference rank's refusal):
/// one per sample (index 0..n-1), a single one (index 0) when its n is above kMaxSamplesPerRequest.
inline uint32_t refusal_chunks(const proto::GenerateRequest& request) {
  return request.n() > kMaxSamplesPerRequest ? 1 : std::max<uint32_t>(1, request.n());
}

struct ClientOptions {
  std::string coordinator_host = "127.0.0.1";  // MASTER_ADDR
  uint16_t coordinator_port = 29500;           // MASTER_PORT
  proto::Role role = proto::CLIENT;
  uint32_t rank = 0;        // global rank (ignored for CLIENT)
  uint32_t role_index = 0;  // inference #i / cache #i (ignored for CLIENT)
  uint32_t world_size = 0;  // as launched; 0 = accept the coordinator's
  uint32_t local_rank = 0;
  std::string host;    // default: this machine's hostname
  std::string device;  // e.g. "cpu", "cuda:0"
  proto::TransportKind transport_kind = proto::TRANSPORT_UNSPECIFIED;
  std::string transport_address;                    // opaque bytes from transport::Transport::local_address()
  uint32_t layers_per_pack = 0;  // inference rank: its --layers-per-pack, which its cache ranks' shards follow
  std::chrono::milliseconds heartbeat_interval{0};  // 0 = use the coordinator's heartbeat_interval_ms
  std::chrono::milliseconds connect_retry_interval{100};
  size_t max_frame_bytes = proto::kMaxFrameBytes;
  /// The cluster secret (LaunchEnv::cluster_secret; never logged). Non-empty: connect() runs the
  /// challenge-response of coordinator/auth.h and refuses a coordinator that cannot prove it knows the same
  /// secret. Empty: no authentication (a coordinator with a secret then rejects the registration, naming what
  /// is missing).
  std::string cluster_secret;
};

/// ClientOptions of this process from its resolved launch environment: coordinator at
/// master_addr:master_port, role / rank / role index / world size / local rank and the cluster secret from
/// `env`. Transport and device fields are left for the caller.
ClientOptions client_options_for(const LaunchEnv& env);

/// Something the coordinator told us (or the loss of the coordinator itself). kPeerReplaced: a paired rank that was
/// declared dead has a replacement (same role and index, peer_replaced.peer().incarnation() higher); the data plane
/// may be re-paired with it (an inference rank answers with send_pair_offer()).
struct ClientEvent {
  enum class Kind { kPeerDown, kShutdown, kCoordinatorLost, kPeerReplaced };
  Kind kind = Kind::kShutdown;
  proto::PeerDown peer_down;          // kPeerDown
  proto::Shutdown shutdown;           // kShutdown
  proto::PeerReplaced peer_replaced;  // kPeerReplaced
  std::string message;        // human-readable, names the coordinator endpoint and the peer
};

class CoordinatorClient {
 public:
  explicit CoordinatorClient(ClientOptions options);
  ~CoordinatorClient();  // stops heartbeats, closes the connection, joins the io thread

  CoordinatorClient(const CoordinatorClient&) = delete;
  CoordinatorClient& operator=(const CoordinatorClient&) = delete;

  /// Connects, retrying every connect_retry_interval until `deadline` (the coordinator may start later),
  /// then, with a cluster secret, authenticates (AuthHello, the coordinator's AuthChallenge checked,
  /// AuthProof). Throws spade::Error "cannot reach coordinator at host:port within N ms ...: <last error>";
  /// "coordinator ... did not prove it knows the cluster secret ..." (wrong secret on one side, or not our
  /// coordinator); or the coordinator's refusal (e.g. it has no secret configured) and loss of the connection
  /// during the exchange.
  void connect(Deadline deadline);

  /// Sends RegisterRequest and waits for the RegisterReply. Throws when rejected (the coordinator's error
  /// text is in the message), on Shutdown, on connection loss or at the deadline.
  proto::RegisterReply register_self(Deadline deadline);

  /// Waits for the ClusterView (sent once the whole world has registered). Throws on Shutdown (e.g. "rank 2
  /// (cache #0) never registered within 500 ms"), connection loss or at the deadline.
  proto::ClusterView wait_cluster_view(Deadline deadline);

  /// connect + register_self + start_heartbeat + wait_cluster_view, all within one deadline. For CLIENT role:
  /// connect + register_self + start_heartbeat (returns an empty view).
  proto::ClusterView rendezvous(Deadline deadline);

  /// Starts/stops the heartbeat timer. Interval: options.heartbeat_interval, else the coordinator's. Ranks
  /// must heartbeat (the coordinator declares a silent rank dead); a client's heartbeats keep its connection
  /// from the coordinator's idle timeout. While heartbeating, a coordinator that sends nothing (no
  /// HeartbeatAck) for its heartbeat_timeout is reported as a kCoordinatorLost event and the connection is
  /// closed.
  void start_heartbeat();
  void stop_heartbeat();
  /// Gauge reported in the next heartbeats' stats map.
  void set_stat(const std::string& key, double value);

  /// Callback for every event (runs on the io thread). Events are queued for next_event() as well.
  void set_event_callback(std::function<void(const ClientEvent&)> cb);
  /// Next event, or nullopt when none arrived before `deadline` (no throw).
  std::optional<ClientEvent> next_event(Deadline deadline);

  /// Asks the coordinator for a StatusReply (registered connections only). Throws at the deadline / on
  /// connection loss.
  proto::StatusReply query_status(Deadline deadline);

  /// Asks the coordinator to shut the world down (it broadcasts Shutdown to everyone, including us). Only a
  /// registered CLIENT may: the coordinator ignores (and logs) the request from any other connection.
  void request_shutdown(const std::string& reason);

  // ---- request routing ----
  /// Submits a GenerateRequest through the coordinator; request_id 0 is replaced by a fresh id. Returns the
  /// id the chunks will carry. With n > 1 (at most kMaxSamplesPerRequest) the chunks of the n samples interleave,
  /// each naming its sample (GenerateChunk.index); each sample ends with one finished chunk of its own, and the
  /// request is over when all n have. A request refused before it runs (not routable, invalid) gets a FINISH_ERROR
  /// chunk for each sample; a single one (index 0) when n itself is above kMaxSamplesPerRequest.
  uint64_t submit(proto::GenerateRequest request);
  /// Next GenerateChunk for any request this client submitted; nullopt at the deadline.
  std::optional<proto::GenerateChunk> next_chunk(Deadline deadline);
  /// (inference rank) Next GenerateRequest routed to us; nullopt at the deadline.
  std::optional<proto::GenerateRequest> next_request(Deadline deadline);
  /// Cancels a request this client submitted (id as returned by submit()). Chunks already under way may still
  /// arrive, then exactly one final chunk per sample not yet finished, FINISH_CANCELLED (sent by the coordinator when
  /// it forwards the cancel), or the sample's own final chunk if it finished first. Unknown or finished ids are
  /// ignored. With `sample` set, only that sample of a request with n > 1: it ends with its own final chunk
  /// (FINISH_CANCELLED, from the inference rank) and the other samples go on.
  void cancel(uint64_t request_id, const std::string& reason, std::optional<uint32_t> sample = std::nullopt);
  /// (inference rank) Next CancelRequest routed to us (ids as in next_request()); nullopt at the deadline.
  std::optional<proto::CancelRequest> next_cancel(Deadline deadline);
  /// (inference rank) Sends one chunk of a routed request back (request_id as received).
  void send_chunk(const proto::GenerateChunk& chunk);
  /// (inference rank) Answers a kPeerReplaced for its cache rank: the data-plane address the replacement joins
  /// (the coordinator forwards it in the replacement's ClusterView). Returns at once.
  void send_pair_offer(const proto::PairOffer& offer);

  /// True while the TCP connection is up and no Shutdown has been received.
  bool connected() const;
  /// The RegisterReply once registered.
  std::optional<proto::RegisterReply> registration() const;
  /// "coordinator 127.0.0.1:29500".
  std::string coordinator_name() const;
  /// "inference rank 1 (#0)" / "client".
  std::string self_name() const;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace spade::coord

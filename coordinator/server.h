// Coordinator: the control plane of a Spade world (one coordinator, N inference ranks, N cache ranks).
//
// What it does (paper: AsyncSpade Sec. 4.1, "Inference Rank and Cache Rank"):
//   * Admission (docs/DEPLOY.md, "Security model"): with a cluster secret, a new connection must first pass
//   the
//     challenge-response of coordinator/auth.h (AuthHello, AuthChallenge, AuthProof); without one (allowed
//     only on a loopback bind address) its registration admits it. Until then it may send only those frames
//     and its RegisterRequest, each at most max_unauthenticated_frame_bytes; anything else is logged with the
//     peer's address and the connection closed. At most max_unauthenticated_connections such connections are
//     open at once (more are closed on accept), and one that has not authenticated within auth_timeout is
//     closed. An admitted connection may send frames of up to max_frame_bytes; one that sends nothing for
//     idle_timeout is closed (ranks and clients heartbeat).
//   * Roles: status needs a registered rank or client; Shutdown and GenerateRequest a registered client (an
//     operator: spade_submit, tools). From anyone else they are dropped and logged.
//   * Rendezvous: every rank connects over TCP and sends RegisterRequest (role, global rank, role index,
//   host, device,
//     data-plane transport address). Registrations are checked against the role map (LaunchEnv); duplicates
//     and inconsistent ones get a RegisterReply with an error and the connection is closed.
//   * Pairing: when the whole world has registered, inference #i is paired with cache #i (requires N == M)
//   and each
//     rank gets a ClusterView holding its peer's transport address.
//   * Liveness: ranks send Heartbeat every heartbeat_interval; a rank silent for longer than
//   heartbeat_timeout, or
//     whose connection drops, is declared dead: logged, PeerDown sent to its paired peer, reported by
//     status(). (A rank lost *before* the world is complete just frees its slot; it may register again.)
//   * Rendezvous deadline: if the world is not complete within rendezvous_timeout, every connection gets
//     Shutdown{is_error, "rank X (role #i) never registered within N ms"} and run() returns that message,
//     code 1.
//   * Shutdown: a Shutdown frame from a registered client, request_shutdown(), or SIGINT/SIGTERM
//   (handle_signals)
//     is broadcast; run() returns code 0 once every connection has been flushed and closed (or after
//     shutdown_flush_timeout).
//   * Request routing: a GenerateRequest from a registered client is forwarded to an inference rank
//   (target_inference, or
//     round robin over live inference ranks) with a coordinator-unique request_id; its GenerateChunks are
//     forwarded back to the submitter with the submitter's request_id. If the inference rank dies, the
//     submitter gets a final chunk with FINISH_ERROR naming it.
//   * Cancellation: a CancelRequest from a submitter, cancel_local(), or the submitter's connection dropping
//   sends
//     CancelRequest to the inference rank serving the request.
//   * In-process submissions (submit_local): the coordinator's HTTP API routes through the same path.
//   * Bad input: garbage, truncated or oversized frames are logged with the remote endpoint and that
//   connection is
//     closed; the server keeps serving everyone else.
//
// Threading: all protocol state lives on one io_context thread (the one calling run(), or the thread start()
// spawns). port(), request_shutdown() and status() are safe from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/proto/coordinator.pb.h"
#include "common/proto/framing.h"

namespace spade::coord {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

/// Receives the chunks of an in-process submission (CoordinatorServer::submit_local). Runs on the coordinator's io
/// thread: must not block. Each sample's last chunk (GenerateChunk.index, 0..n-1 for GenerateRequest.n) has
/// finished == true (FINISH_ERROR with `error` set when the request could not be routed or its inference rank died:
/// one such chunk for every sample not finished yet).
using ChunkSink = std::function<void(const proto::GenerateChunk&)>;

/// What /health and /ready report (thread-safe snapshot).
struct Health {
  bool running = false;         // the io loop is serving
  bool world_complete = false;  // every rank has registered
  bool shutting_down = false;
  uint32_t live_inference = 0;
  uint32_t live_cache = 0;
  uint32_t num_inference = 0;
  uint32_t num_cache = 0;
  std::chrono::milliseconds since_loop_tick{0};  // age of the io loop's last timer tick (liveness)
  bool auth_required = false;                    // a cluster secret is configured
  uint32_t unauthenticated_connections = 0;      // open connections not yet admitted (see ServerOptions)
  uint64_t rejected_connections = 0;  // closed before admission: over the limit, no or wrong proof,
                                      // deadline missed, oversized or forbidden frame (since start)
  /// "" while the complete world has every rank alive and paired; else which ranks are dead (waiting for a
  /// replacement) or re-pairing. Back to "" once replacements have re-paired.
  std::string degraded;
};

struct ServerOptions {
  /// Address of the control port. A non-loopback address needs a cluster secret (the constructor refuses it
  /// otherwise): without one, anyone who reaches the port could register, submit, read the world's hosts,
  /// pids and transport addresses, or stop it.
  std::string bind_host = "127.0.0.1";
  uint16_t port = 29500;  // 0 = pick an ephemeral port (read it back with port())
  /// Shared secret of the world (LaunchEnv::cluster_secret; at least kMinClusterSecretBytes bytes), or empty
  /// for none. Never logged.
  std::string cluster_secret;
  std::vector<proto::Role>
      role_map;  // role of every global rank (LaunchEnv::role_map); exactly one coordinator
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{5000};
  std::chrono::milliseconds rendezvous_timeout{60000};
  std::chrono::milliseconds shutdown_flush_timeout{2000};
  size_t max_frame_bytes = proto::kMaxFrameBytes;  // frames of admitted connections, bytes
  /// Frames of a connection that has not been admitted yet (AuthHello, AuthProof, RegisterRequest), bytes; a
  /// longer length prefix closes the connection before its body is read. At least 1024, at most
  /// max_frame_bytes.
  size_t max_unauthenticated_frame_bytes = size_t{64} << 10;
  /// Connections not yet admitted that may be open at once (>= 1); further ones are closed on accept.
  uint32_t max_unauthenticated_connections = 64;
  /// Time from accept to admission (> 0); a connection still not admitted is closed.
  std::chrono::milliseconds auth_timeout{10000};
  /// An admitted connection that sends no frame for this long is closed; at least twice heartbeat_interval.
  std::chrono::milliseconds idle_timeout{30000};
  bool handle_signals = false;  // install SIGINT/SIGTERM handlers (the executable does; tests do not)
  /// The API's model name (coord::served_model_name()), sent to every rank in its ClusterView; "" without an API.
  std::string served_model_name;
};

/// How the coordinator ended: code 0 = clean shutdown, 1 = rendezvous deadline or other fatal condition.
struct ExitStatus {
  int code = 0;
  std::string message;
};

class CoordinatorServer {
 public:
  /// Validates options (throws spade::Error: bad role map, cache ranks not a non-zero multiple of the inference
  /// ranks (launch_env.h cache_ranks_per_inference), bad timeouts or limits, a non-loopback
  /// bind_host without a cluster secret, a secret shorter than kMinClusterSecretBytes) and binds the
  /// listening socket (throws spade::Error naming host:port when it cannot). The rendezvous clock starts
  /// here.
  explicit CoordinatorServer(ServerOptions options);
  ~CoordinatorServer();  // stops the server if still running (broadcasting Shutdown) and joins its thread

  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  /// The bound TCP port.
  uint16_t port() const;

  /// Serves on the calling thread until the world shuts down.
  ExitStatus run();

  /// Serves on a background thread; pair with wait()/wait_until().
  void start();
  /// Waits for the background thread (started by start()) to finish.
  ExitStatus wait();
  /// Like wait() but gives up at `deadline`; returns false then.
  bool wait_until(Deadline deadline, ExitStatus* out);

  /// Broadcasts Shutdown{reason} and stops (exit code 0). Thread-safe; no-op when already shutting down.
  void request_shutdown(const std::string& reason);

  /// Routes a request submitted in-process (the HTTP API) like one from a TCP client: round robin over the live
  /// inference ranks unless target_inference is set. Thread-safe; returns at once with the routed id (the id the
  /// chunks carry). Every outcome, routing errors included, arrives at `sink`.
  uint64_t submit_local(proto::GenerateRequest request, ChunkSink sink);
  /// Cancels an in-process submission: its inference rank stops it (and frees its KV on both ranks); no further
  /// chunks reach the sink. With `sample` set, only that sample of a request with n > 1: the rank ends it with a
  /// FINISH_CANCELLED chunk that still reaches the sink, and the other samples go on. Thread-safe; unknown or
  /// finished ids (and samples) are ignored.
  void cancel_local(uint64_t routed_id, const std::string& reason, std::optional<uint32_t> sample = std::nullopt);
  /// Liveness / readiness snapshot (thread-safe, never blocks).
  Health health() const;

  /// Snapshot of the world (thread-safe; waits for the io thread until `deadline`, throws spade::Error on
  /// timeout or when the server is not running).
  proto::StatusReply status(Deadline deadline) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};


}  // namespace spade::coord

// Internal to the coordinator server (server.cpp, server_connection.cpp, server_membership.cpp,
// server_routing.cpp): the state those units share and small helpers. Not a public header; users of the
// coordinator include server.h (the server) or client.h / launch_env.h (ranks and submitters).
//
// How the server is cut:
//   server.cpp           CoordinatorServer::Impl: options, the io thread, timers (tick, rendezvous
//                        deadline, shutdown flush), shutdown, health, and the frame dispatcher that
//                        hands each frame to one of the units below.
//   server_connection.*  Connections: accepting (bounded: max_unauthenticated_connections), framed reads
//                        (frame limit before and after admission) and writes, graceful and hard closes,
//                        the admission and idle deadlines, the per-connection state (Conn).
//   server_auth.*        Authenticator: the coordinator's side of the challenge-response (AuthHello ->
//                        AuthChallenge, AuthProof checked), and refusals of unadmitted connections.
//   server_membership.*  Membership: the ranks table (Member), registration, heartbeats and their
//                        deadline, pairing and ClusterView, PeerDown, status snapshots.
//   server_routing.*     RequestRouter: GenerateRequest routing to inference ranks, chunk forwarding,
//                        cancellation, failing the requests of a dead inference rank.
//
// Threading: everything here runs on the server's one io thread unless a member says otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>

#include "coordinator/asio.h"
#include "coordinator/server.h"

namespace spade::coord {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

/// Milliseconds from `since` to `now` (steady clock), truncated; `now` must not precede `since`.
inline uint64_t age_ms(Clock::time_point since, Clock::time_point now) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count());
}

/// State shared by the server units; owned by CoordinatorServer::Impl, which outlives the units that hold a
/// reference to it. `opts` is immutable after construction; the rest is touched on the io thread only.
struct ServerContext {
  /// Takes options already validated by CoordinatorServer::Impl; draws the session id (random_device).
  explicit ServerContext(ServerOptions o) : opts(std::move(o)) {
    std::random_device rd;
    session_id = (uint64_t{rd()} << 32) ^ rd();
  }

  const ServerOptions opts;
  asio::io_context io;
  uint64_t session_id = 0;  // random per coordinator; sent in RegisterReply, ClusterView and StatusReply
  Clock::time_point start_time{};  // when the socket was bound: origin of the rendezvous deadline and uptime
  bool shutting_down = false;      // Shutdown is being broadcast: accept nothing new, only close handshakes
  uint64_t rejected_connections = 0;  // closed before admission (Health::rejected_connections)
};

}  // namespace spade::coord

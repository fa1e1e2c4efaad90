// Internal to the coordinator server: generation-request routing. A GenerateRequest (from a TCP client, or
// in-process through CoordinatorServer::submit_local) goes to an inference rank (target_inference, or round
// robin over the live ones) under a coordinator-unique routed id; the rank's GenerateChunks go back to the
// submitter under the submitter's own request id. Cancellation (CancelRequest, cancel_local, a submitter
// disconnecting) and the death of an inference rank end the routes concerned.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/proto/coordinator.pb.h"
#include "coordinator/server_connection.h"
#include "coordinator/server_internal.h"
#include "coordinator/server_membership.h"

namespace spade::coord {

struct Route {
  std::weak_ptr<Conn> submitter;  // a TCP client, or none for an in-process (HTTP API) submission
  uint64_t submitter_request_id = 0;
  uint32_t inference_rank = 0;
  ChunkSink local_sink;  // in-process submissions: chunks go here (io thread)
};

/// The table of requests in flight (routed id -> Route). Io thread only, except reserve_id().
class RequestRouter {
 public:
  /// Keeps references to all three arguments; they must outlive this object.
  RequestRouter(ServerContext& ctx, const Membership& membership, Connections& conns);

  /// A fresh routed id (thread-safe): what submit_local returns before posting the request to the io thread.
  uint64_t reserve_id() { return next_route_id_++; }

  /// GenerateRequest from TCP connection `c`: forwarded to an inference rank, or answered at once with a
  /// final FINISH_ERROR chunk (shutting down, world not complete, no live inference rank, target not alive).
  void on_generate_request(const ConnPtr& c, const proto::GenerateRequest& req);
  /// Answers `req` from `c` with a final FINISH_ERROR chunk carrying `why`, without routing it.
  void refuse(const ConnPtr& c, const proto::GenerateRequest& req, const std::string& why);
  /// In-process submission under `routed_id` (from reserve_id()): like on_generate_request, but every chunk,
  /// a routing error included, goes to `sink` and carries `routed_id`.
  void on_local_request(uint64_t routed_id, const proto::GenerateRequest& req, ChunkSink sink);
  /// CancelRequest from `c` for one of its own requests (by its request id); others are ignored.
  void on_cancel_request(const ConnPtr& c, const proto::CancelRequest& cr);
  /// Cancels route `routed_id` on its inference rank and forgets it (later chunks are dropped). Unknown ids
  /// are ignored.
  void cancel_route(uint64_t routed_id, const std::string& reason);
  /// GenerateChunk from inference-rank connection `c`: forwarded to its submitter; a finished chunk ends the
  /// route. Chunks of unknown routes, or from a rank that does not serve the route, are dropped.
  void on_generate_chunk(const ConnPtr& c, const proto::GenerateChunk& chunk);
  /// Inference rank `r` died: each of its routes gets a final FINISH_ERROR chunk with `why` and is dropped.
  void fail_routes_of_inference(uint32_t r, const std::string& why);
  /// TCP submitter `c` went away: its routes (and any whose submitter is gone) are cancelled on their
  /// inference ranks and forgotten. In-process routes are untouched.
  void drop_routes_of_submitter(const ConnPtr& c);

 private:
  std::string pick_target(const proto::GenerateRequest& req, uint32_t* target);
  void forward(uint64_t routed_id, const proto::GenerateRequest& req, uint32_t target);
  void send_error_chunk(const ConnPtr& c, uint64_t request_id, const std::string& error);
  void send_cancel(uint32_t inference_rank, uint64_t routed_id, const std::string& reason);

  ServerContext& ctx_;
  const Membership& membership_;
  Connections& conns_;
  std::unordered_map<uint64_t, Route> routes_;
  std::atomic<uint64_t> next_route_id_{1};
  uint32_t rr_ = 0;  // round-robin cursor over the live inference ranks
};

}  // namespace spade::coord

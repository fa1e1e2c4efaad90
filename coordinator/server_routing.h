// Internal to the coordinator server: generation-request routing. A GenerateRequest (from a TCP client, or
// in-process through CoordinatorServer::submit_local) goes to an inference rank (target_inference, or round
// robin over the live ones) under a coordinator-unique routed id; the rank's GenerateChunks go back to the
// submitter under the submitter's own request id. A request of n samples (GenerateRequest.n) stays routed until each
// of its samples has had its finished chunk (GenerateChunk.index names the sample). Cancellation (CancelRequest,
// cancel_local, a submitter disconnecting) and the death of an inference rank end the routes concerned; a
// CancelRequest with an index ends one sample only.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

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
  std::vector<bool> sample_done;  // per sample (GenerateRequest.n, at least 1): its finished chunk has passed
  uint32_t open_samples = 1;      // samples without their finished chunk yet; the route ends at 0
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
  /// Cancels sample `sample` of route `routed_id` on its inference rank; the route stays (the rank's FINISH_CANCELLED
  /// chunk of that sample is forwarded as usual). Unknown routes and samples, or finished ones, are ignored.
  void cancel_sample(uint64_t routed_id, uint32_t sample, const std::string& reason);
  /// GenerateChunk from inference-rank connection `c`: forwarded to its submitter; the finished chunk of the last
  /// open sample ends the route. Chunks of unknown routes or samples, of samples already finished, or from a rank
  /// that does not serve the route, are dropped.
  void on_generate_chunk(const ConnPtr& c, const proto::GenerateChunk& chunk);
  /// Inference rank `r` died: each open sample of its routes gets a final FINISH_ERROR chunk with `why`, and the
  /// routes are dropped.
  void fail_routes_of_inference(uint32_t r, const std::string& why);
  /// TCP submitter `c` went away: its routes (and any whose submitter is gone) are cancelled on their
  /// inference ranks and forgotten. In-process routes are untouched.
  void drop_routes_of_submitter(const ConnPtr& c);

 private:
  std::string pick_target(const proto::GenerateRequest& req, uint32_t* target);
  void forward(uint64_t routed_id, const proto::GenerateRequest& req, uint32_t target);
  void send_error_chunk(const ConnPtr& c, uint64_t request_id, const std::string& error, uint32_t sample = 0);
  void send_cancel(uint32_t inference_rank, uint64_t routed_id, const std::string& reason,
                   std::optional<uint32_t> sample = std::nullopt);

  ServerContext& ctx_;
  const Membership& membership_;
  Connections& conns_;
  std::unordered_map<uint64_t, Route> routes_;
  std::atomic<uint64_t> next_route_id_{1};
  uint32_t rr_ = 0;  // round-robin cursor over the live inference ranks
};

}  // namespace spade::coord

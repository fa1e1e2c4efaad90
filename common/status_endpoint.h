// GET /metrics, /health and /ready for a Spade process: the Prometheus text of a metrics::Registry, and liveness /
// readiness answers from callbacks. Ranks serve it on --metrics-port; the coordinator answers the same three paths
// on its API port.
//
//   /metrics  200, text format 0.0.4 (common/metrics.h)
//   /health   liveness: 200 {"status":"ok"} while the process's main loop is alive, else 503 {"status":"unhealthy",
//             "reason":...} (Kubernetes livenessProbe)
//   /ready    readiness: 200 {"status":"ready"} once the process can do its job (weights loaded, peers connected),
//             else 503 {"status":"not ready","reason":...} (readinessProbe); 200 {"status":"degraded","reason":...}
//             while it serves in a reduced mode (an inference rank whose cache rank was lost decodes densely), and
//             /health then carries the same "degraded" reason beside its "ok"
// Other paths get 404, other methods on these paths 405 (JSON bodies).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/http_server.h"
#include "common/metrics.h"

namespace spade {

/// A check: "" = OK, else the reason it is not.
using StatusCheck = std::function<std::string()>;

struct StatusChecks {
  StatusCheck health;  // nullptr = always OK
  StatusCheck ready;   // nullptr = always OK
  StatusCheck degraded;  // nullptr = never; "" = whole, else why the process serves in a reduced mode
};

/// Answers `req` if its path is /metrics, /health or /ready (returns true), else returns false and leaves `res`.
bool answer_status_request(const http::HttpRequest& req, http::HttpResponder& res, const metrics::Registry& registry,
                           const StatusChecks& checks);

/// An HttpServer answering only the three status paths (404 otherwise), for the ranks' --metrics-port. Throws
/// spade::Error naming host:port when it cannot listen.
std::unique_ptr<http::HttpServer> serve_status_endpoint(const std::string& bind_host, uint16_t port,
                                                        const std::string& name, const metrics::Registry& registry,
                                                        StatusChecks checks);

/// Liveness of a main loop: tick() from the loop, stale() tells whether the last tick is older than `timeout`.
class LoopHeartbeat {
 public:
  explicit LoopHeartbeat(std::chrono::milliseconds timeout) : timeout_(timeout) { tick(); }
  void tick() { last_ns_.store(now_ns(), std::memory_order_relaxed); }
  /// "" while alive, else "main loop stalled for N ms (limit M ms)".
  std::string check() const;

 private:
  static int64_t now_ns();
  std::chrono::milliseconds timeout_;
  std::atomic<int64_t> last_ns_{0};
};

}  // namespace spade

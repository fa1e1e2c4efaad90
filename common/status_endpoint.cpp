#include "common/status_endpoint.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace spade {

namespace {

void json_reply(http::HttpResponder& res, int status, const nlohmann::json& body) {
  res.send(status, "application/json", body.dump() + "\n");
}

}  // namespace

bool answer_status_request(const http::HttpRequest& req, http::HttpResponder& res, const metrics::Registry& registry,
                           const StatusChecks& checks) {
  if (req.path != "/metrics" && req.path != "/health" && req.path != "/ready") return false;
  if (req.method != "GET" && req.method != "HEAD") {
    json_reply(res, 405, {{"error", fmt::format("method {} not allowed on {} (use GET)", req.method, req.path)}});
    return true;
  }
  if (req.path == "/metrics") {
    res.send(200, std::string(metrics::Registry::kContentType), registry.render());
  } else if (req.path == "/health") {
    const std::string why = checks.health ? checks.health() : "";
    if (why.empty()) {
      const std::string degraded = checks.degraded ? checks.degraded() : "";
      nlohmann::json body = {{"status", "ok"}};
      if (!degraded.empty()) body["degraded"] = degraded;
      json_reply(res, 200, body);
    } else {
      json_reply(res, 503, {{"status", "unhealthy"}, {"reason", why}});
    }
  } else {
    const std::string why = checks.ready ? checks.ready() : "";
    const std::string degraded = why.empty() && checks.degraded ? checks.degraded() : "";
    if (!degraded.empty()) {
      json_reply(res, 200, {{"status", "degraded"}, {"reason", degraded}});
    } else if (why.empty()) {
      json_reply(res, 200, {{"status", "ready"}});
    } else {
      json_reply(res, 503, {{"status", "not ready"}, {"reason", why}});
    }
  }
  return true;
}

std::unique_ptr<http::HttpServer> serve_status_endpoint(const std::string& bind_host, uint16_t port,
                                                        const std::string& name, const metrics::Registry& registry,
                                                        StatusChecks checks) {
  http::HttpServerOptions o;
  o.bind_host = bind_host;
  o.port = port;
  o.name = name + " metrics endpoint";
  o.max_body_bytes = 64 * 1024;
  o.error_body = [](int status, const std::string& msg) {
    return std::make_pair(std::string("application/json"),
                          nlohmann::json{{"error", msg}, {"status", status}}.dump() + "\n");
  };
  return std::make_unique<http::HttpServer>(
      o, [&registry, checks = std::move(checks)](const http::HttpRequest& req, std::shared_ptr<http::HttpResponder> res) {
        if (!answer_status_request(req, *res, registry, checks))
          json_reply(*res, 404, {{"error", fmt::format("no such path {} (serving /metrics, /health, /ready)", req.path)}});
      });
}

int64_t LoopHeartbeat::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string LoopHeartbeat::check() const {
  const int64_t age_ms = (now_ns() - last_ns_.load(std::memory_order_relaxed)) / 1000000;
  if (age_ms <= timeout_.count()) return "";
  return fmt::format("main loop stalled for {} ms (limit {} ms)", age_ms, timeout_.count());
}

}  // namespace spade

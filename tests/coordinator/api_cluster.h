// A whole local cluster for the HTTP-facing tests: the real coordinator (with the OpenAI API), inference rank and
// cache rank executables on stories260K, with their metrics endpoints; plus small HTTP / metrics helpers.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/http_server.h"
#include "tests/inference_rank/cluster_client.h"  // bin(), cluster_client()
#include "tests/test_util.h"

namespace spade::test {

using namespace std::chrono_literals;

/// Parses the Prometheus text format into {"name{labels}" -> value} (labels exactly as served).
inline std::map<std::string, double> parse_metrics(const std::string& text) {
  std::map<std::string, double> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    const std::string v = line.substr(sp + 1);
    out[line.substr(0, sp)] = v == "+Inf" ? 1e308 : v == "NaN" ? 0 : std::stod(v);
  }
  return out;
}

struct ClusterOptions {
  std::vector<std::string> coordinator_flags;  // extra flags
  std::vector<std::string> inference_flags;    // sparse flags etc.
  std::vector<std::string> cache_flags;
};

/// The `data: ` payloads of a server-sent-events body (already de-chunked), in order, "[DONE]" included.
inline std::vector<std::string> sse_payloads(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const size_t end = body.find("\n\n", pos);
    out.push_back(body.substr(pos + 6, end == std::string::npos ? std::string::npos : end - pos - 6));
    pos = end;
  }
  return out;
}

/// coordinator (rank 0) + inference (rank 1) + cache (rank 2), all on 127.0.0.1 with free ports.
struct ApiCluster {
  int control_port = free_port();
  int http_port = free_port();
  int inference_metrics_port = free_port();
  int cache_metrics_port = free_port();
  std::string model = data_path("models/stories260K");
  std::unique_ptr<ChildProcess> coord, inf, cache;
  std::vector<std::unique_ptr<ChildProcess>> retired;  // ranks replaced by a restart (their logs stay readable)

  std::map<std::string, std::string> extra_env;  // added to every process's environment (e.g. CUDA settings)

  std::map<std::string, std::string> env(int rank) const {
    std::map<std::string, std::string> e = {{"MASTER_ADDR", "127.0.0.1"},
                                            {"MASTER_PORT", std::to_string(control_port)},
                                            {"RANK", std::to_string(rank)},
                                            {"WORLD_SIZE", "3"},
                                            {"UCX_LOG_LEVEL", "error"},
                                            // Every process authenticates its control connection (docs/DEPLOY.md,
                                            // "Security model").
                                            {"SPADE_CLUSTER_SECRET", kSecret}};
    for (const auto& [k, v] : extra_env) e[k] = v;
    return e;
  }
  static constexpr const char* kSecret = "api-cluster-test-secret-0123456789";

  /// A CLIENT of the coordinator's control port (authenticated with the cluster secret), once the world is complete.
  std::unique_ptr<coord::CoordinatorClient> control_client() const {
    return cluster_client(control_port, 60s, 60s, kSecret);
  }

  void start_coordinator(const ClusterOptions& o) {
    std::vector<std::string> a = {"--num-inference",        "1",     "--num-cache", "1", "--model", model,
                                  "--http-port",            std::to_string(http_port),
                                  "--http-host",            "127.0.0.1",
                                  "--rendezvous-timeout-ms", "60000", "--heartbeat-interval-ms", "200",
                                  "--heartbeat-timeout-ms", "3000"};
    a.insert(a.end(), o.coordinator_flags.begin(), o.coordinator_flags.end());
    coord = std::make_unique<ChildProcess>(bin("coordinator/coordinator"), a, env(0), "coordinator");
  }
  void start_ranks(const ClusterOptions& o) {
    start_inference(o.inference_flags);
    start_cache(o.cache_flags);
  }
  /// (Re)starts the inference rank (rank 1) with these extra flags; a restart replaces a dead one (rejoin).
  void start_inference(const std::vector<std::string>& flags) {
    std::vector<std::string> a = {"--serve", "--model", model, "--num-inference", "1", "--num-cache", "1",
                                  "--rendezvous-timeout-ms", "60000", "--log-level", "info", "--metrics-port",
                                  std::to_string(inference_metrics_port), "--metrics-host", "127.0.0.1"};
    a.insert(a.end(), flags.begin(), flags.end());
    if (inf) retired.push_back(std::move(inf));
    inf = std::make_unique<ChildProcess>(bin("inference_rank/inference_rank"), a, env(1), "inference rank");
  }
  /// (Re)starts the cache rank (rank 2) with these extra flags; a restart replaces a dead one (rejoin).
  void start_cache(const std::vector<std::string>& flags) {
    std::vector<std::string> c = {"--model", model, "--num-inference", "1", "--num-cache", "1",
                                  "--rendezvous-timeout-ms", "60000", "--metrics-port",
                                  std::to_string(cache_metrics_port), "--metrics-host", "127.0.0.1"};
    c.insert(c.end(), flags.begin(), flags.end());
    if (cache) retired.push_back(std::move(cache));
    cache = std::make_unique<ChildProcess>(bin("cache_rank/cache_rank"), c, env(2), "cache rank");
  }
  /// Waits until GET /ready on `port` answers 200.
  bool wait_ready(int port, std::chrono::milliseconds timeout = 60s) {
    for (auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;
         std::this_thread::sleep_for(100ms)) {
      try {
        if (http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/ready", "", {}, 2s).status == 200)
          return true;
      } catch (const std::exception&) {
      }
    }
    return false;
  }
  std::string logs() const {
    std::string s;
    for (const auto& p : retired) s += "---- " + p->name() + " (replaced) ----\n" + p->log();
    for (auto* p : {coord.get(), inf.get(), cache.get()})
      if (p) s += "---- " + p->name() + " ----\n" + p->log();
    return s;
  }

  http::HttpResponse post(const std::string& path, const std::string& body, std::chrono::milliseconds t = 60s) {
    return http::http_request("127.0.0.1", static_cast<uint16_t>(http_port), "POST", path, body, {}, t);
  }
  http::HttpResponse get(const std::string& path) {
    return http::http_request("127.0.0.1", static_cast<uint16_t>(http_port), "GET", path);
  }
  std::string metrics_text(int port) {
    return http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/metrics").body;
  }
  std::map<std::string, double> metrics(int port) { return parse_metrics(metrics_text(port)); }
};

}  // namespace spade::test

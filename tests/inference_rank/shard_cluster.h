// The processes of the CPU layer-shard tests (test_sharded_cluster.cpp, test_shard_rejoin.cpp): the real coordinator,
// one inference rank and N cache rank binaries over UCX on stories260K. Coordinator (rank 0), inference #0 (rank 1),
// cache #0..#N-1 (ranks 2..N+1); the inference rank and each cache rank serve /metrics on their own port.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/client.h"
#include "tests/inference_rank/cluster_client.h"
#include "tests/test_util.h"

namespace spade::test {

struct ShardWorld {
  int n = 1;            // cache ranks (layer shards)
  int token_budget = 0;  // --token-budget of both sides, set by start()
  int port = free_port();
  int inf_metrics_port = free_port();
  std::vector<int> cache_metrics_ports;  // cache #s's /metrics
  std::string model = data_path("models/stories260K");
  std::unique_ptr<ChildProcess> coord, inf;
  std::vector<std::unique_ptr<ChildProcess>> caches;
  std::vector<std::unique_ptr<ChildProcess>> retired;  // replaced cache ranks (their logs stay readable)

  explicit ShardWorld(int num_cache) : n(num_cache) {
    for (int s = 0; s < n; ++s) cache_metrics_ports.push_back(free_port());
  }
  std::map<std::string, std::string> env(int rank) const {
    return {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}, {"RANK", std::to_string(rank)},
            {"WORLD_SIZE", std::to_string(2 + n)}, {"UCX_LOG_LEVEL", "error"}};
  }
  std::vector<std::string> world() const { return {"--num-inference", "1", "--num-cache", std::to_string(n)}; }
  /// Starts every process: the inference rank with --selection predicted, --token-budget `budget`, --local-window 16
  /// and then `inf_flags`; the cache ranks (start_cache) on `model`.
  void start(int budget, const std::vector<std::string>& inf_flags) {
    token_budget = budget;
    std::vector<std::string> a = {"--port", std::to_string(port), "--http-port", "0", "--rendezvous-timeout-ms",
                                  "20000", "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1000"};
    for (const auto& w : world()) a.push_back(w);
    coord = std::make_unique<ChildProcess>(bin("coordinator/coordinator"), a, env(0), "coordinator");
    std::vector<std::string> i = {"--serve", "--model", model, "--rendezvous-timeout-ms", "20000", "--log-level",
                                  "info", "--metrics-port", std::to_string(inf_metrics_port), "--metrics-host",
                                  "127.0.0.1", "--selection", "predicted", "--token-budget", std::to_string(budget),
                                  "--local-window", "16"};
    for (const auto& w : world()) i.push_back(w);
    i.insert(i.end(), inf_flags.begin(), inf_flags.end());
    inf = std::make_unique<ChildProcess>(bin("inference_rank/inference_rank"), i, env(1), "inference rank");
    for (int s = 0; s < n; ++s) caches.push_back(start_cache(s, model));
  }
  /// Cache #s (rank 2 + s) on the checkpoint in `model_dir`: --token-budget as start() got, --local-window 16,
  /// --kv-pages 512.
  std::unique_ptr<ChildProcess> start_cache(int s, const std::string& model_dir) const {
    std::vector<std::string> c = {"--model", model_dir, "--rendezvous-timeout-ms", "20000", "--token-budget",
                                  std::to_string(token_budget), "--local-window", "16", "--metrics-port",
                                  std::to_string(cache_metrics_ports[static_cast<size_t>(s)]), "--metrics-host",
                                  "127.0.0.1", "--kv-pages", "512"};
    for (const auto& w : world()) c.push_back(w);
    return std::make_unique<ChildProcess>(bin("cache_rank/cache_rank"), c, env(2 + s),
                                          "cache rank " + std::to_string(2 + s));
  }
  /// A replacement for cache #s: the old process is kept (retired) for its log.
  void replace_cache(int s, const std::string& model_dir) {
    retired.push_back(std::move(caches[static_cast<size_t>(s)]));
    caches[static_cast<size_t>(s)] = start_cache(s, model_dir);
  }
  std::string logs() const {
    std::string s;
    for (auto* p : {coord.get(), inf.get()})
      if (p) s += "---- " + p->name() + " ----\n" + p->log();
    for (const auto& p : retired) s += "---- " + p->name() + " (retired) ----\n" + p->log();
    for (const auto& p : caches) s += "---- " + p->name() + " ----\n" + p->log();
    return s;
  }
  /// Shuts the world down through `c`; every process still running must exit 0 within 15 s.
  void shutdown(coord::CoordinatorClient& c) {
    c.request_shutdown("test done");
    EXPECT_EQ(inf->wait_exit(std::chrono::seconds(15)), 0) << logs();
    for (auto& p : caches)
      if (p->running()) {
        EXPECT_EQ(p->wait_exit(std::chrono::seconds(15)), 0) << logs();
      }
    EXPECT_EQ(coord->wait_exit(std::chrono::seconds(15)), 0) << logs();
  }
};

}  // namespace spade::test

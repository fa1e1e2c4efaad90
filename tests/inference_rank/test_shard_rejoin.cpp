// Rejoin of one layer shard (pair/sharded_link.h), as processes: the real coordinator, inference rank and two cache
// rank binaries over UCX on stories260K (5 layers, packs of one layer: cache #0 holds layers 0,2,4, cache #1 layers
// 1,3). Cache #1 (rank 3) is SIGKILLed: the pair decodes densely; a replacement for the same index is re-paired as
// shard 1 alone (shard 0 keeps its link and frees what it held) and new requests decode sparsely over both shards
// again, token for token as one cache rank holding every layer; a replacement holding other layers is refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/http_server.h"
#include "coordinator/client.h"
#include "tests/coordinator/api_cluster.h"  // parse_metrics
#include "tests/inference_rank/cluster_client.h"
#include "tests/inference_rank/shard_cluster.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using test::generate;
using test::Outcome;
using Clock = std::chrono::steady_clock;

constexpr int kBudget = 16;  // small: sparse steps really choose, so equal ids mean equal selections
constexpr int kTokens = 240;

// The shard world (shard_cluster.h) at budget kBudget, sparse from token 32, packs of one layer, with this file's
// /ready and /metrics probes.
struct ShardCluster : test::ShardWorld {
  using ShardWorld::ShardWorld;
  void start() { ShardWorld::start(kBudget, {"--sparse-threshold", "32", "--layers-per-pack", "1"}); }
  static std::string get(int port, const std::string& path) {
    try {
      return http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", path, "", {}, 2s).body;
    } catch (const std::exception& e) {
      return std::string("unreachable: ") + e.what();
    }
  }
  /// Metric `series` (name with labels, as served) on `port`; -1 when absent or unreachable.
  static double metric(int port, const std::string& series) {
    const auto m = test::parse_metrics(get(port, "/metrics"));
    const auto it = m.find(series);
    return it == m.end() ? -1.0 : it->second;
  }
  /// Until the inference rank's /ready body contains `needle`.
  bool inf_ready_says(const std::string& needle, std::chrono::milliseconds timeout = 30s) const {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms))
      if (get(inf_metrics_port, "/ready").find(needle) != std::string::npos) return true;
    return false;
  }
  /// Until the pair is whole: /ready ready and not degraded, spade_pair_degraded 0.
  bool pair_whole(std::chrono::milliseconds timeout = 30s) const {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      const std::string body = get(inf_metrics_port, "/ready");
      if (body.find("\"ready\"") != std::string::npos && body.find("degraded") == std::string::npos &&
          metric(inf_metrics_port, "spade_pair_degraded") == 0)
        return true;
    }
    return false;
  }
  /// Until `series` on `port` reads `value`.
  static bool metric_reaches(int port, const std::string& series, double value, std::chrono::milliseconds timeout) {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms))
      if (metric(port, series) == value) return true;
    return false;
  }
};

test::GenerateOptions ignore_eos() {
  test::GenerateOptions o;
  o.ignore_eos = true;
  return o;
}

// A sparse request is streamed and cache #1 (shard 1, rank 3) SIGKILLed once it is past the sparse threshold: the
// request fails naming it and the pair is degraded.
void kill_shard_one_mid_decode(ShardCluster& cl, coord::CoordinatorClient& c) {
  Clock::time_point killed{};
  const auto streams = test::stream(c, {test::greedy_request("Once upon a time", 400, true)},
                                    [&](size_t, const test::StreamOutcome& s) {
                                      if (killed == Clock::time_point{} && s.outcome.ids.size() >= 60) {
                                        cl.caches[1]->signal(SIGKILL);
                                        killed = Clock::now();
                                      }
                                    });
  ASSERT_NE(killed, Clock::time_point{}) << streams[0].outcome.error << cl.logs();
  EXPECT_EQ(streams[0].outcome.reason, proto::FINISH_ERROR) << streams[0].outcome.error << cl.logs();
  EXPECT_THAT(streams[0].outcome.error, HasSubstr("cache rank 3"));
  ASSERT_TRUE(cl.inf_ready_says("degraded")) << cl.logs();
  EXPECT_THAT(ShardCluster::get(cl.inf_metrics_port, "/ready"), HasSubstr("cache rank 3"));
}

TEST(ShardRejoin, KilledShardIsReplacedAndNewRequestsDecodeSparselyOverBothShardsAgain) {
  Outcome ref;  // one cache rank holding every layer, same budget
  {
    ShardCluster one(1);
    one.start();
    auto c1 = test::cluster_client(one.port);
    ref = generate(*c1, "", kTokens, nullptr, ignore_eos());
    ASSERT_EQ(ref.reason, proto::FINISH_LENGTH) << ref.error << one.logs();
    ASSERT_EQ(ref.ids.size(), static_cast<size_t>(kTokens));
    one.shutdown(*c1);
  }
  ShardCluster cl(2);
  cl.start();
  auto c = test::cluster_client(cl.port);
  ASSERT_TRUE(cl.inf_ready_says("\"ready\"")) << cl.logs();
  kill_shard_one_mid_decode(cl, *c);

  // Degraded: a request past the threshold is served densely to its end; shard 0 stays up.
  const Outcome dense = generate(*c, "", 120, nullptr, ignore_eos());
  EXPECT_EQ(dense.reason, proto::FINISH_LENGTH) << dense.error << cl.logs();
  EXPECT_EQ(dense.ids.size(), 120u);
  const double fallbacks = ShardCluster::metric(cl.inf_metrics_port, "spade_dense_fallbacks_total");
  EXPECT_GT(fallbacks, 0) << cl.logs();
  EXPECT_TRUE(cl.caches[0]->running()) << cl.logs();
  // Shard 0 still holds the KV of the request the kill ended (nothing could release it over the failed link).
  EXPECT_GT(ShardCluster::metric(cl.cache_metrics_ports[0], "spade_cache_sequences"), 0) << cl.logs();
  const double updates0 = ShardCluster::metric(cl.cache_metrics_ports[0], "spade_cache_pack_updates_total");

  // A replacement for cache #1 re-pairs as shard 1; the pair is whole again.
  cl.replace_cache(1, cl.model);
  ASSERT_TRUE(cl.pair_whole()) << ShardCluster::get(cl.inf_metrics_port, "/ready") << "\n" << cl.logs();
  EXPECT_THAT(cl.inf->log(), HasSubstr("re-paired as layer shard 1 of 2 (layers 1,3)"));
  const double sparse0 = ShardCluster::metric(cl.inf_metrics_port, "spade_sparse_sequence_steps_total");

  const Outcome after = generate(*c, "", kTokens, nullptr, ignore_eos());
  ASSERT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  EXPECT_EQ(after.ids, ref.ids) << "greedy output after the shard's rejoin differs from one cache rank's";
  std::this_thread::sleep_for(300ms);  // the metrics of the last step
  EXPECT_GT(ShardCluster::metric(cl.inf_metrics_port, "spade_sparse_sequence_steps_total"), sparse0 + 100)
      << "the request after the rejoin did not decode sparsely" << cl.logs();
  EXPECT_EQ(ShardCluster::metric(cl.inf_metrics_port, "spade_dense_fallbacks_total"), fallbacks);
  EXPECT_EQ(ShardCluster::metric(cl.inf_metrics_port, "spade_pair_degraded"), 0);
  // Both shards served it, each its own layers, without an error.
  EXPECT_GT(ShardCluster::metric(cl.cache_metrics_ports[0], "spade_cache_pack_updates_total"), updates0);
  EXPECT_GT(ShardCluster::metric(cl.cache_metrics_ports[1], "spade_cache_pack_updates_total"), 0) << cl.logs();
  EXPECT_GT(ShardCluster::metric(cl.cache_metrics_ports[1], "spade_selected_tokens_total"), 0) << cl.logs();
  for (int s = 0; s < 2; ++s) {
    const int port = cl.cache_metrics_ports[static_cast<size_t>(s)];
    EXPECT_EQ(ShardCluster::metric(port, "spade_cache_selection_errors_total"), 0) << "shard " << s << cl.logs();
    const std::string series = "spade_cache_shard_layers{shard=\"" + std::to_string(s) + "\",num_shards=\"2\"}";
    EXPECT_EQ(ShardCluster::metric(port, series), s == 0 ? 3 : 2) << series;
  }
  // Nothing leaks: shard 0 freed the request the kill ended, and both freed the last one.
  for (int s = 0; s < 2; ++s)
    EXPECT_TRUE(ShardCluster::metric_reaches(cl.cache_metrics_ports[static_cast<size_t>(s)], "spade_cache_sequences",
                                             0, 10s))
        << "shard " << s << " still holds sequences\n"
        << cl.logs();
  cl.shutdown(*c);
}

// A replacement for cache #1 started on a checkpoint of 3 layers holds layer 1 only as shard 1 (not 1 and 3): the
// inference rank's probe refuses it, naming it and the layers, and stays dense; a correct replacement then re-pairs.
TEST(ShardRejoin, AReplacementHoldingOtherLayersIsRefusedByName) {
  const std::string bad = test::make_temp_dir("spade_shard_rejoin_model");
  {
    std::string cfg = test::read_file(test::data_path("models/stories260K/config.json"));
    const std::string from = "\"num_hidden_layers\": 5";
    ASSERT_NE(cfg.find(from), std::string::npos);
    cfg.replace(cfg.find(from), from.size(), "\"num_hidden_layers\": 3");
    std::ofstream(bad + "/config.json") << cfg;
  }
  ShardCluster cl(2);
  cl.start();
  auto c = test::cluster_client(cl.port);
  ASSERT_TRUE(cl.inf_ready_says("\"ready\"")) << cl.logs();
  cl.caches[1]->signal(SIGKILL);
  ASSERT_TRUE(cl.inf_ready_says("degraded")) << cl.logs();

  cl.replace_cache(1, bad);
  ASSERT_TRUE(cl.inf_ready_says("does not serve layer shard 1 of 2 (layers 1,3 of 5")) << cl.logs();
  const std::string ready = ShardCluster::get(cl.inf_metrics_port, "/ready");
  EXPECT_THAT(ready, HasSubstr("cache rank 3 (#1)")) << ready;
  EXPECT_THAT(ready, HasSubstr("layer 3")) << ready;  // the cache rank's own refusal of the layer it lacks
  EXPECT_THAT(cl.inf->log(), HasSubstr("re-pairing cache rank 3 (#1)"));
  EXPECT_EQ(ShardCluster::metric(cl.inf_metrics_port, "spade_pair_degraded"), 1);
  // Still dense, and serving.
  const Outcome dense = generate(*c, "", 120, nullptr, ignore_eos());
  EXPECT_EQ(dense.reason, proto::FINISH_LENGTH) << dense.error << cl.logs();
  // The refused replacement's session was ended: it leaves, and a correct replacement re-pairs.
  EXPECT_NE(cl.caches[1]->wait_exit(15s), -1) << cl.logs();
  bool dead = false;  // the coordinator declared it dead: its index is free for a replacement
  for (auto until = Clock::now() + 10s; !dead && Clock::now() < until; std::this_thread::sleep_for(50ms)) {
    const proto::StatusReply st = c->query_status(Clock::now() + 2s);
    for (const auto& r : st.ranks()) dead = dead || (r.info().rank() == 3 && r.state() == proto::DEAD);
  }
  ASSERT_TRUE(dead) << cl.logs();
  cl.replace_cache(1, cl.model);
  ASSERT_TRUE(cl.pair_whole()) << ShardCluster::get(cl.inf_metrics_port, "/ready") << "\n" << cl.logs();
  const double sparse0 = ShardCluster::metric(cl.inf_metrics_port, "spade_sparse_sequence_steps_total");
  const Outcome after = generate(*c, "", 120, nullptr, ignore_eos());
  EXPECT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  std::this_thread::sleep_for(300ms);
  EXPECT_GT(ShardCluster::metric(cl.inf_metrics_port, "spade_sparse_sequence_steps_total"), sparse0) << cl.logs();
  cl.shutdown(*c);
  std::filesystem::remove_all(bad);
}

}  // namespace
}  // namespace spade

// One inference rank with N cache ranks (layer shards, pair/sharded_link.h), as processes: the real coordinator,
// inference rank and N cache rank binaries over UCX on stories260K (5 layers). Inference #0 pairs with cache
// #0..#N-1; with --layers-per-pack 1, cache #s holds the layers l with l mod N == s.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "common/http_server.h"
#include "coordinator/client.h"
#include "tests/inference_rank/cluster_client.h"
#include "tests/inference_rank/shard_cluster.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using test::bin;
using test::ChildProcess;
using test::generate;
using test::Outcome;
using Clock = std::chrono::steady_clock;

// The shard world (shard_cluster.h) with this file's /ready and /metrics probes.
struct ShardedCluster : test::ShardWorld {
  using ShardWorld::ShardWorld;
  static http::HttpResponse get(int port, const std::string& path) {
    return http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", path);
  }
  bool inf_ready(std::chrono::milliseconds timeout = 30s) const {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      try {
        if (get(inf_metrics_port, "/ready").status == 200) return true;
      } catch (const std::exception&) {  // not listening yet
      }
    }
    return false;
  }
  /// The first sample of metric `name` (a series line starting with `name`, labels included) on `port`; -1 if none.
  static double metric(int port, const std::string& name) {
    const std::string text = get(port, "/metrics").body;
    for (size_t pos = 0; pos < text.size();) {
      size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(pos, end - pos);
      pos = end + 1;
      if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
    }
    return -1;
  }
};

// Greedy from BOS, sparse from token 32 on, packs of one layer (5 packs: every shard holds one or more).
Outcome greedy_run(ShardedCluster& cl, int budget, int tokens, std::string* logs) {
  cl.start(budget, {"--sparse-threshold", "32", "--layers-per-pack", "1"});
  auto c = test::cluster_client(cl.port);
  const Outcome o = generate(*c, "", tokens, nullptr, {.ignore_eos = true});
  std::this_thread::sleep_for(300ms);  // the metrics of the last step
  // The pair decoded sparsely all along (a failed shard would fall back to dense: the same text at full budget).
  EXPECT_GT(ShardedCluster::metric(cl.inf_metrics_port, "spade_sparse_sequence_steps_total"), 0) << cl.logs();
  EXPECT_EQ(ShardedCluster::metric(cl.inf_metrics_port, "spade_pair_degraded"), 0) << cl.logs();
  EXPECT_EQ(ShardedCluster::metric(cl.inf_metrics_port, "spade_dense_fallbacks_total"), 0) << cl.logs();
  // Every cache rank served its shard, and only its shard's layers (the metric's labels name the shard).
  for (int s = 0; s < cl.n; ++s) {
    const int port = cl.cache_metrics_ports[static_cast<size_t>(s)];
    EXPECT_GT(ShardedCluster::metric(port, "spade_cache_pack_updates_total"), 0) << "shard " << s << cl.logs();
    EXPECT_EQ(ShardedCluster::metric(port, "spade_cache_selection_errors_total"), 0) << "shard " << s << cl.logs();
    const std::string series = "spade_cache_shard_layers{shard=\"" + std::to_string(s) + "\",num_shards=\"" +
                               std::to_string(cl.n) + "\"}";
    const int held = (5 - s + cl.n - 1) / cl.n;  // layers l < 5 with l mod N == s
    EXPECT_EQ(ShardedCluster::metric(port, series), held) << series << "\n"
                                                          << ShardedCluster::get(port, "/metrics").body;
  }
  *logs = cl.logs();
  cl.shutdown(*c);
  return o;
}

TEST(ShardedCluster, TwoAndThreeCacheRanksAtFullBudgetReproduceDenseGreedyExactly) {
  const std::string expected = test::read_file(test::data_path("models/stories260K/expected_greedy_200tok.txt"));
  for (int n : {2, 3}) {
    SCOPED_TRACE("N = " + std::to_string(n));
    ShardedCluster cl(n);
    std::string logs;
    const Outcome o = greedy_run(cl, 512, 200, &logs);  // budget >= context: selection holds every candidate
    EXPECT_EQ(o.reason, proto::FINISH_LENGTH) << o.error << logs;
    EXPECT_EQ(o.text, expected) << logs;
    EXPECT_THAT(cl.inf->log(), HasSubstr(std::to_string(n) + " layer shards")) << logs;
    EXPECT_THAT(cl.caches[0]->log(), HasSubstr("shard 0 of " + std::to_string(n))) << logs;
  }
}

TEST(ShardedCluster, AtASmallBudgetTwoAndThreeCacheRanksSelectWhatOneCacheRankSelects) {
  // 240 tokens at budget 16: sparse steps really choose (and the output differs from dense), so equal token ids
  // mean every shard selected exactly what the one cache rank holding every layer selects.
  ShardedCluster one(1);
  std::string logs1;
  const Outcome ref = greedy_run(one, 16, 240, &logs1);
  ASSERT_EQ(ref.reason, proto::FINISH_LENGTH) << ref.error << logs1;
  ASSERT_EQ(ref.ids.size(), 240u);
  const std::string dense = test::read_file(test::data_path("models/stories260K/expected_greedy_200tok.txt"));
  EXPECT_NE(ref.text.substr(0, dense.size()), dense) << "budget 16 should change the greedy output";
  for (int n : {2, 3}) {
    SCOPED_TRACE("N = " + std::to_string(n));
    ShardedCluster cl(n);
    std::string logs;
    const Outcome o = greedy_run(cl, 16, 240, &logs);
    EXPECT_EQ(o.reason, proto::FINISH_LENGTH) << o.error << logs;
    EXPECT_EQ(o.ids, ref.ids) << logs;
  }
}

// One of the two cache ranks is killed while a sparse and a dense (force_dense) stream are in flight: the pair
// degrades as with one cache rank — the sparse stream fails fast naming the dead cache rank, the dense stream gets
// every token, a new request decodes densely, /ready says "degraded" naming it — and the other cache rank stays up.
TEST(ShardedCluster, KillingOneOfTwoCacheRanksDegradesThePairToDense) {
  ShardedCluster cl(2);
  cl.start(16, {"--sparse-threshold", "32", "--layers-per-pack", "1"});
  auto c = test::cluster_client(cl.port);
  ASSERT_TRUE(cl.inf_ready()) << cl.logs();
  EXPECT_EQ(ShardedCluster::metric(cl.inf_metrics_port, "spade_pair_degraded"), 0) << cl.logs();
  Clock::time_point killed{};
  const auto streams = test::stream(
      *c, {test::greedy_request("Once upon a time", 400, true), test::greedy_request("", 480, true, true)},
      [&](size_t i, const test::StreamOutcome& s) {
        if (killed == Clock::time_point{} && i == 0 && s.outcome.ids.size() >= 60) {
          cl.caches[1]->signal(SIGKILL);  // cache #1 = rank 3, shard 1
          killed = Clock::now();
        }
      });
  ASSERT_NE(killed, Clock::time_point{}) << streams[0].outcome.error << cl.logs();
  const Outcome& sparse = streams[0].outcome;
  const Outcome& dense = streams[1].outcome;
  EXPECT_EQ(sparse.reason, proto::FINISH_ERROR) << sparse.error << cl.logs();
  EXPECT_THAT(sparse.error, HasSubstr("cache rank 3")) << "the error names the lost shard's rank";
  EXPECT_LT(streams[0].ended - killed, 2s) << "heartbeat deadline (1 s) + 1 s:\n" << cl.logs();
  EXPECT_EQ(dense.reason, proto::FINISH_LENGTH) << dense.error << cl.logs();
  EXPECT_EQ(dense.ids.size(), 480u);
  const Outcome after = generate(*c, "", 120, nullptr, {.ignore_eos = true});
  EXPECT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  EXPECT_EQ(after.ids.size(), 120u);
  const http::HttpResponse ready = ShardedCluster::get(cl.inf_metrics_port, "/ready");
  EXPECT_EQ(ready.status, 200) << ready.body;
  EXPECT_THAT(ready.body, HasSubstr("\"degraded\"")) << ready.body;
  EXPECT_THAT(ready.body, HasSubstr("cache rank 3")) << ready.body;
  EXPECT_EQ(ShardedCluster::metric(cl.inf_metrics_port, "spade_pair_degraded"), 1);
  EXPECT_TRUE(cl.caches[0]->running()) << "the healthy shard stays up" << cl.logs();
  cl.shutdown(*c);
}

// A world whose cache ranks are not a multiple of its inference ranks is refused by every binary, naming the counts.
TEST(ShardedCluster, CacheRanksNotAMultipleOfInferenceRanksAreRefused) {
  const int port = test::free_port();
  std::map<std::string, std::string> env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
                                            {"RANK", "0"}, {"WORLD_SIZE", "6"}};
  ChildProcess coord(bin("coordinator/coordinator"),
                     {"--port", std::to_string(port), "--http-port", "0", "--num-inference", "2", "--num-cache", "3"},
                     env, "coordinator");
  EXPECT_EQ(coord.wait_exit(15s), 2) << coord.log();
  EXPECT_THAT(coord.log(), HasSubstr("cannot pair 2 inference rank(s) with 3 cache rank(s)"));
  EXPECT_THAT(coord.log(), HasSubstr("multiple of --num-inference"));
  env["RANK"] = "3";
  ChildProcess cache(bin("cache_rank/cache_rank"),
                     {"--model", test::data_path("models/stories260K"), "--num-inference", "2", "--num-cache", "3"},
                     env, "cache rank");
  EXPECT_EQ(cache.wait_exit(15s), 2) << cache.log();
  EXPECT_THAT(cache.log(), HasSubstr("cannot pair 2 inference rank(s) with 3 cache rank(s)"));
}

// More cache ranks than layer packs (5 layers in packs of 2: 3 packs, 4 cache ranks): a shard would hold nothing, and
// the inference rank refuses to start, naming --layers-per-pack.
TEST(ShardedCluster, MoreCacheRanksThanLayerPacksAreRefused) {
  ShardedCluster cl(4);
  cl.start(16, {"--sparse-threshold", "32", "--layers-per-pack", "2"});
  EXPECT_EQ(cl.inf->wait_exit(30s), 2) << cl.logs();
  EXPECT_THAT(cl.inf->log(), HasSubstr("4 cache ranks but only 3 layer packs")) << cl.logs();
}

}  // namespace
}  // namespace spade

// Rejoin on the CPU, as processes: the real coordinator (with the OpenAI API), inference rank and cache rank on
// stories260K over UCX (ApiCluster), sparse decoding from 32 tokens on. A rank SIGKILLed mid-decode is replaced by a
// new process with the same index (what a Kubernetes StatefulSet or launch_local.sh's restart does): the pair
// re-handshakes and new requests decode sparsely again, token for token as before the kill; a registration for a
// live index is refused by name.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <future>
#include <thread>

#include "tests/coordinator/api_cluster.h"
#include "tests/inference_rank/cluster_client.h"

namespace spade {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::vector<std::string> kInferenceFlags = {"--selection", "predicted", "--sparse-threshold", "32",
                                                  "--token-budget", "16", "--layers-per-pack", "2"};
const std::vector<std::string> kCacheFlags = {"--token-budget", "16"};
const std::string kPrompt = "Once upon a time";
constexpr int kTokens = 120;  // 4 prompt tokens + 120: sparse from token 32 on

struct RejoinTest : ::testing::Test {
  test::ApiCluster cl;

  double metric(int port, const std::string& name) {
    try {
      const auto m = cl.metrics(port);
      const auto it = m.find(name);
      return it == m.end() ? -1.0 : it->second;
    } catch (const std::exception&) {
      return -1.0;
    }
  }
  std::string ready_body(int port) {
    try {
      return http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/ready", "", {}, 2s).body;
    } catch (const std::exception& e) {
      return std::string("unreachable: ") + e.what();
    }
  }
  /// Waits until /ready on `port` answers with `needle` in its body.
  bool ready_says(int port, const std::string& needle, std::chrono::milliseconds timeout = 30s) {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms))
      if (ready_body(port).find(needle) != std::string::npos) return true;
    return false;
  }
  /// Until the inference rank's metrics say the pair is whole (spade_pair_degraded 0) and its /ready is not
  /// degraded.
  bool pair_whole(std::chrono::milliseconds timeout = 30s) {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      const std::string body = ready_body(cl.inference_metrics_port);
      if (body.find("\"ready\"") != std::string::npos && body.find("degraded") == std::string::npos &&
          metric(cl.inference_metrics_port, "spade_pair_degraded") == 0)
        return true;
    }
    return false;
  }

  void start() {
    cl.start_coordinator({});
    cl.start_ranks({{}, kInferenceFlags, kCacheFlags});
    ASSERT_TRUE(cl.wait_ready(cl.http_port)) << cl.logs();
    ASSERT_TRUE(cl.wait_ready(cl.inference_metrics_port)) << cl.logs();
  }

  /// A long sparse request streamed on a thread of its own; `tokens` counts what arrived.
  struct Background {
    std::atomic<size_t> tokens{0};
    std::future<test::Outcome> outcome;
  };
  void run_long(coord::CoordinatorClient& c, Background& b) {
    b.outcome = std::async(std::launch::async, [&c, &b] {
      test::GenerateOptions o;
      o.ignore_eos = true;
      return test::generate(c, kPrompt, 500, [&b](size_t n) { b.tokens = n; }, o);  // 4 + 500 <= 512
    });
  }
  /// Waits until the background request is past the sparse threshold (decoding sparsely).
  bool mid_decode(Background& b) {
    for (auto until = Clock::now() + 30s; Clock::now() < until; std::this_thread::sleep_for(5ms))
      if (b.tokens >= 60) return true;
    return false;
  }
};

TEST_F(RejoinTest, KilledCacheRankIsReplacedAndNewRequestsDecodeSparselyAgain) {
  start();
  auto c = cl.control_client();
  test::GenerateOptions go;
  go.ignore_eos = true;
  const test::Outcome before = test::generate(*c, kPrompt, kTokens, nullptr, go);
  ASSERT_EQ(before.reason, proto::FINISH_LENGTH) << before.error << cl.logs();
  std::this_thread::sleep_for(300ms);  // the rank's metrics follow its loop
  const double sparse0 = metric(cl.inference_metrics_port, "spade_sparse_sequence_steps_total");
  ASSERT_GT(sparse0, 0) << "the reference must decode sparsely";

  // Kill the cache rank mid-decode: the stream in flight fails naming it; the pair is degraded.
  Background b;
  run_long(*c, b);
  ASSERT_TRUE(mid_decode(b)) << cl.logs();
  cl.cache->signal(SIGKILL);
  const test::Outcome cut = b.outcome.get();
  EXPECT_EQ(cut.reason, proto::FINISH_ERROR) << cut.error;
  EXPECT_NE(cut.error.find("cache rank 2"), std::string::npos) << cut.error;
  ASSERT_TRUE(ready_says(cl.inference_metrics_port, "degraded")) << cl.logs();
  ASSERT_TRUE(ready_says(cl.http_port, "cache rank 2 (#0) is dead")) << ready_body(cl.http_port);
  // Degraded: a request past the threshold is served, densely.
  const test::Outcome dense = test::generate(*c, kPrompt, kTokens, nullptr, go);
  EXPECT_EQ(dense.reason, proto::FINISH_LENGTH) << dense.error;
  const double fallbacks = metric(cl.inference_metrics_port, "spade_dense_fallbacks_total");
  EXPECT_GT(fallbacks, 0);

  // A replacement with the same index re-pairs; the coordinator and the inference rank are whole again.
  cl.start_cache(kCacheFlags);
  ASSERT_TRUE(pair_whole()) << ready_body(cl.inference_metrics_port) << "\n" << cl.logs();
  ASSERT_TRUE(ready_says(cl.http_port, "\"ready\"")) << ready_body(cl.http_port);
  EXPECT_EQ(ready_body(cl.http_port).find("degraded"), std::string::npos) << ready_body(cl.http_port);
  ASSERT_TRUE(cl.wait_ready(cl.cache_metrics_port)) << cl.logs();

  const double sparse1 = metric(cl.inference_metrics_port, "spade_sparse_sequence_steps_total");
  const test::Outcome after = test::generate(*c, kPrompt, kTokens, nullptr, go);
  ASSERT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  EXPECT_EQ(after.ids, before.ids) << "greedy output after the rejoin differs from the one before the kill";
  std::this_thread::sleep_for(300ms);
  EXPECT_GT(metric(cl.inference_metrics_port, "spade_sparse_sequence_steps_total"), sparse1)
      << "the request after the rejoin did not decode sparsely";
  EXPECT_EQ(metric(cl.inference_metrics_port, "spade_dense_fallbacks_total"), fallbacks);
  EXPECT_GT(metric(cl.cache_metrics_port, "spade_selected_tokens_total"), 0) << "the new cache rank never selected";
  EXPECT_GT(metric(cl.cache_metrics_port, "spade_cache_pack_updates_total"), 0);
  EXPECT_EQ(metric(cl.inference_metrics_port, "spade_pair_degraded"), 0);

  c->request_shutdown("rejoin test done");
  EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
  EXPECT_EQ(cl.cache->wait_exit(10s), 0) << cl.logs();
  EXPECT_EQ(cl.coord->wait_exit(10s), 0) << cl.logs();
}

TEST_F(RejoinTest, KilledInferenceRankIsReplacedAndTheLiveCacheRankServesIt) {
  start();
  auto c = cl.control_client();
  test::GenerateOptions go;
  go.ignore_eos = true;
  const test::Outcome before = test::generate(*c, kPrompt, kTokens, nullptr, go);
  ASSERT_EQ(before.reason, proto::FINISH_LENGTH) << before.error << cl.logs();

  // Kill the inference rank mid-decode: the request ends with an error naming it; the cache rank stays up, frees the
  // dead rank's sequences and waits for a replacement.
  Background b;
  run_long(*c, b);
  ASSERT_TRUE(mid_decode(b)) << cl.logs();
  // The cache rank holds the sparse sequence (its gauge follows each pack, so poll rather than wait a fixed time:
  // the request must still be decoding when the rank is killed).
  bool held = false;
  for (auto until = Clock::now() + 5s; !held && Clock::now() < until; std::this_thread::sleep_for(5ms))
    held = metric(cl.cache_metrics_port, "spade_cache_sequences") > 0;
  EXPECT_TRUE(held) << "the cache rank holds the sparse sequence";
  cl.inf->signal(SIGKILL);
  const test::Outcome cut = b.outcome.get();
  EXPECT_EQ(cut.reason, proto::FINISH_ERROR) << cut.error;
  EXPECT_NE(cut.error.find("inference rank 1"), std::string::npos) << cut.error;
  // Its only inference rank dead, the coordinator is not ready (503) until the replacement registers.
  ASSERT_TRUE(ready_says(cl.http_port, "no live inference rank")) << ready_body(cl.http_port);
  EXPECT_TRUE(cl.cache->running()) << cl.logs();
  for (auto until = Clock::now() + 10s;
       Clock::now() < until && metric(cl.cache_metrics_port, "spade_cache_sequences") != 0;)
    std::this_thread::sleep_for(50ms);
  EXPECT_EQ(metric(cl.cache_metrics_port, "spade_cache_sequences"), 0) << "the dead rank's KV leaked";
  EXPECT_EQ(metric(cl.cache_metrics_port, "spade_cache_kv_usage_perc"), 0);
  const double selected0 = metric(cl.cache_metrics_port, "spade_selected_tokens_total");

  // The replacement registers, pairs with the live cache rank and serves sparsely.
  cl.start_inference(kInferenceFlags);
  ASSERT_TRUE(cl.wait_ready(cl.inference_metrics_port)) << cl.logs();
  ASSERT_TRUE(pair_whole()) << cl.logs();
  ASSERT_TRUE(ready_says(cl.http_port, "\"ready\"")) << ready_body(cl.http_port);
  const test::Outcome after = test::generate(*c, kPrompt, kTokens, nullptr, go);
  ASSERT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  EXPECT_EQ(after.ids, before.ids) << "greedy output after the rejoin differs from the one before the kill";
  std::this_thread::sleep_for(300ms);
  EXPECT_GT(metric(cl.inference_metrics_port, "spade_sparse_sequence_steps_total"), 0)
      << "the replacement did not decode sparsely";
  EXPECT_GT(metric(cl.cache_metrics_port, "spade_selected_tokens_total"), selected0)
      << "the cache rank did not select for the replacement";
  // Its sequences are released when they end (no leak across incarnations).
  for (auto until = Clock::now() + 10s;
       Clock::now() < until && metric(cl.cache_metrics_port, "spade_cache_sequences") != 0;)
    std::this_thread::sleep_for(50ms);
  EXPECT_EQ(metric(cl.cache_metrics_port, "spade_cache_sequences"), 0);

  c->request_shutdown("rejoin test done");
  EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
  EXPECT_EQ(cl.cache->wait_exit(10s), 0) << cl.logs();
  EXPECT_EQ(cl.coord->wait_exit(10s), 0) << cl.logs();
}

// No split brain: a second cache rank #0 while the first is alive exits non-zero with the coordinator's refusal, and
// the live pair keeps decoding sparsely.
TEST_F(RejoinTest, SecondRankForALiveIndexIsRefusedByName) {
  start();
  std::vector<std::string> c = {"--model", cl.model, "--num-inference", "1", "--num-cache", "1",
                                "--rendezvous-timeout-ms", "10000", "--token-budget", "16"};
  test::ChildProcess intruder(test::bin("cache_rank/cache_rank"), c, cl.env(2), "second cache rank");
  const int code = intruder.wait_exit(20s);
  EXPECT_NE(code, 0) << intruder.log();
  EXPECT_NE(code, -1) << "the second cache rank was not refused";
  EXPECT_NE(intruder.log().find("rank 2 is already registered"), std::string::npos) << intruder.log();
  EXPECT_TRUE(cl.cache->running());
  auto client = cl.control_client();
  test::GenerateOptions go;
  go.ignore_eos = true;
  const double sparse0 = metric(cl.inference_metrics_port, "spade_sparse_sequence_steps_total");
  const test::Outcome o = test::generate(*client, kPrompt, kTokens, nullptr, go);
  EXPECT_EQ(o.reason, proto::FINISH_LENGTH) << o.error;
  std::this_thread::sleep_for(300ms);
  EXPECT_GT(metric(cl.inference_metrics_port, "spade_sparse_sequence_steps_total"), sparse0);
  client->request_shutdown("rejoin test done");
  EXPECT_EQ(cl.coord->wait_exit(10s), 0) << cl.logs();
}

}  // namespace
}  // namespace spade

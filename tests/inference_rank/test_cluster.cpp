// Multi-process tests of the disaggregated path: real coordinator, inference rank and cache rank processes talking
// protobuf over TCP (control) and UCX over loopback (data), on the real stories260K model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "common/http_server.h"
#include "coordinator/client.h"
#include "tests/inference_rank/cluster_client.h"
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

struct Cluster {
  int port = test::free_port();
  int inf_metrics_port = test::free_port();  // the inference rank's /metrics, /health, /ready
  std::string model = test::data_path("models/stories260K");
  std::unique_ptr<ChildProcess> coord, inf, cache;

  std::map<std::string, std::string> env(int rank) {
    return {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}, {"RANK", std::to_string(rank)},
            {"WORLD_SIZE", "3"}};
  }
  void start(const std::vector<std::string>& sparse_flags, int rendezvous_ms = 20000, bool with_cache = true) {
    coord = std::make_unique<ChildProcess>(
        bin("coordinator/coordinator"),
        std::vector<std::string>{"--port", std::to_string(port), "--http-port", "0", "--num-inference", "1", "--num-cache", "1",
                                 "--rendezvous-timeout-ms", std::to_string(rendezvous_ms), "--heartbeat-interval-ms",
                                 "200", "--heartbeat-timeout-ms", "1000"},
        env(0), "coordinator");
    std::vector<std::string> a = {"--serve", "--model", model, "--num-inference", "1", "--num-cache", "1",
                                  "--rendezvous-timeout-ms", std::to_string(rendezvous_ms), "--log-level", "info",
                                  "--metrics-port", std::to_string(inf_metrics_port), "--metrics-host", "127.0.0.1"};
    a.insert(a.end(), sparse_flags.begin(), sparse_flags.end());
    inf = std::make_unique<ChildProcess>(bin("inference_rank/inference_rank"), a, env(1), "inference rank");
    if (with_cache) {
      std::vector<std::string> c = {"--model", model, "--num-inference", "1", "--num-cache", "1",
                                    "--rendezvous-timeout-ms", std::to_string(rendezvous_ms)};
      for (size_t i = 0; i + 1 < sparse_flags.size(); i += 2)
        if (sparse_flags[i] == "--token-budget" || sparse_flags[i] == "--local-window" ||
            sparse_flags[i] == "--sink-tokens" || sparse_flags[i] == "--query-window") {
          c.push_back(sparse_flags[i]);
          c.push_back(sparse_flags[i + 1]);
        }
      cache = std::make_unique<ChildProcess>(bin("cache_rank/cache_rank"), c, env(2), "cache rank");
    }
  }
  std::string logs() const {
    std::string s;
    for (auto* p : {coord.get(), inf.get(), cache.get()})
      if (p) s += "---- " + p->name() + " ----\n" + p->log();
    return s;
  }
  /// GET `path` on the inference rank's status endpoint.
  http::HttpResponse inf_get(const std::string& path) const {
    return http::http_request("127.0.0.1", static_cast<uint16_t>(inf_metrics_port), "GET", path);
  }
  /// Waits up to `timeout` for the inference rank's /ready to answer 200 (weights loaded, data plane connected).
  bool inf_ready(std::chrono::milliseconds timeout = 20s) const {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      try {
        if (inf_get("/ready").status == 200) return true;
      } catch (const std::exception&) {  // not listening yet
      }
    }
    return false;
  }
  /// The inference rank's metric `name` (a series without labels); -1 when it is not served.
  double inf_metric(const std::string& name) const {
    const std::string text = inf_get("/metrics").body;
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

std::unique_ptr<coord::CoordinatorClient> client(int port) { return test::cluster_client(port); }

const std::vector<std::string> kFullBudget = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget",
                                              "512", "--layers-per-pack", "2", "--local-window", "16"};

TEST(Cluster, SparseDecodingOverUcxReproducesDenseGreedyExactly) {
  Cluster cl;
  cl.start(kFullBudget);
  auto c = client(cl.port);
  const Outcome o = generate(*c, "", 200);
  EXPECT_EQ(o.reason, proto::FINISH_LENGTH) << o.error << cl.logs();
  EXPECT_EQ(o.text, test::read_file(test::data_path("models/stories260K/expected_greedy_200tok.txt")));
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
  EXPECT_EQ(cl.cache->wait_exit(10s), 0) << cl.logs();
  EXPECT_EQ(cl.coord->wait_exit(10s), 0) << cl.logs();
  EXPECT_THAT(cl.inf->log(), HasSubstr("sparse sequence-steps")) << "the inference rank logs its sparse summary";
}

// The cache rank fails mid-decode (`sig`: SIGKILL, or SIGSTOP — a black hole: its process and sockets stay, it
// answers nothing, only the coordinator's heartbeat deadline finds it) while a sparse and a dense (force_dense)
// stream are in flight. The coordinator's PeerDown aborts the pair's link at once, also while the inference rank
// waits on it inside a step: the sparse stream ends with an error naming the cache rank within the heartbeat
// deadline (1 s here) + 1 s — not the selection deadline (10 s, the default) —, the dense stream gets every token,
// a new request decodes densely, and the rank says it is degraded (/ready, spade_pair_degraded) while /health is 200.
void cache_rank_fault_keeps_dense_streams(int sig) {
  Cluster cl;
  cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16", "--layers-per-pack", "2"});
  auto c = client(cl.port);
  ASSERT_TRUE(cl.inf_ready()) << cl.logs();
  EXPECT_EQ(cl.inf_metric("spade_pair_degraded"), 0) << cl.logs();
  Clock::time_point faulted{};
  const auto streams = test::stream(
      *c, {test::greedy_request("Once upon a time", 400, true), test::greedy_request("", 480, true, true)},
      [&](size_t i, const test::StreamOutcome& s) {
        if (faulted == Clock::time_point{} && i == 0 && s.outcome.ids.size() >= 60) {  // sparse for a while now
          cl.cache->signal(sig);
          faulted = Clock::now();
        }
      });
  ASSERT_NE(faulted, Clock::time_point{}) << streams[0].outcome.error << cl.logs();
  const test::Outcome& sparse = streams[0].outcome;
  const test::Outcome& dense = streams[1].outcome;
  EXPECT_EQ(sparse.reason, proto::FINISH_ERROR) << sparse.error << cl.logs();
  EXPECT_THAT(sparse.error, HasSubstr("cache rank 2")) << "the error names the lost rank";
  EXPECT_LT(streams[0].ended - faulted, 2s) << "heartbeat deadline (1 s) + 1 s:\n" << cl.logs();
  EXPECT_LT(sparse.ids.size(), 400u);
  EXPECT_EQ(dense.reason, proto::FINISH_LENGTH) << dense.error << cl.logs();
  EXPECT_EQ(dense.ids.size(), 480u) << "the dense stream keeps decoding past the fault";
  // The inference rank stays up and serves a new request densely.
  const Outcome d = generate(*c, "", 120);
  EXPECT_EQ(d.reason, proto::FINISH_LENGTH) << d.error << cl.logs();
  EXPECT_EQ(d.ids.size(), 120u);
  EXPECT_TRUE(cl.inf->running());
  // It says so: /ready 200 "degraded" naming the cache rank, /health 200, spade_pair_degraded 1.
  const http::HttpResponse ready = cl.inf_get("/ready");
  EXPECT_EQ(ready.status, 200) << ready.body;
  EXPECT_THAT(ready.body, HasSubstr("\"degraded\"")) << ready.body;
  EXPECT_THAT(ready.body, HasSubstr("cache rank 2")) << ready.body;
  const http::HttpResponse health = cl.inf_get("/health");
  EXPECT_EQ(health.status, 200) << health.body;
  EXPECT_THAT(health.body, HasSubstr("cache rank 2")) << health.body;
  EXPECT_EQ(cl.inf_metric("spade_pair_degraded"), 1);
  // The coordinator reports the cache rank dead.
  bool dead = false;
  for (auto until = Clock::now() + 10s; Clock::now() < until && !dead; std::this_thread::sleep_for(100ms)) {
    const proto::StatusReply st = c->query_status(Clock::now() + 5s);
    for (const auto& r : st.ranks())
      if (r.info().rank() == 2 && r.state() == proto::DEAD) dead = true;
  }
  EXPECT_TRUE(dead) << cl.logs();
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
}

TEST(Cluster, KilledCacheRankFailsSparseStreamFastAndDenseStreamsContinue) {
  cache_rank_fault_keeps_dense_streams(SIGKILL);
}

TEST(Cluster, StoppedCacheRankFailsSparseStreamAtTheHeartbeatDeadlineAndDenseStreamsContinue) {
  cache_rank_fault_keeps_dense_streams(SIGSTOP);
}

// The cache rank is lost while nothing is in flight on the link (killed, or stopped until the heartbeat deadline):
// the rank reports itself degraded, and a new request past the sparse threshold decodes densely to its end (it
// must not try to switch to sparse over the dead link and fail).
TEST(Cluster, CacheRankLostBetweenRequestsNewRequestsDecodeDensely) {
  for (int sig : {SIGKILL, SIGSTOP}) {
    SCOPED_TRACE(sig == SIGKILL ? "SIGKILL" : "SIGSTOP");
    Cluster cl;
    cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16", "--layers-per-pack",
              "2"});
    auto c = client(cl.port);
    ASSERT_TRUE(cl.inf_ready()) << cl.logs();
    const Outcome before = generate(*c, "", 80);  // sparse from token 32 on
    ASSERT_EQ(before.reason, proto::FINISH_LENGTH) << before.error << cl.logs();
    std::this_thread::sleep_for(200ms);
    ASSERT_GT(cl.inf_metric("spade_sparse_sequence_steps_total"), 0) << cl.logs();
    cl.cache->signal(sig);
    bool degraded = false;
    for (auto until = Clock::now() + 10s; !degraded && Clock::now() < until; std::this_thread::sleep_for(50ms))
      degraded = cl.inf_get("/ready").body.find("degraded") != std::string::npos;
    ASSERT_TRUE(degraded) << cl.logs();
    const auto t0 = Clock::now();
    const Outcome after = generate(*c, "", 120);
    EXPECT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
    EXPECT_EQ(after.ids.size(), 120u);
    EXPECT_LT(Clock::now() - t0, 5s) << "the dense request waited on the dead link" << cl.logs();
    std::this_thread::sleep_for(200ms);
    EXPECT_GT(cl.inf_metric("spade_dense_fallbacks_total"), 0) << "counted as a dense fallback";
    EXPECT_EQ(cl.inf_metric("spade_pair_degraded"), 1);
    c->request_shutdown("test done");
    EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
  }
}

// A GenerateRequest sent over the control port (not through the HTTP API's checks) with a field out of range is
// answered by one error chunk naming the field, and the engine never runs it: no token is generated or prefilled.
TEST(Cluster, ControlPortRequestWithABadFieldIsRejectedAndNeverRuns) {
  Cluster cl;
  cl.start(kFullBudget);  // --token-budget 512
  auto c = client(cl.port);
  ASSERT_TRUE(cl.inf_ready()) << cl.logs();
  ASSERT_EQ(generate(*c, "", 8).reason, proto::FINISH_LENGTH) << cl.logs();
  std::this_thread::sleep_for(200ms);  // the rank's metrics follow its loop
  const double prompt_tokens = cl.inf_metric("spade_prompt_tokens_total");
  const double generated = cl.inf_metric("spade_generation_tokens_total");
  ASSERT_GT(generated, 0) << cl.logs();
  using Edit = std::function<void(proto::GenerateRequest&)>;
  const std::vector<std::pair<std::string, Edit>> cases = {
      {"spade.sparse_threshold", [](auto& r) { r.mutable_sparse()->set_sparse_threshold(3000000000u); }},
      {"spade.token_budget", [](auto& r) { r.mutable_sparse()->set_token_budget(4000000000u); }},
      {"spade.token_budget", [](auto& r) { r.mutable_sparse()->set_token_budget(513); }},
      {"sparse.local_window", [](auto& r) { r.mutable_sparse()->set_local_window(8); }},
      {"maximum context length", [](auto& r) { r.set_max_tokens(4294967295u); }},
      {"stop token id 100000", [](auto& r) { r.mutable_sampling()->add_stop_token_ids(100000); }},
      {"top_k", [](auto& r) { r.mutable_sampling()->set_top_k(3000000000u); }},
      {"top_p", [](auto& r) { r.mutable_sampling()->set_top_p(-0.5f); }},
      {"prompt token id 4000000000", [](auto& r) {
         r.mutable_prompt_ids()->add_ids(1);
         r.mutable_prompt_ids()->add_ids(4000000000u);
       }},
  };
  for (const auto& [field, edit] : cases) {
    proto::GenerateRequest r = test::greedy_request("Once upon a time", 40, true);
    edit(r);
    const uint64_t id = c->submit(r);
    std::vector<proto::GenerateChunk> chunks;
    for (auto until = Clock::now() + 10s; Clock::now() < until;) {
      auto ch = c->next_chunk(until);
      if (!ch) break;
      if (ch->request_id() == id) chunks.push_back(*ch);
      if (!chunks.empty() && chunks.back().finished()) break;
    }
    for (auto until = Clock::now() + 300ms; auto ch = c->next_chunk(until);)  // nothing follows the rejection
      if (ch->request_id() == id) chunks.push_back(*ch);
    ASSERT_EQ(chunks.size(), 1u) << field << cl.logs();
    EXPECT_TRUE(chunks[0].finished());
    EXPECT_EQ(chunks[0].finish_reason(), proto::FINISH_ERROR) << field;
    EXPECT_EQ(chunks[0].token_ids_size(), 0) << field;
    EXPECT_THAT(chunks[0].error(), HasSubstr("invalid request")) << field;
    EXPECT_THAT(chunks[0].error(), HasSubstr(field)) << chunks[0].error();
  }
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(cl.inf_metric("spade_prompt_tokens_total"), prompt_tokens) << "a rejected request was prefilled";
  EXPECT_EQ(cl.inf_metric("spade_generation_tokens_total"), generated) << "a rejected request generated tokens";
  EXPECT_EQ(cl.inf_metric("spade_num_requests_running"), 0);
  EXPECT_EQ(cl.inf_metric("spade_num_requests_waiting"), 0);
  const Outcome ok = generate(*c, "", 40);  // the rank still serves
  EXPECT_EQ(ok.reason, proto::FINISH_LENGTH) << ok.error << cl.logs();
  EXPECT_EQ(ok.ids.size(), 40u);
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
}

// A request that reaches an idle rank starts with the next step: the serving loop's idle wait (50 ms) ends when it
// arrives. Solo requests back to back (each arrives just after the rank went idle) on a model whose step takes about
// a millisecond: the median time to first token, measured by the submitting client, stays far below the idle wait.
TEST(Cluster, AnIdleRankStartsALoneRequestWithinAStep) {
  Cluster cl;
  cl.start({"--selection", "dense"});
  auto c = client(cl.port);
  ASSERT_EQ(generate(*c, "", 8).reason, proto::FINISH_LENGTH) << cl.logs();  // warm
  std::vector<double> ttft_ms;
  for (int i = 0; i < 9; ++i) {
    const auto t0 = Clock::now();
    const uint64_t id = c->submit(test::greedy_request("", 4, true));
    bool first = true, done = false;
    for (auto until = Clock::now() + 10s; !done && Clock::now() < until;) {
      auto ch = c->next_chunk(until);
      if (!ch) break;
      if (ch->request_id() != id) continue;
      if (first && ch->token_ids_size() > 0) {
        ttft_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        first = false;
      }
      done = ch->finished();
    }
    ASSERT_TRUE(done) << cl.logs();
  }
  ASSERT_EQ(ttft_ms.size(), 9u);
  std::sort(ttft_ms.begin(), ttft_ms.end());
  EXPECT_LT(ttft_ms[4], 25.0) << "median TTFT of solo requests (the idle wait is 50 ms); min " << ttft_ms.front()
                              << " ms, max " << ttft_ms.back() << " ms";
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(10s), 0) << cl.logs();
}

// Raw bytes to the coordinator process's port: garbage, a truncated frame, an absurd length prefix.
void send_raw(int port, const std::string& bytes) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  std::this_thread::sleep_for(100ms);
  ::close(fd);
}

TEST(Cluster, GarbageFramesOnTheCoordinatorPortAreRejectedAndServiceContinues) {
  Cluster cl;
  cl.start(kFullBudget);
  auto c = client(cl.port);  // the world is up
  send_raw(cl.port, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  send_raw(cl.port, std::string("\x10\x0a\x05hel", 6));                  // truncated frame
  send_raw(cl.port, std::string("\xff\xff\xff\xff\xff\xff\x01", 7));  // length prefix past any limit
  const Outcome o = generate(*c, "", 40);
  EXPECT_EQ(o.reason, proto::FINISH_LENGTH) << o.error << cl.logs();
  EXPECT_EQ(o.ids.size(), 40u);
  EXPECT_TRUE(cl.coord->running());
  c->request_shutdown("test done");
  EXPECT_EQ(cl.coord->wait_exit(10s), 0) << cl.logs();
  const std::string log = cl.coord->log();
  EXPECT_THAT(log, HasSubstr("127.0.0.1")) << "rejections are logged with the remote endpoint:\n" << log;
}

TEST(Cluster, RankThatNeverRegistersStopsEveryoneWithItsName) {
  Cluster cl;
  cl.start(kFullBudget, /*rendezvous_ms=*/1500, /*with_cache=*/false);
  EXPECT_NE(cl.coord->wait_exit(15s), 0);
  EXPECT_NE(cl.inf->wait_exit(15s), 0);
  EXPECT_THAT(cl.coord->log(), HasSubstr("rank 2 (cache #0) never registered")) << cl.logs();
  EXPECT_THAT(cl.inf->log(), HasSubstr("rank 2 (cache #0) never registered")) << cl.logs();
}

// --max-context-pages sizes a GPU cache rank's pool (page dropping re-admits freed pages up to it); anywhere else it
// would oversubscribe a pool of the local size, so the binary refuses it by name before loading anything.
TEST(InferenceRankCli, MaxContextPagesIsRefusedOffTheGpuCacheRankPath) {
  const std::string model = test::data_path("models/stories260K");
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--selection", "predicted"},
        std::vector<std::string>{"--device", "cuda", "--selection", "dense"}}) {
    std::vector<std::string> args = {"--model", model, "--prompt", "Once", "--max-tokens", "4",
                                     "--max-context-pages", "100"};
    args.insert(args.end(), extra.begin(), extra.end());
    ChildProcess p(bin("inference_rank/inference_rank"), args, {}, "inference rank");
    EXPECT_NE(p.wait_exit(30s), 0) << p.log();
    EXPECT_THAT(p.log(), HasSubstr("--max-context-pages sizes the GPU cache rank's pool")) << p.log();
  }
}

// The GPU cache rank's stream layout is 1 (serial) or 3 (pipelined); anything else is refused by name at parse time.
TEST(CacheRankCli, SelectionStreamsOtherThanOneOrThreeAreRefusedByName) {
  const std::string model = test::data_path("models/stories260K");
  for (const char* n : {"2", "0", "x"}) {
    ChildProcess p(bin("cache_rank/cache_rank"), {"--model", model, "--device", "cuda", "--selection-streams", n}, {},
                   "cache rank");
    EXPECT_NE(p.wait_exit(30s), 0) << p.log();
    EXPECT_THAT(p.log(), HasSubstr("--selection-streams")) << p.log();
  }
}

}  // namespace
}  // namespace spade

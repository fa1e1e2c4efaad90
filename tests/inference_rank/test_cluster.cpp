// Multi-process tests of the disaggregated path: real coordinator, inference rank and cache rank processes talking
// protobuf over TCP (control) and UCX over loopback (data), on the real stories260K model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

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
                                  "--rendezvous-timeout-ms", std::to_string(rendezvous_ms), "--log-level", "info"};
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

TEST(Cluster, KilledCacheRankFailsInFlightRequestAndServiceContinuesDensely) {
  Cluster cl;
  cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16", "--layers-per-pack", "2",
            "--selection-deadline-ms", "3000"});
  auto c = client(cl.port);
  const auto t0 = Clock::now();
  bool killed = false;
  const Outcome o = generate(*c, "Once upon a time", 400, [&](size_t n) {
    if (!killed && n >= 60) {  // well past the threshold: the request is sparse now
      cl.cache->signal(SIGKILL);
      killed = true;
    }
  });
  ASSERT_TRUE(killed) << o.error << cl.logs();
  EXPECT_EQ(o.reason, proto::FINISH_ERROR) << cl.logs();
  EXPECT_THAT(o.error, HasSubstr("cache rank 2")) << "the error names the dead rank";
  EXPECT_LT(Clock::now() - t0, 20s) << "bounded failure time";
  EXPECT_LT(o.ids.size(), 400u);
  // The inference rank stays up and serves a new request densely.
  const Outcome d = generate(*c, "", 120);
  EXPECT_EQ(d.reason, proto::FINISH_LENGTH) << d.error << cl.logs();
  EXPECT_EQ(d.ids.size(), 120u);
  EXPECT_TRUE(cl.inf->running());
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

// The launch forms of deploy/spade_rank.sh: under Open MPI's mpirun (OMPI_COMM_WORLD_*; default and explicit role
// maps; one-prompt and serving modes) and torchrun-style (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT /
// LOCAL_RANK per process), each producing the stories260K reference continuation; and its bad-input errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <regex>

#include <nlohmann/json.hpp>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

std::string script() { return std::string(SPADE_SOURCE_DIR) + "/deploy/spade_rank.sh"; }
std::string model() { return data_path("models/stories260K"); }
std::string reference() { return read_file(data_path("models/stories260K/expected_greedy_200tok.txt")); }

std::vector<std::string> mpirun_args(int np) {
  return {"--oversubscribe", "--allow-run-as-root", "-np", std::to_string(np), "-x", "MASTER_PORT", "-x",
          "SPADE_BUILD_DIR", "-x", "UCX_LOG_LEVEL", "--mca", "btl", "self,tcp"};
}

std::map<std::string, std::string> base_env(int master_port) {
  return {{"MASTER_PORT", std::to_string(master_port)}, {"SPADE_BUILD_DIR", binary_dir()}, {"UCX_LOG_LEVEL", "error"}};
}

/// POSTs a greedy completion from BOS to the coordinator at `http_port` once it is ready. Fails fast, with the
/// launch's output, when a process of the launch exits before the API is ready or the 90 s deadline passes.
std::string greedy_from_bos(int http_port, int max_tokens, const std::vector<ChildProcess*>& launch) {
  ApiCluster probe;  // only for its helpers; starts nothing
  probe.http_port = http_port;
  auto logs = [&] {
    std::string s;
    for (auto* p : launch) s += "---- " + p->name() + " ----\n" + p->log();
    return s;
  };
  bool ready = false;
  for (auto until = std::chrono::steady_clock::now() + 90s; !ready && std::chrono::steady_clock::now() < until;) {
    for (auto* p : launch)
      if (!p->running()) {
        ADD_FAILURE() << p->name() << " exited before the API on port " << http_port << " was ready:\n" << logs();
        return "";
      }
    ready = probe.wait_ready(http_port, 1s);
  }
  if (!ready) {
    ADD_FAILURE() << "the API on port " << http_port << " was not ready within 90 s:\n" << logs();
    return "";
  }
  auto r = probe.post("/v1/completions", json{{"model", "stories260K"},
                                              {"prompt", json::array({1})},
                                              {"max_tokens", max_tokens},
                                              {"temperature", 0}}
                                             .dump());
  EXPECT_EQ(r.status, 200) << r.body << "\n" << logs();
  if (r.status != 200) return "";
  return json::parse(r.body)["choices"][0]["text"];
}

TEST(Launchers, MpirunOnePromptDefaultRoleMap) {
  const int port = free_port();
  std::vector<std::string> a = mpirun_args(3);
  for (std::string s : {script(), std::string("--model"), model(), std::string("--prompt"), std::string(""),
                        std::string("--max-tokens"), std::string("30"), std::string("--temperature"),
                        std::string("0"), std::string("--selection"), std::string("predicted"),
                        std::string("--sparse-threshold"), std::string("16"), std::string("--token-budget"),
                        std::string("512")})
    a.push_back(s);
  ChildProcess mpi("/usr/bin/mpirun", a, base_env(port), "mpirun");
  ASSERT_EQ(mpi.wait_exit(180s), 0) << mpi.log();
  // 30 greedy tokens from BOS: the start of the reference continuation. mpirun merges every rank's stdout and
  // stderr, so a log line (spdlog "[HH:MM:SS.mmm] ...", spade_submit's "[spade] generated_tokens=...") can land in
  // the middle of the streamed text: those lines are cut out before matching.
  static const std::regex kLogLine(R"(\[(spade|\d\d:\d\d:\d\d\.\d\d\d)\][^\n]*\n)");
  EXPECT_THAT(std::regex_replace(mpi.log(), kLogLine, ""), HasSubstr(reference().substr(0, 60))) << mpi.log();
}

// Layer shards under mpirun: --cache-ranks-per-inference 2 makes a world of 4 (coordinator, 1 inference, 2 cache
// ranks) that reproduces the reference continuation at full budget.
TEST(Launchers, MpirunWithTwoCacheRanksPerInferenceRank) {
  const int port = free_port();
  std::vector<std::string> a = mpirun_args(4);
  for (std::string s : {script(), std::string("--model"), model(), std::string("--prompt"), std::string(""),
                        std::string("--max-tokens"), std::string("30"), std::string("--temperature"),
                        std::string("0"), std::string("--cache-ranks-per-inference"), std::string("2"),
                        std::string("--selection"), std::string("predicted"), std::string("--sparse-threshold"),
                        std::string("16"), std::string("--token-budget"), std::string("512"),
                        std::string("--layers-per-pack"), std::string("1")})
    a.push_back(s);
  ChildProcess mpi("/usr/bin/mpirun", a, base_env(port), "mpirun");
  ASSERT_EQ(mpi.wait_exit(180s), 0) << mpi.log();
  static const std::regex kLogLine(R"(\[(spade|\d\d:\d\d:\d\d\.\d\d\d)\][^\n]*\n)");
  EXPECT_THAT(std::regex_replace(mpi.log(), kLogLine, ""), HasSubstr(reference().substr(0, 60))) << mpi.log();
}

TEST(Launchers, MpirunServesTheApiWithAnExplicitRoleMap) {
  // Ranks r = 0..2 serve /metrics on metrics + r: three consecutive ports, distinct from the other two.
  const int port = free_port(), http = free_port(), metrics = free_port_run(3);
  std::vector<std::string> a = mpirun_args(3);
  // Rank 1 is the cache rank, rank 2 the inference rank.
  for (std::string s : {script(), std::string("--model"), model(), std::string("--role-map"), std::string("c,k,i"),
                        std::string("--http-port"), std::to_string(http), std::string("--metrics-port-base"),
                        std::to_string(metrics), std::string("--selection"), std::string("predicted"),
                        std::string("--sparse-threshold"), std::string("16"), std::string("--token-budget"),
                        std::string("512")})
    a.push_back(s);
  ChildProcess mpi("/usr/bin/mpirun", a, base_env(port), "mpirun");
  const std::string text = greedy_from_bos(http, 40, {&mpi});
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(text, reference().substr(0, text.size()));
  EXPECT_GT(text.size(), 100u);
  ApiCluster probe;
  const auto inf = probe.metrics(metrics + 2);  // rank 2 = inference
  EXPECT_EQ(inf.at("spade_generation_tokens_total"), 40);
  EXPECT_GT(inf.at("spade_sparse_switches_total"), 0);
  const auto cache = probe.metrics(metrics + 1);  // rank 1 = cache
  EXPECT_GT(cache.at("spade_cache_pack_updates_total"), 0);
  mpi.signal(SIGTERM);
  EXPECT_NE(mpi.wait_exit(60s), -1) << "mpirun did not end after SIGTERM:\n" << mpi.log();
  if (HasFailure()) std::cerr << mpi.log();
}

TEST(Launchers, TorchrunStyleEnvironment) {
  const int port = free_port(), http = free_port();
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int r = 0; r < 3; ++r) {
    auto env = base_env(port);
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = "3";
    env["MASTER_ADDR"] = "127.0.0.1";
    ranks.push_back(std::make_unique<ChildProcess>(
        script(),
        std::vector<std::string>{"--model", model(), "--http-port", std::to_string(http), "--selection", "predicted",
                                 "--sparse-threshold", "16", "--token-budget", "512"},
        env, "rank " + std::to_string(r)));
  }
  std::vector<ChildProcess*> launch;
  for (auto& r : ranks) launch.push_back(r.get());
  const std::string text = greedy_from_bos(http, 40, launch);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(text, reference().substr(0, text.size()));
  EXPECT_GT(text.size(), 100u);
  // One host and no secret given: rank 0 drew one for this launch into a private file, which every rank read.
  std::smatch m;
  const std::string coord_log = ranks[0]->log();
  static const std::regex kSecretLine(
      R"(authenticate with the cluster secret from env SPADE_CLUSTER_SECRET_FILE (\S+))");
  ASSERT_TRUE(std::regex_search(coord_log, m, kSecretLine)) << coord_log;
  struct stat st {};
  ASSERT_EQ(::stat(m[1].str().c_str(), &st), 0) << m[1];
  EXPECT_EQ(st.st_mode & 0777, 0600u) << m[1];
  ranks[0]->signal(SIGTERM);  // the coordinator shuts the world down; the ranks follow with exit code 0
  for (auto& r : ranks) {
    EXPECT_EQ(r->wait_exit(60s), 0) << r->name() << ":\n" << r->log();
  }
}

TEST(Launchers, BadLaunchesFailWithClearErrors) {
  auto run = [&](std::map<std::string, std::string> env, std::vector<std::string> args) {
    ChildProcess p(script(), args, env, "spade_rank");
    const int rc = p.wait_exit(30s);
    return std::make_pair(rc, p.log());
  };
  auto env = base_env(free_port());
  auto [rc1, log1] = run(env, {"--model", model()});
  EXPECT_EQ(rc1, 2);
  EXPECT_THAT(log1, HasSubstr("no rank/world size"));
  env["RANK"] = "0";
  env["WORLD_SIZE"] = "4";
  auto [rc2, log2] = run(env, {"--model", model()});
  EXPECT_EQ(rc2, 2);
  EXPECT_THAT(log2, HasSubstr("world size 4 must be 1 + 2N"));
  auto [rc_k, log_k] = run(env, {"--model", model(), "--cache-ranks-per-inference", "3"});
  EXPECT_EQ(rc_k, 2);
  EXPECT_THAT(log_k, HasSubstr("world size 4 must be 1 + N x (1 + 3)"));
  auto [rc3, log3] = run(env, {"--model", model(), "--role-map", "c,i,k"});
  EXPECT_EQ(rc3, 2);
  EXPECT_THAT(log3, HasSubstr("--role-map has 3 entries for world size 4"));
  env["WORLD_SIZE"] = "3";
  env["RANK"] = "1";
  auto [rc4, log4] = run(env, {"--model", model(), "--role-map", "c,x,k"});
  EXPECT_EQ(rc4, 2);
  EXPECT_THAT(log4, HasSubstr("rank 1 has unknown role 'x'"));
  auto [rc5, log5] = run(env, {"--bogus"});
  EXPECT_EQ(rc5, 2);
  EXPECT_THAT(log5, HasSubstr("unknown flag --bogus"));
  // Across hosts the ranks need a secret they share; none is made up.
  env["MASTER_ADDR"] = "10.0.0.1";
  auto [rc6, log6] = run(env, {"--model", model()});
  EXPECT_EQ(rc6, 2);
  EXPECT_THAT(log6, HasSubstr("MASTER_ADDR=10.0.0.1: a world across hosts needs a cluster secret"));
}

}  // namespace
}  // namespace spade::test

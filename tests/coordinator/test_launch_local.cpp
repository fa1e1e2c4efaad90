// deploy/launch_local.sh in serving mode when a process of its cluster dies: a cache rank's death is logged and the
// cluster keeps serving (its inference rank decodes densely: a dense stream in flight ends with every token and
// [DONE], a new request is answered in full); by default the cache rank is restarted with the same index and rejoins
// (the coordinator's /ready is whole again); an inference rank's death still tears the whole cluster down.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>

#include <dirent.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

std::string launcher() { return std::string(SPADE_SOURCE_DIR) + "/deploy/launch_local.sh"; }

/// The children of `parent` whose command line contains `what` (/proc).
std::vector<pid_t> children(pid_t parent, const std::string& what) {
  std::vector<pid_t> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const size_t close = line.rfind(')');  // "pid (comm) state ppid ..."
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    std::ifstream cmd("/proc/" + std::to_string(pid) + "/cmdline");
    std::string argv((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    if (argv.find(what) != std::string::npos) out.push_back(pid);
  }
  ::closedir(d);
  return out;
}

/// True while `pid` exists and is not a zombie.
bool alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

// The launcher and its cluster; on destruction the launcher is stopped (SIGTERM: its EXIT trap stops every process)
// and any rank it left is killed.
struct Launch {
  ChildProcess proc;
  std::vector<pid_t> ranks;
  Launch(const std::vector<std::string>& args, const std::map<std::string, std::string>& env)
      : proc(launcher(), args, env, "launch_local") {}
  ~Launch() {
    proc.signal(SIGTERM);
    proc.wait_exit(10s);
    for (pid_t p : ranks)
      if (alive(p)) ::kill(p, SIGKILL);
  }
};

TEST(LaunchLocal, ServesDenselyWhenTheCacheRankDiesAndTearsDownWhenTheInferenceRankDies) {
  const int http = free_port();
  const std::string logs = make_temp_dir("spade-launch-local");
  Launch l({"--model", data_path("models/stories260K"), "--http-port", std::to_string(http), "--no-metrics",
            "--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16",
            "--restart-cache-rank", "0"},
           {{"SPADE_BUILD_DIR", binary_dir()}, {"SPADE_LOG_DIR", logs}, {"UCX_LOG_LEVEL", "error"}});
  ApiCluster api;  // for its helpers; starts nothing
  api.http_port = http;
  ASSERT_TRUE(api.wait_ready(http, 90s)) << l.proc.log();
  const std::vector<pid_t> cache = children(l.proc.pid(), "cache_rank/cache_rank");
  const std::vector<pid_t> inf = children(l.proc.pid(), "inference_rank/inference_rank");
  const std::vector<pid_t> coord = children(l.proc.pid(), "coordinator/coordinator");
  ASSERT_EQ(cache.size(), 1u) << l.proc.log();
  ASSERT_EQ(inf.size(), 1u) << l.proc.log();
  ASSERT_EQ(coord.size(), 1u) << l.proc.log();
  l.ranks = {coord[0], inf[0], cache[0]};

  // A dense stream in flight when the cache rank dies ends normally, every token and [DONE].
  RawClient stream(http);
  stream.post("/v1/completions", json{{"model", "stories260K"},
                                      {"prompt", json::array({1})},
                                      {"max_tokens", 400},
                                      {"ignore_eos", true},
                                      {"temperature", 0},
                                      {"stream", true},
                                      {"stream_options", {{"include_usage", true}}},
                                      {"spade", {{"selection", "dense"}}}}
                                     .dump());
  EXPECT_THAT(stream.read_until("data: ", 2), HasSubstr("data: "));
  ASSERT_EQ(::kill(cache[0], SIGKILL), 0);
  const std::string body = stream.read_until("data: [DONE]", 1, 60s);
  EXPECT_THAT(body, HasSubstr("data: [DONE]")) << body.substr(0, 2000) << l.proc.log();
  EXPECT_THAT(body, HasSubstr("\"completion_tokens\":400")) << body.substr(body.size() > 2000 ? body.size() - 2000 : 0);
  EXPECT_THAT(body, ::testing::Not(HasSubstr("\"error\""))) << body.substr(0, 2000);

  // The launcher says so and keeps the cluster up (its watchdog looks every 0.5 s).
  bool logged = false;
  for (auto until = std::chrono::steady_clock::now() + 10s; !logged && std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(100ms))
    logged = l.proc.log().find("cache rank #0 (pid " + std::to_string(cache[0]) + ") exited") != std::string::npos;
  EXPECT_TRUE(logged) << l.proc.log();
  EXPECT_THAT(l.proc.log(), HasSubstr("keeps serving, densely"));
  std::this_thread::sleep_for(1500ms);
  ASSERT_TRUE(l.proc.running()) << l.proc.log();
  EXPECT_TRUE(alive(coord[0]));
  EXPECT_TRUE(alive(inf[0]));

  // A new request past the sparse threshold is served in full (densely).
  const http::HttpResponse r = api.post("/v1/completions", json{{"model", "stories260K"},
                                                                {"prompt", json::array({1})},
                                                                {"max_tokens", 64},
                                                                {"ignore_eos", true},
                                                                {"temperature", 0}}
                                                               .dump());
  ASSERT_EQ(r.status, 200) << r.body << l.proc.log();
  EXPECT_EQ(json::parse(r.body)["usage"]["completion_tokens"], 64) << r.body;
  EXPECT_EQ(api.get("/ready").status, 200);

  // An inference rank's death still takes the cluster down.
  ASSERT_EQ(::kill(inf[0], SIGKILL), 0);
  EXPECT_NE(l.proc.wait_exit(15s), -1) << "the launcher did not tear down after its inference rank died:\n"
                                        << l.proc.log();
  EXPECT_THAT(l.proc.log(), HasSubstr("tearing down"));
  bool coordinator_gone = false;
  for (auto until = std::chrono::steady_clock::now() + 10s;
       !coordinator_gone && std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(100ms))
    coordinator_gone = !alive(coord[0]);
  EXPECT_TRUE(coordinator_gone) << "the coordinator outlived the teardown";
}

// Layer shards: one inference rank with two cache ranks (--num-cache 2). One prompt through the whole cluster gives
// the dense greedy continuation at full budget; each cache rank served its shard; a --num-cache that is not a
// multiple of --num-inference is refused before anything starts.
TEST(LaunchLocal, OneInferenceRankWithTwoCacheRanksServesAPrompt) {
  const std::string logs = make_temp_dir("spade-launch-local");
  ChildProcess p(launcher(),
                 {"--model", data_path("models/stories260K"), "--prompt", "", "--max-tokens", "40", "--temperature",
                  "0", "--num-inference", "1", "--num-cache", "2", "--selection", "predicted", "--sparse-threshold",
                  "16", "--token-budget", "512", "--layers-per-pack", "1"},
                 {{"SPADE_BUILD_DIR", binary_dir()}, {"SPADE_LOG_DIR", logs}, {"UCX_LOG_LEVEL", "error"}},
                 "launch_local");
  ASSERT_EQ(p.wait_exit(180s), 0) << p.log();
  const std::string reference = read_file(data_path("models/stories260K/expected_greedy_200tok.txt"));
  EXPECT_THAT(p.log(), HasSubstr(reference.substr(0, 60))) << p.log();
  for (int s = 0; s < 2; ++s) {
    const std::string cache_log = read_file(logs + "/cache_" + std::to_string(s) + ".log");
    EXPECT_THAT(cache_log, HasSubstr("shard " + std::to_string(s) + " of 2")) << cache_log;
  }
  ChildProcess bad(launcher(),
                   {"--model", data_path("models/stories260K"), "--prompt", "", "--num-inference", "2", "--num-cache",
                    "3"},
                   {{"SPADE_BUILD_DIR", binary_dir()}}, "launch_local");
  EXPECT_EQ(bad.wait_exit(30s), 2) << bad.log();
  EXPECT_THAT(bad.log(), HasSubstr("--num-cache (3) must be a multiple N >= 1 of --num-inference (2)"));
}

/// The pid in the launcher's "restarted it as pid N" line (0 when there is none yet).
pid_t restarted_pid(const std::string& log) {
  const std::string key = "restarted it as pid ";
  const size_t at = log.find(key);
  return at == std::string::npos ? 0 : static_cast<pid_t>(std::atoi(log.c_str() + at + key.size()));
}

TEST(LaunchLocal, RestartsADeadCacheRankWhichRejoinsAndTheWorldIsWholeAgain) {
  const int http = free_port();
  const std::string logs = make_temp_dir("spade-launch-local");
  Launch l({"--model", data_path("models/stories260K"), "--http-port", std::to_string(http), "--no-metrics",
            "--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16"},
           {{"SPADE_BUILD_DIR", binary_dir()}, {"SPADE_LOG_DIR", logs}, {"UCX_LOG_LEVEL", "error"}});
  ApiCluster api;  // for its helpers; starts nothing
  api.http_port = http;
  ASSERT_TRUE(api.wait_ready(http, 90s)) << l.proc.log();
  const std::vector<pid_t> cache = children(l.proc.pid(), "cache_rank/cache_rank");
  const std::vector<pid_t> inf = children(l.proc.pid(), "inference_rank/inference_rank");
  const std::vector<pid_t> coord = children(l.proc.pid(), "coordinator/coordinator");
  ASSERT_EQ(cache.size(), 1u) << l.proc.log();
  ASSERT_EQ(inf.size(), 1u) << l.proc.log();
  ASSERT_EQ(coord.size(), 1u) << l.proc.log();
  l.ranks = {coord[0], inf[0], cache[0]};
  ASSERT_EQ(::kill(cache[0], SIGKILL), 0);

  // The watchdog restarts it (default policy when serving) and says so.
  pid_t again = 0;
  for (auto until = std::chrono::steady_clock::now() + 10s; again == 0 && std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(100ms))
    again = restarted_pid(l.proc.log());
  ASSERT_NE(again, 0) << l.proc.log();
  l.ranks.push_back(again);
  EXPECT_THAT(l.proc.log(), HasSubstr("restart 1 of 3"));
  // The replacement rejoins: the coordinator's /ready is whole again (no "degraded").
  bool whole = false;
  std::string ready;
  for (auto until = std::chrono::steady_clock::now() + 30s; !whole && std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(100ms)) {
    const http::HttpResponse r = api.get("/ready");
    ready = r.body;
    whole = r.status == 200 && ready.find("degraded") == std::string::npos;
  }
  EXPECT_TRUE(whole) << ready << "\n" << l.proc.log();
  std::ifstream cache_log(logs + "/cache_0.log");
  const std::string clog((std::istreambuf_iterator<char>(cache_log)), std::istreambuf_iterator<char>());
  EXPECT_THAT(clog, HasSubstr("serving inference rank 1 (#0)"));
  const http::HttpResponse r = api.post("/v1/completions", json{{"model", "stories260K"},
                                                                {"prompt", json::array({1})},
                                                                {"max_tokens", 64},
                                                                {"ignore_eos", true},
                                                                {"temperature", 0}}
                                                               .dump());
  ASSERT_EQ(r.status, 200) << r.body << l.proc.log();
  EXPECT_EQ(json::parse(r.body)["usage"]["completion_tokens"], 64) << r.body;
  // The launcher's teardown stops the restarted rank too.
  l.proc.signal(SIGTERM);
  EXPECT_NE(l.proc.wait_exit(15s), -1) << l.proc.log();
  bool gone = false;
  for (auto until = std::chrono::steady_clock::now() + 5s; !gone && std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(100ms))
    gone = !alive(again);
  EXPECT_TRUE(gone) << "the restarted cache rank outlived the launcher";
}

}  // namespace
}  // namespace spade::test

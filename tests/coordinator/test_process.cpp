// The real `coordinator` executable, run as a child process (fork/exec) with deadlines on everything.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "common/error.h"
#include "coordinator/client.h"
#include "tests/test_util.h"

namespace spade::coord {
namespace {

using namespace std::chrono_literals;

Deadline in(std::chrono::milliseconds d) {
  return Clock::now() + d;
}

// A child process running the coordinator; killed on destruction if still running.
class CoordinatorProcess {
 public:
  explicit CoordinatorProcess(std::vector<std::string> args) {
    dir_ = spade::test::make_temp_dir("spade_coord_");
    port_file_ = dir_ + "/port";
    log_file_ = dir_ + "/stderr.log";
    std::string exe = spade::test::binary_dir() + "/coordinator/coordinator";
    if (!std::filesystem::exists(exe)) throw std::runtime_error("coordinator binary not built: " + exe);
    args.insert(args.begin(), exe);
    args.push_back("--port-file");
    args.push_back(port_file_);
    args.push_back("--http-port");  // no HTTP API here (tests run in parallel; 8000 would clash)
    args.push_back("0");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      int fd = ::open(log_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 2);
        ::dup2(fd, 1);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
  }

  ~CoordinatorProcess() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Waits for the port file the coordinator writes once listening.
  uint16_t wait_port(std::chrono::milliseconds timeout) {
    auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      std::ifstream f(port_file_);
      int p = 0;
      if (f >> p && p > 0) return static_cast<uint16_t>(p);
      if (poll_exit()) throw std::runtime_error("coordinator exited early: " + log());
      std::this_thread::sleep_for(20ms);
    }
    throw std::runtime_error("coordinator did not write its port file: " + log());
  }

  // Exit code once exited (or -1 on timeout). Signals map to 128 + signo.
  int wait_exit(std::chrono::milliseconds timeout) {
    auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      if (poll_exit()) return code_;
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }

  void signal(int sig) { ::kill(pid_, sig); }

  std::string log() const {
    std::ifstream f(log_file_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  bool poll_exit() {
    if (exited_) return true;
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    return exited_;
  }

  std::string dir_, port_file_, log_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int code_ = -1;
};

ClientOptions rank_opts(uint16_t port, proto::Role role) {
  ClientOptions o;
  o.coordinator_port = port;
  o.role = role;
  o.rank = role == proto::INFERENCE ? 1 : 2;
  o.role_index = 0;
  o.world_size = 3;
  o.transport_kind = proto::TRANSPORT_UCX;
  o.transport_address = role == proto::INFERENCE ? "inference-address" : "cache-address";
  return o;
}

TEST(CoordinatorProcess, MissingRankFailsRendezvousAndExitsNonZero) {
  CoordinatorProcess p({"--host", "127.0.0.1", "--port", "0", "--num-inference", "1", "--num-cache", "1",
                        "--rendezvous-timeout-ms", "700"});
  uint16_t port = p.wait_port(10000ms);
  CoordinatorClient inf(rank_opts(port, proto::INFERENCE));
  try {
    inf.rendezvous(in(5000ms));
    FAIL() << "rendezvous completed without the cache rank";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 (cache #0) never registered within 700 ms"),
              std::string::npos)
        << e.what();
  }
  int code = p.wait_exit(5000ms);
  EXPECT_EQ(code, 1) << p.log();
  EXPECT_NE(
      p.log().find("coordinator: error: rendezvous failed: rank 2 (cache #0) never registered within 700 ms"),
      std::string::npos)
      << p.log();
}

TEST(CoordinatorProcess, SigtermBroadcastsShutdownAndExitsZero) {
  CoordinatorProcess p({"--host", "127.0.0.1", "--port", "0", "--num-inference", "1", "--num-cache", "1",
                        "--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "1000"});
  uint16_t port = p.wait_port(10000ms);
  CoordinatorClient inf(rank_opts(port, proto::INFERENCE));
  CoordinatorClient cache(rank_opts(port, proto::CACHE));
  auto f = std::async(std::launch::async, [&] { return cache.rendezvous(in(5000ms)); });
  auto view = inf.rendezvous(in(5000ms));
  EXPECT_EQ(view.peers(0).transport().address(), "cache-address");
  EXPECT_EQ(f.get().peers(0).transport().address(), "inference-address");
  p.signal(SIGTERM);
  for (auto* c : {&inf, &cache}) {
    auto ev = c->next_event(in(5000ms));
    ASSERT_TRUE(ev.has_value());
    ASSERT_EQ(ev->kind, ClientEvent::Kind::kShutdown) << ev->message;
    EXPECT_NE(ev->shutdown.reason().find("SIGTERM"), std::string::npos) << ev->shutdown.reason();
  }
  EXPECT_EQ(p.wait_exit(5000ms), 0) << p.log();
}

TEST(CoordinatorProcess, ShutdownRequestFromClientExitsZero) {
  CoordinatorProcess p({"--host", "127.0.0.1", "--port", "0", "--num-inference", "1", "--num-cache", "1"});
  uint16_t port = p.wait_port(10000ms);
  ClientOptions o;
  o.coordinator_port = port;
  o.role = proto::CLIENT;
  CoordinatorClient admin(o);
  admin.rendezvous(in(5000ms));
  admin.request_shutdown("operator stop");
  auto ev = admin.next_event(in(5000ms));
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ClientEvent::Kind::kShutdown);
  EXPECT_EQ(p.wait_exit(5000ms), 0) << p.log();
}

TEST(CoordinatorProcess, BadConfigurationExitsWithClearError) {
  CoordinatorProcess p({"--host", "127.0.0.1", "--port", "0", "--num-inference", "2", "--num-cache", "1"});
  EXPECT_EQ(p.wait_exit(5000ms), 2);
  EXPECT_NE(p.log().find("cannot pair 2 inference rank(s) with 1 cache rank(s)"), std::string::npos)
      << p.log();
}

}  // namespace
}  // namespace spade::coord

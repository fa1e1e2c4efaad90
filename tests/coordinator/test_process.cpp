// The real `coordinator` executable, run as a child process (fork/exec) with deadlines on everything.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "common/error.h"
#include "common/proto/framing.h"
#include "coordinator/asio.h"
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

  // Resident set size of the coordinator in bytes (VmRSS), or 0 when it cannot be read.
  size_t rss_bytes() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    return 0;
  }

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

// ---- security: secret, bind address, what strangers can hold
// --------------------------------------------------

namespace asio = boost::asio;
using asio::ip::tcp;

std::string varint(uint64_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s.push_back(static_cast<char>((v & 0x7F) | 0x80));
  s.push_back(static_cast<char>(v));
  return s;
}

// A stranger's connection: writes `bytes` (up to `deadline`), then waits until the server closes it or
// `deadline`. True when the server closed it.
bool stranger(uint16_t port, const std::string& bytes, std::chrono::milliseconds deadline) {
  asio::io_context io;
  tcp::socket s(io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  bool closed = false;
  asio::async_write(s, asio::buffer(bytes), [&](const boost::system::error_code& ec, size_t) {
    if (ec) {
      closed = true;
      return;
    }
    auto buf = std::make_shared<std::array<char, 256>>();
    s.async_read_some(asio::buffer(*buf),
                      [&, buf](const boost::system::error_code& e, size_t) { closed = bool(e); });
  });
  io.run_for(deadline);
  return closed;
}

std::string write_secret(const std::string& dir, const std::string& value) {
  const std::string path = dir + "/cluster.secret";
  std::ofstream(path) << value << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

TEST(CoordinatorProcess, NonLoopbackControlPortNeedsASecret) {
  CoordinatorProcess p({"--host", "0.0.0.0", "--port", "0", "--num-inference", "1", "--num-cache", "1"});
  EXPECT_EQ(p.wait_exit(5000ms), 2);
  EXPECT_NE(p.log().find("refusing to listen on 0.0.0.0:0 without a cluster secret"), std::string::npos)
      << p.log();
}

// The attack on the real binary: one unregistered Shutdown frame used to stop the world. With a
// secret it is dropped; the ranks and an operator holding the secret work as before.
TEST(CoordinatorProcess, SecretKeepsStrangersOutAndLetsTheWorldIn) {
  const std::string dir = spade::test::make_temp_dir("spade_secret_");
  const std::string secret = "process-test-cluster-secret-0123456789";
  CoordinatorProcess p({"--host", "0.0.0.0", "--port", "0", "--num-inference", "1", "--num-cache", "1",
                        "--cluster-secret-file", write_secret(dir, secret), "--heartbeat-interval-ms", "100",
                        "--heartbeat-timeout-ms", "1000"});
  uint16_t port = p.wait_port(10000ms);
  proto::Envelope bye;
  bye.mutable_shutdown()->set_reason("stranger says stop");
  EXPECT_TRUE(stranger(port, proto::encode_frame(bye), 3000ms));
  EXPECT_EQ(p.wait_exit(500ms), -1) << "an unauthenticated Shutdown stopped the coordinator:\n" << p.log();
  EXPECT_NE(p.log().find("dropping shutdown frame from unauthenticated connection 127.0.0.1:"),
            std::string::npos)
      << p.log();
  EXPECT_NE(p.log().find(
                "control connections authenticate with the cluster secret from flag --cluster-secret-file"),
            std::string::npos)
      << p.log();
  EXPECT_EQ(p.log().find(secret), std::string::npos) << "the secret was logged";

  ClientOptions io = rank_opts(port, proto::INFERENCE), co = rank_opts(port, proto::CACHE);
  io.cluster_secret = co.cluster_secret = secret;
  CoordinatorClient inf(io), cache(co);
  auto f = std::async(std::launch::async, [&] { return cache.rendezvous(in(5000ms)); });
  EXPECT_EQ(inf.rendezvous(in(5000ms)).peers(0).transport().address(), "cache-address");
  f.get();
  ClientOptions wrong;
  wrong.coordinator_port = port;
  wrong.role = proto::CLIENT;
  wrong.cluster_secret = "not-the-cluster-secret-at-all";
  CoordinatorClient intruder(wrong);
  EXPECT_THROW(intruder.connect(in(3000ms)), spade::Error);
  ClientOptions admin_opts = wrong;
  admin_opts.cluster_secret = secret;
  CoordinatorClient admin(admin_opts);
  admin.rendezvous(in(5000ms));
  admin.request_shutdown("operator stop");
  EXPECT_EQ(p.wait_exit(5000ms), 0) << p.log();
  std::filesystem::remove_all(dir);
}

// 4 connections x a 48 MiB frame used to hold +223 MB until they closed. Before authentication the length
// prefix alone now closes such a connection, and frames within the small limit left unfinished are dropped at
// the authentication deadline.
TEST(CoordinatorProcess, StrangersCannotMakeItBufferLargeFrames) {
  const std::string dir = spade::test::make_temp_dir("spade_secret_");
  CoordinatorProcess p({"--host", "127.0.0.1", "--port", "0", "--num-inference", "1", "--num-cache", "1",
                        "--cluster-secret-file", write_secret(dir, "rss-test-cluster-secret-0123456789"),
                        "--auth-timeout-ms", "1000"});
  uint16_t port = p.wait_port(10000ms);
  std::this_thread::sleep_for(200ms);
  const size_t before = p.rss_bytes();
  ASSERT_GT(before, 0u);
  const std::string big = varint(uint64_t{48} << 20) + std::string(size_t{48} << 20, 'x');
  std::vector<std::future<bool>> big_ones, half_ones;
  const auto t0 = Clock::now();
  for (int i = 0; i < 4; ++i)
    big_ones.push_back(std::async(std::launch::async, [&] { return stranger(port, big, 10000ms); }));
  for (auto& b : big_ones) EXPECT_TRUE(b.get()) << "a 48 MiB frame from a stranger was not refused";
  EXPECT_LT(Clock::now() - t0, 1000ms) << "refused only at the deadline, not from the length prefix";
  const std::string half = varint(60000) + std::string(30000, 'y');  // within the limit, never finished
  for (int i = 0; i < 4; ++i)
    half_ones.push_back(std::async(std::launch::async, [&] { return stranger(port, half, 5000ms); }));
  std::this_thread::sleep_for(300ms);
  const size_t during = p.rss_bytes();
  for (auto& h : half_ones) EXPECT_TRUE(h.get()) << "a half-sent frame outlived the authentication deadline";
  EXPECT_LT(Clock::now() - t0, 4000ms);
  EXPECT_LT(during, before + (size_t{16} << 20)) << "RSS " << before << " -> " << during << " bytes";
  EXPECT_NE(
      p.log().find("frame length prefix 50331648 bytes exceeds the maximum frame size of 65536 bytes (before "
                   "authentication"),
      std::string::npos)
      << p.log();
  EXPECT_NE(p.log().find("not authenticated within 1000 ms (--auth-timeout-ms); dropping 30003 bytes"),
            std::string::npos)
      << p.log();
  EXPECT_EQ(p.wait_exit(10ms), -1) << p.log();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace spade::coord

// UCX transport: the transport contract (two UCX workers in one process) and cross-process tests with a child
// process (tests/transport/ucx_peer_main.cpp): echo, and a peer killed with SIGKILL.
#include <gtest/gtest.h>

#if SPADE_HAVE_UCX
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "common/error.h"
#include "tests/test_util.h"
#include "tests/transport/contract.h"
#include "transport/ucx.h"

namespace spade::transport::test {
namespace {

// Default: peer failure detection on (UCX selects tcp between two workers). "shm": detection off, shared
// memory only (posix/sysv/cma eager and rendezvous paths).
INSTANTIATE_TEST_SUITE_P(Ucx, TransportContract,
                         ::testing::Values(TransportFactory{"ucx",
                                                            [](const std::string& label) {
                                                              UcxOptions o;
                                                              o.name = label;
                                                              return make_ucx_transport(o);
                                                            }},
                                           TransportFactory{"ucx_shm",
                                                            [](const std::string& label) {
                                                              UcxOptions o;
                                                              o.name = label;
                                                              o.tls = "sm,self";
                                                              o.peer_failure_detection = false;
                                                              return make_ucx_transport(o);
                                                            }}),
                         [](const ::testing::TestParamInfo<TransportFactory>& i) { return i.param.name; });

std::string to_hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

std::string from_hex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

// The helper process with pipes on stdin/stdout; SIGKILLed on destruction if still alive.
class PeerProcess {
 public:
  explicit PeerProcess(std::vector<std::string> args) {
    std::string exe = spade::test::binary_dir() + "/tests/transport/transport_ucx_peer";
    if (!std::filesystem::exists(exe)) throw std::runtime_error("helper not built: " + exe);
    int in_pipe[2], out_pipe[2];
    if (::pipe(in_pipe) != 0 || ::pipe(out_pipe) != 0) throw std::runtime_error("pipe failed");
    args.insert(args.begin(), exe);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
      ::close(in_pipe[1]);
      ::close(out_pipe[0]);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    to_child_ = in_pipe[1];
    from_child_ = out_pipe[0];
  }

  ~PeerProcess() {
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_ >= 0) ::close(from_child_);
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
  }

  pid_t pid() const { return pid_; }

  std::string read_line(std::chrono::milliseconds timeout) {
    auto until = Clock::now() + timeout;
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      if (left <= 0) throw std::runtime_error("timed out reading from the peer process; got: " + buf_);
      pollfd p{from_child_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char tmp[4096];
      ssize_t n = ::read(from_child_, tmp, sizeof(tmp));
      if (n <= 0) throw std::runtime_error("peer process closed its output; got: " + buf_);
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }

  void write_line(const std::string& s) {
    std::string l = s + "\n";
    if (::write(to_child_, l.data(), l.size()) != static_cast<ssize_t>(l.size()))
      throw std::runtime_error("write");
  }

  void close_stdin() {
    ::close(to_child_);
    to_child_ = -1;
  }

  void kill9() { ::kill(pid_, SIGKILL); }

  int wait_exit(std::chrono::milliseconds timeout) {
    auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        reaped_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1, from_child_ = -1;
  bool reaped_ = false;
  std::string buf_;
};

// Exchanges addresses with the child and connects (both sides concurrently).
std::unique_ptr<Endpoint> connect_child(Transport& t, PeerProcess& p, const std::string& peer_name) {
  std::string child_addr = from_hex(p.read_line(10000ms));
  p.write_line(to_hex(t.local_address()));
  auto ep = t.connect(child_addr, peer_name, in(10000ms));
  std::string line = p.read_line(10000ms);
  if (line != "CONNECTED") throw std::runtime_error("peer process: " + line);
  return ep;
}

TEST(UcxCrossProcess, EchoThroughAChildProcess) {
  UcxOptions o;
  o.name = "inference-test";
  auto t = make_ucx_transport(o);
  constexpr int kN = 30;
  PeerProcess child({"cache-child", "echo", std::to_string(kN)});
  auto ep = connect_child(*t, child, fmt::format("cache rank 2 (pid {})", child.pid()));
  for (int i = 0; i < kN; ++i) {
    size_t n = static_cast<size_t>(1 + (i * 37813) % (1 << 20));
    auto src = pattern(n, static_cast<uint32_t>(i));
    std::vector<uint8_t> dst(n);
    auto r = ep->post_recv(make_tag(MsgKind::kSelectedKv, i, 0), dst.data(), dst.size());
    auto s = ep->post_send(make_tag(MsgKind::kQkvPack, i, 0), src.data(), src.size());
    ASSERT_EQ(s.wait(in(10000ms)), Status::OK) << s.error();
    ASSERT_EQ(r.wait(in(10000ms)), Status::OK) << r.error();
    ASSERT_EQ(r.length(), n);
    ASSERT_TRUE(src == dst) << i;
  }
  EXPECT_EQ(child.read_line(10000ms), "DONE");
  child.close_stdin();
  EXPECT_EQ(child.wait_exit(10000ms), 0);
}

TEST(UcxCrossProcess, KilledPeerFailsPendingOperationsNamingThePeer) {
  UcxOptions o;
  o.name = "inference-test";
  auto t = make_ucx_transport(o);
  PeerProcess child({"cache-child", "sleep"});
  std::string peer_name = fmt::format("cache rank 2 (pid {})", child.pid());
  auto ep = connect_child(*t, child, peer_name);
  std::vector<uint8_t> small(4096), big(size_t{8} << 20, 1);
  auto r = ep->post_recv(make_tag(MsgKind::kSelectedKv, 1, 0), small.data(), small.size());
  auto s =
      ep->post_send(make_tag(MsgKind::kQkvPack, 1, 0), big.data(), big.size());  // rendezvous, never matched
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(r.poll(), Status::PENDING);
  auto t0 = Clock::now();
  child.kill9();
  EXPECT_EQ(child.wait_exit(5000ms), 128 + SIGKILL);
  Status rs = r.wait(in(15000ms));
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  ASSERT_EQ(rs, Status::FAILED) << "pending receive not failed within 15 s of SIGKILL";
  EXPECT_NE(r.error().find(peer_name), std::string::npos) << r.error();
  ASSERT_EQ(s.wait(in(5000ms)), Status::FAILED);
  EXPECT_NE(s.error().find(peer_name), std::string::npos) << s.error();
  EXPECT_TRUE(ep->failed());
  auto later = ep->post_recv(make_tag(MsgKind::kSelectedKv, 2, 0), small.data(), small.size());
  EXPECT_EQ(later.wait(in(1000ms)), Status::FAILED);
  EXPECT_NE(later.error().find(peer_name), std::string::npos) << later.error();
  std::cerr << "[ UCX     ] peer death detected after " << took.count() << " ms: " << r.error() << "\n";
  EXPECT_LT(took, 10000ms);
}

TEST(UcxTransport, HandshakeTimesOutNamingThePeer) {
  UcxOptions o;
  o.name = "lonely";
  auto a = make_ucx_transport(o);
  auto b = make_ucx_transport(o);  // never calls connect() back
  auto t0 = Clock::now();
  try {
    a->connect(b->local_address(), "cache rank 2 (#0)", in(300ms));
    FAIL() << "handshake succeeded without the peer";
  } catch (const spade::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("handshake with peer cache rank 2 (#0) failed"), std::string::npos) << m;
    EXPECT_NE(m.find("no hello within"), std::string::npos) << m;
  }
  EXPECT_LT(Clock::now() - t0, 5000ms);
  EXPECT_EQ(a->kind(), "ucx");
}

TEST(UcxTransport, SharedMemoryOnlyWithPeerFailureDetectionExplainsWhy) {
  UcxOptions o;
  o.name = "shm-only";
  o.tls = "sm,self";
  auto a = make_ucx_transport(o);
  auto b = make_ucx_transport(o);
  try {
    a->connect(b->local_address(), "cache rank 2 (#0)", in(1000ms));
    FAIL() << "connected without a transport that supports peer failure";
  } catch (const spade::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("cannot create an endpoint to peer cache rank 2 (#0)"), std::string::npos) << m;
    EXPECT_NE(m.find("peer_failure_detection"), std::string::npos) << m;
  }
}

TEST(UcxTransport, GarbageAddressIsRejected) {
  auto a = make_ucx_transport({});
  EXPECT_THROW(a->connect("definitely not a ucx worker address", "peer x", in(1000ms)), spade::Error);
}

}  // namespace
}  // namespace spade::transport::test

#else

TEST(UcxTransport, NotBuilt) {
  GTEST_SKIP() << "built without UCX (SPADE_HAVE_UCX=OFF): UCX transport not tested";
}

#endif

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
#include "tests/transport/peer_process.h"
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

constexpr const char* kUcxPeer = "tests/transport/transport_ucx_peer";

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
  PeerProcess child(kUcxPeer, {"cache-child", "echo", std::to_string(kN)});
  auto ep = connect_child(*t, child, fmt::format("cache rank 2 (pid {})", child.pid()));
  for (int i = 0; i < kN; ++i) {
    size_t n = echo_bytes(i);
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
  PeerProcess child(kUcxPeer, {"cache-child", "sleep"});
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

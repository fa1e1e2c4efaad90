// Loopback transport: the transport contract plus simulated peer failure.
#include "common/error.h"
#include "tests/transport/contract.h"
#include "transport/loopback.h"

namespace spade::transport::test {
namespace {

std::shared_ptr<LoopbackFabric> fabric() {
  static auto f = LoopbackFabric::create();
  return f;
}

INSTANTIATE_TEST_SUITE_P(Loopback, TransportContract,
                         ::testing::Values(TransportFactory{"loopback", [](const std::string& label) {
                                                              return fabric()->make_transport(label);
                                                            }}));

TEST(LoopbackTransport, KilledPeerFailsPendingAndFutureOperationsNamingIt) {
  auto f = LoopbackFabric::create();
  auto inf = f->make_transport("inference rank 1");
  auto cache = f->make_transport("cache rank 2");
  auto [to_cache, to_inf] = connect_pair(*inf, "inference rank 1 (#0)", *cache, "cache rank 2 (#0)");
  std::vector<uint8_t> buf(256);
  auto r = to_cache->post_recv(make_tag(MsgKind::kSelectedKv, 10, 0), buf.data(), buf.size());
  auto s = to_cache->post_send(make_tag(MsgKind::kQkvPack, 10, 0), buf.data(), 16);  // never received
  f->kill(cache->local_address(), "SIGKILL (simulated)");
  ASSERT_EQ(r.wait(in(1000ms)), Status::FAILED);
  EXPECT_EQ(r.error(), "peer cache rank 2 (#0) died: SIGKILL (simulated)");
  ASSERT_EQ(s.wait(in(1000ms)), Status::FAILED);
  EXPECT_NE(s.error().find("cache rank 2 (#0)"), std::string::npos);
  EXPECT_TRUE(to_cache->failed());
  auto later = to_cache->post_recv(make_tag(MsgKind::kSelectedKv, 11, 0), buf.data(), buf.size());
  EXPECT_EQ(later.poll(), Status::FAILED);
  EXPECT_NE(later.error().find("cache rank 2 (#0) died"), std::string::npos);
  // Reconnecting to a dead peer is refused with its name.
  try {
    inf->connect(cache->local_address(), "cache rank 2 (#0)", in(100ms));
    FAIL() << "connected to a dead peer";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache rank 2 (#0)"), std::string::npos) << e.what();
  }
}

TEST(LoopbackTransport, DestroyedTransportLooksDeadToItsPeers) {
  auto f = LoopbackFabric::create();
  auto inf = f->make_transport("inference");
  auto cache = f->make_transport("cache");
  auto [to_cache, to_inf] = connect_pair(*inf, "inference rank 1", *cache, "cache rank 2");
  uint32_t v = 0;
  auto r = to_inf->post_recv(make_tag(MsgKind::kQkvPack, 1, 0), &v, 4);
  to_cache.reset();
  inf.reset();
  ASSERT_EQ(r.wait(in(1000ms)), Status::FAILED);
  EXPECT_NE(r.error().find("inference rank 1"), std::string::npos) << r.error();
}

TEST(LoopbackTransport, AbortBreaksBothDirections) {
  auto f = LoopbackFabric::create();
  auto inf = f->make_transport("inference");
  auto cache = f->make_transport("cache");
  auto [to_cache, to_inf] = connect_pair(*inf, "inference rank 1", *cache, "cache rank 2");
  uint32_t v = 0;
  auto r = to_inf->post_recv(make_tag(MsgKind::kQkvPack, 1, 0), &v, 4);
  to_cache->abort("PeerDown from coordinator");
  ASSERT_EQ(r.wait(in(1000ms)), Status::FAILED);
  EXPECT_NE(r.error().find("peer inference rank 1 closed the connection: PeerDown from coordinator"),
            std::string::npos)
      << r.error();
}

TEST(LoopbackTransport, MalformedOrForeignAddressesAreRejected) {
  auto f = LoopbackFabric::create();
  auto g = LoopbackFabric::create();
  auto a = f->make_transport("a");
  auto b = g->make_transport("b");
  EXPECT_THROW(a->connect("tcp://1.2.3.4", "peer x", in(100ms)), spade::Error);
  EXPECT_THROW(a->connect(b->local_address(), "peer b", in(100ms)), spade::Error);
  EXPECT_EQ(a->kind(), "loopback");
}

}  // namespace
}  // namespace spade::transport::test

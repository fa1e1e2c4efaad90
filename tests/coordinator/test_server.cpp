// Coordinator server + client library, in-process, over real TCP on 127.0.0.1 (ephemeral ports).
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <future>
#include <optional>
#include <thread>
#include <tuple>

#include "common/error.h"
#include "common/proto/framing.h"
#include "coordinator/asio.h"
#include "coordinator/auth.h"
#include "coordinator/client.h"
#include "coordinator/launch_env.h"
#include "coordinator/server.h"

namespace spade::coord {
namespace {

using namespace std::chrono_literals;
namespace asio = boost::asio;
using asio::ip::tcp;

Deadline in(std::chrono::milliseconds d) {
  return Clock::now() + d;
}

// Captures log lines so tests can check that rejections name the remote endpoint.
std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> g_log;

class CoordinatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_log = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(2000);
    auto logger = std::make_shared<spdlog::logger>(
        "test", spdlog::sinks_init_list{g_log, std::make_shared<spdlog::sinks::stderr_sink_mt>()});
    logger->set_level(spdlog::level::info);
    spdlog::set_default_logger(logger);
  }

  void start_server(uint32_t n = 1, std::chrono::milliseconds rendezvous = 10000ms,
                    std::chrono::milliseconds hb_interval = 50ms,
                    std::chrono::milliseconds hb_timeout = 400ms) {
    ServerOptions o;
    o.bind_host = "127.0.0.1";
    o.port = 0;
    o.role_map = default_role_map(n, n);
    o.heartbeat_interval = hb_interval;
    o.heartbeat_timeout = hb_timeout;
    o.rendezvous_timeout = rendezvous;
    o.shutdown_flush_timeout = 1000ms;
    o.cluster_secret = secret_;
    if (tweak_) tweak_(o);
    server_ = std::make_unique<CoordinatorServer>(o);
    server_->start();
    n_ = n;
  }

  ClientOptions rank_opts(proto::Role role, uint32_t idx) const {
    ClientOptions o;
    o.coordinator_port = server_->port();
    o.role = role;
    o.role_index = idx;
    o.rank = role == proto::INFERENCE ? 1 + idx : 1 + n_ + idx;
    o.world_size = 1 + 2 * n_;
    o.device = "cpu";
    o.transport_kind = proto::TRANSPORT_LOOPBACK;
    o.transport_address = fmt::format("{}-addr-{}", role == proto::INFERENCE ? "inf" : "cache", idx);
    o.cluster_secret = secret_;
    return o;
  }

  ClientOptions submit_opts() const {
    ClientOptions o;
    o.coordinator_port = server_->port();
    o.role = proto::CLIENT;
    o.cluster_secret = secret_;
    return o;
  }

  // Waits until the server's health snapshot satisfies `pred` (it refreshes every tick).
  bool health_reaches(const std::function<bool(const Health&)>& pred,
                      std::chrono::milliseconds timeout = 3000ms) {
    for (auto until = Clock::now() + timeout; Clock::now() < until; std::this_thread::sleep_for(10ms))
      if (pred(server_->health())) return true;
    return false;
  }

  // Brings up inference #0..n-1 and cache #0..n-1 concurrently; returns them with their views.
  void bring_up_world() {
    std::vector<std::future<proto::ClusterView>> futs;
    for (uint32_t i = 0; i < n_; ++i) {
      inf_.push_back(std::make_unique<CoordinatorClient>(rank_opts(proto::INFERENCE, i)));
      cache_.push_back(std::make_unique<CoordinatorClient>(rank_opts(proto::CACHE, i)));
    }
    for (uint32_t i = 0; i < n_; ++i) {
      futs.push_back(std::async(std::launch::async, [this, i] { return inf_[i]->rendezvous(in(5000ms)); }));
      futs.push_back(std::async(std::launch::async, [this, i] { return cache_[i]->rendezvous(in(5000ms)); }));
    }
    for (auto& f : futs) views_.push_back(f.get());
  }

  void TearDown() override {
    if (server_) {
      server_->request_shutdown("test teardown");
      ExitStatus st;
      EXPECT_TRUE(server_->wait_until(in(5000ms), &st)) << "coordinator did not stop";
    }
    inf_.clear();
    cache_.clear();
  }

  bool log_contains(const std::string& needle) const {
    for (const auto& line : g_log->last_formatted()) {
      if (line.find(needle) != std::string::npos) return true;
    }
    return false;
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::string secret_;                         // the cluster secret of the server and the clients ("" = none)
  std::function<void(ServerOptions&)> tweak_;  // further server options
  uint32_t n_ = 1;
  std::vector<std::unique_ptr<CoordinatorClient>> inf_, cache_;
  std::vector<proto::ClusterView> views_;
};

// The GPU data plane's handshake (transport/nccl/nccl_link.h): each inference rank publishes its NcclLink address --
// two ncclUniqueIds, 256 raw bytes with zeros and high bytes -- as TRANSPORT_NCCL, and its paired cache rank gets
// exactly those bytes in ClusterView (the cache side publishes no address of its own).
TEST_F(CoordinatorTest, HandsEachPairItsNcclLinkAddressVerbatim) {
  start_server(2);
  std::vector<std::string> addr(2);
  std::vector<std::future<proto::ClusterView>> futs;
  for (uint32_t i = 0; i < 2; ++i) {
    for (int b = 0; b < 256; ++b) addr[i].push_back(static_cast<char>((b * 37 + static_cast<int>(i) * 101) & 0xff));
    addr[i][0] = '\0';
    ClientOptions io = rank_opts(proto::INFERENCE, i), co = rank_opts(proto::CACHE, i);
    io.transport_kind = co.transport_kind = proto::TRANSPORT_NCCL;
    io.transport_address = addr[i];
    co.transport_address.clear();
    inf_.push_back(std::make_unique<CoordinatorClient>(io));
    cache_.push_back(std::make_unique<CoordinatorClient>(co));
  }
  for (uint32_t i = 0; i < 2; ++i) {
    futs.push_back(std::async(std::launch::async, [this, i] { return inf_[i]->rendezvous(in(5000ms)); }));
    futs.push_back(std::async(std::launch::async, [this, i] { return cache_[i]->rendezvous(in(5000ms)); }));
  }
  for (auto& f : futs) views_.push_back(f.get());
  for (uint32_t i = 0; i < 2; ++i) {
    const auto& cv = views_[2 * i + 1];
    ASSERT_EQ(cv.peers_size(), 1);
    EXPECT_EQ(cv.peers(0).transport().kind(), proto::TRANSPORT_NCCL);
    EXPECT_EQ(cv.peers(0).transport().address().size(), 256u);
    EXPECT_EQ(cv.peers(0).transport().address(), addr[i]) << "pair " << i;
    EXPECT_EQ(views_[2 * i].peers(0).transport().kind(), proto::TRANSPORT_NCCL);
  }
}

TEST_F(CoordinatorTest, PairsInferenceWithCacheAndExchangesAddresses) {
  start_server(2);
  bring_up_world();
  // views_ order: inf0, cache0, inf1, cache1
  for (uint32_t i = 0; i < 2; ++i) {
    const auto& iv = views_[2 * i];
    const auto& cv = views_[2 * i + 1];
    EXPECT_EQ(iv.self().role(), proto::INFERENCE);
    EXPECT_EQ(iv.self().rank(), 1 + i);
    ASSERT_EQ(iv.peers_size(), 1);
    EXPECT_EQ(iv.peers(0).role(), proto::CACHE);
    EXPECT_EQ(iv.peers(0).role_index(), i);
    EXPECT_EQ(iv.peers(0).rank(), 3 + i);
    EXPECT_EQ(iv.peers(0).transport().address(), fmt::format("cache-addr-{}", i));
    EXPECT_EQ(iv.peers(0).transport().kind(), proto::TRANSPORT_LOOPBACK);
    ASSERT_EQ(cv.peers_size(), 1);
    EXPECT_EQ(cv.peers(0).transport().address(), fmt::format("inf-addr-{}", i));
    EXPECT_EQ(cv.peers(0).rank(), 1 + i);
    EXPECT_EQ(iv.world_size(), 5u);
    EXPECT_EQ(iv.pairing_rule(), pairing_rule(1));
    EXPECT_EQ(iv.session_id(), cv.session_id());
  }
  auto st = server_->status(in(2000ms));
  EXPECT_TRUE(st.world_complete());
  ASSERT_EQ(st.ranks_size(), 4);
  for (const auto& r : st.ranks()) EXPECT_EQ(r.state(), proto::ALIVE) << r.info().rank();
}

TEST_F(CoordinatorTest, HeartbeatTimeoutDeclaresDeadAndNotifiesPeer) {
  start_server(1, 10000ms, 50ms, 400ms);
  bring_up_world();
  cache_[0]->set_stat("kv_tokens", 1234);
  std::this_thread::sleep_for(150ms);
  auto st0 = inf_[0]->query_status(in(2000ms));
  ASSERT_EQ(st0.ranks_size(), 2);
  EXPECT_GT(st0.ranks(1).heartbeat_seq(), 0u);
  EXPECT_DOUBLE_EQ(st0.ranks(1).stats().at("kv_tokens"), 1234);

  auto t0 = Clock::now();
  cache_[0]->stop_heartbeat();  // connection stays open, heartbeats stop
  auto ev = inf_[0]->next_event(in(3000ms));
  auto took = Clock::now() - t0;
  ASSERT_TRUE(ev.has_value()) << "no PeerDown within 3 s";
  ASSERT_EQ(ev->kind, ClientEvent::Kind::kPeerDown) << ev->message;
  EXPECT_EQ(ev->peer_down.rank(), 2u);
  EXPECT_EQ(ev->peer_down.role(), proto::CACHE);
  EXPECT_NE(ev->peer_down.reason().find("no heartbeat"), std::string::npos) << ev->peer_down.reason();
  EXPECT_GE(took, 300ms);  // timeout 400 ms minus up to one heartbeat interval already elapsed
  EXPECT_LT(took, 2000ms);

  auto st = server_->status(in(2000ms));
  ASSERT_EQ(st.ranks_size(), 2);
  EXPECT_EQ(st.ranks(0).state(), proto::ALIVE);
  EXPECT_EQ(st.ranks(1).state(), proto::DEAD);
  EXPECT_NE(st.ranks(1).dead_reason().find("no heartbeat"), std::string::npos);

  // The silent rank itself is told it was declared dead.
  auto bye = cache_[0]->next_event(in(2000ms));
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->kind, ClientEvent::Kind::kShutdown);
  EXPECT_TRUE(bye->shutdown.is_error());
  EXPECT_NE(bye->shutdown.reason().find("declared cache rank 2"), std::string::npos)
      << bye->shutdown.reason();
}

TEST_F(CoordinatorTest, ConnectionDropDeclaresDeadAndNotifiesPeer) {
  start_server(1);
  bring_up_world();
  std::vector<ClientEvent> via_callback;
  std::mutex mu;
  cache_[0]->set_event_callback([&](const ClientEvent& e) {
    std::lock_guard lk(mu);
    via_callback.push_back(e);
  });
  inf_[0].reset();  // inference process "exits"
  auto ev = cache_[0]->next_event(in(3000ms));
  ASSERT_TRUE(ev.has_value());
  ASSERT_EQ(ev->kind, ClientEvent::Kind::kPeerDown);
  EXPECT_EQ(ev->peer_down.rank(), 1u);
  EXPECT_EQ(ev->peer_down.role(), proto::INFERENCE);
  EXPECT_NE(ev->peer_down.reason().find("connection"), std::string::npos) << ev->peer_down.reason();
  EXPECT_NE(ev->message.find("inference rank 1"), std::string::npos) << ev->message;
  // The callback may run just after the queued event was taken: wait for it (with a deadline).
  for (auto until = std::chrono::steady_clock::now() + 3s; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(1ms)) {
    std::lock_guard lk(mu);
    if (!via_callback.empty()) break;
  }
  cache_[0]->set_event_callback(nullptr);  // the callback captures locals of this test
  std::lock_guard lk(mu);
  ASSERT_EQ(via_callback.size(), 1u);
  EXPECT_EQ(via_callback[0].kind, ClientEvent::Kind::kPeerDown);
}

// Rejoin of a cache rank: the replacement (same rank and index, after the old one was declared dead) is admitted
// with the next incarnation; the live inference rank gets PeerReplaced with the replacement's address, answers with a
// fresh PairOffer (as NCCL needs: ids are single-use), and only then does the replacement get its ClusterView, carrying
// the offered address. The world is degraded while the cache rank is dead or re-pairing and whole afterwards.
TEST_F(CoordinatorTest, ReplacementCacheRankIsAdmittedAndRePairedThroughAFreshOffer) {
  start_server(1);
  bring_up_world();
  ASSERT_TRUE(health_reaches([](const Health& h) { return h.world_complete && h.degraded.empty(); }));
  EXPECT_EQ(inf_[0]->registration()->incarnation(), 0u);
  cache_[0].reset();  // the cache rank "dies"
  auto down = inf_[0]->next_event(in(3000ms));
  ASSERT_TRUE(down.has_value());
  ASSERT_EQ(down->kind, ClientEvent::Kind::kPeerDown) << down->message;
  EXPECT_EQ(down->peer_down.incarnation(), 0u);
  ASSERT_TRUE(health_reaches(
      [](const Health& h) { return h.degraded.find("cache rank 2 (#0) is dead") != std::string::npos; }))
      << server_->health().degraded;

  ClientOptions ro = rank_opts(proto::CACHE, 0);
  ro.transport_address = "cache-addr-0-incarnation-1";
  auto replacement = std::make_unique<CoordinatorClient>(ro);
  auto view = std::async(std::launch::async, [&] { return replacement->rendezvous(in(5000ms)); });
  auto ev = inf_[0]->next_event(in(3000ms));
  ASSERT_TRUE(ev.has_value());
  ASSERT_EQ(ev->kind, ClientEvent::Kind::kPeerReplaced) << ev->message;
  EXPECT_EQ(ev->peer_replaced.peer().rank(), 2u);
  EXPECT_EQ(ev->peer_replaced.peer().incarnation(), 1u);
  EXPECT_EQ(ev->peer_replaced.peer().transport().address(), "cache-addr-0-incarnation-1");
  EXPECT_NE(ev->peer_replaced.previous_reason().find("connection"), std::string::npos);
  // No view before the offer; the world says it is re-pairing.
  EXPECT_EQ(view.wait_for(200ms), std::future_status::timeout);
  EXPECT_NE(server_->health().degraded.find("re-pairing"), std::string::npos) << server_->health().degraded;
  // A stale offer (wrong incarnation) is ignored; the right one releases the view.
  proto::PairOffer stale;
  stale.set_peer_rank(2);
  stale.set_peer_incarnation(0);
  stale.mutable_transport()->set_kind(proto::TRANSPORT_NCCL);
  stale.mutable_transport()->set_address("stale-ids");
  inf_[0]->send_pair_offer(stale);
  EXPECT_EQ(view.wait_for(200ms), std::future_status::timeout);
  proto::PairOffer offer = stale;
  offer.set_peer_incarnation(1);
  offer.mutable_transport()->set_address("fresh-ids");
  inf_[0]->send_pair_offer(offer);
  ASSERT_EQ(view.wait_for(3000ms), std::future_status::ready);
  const proto::ClusterView v = view.get();
  EXPECT_EQ(v.self().incarnation(), 1u);
  ASSERT_EQ(v.peers_size(), 1);
  EXPECT_EQ(v.peers(0).rank(), 1u);
  EXPECT_EQ(v.peers(0).transport().address(), "fresh-ids");
  EXPECT_EQ(replacement->registration()->incarnation(), 1u);
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.degraded.empty() && h.live_cache == 1; }))
      << server_->health().degraded;
  EXPECT_TRUE(log_contains("replacing incarnation 0 declared dead"));
  auto st = server_->status(in(2000ms));
  EXPECT_EQ(st.ranks(1).state(), proto::ALIVE);
  EXPECT_EQ(st.ranks(1).info().incarnation(), 1u);
  // The replacement dies too: its PeerDown carries its incarnation.
  replacement.reset();
  auto down2 = inf_[0]->next_event(in(3000ms));
  ASSERT_TRUE(down2.has_value());
  ASSERT_EQ(down2->kind, ClientEvent::Kind::kPeerDown);
  EXPECT_EQ(down2->peer_down.incarnation(), 1u);
}

// Rejoin of an inference rank: the replacement gets its ClusterView at once (the live cache rank's address) and the
// cache rank gets PeerReplaced carrying the replacement's freshly registered address.
TEST_F(CoordinatorTest, ReplacementInferenceRankIsPairedWithTheLiveCacheRank) {
  start_server(1);
  bring_up_world();
  inf_[0].reset();
  auto down = cache_[0]->next_event(in(3000ms));
  ASSERT_TRUE(down.has_value());
  ASSERT_EQ(down->kind, ClientEvent::Kind::kPeerDown);
  ClientOptions ro = rank_opts(proto::INFERENCE, 0);
  ro.transport_address = "inf-addr-0-new";
  auto replacement = std::make_unique<CoordinatorClient>(ro);
  const proto::ClusterView v = replacement->rendezvous(in(5000ms));
  EXPECT_EQ(v.self().incarnation(), 1u);
  ASSERT_EQ(v.peers_size(), 1);
  EXPECT_EQ(v.peers(0).transport().address(), "cache-addr-0");
  auto ev = cache_[0]->next_event(in(3000ms));
  ASSERT_TRUE(ev.has_value());
  ASSERT_EQ(ev->kind, ClientEvent::Kind::kPeerReplaced) << ev->message;
  EXPECT_EQ(ev->peer_replaced.peer().rank(), 1u);
  EXPECT_EQ(ev->peer_replaced.peer().transport().address(), "inf-addr-0-new");
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.degraded.empty() && h.live_inference == 1; }))
      << server_->health().degraded;
  // Requests are routed to the replacement.
  CoordinatorClient submitter(submit_opts());
  submitter.rendezvous(in(3000ms));
  proto::GenerateRequest r;
  r.set_text("hi");
  r.set_max_tokens(1);
  submitter.submit(r);
  auto routed = replacement->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value()) << "the replacement got no request";
}

// No split brain: while a rank is alive, a second registration for its index is refused by name, and the live
// rank keeps its slot and pairing.
TEST_F(CoordinatorTest, RegistrationForALiveIndexIsRefusedByName) {
  start_server(1);
  bring_up_world();
  CoordinatorClient intruder(rank_opts(proto::CACHE, 0));
  intruder.connect(in(3000ms));
  try {
    intruder.register_self(in(3000ms));
    FAIL() << "a second cache rank #0 was admitted while the first is alive";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 2 is already registered"), std::string::npos) << msg;
    EXPECT_NE(msg.find("alive"), std::string::npos) << msg;
    EXPECT_NE(msg.find("declared it dead"), std::string::npos) << msg;
  }
  EXPECT_FALSE(inf_[0]->next_event(in(300ms)).has_value()) << "the live pair was disturbed";
  auto st = server_->status(in(2000ms));
  EXPECT_EQ(st.ranks(1).state(), proto::ALIVE);
  EXPECT_EQ(st.ranks(1).info().incarnation(), 0u);
  EXPECT_TRUE(server_->health().degraded.empty());
}

TEST_F(CoordinatorTest, DuplicateAndInconsistentRegistrationsAreRejected) {
  start_server(1);
  CoordinatorClient first(rank_opts(proto::INFERENCE, 0));
  first.connect(in(3000ms));
  first.register_self(in(3000ms));

  CoordinatorClient dup(rank_opts(proto::INFERENCE, 0));
  dup.connect(in(3000ms));
  try {
    dup.register_self(in(3000ms));
    FAIL() << "duplicate registration accepted";
  } catch (const spade::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("duplicate registration"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
    EXPECT_NE(m.find(fmt::format("127.0.0.1:{}", server_->port())), std::string::npos) << m;
  }

  auto wrong = rank_opts(proto::INFERENCE, 0);
  wrong.rank = 2;  // the role map says rank 2 is cache #0
  CoordinatorClient bad(wrong);
  bad.connect(in(3000ms));
  try {
    bad.register_self(in(3000ms));
    FAIL() << "inconsistent registration accepted";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the role map c,i,k says rank 2 is cache #0"), std::string::npos)
        << e.what();
  }

  auto wrong_world = rank_opts(proto::CACHE, 0);
  wrong_world.world_size = 7;
  CoordinatorClient bad2(wrong_world);
  bad2.connect(in(3000ms));
  EXPECT_THROW(bad2.register_self(in(3000ms)), spade::Error);

  // The original registration is unaffected: the world still completes.
  CoordinatorClient cache(rank_opts(proto::CACHE, 0));
  auto fut = std::async(std::launch::async, [&] { return cache.rendezvous(in(5000ms)); });
  first.start_heartbeat();
  auto view = first.wait_cluster_view(in(5000ms));
  EXPECT_EQ(view.peers(0).transport().address(), "cache-addr-0");
  fut.get();
}

// Raw TCP connection that writes `bytes` and reports whether the server closed it within 3 s.
struct RawResult {
  bool closed_by_server = false;
  std::string local_endpoint;
};

RawResult send_raw(uint16_t port, const std::string& bytes, bool close_after) {
  asio::io_context io;
  tcp::socket s(io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  RawResult r;
  r.local_endpoint = fmt::format("127.0.0.1:{}", s.local_endpoint().port());
  asio::write(s, asio::buffer(bytes));
  if (close_after) {
    s.close();
    r.closed_by_server = true;  // we closed; the server must cope
    return r;
  }
  // Wait for EOF/reset from the server, bounded by a timer.
  std::array<char, 256> buf{};
  bool done = false;
  asio::steady_timer t(io, 3s);
  s.async_read_some(asio::buffer(buf), [&](const boost::system::error_code& ec, size_t) {
    r.closed_by_server = static_cast<bool>(ec);
    done = true;
    t.cancel();
  });
  t.async_wait([&](const boost::system::error_code& ec) {
    if (!ec && !done) s.close();
  });
  io.run_for(4s);
  return r;
}

std::string varint(uint64_t v) {
  std::string s;
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
  return s;
}

TEST_F(CoordinatorTest, BadFramesAreRejectedAndServerKeepsServing) {
  start_server(1);
  uint16_t port = server_->port();

  // An HTTP request: 'G' reads as a 71-byte length prefix, and the next 71 bytes are not an Envelope.
  auto garbage = send_raw(port,
                          "GET /status HTTP/1.1\r\nHost: coordinator.example\r\nUser-Agent: curl/7.88.1\r\n"
                          "Accept: */*\r\n\r\n",
                          false);
  EXPECT_TRUE(garbage.closed_by_server);
  auto oversized = send_raw(port, varint(uint64_t{1} << 31), false);
  EXPECT_TRUE(oversized.closed_by_server);
  proto::Envelope hb;
  hb.mutable_heartbeat()->set_seq(1);
  std::string frame = proto::encode_frame(hb);
  auto truncated = send_raw(port, frame.substr(0, frame.size() - 2), true);
  auto before_register = send_raw(port, frame, false);  // valid frame, but heartbeat before registration
  EXPECT_TRUE(before_register.closed_by_server);

  // Give the server a moment to log the truncated connection's close.
  std::this_thread::sleep_for(200ms);
  EXPECT_TRUE(log_contains("rejecting connection from " + garbage.local_endpoint)) << garbage.local_endpoint;
  EXPECT_TRUE(
      log_contains("rejecting connection from " + oversized.local_endpoint + ": frame length prefix"));
  EXPECT_TRUE(log_contains("rejecting data from " + truncated.local_endpoint + ": truncated frame"))
      << truncated.local_endpoint;
  EXPECT_TRUE(log_contains("dropping heartbeat frame from unauthenticated connection " +
                           before_register.local_endpoint + ": not allowed before registering"));

  bring_up_world();  // proper clients are still served
  EXPECT_EQ(views_[0].peers(0).transport().address(), "cache-addr-0");
}

TEST_F(CoordinatorTest, ShutdownRequestIsBroadcast) {
  start_server(1);
  bring_up_world();
  CoordinatorClient admin(submit_opts());
  admin.rendezvous(in(3000ms));
  admin.request_shutdown("benchmark finished");
  for (auto* c : {inf_[0].get(), cache_[0].get()}) {
    auto ev = c->next_event(in(3000ms));
    ASSERT_TRUE(ev.has_value());
    ASSERT_EQ(ev->kind, ClientEvent::Kind::kShutdown) << ev->message;
    EXPECT_FALSE(ev->shutdown.is_error());
    EXPECT_NE(ev->shutdown.reason().find("benchmark finished"), std::string::npos) << ev->shutdown.reason();
  }
  ExitStatus st;
  ASSERT_TRUE(server_->wait_until(in(3000ms), &st));
  EXPECT_EQ(st.code, 0);
  EXPECT_NE(st.message.find("benchmark finished"), std::string::npos) << st.message;
  server_.reset();
}

TEST_F(CoordinatorTest, RendezvousDeadlineShutsDownRegisteredRanks) {
  start_server(1, 400ms);
  CoordinatorClient inf(rank_opts(proto::INFERENCE, 0));
  auto t0 = Clock::now();
  try {
    inf.rendezvous(in(5000ms));
    FAIL() << "rendezvous succeeded without the cache rank";
  } catch (const spade::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("rank 2 (cache #0) never registered within 400 ms"), std::string::npos) << m;
    EXPECT_NE(m.find(fmt::format("coordinator 127.0.0.1:{}", server_->port())), std::string::npos) << m;
  }
  EXPECT_LT(Clock::now() - t0, 3000ms);
  ExitStatus st;
  ASSERT_TRUE(server_->wait_until(in(3000ms), &st));
  EXPECT_EQ(st.code, 1);
  EXPECT_NE(st.message.find("rank 2 (cache #0) never registered within 400 ms"), std::string::npos)
      << st.message;
  server_.reset();
}

TEST_F(CoordinatorTest, RoutesGenerateRequestsAndChunks) {
  start_server(1);
  bring_up_world();
  // Fake inference rank: answers every request with three chunks echoing the prompt.
  std::atomic<bool> stop{false};
  std::thread fake([&] {
    while (!stop) {
      auto req = inf_[0]->next_request(in(100ms));
      if (!req) continue;
      for (uint32_t k = 0; k < 3; ++k) {
        proto::GenerateChunk ch;
        ch.set_request_id(req->request_id());
        ch.add_token_ids(req->prompt_ids().ids(0) + k);
        ch.set_text(fmt::format("tok{}", k));
        ch.set_finished(k == 2);
        if (k == 2) ch.set_finish_reason(proto::FINISH_LENGTH);
        inf_[0]->send_chunk(ch);
      }
    }
  });
  CoordinatorClient sub(submit_opts());
  sub.rendezvous(in(3000ms));
  proto::GenerateRequest req;
  req.mutable_prompt_ids()->add_ids(100);
  req.set_max_tokens(3);
  req.mutable_sparse()->set_token_budget(2048);
  uint64_t id1 = sub.submit(req);
  req.mutable_prompt_ids()->set_ids(0, 500);
  uint64_t id2 = sub.submit(req);
  ASSERT_NE(id1, id2);
  std::map<uint64_t, std::vector<uint32_t>> tokens;
  int finished = 0;
  while (finished < 2) {
    auto ch = sub.next_chunk(in(3000ms));
    ASSERT_TRUE(ch.has_value()) << "missing chunks";
    ASSERT_TRUE(ch->request_id() == id1 || ch->request_id() == id2) << ch->request_id();
    EXPECT_EQ(ch->served_by_rank(), 1u);
    EXPECT_TRUE(ch->error().empty()) << ch->error();
    tokens[ch->request_id()].push_back(ch->token_ids(0));
    if (ch->finished()) {
      EXPECT_EQ(ch->finish_reason(), proto::FINISH_LENGTH);
      ++finished;
    }
  }
  EXPECT_EQ(tokens[id1], (std::vector<uint32_t>{100, 101, 102}));
  EXPECT_EQ(tokens[id2], (std::vector<uint32_t>{500, 501, 502}));

  // Targeting a non-existent inference rank is answered with an error chunk.
  proto::GenerateRequest bad = req;
  bad.set_target_inference(7);
  uint64_t id3 = sub.submit(bad);
  auto err = sub.next_chunk(in(3000ms));
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->request_id(), id3);
  EXPECT_TRUE(err->finished());
  EXPECT_EQ(err->finish_reason(), proto::FINISH_ERROR);
  EXPECT_NE(err->error().find("inference #7"), std::string::npos) << err->error();
  stop = true;
  fake.join();

  // A request in flight when its inference rank dies ends with an error chunk naming the rank.
  uint64_t id4 = sub.submit(req);
  auto routed = inf_[0]->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value());
  inf_[0].reset();
  auto dead = sub.next_chunk(in(3000ms));
  ASSERT_TRUE(dead.has_value());
  EXPECT_EQ(dead->request_id(), id4);
  EXPECT_EQ(dead->finish_reason(), proto::FINISH_ERROR);
  EXPECT_NE(dead->error().find("inference rank 1"), std::string::npos) << dead->error();
}

// A request of n samples (GenerateRequest.n): each chunk names its sample, the route stays until each sample has had
// its finished chunk (a repeated final chunk or a sample >= n is dropped), a cancel of one sample reaches the rank
// with its index and keeps the route, a cancel of the whole request ends each open sample with FINISH_CANCELLED,
// the rank's death ends each open sample with FINISH_ERROR, and n above kMaxSamplesPerRequest is refused.
TEST_F(CoordinatorTest, RoutesTheSamplesOfARequestUntilEachHasFinished) {
  start_server(1);
  bring_up_world();
  CoordinatorClient sub(submit_opts());
  sub.rendezvous(in(3000ms));
  auto request = [](uint32_t n) {
    proto::GenerateRequest r;
    r.mutable_prompt_ids()->add_ids(100);
    r.set_max_tokens(3);
    r.set_n(n);
    return r;
  };
  auto chunk = [&](uint64_t routed, uint32_t index, bool finished, proto::FinishReason why = proto::FINISH_LENGTH) {
    proto::GenerateChunk ch;
    ch.set_request_id(routed);
    ch.set_index(index);
    ch.add_token_ids(10 + index);
    ch.set_finished(finished);
    if (finished) ch.set_finish_reason(why);
    inf_[0]->send_chunk(ch);
  };
  // (index, finished, reason) of every chunk `sub` gets within `wait` after the last one.
  using Seen = std::vector<std::tuple<uint32_t, bool, proto::FinishReason>>;
  auto received = [&](uint64_t id, std::chrono::milliseconds wait = 300ms) {
    Seen seen;
    while (auto ch = sub.next_chunk(in(wait))) {
      EXPECT_EQ(ch->request_id(), id);
      seen.emplace_back(ch->index(), ch->finished(), ch->finish_reason());
    }
    return seen;
  };

  const uint64_t id = sub.submit(request(3));
  auto routed = inf_[0]->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value());
  EXPECT_EQ(routed->n(), 3u);
  chunk(routed->request_id(), 1, false);
  chunk(routed->request_id(), 0, true);
  chunk(routed->request_id(), 7, true);   // no such sample: dropped
  chunk(routed->request_id(), 0, true);   // sample 0 finished already: dropped
  chunk(routed->request_id(), 2, true);
  chunk(routed->request_id(), 1, true);   // the last open sample: the route ends
  chunk(routed->request_id(), 1, false);  // unknown route now: dropped
  EXPECT_EQ(received(id), (Seen{{1, false, proto::FINISH_NONE},
                                {0, true, proto::FINISH_LENGTH},
                                {2, true, proto::FINISH_LENGTH},
                                {1, true, proto::FINISH_LENGTH}}));
  EXPECT_TRUE(log_contains("chunk for sample 7 of request")) << "the stray chunk is logged";

  // One sample cancelled: the rank is told which, the route stays for the rank's own final chunks.
  const uint64_t id2 = sub.submit(request(2));
  routed = inf_[0]->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value());
  sub.cancel(id2, "only the second", 1);
  auto cancel = inf_[0]->next_cancel(in(3000ms));
  ASSERT_TRUE(cancel.has_value());
  EXPECT_EQ(cancel->request_id(), routed->request_id());
  ASSERT_TRUE(cancel->has_index());
  EXPECT_EQ(cancel->index(), 1u);
  chunk(routed->request_id(), 1, true, proto::FINISH_CANCELLED);
  chunk(routed->request_id(), 0, true);
  EXPECT_EQ(received(id2), (Seen{{1, true, proto::FINISH_CANCELLED}, {0, true, proto::FINISH_LENGTH}}));

  // The whole request cancelled after sample 2 finished: samples 0 and 1 end with FINISH_CANCELLED.
  const uint64_t id3 = sub.submit(request(3));
  routed = inf_[0]->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value());
  chunk(routed->request_id(), 2, true);
  ASSERT_TRUE(sub.next_chunk(in(3000ms)).has_value());
  sub.cancel(id3, "all of it");
  cancel = inf_[0]->next_cancel(in(3000ms));
  ASSERT_TRUE(cancel.has_value());
  EXPECT_FALSE(cancel->has_index());
  EXPECT_EQ(received(id3), (Seen{{0, true, proto::FINISH_CANCELLED}, {1, true, proto::FINISH_CANCELLED}}));

  // Above the limit: refused with one error chunk naming n; nothing reaches the rank.
  const uint64_t id4 = sub.submit(request(kMaxSamplesPerRequest + 1));
  auto refused = sub.next_chunk(in(3000ms));
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->request_id(), id4);
  EXPECT_EQ(refused->finish_reason(), proto::FINISH_ERROR);
  EXPECT_NE(refused->error().find("n = 65 samples is above the limit of 64"), std::string::npos) << refused->error();
  EXPECT_FALSE(inf_[0]->next_request(in(200ms)).has_value());

  // The rank dies with sample 1 finished: samples 0 and 2 end with FINISH_ERROR naming it.
  const uint64_t id5 = sub.submit(request(3));
  routed = inf_[0]->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value());
  chunk(routed->request_id(), 1, true);
  ASSERT_TRUE(sub.next_chunk(in(3000ms)).has_value());
  inf_[0].reset();
  std::vector<uint32_t> failed;
  while (auto ch = sub.next_chunk(in(3000ms))) {
    EXPECT_EQ(ch->request_id(), id5);
    EXPECT_EQ(ch->finish_reason(), proto::FINISH_ERROR);
    EXPECT_NE(ch->error().find("inference rank 1"), std::string::npos) << ch->error();
    failed.push_back(ch->index());
    if (failed.size() == 2) break;
  }
  EXPECT_EQ(failed, (std::vector<uint32_t>{0, 2}));
}

TEST_F(CoordinatorTest, ClientRetriesUntilTheCoordinatorStarts) {
  // Reserve a free port, release it, start the coordinator there only after the client began connecting.
  uint16_t port;
  {
    asio::io_context io;
    tcp::acceptor a(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    port = a.local_endpoint().port();
  }
  ClientOptions o;
  o.coordinator_port = port;
  o.role = proto::CLIENT;
  o.connect_retry_interval = 50ms;
  CoordinatorClient early(o);
  auto fut = std::async(std::launch::async, [&] { early.connect(in(5000ms)); });
  std::this_thread::sleep_for(300ms);
  ServerOptions so;
  so.bind_host = "127.0.0.1";
  so.port = port;
  so.role_map = default_role_map(1, 1);
  server_ = std::make_unique<CoordinatorServer>(so);
  server_->start();
  fut.get();
  EXPECT_TRUE(early.connected());
  early.register_self(in(2000ms));  // status is for registered connections only
  auto st = early.query_status(in(2000ms));
  EXPECT_FALSE(st.world_complete());
  EXPECT_EQ(st.ranks_size(), 2);
  EXPECT_EQ(st.ranks(0).state(), proto::MISSING);
}

TEST(CoordinatorClientTest, ConnectDeadlineNamesTheCoordinator) {
  uint16_t port;
  {
    asio::io_context io;
    tcp::acceptor a(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    port = a.local_endpoint().port();
  }
  ClientOptions o;
  o.coordinator_port = port;
  o.role = proto::INFERENCE;
  o.rank = 1;
  CoordinatorClient c(o);
  auto t0 = Clock::now();
  try {
    c.connect(Clock::now() + 400ms);
    FAIL() << "connected to nothing";
  } catch (const spade::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find(fmt::format("cannot reach coordinator 127.0.0.1:{}", port)), std::string::npos) << m;
    EXPECT_NE(m.find("inference rank 1 (#0)"), std::string::npos) << m;
  }
  EXPECT_LT(Clock::now() - t0, 2000ms);
}

TEST(CoordinatorClientTest, SilentCoordinatorIsReportedLost) {
  // A fake coordinator that accepts the registration and then never answers again.
  asio::io_context io;
  tcp::acceptor acc(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  uint16_t port = acc.local_endpoint().port();
  std::thread fake([&] {
    tcp::socket s(io);
    acc.accept(s);
    proto::FrameDecoder dec;
    std::array<char, 4096> buf{};
    proto::Envelope env;
    std::string err;
    boost::system::error_code ec;
    bool replied = false;
    while (!ec) {
      size_t n = s.read_some(asio::buffer(buf), ec);
      dec.feed(buf.data(), n);
      while (!replied && dec.next(&env, &err) == proto::FrameDecoder::Result::kFrame) {
        if (env.has_register_request()) {
          proto::Envelope rep;
          rep.mutable_register_reply()->set_world_size(3);
          rep.mutable_register_reply()->set_heartbeat_interval_ms(50);
          rep.mutable_register_reply()->set_heartbeat_timeout_ms(300);
          asio::write(s, asio::buffer(proto::encode_frame(rep)));
          replied = true;
        }
      }
    }
  });
  ClientOptions o;
  o.coordinator_port = port;
  o.role = proto::CACHE;
  o.rank = 2;
  CoordinatorClient c(o);
  c.connect(Clock::now() + 2000ms);
  c.register_self(Clock::now() + 2000ms);
  c.start_heartbeat();
  auto ev = c.next_event(Clock::now() + 3000ms);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ClientEvent::Kind::kCoordinatorLost);
  EXPECT_NE(ev->message.find("no frame from the coordinator for more than 300 ms"), std::string::npos)
      << ev->message;
  EXPECT_NE(ev->message.find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << ev->message;
  EXPECT_FALSE(c.connected());
  fake.join();  // the client closed the socket, so the fake's read fails
}

TEST(CoordinatorServerOptions, UnequalRoleCountsAreRefused) {
  ServerOptions o;
  o.bind_host = "127.0.0.1";
  o.port = 0;
  o.role_map = default_role_map(2, 1);
  try {
    CoordinatorServer s(o);
    FAIL() << "N != M accepted";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot pair 2 inference rank(s) with 1 cache rank(s)"),
              std::string::npos)
        << e.what();
  }
}

TEST(CoordinatorServerOptions, CacheRanksMustBeANonZeroMultipleOfTheInferenceRanks) {
  ServerOptions o;
  o.bind_host = "127.0.0.1";
  o.port = 0;
  for (auto [i, c] : {std::pair<uint32_t, uint32_t>{2, 3}, {2, 0}, {3, 4}}) {
    o.role_map = default_role_map(i, c);
    EXPECT_THROW(CoordinatorServer s(o), spade::Error) << i << " inference, " << c << " cache";
  }
  o.role_map = default_role_map(2, 6);  // N = 3
  EXPECT_NO_THROW(CoordinatorServer s(o));
}

// Layer shards: a world of 2 inference and 4 cache ranks (N = 2). Inference #i is paired with cache #(2i) and
// #(2i+1), in shard order, and learns N; each cache rank learns its shard and its one inference rank (with its
// --layers-per-pack). A dead shard's PeerDown goes to its own inference rank and to the other shards of that inference
// rank (a GPU cache rank ends then), not to other inference ranks or their shards; its replacement re-pairs through
// the inference rank's offer, as with one cache rank.
TEST_F(CoordinatorTest, ShardedWorldPairsEachInferenceRankWithItsNCacheRanksInShardOrder) {
  tweak_ = [](ServerOptions& o) { o.role_map = default_role_map(2, 4); };
  start_server(2);
  auto opts = [&](proto::Role role, uint32_t idx) {
    ClientOptions o = rank_opts(role, idx);
    o.rank = role == proto::INFERENCE ? 1 + idx : 3 + idx;
    o.world_size = 7;
    o.layers_per_pack = role == proto::INFERENCE ? 2 : 0;
    return o;
  };
  std::vector<std::future<proto::ClusterView>> futs;
  for (uint32_t i = 0; i < 2; ++i) inf_.push_back(std::make_unique<CoordinatorClient>(opts(proto::INFERENCE, i)));
  for (uint32_t c = 0; c < 4; ++c) cache_.push_back(std::make_unique<CoordinatorClient>(opts(proto::CACHE, c)));
  for (auto& r : inf_) futs.push_back(std::async(std::launch::async, [&r] { return r->rendezvous(in(5000ms)); }));
  for (auto& r : cache_) futs.push_back(std::async(std::launch::async, [&r] { return r->rendezvous(in(5000ms)); }));
  for (auto& f : futs) views_.push_back(f.get());
  for (uint32_t i = 0; i < 2; ++i) {
    const proto::ClusterView& iv = views_[i];
    EXPECT_EQ(iv.cache_ranks_per_inference(), 2u);
    EXPECT_EQ(iv.pairing_rule(), pairing_rule(2));
    ASSERT_EQ(iv.peers_size(), 2);
    for (uint32_t s = 0; s < 2; ++s) {
      EXPECT_EQ(iv.peers(static_cast<int>(s)).rank(), 3 + 2 * i + s);
      EXPECT_EQ(iv.peers(static_cast<int>(s)).shard(), s);
      EXPECT_EQ(iv.peers(static_cast<int>(s)).transport().address(), fmt::format("cache-addr-{}", 2 * i + s));
    }
  }
  for (uint32_t c = 0; c < 4; ++c) {
    const proto::ClusterView& cv = views_[2 + c];
    EXPECT_EQ(cv.self().shard(), c % 2);
    EXPECT_EQ(cv.cache_ranks_per_inference(), 2u);
    ASSERT_EQ(cv.peers_size(), 1);
    EXPECT_EQ(cv.peers(0).rank(), 1 + c / 2);
    EXPECT_EQ(cv.peers(0).layers_per_pack(), 2u);
    EXPECT_EQ(cv.peers(0).transport().address(), fmt::format("inf-addr-{}", c / 2));
  }
  // Cache #3 (rank 6, shard 1 of inference #1) dies: inference #1 hears of it, inference #0 does not.
  cache_[3].reset();
  auto down = inf_[1]->next_event(in(3000ms));
  ASSERT_TRUE(down.has_value());
  ASSERT_EQ(down->kind, ClientEvent::Kind::kPeerDown) << down->message;
  EXPECT_EQ(down->peer_down.rank(), 6u);
  EXPECT_FALSE(inf_[0]->next_event(in(300ms)).has_value()) << "inference #0 is not paired with cache #3";
  auto sibling = cache_[2]->next_event(in(3000ms));  // cache #2: the other shard of inference #1
  ASSERT_TRUE(sibling.has_value()) << "the sibling shard hears of it";
  ASSERT_EQ(sibling->kind, ClientEvent::Kind::kPeerDown) << sibling->message;
  EXPECT_EQ(sibling->peer_down.rank(), 6u);
  EXPECT_EQ(sibling->peer_down.role(), proto::CACHE);
  EXPECT_EQ(sibling->peer_down.role_index(), 3u);
  for (uint32_t c : {0u, 1u})
    EXPECT_FALSE(cache_[c]->next_event(in(200ms)).has_value()) << "cache #" << c << " is inference #0's shard";
  ClientOptions ro = opts(proto::CACHE, 3);
  ro.transport_address = "cache-addr-3-new";
  auto replacement = std::make_unique<CoordinatorClient>(ro);
  auto view = std::async(std::launch::async, [&] { return replacement->rendezvous(in(5000ms)); });
  auto ev = inf_[1]->next_event(in(3000ms));
  ASSERT_TRUE(ev.has_value());
  ASSERT_EQ(ev->kind, ClientEvent::Kind::kPeerReplaced) << ev->message;
  EXPECT_EQ(ev->peer_replaced.peer().rank(), 6u);
  EXPECT_EQ(ev->peer_replaced.peer().shard(), 1u);
  proto::PairOffer offer;
  offer.set_peer_rank(6);
  offer.set_peer_incarnation(1);
  offer.mutable_transport()->set_kind(proto::TRANSPORT_LOOPBACK);
  offer.mutable_transport()->set_address("inf-addr-1-again");
  inf_[0]->send_pair_offer(offer);  // not its shard: ignored
  EXPECT_EQ(view.wait_for(300ms), std::future_status::timeout);
  inf_[1]->send_pair_offer(offer);
  ASSERT_EQ(view.wait_for(3000ms), std::future_status::ready);
  const proto::ClusterView v = view.get();
  EXPECT_EQ(v.self().shard(), 1u);
  ASSERT_EQ(v.peers_size(), 1);
  EXPECT_EQ(v.peers(0).rank(), 2u);
  EXPECT_EQ(v.peers(0).transport().address(), "inf-addr-1-again");
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.degraded.empty() && h.live_cache == 4; }))
      << server_->health().degraded;
}

// A GPU data plane (NCCL, CUDA IPC) shards too: in a world with N > 1 an inference rank registering one (its N link
// addresses packed into one, pair/gpu_shard.h) is admitted, and each of its cache ranks gets those bytes verbatim,
// its shard and the inference rank's --layers-per-pack.
TEST_F(CoordinatorTest, AGpuTransportIsAdmittedInAShardedWorld) {
  tweak_ = [](ServerOptions& o) { o.role_map = default_role_map(1, 2); };
  start_server(1);
  auto opts = [&](proto::Role role, uint32_t idx) {
    ClientOptions o = rank_opts(role, idx);
    o.rank = role == proto::INFERENCE ? 1 : 2 + idx;
    o.world_size = 4;
    o.transport_kind = proto::TRANSPORT_NCCL;
    if (role == proto::INFERENCE) {
      o.transport_address = std::string("gpu-links\0of-two", 16);
      o.layers_per_pack = 1;
    }
    return o;
  };
  inf_.push_back(std::make_unique<CoordinatorClient>(opts(proto::INFERENCE, 0)));
  for (uint32_t c = 0; c < 2; ++c) cache_.push_back(std::make_unique<CoordinatorClient>(opts(proto::CACHE, c)));
  std::vector<std::future<proto::ClusterView>> futs;
  futs.push_back(std::async(std::launch::async, [this] { return inf_[0]->rendezvous(in(5000ms)); }));
  for (auto& r : cache_) futs.push_back(std::async(std::launch::async, [&r] { return r->rendezvous(in(5000ms)); }));
  for (auto& f : futs) views_.push_back(f.get());
  EXPECT_EQ(views_[0].cache_ranks_per_inference(), 2u);
  ASSERT_EQ(views_[0].peers_size(), 2);
  for (uint32_t c = 0; c < 2; ++c) {
    const proto::ClusterView& cv = views_[1 + c];
    EXPECT_EQ(cv.self().shard(), c);
    ASSERT_EQ(cv.peers_size(), 1);
    EXPECT_EQ(cv.peers(0).transport().kind(), proto::TRANSPORT_NCCL);
    EXPECT_EQ(cv.peers(0).transport().address(), std::string("gpu-links\0of-two", 16));
    EXPECT_EQ(cv.peers(0).layers_per_pack(), 1u);
  }
}

// ---- admission: authentication, roles and bounds
// ---------------------------------------------------------------

const std::string kSecret = "correct horse battery staple 0123456789";

// A raw control connection that speaks the framing directly: what a stranger (or a broken peer) can send.
class RawConn {
 public:
  explicit RawConn(uint16_t port) : sock_(io_) {
    sock_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    local = fmt::format("127.0.0.1:{}", sock_.local_endpoint().port());
  }
  void send(const proto::Envelope& env) { send_bytes(proto::encode_frame(env)); }
  // Writes `bytes`; false when the server has already closed the connection.
  bool send_bytes(const std::string& bytes) {
    boost::system::error_code ec;
    asio::write(sock_, asio::buffer(bytes), ec);
    return !ec;
  }
  // The next frame from the server within `timeout`; nullopt on timeout or once the server closed the
  // connection (then closed() is true).
  std::optional<proto::Envelope> next(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    for (;;) {
      proto::Envelope env;
      std::string err;
      if (dec_.next(&env, &err) == proto::FrameDecoder::Result::kFrame) return env;
      if (closed_ || Clock::now() >= until) return std::nullopt;
      boost::system::error_code ec;
      size_t n = 0;
      bool done = false;
      sock_.async_read_some(asio::buffer(buf_), [&](const boost::system::error_code& e, size_t k) {
        ec = e;
        n = k;
        done = true;
      });
      io_.restart();
      io_.run_for(until - Clock::now());
      if (!done) {
        sock_.cancel();
        io_.restart();
        io_.run();
        return std::nullopt;
      }
      if (ec) {
        closed_ = true;
        return std::nullopt;
      }
      dec_.feed(buf_.data(), n);
    }
  }
  // Reads until the server closes the connection or `timeout`; true when it closed. Frames received meanwhile
  // are kept in frames().
  bool closed_within(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (!closed_ && Clock::now() < until) {
      auto f = next(std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()));
      if (f) frames_.push_back(*f);
    }
    return closed_;
  }
  bool closed() const { return closed_; }
  const std::vector<proto::Envelope>& frames() const { return frames_; }
  // AuthHello, the server's AuthChallenge (its proof checked against `secret`), and the AuthProof for
  // `secret` (or `proof_override` when set). False when no valid challenge came.
  bool authenticate(const std::string& secret,
                    const std::optional<std::string>& proof_override = std::nullopt) {
    const std::string nonce = auth_nonce();
    proto::Envelope hello;
    hello.mutable_auth_hello()->set_client_nonce(nonce);
    send(hello);
    auto ch = next(2000ms);
    if (!ch || !ch->has_auth_challenge()) return false;
    const auto& c = ch->auth_challenge();
    if (!proof_matches(coordinator_proof(secret, nonce, c.server_nonce()), c.server_proof())) return false;
    proto::Envelope proof;
    proof.mutable_auth_proof()->set_client_proof(
        proof_override ? *proof_override : peer_proof(secret, c.server_nonce(), nonce));
    send(proof);
    return true;
  }

  std::string local;  // "127.0.0.1:port" of our end, as the server logs it

 private:
  asio::io_context io_;
  tcp::socket sock_;
  proto::FrameDecoder dec_;
  std::array<char, 4096> buf_{};
  bool closed_ = false;
  std::vector<proto::Envelope> frames_;
};

proto::Envelope shutdown_frame(const std::string& reason) {
  proto::Envelope e;
  e.mutable_shutdown()->set_reason(reason);
  return e;
}

proto::Envelope status_frame() {
  proto::Envelope e;
  e.mutable_status_request();
  return e;
}

proto::Envelope generate_frame(uint64_t id, const std::string& text) {
  proto::Envelope e;
  e.mutable_generate_request()->set_request_id(id);
  e.mutable_generate_request()->set_text(text);
  e.mutable_generate_request()->set_max_tokens(4);
  return e;
}

proto::Envelope client_register_frame() {
  proto::Envelope e;
  e.mutable_register_request()->set_protocol_version(proto::kProtocolVersion);
  e.mutable_register_request()->mutable_self()->set_role(proto::CLIENT);
  return e;
}

bool has_case(const std::vector<proto::Envelope>& frames, proto::Envelope::MsgCase c) {
  return std::any_of(frames.begin(), frames.end(),
                     [c](const proto::Envelope& e) { return e.msg_case() == c; });
}

// Without a secret (loopback): a connection that never registered cannot stop the world, submit or read
// status; each such frame is dropped, logged with its address, and its connection closed. Registered ranks
// may read status but neither stop the world nor submit (those are a client's).
TEST_F(CoordinatorTest, UnregisteredConnectionCannotStopSubmitOrReadStatus) {
  start_server(1);
  bring_up_world();
  RawConn stop(server_->port()), status(server_->port()), submit(server_->port());
  stop.send(shutdown_frame("stranger says stop"));
  status.send(status_frame());
  submit.send(generate_frame(7, "hello"));
  for (auto* r : {&stop, &status, &submit}) {
    EXPECT_TRUE(r->closed_within(2000ms)) << r->local;
    EXPECT_TRUE(r->frames().empty()) << r->local << " got a " << proto::envelope_case_name(r->frames()[0]);
  }
  EXPECT_TRUE(log_contains("dropping shutdown frame from unauthenticated connection " + stop.local));
  EXPECT_TRUE(log_contains("dropping status_request frame from unauthenticated connection " + status.local));
  EXPECT_TRUE(
      log_contains("dropping generate_request frame from unauthenticated connection " + submit.local));
  EXPECT_FALSE(inf_[0]->next_request(in(300ms)).has_value()) << "an unregistered submission was routed";
  EXPECT_FALSE(inf_[0]->next_event(in(10ms)).has_value()) << "the world got an event";
  EXPECT_TRUE(server_->health().running);
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.rejected_connections == 3; }));

  // A registered rank: status yes; shutdown and submit no.
  EXPECT_EQ(inf_[0]->query_status(in(2000ms)).ranks_size(), 2);
  inf_[0]->request_shutdown("a rank tries to stop the world");
  proto::GenerateRequest req;
  req.set_text("from a rank");
  const uint64_t id = inf_[0]->submit(req);
  auto refused = inf_[0]->next_chunk(in(2000ms));
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->request_id(), id);
  EXPECT_EQ(refused->finish_reason(), proto::FINISH_ERROR);
  EXPECT_NE(refused->error().find("only a registered client may submit"), std::string::npos)
      << refused->error();
  EXPECT_TRUE(log_contains("ignoring a shutdown request from 127.0.0.1:"));
  EXPECT_FALSE(cache_[0]->next_event(in(300ms)).has_value()) << "a rank's Shutdown was broadcast";
  EXPECT_FALSE(server_->health().shutting_down);
}

// With a secret: ranks and clients that hold it form the world and may do what their role allows; a
// connection that has not authenticated is refused whatever it sends, and the world does not notice.
TEST_F(CoordinatorTest, WithASecretOnlyAuthenticatedPeersAreServed) {
  secret_ = kSecret;
  start_server(1);
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.auth_required; }));
  bring_up_world();
  EXPECT_EQ(views_[0].peers(0).transport().address(), "cache-addr-0");

  RawConn stop(server_->port());
  stop.send(shutdown_frame("stranger says stop"));
  EXPECT_TRUE(stop.closed_within(2000ms));
  EXPECT_TRUE(log_contains("dropping shutdown frame from unauthenticated connection " + stop.local +
                           ": not allowed before authenticating"));
  // A registration without authentication is answered (so that a misconfigured rank says why) and closed.
  RawConn reg(server_->port());
  reg.send(client_register_frame());
  EXPECT_TRUE(reg.closed_within(2000ms));
  ASSERT_TRUE(has_case(reg.frames(), proto::Envelope::kRegisterReply));
  EXPECT_NE(reg.frames()[0].register_reply().error().find("authentication required"), std::string::npos);
  // Half-way through the handshake (hello sent, no proof) status is still refused.
  RawConn half(server_->port());
  proto::Envelope hello;
  hello.mutable_auth_hello()->set_client_nonce(auth_nonce());
  half.send(hello);
  auto ch = half.next(2000ms);
  ASSERT_TRUE(ch && ch->has_auth_challenge());
  half.send(status_frame());
  EXPECT_TRUE(half.closed_within(2000ms));
  EXPECT_FALSE(has_case(half.frames(), proto::Envelope::kStatusReply));
  // Authenticated but not registered: still nothing but the registration.
  RawConn unreg(server_->port());
  ASSERT_TRUE(unreg.authenticate(kSecret));
  unreg.send(status_frame());
  EXPECT_TRUE(unreg.closed_within(2000ms));
  EXPECT_FALSE(has_case(unreg.frames(), proto::Envelope::kStatusReply));
  // A client without the secret is told what is missing.
  ClientOptions no_secret = submit_opts();
  no_secret.cluster_secret.clear();
  CoordinatorClient plain(no_secret);
  plain.connect(in(2000ms));
  try {
    plain.register_self(in(2000ms));
    FAIL() << "a client without the secret registered";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("authentication required"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(inf_[0]->next_event(in(200ms)).has_value()) << "the world got an event";
  auto st = server_->status(in(2000ms));
  for (const auto& r : st.ranks()) EXPECT_EQ(r.state(), proto::ALIVE) << r.info().rank();

  // The authenticated operator reads status and stops the world.
  CoordinatorClient admin(submit_opts());
  admin.rendezvous(in(3000ms));
  EXPECT_TRUE(admin.query_status(in(2000ms)).world_complete());
  admin.request_shutdown("operator stop");
  ExitStatus es;
  ASSERT_TRUE(server_->wait_until(in(3000ms), &es));
  EXPECT_EQ(es.code, 0);
  EXPECT_NE(es.message.find("operator stop"), std::string::npos) << es.message;
  server_.reset();
}

TEST_F(CoordinatorTest, WrongSecretIsRejectedInBothDirections) {
  secret_ = kSecret;
  start_server(1);
  // The peer checks the coordinator first: a client with another secret refuses the coordinator.
  ClientOptions other = submit_opts();
  other.cluster_secret = "a different secret of enough length";
  CoordinatorClient c(other);
  try {
    c.connect(in(2000ms));
    FAIL() << "a client with the wrong secret accepted the coordinator";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not prove it knows the cluster secret"), std::string::npos)
        << e.what();
  }
  // The coordinator checks the peer: a wrong proof is answered and closed.
  RawConn liar(server_->port());
  ASSERT_TRUE(liar.authenticate(kSecret, std::string(kAuthProofBytes, 'x')));
  EXPECT_TRUE(liar.closed_within(2000ms));
  ASSERT_TRUE(has_case(liar.frames(), proto::Envelope::kRegisterReply));
  EXPECT_NE(liar.frames()[0].register_reply().error().find("authentication failed"), std::string::npos);
  EXPECT_TRUE(log_contains("refusing connection from " + liar.local + ": authentication failed"));
  // A proof replayed on another connection (other nonces) fails too.
  RawConn first(server_->port());
  const std::string nonce = auth_nonce();
  proto::Envelope hello;
  hello.mutable_auth_hello()->set_client_nonce(nonce);
  first.send(hello);
  auto ch = first.next(2000ms);
  ASSERT_TRUE(ch && ch->has_auth_challenge());
  const std::string stolen = peer_proof(kSecret, ch->auth_challenge().server_nonce(), nonce);
  RawConn replay(server_->port());
  ASSERT_TRUE(replay.authenticate(kSecret, stolen));
  EXPECT_TRUE(replay.closed_within(2000ms));
  EXPECT_TRUE(log_contains("refusing connection from " + replay.local + ": authentication failed"));
  // A proof without a hello.
  RawConn early(server_->port());
  proto::Envelope proof;
  proof.mutable_auth_proof()->set_client_proof(stolen);
  early.send(proof);
  EXPECT_TRUE(early.closed_within(2000ms));
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.rejected_connections >= 3; }));
  // The world still forms with the right secret.
  bring_up_world();

  // A peer with a secret and a coordinator without one disagree: the peer says so.
  ServerOptions so;
  so.bind_host = "127.0.0.1";
  so.port = 0;
  so.role_map = default_role_map(1, 1);
  CoordinatorServer plain(so);
  plain.start();
  ClientOptions o = submit_opts();
  o.coordinator_port = plain.port();
  CoordinatorClient d(o);
  try {
    d.connect(in(2000ms));
    FAIL() << "authenticated against a coordinator without a secret";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no cluster secret"), std::string::npos) << e.what();
  }
  plain.request_shutdown("test done");
  ExitStatus es;
  EXPECT_TRUE(plain.wait_until(in(3000ms), &es));
}

TEST_F(CoordinatorTest, UnauthenticatedConnectionsAreCapped) {
  tweak_ = [](ServerOptions& o) { o.max_unauthenticated_connections = 2; };
  start_server(1);
  bring_up_world();  // registered connections do not count against the cap
  auto a = std::make_unique<RawConn>(server_->port());
  RawConn b(server_->port());
  ASSERT_TRUE(health_reaches([](const Health& h) { return h.unauthenticated_connections == 2; }));
  RawConn over(server_->port());
  EXPECT_TRUE(over.closed_within(1000ms)) << "a third unauthenticated connection was kept";
  EXPECT_FALSE(b.closed_within(200ms));
  EXPECT_TRUE(log_contains("refusing connection from " + over.local +
                           ": 2 unauthenticated connection(s) already "
                           "open (--max-unauthenticated-connections)"));
  a.reset();  // a slot frees up
  ASSERT_TRUE(health_reaches([](const Health& h) { return h.unauthenticated_connections == 1; }));
  RawConn again(server_->port());
  EXPECT_FALSE(again.closed_within(300ms)) << "the freed slot was not reused";
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.rejected_connections == 1; }));
  const auto status = server_->status(in(2000ms));
  for (const auto& r : status.ranks()) EXPECT_EQ(r.state(), proto::ALIVE) << r.info().rank();
}

TEST_F(CoordinatorTest, AuthDeadlineDropsSilentAndHalfSentConnections) {
  tweak_ = [](ServerOptions& o) { o.auth_timeout = 400ms; };
  start_server(1);
  const auto t0 = Clock::now();
  RawConn silent(server_->port()), half(server_->port());
  std::string partial = varint(60000) + std::string(1000, 'x');  // within the pre-auth limit, never finished
  ASSERT_TRUE(half.send_bytes(partial));
  EXPECT_TRUE(silent.closed_within(3000ms));
  EXPECT_TRUE(half.closed_within(3000ms));
  const auto took = Clock::now() - t0;
  EXPECT_GE(took, 350ms);
  EXPECT_LT(took, 2500ms);
  EXPECT_TRUE(log_contains("closing connection from " + silent.local +
                           ": not authenticated within 400 ms (--auth-timeout-ms)"));
  EXPECT_TRUE(log_contains("closing connection from " + half.local +
                           ": not authenticated within 400 ms "
                           "(--auth-timeout-ms); dropping 1003 bytes of an unfinished frame"));
  EXPECT_TRUE(health_reaches([](const Health& h) { return h.rejected_connections == 2; }));
  bring_up_world();  // ranks register well within the deadline
}

// Before authentication a frame may not exceed max_unauthenticated_frame_bytes: the length prefix alone
// closes the connection, so a stranger cannot make the coordinator buffer a large frame. After authentication
// the full limit applies.
TEST_F(CoordinatorTest, OversizedFrameBeforeAuthenticationIsRefusedFromItsPrefix) {
  secret_ = kSecret;
  start_server(1);
  const auto t0 = Clock::now();
  RawConn big(server_->port()), just_over(server_->port());
  ASSERT_TRUE(big.send_bytes(varint(uint64_t{48} << 20)));
  ASSERT_TRUE(just_over.send_bytes(varint((64 << 10) + 1)));
  EXPECT_TRUE(big.closed_within(2000ms));
  EXPECT_TRUE(just_over.closed_within(2000ms));
  EXPECT_LT(Clock::now() - t0, 2000ms) << "closed by the deadline, not by the prefix";
  EXPECT_TRUE(
      log_contains("rejecting connection from " + big.local +
                   ": frame length prefix 50331648 bytes exceeds the maximum frame size of 65536 bytes "
                   "(before authentication: --max-unauthenticated-frame-bytes)"));
  EXPECT_TRUE(
      log_contains("rejecting connection from " + just_over.local + ": frame length prefix 65537 bytes"));
  EXPECT_TRUE(health_reaches(
      [](const Health& h) { return h.rejected_connections == 2 && h.unauthenticated_connections == 0; }));

  // An authenticated client may send a 1 MiB request.
  bring_up_world();
  CoordinatorClient sub(submit_opts());
  sub.rendezvous(in(3000ms));
  proto::GenerateRequest req;
  req.set_text(std::string(1 << 20, 'a'));
  req.set_max_tokens(1);
  sub.submit(req);
  auto routed = inf_[0]->next_request(in(3000ms));
  ASSERT_TRUE(routed.has_value());
  EXPECT_EQ(routed->text().size(), size_t{1} << 20);
}

TEST_F(CoordinatorTest, IdleTimeoutClosesSilentConnectionsOnly) {
  tweak_ = [](ServerOptions& o) { o.idle_timeout = 400ms; };
  start_server(1, 10000ms, 50ms, 400ms);
  bring_up_world();
  CoordinatorClient quiet(submit_opts());  // registers but never heartbeats
  quiet.connect(in(2000ms));
  quiet.register_self(in(2000ms));
  CoordinatorClient chatty(submit_opts());  // rendezvous: heartbeats
  chatty.rendezvous(in(2000ms));
  auto ev = quiet.next_event(in(3000ms));
  ASSERT_TRUE(ev.has_value()) << "a silent connection outlived the idle timeout";
  EXPECT_EQ(ev->kind, ClientEvent::Kind::kCoordinatorLost) << ev->message;
  EXPECT_TRUE(log_contains("closing idle connection from "));
  EXPECT_TRUE(log_contains("(client): no frame for "));
  std::this_thread::sleep_for(800ms);  // twice the idle timeout
  EXPECT_TRUE(chatty.connected());
  EXPECT_TRUE(chatty.query_status(in(2000ms)).world_complete());
  const auto status = server_->status(in(2000ms));
  for (const auto& r : status.ranks()) EXPECT_EQ(r.state(), proto::ALIVE) << r.info().rank();
}

TEST(CoordinatorServerOptions, UnsafeOrInconsistentBoundsAreRefused) {
  auto error_of = [](const std::function<void(ServerOptions&)>& f) -> std::string {
    ServerOptions o;
    o.bind_host = "127.0.0.1";
    o.port = 0;
    o.role_map = default_role_map(1, 1);
    f(o);
    try {
      CoordinatorServer s(o);
    } catch (const spade::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of([](ServerOptions& o) {
              o.bind_host = "0.0.0.0";
            }).find("refusing to listen on 0.0.0.0:0 without a cluster secret"),
            std::string::npos);
  EXPECT_EQ(error_of([](ServerOptions& o) {
              o.bind_host = "0.0.0.0";
              o.cluster_secret = kSecret;
            }),
            "");
  EXPECT_EQ(error_of([](ServerOptions& o) { o.bind_host = "::1"; }), "");
  EXPECT_NE(error_of([](ServerOptions& o) { o.cluster_secret = "short"; }).find("at least 16 are required"),
            std::string::npos);
  EXPECT_NE(error_of([](ServerOptions& o) { o.idle_timeout = 1500ms; }).find("at least twice the heartbeat"),
            std::string::npos);
  EXPECT_NE(error_of([](ServerOptions& o) {
              o.max_unauthenticated_frame_bytes = o.max_frame_bytes + 1;
            }).find("--max-unauthenticated-frame-bytes"),
            std::string::npos);
  EXPECT_NE(error_of([](ServerOptions& o) {
              o.max_unauthenticated_connections = 0;
            }).find("--max-unauthenticated-connections"),
            std::string::npos);
  EXPECT_NE(error_of([](ServerOptions& o) { o.auth_timeout = 0ms; }).find("--auth-timeout-ms"),
            std::string::npos);
}

}  // namespace
}  // namespace spade::coord

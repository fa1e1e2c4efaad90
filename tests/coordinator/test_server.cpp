// Coordinator server + client library, in-process, over real TCP on 127.0.0.1 (ephemeral ports).
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <future>
#include <thread>

#include "common/error.h"
#include "common/proto/framing.h"
#include "coordinator/asio.h"
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
    return o;
  }

  ClientOptions submit_opts() const {
    ClientOptions o;
    o.coordinator_port = server_->port();
    o.role = proto::CLIENT;
    return o;
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
    EXPECT_EQ(iv.pairing_rule(), kPairingRule);
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
  cache_[0]->set_event_callback(nullptr);  // the callback captures locals of this test
  std::lock_guard lk(mu);
  ASSERT_EQ(via_callback.size(), 1u);
  EXPECT_EQ(via_callback[0].kind, ClientEvent::Kind::kPeerDown);
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
  EXPECT_TRUE(
      log_contains("rejecting connection from " + before_register.local_endpoint + ": heartbeat before"));

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

}  // namespace
}  // namespace spade::coord

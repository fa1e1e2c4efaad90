// The transport contract (transport/transport.h), checked against every implementation. Included by one test
// file per implementation, which instantiates TransportContract with its factory.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/tags.h"
#include "transport/transport.h"

namespace spade::transport::test {

using namespace std::chrono_literals;

struct TransportFactory {
  std::string name;
  std::function<std::unique_ptr<Transport>(const std::string& label)> make;
};

inline std::ostream& operator<<(std::ostream& os, const TransportFactory& f) {
  return os << f.name;
}

inline Deadline in(std::chrono::milliseconds d) {
  return Clock::now() + d;
}

// Connects a <-> b from two threads (UCX's handshake needs both sides at once).
inline std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>> connect_pair(
    Transport& a, const std::string& a_name, Transport& b, const std::string& b_name) {
  auto fb = std::async(std::launch::async, [&] { return b.connect(a.local_address(), a_name, in(10000ms)); });
  auto ea = a.connect(b.local_address(), b_name, in(10000ms));
  return {std::move(ea), fb.get()};
}

inline std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(&v[i], &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

class TransportContract : public ::testing::TestWithParam<TransportFactory> {
 protected:
  void SetUp() override {
    a_ = GetParam().make("inference-test");
    b_ = GetParam().make("cache-test");
    auto [ea, eb] = connect_pair(*a_, "inference-test", *b_, "cache-test");
    ab_ = std::move(ea);  // a's endpoint to b (peer name "cache-test")
    ba_ = std::move(eb);  // b's endpoint to a (peer name "inference-test")
  }
  void TearDown() override {
    ab_.reset();
    ba_.reset();
    a_.reset();
    b_.reset();
  }

  std::unique_ptr<Transport> a_, b_;
  std::unique_ptr<Endpoint> ab_, ba_;
};

TEST_P(TransportContract, ManyTaggedMessagesBothDirections) {
  constexpr int kSteps = 40, kPacks = 6;
  // Per step/pack: inference -> cache a "qkv" message, cache -> inference a "selected kv" message, sizes
  // varying.
  std::vector<std::vector<uint8_t>> qkv, sel;
  std::vector<std::vector<uint8_t>> qkv_rx, sel_rx;
  std::vector<RecvHandle> rq, rs;
  std::vector<SendHandle> sq, ss;
  for (int t = 0; t < kSteps; ++t) {
    for (int p = 0; p < kPacks; ++p) {
      size_t n1 = 1 + static_cast<size_t>((t * 131 + p * 977) % 20000);
      size_t n2 = 1 + static_cast<size_t>((t * 71 + p * 313) % 70000);
      qkv.push_back(pattern(n1, static_cast<uint32_t>(t * 100 + p)));
      sel.push_back(pattern(n2, static_cast<uint32_t>(t * 100 + p + 50000)));
      qkv_rx.emplace_back(n1 + 7);
      sel_rx.emplace_back(n2);
    }
  }
  // Half the receives are posted before the sends, half after.
  auto post_recvs = [&](int from, int to) {
    for (int i = from; i < to; ++i) {
      int t = i / kPacks, p = i % kPacks;
      rq.push_back(ba_->post_recv(make_tag(MsgKind::kQkvPack, t, p), qkv_rx[i].data(), qkv_rx[i].size()));
      rs.push_back(
          ab_->post_recv(make_tag(MsgKind::kSelectedKv, t + 1, p), sel_rx[i].data(), sel_rx[i].size()));
    }
  };
  const int total = kSteps * kPacks;
  post_recvs(0, total / 2);
  for (int i = 0; i < total; ++i) {
    int t = i / kPacks, p = i % kPacks;
    sq.push_back(ab_->post_send(make_tag(MsgKind::kQkvPack, t, p), qkv[i].data(), qkv[i].size()));
    ss.push_back(ba_->post_send(make_tag(MsgKind::kSelectedKv, t + 1, p), sel[i].data(), sel[i].size()));
  }
  post_recvs(total / 2, total);
  for (int i = 0; i < total; ++i) {
    ASSERT_EQ(rq[i].wait(in(10000ms)), Status::OK) << i << ": " << rq[i].error();
    ASSERT_EQ(rs[i].wait(in(10000ms)), Status::OK) << i << ": " << rs[i].error();
    ASSERT_EQ(sq[i].wait(in(10000ms)), Status::OK) << sq[i].error();
    ASSERT_EQ(ss[i].wait(in(10000ms)), Status::OK) << ss[i].error();
    ASSERT_EQ(rq[i].length(), qkv[i].size());
    ASSERT_EQ(rs[i].length(), sel[i].size());
    ASSERT_EQ(0, std::memcmp(qkv_rx[i].data(), qkv[i].data(), qkv[i].size())) << "qkv payload " << i;
    ASSERT_EQ(0, std::memcmp(sel_rx[i].data(), sel[i].data(), sel[i].size())) << "selected payload " << i;
  }
}

TEST_P(TransportContract, OutOfOrderPostingAndSameTagFifo) {
  // Receives posted in reverse tag order; sends in forward order.
  constexpr int kN = 16;
  std::vector<uint64_t> rx(kN, 0), tx(kN);
  std::vector<RecvHandle> r;
  for (int i = kN - 1; i >= 0; --i) {
    r.insert(r.begin(), ab_->post_recv(make_tag(MsgKind::kControl, static_cast<uint64_t>(i), 0), &rx[i], 8));
  }
  std::vector<SendHandle> s;
  for (int i = 0; i < kN; ++i) {
    tx[i] = 0xABC0000ull + static_cast<uint64_t>(i);
    s.push_back(ba_->post_send(make_tag(MsgKind::kControl, static_cast<uint64_t>(i), 0), &tx[i], 8));
  }
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(r[i].wait(in(5000ms)), Status::OK) << r[i].error();
    EXPECT_EQ(rx[i], tx[i]);
  }
  // Same tag several times: delivered in send order, also when the sends come first.
  uint64_t tag = make_tag(MsgKind::kControl, 999, 3);
  std::vector<uint32_t> vals = {11, 22, 33};
  std::vector<SendHandle> s2;
  for (auto& v : vals) s2.push_back(ab_->post_send(tag, &v, sizeof(v)));
  std::this_thread::sleep_for(20ms);
  std::vector<uint32_t> got(3, 0);
  std::vector<RecvHandle> r2;
  for (auto& g : got) r2.push_back(ba_->post_recv(tag, &g, sizeof(g)));
  for (auto& h : r2) ASSERT_EQ(h.wait(in(5000ms)), Status::OK) << h.error();
  EXPECT_EQ(got, vals);
  for (auto& h : s) EXPECT_EQ(h.wait(in(5000ms)), Status::OK);
  for (auto& h : s2) EXPECT_EQ(h.wait(in(5000ms)), Status::OK);
}

TEST_P(TransportContract, LargeMessages64MiB) {
  const size_t n = size_t{64} << 20;
  auto src = pattern(n, 7);
  std::vector<uint8_t> dst(n, 0);
  auto back = pattern(n / 2, 8);
  std::vector<uint8_t> back_rx(n / 2, 0);
  auto s = ab_->post_send(make_tag(MsgKind::kQkvPack, 1, 0), src.data(), n);
  auto r2 = ab_->post_recv(make_tag(MsgKind::kSelectedKv, 2, 0), back_rx.data(), back_rx.size());
  auto r = ba_->post_recv(make_tag(MsgKind::kQkvPack, 1, 0), dst.data(), n);
  auto s2 = ba_->post_send(make_tag(MsgKind::kSelectedKv, 2, 0), back.data(), back.size());
  ASSERT_EQ(r.wait(in(20000ms)), Status::OK) << r.error();
  ASSERT_EQ(s.wait(in(20000ms)), Status::OK) << s.error();
  ASSERT_EQ(r2.wait(in(20000ms)), Status::OK) << r2.error();
  ASSERT_EQ(s2.wait(in(20000ms)), Status::OK) << s2.error();
  EXPECT_EQ(r.length(), n);
  EXPECT_TRUE(src == dst);
  EXPECT_TRUE(back == back_rx);
}

TEST_P(TransportContract, MessageLargerThanBufferFails) {
  for (size_t n : {size_t{64}, size_t{1} << 20}) {  // eager-sized and rendezvous-sized
    auto src = pattern(n, 1);
    std::vector<uint8_t> small(n / 2);
    uint64_t tag = make_tag(MsgKind::kSelectedKv, n, 1);
    auto r = ab_->post_recv(tag, small.data(), small.size());
    auto s = ba_->post_send(tag, src.data(), src.size());
    ASSERT_EQ(r.wait(in(5000ms)), Status::FAILED) << n;
    EXPECT_NE(r.error().find("larger than the posted buffer"), std::string::npos) << r.error();
    EXPECT_NE(r.error().find("cache-test"), std::string::npos) << r.error();
    // The sender completes either way (it is not left hanging).
    EXPECT_NE(s.wait(in(5000ms)), Status::TIMEOUT) << n;
  }
  // The endpoint keeps working afterwards.
  uint32_t v = 42, got = 0;
  auto r = ab_->post_recv(make_tag(MsgKind::kControl, 1, 1), &got, 4);
  auto s = ba_->post_send(make_tag(MsgKind::kControl, 1, 1), &v, 4);
  ASSERT_EQ(r.wait(in(5000ms)), Status::OK) << r.error();
  EXPECT_EQ(got, 42u);
  EXPECT_EQ(s.wait(in(5000ms)), Status::OK);
}

TEST_P(TransportContract, WaitDeadlineTimesOutAndCancelReleasesTheBuffer) {
  std::vector<uint8_t> buf(128);
  auto r = ab_->post_recv(make_tag(MsgKind::kSelectedKv, 77, 0), buf.data(), buf.size());
  auto t0 = Clock::now();
  EXPECT_EQ(r.wait(in(100ms)), Status::TIMEOUT);
  auto took = Clock::now() - t0;
  EXPECT_GE(took, 100ms);
  EXPECT_LT(took, 1000ms);
  EXPECT_EQ(r.poll(), Status::PENDING);  // still pending after a timed-out wait
  r.cancel();
  ASSERT_EQ(r.wait(in(5000ms)), Status::CANCELLED);
  EXPECT_NE(r.error().find("cancelled"), std::string::npos);
  // A message sent afterwards with that tag is not swallowed by the cancelled receive.
  uint32_t v = 5, got = 0;
  auto s = ba_->post_send(make_tag(MsgKind::kSelectedKv, 77, 0), &v, 4);
  auto r2 = ab_->post_recv(make_tag(MsgKind::kSelectedKv, 77, 0), &got, 4);
  ASSERT_EQ(r2.wait(in(5000ms)), Status::OK) << r2.error();
  EXPECT_EQ(got, 5u);
  EXPECT_EQ(s.wait(in(5000ms)), Status::OK);
}

TEST_P(TransportContract, TwoEndpointsConcurrentlyDoNotCrossTalk) {
  // a talks to b (set up) and to c, with the same tags on both endpoints, from two threads.
  auto c = GetParam().make("cache-test-2");
  auto [ac, ca] = connect_pair(*a_, "inference-test", *c, "cache-test-2");
  constexpr int kN = 200;
  auto run = [&](Endpoint* mine, Endpoint* theirs, uint32_t salt) {
    std::vector<uint32_t> out(kN), in_buf(kN, 0);
    std::vector<SendHandle> s;
    std::vector<RecvHandle> r;
    for (int i = 0; i < kN; ++i) {
      out[i] = salt + static_cast<uint32_t>(i);
      r.push_back(mine->post_recv(make_tag(MsgKind::kSelectedKv, i, 0), &in_buf[i], 4));
      s.push_back(theirs->post_send(make_tag(MsgKind::kSelectedKv, i, 0), &out[i], 4));
    }
    for (int i = 0; i < kN; ++i) {
      if (r[i].wait(in(10000ms)) != Status::OK) return std::string("recv failed: ") + r[i].error();
      if (s[i].wait(in(10000ms)) != Status::OK) return std::string("send failed: ") + s[i].error();
      if (in_buf[i] != out[i]) return "cross-talk at " + std::to_string(i);
    }
    return std::string();
  };
  auto f1 = std::async(std::launch::async, run, ab_.get(), ba_.get(), 1000000u);
  auto f2 = std::async(std::launch::async, run, ac.get(), ca.get(), 2000000u);
  EXPECT_EQ(f1.get(), "");
  EXPECT_EQ(f2.get(), "");
  ac.reset();
  ca.reset();
}

TEST_P(TransportContract, AbortFailsPendingAndFutureOperations) {
  std::vector<uint8_t> buf(64);
  auto r = ab_->post_recv(make_tag(MsgKind::kSelectedKv, 1, 0), buf.data(), buf.size());
  ab_->abort("coordinator reported cache rank 2 dead");
  ASSERT_EQ(r.wait(in(5000ms)), Status::FAILED);
  EXPECT_NE(r.error().find("coordinator reported cache rank 2 dead"), std::string::npos) << r.error();
  EXPECT_NE(r.error().find("cache-test"), std::string::npos) << r.error();
  EXPECT_TRUE(ab_->failed());
  auto s = ab_->post_send(make_tag(MsgKind::kQkvPack, 2, 0), buf.data(), 8);
  EXPECT_EQ(s.wait(in(1000ms)), Status::FAILED);
  EXPECT_NE(s.error().find("cache-test"), std::string::npos) << s.error();
}

TEST_P(TransportContract, InvalidTagsAreRejected) {
  uint32_t v = 0;
  EXPECT_THROW(ab_->post_send(kMaxTag + 1, &v, 4), spade::Error);
  EXPECT_THROW(ab_->post_recv(transport_control_tag(1), &v, 4), spade::Error);
  EXPECT_THROW(make_tag(MsgKind::kTransportReserved, 0, 0), spade::Error);
  uint64_t t = make_tag(MsgKind::kSelectedKv, (uint64_t{1} << 24) + 5, 9);  // step wraps mod 2^24
  EXPECT_EQ(tag_kind(t), MsgKind::kSelectedKv);
  EXPECT_EQ(tag_step(t), 5u);
  EXPECT_EQ(tag_pack(t), 9u);
  EXPECT_LE(t, kMaxTag);
}

}  // namespace spade::transport::test

// The link factory (transport/link_factory.h) on one GPU (label gpu): a CUDA IPC pair made through the factory in one
// process echoes both ways; the shared watchdog (transport/gpu_link_watch.h) fails an unmatched receive at its
// deadline naming the peer and the operation, runs on_failure once and refuses later operations; an NCCL offer whose
// peer never joins fails at the connect deadline naming the peer.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "transport/link_factory.h"

namespace spade::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(s); }
};

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t n) { EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
};

LinkOptions ipc_options(const std::string& peer) {
  LinkOptions o;
  o.kind = LinkKind::kCudaIpc;
  o.device = 0;
  o.peer_name = peer;
  o.ipc_chunk_bytes = size_t{1} << 16;  // messages wrap the ring
  o.ipc_ring_slots = 4;
  o.connect_timeout = 5000ms;
  return o;
}

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  unsigned x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

TEST(LinkFactoryGpu, BuildHasBothGpuLinks) {
  EXPECT_TRUE(link_kind_available(LinkKind::kNccl));
  EXPECT_TRUE(link_kind_available(LinkKind::kCudaIpc));
}

TEST(LinkFactoryGpu, CudaIpcPairMadeByTheFactoryEchoesBothWays) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto offer = offer_gpu_link(ipc_options("cache rank (same process)"));
  ASSERT_EQ(offer->kind(), LinkKind::kCudaIpc);
  auto cache = join_gpu_link(offer->address(), ipc_options("inference rank (same process)"));
  auto inf = offer->connect("cache rank (named at connect)", 0ms);
  EXPECT_EQ(inf->peer_name(), "cache rank (same process)");  // CUDA IPC keeps its creation name
  EXPECT_EQ(inf->role(), PairRole::kInference);
  EXPECT_EQ(cache->role(), PairRole::kCache);
  EXPECT_THROW(offer->connect("again", 0ms), spade::Error);

  constexpr size_t kBytes = (size_t{1} << 18) + 123;  // several ring wraps, a partial last chunk
  DeviceBuffer a(kBytes), b(kBytes);
  Stream up, down;
  for (unsigned i = 0; i < 3; ++i) {
    const auto src = pattern(kBytes, i);
    ASSERT_EQ(cudaMemcpy(a.p, src.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
    inf->send(a.p, kBytes, up.s, "request");
    cache->recv(b.p, kBytes, down.s, "request");
    ASSERT_EQ(cudaStreamSynchronize(down.s), cudaSuccess) << cache->failure();
    cache->send(b.p, kBytes, down.s, "reply");
    inf->recv(a.p, kBytes, up.s, "reply");
    ASSERT_EQ(cudaStreamSynchronize(up.s), cudaSuccess) << inf->failure();
    std::vector<unsigned char> got(kBytes);
    ASSERT_EQ(cudaMemcpy(got.data(), a.p, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(got, src) << "round " << i;
  }
  ASSERT_EQ(cudaStreamSynchronize(down.s), cudaSuccess);
  const GpuLinkCounters c = inf->counters();
  EXPECT_EQ(c.sends, 3u);
  EXPECT_EQ(c.recvs, 3u);
  EXPECT_EQ(c.bytes_sent, 3 * kBytes);
  EXPECT_EQ(c.bytes_received, 3 * kBytes);
  EXPECT_FALSE(inf->failed()) << inf->failure();
  EXPECT_FALSE(cache->failed()) << cache->failure();
}

// The shared watchdog: a receive the peer never matches fails the link at its own deadline, naming the peer and the
// operation; on_failure runs once; the stream drains; later operations are refused with the failure.
TEST(LinkFactoryGpu, UnmatchedReceiveFailsAtItsDeadlineNamingPeerAndOperation) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto offer = offer_gpu_link(ipc_options("cache rank 3 (#1)"));
  auto cache = join_gpu_link(offer->address(), ipc_options("inference rank 2 (#1)"));
  auto inf = offer->connect("", 0ms);
  std::atomic<int> calls{0};
  std::string seen;
  cache->on_failure([&](const std::string& why) {
    seen = why;
    ++calls;
  });
  DeviceBuffer buf(4096);
  Stream s;
  const auto t0 = Clock::now();
  cache->recv(buf.p, 4096, s.s, "qkv of pack 5", 300ms);
  EXPECT_EQ(cache->in_flight(), 1u);
  while (!cache->failed() && Clock::now() - t0 < 10s) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(cache->failed());
  EXPECT_GE(Clock::now() - t0, 300ms);
  EXPECT_EQ(cudaStreamSynchronize(s.s), cudaSuccess);  // released: the stream drains
  const std::string f = cache->failure();
  EXPECT_NE(f.find("CUDA IPC link (cache side) to inference rank 2 (#1)"), std::string::npos) << f;
  EXPECT_NE(f.find("receive of 4096 bytes (qkv of pack 5) not complete 300 ms after it was posted"),
            std::string::npos)
      << f;
  for (int i = 0; i < 200 && calls.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(seen, f);
  EXPECT_EQ(cache->in_flight(), 0u);
  try {
    cache->send(buf.p, 4096, s.s, "selected kv");
    FAIL() << "a failed link accepted a send";
  } catch (const spade::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("inference rank 2 (#1)"), std::string::npos) << m;
    EXPECT_NE(m.find("(refused send of 4096 bytes (selected kv))"), std::string::npos) << m;
  }
  // The other end sees the abort word.
  for (int i = 0; i < 2000 && !inf->failed(); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(inf->failed());
  EXPECT_NE(inf->failure().find("the peer failed the link"), std::string::npos) << inf->failure();
  // abort() after the failure changes nothing.
  cache->abort("late");
  EXPECT_EQ(cache->failure(), f);
  EXPECT_EQ(calls.load(), 1);
}

TEST(LinkFactoryGpu, NcclOfferWhosePeerNeverJoinsFailsNamingIt) {
  LinkOptions o;
  o.kind = LinkKind::kNccl;
  o.device = 0;
  auto offer = offer_gpu_link(o);
  EXPECT_EQ(offer->kind(), LinkKind::kNccl);
  EXPECT_EQ(offer->address().size(), 256u);  // two ncclUniqueIds
  const auto t0 = Clock::now();
  try {
    offer->connect("cache rank 1 (#0) on host-b", 1500ms);
    FAIL() << "connected without a peer";
  } catch (const spade::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("NCCL link (inference side) to cache rank 1 (#0) on host-b"), std::string::npos) << m;
    EXPECT_NE(m.find("did not join within 1500 ms"), std::string::npos) << m;
  }
  EXPECT_GE(Clock::now() - t0, 1500ms);
}

}  // namespace
}  // namespace spade::transport

// CudaIpcLink (transport/cuda_ipc/cuda_ipc_link.h) on one GPU (label gpu): the cross-process cases shared with
// NcclLink (tests/transport/gpu_link_cases.h: echo, the cache-rank process SIGKILLed mid-decode, abort on request),
// both ends in one process (the single-GPU bench_tpot), ring wrap-around, a failure reaching the other end, the
// connect deadline, bad addresses and teardown.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "tests/transport/gpu_link_cases.h"
#include "transport/cuda_ipc/cuda_ipc_link.h"

namespace spade::transport::test {
namespace {

using Clock = std::chrono::steady_clock;

TEST(CudaIpcLinkProcesses, EchoAcrossProcessesWithIrregularSizes) { echo_across_processes_case(LinkKind::kIpc, 0); }

TEST(CudaIpcLinkProcesses, KilledCacheRankIsReleasedWithinTheDeadline) { killed_cache_rank_case(LinkKind::kIpc, 0); }

TEST(CudaIpcLinkProcesses, AbortOnRequestUnblocksAPendingReceive) {
  abort_unblocks_pending_receive_case(LinkKind::kIpc, 0);
}

struct Pair {
  std::unique_ptr<CudaIpcLink> inf, cache;
  explicit Pair(CudaIpcLinkOptions o) {
    inf = CudaIpcLink::create("cache rank (same process)", o);
    cache = CudaIpcLink::open(inf->address(), "inference rank (same process)", o);
    inf->connect();
  }
};

struct Streams {
  cudaStream_t s[4] = {};
  Streams() {
    for (auto& x : s) EXPECT_EQ(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), cudaSuccess);
  }
  ~Streams() {
    for (auto x : s) cudaStreamDestroy(x);
  }
};

TEST(CudaIpcLinkOneProcess, EchoesBothWaysAcrossManyRingWraps) {
  CudaIpcLinkOptions o;
  o.chunk_bytes = 64 << 10;
  o.ring_slots = 3;
  Pair p(o);
  Streams st;  // inference up / down, cache up / down
  const std::vector<size_t> sizes = {1, 300, 65536, 65537, 200000, size_t{5} << 20, 4096, 3};
  const size_t max = size_t{5} << 20;
  void *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr;
  ASSERT_EQ(cudaMalloc(&a, max), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, max), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&c, max), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d, max), cudaSuccess);
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t n = sizes[i];
    const auto up = pattern(n, static_cast<unsigned>(i)), down = pattern(n, static_cast<unsigned>(100 + i));
    ASSERT_EQ(cudaMemcpy(a, up.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(c, down.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(b, 0, n), cudaSuccess);
    ASSERT_EQ(cudaMemset(d, 0, n), cudaSuccess);
    // Receives first: they wait on the device for the sends posted after them.
    p.cache->recv(b, n, st.s[2], "qkv rows");
    p.inf->recv(d, n, st.s[1], "selected K/V");
    p.inf->send(a, n, st.s[0], "qkv rows");
    p.cache->send(c, n, st.s[3], "selected K/V");
    for (auto x : st.s) ASSERT_EQ(cudaStreamSynchronize(x), cudaSuccess);
    std::vector<unsigned char> got(n);
    ASSERT_EQ(cudaMemcpy(got.data(), b, n, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(got, up) << "up message " << i << " of " << n << " bytes";
    ASSERT_EQ(cudaMemcpy(got.data(), d, n, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(got, down) << "down message " << i << " of " << n << " bytes";
    total += n;
  }
  EXPECT_EQ(p.inf->counters().bytes_sent, total);
  EXPECT_EQ(p.inf->counters().bytes_received, total);
  EXPECT_EQ(p.cache->counters().sends, sizes.size());
  EXPECT_FALSE(p.inf->failed());
  EXPECT_FALSE(p.cache->failed());
  // Wrong device current: refused without failing the link.
  int ndev = 0;
  cudaGetDeviceCount(&ndev);
  if (ndev > 1) {
    cudaSetDevice(1);
    EXPECT_THROW(p.inf->send(a, 16, nullptr, "wrong device"), spade::Error);
    cudaSetDevice(0);
    EXPECT_FALSE(p.inf->failed());
  }
  for (void* x : {a, b, c, d}) cudaFree(x);
  const auto t0 = Clock::now();
  std::thread close_cache([&] { p.cache.reset(); });
  p.inf.reset();
  close_cache.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2000)) << "idle teardown of both ends";
}

TEST(CudaIpcLinkOneProcess, AFailureOnOneEndFailsTheOtherAndDrainsItsStreams) {
  CudaIpcLinkOptions o;
  o.op_timeout = std::chrono::milliseconds(20000);  // the peer's abort word, not a deadline, must end it
  Pair p(o);
  Streams st;
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 1 << 20), cudaSuccess);
  std::atomic<int> calls{0};
  p.inf->on_failure([&](const std::string&) { ++calls; });
  p.inf->recv(buf, 1 << 20, st.s[1], "selected K/V of pack 2", GpuLink::kNoTimeout);  // never sent
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(st.s[1]), cudaErrorNotReady);
  const auto t0 = Clock::now();
  p.cache->abort("cache rank shutting down after an error");
  EXPECT_TRUE(p.cache->failed());
  EXPECT_EQ(cudaStreamSynchronize(st.s[1]), cudaSuccess);
  for (const auto until = Clock::now() + std::chrono::milliseconds(3000); !p.inf->failed() && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(3000));
  ASSERT_TRUE(p.inf->failed());
  EXPECT_NE(p.inf->failure().find("the peer failed the link"), std::string::npos) << p.inf->failure();
  EXPECT_NE(p.inf->failure().find("cache rank (same process)"), std::string::npos) << p.inf->failure();
  EXPECT_NE(p.inf->failure().find("cache rank shutting down after an error"), std::string::npos)
      << "the peer's reason travels in the header: " << p.inf->failure();
  for (const auto until = Clock::now() + std::chrono::milliseconds(3000); calls.load() == 0 && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_THROW(p.inf->send(buf, 64, st.s[0], "after failure"), spade::Error);
  cudaFree(buf);
}

// The in-process pair's stall (docs/FIDELITY.md): posting must never wait for the peer. With receives of both ends
// pending on the device (as the cache rank's next-plan receive always is), one thread posts more operations than the
// link ever had in flight before (each needs a completion event); every post must return at once, and the data must
// arrive once the sends come.
TEST(CudaIpcLinkOneProcess, PostingManyOperationsWhileReceivesArePendingNeverWaits) {
  CudaIpcLinkOptions o;
  o.chunk_bytes = 4096;
  o.ring_slots = 64;
  Pair p(o);
  Streams st;
  constexpr int kOps = 48;  // more than any step of the pair has in flight
  constexpr size_t kBytes = 1024;
  void *src = nullptr, *dst = nullptr, *plan = nullptr;
  ASSERT_EQ(cudaMalloc(&src, kOps * kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, kOps * kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&plan, kBytes), cudaSuccess);
  const auto data = pattern(kOps * kBytes, 7);
  ASSERT_EQ(cudaMemcpy(src, data.data(), data.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  p.cache->recv(plan, kBytes, st.s[2], "the next step's plan", GpuLink::kNoTimeout);  // pending throughout
  const auto t0 = Clock::now();
  for (int i = 0; i < kOps; ++i)
    p.inf->recv(static_cast<char*>(dst) + i * kBytes, kBytes, st.s[1], "selections of a pack");
  const auto posted = Clock::now() - t0;
  EXPECT_LT(posted, std::chrono::milliseconds(1000)) << kOps << " receives posted while receives were pending";
  EXPECT_EQ(p.inf->in_flight(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i)
    p.cache->send(static_cast<char*>(src) + i * kBytes, kBytes, st.s[3], "selections of a pack");
  ASSERT_EQ(cudaStreamSynchronize(st.s[1]), cudaSuccess);
  std::vector<unsigned char> got(data.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, data);
  p.inf->send(src, kBytes, st.s[0], "the next step's plan");  // completes the pending receive
  ASSERT_EQ(cudaStreamSynchronize(st.s[2]), cudaSuccess);
  EXPECT_FALSE(p.inf->failed());
  EXPECT_FALSE(p.cache->failed());
  for (void* x : {src, dst, plan}) cudaFree(x);
}

TEST(CudaIpcLinkOneProcess, CreatorThatNobodyOpensTimesOutNamingThePeer) {
  CudaIpcLinkOptions o;
  o.connect_timeout = std::chrono::milliseconds(300);
  auto l = CudaIpcLink::create("cache rank 3 (#1)", o);
  const auto t0 = Clock::now();
  try {
    l->connect();
    FAIL() << "connected without a peer";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache rank 3 (#1)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("within 300 ms"), std::string::npos) << e.what();
  }
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(300));
  const auto t1 = Clock::now();
  l.reset();  // nobody opened it: teardown does not wait for an opener
  EXPECT_LT(Clock::now() - t1, std::chrono::milliseconds(1000));
}

TEST(CudaIpcLinkOneProcess, MalformedAddressesAndOptionsAreRefused) {
  EXPECT_THROW(CudaIpcLink::open("short", "inference rank 0"), spade::Error);
  auto l = CudaIpcLink::create("cache rank 0");
  std::string a = l->address();
  a[0] = 'X';
  try {
    CudaIpcLink::open(a, "inference rank 0 on host-a");
    FAIL() << "accepted a bad magic";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("inference rank 0 on host-a"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not a CUDA IPC link address"), std::string::npos) << e.what();
  }
  std::string b = l->address();
  b[12] ^= 0x10;  // ring_slots (after magic and version): the rings no longer match the total size
  EXPECT_THROW(CudaIpcLink::open(b, "inference rank 0"), spade::Error);
  CudaIpcLinkOptions bad;
  bad.chunk_bytes = 1000;  // not a multiple of 256
  EXPECT_THROW(CudaIpcLink::create("cache rank 0", bad), spade::Error);
  CudaIpcLinkOptions dev;
  dev.device = 4096;
  EXPECT_THROW(CudaIpcLink::create("cache rank 0", dev), spade::Error);
  // Bad operations: clear errors, the link stays healthy.
  auto c = CudaIpcLink::open(l->address(), "inference rank 0");
  EXPECT_THROW(c->send(nullptr, 8, nullptr, "null"), spade::Error);
  EXPECT_FALSE(c->failed());
}

}  // namespace
}  // namespace spade::transport::test

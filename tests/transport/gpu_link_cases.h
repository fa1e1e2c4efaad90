// The cross-process GpuLink cases (transport/gpu_link.h), shared by NcclLink on two GPUs
// (test_nccl_link_2gpu.cu, labels gpu, gpu2) and CudaIpcLink on one (test_cuda_ipc_link.cu, label gpu): this
// process is the inference side on device 0, tests/transport/gpu_link_peer_main.cpp the cache side on the peer
// device. Echo of irregular sizes, the failure case (the cache-rank process SIGKILLed mid-decode with a
// receive and a send in flight: the watchdog fails the link within op_timeout, the streams drain, the error names the
// peer, later operations are refused, the GPU stays usable), and abort on request.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "tests/transport/peer_process.h"
#include "transport/cuda_ipc/cuda_ipc_link.h"
#include "transport/nccl/nccl_link.h"

namespace spade::transport::test {

using namespace std::chrono_literals;
constexpr const char* kGpuLinkPeer = "tests/transport/transport_gpu_link_peer";

enum class LinkKind { kNccl, kIpc };
inline const char* kind_arg(LinkKind k) { return k == LinkKind::kNccl ? "nccl" : "ipc"; }

// Progress lines on stderr, so a hang shows where it stopped.
inline void trace(const std::string& what) {
  static const auto t0 = std::chrono::steady_clock::now();
  std::cerr << "[ trace   ] +"
            << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count()
            << " ms " << what << std::endl;
}

inline std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  unsigned x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

/// The child's arguments: link kind, its device, mode, message count.
inline std::vector<std::string> peer_args(LinkKind k, int peer_device, const char* mode, int n) {
  return {kind_arg(k), std::to_string(peer_device), mode, std::to_string(n)};
}

/// Makes the link's address, hands it to the child and joins the link as the inference side on device 0.
inline std::unique_ptr<GpuLink> connect_child(LinkKind kind, PeerProcess& child, const std::string& peer_name,
                                              std::chrono::milliseconds op_timeout) {
  std::unique_ptr<GpuLink> link;
  trace("joining the link");
  if (kind == LinkKind::kNccl) {
    NcclLinkOptions o;
    o.device = 0;
    o.op_timeout = op_timeout;
    const std::string address = NcclLink::new_address();
    child.write_line(to_hex(address));
    link = std::make_unique<NcclLink>(address, NcclRole::kInference, peer_name, o);
  } else {
    CudaIpcLinkOptions o;
    o.device = 0;
    o.op_timeout = op_timeout;
    o.ring_slots = 4;  // messages wrap the ring many times
    o.chunk_bytes = 1 << 20;  // 64 chunks for the 64 MiB messages of the failure case
    o.connect_timeout = 15000ms;
    auto ipc = CudaIpcLink::create(peer_name, o);
    child.write_line(to_hex(ipc->address()));
    try {
      ipc->connect();
    } catch (const std::exception& e) {
      std::string line;
      try {
        line = child.read_line(100ms);
      } catch (const std::exception&) {
      }
      throw std::runtime_error(std::string(e.what()) + "; the peer process said: " + line);
    }
    link = std::move(ipc);
  }
  trace("joined");
  const std::string line = child.read_line(20000ms);
  if (line != "CONNECTED") throw std::runtime_error("peer process: " + line);
  return link;
}

// A stream and two 2 MiB device buffers (up: what we send, down: what we receive), freed at scope exit.
struct Buffers {
  cudaStream_t s = nullptr;
  void* up = nullptr;
  void* down = nullptr;
  Buffers() {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess || cudaMalloc(&up, 1 << 21) != cudaSuccess ||
        cudaMalloc(&down, 1 << 21) != cudaSuccess)
      throw std::runtime_error("test buffers: CUDA allocation failed");
  }
  ~Buffers() {
    cudaFree(up);
    cudaFree(down);
    cudaStreamDestroy(s);
  }
};

// Sends message i up, receives the peer's XOR-0xA5 echo and checks it.
inline void echo_once(GpuLink& link, cudaStream_t s, void* up, void* down, int i) {
  const size_t n = echo_bytes(i);
  const auto src = pattern(n, static_cast<unsigned>(i));
  ASSERT_EQ(cudaMemcpy(up, src.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  link.send(up, n, s, "echo request");  // send first: one stream runs its operations in order
  link.recv(down, n, s, "echo reply");
  trace("echo " + std::to_string(i) + " posted");
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess) << link.failure();
  std::vector<unsigned char> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), down, n, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t k = 0; k < n; ++k) ASSERT_EQ(got[k], src[k] ^ 0xA5) << "message " << i << " byte " << k;
}

inline void echo_across_processes_case(LinkKind kind, int peer_device) {
  constexpr int kN = 24;
  PeerProcess child(kGpuLinkPeer, peer_args(kind, peer_device, "echo", kN));
  auto link = connect_child(kind, child, "cache rank 1 (test child)", 10000ms);
  Buffers buf;
  size_t total = 0;
  for (int i = 0; i < kN; ++i) {
    echo_once(*link, buf.s, buf.up, buf.down, i);
    total += echo_bytes(i);
    ASSERT_EQ(child.read_line(10000ms), "ECHOED " + std::to_string(i));
    if (i == kN / 2) {
      // Bad input mid-stream, while the child waits for the next message: clear errors, and the link stays healthy
      // (the echoes that follow check that it still works).
      EXPECT_THROW(link->send(nullptr, 16, buf.s, "null"), spade::Error);
      EXPECT_THROW(link->recv(buf.down, 0, buf.s, "empty"), spade::Error);
      EXPECT_FALSE(link->failed()) << link->failure();
    }
  }
  EXPECT_EQ(child.read_line(10000ms), "DONE");
  trace("child done");
  EXPECT_EQ(child.wait_exit(20000ms), 0);
  trace("child exited");
  const GpuLinkCounters c = link->counters();
  EXPECT_EQ(c.sends, static_cast<uint64_t>(kN));
  EXPECT_EQ(c.recvs, static_cast<uint64_t>(kN));
  EXPECT_EQ(c.bytes_sent, total);
  EXPECT_EQ(c.bytes_received, total);
  // The child has closed its end and exited. NCCL cannot tell a clean close from a quiet peer (the link stays
  // healthy until an operation times out); CUDA IPC sees the close in the shared header and reports it, naming
  // the peer, so the inference rank stops planning sparse steps for it.
  const auto expect_state_after_close = [&] {
    if (kind == LinkKind::kNccl) {
      EXPECT_FALSE(link->failed()) << link->failure();
      EXPECT_EQ(link->failure(), "");
    } else {
      EXPECT_TRUE(link->failed());
      EXPECT_NE(link->failure().find("cache rank 1 (test child): the peer closed the link"), std::string::npos)
          << link->failure();
    }
  };
  expect_state_after_close();
  // Bad input after the close: still clear errors, and the link's state is as it was.
  EXPECT_THROW(link->send(nullptr, 16, buf.s, "null"), spade::Error);
  EXPECT_THROW(link->recv(buf.down, 0, buf.s, "empty"), spade::Error);
  expect_state_after_close();
  trace("destroying the link");
  link.reset();
  trace("destroyed");
}

inline void killed_cache_rank_case(LinkKind kind, int peer_device) {
  using Clock = std::chrono::steady_clock;
  PeerProcess child(kGpuLinkPeer, peer_args(kind, peer_device, "echo-then-hang", 3));
  const std::string peer = "cache rank 1 (pid " + std::to_string(child.pid()) + ")";
  auto link = connect_child(kind, child, peer, 2000ms);
  std::atomic<int> callbacks{0};
  std::string cb_reason;
  link->on_failure([&](const std::string& r) {
    cb_reason = r;
    ++callbacks;
  });
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  void *up = nullptr, *down = nullptr;
  const size_t big = size_t{64} << 20;  // a pack's worth of selected K/V
  ASSERT_EQ(cudaMalloc(&up, big), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&down, big), cudaSuccess);
  for (int i = 0; i < 3; ++i) {
    echo_once(*link, s, up, down, i);
    ASSERT_EQ(child.read_line(10000ms), "ECHOED " + std::to_string(i));
  }
  ASSERT_EQ(child.read_line(10000ms), "HANG");
  // The watchdog retires completed operations within a poll period or two.
  for (const auto until = Clock::now() + 2000ms; link->in_flight() != 0 && Clock::now() < until;)
    std::this_thread::sleep_for(1ms);
  ASSERT_EQ(link->in_flight(), 0u);
  // Mid-decode: the next step's receive and this step's send are in flight when the cache rank dies, each on its
  // direction's stream as in the ranks.
  cudaStream_t s_up;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s_up, cudaStreamNonBlocking), cudaSuccess);
  link->recv(down, big, s, "selected K/V of pack 0");
  link->send(up, big, s_up, "qkv rows of pack 0");
  EXPECT_EQ(link->in_flight(), 2u);
  const auto t0 = Clock::now();
  trace("killing the child");
  child.kill9();
  EXPECT_EQ(child.wait_exit(5000ms), 128 + SIGKILL);
  trace("child reaped; synchronizing the stream");
  const cudaError_t sync = cudaStreamSynchronize(s);
  cudaStreamSynchronize(s_up);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  std::cerr << "[ " << kind_arg(kind) << "    ] stream drained " << took.count() << " ms after SIGKILL ("
            << cudaGetErrorString(sync) << "): " << link->failure() << "\n";
  EXPECT_LT(took, 2000ms + 3000ms) << "release not within op_timeout + 3 s";
  ASSERT_TRUE(link->failed());
  const std::string f = link->failure();
  EXPECT_NE(f.find(peer), std::string::npos) << f;
  // The callback runs on the watchdog thread once the link is released, which can be after the streams drained.
  for (const auto until = Clock::now() + 5000ms; callbacks.load() == 0 && Clock::now() < until;)
    std::this_thread::sleep_for(1ms);
  ASSERT_EQ(callbacks.load(), 1);
  EXPECT_EQ(cb_reason, f);  // written before the counter's increment
  try {
    link->send(up, 4096, s, "qkv rows of pack 1");
    FAIL() << "send accepted on a failed link";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find(peer), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("refused send of 4096 bytes"), std::string::npos) << e.what();
  }
  link->abort("again");  // idempotent: the first reason stays
  EXPECT_EQ(link->failure(), f);
  EXPECT_EQ(callbacks.load(), 1);
  trace("freeing");
  // The GPU memory of the failed requests is freed and the device keeps working (dense serving goes on).
  EXPECT_EQ(cudaFree(up), cudaSuccess);
  EXPECT_EQ(cudaFree(down), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s_up), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  ASSERT_EQ(cudaMemset(p, 7, 1 << 20), cudaSuccess);
  unsigned char h = 0;
  ASSERT_EQ(cudaMemcpy(&h, p, 1, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, 7);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  link.reset();  // destroying a failed link does nothing more
  trace("done");
}

inline void abort_unblocks_pending_receive_case(LinkKind kind, int peer_device) {
  using Clock = std::chrono::steady_clock;
  PeerProcess child(kGpuLinkPeer, peer_args(kind, peer_device, "echo-then-hang", 1));
  auto link = connect_child(kind, child, "cache rank 1 (test child)", 1000ms);
  Buffers buf;
  echo_once(*link, buf.s, buf.up, buf.down, 0);
  ASSERT_EQ(child.read_line(10000ms), "ECHOED 0");
  ASSERT_EQ(child.read_line(10000ms), "HANG");
  // The peer is alive but never sends; a receive without deadline (an idle server's pre-posted receive) outlives
  // op_timeout, and only abort() ends it.
  link->recv(buf.down, 1 << 20, buf.s, "selected K/V of pack 0", GpuLink::kNoTimeout);
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ(cudaStreamQuery(buf.s), cudaErrorNotReady);
  EXPECT_FALSE(link->failed()) << link->failure();
  EXPECT_EQ(link->in_flight(), 1u);
  const auto t0 = Clock::now();
  trace("abort()");
  link->abort("coordinator: PeerDown for cache rank 1");  // what the serving loop does on PeerDown
  trace("aborted; synchronizing the stream");
  cudaStreamSynchronize(buf.s);
  trace("stream drained");
  EXPECT_LT(Clock::now() - t0, 3000ms);
  EXPECT_TRUE(link->failed());
  EXPECT_NE(link->failure().find("PeerDown for cache rank 1"), std::string::npos) << link->failure();
  // The child still maps the link's memory: end it before the link (the creator frees the memory once the child
  // unmapped it or is gone).
  child.kill9();
  child.wait_exit(5000ms);
  link.reset();
}

}  // namespace spade::transport::test

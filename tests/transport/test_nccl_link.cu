// NcclLink on one GPU (label gpu): bad input and the connect deadline. The two-process tests (echo, peer killed
// mid-decode) need two GPUs and live in test_nccl_link_2gpu.cu (label gpu2).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "common/error.h"
#include "transport/nccl/nccl_link.h"

namespace spade::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The device is usable after a failed link: allocate, fill, copy back, free.
void expect_device_usable(int device) {
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  ASSERT_EQ(cudaMemset(p, 0x5c, 1 << 20), cudaSuccess);
  unsigned char h[16] = {};
  ASSERT_EQ(cudaMemcpy(h, static_cast<char*>(p) + 12345, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
  for (unsigned char c : h) EXPECT_EQ(c, 0x5c);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(NcclLinkOneGpu, AddressHasTwoUniqueIds) {
  const std::string a = NcclLink::new_address(), b = NcclLink::new_address();
  EXPECT_EQ(a.size(), NcclLink::address_size());
  EXPECT_EQ(a.size(), 256u);
  EXPECT_NE(a, b);
}

TEST(NcclLinkOneGpu, RejectsMalformedAddressNamingThePeer) {
  try {
    NcclLink link("not an address", NcclRole::kInference, "cache rank 1 (#0) on host-b");
    FAIL() << "accepted a 14-byte address";
  } catch (const spade::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cache rank 1 (#0) on host-b"), std::string::npos) << m;
    EXPECT_NE(m.find("address is 14 bytes, expected 256"), std::string::npos) << m;
  }
}

TEST(NcclLinkOneGpu, RejectsDeviceOutOfRangeAndBadOptions) {
  NcclLinkOptions o;
  o.device = 4096;
  try {
    NcclLink link(NcclLink::new_address(), NcclRole::kCache, "inference rank 0", o);
    FAIL() << "accepted device 4096";
  } catch (const spade::Error& e) {
    EXPECT_NE(std::string(e.what()).find("device 4096 out of range"), std::string::npos) << e.what();
  }
  NcclLinkOptions z;
  z.op_timeout = 0ms;
  EXPECT_THROW(NcclLink(NcclLink::new_address(), NcclRole::kCache, "inference rank 0", z), spade::Error);
}

// The peer never joins: the non-blocking init is abandoned at the deadline (communicators aborted), the error names
// the peer, and the GPU stays usable.
TEST(NcclLinkOneGpu, PeerThatNeverJoinsTimesOutAtTheDeadline) {
  NcclLinkOptions o;
  o.connect_timeout = 1500ms;
  const auto t0 = Clock::now();
  try {
    NcclLink link(NcclLink::new_address(), NcclRole::kInference, "cache rank 1 (#0) on host-b", o);
    FAIL() << "connected without a peer";
  } catch (const spade::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cache rank 1 (#0) on host-b"), std::string::npos) << m;
    EXPECT_NE(m.find("did not join within 1500 ms"), std::string::npos) << m;
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  EXPECT_GE(took, 1500ms);
  EXPECT_LT(took, 6000ms) << "abort after the connect deadline took too long";
  expect_device_usable(0);
}

}  // namespace
}  // namespace spade::transport

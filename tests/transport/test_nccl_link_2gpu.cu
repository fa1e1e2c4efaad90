// NcclLink across two processes on two GPUs (labels gpu, gpu2; run on nvidia-h200-x2): this process is the inference
// side on GPU 0, tests/transport/gpu_link_peer_main.cpp the cache side on GPU 1. The cases (echo of irregular sizes;
// the cache-rank process SIGKILLed mid-decode; abort on request) are tests/transport/gpu_link_cases.h, shared with
// CudaIpcLink on one GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "tests/transport/gpu_link_cases.h"

namespace spade::transport::test {
namespace {

void require_two_gpus() {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  ASSERT_GE(n, 2) << "this test needs two GPUs (run it on nvidia-h200-x2); bench/run_gpu.sh leaves label gpu2 out "
                     "on one-GPU machines and says so";
}

TEST(NcclLinkTwoGpu, EchoAcrossProcessesWithIrregularSizes) {
  require_two_gpus();
  echo_across_processes_case(LinkKind::kNccl, 1);
}

TEST(NcclLinkTwoGpu, KilledCacheRankIsAbortedWithinTheDeadline) {
  require_two_gpus();
  killed_cache_rank_case(LinkKind::kNccl, 1);
}

TEST(NcclLinkTwoGpu, AbortOnRequestUnblocksAPendingReceive) {
  require_two_gpus();
  abort_unblocks_pending_receive_case(LinkKind::kNccl, 1);
}

}  // namespace
}  // namespace spade::transport::test

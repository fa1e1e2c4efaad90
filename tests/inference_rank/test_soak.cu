// Soak test of the GPU serving path (tests/inference_rank/soak.h): `inference_rank --serve --device cuda` and
// `cache_rank --device cuda` as processes on the make_demo_checkpoint Qwen3 model (head_dim 64), sparse decoding from
// 64 tokens on with a budget of 64, 60 s of mixed load with the cache rank SIGKILLed at 20 s and replaced at 28 s
// (the pair re-handshakes over a fresh link). Two data planes:
//   CudaIpcOneGpu  both ranks on GPU 0, `--gpu-link ipc` (ctest inference_rank_test_soak_gpu, label gpu);
//   Nccl2Gpu       cache rank on GPU 1, `--gpu-link nccl` (ctest inference_rank_test_soak_2gpu_gpu, gpu + gpu2).
// Differences from the CPU soak: the dense outputs under load are not compared token for token with the idle
// reference (the GPU path's split-K and GEMM choices depend on the batch), and the GPU cache rank exports no
// per-sequence gauge (its pool is checked through the inference rank's KV usage and the final greedy request).
#include <cuda_runtime_api.h>

#include "tests/inference_rank/gpu_demo_checkpoint.h"
#include "tests/inference_rank/soak.h"

namespace spade::soak {
namespace {

void run_gpu_soak(const char* gpu_link, int cache_gpu) {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  ASSERT_GT(n, cache_gpu) << "the cache rank goes on GPU " << cache_gpu << " and this machine has " << n
                          << " GPU(s): this ctest entry is labelled gpu2";
  SoakSetup setup;
  setup.model = test::gpu_demo_checkpoint();
  setup.served_name = "ckpt";
  setup.inference_flags = {"--device", "cuda", "--gpu-link", gpu_link, "--max-num-seqs", "8",
                           "--max-num-batched-tokens", "256", "--selection", "predicted", "--sparse-threshold", "64",
                           "--token-budget", "64", "--layers-per-pack", "2", "--local-window", "16",
                           "--delta-capacity", "16", "--selection-deadline-ms", "3000"};
  setup.cache_flags = {"--device", "cuda", "--gpu", std::to_string(cache_gpu), "--query-window", "4"};
  // NVLink multicast stays off in NCCL (shared machines: deploy and device notes); the pair's streams need more
  // hardware queues than the default 8.
  setup.env = {{"CUDA_DEVICE_MAX_CONNECTIONS", "32"}, {"CUDA_MODULE_LOADING", "EAGER"}, {"NCCL_NVLS_ENABLE", "0"}};
  setup.duration = std::chrono::seconds(60);
  setup.kill_at = std::chrono::seconds(20);
  setup.rejoin_at = std::chrono::seconds(28);
  setup.stream_deadline = std::chrono::seconds(30);
  setup.short_max_tokens = 32;  // byte-level prompts of at most 16 tokens + 32 < the threshold 64
  setup.dense_batch_invariant = false;
  run_soak(setup);
}

TEST(SoakGpu, CudaIpcOneGpuMixedLoadWithACacheRankKillAndRejoinLosesNothing) { run_gpu_soak("ipc", 0); }

TEST(SoakGpu, Nccl2GpuMixedLoadWithACacheRankKillAndRejoinLosesNothing) { run_gpu_soak("nccl", 1); }

}  // namespace
}  // namespace spade::soak

// What the multi-process GPU cluster tests (test_gpu_cluster.cu, test_gpu_sharded_cluster.cu) share: the pair's data
// plane as a test parameter (CudaIpcOneGpu: every rank on GPU 0 over CUDA IPC; Nccl2Gpu / CudaIpc2Gpu: the cache
// ranks on GPU 1 over NCCL / over CUDA IPC with peer access, label gpu2), the ranks' environment, and a coordinator client and greedy request sized for a first CUDA
// start.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <regex>
#include <string>
#include <vector>

#include "coordinator/client.h"
#include "tests/inference_rank/cluster_client.h"

namespace spade::test {

// The pair's data plane: the inference rank's --gpu-link and the cache ranks' GPU.
struct LinkSetup {
  const char* name;
  const char* gpu_link;
  int cache_gpu;
};
inline void PrintTo(const LinkSetup& l, std::ostream* os) { *os << l.name; }

/// Every data plane, for INSTANTIATE_TEST_SUITE_P(Links, Suite, gpu_links(), link_name).
inline auto gpu_links() {
  return ::testing::Values(LinkSetup{"CudaIpcOneGpu", "ipc", 0}, LinkSetup{"Nccl2Gpu", "nccl", 1},
                           LinkSetup{"CudaIpc2Gpu", "ipc", 1});
}
inline std::string link_name(const ::testing::TestParamInfo<LinkSetup>& i) { return i.param.name; }

/// A test over each data plane; fails at set-up when the machine lacks the cache ranks' GPU.
class GpuLinkTest : public ::testing::TestWithParam<LinkSetup> {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
    ASSERT_GT(count, GetParam().cache_gpu)
        << GetParam().name << " puts the cache rank(s) on GPU " << GetParam().cache_gpu << " and this machine has "
        << count << " GPU(s): its ctest entry is labelled gpu2 (bench/run_gpu.sh leaves it out on one GPU)";
  }
};

/// The environment of rank `rank` of a world of `world_size` whose coordinator listens on `port`.
inline std::map<std::string, std::string> gpu_rank_env(int port, int rank, int world_size) {
  // NVLink multicast stays off in NCCL (shared machines: deploy and device notes).
  return {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}, {"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world_size)}, {"CUDA_DEVICE_MAX_CONNECTIONS", "32"},
          {"CUDA_MODULE_LOADING", "EAGER"}, {"NCCL_NVLS_ENABLE", "0"}};
}

/// cluster_client with room for the ranks' first CUDA start (registration 60 s, completion 90 s).
inline std::unique_ptr<coord::CoordinatorClient> gpu_cluster_client(int port) {
  return cluster_client(port, std::chrono::seconds(60), std::chrono::seconds(90));
}

/// Greedy, past EOS (noise weights may emit it early), final chunk within 120 s (a first CUDA start).
inline Outcome gpu_generate(coord::CoordinatorClient& c, const std::string& prompt, int max_tokens,
                            const std::function<void(size_t)>& on_tokens = nullptr) {
  return generate(c, prompt, max_tokens, on_tokens, GenerateOptions{true, std::chrono::seconds(120)});
}

/// The arguments of the standalone dense GPU run the cluster tests compare against: `inference_rank` on `checkpoint`,
/// 200 greedy tokens past EOS from "Once upon a time", eager (no CUDA graphs), with the clusters' engine limits (so
/// its split-K choices match theirs); its stdout is the generated text.
inline std::vector<std::string> dense_reference_args(const std::string& checkpoint) {
  return {"--model", checkpoint, "--device", "cuda", "--prompt", "Once upon a time", "--max-tokens", "200",
          "--temperature", "0", "--ignore-eos", "--log-level", "warn", "--no-cuda-graphs", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "256"};
}

/// The number logged before `what` in the last line that has it, e.g. "123 sparse sequence-steps"; -1 if none.
inline long long logged(const std::string& log, const std::string& what) {
  long long v = -1;
  const std::regex re("([0-9]+) " + what);
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator(); ++it)
    v = std::stoll((*it)[1].str());
  return v;
}

}  // namespace spade::test

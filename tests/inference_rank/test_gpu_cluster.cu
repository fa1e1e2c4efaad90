// Multi-process test of the GPU serving path: a real coordinator, `inference_rank --serve --device cuda` and
// `cache_rank --device cuda` as separate processes, the link's address going through the coordinator and the cache
// rank sized by the inference rank's pair hello. Three data planes, the same cases:
//   CudaIpcOneGpu  both ranks on GPU 0, `--gpu-link ipc` (ctest inference_rank_test_gpu_cluster_gpu, label gpu);
//   Nccl2Gpu       inference rank on GPU 0, cache rank on GPU 1, `--gpu-link nccl`;
//   CudaIpc2Gpu    the same two GPUs, `--gpu-link ipc` (the cache rank maps the rings on GPU 0 with peer access)
//                  (both in ctest inference_rank_test_gpu_cluster_2gpu_gpu, labels gpu + gpu2: two GPUs).
// The model is a make_demo_checkpoint Qwen3 checkpoint with head_dim 64 (the GPU kernels' smallest; stories260K's
// head_dim 8 runs on the CPU path only).
//
// - Sparse decoding with a budget above every context reproduces the standalone dense GPU run's text for the first
//   tokens (the prompt is 16 byte tokens and the threshold 64, so about 48 generated tokens are dense on both; the
//   reference runs eagerly with the cluster's engine limits, so its split-K choices match), the request finishes
//   with its full length, both ranks log sparse work, and the world shuts down cleanly.
// - A cache rank killed mid-request fails that request naming the cache rank, within a bounded time; the inference
//   rank stays up and serves the next request densely.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <regex>
#include <thread>

#include "coordinator/client.h"
#include "tests/inference_rank/cluster_client.h"
#include "tests/inference_rank/gpu_demo_checkpoint.h"
#include "tests/inference_rank/gpu_link_setup.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using test::bin;
using test::ChildProcess;
using test::LinkSetup;
using test::logged;
using test::Outcome;
using Clock = std::chrono::steady_clock;

// A Qwen3 demo checkpoint the GPU kernels accept (head_dim 64), written once per test binary.
const std::string& checkpoint() { return test::gpu_demo_checkpoint(); }

struct Cluster {
  explicit Cluster(LinkSetup l) : link(l) {}
  LinkSetup link;
  int port = test::free_port();
  std::unique_ptr<ChildProcess> coord, inf, cache;

  std::map<std::string, std::string> env(int rank) { return test::gpu_rank_env(port, rank, 3); }
  void start(const std::vector<std::string>& sparse_flags) {
    coord = std::make_unique<ChildProcess>(
        bin("coordinator/coordinator"),
        std::vector<std::string>{"--port", std::to_string(port), "--http-port", "0", "--num-inference", "1",
                                 "--num-cache", "1", "--rendezvous-timeout-ms", "60000", "--heartbeat-interval-ms",
                                 "200", "--heartbeat-timeout-ms", "1000"},
        env(0), "coordinator");
    std::vector<std::string> a = {"--serve", "--model", checkpoint(), "--num-inference", "1", "--num-cache", "1",
                                  "--rendezvous-timeout-ms", "60000", "--device", "cuda", "--gpu-link", link.gpu_link,
                                  "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--log-level", "info"};
    a.insert(a.end(), sparse_flags.begin(), sparse_flags.end());
    inf = std::make_unique<ChildProcess>(bin("inference_rank/inference_rank"), a, env(1), "inference rank");
    start_cache();
  }
  /// (Re)starts the cache rank (rank 2); a restart is a replacement of a dead one (rejoin).
  void start_cache() {
    if (cache) retired.push_back(std::move(cache));
    cache = std::make_unique<ChildProcess>(
        bin("cache_rank/cache_rank"),
        std::vector<std::string>{"--model", checkpoint(), "--num-inference", "1", "--num-cache", "1",
                                 "--rendezvous-timeout-ms", "60000", "--device", "cuda", "--gpu",
                                 std::to_string(link.cache_gpu), "--query-window", "4"},
        env(2), "cache rank");
  }
  std::vector<std::unique_ptr<ChildProcess>> retired;  // replaced cache ranks
  std::string logs() const {
    std::string s;
    for (const auto& p : retired) s += "---- " + p->name() + " (replaced) ----\n" + p->log();
    for (auto* p : {coord.get(), inf.get(), cache.get()})
      if (p) s += "---- " + p->name() + " ----\n" + p->log();
    return s;
  }
};

class GpuCluster : public test::GpuLinkTest {};

TEST_P(GpuCluster, SparseDecodingAcrossProcesses) {
  // Reference: the standalone dense GPU run of the same checkpoint.
  ChildProcess ref(bin("inference_rank/inference_rank"), test::dense_reference_args(checkpoint()), {},
                   "dense reference");
  ASSERT_EQ(ref.wait_exit(120s), 0) << ref.log();
  Cluster cl(GetParam());
  cl.start({"--selection", "predicted", "--sparse-threshold", "64", "--token-budget", "512", "--layers-per-pack", "2",
            "--local-window", "16", "--delta-capacity", "64"});
  auto c = test::gpu_cluster_client(cl.port);
  const Outcome o = test::gpu_generate(*c, "Once upon a time", 200);
  ASSERT_EQ(o.reason, proto::FINISH_LENGTH) << o.error << cl.logs();
  EXPECT_EQ(o.ids.size(), 200u);
  // The reference's stdout is the generated text (streamed), then a newline; the log also holds its stderr lines.
  const std::string ref_log = ref.log();
  size_t common = 0;
  while (common < o.text.size() && common < ref_log.size() && o.text[common] == ref_log[common]) ++common;
  std::printf("[ cluster  ] %zu leading bytes of the sparse cluster's text match the standalone dense GPU run\n",
              common);
  EXPECT_GE(common, 16u) << "sparse: " << o.text.substr(0, 64) << "\ndense: " << ref_log.substr(0, 64);
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(30s), 0) << cl.logs();
  EXPECT_EQ(cl.cache->wait_exit(30s), 0) << cl.logs();
  EXPECT_EQ(cl.coord->wait_exit(30s), 0) << cl.logs();
  EXPECT_GT(logged(cl.inf->log(), "sparse sequence-steps"), 100) << cl.inf->log();
  EXPECT_GT(logged(cl.cache->log(), "selections"), 100) << cl.cache->log();
  // Decode steps with the link up replayed CUDA graphs (the cache rank is another process).
  EXPECT_GT(logged(cl.inf->log(), "link-step graph replays"), 100) << cl.inf->log();
}

TEST_P(GpuCluster, KilledGpuCacheRankFailsTheSparseRequestAndServiceContinuesDensely) {
  Cluster cl(GetParam());
  cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "64", "--layers-per-pack", "2",
            "--local-window", "16", "--delta-capacity", "16", "--selection-deadline-ms", "3000"});
  auto c = test::gpu_cluster_client(cl.port);
  const auto t0 = Clock::now();
  bool killed = false;
  const Outcome o = test::gpu_generate(*c, "Once upon a time", 400, [&](size_t n) {
    if (!killed && n >= 60) {  // well past the threshold: the request is sparse now
      cl.cache->signal(SIGKILL);
      killed = true;
    }
  });
  ASSERT_TRUE(killed) << o.error << cl.logs();
  EXPECT_EQ(o.reason, proto::FINISH_ERROR) << cl.logs();
  EXPECT_THAT(o.error, HasSubstr("cache rank 2")) << "the error names the dead rank";
  EXPECT_LT(Clock::now() - t0, 30s) << "bounded failure time";
  const Outcome d = test::gpu_generate(*c, "", 120);
  EXPECT_EQ(d.reason, proto::FINISH_LENGTH) << d.error << cl.logs();
  EXPECT_EQ(d.ids.size(), 120u);
  EXPECT_TRUE(cl.inf->running());
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(30s), 0) << cl.logs();
}

// Rejoin: the cache rank SIGKILLed mid-decode is replaced by a new process on the same GPU (same rank and index);
// the inference rank offers a fresh link (NCCL: new ids, CUDA IPC: new memory) through the coordinator, swaps in a
// new controller after the pair hello, and the next request decodes sparsely again over the new link.
TEST_P(GpuCluster, KilledGpuCacheRankIsReplacedAndSparseDecodingResumes) {
  Cluster cl(GetParam());
  cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "64", "--layers-per-pack", "2",
            "--local-window", "16", "--delta-capacity", "16", "--selection-deadline-ms", "3000"});
  auto c = test::gpu_cluster_client(cl.port);
  bool killed = false;
  const Outcome o = test::gpu_generate(*c, "Once upon a time", 400, [&](size_t n) {
    if (!killed && n >= 60) {
      cl.cache->signal(SIGKILL);
      killed = true;
    }
  });
  ASSERT_TRUE(killed) << o.error << cl.logs();
  EXPECT_EQ(o.reason, proto::FINISH_ERROR) << cl.logs();
  EXPECT_THAT(o.error, HasSubstr("cache rank 2"));
  cl.start_cache();
  bool whole = false;
  for (auto until = Clock::now() + 120s; !whole && Clock::now() < until; std::this_thread::sleep_for(100ms))
    whole = cl.inf->log().find("the pair is whole again") != std::string::npos;
  ASSERT_TRUE(whole) << "the inference rank never re-paired\n" << cl.logs();
  const Outcome after = test::gpu_generate(*c, "Once upon a time", 200);
  EXPECT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  EXPECT_EQ(after.ids.size(), 200u);
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(30s), 0) << cl.logs();
  EXPECT_EQ(cl.cache->wait_exit(30s), 0) << cl.logs();
  EXPECT_EQ(cl.coord->wait_exit(30s), 0) << cl.logs();
  // The replacement selected for the request after the rejoin (its shutdown summary).
  EXPECT_GT(logged(cl.cache->log(), "selections"), 50) << cl.cache->log();
}

INSTANTIATE_TEST_SUITE_P(Links, GpuCluster, test::gpu_links(), test::link_name);

}  // namespace
}  // namespace spade

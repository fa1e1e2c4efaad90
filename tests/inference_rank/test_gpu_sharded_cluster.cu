// One GPU inference rank over N = 2 GPU cache ranks (layer shards, pair/gpu_shard.h), as processes: a real
// coordinator, `inference_rank --serve --device cuda` and two `cache_rank --device cuda`, the N link addresses going
// through the coordinator as one, each cache rank sized by its shard's pair hello. Three data planes, the same cases:
//   CudaIpcOneGpu  all three ranks on GPU 0, `--gpu-link ipc` (ctest inference_rank_test_gpu_sharded_cluster_gpu,
//                  label gpu);
//   Nccl2Gpu       inference rank on GPU 0, both cache ranks on GPU 1, `--gpu-link nccl`, one communicator pair per
//                  link; CudaIpc2Gpu: the same GPUs over `--gpu-link ipc` with peer access (both in ctest
//                  inference_rank_test_gpu_sharded_cluster_2gpu_gpu, labels gpu + gpu2).
// The model is the 4-layer make_demo_checkpoint Qwen3 checkpoint of the GPU cluster test (head_dim 64).
//
// - At a budget above every context, N = 2 with one layer per pack reproduces the standalone dense GPU run's text for
//   the first tokens (the GPU cluster test's criterion: about 48 tokens are dense on both sides, then the sparse
//   kernels' arithmetic may differ in the last bits), and exactly the N = 1 pair's greedy tokens.
// - At a small budget (64 of ~400 tokens) with packs of 3 layers (pack 0 = layers 0..2 on shard 0, pack 1 = layer 3,
//   the model's partial last pack, on shard 1), N = 2 produces exactly the N = 1 pair's greedy tokens: selection is
//   per layer and KV head, so the shards select what one cache rank selects.
// - One cache rank SIGKILLed mid-request fails that request naming it, within a bounded time; the inference rank
//   stays up and serves the next request densely, and shuts down cleanly.
// - Shard rejoin: after one shard is SIGKILLed the other ends by itself (exit 1: the coordinator told it its sibling
//   was lost); replacements of both re-pair together, and new requests decode sparsely over both again.
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

const std::string& checkpoint() { return test::gpu_demo_checkpoint(); }

// Coordinator (rank 0), inference #0 on GPU 0 (rank 1), cache #0..#N-1 on link.cache_gpu (ranks 2..N+1).
struct ShardedGpuCluster {
  ShardedGpuCluster(LinkSetup l, int num_cache) : link(l), n(num_cache) {}
  LinkSetup link;
  int n = 1;
  int port = test::free_port();
  std::unique_ptr<ChildProcess> coord, inf;
  std::vector<std::unique_ptr<ChildProcess>> caches;
  std::vector<std::unique_ptr<ChildProcess>> replaced;  // earlier incarnations (their logs)

  std::map<std::string, std::string> env(int rank) const { return test::gpu_rank_env(port, rank, 2 + n); }
  // Cache #s's process (a replacement when one ran before: the same rank, the next incarnation).
  void start_cache(int s) {
    std::vector<std::string> k = {"--model", checkpoint(), "--rendezvous-timeout-ms", "60000", "--device", "cuda",
                                  "--gpu", std::to_string(link.cache_gpu), "--query-window", "4"};
    const std::vector<std::string> w = world();
    k.insert(k.end(), w.begin(), w.end());
    auto p = std::make_unique<ChildProcess>(bin("cache_rank/cache_rank"), k, env(2 + s),
                                            "cache rank " + std::to_string(2 + s));
    if (static_cast<size_t>(s) < caches.size()) {
      replaced.push_back(std::move(caches[static_cast<size_t>(s)]));
      caches[static_cast<size_t>(s)] = std::move(p);
    } else {
      caches.push_back(std::move(p));
    }
  }
  std::vector<std::string> world() const { return {"--num-inference", "1", "--num-cache", std::to_string(n)}; }
  void start(const std::vector<std::string>& sparse_flags) {
    std::vector<std::string> c = {"--port", std::to_string(port), "--http-port", "0", "--rendezvous-timeout-ms",
                                  "60000", "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1000"};
    const std::vector<std::string> w = world();  // one vector: begin() and end() of two temporaries is no range
    c.insert(c.end(), w.begin(), w.end());
    coord = std::make_unique<ChildProcess>(bin("coordinator/coordinator"), c, env(0), "coordinator");
    std::vector<std::string> a = {"--serve", "--model", checkpoint(), "--rendezvous-timeout-ms", "60000", "--device",
                                  "cuda", "--gpu-link", link.gpu_link, "--max-num-seqs", "4",
                                  "--max-num-batched-tokens", "256", "--log-level", "info"};
    a.insert(a.end(), w.begin(), w.end());
    a.insert(a.end(), sparse_flags.begin(), sparse_flags.end());
    inf = std::make_unique<ChildProcess>(bin("inference_rank/inference_rank"), a, env(1), "inference rank");
    for (int s = 0; s < n; ++s) start_cache(s);
  }
  std::string logs() const {
    std::string s;
    for (auto* p : {coord.get(), inf.get()})
      if (p) s += "---- " + p->name() + " ----\n" + p->log();
    for (const auto& p : replaced) s += "---- " + p->name() + " (earlier incarnation) ----\n" + p->log();
    for (const auto& p : caches) s += "---- " + p->name() + " ----\n" + p->log();
    return s;
  }
  // Shuts the world down; every process exits 0 except the killed cache ranks (not running any more).
  void shutdown(coord::CoordinatorClient& c) {
    c.request_shutdown("test done");
    EXPECT_EQ(inf->wait_exit(30s), 0) << logs();
    for (auto& p : caches)
      if (p->running()) {
        EXPECT_EQ(p->wait_exit(30s), 0) << logs();
      }
    EXPECT_EQ(coord->wait_exit(30s), 0) << logs();
  }
};

// One greedy request on a fresh cluster of `n` cache ranks with `flags`; checks that it decoded sparsely on every
// shard and that the world shut down cleanly.
Outcome run(LinkSetup link, int n, const std::vector<std::string>& flags, const std::string& prompt, int tokens) {
  ShardedGpuCluster cl(link, n);
  cl.start(flags);
  auto c = test::gpu_cluster_client(cl.port);
  const Outcome o = test::gpu_generate(*c, prompt, tokens);
  EXPECT_EQ(o.reason, proto::FINISH_LENGTH) << o.error << cl.logs();
  EXPECT_EQ(o.ids.size(), static_cast<size_t>(tokens)) << cl.logs();
  cl.shutdown(*c);
  EXPECT_GT(logged(cl.inf->log(), "sparse sequence-steps"), tokens / 2) << cl.inf->log();
  EXPECT_EQ(logged(cl.inf->log(), "failed,"), 0) << cl.inf->log();
  if (n > 1) EXPECT_THAT(cl.inf->log(), HasSubstr(std::to_string(n) + " layer shards, pack p to shard p mod"));
  for (int s = 0; s < n; ++s) {
    const std::string& log = cl.caches[static_cast<size_t>(s)]->log();
    EXPECT_GT(logged(log, "selections"), tokens / 2) << "shard " << s << " selected\n" << log;
    if (n > 1) EXPECT_THAT(log, HasSubstr("layer shard " + std::to_string(s) + " of " + std::to_string(n))) << log;
  }
  return o;
}

class GpuShardedCluster : public test::GpuLinkTest {};

TEST_P(GpuShardedCluster, FullBudgetMatchesDenseAndOneCacheRank) {
  ChildProcess ref(bin("inference_rank/inference_rank"), test::dense_reference_args(checkpoint()), {},
                   "dense reference");
  ASSERT_EQ(ref.wait_exit(120s), 0) << ref.log();
  const std::vector<std::string> flags = {"--selection", "predicted", "--sparse-threshold", "64", "--token-budget",
                                          "512", "--layers-per-pack", "1", "--local-window", "16",
                                          "--delta-capacity", "64"};
  const Outcome two = run(GetParam(), 2, flags, "Once upon a time", 200);
  const std::string ref_log = ref.log();
  size_t common = 0;
  while (common < two.text.size() && common < ref_log.size() && two.text[common] == ref_log[common]) ++common;
  std::printf("[ sharded  ] %zu leading bytes of the N = 2 cluster's text match the standalone dense GPU run\n",
              common);
  EXPECT_GE(common, 16u) << "sparse: " << two.text.substr(0, 64) << "\ndense: " << ref_log.substr(0, 64);
  const Outcome one = run(GetParam(), 1, flags, "Once upon a time", 200);
  EXPECT_EQ(two.ids, one.ids) << "N = 2: " << two.text << "\nN = 1: " << one.text;
}

TEST_P(GpuShardedCluster, SmallBudgetMatchesOneCacheRank) {
  const std::vector<std::string> flags = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget",
                                          "64", "--layers-per-pack", "3", "--local-window", "16",
                                          "--delta-capacity", "16"};
  const Outcome two = run(GetParam(), 2, flags, "Once upon a time", 400);
  const Outcome one = run(GetParam(), 1, flags, "Once upon a time", 400);
  ASSERT_EQ(two.ids.size(), one.ids.size());
  size_t same = 0;
  while (same < two.ids.size() && two.ids[same] == one.ids[same]) ++same;
  EXPECT_EQ(same, one.ids.size()) << "the N = 2 and N = 1 greedy tokens part at token " << same;
}

TEST_P(GpuShardedCluster, KilledShardFailsTheSparseRequestAndServiceContinuesDensely) {
  ShardedGpuCluster cl(GetParam(), 2);
  cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "64", "--layers-per-pack", "1",
            "--local-window", "16", "--delta-capacity", "16", "--selection-deadline-ms", "3000"});
  auto c = test::gpu_cluster_client(cl.port);
  const auto t0 = Clock::now();
  bool killed = false;
  const Outcome o = test::gpu_generate(*c, "Once upon a time", 400, [&](size_t got) {
    if (!killed && got >= 60) {  // well past the threshold: the request is sparse on both shards
      cl.caches[1]->signal(SIGKILL);
      killed = true;
    }
  });
  ASSERT_TRUE(killed) << o.error << cl.logs();
  EXPECT_EQ(o.reason, proto::FINISH_ERROR) << cl.logs();
  // "<the pair's cache ranks> failed: <why>": the reason itself names the dead shard's cache rank.
  const size_t list = o.error.find("(#1) on ");
  ASSERT_NE(list, std::string::npos) << o.error;
  const size_t why = o.error.find(" failed: ", list);
  ASSERT_NE(why, std::string::npos) << o.error;
  EXPECT_THAT(o.error.substr(why), HasSubstr("cache rank 3")) << "the reason names the dead shard: " << o.error;
  EXPECT_LT(Clock::now() - t0, 30s) << "bounded failure time";
  const Outcome d = test::gpu_generate(*c, "", 120);
  EXPECT_EQ(d.reason, proto::FINISH_LENGTH) << d.error << cl.logs();
  EXPECT_EQ(d.ids.size(), 120u);
  EXPECT_TRUE(cl.inf->running());
  c->request_shutdown("test done");
  EXPECT_EQ(cl.inf->wait_exit(30s), 0) << cl.logs();
  EXPECT_EQ(cl.coord->wait_exit(30s), 0) << cl.logs();
  // The surviving shard's link was aborted with the lost one: it ends at its own deadline or at the shutdown,
  // never hanging (the coordinator's shutdown reaches it too).
  EXPECT_NE(cl.caches[0]->wait_exit(30s), -1) << cl.logs();
}

TEST_P(GpuShardedCluster, ReplacedShardsRepairTogetherAndDecodeSparselyAgain) {
  ShardedGpuCluster cl(GetParam(), 2);
  cl.start({"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "64", "--layers-per-pack", "1",
            "--local-window", "16", "--delta-capacity", "16", "--selection-deadline-ms", "3000"});
  auto c = test::gpu_cluster_client(cl.port);
  bool killed = false;
  const Outcome o = test::gpu_generate(*c, "Once upon a time", 400, [&](size_t got) {
    if (!killed && got >= 60) {
      cl.caches[1]->signal(SIGKILL);
      killed = true;
    }
  });
  ASSERT_TRUE(killed) << o.error << cl.logs();
  EXPECT_EQ(o.reason, proto::FINISH_ERROR) << cl.logs();
  // The surviving shard hears of its sibling's loss and ends by itself, so that its restart re-pairs with the other.
  const auto t_kill = Clock::now();
  EXPECT_EQ(cl.caches[0]->wait_exit(20s), 1) << cl.logs();
  EXPECT_LT(Clock::now() - t_kill, 20s);
  EXPECT_THAT(cl.caches[0]->log(), HasSubstr("another layer shard")) << cl.caches[0]->log();
  for (int s = 0; s < 2; ++s) cl.start_cache(s);
  const auto until = Clock::now() + 90s;
  while (Clock::now() < until && cl.inf->log().find("re-paired its 2 layer shards") == std::string::npos)
    std::this_thread::sleep_for(200ms);
  ASSERT_THAT(cl.inf->log(), HasSubstr("the pair is whole again: re-paired its 2 layer shards")) << cl.logs();
  // A new request decodes sparsely over both replacements, to its end.
  const Outcome after = test::gpu_generate(*c, "Once upon a time", 160);
  EXPECT_EQ(after.reason, proto::FINISH_LENGTH) << after.error << cl.logs();
  EXPECT_EQ(after.ids.size(), 160u);
  cl.shutdown(*c);
  for (int s = 0; s < 2; ++s) {
    const std::string& log = cl.caches[static_cast<size_t>(s)]->log();
    EXPECT_THAT(log, HasSubstr("layer shard " + std::to_string(s) + " of 2")) << log;
    EXPECT_GT(logged(log, "selections"), 60) << "replacement of shard " << s << " selected\n" << log;
  }
}

INSTANTIATE_TEST_SUITE_P(Links, GpuShardedCluster, test::gpu_links(), test::link_name);

}  // namespace
}  // namespace spade

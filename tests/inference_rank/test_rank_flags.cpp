// inference_rank's flags per mode (standalone or --serve, --device cpu or cuda): a flag the mode would ignore is
// refused by name before anything is loaded, allocated or connected, so these run the real binary on a CPU-only
// build too (the GPU modes' refusals included). The accepted cases get past the flag checks to the next error a
// missing checkpoint gives ("config.json: not found"), which no mode reaches before it has checked its flags.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace spade {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;

std::string exe() { return test::binary_dir() + "/inference_rank/inference_rank"; }

// No checkpoint there: a run that passes its flag checks stops at loading it.
const std::string kMissingModel = "/nonexistent/spade-test-rank-flags-model";
const char* kModelMissing = "config.json: not found";
const char* kRefused = "does not apply to";

using Args = std::vector<std::string>;

// The modes' base command lines. --serve: an identity that resolves offline (no coordinator is contacted before the
// checkpoint loads).
Args standalone(const std::string& device) { return {"--model", kMissingModel, "--device", device, "--prompt", "hi"}; }
Args serve(const std::string& device) {
  return {"--model", kMissingModel, "--device", device, "--serve", "--rank", "1", "--world-size", "3",
          "--num-inference", "1", "--num-cache", "1", "--master-addr", "127.0.0.1", "--master-port", "29999"};
}

using Exit = test::ProcessExit;

Exit run(Args args, const Args& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return test::run_to_exit(exe(), args, "inference rank", 60s);
}

// `extra` appended to `base` is refused: non-zero exit, and the error names every flag of `named`.
void expect_refused(const Args& base, const Args& extra, const std::vector<std::string>& named,
                    const std::string& mode) {
  SCOPED_TRACE(mode);
  const Exit r = run(base, extra);
  EXPECT_NE(r.rc, 0) << r.log;
  for (const std::string& f : named) EXPECT_THAT(r.log, HasSubstr(f + " does not apply to " + mode)) << r.log;
  EXPECT_THAT(r.log, Not(HasSubstr(kModelMissing))) << "refused before the checkpoint is read:\n" << r.log;
}

// `extra` appended to `base` passes the flag checks and stops at the missing checkpoint.
void expect_accepted(const Args& base, const Args& extra) {
  const Exit r = run(base, extra);
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, Not(HasSubstr(kRefused))) << r.log;
  EXPECT_THAT(r.log, HasSubstr(kModelMissing)) << r.log;
}

TEST(InferenceRankFlags, BinaryIsBuilt) {
  ASSERT_TRUE(std::filesystem::exists(exe())) << exe() << " is missing: build the inference_rank target";
}

TEST(InferenceRankFlags, StandaloneCpuRefusesGpuAndClusterFlagsByName) {
  for (const Args& extra : {Args{"--no-cuda-graphs"}, Args{"--host-sampling"}, Args{"--delta-capacity", "16"},
                            Args{"--max-context-pages", "100"}})
    expect_refused(standalone("cpu"), extra, {extra[0]}, "--device cpu");
  for (const Args& extra :
       {Args{"--rank", "1"}, Args{"--world-size", "3"}, Args{"--num-inference", "1"}, Args{"--num-cache", "1"},
        Args{"--master-addr", "127.0.0.1"}, Args{"--master-port", "29500"}, Args{"--role-map", "c,i,k"},
        Args{"--rendezvous-timeout-ms", "1000"}, Args{"--metrics-port", "8100"}, Args{"--metrics-host", "0.0.0.0"},
        Args{"--gpu", "1"}, Args{"--gpu-link", "ipc"}, Args{"--cluster-secret-file", "x"}})
    expect_refused(standalone("cpu"), extra, {extra[0]}, "a standalone run");
  // Several at once: every one is named.
  expect_refused(standalone("cpu"), {"--no-cuda-graphs", "--delta-capacity", "8"},
                 {"--no-cuda-graphs", "--delta-capacity"}, "--device cpu");
}

TEST(InferenceRankFlags, StandaloneCudaRefusesSinkTokensOracleAndClusterFlags) {
  {
    const Exit r = run(standalone("cuda"), {"--selection", "predicted", "--sink-tokens", "4"});
    EXPECT_NE(r.rc, 0) << r.log;
    EXPECT_THAT(r.log, HasSubstr("--sink-tokens 4 does not apply to --device cuda")) << r.log;
  }
  for (const char* sel : {"oracle", "quest"}) {
    // The synchronous references run in the one-process path, not in a cluster.
    const Exit r = run(serve("cuda"), {"--selection", sel});
    EXPECT_NE(r.rc, 0) << r.log;
    EXPECT_THAT(r.log, HasSubstr(std::string("--selection ") + sel + " does not apply to --serve --device cuda"))
        << r.log;
    // Standalone they select with the true query: the predicted selection's and its cache rank's knobs are refused.
    for (const Args& extra : {Args{"--query-window", "4"}, Args{"--predictor", "last"}, Args{"--anchor-queries", "0"},
                              Args{"--score-keys", "bf16"}, Args{"--delta-capacity", "16"},
                              Args{"--max-context-pages", "100"}, Args{"--selection-deadline-ms", "100"}}) {
      Args a = {"--selection", sel};
      a.insert(a.end(), extra.begin(), extra.end());
      expect_refused(standalone("cuda"), a, {extra[0]}, std::string("--selection ") + sel + " --device cuda");
    }
  }
  for (const Args& extra : {Args{"--gpu", "1"}, Args{"--gpu-link", "nccl"}, Args{"--metrics-port", "8100"},
                            Args{"--rank", "1"}})
    expect_refused(standalone("cuda"), extra, {extra[0]}, "a standalone run");
}

TEST(InferenceRankFlags, ServeRefusesPerRequestAndStandaloneFlags) {
  for (const std::string device : {"cpu", "cuda"})
    for (const Args& extra :
         {Args{"--max-tokens", "4"}, Args{"--temperature", "0"}, Args{"--top-p", "0.9"}, Args{"--top-k", "5"},
          Args{"--seed", "1"}, Args{"--chat"}, Args{"--ignore-eos"}, Args{"--random-weights"},
          Args{"--tokenizer", "/tmp"}, Args{"--host-sampling"}})
      expect_refused(serve(device), extra, {extra[0]}, "--serve");
  for (const Args& extra : {Args{"--no-cuda-graphs"}, Args{"--delta-capacity", "16"}, Args{"--gpu", "0"},
                            Args{"--gpu-link", "ipc"}, Args{"--max-context-pages", "100"}})
    expect_refused(serve("cpu"), extra, {extra[0]}, "--device cpu");
}

TEST(InferenceRankFlags, ServeCudaRefusesTheCacheRanksSelectionKnobs) {
  for (const Args& extra : {Args{"--query-window", "4"}, Args{"--ridge-eps", "0.1"}, Args{"--gqa-rule", "mean"},
                            Args{"--predictor", "paper"}, Args{"--successor-expand", "false"},
                            Args{"--anchor-queries", "32"}, Args{"--anchor-span", "8"}})
    expect_refused(serve("cuda"), extra, {extra[0]}, "--serve --device cuda");
  const Exit r = run(serve("cuda"), {"--selection", "predicted", "--sink-tokens", "2"});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--sink-tokens 2 does not apply to --device cuda")) << r.log;
}

TEST(InferenceRankFlags, TeacherForcingRefusesWhatItWouldIgnore) {
  expect_refused(serve("cpu"), {"--teacher-force", "8"}, {"--teacher-force"}, "--serve");
  for (const Args& extra : {Args{"--max-tokens", "4"}, Args{"--temperature", "0"}, Args{"--seed", "1"},
                            Args{"--ignore-eos"}, Args{"--chat"}}) {
    Args a = {"--teacher-force", "8"};
    a.insert(a.end(), extra.begin(), extra.end());
    expect_refused(standalone("cpu"), a, {extra[0]}, "--teacher-force");
  }
  const Exit r = run(standalone("cuda"), {"--teacher-force", "8"});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--teacher-force on --device cuda needs --host-sampling")) << r.log;
  expect_accepted(standalone("cpu"), {"--teacher-force", "8", "--selection", "oracle"});
  expect_accepted(standalone("cuda"), {"--teacher-force", "8", "--host-sampling", "--selection", "quest"});
}

// Overlap sampling measures the predicted selection of the cache rank in this process: refused in a cluster (its
// cache_rank samples) and with any other selection mode.
TEST(InferenceRankFlags, OverlapSamplingOnlyWithTheInProcessPredictedSelection) {
  for (const std::string device : {"cpu", "cuda"}) {
    SCOPED_TRACE(device);
    expect_refused(serve(device), {"--selection", "predicted", "--overlap-sample-every", "1"},
                   {"--overlap-sample-every"}, "--serve");
    for (const char* sel : {"dense", "oracle", "quest"})
      expect_refused(standalone(device), {"--selection", sel, "--overlap-sample-every", "1"},
                     {"--overlap-sample-every"}, std::string("--selection ") + sel);
  }
  expect_accepted(standalone("cpu"), {"--selection", "predicted", "--overlap-sample-every", "1"});
  expect_accepted(standalone("cuda"), {"--selection", "predicted", "--overlap-sample-every", "4"});
}

TEST(InferenceRankFlags, WeightsSeedNeedsRandomWeights) {
  const Exit r = run(standalone("cpu"), {"--weights-seed", "3"});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--weights-seed requires --random-weights")) << r.log;
}

TEST(InferenceRankFlags, UnknownDeviceIsRefusedByName) {
  const Exit r = run(standalone("tpu"), {});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--device must be cpu or cuda, got 'tpu'")) << r.log;
}

// Every flag a mode honours gets past the checks (to the missing checkpoint).
TEST(InferenceRankFlags, EachModeAcceptsItsOwnFlags) {
  const Args sparse = {"--sparse-threshold", "64", "--token-budget", "32", "--local-window", "8", "--layers-per-pack",
                       "2", "--selection-deadline-ms", "1000", "--page-size", "16", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "256", "--kv-cache-gib", "0.5", "--log-level", "warn"};
  const Args cpu_selection = {"--sink-tokens", "4", "--query-window", "4", "--ridge-eps", "0.1", "--gqa-rule",
                              "mean", "--predictor", "paper", "--successor-expand", "false"};
  const Args generation = {"--max-tokens", "4", "--temperature", "0", "--top-p", "0.9", "--top-k", "5", "--seed", "1",
                           "--chat", "--ignore-eos", "--random-weights", "--weights-seed", "3", "--tokenizer", "/tmp"};
  auto cat = [](std::vector<Args> parts) {
    Args a;
    for (const Args& p : parts) a.insert(a.end(), p.begin(), p.end());
    return a;
  };
  {
    SCOPED_TRACE("standalone --device cpu");
    expect_accepted(standalone("cpu"), cat({{"--selection", "oracle"}, sparse, cpu_selection, generation}));
  }
  for (const char* sel : {"oracle", "quest"}) {
    SCOPED_TRACE(std::string("standalone --device cuda --selection ") + sel);
    Args sync_sparse = sparse;  // no cache rank: no selection deadline
    const auto d = std::find(sync_sparse.begin(), sync_sparse.end(), "--selection-deadline-ms");
    sync_sparse.erase(d, d + 2);
    expect_accepted(standalone("cuda"), cat({{"--selection", sel, "--gqa-rule", "mean", "--successor-expand", "false",
                                              "--no-cuda-graphs", "--host-sampling"},
                                             sync_sparse, generation}));
  }
  {
    SCOPED_TRACE("standalone --device cuda");
    expect_accepted(standalone("cuda"),
                    cat({{"--selection", "predicted", "--sink-tokens", "0", "--query-window", "4", "--ridge-eps",
                          "0.1", "--gqa-rule", "mean", "--predictor", "paper", "--successor-expand", "false",
                          "--anchor-queries", "32", "--anchor-span", "8",
                          "--delta-capacity", "16", "--no-cuda-graphs", "--host-sampling", "--max-context-pages",
                          "100"},
                         sparse, generation}));
  }
  {
    SCOPED_TRACE("--serve --device cpu");
    expect_accepted(serve("cpu"), cat({{"--selection", "predicted", "--metrics-host", "127.0.0.1",
                                        "--rendezvous-timeout-ms", "1000"},
                                       sparse, cpu_selection}));
  }
  {
    SCOPED_TRACE("--serve --device cuda");
    expect_accepted(serve("cuda"), cat({{"--selection", "predicted", "--sink-tokens", "0", "--gpu", "0", "--gpu-link",
                                         "ipc", "--delta-capacity", "16", "--no-cuda-graphs", "--max-context-pages",
                                         "100", "--metrics-host", "127.0.0.1", "--rendezvous-timeout-ms", "1000"},
                                        sparse}));
  }
}

// Prefix caching is on by default where it applies; given explicitly where it does not, it is refused by name.
TEST(InferenceRankFlags, PrefixCachingIsRefusedWhereItDoesNotApply) {
  const std::string hybrid = test::data_path("models/tiny-random-qwen3_5");
  Exit r = run({"--model", hybrid, "--prompt", "hi", "--max-tokens", "2"}, {"--enable-prefix-caching"});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--enable-prefix-caching: not supported for hybrid")) << r.log;
  // The default turns itself off for a hybrid model, and --no-enable-prefix-caching is always accepted: the run gets
  // past the flags to the next error (this checkpoint has no tokenizer).
  for (const Args& extra : {Args{}, Args{"--no-enable-prefix-caching"}}) {
    r = run({"--model", hybrid, "--prompt", "hi", "--max-tokens", "2"}, extra);
    EXPECT_THAT(r.log, HasSubstr("tokenizer.json is required")) << r.log;
    EXPECT_THAT(r.log, Not(HasSubstr("prefix"))) << r.log;
  }
  const std::string dense = test::data_path("models/stories260K");
  r = run({"--model", dense, "--device", "cuda", "--selection", "quest", "--prompt", "hi"},
          {"--enable-prefix-caching"});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--enable-prefix-caching: not supported with --device cuda and --selection quest"))
      << r.log;
  // With a GPU cache rank it is opt-in: given, it is accepted (the run gets past the flags); not given, it is off, so
  // a retention bound is refused by name.
  r = run({"--model", dense, "--device", "cuda", "--selection", "predicted", "--prompt", "hi"},
          {"--enable-prefix-caching", "--max-retained-prefix-tokens", "4096"});
  EXPECT_THAT(r.log, Not(HasSubstr("--enable-prefix-caching"))) << r.log;
  EXPECT_THAT(r.log, Not(HasSubstr("--max-retained-prefix-tokens"))) << r.log;
  r = run({"--model", dense, "--device", "cuda", "--selection", "predicted", "--prompt", "hi"},
          {"--max-retained-prefix-tokens", "4096"});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--max-retained-prefix-tokens: needs --selection predicted with prefix caching on"))
      << r.log;
}

}  // namespace
}  // namespace spade

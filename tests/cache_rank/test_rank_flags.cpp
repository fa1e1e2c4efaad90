// cache_rank's flags per device: a flag the device would ignore is refused by name before anything is loaded or
// connected, so these run the real binary on a CPU-only build too (the GPU device's refusals included). On
// --device cuda the budget, local window, page size and pool come from the inference rank's pair hello, and the GPU
// pair has no sink tokens, always sends deltas and samples no overlap ratio; on --device cpu the GPU cache rank's own
// flags do nothing. The accepted cases get past the flag checks to the next error a missing checkpoint gives
// ("config.json: not found").
#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

std::string exe() { return test::binary_dir() + "/cache_rank/cache_rank"; }

const std::string kMissingModel = "/nonexistent/spade-test-rank-flags-model";
const char* kModelMissing = "config.json: not found";

using Args = std::vector<std::string>;

using Exit = test::ProcessExit;

Exit run(const std::string& device, const Args& extra) {
  Args args = {"--model", kMissingModel, "--device", device};
  args.insert(args.end(), extra.begin(), extra.end());
  return test::run_to_exit(exe(), args, "cache rank", 60s);
}

TEST(CacheRankFlags, BinaryIsBuilt) {
  ASSERT_TRUE(std::filesystem::exists(exe())) << exe() << " is missing: build the cache_rank target";
}

TEST(CacheRankFlags, CudaRefusesTheFlagsItTakesFromTheHelloOrDoesNotUse) {
  for (const Args& extra : {Args{"--token-budget", "64"}, Args{"--local-window", "16"}, Args{"--sink-tokens", "0"},
                            Args{"--sink-tokens", "4"}, Args{"--kv-pages", "1024"}, Args{"--page-size", "16"},
                            Args{"--delta-transfer", "false"}, Args{"--rejoin-timeout-ms", "5000"}}) {
    SCOPED_TRACE(extra[0] + " " + extra[1]);
    const Exit r = run("cuda", extra);
    EXPECT_NE(r.rc, 0) << r.log;
    EXPECT_THAT(r.log, HasSubstr(extra[0] + " does not apply to --device cuda")) << r.log;
    EXPECT_THAT(r.log, Not(HasSubstr(kModelMissing))) << "refused before the checkpoint is read:\n" << r.log;
  }
  // Several at once (the k8s CPU overlay's cache flags on a GPU rank): every one is named.
  const Exit r = run("cuda", {"--token-budget", "64", "--local-window", "32", "--sink-tokens", "0", "--kv-pages", "64",
                             "--page-size", "16"});
  EXPECT_NE(r.rc, 0) << r.log;
  for (const char* f : {"--token-budget", "--local-window", "--sink-tokens", "--kv-pages", "--page-size"})
    EXPECT_THAT(r.log, HasSubstr(std::string(f) + " does not apply to --device cuda")) << r.log;
}

TEST(CacheRankFlags, CpuRefusesTheGpuCacheRanksFlags) {
  for (const Args& extra : {Args{"--gpu", "1"}, Args{"--hello-timeout-ms", "1000"}, Args{"--selection-streams", "1"}}) {
    SCOPED_TRACE(extra[0]);
    const Exit r = run("cpu", extra);
    EXPECT_NE(r.rc, 0) << r.log;
    EXPECT_THAT(r.log, HasSubstr(extra[0] + " does not apply to --device cpu")) << r.log;
    EXPECT_THAT(r.log, Not(HasSubstr(kModelMissing))) << r.log;
  }
}

TEST(CacheRankFlags, UnknownDeviceIsRefusedByName) {
  const Exit r = run("tpu", {});
  EXPECT_NE(r.rc, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--device must be cpu or cuda, got 'tpu'")) << r.log;
}

// Every flag a device honours gets past the checks (to the missing checkpoint).
TEST(CacheRankFlags, EachDeviceAcceptsItsOwnFlags) {
  const Args common = {"--query-window", "4", "--ridge-eps", "0.1", "--gqa-rule", "mean", "--predictor", "paper",
                       "--successor-expand", "false", "--anchor-queries", "32", "--anchor-span", "8",
                       "--metrics-host", "127.0.0.1", "--rendezvous-timeout-ms",
                       "1000", "--log-level", "warn", "--num-inference", "1", "--num-cache", "1"};
  for (const std::string device : {"cpu", "cuda"}) {
    SCOPED_TRACE(device);
    Args extra = common;
    const Args own = device == "cpu"
                         ? Args{"--token-budget", "64", "--local-window", "16", "--sink-tokens", "4", "--kv-pages",
                                "1024", "--page-size", "16", "--delta-transfer", "false", "--overlap-sample-every", "4",
                                "--rejoin-timeout-ms", "5000"}
                         : Args{"--gpu", "0", "--hello-timeout-ms", "1000", "--selection-streams", "1",
                                "--overlap-sample-every", "4"};
    extra.insert(extra.end(), own.begin(), own.end());
    const Exit r = run(device, extra);
    EXPECT_NE(r.rc, 0) << r.log;
    EXPECT_THAT(r.log, Not(HasSubstr("does not apply to"))) << r.log;
    EXPECT_THAT(r.log, HasSubstr(kModelMissing)) << r.log;
  }
}

}  // namespace
}  // namespace spade

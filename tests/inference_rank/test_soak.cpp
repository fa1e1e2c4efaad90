// Soak test of the serving cluster on the CPU (tests/inference_rank/soak.h): stories260K, the pair over UCX, sparse
// decoding from 32 tokens on with a budget of 16, 24 s of mixed load with the cache rank SIGKILLed at 8 s and
// replaced at 12 s.
#include "tests/inference_rank/soak.h"

namespace spade::soak {
namespace {

TEST(Soak, MixedLoadWithCancelsBadRequestsAndACacheRankKillAndRejoinLosesNothing) {
  SoakSetup setup;
  setup.model = test::data_path("models/stories260K");
  setup.served_name = "stories260K";
  // Sparse decoding from 32 tokens on with a budget of 16: sequences past the threshold really do use the cache rank.
  setup.inference_flags = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16",
                           "--layers-per-pack", "2"};
  setup.cache_flags = {"--token-budget", "16"};
  run_soak(setup);
}

}  // namespace
}  // namespace spade::soak

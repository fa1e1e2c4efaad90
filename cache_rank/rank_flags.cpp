// The cache_rank binary's flags (rank_flags.h): registration and the refusals by device.
#include "cache_rank/rank_flags.h"

#include "common/error.h"

namespace spade::cache_rank_cli {

void refuse_unused_flags(const CLI::App& app, const std::string& device) {
  if (device != "cpu" && device != "cuda") spade::fail("--device must be cpu or cuda, got '{}'", device);
  spade::pair::FlagRefusals r(app);
  if (device == "cpu") {
    r.refuse("--device cpu", {"--gpu", "--hello-timeout-ms", "--selection-streams", "--score-keys"},
             "it configures the GPU cache rank");
  } else {
    r.refuse("--device cuda", {"--token-budget", "--local-window", "--kv-pages", "--page-size"},
             "the GPU cache rank takes the budget, the local window, the page size and its pool from the inference "
             "rank's pair hello");
    r.refuse("--device cuda", {"--sink-tokens"},
             "the GPU pair attends no sink tokens of its own: they compete in the top-k");
    r.refuse("--device cuda", {"--delta-transfer"},
             "the GPU pair always sends deltas, of the inference rank's --delta-capacity");
    r.refuse("--device cuda", {"--rejoin-timeout-ms"},
             "the GPU cache rank exits when its inference rank dies (its own restart re-pairs with the replacement)");
  }
  r.check();
}

void add_flags(CLI::App& app, Flags& f) {
  app.add_option("--model", f.model_dir, "checkpoint directory (config.json is read for the shapes)")->required();
  spade::pair::add_sparse_flags(app, f.sparse, f.sparse_text,
                                spade::pair::kSelectionFlags | spade::pair::kDeltaTransferFlag |
                                    spade::pair::kScoreKeysFlag | spade::pair::kOverlapSampleFlag);
  app.add_option("--kv-pages", f.kv_pages,
                 "KV pool size in pages of every layer; a layer shard (N cache ranks per inference rank) holds "
                 "fewer layers and gets as many more pages in the same memory")
      ->check(CLI::PositiveNumber);
  app.add_option("--page-size", f.page_size, "tokens per page")->check(CLI::PositiveNumber);
  spade::coord::add_launch_flags(app, f.lf);
  app.add_option("--rendezvous-timeout-ms", f.rendezvous_ms, "deadline for the whole world to register");
  app.add_option("--log-level", f.log_level, "trace|debug|info|warn|error|off");
  app.add_option("--metrics-port", f.metrics_port, "serve /metrics, /health, /ready on this port (0 = off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-host", f.metrics_host, "address of the metrics endpoint")->capture_default_str();
  app.add_option("--device", f.device,
                 "cpu (the CPU selector over UCX) | cuda (the GPU server over NCCL / CUDA IPC, paired with "
                 "inference_rank --serve --device cuda; its shapes and limits come from the inference rank's hello)");
  app.add_option("--gpu", f.gpu_index, "--device cuda: the CUDA device of this rank")->check(CLI::NonNegativeNumber);
  app.add_option("--hello-timeout-ms", f.hello_timeout_ms,
                 "--device cuda: longest wait for the inference rank's pair hello (it loads its weights first)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--rejoin-timeout-ms", f.rejoin_timeout_ms,
                 "--device cpu, after the paired inference rank died: longest wait for its replacement (same index) "
                 "to register, then exit 1 naming it; the replacement is served with a fresh KV pool")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--selection-streams", f.selection_streams,
                 "--device cuda: 3 pipelines the packs' selections (scoring beside the previous pack's top-k and "
                 "gather; a second set of scores in device memory), 1 runs them in order on one stream")
      ->check(CLI::IsMember({1, 3}))
      ->capture_default_str();
}

}  // namespace spade::cache_rank_cli

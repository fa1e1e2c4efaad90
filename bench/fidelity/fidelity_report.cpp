// fidelity_report: the command line. What it measures and how: fidelity_report.h and docs/FIDELITY.md.
#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "bench/fidelity/fidelity_report.h"
#include "common/error.h"
#include "common/logging.h"

int main(int argc, char** argv) {
  using spade::fidelity::report::Options;
  CLI::App app{
      "fidelity_report: overlap of AsyncSpade's predicted-query selection with the true-query selection "
      "(AsyncSpade Eq. 1) and greedy agreement of sparse decoding; see docs/FIDELITY.md"};
  Options o;
  const char* env = std::getenv("SPADE_DATA_DIR");
  o.data_dir = env && *env ? env : SPADE_DEFAULT_DATA_DIR;
  std::string out_dir = std::string(SPADE_SOURCE_DIR) + "/bench/results";
  std::string log_level = "warn";
  app.add_option("--data-dir", o.data_dir,
                 "shared data directory (default: $SPADE_DATA_DIR, else ../shared/data)");
  auto* out_opt = app.add_option("--out-dir", out_dir,
                                 "where fidelity_<model>.json is written; \"\" = nowhere "
                                 "(default: bench/results; with --quick: nowhere)");
  app.add_option("--models", o.models, "stories | qwen | all")
      ->check(CLI::IsMember({"stories", "qwen", "all"}));
  app.add_flag("--quick", o.quick,
               "a fast subset (3 stories prompts x 200 tokens, 2 qwen prompts, no sweep) for tests");
  // A whole-number option that must be > 0 (>= 0 where zero_ok).
  auto count = [&app](const char* flag, int& value, const char* help, bool zero_ok = false) {
    app.add_option(flag, value, help)
        ->check(zero_ok ? CLI::Validator(CLI::NonNegativeNumber) : CLI::Validator(CLI::PositiveNumber));
  };
  count("--sparse-threshold", o.threshold, "context length from which steps are measured / decoded sparsely");
  count("--sink-tokens", o.sinks, "S: first tokens attended anyway, never selected", true);
  count("--local-window", o.local_window, "R: most recent tokens attended anyway, never selected");
  app.add_option("--budgets", o.budgets, "token budgets as fractions of the candidates (first one: sweeps)")
      ->check(CLI::Range(1e-6, 1.0));
  count("--layers-per-pack", o.layers_per_pack, "layers per pack of the SparseAttention runs");
  app.add_option("--stories-prompts", o.stories_prompts, "story openings used (1..9)")
      ->check(CLI::Range(1, 9));
  count("--stories-max-tokens", o.stories_max_tokens, "tokens generated per story");
  count("--qwen-max-tokens", o.qwen_max_tokens, "tokens generated per qwen prompt");
  count("--qwen-plumbing-prompts", o.qwen_plumbing_prompts, "qwen prompts given the budget >= context check",
        true);
  count("--qwen-plumbing-tokens", o.qwen_plumbing_tokens, "tokens generated in that check");
  count("--qwen-hidden", o.qwen_hidden, "synthetic Qwen3 hidden size");
  count("--qwen-intermediate", o.qwen_intermediate, "synthetic Qwen3 MLP width");
  count("--qwen-layers", o.qwen_layers, "synthetic Qwen3 layers");
  count("--qwen-heads", o.qwen_heads, "synthetic Qwen3 query heads");
  count("--qwen-kv-heads", o.qwen_kv_heads, "synthetic Qwen3 KV heads");
  count("--qwen-head-dim", o.qwen_head_dim, "synthetic Qwen3 head_dim");
  app.add_option("--qwen-seed", o.qwen_seed, "seed of the synthetic weights");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off");
  CLI11_PARSE(app, argc, argv);
  if (o.quick) {
    o.stories_prompts = std::min(o.stories_prompts, 3);
    o.stories_max_tokens = std::min(o.stories_max_tokens, 200);
    o.qwen_max_tokens = std::min(o.qwen_max_tokens, 24);
    o.qwen_plumbing_prompts = std::min(o.qwen_plumbing_prompts, 1);
    o.sweep = false;
    if (out_opt->count() == 0) out_dir.clear();
  }
  o.out_dir = out_dir;
  try {
    spade::init_logging("fidelity_report", log_level);
    const auto t0 = spade::fidelity::report::Clock::now();
    bool ok = true;
    if (o.models == "stories" || o.models == "all") ok = spade::fidelity::report::run_stories(o) && ok;
    if (o.models == "qwen" || o.models == "all") ok = spade::fidelity::report::run_qwen(o) && ok;
    fmt::print("\nfidelity_report: {} in {:.1f} s\n", ok ? "all checks passed" : "CHECKS FAILED",
               spade::fidelity::report::seconds_since(t0));
    return ok ? 0 : 1;
  } catch (const spade::Error& e) {
    fmt::print(stderr, "fidelity_report: error: {}\n", e.what());
    return 2;
  }
}

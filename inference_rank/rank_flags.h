// The inference_rank binary's flags: every flag in one struct (InferenceRankFlags), registered once on the CLI11 app
// (add_flags), then checked and resolved before anything is loaded (refuse_unused_flags, resolve_flags): a flag the
// mode (standalone or --serve, --device cpu or cuda) would ignore is refused by name, and the derived settings
// (the selection mode, the sparse flags' text forms, the KV budget, prefix caching) are filled in. The sparse flags
// are the pair's (pair/selection_flags.h); the engine limits are EngineOptions (inference_rank/engine.h).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "common/sampling.h"
#include "coordinator/launch_env.h"
#include "inference_rank/engine.h"
#include "inference_rank/serve.h"
#include "inference_rank/sparse_attention.h"
#include "pair/selection_flags.h"

namespace spade::inference_rank_cli {

/// Every flag of the binary, in one place (registered by add_flags, checked by refuse_unused_flags, completed by
/// resolve_flags).
struct Flags {
  std::string model_dir, log_level = "warn";
  std::vector<std::string> prompts;  // standalone: one request each ("" = the BOS token alone)
  int max_tokens = 128;
  spade::SamplingParams sp;  // temperature < 0: unset, generation_config.json decides
  bool chat = false, ignore_eos = false;
  spade::EngineOptions eo;
  bool serve = false;
  std::string selection = "dense";
  spade::SparseOptions so;  // the pair's sparse settings (pair/selection_flags.h) and this rank's selection mode
  spade::pair::SparseFlagText sparse_text;
  int deadline_ms = 10000;
  spade::coord::LaunchFlags lf;
  int rendezvous_ms = 30000;
  std::string metrics_host = "0.0.0.0";
  int metrics_port = 0;
  std::string device = "cpu", tokenizer_dir;
  bool random_weights = false, no_cuda_graphs = false;
  double kv_gib = 0;  // 0: the engine's default KV budget
  uint64_t weights_seed = 0;
  int gpu_index = 0;
  std::string gpu_link = "nccl";
  bool host_sampling = false;
  int teacher_force = 0;  // standalone: the last N tokens of each prompt are forced (GenerateRequest::forced_tokens)
  bool prefix_caching = true;  // --enable-prefix-caching / --no-enable-prefix-caching (EngineOptions)
};

/// Registers every flag on `app`, writing into `f` (CLI11 fills it when `app` parses).
void add_flags(CLI::App& app, Flags& f);

/// Refuses, by name, every flag the user gave that this mode would ignore (and a GPU run's nonzero --sink-tokens or
/// CPU-only --selection), before anything is loaded, allocated or connected: CPU-only builds refuse the GPU modes'
/// flags the same way (tests/inference_rank/test_rank_flags.cpp). `app`: parsed. Throws spade::Error naming each one
/// (and "--device must be cpu or cuda" for another device).
void refuse_unused_flags(const CLI::App& app, bool serve, const std::string& device, SelectionMode mode,
                         const pair::SparseConfig& sparse);

/// After refuse_unused_flags (f.so.mode set) and init_logging: fills the settings derived from the flags (the
/// selection deadline, the sparse flags' text forms, --kv-cache-gib in bytes, prefix caching, which reads
/// --model's config.json). Throws spade::Error naming the flag for --max-context-pages without --device cuda
/// --selection predicted, --enable-prefix-caching where it does not apply, and sparse decoding with
/// --max-num-batched-tokens < --max-num-seqs.
void resolve_flags(const CLI::App& app, Flags& f);

/// The --serve options of resolved flags `f` (inference_rank/serve.h).
ServeOptions serve_options(const Flags& f);

}  // namespace spade::inference_rank_cli

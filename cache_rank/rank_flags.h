// The cache_rank binary's flags: every flag in one struct (Flags), registered once on the CLI11 app (add_flags) and
// checked before anything is loaded or connected (refuse_unused_flags: a flag the device would ignore, e.g.
// --token-budget with --device cuda or --gpu with --device cpu, is refused by name). The selection flags are the
// pair's (pair/selection_flags.h).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "coordinator/launch_env.h"
#include "pair/selection_flags.h"

namespace spade::cache_rank_cli {

/// Every flag of the binary, in one place (registered by add_flags, checked by refuse_unused_flags).
struct Flags {
  std::string model_dir, log_level = "info";
  spade::pair::SparseConfig sparse;  // the pair's settings (pair/selection_flags.h)
  spade::pair::SparseFlagText sparse_text;
  int kv_pages = 16384, page_size = 16, rendezvous_ms = 30000;  // --device cpu: the KV pool
  spade::coord::LaunchFlags lf;
  int metrics_port = 0;
  std::string metrics_host = "0.0.0.0";
  std::string device = "cpu";
  int gpu_index = 0;
  int hello_timeout_ms = 600000;
  int rejoin_timeout_ms = 600000;
  int selection_streams = 3;
};

/// Registers every flag on `app`, writing into `f` (CLI11 fills it when `app` parses).
void add_flags(CLI::App& app, Flags& f);

/// Refuses, by name, every flag the user gave that `device` would ignore, before anything is loaded or connected
/// (CPU-only builds refuse the GPU device's flags the same way: tests/cache_rank/test_rank_flags.cpp). `app`: parsed.
/// Throws spade::Error naming each one (and "--device must be cpu or cuda" for another device).
void refuse_unused_flags(const CLI::App& app, const std::string& device);

}  // namespace spade::cache_rank_cli

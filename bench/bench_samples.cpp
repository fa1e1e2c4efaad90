// bench_samples: n samples of one prompt on the GPU pair (the test-time-scaling workload: self-consistency,
// best-of-N) against n separate requests of that prompt, on one GPU: the inference rank (Engine over
// GpuEngineForward, on-device sampling) and its cache rank in this process (cache_rank/gpu_local.h, over CUDA IPC),
// sparse decoding with the pair's settings, as `inference_rank --device cuda --selection predicted` serves.
//
// Runs, each on a fresh engine and cache rank:
//   1 request            the prompt once: the TTFT floor of the samples (they cannot start before one prefill)
//   n separate requests  the prompt n times, submitted together
//   n samples            Engine::submit_samples: the group prefills the prompt's whole pages once, the samples hold
//                        them on the inference rank and fork them on the cache rank (pair/gpu_plan.h, Forks)
//   prefix cache         one request of the prompt, then the same prompt again once it ended, prefix caching on: the
//                        repeat reuses the cached prefix here and forks the prefix the cache rank retained (all but
//                        the last prefix_recompute_tokens prompt tokens: neither computed nor shipped again)
// Per run: TTFT (submission to each sequence's first token: mean and max), TPOT (each sequence's first to last
// token over its tokens after the first: mean), output throughput (every generated token over the run's wall time),
// the peak KV pages and bytes of each rank (the cache
// rank's counted by its allocator, shared pages once), the tokens the inference rank shipped to the cache rank, the
// sequences that switched to sparse decoding, the forks. The floor of the KV beside it: the prompt's whole pages once
// plus each sample's tail pages. Ratios: separate / samples (above 1: the samples hold, ship or wait less).
// Random bf16 weights of a real config (--config DIR with config.json) and random prompt ids: content does not change
// what is held or shipped; sampling at temperature 0.8 (top-k 50), one seed per sequence.
//
// Usage: bench_samples --config DIR [--prompt 8192] [--samples 8] [--tokens 128] [--max-batched-tokens 2048]
//                      [--page-size 16] [--seed 1] [--label NAME] [--out results.jsonl]
//                      [the pair's flags: --token-budget, --local-window, --sparse-threshold (default: the prompt),
//                       --layers-per-pack, --delta-capacity, --score-keys, --query-window, ...]
// Exits non-zero (naming the run) when a sequence fails, a run does not decode sparsely, or the samples did not fork.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench/run_stamp.h"
#include "cache_rank/gpu_local.h"
#include "cache_rank/gpu_server.h"
#include "common/config.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_model.h"
#include "inference_rank/gpu_sparse.h"
#include "inference_rank/sparse_attention.h"
#include "kernels/device.h"
#include "pair/selection_flags.h"

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using spade::Engine;
using spade::EngineOptions;
using spade::ModelConfig;

struct Opts {
  std::string config, label, out;
  int prompt = 8192, samples = 8, tokens = 128, max_batched = 2048, page_size = 16;
  uint64_t seed = 1;
  spade::SparseOptions sparse;  // the pair's settings, mode predicted (its prefix_recompute_tokens, as serving)
};

struct Run {
  std::string name;
  int sequences = 0;
  uint64_t prefix_hit_tokens = 0;  // prompt tokens the engine reused from its prefix cache
  double ttft_mean_s = 0, ttft_max_s = 0, tpot_mean_ms = 0, output_tokens_per_s = 0, e2e_s = 0;
  int inference_peak_pages = 0;
  uint64_t cache_peak_pages = 0, cache_tokens = 0, forks = 0, switches = 0, sparse_seq_steps = 0, bytes_up = 0;
};

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// One run: `requests` requests of `n` samples each (n > 1: submit_samples); with `names` of two or more entries that
// many rounds, one after the other on the same engine and cache rank with prefix caching on (a Run per round, its
// counters the round's own).
std::vector<Run> run(const Opts& o, const ModelConfig& cfg, const std::vector<int32_t>& prompt,
                     const std::vector<std::string>& names, int requests, int n) {
  const std::string& name = names.front();
  const bool caching = names.size() > 1;
  EngineOptions eo;
  eo.page_size = o.page_size;
  eo.max_num_seqs = requests * n;
  eo.max_num_batched_tokens = o.max_batched;
  eo.max_model_len = o.prompt + o.tokens + o.page_size;
  const int pages_per_seq = (o.prompt + o.tokens + o.page_size - 1) / o.page_size;
  eo.num_pages = requests * n * pages_per_seq + 1;
  eo.prefix_recompute_tokens = o.sparse.prefix_recompute_tokens();
  eo.enable_prefix_caching = caching;
  spade::GpuEngineOptions go = spade::gpu_engine_options(eo, /*cuda_graphs=*/true);
  go.link_graphs = false;  // the cache rank runs in this process (gpu_engine.h GpuEngineOptions::link_graphs)
  spade::GpuEngineForward gpu(spade::GpuModel::random(cfg, o.seed, spade::GpuEngineForward::model_options(go)), go);
  spade::GpuEngineForward* g = &gpu;
  Engine engine(cfg, eo,
                spade::ForwardSampleFn([g](const spade::ForwardBatch& b, const std::vector<spade::RowSampling>& r,
                                           std::vector<int32_t>& t, std::vector<spade::TokenLogprobs>& l) {
                  g->sample(b, r, t, l);
                }));
  gpu.warm_up();  // before the in-process cache rank exists (gpu_engine.h)
  const ModelConfig attn = cfg.attention_view();
  // Prefix caching: the cache rank retains up to one prompt (pages) of ended sequences.
  const spade::GpuSparseOptions so = spade::gpu_sparse_options(o.sparse, engine.options(), "the in-process cache rank",
                                                               caching ? o.prompt + o.page_size : 0);
  auto cache_rank = std::make_unique<spade::cache::LocalGpuCacheRank>(attn, o.sparse, 0);
  auto ctl = std::make_unique<spade::GpuSparseController>(attn, so, cache_rank->inference_link(), eo.page_size,
                                                          gpu.max_batch());
  ctl->send_hello(spade::make_gpu_pair_hello(attn, so, engine.options()));
  cache_rank->wait_ready(std::chrono::milliseconds(60000));
  gpu.set_sparse(ctl.get());
  engine.set_attention_hooks(ctl.get());

  spade::GenerateRequest req;
  req.prompt_ids = prompt;
  req.max_tokens = o.tokens;
  req.ignore_eos = true;
  req.sampling.temperature = 0.8f;
  req.sampling.top_k = 50;
  req.sampling.seed = o.seed * 1000;
  const int total = requests * n;
  std::vector<Run> rounds;
  for (const std::string& round_name : names) {
    std::vector<double> ttft(static_cast<size_t>(total), -1.0), last(static_cast<size_t>(total), -1.0);
    std::vector<int> got(static_cast<size_t>(total), 0);
    std::string error;
    std::map<uint64_t, int> index;
    const spade::GpuSparseStats ss0 = ctl->stats();
    const uint64_t hits0 = engine.stats().prefix_hit_tokens;
    const Clock::time_point t0 = Clock::now();
    auto cb = [&](const spade::TokenEvent& ev) {
      const int i = index.at(ev.request_id);
      if (ev.token >= 0) {
        const double t = seconds(t0, Clock::now());
        if (got[static_cast<size_t>(i)]++ == 0) ttft[static_cast<size_t>(i)] = t;
        last[static_cast<size_t>(i)] = t;
      }
      if (ev.finished && ev.reason != spade::FinishReason::Length && error.empty())
        error = "sequence " + std::to_string(ev.request_id) + " ended early: " + ev.error;
    };
    std::vector<uint64_t> ids;
    for (int r = 0; r < requests; ++r) {
      spade::GenerateRequest q = req;
      q.sampling.seed = req.sampling.seed + static_cast<uint64_t>(r);
      if (n > 1) {
        for (uint64_t id : engine.submit_samples(q, n, cb)) ids.push_back(id);
      } else {
        ids.push_back(engine.submit(q, cb));
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) index[ids[i]] = static_cast<int>(i);
    int low = engine.pages().num_free_pages();
    while (engine.step()) low = std::min(low, engine.pages().num_free_pages());
    const Clock::time_point t1 = Clock::now();
    SPADE_CHECK(error.empty(), "bench_samples ({}): {}", round_name, error);
    const spade::GpuSparseStats ss = ctl->stats();
    SPADE_CHECK(ss.switches - ss0.switches == static_cast<uint64_t>(total) && ss.failed_seqs == 0,
                "bench_samples ({}): {} of {} sequences switched to sparse decoding ({} failed); lower "
                "--sparse-threshold below the prompt plus the tokens",
                round_name, ss.switches - ss0.switches, total, ss.failed_seqs);
    Run out;
    out.name = round_name;
    out.sequences = total;
    double sum = 0, mx = 0, tpot = 0;
    for (int i = 0; i < total; ++i) {
      const double t = ttft[static_cast<size_t>(i)];
      sum += t;
      mx = std::max(mx, t);
      tpot += (last[static_cast<size_t>(i)] - t) / (o.tokens - 1);
    }
    out.ttft_mean_s = sum / total;
    out.ttft_max_s = mx;
    out.tpot_mean_ms = tpot / total * 1e3;
    out.e2e_s = seconds(t0, t1);
    out.output_tokens_per_s = static_cast<double>(total) * o.tokens / std::max(out.e2e_s, 1e-9);
    out.inference_peak_pages = engine.pages().num_pages() - low;
    out.switches = ss.switches - ss0.switches;
    out.sparse_seq_steps = ss.sparse_seq_steps - ss0.sparse_seq_steps;
    out.bytes_up = ss.bytes_sent - ss0.bytes_sent;
    out.prefix_hit_tokens = engine.stats().prefix_hit_tokens - hits0;
    rounds.push_back(out);
  }
  ctl->close();
  cache_rank->stop();
  const std::string server_error = cache_rank->error();
  const spade::cache::GpuCacheStats cs = cache_rank->stats();
  gpu.set_sparse(nullptr);
  engine.set_attention_hooks(nullptr);
  SPADE_CHECK(server_error.empty(), "bench_samples ({}): the cache rank failed: {}", name, server_error);
  SPADE_CHECK(n == 1 || cs.forks == static_cast<uint64_t>(requests * (n - 1)),
              "bench_samples ({}): the cache rank forked {} samples, expected {}", name, cs.forks, requests * (n - 1));
  SPADE_CHECK(!caching || cs.retained_hits == names.size() - 1,
              "bench_samples ({}): {} rounds forked a retained prefix, expected {}", name, cs.retained_hits,
              names.size() - 1);
  // The cache rank's counters cover the whole run: with one round they are the round's; with several (one request
  // each) a round shipped every token it computed, its prompt less the reused prefix and its tokens but the last.
  if (rounds.size() == 1) {
    rounds.front().cache_peak_pages = cs.peak_pages_held;
    rounds.front().cache_tokens = cs.tokens_appended;
    rounds.front().forks = cs.forks;
  } else {
    uint64_t sum = 0;
    for (Run& r : rounds) {
      r.cache_tokens = static_cast<uint64_t>(total) * (o.prompt + o.tokens - 1) - r.prefix_hit_tokens;
      r.cache_peak_pages = cs.peak_pages_held;
      sum += r.cache_tokens;
    }
    SPADE_CHECK(n == 1 && sum == cs.tokens_appended,
                "bench_samples ({}): the cache rank appended {} tokens, the rounds computed {}", name,
                cs.tokens_appended, sum);
  }
  return rounds;
}

}  // namespace

int main(int argc, char** argv) {
  // Both ranks in one process (cache_rank/gpu_local.h), as inference_rank sets them.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  Opts o;
  CLI::App app{"bench_samples: n samples of one prompt against n separate requests on the GPU pair"};
  app.add_option("--config", o.config, "model directory with config.json (random weights)")->required();
  app.add_option("--prompt", o.prompt, "prompt tokens")->check(CLI::PositiveNumber);
  app.add_option("--samples", o.samples, "n")->check(CLI::Range(2, 256));
  app.add_option("--tokens", o.tokens, "tokens generated per sequence")->check(CLI::Range(2, 1 << 20));
  app.add_option("--max-batched-tokens", o.max_batched, "the engine's tokens per step")->check(CLI::PositiveNumber);
  app.add_option("--page-size", o.page_size, "KV page size")->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "weights and sampling seed");
  app.add_option("--label", o.label, "a name for this run in the JSON");
  app.add_option("--out", o.out, "append the JSON document to this file");
  spade::pair::SparseFlagText text;
  spade::pair::add_sparse_flags(app, o.sparse, text,
                                spade::pair::kSelectionFlags | spade::pair::kScheduleFlags |
                                    spade::pair::kDeltaCapacityFlag | spade::pair::kScoreKeysFlag);
  CLI11_PARSE(app, argc, argv);
  try {
    spade::pair::resolve_sparse_flags(text, o.sparse);
    if (app.get_option("--sparse-threshold")->count() == 0) o.sparse.sparse_threshold = o.prompt;
    const ModelConfig cfg = spade::load_model_config(o.config);
    cudaDeviceProp prop{};
    spade::cuda_check(cudaGetDeviceProperties(&prop, 0), "device properties");
    std::mt19937_64 rng(o.seed);
    std::vector<int32_t> prompt(static_cast<size_t>(o.prompt));
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
    const int n = o.samples;
    std::vector<Run> runs;
    for (const auto& [names, requests, per] :
         std::vector<std::tuple<std::vector<std::string>, int, int>>{
             {{"1 request"}, 1, 1},
             {{"n separate requests"}, n, 1},
             {{"n samples"}, 1, n},
             {{"prefix cache: first", "prefix cache: repeat"}, 1, 1}})
      for (const Run& r : run(o, cfg, prompt, names, requests, per)) runs.push_back(r);
    const ModelConfig attn = cfg.attention_view();
    const double inf_page_bytes =
        2.0 * attn.num_layers * attn.num_kv_heads * attn.head_dim * 2.0 * o.page_size;  // bf16 K and V
    const double cache_page_bytes =
        static_cast<double>(spade::cache::gpu_cache_page_bytes(attn, o.page_size, o.sparse.selection.score_keys));
    const int shared_pages = std::max(0, o.prompt - o.sparse.prefix_recompute_tokens()) / o.page_size;
    const int pages_per_seq = (o.prompt + o.tokens - 1 + o.page_size - 1) / o.page_size;
    const int floor_pages = shared_pages + n * (pages_per_seq - shared_pages);
    json doc;
    doc["bench"] = "bench_samples";
    doc["device"] = prop.name;
    spade::bench::stamp_run(doc);
    if (!o.label.empty()) doc["label"] = o.label;
    doc["config"] = o.config;
    doc["settings"] = {{"prompt", o.prompt},
                       {"samples", n},
                       {"tokens", o.tokens},
                       {"page_size", o.page_size},
                       {"max_batched_tokens", o.max_batched},
                       {"token_budget", o.sparse.selection.token_budget},
                       {"local_window", o.sparse.selection.local_window},
                       {"sparse_threshold", o.sparse.sparse_threshold},
                       {"layers_per_pack", o.sparse.layers_per_pack},
                       {"delta_capacity", o.sparse.effective_delta_capacity()},
                       {"prefix_recompute_tokens", o.sparse.prefix_recompute_tokens()},
                       {"sampling", "temperature 0.8, top-k 50"}};
    json rows = json::array();
    std::printf("%-20s %5s %10s %10s %9s %10s %9s %10s %10s %10s %6s\n", "run", "seqs", "TTFT mean", "TTFT max",
                "TPOT ms", "out tok/s", "e2e s", "inf MB", "cache MB", "cache toks", "forks");
    for (const Run& r : runs) {
      rows.push_back({{"run", r.name},
                      {"sequences", r.sequences},
                      {"ttft_mean_s", r.ttft_mean_s},
                      {"ttft_max_s", r.ttft_max_s},
                      {"tpot_mean_ms", r.tpot_mean_ms},
                      {"output_tokens_per_s", r.output_tokens_per_s},
                      {"e2e_s", r.e2e_s},
                      {"inference_peak_pages", r.inference_peak_pages},
                      {"inference_peak_kv_bytes", r.inference_peak_pages * inf_page_bytes},
                      {"cache_peak_pages", r.cache_peak_pages},
                      {"cache_peak_kv_bytes", static_cast<double>(r.cache_peak_pages) * cache_page_bytes},
                      {"cache_tokens_appended", r.cache_tokens},
                      {"bytes_up", r.bytes_up},
                      {"forks", r.forks},
                      {"prefix_hit_tokens", r.prefix_hit_tokens},
                      {"switches", r.switches},
                      {"sparse_seq_steps", r.sparse_seq_steps}});
      std::printf("%-20s %5d %10.3f %10.3f %9.2f %10.1f %9.2f %10.1f %10.1f %10llu %6llu\n", r.name.c_str(),
                  r.sequences, r.ttft_mean_s, r.ttft_max_s, r.tpot_mean_ms, r.output_tokens_per_s, r.e2e_s,
                  r.inference_peak_pages * inf_page_bytes / 1e6,
                  static_cast<double>(r.cache_peak_pages) * cache_page_bytes / 1e6,
                  static_cast<unsigned long long>(r.cache_tokens), static_cast<unsigned long long>(r.forks));
    }
    doc["runs"] = rows;
    const Run& sep = runs[1];
    const Run& smp = runs[2];
    doc["floor"] = {{"what", "the cache rank's KV of n samples: the prompt's whole pages once + each sample's tail"},
                    {"cache_pages", floor_pages},
                    {"cache_kv_bytes", floor_pages * cache_page_bytes},
                    {"ttft_s", runs[0].ttft_max_s},
                    {"ttft_what", "one request of the prompt, measured in this run"}};
    doc["ratio"] = {{"what", "n separate requests / n samples"},
                    {"cache_peak_kv", static_cast<double>(sep.cache_peak_pages) / std::max<uint64_t>(smp.cache_peak_pages, 1)},
                    {"inference_peak_kv", static_cast<double>(sep.inference_peak_pages) /
                                              std::max(smp.inference_peak_pages, 1)},
                    {"tokens_shipped", static_cast<double>(sep.cache_tokens) / std::max<uint64_t>(smp.cache_tokens, 1)},
                    {"bytes_up", static_cast<double>(sep.bytes_up) / std::max<uint64_t>(smp.bytes_up, 1)},
                    {"ttft_max", sep.ttft_max_s / std::max(smp.ttft_max_s, 1e-9)},
                    {"tpot_mean", sep.tpot_mean_ms / std::max(smp.tpot_mean_ms, 1e-9)},
                    {"e2e", sep.e2e_s / std::max(smp.e2e_s, 1e-9)}};
    const Run& first = runs[3];
    const Run& repeat = runs[4];
    doc["prefix_cache_ratio"] = {{"what", "first request / its repeat from the prefix cache (retained on the cache rank)"},
                                 {"ttft", first.ttft_max_s / std::max(repeat.ttft_max_s, 1e-9)},
                                 {"tokens_shipped", static_cast<double>(first.cache_tokens) /
                                                        std::max<uint64_t>(repeat.cache_tokens, 1)},
                                 {"repeat_prefix_hit_tokens", repeat.prefix_hit_tokens}};
    std::printf("prefix cache: the repeat's TTFT %.3f s against %.3f s (%.1fx), %llu prompt tokens reused, %llu tokens "
                "shipped against %llu\n",
                repeat.ttft_max_s, first.ttft_max_s, doc["prefix_cache_ratio"]["ttft"].get<double>(),
                static_cast<unsigned long long>(repeat.prefix_hit_tokens),
                static_cast<unsigned long long>(repeat.cache_tokens),
                static_cast<unsigned long long>(first.cache_tokens));
    doc["samples_over_floor"] = {
        {"cache_pages", static_cast<double>(smp.cache_peak_pages) / floor_pages},
        {"ttft_max", smp.ttft_max_s / std::max(runs[0].ttft_max_s, 1e-9)}};
    std::printf("separate / samples: cache KV %.2fx, inference KV %.2fx, tokens shipped %.2fx, TTFT max %.2fx, "
                "TPOT %.2fx, e2e %.2fx; samples' cache KV %.2fx its floor (%d pages), TTFT max %.2fx one request's\n",
                doc["ratio"]["cache_peak_kv"].get<double>(), doc["ratio"]["inference_peak_kv"].get<double>(),
                doc["ratio"]["tokens_shipped"].get<double>(), doc["ratio"]["ttft_max"].get<double>(),
                doc["ratio"]["tpot_mean"].get<double>(), doc["ratio"]["e2e"].get<double>(),
                doc["samples_over_floor"]["cache_pages"].get<double>(),
                floor_pages, doc["samples_over_floor"]["ttft_max"].get<double>());
    if (!o.out.empty()) {
      std::ofstream f(o.out, std::ios::app);
      SPADE_CHECK(f.good(), "bench_samples: cannot write {}", o.out);
      f << doc.dump() << "\n";
    }
  } catch (const spade::Error& e) {
    std::fprintf(stderr, "bench_samples: %s\n", e.what());
    return 1;
  }
  return 0;
}

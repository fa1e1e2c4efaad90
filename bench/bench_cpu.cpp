// bench_cpu: the CPU data path's prefill and decode FLOP rates on a real checkpoint, beside the floor they are held
// to: the BLAS's own SGEMM rate (kernels/linear_ref.h) measured in the same run on the model's largest GEMM shape.
//
//   bench_cpu [--model DIR] [--prefill 2048,7680] [--decode-context 2048] [--decode-batch 1,8] [--decode-steps 8]
//             [--shared-prompt 2048] [--samples 8] [--sample-tokens 32] [--sparse-samples] [--sparse-repeat]
//             [sparse flags] [--out FILE.json]
//
// --model defaults to $SPADE_DATA_DIR/models/longctx-22m. Prefill: one sequence of N tokens in one chunk (a token
// sequence drawn from the vocabulary), dense paged attention, logits of the last token. Decode: B sequences at the
// given context, the median step of --decode-steps. FLOPs counted: 2 per multiply-add of every linear layer (the LM
// head on the rows whose logits are taken) plus causal attention, 4 * head_dim * q_heads per (query, visible key) pair.
// Shared prompts (the engine, greedy, page size 16): TTFT of a --shared-prompt-token prompt cold and again from the
// prefix cache (its peer: the same repeat with prefix caching off); and --samples samples of that prompt
// (Engine::submit_samples, the prompt's KV stored once) against as many separate requests submitted together: peak KV
// pages, time to every first token, decode tokens/s.
// --sparse-samples: the same n samples against n separate requests (and n samples with the shared INIT off) on the
// CPU sparse pair (bench/sparse_pair.h: predicted selection, the cache rank served by a thread over a loopback
// transport, the pair's wire as between the processes), on both ranks: peak KV pages and bytes (fp32 K and V of every
// layer per page on either rank), bytes to the cache rank (INIT bulk ship, appends) and back (selections), time to
// every first token, total time, decode tokens/s (tokens after the last first token over the time after it), and
// separate / samples ratios. The sparse settings are the ranks' flags (pair/selection_flags.h: --token-budget,
// --local-window, --sparse-threshold, --layers-per-pack, --delta-transfer, ...); the threshold must let the samples
// switch (below --shared-prompt + --sample-tokens). An empty --prefill / --decode-batch skips that section.
// --sparse-repeat: on the same CPU sparse pair with prefix caching, a request of the --shared-prompt prompt runs to
// its end, then the same prompt again, with retained prefixes on (SparseOptions::max_retained_prefix_tokens default)
// and off (0), each on a fresh pair in the same run: the repeat's bytes to the cache rank, its INIT's tokens shipped
// and shared, TTFT, the switch step (first to second token: the INIT ship) and its total time; its tokens must match.
// The JSON carries date, commit (SPADE_COMMIT), the CPU, the BLAS and every figure beside the SGEMM floor.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/run_stamp.h"
#include "bench/sparse_pair.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/model.h"
#include "inference_rank/sparse_attention.h"
#include "kernels/linear_ref.h"
#include "pair/selection_flags.h"

namespace {

using Clock = std::chrono::steady_clock;
using spade::ForwardBatch;
using spade::KvCache;
using spade::Model;
using spade::ModelConfig;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// Multiply-adds of the linear layers per token (the LM head excluded).
double linear_macs_per_token(const Model& m) {
  double macs = 0;
  for (const auto& L : m.weights().layers)
    macs += static_cast<double>(L.qkv_w.size() + L.o_w.size() + L.in_proj_w.size() + L.out_proj_w.size() +
                                L.gate_up_w.size() + L.down_w.size());
  return macs;
}

// FLOPs of one forward: `tokens` new tokens, `pairs` (query, visible key) pairs summed over the batch, `logit_rows`.
double forward_flops(const Model& m, double tokens, double pairs, double logit_rows) {
  const ModelConfig& c = m.config();
  const double attn = 4.0 * c.head_dim * c.num_q_heads * pairs * c.num_attention_layers();
  return 2.0 * linear_macs_per_token(m) * tokens + 2.0 * c.vocab_size * c.hidden_size * logit_rows + attn;
}

// Best of `reps` SGEMMs y[m, n] = x[m, k] · w[n, k]ᵀ through linear_ref, in GFLOP/s.
double sgemm_gflops(int m, int n, int k, int reps) {
  std::vector<float> x(static_cast<size_t>(m) * k, 0.5f), w(static_cast<size_t>(n) * k, 0.25f),
      y(static_cast<size_t>(m) * n);
  spade::kernels::linear_ref(x.data(), w.data(), nullptr, y.data(), m, n, k);  // warm-up (thread pool, pages)
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    spade::kernels::linear_ref(x.data(), w.data(), nullptr, y.data(), m, n, k);
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * m * n * k / best / 1e9;
}

// A batch of `lens.size()` sequences whose contexts end at lens[b], each contributing its last q_lens[b] tokens.
ForwardBatch make_batch(const std::vector<int>& lens, const std::vector<int>& q_lens, int page_size, int vocab,
                        std::mt19937& rng) {
  ForwardBatch fb;
  int max_pages = 0;
  for (int len : lens) max_pages = std::max(max_pages, (len + page_size - 1) / page_size);
  fb.max_pages = max_pages;
  fb.cu_q_lens.push_back(0);
  int next_page = 0;
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int i = lens[b] - q_lens[b]; i < lens[b]; ++i) {
      fb.tokens.push_back(tok(rng));
      fb.positions.push_back(i);
    }
    fb.cu_q_lens.push_back(fb.cu_q_lens.back() + q_lens[b]);
    fb.seq_lens.push_back(lens[b]);
    fb.seq_ids.push_back(b + 1);
    for (int p = 0; p < max_pages; ++p)
      fb.block_table.push_back(p < (lens[b] + page_size - 1) / page_size ? next_page++ : -1);
    fb.logit_rows.push_back(fb.cu_q_lens.back() - 1);
  }
  return fb;
}

// "a,b,c" -> {a, b, c}; "" -> {}. Throws spade::Error naming `flag` for an item that is not an integer.
std::vector<int> parse_list(const std::string& s, const char* flag) {
  std::vector<int> out;
  size_t at = 0;
  while (at < s.size()) {
    const size_t comma = s.find(',', at);
    const std::string item = s.substr(at, comma - at);
    size_t used = 0;
    try {
      out.push_back(std::stoi(item, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    SPADE_CHECK(used > 0 && used == item.size(), "{} '{}': '{}' is not an integer", flag, s, item);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

// One engine run of `requests` (a request is `n` samples when n > 1): seconds to the first token of every sequence,
// seconds to the end, generated tokens (of those, generated after every sequence had its first), the most KV pages
// held at once, the first error a sequence ended with ("" if none).
struct EngineRun {
  double all_first_s = 0, total_s = 0;
  int generated = 0, after_all_first = 0, peak_pages = 0;
  std::string error;
};
EngineRun run_engine(spade::Engine& e, const std::vector<int32_t>& prompt, int requests, int n, int tokens) {
  spade::GenerateRequest r;
  r.prompt_ids = prompt;
  r.max_tokens = tokens;
  r.sampling.temperature = 1.0f;
  r.ignore_eos = true;
  EngineRun out;
  int firsts = 0, sequences = 0;
  std::vector<bool> seen;
  const auto t0 = Clock::now();
  auto cb = [&](const spade::TokenEvent& ev) {
    if (ev.finished && !ev.error.empty() && out.error.empty())
      out.error = "request " + std::to_string(ev.request_id) + ": " + ev.error;
    if (ev.token < 0) return;
    ++out.generated;
    if (firsts == sequences) ++out.after_all_first;
    if (ev.request_id >= seen.size()) seen.resize(ev.request_id + 1, false);
    if (!seen[ev.request_id]) {
      seen[ev.request_id] = true;
      if (++firsts == sequences) out.all_first_s = seconds_since(t0);
    }
  };
  for (int i = 0; i < requests; ++i) {
    r.sampling.seed = static_cast<uint64_t>(i) * 1000;
    sequences += n;
    if (n > 1) e.submit_samples(r, n, cb); else e.submit(r, cb);
  }
  while (!e.idle()) {
    e.step();
    out.peak_pages = std::max(out.peak_pages, e.pages().num_pages() - e.pages().num_free_pages());
  }
  out.total_s = seconds_since(t0);
  return out;
}

// --sparse-repeat (header comment): rows into doc["sparse_repeat"]. Throws spade::Error when a request failed, did
// not decode sparsely, or the repeat's tokens differ between retention on and off.
void run_sparse_repeat(const Model& model, spade::EngineOptions eo, spade::SparseOptions so,
                       const std::vector<int32_t>& prompt, int tokens, nlohmann::json& doc) {
  eo.enable_prefix_caching = true;
  eo.max_num_seqs = 1;
  std::vector<int32_t> first_tokens;
  nlohmann::json rows;
  for (const bool retain : {false, true}) {
    so.max_retained_prefix_tokens = retain ? spade::SparseOptions{}.max_retained_prefix_tokens : 0;
    spade::bench::LoopbackSparsePair pair(model, eo, so, true);
    auto* sparse = dynamic_cast<spade::SparseAttention*>(&pair.engine().attention());
    SPADE_CHECK(sparse != nullptr && sparse->link() != nullptr, "--sparse-repeat: no sparse backend");
    struct Run {
      std::vector<int32_t> tokens;
      std::vector<double> at;  // seconds since submit of each token
      double total_s = 0;
      uint64_t bytes_to_cache = 0;
      std::string error;
    };
    auto run = [&]() {
      Run out;
      spade::GenerateRequest r;
      r.prompt_ids = prompt;
      r.max_tokens = tokens;
      r.sampling.temperature = 0.f;
      r.ignore_eos = true;
      const uint64_t before = sparse->link()->stats().bytes_sent;
      const auto t0 = Clock::now();
      pair.engine().submit(r, [&](const spade::TokenEvent& ev) {
        if (ev.finished && !ev.error.empty()) out.error = ev.error;
        if (ev.token < 0) return;
        out.tokens.push_back(ev.token);
        out.at.push_back(seconds_since(t0));
      });
      while (!pair.engine().idle()) pair.engine().step();
      sparse->idle_flush();  // the release (and retain) of the request, as the rank's idle loop sends it
      out.total_s = seconds_since(t0);
      out.bytes_to_cache = sparse->link()->stats().bytes_sent - before;
      SPADE_CHECK(out.error.empty() && out.tokens.size() >= 2, "--sparse-repeat: request failed: {}", out.error);
      return out;
    };
    const Run a = run();
    const spade::SparseStats st_a = sparse->stats();
    const Run b = run();
    const spade::SparseStats& st = sparse->stats();
    SPADE_CHECK(st.switches == 2 && st.failed_seqs == 0 && st.dense_fallbacks == 0,
                "--sparse-repeat: {} of 2 requests switched to sparse decoding", st.switches);
    if (first_tokens.empty()) first_tokens = b.tokens;
    SPADE_CHECK(b.tokens == first_tokens, "--sparse-repeat: the repeat's tokens differ with retained prefixes {}",
                retain ? "on" : "off");
    (void)pair.finish();
    nlohmann::json row = {
        {"retained_prefixes", retain},
        {"max_retained_prefix_tokens", so.max_retained_prefix_tokens},
        {"prompt_tokens", prompt.size()},
        {"tokens", tokens},
        {"first", {{"ttft_s", a.at[0]}, {"switch_step_s", a.at[1] - a.at[0]}, {"total_s", a.total_s},
                   {"bytes_to_cache_rank", a.bytes_to_cache}}},
        {"repeat",
         {{"ttft_s", b.at[0]},
          {"switch_step_s", b.at[1] - b.at[0]},
          {"total_s", b.total_s},
          {"bytes_to_cache_rank", b.bytes_to_cache},
          {"init_tokens", st.init_tokens - st_a.init_tokens},
          {"init_shared_tokens", st.init_shared_tokens - st_a.init_shared_tokens},
          {"retained_reused_tokens", st.retained_reused_tokens - st_a.retained_reused_tokens},
          {"prefix_hit_tokens", pair.engine().stats().prefix_hit_tokens}}}};
    std::printf("sparse repeat, retained prefixes %-3s: repeat of a %zu-token prompt: %.1f MB to the cache rank "
                "(first request %.1f MB), INIT shared %llu of %llu tokens; TTFT %.3f s, switch step %.3f s, %d tokens "
                "in %.2f s\n",
                retain ? "on" : "off", prompt.size(), b.bytes_to_cache / 1e6, a.bytes_to_cache / 1e6,
                static_cast<unsigned long long>(st.init_shared_tokens - st_a.init_shared_tokens),
                static_cast<unsigned long long>(st.init_tokens - st_a.init_tokens), b.at[0], b.at[1] - b.at[0],
                static_cast<int>(b.tokens.size()), b.total_s);
    rows.push_back(std::move(row));
  }
  doc["sparse_repeat_settings"] = {{"selection", "predicted"},
                                   {"sparse_threshold", so.sparse_threshold},
                                   {"token_budget", so.selection.token_budget},
                                   {"local_window", so.selection.local_window},
                                   {"query_window", so.selection.query_window},
                                   {"anchor_queries", so.selection.anchor_queries},
                                   {"layers_per_pack", so.layers_per_pack},
                                   {"delta_transfer", so.delta_transfer},
                                   {"page_size", eo.page_size},
                                   {"prefix_caching", true},
                                   {"temperature", 0},
                                   {"repeat_tokens_identical", true},
                                   {"transport", "loopback (in process), cache rank on its own thread"}};
  doc["sparse_repeat"] = rows;
}

// --sparse-samples: n separate requests, n samples with the shared INIT off, and n samples, each on a fresh CPU
// sparse pair (bench/sparse_pair.h) with engine options `eo`; rows into doc["sparse_samples"], the separate / samples
// ratios into doc["sparse_samples_ratio"]. Throws spade::Error when a sequence failed or did not decode sparsely.
void run_sparse_samples(const Model& model, const ModelConfig& attn_cfg, const spade::EngineOptions& eo,
                        const spade::SparseOptions& so, const std::vector<int32_t>& prompt, int samples,
                        int sample_tokens, nlohmann::json& doc) {
  struct Mode {
    const char* name;
    bool grouped, shared_init;
  };
  const double page_bytes = static_cast<double>(KvCache::page_bytes(attn_cfg, eo.page_size));
  nlohmann::json rows;
  for (const Mode m : {Mode{"n separate requests", false, true}, Mode{"n samples, shared INIT off", true, false},
                       Mode{"n samples (submit_samples)", true, true}}) {
    spade::bench::LoopbackSparsePair pair(model, eo, so, m.shared_init);
    const EngineRun r = m.grouped ? run_engine(pair.engine(), prompt, 1, samples, sample_tokens)
                                  : run_engine(pair.engine(), prompt, samples, 1, sample_tokens);
    SPADE_CHECK(r.error.empty(), "--sparse-samples ({}): {}", m.name, r.error);
    const spade::bench::CacheRankTally t = pair.finish();
    const spade::SparseStats& st = pair.sparse().stats();
    SPADE_CHECK(st.switches == static_cast<uint64_t>(samples) && st.dense_fallbacks == 0 && st.failed_seqs == 0,
                "--sparse-samples ({}): {} of {} sequences switched to sparse decoding ({} dense "
                "fallbacks, {} failed)",
                m.name, st.switches, samples, st.dense_fallbacks, st.failed_seqs);
    const double decode_s = r.total_s - r.all_first_s;
    nlohmann::json row = {
        {"mode", m.name},
        {"n", samples},
        {"prompt_tokens", prompt.size()},
        {"tokens_per_sample", sample_tokens},
        {"inference_rank", {{"peak_kv_pages", r.peak_pages}, {"peak_kv_bytes", r.peak_pages * page_bytes}}},
        {"cache_rank", {{"peak_kv_pages", t.peak_pages}, {"peak_kv_bytes", t.peak_pages * page_bytes}}},
        {"bytes_to_cache_rank",
         {{"total", t.to_cache_bytes}, {"init_bulk_ship", t.init_bytes}, {"appends_and_headers", t.append_bytes}}},
        {"bytes_to_inference_rank", t.to_inference_bytes},
        {"updates", t.updates},
        {"init_tokens", st.init_tokens},
        {"init_shared_tokens", st.init_shared_tokens},
        {"shared_inits", st.shared_inits},
        {"sparse_seq_steps", st.sparse_seq_steps},
        {"selection_stalls", st.stalls},
        {"selection_stall_ms", st.stall_ms},
        {"all_first_tokens_s", r.all_first_s},
        {"total_s", r.total_s},
        {"generated_tokens", r.generated},
        {"tokens_per_s", r.generated / r.total_s},
        {"decode_tokens", r.after_all_first},
        {"decode_tokens_per_s", decode_s > 0 ? r.after_all_first / decode_s : 0.0}};
    std::printf("sparse %-26s n=%d: peak KV %5d pages (%.1f MB) inference, %5d (%.1f MB) cache rank; to cache "
                "%.1f MB (INIT %.1f MB); all first tokens %.2f s, %d tokens in %.2f s, decode %.1f tok/s\n",
                m.name, samples, r.peak_pages, r.peak_pages * page_bytes / 1e6, t.peak_pages,
                t.peak_pages * page_bytes / 1e6, t.to_cache_bytes / 1e6, t.init_bytes / 1e6, r.all_first_s,
                r.generated, r.total_s, row["decode_tokens_per_s"].get<double>());
    rows.push_back(std::move(row));
  }
  doc["sparse_samples_settings"] = {{"selection", "predicted"},
                                    {"sparse_threshold", so.sparse_threshold},
                                    {"token_budget", so.selection.token_budget},
                                    {"local_window", so.selection.local_window},
                                    {"sink_tokens", so.selection.sink_tokens},
                                    {"query_window", so.selection.query_window},
                                    {"anchor_queries", so.selection.anchor_queries},
                                    {"layers_per_pack", so.layers_per_pack},
                                    {"delta_transfer", so.delta_transfer},
                                    {"page_size", eo.page_size},
                                    {"max_num_batched_tokens", eo.max_num_batched_tokens},
                                    {"transport", "loopback (in process), cache rank on its own thread"}};
  doc["sparse_samples"] = rows;
  // Separate requests over n samples (shared INIT on): above 1 = the samples hold, ship or take less (for the decode
  // tokens/s: below 1 = the samples decode faster).
  const nlohmann::json &sep = rows.front(), &grp = rows.back();
  auto ratio = [](const nlohmann::json& a, const nlohmann::json& b) {
    return b.get<double>() > 0 ? a.get<double>() / b.get<double>() : 0.0;
  };
  doc["sparse_samples_ratio"] = {
      {"what", "n separate requests / n samples (shared INIT on)"},
      {"inference_peak_kv_pages", ratio(sep["inference_rank"]["peak_kv_pages"], grp["inference_rank"]["peak_kv_pages"])},
      {"cache_peak_kv_pages", ratio(sep["cache_rank"]["peak_kv_pages"], grp["cache_rank"]["peak_kv_pages"])},
      {"bytes_to_cache_rank", ratio(sep["bytes_to_cache_rank"]["total"], grp["bytes_to_cache_rank"]["total"])},
      {"init_bulk_ship_bytes",
       ratio(sep["bytes_to_cache_rank"]["init_bulk_ship"], grp["bytes_to_cache_rank"]["init_bulk_ship"])},
      {"all_first_tokens_s", ratio(sep["all_first_tokens_s"], grp["all_first_tokens_s"])},
      {"total_s", ratio(sep["total_s"], grp["total_s"])},
      {"decode_tokens_per_s", ratio(sep["decode_tokens_per_s"], grp["decode_tokens_per_s"])}};
  std::printf("sparse separate / samples: inference peak %.2fx, cache rank peak %.2fx, bytes to cache %.2fx, all "
              "first tokens %.2fx, total %.2fx, decode tok/s %.2fx\n",
              doc["sparse_samples_ratio"]["inference_peak_kv_pages"].get<double>(),
              doc["sparse_samples_ratio"]["cache_peak_kv_pages"].get<double>(),
              doc["sparse_samples_ratio"]["bytes_to_cache_rank"].get<double>(),
              doc["sparse_samples_ratio"]["all_first_tokens_s"].get<double>(),
              doc["sparse_samples_ratio"]["total_s"].get<double>(),
              doc["sparse_samples_ratio"]["decode_tokens_per_s"].get<double>());
}

int main(int argc, char** argv) {
  CLI::App app{"bench_cpu: CPU prefill / decode FLOP rates against the BLAS SGEMM rate"};
  std::string model_dir, out_path, prefill_list = "2048,7680", batch_list = "1,8";
  int decode_context = 2048, decode_steps = 8, page_size = 16, shared_prompt = 2048, samples = 8, sample_tokens = 32;
  app.add_option("--model", model_dir, "checkpoint directory (default $SPADE_DATA_DIR/models/longctx-22m)");
  app.add_option("--prefill", prefill_list, "prompt lengths to prefill, comma-separated")->capture_default_str();
  app.add_option("--decode-context", decode_context, "context length of the decode sequences")->capture_default_str();
  app.add_option("--decode-batch", batch_list, "decode batch sizes, comma-separated")->capture_default_str();
  app.add_option("--decode-steps", decode_steps, "decode steps timed per batch size (median)")->capture_default_str();
  app.add_option("--shared-prompt", shared_prompt, "prompt tokens of the prefix-cache and n-sample runs (0 = skip)")
      ->capture_default_str();
  app.add_option("--samples", samples, "n of the n-sample run")->capture_default_str()->check(CLI::Range(2, 64));
  app.add_option("--sample-tokens", sample_tokens, "tokens each sample generates")->capture_default_str()
      ->check(CLI::PositiveNumber);
  bool sparse_samples = false, sparse_repeat = false;
  app.add_flag("--sparse-samples", sparse_samples,
               "also run the n samples and the n separate requests on the CPU sparse pair (both ranks)");
  app.add_flag("--sparse-repeat", sparse_repeat,
               "also run a request of the --shared-prompt prompt, then the same prompt again, on the CPU sparse pair "
               "with retained prefixes on and off");
  spade::SparseOptions so;  // the sparse settings: the ranks' flags, one home (pair/selection_flags.h)
  so.mode = spade::SelectionMode::Predicted;
  spade::pair::SparseFlagText sparse_text;
  spade::pair::add_sparse_flags(app, so, sparse_text,
                                spade::pair::kSelectionFlags | spade::pair::kScheduleFlags |
                                    spade::pair::kDeltaTransferFlag);
  app.add_option("--out", out_path, "JSON output (default: stdout only)");
  CLI11_PARSE(app, argc, argv);
  try {
    spade::pair::resolve_sparse_flags(sparse_text, so);
    spade::pair::FlagRefusals refusals(app);
    if (!sparse_samples && !sparse_repeat)
      refusals.refuse("bench_cpu without --sparse-samples or --sparse-repeat",
                      {"--token-budget", "--local-window", "--sink-tokens", "--query-window", "--ridge-eps",
                       "--gqa-rule", "--predictor", "--successor-expand", "--anchor-queries", "--anchor-span",
                       "--sparse-threshold", "--layers-per-pack", "--delta-transfer"},
                      "only the --sparse-samples and --sparse-repeat sections decode sparsely");
    refusals.refuse_if(sparse_repeat && shared_prompt <= 0,
                       "--sparse-repeat needs --shared-prompt > 0 (the repeated prompt's length)");
    refusals.refuse_if(sparse_samples && shared_prompt <= 0,
                       "--sparse-samples needs --shared-prompt > 0 (the samples' prompt length)");
    refusals.refuse_if((sparse_samples || sparse_repeat) && shared_prompt > 0 &&
                           so.sparse_threshold >= shared_prompt + sample_tokens,
                       "--sparse-threshold " + std::to_string(so.sparse_threshold) +
                           ": no sample would switch to sparse decoding (at least --shared-prompt + --sample-tokens)");
    refusals.check();
    if (model_dir.empty()) {
      const char* data = std::getenv("SPADE_DATA_DIR");
      SPADE_CHECK(data != nullptr, "bench_cpu: give --model or set SPADE_DATA_DIR");
      model_dir = std::string(data) + "/models/longctx-22m";
    }
    const auto model = Model::load(model_dir);
    const ModelConfig& cfg = model->config();
    const ModelConfig attn_cfg = cfg.attention_view();  // DensePagedAttention keeps a reference
    SPADE_CHECK(!cfg.is_hybrid(), "bench_cpu: {} is hybrid; this bench covers attention-only models", model_dir);
    nlohmann::json doc;
    spade::bench::stamp_run(doc);
    doc["bench"] = "bench_cpu";
    doc["args"] = std::vector<std::string>(argv + 1, argv + argc);
    for (const char* var : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS"})  // the threads' settings
      if (const char* val = std::getenv(var)) doc["env"][var] = val;
    doc["device"] = {{"cpu", cpu_name()}, {"hardware_threads", std::thread::hardware_concurrency()}};
    doc["blas"] = spade::kernels::blas_description();
    doc["model"] = model_dir;
    // The floor: the model's largest GEMM (gate_up at a 2k-token chunk) and a square one.
    const int big_n = 2 * cfg.intermediate_size, big_k = cfg.hidden_size;
    const double floor_model = sgemm_gflops(2048, big_n, big_k, 5);
    const double floor_square = sgemm_gflops(2048, 2048, 2048, 3);
    doc["sgemm_gflops"] = {{"model_gate_up_2048x" + std::to_string(big_n) + "x" + std::to_string(big_k), floor_model},
                           {"square_2048", floor_square}};
    std::printf("BLAS: %s\nSGEMM floor: %.1f GFLOP/s (2048x%dx%d), %.1f GFLOP/s (2048^3)\n",
                spade::kernels::blas_description(), floor_model, big_n, big_k, floor_square);
    std::mt19937 rng(1234);
    std::vector<float> logits;
    for (int n : parse_list(prefill_list, "--prefill")) {
      SPADE_CHECK(n >= 1 && n <= cfg.max_position_embeddings, "bench_cpu: --prefill {} outside 1..{}", n,
                  cfg.max_position_embeddings);
      KvCache cache(attn_cfg, (n + page_size - 1) / page_size, page_size);
      spade::DensePagedAttention attn(attn_cfg, cache);
      const ForwardBatch fb = make_batch({n}, {n}, page_size, cfg.vocab_size, rng);
      const auto t0 = Clock::now();
      model->forward(fb, attn, logits);
      const double s = seconds_since(t0);
      const double flops = forward_flops(*model, n, 0.5 * n * (n + 1.0), 1);
      const double gflops = flops / s / 1e9;
      doc["prefill"].push_back({{"tokens", n},
                                {"seconds", s},
                                {"tokens_per_s", n / s},
                                {"gflops", gflops},
                                {"gflop", flops / 1e9},
                                {"floor_sgemm_gflops", floor_model},
                                {"fraction_of_sgemm", gflops / floor_model}});
      std::printf("prefill %5d tokens: %7.2f s  %8.1f tok/s  %6.1f GFLOP/s = %.2f of SGEMM\n", n, s, n / s, gflops,
                  gflops / floor_model);
    }
    for (int B : parse_list(batch_list, "--decode-batch")) {
      SPADE_CHECK(B >= 1 && decode_context >= 2 && decode_context <= cfg.max_position_embeddings,
                  "bench_cpu: decode batch {} / context {} out of range", B, decode_context);
      const int pages_per_seq = (decode_context + page_size - 1) / page_size;
      KvCache cache(attn_cfg, B * pages_per_seq, page_size);
      spade::DensePagedAttention attn(attn_cfg, cache);
      // Fill the caches with one prefill of context - 1 tokens per sequence, then time decode steps at `context`.
      model->forward(make_batch(std::vector<int>(B, decode_context - 1), std::vector<int>(B, decode_context - 1),
                                page_size, cfg.vocab_size, rng),
                     attn, logits);
      std::vector<double> times;
      const ForwardBatch fb =
          make_batch(std::vector<int>(B, decode_context), std::vector<int>(B, 1), page_size, cfg.vocab_size, rng);
      for (int s = 0; s < decode_steps; ++s) {
        const auto t0 = Clock::now();
        model->forward(fb, attn, logits);
        times.push_back(seconds_since(t0));
      }
      std::sort(times.begin(), times.end());
      const double s = times[times.size() / 2];
      const double flops = forward_flops(*model, B, static_cast<double>(B) * decode_context, B);
      const double gflops = flops / s / 1e9;
      doc["decode"].push_back({{"batch", B},
                               {"context", decode_context},
                               {"step_ms", s * 1e3},
                               {"tokens_per_s", B / s},
                               {"gflops", gflops},
                               {"floor_sgemm_gflops", floor_model},
                               {"fraction_of_sgemm", gflops / floor_model}});
      std::printf("decode B=%-3d ctx %5d: %7.2f ms/step  %8.1f tok/s  %6.1f GFLOP/s = %.2f of SGEMM\n", B,
                  decode_context, s * 1e3, B / s, gflops, gflops / floor_model);
    }
    if (shared_prompt > 0) {
      SPADE_CHECK(shared_prompt + sample_tokens <= cfg.max_position_embeddings, "bench_cpu: --shared-prompt {} too long",
                  shared_prompt);
      std::vector<int32_t> prompt(static_cast<size_t>(shared_prompt));
      std::uniform_int_distribution<int32_t> tok(0, cfg.vocab_size - 1);
      for (auto& t : prompt) t = tok(rng);
      spade::EngineOptions eo;
      eo.page_size = page_size;
      eo.max_num_seqs = samples;
      eo.max_num_batched_tokens = 2048;
      eo.max_model_len = shared_prompt + sample_tokens;
      for (bool caching : {false, true}) {  // the repeat's TTFT, prefix caching off (the peer) and on
        eo.enable_prefix_caching = caching;
        spade::Engine e(*model, eo);
        const EngineRun cold = run_engine(e, prompt, 1, 1, 1), warm = run_engine(e, prompt, 1, 1, 1);
        doc["prefix_cache"].push_back({{"prefix_caching", caching},
                                       {"prompt_tokens", shared_prompt},
                                       {"ttft_first_s", cold.all_first_s},
                                       {"ttft_repeat_s", warm.all_first_s},
                                       {"hit_tokens", e.stats().prefix_hit_tokens}});
        std::printf("prefix cache %-3s: TTFT %5d-token prompt %.3f s, repeated %.3f s (%llu tokens reused)\n",
                    caching ? "on" : "off", shared_prompt, cold.all_first_s, warm.all_first_s,
                    static_cast<unsigned long long>(e.stats().prefix_hit_tokens));
      }
      eo.enable_prefix_caching = false;  // the sample groups alone share the prompt
      for (bool grouped : {false, true}) {
        spade::Engine e(*model, eo);
        const EngineRun r = grouped ? run_engine(e, prompt, 1, samples, sample_tokens)
                                    : run_engine(e, prompt, samples, 1, sample_tokens);
        const double kv_page_bytes = static_cast<double>(KvCache::page_bytes(attn_cfg, page_size));
        doc["samples"].push_back({{"mode", grouped ? "n samples (submit_samples)" : "n separate requests"},
                                  {"n", samples},
                                  {"prompt_tokens", shared_prompt},
                                  {"tokens_per_sample", sample_tokens},
                                  {"peak_kv_pages", r.peak_pages},
                                  {"peak_kv_bytes", r.peak_pages * kv_page_bytes},
                                  {"all_first_tokens_s", r.all_first_s},
                                  {"total_s", r.total_s},
                                  {"generated_tokens", r.generated},
                                  {"tokens_per_s", r.generated / r.total_s}});
        std::printf("%-27s n=%d: peak KV %5d pages (%.1f MB), all first tokens %.2f s, %d tokens in %.2f s\n",
                    grouped ? "n samples (shared prompt)" : "n separate requests", samples, r.peak_pages,
                    r.peak_pages * kv_page_bytes / 1e6, r.all_first_s, r.generated, r.total_s);
      }
      if (sparse_samples) {
        spade::SparseOptions sso = so;
        sso.max_retained_prefix_tokens = 0;  // prefix caching is off there: nothing to retain
        run_sparse_samples(*model, attn_cfg, eo, sso, prompt, samples, sample_tokens, doc);
      }
      if (sparse_repeat) run_sparse_repeat(*model, eo, so, prompt, sample_tokens, doc);
    }
    if (!out_path.empty()) {
      std::ofstream f(out_path);
      SPADE_CHECK(f.good(), "bench_cpu: cannot write {}", out_path);
      f << doc.dump(2) << "\n";
    }
    return 0;
  } catch (const spade::Error& e) {
    std::cerr << "bench_cpu: " << e.what() << "\n";
    return 1;
  }
}

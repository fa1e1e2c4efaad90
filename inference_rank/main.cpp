// inference_rank: loads a Hugging Face checkpoint and generates text on the CPU (fp32) or one GPU (bf16, --device cuda).
//
//   inference_rank --model DIR --prompt TEXT --max-tokens N [--temperature T --top-p P --top-k K --seed S]
//                  [--selection dense|oracle|predicted --sparse-threshold N --token-budget K ...]
//   inference_rank --model DIR --device cuda [--random-weights] [--tokenizer DIR] [--no-cuda-graphs]
//                  [--host-sampling] [--selection predicted --delta-capacity C ...] --prompt TEXT ...
//                  (sampling runs on the GPU unless --host-sampling; with --selection predicted a GPU cache rank
//                  runs in this process on the same GPU, cache_rank/gpu_local.h)
//   inference_rank --serve --model DIR [launch flags / RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT / OMPI_*] [...]
//                  [--device cuda --gpu N --gpu-link nccl|ipc]   (pairs with cache_rank --device cuda)
//
// Standalone (--prompt): the generated text streams to stdout; TTFT, TPOT and tokens/s go to stderr at the end.
// `--prompt ""` means the BOS token alone. Several --prompt flags run as one continuously batched workload. With
// --selection predicted the cache rank runs in-process. --serve: the rank of a cluster (inference_rank/serve.h).
// A flag that the mode (standalone or --serve, --device cpu or cuda) would ignore is refused by name at start-up
// (refuse_unused_flags below); the sparse flags are the pair's (pair/selection_flags.h).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>

#include "pair/selection_flags.h"
#include "common/chat_template.h"
#include "common/config.h"
#include "common/error.h"
#include "common/logging.h"
#include "common/tokenizer.h"
#include "inference_rank/engine.h"
#include "inference_rank/serve.h"
#include "inference_rank/sparse_attention.h"
#ifdef SPADE_HAVE_GPU_PATH
#include <cuda_runtime_api.h>

#include "cache_rank/gpu_local.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sparse.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Refuses, by name, every flag the user gave that this mode would ignore (and a GPU run's nonzero --sink-tokens or
// CPU-only --selection), before anything is loaded, allocated or connected: CPU-only builds refuse the GPU modes'
// flags the same way (tests/inference_rank/test_rank_flags.cpp). Throws spade::Error naming each one.
void refuse_unused_flags(const CLI::App& app, bool serve, const std::string& device, spade::SelectionMode mode,
                         const spade::pair::SparseConfig& sparse) {
  if (device != "cpu" && device != "cuda") spade::fail("--device must be cpu or cuda, got '{}'", device);
  spade::pair::FlagRefusals r(app);
  if (serve) {
    r.refuse("--serve", {"--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--chat", "--ignore-eos"},
             "a cluster rank generates what each request asks for: set these per request, with spade_submit or the "
             "OpenAI API");
    r.refuse("--serve", {"--random-weights", "--weights-seed", "--tokenizer"},
             "a cluster rank loads the weights and the tokenizer of --model");
    r.refuse("--serve", {"--host-sampling"}, "a cluster rank on the GPU samples on the GPU");
  } else {
    r.refuse("a standalone run (--prompt)",
             {"--master-addr", "--master-port", "--rank", "--world-size", "--num-inference", "--num-cache",
              "--role-map", "--cluster-secret-file", "--rendezvous-timeout-ms", "--metrics-port", "--metrics-host"},
             "it joins no cluster and serves no metrics: these need --serve");
    r.refuse("a standalone run (--prompt)", {"--gpu", "--gpu-link"},
             "it runs on GPU 0 (choose it with CUDA_VISIBLE_DEVICES), its cache rank in this process");
  }
  if (device == "cpu") {
    r.refuse("--device cpu", {"--no-cuda-graphs", "--host-sampling", "--gpu", "--gpu-link"},
             "it configures the GPU path");
    r.refuse("--device cpu", {"--delta-capacity"},
             "it bounds the GPU pair's selection deltas; the CPU cache rank's --delta-transfer sends every entering "
             "token");
    r.refuse("--device cpu", {"--score-keys"}, "it selects what the GPU cache rank scores with");
    r.refuse("--device cpu", {"--max-context-pages"},
             "--max-context-pages sizes the GPU cache rank's pool; the CPU cache rank's pool is the local one");
  } else {
    r.refuse_if(mode == spade::SelectionMode::Oracle || mode == spade::SelectionMode::Quest,
                fmt::format("--selection {} does not apply to --device cuda (CPU only: synchronous selection with "
                            "the true query); use dense or predicted",
                            spade::selection_mode_name(mode)));
    r.refuse_if(sparse.selection.sink_tokens > 0,
                fmt::format("--sink-tokens {} does not apply to --device cuda (the GPU path attends no sink tokens "
                            "of its own: they compete in the top-k); use 0",
                            sparse.selection.sink_tokens));
    r.refuse("--device cuda", {"--anchor-queries", "--anchor-span"},
             "the GPU path has no prompt anchors yet (the CPU cache rank's; docs/FIDELITY.md)");
    if (serve)
      r.refuse("--serve --device cuda",
               {"--query-window", "--ridge-eps", "--gqa-rule", "--predictor", "--successor-expand", "--score-keys"},
               "the cache_rank --device cuda process predicts and selects with its own: give them to it");
  }
  r.check();
}

struct Output {
  std::vector<spade::TokenEvent> events;
  std::vector<Clock::time_point> times;
  std::string text;
  spade::FinishReason reason = spade::FinishReason::None;
  std::string error;
  size_t prompt_tokens = 0;
};

// Every flag of the binary, in one place (registered by add_flags, checked by refuse_unused_flags).
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
  bool prefix_caching = true;  // --enable-prefix-caching / --no-enable-prefix-caching (EngineOptions)
};

// Registers every flag on `app`, writing into `f`.
void add_flags(CLI::App& app, Flags& f) {
  f.sp.temperature = -1;  // unset: generation_config.json decides (greedy unless do_sample)
  app.add_option("--model", f.model_dir, "Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
      ->required();
  auto* prompt_opt = app.add_option("--prompt", f.prompts, "prompt text; \"\" = the BOS token alone; repeat for a batch");
  auto* serve_opt = app.add_flag("--serve", f.serve, "run as an inference rank of a cluster (see docs/ARCHITECTURE.md)");
  prompt_opt->excludes(serve_opt);
  // Sparse decoding (AsyncSpade): the pair's settings (pair/selection_flags.h) and this rank's selection mode.
  app.add_option("--selection", f.selection, "dense | oracle | quest (CPU: synchronous, true query) | predicted (AsyncSpade)");
  spade::pair::add_sparse_flags(app, f.so, f.sparse_text,
                                spade::pair::kSelectionFlags | spade::pair::kScheduleFlags |
                                    spade::pair::kDeltaCapacityFlag | spade::pair::kScoreKeysFlag);
  app.add_option("--selection-deadline-ms", f.deadline_ms, "longest wait for a late selection")->check(CLI::PositiveNumber);
  // Cluster (--serve).
  spade::coord::add_launch_flags(app, f.lf);
  app.add_option("--rendezvous-timeout-ms", f.rendezvous_ms, "deadline for the whole world to register");
  app.add_option("--metrics-port", f.metrics_port, "--serve: serve /metrics, /health, /ready on this port (0 = off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-host", f.metrics_host, "--serve: address of the metrics endpoint")->capture_default_str();
  app.add_option("--max-tokens", f.max_tokens, "tokens to generate at most")->check(CLI::PositiveNumber);
  app.add_option("--temperature", f.sp.temperature, "sampling temperature; 0 = greedy (default: generation_config)");
  app.add_option("--top-p", f.sp.top_p, "nucleus sampling mass in (0, 1]");
  app.add_option("--top-k", f.sp.top_k, "sample among the k most likely tokens; 0 = off");
  app.add_option("--seed", f.sp.seed, "random seed of the sampler");
  app.add_flag("--chat", f.chat, "wrap each prompt as a user message with the checkpoint's chat template");
  app.add_flag("--ignore-eos", f.ignore_eos, "do not stop at EOS");
  app.add_option("--page-size", f.eo.page_size, "KV-cache page size in tokens")->check(CLI::PositiveNumber);
  app.add_option("--max-num-seqs", f.eo.max_num_seqs, "sequences decoded together at most")->check(CLI::PositiveNumber);
  app.add_option("--max-num-batched-tokens", f.eo.max_num_batched_tokens, "tokens per forward (prefill chunk) at most")
      ->check(CLI::PositiveNumber);
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", f.prefix_caching,
               "automatic prefix caching: reuse the KV pages of earlier prompts' identical leading tokens (default on "
               "where it applies: off for hybrid models and for GPU sparse decoding, which refuse the flag)");
  app.add_option("--log-level", f.log_level, "trace|debug|info|warn|error|off");
  app.add_option("--device", f.device, "cpu (fp32) | cuda (bf16; standalone on GPU 0 with --selection predicted running the GPU cache rank in this process; --serve pairs with cache_rank --device cuda)");
  auto* random_opt = app.add_flag("--random-weights", f.random_weights,
                                  "deterministic random weights for the config.json in --model (no safetensors "
                                  "needed)");
  app.add_option("--weights-seed", f.weights_seed, "seed of --random-weights")->needs(random_opt);
  app.add_option("--tokenizer", f.tokenizer_dir, "directory with tokenizer.json (default: --model)");
  app.add_option("--kv-cache-gib", f.kv_gib, "KV-cache budget in GiB (default 1; counted in fp32 bytes)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-cuda-graphs", f.no_cuda_graphs, "--device cuda: run decode steps eagerly");
  app.add_option("--max-context-pages", f.eo.max_context_pages,
                 "--device cuda --selection predicted: KV pages that the running sequences' full contexts (prompt + "
                 "max_tokens) may fill together, i.e. the GPU cache rank's pool. Set it above the local pool "
                 "(--kv-cache-gib) so that the pages sparse decoding frees here admit more requests (default 0: the "
                 "local pool)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--gpu", f.gpu_index, "--serve --device cuda: the CUDA device of this rank")->check(CLI::NonNegativeNumber);
  app.add_option("--gpu-link", f.gpu_link,
                 "--serve --device cuda: the data plane to the cache rank: nccl (another GPU) | ipc (the same GPU)");
  app.add_flag("--host-sampling", f.host_sampling,
               "--device cuda: copy the logits back and sample on the host (the CPU path's sampler) instead of on the "
               "GPU");
}

// --enable-prefix-caching: on by default where it applies. Hybrid models (a recurrent state is not paged) and GPU
// sparse decoding (the GPU cache rank receives each token's rows as they are computed, so a reused prefix would never
// reach it) turn it off, and refuse the flag given explicitly. A sparse CPU backend needs the prompt's last queries
// (the predictor's window, the prompt anchors): those prompt tokens are always recomputed.
void resolve_prefix_caching(const CLI::App& app, Flags& f) {
  const bool explicit_on = app.get_option("--enable-prefix-caching")->count() > 0 && f.prefix_caching;
  const bool hybrid = spade::load_model_config(f.model_dir).is_hybrid();
  const bool gpu_sparse = f.device == "cuda" && f.so.mode != spade::SelectionMode::Dense;
  if (explicit_on && hybrid)
    spade::fail("--enable-prefix-caching: not supported for hybrid (linear-attention) models such as {} (their "
                "recurrent state is not paged)", f.model_dir);
  if (explicit_on && gpu_sparse)
    spade::fail("--enable-prefix-caching: not supported with --device cuda and --selection {} (the GPU cache rank "
                "receives each token's rows as they are computed; a reused prefix would never reach it)", f.selection);
  f.eo.enable_prefix_caching = f.prefix_caching && !hybrid && !gpu_sparse;
  f.eo.prefix_recompute_tokens = f.so.prefix_recompute_tokens();
}

// A standalone run (--prompt): generates for every prompt with the cache rank, if any, in this process; the text
// streams to stdout (one prompt) or is printed per prompt; TTFT / TPOT / tokens/s go to stderr. Returns the exit code.
int run_standalone(Flags& f) {
  if (f.prompts.empty()) spade::fail("give --prompt TEXT (standalone) or --serve (cluster)");
  auto t_load = Clock::now();
  const spade::ModelConfig cfg = spade::load_model_config(f.model_dir);
  auto tok = spade::Tokenizer::from_dir(f.tokenizer_dir.empty() ? f.model_dir : f.tokenizer_dir);
  auto gen = spade::load_generation_config(f.model_dir, cfg);
  if (f.sp.temperature < 0) f.sp.temperature = gen.do_sample ? gen.temperature : 0.f;
  spade::validate(f.sp);

  spade::SparseAttention* backend = nullptr;
  std::unique_ptr<spade::Model> model;
  std::unique_ptr<spade::Engine> engine_ptr;
#ifdef SPADE_HAVE_GPU_PATH
  // Destroyed in reverse, also on an error: the controller first (its destructor sends the close plan), then the
  // cache rank (which then has no receive pending), then the forward pass, whose cudaFree would otherwise wait
  // for that receive forever (cache_rank/gpu_local.h).
  std::unique_ptr<spade::GpuEngineForward> gpu;
  std::unique_ptr<spade::ModelConfig> gpu_attn_cfg;
  std::unique_ptr<spade::cache::LocalGpuCacheRank> gpu_cache;
  std::unique_ptr<spade::GpuSparseController> gpu_sparse;
#endif
  if (f.device == "cuda") {
#ifdef SPADE_HAVE_GPU_PATH
    if (f.host_sampling) {
      engine_ptr = std::make_unique<spade::Engine>(
          cfg, f.eo, [&](const spade::ForwardBatch& b, std::vector<float>& l) { (*gpu)(b, l); });
    } else {  // on-device sampling: only the sampled token ids come back each step
      engine_ptr = std::make_unique<spade::Engine>(
          cfg, f.eo, spade::ForwardSampleFn([&](const spade::ForwardBatch& b, const std::vector<spade::RowSampling>& r,
                                              std::vector<int32_t>& t, std::vector<spade::TokenLogprobs>& l) {
            gpu->sample(b, r, t, l);
          }));
    }
    spade::GpuEngineOptions go = spade::gpu_engine_options(engine_ptr->options(), !f.no_cuda_graphs);
    go.link_graphs = false;  // the cache rank runs in this process (gpu_engine.h GpuEngineOptions::link_graphs)
    const spade::GpuModelOptions mo = spade::GpuEngineForward::model_options(go);
    std::unique_ptr<spade::GpuModel> gm;
    if (f.random_weights) {
      gm = spade::GpuModel::random(cfg, f.weights_seed, mo);
    } else {
      const auto ckpt = spade::Model::load(f.model_dir);  // host fp32 copy, freed after the upload
      gm = spade::GpuModel::upload(ckpt->config(), ckpt->weights(), mo);
    }
    gpu = std::make_unique<spade::GpuEngineForward>(std::move(gm), go);
    {
      const auto t_warm = Clock::now();
      const int n = gpu->warm_up();  // before the in-process cache rank exists (gpu_engine.h)
      spdlog::info("GPU warm-up: {} steps in {:.1f} ms", n, ms(Clock::now() - t_warm));
    }
    if (f.so.mode == spade::SelectionMode::Predicted) {
      // AsyncSpade on one GPU: the cache rank runs in this process on its own thread, over a CudaIpcLink.
      const spade::EngineOptions& en = engine_ptr->options();
      gpu_attn_cfg = std::make_unique<spade::ModelConfig>(cfg.attention_view());
      const spade::GpuSparseOptions gso = spade::gpu_sparse_options(f.so, en, "the in-process cache rank");
      gpu_cache = std::make_unique<spade::cache::LocalGpuCacheRank>(*gpu_attn_cfg, f.so, 0, f.so.selection_deadline);
      gpu_sparse = std::make_unique<spade::GpuSparseController>(*gpu_attn_cfg, gso, gpu_cache->inference_link(),
                                                                en.page_size, gpu->max_batch());
      // Everything is allocated: now the cache rank may start (see cache_rank/gpu_local.h).
      gpu_sparse->send_hello(spade::make_gpu_pair_hello(*gpu_attn_cfg, gso, en));
      gpu_cache->wait_ready(std::chrono::milliseconds(60000));
      gpu->set_sparse(gpu_sparse.get());
      engine_ptr->set_attention_hooks(gpu_sparse.get());
      spdlog::info("GPU sparse decoding: threshold {}, budget {}, local window {}, delta capacity {}, {} layers per "
                   "pack; cache rank in this process",
                   f.so.sparse_threshold, f.so.selection.token_budget, f.so.selection.local_window,
                   f.so.effective_delta_capacity(), f.so.layers_per_pack);
    }
    spdlog::info("GPU model: {:.2f} GB weights, {:.2f} GB KV pool ({} pages) in {:.1f} ms",
                 gpu->model().weight_bytes() / 1e9, gpu->kv_bytes() / 1e9, go.engine.num_pages,
                 ms(Clock::now() - t_load));
#else
    spade::fail("--device cuda: this build has no CUDA (configure with SPADE_ENABLE_CUDA=ON and NCCL/cuBLAS)");
#endif
  } else {
    model = f.random_weights ? spade::Model::random(cfg, f.weights_seed) : spade::Model::load(f.model_dir);
    spdlog::info("loaded {} ({} params) in {:.1f} ms", f.model_dir, model->num_params(), ms(Clock::now() - t_load));
    engine_ptr = std::make_unique<spade::Engine>(*model, f.eo, [&](const spade::ModelConfig& c, spade::KvCache& kv) {
      std::unique_ptr<spade::pair::CacheRankLink> link;
      if (f.so.mode == spade::SelectionMode::Predicted)
        link = std::make_unique<spade::cache::InProcessLink>(c, f.so.selection, kv.num_pages(), kv.page_size());
      auto b = std::make_unique<spade::SparseAttention>(c, kv, f.so, std::move(link));
      backend = b.get();
      return std::unique_ptr<spade::AttentionBackend>(std::move(b));
    });
  }
  spade::Engine& engine = *engine_ptr;
  std::vector<Output> outs(f.prompts.size());
  std::map<uint64_t, size_t> slot;
  const bool stream = f.prompts.size() == 1;
  spade::StreamingDecoder streamer(tok, /*skip_special_tokens=*/true);
  const auto t0 = Clock::now();
  for (size_t i = 0; i < f.prompts.size(); ++i) {
    std::vector<int32_t> ids;
    if (f.prompts[i].empty() && !f.chat) {
      auto bos = tok.bos_id();
      if (!bos && gen.bos_token_id >= 0) bos = gen.bos_token_id;
      if (!bos) spade::fail("--prompt \"\" needs a BOS token, but {} defines none", f.model_dir);
      ids = {*bos};
    } else if (f.chat) {
      const auto tmpl = spade::ChatTemplate::for_tokenizer(tok);
      const std::vector<spade::ChatMessage> msgs = {{"user", f.prompts[i]}};
      ids = tok.encode(tmpl.render(msgs), /*add_special_tokens=*/false);
    } else {
      ids = tok.encode(f.prompts[i], /*add_special_tokens=*/true);
    }
    spade::GenerateRequest r;
    r.prompt_ids = ids;
    r.max_tokens = f.max_tokens;
    r.sampling = f.sp;
    r.sampling.seed = f.sp.seed + i;
    r.stop_token_ids = gen.eos_token_ids;
    r.ignore_eos = f.ignore_eos;
    outs[i].prompt_tokens = ids.size();
    const uint64_t id = engine.submit(r, [&, i](const spade::TokenEvent& ev) {
      Output& o = outs[i];
      o.times.push_back(Clock::now());
      o.events.push_back(ev);
      if (ev.finished) {
        o.reason = ev.reason;
        o.error = ev.error;
      }
      const bool is_eos = ev.reason == spade::FinishReason::Stop;
      if (ev.token >= 0 && !is_eos) {
        if (stream) {
          std::string piece = streamer.push(ev.token);
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          std::fflush(stdout);
        } else {
          o.text += tok.decode(std::vector<int32_t>{ev.token}, true);
        }
      }
    });
    slot[id] = i;
  }
  engine.run_until_idle();
  const auto t_end = Clock::now();
  if (stream) {
    std::string rest = streamer.finish();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
  }

  int failed = 0;
  size_t generated = 0;
  double ttft_sum = 0, tpot_sum = 0;
  size_t tpot_n = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    Output& o = outs[i];
    if (!stream) {
      // Batched: decode each whole sequence at once (byte-fallback and multi-byte tokens join correctly).
      std::vector<int32_t> ids;
      for (auto& ev : o.events)
        if (ev.token >= 0 && ev.reason != spade::FinishReason::Stop) ids.push_back(ev.token);
      std::printf("=== prompt %zu ===\n%s\n", i, tok.decode(ids, true).c_str());
    }
    if (o.reason == spade::FinishReason::Error) {
      std::fprintf(stderr, "request %zu failed: %s\n", i, o.error.c_str());
      ++failed;
      continue;
    }
    generated += o.events.size();
    if (!o.times.empty()) ttft_sum += ms(o.times.front() - t0);
    for (size_t k = 1; k < o.times.size(); ++k, ++tpot_n) tpot_sum += ms(o.times[k] - o.times[k - 1]);
  }
  const double total_s = std::chrono::duration<double>(t_end - t0).count();
  const size_t ok = outs.size() - failed;
  std::fprintf(stderr,
               "[spade] requests=%zu prompt_tokens=%zu generated_tokens=%zu ttft_ms=%.3f tpot_ms=%.3f "
               "tokens_per_s=%.1f finish_reason=%s\n",
               outs.size(), outs[0].prompt_tokens, generated, ok ? ttft_sum / ok : 0.0,
               tpot_n ? tpot_sum / tpot_n : 0.0, total_s > 0 ? generated / total_s : 0.0,
               spade::finish_reason_name(outs[0].reason));
#ifdef SPADE_HAVE_GPU_PATH
  if (gpu_sparse) {
    const auto& st = gpu_sparse->stats();
    gpu_sparse->close();
    gpu_cache->stop();
    const auto cs = gpu_cache->stats();
    std::fprintf(stderr,
                 "[spade] selection=predicted device=cuda sparse_seq_steps=%llu switches=%llu failed=%llu "
                 "cache_selections=%llu bytes_up=%llu bytes_down=%llu dropped_pages=%llu%s%s\n",
                 static_cast<unsigned long long>(st.sparse_seq_steps), static_cast<unsigned long long>(st.switches),
                 static_cast<unsigned long long>(st.failed_seqs), static_cast<unsigned long long>(cs.selections),
                 static_cast<unsigned long long>(st.bytes_sent), static_cast<unsigned long long>(st.bytes_received),
                 static_cast<unsigned long long>(engine.stats().dropped_pages),
                 gpu_cache->error().empty() ? "" : " cache_rank_error=", gpu_cache->error().c_str());
    return failed ? 1 : 0;
  }
#endif
  if (f.so.mode != spade::SelectionMode::Dense) {
    const auto& st = backend->stats();
    std::fprintf(stderr,
                 "[spade] selection=%s sparse_seq_steps=%llu switches=%llu stalls=%llu dense_fallbacks=%llu\n",
                 spade::selection_mode_name(f.so.mode), static_cast<unsigned long long>(st.sparse_seq_steps),
                 static_cast<unsigned long long>(st.switches), static_cast<unsigned long long>(st.stalls),
                 static_cast<unsigned long long>(st.dense_fallbacks));
  }
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  // --device cuda with the cache rank in this process (--selection predicted) or on this GPU (--gpu-link ipc): the
  // two ends' streams wait on each other through stream memory operations (transport/cuda_ipc/cuda_ipc_link.h), so
  // every stream needs its own hardware queue and every kernel must be loaded before the first step (a lazy load may
  // synchronise the context). Set before CUDA starts; an explicit environment wins.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  CLI::App app{"Spade inference rank: generation from a Hugging Face checkpoint (CPU fp32, or GPU bf16 with --device cuda)"};
  Flags f;
  add_flags(app, f);
  CLI11_PARSE(app, argc, argv);

  try {
    f.so.mode = spade::parse_selection_mode(f.selection);
    refuse_unused_flags(app, f.serve, f.device, f.so.mode, f.so);
    spade::init_logging("inference_rank", f.log_level);
    f.so.selection_deadline = std::chrono::milliseconds(f.deadline_ms);
    spade::pair::resolve_sparse_flags(f.sparse_text, f.so);
    if (f.kv_gib > 0) f.eo.kv_cache_bytes = static_cast<size_t>(f.kv_gib * (1 << 30));
    if (f.eo.max_context_pages > 0 && (f.device != "cuda" || f.so.mode != spade::SelectionMode::Predicted))
      spade::fail("--max-context-pages sizes the GPU cache rank's pool: it needs --device cuda and --selection "
                  "predicted (the CPU cache rank's pool is the local one)");
    resolve_prefix_caching(app, f);
    if (f.so.mode != spade::SelectionMode::Dense && f.eo.max_num_batched_tokens < f.eo.max_num_seqs)
      spade::fail("sparse decoding needs --max-num-batched-tokens ({}) >= --max-num-seqs ({})",
                  f.eo.max_num_batched_tokens, f.eo.max_num_seqs);
    if (f.serve) {
      spade::ServeOptions sv;
      sv.model_dir = f.model_dir;
      sv.launch = f.lf;
      sv.engine = f.eo;
      sv.sparse = f.so;
      sv.rendezvous_timeout = std::chrono::milliseconds(f.rendezvous_ms);
      sv.metrics_host = f.metrics_host;
      sv.metrics_port = f.metrics_port;
      sv.device = f.device;
      sv.gpu = f.gpu_index;
      sv.gpu_link = f.gpu_link;
      sv.cuda_graphs = !f.no_cuda_graphs;
      return spade::run_serve(sv);
    }
    return run_standalone(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "inference_rank: error: %s\n", e.what());
    return 2;
  }
}

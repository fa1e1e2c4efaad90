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
// (refuse_unused_flags, inference_rank/rank_flags.h); the sparse flags are the pair's (pair/selection_flags.h).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>

#include "cache_rank/pack_server.h"
#include "common/chat_template.h"
#include "common/config.h"
#include "common/error.h"
#include "common/logging.h"
#include "common/tokenizer.h"
#include "inference_rank/engine.h"
#include "inference_rank/rank_flags.h"
#include "inference_rank/serve.h"
#include "inference_rank/sparse_attention.h"
#ifdef SPADE_HAVE_GPU_PATH
#include <cuda_runtime_api.h>

#include "cache_rank/gpu_local.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sparse.h"
#include "inference_rank/gpu_sync_selection.h"
#endif

namespace {

using namespace spade::inference_rank_cli;
using Clock = std::chrono::steady_clock;
double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Output {
  std::vector<spade::TokenEvent> events;
  std::vector<Clock::time_point> times;
  std::string text;
  spade::FinishReason reason = spade::FinishReason::None;
  std::string error;
  size_t prompt_tokens = 0;
};

// A standalone run (--prompt): generates for every prompt with the cache rank, if any, in this process; the text
// streams to stdout (one prompt) or is printed per prompt; TTFT / TPOT / tokens/s go to stderr. Returns the exit code.
// The cache rank's sampled overlap ratio and churn (--overlap-sample-every), per [layer * num_kv_heads + KV head]:
// returns the summary line's fields; `json` also prints one JSON line (the fidelity scripts read it) with the means
// and, per layer, each KV head's {overlap, overlap_n, churn, churn_n} (null where nothing was sampled).
std::string report_selection_samples(const std::vector<spade::cache::SelectionSampleStats>& heads, int num_kv_heads,
                                     bool json) {
  spade::cache::SelectionSampleStats all;
  for (const auto& h : heads) all += h;
  auto num = [](double x) { return std::isfinite(x) ? fmt::format("{:.6g}", x) : std::string("null"); };
  if (json) {
    std::string layers;
    for (size_t l = 0; l * num_kv_heads < heads.size(); ++l) {
      std::string row;
      for (int h = 0; h < num_kv_heads; ++h) {
        const auto& x = heads[l * num_kv_heads + static_cast<size_t>(h)];
        row += fmt::format("{}{{\"overlap\": {}, \"overlap_n\": {}, \"churn\": {}, \"churn_n\": {}}}",
                           h ? ", " : "", num(x.overlap()), x.overlap_n, num(x.churn()), x.churn_n);
      }
      layers += fmt::format("{}[{}]", l ? ", " : "", row);
    }
    std::printf("{\"selection_samples\": {\"overlap\": %s, \"overlap_n\": %lld, \"churn\": %s, \"churn_n\": %lld, "
                "\"layers\": [%s]}}\n",
                num(all.overlap()).c_str(), static_cast<long long>(all.overlap_n), num(all.churn()).c_str(),
                static_cast<long long>(all.churn_n), layers.c_str());
  }
  return fmt::format(" overlap={} overlap_samples={} churn={} churn_samples={}", num(all.overlap()), all.overlap_n,
                     num(all.churn()), all.churn_n);
}

int run_standalone(Flags& f) {
  if (f.prompts.empty()) spade::fail("give --prompt TEXT (standalone) or --serve (cluster)");
  auto t_load = Clock::now();
  const spade::ModelConfig cfg = spade::load_model_config(f.model_dir);
  auto tok = spade::Tokenizer::from_dir(f.tokenizer_dir.empty() ? f.model_dir : f.tokenizer_dir);
  auto gen = spade::load_generation_config(f.model_dir, cfg);
  if (f.sp.temperature < 0) f.sp.temperature = gen.do_sample ? gen.temperature : 0.f;
  spade::validate(f.sp);

  spade::SparseAttention* backend = nullptr;
  std::unique_ptr<spade::cache::OverlapSampler> sampler;  // --device cpu --selection predicted, sampling on
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
  std::unique_ptr<spade::GpuSyncSelection> gpu_sync;  // --selection oracle | quest
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
      const spade::GpuSparseOptions gso = spade::gpu_sparse_options(f.so, en, "the in-process cache rank",
                                                                    f.so.max_retained_prefix_tokens);
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
    if (f.so.mode == spade::SelectionMode::Oracle || f.so.mode == spade::SelectionMode::Quest) {
      // The synchronous references: selection with the true query inside this rank's forward pass, no cache rank.
      const spade::EngineOptions& en = engine_ptr->options();
      gpu_attn_cfg = std::make_unique<spade::ModelConfig>(cfg.attention_view());
      gpu_sync = std::make_unique<spade::GpuSyncSelection>(
          *gpu_attn_cfg, spade::gpu_sparse_options(f.so, en, "the synchronous selection"), f.so.mode, en.page_size,
          gpu->max_batch(), en.max_model_len);
      gpu->set_sparse(gpu_sync.get());
      engine_ptr->set_attention_hooks(gpu_sync.get());
      spdlog::info("GPU {} selection (synchronous, true query): threshold {}, budget {}, local window {}",
                   spade::selection_mode_name(f.so.mode), f.so.sparse_threshold, f.so.selection.token_budget,
                   f.so.selection.local_window);
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
      if (f.so.mode == spade::SelectionMode::Predicted) {
        auto in_process =
            std::make_unique<spade::cache::InProcessLink>(c, f.so.selection, kv.num_pages(), kv.page_size());
        if (f.so.overlap_sample_every > 0) {
          sampler = std::make_unique<spade::cache::OverlapSampler>(f.so.overlap_sample_every);
          in_process->set_sampler(sampler.get());
        }
        link = std::move(in_process);
      }
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
    if (f.teacher_force > 0) {  // the prompt's last N tokens are forced, one decode step each
      const int n = f.teacher_force;
      if (static_cast<int>(ids.size()) <= n)
        spade::fail("--teacher-force {}: prompt {} has {} tokens; it needs at least one more than the forced ones", n,
                    i, ids.size());
      r.prompt_ids.assign(ids.begin(), ids.end() - n);
      r.forced_tokens.assign(ids.end() - n, ids.end());
      r.max_tokens = n;
      r.ignore_eos = true;
      r.logprobs = 1;  // the forced token's and the argmax's
    }
    outs[i].prompt_tokens = r.prompt_ids.size();
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

  if (f.teacher_force > 0) {
    // One JSON line per prompt: each forced token's logprob (nats) and the model's argmax at that step.
    auto num = [](float x) { return std::isfinite(x) ? fmt::format("{:.7g}", x) : std::string("null"); };
    for (size_t i = 0; i < outs.size(); ++i) {
      std::string lp, am;
      for (const auto& ev : outs[i].events) {
        if (!ev.logprobs) continue;
        lp += (lp.empty() ? "" : ",") + num(ev.logprobs->logprob);
        am += (am.empty() ? "" : ",") +
              std::to_string(ev.logprobs->top_ids.empty() ? -1 : ev.logprobs->top_ids.front());
      }
      std::printf("{\"teacher_forced\": %zu, \"prompt_tokens\": %zu, \"logprob\": [%s], \"argmax\": [%s]}\n", i,
                  outs[i].prompt_tokens, lp.c_str(), am.c_str());
    }
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
    const std::string samples = cs.head_samples.empty()
                                    ? std::string()
                                    : report_selection_samples(cs.head_samples, gpu_attn_cfg->num_kv_heads,
                                                               f.teacher_force > 0);
    std::fprintf(stderr,
                 "[spade] selection=predicted device=cuda sparse_seq_steps=%llu switches=%llu failed=%llu "
                 "cache_selections=%llu bytes_up=%llu bytes_down=%llu dropped_pages=%llu%s%s%s\n",
                 static_cast<unsigned long long>(st.sparse_seq_steps), static_cast<unsigned long long>(st.switches),
                 static_cast<unsigned long long>(st.failed_seqs), static_cast<unsigned long long>(cs.selections),
                 static_cast<unsigned long long>(st.bytes_sent), static_cast<unsigned long long>(st.bytes_received),
                 static_cast<unsigned long long>(engine.stats().dropped_pages), samples.c_str(),
                 gpu_cache->error().empty() ? "" : " cache_rank_error=", gpu_cache->error().c_str());
    return failed ? 1 : 0;
  }
  if (gpu_sync) {
    std::fprintf(stderr, "[spade] selection=%s device=cuda sparse_seq_steps=%llu switches=%llu\n",
                 spade::selection_mode_name(f.so.mode), static_cast<unsigned long long>(gpu_sync->sparse_seq_steps()),
                 static_cast<unsigned long long>(gpu_sync->switches()));
    return failed ? 1 : 0;
  }
#endif
  if (f.so.mode != spade::SelectionMode::Dense) {
    const auto& st = backend->stats();
    std::string samples;
    if (sampler && !sampler->head_stats().empty()) {
      std::vector<spade::cache::SelectionSampleStats> heads;
      for (const auto& layer : sampler->head_stats()) heads.insert(heads.end(), layer.begin(), layer.end());
      samples = report_selection_samples(heads, static_cast<int>(sampler->head_stats().front().size()),
                                         f.teacher_force > 0);
    }
    std::fprintf(stderr,
                 "[spade] selection=%s sparse_seq_steps=%llu switches=%llu stalls=%llu dense_fallbacks=%llu%s\n",
                 spade::selection_mode_name(f.so.mode), static_cast<unsigned long long>(st.sparse_seq_steps),
                 static_cast<unsigned long long>(st.switches), static_cast<unsigned long long>(st.stalls),
                 static_cast<unsigned long long>(st.dense_fallbacks), samples.c_str());
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
    resolve_flags(app, f);
    if (f.serve) return spade::run_serve(serve_options(f));
    return run_standalone(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "inference_rank: error: %s\n", e.what());
    return 2;
  }
}

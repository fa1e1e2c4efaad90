// The inference_rank binary's flags (rank_flags.h): registration, refusals by mode, resolution.
#include "inference_rank/rank_flags.h"

#include <chrono>

#include "common/config.h"
#include "common/error.h"

namespace spade::inference_rank_cli {

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
    r.refuse("--serve", {"--teacher-force"}, "teacher forcing is a standalone fidelity measurement");
    r.refuse("--serve", {"--overlap-sample-every"},
             "the cluster's cache_rank samples its own selections: give it --overlap-sample-every");
  } else {
    if (app.count("--teacher-force") > 0) {
      r.refuse("--teacher-force", {"--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--ignore-eos"},
               "every generated token is forced (the prompt's last N tokens), none is sampled");
      r.refuse("--teacher-force", {"--chat"},
               "the forced tokens are the prompt text's last N; with the chat template they would be its tail");
      r.refuse_if(device == "cuda" && app.count("--host-sampling") == 0,
                  "--teacher-force on --device cuda needs --host-sampling (the forced token's logprob comes from the "
                  "host sampler)");
    }
    r.refuse("a standalone run (--prompt)",
             {"--master-addr", "--master-port", "--rank", "--world-size", "--num-inference", "--num-cache",
              "--role-map", "--cluster-secret-file", "--rendezvous-timeout-ms", "--metrics-port", "--metrics-host"},
             "it joins no cluster and serves no metrics: these need --serve");
    r.refuse("a standalone run (--prompt)", {"--gpu", "--gpu-link"},
             "it runs on GPU 0 (choose it with CUDA_VISIBLE_DEVICES), its cache rank in this process");
  }
  if (mode != spade::SelectionMode::Predicted)
    r.refuse(fmt::format("--selection {}", spade::selection_mode_name(mode)), {"--overlap-sample-every"},
             "it samples the predicted selection of the cache rank in this process (--selection predicted)");
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
    r.refuse_if(serve && (mode == spade::SelectionMode::Oracle || mode == spade::SelectionMode::Quest),
                fmt::format("--selection {} does not apply to --serve --device cuda (a fidelity reference: "
                            "synchronous selection with the true query in the one-process path, without --serve); "
                            "use dense or predicted",
                            spade::selection_mode_name(mode)));
    if (mode == spade::SelectionMode::Oracle || mode == spade::SelectionMode::Quest)
      r.refuse(fmt::format("--selection {} --device cuda", spade::selection_mode_name(mode)),
               {"--query-window", "--ridge-eps", "--predictor", "--anchor-queries", "--anchor-span", "--score-keys",
                "--delta-capacity", "--max-context-pages", "--selection-deadline-ms"},
               "it configures the predicted selection or its cache rank; the synchronous references select with "
               "the true query in this rank's forward pass");
    r.refuse_if(sparse.selection.sink_tokens > 0,
                fmt::format("--sink-tokens {} does not apply to --device cuda (the GPU path attends no sink tokens "
                            "of its own: they compete in the top-k); use 0",
                            sparse.selection.sink_tokens));
    if (serve)
      r.refuse("--serve --device cuda",
               {"--query-window", "--ridge-eps", "--gqa-rule", "--predictor", "--successor-expand", "--score-keys",
                "--anchor-queries", "--anchor-span"},
               "the cache_rank --device cuda process predicts and selects with its own: give them to it");
  }
  r.check();
}

void add_flags(CLI::App& app, Flags& f) {
  f.sp.temperature = -1;  // unset: generation_config.json decides (greedy unless do_sample)
  app.add_option("--model", f.model_dir, "Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
      ->required();
  auto* prompt_opt = app.add_option("--prompt", f.prompts, "prompt text; \"\" = the BOS token alone; repeat for a batch");
  auto* serve_opt = app.add_flag("--serve", f.serve, "run as an inference rank of a cluster (see docs/ARCHITECTURE.md)");
  prompt_opt->excludes(serve_opt);
  // Sparse decoding (AsyncSpade): the pair's settings (pair/selection_flags.h) and this rank's selection mode.
  app.add_option("--selection", f.selection, "dense | oracle | quest (synchronous, true query: fidelity references; not with --serve --device cuda) | predicted (AsyncSpade)");
  spade::pair::add_sparse_flags(app, f.so, f.sparse_text,
                                spade::pair::kSelectionFlags | spade::pair::kScheduleFlags |
                                    spade::pair::kDeltaCapacityFlag | spade::pair::kScoreKeysFlag |
                                    spade::pair::kOverlapSampleFlag);
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
  app.add_option("--max-retained-prefix-tokens", f.so.max_retained_prefix_tokens,
                 "--device cpu --selection predicted with prefix caching: tokens the cache rank may keep of ended "
                 "requests whose prompt prefix stays in this rank's prefix cache, so that a repeated prompt is not "
                 "shipped again (least recently used dropped beyond it; 0 = none). The cache rank's --kv-pages must "
                 "hold this rank's KV pool plus these tokens")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
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
                 "--serve --device cuda: the data plane to the cache rank: nccl (another GPU) | ipc (the same GPU, or "
                 "another GPU of this host with peer access: the copy engines move the bytes, no SM)");
  app.add_option("--teacher-force", f.teacher_force,
                 "standalone fidelity measurement: the last N tokens of each --prompt are forced, one decode step each "
                 "(not sampled); prints a JSON line per prompt with each forced token's logprob and the model's argmax")
      ->check(CLI::PositiveNumber);
  app.add_flag("--host-sampling", f.host_sampling,
               "--device cuda: copy the logits back and sample on the host (the CPU path's sampler) instead of on the "
               "GPU");
}

// --enable-prefix-caching: on by default where it applies. Hybrid models (a recurrent state is not paged) and the GPU
// synchronous references (--selection oracle|quest on --device cuda) turn it off and refuse the flag given explicitly.
// With a GPU cache rank (--device cuda --selection predicted) it is on only when given: the cache rank then also
// holds the retained prefixes (up to --max-retained-prefix-tokens of KV on its GPU beside the running contexts), a
// memory cost to opt into. A sparse backend needs the prompt's last queries (the predictor's window, the prompt
// anchors): those prompt tokens are always recomputed.
namespace {

void resolve_prefix_caching(const CLI::App& app, Flags& f) {
  const bool explicit_on = app.get_option("--enable-prefix-caching")->count() > 0 && f.prefix_caching;
  const bool hybrid = spade::load_model_config(f.model_dir).is_hybrid();
  const bool gpu_sync = f.device == "cuda" && (f.so.mode == spade::SelectionMode::Oracle ||
                                               f.so.mode == spade::SelectionMode::Quest);
  const bool gpu_pair = f.device == "cuda" && f.so.mode == spade::SelectionMode::Predicted;
  if (explicit_on && hybrid)
    spade::fail("--enable-prefix-caching: not supported for hybrid (linear-attention) models such as {} (their "
                "recurrent state is not paged)", f.model_dir);
  if (explicit_on && gpu_sync)
    spade::fail("--enable-prefix-caching: not supported with --device cuda and --selection {} (the GPU synchronous "
                "references)", f.selection);
  f.eo.enable_prefix_caching = f.prefix_caching && !hybrid && !gpu_sync && (!gpu_pair || explicit_on);
  // Retained prefixes: the CPU pair's cache rank keeps prefixes the prefix cache still holds (sparse_attention.h).
  if (app.get_option("--max-retained-prefix-tokens")->count() > 0 &&
      (!f.eo.enable_prefix_caching || f.so.mode != spade::SelectionMode::Predicted))
    spade::fail("--max-retained-prefix-tokens: needs --selection predicted with prefix caching on (got --selection {}, "
                "prefix caching {}): the cache rank keeps only prefixes that this rank's prefix cache holds",
                f.selection, f.eo.enable_prefix_caching ? "on" : "off");
  f.eo.prefix_recompute_tokens = f.so.prefix_recompute_tokens();
}

}  // namespace

void resolve_flags(const CLI::App& app, Flags& f) {
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
}

ServeOptions serve_options(const Flags& f) {
  ServeOptions sv;
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
  return sv;
}

}  // namespace spade::inference_rank_cli

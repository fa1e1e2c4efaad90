// Sparse decoding on the GPU path (inference_rank/gpu_sparse.h) against a GPU cache rank in the same process
// (cache_rank/gpu_local.h: a GpuCacheServer on its own thread, over a CudaIpcLink, both on GPU 0). Label gpu.
//
// What is checked:
// - Budget >= every context: the selection is every token outside the local window, so sparse decoding is dense
//   decoding up to summation order. Per engine step, the logits of the sparse run match the dense run's (same
//   weights, same scheduling, no CUDA graphs on either) until the first greedy token that differs; at least 40
//   (sequence, step) pairs were decoded sparsely before it, every request switched to sparse, and the cache rank
//   computed first and steady selections.
// - Budget < context (k 32, capacity 8): selections churn through the slot plan; every request finishes with its
//   full length, the logits stay finite, and the token agreement with dense decoding is printed (approximate).
// - The cache rank dies mid-run (its link aborted): the sparse requests end with FinishReason::Error naming the cache
//   rank, dense ones finish, later requests decode densely and the GPU stays usable. The sparse request had its
//   pages dropped: its last step attends only its window (never a dropped page).
// - Page dropping: a sparse request's pages outside its local window are freed and a new request's prefill takes
//   them (mixed steps: its chunks beside the sparse decode row); with a full budget, every step's logits equal those
//   of the same run without dropping (bigger pool, no page freed), step by step.
// - n samples of one prompt (Engine::submit_samples) share it on both ranks: the cache rank forks the group's slot
//   (its pages shared, its query and anchor windows copied), so the prompt is appended once; greedy samples of one
//   prompt then select, attend and decode alike, step by step, through a small budget's churn; the cache rank's peak
//   pages are the prompt once plus the tails, against three whole contexts for three separate requests.
// - Prefix caching on the pair: a prompt repeated after its first request ended forks the prefix the cache rank
//   retained (pages shared, not shipped again), and decodes as the first request did (full budget: sparse == dense up
//   to summation order, so a wrong page would show in the logits).
// - Bad options are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cache_rank/gpu_local.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sparse.h"
#include "tests/inference_rank/gpu_test_models.h"
#include "tests/inference_rank/greedy_request.h"
#include "transport/cuda_ipc/cuda_ipc_link.h"

namespace spade {
namespace {

using transport::CudaIpcLink;
using transport::CudaIpcLinkOptions;

// The shared Qwen3-like test model with 6 layers: 3 layer packs of 2.
ModelConfig qwen3_like() {
  ModelConfig c = test::qwen3_like();
  c.num_layers = 6;
  return c;
}

EngineOptions engine_options() {
  EngineOptions eo;
  eo.page_size = 16;
  eo.num_pages = 96;
  eo.max_num_seqs = 3;
  eo.max_num_batched_tokens = 64;
  eo.max_model_len = 512;
  return eo;
}

EngineOptions engine_options_normalised() {
  EngineOptions eo = engine_options();
  eo.num_pages = 96;
  return eo;
}

struct Sparse {
  int budget, window, capacity, threshold;
};

// Records every step's logits (the engine's ForwardFn) on top of the GPU forward pass.
struct Recorder {
  std::vector<std::vector<float>> steps;
};

struct RunResult {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<FinishReason> reasons;
  std::vector<std::string> errors;
  Recorder rec;
  GpuSparseStats sparse;
  cache::GpuCacheStats cache;
  std::string server_error;
  uint64_t graph_steps = 0, link_graph_steps = 0, eager_steps = 0;
};

const int kPrompt[3] = {40, 70, 24};
const int kMaxTokens[3] = {48, 40, 56};

std::vector<int32_t> prompt(int i, int vocab) {
  std::mt19937_64 rng(100 + static_cast<uint64_t>(i));
  std::vector<int32_t> p(static_cast<size_t>(kPrompt[i]));
  for (auto& t : p) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return p;
}

// The controller options of these tests: packs of 2 layers, every running sequence may be sparse.
// The binaries' fill (gpu_sparse_options) of these settings.
GpuSparseOptions test_sparse_options(const Sparse& sp, const EngineOptions& eo, int max_retained_prefix_tokens = 0) {
  pair::SparseConfig sc;
  sc.sparse_threshold = sp.threshold;
  sc.layers_per_pack = 2;
  sc.selection.token_budget = sp.budget;
  sc.selection.local_window = sp.window;
  sc.delta_capacity = sp.capacity;
  return gpu_sparse_options(sc, eo, "cache rank (test thread)", max_retained_prefix_tokens);
}

// The cache rank's own settings in these tests: a query window of 4.
pair::SparseConfig cache_side() {
  pair::SparseConfig c;
  c.selection.query_window = 4;
  return c;
}

// Three greedy requests; `sparse` nullptr: dense. `kill_after_steps` > 0: the cache rank's link is aborted after that
// many engine steps, and a fourth request is submitted once the first three ended. `graphs`: decode steps replay
// CUDA graphs when no link operation is in them (the cache rank is in this process: GpuEngineOptions::link_graphs
// stays off, as in `inference_rank --selection predicted`; tests/inference_rank/test_gpu_cluster.cu covers the link
// steps' graphs, with the cache rank in another process).
// `pipeline`: the cache rank's GpuCacheOptions::pipeline.
RunResult run(const Sparse* sparse, int kill_after_steps = 0, bool graphs = false, bool pipeline = true) {
  const ModelConfig cfg = qwen3_like();
  const EngineOptions eo = engine_options();
  GpuEngineOptions go = gpu_engine_options(eo, graphs);
  go.link_graphs = false;
  GpuEngineForward gpu(GpuModel::random(cfg, 31, GpuEngineForward::model_options(go)), go);
  // As the binaries do: every kernel's first-use set-up before an in-process cache rank can post a receive (a first
  // launch mid-run may synchronise the context and wait for that receive; gpu_engine.h warm_up).
  gpu.warm_up();
  RunResult out;
  Engine engine(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) {
    gpu(b, l);
    out.rec.steps.push_back(l);
  });

  std::unique_ptr<cache::LocalGpuCacheRank> cache_rank;
  std::unique_ptr<GpuSparseController> ctl;
  if (sparse != nullptr) {
    const ModelConfig attn = cfg.attention_view();
    const GpuSparseOptions so = test_sparse_options(*sparse, eo);
    cache_rank = std::make_unique<cache::LocalGpuCacheRank>(attn, cache_side(), 0, std::chrono::milliseconds(5000));
    cache_rank->set_pipeline(pipeline);
    ctl = std::make_unique<GpuSparseController>(attn, so, cache_rank->inference_link(), eo.page_size,
                                                gpu.max_batch());
    // The hello sizes the cache rank from this side's options (the path a separate cache_rank process takes too).
    ctl->send_hello(make_gpu_pair_hello(attn, so, engine.options()));
    cache_rank->wait_ready(std::chrono::milliseconds(30000));
    gpu.set_sparse(ctl.get());
    engine.set_attention_hooks(ctl.get());
  }

  const int n = 3;
  out.tokens.resize(4);
  out.reasons.assign(4, FinishReason::None);
  out.errors.resize(4);
  auto submit = [&](int i, const std::vector<int32_t>& ids, int max_tokens) {
    GenerateRequest r;
    r.prompt_ids = ids;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.f;
    r.ignore_eos = true;
    engine.submit(r, [&out, i](const TokenEvent& ev) {
      if (ev.token >= 0) out.tokens[static_cast<size_t>(i)].push_back(ev.token);
      if (ev.finished) {
        out.reasons[static_cast<size_t>(i)] = ev.reason;
        out.errors[static_cast<size_t>(i)] = ev.error;
      }
    });
  };
  for (int i = 0; i < n; ++i) submit(i, prompt(i, cfg.vocab_size), kMaxTokens[i]);
  int steps = 0;
  while (engine.step()) {
    if (++steps == kill_after_steps) cache_rank->cache_link().abort("test: the cache rank went down");
  }
  if (kill_after_steps > 0) {
    submit(3, prompt(0, cfg.vocab_size), 8);
    engine.run_until_idle();
  }
  if (ctl) ctl->close();  // the close plan: the cache rank leaves nothing pending
  if (cache_rank) {
    cache_rank->stop();
    out.cache = cache_rank->stats();
    out.server_error = cache_rank->error();
  }
  if (ctl) out.sparse = ctl->stats();
  out.graph_steps = gpu.graph_steps();
  out.link_graph_steps = gpu.link_graph_steps();
  out.eager_steps = gpu.eager_steps();
  gpu.set_sparse(nullptr);
  engine.set_attention_hooks(nullptr);
  return out;
}

float max_abs(const std::vector<float>& v) {
  float m = 0.f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

TEST(GpuSparse, FullBudgetMatchesDenseDecoding) {
  const RunResult dense = run(nullptr);
  const Sparse sp{/*budget=*/512, /*window=*/16, /*capacity=*/64, /*threshold=*/32};
  const RunResult got = run(&sp);
  ASSERT_EQ(got.server_error, "");
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(got.reasons[i], FinishReason::Length) << "request " << i << ": " << got.errors[i];
    ASSERT_EQ(got.tokens[i].size(), static_cast<size_t>(kMaxTokens[i]));
  }
  // Steps agree while every request's tokens agree.
  size_t agree = 0;
  for (int i = 0; i < 3; ++i) {
    size_t k = 0;
    while (k < got.tokens[i].size() && got.tokens[i][k] == dense.tokens[i][k]) ++k;
    agree += k;
  }
  size_t compared = 0;
  float worst = 0.f;
  const size_t steps = std::min(got.rec.steps.size(), dense.rec.steps.size());
  for (size_t s = 0; s < steps; ++s) {
    const auto& a = got.rec.steps[s];
    const auto& b = dense.rec.steps[s];
    if (a.size() != b.size()) break;  // scheduling diverged (a request ended earlier): stop comparing
    float d = 0.f;
    for (size_t j = 0; j < a.size(); ++j) d = std::max(d, std::fabs(a[j] - b[j]));
    const float tol = 0.02f * max_abs(b) + 1e-3f;
    worst = std::max(worst, d / std::max(max_abs(b), 1e-6f));
    bool same_tokens = true;
    // Compare only up to the first step whose greedy tokens differ somewhere.
    const int V = qwen3_like().vocab_size;
    for (size_t r = 0; r * V < a.size(); ++r) {
      const auto ia = std::max_element(a.begin() + static_cast<long>(r * V), a.begin() + static_cast<long>((r + 1) * V));
      const auto ib = std::max_element(b.begin() + static_cast<long>(r * V), b.begin() + static_cast<long>((r + 1) * V));
      same_tokens &= (ia - a.begin()) == (ib - b.begin());
    }
    EXPECT_LE(d, tol) << "step " << s;
    ++compared;
    if (!same_tokens) break;
  }
  std::printf("[ sparse   ] full budget: %zu steps compared (worst |diff| %.2e of max |logit|), %zu of %d tokens agree "
              "before the first divergence; %llu sparse (sequence, step) pairs, %llu switches; cache rank: %llu "
              "selections (%llu first), %llu tokens appended\n",
              compared, static_cast<double>(worst), agree, kMaxTokens[0] + kMaxTokens[1] + kMaxTokens[2],
              static_cast<unsigned long long>(got.sparse.sparse_seq_steps),
              static_cast<unsigned long long>(got.sparse.switches),
              static_cast<unsigned long long>(got.cache.selections),
              static_cast<unsigned long long>(got.cache.first_selections),
              static_cast<unsigned long long>(got.cache.tokens_appended));
  EXPECT_EQ(got.sparse.switches, 3u);
  EXPECT_EQ(got.cache.first_selections, 3u);
  EXPECT_GT(got.cache.selections, got.cache.first_selections);
  EXPECT_GE(got.sparse.sparse_seq_steps, 40u);
  EXPECT_GE(compared, 20u);
  EXPECT_EQ(got.sparse.failed_seqs, 0u);
  // Every token of every sequence reached the cache rank.
  size_t tokens = 0;
  for (int i = 0; i < 3; ++i) tokens += static_cast<size_t>(kPrompt[i] + kMaxTokens[i] - 1);
  EXPECT_EQ(got.cache.tokens_appended, tokens);
}


TEST(GpuSparse, SmallBudgetChurnsThroughDeltas) {
  const RunResult dense = run(nullptr);
  const Sparse sp{/*budget=*/32, /*window=*/16, /*capacity=*/8, /*threshold=*/32};
  const RunResult got = run(&sp);
  ASSERT_EQ(got.server_error, "");
  size_t agree = 0;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(got.reasons[i], FinishReason::Length) << "request " << i << ": " << got.errors[i];
    ASSERT_EQ(got.tokens[i].size(), static_cast<size_t>(kMaxTokens[i]));
    size_t k = 0;
    while (k < got.tokens[i].size() && got.tokens[i][k] == dense.tokens[i][k]) ++k;
    agree += k;
  }
  for (const auto& s : got.rec.steps)
    for (float x : s) ASSERT_TRUE(std::isfinite(x));
  std::printf("[ sparse   ] k 32, C 8: %zu of %d greedy tokens agree with dense decoding before the first divergence; "
              "%llu sparse (sequence, step) pairs; %llu bytes up, %llu bytes down\n",
              agree, kMaxTokens[0] + kMaxTokens[1] + kMaxTokens[2],
              static_cast<unsigned long long>(got.sparse.sparse_seq_steps),
              static_cast<unsigned long long>(got.sparse.bytes_sent),
              static_cast<unsigned long long>(got.sparse.bytes_received));
  EXPECT_GE(got.sparse.sparse_seq_steps, 40u);
  EXPECT_EQ(got.sparse.switches, 3u);
}

// The pipelined cache rank (scoring and top-k / delta / gather on two more streams, double-buffered scratch) must
// select exactly what the serial one does: every step's logits equal, bit for bit, through the churn of a small
// budget (a missing wait between the streams would let a selection read another's queries or scores).
TEST(GpuSparse, PipelinedCacheRankSelectsAsTheSerialOne) {
  const Sparse sp{/*budget=*/32, /*window=*/16, /*capacity=*/8, /*threshold=*/32};
  const RunResult serial = run(&sp, 0, false, /*pipeline=*/false);
  const RunResult piped = run(&sp, 0, false, /*pipeline=*/true);
  ASSERT_EQ(serial.server_error, "");
  ASSERT_EQ(piped.server_error, "");
  ASSERT_GE(piped.sparse.sparse_seq_steps, 40u);
  ASSERT_EQ(piped.rec.steps.size(), serial.rec.steps.size());
  for (size_t s = 0; s < piped.rec.steps.size(); ++s) ASSERT_EQ(piped.rec.steps[s], serial.rec.steps[s]) << "step " << s;
  EXPECT_EQ(piped.tokens, serial.tokens);
  EXPECT_EQ(piped.cache.selections, serial.cache.selections);
}

void dead_cache_rank_fails_only_the_sparse_requests(bool graphs) {
  const Sparse sp{/*budget=*/64, /*window=*/16, /*capacity=*/16, /*threshold=*/60};
  // Request 1 (70-token prompt) is sparse from its first decode step; request 0 (40) switches at step ~20 of its
  // decode, request 2 (24) at ~36. Kill after a few decode steps: only request 1 is sparse then.
  const RunResult got = run(&sp, /*kill_after_steps=*/8, graphs);
  EXPECT_NE(got.server_error, "");  // the server saw the abort
  EXPECT_EQ(got.reasons[1], FinishReason::Error);
  EXPECT_NE(got.errors[1].find("cache rank (test thread) failed"), std::string::npos) << got.errors[1];
  EXPECT_EQ(got.reasons[0], FinishReason::Length) << got.errors[0];
  EXPECT_EQ(got.reasons[2], FinishReason::Length) << got.errors[2];
  EXPECT_EQ(got.tokens[0].size(), static_cast<size_t>(kMaxTokens[0]));
  EXPECT_EQ(got.reasons[3], FinishReason::Length) << got.errors[3];  // submitted after the failure: dense
  EXPECT_EQ(got.sparse.failed_seqs, 1u);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (graphs) {
    EXPECT_EQ(got.link_graph_steps, 0u);  // in-process cache rank: link steps run eagerly
    EXPECT_GT(got.graph_steps, 0u);       // once the link is gone, decode steps replay the dense graphs
  }
}

TEST(GpuSparse, DeadCacheRankFailsOnlyTheSparseRequests) { dead_cache_rank_fails_only_the_sparse_requests(false); }
TEST(GpuSparse, DeadCacheRankFailsOnlyTheSparseRequestsWithCudaGraphs) {
  dead_cache_rank_fails_only_the_sparse_requests(true);
}

// ---- page dropping ----

struct SampleRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<FinishReason> reasons;
  std::vector<std::string> errors;
  std::vector<std::vector<float>> steps;  // logits per engine step, [rows][vocab]
  GpuSparseStats sparse;
  cache::GpuCacheStats cache;
  std::string server_error;
  bool pages_back = false;  // the inference rank's pool is whole again after the run
};

constexpr int kSamplePrompt = 100, kSampleTokens = 40, kSamples = 3;

// Three greedy continuations of one 100-token prompt, sparse from context 100 with a budget of 32 and a delta
// capacity of 8 (the selections churn; prompt anchors on): `shared` as n = 3 samples of one request (the group
// prefills 96 tokens, the samples fork it), else as three separate requests.
SampleRun run_samples(bool shared) {
  const ModelConfig cfg = qwen3_like();
  EngineOptions eo = engine_options();
  const GpuEngineOptions go = gpu_engine_options(eo, /*cuda_graphs=*/false);
  GpuEngineForward gpu(GpuModel::random(cfg, 31, GpuEngineForward::model_options(go)), go);
  gpu.warm_up();  // before the in-process cache rank exists (see run())
  SampleRun out;
  Engine engine(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) {
    gpu(b, l);
    out.steps.push_back(l);
  });
  const ModelConfig attn = cfg.attention_view();
  const GpuSparseOptions so =
      test_sparse_options(Sparse{/*budget=*/32, /*window=*/16, /*capacity=*/8, /*threshold=*/100}, eo);
  auto cache_rank = std::make_unique<cache::LocalGpuCacheRank>(attn, cache_side(), 0, std::chrono::milliseconds(5000));
  auto ctl = std::make_unique<GpuSparseController>(attn, so, cache_rank->inference_link(), eo.page_size,
                                                   gpu.max_batch());
  ctl->send_hello(make_gpu_pair_hello(attn, so, engine.options()));
  cache_rank->wait_ready(std::chrono::milliseconds(30000));
  gpu.set_sparse(ctl.get());
  engine.set_attention_hooks(ctl.get());

  GenerateRequest req;
  std::mt19937_64 rng(300);
  req.prompt_ids.resize(kSamplePrompt);
  for (auto& t : req.prompt_ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
  req.max_tokens = kSampleTokens;
  req.sampling.temperature = 0.f;
  req.ignore_eos = true;
  out.tokens.resize(kSamples);
  out.reasons.assign(kSamples, FinishReason::None);
  out.errors.resize(kSamples);
  std::map<uint64_t, int> index;
  auto cb = [&](const TokenEvent& ev) {
    const int i = index.at(ev.request_id);
    if (ev.token >= 0) out.tokens[static_cast<size_t>(i)].push_back(ev.token);
    if (ev.finished) {
      out.reasons[static_cast<size_t>(i)] = ev.reason;
      out.errors[static_cast<size_t>(i)] = ev.error;
    }
  };
  std::vector<uint64_t> ids;
  if (shared) {
    ids = engine.submit_samples(req, kSamples, cb);
  } else {
    for (int i = 0; i < kSamples; ++i) ids.push_back(engine.submit(req, cb));
  }
  for (int i = 0; i < kSamples; ++i) index[ids[static_cast<size_t>(i)]] = i;
  engine.run_until_idle();
  ctl->close();
  cache_rank->stop();
  out.server_error = cache_rank->error();
  out.cache = cache_rank->stats();
  out.sparse = ctl->stats();
  out.pages_back = engine.pages().num_free_pages() == engine.pages().num_pages();
  gpu.set_sparse(nullptr);
  engine.set_attention_hooks(nullptr);
  return out;
}

TEST(GpuSparse, SamplesShareThePromptOnTheCacheRank) {
  const SampleRun got = run_samples(true);
  const SampleRun alone = run_samples(false);
  for (const SampleRun* r : {&got, &alone}) {
    ASSERT_EQ(r->server_error, "");
    for (int i = 0; i < kSamples; ++i) {
      ASSERT_EQ(r->reasons[static_cast<size_t>(i)], FinishReason::Length)
          << "sample " << i << ": " << r->errors[static_cast<size_t>(i)];
      ASSERT_EQ(r->tokens[static_cast<size_t>(i)].size(), static_cast<size_t>(kSampleTokens));
    }
    EXPECT_EQ(r->sparse.switches, static_cast<uint64_t>(kSamples));
    EXPECT_EQ(r->sparse.failed_seqs, 0u);
    EXPECT_GE(r->sparse.sparse_seq_steps, static_cast<uint64_t>(kSamples) * 30);
    EXPECT_TRUE(r->pages_back) << "a page is still held on the inference rank";
  }
  // The group computes and ships 96 prompt tokens once (whole pages, prefix_recompute_tokens 1 left); each sample
  // its last 4 and its own 39 tokens. Three requests ship everything three times.
  const int shared_tokens = 96;
  EXPECT_EQ(got.cache.forks, static_cast<uint64_t>(kSamples - 1)) << "the first sample took over the group's slot";
  EXPECT_EQ(alone.cache.forks, 0u);
  EXPECT_EQ(got.cache.tokens_appended,
            static_cast<uint64_t>(shared_tokens + kSamples * (kSamplePrompt - shared_tokens + kSampleTokens - 1)));
  EXPECT_EQ(alone.cache.tokens_appended, static_cast<uint64_t>(kSamples * (kSamplePrompt + kSampleTokens - 1)));
  // Pages of 16: a context of 139 tokens holds 9; the prompt's 6 whole pages once, plus 3 per sample.
  EXPECT_LE(got.cache.peak_pages_held, static_cast<uint64_t>(6 + kSamples * 3));
  EXPECT_EQ(alone.cache.peak_pages_held, static_cast<uint64_t>(kSamples * 9));
  // Greedy samples of one prompt: the same tokens, and step by step the same logits in every sample's row. A forked
  // sample with the wrong pages or windows would predict other queries, select other tokens and attend other KV.
  for (int i = 1; i < kSamples; ++i) EXPECT_EQ(got.tokens[static_cast<size_t>(i)], got.tokens[0]) << "sample " << i;
  const size_t V = static_cast<size_t>(qwen3_like().vocab_size);
  size_t compared = 0;
  float worst = 0.f;
  for (size_t s = 0; s < got.steps.size(); ++s) {
    const auto& l = got.steps[s];
    if (l.size() != kSamples * V) continue;  // the group's prefill steps have no logits
    const std::vector<float> row0(l.begin(), l.begin() + static_cast<long>(V));
    const float scale = std::max(max_abs(row0), 1e-6f);
    for (size_t r = 1; r < static_cast<size_t>(kSamples); ++r) {
      float d = 0.f;
      for (size_t j = 0; j < V; ++j) d = std::max(d, std::fabs(l[r * V + j] - row0[j]));
      worst = std::max(worst, d / scale);
      EXPECT_LE(d, 1e-4f * scale) << "step " << s << ", sample " << r;
    }
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<size_t>(kSampleTokens));
  size_t agree = 0;
  for (int i = 0; i < kSamples; ++i) {
    size_t k = 0;
    while (k < static_cast<size_t>(kSampleTokens) && got.tokens[static_cast<size_t>(i)][k] == alone.tokens[static_cast<size_t>(i)][k]) ++k;
    agree += k;
  }
  std::printf("[ samples  ] 3 samples of a 100-token prompt, k 32, C 8: %zu steps compared across the samples (worst "
              "|diff| %.2e of max |logit|); cache rank: %llu tokens appended, peak %llu pages, %llu forks (3 "
              "requests: %llu tokens, peak %llu pages); %zu of %d tokens agree with the 3 requests before the first "
              "divergence (another prefill chunking)\n",
              compared, static_cast<double>(worst), static_cast<unsigned long long>(got.cache.tokens_appended),
              static_cast<unsigned long long>(got.cache.peak_pages_held),
              static_cast<unsigned long long>(got.cache.forks),
              static_cast<unsigned long long>(alone.cache.tokens_appended),
              static_cast<unsigned long long>(alone.cache.peak_pages_held), agree, kSamples * kSampleTokens);
}

// The prefix-caching tests' pair: the GPU engine with prefix caching (the serving rule for the recomputed prompt
// tokens, max(W + 1, anchor queries) = 64) and an in-process cache rank retaining up to 4096 tokens, paired through
// the hello. `steps` records every step's logits. finish() closes the pair; then cache_rank's stats are final.
struct PrefixCachingPair {
  static EngineOptions options() {
    EngineOptions eo = engine_options();
    eo.enable_prefix_caching = true;
    eo.prefix_recompute_tokens = 64;
    return eo;
  }
  ModelConfig cfg = qwen3_like();
  EngineOptions eo = options();
  GpuEngineOptions go = gpu_engine_options(eo, /*cuda_graphs=*/false);
  GpuEngineForward gpu{GpuModel::random(cfg, 31, GpuEngineForward::model_options(go)), go};
  std::vector<std::vector<float>> steps;
  Engine engine{cfg, eo, [this](const ForwardBatch& b, std::vector<float>& l) {
                  gpu(b, l);
                  steps.push_back(l);
                }};
  ModelConfig attn = cfg.attention_view();
  GpuSparseOptions so;
  pair::GpuPairHello hello;
  std::unique_ptr<cache::LocalGpuCacheRank> cache_rank;
  std::unique_ptr<GpuSparseController> ctl;

  explicit PrefixCachingPair(const Sparse& sp) {
    gpu.warm_up();  // before the in-process cache rank exists (see run())
    so = test_sparse_options(sp, eo, /*max_retained_prefix_tokens=*/4096);
    cache_rank = std::make_unique<cache::LocalGpuCacheRank>(attn, cache_side(), 0, std::chrono::milliseconds(5000));
    ctl = std::make_unique<GpuSparseController>(attn, so, cache_rank->inference_link(), eo.page_size, gpu.max_batch());
    hello = make_gpu_pair_hello(attn, so, engine.options());
    ctl->send_hello(hello);
    cache_rank->wait_ready(std::chrono::milliseconds(30000));
    gpu.set_sparse(ctl.get());
    engine.set_attention_hooks(ctl.get());
  }
  ~PrefixCachingPair() { finish(); }
  void finish() {
    if (!ctl) return;
    ctl->close();
    cache_rank->stop();
    gpu.set_sparse(nullptr);
    engine.set_attention_hooks(nullptr);
    ctl_closed = std::move(ctl);
  }
  std::unique_ptr<GpuSparseController> ctl_closed;  // after finish(): its stats stay readable
  const GpuSparseController& controller() const { return ctl ? *ctl : *ctl_closed; }
};

// A 200-token prompt twice, one request after the other (greedy, 40 tokens each), prefix caching on and the cache
// rank retaining up to 4096 tokens; the serving rule for the recomputed prompt tokens (max(W + 1, anchor queries) =
// 64), so the repeat may reuse 136 tokens: 8 whole pages.
TEST(GpuSparse, ARepeatedPromptForksTheRetainedPrefix) {
  PrefixCachingPair pp(Sparse{/*budget=*/512, /*window=*/16, /*capacity=*/64, /*threshold=*/200});
  const ModelConfig& cfg = pp.cfg;
  Engine& engine = pp.engine;
  std::vector<std::vector<float>>& steps = pp.steps;
  EXPECT_EQ(pp.hello.num_pages, engine.options().max_context_pages + 4096 / pp.eo.page_size)
      << "the cache rank's pool holds the retained prefixes too";
  std::mt19937_64 rng(400);
  GenerateRequest req;
  req.prompt_ids.resize(200);
  for (auto& t : req.prompt_ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
  req.max_tokens = 40;
  req.sampling.temperature = 0.f;
  req.ignore_eos = true;
  std::vector<std::vector<int32_t>> tokens(2);
  std::vector<size_t> first_step(2);  // index into `steps` of each request's first logits
  for (int i = 0; i < 2; ++i) {
    FinishReason reason = FinishReason::None;
    std::string error;
    first_step[static_cast<size_t>(i)] = std::numeric_limits<size_t>::max();
    engine.submit(req, [&, i](const TokenEvent& ev) {
      if (ev.token >= 0) {
        if (tokens[static_cast<size_t>(i)].empty()) first_step[static_cast<size_t>(i)] = steps.size() - 1;
        tokens[static_cast<size_t>(i)].push_back(ev.token);
      }
      if (ev.finished) {
        reason = ev.reason;
        error = ev.error;
      }
    });
    engine.run_until_idle();
    ASSERT_EQ(reason, FinishReason::Length) << "request " << i << ": " << error;
    ASSERT_EQ(tokens[static_cast<size_t>(i)].size(), 40u);
  }
  const EngineStats est = engine.stats();
  pp.finish();
  ASSERT_EQ(pp.cache_rank->error(), "");
  const cache::GpuCacheStats cs = pp.cache_rank->stats();
  const GpuSparseStats ss = pp.controller().stats();
  const SparseStepPlanner::RetentionStats rs = pp.controller().retention_stats();
  EXPECT_EQ(ss.switches, 2u);
  EXPECT_EQ(ss.failed_seqs, 0u);
  EXPECT_EQ(est.prefix_hit_tokens, 128u) << "8 whole pages of the repeat from the prefix cache";
  EXPECT_EQ(rs.retained, 1u) << "the first request's prefix; the repeat's own is covered by it";
  EXPECT_EQ(rs.reused, 1u);
  EXPECT_EQ(cs.retained_hits, 1u);
  EXPECT_EQ(cs.retained_hit_tokens, 128u);
  EXPECT_EQ(cs.retained_prefixes, 1u);
  EXPECT_EQ(cs.tokens_appended, static_cast<uint64_t>((200 + 39) + (200 - 128 + 39))) << "the reused prefix not shipped";
  // Token by token, the repeat's logits are the first request's (the prefix's KV came from the retained pages on the
  // cache rank and the prefix cache here), until the first greedy token that differs.
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  size_t compared = 0;
  float worst = 0.f;
  for (size_t k = 0; k < 40; ++k) {
    const auto& a = steps[first_step[0] + k];
    const auto& b = steps[first_step[1] + k];
    ASSERT_EQ(a.size(), V);
    ASSERT_EQ(b.size(), V);
    float d = 0.f;
    for (size_t j = 0; j < V; ++j) d = std::max(d, std::fabs(a[j] - b[j]));
    const float scale = std::max(max_abs(a), 1e-6f);
    worst = std::max(worst, d / scale);
    EXPECT_LE(d, 0.02f * scale) << "token " << k;
    ++compared;
    if (tokens[0][k] != tokens[1][k]) break;
  }
  std::printf("[ prefix   ] repeat of a 200-token prompt: %llu tokens from the retained prefix; cache rank appended %llu "
              "tokens; %zu tokens compared with the first request (worst |diff| %.2e of max |logit|)\n",
              static_cast<unsigned long long>(cs.retained_hit_tokens),
              static_cast<unsigned long long>(cs.tokens_appended), compared, static_cast<double>(worst));
  EXPECT_GE(compared, 10u);
}

// Aborts around forks and retained prefixes, prefix caching on (retaining up to 4096 tokens), budget 32 so the
// samples drop pages, n = 3 samples each time:
//   A (prompt P): sample 2 aborted before any step, sample 1 after 5 sparse tokens; sample 0 runs to its end and its
//     prefix is retained;
//   B (P again): the whole shared part comes from A's retained prefix (no group prefill row); sample 0 aborted before
//     its first row (its pin goes with it), sample 1 after its first token (its fork was applied); sample 2 runs on;
//   C (prompt Q): samples 0 (which took over the group's slot) and 1 aborted after the group prefill, before the plan
//     that forks them (sample 2's fork from the slot comes with the slot's release in one plan); sample 2 runs on;
//   D (prompt R): every sample aborted midway through the group prefill.
// The surviving samples end normally; once a one-token request's plan has carried every release, the cache rank
// holds the retained prefixes' pages and that request's one page, nothing else (no slot, fork or pin leaks), and the
// inference rank's pool is whole again.
TEST(GpuSparse, AbortsAroundForksLeaveOnlyTheRetainedPrefixesOnTheCacheRank) {
  PrefixCachingPair pp(Sparse{/*budget=*/32, /*window=*/16, /*capacity=*/8, /*threshold=*/100});
  const ModelConfig& cfg = pp.cfg;
  Engine& engine = pp.engine;
  std::mt19937_64 rng(500);
  auto random_prompt = [&](int n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& t : p) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
    return p;
  };
  const std::vector<int32_t> P = random_prompt(200), Q = random_prompt(300), R = random_prompt(300);
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, FinishReason> reasons;
  std::map<uint64_t, std::string> errors;
  auto cb = [&](const TokenEvent& ev) {
    if (ev.token >= 0) tokens[ev.request_id].push_back(ev.token);
    if (ev.finished) {
      reasons[ev.request_id] = ev.reason;
      errors[ev.request_id] = ev.error;
    }
  };
  auto step_until = [&](const std::function<bool()>& done) {  // at most 64 steps
    for (int i = 0; i < 64 && !done(); ++i)
      if (!engine.step()) break;
    return done();
  };
  std::vector<uint64_t> survivors, aborted;

  const std::vector<uint64_t> a = engine.submit_samples(test::greedy(P, 40), 3, cb);
  engine.abort(a[2]);
  ASSERT_TRUE(step_until([&] { return tokens[a[1]].size() >= 5; })) << "A: sample 1's fifth token";
  engine.abort(a[1]);
  engine.run_until_idle();
  pp.ctl->idle_flush();  // as the serve loop does once the engine is idle
  survivors.push_back(a[0]);
  aborted.insert(aborted.end(), {a[1], a[2]});

  const std::vector<uint64_t> b = engine.submit_samples(test::greedy(P, 24), 3, cb);
  engine.abort(b[0]);
  ASSERT_TRUE(step_until([&] { return !tokens[b[1]].empty(); })) << "B: sample 1's first token";
  engine.abort(b[1]);
  engine.run_until_idle();
  pp.ctl->idle_flush();  // as the serve loop does once the engine is idle
  survivors.push_back(b[2]);
  aborted.insert(aborted.end(), {b[0], b[1]});

  const std::vector<uint64_t> c = engine.submit_samples(test::greedy(Q, 24), 3, cb);
  ASSERT_TRUE(step_until([&] { return engine.stats().num_running == 3; })) << "C: the group prefill's end";
  ASSERT_TRUE(tokens[c[0]].empty() && tokens[c[1]].empty() && tokens[c[2]].empty())
      << "C: the samples decoded before their forks were planned";
  engine.abort(c[0]);
  engine.abort(c[1]);
  engine.run_until_idle();
  pp.ctl->idle_flush();  // as the serve loop does once the engine is idle
  survivors.push_back(c[2]);
  aborted.insert(aborted.end(), {c[0], c[1]});

  const std::vector<uint64_t> d = engine.submit_samples(test::greedy(R, 24), 3, cb);
  ASSERT_TRUE(engine.step());
  ASSERT_EQ(engine.stats().num_running, 1) << "D: the group prefill is one step in";
  for (uint64_t id : d) engine.abort(id);
  engine.run_until_idle();
  pp.ctl->idle_flush();  // as the serve loop does once the engine is idle
  aborted.insert(aborted.end(), d.begin(), d.end());

  const bool pages_back = engine.pages().num_free_pages() == engine.pages().num_pages();
  const int retained_pages = pp.ctl->retained_pages();
  const SparseStepPlanner::RetentionStats rs = pp.ctl->retention_stats();
  const GpuSparseStats ss = pp.ctl->stats();
  pp.finish();
  ASSERT_EQ(pp.cache_rank->error(), "");
  const cache::GpuCacheStats cs = pp.cache_rank->stats();

  for (uint64_t id : survivors) {
    EXPECT_EQ(reasons[id], FinishReason::Length) << "request " << id << ": " << errors[id];
    EXPECT_EQ(tokens[id].size(), id == a[0] ? 40u : 24u) << "request " << id;
  }
  for (uint64_t id : aborted) EXPECT_EQ(reasons[id], FinishReason::Abort) << "request " << id << ": " << errors[id];
  EXPECT_EQ(ss.failed_seqs, 0u);
  EXPECT_GE(ss.switches, 3u) << "A's sample 0 and 1, B's and C's sample 2 went sparse";
  EXPECT_TRUE(pages_back) << "a page is still held on the inference rank";
  EXPECT_GE(rs.retained, 1u);
  EXPECT_GE(rs.reused, 1u) << "B started from A's retained prefix";
  // As in the CPU replay of this script (test_plan_replay.cpp): A's sample 1 and C's sample 2 forked from a slot, B's
  // samples 1 and 2 from A's retained prefix.
  EXPECT_EQ(cs.forks, 2u);
  EXPECT_EQ(cs.retained_hits, 2u);
  EXPECT_EQ(cs.retained_prefixes, rs.retained - rs.dropped);
  EXPECT_EQ(ss.idle_flushes, 4u) << "each of A, B, C and D ended with the engine idle and its releases waiting";
  EXPECT_EQ(cs.idle_flushes, ss.idle_flushes);
  EXPECT_EQ(cs.sequences, 0u) << "the idle flushes released every slot";
  EXPECT_EQ(cs.pool_pages, static_cast<uint64_t>(pp.hello.num_pages));
  EXPECT_EQ(cs.pages_held, static_cast<uint64_t>(retained_pages))
      << "the cache rank holds pages of no live sequence and no retained prefix";
  std::printf("[ aborts   ] 4 groups of 3 samples, 9 aborted around their forks: %llu forks, %llu retained-prefix "
              "hits, %llu prefixes retained (%d pages), cache rank holds %llu pages at the end\n",
              static_cast<unsigned long long>(cs.forks), static_cast<unsigned long long>(cs.retained_hits),
              static_cast<unsigned long long>(cs.retained_prefixes), retained_pages,
              static_cast<unsigned long long>(cs.pages_held));
}

// The engine's hooks without page dropping: the reference run keeps every page.
class NoDropHooks : public AttentionBackend {
 public:
  explicit NoDropHooks(GpuSparseController& c) : c_(c) {}
  void attend(int layer, const ForwardBatch& b, const float* q, const float* k, const float* v, float* out) override {
    c_.attend(layer, b, q, k, v, out);
  }
  void on_release(uint64_t id) override { c_.on_release(id); }
  void on_fork(uint64_t parent, uint64_t child) override { c_.on_fork(parent, child); }
  std::vector<std::pair<uint64_t, std::string>> take_failures() override { return c_.take_failures(); }

 private:
  GpuSparseController& c_;
};

struct DropRun {
  std::vector<std::vector<float>> steps;  // logits per engine step
  std::vector<std::vector<int32_t>> tokens;
  std::vector<FinishReason> reasons;
  std::vector<std::string> errors;
  int mixed_sparse_steps = 0;  // steps with a prefill chunk and a sparse decode row
  int a_max_held_after_drop = 0;
  bool b_reuses_a_pages = false;
  uint64_t dropped_pages = 0;
  GpuSparseStats sparse;
  std::string server_error;
};

// Request A (200-token prompt, 40 tokens: 15 pages) decodes sparsely from its first decode step (step 5). After step
// 29 (A's context 225), request B (100-token prompt, 12 tokens: 7 pages) arrives: its prefill runs in two mixed steps
// beside A's sparse decode row, then both decode (B sparsely too). With `drop`, the engine's pool is 16 pages: A
// holds 15 pages in full, so B fits only in the pages A dropped (13 of them by then), and B's first pages are A's
// old ones (the allocator takes the lowest long free run). Without, a pool of 64 pages and no page freed. The cache
// rank holds every context in full: 64 pages (max_context_pages) in both runs, so admission is the same.
DropRun run_drop(bool drop) {
  const ModelConfig cfg = qwen3_like();
  EngineOptions eo = engine_options();
  eo.num_pages = drop ? 16 : 64;
  eo.max_context_pages = 64;
  GpuEngineOptions go = gpu_engine_options(eo, /*cuda_graphs=*/false);
  GpuEngineForward gpu(GpuModel::random(cfg, 31, GpuEngineForward::model_options(go)), go);
  gpu.warm_up();  // before the in-process cache rank exists (see run())
  DropRun out;
  std::unique_ptr<cache::LocalGpuCacheRank> cache_rank;  // outlives the controller (it owns the link)
  std::unique_ptr<GpuSparseController> ctl;
  Engine engine(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) {
    gpu(b, l);
    out.steps.push_back(l);
    if (b.total_tokens() != b.batch() && ctl->sparse_this_step()) ++out.mixed_sparse_steps;
  });
  const ModelConfig attn = cfg.attention_view();
  // Budget 512 >= every context: sparse == dense up to summation order.
  const GpuSparseOptions so =
      test_sparse_options(Sparse{/*budget=*/512, /*window=*/16, /*capacity=*/64, /*threshold=*/32}, eo);
  cache_rank = std::make_unique<cache::LocalGpuCacheRank>(attn, cache_side(), 0, std::chrono::milliseconds(5000));
  ctl = std::make_unique<GpuSparseController>(attn, so, cache_rank->inference_link(), eo.page_size, gpu.max_batch());
  const pair::GpuPairHello hello = make_gpu_pair_hello(attn, so, engine.options());
  EXPECT_EQ(hello.num_pages, 64) << "the cache rank's pool is the engine's bound on full contexts";
  ctl->send_hello(hello);
  cache_rank->wait_ready(std::chrono::milliseconds(30000));
  gpu.set_sparse(ctl.get());
  NoDropHooks no_drop(*ctl);
  engine.set_attention_hooks(drop ? static_cast<AttentionBackend*>(ctl.get()) : &no_drop);

  out.tokens.resize(2);
  out.reasons.assign(2, FinishReason::None);
  out.errors.resize(2);
  auto submit = [&](int i, int prompt_len, int max_tokens) {
    std::mt19937_64 rng(200 + static_cast<uint64_t>(i));
    GenerateRequest r;
    r.prompt_ids.resize(static_cast<size_t>(prompt_len));
    for (auto& t : r.prompt_ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.f;
    r.ignore_eos = true;
    return engine.submit(r, [&out, i](const TokenEvent& ev) {
      if (ev.token >= 0) out.tokens[static_cast<size_t>(i)].push_back(ev.token);
      if (ev.finished) {
        out.reasons[static_cast<size_t>(i)] = ev.reason;
        out.errors[static_cast<size_t>(i)] = ev.error;
      }
    });
  };
  const uint64_t a = submit(0, 200, 40);
  uint64_t b = 0;
  std::vector<char> a_pages(static_cast<size_t>(eo.num_pages), 0);  // every page A ever held
  int steps = 0;
  while (engine.step()) {
    ++steps;
    const PageAllocator& pages = engine.pages();
    if (pages.contains(a)) {
      for (int32_t pg : pages.block_table(a))
        if (pg >= 0) a_pages[static_cast<size_t>(pg)] = 1;
      if (pages.held_pages(a) < static_cast<int>(pages.block_table(a).size()))
        out.a_max_held_after_drop = std::max(out.a_max_held_after_drop, pages.held_pages(a));
    }
    if (b != 0 && pages.contains(b))
      for (int32_t pg : pages.block_table(b))
        if (pg >= 0 && a_pages[static_cast<size_t>(pg)] != 0) out.b_reuses_a_pages = true;
    if (steps == 29) {
      b = submit(1, 100, 12);
      EXPECT_TRUE(pages.contains(a)) << "A still runs when B arrives";
    }
  }
  ctl->close();
  cache_rank->stop();
  out.server_error = cache_rank->error();
  out.sparse = ctl->stats();
  out.dropped_pages = engine.stats().dropped_pages;
  gpu.set_sparse(nullptr);
  engine.set_attention_hooks(nullptr);
  return out;
}

TEST(GpuSparse, DroppedPagesAreReusedAndTheLogitsEqualTheUndroppedRun) {
  const DropRun kept = run_drop(false);
  const DropRun got = run_drop(true);
  ASSERT_EQ(got.server_error, "");
  ASSERT_EQ(kept.server_error, "");
  for (const DropRun* r : {&kept, &got}) {
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(r->reasons[static_cast<size_t>(i)], FinishReason::Length)
          << "request " << i << ": " << r->errors[static_cast<size_t>(i)];
    }
    EXPECT_EQ(r->tokens[0].size(), 40u);
    EXPECT_EQ(r->tokens[1].size(), 12u);
    EXPECT_EQ(r->sparse.failed_seqs, 0u);
    EXPECT_EQ(r->sparse.switches, 2u);
    EXPECT_GE(r->mixed_sparse_steps, 2) << "B's two prefill chunks ran beside A's sparse decode row";
  }
  EXPECT_EQ(kept.dropped_pages, 0u);
  EXPECT_GE(got.dropped_pages, 13u);
  EXPECT_EQ(got.sparse.dropped_seqs, 2u);
  EXPECT_GT(got.a_max_held_after_drop, 0);
  EXPECT_LE(got.a_max_held_after_drop, 2) << "a sparse sequence keeps only the pages of its local window (16 tokens)";
  EXPECT_TRUE(got.b_reuses_a_pages) << "B's prefill took pages A dropped";
  // Step by step, the same logits: no dropped (or since reused) page was read.
  ASSERT_EQ(got.steps.size(), kept.steps.size());
  float worst = 0.f;
  for (size_t s = 0; s < got.steps.size(); ++s) {
    ASSERT_EQ(got.steps[s].size(), kept.steps[s].size()) << "step " << s;
    float d = 0.f;
    for (size_t j = 0; j < got.steps[s].size(); ++j) d = std::max(d, std::fabs(got.steps[s][j] - kept.steps[s][j]));
    const float scale = std::max(max_abs(kept.steps[s]), 1e-6f);
    worst = std::max(worst, d / scale);
    EXPECT_LE(d, 1e-4f * scale) << "step " << s;
  }
  EXPECT_EQ(got.tokens, kept.tokens);
  std::printf("[ sparse   ] page dropping: %zu steps, worst |diff| %.2e of max |logit|, %llu pages dropped, A held <= %d "
              "pages after its first drop, %d mixed steps with a sparse row, B reused A's pages: %s\n",
              got.steps.size(), static_cast<double>(worst), static_cast<unsigned long long>(got.dropped_pages),
              got.a_max_held_after_drop, got.mixed_sparse_steps, got.b_reuses_a_pages ? "yes" : "no");
}

TEST(GpuSparseBadInput, AHelloForAnotherModelFailsTheCacheRankByName) {
  ModelConfig other = qwen3_like();
  other.num_layers = 4;  // the cache rank loaded a different model
  cache::LocalGpuCacheRank local(other.attention_view(), pair::SparseConfig{}, 0, std::chrono::milliseconds(2000));
  GpuSparseOptions so;
  so.max_slots = 3;
  so.max_step_tokens = 64;
  const ModelConfig attn = qwen3_like().attention_view();
  GpuSparseController ctl(attn, so, local.inference_link(), 16, 4);
  ctl.send_hello(make_gpu_pair_hello(attn, so, engine_options_normalised()));
  EXPECT_THROW(local.wait_ready(std::chrono::milliseconds(5000)), Error);
  for (int i = 0; i < 200 && local.error().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_NE(local.error().find("full-attention layers"), std::string::npos) << local.error();
  // The cache rank's failure reaches the inference side's link.
  for (int i = 0; i < 200 && !local.inference_link().failed(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(local.inference_link().failed());
}

// CUDA_LAUNCH_BLOCKING=1 makes each stream wait of the link a wait of the posting thread: the in-process cache rank's
// first plan receive blocked its start-up while the inference side waited for that start-up (a hang). Refused by name.
TEST(GpuSparseBadInput, LaunchBlockingIsRefusedByTheInProcessCacheRank) {
  ASSERT_EQ(setenv("CUDA_LAUNCH_BLOCKING", "1", 1), 0);
  try {
    cache::LocalGpuCacheRank local(qwen3_like().attention_view(), pair::SparseConfig{}, 0);
    ADD_FAILURE() << "the in-process cache rank started under CUDA_LAUNCH_BLOCKING=1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA_LAUNCH_BLOCKING=1"), std::string::npos) << e.what();
  }
  ASSERT_EQ(setenv("CUDA_LAUNCH_BLOCKING", "0", 1), 0);  // "0": off, accepted
  EXPECT_NO_THROW(cache::LocalGpuCacheRank(qwen3_like().attention_view(), pair::SparseConfig{}, 0));
  unsetenv("CUDA_LAUNCH_BLOCKING");
}

TEST(GpuSparseBadInput, OptionsAreRefusedByName) {
  const ModelConfig attn = qwen3_like().attention_view();
  CudaIpcLinkOptions lo;
  auto inf = CudaIpcLink::create("cache rank (test)", lo);
  auto cache = CudaIpcLink::open(inf->address(), "inference rank (test)", lo);
  inf->connect();
  GpuSparseOptions o;
  o.sparse.delta_capacity = -1;  // 0 or above the budget mean the budget (pair::SparseConfig::effective_delta_capacity)
  try {
    GpuSparseController c(attn, o, *inf, 16, 4);
    FAIL() << "a negative capacity was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
  }
  o = GpuSparseOptions{};
  o.sparse.selection.sink_tokens = 4;  // the GPU path has none of its own
  try {
    GpuSparseController c(attn, o, *inf, 16, 4);
    FAIL() << "sink tokens were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sink tokens"), std::string::npos) << e.what();
  }
  o = GpuSparseOptions{};
  o.max_slots = pair::gpu_plan_max_rows() + 1;
  EXPECT_THROW(GpuSparseController(attn, o, *inf, 16, 4), Error);
}

}  // namespace
}  // namespace spade

// The synchronous selection references on the GPU path (inference_rank/gpu_sync_selection.h: --selection oracle and
// quest with --device cuda) behind the continuous-batching Engine. Label gpu.
//
// What is checked (random-weight Qwen3-like model, 6 layers, three greedy requests whose prefill chunks share steps
// with the others' decode rows, so sparse rows run in decode-only and in mixed steps):
// - Budget >= every context: the selection is every candidate token, so oracle and quest decoding are dense decoding
//   up to summation order. Per engine step the logits match the dense run's until the first greedy token that
//   differs, with at least 40 (sequence, step) pairs decoded sparsely before it and every request switched.
// - Budget below the context: the selection is really used (the logits leave the dense run's), every request ends
//   with its full length and finite logits; oracle and quest select differently.
// - Bad options are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sync_selection.h"
#include "kernels/selection.cuh"
#include "tests/inference_rank/gpu_test_models.h"

namespace spade {
namespace {

ModelConfig six_layers() {
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

const int kPrompt[3] = {40, 70, 24};
const int kMaxTokens[3] = {48, 40, 56};

struct Decoded {
  std::vector<std::vector<int32_t>> tokens{3};
  std::vector<FinishReason> reasons = std::vector<FinishReason>(3, FinishReason::None);
  std::vector<std::vector<float>> logits;  // per engine step
  uint64_t sparse_seq_steps = 0, switches = 0;
};

// mode Dense: no step attention (the engine's own dense attention).
Decoded run(SelectionMode mode, int budget, int window = 16, int threshold = 32) {
  const ModelConfig cfg = six_layers();
  const EngineOptions eo = engine_options();
  const GpuEngineOptions go = gpu_engine_options(eo, /*cuda_graphs=*/true);
  GpuEngineForward gpu(GpuModel::random(cfg, 31, GpuEngineForward::model_options(go)), go);
  gpu.warm_up();
  Decoded out;
  Engine engine(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) {
    gpu(b, l);
    out.logits.push_back(l);
  });
  std::unique_ptr<GpuSyncSelection> sync;
  const ModelConfig attn = cfg.attention_view();
  if (mode != SelectionMode::Dense) {
    pair::SparseConfig sc;
    sc.sparse_threshold = threshold;
    sc.selection.token_budget = budget;
    sc.selection.local_window = window;
    sync = std::make_unique<GpuSyncSelection>(attn, gpu_sparse_options(sc, engine.options(), "test"), mode,
                                              eo.page_size, gpu.max_batch(), eo.max_model_len);
    gpu.set_sparse(sync.get());
    engine.set_attention_hooks(sync.get());
  }
  for (int i = 0; i < 3; ++i) {
    std::mt19937_64 rng(100 + static_cast<uint64_t>(i));
    GenerateRequest r;
    r.prompt_ids.resize(static_cast<size_t>(kPrompt[i]));
    for (auto& t : r.prompt_ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
    r.max_tokens = kMaxTokens[i];
    r.sampling.temperature = 0.f;
    r.ignore_eos = true;
    engine.submit(r, [&out, i](const TokenEvent& ev) {
      if (ev.token >= 0) out.tokens[static_cast<size_t>(i)].push_back(ev.token);
      if (ev.finished) out.reasons[static_cast<size_t>(i)] = ev.reason;
    });
  }
  engine.run_until_idle();
  if (sync) {
    out.sparse_seq_steps = sync->sparse_seq_steps();
    out.switches = sync->switches();
  }
  gpu.set_sparse(nullptr);
  engine.set_attention_hooks(nullptr);
  return out;
}

float max_abs(const std::vector<float>& v) {
  float m = 0.f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Steps whose logits match `dense` within 2 % of the step's largest logit, counted up to the first step whose greedy
// tokens differ (scheduling is the same while the tokens are).
size_t matching_steps(const Decoded& got, const Decoded& dense, int vocab, float* worst) {
  size_t compared = 0;
  *worst = 0.f;
  for (size_t s = 0; s < std::min(got.logits.size(), dense.logits.size()); ++s) {
    const auto& a = got.logits[s];
    const auto& b = dense.logits[s];
    if (a.size() != b.size()) break;
    float d = 0.f;
    for (size_t j = 0; j < a.size(); ++j) d = std::max(d, std::fabs(a[j] - b[j]));
    *worst = std::max(*worst, d / std::max(max_abs(b), 1e-6f));
    EXPECT_LE(d, 0.02f * max_abs(b) + 1e-3f) << "step " << s;
    ++compared;
    bool same = true;
    for (size_t r = 0; r * static_cast<size_t>(vocab) < a.size(); ++r) {
      const auto row = [&](const std::vector<float>& v) {
        return std::max_element(v.begin() + static_cast<long>(r * vocab), v.begin() + static_cast<long>((r + 1) * vocab)) -
               v.begin();
      };
      same &= row(a) == row(b);
    }
    if (!same) break;
  }
  return compared;
}

TEST(GpuSyncSelection, FullBudgetOracleAndQuestMatchDenseDecoding) {
  const Decoded dense = run(SelectionMode::Dense, 0);
  for (const SelectionMode mode : {SelectionMode::Oracle, SelectionMode::Quest}) {
    SCOPED_TRACE(selection_mode_name(mode));
    const Decoded got = run(mode, /*budget=*/512);
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(got.reasons[static_cast<size_t>(i)], FinishReason::Length) << "request " << i;
      ASSERT_EQ(got.tokens[static_cast<size_t>(i)].size(), static_cast<size_t>(kMaxTokens[i]));
    }
    float worst = 0.f;
    const size_t compared = matching_steps(got, dense, six_layers().vocab_size, &worst);
    std::printf("[ %-6s ] full budget: %zu steps match dense (worst |diff| %.2e of max |logit|); %llu sparse "
                "(sequence, step) pairs, %llu switches\n",
                selection_mode_name(mode), compared, static_cast<double>(worst),
                static_cast<unsigned long long>(got.sparse_seq_steps), static_cast<unsigned long long>(got.switches));
    EXPECT_EQ(got.switches, 3u);
    EXPECT_GE(got.sparse_seq_steps, 40u);
    EXPECT_GE(compared, 20u);
  }
}

TEST(GpuSyncSelection, SmallBudgetIsUsedAndOracleAndQuestSelectDifferently) {
  const Decoded dense = run(SelectionMode::Dense, 0);
  const Decoded oracle = run(SelectionMode::Oracle, /*budget=*/8, /*window=*/8);
  const Decoded quest = run(SelectionMode::Quest, /*budget=*/8, /*window=*/8);
  for (const Decoded* r : {&oracle, &quest}) {
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(r->reasons[static_cast<size_t>(i)], FinishReason::Length) << "request " << i;
      ASSERT_EQ(r->tokens[static_cast<size_t>(i)].size(), static_cast<size_t>(kMaxTokens[i]));
    }
    EXPECT_EQ(r->switches, 3u);
    EXPECT_GE(r->sparse_seq_steps, 40u);
    for (const auto& l : r->logits)
      for (float x : l) ASSERT_TRUE(std::isfinite(x));
  }
  // 16 of up to 126 tokens attended: the logits leave the dense run's, and the token and page selections differ.
  auto differs = [](const Decoded& a, const Decoded& b) {
    for (size_t s = 0; s < std::min(a.logits.size(), b.logits.size()); ++s) {
      if (a.logits[s].size() != b.logits[s].size()) return true;
      for (size_t j = 0; j < a.logits[s].size(); ++j)
        if (std::fabs(a.logits[s][j] - b.logits[s][j]) > 0.05f * (1.f + max_abs(b.logits[s]))) return true;
    }
    return false;
  };
  EXPECT_TRUE(differs(oracle, dense));
  EXPECT_TRUE(differs(quest, dense));
  EXPECT_TRUE(differs(oracle, quest));
}

TEST(GpuSyncSelectionBadInput, OptionsAreRefusedByName) {
  const ModelConfig attn = six_layers().attention_view();
  const EngineOptions eo = engine_options();
  pair::SparseConfig sc;
  sc.selection.token_budget = 64;
  sc.selection.local_window = 16;
  auto make = [&](const pair::SparseConfig& c, SelectionMode m, int max_model_len) {
    return GpuSyncSelection(attn, gpu_sparse_options(c, eo, "test"), m, eo.page_size, 4, max_model_len);
  };
  try {
    make(sc, SelectionMode::Predicted, 512);
    ADD_FAILURE() << "predicted accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not oracle or quest"), std::string::npos) << e.what();
  }
  pair::SparseConfig sinks = sc;
  sinks.selection.sink_tokens = 4;
  try {
    make(sinks, SelectionMode::Oracle, 512);
    ADD_FAILURE() << "sink tokens accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sink tokens 4"), std::string::npos) << e.what();
  }
  try {
    make(sc, SelectionMode::Quest, 16 * (kernels::kMaxQuestPages + 1));
    ADD_FAILURE() << "a context of too many pages accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--max-model-len"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spade

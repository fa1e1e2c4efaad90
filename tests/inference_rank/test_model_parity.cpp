// Parity of the CPU forward pass with references nobody here wrote:
//  - stories260K (real trained llama2.c model): greedy 200 tokens from BOS == expected ids, per-step logits match
//    the float64 llama2.c reimplementation;
//  - tiny-random-qwen3 (transformers 5.17 reference): prefill logits, no-cache decode logits, greedy continuation.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

#include "inference_rank/engine.h"
#include "inference_rank/model.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using nlohmann::json;

double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

// Runs one request through a fresh engine, recording the logits of every decode step via a probing backend.
std::vector<int32_t> generate(const Model& m, std::vector<int32_t> prompt, int n, bool ignore_eos,
                              EngineOptions opt = {}) {
  Engine e(m, opt);
  GenerateRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_tokens = n;
  r.sampling.temperature = 0;
  r.ignore_eos = ignore_eos;
  r.stop_token_ids = m.config().eos_token_ids;
  std::vector<int32_t> out;
  e.submit(r, [&](const TokenEvent& ev) {
    ASSERT_NE(ev.reason, FinishReason::Error) << ev.error;
    if (ev.token >= 0) out.push_back(ev.token);
  });
  e.run_until_idle();
  return out;
}

// Logits of every position when feeding `ids` one token per step through the KV cache.
std::vector<float> stepwise_logits(const Model& m, const std::vector<int32_t>& ids, int prefill) {
  const ModelConfig& c = m.config();
  KvCache cache(c, (static_cast<int>(ids.size()) + 15) / 16, 16);
  DensePagedAttention attn(c, cache);
  std::vector<float> all, logits;
  ForwardBatch b;
  b.max_pages = cache.num_pages();
  for (int p = 0; p < cache.num_pages(); ++p) b.block_table.push_back(p);
  b.seq_ids = {1};
  int pos = 0;
  while (pos < static_cast<int>(ids.size())) {
    const int n = pos == 0 ? prefill : 1;
    b.tokens.assign(ids.begin() + pos, ids.begin() + pos + n);
    b.positions.clear();
    b.logit_rows.clear();
    for (int i = 0; i < n; ++i) {
      b.positions.push_back(pos + i);
      b.logit_rows.push_back(i);
    }
    b.cu_q_lens = {0, n};
    b.seq_lens = {pos + n};
    m.forward(b, attn, logits);
    all.insert(all.end(), logits.begin(), logits.end());
    pos += n;
  }
  return all;
}

TEST(Stories260K, Greedy200TokensFromBosMatchReference) {
  const std::string dir = test::data_path("models/stories260K");
  auto model = Model::load(dir);
  const json ref = json::parse(test::read_file(dir + "/expected_greedy_200tok.ids.json"));
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const auto expected = ref["generated_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(expected.size(), 200u);
  const auto got = generate(*model, prompt, 200, /*ignore_eos=*/false);
  EXPECT_EQ(got, expected);
}

TEST(Stories260K, PerStepLogitsMatchFloat64Reference) {
  const std::string dir = test::data_path("models/stories260K");
  auto model = Model::load(dir);
  const json ref = json::parse(test::read_file(dir + "/expected_greedy_200tok.ids.json"));
  std::vector<int32_t> ids = ref["prompt_ids"].get<std::vector<int32_t>>();
  for (int t : ref["generated_ids"]) ids.push_back(t);
  ids.resize(200);  // row p = logits after feeding ids[p] at position p
  const auto want = test::read_f32(dir + "/reference_logits_200x512.f32.bin");
  ASSERT_EQ(want.size(), 200u * 512u);
  const auto got = stepwise_logits(*model, ids, 1);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (int p = 0; p < 200; ++p) worst = std::max(worst, rel_err(&got[p * 512], &want[p * 512], 512));
  EXPECT_LT(worst, 1e-5) << "worst per-row relative error vs float64 reference";
}

struct TinyQwen3 : ::testing::Test {
  std::string dir;
  json ref;
  std::unique_ptr<Model> model;
  void SetUp() override {
    dir = test::data_path("models/tiny-random-qwen3");
    ref = json::parse(test::read_file(dir + "/reference.json"));
    model = Model::load(dir);
    ASSERT_EQ(model->config().arch, ModelArch::Qwen3);
    ASSERT_TRUE(model->config().qk_norm);
  }
};

TEST_F(TinyQwen3, PrefillLogitsMatchTransformers) {
  const auto input = ref["input_ids"].get<std::vector<int32_t>>();
  const auto want = test::read_f32(dir + "/prefill_logits_16x512.f32.bin");
  const auto got = stepwise_logits(*model, input, static_cast<int>(input.size()));
  ASSERT_EQ(got.size(), want.size());
  for (int p = 0; p < 16; ++p) EXPECT_LT(rel_err(&got[p * 512], &want[p * 512], 512), 1e-4) << "position " << p;
}

TEST_F(TinyQwen3, CachedDecodeLogitsMatchNoCacheReference) {
  const auto all = ref["all_ids"].get<std::vector<int32_t>>();
  const auto want = test::read_f32(dir + "/decode_logits_32x512.f32.bin");
  // Prefill 16, then one token at a time: logits at position 15 + i must equal reference row i.
  std::vector<int32_t> ids(all.begin(), all.begin() + 16 + 31);
  const auto got = stepwise_logits(*model, ids, 16);
  ASSERT_EQ(got.size(), (16u + 31u) * 512u);
  for (int i = 0; i < 32; ++i) {
    const float* g = &got[static_cast<size_t>(15 + i) * 512];
    EXPECT_LT(rel_err(g, &want[i * 512], 512), 1e-4) << "decode step " << i;
    float max_abs = 0;
    for (int j = 0; j < 512; ++j) max_abs = std::max(max_abs, std::abs(g[j] - want[i * 512 + j]));
    EXPECT_LT(max_abs, 1e-4) << "decode step " << i;
  }
}

TEST_F(TinyQwen3, GreedyContinuationMatchesExactly) {
  const auto input = ref["input_ids"].get<std::vector<int32_t>>();
  const auto expected = ref["generated_ids"].get<std::vector<int32_t>>();
  ASSERT_TRUE(ref["eos_ignored"].get<bool>());
  EXPECT_EQ(generate(*model, input, 32, /*ignore_eos=*/true), expected);
  // With EOS honoured the same run stops at the first EOS (id 2 at step 15), with that token as the last one.
  const auto stopped = generate(*model, input, 32, /*ignore_eos=*/false);
  const auto eos = std::find(expected.begin(), expected.end(), 2);
  ASSERT_NE(eos, expected.end());
  EXPECT_EQ(stopped, std::vector<int32_t>(expected.begin(), eos + 1));
}

}  // namespace
}  // namespace spade

// Logprobs on the CPU path (GenerateRequest::logprobs, common/sampling.h token_logprobs): every token's logprob and
// top alternatives are the log-softmax of the very logits row it was sampled from (raw mode: before temperature /
// top-k / top-p), checked against a log-softmax computed here independently (long double) from the logits the model
// produced, in a continuously batched run with chunked prefill; the CPU model's own engine gives the same values; bad
// values are refused; token_logprobs' edge cases (NaN, -inf, +inf, ties, tiny vocabularies).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "common/error.h"
#include "common/sampling.h"
#include "inference_rank/engine.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

/// log_softmax(l)[i] in long double, NaN read as -inf (the sampler's canonical logits).
std::vector<long double> log_softmax(const float* l, int vocab) {
  long double m = -std::numeric_limits<long double>::infinity();
  for (int i = 0; i < vocab; ++i)
    if (!std::isnan(l[i])) m = std::max<long double>(m, l[i]);
  long double s = 0;
  for (int i = 0; i < vocab; ++i)
    if (!std::isnan(l[i])) s += std::exp(static_cast<long double>(l[i]) - m);
  std::vector<long double> out(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i)
    out[static_cast<size_t>(i)] =
        std::isnan(l[i]) ? -std::numeric_limits<long double>::infinity() : static_cast<long double>(l[i]) - m - std::log(s);
  return out;
}

struct Got {
  std::vector<int32_t> tokens;
  std::vector<std::optional<TokenLogprobs>> logprobs;
};

std::vector<GenerateRequest> requests() {
  std::vector<GenerateRequest> rs(4);
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 20, 30, 40, 50},
      {1, 10, 20},
      {1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318},
      {5}};
  const int lp[] = {5, 20, -1, 0};
  for (size_t i = 0; i < rs.size(); ++i) {
    rs[i].prompt_ids = prompts[i];
    rs[i].max_tokens = 12;
    rs[i].ignore_eos = true;
    rs[i].logprobs = lp[i];
  }
  rs[1].sampling.temperature = 0.9f;  // sampled from a top-3 / temperature distribution, logprobs still raw
  rs[1].sampling.top_k = 3;
  rs[1].sampling.seed = 7;
  rs[3].sampling.temperature = 1.3f;
  rs[3].sampling.seed = 11;
  return rs;
}

/// Runs `rs` (submitted together) on `e`; returns each request's tokens and logprobs in submit order.
std::vector<Got> run(Engine& e, const std::vector<GenerateRequest>& rs, std::vector<uint64_t>* ids_out = nullptr) {
  std::map<uint64_t, Got> out;
  std::vector<uint64_t> ids;
  for (const auto& r : rs)
    ids.push_back(e.submit(r, [&](const TokenEvent& ev) {
      ASSERT_NE(ev.reason, FinishReason::Error) << ev.error;
      out[ev.request_id].tokens.push_back(ev.token);
      out[ev.request_id].logprobs.push_back(ev.logprobs);
    }));
  e.run_until_idle();
  std::vector<Got> res;
  for (auto id : ids) res.push_back(out[id]);
  if (ids_out) *ids_out = ids;
  return res;
}

TEST(EngineLogprobs, AreTheRawLogSoftmaxOfTheLogitsEachTokenWasSampledFrom) {
  const auto m = Model::load(test::data_path("models/tiny-random-qwen3"));
  const ModelConfig& cfg = m->config();
  const int V = cfg.vocab_size;
  EngineOptions opt;
  opt.max_num_batched_tokens = 16;  // chunked prefill: mixed prefill / decode batches
  // The CPU model behind an external forward pass that records every logits row by sequence and step.
  std::map<uint64_t, std::vector<std::vector<float>>> rows;
  Engine* self = nullptr;
  Engine e(cfg, opt, ForwardFn([&](const ForwardBatch& b, std::vector<float>& logits) {
             m->forward(b, self->attention(), logits);
             size_t k = 0;
             for (int s = 0; s < b.batch() && k < b.logit_rows.size(); ++s) {
               if (b.logit_rows[k] != b.cu_q_lens[static_cast<size_t>(s) + 1] - 1) continue;
               rows[b.seq_ids[static_cast<size_t>(s)]].emplace_back(logits.begin() + static_cast<long>(k * V),
                                                                    logits.begin() + static_cast<long>((k + 1) * V));
               ++k;
             }
           }));
  self = &e;
  const std::vector<GenerateRequest> rs = requests();
  std::vector<uint64_t> ids;
  const std::vector<Got> got = run(e, rs, &ids);
  for (size_t q = 0; q < rs.size(); ++q) {
    SCOPED_TRACE("request " + std::to_string(q));
    const Got& g = got[q];
    ASSERT_EQ(g.tokens.size(), 12u);
    ASSERT_EQ(rows[ids[q]].size(), 12u);
    for (size_t t = 0; t < g.tokens.size(); ++t) {
      SCOPED_TRACE("token " + std::to_string(t));
      if (rs[q].logprobs < 0) {
        EXPECT_FALSE(g.logprobs[t].has_value());
        continue;
      }
      ASSERT_TRUE(g.logprobs[t].has_value());
      const TokenLogprobs& lp = *g.logprobs[t];
      const std::vector<long double> want = log_softmax(rows[ids[q]][t].data(), V);
      const int tok = g.tokens[t];
      EXPECT_NEAR(lp.logprob, static_cast<double>(want[static_cast<size_t>(tok)]), 1e-5);
      // The top alternatives: the n largest logits, most likely first, ties by lower id.
      std::vector<int> order(static_cast<size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return want[static_cast<size_t>(a)] > want[static_cast<size_t>(b)]; });
      ASSERT_EQ(lp.top_ids.size(), static_cast<size_t>(rs[q].logprobs));
      ASSERT_EQ(lp.top_logprobs.size(), lp.top_ids.size());
      double mass = 0;
      for (size_t i = 0; i < lp.top_ids.size(); ++i) {
        EXPECT_EQ(lp.top_ids[i], order[i]) << "alternative " << i;
        EXPECT_NEAR(lp.top_logprobs[i], static_cast<double>(want[static_cast<size_t>(order[i])]), 1e-5);
        mass += std::exp(static_cast<double>(lp.top_logprobs[i]));
        if (lp.top_ids[i] == tok) {
          EXPECT_EQ(lp.top_logprobs[i], lp.logprob);
        }
      }
      EXPECT_LE(mass, 1.0 + 1e-5);
      if (rs[q].sampling.temperature == 0.f && !lp.top_ids.empty()) {
        EXPECT_EQ(lp.top_ids[0], tok);  // greedy
      }
      if (rs[q].sampling.top_k == 3) {  // raw, not the top-3 renormalised distribution: the token is among the top 3
        EXPECT_NE(std::find(order.begin(), order.begin() + 3, tok), order.begin() + 3);
        EXPECT_LT(lp.logprob, 0.f);
      }
    }
  }
  // The CPU model's own engine (its sampler, its logits) gives the same tokens and the same logprobs, bit for bit.
  Engine cpu(*m, opt);
  const std::vector<Got> again = run(cpu, rs);
  for (size_t q = 0; q < rs.size(); ++q) {
    EXPECT_EQ(again[q].tokens, got[q].tokens) << "request " << q;
    for (size_t t = 0; t < again[q].logprobs.size() && t < got[q].logprobs.size(); ++t) {
      ASSERT_EQ(again[q].logprobs[t].has_value(), got[q].logprobs[t].has_value());
      if (!got[q].logprobs[t]) continue;
      EXPECT_EQ(again[q].logprobs[t]->logprob, got[q].logprobs[t]->logprob);
      EXPECT_EQ(again[q].logprobs[t]->top_ids, got[q].logprobs[t]->top_ids);
      EXPECT_EQ(again[q].logprobs[t]->top_logprobs, got[q].logprobs[t]->top_logprobs);
    }
  }
}

TEST(EngineLogprobs, OutOfRangeIsRefusedBeforeQueuing) {
  const auto m = Model::load(test::data_path("models/tiny-random-qwen3"));
  Engine e(*m, EngineOptions{});
  for (const int bad : {-2, kMaxTopLogprobs + 1}) {
    GenerateRequest r;
    r.prompt_ids = {1, 2, 3};
    r.max_tokens = 2;
    r.logprobs = bad;
    try {
      e.submit(r, nullptr);
      ADD_FAILURE() << "logprobs " << bad << " accepted";
    } catch (const Error& err) {
      EXPECT_THAT(err.what(), HasSubstr("logprobs must be -1 (none) or in [0, 20]"));
    }
  }
  EXPECT_TRUE(e.idle());
}

// Teacher forcing (GenerateRequest::forced_tokens): the forced tokens are what the request emits, each with its
// logprob under the logits of its step; forcing the tokens greedy decoding picked reproduces that run (up to float
// rounding: the second run reuses the first one's cached prompt pages), and other tokens leave the first step's
// distribution as it was. Bad forced tokens and a device-sampling engine are refused.
TEST(EngineTeacherForcing, EmitsTheForcedTokensWithTheirLogprobs) {
  const auto m = Model::load(test::data_path("models/tiny-random-qwen3"));
  const int V = m->config().vocab_size;
  EngineOptions opt;
  opt.max_num_batched_tokens = 16;
  Engine e(*m, opt);
  GenerateRequest greedy;
  greedy.prompt_ids = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376};
  greedy.max_tokens = 10;
  greedy.ignore_eos = true;
  greedy.logprobs = 1;
  const Got g = run(e, {greedy})[0];
  ASSERT_EQ(g.tokens.size(), 10u);

  GenerateRequest same = greedy;
  same.forced_tokens = g.tokens;
  GenerateRequest other = greedy;
  for (int i = 0; i < 10; ++i) other.forced_tokens.push_back((g.tokens[static_cast<size_t>(i)] + 7 + i) % V);
  const std::vector<Got> f = run(e, {same, other});
  EXPECT_EQ(f[0].tokens, g.tokens);
  EXPECT_EQ(f[1].tokens, other.forced_tokens);
  for (size_t t = 0; t < 10; ++t) {
    ASSERT_TRUE(f[0].logprobs[t] && f[1].logprobs[t] && g.logprobs[t]);
    EXPECT_NEAR(f[0].logprobs[t]->logprob, g.logprobs[t]->logprob, 1e-4) << t;
    EXPECT_EQ(f[0].logprobs[t]->top_ids, g.logprobs[t]->top_ids) << t;
    // The forced token's logprob, at most the argmax's.
    EXPECT_LE(f[1].logprobs[t]->logprob, f[1].logprobs[t]->top_logprobs[0]) << t;
  }
  // Step 0 reads the same context in both runs: the same argmax, and the forced token scored in that distribution.
  EXPECT_EQ(f[1].logprobs[0]->top_ids, g.logprobs[0]->top_ids);
  EXPECT_NEAR(f[1].logprobs[0]->top_logprobs[0], g.logprobs[0]->top_logprobs[0], 1e-4);
  EXPECT_LT(f[1].logprobs[0]->logprob, g.logprobs[0]->logprob);

  auto refused = [&](Engine& eng, const GenerateRequest& r, const std::string& what) {
    try {
      eng.submit(r, nullptr);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& err) {
      EXPECT_THAT(err.what(), HasSubstr(what));
    }
  };
  GenerateRequest shorter = greedy;
  shorter.forced_tokens = {5, 6};
  refused(e, shorter, "2 forced tokens for max_tokens 10");
  GenerateRequest bad = greedy;
  bad.forced_tokens.assign(10, V);
  refused(e, bad, "forced token id");
  Engine device(m->config(), opt,
                ForwardSampleFn([](const ForwardBatch&, const std::vector<RowSampling>&, std::vector<int32_t>&,
                                   std::vector<TokenLogprobs>&) {}));
  refused(device, same, "teacher forcing (forced_tokens) needs the host sampler");
  EXPECT_TRUE(e.idle());
}

TEST(TokenLogprobs, EdgeCases) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  {  // ordinary row with a tie and a NaN: ties by lower id, NaN has probability 0
    const float l[] = {1.f, 3.f, nan, 3.f, -inf, 0.f};
    const TokenLogprobs t = token_logprobs(l, 6, 5, 4);
    const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + 1.0);
    EXPECT_NEAR(t.logprob, 0.0 - lse, 1e-6);
    EXPECT_EQ(t.top_ids, (std::vector<int32_t>{1, 3, 0, 5}));
    EXPECT_NEAR(t.top_logprobs[0], 3.0 - lse, 1e-6);
    EXPECT_EQ(token_logprobs(l, 6, 2, 0).logprob, -inf);
    EXPECT_EQ(token_logprobs(l, 6, 4, 0).logprob, -inf);
    EXPECT_TRUE(token_logprobs(l, 6, 4, 0).top_ids.empty());
  }
  {  // all -inf / NaN: uniform; two +inf: half each, the rest 0
    const float a[] = {-inf, nan, -inf};
    EXPECT_NEAR(token_logprobs(a, 3, 1, 0).logprob, -std::log(3.0), 1e-6);
    const float b[] = {inf, 2.f, inf};
    const TokenLogprobs t = token_logprobs(b, 3, 2, 3);
    EXPECT_NEAR(t.logprob, -std::log(2.0), 1e-6);
    EXPECT_EQ(t.top_ids, (std::vector<int32_t>{0, 2, 1}));
    EXPECT_EQ(t.top_logprobs[2], -inf);
  }
  {  // fewer tokens than asked for
    const float l[] = {0.5f, -0.5f};
    EXPECT_EQ(token_logprobs(l, 2, 0, 20).top_ids, (std::vector<int32_t>{0, 1}));
    EXPECT_THROW(token_logprobs(l, 2, 2, 1), Error);
    EXPECT_THROW(token_logprobs(l, 2, 0, 21), Error);
  }
}

}  // namespace
}  // namespace spade

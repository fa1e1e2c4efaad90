// Logprobs on the GPU path (GpuEngineForward::sample + kernels::logprob_rows): an Engine sampling on the device
// returns, for greedy requests, the same tokens and the same logprobs / alternatives as an Engine that copies the same
// GPU logits back and computes them on the host (common/sampling.h token_logprobs); for sampled requests the sampled
// token's logprob equals its entry among the alternatives and they are most likely first; requests without logprobs
// get none. Continuous batching with chunked prefill, graphs on and off.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <optional>
#include <vector>

#include "inference_rank/engine.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/weights.h"
#include "tests/inference_rank/gpu_test_models.h"

namespace spade {
namespace {

struct Got {
  std::vector<int32_t> tokens;
  std::vector<std::optional<TokenLogprobs>> logprobs;
};

std::vector<GenerateRequest> requests() {
  std::vector<GenerateRequest> rs(4);
  const int lp[] = {20, 3, -1, 5};
  for (size_t i = 0; i < rs.size(); ++i) {
    for (int t = 0; t < 5 + 11 * static_cast<int>(i); ++t) rs[i].prompt_ids.push_back((37 * t + 11 * i + 1) % 1000);
    rs[i].max_tokens = 10;
    rs[i].ignore_eos = true;
    rs[i].logprobs = lp[i];
  }
  rs[3].sampling.temperature = 1.f;  // sampled on the device (Philox), so its tokens differ from the host's
  rs[3].sampling.seed = 9;
  return rs;
}

std::vector<Got> run(Engine& e, const std::vector<GenerateRequest>& rs) {
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
  return res;
}

TEST(GpuEngineLogprobs, OnDeviceLogprobsMatchHostLogprobsOfTheSameLogits) {
  const ModelConfig cfg = test::qwen3_like();
  const ModelWeights w = load_weights(cfg, random_source(33));
  EngineOptions eo;
  eo.page_size = 16;
  eo.num_pages = 64;
  eo.max_num_seqs = 4;
  eo.max_num_batched_tokens = 16;
  eo.max_model_len = 256;
  const std::vector<GenerateRequest> rs = requests();
  for (const bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "graphs" : "eager");
    const GpuEngineOptions go = gpu_engine_options(eo, graphs);
    GpuEngineForward host_side(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
    Engine host(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) { host_side(b, l); });
    const std::vector<Got> want = run(host, rs);
    GpuEngineForward dev_side(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
    Engine dev(cfg, eo,
               ForwardSampleFn([&](const ForwardBatch& b, const std::vector<RowSampling>& r, std::vector<int32_t>& t,
                                   std::vector<TokenLogprobs>& l) { dev_side.sample(b, r, t, l); }));
    const std::vector<Got> got = run(dev, rs);
    for (size_t q = 0; q < rs.size(); ++q) {
      SCOPED_TRACE("request " + std::to_string(q));
      ASSERT_EQ(got[q].tokens.size(), 10u);
      for (size_t t = 0; t < got[q].tokens.size(); ++t) {
        SCOPED_TRACE("token " + std::to_string(t));
        if (rs[q].logprobs < 0) {
          EXPECT_FALSE(got[q].logprobs[t].has_value());
          continue;
        }
        ASSERT_TRUE(got[q].logprobs[t].has_value());
        const TokenLogprobs& g = *got[q].logprobs[t];
        ASSERT_EQ(g.top_ids.size(), static_cast<size_t>(rs[q].logprobs));
        for (size_t i = 0; i < g.top_ids.size(); ++i) {
          if (i > 0) {
            EXPECT_LE(g.top_logprobs[i], g.top_logprobs[i - 1]);
          }
          if (g.top_ids[i] == got[q].tokens[t]) {
            EXPECT_EQ(g.top_logprobs[i], g.logprob);
          }
        }
        if (rs[q].sampling.temperature > 0) continue;  // Philox on the device, mt19937_64 on the host
        ASSERT_EQ(got[q].tokens[t], want[q].tokens[t]) << "greedy tokens diverged";
        const TokenLogprobs& h = *want[q].logprobs[t];
        EXPECT_NEAR(g.logprob, h.logprob, 1e-5 + 1e-6 * std::fabs(h.logprob));
        EXPECT_EQ(g.top_ids, h.top_ids);
        for (size_t i = 0; i < g.top_ids.size() && i < h.top_logprobs.size(); ++i)
          EXPECT_NEAR(g.top_logprobs[i], h.top_logprobs[i], 1e-5 + 1e-6 * std::fabs(h.top_logprobs[i]));
      }
    }
  }
}

}  // namespace
}  // namespace spade

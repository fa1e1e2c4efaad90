// Retained prefixes end to end, as processes: the real coordinator, inference rank and CPU cache rank executables on
// stories260K (predicted sparse decoding with a budget above the context, so the output is exact; prefix caching on,
// the rank's default). A request runs to its end; the same prompt again: the cache rank kept the first request's
// prompt prefix (spade_cache_retained_prefixes 1, spade_cache_sequences 0, its pages counted in
// spade_cache_kv_pages_used), the repeat's switch shares it (spade_retained_prefix_reused_tokens_total) and ships
// fewer bytes to the cache rank, and decodes the same tokens.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kPrompt = 300;  // prompt tokens: 18 whole pages and a part

proto::GenerateRequest greedy(int max_tokens) {
  const auto ids = nlohmann::json::parse(read_file(data_path("models/stories260K/expected_greedy_200tok.ids.json")));
  proto::GenerateRequest r;
  r.mutable_prompt_ids()->add_ids(1);
  while (r.prompt_ids().ids_size() < kPrompt)
    for (const auto& id : ids["generated_ids"])
      if (r.prompt_ids().ids_size() < kPrompt) r.mutable_prompt_ids()->add_ids(id.get<uint32_t>());
  r.set_max_tokens(static_cast<uint32_t>(max_tokens));
  r.set_ignore_eos(true);
  r.mutable_sampling()->set_temperature(0.f);
  return r;
}

// The tokens of request `id` once its final chunk came ("" error), or the error.
std::pair<std::vector<uint32_t>, std::string> collect(coord::CoordinatorClient& c, uint64_t id) {
  std::vector<uint32_t> out;
  for (auto until = Clock::now() + 120s; Clock::now() < until;) {
    auto ch = c.next_chunk(until);
    if (!ch || ch->request_id() != id) continue;
    for (uint32_t t : ch->token_ids()) out.push_back(t);
    if (ch->finished()) return {out, ch->error()};
  }
  return {out, "no final chunk"};
}

double value(const std::map<std::string, double>& m, const std::string& prefix) {
  for (const auto& [k, v] : m)
    if (k.rfind(prefix, 0) == 0) return v;
  ADD_FAILURE() << "no series " << prefix;
  return 0;
}

TEST(RetainedPrefixCluster, ARepeatedPromptIsNotShippedToTheCacheRankAgain) {
  ApiCluster c;
  ClusterOptions o;
  o.inference_flags = {"--selection", "predicted", "--sparse-threshold", "320", "--token-budget", "512"};
  o.cache_flags = {"--token-budget", "512"};
  c.start_coordinator(o);
  c.start_ranks(o);
  ASSERT_TRUE(c.wait_ready(c.http_port)) << c.logs();
  ASSERT_TRUE(c.wait_ready(c.inference_metrics_port)) << c.logs();
  auto cc = c.control_client();
  // Metrics once the inference rank is idle, the cache rank holds no live sequence and `kept` retained prefixes.
  auto settled = [&](double kept) {
    std::map<std::string, double> inf, cache;
    for (auto until = Clock::now() + 30s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      inf = c.metrics(c.inference_metrics_port);
      cache = c.metrics(c.cache_metrics_port);
      if (inf.at("spade_num_requests_running") == 0 && cache.at("spade_cache_sequences") == 0 &&
          cache.at("spade_cache_retained_prefixes") == kept)
        break;
    }
    return std::make_pair(inf, cache);
  };
  const auto [inf0, cache0] = settled(0);
  const auto [a, a_err] = collect(*cc, cc->submit(greedy(60)));
  ASSERT_EQ(a_err, "") << c.logs();
  const auto [inf1, cache1] = settled(1);
  EXPECT_EQ(cache1.at("spade_cache_retained_prefixes"), 1)
      << "the first request's prompt prefix stays on the cache rank\n"
      << c.logs();
  EXPECT_EQ(cache1.at("spade_cache_sequences"), 0) << "no live sequence is left";
  EXPECT_GT(cache1.at("spade_cache_kv_pages_used"), 0) << "retained pages count as used";
  const std::string sent = "spade_transfer_bytes_total{direction=\"send\"";
  const double first_bytes = value(inf1, sent) - value(inf0, sent);
  const auto [b, b_err] = collect(*cc, cc->submit(greedy(60)));
  ASSERT_EQ(b_err, "") << c.logs();
  EXPECT_EQ(a, b) << "the repeat decodes the same tokens";
  const auto [inf2, cache2] = settled(1);
  const double repeat_bytes = value(inf2, sent) - value(inf1, sent);
  EXPECT_EQ(inf2.at("spade_sparse_switches_total") - inf0.at("spade_sparse_switches_total"), 2);
  const double reused = inf2.at("spade_retained_prefix_reused_tokens_total");
  // Its prefix-cache hit: whole pages up to the tokens the sparse switch recomputes (predictor window, prompt anchors).
  EXPECT_GT(reused, 0) << c.logs();
  EXPECT_EQ(std::fmod(reused, 16.0), 0);
  EXPECT_LT(repeat_bytes, first_bytes);
  std::cout << "bytes to the cache rank: first request " << first_bytes << ", repeat " << repeat_bytes << " ("
            << reused << " tokens shared from the retained prefix)\n";
  EXPECT_EQ(cache2.at("spade_cache_retained_prefixes"), 1) << "the repeat is covered by the retained prefix";
}

}  // namespace
}  // namespace spade::test

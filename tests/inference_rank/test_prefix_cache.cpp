// Shared prompt pages in the engine (common/page_allocator.h) on the real stories260K model:
//  - automatic prefix caching (EngineOptions::enable_prefix_caching): a repeated prompt reuses its full pages and
//    decodes exactly what a cold engine decodes, dense and with sparse decoding (whose prompt queries are recomputed);
//    cancels leave no page held; hybrid models refuse it; a backend that can serve fewer cached tokens
//    (AttentionBackend::reusable_prefix_tokens) bounds the reuse;
//  - n samples of one prompt (Engine::submit_samples): the prompt's pages are computed once and held by every sample,
//    and each sample decodes exactly what an independent request with its seed decodes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "cache_rank/pack_server.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"
#include "tests/inference_rank/request_helpers.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

using test::greedy;
using test::prompt;  // token ids in [3, 503)

// Sparse decoding from 24 tokens on with a budget of 16, its cache rank in process.
SparseOptions sparse_options() { return test::stories_sparse(); }
BackendFactory in_process_sparse(const SparseOptions& so) {
  return [so](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
    return std::make_unique<SparseAttention>(
        cfg, kv, so, std::make_unique<cache::InProcessLink>(cfg, so.selection, kv.num_pages(), kv.page_size()));
  };
}

// Runs each prompt to completion, one after the other, on one engine; returns the generated ids of each.
std::vector<std::vector<int32_t>> run_in_turn(Engine& e, const std::vector<std::vector<int32_t>>& prompts, int n) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::string error;
    e.submit(greedy(prompts[i], n), [&out, &error, i](const TokenEvent& ev) {
      if (ev.token >= 0) out[i].push_back(ev.token);
      if (ev.finished && ev.reason == FinishReason::Error) error = ev.error;
    });
    e.run_until_idle();
    EXPECT_EQ(error, "");
  }
  return out;
}

struct PrefixCache : ::testing::Test {
  std::unique_ptr<Model> model;
  void SetUp() override { model = Model::load(test::data_path("models/stories260K")); }
  EngineOptions options(bool caching) const {
    EngineOptions o;
    o.max_num_seqs = 4;
    o.max_model_len = 512;
    o.enable_prefix_caching = caching;
    return o;
  }
};

TEST_F(PrefixCache, RepeatedPromptReusesPagesAndDecodesTheSameTokens) {
  const auto a = prompt(100, 1);
  auto b = prompt(100, 2);  // shares a's first 50 tokens
  std::copy(a.begin(), a.begin() + 50, b.begin());
  Engine cold(*model, options(false));
  const auto expected = run_in_turn(cold, {a, b}, 40);
  EXPECT_EQ(cold.stats().prefix_queried_tokens, 0u);
  EXPECT_EQ(cold.stats().prefix_hit_tokens, 0u);

  Engine warm(*model, options(true));
  const auto got = run_in_turn(warm, {a, a, b}, 40);
  EXPECT_EQ(got[0], expected[0]);
  EXPECT_EQ(got[1], expected[0]) << "the repeat, from the cached pages";
  EXPECT_EQ(got[2], expected[1]) << "a shared leading part";
  const EngineStats st = warm.stats();
  EXPECT_EQ(st.prefix_queried_tokens, 300u);
  // Page size 16: the repeat reuses 6 full pages (96 of 99 tokens), b the 3 pages inside its first 50 tokens.
  EXPECT_EQ(st.prefix_hit_tokens, 96u + 48u);
  EXPECT_EQ(warm.pages().num_free_pages(), warm.pages().num_pages()) << "cached pages count as free";
  EXPECT_GT(warm.pages().num_cached_pages(), 0);
}

TEST_F(PrefixCache, SparseDecodingWithCachedPrefixDecodesAsWithout) {
  const SparseOptions so = sparse_options();
  const BackendFactory factory = in_process_sparse(so);
  const auto a = prompt(200, 3);
  Engine cold(*model, options(false), factory);
  const auto expected = run_in_turn(cold, {a}, 60);
  EngineOptions o = options(true);
  // The sparse backend's INIT ship needs the prompt's last queries: those tokens are always recomputed.
  o.prefix_recompute_tokens = so.prefix_recompute_tokens();
  Engine warm(*model, o, factory);
  const auto got = run_in_turn(warm, {a, a}, 60);
  EXPECT_EQ(got[0], expected[0]);
  EXPECT_EQ(got[1], expected[0]);
  const int reusable = (200 - o.prefix_recompute_tokens) / 16 * 16;
  EXPECT_GT(reusable, 0);
  EXPECT_EQ(warm.stats().prefix_hit_tokens, static_cast<uint64_t>(reusable));
  auto* sparse = dynamic_cast<SparseAttention*>(&warm.attention());
  ASSERT_NE(sparse, nullptr);
  EXPECT_EQ(sparse->stats().switches, 2u) << "both requests decoded sparsely";
}

TEST_F(PrefixCache, CancelsOfRequestsSharingCachedPagesLeakNothing) {
  Engine e(*model, options(true));
  const auto a = prompt(90, 4);
  run_in_turn(e, {a}, 5);  // publishes a's pages
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(e.submit(greedy(a, 50), nullptr));
  for (int step = 0; step < 6; ++step) e.step();
  for (size_t i = 0; i < ids.size(); i += 2) e.abort(ids[i]);  // two cancelled mid-decode
  const uint64_t queued = e.submit(greedy(a, 50), nullptr);
  e.abort(queued);  // one cancelled before it ran
  e.run_until_idle();
  EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages());
  for (int32_t p = 0; p < e.pages().num_pages(); ++p) EXPECT_EQ(e.pages().refcount(p), 0) << "page " << p;
  EXPECT_EQ(e.stats().prefix_hit_tokens, 4u * 80u) << "each of the 4 requests that ran reused 5 pages";
}

// Dense attention whose reuse of cached pages is bounded (as a GPU pair's is by what its cache rank retained): asked
// with the cached pages it would share, it allows `limit` tokens and records what it was asked.
class BoundedReuse : public AttentionBackend {
 public:
  BoundedReuse(AttentionBackend& inner, int limit) : inner_(inner), limit_(limit) {}
  void attend(int layer, const ForwardBatch& b, const float* q, const float* k, const float* v, float* out) override {
    inner_.attend(layer, b, q, k, v, out);
  }
  int reusable_prefix_tokens(uint64_t /*seq*/, const std::vector<int32_t>& pages) override {
    asked.push_back(static_cast<int>(pages.size()));
    return limit_;
  }
  std::vector<int> asked;  // cached pages offered, per admitted sequence with some

 private:
  AttentionBackend& inner_;
  int limit_;
};

TEST_F(PrefixCache, TheBackendBoundsTheReuseAndTheTokensStayTheSame) {
  const auto a = prompt(100, 1);
  Engine cold(*model, options(false));
  const auto expected = run_in_turn(cold, {a}, 24);
  Engine e(*model, options(true));
  BoundedReuse bounded(e.attention(), 32);
  e.set_attention_hooks(&bounded);
  const auto got = run_in_turn(e, {a, a}, 24);
  EXPECT_EQ(got[0], expected[0]);
  EXPECT_EQ(got[1], expected[0]) << "the repeat computed what the backend could not serve";
  EXPECT_EQ(bounded.asked, std::vector<int>{6}) << "asked once, with the 6 cached whole pages";
  EXPECT_EQ(e.stats().prefix_hit_tokens, 32u) << "hits count what was reused, not what was cached";
  e.set_attention_hooks(nullptr);
}

TEST(PrefixCacheHybrid, HybridModelsRefuseIt) {
  auto m = Model::load(test::data_path("models/tiny-random-qwen3_5"));
  ASSERT_TRUE(m->config().is_hybrid());
  EngineOptions o;
  o.max_num_seqs = 2;
  o.enable_prefix_caching = true;
  EXPECT_THAT([&] { Engine e(*m, o); }, ::testing::ThrowsMessage<Error>(HasSubstr("hybrid")));
  o.enable_prefix_caching = false;
  o.prefix_recompute_tokens = 0;
  EXPECT_THAT([&] { Engine e(*m, o); }, ::testing::ThrowsMessage<Error>(HasSubstr("prefix_recompute_tokens")));
}

// ---- n samples of one prompt ----

struct Samples : PrefixCache {
  // Runs `n` samples of `p` on `e`; returns each sample's tokens and the fewest free pages seen.
  std::vector<std::vector<int32_t>> run_samples(Engine& e, const GenerateRequest& r, int n, int* min_free = nullptr) {
    std::map<uint64_t, std::vector<int32_t>> by_id;
    std::map<uint64_t, FinishReason> reason;
    const auto ids = e.submit_samples(r, n, [&](const TokenEvent& ev) {
      if (ev.token >= 0) by_id[ev.request_id].push_back(ev.token);
      if (ev.finished) reason[ev.request_id] = ev.reason;
    });
    EXPECT_EQ(ids.size(), static_cast<size_t>(n));
    int low = e.pages().num_free_pages();
    while (!e.idle()) {
      e.step();
      low = std::min(low, e.pages().num_free_pages());
    }
    if (min_free) *min_free = low;
    std::vector<std::vector<int32_t>> out;
    for (uint64_t id : ids) {
      EXPECT_EQ(reason[id], FinishReason::Length) << "sample " << id;
      out.push_back(by_id[id]);
    }
    return out;
  }
  static GenerateRequest sampled(std::vector<int32_t> ids, int n, uint64_t seed) {
    GenerateRequest r = greedy(std::move(ids), n);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = seed;
    return r;
  }
  // `n` independent requests of `p`, one after the other, seeds seed .. seed + n - 1 (what sample i must decode).
  static std::vector<std::vector<int32_t>> run_alone(Engine& e, const std::vector<int32_t>& p, int tokens, uint64_t seed,
                                                     int n) {
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t> got;
      e.submit(sampled(p, tokens, seed + static_cast<uint64_t>(i)), [&](const TokenEvent& ev) {
        if (ev.token >= 0) got.push_back(ev.token);
      });
      e.run_until_idle();
      out.push_back(got);
    }
    return out;
  }
};

TEST_F(Samples, EachSampleDecodesAsAnIndependentRequestWithItsSeedAndThePromptIsStoredOnce) {
  const auto p = prompt(150, 5);
  const int n = 4, gen = 40;
  EngineOptions o = options(false);
  o.max_num_seqs = 8;
  Engine alone(*model, o);
  const auto expected = run_alone(alone, p, gen, 100, n);
  EXPECT_NE(expected[0], expected[1]) << "sampling at temperature 1 with different seeds";

  Engine shared(*model, o);
  int min_free = 0;
  const auto got = run_samples(shared, sampled(p, gen, 100), n, &min_free);
  for (int i = 0; i < n; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], expected[static_cast<size_t>(i)]) << "sample " << i;
  // Page size 16: the prompt's first 144 tokens (9 pages) are stored once; each sample holds its own last page(s).
  const int used = shared.pages().num_pages() - min_free;
  const int one = shared.pages().pages_for(150 + gen);
  EXPECT_LE(used, 9 + n * (one - 9)) << "prompt once + n tails";
  EXPECT_LT(used, n * one - 20) << "well below n separate copies";
  EXPECT_EQ(shared.pages().num_free_pages(), shared.pages().num_pages());
  for (int32_t pg = 0; pg < shared.pages().num_pages(); ++pg) EXPECT_EQ(shared.pages().refcount(pg), 0);
}

TEST_F(Samples, SparseDecodingSamplesDecodeAsIndependentRequests) {
  const SparseOptions so = sparse_options();
  const BackendFactory factory = in_process_sparse(so);
  EngineOptions o = options(false);
  o.prefix_recompute_tokens = so.prefix_recompute_tokens();
  const auto p = prompt(220, 6);
  const int n = 3;
  Engine alone(*model, o, factory);
  const auto expected = run_alone(alone, p, 50, 7, n);
  Engine shared(*model, o, factory);
  const auto got = run_samples(shared, sampled(p, 50, 7), n);
  for (int i = 0; i < n; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], expected[static_cast<size_t>(i)]) << "sample " << i;
  auto* sparse = dynamic_cast<SparseAttention*>(&shared.attention());
  ASSERT_NE(sparse, nullptr);
  EXPECT_EQ(sparse->stats().switches, static_cast<uint64_t>(n)) << "every sample decoded sparsely";
}

TEST_F(Samples, AbortingSamplesBeforeAndAfterTheForkLeaksNothing) {
  EngineOptions o = options(false);
  o.max_num_seqs = 8;
  const auto p = prompt(120, 8);
  for (int when : {0, 1, 5}) {  // steps before the aborts: 0 = still queued, 1 = the group prefill ran, 5 = decoding
    Engine e(*model, o);
    std::map<uint64_t, FinishReason> reason;
    std::map<uint64_t, int> tokens;
    const auto ids = e.submit_samples(greedy(p, 30), 4, [&](const TokenEvent& ev) {
      if (ev.token >= 0) ++tokens[ev.request_id];
      if (ev.finished) reason[ev.request_id] = ev.reason;
    });
    for (int s = 0; s < when; ++s) e.step();
    e.abort(ids[0]);
    e.abort(ids[2]);
    e.run_until_idle();
    EXPECT_EQ(reason[ids[0]], FinishReason::Abort) << when;
    EXPECT_EQ(reason[ids[2]], FinishReason::Abort) << when;
    EXPECT_EQ(reason[ids[1]], FinishReason::Length) << when;
    EXPECT_EQ(reason[ids[3]], FinishReason::Length) << when;
    EXPECT_EQ(tokens[ids[1]], 30) << when;
    EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages()) << when;
    for (int32_t pg = 0; pg < e.pages().num_pages(); ++pg) ASSERT_EQ(e.pages().refcount(pg), 0) << when;
    // All samples aborted while the group prefill is queued / running: the group goes too.
    const auto again = e.submit_samples(greedy(p, 30), 2, nullptr);
    for (int s = 0; s < when && s < 1; ++s) e.step();
    e.abort(again[0]);
    e.abort(again[1]);
    EXPECT_TRUE(e.idle()) << when;
    EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages()) << when;
  }
}

TEST_F(Samples, BadCountsAreRefusedAndShortPromptsStillWork) {
  Engine e(*model, options(false));  // max_num_seqs 4
  EXPECT_THAT([&] { e.submit_samples(greedy(prompt(40, 1), 5), 0, nullptr); },
              ::testing::ThrowsMessage<Error>(HasSubstr("n must be in [1, 4]")));
  EXPECT_THAT([&] { e.submit_samples(greedy(prompt(40, 1), 5), 5, nullptr); },
              ::testing::ThrowsMessage<Error>(HasSubstr("n must be in [1, 4]")));
  EXPECT_TRUE(e.idle()) << "nothing queued";
  // A prompt shorter than a page: n independent requests, greedy, so all equal.
  const auto got = run_samples(e, greedy(prompt(10, 2), 12), 3);
  EXPECT_EQ(got[0], got[1]);
  EXPECT_EQ(got[1], got[2]);
}

}  // namespace
}  // namespace spade

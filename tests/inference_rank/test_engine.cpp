// Continuous batching: results never depend on who else is in the batch, on chunking or on page size;
// requests join and leave between steps; pages are freed; bad requests are rejected before queueing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "common/error.h"
#include "inference_rank/engine.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Model> tiny() { return Model::load(test::data_path("models/tiny-random-qwen3")); }

std::vector<std::vector<int32_t>> prompts() {
  return {{1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426},
          {1, 10, 20},
          {1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318, 319, 320,
           321, 322, 323, 324, 325, 326, 327, 328, 329, 330, 331, 332, 333, 334, 335, 336, 337},
          {5}};
}

GenerateRequest req(std::vector<int32_t> p, int n, float temperature = 0, uint64_t seed = 0) {
  GenerateRequest r;
  r.prompt_ids = std::move(p);
  r.max_tokens = n;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.ignore_eos = true;
  return r;
}

// Submits all requests at once (optionally staggered by `stagger` steps) and returns each one's tokens.
std::vector<std::vector<int32_t>> run_all(const Model& m, EngineOptions opt, const std::vector<GenerateRequest>& rs,
                                          int stagger = 0, int* max_running = nullptr) {
  Engine e(m, opt);
  std::map<uint64_t, std::vector<int32_t>> out;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < rs.size(); ++i) {
    ids.push_back(e.submit(rs[i], [&](const TokenEvent& ev) {
      ASSERT_NE(ev.reason, FinishReason::Error) << ev.error;
      out[ev.request_id].push_back(ev.token);
    }));
    for (int s = 0; s < stagger; ++s) e.step();
  }
  int peak = 0;
  while (!e.idle()) {
    e.step();
    peak = std::max(peak, e.stats().num_running);
  }
  if (max_running) *max_running = peak;
  EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages()) << "pages leaked";
  std::vector<std::vector<int32_t>> res;
  for (auto id : ids) res.push_back(out[id]);
  return res;
}

TEST(Engine, BatchedEqualsSolo) {
  auto m = tiny();
  std::vector<GenerateRequest> rs;
  for (auto& p : prompts()) rs.push_back(req(p, 12));
  std::vector<std::vector<int32_t>> solo;
  for (auto& r : rs) solo.push_back(run_all(*m, {}, {r})[0]);
  EXPECT_EQ(run_all(*m, {}, rs), solo);
  EXPECT_EQ(run_all(*m, {}, rs, /*stagger=*/3), solo) << "requests joining between steps";
  EngineOptions chunked;
  chunked.max_num_batched_tokens = 5;
  EXPECT_EQ(run_all(*m, chunked, rs), solo) << "chunked prefill";
  for (int ps : {1, 7, 64}) {
    EngineOptions o;
    o.page_size = ps;
    EXPECT_EQ(run_all(*m, o, rs), solo) << "page size " << ps;
  }
  for (auto& s : solo) EXPECT_EQ(s.size(), 12u);
}

TEST(Engine, WaitsForMemoryInsteadOfFailing) {
  auto m = tiny();
  std::vector<GenerateRequest> rs;
  for (auto& p : prompts()) rs.push_back(req(p, 10));
  std::vector<std::vector<int32_t>> solo;
  for (auto& r : rs) solo.push_back(run_all(*m, {}, {r})[0]);
  EngineOptions small;
  small.page_size = 4;
  small.num_pages = 13;  // 48 tokens: the longest request (39 + 10 = 49 tokens, 13 pages) fits only alone
  int peak = 0;
  EXPECT_EQ(run_all(*m, small, rs, 0, &peak), solo);
  EXPECT_LT(peak, 4);
  EngineOptions one;
  one.max_num_seqs = 1;
  EXPECT_EQ(run_all(*m, one, rs, 0, &peak), solo);
  EXPECT_EQ(peak, 1);
}

// Hooks of a backend that drops every full page of every sequence after each step (page dropping taken to its
// extreme; the external forward pass below reads no KV).
class DropEverything : public AttentionBackend {
 public:
  void attend(int, const ForwardBatch&, const float*, const float*, const float*, float*) override {}
  std::pair<int, int> droppable_range(uint64_t, int len) override { return {0, len}; }
};

// Returns the most sequences running at once; `dropped` gets EngineStats::dropped_pages.
int run_dropping(const ModelConfig& cfg, EngineOptions opt, uint64_t* dropped) {
  Engine e(cfg, opt, ForwardFn([&](const ForwardBatch& b, std::vector<float>& logits) {
             logits.assign(b.logit_rows.size() * static_cast<size_t>(cfg.vocab_size), 0.f);
           }));
  DropEverything hooks;
  e.set_attention_hooks(&hooks);
  for (int i = 0; i < 4; ++i) e.submit(req(std::vector<int32_t>(12, 1), 4), nullptr);  // 16 tokens: 4 pages each
  int peak = 0;
  while (e.step()) peak = std::max(peak, e.stats().num_running);
  EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages()) << "pages leaked";
  *dropped = e.stats().dropped_pages;
  return peak;
}

// Freed (dropped) pages are admitted again only up to max_context_pages: the full contexts of the running sequences,
// which their cache rank holds in full, never exceed it. The default (num_pages) admits nothing extra.
TEST(Engine, DroppedPagesAreAdmittedAgainOnlyUpToMaxContextPages) {
  const ModelConfig cfg = tiny()->config();
  EngineOptions o;
  o.page_size = 4;
  o.num_pages = 8;  // two full contexts
  uint64_t dropped = 0;
  EXPECT_EQ(run_dropping(cfg, o, &dropped), 2);
  EXPECT_GT(dropped, 0u);
  EXPECT_EQ(Engine(cfg, o, ForwardFn([](const ForwardBatch&, std::vector<float>&) {})).options().max_context_pages, 8);
  o.max_context_pages = 16;  // the cache rank holds four
  const int peak = run_dropping(cfg, o, &dropped);
  EXPECT_GT(peak, 2) << "dropped pages admitted a third request";
  EXPECT_LE(peak, 4);
  // A request longer than the cache rank's pool is refused up front.
  o.max_context_pages = 2;
  Engine e(cfg, o, ForwardFn([](const ForwardBatch&, std::vector<float>&) {}));
  try {
    e.submit(req(std::vector<int32_t>(12, 1), 4), nullptr);
    FAIL() << "a request of 4 pages was queued for a cache rank of 2";
  } catch (const Error& err) {
    EXPECT_THAT(err.what(), ::testing::HasSubstr("max_context_pages"));
  }
  o.max_context_pages = -1;
  EXPECT_THROW(Engine(cfg, o, ForwardFn([](const ForwardBatch&, std::vector<float>&) {})), Error);
}

TEST(Engine, SamplingIsSeededPerRequest) {
  auto m = tiny();
  auto a = run_all(*m, {}, {req(prompts()[0], 20, 1.0f, 7), req(prompts()[1], 20, 1.0f, 7)});
  auto b = run_all(*m, {}, {req(prompts()[1], 20, 1.0f, 7)});
  EXPECT_EQ(a[1], b[0]) << "a request's samples must not depend on its batch neighbours";
  auto c = run_all(*m, {}, {req(prompts()[1], 20, 1.0f, 8)});
  EXPECT_NE(b[0], c[0]) << "different seeds should give different samples";
}

TEST(Engine, AbortFreesPagesAndReportsAbort) {
  auto m = tiny();
  Engine e(*m, {});
  std::vector<TokenEvent> events;
  auto id = e.submit(req(prompts()[2], 50), [&](const TokenEvent& ev) { events.push_back(ev); });
  auto queued = e.submit(req(prompts()[1], 5), [&](const TokenEvent& ev) { events.push_back(ev); });
  e.step();
  e.step();
  EXPECT_LT(e.pages().num_free_pages(), e.pages().num_pages());
  e.abort(id);
  e.abort(queued);
  e.abort(12345);  // unknown: ignored
  EXPECT_TRUE(e.idle());
  EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages());
  ASSERT_GE(events.size(), 2u);
  int aborts = 0;
  for (auto& ev : events) aborts += ev.reason == FinishReason::Abort;
  EXPECT_EQ(aborts, 2);
}

TEST(Engine, StopsOnEos) {
  auto m = tiny();
  Engine e(*m, {});
  GenerateRequest r = req(prompts()[0], 32);
  r.ignore_eos = false;
  r.stop_token_ids = {2};
  std::vector<TokenEvent> evs;
  e.submit(r, [&](const TokenEvent& ev) { evs.push_back(ev); });
  e.run_until_idle();
  ASSERT_FALSE(evs.empty());
  EXPECT_TRUE(evs.back().finished);
  EXPECT_EQ(evs.back().reason, FinishReason::Stop);
  EXPECT_EQ(evs.back().token, 2);
  EXPECT_LT(evs.size(), 32u);
}

TEST(Engine, RejectsBadRequestsBeforeQueueing) {
  auto m = tiny();
  EngineOptions o;
  o.max_model_len = 64;
  Engine e(*m, o);
  auto expect_error = [&](GenerateRequest r, const std::string& msg) {
    try {
      e.submit(r, nullptr);
      ADD_FAILURE() << "no error for: " << msg;
    } catch (const Error& err) {
      EXPECT_THAT(err.what(), HasSubstr(msg));
    }
  };
  expect_error(req({}, 4), "empty prompt");
  expect_error(req({1, 512}, 4), "token id 512 is outside the vocabulary [0, 512)");
  expect_error(req({1, -3}, 4), "token id -3");
  expect_error(req({1}, 0), "max_tokens must be positive");
  expect_error(req(std::vector<int32_t>(60, 1), 10),
               "maximum context length is 64 tokens and your request has 70 tokens (60 in the prompt, 10 to generate)");
  auto bad = req({1}, 4, -1.0f);
  expect_error(bad, "temperature must be >= 0");
  EXPECT_TRUE(e.idle());
  EXPECT_THROW(Engine(*m, EngineOptions{.page_size = 0}), Error);
  EXPECT_THROW(Engine(*m, EngineOptions{.max_model_len = 1 << 20}), Error);
}

}  // namespace
}  // namespace spade

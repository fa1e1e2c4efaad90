// The serving loop's request table (inference_rank/serve_requests.h RequestTable) over a real engine: a rejected
// request is answered once per sample and never runs, samples stream with their own index, a cancel by index ends
// that sample alone, and a request whose sparse options the backend refuses is withdrawn with only its rejection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "common/error.h"
#include "inference_rank/serve_requests.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

struct Fixture {
  std::string dir = test::data_path("models/stories260K");
  std::unique_ptr<Model> model = Model::load(dir);
  Tokenizer tok = Tokenizer::from_dir(dir);
  GenerationConfig gen = load_generation_config(dir, model->config());
  Engine engine{*model, EngineOptions{}};
  std::vector<proto::GenerateChunk> chunks;
  std::vector<uint64_t> options_applied;  // engine ids the ApplyOptions hook saw
  bool refuse_options = false;

  RequestTable table() {
    IntakeLimits lim;
    lim.vocab_size = model->config().vocab_size;
    lim.max_model_len = engine.options().max_model_len;
    return RequestTable(
        "inference rank 0 (#0)", 0, engine, tok, gen, lim,
        [this](uint64_t eid, const IntakeRequest& r) {
          if (refuse_options) fail("sparse threshold {} refused", r.sparse_threshold);
          options_applied.push_back(eid);
        },
        [this](const proto::GenerateChunk& c) { chunks.push_back(c); });
  }
  void run_to_idle() {
    for (int i = 0; i < 1000 && !engine.idle(); ++i) engine.step();
    ASSERT_TRUE(engine.idle());
  }
};

proto::GenerateRequest request(uint64_t id, uint32_t n, uint32_t max_tokens) {
  proto::GenerateRequest r;
  r.set_request_id(id);
  r.set_text("Once upon a time");
  r.set_max_tokens(max_tokens);
  r.set_ignore_eos(true);
  r.set_n(n);
  return r;
}

TEST(RequestTable, AnInvalidRequestGetsOneErrorChunkPerSampleAndNeverRuns) {
  Fixture f;
  RequestTable t = f.table();
  proto::GenerateRequest r = request(7, 3, 4);
  r.mutable_prompt_ids()->add_ids(static_cast<uint32_t>(f.model->config().vocab_size));  // one past the vocabulary
  t.take(r);
  EXPECT_EQ(t.size(), 0u);
  EXPECT_TRUE(f.engine.idle());
  EXPECT_TRUE(f.options_applied.empty());
  ASSERT_EQ(f.chunks.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(f.chunks[i].request_id(), 7u);
    EXPECT_EQ(f.chunks[i].index(), i);
    EXPECT_TRUE(f.chunks[i].finished());
    EXPECT_EQ(f.chunks[i].finish_reason(), proto::FINISH_ERROR);
    EXPECT_THAT(f.chunks[i].error(), HasSubstr("inference rank 0 (#0): invalid request: prompt token id"));
  }
}

TEST(RequestTable, SamplesStreamWithTheirIndexAndACancelByIndexEndsThatSampleAlone) {
  Fixture f;
  RequestTable t = f.table();
  proto::GenerateRequest r = request(9, 2, 12);
  r.mutable_sparse()->set_sparse_threshold(5);
  t.take(r);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(f.options_applied.size(), 2u);
  std::map<uint64_t, int> thresholds;
  t.for_each_sample([&](uint64_t eid, int threshold, int budget) {
    thresholds[eid] = threshold;
    EXPECT_EQ(budget, 0);
  });
  EXPECT_EQ(thresholds.size(), 2u);
  for (const auto& [eid, th] : thresholds) EXPECT_EQ(th, 5) << "engine id " << eid;
  f.engine.step();
  f.engine.step();
  proto::CancelRequest c;
  c.set_request_id(9);
  c.set_index(1);
  t.cancel(c);
  proto::CancelRequest unknown;
  unknown.set_request_id(10);
  t.cancel(unknown);  // ignored
  f.run_to_idle();
  EXPECT_EQ(t.size(), 0u);
  std::map<uint32_t, int> tokens;
  std::map<uint32_t, proto::FinishReason> reason;
  for (const proto::GenerateChunk& ch : f.chunks) {
    EXPECT_EQ(ch.request_id(), 9u);
    EXPECT_TRUE(ch.error().empty()) << ch.error();
    tokens[ch.index()] += ch.token_ids_size();
    if (ch.finished()) {
      EXPECT_EQ(reason.count(ch.index()), 0u) << "sample " << ch.index() << " finished twice";
      reason[ch.index()] = ch.finish_reason();
    }
  }
  ASSERT_EQ(reason.size(), 2u);
  EXPECT_EQ(reason[0], proto::FINISH_LENGTH);
  EXPECT_EQ(tokens[0], 12);
  EXPECT_EQ(reason[1], proto::FINISH_CANCELLED);
  EXPECT_LT(tokens[1], 12);
}

TEST(RequestTable, ARefusalOfTheSparseOptionsWithdrawsTheRequestWithOnlyItsRejection) {
  Fixture f;
  f.refuse_options = true;
  RequestTable t = f.table();
  proto::GenerateRequest r = request(11, 2, 8);
  r.mutable_sparse()->set_sparse_threshold(3);
  t.take(r);
  f.run_to_idle();
  EXPECT_EQ(t.size(), 0u);
  ASSERT_EQ(f.chunks.size(), 2u) << "the withdrawn samples must not stream chunks of their own";
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(f.chunks[i].index(), i);
    EXPECT_EQ(f.chunks[i].finish_reason(), proto::FINISH_ERROR);
    EXPECT_THAT(f.chunks[i].error(), HasSubstr("invalid request: sparse threshold 3 refused"));
    EXPECT_EQ(f.chunks[i].token_ids_size(), 0);
  }
}

TEST(RequestTable, AbortAllEndsEverySampleCancelled) {
  Fixture f;
  RequestTable t = f.table();
  t.take(request(1, 1, 50));
  t.take(request(2, 2, 50));
  ASSERT_EQ(t.size(), 3u);
  f.engine.step();
  t.abort_all();
  f.run_to_idle();
  EXPECT_EQ(t.size(), 0u);
  int cancelled = 0;
  for (const proto::GenerateChunk& ch : f.chunks)
    if (ch.finished()) {
      EXPECT_EQ(ch.finish_reason(), proto::FINISH_CANCELLED);
      ++cancelled;
    }
  EXPECT_EQ(cancelled, 3);
}

}  // namespace
}  // namespace spade

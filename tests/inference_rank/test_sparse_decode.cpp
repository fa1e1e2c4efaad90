// Sparse decoding end to end on the real stories260K model:
//  - with a token budget >= context, every mode (oracle inline, predicted in-process, predicted over a transport to a
//    cache rank thread) reproduces the dense greedy output exactly — the plumbing is right;
//  - with a small budget it decodes sparsely, selection arrives in time, and the cache rank's death fails the sparse
//    requests with an error naming it while the engine keeps serving densely.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <thread>

#include "cache_rank/pack_server.h"
#include "pair/link.h"
#include "pair/sharded_link.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"
#include "tests/inference_rank/loopback_cache_rank.h"
#include "tests/test_util.h"
#include "transport/loopback.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

struct Result {
  std::vector<int32_t> ids;
  FinishReason reason = FinishReason::None;
  std::string error;
};

// What a run leaves behind once its engine (and backend) are gone.
struct After {
  SparseStats stats;
  pair::LinkStats link;
  bool link_failed = false;
};

std::vector<Result> run(const Model& m, const std::vector<std::vector<int32_t>>& prompts, int n,
                        const BackendFactory& f, After* after = nullptr,
                        const std::function<void(Engine&, int)>& each_step = nullptr) {
  EngineOptions eo;
  eo.max_num_seqs = 8;
  eo.max_model_len = 512;
  Engine e(m, eo, f);
  std::vector<Result> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.prompt_ids = prompts[i];
    r.max_tokens = n;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    e.submit(r, [&out, i](const TokenEvent& ev) {
      if (ev.token >= 0) out[i].ids.push_back(ev.token);
      if (ev.finished) {
        out[i].reason = ev.reason;
        out[i].error = ev.error;
      }
    });
  }
  int step = 0;
  while (!e.idle()) {
    e.step();
    if (each_step) each_step(e, step++);
  }
  EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages());
  if (after) {
    auto* be = dynamic_cast<SparseAttention*>(&e.attention());
    if (be) {
      after->stats = be->stats();
      if (be->link()) after->link = be->link()->stats();
      after->link_failed = be->link_failed();
    }
  }
  return out;
}

SparseOptions opts(SelectionMode mode, int budget) {
  SparseOptions o;
  o.mode = mode;
  o.sparse_threshold = 24;
  o.layers_per_pack = 2;
  o.selection.token_budget = budget;
  o.selection.local_window = 8;
  o.selection.sink_tokens = 2;
  o.selection.query_window = 4;
  return o;
}

BackendFactory in_process(SparseOptions o, bool delta = false) {
  return [o, delta](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
    std::unique_ptr<pair::CacheRankLink> link;
    if (o.mode == SelectionMode::Predicted)
      link = std::make_unique<cache::InProcessLink>(cfg, o.selection, kv.num_pages(), kv.page_size(), delta);
    return std::make_unique<SparseAttention>(cfg, kv, o, std::move(link));
  };
}

using test::LoopbackCacheRank;

struct Stories : ::testing::Test {
  std::unique_ptr<Model> model;
  std::vector<int32_t> expected;
  void SetUp() override {
    const std::string dir = test::data_path("models/stories260K");
    model = Model::load(dir);
    auto ref = nlohmann::json::parse(test::read_file(dir + "/expected_greedy_200tok.ids.json"));
    expected = ref["generated_ids"].get<std::vector<int32_t>>();
  }
};

TEST_F(Stories, FullBudgetReproducesDenseGreedyExactly) {
  for (SelectionMode mode : {SelectionMode::Dense, SelectionMode::Oracle, SelectionMode::Predicted}) {
    After be;
    auto r = run(*model, {{1}}, 200, in_process(opts(mode, 512)), &be);
    EXPECT_EQ(r[0].ids, expected) << selection_mode_name(mode);
    if (mode != SelectionMode::Dense) {
      EXPECT_EQ(be.stats.switches, 1u);
      EXPECT_GT(be.stats.sparse_seq_steps, 150u) << "most steps must actually be sparse";
    }
  }
}

TEST_F(Stories, FullBudgetOverTransportReproducesDenseGreedyExactly) {
  LoopbackCacheRank cr;
  SparseOptions o = opts(SelectionMode::Predicted, 512);
  After be;
  auto r = run(*model, {{1}, {1, 403, 407}}, 120,
               [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
                 return std::make_unique<SparseAttention>(cfg, kv, o, cr.start(cfg, o));
               },
               &be);
  EXPECT_EQ(r[0].ids, std::vector<int32_t>(expected.begin(), expected.begin() + 120));
  auto dense = run(*model, {{1, 403, 407}}, 120, nullptr);
  EXPECT_EQ(r[1].ids, dense[0].ids) << r[1].error;
  EXPECT_GT(cr.stats.bytes_received, 0u);
  EXPECT_GT(be.link.bytes_received, 0u);
}

// Delta transfer (pair/delta.h) on a real trained model: the same tokens as a full transfer, bit for bit, in
// process and over a transport, with fewer bytes down. Prints how much of a full transfer it sends.
TEST_F(Stories, DeltaTransferIsBitIdenticalToFullTransferAndSendsLess) {
  for (int budget : {16, 64}) {
    After full_be, delta_be;
    const auto full = run(*model, {{1}, {1, 403, 407, 261}}, 150, in_process(opts(SelectionMode::Predicted, budget)),
                          &full_be);
    const auto delta = run(*model, {{1}, {1, 403, 407, 261}}, 150,
                           in_process(opts(SelectionMode::Predicted, budget), /*delta=*/true), &delta_be);
    ASSERT_EQ(full.size(), delta.size());
    for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(full[i].ids, delta[i].ids) << "budget " << budget << " seq " << i;
    EXPECT_GT(delta_be.stats.sparse_seq_steps, 200u);
  }
  for (int budget : {16, 64}) {
    SparseOptions o = opts(SelectionMode::Predicted, budget);
    LoopbackCacheRank full_cr, delta_cr;
    auto over = [&](LoopbackCacheRank& cr, bool delta) {
      return run(*model, {{1}, {1, 403, 407}}, 150,
                 [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
                   return std::make_unique<SparseAttention>(cfg, kv, o, cr.start(cfg, o, delta));
                 });
    };
    const auto a = over(full_cr, false), b = over(delta_cr, true);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].ids, b[i].ids) << b[i].error;
    const pair::DeltaStats& ds = delta_cr.mirror->stats();
    EXPECT_GT(ds.selected_rows, 0u);
    EXPECT_LT(ds.sent_rows, ds.selected_rows);
    EXPECT_LT(delta_cr.stats.bytes_sent, full_cr.stats.bytes_sent);
    std::cerr << "[ DELTA   ] stories260K, budget " << budget << ", window 8, sinks 2, 2 x 150 tokens: sent "
              << ds.sent_rows << " of " << ds.selected_rows << " selected rows ("
              << 100.0 * ds.sent_rows / ds.selected_rows << " %); selection bytes down " << delta_cr.stats.bytes_sent
              << " vs " << full_cr.stats.bytes_sent << " ("
              << 100.0 * delta_cr.stats.bytes_sent / full_cr.stats.bytes_sent << " %)\n";
  }
}

TEST_F(Stories, SmallBudgetDecodesSparselyWithoutStalls) {
  After be;
  size_t max_held_tokens = 0, max_len = 0;  // held: pages of request 1 once past 3 pages of context
  auto r = run(*model, {{1}, {1, 403, 407, 261}}, 150, in_process(opts(SelectionMode::Predicted, 16)), &be,
               [&](Engine& e, int) {
                 if (!e.pages().contains(1)) return;
                 // The inference rank keeps only sink tokens + local window (+ partial pages at the edges).
                 if (e.pages().seq_len(1) > 48) max_held_tokens = std::max<size_t>(max_held_tokens, e.pages().held_pages(1));
                 max_len = std::max<size_t>(max_len, e.pages().seq_len(1));
               });
  EXPECT_GE(max_len, 140u);
  EXPECT_LE(max_held_tokens, 3u) << "pages held: the sink page + at most two pages of the 8-token window";
  EXPECT_GE(max_held_tokens, 1u);
  for (auto& x : r) {
    EXPECT_EQ(x.ids.size(), 150u);
    EXPECT_EQ(x.reason, FinishReason::Length);
  }
  EXPECT_EQ(be.stats.switches, 2u);
  EXPECT_EQ(be.stats.stalls, 0u) << "in-process selection is always ready";
  EXPECT_GT(be.stats.sparse_seq_steps, 200u);
  auto o = run(*model, {{1}}, 150, in_process(opts(SelectionMode::Oracle, 16)), &be);
  EXPECT_EQ(o[0].ids.size(), 150u);
}

// One inference rank, N cache ranks (pair/sharded_link.h): the layer packs round-robin over N in-process cache ranks
// select exactly what one cache rank holding every layer selects, bit for bit, at a small budget (full and delta
// transfer), and each cache rank is sent only the packs it serves.
TEST_F(Stories, ShardedOverSeveralCacheRanksSelectsExactlyAsOne) {
  const int layers = model->config().num_layers;
  for (bool delta : {false, true}) {
    const SparseOptions o = opts(SelectionMode::Predicted, 16);
    const int packs = (layers + o.layers_per_pack - 1) / o.layers_per_pack;
    const auto one = run(*model, {{1}, {1, 403, 407, 261}}, 120, in_process(o, delta));
    for (int n : {2, 3}) {
      std::vector<cache::InProcessLink*> shards;
      std::vector<uint64_t> shard_updates(static_cast<size_t>(n));
      After be;
      const auto sharded = run(
          *model, {{1}, {1, 403, 407, 261}}, 120,
          [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
            std::vector<std::unique_ptr<pair::CacheRankLink>> links;
            for (int i = 0; i < n; ++i) {
              auto l = std::make_unique<cache::InProcessLink>(cfg, o.selection, kv.num_pages(), kv.page_size(), delta);
              shards.push_back(l.get());
              links.push_back(std::move(l));
            }
            return std::make_unique<SparseAttention>(cfg, kv, o, std::make_unique<pair::ShardedLink>(std::move(links)));
          },
          &be,
          [&](Engine&, int) {
            for (int i = 0; i < n; ++i) shard_updates[static_cast<size_t>(i)] = shards[static_cast<size_t>(i)]->stats().updates;
          });
      ASSERT_EQ(sharded.size(), one.size());
      for (size_t i = 0; i < one.size(); ++i)
        EXPECT_EQ(sharded[i].ids, one[i].ids) << "delta " << delta << ", " << n << " cache ranks, seq " << i;
      EXPECT_GT(be.stats.sparse_seq_steps, 150u);
      uint64_t sum = 0;
      for (int i = 0; i < n; ++i) {
        // Shard i serves the packs p with p mod n == i: its share of the updates is exact.
        int mine = 0;
        for (int p = i; p < packs; p += n) ++mine;
        EXPECT_EQ(shard_updates[static_cast<size_t>(i)] * static_cast<uint64_t>(packs),
                  be.link.updates * static_cast<uint64_t>(mine))
            << "shard " << i << " of " << n;
        sum += shard_updates[static_cast<size_t>(i)];
      }
      EXPECT_EQ(sum, be.link.updates);
    }
  }
}

// Throws once, in layer `layer` of forward pass `step` (1-based), before the wrapped backend sees that layer: a step
// that ends early, as when a kernel or a bad page fails mid-forward.
class ThrowOnce : public AttentionBackend {
 public:
  ThrowOnce(std::unique_ptr<AttentionBackend> inner, int step, int layer)
      : inner_(std::move(inner)), step_(step), layer_(layer) {}
  void attend(int layer, const ForwardBatch& b, const float* q, const float* k, const float* v, float* out) override {
    if (layer == 0) ++steps_;
    if (steps_ == step_ && layer == layer_) throw spade::Error("injected failure in layer " + std::to_string(layer));
    inner_->attend(layer, b, q, k, v, out);
  }
  void on_release(uint64_t id) override { inner_->on_release(id); }
  std::vector<std::pair<uint64_t, std::string>> take_failures() override { return inner_->take_failures(); }
  std::pair<int, int> droppable_range(uint64_t id, int len) override { return inner_->droppable_range(id, len); }

 private:
  std::unique_ptr<AttentionBackend> inner_;
  int step_, layer_, steps_ = 0;
};

// A forward pass that fails between two layer packs (after pack 0 was shipped, before pack 1 was read) fails its
// batch; the answers it left unread are dropped, so the link stays healthy and the next request decodes sparsely,
// exactly as on a fresh rank (with delta transfer, whose mirror must stay in step).
TEST_F(Stories, StepFailingMidForwardKeepsTheCacheRankLinkUsable) {
  ASSERT_GE(model->config().num_layers, 3) << "needs a layer in a second pack";
  for (bool delta : {false, true}) {
    const SparseOptions o = opts(SelectionMode::Predicted, 16);
    SparseAttention* sparse = nullptr;
    EngineOptions eo;
    eo.max_num_seqs = 8;
    eo.max_model_len = 512;
    Engine e(*model, eo, [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
      auto b = std::make_unique<SparseAttention>(
          cfg, kv, o, std::make_unique<cache::InProcessLink>(cfg, o.selection, kv.num_pages(), kv.page_size(), delta));
      sparse = b.get();
      return std::make_unique<ThrowOnce>(std::move(b), /*step=*/40, /*layer=*/o.layers_per_pack);
    });
    auto submit = [&](std::vector<int32_t> prompt, int n, Result& out) {
      GenerateRequest r;
      r.prompt_ids = std::move(prompt);
      r.max_tokens = n;
      r.sampling.temperature = 0;
      r.ignore_eos = true;
      e.submit(r, [&out](const TokenEvent& ev) {
        if (ev.token >= 0) out.ids.push_back(ev.token);
        if (ev.finished) {
          out.reason = ev.reason;
          out.error = ev.error;
        }
      });
    };
    Result a, b;
    submit({1}, 120, a);  // sparse from step 24 on (threshold 24); the 40th forward pass fails
    e.run_until_idle();
    EXPECT_EQ(a.reason, FinishReason::Error);
    EXPECT_THAT(a.error, HasSubstr("injected failure in layer 2"));
    submit({1, 403, 407}, 80, b);
    e.run_until_idle();
    ASSERT_NE(sparse, nullptr);
    EXPECT_FALSE(sparse->link_failed()) << "delta " << delta;
    EXPECT_GE(sparse->stats().dropped_answers, 1u);
    EXPECT_EQ(sparse->stats().switches, 2u);
    EXPECT_EQ(b.reason, FinishReason::Length) << b.error;
    const auto clean = run(*model, {{1, 403, 407}}, 80, in_process(o, delta));
    EXPECT_EQ(b.ids, clean[0].ids) << "delta " << delta;
  }
}

TEST_F(Stories, CacheRankDeathFailsSparseRequestsAndDenseServiceContinues) {
  LoopbackCacheRank cr;
  SparseOptions o = opts(SelectionMode::Predicted, 16);
  o.selection_deadline = std::chrono::milliseconds(2000);
  After be;
  const auto t0 = std::chrono::steady_clock::now();
  // Kill the cache rank's transport after 40 steps: the sequence is sparse by then (threshold 24).
  auto r = run(*model, {{1}, {1, 403}}, 120,
               [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
                 return std::make_unique<SparseAttention>(cfg, kv, o, cr.start(cfg, o));
               },
               &be,
               [&](Engine& e, int step) {
                 if (step == 40) {
                   cr.fabric->kill(cr.t_cache->local_address(), "SIGKILL (test)");
                   // A new request after the death is served densely (it passes the threshold later).
                   GenerateRequest g;
                   g.prompt_ids = {1};
                   g.max_tokens = 60;
                   g.sampling.temperature = 0;
                   g.ignore_eos = true;
                   e.submit(g, [](const TokenEvent& ev) { EXPECT_NE(ev.reason, FinishReason::Error) << ev.error; });
                 }
               });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  for (auto& x : r) {
    EXPECT_EQ(x.reason, FinishReason::Error);
    EXPECT_THAT(x.error, HasSubstr("cache rank 1"));
    EXPECT_LT(x.ids.size(), 120u);
  }
  EXPECT_TRUE(be.link_failed);
  EXPECT_EQ(be.stats.failed_seqs, 2u);
  EXPECT_GE(be.stats.dense_fallbacks, 1u) << "the later request passed the threshold without a cache rank";
}

}  // namespace
}  // namespace spade

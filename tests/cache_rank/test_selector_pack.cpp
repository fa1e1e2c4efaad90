// The cache rank's selector and the layer-pack wire format.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "cache_rank/pack_server.h"
#include "cache_rank/selector.h"
#include "pair/pack.h"
#include "common/error.h"
#include "tests/small_config.h"

namespace spade::cache {
namespace {

using ::testing::HasSubstr;
using namespace ::spade::pair;  // the wire types (pair/pack.h) this file encodes, decodes and selects into

using test::small_cfg;

std::vector<float> randn(size_t n, std::mt19937& g) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(Selector, OracleSelectsHighestScoringCandidatesOnly) {
  const ModelConfig c = small_cfg();
  SelectionConfig sc;
  sc.token_budget = 5;
  sc.sink_tokens = 2;
  sc.local_window = 4;
  sc.successor_expand = false;  // plain exact top-k (the expansion: SuccessorExpansionBringsTheNextToken)
  Selector sel(c, sc, 16, 4);
  std::mt19937 g(1);
  const int L = 30;
  auto k = randn(static_cast<size_t>(L) * c.kv_dim(), g), v = randn(k.size(), g), q = randn(c.q_dim(), g);
  sel.init_layer(7, 0, L, k.data(), v.data(), 1, q.data());
  LayerSelection out;
  sel.select(7, 0, L, q.data(), out);
  ASSERT_EQ(out.count, 5);
  for (int h = 0; h < c.num_kv_heads; ++h) {
    // Brute force: max over the group's heads of q·k, candidates [S, L - R).
    std::vector<std::pair<float, int>> s;
    for (int t = sc.sink_tokens; t < L - sc.local_window; ++t) {
      float best = -1e30f;
      for (int qh = h * 2; qh < h * 2 + 2; ++qh) {
        float d = 0;
        for (int e = 0; e < c.head_dim; ++e) d += q[qh * c.head_dim + e] * k[(t * c.num_kv_heads + h) * c.head_dim + e];
        best = std::max(best, d);
      }
      s.push_back({-best, t});
    }
    std::sort(s.begin(), s.end());
    std::set<int> want;
    for (int i = 0; i < 5; ++i) want.insert(s[i].second);
    std::set<int> got(out.positions.begin() + h * 5, out.positions.begin() + h * 5 + 5);
    EXPECT_EQ(got, want) << "head " << h;
    for (int i = 0; i < 5; ++i) {
      const int t = out.positions[h * 5 + i];
      EXPECT_EQ(out.k[(h * 5 + i) * c.head_dim], k[(t * c.num_kv_heads + h) * c.head_dim]) << "gathered K row";
      EXPECT_EQ(out.v[(h * 5 + i) * c.head_dim + 3], v[(t * c.num_kv_heads + h) * c.head_dim + 3]);
    }
  }
}

TEST(Selector, SuccessorExpansionBringsTheNextToken) {
  const ModelConfig c = small_cfg();
  SelectionConfig sc;
  sc.token_budget = 2;
  sc.sink_tokens = 0;
  sc.local_window = 4;
  Selector sel(c, sc, 16, 4);
  const int L = 30;
  // Keys all zero except position 11, which matches the query: the expansion selects {11, 12}.
  std::vector<float> k(static_cast<size_t>(L) * c.kv_dim(), 0.f), v(k.size(), 1.f), q(c.q_dim(), 1.f);
  for (int d = 0; d < c.kv_dim(); ++d) k[11 * c.kv_dim() + d] = 1.f;
  sel.init_layer(3, 0, L, k.data(), v.data(), 1, q.data());
  LayerSelection out;
  sel.select(3, 0, L, q.data(), out);
  ASSERT_EQ(out.count, 2);
  for (int h = 0; h < c.num_kv_heads; ++h) {
    EXPECT_EQ(out.positions[h * 2], 11);
    EXPECT_EQ(out.positions[h * 2 + 1], 12);
  }
}

// A retrieval head that fires at a step no earlier decode query predicts (docs/FIDELITY.md: the step that writes a pass
// key's first digit): the prompt's question read the needle, the decode queries never did. Keys: the needle block
// 40..55 scores 0 for every decode query; the other candidates score 1. The prompt's query (the first of the queries
// init_layer gets) attends position 40 alone. Without anchors the predicted selection holds none of 41..55; with
// them it holds [40, 40 + span).
TEST(Selector, PromptAnchorsHoldTheSpanAfterATokenThePromptAttended) {
  const ModelConfig c = small_cfg();
  const int D = c.head_dim, KV = c.kv_dim(), L = 120, span = 16;
  std::vector<float> k(static_cast<size_t>(L) * KV, 0.f), v(k.size(), 1.f);
  for (int t = 0; t < L; ++t)
    for (int h = 0; h < c.num_kv_heads; ++h) {
      float* kr = &k[(static_cast<size_t>(t) * c.num_kv_heads + h) * D];
      if (t == 40) kr[1] = 8.f;                // the needle's anchor: only the prompt query's direction
      else if (t < 40 || t >= 56) kr[0] = 1.f;  // everything else matches the decode queries
    }
  // Queries oldest first: the prompt's question (direction e1, at position L - 3), then two decode-like ones (e0).
  std::vector<float> qs(static_cast<size_t>(3) * c.q_dim(), 0.f);
  for (int h = 0; h < c.num_q_heads; ++h) {
    qs[static_cast<size_t>(h) * D + 1] = 4.f;
    qs[c.q_dim() + static_cast<size_t>(h) * D] = 1.f;
    qs[2 * c.q_dim() + static_cast<size_t>(h) * D] = 1.f;
  }
  for (const int anchors : {0, 3}) {
    SelectionConfig sc;
    sc.token_budget = 4 * (span + 1);  // one span fits in a quarter of the budget
    sc.local_window = 4;
    sc.anchor_queries = anchors;
    sc.anchor_span = span;
    Selector sel(c, sc, 64, 4);
    sel.init_layer(5, 0, L, k.data(), v.data(), 3, qs.data());
    LayerSelection out;
    sel.select(5, 0, L + 1, nullptr, out);
    ASSERT_EQ(out.count, sc.token_budget);
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const std::set<int> got(out.positions.begin() + h * sc.token_budget,
                              out.positions.begin() + (h + 1) * sc.token_budget);
      int in_block = 0;
      for (int t = 41; t < 56; ++t) in_block += got.count(t);  // (40 itself comes as 39's successor either way)
      EXPECT_EQ(in_block, anchors > 0 ? 15 : 0) << "anchors " << anchors << " head " << h;
    }
    // The oracle (a given query) never uses anchors.
    sel.select(5, 0, L + 1, qs.data() + 2 * c.q_dim(), out);
    EXPECT_EQ(std::count(out.positions.begin(), out.positions.begin() + sc.token_budget, 41), 0);
  }
}

TEST(Selector, QuestPagesMatchBruteForceBoundsAndFillTheBudget) {
  const ModelConfig c = small_cfg();
  SelectionConfig sc;
  sc.token_budget = 10;
  sc.sink_tokens = 2;
  sc.local_window = 4;
  const int P = 4, L = 38;  // candidates [2, 34): pages 0 (partial: 2..3) to 8 (32..33)
  Selector sel(c, sc, 16, P);
  std::mt19937 g(4);
  auto k = randn(static_cast<size_t>(L) * c.kv_dim(), g), v = randn(k.size(), g), q = randn(c.q_dim(), g);
  sel.init_layer(9, 0, L, k.data(), v.data(), 1, q.data());
  LayerSelection out;
  sel.select_pages(9, 0, L, q.data(), out);
  ASSERT_EQ(out.count, 10);
  const int G = c.num_q_heads / c.num_kv_heads, D = c.head_dim;
  for (int h = 0; h < c.num_kv_heads; ++h) {
    // Brute force: the Quest bound of every page over its candidate tokens, max over the group.
    std::vector<std::pair<float, int>> pages;
    for (int pg = 0; pg * P < L - sc.local_window; ++pg) {
      const int t0 = std::max(sc.sink_tokens, pg * P), t1 = std::min(L - sc.local_window, (pg + 1) * P);
      float best = -1e30f;
      for (int qh = h * G; qh < (h + 1) * G; ++qh) {
        float s = 0;
        for (int d = 0; d < D; ++d) {
          float mn = 1e30f, mx = -1e30f;
          for (int t = t0; t < t1; ++t) {
            const float x = k[(t * c.num_kv_heads + h) * D + d];
            mn = std::min(mn, x), mx = std::max(mx, x);
          }
          const float qd = q[qh * D + d];
          s += std::max(qd * mn, qd * mx);
        }
        best = std::max(best, s);
      }
      pages.push_back({-best, pg});
    }
    std::sort(pages.begin(), pages.end());
    std::vector<int> want;
    for (const auto& [neg, pg] : pages) {
      for (int t = std::max(sc.sink_tokens, pg * P); t < std::min(L - sc.local_window, (pg + 1) * P); ++t)
        if (static_cast<int>(want.size()) < sc.token_budget) want.push_back(t);
    }
    std::sort(want.begin(), want.end());
    std::vector<int> got(out.positions.begin() + h * sc.token_budget, out.positions.begin() + (h + 1) * sc.token_budget);
    EXPECT_EQ(got, want) << "kv head " << h;
    // The gathered rows are the selected tokens' K.
    for (int j = 0; j < out.count; ++j)
      EXPECT_EQ(out.k[(static_cast<size_t>(h) * sc.token_budget + j) * D], k[(got[j] * c.num_kv_heads + h) * D]);
  }
  EXPECT_THROW(sel.select_pages(9, 0, L, nullptr, out), Error);
}

TEST(Selector, FullBudgetReturnsEveryCandidateAndAppendGrows) {
  const ModelConfig c = small_cfg();
  SelectionConfig sc;
  sc.token_budget = 100;
  sc.sink_tokens = 1;
  sc.local_window = 2;
  sc.query_window = 3;
  Selector sel(c, sc, 8, 8);
  std::mt19937 g(2);
  auto k = randn(10 * c.kv_dim(), g), v = randn(k.size(), g), qs = randn(5 * c.q_dim(), g);
  for (int l = 0; l < 2; ++l) sel.init_layer(3, l, 10, k.data(), v.data(), 5, qs.data());
  EXPECT_EQ(sel.seq_len(3), 10);
  LayerSelection out;
  sel.select(3, 1, 11, nullptr, out);  // predicted query, next step's context 11: candidates [1, 9)
  EXPECT_EQ(out.count, 8);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out.positions[i], i + 1);
  auto q1 = randn(c.q_dim(), g), k1 = randn(c.kv_dim(), g), v1 = randn(c.kv_dim(), g);
  sel.append_layer(3, 0, 10, q1.data(), k1.data(), v1.data());
  sel.append_layer(3, 1, 10, q1.data(), k1.data(), v1.data());
  EXPECT_EQ(sel.seq_len(3), 11);
  EXPECT_THROW(sel.append_layer(3, 0, 5, q1.data(), k1.data(), v1.data()), Error);
  sel.release(3);
  EXPECT_FALSE(sel.tracks(3));
  EXPECT_EQ(sel.num_free_pages(), sel.num_pages());
  EXPECT_THROW(Selector(c, SelectionConfig{.token_budget = 0}, 4, 4), Error);
}

// A layer shard (pair/sharded_link.h): a Selector holding layers {1} of 2 selects for layer 1 exactly what a
// Selector holding every layer does (prompt and appended tokens, predicted query), and refuses layer 0 by name
// without admitting the sequence.
TEST(Selector, AShardHoldsItsLayersOnlyAndSelectsLikeTheFullSelector) {
  const ModelConfig c = small_cfg();
  SelectionConfig sc;
  sc.token_budget = 6;
  sc.local_window = 4;
  Selector full(c, sc, 16, 4);
  Selector shard(c, sc, 16, 4, {1});
  std::mt19937 g(3);
  const int L = 40;
  auto k = randn(static_cast<size_t>(L) * c.kv_dim(), g), v = randn(k.size(), g);
  auto qs = randn(static_cast<size_t>(4) * c.q_dim(), g);
  try {
    shard.init_layer(9, 0, L, k.data(), v.data(), 4, qs.data());
    FAIL() << "layer 0 accepted by the shard holding layer 1";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer 0 is not held by this shard (it holds layers 1)"));
  }
  EXPECT_FALSE(shard.tracks(9));
  EXPECT_EQ(shard.num_free_pages(), 16);
  for (Selector* s : {&full, &shard}) s->init_layer(9, 1, L, k.data(), v.data(), 4, qs.data());
  full.init_layer(9, 0, L, k.data(), v.data(), 4, qs.data());
  for (int step = 0; step < 3; ++step) {
    LayerSelection a, b;
    full.select(9, 1, L + step + 1, nullptr, a);
    shard.select(9, 1, L + step + 1, nullptr, b);
    EXPECT_EQ(a.count, b.count);
    EXPECT_EQ(a.positions, b.positions) << "step " << step;
    EXPECT_EQ(a.k, b.k);
    EXPECT_EQ(a.v, b.v);
    auto q = randn(c.q_dim(), g), kt = randn(c.kv_dim(), g), vt = randn(c.kv_dim(), g);
    full.append_layer(9, 0, L + step, q.data(), kt.data(), vt.data());
    full.append_layer(9, 1, L + step, q.data(), kt.data(), vt.data());
    shard.append_layer(9, 1, L + step, q.data(), kt.data(), vt.data());
  }
  EXPECT_EQ(shard.seq_len(9), full.seq_len(9));
  EXPECT_THROW(Selector(c, sc, 16, 4, {2}), Error);  // outside the model's layers
}

TEST(Selector, PoolExhaustionIsAClearError) {
  const ModelConfig c = small_cfg();
  Selector sel(c, {}, 2, 4);
  std::vector<float> k(20 * c.kv_dim()), q(c.q_dim());
  try {
    sel.init_layer(1, 0, 20, k.data(), k.data(), 1, q.data());
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cache rank KV pool exhausted: sequence 1 needs 5 pages, 2 of 2 free"));
  }
  EXPECT_FALSE(sel.tracks(1));
}

TEST(Pack, RoundTripAndProcessing) {
  const ModelConfig c = small_cfg();
  SelectionConfig sc;
  sc.token_budget = 4;
  sc.sink_tokens = 1;
  sc.local_window = 2;
  const PackShape s = pack_shape(c, sc);
  std::mt19937 g(3);
  PackUpdate u;
  u.step = 12;
  u.pack = 0;
  u.first_layer = 0;
  u.num_layers = 2;
  u.released = {99};
  SeqUpdate e;
  e.seq_id = 5;
  e.context_len = 9;
  e.init = true;
  e.num_queries = 3;
  e.q = randn(2 * 3 * c.q_dim(), g);
  e.k = randn(2 * 9 * c.kv_dim(), g);
  e.v = randn(e.k.size(), g);
  u.seqs.push_back(e);
  const auto bytes = encode(u, s);
  const PackUpdate d = decode_update(bytes.data(), bytes.size(), s, "peer X");
  EXPECT_EQ(d.step, 12);
  EXPECT_EQ(d.released, std::vector<uint64_t>{99});
  ASSERT_EQ(d.seqs.size(), 1u);
  EXPECT_EQ(d.seqs[0].k, e.k);
  EXPECT_EQ(d.seqs[0].q, e.q);
  EXPECT_TRUE(d.seqs[0].init);

  Selector sel(c, sc, 16, 4);
  const PackSelection p = process_pack(sel, d);
  ASSERT_TRUE(p.error.empty()) << p.error;
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_EQ(p.seqs[0].context_len, 10);
  ASSERT_EQ(p.seqs[0].layers.size(), 2u);
  EXPECT_EQ(p.seqs[0].layers[0].count, 4);  // candidates [1, 8): 7 > budget 4
  const auto sb = encode(p, s);
  const PackSelection q = decode_selection(sb.data(), sb.size(), s, "peer X");
  EXPECT_EQ(q.seqs[0].layers[1].positions, p.seqs[0].layers[1].positions);
  EXPECT_EQ(q.seqs[0].layers[1].k, p.seqs[0].layers[1].k);

  // An APPEND for an unknown sequence is reported in the selection, not thrown.
  PackUpdate bad = u;
  bad.seqs[0].seq_id = 77;
  bad.seqs[0].init = false;
  bad.seqs[0].num_queries = 1;
  bad.seqs[0].q.resize(2 * c.q_dim());
  bad.seqs[0].k.resize(2 * c.kv_dim());
  bad.seqs[0].v.resize(2 * c.kv_dim());
  EXPECT_THAT(process_pack(sel, bad).error, HasSubstr("unknown sequence 77"));
}

TEST(Pack, OverlapSamplerMeasuresEveryLayerOfEveryPack) {
  ModelConfig c = small_cfg();
  c.num_layers = 4;
  SelectionConfig sc;
  sc.token_budget = 3;
  sc.local_window = 2;
  Selector sel(c, sc, 32, 4);
  OverlapSampler sampler(1);
  std::mt19937 g(8);
  int len = 12;
  auto update = [&](int64_t step, int first_layer, bool init) {
    PackUpdate u;
    u.step = step;
    u.first_layer = first_layer;
    u.pack = first_layer / 2;
    u.num_layers = 2;
    SeqUpdate e;
    e.seq_id = 1;
    e.context_len = len;
    e.init = init;
    e.num_queries = init ? 3 : 1;
    const int tokens = init ? len : 1;
    e.q = randn(static_cast<size_t>(2) * e.num_queries * c.q_dim(), g);
    e.k = randn(static_cast<size_t>(2) * tokens * c.kv_dim(), g);
    e.v = randn(e.k.size(), g);
    u.seqs.push_back(e);
    const PackSelection p = process_pack(sel, u, &sampler);
    ASSERT_TRUE(p.error.empty()) << p.error;
  };
  update(1, 0, true);
  update(1, 2, true);
  for (int step = 2; step <= 4; ++step) {
    ++len;
    update(step, 0, false);
    update(step, 2, false);
  }
  // Three APPEND steps: every layer (both layers of both packs) compared its prediction three times, and its churn
  // measured three times (the INIT's prediction is the first one).
  const auto& st = sampler.head_stats();
  ASSERT_EQ(st.size(), 4u);
  for (int l = 0; l < 4; ++l) {
    ASSERT_EQ(st[l].size(), static_cast<size_t>(c.num_kv_heads)) << "layer " << l;
    for (const auto& h : st[l]) {
      EXPECT_EQ(h.overlap_n, 3) << "layer " << l;
      EXPECT_EQ(h.churn_n, 3) << "layer " << l;
      EXPECT_GE(h.overlap_sum, 0.0);
      EXPECT_LE(h.overlap_sum, 3.0);
    }
  }
  EXPECT_EQ(sampler.take().size(), 12u);
}

TEST(Pack, MalformedMessagesNameThePeer) {
  const ModelConfig c = small_cfg();
  const PackShape s = pack_shape(c, {});
  PackUpdate u;
  u.num_layers = 1;
  SeqUpdate e;
  e.seq_id = 1;
  e.context_len = 1;
  e.num_queries = 1;
  e.q.resize(c.q_dim());
  e.k.resize(c.kv_dim());
  e.v.resize(c.kv_dim());
  u.seqs.push_back(e);
  auto bytes = encode(u, s);
  for (size_t cut : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    try {
      decode_update(bytes.data(), cut, s, "inference rank 0 (#1)");
      ADD_FAILURE() << "accepted a truncated message of " << cut << " bytes";
    } catch (const Error& err) {
      EXPECT_THAT(err.what(), HasSubstr("inference rank 0 (#1): malformed pack update"));
    }
  }
  bytes.push_back(0);
  EXPECT_THROW(decode_update(bytes.data(), bytes.size(), s, "p"), Error);
  std::vector<uint8_t> garbage(64, 0xAB);
  EXPECT_THROW(decode_selection(garbage.data(), garbage.size(), s, "p"), Error);
}

}  // namespace
}  // namespace spade::cache

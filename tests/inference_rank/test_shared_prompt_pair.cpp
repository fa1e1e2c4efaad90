// The shared prompt on both ranks of the CPU pair (inference_rank/sparse_attention.h "Shared INIT",
// pair::SeqUpdate::shared_from): n samples of one prompt, and a prompt that hits the prefix cache while a sequence
// holding that prefix runs, ship and store the shared part once on the cache rank too; every selection and token is
// bit-identical to the unshared pair's; cancels and releases leave no page held on either rank. In process (a
// recording link around a whole cache rank) and over a loopback transport (the wire bytes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <map>
#include <thread>

#include "cache_rank/pack_server.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"
#include "pair/link.h"
#include "tests/inference_rank/loopback_cache_rank.h"
#include "tests/inference_rank/request_helpers.h"
#include "tests/test_util.h"
#include "transport/loopback.h"

namespace spade {
namespace {

using test::prompt;
using test::stories_sparse;

GenerateRequest request(std::vector<int32_t> ids, int n, float temperature, uint64_t seed) {
  GenerateRequest r;
  r.prompt_ids = std::move(ids);
  r.max_tokens = n;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.ignore_eos = true;
  return r;
}

// One layer's selection as the inference rank received it.
struct Rec {
  int64_t step;
  int pack;
  uint64_t seq;
  int context_len, layer, count;
  std::vector<int32_t> positions;
  std::vector<float> k, v;
  bool operator==(const Rec&) const = default;
};

// A whole cache rank in process that records every selection it answers, the wire bytes of every update (as
// pair::encode would send them, frame prefix included) and, polled by the test, the most pages it held at once.
class RecordingLink : public pair::CacheRankLink {
 public:
  RecordingLink(const ModelConfig& cfg, const pair::SelectionConfig& sc, int num_pages, int page_size)
      : inner_(cfg, sc, num_pages, page_size), shape_(pair::pack_shape(cfg, sc)) {}
  void send(pair::PackUpdate&& u) override {
    const size_t bytes = pair::encode(u, shape_).size() + sizeof(pair::FramePrefix);
    update_bytes += bytes;
    for (const auto& e : u.seqs)
      if (e.init) {
        init_update_bytes += bytes;  // updates of a step that switches sequences (their bulk ship)
        break;
      }
    inner_.send(std::move(u));
    peak_pages = std::max(peak_pages, inner_.selector().num_used_pages());
  }
  pair::PackSelection receive(transport::Deadline deadline, bool* waited) override {
    pair::PackSelection p = inner_.receive(deadline, waited);
    for (const auto& s : p.seqs)
      for (size_t i = 0; i < s.layers.size(); ++i) {
        const auto& l = s.layers[i];
        recs.push_back({p.step, p.pack, s.seq_id, s.context_len, static_cast<int>(i), l.count, l.positions, l.k, l.v});
      }
    return p;
  }
  size_t in_flight() const override { return inner_.in_flight(); }
  const pair::LinkStats& stats() const override { return inner_.stats(); }
  std::string peer() const override { return inner_.peer(); }
  cache::Selector& selector() { return inner_.selector(); }

  std::vector<Rec> recs;
  size_t update_bytes = 0, init_update_bytes = 0;
  int peak_pages = 0;

 private:
  cache::InProcessLink inner_;
  pair::PackShape shape_;
};


// An engine whose sparse backend talks to a RecordingLink (cache-rank page size `cache_page`); `sharing` false
// takes the engine's page allocator away from the backend (every INIT ships the whole context, as before).
struct Pair {
  std::unique_ptr<Engine> engine;
  RecordingLink* link = nullptr;
  SparseAttention* sparse = nullptr;
  Pair(const Model& m, EngineOptions o, const SparseOptions& so, bool sharing, int cache_page = 0) {
    o.prefix_recompute_tokens = so.prefix_recompute_tokens();
    engine = std::make_unique<Engine>(m, o, [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
      auto l = std::make_unique<RecordingLink>(cfg, so.selection, kv.num_pages() * 2,
                                               cache_page > 0 ? cache_page : kv.page_size());
      link = l.get();
      return std::make_unique<SparseAttention>(cfg, kv, so, std::move(l));
    });
    sparse = dynamic_cast<SparseAttention*>(&engine->attention());
    if (!sharing) sparse->set_page_allocator(nullptr);
  }
  // Steps until idle, then sends the last releases (what serve's idle loop does).
  void finish() {
    while (!engine->idle()) engine->step();
    sparse->idle_flush();
  }
  void expect_nothing_held() const {
    EXPECT_EQ(link->selector().num_sequences(), 0u) << "cache rank";
    EXPECT_EQ(link->selector().num_used_pages(), 0) << "cache rank";
    for (int32_t p = 0; p < link->selector().num_pages(); ++p)
      ASSERT_EQ(link->selector().pages().refcount(p), 0) << "cache rank page " << p;
    EXPECT_EQ(engine->pages().num_free_pages(), engine->pages().num_pages()) << "inference rank";
    for (int32_t p = 0; p < engine->pages().num_pages(); ++p)
      ASSERT_EQ(engine->pages().refcount(p), 0) << "inference rank page " << p;
  }
};

// Submits n samples; returns each sample's tokens (in sample order) once `finish` ran.
struct Samples {
  std::vector<uint64_t> ids;
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, FinishReason> reason;
  std::map<uint64_t, std::string> error;
  Samples(Engine& e, const GenerateRequest& r, int n) {
    ids = e.submit_samples(r, n, [this](const TokenEvent& ev) {
      if (ev.token >= 0) tokens[ev.request_id].push_back(ev.token);
      if (ev.finished) reason[ev.request_id] = ev.reason, error[ev.request_id] = ev.error;
    });
  }
};

struct SharedPromptPair : ::testing::TestWithParam<int> {
  std::unique_ptr<Model> model;
  void SetUp() override { model = Model::load(test::data_path("models/stories260K")); }
  static EngineOptions options() {
    EngineOptions o;
    o.max_num_seqs = 8;
    o.max_model_len = 512;
    return o;
  }
};

// Cache-rank page size 16 (the engine's: whole pages shared) and 10 (the shared prefix ends inside a page, which the
// cache rank copies on write).
TEST_P(SharedPromptPair, SamplesStoreThePromptOnceAndSelectBitIdentically) {
  const int cache_page = GetParam(), n = 4, gen = 50, len = 220;
  const SparseOptions so = stories_sparse();
  const auto p = prompt(len, 6, model->config().vocab_size);
  Pair off(*model, options(), so, false, cache_page), on(*model, options(), so, true, cache_page);
  Samples a(*off.engine, request(p, gen, 1.0f, 7), n), b(*on.engine, request(p, gen, 1.0f, 7), n);
  off.finish();
  on.finish();
  ASSERT_EQ(a.ids, b.ids);
  for (uint64_t id : a.ids) {
    EXPECT_EQ(b.reason[id], FinishReason::Length) << b.error[id];
    EXPECT_EQ(b.tokens[id], a.tokens[id]) << "sample " << id;
  }
  EXPECT_NE(a.tokens[a.ids[0]], a.tokens[a.ids[1]]) << "different seeds";
  ASSERT_FALSE(off.link->recs.empty());
  EXPECT_TRUE(on.link->recs == off.link->recs) << "every selection (positions, K, V) bit-identical";

  // The engine shares the prompt's whole pages up to prefix_recompute_tokens before its end: 144 of 220 tokens.
  const int shared = (len - 64) / 16 * 16;
  ASSERT_EQ(shared, 144);
  const SparseStats& st = on.sparse->stats();
  EXPECT_EQ(st.switches, static_cast<uint64_t>(n));
  EXPECT_EQ(st.shared_inits, static_cast<uint64_t>(n - 1)) << "the first sample ships the prompt, the others share";
  EXPECT_EQ(st.init_shared_tokens, static_cast<uint64_t>((n - 1) * shared));
  EXPECT_EQ(st.init_tokens, static_cast<uint64_t>(n * (len + 1)));
  EXPECT_EQ(off.sparse->stats().shared_inits, 0u);
  // Cache rank: the prompt once + n tails. The shared pages wholly inside the 144 tokens are stored once.
  const int saved = (n - 1) * (shared / cache_page);
  EXPECT_EQ(off.link->peak_pages - on.link->peak_pages, saved);
  const int one = (len + gen + cache_page - 1) / cache_page;
  EXPECT_EQ(off.link->peak_pages, n * one);
  std::cerr << "[ SHARED  ] stories260K, " << n << " samples of " << len << " tokens, cache page " << cache_page
            << ": cache rank peak " << on.link->peak_pages << " pages (unshared " << off.link->peak_pages
            << "); switch updates " << on.link->init_update_bytes << " bytes (unshared "
            << off.link->init_update_bytes << ")\n";
  EXPECT_LT(on.link->init_update_bytes, off.link->init_update_bytes);
  on.expect_nothing_held();
  off.expect_nothing_held();
}

INSTANTIATE_TEST_SUITE_P(CachePageSizes, SharedPromptPair, ::testing::Values(16, 10));

// Cancels: the sample every other one shares from, and another, are aborted at the switch step or mid-decode; the
// others decode exactly as without the cancels and without sharing; no page stays held on either rank.
TEST_P(SharedPromptPair, CancelsOfTheSourceAndASharerLeakNothingAndTheOthersDecodeOn) {
  const int cache_page = GetParam(), n = 4, gen = 40, len = 200;
  const SparseOptions so = stories_sparse();
  const auto p = prompt(len, 9, model->config().vocab_size);
  Pair ref(*model, options(), so, false, cache_page);
  Samples expected(*ref.engine, request(p, gen, 1.0f, 3), n);
  ref.finish();
  // Steps: 1 = the group prefill, 2 = the samples' own prompt tokens, 3 = the switch (INIT), then sparse.
  for (int when : {1, 3, 8}) {
    Pair on(*model, options(), so, true, cache_page);
    Samples got(*on.engine, request(p, gen, 1.0f, 3), n);
    for (int s = 0; s < when; ++s) on.engine->step();
    on.engine->abort(got.ids[0]);
    on.engine->abort(got.ids[2]);
    on.finish();
    EXPECT_EQ(got.reason[got.ids[0]], FinishReason::Abort) << when;
    EXPECT_EQ(got.reason[got.ids[2]], FinishReason::Abort) << when;
    for (size_t i : {size_t{1}, size_t{3}}) {
      EXPECT_EQ(got.reason[got.ids[i]], FinishReason::Length) << when << ": " << got.error[got.ids[i]];
      EXPECT_EQ(got.tokens[got.ids[i]], expected.tokens[expected.ids[i]]) << "sample " << i << ", abort after " << when;
    }
    if (when >= 3) {
      EXPECT_EQ(on.sparse->stats().shared_inits, 3u) << when;
    }
    on.expect_nothing_held();
  }
}

// A prompt that hits the inference rank's prefix cache while the request that computed it decodes sparsely: its
// INIT shares that request's pages on the cache rank (not re-shipped) and decodes as a cold engine does.
TEST_F(SharedPromptPair, APrefixCacheHitSharesTheRunningHoldersPagesOnTheCacheRank) {
  SparseOptions so = stories_sparse();
  so.max_retained_prefix_tokens = 0;  // nothing stays held after the requests (retention: test_retained_prefix.cpp)
  const auto p = prompt(220, 4, model->config().vocab_size);
  Pair cold(*model, options(), so, false);
  Samples ca(*cold.engine, request(p, 60, 0.f, 0), 1);
  cold.finish();
  EngineOptions o = options();
  o.enable_prefix_caching = true;
  for (bool sharing : {false, true}) {
    Pair warm(*model, o, so, sharing);
    Samples a(*warm.engine, request(p, 60, 0.f, 0), 1);
    for (int s = 0; s < 6; ++s) warm.engine->step();  // a is sparse now (its middle pages dropped locally)
    Samples b(*warm.engine, request(p, 40, 0.f, 0), 1);
    warm.finish();
    EXPECT_EQ(a.tokens[a.ids[0]], ca.tokens[ca.ids[0]]) << sharing;
    const auto& ref = ca.tokens[ca.ids[0]];
    EXPECT_EQ(b.tokens[b.ids[0]], std::vector<int32_t>(ref.begin(), ref.begin() + 40)) << sharing;
    EXPECT_EQ(warm.engine->stats().prefix_hit_tokens, 144u) << sharing;
    EXPECT_EQ(warm.sparse->stats().switches, 2u) << sharing;
    EXPECT_EQ(warm.sparse->stats().shared_inits, sharing ? 1u : 0u);
    EXPECT_EQ(warm.sparse->stats().init_shared_tokens, sharing ? 144u : 0u);
    warm.expect_nothing_held();
  }
}

// Over a transport: a cache rank served by a thread (cache::serve_cache_rank, pair::TransportLink), so the shared
// INIT crosses the wire encoded. The tokens match the unshared run, and the cache rank receives exactly the shared
// tokens' K/V fewer bytes (less the 16-byte share of each pack's INIT entry).
using test::LoopbackCacheRank;

TEST_F(SharedPromptPair, OverATransportTheSharedTokensAreNotShipped) {
  const SparseOptions so = stories_sparse();
  const int n = 4, len = 220;
  const auto p = prompt(len, 2, model->config().vocab_size);
  std::map<bool, std::vector<std::vector<int32_t>>> tokens;
  std::map<bool, uint64_t> bytes;
  for (bool sharing : {false, true}) {
    LoopbackCacheRank cr;
    EngineOptions o = options();
    o.prefix_recompute_tokens = so.prefix_recompute_tokens();
    Engine e(*model, o, [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
      return std::make_unique<SparseAttention>(cfg, kv, so, cr.start(cfg, so, false, 1024));
    });
    auto* sparse = dynamic_cast<SparseAttention*>(&e.attention());
    if (!sharing) sparse->set_page_allocator(nullptr);
    Samples s(e, request(p, 30, 1.0f, 11), n);
    while (!e.idle()) e.step();
    sparse->idle_flush();
    cr.join();
    EXPECT_EQ(cr.served_error, "");
    EXPECT_EQ(sparse->stats().shared_inits, sharing ? static_cast<uint64_t>(n - 1) : 0u);
    EXPECT_EQ(cr.sel->num_used_pages(), 0) << "every release reached the cache rank";
    for (uint64_t id : s.ids) tokens[sharing].push_back(s.tokens[id]);
    bytes[sharing] = cr.stats.bytes_received;
  }
  EXPECT_EQ(tokens[true], tokens[false]);
  const ModelConfig& c = model->config();
  const int packs = (c.num_layers + so.layers_per_pack - 1) / so.layers_per_pack;
  const uint64_t kv_bytes = static_cast<uint64_t>(n - 1) * 144 * c.num_layers * c.kv_dim() * 2 * sizeof(float);
  EXPECT_EQ(bytes[false] - bytes[true], kv_bytes - static_cast<uint64_t>(n - 1) * packs * 16);
}

// The figure for the docs: 8 samples of a 2,048-token prompt on longctx-7m (the real trained model of the demo), with
// the shared INIT and without it (today's pair: every sample ships and stores the whole prompt, as 8 requests switching
// together do): the same tokens, cache-rank pages and the bytes of the switch step's updates.
TEST(SharedPromptPairLongctx, EightSamplesOfA2kPromptShipAndStoreThePromptOnce) {
  auto model = Model::load(test::data_path("models/longctx-7m"));
  SparseOptions so;
  so.mode = SelectionMode::Predicted;
  so.sparse_threshold = 1024;
  so.layers_per_pack = 2;
  so.selection.token_budget = 32;
  EngineOptions o;
  o.max_num_seqs = 8;
  o.max_model_len = 2304;
  const int n = 8, len = 2048, gen = 8;
  const auto p = prompt(len, 1, model->config().vocab_size);
  struct Run {
    int peak = 0;
    size_t switch_bytes = 0;
    std::vector<std::vector<int32_t>> tokens;
    std::vector<Rec> recs;
    uint64_t shared_tokens = 0;
  };
  auto run = [&](bool sharing) {
    Pair pr(*model, o, so, sharing);
    Samples s(*pr.engine, request(p, gen, 1.0f, 5), n);
    pr.finish();
    Run r;
    for (uint64_t id : s.ids) r.tokens.push_back(s.tokens[id]);
    pr.expect_nothing_held();
    r.peak = pr.link->peak_pages;
    r.switch_bytes = pr.link->init_update_bytes;
    r.recs = std::move(pr.link->recs);
    r.shared_tokens = pr.sparse->stats().init_shared_tokens;
    return r;
  };
  const Run on = run(true), off = run(false);
  EXPECT_EQ(on.tokens, off.tokens);
  EXPECT_TRUE(on.recs == off.recs) << "every selection bit-identical";
  std::cerr << "[ SHARED  ] longctx-7m, " << n << " samples of a " << len << "-token prompt: cache rank peak "
            << on.peak << " pages (16 tokens) against " << off.peak << " unshared; the switch step's updates "
            << on.switch_bytes << " bytes against " << off.switch_bytes << "\n";
  // The prompt's 1,984 shared tokens (124 pages) once + 8 tails of 5 pages = 164, against 8 x 129 = 1,032.
  const int shared = (len - 64) / 16, full = (len + gen + 15) / 16;
  EXPECT_EQ(on.shared_tokens, static_cast<uint64_t>((n - 1) * shared * 16));
  EXPECT_EQ(off.peak, n * full);
  EXPECT_EQ(on.peak, shared + n * (full - shared));
  // Exactly the shared tokens' K and V of every layer fewer, less each pack's 16-byte share per sharer.
  const ModelConfig& c = model->config();
  const size_t packs = static_cast<size_t>((c.num_layers + so.layers_per_pack - 1) / so.layers_per_pack);
  EXPECT_EQ(off.switch_bytes - on.switch_bytes,
            static_cast<size_t>(n - 1) * (static_cast<size_t>(shared) * 16 * c.num_layers * c.kv_dim() * 2 *
                                              sizeof(float) -
                                          packs * 16));
}

}  // namespace
}  // namespace spade

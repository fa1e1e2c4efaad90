// Retained prefixes on the CPU pair (inference_rank/sparse_attention.h "Retained prefixes", pair::PackUpdate::retained):
// a prompt whose earlier holders have all ended, but whose pages the inference rank's prefix cache still holds, is not
// shipped to the cache rank again; its selections and tokens are bit-identical to retention off and to the unshared
// pair; eviction on the inference rank shortens or drops the retained prefix on the cache rank; cancels, a cache-rank
// loss and a replacement leave both ranks agreeing and nothing leaked; malformed retain / drop entries are refused
// naming the peer, the sequence and the field; the rank's flag is refused where it does not apply.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <tuple>

#include "cache_rank/pack_server.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"
#include "pair/link.h"
#include "pair/pack.h"
#include "pair/sharded_link.h"
#include "tests/inference_rank/loopback_cache_rank.h"
#include "tests/inference_rank/request_helpers.h"
#include "tests/small_config.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

using test::greedy;
using test::prompt;

// One layer's selection as the inference rank received it (the step is left out: runs differ in their idle flushes).
struct Rec {
  uint64_t seq;
  int context_len, layer, count;
  std::vector<int32_t> positions;
  std::vector<float> k, v;
  bool operator==(const Rec&) const = default;
};

// An INIT entry as sent: its sequence, K/V rows per layer and share.
struct InitRec {
  uint64_t seq;
  int pack, kv_tokens, shared_tokens;
  uint64_t shared_from;
};

// A whole cache rank in process that records every selection, every INIT entry and the wire bytes of the updates
// that carry INITs; `fail_sends` makes the next send throw (a cache rank lost mid-run).
class RecordingLink : public pair::CacheRankLink {
 public:
  RecordingLink(const ModelConfig& cfg, const pair::SelectionConfig& sc, int num_pages, int page_size)
      : inner_(cfg, sc, num_pages, page_size), shape_(pair::pack_shape(cfg, sc)) {}
  void send(pair::PackUpdate&& u) override {
    if (fail_sends) fail("recording cache rank: lost");
    const size_t bytes = pair::encode(u, shape_).size() + sizeof(pair::FramePrefix);
    for (const auto& e : u.seqs)
      if (e.init) {
        inits.push_back({e.seq_id, u.pack, e.kv_tokens(), e.shared_tokens, e.shared_from});
        init_bytes[e.seq_id] += bytes;  // only one sequence switches per step in these tests
      }
    inner_.send(std::move(u));
  }
  pair::PackSelection receive(transport::Deadline deadline, bool* waited) override {
    pair::PackSelection p = inner_.receive(deadline, waited);
    for (const auto& s : p.seqs)
      for (size_t i = 0; i < s.layers.size(); ++i) {
        const auto& l = s.layers[i];
        recs.push_back({s.seq_id, s.context_len, static_cast<int>(i) + p.pack * 100, l.count, l.positions, l.k, l.v});
      }
    return p;
  }
  size_t in_flight() const override { return inner_.in_flight(); }
  const pair::LinkStats& stats() const override { return inner_.stats(); }
  std::string peer() const override { return inner_.peer(); }
  cache::Selector& selector() { return inner_.selector(); }
  // K/V rows per layer sent for `seq`'s INIT (every pack carries the same count).
  int init_rows(uint64_t seq) const {
    for (const auto& i : inits)
      if (i.seq == seq) return i.kv_tokens;
    return -1;
  }
  const InitRec* init_of(uint64_t seq) const {
    for (const auto& i : inits)
      if (i.seq == seq) return &i;
    return nullptr;
  }

  std::vector<Rec> recs;
  std::vector<InitRec> inits;
  std::map<uint64_t, size_t> init_bytes;
  bool fail_sends = false;

 private:
  cache::InProcessLink inner_;
  pair::PackShape shape_;
};

// The shared stories260K sparse settings, keeping up to `retained_tokens` of retained prefixes (0: none).
SparseOptions stories_sparse(int retained_tokens) {
  SparseOptions so = test::stories_sparse();
  so.max_retained_prefix_tokens = retained_tokens;
  return so;
}

enum class Mode { Retain, NoRetain, Unshared };

// An engine with prefix caching whose sparse backend talks to a RecordingLink, or with `shards` > 1 to that many
// (layer shards over a pair::ShardedLink; `link` is shard 0's). Retain: retention on; NoRetain:
// --max-retained-prefix-tokens 0; Unshared: no shared INIT at all (every INIT ships the whole context).
struct Pair {
  std::unique_ptr<Engine> engine;
  RecordingLink* link = nullptr;
  std::vector<RecordingLink*> shards;
  SparseAttention* sparse = nullptr;
  SparseOptions so;
  Pair(const Model& m, Mode mode, int num_pages = 0, bool prefix_caching = true, int retained_tokens = 65536,
       int num_shards = 1)
      : so(stories_sparse(mode == Mode::Retain ? retained_tokens : 0)) {
    EngineOptions o;
    o.max_num_seqs = 4;
    o.max_model_len = 512;
    o.num_pages = num_pages;
    o.enable_prefix_caching = prefix_caching;
    o.prefix_recompute_tokens = so.prefix_recompute_tokens();
    engine = std::make_unique<Engine>(m, o, [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
      std::vector<std::unique_ptr<pair::CacheRankLink>> links;
      for (int i = 0; i < num_shards; ++i) {
        auto l = std::make_unique<RecordingLink>(cfg, so.selection, 2048, kv.page_size());
        shards.push_back(l.get());
        links.push_back(std::move(l));
      }
      link = shards[0];
      if (num_shards == 1) return std::make_unique<SparseAttention>(cfg, kv, so, std::move(links[0]));
      return std::make_unique<SparseAttention>(cfg, kv, so, std::make_unique<pair::ShardedLink>(std::move(links)));
    });
    sparse = dynamic_cast<SparseAttention*>(&engine->attention());
    if (mode == Mode::Unshared) sparse->set_page_allocator(nullptr);
  }
  // Runs one request to its end (then the idle flush, as serve's loop does); returns its id, fills `tokens`.
  uint64_t run(const GenerateRequest& r, std::vector<int32_t>* tokens, bool force_dense = false) {
    const uint64_t id = engine->submit(r, [tokens](const TokenEvent& ev) {
      if (ev.token >= 0 && tokens) tokens->push_back(ev.token);
    });
    if (force_dense) sparse->set_request_options(id, true, 0);
    while (!engine->idle()) engine->step();
    sparse->idle_flush();
    return id;
  }
  // Both ranks agree on the retained prefixes, and the cache rank holds nothing else (no request runs).
  void expect_consistent(const std::string& where) const {
    SCOPED_TRACE(where);
    EXPECT_EQ(sparse->pending_releases(), 0u);
    for (RecordingLink* l : shards.size() > 1 ? shards : std::vector<RecordingLink*>{link}) {
      const cache::Selector& sel = l->selector();
      EXPECT_EQ(sel.num_retained(), sparse->num_retained());
      EXPECT_EQ(sel.num_sequences(), sel.num_retained()) << "only retained prefixes stay on the cache rank";
      EXPECT_EQ(sel.retained_tokens(), sparse->retained_tokens());
      // In these tests no two retained prefixes share a page (one covering another is dropped), and they hold whole
      // 16-token pages: the cache rank holds exactly their pages.
      EXPECT_EQ(sel.num_used_pages(), sparse->retained_tokens() / 16);
    }
    EXPECT_EQ(engine->pages().num_free_pages(), engine->pages().num_pages()) << "inference rank: no page held";
    for (int32_t p = 0; p < engine->pages().num_pages(); ++p)
      ASSERT_EQ(engine->pages().refcount(p), 0) << "inference rank page " << p;
  }
};

struct RetainedPrefix : ::testing::Test {
  std::unique_ptr<Model> model;
  void SetUp() override { model = Model::load(test::data_path("models/stories260K")); }
  int vocab() const { return model->config().vocab_size; }
};

// A finished request's prompt prefix stays on the cache rank; the same prompt again, and a longer one extending it,
// ship only the tokens past it. Tokens and every selection (positions, K, V) are those of retention off and of the
// unshared pair.
TEST_F(RetainedPrefix, ARepeatedAndAnExtendedPromptShipOnlyWhatFollowsTheRetainedPrefix) {
  const auto p = prompt(220, 4, vocab());
  auto q = p;
  const auto tail = prompt(61, 9, vocab());
  q.insert(q.end(), tail.begin() + 1, tail.end());  // 280 tokens, p first
  Pair on(*model, Mode::Retain), off(*model, Mode::NoRetain), unshared(*model, Mode::Unshared);
  Pair cold(*model, Mode::Unshared, 0, false);
  std::vector<int32_t> ref_p, ref_q;
  cold.run(greedy(p, 40), &ref_p);
  cold.run(greedy(q, 40), &ref_q);
  struct Ids {
    uint64_t a, b, c;
  };
  std::map<Mode, Ids> ids;
  for (auto [mode, pr] : {std::pair{Mode::Retain, &on}, {Mode::NoRetain, &off}, {Mode::Unshared, &unshared}}) {
    std::vector<int32_t> ta, tb, tc;
    Ids i;
    i.a = pr->run(greedy(p, 40), &ta);
    if (mode == Mode::Retain) {
      // A's 13 published full pages (208 of its 220 prompt tokens) stay on the cache rank, nothing else.
      EXPECT_EQ(pr->sparse->num_retained(), 1u);
      EXPECT_EQ(pr->sparse->retained_tokens(), 208);
      EXPECT_TRUE(pr->link->selector().is_retained(i.a));
      EXPECT_EQ(pr->link->selector().seq_len(i.a), 208);
      pr->expect_consistent("after A");
    }
    i.b = pr->run(greedy(p, 40), &tb);
    i.c = pr->run(greedy(q, 40), &tc);
    EXPECT_EQ(ta, ref_p);
    EXPECT_EQ(tb, ref_p);
    EXPECT_EQ(tc, ref_q);
    ids[mode] = i;
    pr->expect_consistent("after C");
  }
  EXPECT_TRUE(on.link->recs == off.link->recs) << "every selection bit-identical to retention off";
  EXPECT_TRUE(on.link->recs == unshared.link->recs) << "and to the unshared pair";
  const Ids& i = ids[Mode::Retain];
  // B: its prompt hit the prefix cache up to the tokens it recomputes (the predictor's window and the prompt anchors:
  // 9 pages, 144 tokens); its INIT shares those of A's retained 208 tokens instead of shipping them.
  const int reused = (220 - on.so.prefix_recompute_tokens()) / 16 * 16;
  ASSERT_EQ(reused, 144);
  const InitRec* b_on = on.link->init_of(i.b);
  const InitRec* b_off = off.link->init_of(i.b);
  ASSERT_TRUE(b_on && b_off);
  EXPECT_EQ(b_on->shared_from, i.a);
  EXPECT_EQ(b_on->shared_tokens, reused);
  EXPECT_EQ(b_off->shared_tokens, 0) << "retention off: A's release freed everything, B ships its whole context";
  EXPECT_EQ(b_on->kv_tokens + reused, b_off->kv_tokens);
  const ModelConfig& cfg = model->config();
  const int packs = (cfg.num_layers + on.so.layers_per_pack - 1) / on.so.layers_per_pack;
  const size_t kv_bytes = static_cast<size_t>(reused) * cfg.kv_dim() * sizeof(float) * 2 * cfg.num_layers;
  EXPECT_EQ(off.link->init_bytes[i.b] - on.link->init_bytes[i.b], kv_bytes - 16 * static_cast<size_t>(packs))
      << "exactly the retained tokens' K/V not shipped (less each pack entry's 16-byte share)";
  // C extends p (280 tokens, 216 reusable): it shares all 208 of A's (B, covered by A's prefix, was not retained).
  const InitRec* c_on = on.link->init_of(i.c);
  ASSERT_TRUE(c_on);
  EXPECT_EQ(c_on->shared_from, i.a);
  EXPECT_EQ(c_on->shared_tokens, 208);
  EXPECT_EQ(on.link->init_rows(i.c) + 208, off.link->init_rows(i.c));
  const SparseStats& st = on.sparse->stats();
  EXPECT_EQ(st.retained_reused_tokens, static_cast<uint64_t>(reused + 208));
  EXPECT_EQ(off.sparse->stats().retained_reused_tokens, 0u);
  EXPECT_EQ(off.link->selector().num_used_pages(), 0) << "retention off: nothing stays";
  // C's 17 published pages cover A's 13: A is dropped, C retained (272 tokens).
  EXPECT_EQ(on.sparse->num_retained(), 1u);
  EXPECT_EQ(on.sparse->retained_tokens(), 272);
  EXPECT_TRUE(on.link->selector().is_retained(i.c));
  EXPECT_FALSE(on.link->selector().tracks(i.a));
  std::cerr << "[ RETAINED ] stories260K, 220-token prompt repeated: the switch step's updates take " << on.link->init_bytes[i.b]
            << " bytes with the retained prefix, " << off.link->init_bytes[i.b] << " without\n";
}

// The inference rank's prefix cache evicts the retained prefix's pages (tail first): the cache rank's copy is
// shortened, then dropped; a later request ships what is no longer retained and still decodes as a cold pair; when
// every cached page is gone, nothing is held on the cache rank.
TEST_F(RetainedPrefix, EvictionShortensThenDropsTheRetainedPrefixAndNothingLeaks) {
  const auto p = prompt(220, 4, vocab());
  Pair cold(*model, Mode::Unshared, 0, false);
  std::vector<int32_t> ref_p;
  cold.run(greedy(p, 40), &ref_p);
  // 32 pages of 16 tokens: A (220 + 40 tokens) leaves 13 cached pages; D (380 + 40) needs 27: its prefill evicts the
  // least recently used cached pages, A's chain tail first.
  Pair on(*model, Mode::Retain, 32);
  std::vector<int32_t> ta, tb;
  const uint64_t a = on.run(greedy(p, 40), &ta);
  EXPECT_EQ(ta, ref_p);
  ASSERT_EQ(on.sparse->retained_tokens(), 208);
  on.engine->submit(greedy(prompt(380, 7, vocab()), 40), nullptr);
  while (!on.engine->idle()) on.engine->step();
  // Before any idle flush: D's own updates already carried the shortened prefix to the cache rank.
  EXPECT_LT(on.link->selector().seq_len(a), 208);
  EXPECT_EQ(on.link->selector().num_retained(), 1u) << "D's retain is sent with its release, at the idle flush";
  on.sparse->idle_flush();
  on.expect_consistent("after D");
  const uint64_t evicted = on.engine->pages().prefix_stats().evicted_pages;
  EXPECT_GT(evicted, 0u);
  // A's retained prefix lost its evicted tail pages (D is retained beside it, or covers nothing of it).
  ASSERT_TRUE(on.link->selector().tracks(a)) << "A's first pages are still cached";
  const int a_left = on.link->selector().seq_len(a);
  EXPECT_LT(a_left, 144) << "shortened below what B reuses";
  std::cerr << "[ RETAINED ] after D: " << evicted << " pages evicted, A's retained prefix " << a_left << " tokens\n";
  // B (p again): reuses and shares what is left of A's prefix, ships the rest, decodes as the cold pair.
  const uint64_t b = on.run(greedy(p, 40), &tb);
  EXPECT_EQ(tb, ref_p);
  const InitRec* bi = on.link->init_of(b);
  ASSERT_NE(bi, nullptr);
  EXPECT_EQ(bi->shared_from, a);
  EXPECT_EQ(bi->shared_tokens, a_left);
  on.expect_consistent("after B");
  // A dense request filling every page evicts every cached page: every retained prefix is dropped on the cache rank.
  on.run(greedy(prompt(460, 5, vocab()), 52), nullptr, /*force_dense=*/true);
  EXPECT_EQ(on.sparse->num_retained(), 0u);
  EXPECT_GE(on.sparse->stats().retained_dropped, 2u);
  EXPECT_EQ(on.link->selector().num_used_pages(), 0) << "no page left on the cache rank";
  EXPECT_EQ(on.link->selector().num_sequences(), 0u);
  on.expect_consistent("after the dense request");
}

// The bound: with room for one 208-token prefix only, the least recently used one is dropped for the next.
TEST_F(RetainedPrefix, TheTokenBoundDropsTheLeastRecentlyUsed) {
  Pair on(*model, Mode::Retain, 0, true, 300);
  const uint64_t a = on.run(greedy(prompt(220, 4, vocab()), 30), nullptr);
  EXPECT_TRUE(on.link->selector().is_retained(a));
  const uint64_t b = on.run(greedy(prompt(220, 5, vocab()), 30), nullptr);
  EXPECT_FALSE(on.link->selector().tracks(a));
  EXPECT_TRUE(on.link->selector().is_retained(b));
  EXPECT_EQ(on.sparse->retained_tokens(), 208);
  EXPECT_EQ(on.sparse->stats().retained_dropped, 1u);
  on.expect_consistent("bound");
  // A prefix longer than the bound is retained up to it (whole pages).
  Pair small(*model, Mode::Retain, 0, true, 100);
  const uint64_t c = small.run(greedy(prompt(220, 4, vocab()), 30), nullptr);
  EXPECT_EQ(small.link->selector().seq_len(c), 96);
  small.expect_consistent("short bound");
}

// Cancels at the switch (its INIT may not have reached every pack: not retained) and mid-decode (retained), then the
// cache rank is lost (its link fails) and replaced: the inference rank forgets every retained prefix, the next request
// ships its whole context to the replacement and decodes as a cold pair; no page leaks on either rank.
TEST_F(RetainedPrefix, CancelsAndACacheRankLossOrReplacementLeakNothing) {
  const auto p = prompt(220, 4, vocab());
  Pair cold(*model, Mode::Unshared, 0, false);
  std::vector<int32_t> ref_p;
  cold.run(greedy(p, 40), &ref_p);
  // Steps: 1 = the prefill, 2 = the switch (INIT), then sparse.
  for (int when : {1, 2, 8}) {
    Pair on(*model, Mode::Retain);
    const uint64_t id = on.engine->submit(greedy(p, 40), nullptr);
    for (int s = 0; s < when; ++s) on.engine->step();
    on.engine->abort(id);
    while (!on.engine->idle()) on.engine->step();
    on.sparse->idle_flush();
    EXPECT_EQ(on.sparse->num_retained(), when == 8 ? 1u : 0u) << when;
    on.expect_consistent("abort after " + std::to_string(when));
    // A second request with the prompt: shares the retained prefix (mid-decode cancel) or ships everything.
    std::vector<int32_t> tb;
    const uint64_t b = on.run(greedy(p, 40), &tb);
    EXPECT_EQ(tb, ref_p) << when;
    EXPECT_EQ(on.link->init_of(b)->shared_tokens, when == 8 ? 144 : 0) << when;
    on.expect_consistent("second request after " + std::to_string(when));
  }
  // Loss: the link fails while a request decodes; the inference rank forgets the retained prefixes.
  {
    Pair on(*model, Mode::Retain);
    on.run(greedy(p, 40), nullptr);
    ASSERT_EQ(on.sparse->num_retained(), 1u);
    const uint64_t id = on.engine->submit(greedy(p, 40), nullptr);
    for (int s = 0; s < 6; ++s) on.engine->step();
    on.link->fail_sends = true;
    while (!on.engine->idle()) on.engine->step();
    on.sparse->idle_flush();
    EXPECT_TRUE(on.sparse->link_failed());
    EXPECT_EQ(on.sparse->num_retained(), 0u) << "a lost cache rank's retained prefixes are forgotten";
    EXPECT_EQ(on.sparse->pending_releases(), 0u);
    (void)id;
    // Replacement: a fresh cache rank; the next request ships its whole context and decodes as the cold pair.
    auto fresh = std::make_unique<RecordingLink>(model->config(), on.so.selection, 2048, 16);
    RecordingLink* f = fresh.get();
    on.sparse->replace_link(std::move(fresh));
    on.link = f;
    std::vector<int32_t> tc;
    const uint64_t c = on.run(greedy(p, 40), &tc);
    EXPECT_EQ(tc, ref_p);
    EXPECT_EQ(f->init_of(c)->shared_tokens, 0);
    EXPECT_EQ(on.sparse->num_retained(), 1u) << "retained again on the replacement";
    on.expect_consistent("after the replacement");
  }
  // Replacement of a healthy link (a rejoin): the retained prefixes are forgotten with the old cache rank.
  {
    Pair on(*model, Mode::Retain);
    on.run(greedy(p, 40), nullptr);
    ASSERT_EQ(on.sparse->num_retained(), 1u);
    on.sparse->replace_link(std::make_unique<RecordingLink>(model->config(), on.so.selection, 2048, 16));
    EXPECT_EQ(on.sparse->num_retained(), 0u);
    EXPECT_EQ(on.sparse->retained_tokens(), 0);
  }
}

// Two cache ranks (layer shards): each keeps its layers of the retained prefix, so a repeated and an extended prompt
// share it on both, with the tokens, shares and every selection of one cache rank; an eviction shortens it on both;
// a replaced shard holds nothing and the other drops what it retained (the inference rank forgets its own).
TEST_F(RetainedPrefix, LayerShardsEachKeepTheirLayersOfTheRetainedPrefix) {
  const auto p = prompt(220, 4, vocab());
  auto q = p;
  const auto tail = prompt(61, 9, vocab());
  q.insert(q.end(), tail.begin() + 1, tail.end());
  Pair one(*model, Mode::Retain), two(*model, Mode::Retain, 0, true, 65536, 2);
  std::vector<std::vector<int32_t>> t1(3), t2(3);
  std::vector<uint64_t> i1, i2;
  for (int r = 0; r < 3; ++r) {
    i1.push_back(one.run(greedy(r < 2 ? p : q, 40), &t1[static_cast<size_t>(r)]));
    i2.push_back(two.run(greedy(r < 2 ? p : q, 40), &t2[static_cast<size_t>(r)]));
    two.expect_consistent("request " + std::to_string(r));
  }
  EXPECT_EQ(t1, t2);
  ASSERT_EQ(i1, i2);
  // Every selection of the two shards together is one cache rank's (layer keys carry the pack).
  auto by_key = [](const Rec& a, const Rec& b) {
    return std::tie(a.seq, a.layer, a.context_len) < std::tie(b.seq, b.layer, b.context_len);
  };
  std::vector<Rec> single = one.link->recs, sharded = two.shards[0]->recs;
  sharded.insert(sharded.end(), two.shards[1]->recs.begin(), two.shards[1]->recs.end());
  std::sort(single.begin(), single.end(), by_key);
  std::sort(sharded.begin(), sharded.end(), by_key);
  EXPECT_TRUE(single == sharded) << single.size() << " selections against " << sharded.size();
  for (RecordingLink* shard : two.shards) {  // B shares 144 tokens of A, C 208, on each shard
    ASSERT_NE(shard->init_of(i2[1]), nullptr);
    EXPECT_EQ(shard->init_of(i2[1])->shared_from, i2[0]);
    EXPECT_EQ(shard->init_of(i2[1])->shared_tokens, 144);
    EXPECT_EQ(shard->init_of(i2[2])->shared_tokens, 208);
    EXPECT_TRUE(shard->selector().is_retained(i2[2]));
  }
  EXPECT_EQ(two.sparse->stats().retained_reused_tokens, one.sparse->stats().retained_reused_tokens);
  // Shard 1 is replaced (a rejoin): shard 0 drops C's retained prefix with its next update; the next request ships
  // its whole context to both, and both then retain it.
  ASSERT_EQ(two.sparse->num_retained(), 1u);
  auto* sharded_link = dynamic_cast<pair::ShardedLink*>(two.sparse->link());
  ASSERT_NE(sharded_link, nullptr);
  EXPECT_EQ(sharded_link->retained_prefixes(), 1u);
  auto fresh = std::make_unique<RecordingLink>(model->config(), two.so.selection, 2048, 16);
  RecordingLink* repl = fresh.get();
  two.sparse->replace_link(sharded_link->replaced(1, std::move(fresh), transport::Clock::now() + 1s));
  two.shards[1] = repl;
  EXPECT_EQ(two.sparse->num_retained(), 0u);
  std::vector<int32_t> td;
  const uint64_t d = two.run(greedy(p, 40), &td);
  EXPECT_EQ(td, t1[0]);
  EXPECT_EQ(two.shards[0]->init_of(d)->shared_tokens, 0) << "the retained prefix was forgotten with the old shard";
  EXPECT_EQ(repl->init_of(d)->shared_tokens, 0);
  EXPECT_FALSE(two.shards[0]->selector().tracks(i2[2])) << "shard 0 dropped C's retained prefix";
  two.expect_consistent("after the replacement");
}

// Prefix caching off (--no-enable-prefix-caching): nothing is retained.
TEST_F(RetainedPrefix, PrefixCachingOffRetainsNothing) {
  Pair on(*model, Mode::Retain, 0, false);
  on.run(greedy(prompt(220, 4, vocab()), 30), nullptr);
  EXPECT_EQ(on.sparse->num_retained(), 0u);
  EXPECT_EQ(on.link->selector().num_used_pages(), 0);
  on.expect_consistent("caching off");
}

// ---- the wire and the cache rank's checks ----

using test::small_cfg;

TEST(RetainedPrefixWire, RoundTripAndMalformedEntriesAreRefusedNamingThePeer) {
  const ModelConfig c = small_cfg();
  const pair::PackShape s = pair::pack_shape(c, {});
  pair::PackUpdate u;
  u.step = 3;
  u.released = {5};
  u.retained = {{5, 32}, {3, 16}};
  u.dropped = {7, 9};
  const auto good = pair::encode(u, s);
  const pair::PackUpdate d = pair::decode_update(good.data(), good.size(), s, "inference rank 2");
  EXPECT_EQ(d.released, u.released);
  EXPECT_EQ(d.retained, u.retained);
  EXPECT_EQ(d.dropped, u.dropped);
  auto refused = [&](std::vector<uint8_t> b) -> std::string {
    try {
      pair::decode_update(b.data(), b.size(), s, "inference rank 2");
    } catch (const Error& e) {
      return e.what();
    }
    return "accepted";
  };
  // Header 40 bytes (magic, step, pack, first_layer, num_layers, 4 counts), released 8, then retained entries of 16.
  const size_t ret0 = 48;
  auto with = [&](size_t off, auto value) {
    auto b = good;
    std::memcpy(b.data() + off, &value, sizeof(value));
    return b;
  };
  EXPECT_THAT(refused(with(ret0 + 8, int32_t{0})),
              HasSubstr("inference rank 2: malformed pack update: retained prefix of sequence 5 has retained tokens = 0"));
  EXPECT_THAT(refused(with(ret0 + 16 + 8, int32_t{-4})), HasSubstr("retained prefix of sequence 3 has retained tokens = -4"));
  EXPECT_THAT(refused(with(ret0 + 12, int32_t{1})), HasSubstr("inference rank 2: malformed pack update: retained prefix"));
  EXPECT_THAT(refused(with(28, uint32_t{1000})), HasSubstr("inference rank 2: malformed pack message: retained count"));
  EXPECT_THAT(refused(with(32, uint32_t{1000})), HasSubstr("inference rank 2: malformed pack message: dropped count"));
  EXPECT_THAT(refused(std::vector<uint8_t>(good.begin(), good.end() - 4)), HasSubstr("inference rank 2: malformed pack"));
  EXPECT_EQ(refused(good), "accepted");
  u.retained[1].tokens = 0;
  EXPECT_THROW(pair::encode(u, s), Error);
}

// The cache rank refuses a retain or drop of a sequence it does not hold or of the wrong kind, and retained tokens
// beyond what it holds, naming the sequence; over a transport the inference rank's error names the cache rank.
TEST(RetainedPrefixWire, TheCacheRankRefusesUnknownAndOutOfRangeEntries) {
  const ModelConfig c = small_cfg();
  pair::SelectionConfig sc;
  sc.token_budget = 4;
  sc.local_window = 2;
  sc.sink_tokens = 0;
  sc.query_window = 2;
  sc.anchor_queries = 0;
  cache::Selector sel(c, sc, 64, 16);
  auto init = [&](uint64_t id, int len, int shared = 0, uint64_t from = 0) {
    pair::PackUpdate u;
    u.num_layers = c.num_layers;
    pair::SeqUpdate e;
    e.seq_id = id;
    e.context_len = len;
    e.init = true;
    e.num_queries = 1;
    e.shared_tokens = shared;
    e.shared_from = from;
    e.q.assign(static_cast<size_t>(c.num_layers) * c.q_dim(), 0.5f);
    e.k.assign(static_cast<size_t>(c.num_layers) * (len - shared) * c.kv_dim(), 0.25f);
    e.v = e.k;
    u.seqs.push_back(e);
    return u;
  };
  auto control = [](std::vector<uint64_t> released, std::vector<pair::Retain> retained, std::vector<uint64_t> dropped) {
    pair::PackUpdate u;
    u.released = std::move(released);
    u.retained = std::move(retained);
    u.dropped = std::move(dropped);
    return u;
  };
  ASSERT_EQ(cache::process_pack(sel, init(1, 40)).error, "");
  EXPECT_THAT(cache::process_pack(sel, control({9}, {{9, 16}}, {})).error,
              HasSubstr("cache rank: retained prefix of released sequence 9: this cache rank does not hold that sequence"));
  EXPECT_THAT(cache::process_pack(sel, control({}, {{9, 16}}, {})).error,
              HasSubstr("retained prefix of sequence 9: this cache rank does not hold that sequence"));
  EXPECT_THAT(cache::process_pack(sel, control({}, {{1, 16}}, {})).error,
              HasSubstr("retained prefix of sequence 1: it is a live sequence not released in this update"));
  EXPECT_THAT(cache::process_pack(sel, control({}, {}, {9})).error,
              HasSubstr("cache rank: dropped retained prefix 9: this cache rank does not hold that sequence"));
  EXPECT_THAT(cache::process_pack(sel, control({}, {}, {1})).error,
              HasSubstr("dropped retained prefix 1: it is a live sequence, not a retained prefix"));
  EXPECT_TRUE(sel.tracks(1) && !sel.is_retained(1)) << "a refused update changed nothing of sequence 1";
  EXPECT_THAT(cache::process_pack(sel, control({1}, {{1, 41}}, {})).error,
              HasSubstr("cache rank: retained prefix of sequence 1: retained tokens = 41 outside 1..40"));
  // A valid retain: 40 tokens -> 20 (2 pages of 16, the last partly covered).
  ASSERT_TRUE(sel.tracks(1) && !sel.is_retained(1)) << "the refused retain changed nothing";
  ASSERT_EQ(cache::process_pack(sel, init(2, 40)).error, "");
  ASSERT_EQ(cache::process_pack(sel, control({2}, {{2, 20}}, {})).error, "");
  EXPECT_TRUE(sel.is_retained(2));
  EXPECT_EQ(sel.seq_len(2), 20);
  EXPECT_THAT(cache::process_pack(sel, control({}, {{2, 21}}, {})).error,
              HasSubstr("retained prefix of sequence 2: retained tokens = 21 beyond the 20 it holds"));
  EXPECT_THAT(cache::process_pack(sel, control({2}, {{2, 10}}, {})).error,
              HasSubstr("retained prefix of released sequence 2: it is a retained prefix already"));
  // An INIT shares from it; an APPEND to it or its own INIT is refused.
  ASSERT_EQ(cache::process_pack(sel, init(3, 30, 16, 2)).error, "");
  pair::PackUpdate ap;
  ap.num_layers = c.num_layers;
  pair::SeqUpdate a;
  a.seq_id = 2;
  a.context_len = 21;
  a.num_queries = 1;
  a.q.assign(static_cast<size_t>(c.num_layers) * c.q_dim(), 0.5f);
  a.k.assign(static_cast<size_t>(c.num_layers) * c.kv_dim(), 0.25f);
  a.v = a.k;
  ap.seqs.push_back(a);
  EXPECT_THAT(cache::process_pack(sel, ap).error, HasSubstr("APPEND to sequence 2, which is a retained prefix"));
  EXPECT_THAT(cache::process_pack(sel, init(2, 30)).error, HasSubstr("INIT of sequence 2, which is a retained prefix"));
  // Shortened, then dropped: only sequence 3 (and the page it shares) stays.
  ASSERT_EQ(cache::process_pack(sel, control({}, {{2, 16}}, {})).error, "");
  EXPECT_EQ(sel.seq_len(2), 16);
  ASSERT_EQ(cache::process_pack(sel, control({1, 3}, {}, {2})).error, "");
  EXPECT_EQ(sel.num_used_pages(), 0);
  EXPECT_EQ(sel.num_sequences(), 0u);

  // A pool too small for the inference rank's pool plus its bound: the INIT that finds no page is refused, naming the
  // retained prefixes and the two flags to size (the link then fails, as for any cache-rank error).
  cache::Selector tight(c, sc, 4, 16);
  ASSERT_EQ(cache::process_pack(tight, init(1, 40)).error, "");
  ASSERT_EQ(cache::process_pack(tight, control({1}, {{1, 32}}, {})).error, "");
  EXPECT_EQ(tight.num_used_pages(), 2) << "retained pages count as used";
  EXPECT_THAT(cache::process_pack(tight, init(2, 40)).error,
              HasSubstr("cache rank KV pool exhausted: sequence 2 needs 3 pages, 2 of 4 free; 1 retained prefixes hold "
                        "32 tokens (size the cache rank's --kv-pages for the inference rank's pool plus its "
                        "--max-retained-prefix-tokens)"));

  // Over a transport: the error comes back naming the cache rank.
  test::LoopbackCacheRank cr;
  SparseOptions so;
  so.selection = sc;
  auto link = cr.start(c, so, false, 64);
  link->send(control({}, {}, {42}));
  bool waited = false;
  try {
    (void)link->receive(transport::Clock::now() + 5s, &waited);
    ADD_FAILURE() << "a drop of an unknown retained prefix was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cache rank 1: cache rank: dropped retained prefix 42"));
  }
  cr.join();
}

// ---- the inference rank's flag ----

std::string exe() { return test::binary_dir() + "/inference_rank/inference_rank"; }

TEST(RetainedPrefixFlag, RefusedByNameWhereItDoesNotApply) {
  const std::string model = test::data_path("models/stories260K");
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--model", model, "--prompt", "hi", "--max-tokens", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    return test::run_to_exit(exe(), args, "inference rank", 60s);
  };
  // With a GPU cache rank prefix caching is opt-in: without --enable-prefix-caching the bound has nothing to keep.
  auto gpu = run({"--device", "cuda", "--selection", "predicted", "--max-retained-prefix-tokens", "64"});
  EXPECT_NE(gpu.rc, 0);
  EXPECT_THAT(gpu.log, HasSubstr("--max-retained-prefix-tokens: needs --selection predicted with prefix caching on "
                                 "(got --selection predicted, prefix caching off)"))
      << gpu.log;
  for (const auto& extra : {std::vector<std::string>{"--selection", "dense"},
                            std::vector<std::string>{"--selection", "predicted", "--no-enable-prefix-caching"}}) {
    auto args = extra;
    args.insert(args.end(), {"--max-retained-prefix-tokens", "64"});
    auto r = run(args);
    EXPECT_NE(r.rc, 0);
    EXPECT_THAT(r.log, HasSubstr("--max-retained-prefix-tokens: needs --selection predicted with prefix caching on"))
        << r.log;
  }
  auto neg = run({"--selection", "predicted", "--max-retained-prefix-tokens", "-1"});
  EXPECT_NE(neg.rc, 0);
  EXPECT_THAT(neg.log, HasSubstr("--max-retained-prefix-tokens")) << neg.log;
  // Accepted where it applies: a standalone CPU run with predicted selection generates.
  auto ok = run({"--selection", "predicted", "--max-retained-prefix-tokens", "64"});
  EXPECT_EQ(ok.rc, 0) << ok.log;
}

}  // namespace
}  // namespace spade

// The cache rank's shared INIT (cache::Selector::init_layer with a SharedPrefix, pair::SeqUpdate::shared_from): a
// sequence that shares another's first tokens holds its pages (stored once), selects exactly what it selects with its
// own copy of the same KV (a partly shared page is copied on write, per layer), and every page returns to the pool
// whatever the release order; bad references are errors naming the sequence and its source.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "cache_rank/pack_server.h"
#include "cache_rank/selector.h"
#include "common/error.h"
#include "tests/small_config.h"

namespace spade::cache {
namespace {

using ::testing::HasSubstr;
using namespace ::spade::pair;

ModelConfig small_cfg() { return test::small_cfg(3); }

SelectionConfig small_sc() {
  SelectionConfig sc;
  sc.token_budget = 6;
  sc.sink_tokens = 1;
  sc.local_window = 4;
  sc.query_window = 3;
  return sc;
}

std::vector<float> randn(size_t n, std::mt19937& g) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// One sequence's data for every layer: k, v [len, kv_dim] and its last `nq` queries [nq, q_dim].
struct SeqData {
  std::vector<std::vector<float>> k, v, q;
};
SeqData make_seq(const ModelConfig& c, int len, int nq, std::mt19937& g) {
  SeqData d;
  for (int l = 0; l < c.num_layers; ++l) {
    d.k.push_back(randn(static_cast<size_t>(len) * c.kv_dim(), g));
    d.v.push_back(randn(d.k.back().size(), g));
    d.q.push_back(randn(static_cast<size_t>(nq) * c.q_dim(), g));
  }
  return d;
}

// `child` = the first `shared` tokens of `parent` then its own tokens.
SeqData with_prefix(const ModelConfig& c, const SeqData& parent, const SeqData& own, int shared) {
  SeqData d = own;
  for (int l = 0; l < c.num_layers; ++l) {
    std::copy(parent.k[l].begin(), parent.k[l].begin() + static_cast<long>(shared) * c.kv_dim(), d.k[l].begin());
    std::copy(parent.v[l].begin(), parent.v[l].begin() + static_cast<long>(shared) * c.kv_dim(), d.v[l].begin());
  }
  return d;
}

void init_all(Selector& sel, const ModelConfig& c, uint64_t id, const SeqData& d, int len, int nq, int shared = 0,
              uint64_t from = 0) {
  for (int l = 0; l < c.num_layers; ++l)
    sel.init_layer(id, l, len, d.k[l].data() + static_cast<size_t>(shared) * c.kv_dim(),
                   d.v[l].data() + static_cast<size_t>(shared) * c.kv_dim(), nq, d.q[l].data(), {from, shared});
}

void expect_same_selection(Selector& a, uint64_t ida, Selector& b, uint64_t idb, const ModelConfig& c, int ctx) {
  for (int l = 0; l < c.num_layers; ++l) {
    LayerSelection x, y;
    a.select(ida, l, ctx, nullptr, x);
    b.select(idb, l, ctx, nullptr, y);
    EXPECT_EQ(x.count, y.count) << "layer " << l;
    EXPECT_EQ(x.positions, y.positions) << "layer " << l;
    EXPECT_EQ(x.k, y.k) << "layer " << l;
    EXPECT_EQ(x.v, y.v) << "layer " << l;
  }
}

void expect_all_free(const Selector& sel) {
  EXPECT_EQ(sel.num_used_pages(), 0);
  EXPECT_EQ(sel.num_sequences(), 0u);
  for (int32_t p = 0; p < sel.num_pages(); ++p) ASSERT_EQ(sel.pages().refcount(p), 0) << "page " << p;
}

// Page size 4 and 10 shared tokens: the third page is partly shared (copied on write at the child's INIT, layer by
// layer); page size 5: whole pages only.
class SharedInit : public ::testing::TestWithParam<int> {};

TEST_P(SharedInit, ChildrenStoreTheSharedPrefixOnceAndSelectAsWithTheirOwnCopy) {
  const int page = GetParam();
  const ModelConfig c = small_cfg();
  const SelectionConfig sc = small_sc();
  std::mt19937 g(11);
  const int L = 23, shared = 10, nq = 4;
  const SeqData parent = make_seq(c, L, nq, g);
  std::vector<SeqData> kids;
  for (int i = 0; i < 3; ++i) kids.push_back(with_prefix(c, parent, make_seq(c, L + i, nq, g), shared));

  Selector sharing(c, sc, 64, page), copies(c, sc, 64, page);
  init_all(sharing, c, 1, parent, L, nq);
  init_all(copies, c, 1, parent, L, nq);
  for (int i = 0; i < 3; ++i) {
    // Kid 2 shares from kid 1 (a sharer may be a source too).
    init_all(sharing, c, 10 + i, kids[i], L + i, nq, shared, i == 2 ? 11 : 1);
    init_all(copies, c, 10 + i, kids[i], L + i, nq);
  }
  const int whole = shared / page;  // pages wholly inside the shared prefix, stored once
  EXPECT_EQ(sharing.num_used_pages(), copies.num_used_pages() - 3 * whole);
  for (int i = 0; i < 3; ++i) expect_same_selection(sharing, 10 + i, copies, 10 + i, c, L + i + 1);
  expect_same_selection(sharing, 1, copies, 1, c, L + 1);

  // Decode a few steps on both, then compare again.
  for (int step = 0; step < 6; ++step)
    for (uint64_t id : {uint64_t{1}, uint64_t{10}, uint64_t{11}, uint64_t{12}}) {
      const int len = sharing.seq_len(id);
      for (int l = 0; l < c.num_layers; ++l) {
        const auto q = randn(c.q_dim(), g), k = randn(c.kv_dim(), g), v = randn(c.kv_dim(), g);
        sharing.append_layer(id, l, len, q.data(), k.data(), v.data());
        copies.append_layer(id, l, len, q.data(), k.data(), v.data());
      }
      expect_same_selection(sharing, id, copies, id, c, len + 2);
    }
  // The source leaves first: its sharers keep the pages.
  sharing.release(1);
  copies.release(1);
  for (int i = 0; i < 3; ++i) expect_same_selection(sharing, 10 + i, copies, 10 + i, c, sharing.seq_len(10 + i) + 1);
  for (uint64_t id : {uint64_t{11}, uint64_t{10}, uint64_t{12}}) sharing.release(id);
  expect_all_free(sharing);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, SharedInit, ::testing::Values(4, 5));

TEST(SharedInit, BadReferencesNameTheSequenceAndItsSource) {
  const ModelConfig c = small_cfg();
  std::mt19937 g(5);
  const SeqData d = make_seq(c, 20, 2, g);
  Selector sel(c, small_sc(), 32, 4);
  auto err = [&](auto f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(err([&] { sel.init_layer(7, 0, 20, d.k[0].data(), d.v[0].data(), 2, d.q[0].data(), {3, 8}); }),
              HasSubstr("sequence 7 shares its first 8 tokens with sequence 3, which this cache rank does not hold"));
  EXPECT_FALSE(sel.tracks(7));
  sel.init_layer(3, 0, 6, d.k[0].data(), d.v[0].data(), 2, d.q[0].data());  // layer 0 only so far
  EXPECT_THAT(err([&] { sel.init_layer(7, 0, 20, d.k[0].data(), d.v[0].data(), 2, d.q[0].data(), {3, 8}); }),
              HasSubstr("sequence 7 shares its first 8 tokens with sequence 3, which holds only 6"));
  EXPECT_THAT(err([&] { sel.init_layer(7, 1, 20, d.k[1].data(), d.v[1].data(), 2, d.q[1].data(), {3, 4}); }),
              HasSubstr("sequence 7 shares the KV of layer 1 of sequence 3 before that sequence initialised it"));
  EXPECT_FALSE(sel.tracks(7));
  sel.init_layer(7, 0, 20, d.k[0].data(), d.v[0].data(), 2, d.q[0].data(), {3, 4});
  EXPECT_THAT(err([&] { sel.init_layer(7, 1, 20, d.k[1].data(), d.v[1].data(), 2, d.q[1].data()); }),
              HasSubstr("sequence 7 layer 1 initialised sharing 0 tokens of sequence 0, other layers 4 of 3"));
  EXPECT_THAT(err([&] { sel.init_layer(8, 0, 5, d.k[0].data(), d.v[0].data(), 2, d.q[0].data(), {3, 5}); }),
              HasSubstr("sequence 8 initialised with 5 tokens shares 5 tokens of sequence 3"));
  EXPECT_THAT(err([&] { sel.init_layer(8, 0, 9, d.k[0].data(), d.v[0].data(), 2, d.q[0].data(), {8, 4}); }),
              HasSubstr("sequence 8 shares its first 4 tokens with sequence 8, which this cache rank does not hold"));
  sel.release(3);
  sel.release(7);
  expect_all_free(sel);
}

TEST(SharedInit, ProcessPackAnswersABadReferenceWithAnErrorAndNoLeak) {
  const ModelConfig c = small_cfg();
  const SelectionConfig sc = small_sc();
  std::mt19937 g(9);
  Selector sel(c, sc, 32, 4);
  PackUpdate u;
  u.step = 1;
  u.num_layers = c.num_layers;
  SeqUpdate e;
  e.seq_id = 21;
  e.context_len = 12;
  e.init = true;
  e.num_queries = 1;
  e.shared_tokens = 8;
  e.shared_from = 20;
  e.q = randn(static_cast<size_t>(c.num_layers) * c.q_dim(), g);
  e.k = randn(static_cast<size_t>(c.num_layers) * 4 * c.kv_dim(), g);
  e.v = randn(e.k.size(), g);
  u.seqs.push_back(e);
  const PackSelection p = process_pack(sel, u);
  EXPECT_THAT(p.error, HasSubstr("sequence 21 shares its first 8 tokens with sequence 20, which this cache rank does "
                                 "not hold"));
  EXPECT_TRUE(p.seqs.empty());
  expect_all_free(sel);

  // With the source first in the same update, the INIT goes through and stores the 8 tokens once.
  SeqUpdate src;
  src.seq_id = 20;
  src.context_len = 10;
  src.init = true;
  src.num_queries = 1;
  src.q = randn(static_cast<size_t>(c.num_layers) * c.q_dim(), g);
  src.k = randn(static_cast<size_t>(c.num_layers) * 10 * c.kv_dim(), g);
  src.v = randn(src.k.size(), g);
  u.seqs.insert(u.seqs.begin(), src);
  const PackSelection ok = process_pack(sel, u);
  ASSERT_EQ(ok.error, "");
  EXPECT_EQ(ok.seqs.size(), 2u);
  EXPECT_EQ(sel.num_used_pages(), 3 + 1) << "source 3 pages (10 tokens), the sharer 1 page of its own";
  PackUpdate rel;
  rel.step = 2;
  rel.released = {20, 21};
  EXPECT_EQ(process_pack(sel, rel).error, "");
  expect_all_free(sel);
}

}  // namespace
}  // namespace spade::cache

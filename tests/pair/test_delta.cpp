// Delta transfer of selections (pair/delta.h): the mirror's deltas applied to the inference rank's slot table
// reproduce every full selection exactly (as a set per KV head, with the right K/V rows), send only the entering
// tokens, survive the wire, and bad deltas are refused with the peer's name.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "pair/delta.h"
#include "pair/pack.h"
#include "common/error.h"

namespace spade::pair {
namespace {

constexpr int kHeads = 3, kBudget = 24, kDim = 8;

// K/V rows are a pure function of (head, position), so a row's content identifies its token.
float kval(int h, int pos, int d) { return static_cast<float>(h * 100000 + pos * 10 + d) * 0.001f; }
float vval(int h, int pos, int d) { return -kval(h, pos, d) - 1.f; }

// A full selection as Selector::select lays it out: per head `count` ascending positions, padded with -1 / zeros.
LayerSelection full_selection(const std::vector<std::vector<int32_t>>& per_head, int count) {
  LayerSelection s;
  s.count = count;
  s.positions.assign(static_cast<size_t>(kHeads) * kBudget, -1);
  s.k.assign(static_cast<size_t>(kHeads) * kBudget * kDim, 0.f);
  s.v.assign(s.k.size(), 0.f);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<int32_t> p = per_head[h];
    std::sort(p.begin(), p.end());
    for (int i = 0; i < count; ++i) {
      const size_t row = static_cast<size_t>(h) * kBudget + i;
      s.positions[row] = p[i];
      for (int d = 0; d < kDim; ++d) {
        s.k[row * kDim + d] = kval(h, p[i], d);
        s.v[row * kDim + d] = vval(h, p[i], d);
      }
    }
  }
  return s;
}

// The held table holds exactly the selection: same set per head in slots [0, count), rows matching their positions.
void expect_holds(const LayerSelection& held, const LayerSelection& full) {
  ASSERT_EQ(held.count, full.count);
  for (int h = 0; h < kHeads; ++h) {
    std::set<int32_t> a, b;
    for (int i = 0; i < full.count; ++i) {
      const size_t row = static_cast<size_t>(h) * kBudget + i;
      a.insert(held.positions[row]);
      b.insert(full.positions[row]);
      for (int d = 0; d < kDim; ++d) {
        ASSERT_EQ(held.k[row * kDim + d], kval(h, held.positions[row], d)) << "head " << h << " slot " << i;
        ASSERT_EQ(held.v[row * kDim + d], vval(h, held.positions[row], d)) << "head " << h << " slot " << i;
      }
    }
    ASSERT_EQ(a, b) << "head " << h;
    for (int i = full.count; i < kBudget; ++i) EXPECT_EQ(held.positions[static_cast<size_t>(h) * kBudget + i], -1);
  }
}

std::vector<std::vector<int32_t>> random_sets(std::mt19937& rng, int count, int context,
                                              const std::vector<std::vector<int32_t>>* prev, double keep) {
  std::vector<std::vector<int32_t>> out(kHeads);
  for (int h = 0; h < kHeads; ++h) {
    std::set<int32_t> s;
    if (prev != nullptr)
      for (int32_t p : (*prev)[h])
        if (static_cast<int>(s.size()) < count && std::uniform_real_distribution<double>(0, 1)(rng) < keep) s.insert(p);
    while (static_cast<int>(s.size()) < count) s.insert(std::uniform_int_distribution<int32_t>(0, context - 1)(rng));
    out[h].assign(s.begin(), s.end());
  }
  return out;
}

TEST(SelectionDelta, RandomStreamReproducesEveryFullSelectionAndSendsOnlyEnteringTokens) {
  std::mt19937 rng(7);
  SelectionMirror mirror(kHeads, kBudget, kDim);
  std::map<int, LayerSelection> held;  // layer -> the inference rank's table
  std::map<int, std::vector<std::vector<int32_t>>> prev;
  uint64_t expected_sent = 0, selected = 0;
  for (int step = 0; step < 200; ++step) {
    for (int layer = 0; layer < 3; ++layer) {
      // Count grows with the context up to the budget; every 37 steps it shrinks (a request's own budget).
      int count = std::min(kBudget, 4 + step / 3);
      if (step % 37 == 36) count = std::max(1, count - 5);
      const double keep = layer == 0 ? 0.9 : (layer == 1 ? 0.5 : 0.0);
      const auto sets = random_sets(rng, count, 40 + step, prev.count(layer) ? &prev[layer] : nullptr, keep);
      const LayerSelection full = full_selection(sets, count);
      // Entering tokens: not held in a slot < count before.
      std::vector<std::set<int32_t>> before(kHeads);
      if (held.count(layer))
        for (int h = 0; h < kHeads; ++h)
          for (int i = 0; i < count && i < held[layer].count; ++i)
            before[h].insert(held[layer].positions[static_cast<size_t>(h) * kBudget + i]);
      for (int h = 0; h < kHeads; ++h)
        for (int32_t p : sets[h]) expected_sent += before[h].count(p) ? 0 : 1;
      selected += static_cast<uint64_t>(count) * kHeads;
      const LayerDelta d = mirror.diff(1, layer, full);
      apply_delta(d, held[layer], kHeads, kBudget, kDim, "cache rank 1");
      expect_holds(held[layer], full);
      prev[layer] = sets;
    }
  }
  EXPECT_EQ(mirror.stats().sent_rows, expected_sent);
  EXPECT_EQ(mirror.stats().selected_rows, selected);
  EXPECT_LT(mirror.stats().sent_rows, mirror.stats().selected_rows * 6 / 10);  // layers 0 and 1 keep most tokens
}

TEST(SelectionDelta, SameSelectionSendsNothingAndANewOneSendsEverything) {
  SelectionMirror mirror(kHeads, kBudget, kDim);
  LayerSelection held;
  std::vector<std::vector<int32_t>> a(kHeads), b(kHeads);
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < kBudget; ++i) {
      a[h].push_back(3 * i + h);
      b[h].push_back(1000 + i);
    }
  const LayerSelection fa = full_selection(a, kBudget), fb = full_selection(b, kBudget);
  LayerDelta d = mirror.diff(9, 0, fa);
  EXPECT_EQ(d.entries(), static_cast<size_t>(kHeads * kBudget));  // first selection: all
  apply_delta(d, held, kHeads, kBudget, kDim, "cache rank 1");
  d = mirror.diff(9, 0, fa);
  EXPECT_EQ(d.entries(), 0u);
  apply_delta(d, held, kHeads, kBudget, kDim, "cache rank 1");
  expect_holds(held, fa);
  d = mirror.diff(9, 0, fb);
  EXPECT_EQ(d.entries(), static_cast<size_t>(kHeads * kBudget));
  apply_delta(d, held, kHeads, kBudget, kDim, "cache rank 1");
  expect_holds(held, fb);
  // Release / reset forget the sequence: its next delta carries everything again.
  mirror.release(9);
  EXPECT_EQ(mirror.num_sequences(), 0u);
  EXPECT_EQ(mirror.diff(9, 0, fb).entries(), static_cast<size_t>(kHeads * kBudget));
}

TEST(SelectionDelta, ToDeltaHonoursReleasesAndInitAndSurvivesTheWire) {
  const PackShape shape{kHeads * kDim * 2, kHeads * kDim, kHeads, kDim, kBudget};
  SelectionMirror mirror(kHeads, kBudget, kDim);
  std::vector<std::vector<int32_t>> a(kHeads);
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < 10; ++i) a[h].push_back(5 * i + h);
  const LayerSelection fa = full_selection(a, 10);
  PackUpdate u;
  u.first_layer = 2;
  u.num_layers = 2;
  SeqUpdate su;
  su.seq_id = 4;
  su.init = true;
  u.seqs.push_back(su);
  auto make = [&] {
    PackSelection p;
    p.step = 11;
    p.pack = 1;
    p.seqs.resize(1);
    p.seqs[0].seq_id = 4;
    p.seqs[0].context_len = 77;
    p.seqs[0].layers = {fa, fa};
    return p;
  };
  PackSelection p = make();
  mirror.to_delta(u, p);
  ASSERT_TRUE(p.delta);
  ASSERT_EQ(p.seqs[0].deltas.size(), 2u);
  EXPECT_TRUE(p.seqs[0].layers.empty());
  EXPECT_EQ(p.seqs[0].deltas[0].entries(), 30u);
  // Round trip through the wire format.
  const std::vector<uint8_t> wire = encode(p, shape);
  const PackSelection q = decode_selection(wire.data(), wire.size(), shape, "cache rank 1");
  ASSERT_TRUE(q.delta);
  ASSERT_EQ(q.seqs.size(), 1u);
  EXPECT_EQ(q.seqs[0].context_len, 77);
  ASSERT_EQ(q.seqs[0].deltas.size(), 2u);
  LayerSelection held;
  apply_delta(q.seqs[0].deltas[1], held, kHeads, kBudget, kDim, "cache rank 1");
  expect_holds(held, fa);
  // The same selection again (an APPEND update): nothing to send; a smaller message.
  u.seqs[0].init = false;
  PackSelection p2 = make();
  mirror.to_delta(u, p2);
  EXPECT_EQ(p2.seqs[0].deltas[0].entries(), 0u);
  EXPECT_LT(encode(p2, shape).size(), wire.size() / 10);
  // INIT again resets the mirror (the sequence re-entered sparse mode): everything is sent.
  u.seqs[0].init = true;
  PackSelection p3 = make();
  mirror.to_delta(u, p3);
  EXPECT_EQ(p3.seqs[0].deltas[0].entries(), 30u);
  // A release drops the sequence.
  PackUpdate rel;
  rel.released = {4};
  PackSelection empty;
  mirror.to_delta(rel, empty);
  EXPECT_EQ(mirror.num_sequences(), 0u);
  // An answer with an error is left as it is.
  PackSelection err = make();
  err.error = "pool exhausted";
  mirror.to_delta(u, err);
  EXPECT_FALSE(err.delta);
}

TEST(SelectionDelta, MalformedDeltasAreRefusedNamingThePeer) {
  LayerSelection held;
  LayerDelta d;
  d.count = 2;
  d.changed = {1, 1, 0};
  d.slots = {0, 5};  // slot 5 is outside [0, 2)
  d.positions = {10, 11};
  d.k.assign(2 * kDim, 1.f);
  d.v.assign(2 * kDim, 1.f);
  try {
    apply_delta(d, held, kHeads, kBudget, kDim, "cache rank 7 (#0)");
    FAIL() << "accepted slot 5 of 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache rank 7 (#0)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("slot 5"), std::string::npos) << e.what();
  }
  // Counts that do not add up.
  LayerDelta bad = d;
  bad.slots = {0, 1};
  bad.changed = {2, 1, 0};
  EXPECT_THROW(apply_delta(bad, held, kHeads, kBudget, kDim, "cache rank 7"), Error);
  // A live slot left empty: the mirror is out of sync.
  LayerSelection fresh;
  LayerDelta gap;
  gap.count = 2;
  gap.changed = {1, 0, 0};
  gap.slots = {1};
  gap.positions = {3};
  gap.k.assign(kDim, 0.f);
  gap.v.assign(kDim, 0.f);
  try {
    apply_delta(gap, fresh, kHeads, kBudget, kDim, "cache rank 7");
    FAIL() << "accepted a table with empty live slots";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of sync"), std::string::npos) << e.what();
  }
  // Wrong-shaped selection into the mirror.
  SelectionMirror mirror(kHeads, kBudget, kDim);
  LayerSelection wrong;
  wrong.count = 1;
  EXPECT_THROW(mirror.diff(1, 0, wrong), Error);
  EXPECT_THROW(SelectionMirror(0, kBudget, kDim), Error);
  // Truncated and flag-corrupted wire messages.
  const PackShape shape{kHeads * kDim * 2, kHeads * kDim, kHeads, kDim, kBudget};
  PackSelection p;
  p.delta = true;
  p.seqs.resize(1);
  p.seqs[0].deltas.push_back(gap);
  std::vector<uint8_t> wire = encode(p, shape);
  EXPECT_THROW(decode_selection(wire.data(), wire.size() - 3, shape, "cache rank 7"), Error);
  std::vector<uint8_t> flags = wire;
  flags[4 + 8 + 4 + 8] = 0x80;  // magic, step, pack, select_ms, then the flags word
  try {
    decode_selection(flags.data(), flags.size(), shape, "cache rank 7");
    FAIL() << "accepted unknown flags";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown flags"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spade::pair

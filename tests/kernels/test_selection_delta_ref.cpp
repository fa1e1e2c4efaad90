// selection_delta_ref / apply_selection_delta_ref (kernels/selection_delta_ref.h): the slot plan of delta transfer.
// Checked against an independent model of the rule: the holder's table after every delta equals the mirror, kept
// tokens never move, a delta with room for every entering token reproduces the selection exactly, an overflowing one
// sends the best-scored entering tokens and fills empty slots first, and bad input is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/selection_delta_ref.h"
#include "kernels/selection_ref.h"

namespace spade::kernels {
namespace {

constexpr int kDim = 4;

// K/V content is a pure function of (row, position): a held row's content identifies its token.
float kval(int r, int pos, int d) { return static_cast<float>(r * 100000 + pos * 10 + d); }

struct Holder {
  int rows, k, cap;
  std::vector<int32_t> mirror, held_pos;
  std::vector<float> held_k, held_v;
  Holder(int r, int kk, int c)
      : rows(r), k(kk), cap(c), mirror(static_cast<size_t>(r) * kk, -1), held_pos(mirror),
        held_k(static_cast<size_t>(r) * kk * kDim, 0.f), held_v(held_k) {}

  // One step: delta of `sel` ([rows][k], ascending then -1) against the mirror, gathered and applied to the holder.
  std::vector<int32_t> step(const std::vector<int32_t>& sel, const std::vector<float>* scores, int stride) {
    std::vector<int32_t> ds(static_cast<size_t>(rows) * cap), dp(ds.size()), info(static_cast<size_t>(rows) * 4);
    SelectionDeltaRefParams p;
    p.indices = sel.data();
    p.scores = scores != nullptr ? scores->data() : nullptr;
    p.mirror = mirror.data();
    p.delta_slots = ds.data();
    p.delta_positions = dp.data();
    p.row_info = info.data();
    p.rows = rows;
    p.k = k;
    p.capacity = cap;
    p.score_stride = stride;
    selection_delta_ref(p);
    // The gather (gather_kv's rule: -1 gives a zero row).
    std::vector<float> dk(ds.size() * kDim, 0.f), dv(dk.size(), 0.f);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < cap; ++j) {
        const size_t e = static_cast<size_t>(r) * cap + j;
        if (dp[e] < 0) continue;
        for (int d = 0; d < kDim; ++d) {
          dk[e * kDim + d] = kval(r, dp[e], d);
          dv[e * kDim + d] = -kval(r, dp[e], d);
        }
      }
    ApplySelectionDeltaRefParams a;
    a.delta_slots = ds.data();
    a.delta_positions = dp.data();
    a.delta_k = dk.data();
    a.delta_v = dv.data();
    a.held_k = held_k.data();
    a.held_v = held_v.data();
    a.held_positions = held_pos.data();
    a.rows = rows;
    a.k = k;
    a.capacity = cap;
    a.head_dim = kDim;
    apply_selection_delta_ref(a);
    return info;
  }

  // The holder agrees with the mirror below n, and every held row carries its token's K/V.
  void expect_consistent(const std::vector<int32_t>& info) const {
    for (int r = 0; r < rows; ++r) {
      const int n = info[static_cast<size_t>(r) * 4 + kDeltaCount];
      for (int s = 0; s < n; ++s) {
        const size_t h = static_cast<size_t>(r) * k + s;
        ASSERT_EQ(held_pos[h], mirror[h]) << "row " << r << " slot " << s;
        if (mirror[h] < 0) continue;
        for (int d = 0; d < kDim; ++d) {
          ASSERT_EQ(held_k[h * kDim + d], kval(r, mirror[h], d));
          ASSERT_EQ(held_v[h * kDim + d], -kval(r, mirror[h], d));
        }
      }
      for (int s = n; s < k; ++s) ASSERT_EQ(mirror[static_cast<size_t>(r) * k + s], -1);
    }
  }
  std::set<int32_t> held_set(int r, int n) const {
    std::set<int32_t> out;
    for (int s = 0; s < n; ++s) {
      const int32_t p = mirror[static_cast<size_t>(r) * k + s];
      if (p >= 0) out.insert(p);
    }
    return out;
  }
};

// Random selections of `n` tokens out of `context`, each keeping a fraction of the previous one.
std::vector<int32_t> next_selection(std::mt19937& rng, int rows, int k, int n, int context,
                                    const std::vector<int32_t>& prev, double keep) {
  std::vector<int32_t> sel(static_cast<size_t>(rows) * k, -1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int r = 0; r < rows; ++r) {
    std::set<int32_t> s;
    for (int i = 0; i < k; ++i) {
      const int32_t p = prev.empty() ? -1 : prev[static_cast<size_t>(r) * k + i];
      if (p >= 0 && static_cast<int>(s.size()) < n && u(rng) < keep) s.insert(p);
    }
    while (static_cast<int>(s.size()) < n) s.insert(std::uniform_int_distribution<int32_t>(0, context - 1)(rng));
    std::copy(s.begin(), s.end(), sel.begin() + static_cast<size_t>(r) * k);
  }
  return sel;
}

TEST(SelectionDeltaRef, RoomForEveryEnteringTokenReproducesEachSelectionAndKeptTokensNeverMove) {
  std::mt19937 rng(11);
  const int rows = 5, k = 32;
  Holder h(rows, k, k);
  std::vector<int32_t> prev;
  for (int step = 0; step < 150; ++step) {
    const int n = std::min(k, 3 + step / 2);
    const std::vector<int32_t> sel = next_selection(rng, rows, k, n, 100 + step, prev, step % 10 == 9 ? 0.0 : 0.85);
    const std::vector<int32_t> before = h.mirror;
    const std::vector<int32_t> info = h.step(sel, nullptr, 0);
    h.expect_consistent(info);
    for (int r = 0; r < rows; ++r) {
      const int32_t* s = sel.data() + static_cast<size_t>(r) * k;
      const std::set<int32_t> want(s, s + n);
      EXPECT_EQ(h.held_set(r, n), want) << "step " << step << " row " << r;
      int entering = 0;
      for (int i = 0; i < n; ++i) {
        bool was_held = false;
        for (int t = 0; t < n; ++t) was_held |= before[static_cast<size_t>(r) * k + t] == s[i];
        entering += was_held ? 0 : 1;
      }
      const int32_t* in = info.data() + static_cast<size_t>(r) * 4;
      EXPECT_EQ(in[kDeltaCount], n);
      EXPECT_EQ(in[kDeltaEntering], entering);
      EXPECT_EQ(in[kDeltaEntries], entering);
      EXPECT_EQ(in[kDeltaHoles], 0);
      for (int t = 0; t < n; ++t) {  // a slot whose token stayed selected did not change
        const int32_t p = before[static_cast<size_t>(r) * k + t];
        if (p >= 0 && want.count(p)) {
          EXPECT_EQ(h.mirror[static_cast<size_t>(r) * k + t], p);
        }
      }
    }
    prev = sel;
  }
}

TEST(SelectionDeltaRef, OverflowSendsTheBestScoredEnteringTokensFillsEmptySlotsFirstAndConverges) {
  const int rows = 1, k = 8, cap = 3, stride = 64;
  Holder h(rows, k, cap);
  std::vector<float> scores(stride);
  for (int i = 0; i < stride; ++i) scores[i] = static_cast<float>((i * 37) % 23);  // ties on purpose
  // First selection of 8 tokens into an empty table: 3 sent (best scores, ties to the earlier position), 5 holes.
  std::vector<int32_t> sel = {1, 4, 6, 9, 10, 15, 20, 30};
  std::vector<int32_t> info = h.step(sel, &scores, stride);
  h.expect_consistent(info);
  std::vector<int32_t> order(sel);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return topk_key(scores[a]) > topk_key(scores[b]); });
  std::set<int32_t> best(order.begin(), order.begin() + cap);
  EXPECT_EQ(h.held_set(0, 8), best);
  EXPECT_EQ(info[kDeltaEntering], 8);
  EXPECT_EQ(info[kDeltaEntries], 3);
  EXPECT_EQ(info[kDeltaHoles], 5);
  // Empty slots are filled first and ascending: slots 0, 1, 2 now.
  for (int s = 0; s < 3; ++s) EXPECT_GE(h.mirror[s], 0);
  // The same selection again: the unsent tokens re-enter, 3 per step, until the table holds it exactly.
  info = h.step(sel, &scores, stride);
  EXPECT_EQ(info[kDeltaEntering], 5);
  EXPECT_EQ(info[kDeltaHoles], 2);
  info = h.step(sel, &scores, stride);
  EXPECT_EQ(info[kDeltaEntering], 2);
  EXPECT_EQ(info[kDeltaEntries], 2);
  EXPECT_EQ(info[kDeltaHoles], 0);
  h.expect_consistent(info);
  EXPECT_EQ(h.held_set(0, 8), std::set<int32_t>(sel.begin(), sel.end()));
  info = h.step(sel, &scores, stride);
  EXPECT_EQ(info[kDeltaEntering], 0);
  // A selection replacing 5 tokens with capacity 3: stale tokens stay in the 2 slots that got nothing.
  std::vector<int32_t> sel2 = {1, 4, 6, 40, 41, 42, 43, 44};
  const std::vector<int32_t> before = h.mirror;
  info = h.step(sel2, &scores, stride);
  h.expect_consistent(info);
  EXPECT_EQ(info[kDeltaEntering], 5);
  EXPECT_EQ(info[kDeltaEntries], 3);
  EXPECT_EQ(info[kDeltaHoles], 0);
  const std::set<int32_t> held = h.held_set(0, 8);
  int stale = 0;
  for (int32_t p : held) stale += std::count(sel2.begin(), sel2.end(), p) ? 0 : 1;
  EXPECT_EQ(stale, 2);
  for (int32_t p : {1, 4, 6}) EXPECT_TRUE(held.count(p)) << p;
  // Growth of n by one with room: the new (empty) slot is filled before any stale one.
  std::vector<int32_t> grow(k, -1);
  Holder g(1, k, 1);
  for (int i = 0; i < 4; ++i) grow[i] = 10 * i;
  g.step(grow, &scores, stride);  // 4 entering, 1 sent: holes
  for (int i = 0; i < 6; ++i) g.step(grow, &scores, stride);
  EXPECT_EQ(g.held_set(0, 4), std::set<int32_t>({0, 10, 20, 30}));
  grow = {0, 10, 20, 30, 50, -1, -1, -1};  // n 4 -> 5: token 50 enters
  info = g.step(grow, &scores, stride);
  EXPECT_EQ(info[kDeltaEntering], 1);
  EXPECT_EQ(info[kDeltaHoles], 0);
  EXPECT_EQ(g.mirror[4], 50);
  // n shrinks to 2: slots >= n are emptied in the mirror; slots 0 and 1 (tokens 30 and 20, filled first by score)
  // are stale and take the two entering tokens, one per step at capacity 1.
  grow = {0, 10, -1, -1, -1, -1, -1, -1};
  info = g.step(grow, &scores, stride);
  g.expect_consistent(info);
  EXPECT_EQ(info[kDeltaEntering], 2);
  EXPECT_EQ(g.held_set(0, 2).size(), 2u);
  info = g.step(grow, &scores, stride);
  g.expect_consistent(info);
  EXPECT_EQ(g.held_set(0, 2), std::set<int32_t>({0, 10}));
}

// mirror_rows: the same plan with each row's mirror stored elsewhere in a taller table (other rows untouched).
TEST(SelectionDeltaRef, MirrorRowsGiveTheSamePlan) {
  const int rows = 3, k = 6;
  const std::vector<int32_t> sel = {1, 3, 5, 7, -1, -1, 2, 4, 6, 8, 10, 12, 0, -1, -1, -1, -1, -1};
  std::vector<int32_t> direct(static_cast<size_t>(rows) * k, -1), tall(static_cast<size_t>(2 * rows) * k, -7);
  const std::vector<int32_t> map = {4, 0, 2};
  for (int r = 0; r < rows; ++r) std::fill_n(tall.begin() + static_cast<long>(map[r]) * k, k, -1);
  std::vector<int32_t> ds1(rows * k), dp1(rows * k), in1(rows * 4), ds2(rows * k), dp2(rows * k), in2(rows * 4);
  SelectionDeltaRefParams p;
  p.indices = sel.data();
  p.rows = rows;
  p.k = k;
  p.capacity = k;
  p.mirror = direct.data();
  p.delta_slots = ds1.data();
  p.delta_positions = dp1.data();
  p.row_info = in1.data();
  selection_delta_ref(p);
  p.mirror = tall.data();
  p.mirror_rows = map.data();
  p.delta_slots = ds2.data();
  p.delta_positions = dp2.data();
  p.row_info = in2.data();
  selection_delta_ref(p);
  EXPECT_EQ(ds1, ds2);
  EXPECT_EQ(dp1, dp2);
  EXPECT_EQ(in1, in2);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < k; ++i)
      EXPECT_EQ(tall[static_cast<size_t>(map[r]) * k + i], direct[static_cast<size_t>(r) * k + i]);
  for (int i = 0; i < k; ++i) {
    EXPECT_EQ(tall[static_cast<size_t>(1) * k + i], -7) << "an unmapped row was written";
    EXPECT_EQ(tall[static_cast<size_t>(3) * k + i], -7);
  }
}

TEST(SelectionDeltaRef, BadInputIsRefused) {
  const int k = 4;
  std::vector<int32_t> mirror(k, -1), ds(k), dp(k), info(4);
  SelectionDeltaRefParams p;
  p.mirror = mirror.data();
  p.delta_slots = ds.data();
  p.delta_positions = dp.data();
  p.row_info = info.data();
  p.rows = 1;
  p.k = k;
  p.capacity = k;
  std::vector<int32_t> sel = {3, 2, -1, -1};  // not ascending
  p.indices = sel.data();
  EXPECT_THROW(selection_delta_ref(p), Error);
  sel = {1, -1, 5, -1};  // -1 inside the count
  EXPECT_THROW(selection_delta_ref(p), Error);
  sel = {1, 2, 3, 4};
  mirror = {2, 2, -1, -1};  // two slots hold token 2
  try {
    selection_delta_ref(p);
    FAIL() << "accepted a corrupt mirror";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt"), std::string::npos) << e.what();
  }
  mirror = {-7, -1, -1, -1};
  EXPECT_THROW(selection_delta_ref(p), Error);
  mirror.assign(k, -1);
  p.capacity = 0;
  EXPECT_THROW(selection_delta_ref(p), Error);
  p.capacity = k + 1;
  EXPECT_THROW(selection_delta_ref(p), Error);
  p.capacity = 2;  // overflow without scores
  EXPECT_THROW(selection_delta_ref(p), Error);
  p.capacity = k;
  p.indices = nullptr;
  EXPECT_THROW(selection_delta_ref(p), Error);

  std::vector<int32_t> slots = {0, 9};  // slot 9 of 4
  std::vector<float> dk(2 * kDim), held(k * kDim);
  ApplySelectionDeltaRefParams a;
  a.delta_slots = slots.data();
  a.delta_k = dk.data();
  a.delta_v = dk.data();
  a.held_k = held.data();
  a.held_v = held.data();
  a.rows = 1;
  a.k = k;
  a.capacity = 2;
  a.head_dim = kDim;
  try {
    apply_selection_delta_ref(a);
    FAIL() << "accepted slot 9";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot 9"), std::string::npos) << e.what();
  }
  std::vector<int32_t> hp(k);
  a.held_positions = hp.data();  // positions wanted but not given
  slots = {0, 1};
  EXPECT_THROW(apply_selection_delta_ref(a), Error);
}

}  // namespace
}  // namespace spade::kernels

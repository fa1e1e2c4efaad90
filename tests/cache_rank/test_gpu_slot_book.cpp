// The GPU cache rank's host bookkeeping of its plans (cache_rank/gpu_slot_book.h): rows admit and append, window
// counts capped and anchor windows pushed until the anchors are picked, forks sharing pages and window counts,
// retained prefixes (retain, fork from, drop), the plan's order (retains, forks, drops, releases, rows), the slots
// reported emptied, and every plan that does not match what is held refused with the peer and the step named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "cache_rank/gpu_slot_book.h"
#include "common/error.h"

namespace spade::cache {
namespace {

using pair::GpuPlanFork;
using pair::GpuPlanRetain;
using pair::GpuPlanRow;
using pair::GpuStepPlan;
using pair::kForkFromRetained;
using pair::kRowFresh;
using ::testing::HasSubstr;

constexpr int kPage = 16;

// 32 pages of 16 tokens, 4 slots, query windows of 5 entries (W = 4), anchor windows of 3.
GpuSlotBook book() { return GpuSlotBook(32, kPage, 4, 5, 3, "inference rank 7"); }

GpuStepPlan plan(int64_t step, std::vector<GpuPlanRow> rows) {
  GpuStepPlan p;
  p.step = step;
  p.rows = std::move(rows);
  return p;
}

// Applies `p`, returning the slots reported emptied.
std::vector<int> apply(GpuSlotBook& b, const GpuStepPlan& p) {
  std::vector<int> emptied;
  b.apply(p, [&](int slot) { emptied.push_back(slot); });
  return emptied;
}

TEST(GpuSlotBook, RowsAdmitAppendAndAdvanceTheWindows) {
  GpuSlotBook b = book();
  EXPECT_EQ(b.pages_held(), 0);
  EXPECT_TRUE(b.anchor_pending(0)) << "anchors on: every slot starts with its anchors to pick";
  EXPECT_EQ(apply(b, plan(0, {{0, 20, 20, kRowFresh}, {2, 3, 3, kRowFresh}})), (std::vector<int>{0, 2}));
  EXPECT_EQ(b.tokens(0), 20);
  EXPECT_EQ(b.block_table(0).size(), 2u);
  EXPECT_EQ(b.tokens(2), 3);
  EXPECT_EQ(b.pages_held(), 3);
  EXPECT_EQ(b.live_slots(), 2);
  EXPECT_EQ(b.window_len(0), 5) << "capped at W + 1";
  EXPECT_EQ(b.window_len(2), 3);
  EXPECT_EQ(b.anchor_window_len(0), 3) << "capped at A";
  EXPECT_EQ(b.anchor_window_len(2), 3);
  // Slot 2's anchors are picked: its anchor window stops; its query window goes on.
  b.anchors_picked(2);
  EXPECT_TRUE(apply(b, plan(1, {{0, 1, 21, 0}, {2, 1, 4, 0}})).empty());
  EXPECT_EQ(b.window_len(2), 4);
  EXPECT_FALSE(b.anchor_pending(2));
  EXPECT_TRUE(b.anchor_pending(0));
  // A fresh row starts its slot over: pages, windows and anchors.
  EXPECT_EQ(apply(b, plan(2, {{2, 2, 2, kRowFresh}})), std::vector<int>{2});
  EXPECT_EQ(b.tokens(2), 2);
  EXPECT_EQ(b.window_len(2), 2);
  EXPECT_TRUE(b.anchor_pending(2));
  EXPECT_EQ(b.anchor_window_len(2), 2);
  EXPECT_EQ(b.pages_held(), 3);
  // Releases empty slots and free their pages.
  GpuStepPlan release = plan(3, {});
  release.released = {0, 2};
  EXPECT_EQ(apply(b, release), (std::vector<int>{0, 2}));
  EXPECT_EQ(b.pages_held(), 0);
  EXPECT_EQ(b.live_slots(), 0);
  EXPECT_TRUE(b.block_table(0).empty());
  EXPECT_EQ(b.window_len(0), 0);
}

TEST(GpuSlotBook, WithoutAnchorsNoAnchorWindowIsPushed) {
  GpuSlotBook b(8, kPage, 2, 5, 0, "inference rank 0");
  EXPECT_FALSE(b.anchor_pending(1));
  apply(b, plan(0, {{1, 4, 4, kRowFresh}}));
  EXPECT_EQ(b.anchor_window_len(1), 0);
  EXPECT_EQ(b.window_len(1), 4);
}

// n samples: a fork shares the parent's pages (by reference) and its window counts; the fork comes before the
// releases of the same plan, so the parent may end in the plan that forks it.
TEST(GpuSlotBook, ForksShareThePagesAndTheWindowCounts) {
  GpuSlotBook b = book();
  apply(b, plan(0, {{0, 32, 32, kRowFresh}, {3, 5, 5, kRowFresh}}));
  b.anchors_picked(0);
  GpuStepPlan p = plan(1, {{1, 1, 33, 0}, {2, 1, 33, 0}});
  p.forks = {{1, 0, 32, 0}, {2, 0, 32, 0}};
  p.released = {0};
  EXPECT_EQ(apply(b, p), (std::vector<int>{1, 2, 0}));
  EXPECT_EQ(b.tokens(1), 33);
  EXPECT_EQ(b.tokens(2), 33);
  EXPECT_EQ(std::vector<int32_t>(b.block_table(1).begin(), b.block_table(1).begin() + 2),
            std::vector<int32_t>(b.block_table(2).begin(), b.block_table(2).begin() + 2))
      << "the prompt's two pages, shared";
  EXPECT_NE(b.block_table(1)[2], b.block_table(2)[2]) << "each sample's own page";
  EXPECT_EQ(b.pages_held(), 2 + 2 + 1) << "2 shared, 1 own each, slot 3's one";
  EXPECT_EQ(b.window_len(1), 5);
  EXPECT_FALSE(b.anchor_pending(1)) << "the parent's anchors were picked: the child has them";
  // Slot 1 holds 33 tokens: not whole pages, so no fork takes them.
  GpuStepPlan q = plan(2, {{3, 1, 34, 0}});
  q.forks = {{3, 1, 33, 0}};
  EXPECT_THROW(b.apply(q, [](int) {}), Error);
}

TEST(GpuSlotBook, RetainedPrefixesAreKeptForkedAndDropped) {
  GpuSlotBook b = book();
  apply(b, plan(0, {{0, 40, 40, kRowFresh}, {3, 5, 5, kRowFresh}}));
  // The slot ends; its two whole pages are retained under id 5 first, in the same plan.
  GpuStepPlan p = plan(1, {{3, 1, 6, 0}});
  p.retains = {{0, 5, 32}};
  p.released = {0};
  apply(b, p);
  EXPECT_EQ(b.retained(), 1);
  EXPECT_EQ(b.pages_held(), 2 + 1);
  EXPECT_EQ(b.live_slots(), 1);
  // A prefix-cache hit into the held slot 3: emptied first, it starts from the prefix's first page, its windows
  // empty, its anchors to pick.
  GpuStepPlan hit = plan(2, {{3, 4, 20, 0}});
  hit.forks = {{3, 5, 16, kForkFromRetained}};
  EXPECT_EQ(apply(b, hit), std::vector<int>{3});
  EXPECT_EQ(b.tokens(3), 20);
  EXPECT_EQ(b.window_len(3), 4);
  EXPECT_TRUE(b.anchor_pending(3));
  EXPECT_EQ(b.anchor_window_len(3), 3);
  EXPECT_EQ(b.pages_held(), 2 + 1) << "the prefix's two, slot 3's own second page (its old one freed)";
  // Dropped, the prefix's second page is freed; its first stays with slot 3.
  GpuStepPlan drop = plan(3, {});
  drop.drops = {5};
  apply(b, drop);
  EXPECT_EQ(b.retained(), 0);
  EXPECT_EQ(b.pages_held(), 2);
  GpuStepPlan end = plan(4, {});
  end.released = {3};
  apply(b, end);
  EXPECT_EQ(b.pages_held(), 0);
}

void expect_refused(GpuSlotBook& b, const GpuStepPlan& p, const std::string& what) {
  try {
    b.apply(p, [](int) {});
    ADD_FAILURE() << "accepted: " << what;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("inference rank 7: step " + std::to_string(p.step))) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(what)) << e.what();
  }
}

TEST(GpuSlotBookBadInput, PlansThatDoNotMatchWhatIsHeldAreRefusedByName) {
  GpuSlotBook b = book();
  apply(b, plan(0, {{0, 32, 32, kRowFresh}}));
  GpuStepPlan p = plan(1, {});
  p.forks = {{1, 2, 16, 0}};
  expect_refused(b, p, "slot 1 forks from slot 2 at 16 tokens, but that slot holds 0");
  p.forks = {{1, 0, 16, 0}};
  expect_refused(b, p, "slot 1 forks from slot 0 at 16 tokens, but that slot holds 32");
  p.forks = {{1, 9, 16, kForkFromRetained}};
  expect_refused(b, p, "forks from retained prefix 9 at 16 tokens, but it is not held");
  p.forks.clear();
  p.retains = {{0, 1, 48}};
  expect_refused(b, p, "retain of slot 0 (32 tokens held) as prefix 1 at 48 tokens");
  p.retains = {{0, 1, 24}};
  expect_refused(b, p, "as prefix 1 at 24 tokens (whole pages of 16");
  p.retains = {{0, 1, 16}};
  apply(b, p);
  p.step = 2;
  expect_refused(b, p, "retain of slot 0 (32 tokens held) as prefix 1 at 16 tokens");  // id 1 is held
  p.retains.clear();
  p.drops = {4};
  expect_refused(b, p, "drop of retained prefix 4, which is not held");
  expect_refused(b, plan(3, {{0, 1, 40, 0}}), "slot 0 continues at position 39 but this rank holds 32 of its tokens");
  expect_refused(b, plan(4, {{3, 16 * 40, 16 * 40, kRowFresh}}), "the KV pool (32 pages) cannot hold slot 3's 640");
  EXPECT_THROW(GpuSlotBook(0, kPage, 4, 5, 3, "x"), Error);
  EXPECT_THROW(GpuSlotBook(8, kPage, 0, 5, 3, "x"), Error);
  EXPECT_THROW(GpuSlotBook(8, kPage, 4, -1, 3, "x"), Error);
}

}  // namespace
}  // namespace spade::cache

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "common/error.h"
#include "common/page_allocator.h"

namespace spade {
namespace {

TEST(PageAllocator, AdmitAppendRelease) {
  PageAllocator a(10, 4);
  a.admit(1);
  EXPECT_TRUE(a.append(1, 5));  // 2 pages
  EXPECT_EQ(a.seq_len(1), 5);
  EXPECT_EQ(a.block_table(1).size(), 2u);
  EXPECT_TRUE(a.append(1, 3));  // 8 tokens: still 2 pages
  EXPECT_EQ(a.block_table(1).size(), 2u);
  EXPECT_TRUE(a.append(1, 1));
  EXPECT_EQ(a.block_table(1).size(), 3u);
  EXPECT_EQ(a.num_free_pages(), 7);
  auto [page, slot] = a.locate(1, 8);
  EXPECT_EQ(page, a.block_table(1)[2]);
  EXPECT_EQ(slot, 0);
  a.admit(2);
  EXPECT_FALSE(a.append(2, 29)) << "needs 8 pages, 7 free";
  EXPECT_EQ(a.seq_len(2), 0) << "failed append changes nothing";
  EXPECT_EQ(a.num_free_pages(), 7);
  EXPECT_TRUE(a.append(2, 28));
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_DOUBLE_EQ(a.usage(), 1.0);
  std::set<int32_t> all;
  for (auto p : a.block_table(1)) all.insert(p);
  for (auto p : a.block_table(2)) all.insert(p);
  EXPECT_EQ(all.size(), 10u) << "no page handed out twice";
  a.release(1);
  a.release(1);  // idempotent
  EXPECT_EQ(a.num_free_pages(), 3);
  EXPECT_FALSE(a.contains(1));
  a.release(2);
  EXPECT_EQ(a.num_free_pages(), 10);
}

TEST(PageAllocator, DropRangeFreesWholePagesOnly) {
  PageAllocator a(10, 4);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 22));  // 6 pages: [0,4) [4,8) ... [20,22)
  EXPECT_EQ(a.drop_range(1, 2, 17), 3) << "pages [4,8) [8,12) [12,16) lie inside [2, 17)";
  EXPECT_EQ(a.held_pages(1), 3);
  EXPECT_EQ(a.num_free_pages(), 7);
  EXPECT_EQ(a.block_table(1).size(), 6u);
  EXPECT_EQ(a.block_table(1)[1], -1);
  EXPECT_EQ(a.drop_range(1, 2, 17), 0) << "idempotent";
  EXPECT_NO_THROW(a.locate(1, 1));
  EXPECT_NO_THROW(a.locate(1, 16));
  EXPECT_THROW(a.locate(1, 5), Error);
  EXPECT_TRUE(a.append(1, 3));  // grows after the table's end
  EXPECT_EQ(a.seq_len(1), 25);
  a.release(1);
  EXPECT_EQ(a.num_free_pages(), 10) << "dropped pages are not freed twice";
}

TEST(PageAllocator, HandsOutLowestFreePageFirst) {
  PageAllocator a(8, 2);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 6));  // pages 0 1 2
  EXPECT_EQ(a.block_table(1), (std::vector<int32_t>{0, 1, 2}));
  a.admit(2);
  ASSERT_TRUE(a.append(2, 4));  // pages 3 4
  EXPECT_EQ(a.block_table(2), (std::vector<int32_t>{3, 4}));
  a.admit(4);
  ASSERT_TRUE(a.append(4, 1));  // page 5
  a.release(1);
  a.release(2);  // free: 0 1 2 3 4 6 7; the last freed page is 4 (a LIFO list would hand out 3 or 4 next)
  a.admit(3);
  ASSERT_TRUE(a.append(3, 1));
  EXPECT_EQ(a.block_table(3), (std::vector<int32_t>{0})) << "the lowest free id, not the last one freed";
  ASSERT_TRUE(a.append(3, 10));  // 11 tokens -> 6 pages: 0 then 1 2 3 4 6
  EXPECT_EQ(a.block_table(3), (std::vector<int32_t>{0, 1, 2, 3, 4, 6}));
  ASSERT_TRUE(a.append(4, 2));
  EXPECT_EQ(a.block_table(4), (std::vector<int32_t>{5, 7}));
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_EQ(a.drop_range(3, 2, 8), 3);  // pages 1 2 3 (tokens [2, 8))
  a.admit(5);
  ASSERT_TRUE(a.append(5, 5));
  EXPECT_EQ(a.block_table(5), (std::vector<int32_t>{1, 2, 3})) << "dropped pages are reused lowest first";
}

// Random churn (admit / append in prefill chunks and single decode tokens / drop_range / release): every page taken
// must be the lowest free id at that moment (checked against an ordered model of the free set), no page is ever
// held twice, and a sequence admitted after the churn gets the lowest free pages in ascending order.
TEST(PageAllocator, LowestFirstAfterChurn) {
  constexpr int kPages = 512, kPageSize = 16;
  PageAllocator a(kPages, kPageSize);
  std::set<int32_t> free_model;
  for (int p = 0; p < kPages; ++p) free_model.insert(p);
  std::map<uint64_t, std::vector<int32_t>> held;  // model of each live sequence's block table
  std::mt19937_64 rng(20261121);
  uint64_t next_id = 1;
  auto check_append = [&](uint64_t seq, int n) {
    const std::vector<int32_t> before = a.block_table(seq);
    const int need = a.pages_for(a.seq_len(seq) + n) - static_cast<int>(before.size());
    const bool ok = a.append(seq, n);
    ASSERT_EQ(ok, need <= static_cast<int>(free_model.size()));
    if (!ok) {
      ASSERT_EQ(a.block_table(seq), before) << "a failed append changes nothing";
      return;
    }
    const std::vector<int32_t>& bt = a.block_table(seq);
    ASSERT_EQ(bt.size(), before.size() + need);
    for (int i = 0; i < need; ++i) {
      const int32_t p = bt[before.size() + i];
      ASSERT_FALSE(free_model.empty());
      ASSERT_EQ(p, *free_model.begin()) << "page " << i << " of this append is not the lowest free id";
      free_model.erase(free_model.begin());
      held[seq].push_back(p);
    }
  };
  int releases = 0, drops = 0;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    if (op < 8 || held.empty()) {  // admit with a prefill of 1..2000 tokens
      const uint64_t id = next_id++;
      a.admit(id);
      held[id];
      check_append(id, 1 + static_cast<int>(rng() % 2000));
    } else {
      auto it = std::next(held.begin(), static_cast<long>(rng() % held.size()));
      const uint64_t id = it->first;
      if (op < 80) {
        check_append(id, 1);  // decode step
      } else if (op < 84) {
        const int len = a.seq_len(id);
        const int b = static_cast<int>(rng() % (len + 1));
        const int e = b + static_cast<int>(rng() % (len - b + 1));
        const std::vector<int32_t> bt = a.block_table(id);
        const int freed = a.drop_range(id, b, e);
        int count = 0;
        for (size_t i = 0; i < bt.size(); ++i) {
          if (bt[i] >= 0 && a.block_table(id)[i] < 0) {
            ASSERT_TRUE(free_model.insert(bt[i]).second) << "page " << bt[i] << " freed twice";
            auto& h = held[id];
            h.erase(std::find(h.begin(), h.end(), bt[i]));
            ++count;
          }
        }
        ASSERT_EQ(freed, count);
        ++drops;
      } else {
        a.release(id);
        for (int32_t p : it->second) ASSERT_TRUE(free_model.insert(p).second) << "page " << p << " freed twice";
        held.erase(it);
        ++releases;
      }
    }
    if (HasFatalFailure()) return;
    ASSERT_EQ(a.num_free_pages(), static_cast<int>(free_model.size()));
  }
  EXPECT_GT(releases, 100);
  EXPECT_GT(drops, 100);
  std::set<int32_t> all;
  for (const auto& [id, pages] : held) {
    for (int32_t p : pages) EXPECT_TRUE(all.insert(p).second) << "page " << p << " held twice";
  }
  EXPECT_EQ(all.size() + free_model.size(), static_cast<size_t>(kPages));

  // After the churn, a new sequence admitted with as many tokens as fit gets the lowest free pages, ascending.
  const std::vector<int32_t> expect(free_model.begin(), free_model.end());
  ASSERT_GT(expect.size(), 8u) << "the churn should leave free pages";
  a.admit(next_id);
  ASSERT_TRUE(a.append(next_id, static_cast<int>(expect.size()) * kPageSize));
  EXPECT_EQ(a.block_table(next_id), expect);
  EXPECT_TRUE(std::is_sorted(a.block_table(next_id).begin(), a.block_table(next_id).end()));
  EXPECT_EQ(a.num_free_pages(), 0);
}

TEST(PageAllocator, Errors) {
  EXPECT_THROW(PageAllocator(0, 4), Error);
  EXPECT_THROW(PageAllocator(4, 0), Error);
  PageAllocator a(4, 4);
  EXPECT_THROW(a.append(9, 1), Error);
  EXPECT_THROW(a.block_table(9), Error);
  a.admit(1);
  EXPECT_THROW(a.admit(1), Error);
  EXPECT_THROW(a.locate(1, 0), Error);
}

}  // namespace
}  // namespace spade

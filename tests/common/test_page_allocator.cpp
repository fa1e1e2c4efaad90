#include <gtest/gtest.h>

#include <set>

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

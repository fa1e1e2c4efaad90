// PageAllocator::fork_prefix (a sequence holding another's leading pages: the cache rank's shared INIT) and
// page_serial (which tells the inference rank that two sequences hold the same KV in a page); peek_prefix and
// published_run (what a later prompt can still match of recorded pages).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "common/error.h"
#include "common/page_allocator.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

TEST(PageAllocatorForkPrefix, SharesTheCoveringPagesAndCopiesAPartlySharedOneOnWrite) {
  PageAllocator a(16, 4);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 11));  // pages 0..2, the third holds 3 tokens
  a.fork_prefix(1, 2, 8);         // two whole pages
  EXPECT_EQ(a.seq_len(2), 8);
  ASSERT_EQ(a.block_table(2).size(), 2u);
  EXPECT_EQ(a.block_table(2)[0], a.block_table(1)[0]);
  EXPECT_EQ(a.refcount(a.block_table(1)[1]), 2);
  EXPECT_EQ(a.refcount(a.block_table(1)[2]), 1);
  EXPECT_EQ(a.num_free_pages(), 13);
  ASSERT_TRUE(a.append(2, 3));  // a page of its own, nothing to copy
  EXPECT_TRUE(a.take_copies().empty());
  a.fork_prefix(1, 3, 10);  // the third page partly: copied on 3's first append
  EXPECT_EQ(a.refcount(a.block_table(1)[2]), 2);
  ASSERT_TRUE(a.append(3, 1));
  const auto copies = a.take_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, a.block_table(1)[2]);
  EXPECT_EQ(copies[0].dst, a.block_table(3)[2]);
  EXPECT_EQ(copies[0].slots, 2);
  EXPECT_EQ(a.refcount(a.block_table(1)[2]), 1);
  a.release(1);  // the source first: its sharers keep the pages
  EXPECT_EQ(a.refcount(a.block_table(2)[0]), 2);
  a.release(3);
  a.release(2);
  EXPECT_EQ(a.num_free_pages(), 16);
  for (int32_t p = 0; p < 16; ++p) EXPECT_EQ(a.refcount(p), 0);
}

TEST(PageAllocatorForkPrefix, BadRequestsAreRefused) {
  PageAllocator a(8, 4);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 12));
  EXPECT_THAT([&] { a.fork_prefix(9, 2, 4); }, ::testing::ThrowsMessage<Error>(HasSubstr("unknown sequence 9")));
  EXPECT_THAT([&] { a.fork_prefix(1, 2, 13); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot share 13 tokens of sequence 1 of length 12")));
  EXPECT_THAT([&] { a.fork_prefix(1, 2, 0); }, ::testing::ThrowsMessage<Error>(HasSubstr("cannot share 0 tokens")));
  EXPECT_THAT([&] { a.fork_prefix(1, 1, 4); }, ::testing::ThrowsMessage<Error>(HasSubstr("1 is already admitted")));
  a.drop_range(1, 4, 8);
  EXPECT_THAT([&] { a.fork_prefix(1, 2, 12); }, ::testing::ThrowsMessage<Error>(HasSubstr("a page among them was dropped")));
  a.fork_prefix(1, 2, 4);  // the page before the dropped one is fine
  EXPECT_EQ(a.refcount(a.block_table(1)[0]), 2);
  a.release(1);
  a.release(2);
  EXPECT_EQ(a.num_free_pages(), 8);
}

TEST(PageAllocatorSerials, ASerialChangesExactlyWhenAPageGetsNewContent) {
  PageAllocator a(4, 2, /*prefix_caching=*/true);
  EXPECT_EQ(a.page_serial(0), 0u) << "never taken";
  const int32_t tokens[] = {5, 6, 7, 8, 9, 10, 11, 12};
  a.admit(1);
  ASSERT_TRUE(a.append(1, 4));
  const int32_t p0 = a.block_table(1)[0], p1 = a.block_table(1)[1];
  const uint64_t s0 = a.page_serial(p0), s1 = a.page_serial(p1);
  EXPECT_NE(s0, 0u);
  EXPECT_NE(s0, s1);
  a.cache_prompt(1, tokens, 4);
  a.fork(1, 2);
  EXPECT_EQ(a.page_serial(p0), s0) << "a fork shares the content";
  a.release(1);
  a.release(2);  // published: kept, unreferenced, same content
  a.admit(3);
  EXPECT_EQ(a.match_prefix(3, tokens, 5), 4);
  EXPECT_EQ(a.block_table(3)[0], p0);
  EXPECT_EQ(a.page_serial(p0), s0) << "a prefix-cache hit holds the same content";
  a.release(3);
  // Fill the pool: the two free pages, then the two cached ones are evicted and reused with new serials.
  a.admit(4);
  ASSERT_TRUE(a.append(4, 8));
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_EQ(a.prefix_stats().evicted_pages, 2u);
  EXPECT_NE(a.page_serial(p0), s0);
  EXPECT_NE(a.page_serial(p1), s1);
  a.release(4);
  a.admit(5);
  ASSERT_TRUE(a.append(5, 1));  // a freed page taken again: new content, new serial
  const int32_t q = a.block_table(5)[0];
  const uint64_t before = a.page_serial(q);
  a.release(5);
  a.admit(6);
  ASSERT_TRUE(a.append(6, 1));
  ASSERT_EQ(a.block_table(6)[0], q) << "the lowest free page, as before";
  EXPECT_NE(a.page_serial(q), before);
  EXPECT_THAT([&] { a.page_serial(4); }, ::testing::ThrowsMessage<Error>(HasSubstr("page 4 outside [0, 4)")));
}

TEST(PageAllocatorPrefix, PeekSharesNothingAndPublishedRunsEndAtAReusedPage) {
  PageAllocator a(4, 4, /*prefix_caching=*/true);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  a.admit(1);
  ASSERT_TRUE(a.append(1, 10));
  a.cache_prompt(1, prompt.data(), 10);  // pages 0 and 1 (whole) published
  std::vector<std::pair<int32_t, uint64_t>> rec;
  for (int i = 0; i < 3; ++i) rec.emplace_back(a.block_table(1)[i], a.page_serial(a.block_table(1)[i]));
  EXPECT_EQ(a.published_run(rec), 2) << "the third page is not published";
  const std::vector<int32_t> peek = a.peek_prefix(prompt.data(), 10, 8);
  EXPECT_EQ(peek, (std::vector<int32_t>{a.block_table(1)[0], a.block_table(1)[1]}));
  EXPECT_EQ(a.prefix_stats().queried_tokens, 0u) << "a peek counts nothing";
  EXPECT_EQ(a.refcount(peek[0]), 1) << "and shares nothing";
  EXPECT_EQ(a.peek_prefix(prompt.data(), 10, 7).size(), 1u) << "at most max_reuse tokens, whole pages";
  a.release(1);  // the published pages stay cached, unreferenced
  EXPECT_EQ(a.published_run(rec), 2);
  a.admit(2);
  ASSERT_TRUE(a.append(2, 16));  // takes every page: the cached ones are evicted and reused
  EXPECT_EQ(a.published_run(rec), 0) << "a reused page holds other KV: its serial changed";
  EXPECT_TRUE(a.peek_prefix(prompt.data(), 10).empty());
  PageAllocator off(4, 4);
  EXPECT_TRUE(off.peek_prefix(prompt.data(), 10).empty()) << "prefix caching off";
}

}  // namespace
}  // namespace spade

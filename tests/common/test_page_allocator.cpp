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

TEST(PageAllocator, PlacesPagesInRuns) {
  PageAllocator a(32, 2);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 6));  // pages 0 1 2: the lowest run of >= kGrowRun pages
  EXPECT_EQ(a.block_table(1), (std::vector<int32_t>{0, 1, 2}));
  a.admit(2);
  ASSERT_TRUE(a.append(2, 4));  // 3 4
  EXPECT_EQ(a.block_table(2), (std::vector<int32_t>{3, 4}));
  ASSERT_TRUE(a.append(1, 2));  // page 3 is taken: sequence 1 starts a new run where it has room to grow
  EXPECT_EQ(a.block_table(1), (std::vector<int32_t>{0, 1, 2, 5}));
  ASSERT_TRUE(a.append(1, 4));  // ... and grows it: 6 7
  EXPECT_EQ(a.block_table(1), (std::vector<int32_t>{0, 1, 2, 5, 6, 7}));
  a.release(2);  // free: 3 4 | 8..31
  a.admit(3);
  ASSERT_TRUE(a.append(3, 2));  // one page: the hole 3-4 is shorter than kGrowRun, so the first long run
  EXPECT_EQ(a.block_table(3), (std::vector<int32_t>{8}));
  a.admit(4);
  ASSERT_TRUE(a.append(4, 46));  // 23 pages: 9..31 is exactly 23 long
  EXPECT_EQ(a.block_table(4).front(), 9);
  EXPECT_EQ(a.block_table(4).back(), 31);
  EXPECT_EQ(a.num_free_pages(), 2);
  EXPECT_EQ(a.num_free_runs(), 1);
  ASSERT_TRUE(a.append(3, 2));  // page 9 is taken: the only run left (3 4, rule 3)
  EXPECT_EQ(a.block_table(3), (std::vector<int32_t>{8, 3}));
  EXPECT_EQ(a.drop_range(1, 2, 10), 4);  // pages 1 2 5 6 (tokens [2, 10))
  EXPECT_EQ(a.num_free_runs(), 2);       // 1 2 | 4 5 6
  a.admit(5);
  ASSERT_TRUE(a.append(5, 10));  // 5 pages, no run that long: the longest (4 5 6), then 1 2
  EXPECT_EQ(a.block_table(5), (std::vector<int32_t>{4, 5, 6, 1, 2}));
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_FALSE(a.append(5, 1));
}

// Reference model of the placement rules (page_allocator.h), over an ordered set of free pages.
struct PlacementModel {
  std::set<int32_t> free;
  int num_pages;
  std::vector<std::pair<int32_t, int32_t>> runs() const {  // (first, length), ascending
    std::vector<std::pair<int32_t, int32_t>> r;
    for (int32_t p : free) {
      if (!r.empty() && r.back().first + r.back().second == p) {
        ++r.back().second;
      } else {
        r.emplace_back(p, 1);
      }
    }
    return r;
  }
  int32_t choose(int need) const {
    const auto r = runs();
    for (auto& [f, l] : r)
      if (l >= std::max(need, PageAllocator::kGrowRun)) return f;
    for (auto& [f, l] : r)
      if (l >= need) return f;
    std::pair<int32_t, int32_t> best{-1, 0};
    for (auto& x : r)
      if (x.second > best.second) best = x;
    return best.first;
  }
  // The pages an append of `need` pages after `last` (-1: none) takes.
  std::vector<int32_t> place(int32_t last, int need) {
    std::vector<int32_t> out;
    while (need > 0) {
      int32_t p = (last >= 0 && free.count(last + 1)) ? last + 1 : choose(need);
      while (need > 0 && free.count(p)) {
        free.erase(p);
        out.push_back(p);
        last = p++;
        --need;
      }
    }
    return out;
  }
};

// Random churn (admit / append in prefill chunks and single decode tokens / drop_range / release): every append
// takes exactly the pages the reference model of the placement rules picks, no page is ever held twice, and the
// free runs stay coalesced.
TEST(PageAllocator, PlacementMatchesTheRulesUnderChurn) {
  constexpr int kPages = 512, kPageSize = 16;
  PageAllocator a(kPages, kPageSize);
  PlacementModel model;
  model.num_pages = kPages;
  for (int p = 0; p < kPages; ++p) model.free.insert(p);
  std::map<uint64_t, std::vector<int32_t>> held;  // model of each live sequence's pages
  std::mt19937_64 rng(20261121);
  uint64_t next_id = 1;
  auto check_append = [&](uint64_t seq, int n) {
    const std::vector<int32_t> before = a.block_table(seq);
    const int need = a.pages_for(a.seq_len(seq) + n) - static_cast<int>(before.size());
    const bool ok = a.append(seq, n);
    ASSERT_EQ(ok, need <= static_cast<int>(model.free.size()));
    if (!ok) {
      ASSERT_EQ(a.block_table(seq), before) << "a failed append changes nothing";
      return;
    }
    const std::vector<int32_t> want = model.place(before.empty() ? -1 : before.back(), need);
    const std::vector<int32_t>& bt = a.block_table(seq);
    ASSERT_EQ(bt.size(), before.size() + need);
    ASSERT_EQ(std::vector<int32_t>(bt.begin() + static_cast<long>(before.size()), bt.end()), want);
    held[seq].insert(held[seq].end(), want.begin(), want.end());
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
            ASSERT_TRUE(model.free.insert(bt[i]).second) << "page " << bt[i] << " freed twice";
            auto& h = held[id];
            h.erase(std::find(h.begin(), h.end(), bt[i]));
            ++count;
          }
        }
        ASSERT_EQ(freed, count);
        ++drops;
      } else {
        a.release(id);
        for (int32_t p : it->second) ASSERT_TRUE(model.free.insert(p).second) << "page " << p << " freed twice";
        held.erase(it);
        ++releases;
      }
    }
    if (HasFatalFailure()) return;
    ASSERT_EQ(a.num_free_pages(), static_cast<int>(model.free.size()));
    ASSERT_EQ(a.num_free_runs(), static_cast<int>(model.runs().size())) << "free runs not coalesced";
  }
  EXPECT_GT(releases, 100);
  EXPECT_GT(drops, 100);
  std::set<int32_t> all;
  for (const auto& [id, pages] : held) {
    for (int32_t p : pages) EXPECT_TRUE(all.insert(p).second) << "page " << p << " held twice";
  }
  EXPECT_EQ(all.size() + model.free.size(), static_cast<size_t>(kPages));
  // After the churn, a sequence taking every free page gets them in as few runs as there are free runs.
  const size_t runs = model.runs().size();
  ASSERT_GT(model.free.size(), 8u) << "the churn should leave free pages";
  a.admit(next_id);
  ASSERT_TRUE(a.append(next_id, static_cast<int>(model.free.size()) * kPageSize));
  const auto& bt = a.block_table(next_id);
  size_t breaks = 1;
  for (size_t i = 1; i < bt.size(); ++i) breaks += bt[i] != bt[i - 1] + 1;
  EXPECT_EQ(breaks, runs);
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_EQ(a.num_free_runs(), 0);
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


// ---- shared pages: fork + copy-on-write (n samples of one prompt) ----

TEST(PageAllocatorShared, ForkSharesEveryPageAndCopiesThePartialPageOnWrite) {
  PageAllocator a(16, 4);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 10));  // pages: 4 + 4 + 2 tokens
  const std::vector<int32_t> prompt = a.block_table(1);
  for (uint64_t c = 2; c <= 4; ++c) a.fork(1, c);  // n = 4 samples
  EXPECT_EQ(a.num_free_pages(), 13) << "the prompt is stored once";
  for (int32_t p : prompt) EXPECT_EQ(a.refcount(p), 4);
  EXPECT_EQ(a.block_table(3), prompt);
  EXPECT_EQ(a.seq_len(3), 10);
  // Each sample's first token goes into the shared partial page: it is copied first (2 slots), except for the last
  // holder, which then owns the original alone.
  for (uint64_t c = 1; c <= 4; ++c) ASSERT_TRUE(a.append(c, 1));
  const auto copies = a.take_copies();
  ASSERT_EQ(copies.size(), 3u);
  std::set<int32_t> tails;
  for (const auto& cp : copies) {
    EXPECT_EQ(cp.src, prompt[2]);
    EXPECT_EQ(cp.slots, 2);
    EXPECT_TRUE(std::find(prompt.begin(), prompt.end(), cp.dst) == prompt.end());
    tails.insert(cp.dst);
  }
  EXPECT_EQ(tails.size(), 3u);
  EXPECT_EQ(a.refcount(prompt[2]), 1);
  EXPECT_EQ(a.refcount(prompt[0]), 4);
  for (uint64_t c = 1; c <= 4; ++c) {
    EXPECT_EQ(a.block_table(c)[0], prompt[0]);
    EXPECT_EQ(a.seq_len(c), 11);
  }
  EXPECT_TRUE(a.take_copies().empty());
  EXPECT_EQ(a.num_free_pages(), 10) << "prompt once (3) + three private tails";
  // Full shared pages need no copy: appends past them take fresh pages.
  for (uint64_t c = 1; c <= 4; ++c) ASSERT_TRUE(a.append(c, 1));
  EXPECT_TRUE(a.take_copies().empty());
  // Releases in any order (a cancel storm) give every page back exactly once.
  for (uint64_t c : {3, 1, 4, 2}) a.release(c);
  EXPECT_EQ(a.num_free_pages(), 16);
  for (int32_t p = 0; p < 16; ++p) EXPECT_EQ(a.refcount(p), 0);
}

TEST(PageAllocatorShared, CopyOnWriteRespectsTheFreePageCountAndDrops) {
  PageAllocator a(3, 4);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 6));
  a.fork(1, 2);
  ASSERT_TRUE(a.append(1, 1));  // copies the partial page: the third page
  EXPECT_FALSE(a.append(2, 3)) << "no page left for the copy";
  EXPECT_EQ(a.seq_len(2), 6) << "a failed append changes nothing";
  EXPECT_EQ(a.take_copies().size(), 1u);
  // A shared page dropped by one holder stays with the other.
  const int32_t first = a.block_table(1)[0];
  EXPECT_EQ(a.drop_range(2, 0, 4), 1);
  EXPECT_EQ(a.refcount(first), 1);
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_THROW(a.fork(2, 5), Error) << "a sequence with dropped pages cannot be forked";
  EXPECT_THROW(a.fork(1, 2), Error) << "the child exists";
  EXPECT_THROW(a.fork(9, 6), Error) << "unknown parent";
  a.release(2);
  a.release(1);
  EXPECT_EQ(a.num_free_pages(), 3);
}

// ---- the prefix cache ----

std::vector<int32_t> tokens(int n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + i;
  return t;
}

TEST(PrefixCache, ARepeatedPromptReusesItsFullPagesAndLeavesOneTokenToCompute) {
  PageAllocator a(16, 4, /*prefix_caching=*/true);
  const auto p = tokens(10, 100);
  a.admit(1);
  EXPECT_EQ(a.match_prefix(1, p.data(), 10), 0) << "cold cache";
  ASSERT_TRUE(a.append(1, 10));
  a.cache_prompt(1, p.data(), 10);
  EXPECT_EQ(a.num_cached_pages(), 2) << "full pages only";
  const std::vector<int32_t> first = a.block_table(1);
  a.release(1);
  EXPECT_EQ(a.num_free_pages(), 16) << "unreferenced cached pages count as free";
  EXPECT_EQ(a.num_evictable_pages(), 2);
  a.admit(2);
  EXPECT_EQ(a.match_prefix(2, p.data(), 10), 8);
  EXPECT_EQ(a.seq_len(2), 8);
  EXPECT_EQ(a.block_table(2)[0], first[0]);
  EXPECT_EQ(a.block_table(2)[1], first[1]);
  EXPECT_EQ(a.refcount(first[0]), 1);
  ASSERT_TRUE(a.append(2, 2));
  // A page-aligned prompt keeps its last page to compute (the prefill must produce logits).
  const auto aligned = tokens(8, 100);
  a.admit(3);
  EXPECT_EQ(a.match_prefix(3, aligned.data(), 8), 4);
  a.release(3);
  a.admit(3);
  EXPECT_EQ(a.match_prefix(3, p.data(), 10, /*max_reuse=*/7), 4) << "at most 7 tokens: one whole page";
  // A different first page matches nothing, though its second page's tokens are the same.
  auto other = p;
  other[0] = 7;
  a.admit(4);
  EXPECT_EQ(a.match_prefix(4, other.data(), 10), 0);
  const auto& st = a.prefix_stats();
  EXPECT_EQ(st.queried_tokens, 48u);
  EXPECT_EQ(st.hit_tokens, 16u);
  for (uint64_t s : {2, 3, 4}) a.release(s);
  EXPECT_EQ(a.num_free_pages(), 16);
}

TEST(PrefixCache, EvictsLeastRecentlyUsedTailsFirstWhenPagesRunOut) {
  PageAllocator a(6, 2, /*prefix_caching=*/true);
  const auto p = tokens(7, 1), q = tokens(7, 50);
  for (uint64_t s : {1, 2}) {
    const auto& t = s == 1 ? p : q;
    a.admit(s);
    ASSERT_EQ(a.match_prefix(s, t.data(), 7), 0);
    ASSERT_TRUE(a.append(s, 6));  // 3 full pages each: the whole pool
    a.cache_prompt(s, t.data(), 6);
    a.release(s);
  }
  EXPECT_EQ(a.num_cached_pages(), 6);
  EXPECT_EQ(a.num_evictable_pages(), 6);
  // A new prompt needing 2 pages evicts prompt 1's last two pages (least recently used, tails first).
  const auto r = tokens(4, 90);
  a.admit(3);
  ASSERT_TRUE(a.append(3, 4));
  EXPECT_EQ(a.prefix_stats().evicted_pages, 2u);
  // Prompt 1 now matches only its first page; prompt 2 all three of its pages (at most 6 of its 7 tokens).
  a.admit(4);
  EXPECT_EQ(a.match_prefix(4, p.data(), 7), 2);
  a.admit(5);
  EXPECT_EQ(a.match_prefix(5, q.data(), 7), 6);
  EXPECT_EQ(a.num_free_pages(), 0);
  EXPECT_FALSE(a.append(4, 2)) << "every page is held";
  for (uint64_t s : {3, 4, 5}) a.release(s);
  EXPECT_EQ(a.num_free_pages(), 6);
}

TEST(PrefixCache, AnEvictedPageNeverMatchesThroughItsReusedIdAndOffMeansOff) {
  PageAllocator a(2, 2, /*prefix_caching=*/true);
  const auto p = tokens(5, 1);
  a.admit(1);
  ASSERT_TRUE(a.append(1, 4));
  a.cache_prompt(1, p.data(), 4);
  a.release(1);
  // Re-use page ids for other content, published too: [9, 9] then prompt 1's second page tokens.
  std::vector<int32_t> other = {9, 9, 3, 4, 0};
  a.admit(2);
  ASSERT_TRUE(a.append(2, 4));
  a.cache_prompt(2, other.data(), 4);
  a.release(2);
  a.admit(3);
  EXPECT_EQ(a.match_prefix(3, p.data(), 5), 0) << "prompt 1's pages were evicted";
  a.release(3);
  a.admit(4);
  EXPECT_EQ(a.match_prefix(4, other.data(), 5), 4);
  a.release(4);

  PageAllocator off(4, 2);
  off.admit(1);
  ASSERT_TRUE(off.append(1, 4));
  off.cache_prompt(1, p.data(), 4);
  EXPECT_EQ(off.num_cached_pages(), 0);
  off.release(1);
  off.admit(2);
  EXPECT_EQ(off.match_prefix(2, p.data(), 5), 0);
  EXPECT_EQ(off.prefix_stats().queried_tokens, 0u);
  EXPECT_EQ(off.num_free_pages(), 4);
}

TEST(PrefixCache, BadInputIsRefused) {
  PageAllocator a(4, 2, true);
  const auto p = tokens(4, 1);
  EXPECT_THROW(a.match_prefix(1, p.data(), 4), Error) << "unknown sequence";
  a.admit(1);
  ASSERT_TRUE(a.append(1, 2));
  EXPECT_THROW(a.match_prefix(1, p.data(), 4), Error) << "holds tokens already";
  EXPECT_THROW(a.cache_prompt(1, p.data(), 3), Error) << "more tokens than the sequence holds";
  EXPECT_THROW(a.refcount(4), Error);
  EXPECT_THROW(a.refcount(-1), Error);
}

// Random fork / prefix / append / drop / release traffic against an independent count of the holders of each page:
// every page is held exactly by the sequences whose block tables list it, and all come back at the end.
TEST(PrefixCache, RefcountsMatchTheBlockTablesUnderRandomTraffic) {
  std::mt19937 rng(7);
  PageAllocator a(48, 4, true);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(tokens(6 + 5 * i, 1000 * i));
  std::map<uint64_t, int> prompt_of;
  uint64_t next = 1;
  for (int op = 0; op < 3000; ++op) {
    const int kind = static_cast<int>(rng() % 5);
    if (kind == 0 || prompt_of.empty()) {
      const int pi = static_cast<int>(rng() % prompts.size());
      const auto& t = prompts[static_cast<size_t>(pi)];
      a.admit(next);
      const int hit = a.match_prefix(next, t.data(), static_cast<int>(t.size()));
      if (!a.append(next, static_cast<int>(t.size()) - hit)) {
        a.release(next++);
        continue;
      }
      a.cache_prompt(next, t.data(), static_cast<int>(t.size()));
      prompt_of[next++] = pi;
    } else {
      auto it = std::next(prompt_of.begin(), static_cast<long>(rng() % prompt_of.size()));
      if (kind == 1) {
        a.release(it->first);
        prompt_of.erase(it);
      } else if (kind == 2) {
        a.append(it->first, 1 + static_cast<int>(rng() % 3));
      } else if (kind == 3 && a.held_pages(it->first) == static_cast<int>(a.block_table(it->first).size())) {
        a.fork(it->first, next);
        prompt_of[next++] = it->second;
      } else {
        a.drop_range(it->first, 0, static_cast<int>(rng() % 9));
      }
    }
    a.take_copies();
    std::map<int32_t, int> holders;
    for (const auto& [s, pi] : prompt_of)
      for (int32_t p : a.block_table(s))
        if (p >= 0) ++holders[p];
    int held = 0;
    for (int32_t p = 0; p < 48; ++p) {
      ASSERT_EQ(a.refcount(p), holders.count(p) ? holders[p] : 0) << "page " << p << " after op " << op;
      held += a.refcount(p) > 0;
    }
    ASSERT_EQ(a.num_free_pages(), 48 - held) << "after op " << op;
  }
  for (const auto& [s, pi] : prompt_of) a.release(s);
  EXPECT_EQ(a.num_free_pages(), 48);
  EXPECT_GT(a.prefix_stats().hit_tokens, 0u);
  EXPECT_GT(a.prefix_stats().evicted_pages, 0u);
}

}  // namespace
}  // namespace spade

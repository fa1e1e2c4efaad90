#include "common/page_allocator.h"

#include <algorithm>
#include <functional>

#include "common/error.h"

namespace spade {

PageAllocator::PageAllocator(int num_pages, int page_size) : num_pages_(num_pages), page_size_(page_size) {
  SPADE_CHECK(num_pages > 0, "PageAllocator: num_pages must be positive, got {}", num_pages);
  SPADE_CHECK(page_size > 0, "PageAllocator: page_size must be positive, got {}", page_size);
  runs_.emplace(0, num_pages);
  num_free_ = num_pages;
}

bool PageAllocator::is_free(int32_t page) const {
  auto it = runs_.upper_bound(page);
  if (it == runs_.begin()) return false;
  --it;
  return page < it->first + it->second;
}

void PageAllocator::take(int32_t page) {
  auto it = std::prev(runs_.upper_bound(page));
  const int32_t first = it->first, len = it->second;
  runs_.erase(it);
  if (page > first) runs_.emplace(first, page - first);
  if (page + 1 < first + len) runs_.emplace(page + 1, first + len - page - 1);
  --num_free_;
}

void PageAllocator::give(int32_t page) {
  int32_t first = page, len = 1;
  auto next = runs_.find(page + 1);
  if (next != runs_.end()) {
    len += next->second;
    runs_.erase(next);
  }
  auto it = runs_.lower_bound(page);
  if (it != runs_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == page) {
      first = prev->first;
      len += prev->second;
      runs_.erase(prev);
    }
  }
  runs_.emplace(first, len);
  ++num_free_;
}

int32_t PageAllocator::choose_run(int need) const {
  const int grow = std::max(need, kGrowRun);
  auto best = runs_.end();
  for (auto it = runs_.begin(); it != runs_.end(); ++it)
    if (it->second >= grow) return it->first;  // rule 2
  for (auto it = runs_.begin(); it != runs_.end(); ++it) {
    if (it->second >= need) return it->first;  // rule 3
    if (best == runs_.end() || it->second > best->second) best = it;
  }
  return best->first;  // rule 4 (runs_ is not empty: the caller checked num_free_)
}

void PageAllocator::admit(uint64_t seq) {
  SPADE_CHECK(!seqs_.count(seq), "PageAllocator: sequence {} is already admitted", seq);
  seqs_.emplace(seq, Seq{});
}

const PageAllocator::Seq& PageAllocator::get(uint64_t seq) const {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  return it->second;
}

bool PageAllocator::append(uint64_t seq, int n) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  SPADE_CHECK(n >= 0, "PageAllocator: cannot append {} tokens", n);
  Seq& s = it->second;
  int need = pages_for(s.len + n) - static_cast<int>(s.pages.size());
  if (need > num_free_) return false;
  while (need > 0) {
    const int32_t last = s.pages.empty() ? -1 : s.pages.back();
    int32_t p = (last >= 0 && last + 1 < num_pages_ && is_free(last + 1)) ? last + 1 : choose_run(need);  // rule 1
    // Take consecutive pages from p while they are free and needed.
    while (need > 0 && p < num_pages_ && is_free(p)) {
      take(p);
      s.pages.push_back(p++);
      --need;
    }
  }
  s.len += n;
  return true;
}

void PageAllocator::release(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t p : it->second.pages)
    if (p >= 0) give(p);
  seqs_.erase(it);
}

int PageAllocator::drop_range(uint64_t seq, int begin, int end) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  Seq& s = it->second;
  int freed = 0;
  const int first = (std::max(begin, 0) + page_size_ - 1) / page_size_;  // first page starting at or after begin
  const int last = std::min(end, s.len) / page_size_;                     // pages ending at or before end
  for (int p = first; p < last && p < static_cast<int>(s.pages.size()); ++p) {
    if (s.pages[p] < 0) continue;
    give(s.pages[p]);
    s.pages[p] = -1;
    ++freed;
  }
  return freed;
}

int PageAllocator::held_pages(uint64_t seq) const {
  int n = 0;
  for (int32_t p : get(seq).pages) n += p >= 0;
  return n;
}

const std::vector<int32_t>& PageAllocator::block_table(uint64_t seq) const { return get(seq).pages; }

int PageAllocator::seq_len(uint64_t seq) const { return get(seq).len; }

std::pair<int32_t, int> PageAllocator::locate(uint64_t seq, int pos) const {
  const Seq& s = get(seq);
  SPADE_CHECK(pos >= 0 && pos < s.len, "PageAllocator: position {} outside sequence {} of length {}", pos, seq, s.len);
  SPADE_CHECK(s.pages[pos / page_size_] >= 0, "PageAllocator: position {} of sequence {} is on a dropped page", pos,
              seq);
  return {s.pages[pos / page_size_], pos % page_size_};
}

}  // namespace spade

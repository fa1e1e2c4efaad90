#include "common/page_allocator.h"

#include <algorithm>
#include <functional>

#include "common/error.h"

namespace spade {

PageAllocator::PageAllocator(int num_pages, int page_size) : num_pages_(num_pages), page_size_(page_size) {
  SPADE_CHECK(num_pages > 0, "PageAllocator: num_pages must be positive, got {}", num_pages);
  SPADE_CHECK(page_size > 0, "PageAllocator: page_size must be positive, got {}", page_size);
  free_.reserve(num_pages);
  for (int p = 0; p < num_pages; ++p) free_.push_back(p);  // ascending ids: already a valid min-heap
}

void PageAllocator::push_free(int32_t page) {
  free_.push_back(page);
  std::push_heap(free_.begin(), free_.end(), std::greater<>{});
}

int32_t PageAllocator::pop_free() {
  std::pop_heap(free_.begin(), free_.end(), std::greater<>{});
  const int32_t page = free_.back();
  free_.pop_back();
  return page;
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
  const int need = pages_for(s.len + n) - static_cast<int>(s.pages.size());
  if (need > static_cast<int>(free_.size())) return false;
  for (int i = 0; i < need; ++i) s.pages.push_back(pop_free());
  s.len += n;
  return true;
}

void PageAllocator::release(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t p : it->second.pages)
    if (p >= 0) push_free(p);
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
    push_free(s.pages[p]);
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

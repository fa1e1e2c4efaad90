#include "common/page_allocator.h"

#include <algorithm>
#include <functional>

#include "common/error.h"

namespace spade {

PageAllocator::PageAllocator(int num_pages, int page_size, bool prefix_caching)
    : num_pages_(num_pages), page_size_(page_size), prefix_caching_(prefix_caching) {
  SPADE_CHECK(num_pages > 0, "PageAllocator: num_pages must be positive, got {}", num_pages);
  SPADE_CHECK(page_size > 0, "PageAllocator: page_size must be positive, got {}", page_size);
  runs_.emplace(0, num_pages);
  num_free_ = num_pages;
  refs_.assign(static_cast<size_t>(num_pages), 0);
  serials_.assign(static_cast<size_t>(num_pages), 0);
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
  serials_[static_cast<size_t>(page)] = next_page_serial_++;
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

int32_t PageAllocator::take_any(int need, int32_t after) {
  int32_t p;
  if (num_free_ > 0) {
    p = (after >= 0 && after + 1 < num_pages_ && is_free(after + 1)) ? after + 1 : choose_run(need);  // rules 1-4
    take(p);
  } else {  // no free run: evict the least recently used unreferenced cached page
    SPADE_CHECK(!lru_.empty(), "PageAllocator: no page to take (caller checked num_free_pages)");
    p = lru_.front();
    uncache(p);
    ++prefix_stats_.evicted_pages;
    serials_[static_cast<size_t>(p)] = next_page_serial_++;  // new content from here on
  }
  refs_[static_cast<size_t>(p)] = 1;
  return p;
}

void PageAllocator::ref(int32_t page) {
  int32_t& r = refs_[static_cast<size_t>(page)];
  if (r == 0) {
    auto it = cached_.find(page);
    SPADE_CHECK(it != cached_.end(), "PageAllocator: page {} is free", page);
    lru_.erase(it->second.lru);
  }
  ++r;
}

void PageAllocator::unref(int32_t page) {
  int32_t& r = refs_[static_cast<size_t>(page)];
  SPADE_CHECK(r > 0, "PageAllocator: page {} released more often than held", page);
  if (--r > 0) return;
  auto it = cached_.find(page);
  if (it == cached_.end()) {
    give(page);
    return;
  }
  lru_.push_back(page);
  it->second.lru = std::prev(lru_.end());
}

void PageAllocator::uncache(int32_t page) {
  auto it = cached_.find(page);
  if (it == cached_.end()) return;
  if (refs_[static_cast<size_t>(page)] == 0) lru_.erase(it->second.lru);
  auto [b, e] = by_hash_.equal_range(it->second.hash);
  for (auto h = b; h != e; ++h)
    if (h->second == page) {
      by_hash_.erase(h);
      break;
    }
  cached_.erase(it);
}

bool PageAllocator::append(uint64_t seq, int n) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  SPADE_CHECK(n >= 0, "PageAllocator: cannot append {} tokens", n);
  Seq& s = it->second;
  // Copy-on-write: the partly filled last page is also another sequence's (fork).
  const bool cow = n > 0 && s.len % page_size_ != 0 && !s.pages.empty() && s.pages.back() >= 0 &&
                   refs_[static_cast<size_t>(s.pages.back())] > 1;
  int need = pages_for(s.len + n) - static_cast<int>(s.pages.size());
  if (need + (cow ? 1 : 0) > num_free_pages()) return false;
  if (cow) {
    const int32_t shared = s.pages.back();
    const int32_t before = s.pages.size() > 1 ? s.pages[s.pages.size() - 2] : -1;
    const int32_t p = take_any(need + 1, before);
    copies_.push_back({shared, p, s.len % page_size_});
    unref(shared);
    s.pages.back() = p;
  }
  while (need > 0) {
    const int32_t last = s.pages.empty() ? -1 : s.pages.back();
    if (num_free_ == 0) {  // only evictable cached pages are left
      s.pages.push_back(take_any(need, last));
      --need;
      continue;
    }
    int32_t p = (last >= 0 && last + 1 < num_pages_ && is_free(last + 1)) ? last + 1 : choose_run(need);  // rule 1
    // Take consecutive pages from p while they are free and needed.
    while (need > 0 && p < num_pages_ && is_free(p)) {
      take(p);
      refs_[static_cast<size_t>(p)] = 1;
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
  // Last page first: of a published chain the later, more specific pages become least recently used and are evicted
  // before the prefix they extend (whose loss would make them unreachable anyway).
  const std::vector<int32_t>& pages = it->second.pages;
  for (auto p = pages.rbegin(); p != pages.rend(); ++p)
    if (*p >= 0) unref(*p);
  seqs_.erase(it);
}

int PageAllocator::drop_range(uint64_t seq, int begin, int end) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  Seq& s = it->second;
  int freed = 0;
  const int first = (std::max(begin, 0) + page_size_ - 1) / page_size_;  // first page starting at or after begin
  const int last = std::min({end, s.len, static_cast<int>(s.pages.size()) * page_size_}) / page_size_;
  // Last page first, as release() does: of a published chain the tail is evicted before the prefix it extends.
  for (int p = last - 1; p >= first; --p) {
    if (s.pages[p] < 0) continue;
    unref(s.pages[p]);
    s.pages[p] = -1;
    ++freed;
  }
  return freed;
}

void PageAllocator::truncate(uint64_t seq, int tokens) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  Seq& s = it->second;
  SPADE_CHECK(tokens >= 0 && tokens <= s.len, "PageAllocator: cannot shorten sequence {} of length {} to {} tokens", seq,
              s.len, tokens);
  const size_t keep = static_cast<size_t>(pages_for(tokens));
  while (s.pages.size() > keep) {  // last page first, as release() does
    if (s.pages.back() >= 0) unref(s.pages.back());
    s.pages.pop_back();
  }
  s.len = tokens;
}

int PageAllocator::held_pages(uint64_t seq) const {
  int n = 0;
  for (int32_t p : get(seq).pages) n += p >= 0;
  return n;
}

void PageAllocator::fork(uint64_t parent, uint64_t child) {
  const Seq& p = get(parent);
  SPADE_CHECK(!seqs_.count(child), "PageAllocator: sequence {} is already admitted", child);
  for (int32_t page : p.pages)
    SPADE_CHECK(page >= 0, "PageAllocator: cannot fork sequence {}: it has dropped pages", parent);
  Seq c = p;  // copied before the insert, which may rehash
  for (int32_t page : c.pages) ref(page);
  seqs_.emplace(child, std::move(c));
}

void PageAllocator::fork_prefix(uint64_t parent, uint64_t child, int tokens) {
  const Seq& p = get(parent);
  SPADE_CHECK(!seqs_.count(child), "PageAllocator: sequence {} is already admitted", child);
  SPADE_CHECK(tokens > 0 && tokens <= p.len, "PageAllocator: cannot share {} tokens of sequence {} of length {}",
              tokens, parent, p.len);
  Seq c;
  c.pages.assign(p.pages.begin(), p.pages.begin() + pages_for(tokens));
  c.len = tokens;
  for (int32_t page : c.pages)
    SPADE_CHECK(page >= 0, "PageAllocator: cannot share tokens of sequence {}: a page among them was dropped", parent);
  for (int32_t page : c.pages) ref(page);
  seqs_.emplace(child, std::move(c));
}

uint64_t PageAllocator::page_serial(int32_t page) const {
  SPADE_CHECK(page >= 0 && page < num_pages_, "PageAllocator: page {} outside [0, {})", page, num_pages_);
  return serials_[static_cast<size_t>(page)];
}

std::vector<PageAllocator::PageCopy> PageAllocator::take_copies() {
  std::vector<PageCopy> out;
  out.swap(copies_);
  return out;
}

int PageAllocator::refcount(int32_t page) const {
  SPADE_CHECK(page >= 0 && page < num_pages_, "PageAllocator: page {} outside [0, {})", page, num_pages_);
  return refs_[static_cast<size_t>(page)];
}

uint64_t PageAllocator::key_hash(uint64_t prev_serial, const int32_t* tokens) const {
  // FNV-1a, 64 bit, over the previous page's serial and the page's token ids (keys are compared exactly on a hit).
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(prev_serial);
  for (int i = 0; i < page_size_; ++i) mix(static_cast<uint32_t>(tokens[i]));
  return h;
}

int32_t PageAllocator::lookup(uint64_t prev_serial, const int32_t* tokens) const {
  auto [b, e] = by_hash_.equal_range(key_hash(prev_serial, tokens));
  for (auto it = b; it != e; ++it) {
    const CachedPage& c = cached_.at(it->second);
    if (c.prev_serial == prev_serial && std::equal(c.tokens.begin(), c.tokens.end(), tokens)) return it->second;
  }
  return -1;
}

int PageAllocator::match_prefix(uint64_t seq, const int32_t* tokens, int n, int max_reuse) {
  auto it = seqs_.find(seq);
  SPADE_CHECK(it != seqs_.end(), "PageAllocator: unknown sequence {}", seq);
  Seq& s = it->second;
  SPADE_CHECK(s.len == 0 && s.pages.empty(), "PageAllocator: match_prefix on sequence {} that holds tokens", seq);
  SPADE_CHECK(n >= 0 && (n == 0 || tokens != nullptr), "PageAllocator: match_prefix with {} tokens", n);
  if (!prefix_caching_) return 0;
  prefix_stats_.queried_tokens += static_cast<uint64_t>(n);
  if (n <= 1) return 0;
  uint64_t prev = 0;
  for (int i = 0; i < std::min(n - 1, max_reuse) / page_size_; ++i) {
    const int32_t p = lookup(prev, tokens + static_cast<size_t>(i) * page_size_);
    if (p < 0) break;
    ref(p);
    s.pages.push_back(p);
    prev = cached_.at(p).serial;
  }
  s.len = static_cast<int>(s.pages.size()) * page_size_;
  prefix_stats_.hit_tokens += static_cast<uint64_t>(s.len);
  return s.len;
}

int PageAllocator::published_run(const std::vector<std::pair<int32_t, uint64_t>>& pages) const {
  int run = 0;
  for (const auto& [page, serial] : pages) {
    if (page_serial(page) != serial || !is_published(page)) break;
    ++run;
  }
  return run;
}

std::vector<int32_t> PageAllocator::peek_prefix(const int32_t* tokens, int n, int max_reuse) const {
  std::vector<int32_t> pages;
  if (!prefix_caching_ || n <= 1 || tokens == nullptr) return pages;
  uint64_t prev = 0;
  for (int i = 0; i < std::min(n - 1, max_reuse) / page_size_; ++i) {
    const int32_t p = lookup(prev, tokens + static_cast<size_t>(i) * page_size_);
    if (p < 0) break;
    pages.push_back(p);
    prev = cached_.at(p).serial;
  }
  return pages;
}

void PageAllocator::cache_prompt(uint64_t seq, const int32_t* tokens, int n) {
  if (!prefix_caching_) return;
  const Seq& s = get(seq);
  SPADE_CHECK(n >= 0 && n <= s.len, "PageAllocator: cache_prompt of {} tokens on sequence {} of length {}", n, seq,
              s.len);
  uint64_t prev = 0;
  for (int i = 0; i < n / page_size_; ++i) {
    const int32_t p = s.pages[static_cast<size_t>(i)];
    if (p < 0) return;  // a dropped page breaks the chain
    const int32_t* t = tokens + static_cast<size_t>(i) * page_size_;
    if (auto c = cached_.find(p); c != cached_.end()) {
      prev = c->second.serial;
      continue;
    }
    if (const int32_t same = lookup(prev, t); same >= 0) {  // the same content is published already: keep this private
      prev = cached_.at(same).serial;
      continue;
    }
    CachedPage c;
    c.serial = next_serial_++;
    c.prev_serial = prev;
    c.hash = key_hash(prev, t);
    c.tokens.assign(t, t + page_size_);
    by_hash_.emplace(c.hash, p);
    prev = c.serial;
    cached_.emplace(p, std::move(c));
  }
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

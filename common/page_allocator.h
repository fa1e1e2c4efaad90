// Paged KV-cache bookkeeping: a fixed pool of pages, a free list, and one block table per sequence.
//
// The same design serves the CPU KV store, the GPU KV pool and the cache rank's store; only the storage differs.
// A page holds `page_size` consecutive token slots of one sequence (for every layer and KV head: storage is
// [num_layers][num_pages, page_size, num_kv_heads, head_dim], see kernels/paged_attention_ref.h).
//
// Placement: the free pages are kept as coalesced runs of consecutive ids, and pages are placed so that a sequence's
// pages form few, long, ascending runs, because the decode kernels then read its K/V in address order and touch few
// 2 MiB regions (docs/KERNELS.md section 7.1 measured on an H100 at B=8 T=32k: randomly placed pages cost 1.6-2.2% of
// decode time against contiguous ones, mostly from the 2 MiB regions a sequence spans). Each page of an append is,
// in this order of preference:
//   1. the page right after the sequence's last page, if free (the sequence's run grows);
//   2. the first page of the lowest free run at least max(pages still needed, kGrowRun) long (room to grow);
//   3. the first page of the lowest free run at least as long as the pages still needed;
//   4. the first page of the longest free run (lowest on ties): a large append is split over the fewest runs.
// O(number of free runs) per run chosen, O(log n) per page. Callers must not rely on any particular page id.
// Not thread-safe: owned by one scheduler thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace spade {

class PageAllocator {
 public:
  /// Throws spade::Error when num_pages or page_size is not positive.
  PageAllocator(int num_pages, int page_size);

  int page_size() const { return page_size_; }
  int num_pages() const { return num_pages_; }
  /// Free runs this long or longer are preferred when a sequence starts a new run (rule 2 of the placement).
  static constexpr int kGrowRun = 8;

  int num_free_pages() const { return num_free_; }
  /// Number of runs of consecutive free pages (fragmentation of the free space).
  int num_free_runs() const { return static_cast<int>(runs_.size()); }
  /// Fraction of pages in use, 0..1 (vLLM's kv_cache_usage_perc / 100).
  double usage() const { return 1.0 - static_cast<double>(num_free_) / num_pages_; }
  /// Pages needed to hold `tokens` tokens.
  int pages_for(int tokens) const { return (tokens + page_size_ - 1) / page_size_; }

  /// Registers a new sequence with no tokens. Throws spade::Error if `seq` already exists.
  void admit(uint64_t seq);
  bool contains(uint64_t seq) const { return seqs_.count(seq) != 0; }
  /// Grows `seq` by `n` tokens, taking pages from the free list as needed. Returns false and changes nothing when
  /// the pool has too few free pages. Throws spade::Error for an unknown sequence.
  bool append(uint64_t seq, int n);
  /// Returns every page of `seq` to the free list and forgets it. Unknown sequences are ignored (idempotent).
  void release(uint64_t seq);
  /// Frees the pages of `seq` that lie entirely inside token range [begin, end) (a sparse sequence no longer needs
  /// them locally: its cache rank holds them). Their block-table entries become -1; the table keeps its length and
  /// later appends continue after it. Returns the number of pages freed.
  int drop_range(uint64_t seq, int begin, int end);
  /// Pages of `seq` currently held (block-table entries that are not -1).
  int held_pages(uint64_t seq) const;

  /// Page ids of `seq` in token order. Throws spade::Error for an unknown sequence.
  const std::vector<int32_t>& block_table(uint64_t seq) const;
  /// Tokens currently held by `seq`. Throws spade::Error for an unknown sequence.
  int seq_len(uint64_t seq) const;
  /// (page id, slot) of token `pos` of `seq`. Throws for a position outside the sequence or on a dropped page.
  std::pair<int32_t, int> locate(uint64_t seq, int pos) const;

 private:
  struct Seq {
    std::vector<int32_t> pages;
    int len = 0;
  };
  const Seq& get(uint64_t seq) const;
  bool is_free(int32_t page) const;
  void take(int32_t page);        // page must be free
  void give(int32_t page);        // page must be held
  int32_t choose_run(int need) const;  // first page of the run rule 2-4 picks
  int num_pages_;
  int page_size_;
  int num_free_ = 0;
  std::map<int32_t, int32_t> runs_;  // free runs: first page -> length, coalesced (no two runs touch)
  std::unordered_map<uint64_t, Seq> seqs_;
};

}  // namespace spade

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
//
// Shared pages (reference counts). A page may be held by several sequences: fork() gives a new sequence the pages of
// an existing one (n samples of one prompt: the prompt's KV is stored once), and the prefix cache hands a new
// sequence the cached pages of its prompt's longest cached prefix. Every held page has a reference count; a page
// returns to the pool when its last holder releases (or drops) it. Copy-on-write: an append into a partly filled
// page that another sequence also holds first moves the appending sequence to a fresh page; the caller must copy the
// shared page's first `slots` token slots (every layer, K and V) from `src` to `dst` before writing the new token —
// take_copies() lists those copies in order (vLLM's block manager does the same).
//
// Prefix cache (automatic prefix caching, vLLM-style; on when constructed with prefix_caching = true). A FULL page of
// a sequence can be published with cache_prompt(): it is keyed by its tokens and the page that precedes it (a hash
// chain over the token ids, the key of page i depending on pages 0..i), so a page is reused only after the exact same
// preceding tokens. A published page whose last holder released it is not freed but kept, unreferenced, in LRU order;
// it still counts as free (num_free_pages, usage), and an append that finds no free page evicts the least recently
// used one. match_prefix() shares the cached pages of the longest cached prefix of a new sequence's prompt (whole
// pages; at least one prompt token is always left to compute, so that the prefill yields the next token's logits).
// Keys are exact (tokens compared, not only hashed): a hash collision cannot hand out the wrong KV. The cache holds
// token ids only; the KV in the pages is the caller's, written by the prefill that filled them, so one allocator (one
// pool) must serve one model. Not thread-safe: owned by one scheduler thread.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace spade {

class PageAllocator {
 public:
  /// Throws spade::Error when num_pages or page_size is not positive. `prefix_caching`: keep published full pages for
  /// reuse by later sequences (see the header comment); off, cache_prompt() publishes nothing and match_prefix()
  /// reuses nothing.
  PageAllocator(int num_pages, int page_size, bool prefix_caching = false);

  int page_size() const { return page_size_; }
  int num_pages() const { return num_pages_; }
  /// Free runs this long or longer are preferred when a sequence starts a new run (rule 2 of the placement).
  static constexpr int kGrowRun = 8;

  /// Pages a new append may take: the free runs plus the unreferenced cached pages it may evict.
  int num_free_pages() const { return num_free_ + static_cast<int>(lru_.size()); }
  /// Number of runs of consecutive free pages (fragmentation of the free space).
  int num_free_runs() const { return static_cast<int>(runs_.size()); }
  /// Fraction of pages in use, 0..1 (vLLM's kv_cache_usage_perc / 100).
  double usage() const { return 1.0 - static_cast<double>(num_free_pages()) / num_pages_; }
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
  /// later appends continue after it. Published pages join the prefix cache's LRU list last page first (as with
  /// release), so eviction takes a chain's tail before its head. Returns the number of pages freed.
  int drop_range(uint64_t seq, int begin, int end);
  /// Shortens `seq` to its first `tokens` tokens (0 <= tokens <= its length): the pages past them return to the pool
  /// (or to the prefix cache's LRU list); a partly covered last page stays held. The cache rank's retained prefixes
  /// (pair::PackUpdate::retained). Throws spade::Error for an unknown sequence or tokens out of range.
  void truncate(uint64_t seq, int tokens);
  /// Pages of `seq` currently held (block-table entries that are not -1).
  int held_pages(uint64_t seq) const;

  /// Admits `child` holding the same pages and length as `parent` (which must exist and have no dropped page; `child`
  /// must not exist): both reference every page; an append into the shared last partial page copies it first
  /// (take_copies). Throws spade::Error otherwise.
  void fork(uint64_t parent, uint64_t child);
  /// Admits `child` holding the pages of `parent` that cover its first `tokens` tokens (0 < tokens <= parent's
  /// length), with length `tokens`: a sequence whose leading KV is the same as another's (the cache rank's shared
  /// INIT). A partly covered last page is shared too and copied on `child`'s first append (take_copies). Throws
  /// spade::Error for an unknown parent, an existing child, tokens out of range or a dropped page among them.
  void fork_prefix(uint64_t parent, uint64_t child, int tokens);
  /// A copy the caller must make before writing into `dst`: token slots [0, slots) of page `src` to page `dst`.
  struct PageCopy {
    int32_t src = -1, dst = -1;
    int slots = 0;
  };
  /// The copies appends made since the last call, in order (copy-on-write of shared partial pages).
  std::vector<PageCopy> take_copies();
  /// Sequences holding `page` (0: free or cached and unreferenced). Throws for a page id out of range.
  int refcount(int32_t page) const;
  /// A number that changes whenever `page` is given new content (taken from the free pool, or evicted from the prefix
  /// cache and reused), never reused: while a page keeps its serial, the token slots written into it keep their KV.
  /// So two sequences whose block tables show the same (page, serial) at a full page hold the same KV there, however
  /// they came to hold it (fork, prefix-cache hit). 0 for a page never taken. Throws for a page id out of range.
  uint64_t page_serial(int32_t page) const;
  /// Whether `page` is a published prefix-cache page (held or not; a later prompt may still match it).
  bool is_published(int32_t page) const { return cached_.count(page) != 0; }
  /// Of `pages` ((page, page_serial) recorded earlier, in token order), the leading run whose pages still hold that KV
  /// (same serial) and are published: what a later prompt can still match of them (a cache rank's retained prefix).
  int published_run(const std::vector<std::pair<int32_t, uint64_t>>& pages) const;

  /// Prefix cache: `seq` was just admitted (no tokens yet) for a prompt of `n` tokens `tokens`. Shares the cached
  /// pages of the longest cached prefix of the prompt (whole pages, at most min(n - 1, max_reuse) tokens) with `seq`,
  /// whose length becomes the number of tokens reused (returned; the caller computes only the rest). Counts n queried
  /// tokens and the reused ones as hits. Returns 0 and counts nothing with prefix caching off. Throws for an unknown or non-empty
  /// sequence.
  int match_prefix(uint64_t seq, const int32_t* tokens, int n, int max_reuse = 1 << 30);
  /// Prefix cache: the pages match_prefix(seq, tokens, n, max_reuse) would share now, in token order, without sharing
  /// them or counting anything (a caller that may reuse fewer asks first). Empty with prefix caching off.
  std::vector<int32_t> peek_prefix(const int32_t* tokens, int n, int max_reuse = 1 << 30) const;
  /// Prefix cache: publishes the full pages of `seq` that hold tokens [0, n) (`tokens` = its first n token ids, n <=
  /// its length, the KV of those tokens already written) so that later prompts may reuse them. Pages already published
  /// are skipped; a page holding the same key as a published one stays private. No-op with prefix caching off.
  void cache_prompt(uint64_t seq, const int32_t* tokens, int n);
  bool prefix_caching() const { return prefix_caching_; }
  /// Published pages (held or not) and those of them no sequence holds (evictable).
  int num_cached_pages() const { return static_cast<int>(cached_.size()); }
  int num_evictable_pages() const { return static_cast<int>(lru_.size()); }
  /// Since construction: prompt tokens looked up by match_prefix, tokens it reused, cached pages evicted.
  struct PrefixStats {
    uint64_t queried_tokens = 0, hit_tokens = 0, evicted_pages = 0;
  };
  const PrefixStats& prefix_stats() const { return prefix_stats_; }

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
  // A published page: its key is (the serial of the published page before it in the chain, 0 for a first page; its
  // page_size tokens). Serials are never reused, so an evicted page's successors can no longer be matched.
  struct CachedPage {
    uint64_t serial = 0, prev_serial = 0, hash = 0;
    std::vector<int32_t> tokens;
    std::list<int32_t>::iterator lru;  // valid while unreferenced
  };
  const Seq& get(uint64_t seq) const;
  bool is_free(int32_t page) const;
  void take(int32_t page);        // page must be free
  void give(int32_t page);        // page must be held
  int32_t choose_run(int need) const;  // first page of the run rule 2-4 picks
  int32_t take_any(int need, int32_t after);  // a free page (rules 1-4) or, with no free run, the evicted LRU page
  void unref(int32_t page);       // one holder fewer: free it, or keep it evictable when published
  void ref(int32_t page);         // one holder more (a cached page leaves the LRU list)
  void uncache(int32_t page);
  uint64_t key_hash(uint64_t prev_serial, const int32_t* tokens) const;
  int32_t lookup(uint64_t prev_serial, const int32_t* tokens) const;  // the published page with this key, or -1
  int num_pages_;
  int page_size_;
  bool prefix_caching_;
  int num_free_ = 0;
  std::map<int32_t, int32_t> runs_;  // free runs: first page -> length, coalesced (no two runs touch)
  std::unordered_map<uint64_t, Seq> seqs_;
  std::vector<int32_t> refs_;                        // [num_pages] holders per page
  std::unordered_map<int32_t, CachedPage> cached_;   // published pages
  std::unordered_multimap<uint64_t, int32_t> by_hash_;  // key hash -> published page
  std::list<int32_t> lru_;                           // unreferenced published pages, least recently used first
  std::vector<PageCopy> copies_;
  std::vector<uint64_t> serials_;                    // [num_pages] page_serial()
  uint64_t next_page_serial_ = 1;
  uint64_t next_serial_ = 1;
  PrefixStats prefix_stats_;
};

}  // namespace spade

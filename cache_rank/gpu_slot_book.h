// The GPU cache rank's host bookkeeping of the plans it receives (pair/gpu_plan.h; AsyncSpade Sec. 4.1, the cache
// rank's side of the step): which plan slot holds which pages of the KV pool (a PageAllocator over the pool's page
// indices; forks and retained prefixes share pages by reference count), each slot's query- and anchor-window entry
// counts, and the retained prefixes of prefix caching. Host-only, so CPU tests replay an inference rank's plans
// through it; GpuCacheServer (gpu_server.h) applies each plan here first, then does the device side.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/page_allocator.h"
#include "pair/gpu_plan.h"

namespace spade::cache {

class GpuSlotBook {
 public:
  /// `num_pages`, `page_size`: the KV pool's (pages of `page_size` tokens). `max_slots`: the plan slots.
  /// `window_cap`: query-window entries a slot keeps (query_window + 1). `anchor_queries`: A, the anchor window's
  /// entries (0: no prompt anchors). `peer` names the inference rank in errors. Throws spade::Error for a
  /// non-positive size or a negative cap.
  GpuSlotBook(int num_pages, int page_size, int max_slots, int window_cap, int anchor_queries, std::string peer);

  /// Applies `plan`'s bookkeeping in the order gpu_plan.h defines: retains (a slot's leading whole pages kept under a
  /// prefix id), forks (the child slot emptied, then sharing the parent slot's pages and window counts, or a retained
  /// prefix's pages with empty windows), drops (retained prefixes forgotten), releases; then per row: a fresh row's
  /// slot is emptied, an empty slot admitted, the row's q_len tokens appended at position ctx_len - q_len, and its
  /// window counts advanced by q_len (capped; the anchor window's only while its anchors are pending).
  /// `on_empty(slot)` is called for each slot emptied (a release, a fork's child, a fresh row), live or not: the
  /// device side resets what it holds for the slot. Throws spade::Error naming the peer and the step for a plan that
  /// does not match what is held: a fork or retain of tokens the slot or prefix does not hold (or not whole pages),
  /// a retain under a held id, a drop of an unknown prefix, a row continuing at another position, a full pool.
  void apply(const pair::GpuStepPlan& plan, const std::function<void(int slot)>& on_empty);
  /// `slot`'s first selection picked its anchors: its queries no longer go to an anchor window.
  void anchors_picked(int slot);

  /// Pages of `slot` in token order (its block table); empty when the slot holds nothing.
  const std::vector<int32_t>& block_table(int slot) const;
  /// KV pages held by slots and retained prefixes (a shared page once).
  int pages_held() const { return alloc_.num_pages() - alloc_.num_free_pages(); }
  int num_pages() const { return alloc_.num_pages(); }
  int retained() const { return retained_; }         // retained prefixes held
  int live_slots() const;                            // slots holding a sequence
  int tokens(int slot) const;                        // tokens `slot` holds (0 when empty)
  int window_len(int slot) const { return wlen_.at(static_cast<size_t>(slot)); }  // query-window entries
  int anchor_window_len(int slot) const { return awlen_.at(static_cast<size_t>(slot)); }
  bool anchor_pending(int slot) const { return anchor_pending_.at(static_cast<size_t>(slot)) != 0; }

 private:
  static uint64_t retained_key(int32_t id) { return (uint64_t{1} << 32) + static_cast<uint32_t>(id); }
  void forget(int slot, const std::function<void(int)>& on_empty);
  void fork(const pair::GpuPlanFork& f, int64_t step, const std::function<void(int)>& on_empty);
  void retain(const pair::GpuPlanRetain& r, int64_t step);
  void drop(int32_t id, int64_t step);

  int page_size_, window_cap_, anchor_queries_;
  std::string peer_;
  PageAllocator alloc_;
  int retained_ = 0;
  std::vector<char> live_;            // per slot: admitted in alloc_
  std::vector<int> wlen_, awlen_;     // per slot: window / anchor-window entries (the same in every layer)
  std::vector<char> anchor_pending_;  // per slot: its anchors are still to be picked (its queries are pushed)
};

}  // namespace spade::cache

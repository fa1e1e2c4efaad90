// The GPU cache rank's host bookkeeping of its plans (see gpu_slot_book.h).
#include "cache_rank/gpu_slot_book.h"

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace spade::cache {

using pair::GpuPlanRow;
using pair::kRowFresh;

namespace {
int checked_num_pages(int num_pages, int page_size, int max_slots, int window_cap, int anchor_queries) {
  SPADE_CHECK(num_pages >= 1 && page_size >= 1 && max_slots >= 1 && window_cap >= 0 && anchor_queries >= 0,
              "GPU slot book: num_pages {}, page_size {}, max_slots {} must be positive, window_cap {} and "
              "anchor_queries {} non-negative",
              num_pages, page_size, max_slots, window_cap, anchor_queries);
  return num_pages;
}
}  // namespace

GpuSlotBook::GpuSlotBook(int num_pages, int page_size, int max_slots, int window_cap, int anchor_queries,
                         std::string peer)
    : page_size_(page_size), window_cap_(window_cap), anchor_queries_(anchor_queries), peer_(std::move(peer)),
      alloc_(checked_num_pages(num_pages, page_size, max_slots, window_cap, anchor_queries), page_size),
      live_(static_cast<size_t>(std::max(max_slots, 0)), 0), wlen_(live_.size(), 0), awlen_(live_.size(), 0),
      anchor_pending_(live_.size(), anchor_queries > 0 ? 1 : 0) {}

void GpuSlotBook::forget(int slot, const std::function<void(int)>& on_empty) {
  const auto i = static_cast<size_t>(slot);
  if (live_[i]) alloc_.release(static_cast<uint64_t>(slot));
  live_[i] = 0;
  wlen_[i] = 0;
  // A new sequence in this slot picks its own anchors at its first selection; until then its queries go to the
  // anchor window.
  anchor_pending_[i] = anchor_queries_ > 0 ? 1 : 0;
  awlen_[i] = 0;
  on_empty(slot);
}

void GpuSlotBook::fork(const pair::GpuPlanFork& f, int64_t step, const std::function<void(int)>& on_empty) {
  const auto child = static_cast<size_t>(f.child);
  if ((f.flags & pair::kForkFromRetained) != 0) {  // a prefix-cache hit: pages shared, windows empty
    const uint64_t key = retained_key(f.parent);
    const int held = alloc_.contains(key) ? alloc_.seq_len(key) : -1;
    SPADE_CHECK(held >= f.tokens && f.tokens % page_size_ == 0,
                "{}: step {}: slot {} forks from retained prefix {} at {} tokens, but it {} (whole pages of {})", peer_,
                step, f.child, f.parent, f.tokens,
                held < 0 ? std::string("is not held") : "holds " + std::to_string(held), page_size_);
    forget(f.child, on_empty);
    alloc_.fork_prefix(key, static_cast<uint64_t>(f.child), f.tokens);
    live_[child] = 1;
    return;
  }
  const auto parent = static_cast<size_t>(f.parent);
  const int held = live_[parent] ? alloc_.seq_len(static_cast<uint64_t>(f.parent)) : 0;
  SPADE_CHECK(live_[parent] && held == f.tokens && f.tokens % page_size_ == 0,
              "{}: step {}: slot {} forks from slot {} at {} tokens, but that slot holds {} (a fork takes whole "
              "pages: all of the parent's, a multiple of the page size {})",
              peer_, step, f.child, f.parent, f.tokens, held, page_size_);
  forget(f.child, on_empty);
  alloc_.fork_prefix(static_cast<uint64_t>(f.parent), static_cast<uint64_t>(f.child), f.tokens);
  live_[child] = 1;
  wlen_[child] = wlen_[parent];
  anchor_pending_[child] = anchor_pending_[parent];
  awlen_[child] = awlen_[parent];
}

void GpuSlotBook::retain(const pair::GpuPlanRetain& r, int64_t step) {
  const auto slot = static_cast<size_t>(r.slot);
  const int held = live_[slot] ? alloc_.seq_len(static_cast<uint64_t>(r.slot)) : 0;
  SPADE_CHECK(held >= r.tokens && r.tokens % page_size_ == 0 && !alloc_.contains(retained_key(r.id)),
              "{}: step {}: retain of slot {} ({} tokens held) as prefix {} at {} tokens (whole pages of {}, an id "
              "not held already)",
              peer_, step, r.slot, held, r.id, r.tokens, page_size_);
  alloc_.fork_prefix(static_cast<uint64_t>(r.slot), retained_key(r.id), r.tokens);
  ++retained_;
}

void GpuSlotBook::drop(int32_t id, int64_t step) {
  SPADE_CHECK(alloc_.contains(retained_key(id)), "{}: step {}: drop of retained prefix {}, which is not held", peer_,
              step, id);
  alloc_.release(retained_key(id));
  --retained_;
}

void GpuSlotBook::apply(const pair::GpuStepPlan& plan, const std::function<void(int)>& on_empty) {
  for (const pair::GpuPlanRetain& r : plan.retains) retain(r, plan.step);
  for (const pair::GpuPlanFork& f : plan.forks) fork(f, plan.step, on_empty);
  for (int32_t id : plan.drops) drop(id, plan.step);
  for (int32_t slot : plan.released) forget(slot, on_empty);
  for (const GpuPlanRow& r : plan.rows) {
    const size_t slot = static_cast<size_t>(r.slot);
    if ((r.flags & kRowFresh) != 0) forget(r.slot, on_empty);
    if (!live_[slot]) {
      alloc_.admit(static_cast<uint64_t>(r.slot));
      live_[slot] = 1;
    }
    SPADE_CHECK(alloc_.seq_len(static_cast<uint64_t>(r.slot)) == r.ctx_len - r.q_len,
                "{}: step {}: slot {} continues at position {} but this rank holds {} of its tokens", peer_, plan.step,
                r.slot, r.ctx_len - r.q_len, alloc_.seq_len(static_cast<uint64_t>(r.slot)));
    SPADE_CHECK(alloc_.append(static_cast<uint64_t>(r.slot), r.q_len),
                "{}: step {}: the KV pool ({} pages) cannot hold slot {}'s {} new tokens", peer_, plan.step,
                alloc_.num_pages(), r.slot, r.q_len);
  }
  // The windows hold, after this step's push, min(W + 1, len + q_len) queries: the predictor reads that. The anchor
  // window is pushed until the slot's first selection.
  for (const GpuPlanRow& r : plan.rows) {
    const size_t slot = static_cast<size_t>(r.slot);
    const bool fresh = (r.flags & kRowFresh) != 0;
    wlen_[slot] = std::min(window_cap_, (fresh ? 0 : wlen_[slot]) + r.q_len);
    if (anchor_pending_[slot]) awlen_[slot] = std::min(anchor_queries_, (fresh ? 0 : awlen_[slot]) + r.q_len);
  }
}

void GpuSlotBook::anchors_picked(int slot) { anchor_pending_.at(static_cast<size_t>(slot)) = 0; }

const std::vector<int32_t>& GpuSlotBook::block_table(int slot) const {
  static const std::vector<int32_t> kNone;
  return live_.at(static_cast<size_t>(slot)) ? alloc_.block_table(static_cast<uint64_t>(slot)) : kNone;
}

int GpuSlotBook::live_slots() const { return static_cast<int>(std::count(live_.begin(), live_.end(), 1)); }

int GpuSlotBook::tokens(int slot) const {
  return live_.at(static_cast<size_t>(slot)) ? alloc_.seq_len(static_cast<uint64_t>(slot)) : 0;
}

}  // namespace spade::cache

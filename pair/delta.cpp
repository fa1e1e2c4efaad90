// Delta transfer of selections (see delta.h).
#include "pair/delta.h"

#include <algorithm>
#include <cstring>

#include "pair/pack.h"
#include "common/error.h"
#include "kernels/selection_delta_ref.h"

namespace spade::pair {

SelectionMirror::SelectionMirror(int num_kv_heads, int token_budget, int head_dim)
    : heads_(num_kv_heads), budget_(token_budget), head_dim_(head_dim) {
  SPADE_CHECK(num_kv_heads > 0 && token_budget > 0 && head_dim > 0,
              "selection mirror: num_kv_heads {}, token_budget {}, head_dim {} must be positive", num_kv_heads,
              token_budget, head_dim);
}

LayerDelta SelectionMirror::diff(uint64_t seq, int layer, const LayerSelection& full) {
  const size_t table = static_cast<size_t>(heads_) * budget_;
  SPADE_CHECK(full.count >= 0 && full.count <= budget_ && full.positions.size() == table &&
                  full.k.size() == table * head_dim_ && full.v.size() == full.k.size(),
              "selection mirror: selection of sequence {} layer {} has count {} and {} positions, expected <= {} and {}",
              seq, layer, full.count, full.positions.size(), budget_, table);
  std::vector<int32_t>& held = seqs_[seq][layer];
  if (held.empty()) held.assign(table, -1);
  // The slot plan of every KV head (kernels/selection_delta_ref.h; capacity = budget: every entering token is sent).
  slots_.resize(table);
  positions_.resize(table);
  info_.resize(static_cast<size_t>(heads_) * kernels::kDeltaInfoFields);
  kernels::SelectionDeltaRefParams dp;
  dp.indices = full.positions.data();
  dp.mirror = held.data();
  dp.delta_slots = slots_.data();
  dp.delta_positions = positions_.data();
  dp.row_info = info_.data();
  dp.rows = heads_;
  dp.k = budget_;
  dp.capacity = budget_;
  try {
    kernels::selection_delta_ref(dp);
  } catch (const Error& e) {
    seqs_.erase(seq);  // the plan may have half-updated the mirror; the sequence starts over with a full delta
    fail("selection mirror: sequence {} layer {}: {}", seq, layer, e.what());
  }
  LayerDelta d;
  d.count = full.count;
  d.changed.assign(heads_, 0);
  for (int h = 0; h < heads_; ++h) {
    const int32_t* sel = full.positions.data() + static_cast<size_t>(h) * budget_;
    const int m = info_[static_cast<size_t>(h) * kernels::kDeltaInfoFields + kernels::kDeltaEntries];
    SPADE_CHECK(info_[static_cast<size_t>(h) * kernels::kDeltaInfoFields + kernels::kDeltaCount] == full.count,
                "selection mirror: sequence {} layer {} head {} selects {} tokens, its count says {}", seq, layer, h,
                info_[static_cast<size_t>(h) * kernels::kDeltaInfoFields + kernels::kDeltaCount], full.count);
    for (int j = 0; j < m; ++j) {
      const size_t e = static_cast<size_t>(h) * budget_ + j;
      const size_t src =
          (static_cast<size_t>(h) * budget_ + (std::lower_bound(sel, sel + full.count, positions_[e]) - sel)) *
          head_dim_;
      d.slots.push_back(slots_[e]);
      d.positions.push_back(positions_[e]);
      d.k.insert(d.k.end(), full.k.begin() + src, full.k.begin() + src + head_dim_);
      d.v.insert(d.v.end(), full.v.begin() + src, full.v.begin() + src + head_dim_);
    }
    d.changed[h] = m;
  }
  stats_.selected_rows += static_cast<uint64_t>(full.count) * heads_;
  stats_.sent_rows += d.entries();
  ++stats_.layer_selections;
  return d;
}

void SelectionMirror::to_delta(const PackUpdate& u, PackSelection& p) {
  for (uint64_t r : u.released) release(r);
  for (const SeqUpdate& s : u.seqs)
    if (s.init) reset(s.seq_id);
  if (!p.error.empty()) return;
  p.delta = true;
  for (SeqSelection& e : p.seqs) {
    e.deltas.clear();
    e.deltas.reserve(e.layers.size());
    for (size_t i = 0; i < e.layers.size(); ++i)
      e.deltas.push_back(diff(e.seq_id, u.first_layer + static_cast<int>(i), e.layers[i]));
    e.layers.clear();
  }
}

void apply_delta(const LayerDelta& d, LayerSelection& held, int num_kv_heads, int token_budget, int head_dim,
                 const std::string& peer) {
  const size_t table = static_cast<size_t>(num_kv_heads) * token_budget;
  SPADE_CHECK(d.count >= 0 && d.count <= token_budget, "{}: delta selection count {} outside [0, {}]", peer, d.count,
              token_budget);
  SPADE_CHECK(d.changed.size() == static_cast<size_t>(num_kv_heads), "{}: delta has {} head counts, expected {}",
              peer, d.changed.size(), num_kv_heads);
  size_t total = 0;
  for (int32_t c : d.changed) {
    SPADE_CHECK(c >= 0 && c <= d.count, "{}: delta head entry count {} outside [0, {}]", peer, c, d.count);
    total += static_cast<size_t>(c);
  }
  SPADE_CHECK(total == d.slots.size() && total == d.positions.size() && d.k.size() == total * head_dim &&
                  d.v.size() == d.k.size(),
              "{}: delta entry arrays disagree ({} by head counts, {} slots, {} positions, {} K floats)", peer, total,
              d.slots.size(), d.positions.size(), d.k.size());
  size_t e = 0;
  for (int h = 0; h < num_kv_heads; ++h)
    for (int32_t j = 0; j < d.changed[h]; ++j, ++e)
      SPADE_CHECK(d.slots[e] >= 0 && d.slots[e] < d.count, "{}: delta slot {} of head {} outside [0, {})", peer,
                  d.slots[e], h, d.count);
  if (held.positions.size() != table) {
    held.positions.assign(table, -1);
    held.k.assign(table * head_dim, 0.f);
    held.v.assign(table * head_dim, 0.f);
  }
  e = 0;
  for (int h = 0; h < num_kv_heads; ++h) {
    for (int32_t j = 0; j < d.changed[h]; ++j, ++e) {
      const int32_t s = d.slots[e];
      const size_t row = static_cast<size_t>(h) * token_budget + s;
      held.positions[row] = d.positions[e];
      std::memcpy(held.k.data() + row * head_dim, d.k.data() + e * head_dim, head_dim * sizeof(float));
      std::memcpy(held.v.data() + row * head_dim, d.v.data() + e * head_dim, head_dim * sizeof(float));
    }
    int32_t* slot = held.positions.data() + static_cast<size_t>(h) * token_budget;
    for (int s = 0; s < d.count; ++s)
      SPADE_CHECK(slot[s] >= 0, "{}: after the delta, slot {} of head {} is empty: the cache rank's mirror of the "
                  "selection is out of sync", peer, s, h);
    std::fill(slot + d.count, slot + token_budget, -1);
  }
  held.count = d.count;
}

}  // namespace spade::pair

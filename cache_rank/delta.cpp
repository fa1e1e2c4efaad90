// Delta transfer of selections (see delta.h).
#include "cache_rank/delta.h"

#include <algorithm>
#include <cstring>

#include "cache_rank/pack.h"
#include "common/error.h"

namespace spade::cache {

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
  const int n = full.count;
  LayerDelta d;
  d.count = n;
  d.changed.assign(heads_, 0);
  for (int h = 0; h < heads_; ++h) {
    const int32_t* sel = full.positions.data() + static_cast<size_t>(h) * budget_;  // ascending
    int32_t* slot = held.data() + static_cast<size_t>(h) * budget_;
    kept_.assign(n, 0);
    free_.clear();
    for (int s = 0; s < n; ++s) {
      const int32_t p = slot[s];
      const int32_t* it = p < 0 ? sel + n : std::lower_bound(sel, sel + n, p);
      if (it != sel + n && *it == p) {
        kept_[it - sel] = 1;
      } else {
        free_.push_back(s);
      }
    }
    size_t j = 0;
    for (int i = 0; i < n; ++i) {
      if (kept_[i]) continue;
      const int s = free_[j++];
      slot[s] = sel[i];
      d.slots.push_back(s);
      d.positions.push_back(sel[i]);
      const size_t src = (static_cast<size_t>(h) * budget_ + i) * head_dim_;
      d.k.insert(d.k.end(), full.k.begin() + src, full.k.begin() + src + head_dim_);
      d.v.insert(d.v.end(), full.v.begin() + src, full.v.begin() + src + head_dim_);
    }
    SPADE_CHECK(j == free_.size(), "selection mirror: sequence {} layer {} head {}: {} entering tokens for {} free slots "
                "(duplicate positions in the selection?)", seq, layer, h, j, free_.size());
    std::fill(slot + n, slot + budget_, -1);
    d.changed[h] = static_cast<int32_t>(j);
  }
  stats_.selected_rows += static_cast<uint64_t>(n) * heads_;
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

}  // namespace spade::cache

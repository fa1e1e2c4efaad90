// CPU reference of delta transfer of selections (see selection_delta_ref.h).
#include "kernels/selection_delta_ref.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "kernels/selection_ref.h"

namespace spade::kernels {

void selection_delta_ref(const SelectionDeltaRefParams& p) {
  const char* what = "selection_delta_ref";
  SPADE_CHECK(p.indices != nullptr && p.mirror != nullptr && p.delta_slots != nullptr &&
                  p.delta_positions != nullptr && p.row_info != nullptr,
              "{}: indices, mirror, delta_slots, delta_positions and row_info must be set", what);
  SPADE_CHECK(p.rows >= 0 && p.k >= 1 && p.capacity >= 1 && p.capacity <= p.k,
              "{}: rows {} / k {} / capacity {} invalid (capacity in 1..k)", what, p.rows, p.k, p.capacity);
  std::vector<uint8_t> kept_sel;
  std::vector<int32_t> free_slots, entering, sent;
  for (int r = 0; r < p.rows; ++r) {
    const int32_t* sel = p.indices + static_cast<size_t>(r) * p.k;
    const int32_t mr = p.mirror_rows != nullptr ? p.mirror_rows[r] : r;
    SPADE_CHECK(mr >= 0, "{}: mirror_rows[{}] = {} is negative", what, r, mr);
    int32_t* m = p.mirror + static_cast<size_t>(mr) * p.k;
    int n = 0;
    while (n < p.k && sel[n] >= 0) ++n;
    for (int i = 0; i < p.k; ++i) {
      SPADE_CHECK(i < n ? (i == 0 || sel[i] > sel[i - 1]) : sel[i] == -1,
                  "{}: row {}: indices[{}] = {} breaks 'ascending positions, then -1'", what, r, i, sel[i]);
    }
    // Kept slots: their token is still selected.
    kept_sel.assign(n, 0);
    std::vector<int32_t> empty, stale;
    int kept = 0;
    for (int s = 0; s < n; ++s) {
      const int32_t pos = m[s];
      SPADE_CHECK(pos >= -1, "{}: row {}: mirror slot {} holds {}", what, r, s, pos);
      const int32_t* it = pos < 0 ? sel + n : std::lower_bound(sel, sel + n, pos);
      if (it != sel + n && *it == pos) {
        SPADE_CHECK(!kept_sel[it - sel], "{}: row {}: two slots below {} hold position {}: the mirror is corrupt",
                    what, r, n, pos);
        kept_sel[it - sel] = 1;
        ++kept;
      } else if (pos < 0) {
        empty.push_back(s);
      } else {
        stale.push_back(s);
      }
    }
    free_slots = empty;
    free_slots.insert(free_slots.end(), stale.begin(), stale.end());
    entering.clear();
    for (int i = 0; i < n; ++i)
      if (!kept_sel[i]) entering.push_back(sel[i]);
    const int E = n - kept;
    const int sent_n = std::min(E, p.capacity);
    sent = entering;
    if (E > p.capacity) {
      SPADE_CHECK(p.scores != nullptr, "{}: row {} has {} entering tokens for capacity {} and scores is null", what,
                  r, E, p.capacity);
      const float* sc = p.scores + static_cast<size_t>(r) * p.score_stride;
      for (int32_t pos : entering)
        SPADE_CHECK(pos < p.score_stride, "{}: row {}: position {} outside score_stride {}", what, r, pos,
                    p.score_stride);
      std::stable_sort(sent.begin(), sent.end(),
                       [&](int32_t a, int32_t b) { return topk_key(sc[a]) > topk_key(sc[b]); });  // ties: ascending
      sent.resize(sent_n);
      std::sort(sent.begin(), sent.end());
    }
    int32_t* ds = p.delta_slots + static_cast<size_t>(r) * p.capacity;
    int32_t* dp = p.delta_positions + static_cast<size_t>(r) * p.capacity;
    for (int j = 0; j < p.capacity; ++j) {
      if (j < sent_n) {
        ds[j] = free_slots[j];
        dp[j] = sent[j];
        m[free_slots[j]] = sent[j];
      } else {
        ds[j] = -1;
        dp[j] = -1;
      }
    }
    int holes = 0;
    for (int s = 0; s < n; ++s) holes += m[s] < 0 ? 1 : 0;
    std::fill(m + n, m + p.k, -1);
    int32_t* info = p.row_info + static_cast<size_t>(r) * kDeltaInfoFields;
    info[kDeltaCount] = n;
    info[kDeltaEntering] = E;
    info[kDeltaEntries] = sent_n;
    info[kDeltaHoles] = holes;
  }
}

void apply_selection_delta_ref(const ApplySelectionDeltaRefParams& p) {
  const char* what = "apply_selection_delta_ref";
  SPADE_CHECK(p.delta_slots != nullptr && p.delta_k != nullptr && p.delta_v != nullptr && p.held_k != nullptr &&
                  p.held_v != nullptr && (p.held_positions == nullptr || p.delta_positions != nullptr),
              "{}: delta_slots, delta_k, delta_v, held_k, held_v (and delta_positions with held_positions) must be set",
              what);
  SPADE_CHECK(p.rows >= 0 && p.k >= 1 && p.capacity >= 1 && p.head_dim >= 1,
              "{}: rows {} / k {} / capacity {} / head_dim {} invalid", what, p.rows, p.k, p.capacity, p.head_dim);
  const size_t D = static_cast<size_t>(p.head_dim);
  for (int r = 0; r < p.rows; ++r) {
    const int32_t hr = p.held_rows != nullptr ? p.held_rows[r] : r;
    SPADE_CHECK(hr >= 0, "{}: held_rows[{}] = {} is negative", what, r, hr);
    for (int j = 0; j < p.capacity; ++j) {
      const size_t e = static_cast<size_t>(r) * p.capacity + j;
      const int32_t s = p.delta_slots[e];
      if (s < 0) continue;
      SPADE_CHECK(s < p.k, "{}: row {} entry {}: slot {} outside [0, {})", what, r, j, s, p.k);
      const size_t h = static_cast<size_t>(hr) * p.k + s;
      std::memcpy(p.held_k + h * D, p.delta_k + e * D, D * sizeof(float));
      std::memcpy(p.held_v + h * D, p.delta_v + e * D, D * sizeof(float));
      if (p.held_positions != nullptr) p.held_positions[h] = p.delta_positions[e];
    }
  }
}

}  // namespace spade::kernels

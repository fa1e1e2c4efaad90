// AsyncSpade Eq. 1, the overlap ratio of a token selection X with a reference selection T of the same
// (sequence, layer) — T the oracle's top-k with the true query: |X_h ∩ T_h| / |T_h| per KV head h. One
// definition for the cache rank's online sampling (pack_server.h OverlapSampler) and the fidelity tools
// (bench/fidelity). Header-only; positions are ascending per KV head (pair::LayerSelection's layout).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "pair/selection_config.h"

namespace spade::cache {

/// Running sums of one (layer, KV head)'s sampled selections: the overlap ratio (Eq. 1) of each sampled
/// prediction against the true query's top-k, and the selection churn — the share of a selection's positions that
/// were not in the same sequence and layer's selection of the step before (it sizes the delta capacity).
/// overlap() and churn() are the means; NaN when nothing was sampled.
struct SelectionSampleStats {
  double overlap_sum = 0, churn_sum = 0;
  int64_t overlap_n = 0, churn_n = 0;
  double overlap() const {
    return overlap_n > 0 ? overlap_sum / overlap_n : std::numeric_limits<double>::quiet_NaN();
  }
  double churn() const { return churn_n > 0 ? churn_sum / churn_n : std::numeric_limits<double>::quiet_NaN(); }
  SelectionSampleStats& operator+=(const SelectionSampleStats& o) {
    overlap_sum += o.overlap_sum;
    churn_sum += o.churn_sum;
    overlap_n += o.overlap_n;
    churn_n += o.churn_n;
    return *this;
  }
};

/// |a ∩ b| of two ascending position lists a[0, na) and b[0, nb).
inline int common_positions(const int32_t* a, int na, const int32_t* b, int nb) {
  struct Counter {  // an output iterator that only counts what is written through it
    int n = 0;
    Counter& operator*() { return *this; }
    Counter& operator++() { return *this; }
    Counter& operator++(int) { return *this; }
    Counter& operator=(int32_t) {
      ++n;
      return *this;
    }
  };
  return std::set_intersection(a, a + std::max(na, 0), b, b + std::max(nb, 0), Counter{}).n;
}

/// Eq. 1 for KV head `h`: |x_h ∩ ref_h| / |ref_h| over the first `count` positions of each selection's row h.
/// A row's stride is positions.size() / num_kv_heads, so selections made with different budgets
/// (Selector::select's `budget`, or selectors of different token_budget) compare. NaN when `ref` selects
/// nothing.
inline double head_overlap_ratio(const pair::LayerSelection& x, const pair::LayerSelection& ref, int h,
                                 int num_kv_heads) {
  if (ref.count == 0) return std::numeric_limits<double>::quiet_NaN();
  const size_t xs = x.positions.size() / num_kv_heads, rs = ref.positions.size() / num_kv_heads;
  const int common =
      common_positions(x.positions.data() + h * xs, x.count, ref.positions.data() + h * rs, ref.count);
  return static_cast<double>(common) / ref.count;
}

}  // namespace spade::cache

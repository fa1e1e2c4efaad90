// CPU reference of the cache rank's query-window push (see query_window_ref.h).
#include "kernels/query_window_ref.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error.h"

namespace spade::kernels {

void push_query_window_ref(const PushQueryWindowRefParams& p) {
  const char* what = "push_query_window_ref";
  SPADE_CHECK(p.windows != nullptr && p.window_len != nullptr && p.window_idx != nullptr && p.q != nullptr &&
                  p.cu_tokens != nullptr,
              "{}: windows, window_len, window_idx, q and cu_tokens must be set", what);
  SPADE_CHECK(p.rows >= 0 && p.num_windows >= 1 && p.num_heads >= 1 && p.capacity >= 1 && p.head_dim >= 1,
              "{}: rows {} / num_windows {} / num_heads {} / capacity {} / head_dim {} invalid", what, p.rows,
              p.num_windows, p.num_heads, p.capacity, p.head_dim);
  SPADE_CHECK(p.rows == 0 || p.cu_tokens[0] == 0, "{}: cu_tokens[0] = {} must be 0", what, p.cu_tokens[0]);
  std::vector<char> used(static_cast<size_t>(p.num_windows), 0);
  const size_t D = static_cast<size_t>(p.head_dim), cap = static_cast<size_t>(p.capacity);
  std::vector<float> merged;
  for (int r = 0; r < p.rows; ++r) {
    const int w = p.window_idx[r];
    SPADE_CHECK(w >= 0 && w < p.num_windows && !used[w], "{}: row {} names window {} (0..{}, each once)", what, r, w,
                p.num_windows - 1);
    used[w] = 1;
    const int n = p.cu_tokens[r + 1] - p.cu_tokens[r];
    SPADE_CHECK(n >= 0, "{}: cu_tokens decreases at row {}", what, r);
    const int len = (p.reset != nullptr && p.reset[r] != 0) ? 0 : p.window_len[w];
    SPADE_CHECK(len >= 0 && len <= p.capacity, "{}: window {} holds {} entries (capacity {})", what, w, len,
                p.capacity);
    const int keep = std::min(p.capacity, len + n);
    for (int h = 0; h < p.num_heads; ++h) {
      float* win = p.windows + (static_cast<size_t>(w) * p.num_heads + h) * cap * D;
      merged.assign(static_cast<size_t>(len + n) * D, 0.f);
      std::memcpy(merged.data(), win, static_cast<size_t>(len) * D * sizeof(float));
      for (int i = 0; i < n; ++i)
        std::memcpy(merged.data() + (static_cast<size_t>(len) + i) * D,
                    p.q + (static_cast<size_t>(p.cu_tokens[r] + i) * p.num_heads + h) * D, D * sizeof(float));
      std::memcpy(win, merged.data() + static_cast<size_t>(len + n - keep) * D, static_cast<size_t>(keep) * D * sizeof(float));
    }
    p.window_len[w] = keep;
  }
}

}  // namespace spade::kernels

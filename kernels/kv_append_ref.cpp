#include "kernels/kv_append_ref.h"

#include <cstddef>
#include <cstring>

namespace spade::kernels {

int kv_append_ref(const KvAppendRefParams& p) {
  int bad = 0;
  const size_t row = static_cast<size_t>(p.num_kv_heads) * p.head_dim;
  for (int t = 0; t < p.tokens; ++t) {
    const int b = p.seq_idx[t];
    const int pos = p.positions[t];
    if (b < 0 || b >= p.batch || pos < 0 ||
        static_cast<long long>(pos) >= static_cast<long long>(p.max_pages_per_seq) * p.page_size) {
      ++bad;
      continue;
    }
    const int page = p.block_table[static_cast<size_t>(b) * p.max_pages_per_seq + pos / p.page_size];
    if (page == -1) continue;
    if (page < 0 || page >= p.num_pages) {
      ++bad;
      continue;
    }
    const size_t dst = (static_cast<size_t>(page) * p.page_size + pos % p.page_size) * row;
    std::memcpy(p.k_cache + dst, p.k + static_cast<size_t>(t) * row, row * sizeof(float));
    std::memcpy(p.v_cache + dst, p.v + static_cast<size_t>(t) * row, row * sizeof(float));
  }
  return bad;
}

}  // namespace spade::kernels

#include "kernels/paged_attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"

namespace spade::kernels {

float attention_over_rows_ref(const float* q, const float* const* k_rows, const float* const* v_rows, int n,
                              int head_dim, float scale, float* scores, float* out) {
  const int D = head_dim;
  float m = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    const float* k = k_rows[t];
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += q[d] * k[d];
    s *= scale;
    scores[t] = s;
    m = std::max(m, s);
  }
  for (int d = 0; d < D; ++d) out[d] = 0.f;
  if (n == 0) return m;
  float denom = 0.f;
  for (int t = 0; t < n; ++t) {
    const float w = std::exp(scores[t] - m);
    denom += w;
    const float* v = v_rows[t];
    for (int d = 0; d < D; ++d) out[d] += w * v[d];
  }
  const float inv = 1.f / denom;
  for (int d = 0; d < D; ++d) out[d] *= inv;
  return m + std::log(denom);
}

void paged_attention_ref(const PagedAttentionParams& p) {
  SPADE_CHECK(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
              "paged_attention_ref: num_q_heads {} is not a multiple of num_kv_heads {}", p.num_q_heads,
              p.num_kv_heads);
  SPADE_CHECK(p.head_dim > 0 && p.page_size > 0, "paged_attention_ref: head_dim {} / page_size {} must be > 0",
              p.head_dim, p.page_size);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int D = p.head_dim;
  const size_t slot_stride = static_cast<size_t>(p.num_kv_heads) * D;
  const size_t page_stride = slot_stride * p.page_size;
  std::vector<float> scores;
  std::vector<const float*> k_rows, v_rows;
  for (int b = 0; b < p.batch; ++b) {
    if (p.skip != nullptr && p.skip[b] != 0) continue;  // another kernel's sequence: nothing read or written
    const int q_begin = p.cu_q_lens[b];
    const int q_len = p.cu_q_lens[b + 1] - q_begin;
    const int seq_len = p.seq_lens[b];
    SPADE_CHECK(q_len >= 0 && q_len <= seq_len, "paged_attention_ref: sequence {} has {} query tokens but context {}",
                b, q_len, seq_len);
    const int32_t* pages = p.block_table + static_cast<size_t>(b) * p.max_pages_per_seq;
    const int num_pages = (seq_len + p.page_size - 1) / p.page_size;
    SPADE_CHECK(num_pages <= p.max_pages_per_seq, "paged_attention_ref: sequence {} needs {} pages > max {}", b,
                num_pages, p.max_pages_per_seq);
    for (int i = 0; i < num_pages; ++i)
      SPADE_CHECK(pages[i] >= 0, "paged_attention_ref: sequence {} block_table[{}] = {} inside the context", b, i,
                  pages[i]);
    scores.resize(seq_len);
    k_rows.resize(seq_len);
    v_rows.resize(seq_len);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      for (int t = 0; t < seq_len; ++t) {
        const size_t off = pages[t / p.page_size] * page_stride + (t % p.page_size) * slot_stride +
                           static_cast<size_t>(kvh) * D;
        k_rows[t] = p.k_cache + off;
        v_rows[t] = p.v_cache + off;
      }
      for (int i = 0; i < q_len; ++i) {
        const int pos = seq_len - q_len + i;  // absolute position of this query: attends to 0..pos
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          const size_t row = static_cast<size_t>(q_begin + i) * p.num_q_heads + h;
          const float lse = attention_over_rows_ref(p.q + row * D, k_rows.data(), v_rows.data(), pos + 1, D, p.scale,
                                                    scores.data(), p.out + row * D);
          if (p.lse) p.lse[row] = lse;
        }
      }
    }
  }
}

}  // namespace spade::kernels

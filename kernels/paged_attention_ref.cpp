#include "kernels/paged_attention_ref.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"

namespace spade::kernels {

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
  std::vector<float> acc(D);
  for (int b = 0; b < p.batch; ++b) {
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
    for (int i = 0; i < q_len; ++i) {
      const int pos = seq_len - q_len + i;  // absolute position of this query
      for (int h = 0; h < p.num_q_heads; ++h) {
        const int kvh = h / group;
        const float* q = p.q + (static_cast<size_t>(q_begin + i) * p.num_q_heads + h) * D;
        float m = -std::numeric_limits<float>::infinity();
        for (int t = 0; t <= pos; ++t) {
          const float* k = p.k_cache + pages[t / p.page_size] * page_stride + (t % p.page_size) * slot_stride +
                           static_cast<size_t>(kvh) * D;
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += q[d] * k[d];
          s *= p.scale;
          scores[t] = s;
          m = std::max(m, s);
        }
        float denom = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int t = 0; t <= pos; ++t) {
          const float w = std::exp(scores[t] - m);
          denom += w;
          const float* v = p.v_cache + pages[t / p.page_size] * page_stride + (t % p.page_size) * slot_stride +
                           static_cast<size_t>(kvh) * D;
          for (int d = 0; d < D; ++d) acc[d] += w * v[d];
        }
        float* o = p.out + (static_cast<size_t>(q_begin + i) * p.num_q_heads + h) * D;
        const float inv = 1.f / denom;
        for (int d = 0; d < D; ++d) o[d] = acc[d] * inv;
        if (p.lse) p.lse[static_cast<size_t>(q_begin + i) * p.num_q_heads + h] = m + std::log(denom);
      }
    }
  }
}

}  // namespace spade::kernels

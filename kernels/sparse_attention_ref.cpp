#include "kernels/sparse_attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"

namespace spade::kernels {
namespace {

// Attention of one query over explicit K/V row pointers (two-pass softmax, fp32 with fp64 sums).
void attend_rows(const float* q, const std::vector<const float*>& ks, const std::vector<const float*>& vs, int D,
                 float scale, float* out, float* lse) {
  if (ks.empty()) {
    std::fill(out, out + D, 0.f);
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  std::vector<double> s(ks.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < ks.size(); ++j) {
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += q[d] * ks[j][d];
    s[j] = static_cast<double>(acc) * scale;
    mx = std::max(mx, s[j]);
  }
  double sum = 0.0;
  std::vector<double> o(D, 0.0);
  for (size_t j = 0; j < ks.size(); ++j) {
    const double w = std::exp(s[j] - mx);
    sum += w;
    for (int d = 0; d < D; ++d) o[d] += w * vs[j][d];
  }
  for (int d = 0; d < D; ++d) out[d] = static_cast<float>(o[d] / sum);
  if (lse != nullptr) *lse = static_cast<float>(mx + std::log(sum));
}

void check_heads(const char* what, int hq, int hkv, int D, int page_size, int max_pages) {
  SPADE_CHECK(hkv > 0 && hq % hkv == 0, "{}: num_q_heads {} is not a multiple of num_kv_heads {}", what, hq, hkv);
  SPADE_CHECK(D > 0 && page_size > 0 && max_pages > 0, "{}: head_dim {} / page_size {} / max_pages_per_seq {} invalid",
              what, D, page_size, max_pages);
}

const float* cache_row(const float* cache, const int32_t* bt, int b, int pos, int kvh, int page_size, int max_pages,
                       int hkv, int D, const char* what) {
  SPADE_CHECK(pos >= 0 && pos < max_pages * page_size, "{}: position {} of sequence {} outside 0..{}", what, pos, b,
              max_pages * page_size - 1);
  const int32_t page = bt[static_cast<size_t>(b) * max_pages + pos / page_size];
  SPADE_CHECK(page >= 0, "{}: block_table[{}][{}] = {} is not a page id", what, b, pos / page_size, page);
  return cache + ((static_cast<size_t>(page) * page_size + pos % page_size) * hkv + kvh) * D;
}

}  // namespace

void sparse_index_attention_ref(const SparseIndexAttentionRefParams& p) {
  const char* what = "sparse_index_attention_ref";
  SPADE_CHECK(p.q != nullptr && p.k_cache != nullptr && p.v_cache != nullptr && p.block_table != nullptr &&
                  p.indices != nullptr && p.num_indices != nullptr && p.out != nullptr,
              "{}: q, k_cache, v_cache, block_table, indices, num_indices and out must be set", what);
  check_heads(what, p.num_q_heads, p.num_kv_heads, p.head_dim, p.page_size, p.max_pages_per_seq);
  const int G = p.num_q_heads / p.num_kv_heads;
  const int D = p.head_dim;
  std::vector<const float*> ks, vs;
  for (int b = 0; b < p.batch; ++b) {
    const int n = p.num_indices[b];
    SPADE_CHECK(n >= 0 && n <= p.index_stride, "{}: num_indices[{}] = {} outside 0..{}", what, b, n, p.index_stride);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const int32_t* idx = p.indices + (static_cast<size_t>(b) * p.num_kv_heads + kvh) * p.index_stride;
      ks.clear();
      vs.clear();
      for (int j = 0; j < n; ++j) {
        ks.push_back(cache_row(p.k_cache, p.block_table, b, idx[j], kvh, p.page_size, p.max_pages_per_seq,
                               p.num_kv_heads, D, what));
        vs.push_back(cache_row(p.v_cache, p.block_table, b, idx[j], kvh, p.page_size, p.max_pages_per_seq,
                               p.num_kv_heads, D, what));
      }
      for (int g = 0; g < G; ++g) {
        const size_t qh = static_cast<size_t>(b) * p.num_q_heads + kvh * G + g;
        attend_rows(p.q + qh * D, ks, vs, D, p.scale, p.out + qh * D, p.lse != nullptr ? p.lse + qh : nullptr);
      }
    }
  }
}

void sparse_packed_attention_ref(const SparsePackedAttentionRefParams& p) {
  const char* what = "sparse_packed_attention_ref";
  SPADE_CHECK(p.q != nullptr && p.packed_k != nullptr && p.packed_v != nullptr && p.num_packed != nullptr &&
                  p.seq_lens != nullptr && p.out != nullptr,
              "{}: q, packed_k, packed_v, num_packed, seq_lens and out must be set", what);
  SPADE_CHECK(p.local_window >= 0 && p.packed_capacity >= 0, "{}: local_window {} / packed_capacity {} invalid", what,
              p.local_window, p.packed_capacity);
  SPADE_CHECK(p.local_window == 0 || (p.k_cache != nullptr && p.v_cache != nullptr && p.block_table != nullptr),
              "{}: k_cache, v_cache and block_table must be set when local_window > 0", what);
  check_heads(what, p.num_q_heads, p.num_kv_heads, p.head_dim, p.page_size, p.max_pages_per_seq);
  const int G = p.num_q_heads / p.num_kv_heads;
  const int D = p.head_dim;
  std::vector<const float*> ks, vs;
  if (p.q_rows != nullptr) {
    std::vector<int32_t> rows;
    for (int b = 0; b < p.batch; ++b)
      if (p.q_rows[b] >= 0) rows.push_back(p.q_rows[b]);
    std::sort(rows.begin(), rows.end());
    const auto dup = std::adjacent_find(rows.begin(), rows.end());
    SPADE_CHECK(dup == rows.end(), "{}: q_rows names row {} twice", what, dup == rows.end() ? 0 : *dup);
  }
  for (int b = 0; b < p.batch; ++b) {
    const int qrow = p.q_rows != nullptr ? p.q_rows[b] : b;
    if (qrow < 0) continue;  // another kernel's row (a mixed step's prefill or dense row)
    const int n = p.num_packed[b];
    SPADE_CHECK(n >= 0 && n <= p.packed_capacity, "{}: num_packed[{}] = {} outside 0..{}", what, b, n,
                p.packed_capacity);
    const int seq_len = p.seq_lens[b];
    SPADE_CHECK(seq_len >= 0, "{}: seq_lens[{}] = {} is negative", what, b, seq_len);
    const int window = p.local_windows != nullptr ? p.local_windows[b] : p.local_window;
    SPADE_CHECK(window >= 0, "{}: local_windows[{}] = {} is negative", what, b, window);
    SPADE_CHECK(window == 0 || (p.k_cache != nullptr && p.v_cache != nullptr && p.block_table != nullptr),
                "{}: k_cache, v_cache and block_table must be set for a window", what);
    const int wl = std::min(window, seq_len);
    const int prow = p.packed_rows != nullptr ? p.packed_rows[b] : b;
    SPADE_CHECK(prow >= 0, "{}: packed_rows[{}] = {} is negative", what, b, prow);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const size_t base = (static_cast<size_t>(prow) * p.num_kv_heads + kvh) * p.packed_capacity;
      ks.clear();
      vs.clear();
      for (int j = 0; j < n; ++j) {
        ks.push_back(p.packed_k + (base + j) * D);
        vs.push_back(p.packed_v + (base + j) * D);
      }
      for (int pos = seq_len - wl; pos < seq_len; ++pos) {
        ks.push_back(cache_row(p.k_cache, p.block_table, b, pos, kvh, p.page_size, p.max_pages_per_seq,
                               p.num_kv_heads, D, what));
        vs.push_back(cache_row(p.v_cache, p.block_table, b, pos, kvh, p.page_size, p.max_pages_per_seq,
                               p.num_kv_heads, D, what));
      }
      for (int g = 0; g < G; ++g) {
        const size_t qh = static_cast<size_t>(qrow) * p.num_q_heads + kvh * G + g;
        attend_rows(p.q + qh * D, ks, vs, D, p.scale, p.out + qh * D, p.lse != nullptr ? p.lse + qh : nullptr);
      }
    }
  }
}

}  // namespace spade::kernels

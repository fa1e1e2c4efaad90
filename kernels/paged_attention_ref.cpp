#include "kernels/paged_attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <cblas.h>

#include "common/error.h"

namespace spade::kernels {

namespace {

constexpr int kQueryTile = 64;  // query tokens per tile (times the GQA group: rows of one GEMM)
constexpr int kKeyTile = 256;   // context tokens per tile

// Flash-attention forward (FlashAttention-2, Dao 2023, Algorithm 1) on the CPU for one sequence, one KV head and
// query tokens [i0, i1) of its q_len new tokens: every query head of the GQA group stacked into the rows of one
// GEMM, the context (gathered from the pages once per chunk) in key tiles, S = Q Kᵀ and O += P V as SGEMMs, online
// softmax in fp32.
// Query token i sits at absolute position seq_len - q_len + i and attends to 0..position (causal).
struct TileScratch {
  std::vector<float> q, s, o, m, l;
};

// kc, vc: this KV head's context gathered once per chunk, [seq_len, head_dim] fp32 each.
void attend_tile(const PagedAttentionParams& p, int q_begin, int q_len, int seq_len, const float* kc, const float* vc,
                 int kvh, int i0, int i1, TileScratch& w) {
  const int group = p.num_q_heads / p.num_kv_heads, D = p.head_dim;
  const int rows = (i1 - i0) * group;
  w.q.resize(static_cast<size_t>(rows) * D);
  w.o.assign(static_cast<size_t>(rows) * D, 0.f);
  w.m.assign(rows, -std::numeric_limits<float>::infinity());
  w.l.assign(rows, 0.f);
  for (int i = i0; i < i1; ++i)
    for (int g = 0; g < group; ++g) {
      const size_t src = (static_cast<size_t>(q_begin + i) * p.num_q_heads + kvh * group + g) * D;
      std::copy(p.q + src, p.q + src + D, w.q.begin() + (static_cast<size_t>(i - i0) * group + g) * D);
    }
  const int first_pos = seq_len - q_len + i0, last_pos = seq_len - q_len + i1 - 1;
  for (int j0 = 0; j0 <= last_pos; j0 += kKeyTile) {
    const int j1 = std::min(j0 + kKeyTile, last_pos + 1), n = j1 - j0;
    const float* kt = kc + static_cast<size_t>(j0) * D;
    const float* vt = vc + static_cast<size_t>(j0) * D;
    w.s.resize(static_cast<size_t>(rows) * n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, D, p.scale, w.q.data(), D, kt, D, 0.f, w.s.data(),
                n);
    const bool masked = j1 - 1 > first_pos;  // some row of the tile sees only part of this key tile
    for (int r = 0; r < rows; ++r) {
      float* srow = &w.s[static_cast<size_t>(r) * n];
      const int visible = masked ? std::clamp(first_pos + r / group - j0 + 1, 0, n) : n;
      float mx = w.m[r];
      for (int t = 0; t < visible; ++t) mx = std::max(mx, srow[t]);
      const float alpha = std::exp(w.m[r] - mx);  // 0 when the row had seen nothing (m = -inf)
      float sum = 0.f;
      for (int t = 0; t < visible; ++t) {
        srow[t] = std::exp(srow[t] - mx);
        sum += srow[t];
      }
      for (int t = visible; t < n; ++t) srow[t] = 0.f;
      w.m[r] = mx;
      w.l[r] = w.l[r] * alpha + sum;
      float* orow = &w.o[static_cast<size_t>(r) * D];
      for (int d = 0; d < D; ++d) orow[d] *= alpha;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, D, n, 1.f, w.s.data(), n, vt, D, 1.f, w.o.data(),
                D);
  }
  for (int i = i0; i < i1; ++i)
    for (int g = 0; g < group; ++g) {
      const int r = (i - i0) * group + g;
      const size_t row = static_cast<size_t>(q_begin + i) * p.num_q_heads + kvh * group + g;
      const float inv = 1.f / w.l[r];
      for (int d = 0; d < D; ++d) p.out[row * D + d] = w.o[static_cast<size_t>(r) * D + d] * inv;
      if (p.lse) p.lse[row] = w.m[r] + std::log(w.l[r]);
    }
}

}  // namespace

namespace {

// q · k over `n` floats: eight independent partial sums (vectorised without -ffast-math reassociation), then a fixed
// pairwise order — the same result for the same inputs wherever it is called.
inline float dot(const float* __restrict q, const float* __restrict k, int n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += q[d + j] * k[d + j];
  float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; d < n; ++d) s += q[d] * k[d];
  return s;
}

}  // namespace

float attention_over_rows_ref(const float* q, const float* const* k_rows, const float* const* v_rows, int n,
                              int head_dim, float scale, float* scores, float* out) {
  const int D = head_dim;
  float m = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    const float s = dot(q, k_rows[t], D) * scale;
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
  std::vector<float> kc, vc;     // a prefill chunk's context, gathered per KV head
  std::vector<int> decode_seqs;  // sequences with one query row (decode steps), attended after the prefill chunks
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
    if (q_len == 1) {
      decode_seqs.push_back(b);
      continue;
    }
    if (q_len == 0) continue;
    // Prefill chunks: the context of every KV head gathered from the pages once ([num_kv_heads, seq_len, head_dim]
    // K and V), then tiled, GEMM-shaped, the (KV head, query tile) pairs in parallel (each GEMM on its thread).
    const size_t head_floats = static_cast<size_t>(seq_len) * D;
    kc.resize(head_floats * p.num_kv_heads);
    vc.resize(head_floats * p.num_kv_heads);
    const int tiles = (q_len + kQueryTile - 1) / kQueryTile;
#pragma omp parallel
    {
#pragma omp for schedule(static)
      for (int t = 0; t < seq_len; ++t) {
        const size_t slot = pages[t / p.page_size] * page_stride + (t % p.page_size) * slot_stride;
        for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
          const size_t src = slot + static_cast<size_t>(kvh) * D, dst = kvh * head_floats + static_cast<size_t>(t) * D;
          std::copy(p.k_cache + src, p.k_cache + src + D, kc.begin() + static_cast<std::ptrdiff_t>(dst));
          std::copy(p.v_cache + src, p.v_cache + src + D, vc.begin() + static_cast<std::ptrdiff_t>(dst));
        }
      }
      TileScratch w;
#pragma omp for schedule(dynamic)
      for (int task = 0; task < p.num_kv_heads * tiles; ++task) {
        const int kvh = task / tiles, i0 = (task % tiles) * kQueryTile;
        attend_tile(p, q_begin, q_len, seq_len, kc.data() + kvh * head_floats, vc.data() + kvh * head_floats, kvh, i0,
                    std::min(i0 + kQueryTile, q_len), w);
      }
    }
  }
  // Decode rows: one query over its whole context, the arithmetic of attention_over_rows_ref, so that a dense and a
  // sparse decode step that visit the same rows in the same order give bit-identical results. The (sequence, KV
  // head) pairs in parallel; each row's arithmetic is the same on any thread.
  const int tasks = static_cast<int>(decode_seqs.size()) * p.num_kv_heads;
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> scores;
    std::vector<const float*> k_rows, v_rows;
#pragma omp for schedule(dynamic)
    for (int task = 0; task < tasks; ++task) {
      const int b = decode_seqs[static_cast<size_t>(task / p.num_kv_heads)], kvh = task % p.num_kv_heads;
      const int seq_len = p.seq_lens[b];
      const int32_t* pages = p.block_table + static_cast<size_t>(b) * p.max_pages_per_seq;
      scores.resize(seq_len);
      k_rows.resize(seq_len);
      v_rows.resize(seq_len);
      for (int t = 0; t < seq_len; ++t) {
        const size_t off = pages[t / p.page_size] * page_stride + (t % p.page_size) * slot_stride +
                           static_cast<size_t>(kvh) * D;
        k_rows[t] = p.k_cache + off;
        v_rows[t] = p.v_cache + off;
      }
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const size_t row = static_cast<size_t>(p.cu_q_lens[b]) * p.num_q_heads + h;
        const float lse = attention_over_rows_ref(p.q + row * D, k_rows.data(), v_rows.data(), seq_len, D, p.scale,
                                                  scores.data(), p.out + row * D);
        if (p.lse) p.lse[row] = lse;
      }
    }
  }
}

}  // namespace spade::kernels

// CPU tests of kernels/sparse_attention_ref.h: sparse attention over all tokens equals dense paged decode
// (paged_attention_ref), for both the index-list and the packed + local-window forms (also with per-sequence windows
// and packed rows, a serving batch mixing sparse and dense sequences), and the mixed prefill + decode step of the GPU
// path's page dropping: the prefill reference skipping the sparse rows (paged_attention_ref `skip`) plus the packed
// reference over the step's token layout (`q_rows`) equals dense attention, without reading a dropped page.
#include "kernels/sparse_attention_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "common/error.h"
#include "kernels/paged_attention_ref.h"

namespace spade::kernels {
namespace {

struct Fixture {
  int batch = 2, hq = 4, hkv = 2, D = 8, ps = 4;
  std::vector<int32_t> lens = {13, 5};
  int max_pages = 4;
  std::vector<int32_t> bt = {3, 0, 5, 1, 2, 4, -1, -1};
  std::vector<float> kc, vc, q;
  float scale = 0.35f;
  Fixture() {
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    kc.resize(static_cast<size_t>(6) * ps * hkv * D);
    vc.resize(kc.size());
    q.resize(static_cast<size_t>(batch) * hq * D);
    for (float& x : kc) x = nd(rng);
    for (float& x : vc) x = nd(rng);
    for (float& x : q) x = nd(rng);
  }
  void dense(std::vector<float>* out, std::vector<float>* lse) const {
    std::vector<int32_t> cu = {0, 1, 2};
    out->assign(q.size(), 0.f);
    lse->assign(static_cast<size_t>(batch) * hq, 0.f);
    PagedAttentionParams p;
    p.q = q.data();
    p.k_cache = kc.data();
    p.v_cache = vc.data();
    p.block_table = bt.data();
    p.cu_q_lens = cu.data();
    p.seq_lens = lens.data();
    p.out = out->data();
    p.lse = lse->data();
    p.batch = batch;
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = D;
    p.page_size = ps;
    p.max_pages_per_seq = max_pages;
    p.scale = scale;
    paged_attention_ref(p);
  }
};

TEST(SparseIndexRef, AllPositionsEqualsDense) {
  Fixture f;
  std::vector<float> ref, ref_lse;
  f.dense(&ref, &ref_lse);
  const int stride = 16;
  std::vector<int32_t> idx(static_cast<size_t>(f.batch) * f.hkv * stride, -1);
  std::mt19937_64 rng(4);
  for (int b = 0; b < f.batch; ++b) {
    for (int h = 0; h < f.hkv; ++h) {
      std::vector<int32_t> all(f.lens[b]);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);  // order must not matter
      std::copy(all.begin(), all.end(), idx.begin() + (b * f.hkv + h) * stride);
    }
  }
  std::vector<float> out(f.q.size()), lse(ref_lse.size());
  SparseIndexAttentionRefParams p;
  p.q = f.q.data();
  p.k_cache = f.kc.data();
  p.v_cache = f.vc.data();
  p.block_table = f.bt.data();
  p.indices = idx.data();
  p.num_indices = f.lens.data();
  p.out = out.data();
  p.lse = lse.data();
  p.batch = f.batch;
  p.num_q_heads = f.hq;
  p.num_kv_heads = f.hkv;
  p.head_dim = f.D;
  p.page_size = f.ps;
  p.max_pages_per_seq = f.max_pages;
  p.index_stride = stride;
  p.scale = f.scale;
  sparse_index_attention_ref(p);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], ref_lse[i], 1e-5) << i;

  // Empty lists give zeros and -inf; an out-of-range position is an error naming the function.
  const std::vector<int32_t> zero = {0, 0};
  p.num_indices = zero.data();
  sparse_index_attention_ref(p);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.f; }));
  EXPECT_TRUE(std::isinf(lse[0]) && lse[0] < 0);
  idx[0] = 99;
  p.num_indices = f.lens.data();
  EXPECT_THROW(sparse_index_attention_ref(p), spade::Error);
}

TEST(SparsePackedRef, GatheredPrefixPlusWindowEqualsDense) {
  Fixture f;
  std::vector<float> ref, ref_lse;
  f.dense(&ref, &ref_lse);
  const int window = 4, cap = 12;
  std::vector<int32_t> num_packed(f.batch);
  std::vector<float> pk(static_cast<size_t>(f.batch) * f.hkv * cap * f.D, std::nanf(""));
  std::vector<float> pv(pk.size(), std::nanf(""));
  for (int b = 0; b < f.batch; ++b) {
    num_packed[b] = std::max(0, f.lens[b] - window);
    for (int h = 0; h < f.hkv; ++h) {
      for (int t = 0; t < num_packed[b]; ++t) {
        const int page = f.bt[b * f.max_pages + t / f.ps];
        for (int d = 0; d < f.D; ++d) {
          const size_t src = ((static_cast<size_t>(page) * f.ps + t % f.ps) * f.hkv + h) * f.D + d;
          const size_t dst = ((static_cast<size_t>(b) * f.hkv + h) * cap + t) * f.D + d;
          pk[dst] = f.kc[src];
          pv[dst] = f.vc[src];
        }
      }
    }
  }
  std::vector<float> out(f.q.size()), lse(ref_lse.size());
  SparsePackedAttentionRefParams p;
  p.q = f.q.data();
  p.packed_k = pk.data();
  p.packed_v = pv.data();
  p.num_packed = num_packed.data();
  p.k_cache = f.kc.data();
  p.v_cache = f.vc.data();
  p.block_table = f.bt.data();
  p.seq_lens = f.lens.data();
  p.out = out.data();
  p.lse = lse.data();
  p.batch = f.batch;
  p.num_q_heads = f.hq;
  p.num_kv_heads = f.hkv;
  p.head_dim = f.D;
  p.page_size = f.ps;
  p.max_pages_per_seq = f.max_pages;
  p.packed_capacity = cap;
  p.local_window = window;
  p.scale = f.scale;
  sparse_packed_attention_ref(p);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], ref_lse[i], 1e-5) << i;

  // Per-sequence variants: sequence 0 stays sparse (its selection moved to packed row 1), sequence 1 is dense (no
  // selection, its whole context as the window): both still equal dense attention.
  std::vector<float> pk2(pk.size() * 2, std::nanf("")), pv2(pk2.size(), std::nanf(""));
  const size_t row = static_cast<size_t>(f.hkv) * cap * f.D;
  std::copy(pk.begin(), pk.begin() + static_cast<long>(row), pk2.begin() + static_cast<long>(row));
  std::copy(pv.begin(), pv.begin() + static_cast<long>(row), pv2.begin() + static_cast<long>(row));
  const std::vector<int32_t> windows = {window, f.lens[1]}, rows = {1, 3}, counts = {num_packed[0], 0};
  p.packed_k = pk2.data();
  p.packed_v = pv2.data();
  p.num_packed = counts.data();
  p.local_window = f.lens[1];  // the bound
  p.local_windows = windows.data();
  p.packed_rows = rows.data();
  std::fill(out.begin(), out.end(), 0.f);
  sparse_packed_attention_ref(p);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << "per-sequence variant " << i;
  const std::vector<int32_t> bad = {-1, 3};
  p.local_windows = bad.data();
  EXPECT_THROW(sparse_packed_attention_ref(p), Error);
}

// A mixed step of the GPU path: sequence 0 decodes sparsely (one query, row 0 of the step) and its pages outside
// the local window were dropped (-1 in its block-table row); sequence 1 prefills a chunk of 3 tokens (rows 1..3).
// The prefill reference skips sequence 0, the packed reference serves only it through q_rows: together they equal
// dense attention of the undropped cache, and neither reads a dropped page.
TEST(SparsePackedRef, MixedStepRowsOverDroppedPagesEqualDense) {
  Fixture f;
  const std::vector<int32_t> cu = {0, 1, 4};
  const int rows = 4, window = 4;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(rows) * f.hq * f.D);
  for (float& x : q) x = nd(rng);
  PagedAttentionParams dp;
  dp.q = q.data();
  dp.k_cache = f.kc.data();
  dp.v_cache = f.vc.data();
  dp.block_table = f.bt.data();
  dp.cu_q_lens = cu.data();
  dp.seq_lens = f.lens.data();
  dp.batch = f.batch;
  dp.num_q_heads = f.hq;
  dp.num_kv_heads = f.hkv;
  dp.head_dim = f.D;
  dp.page_size = f.ps;
  dp.max_pages_per_seq = f.max_pages;
  dp.scale = f.scale;
  std::vector<float> ref(q.size()), ref_lse(static_cast<size_t>(rows) * f.hq);
  dp.out = ref.data();
  dp.lse = ref_lse.data();
  paged_attention_ref(dp);

  // The previous step (context 12) dropped [0, 12 + 1 - window) = tokens 0..8: pages 0 and 1 of sequence 0 (page 2
  // holds token 8 but also 9..11 of the window, so it stays).
  std::vector<int32_t> bt = f.bt;
  bt[0] = bt[1] = -1;
  const float sentinel = 7.f;
  std::vector<float> out(q.size(), sentinel), lse(ref_lse.size(), sentinel);
  dp.block_table = bt.data();
  dp.out = out.data();
  dp.lse = lse.data();
  EXPECT_THROW(paged_attention_ref(dp), Error);  // dense attention of sequence 0 would read a dropped page
  std::fill(out.begin(), out.end(), sentinel);
  std::fill(lse.begin(), lse.end(), sentinel);
  const std::vector<int32_t> skip = {1, 0};
  dp.skip = skip.data();
  paged_attention_ref(dp);
  const size_t row_elems = static_cast<size_t>(f.hq) * f.D;
  for (size_t i = 0; i < row_elems; ++i) ASSERT_EQ(out[i], sentinel) << "the skipped row was written at " << i;
  for (int h = 0; h < f.hq; ++h) ASSERT_EQ(lse[static_cast<size_t>(h)], sentinel);
  for (size_t i = row_elems; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << i;

  // Sequence 0's held selection: every token before the window (0..8), gathered into packed row 0.
  const int cap = 12, n_sel = f.lens[0] - window;
  std::vector<float> pk(static_cast<size_t>(f.hkv) * cap * f.D, std::nanf("")), pv(pk.size(), std::nanf(""));
  for (int h = 0; h < f.hkv; ++h)
    for (int t = 0; t < n_sel; ++t) {
      const int page = f.bt[static_cast<size_t>(t / f.ps)];
      for (int d = 0; d < f.D; ++d) {
        const size_t src = ((static_cast<size_t>(page) * f.ps + t % f.ps) * f.hkv + h) * f.D + d;
        const size_t dst = ((static_cast<size_t>(h) * cap) + t) * f.D + d;
        pk[dst] = f.kc[src];
        pv[dst] = f.vc[src];
      }
    }
  const std::vector<int32_t> counts = {n_sel, 0}, windows = {window, 0}, packed_rows = {0, 0}, q_rows = {0, -1};
  SparsePackedAttentionRefParams p;
  p.q = q.data();
  p.packed_k = pk.data();
  p.packed_v = pv.data();
  p.num_packed = counts.data();
  p.k_cache = f.kc.data();
  p.v_cache = f.vc.data();
  p.block_table = bt.data();
  p.seq_lens = f.lens.data();
  p.out = out.data();
  p.lse = lse.data();
  p.batch = f.batch;
  p.num_q_heads = f.hq;
  p.num_kv_heads = f.hkv;
  p.head_dim = f.D;
  p.page_size = f.ps;
  p.max_pages_per_seq = f.max_pages;
  p.packed_capacity = cap;
  p.local_window = window;
  p.scale = f.scale;
  p.local_windows = windows.data();
  p.packed_rows = packed_rows.data();
  p.q_rows = q_rows.data();
  const std::vector<float> prefill_rows(out.begin() + static_cast<long>(row_elems), out.end());
  sparse_packed_attention_ref(p);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], ref_lse[i], 1e-5) << i;
  // The skipped sequence's rows (the prefill's) are untouched bit for bit.
  EXPECT_TRUE(std::equal(prefill_rows.begin(), prefill_rows.end(), out.begin() + static_cast<long>(row_elems)));

  // A window reaching a dropped page is an error, and so are two sequences writing one row.
  const std::vector<int32_t> wide = {window + 4, 0};
  p.local_windows = wide.data();
  EXPECT_THROW(sparse_packed_attention_ref(p), Error);
  p.local_windows = windows.data();
  const std::vector<int32_t> twice = {2, 2};
  p.q_rows = twice.data();
  EXPECT_THROW(sparse_packed_attention_ref(p), Error);
}

}  // namespace
}  // namespace spade::kernels

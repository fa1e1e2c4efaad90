// GPU tests: cache-rank selection kernels (predictor, scoring, top-k, gather) against kernels/selection_ref.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/selection.cuh"
#include "kernels/selection_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::PagedCache;

// ---- predictor ----

void run_predict(DType wdtype, int D, int heads, const std::vector<int>& lens, int cap, int max_reg, float eps,
                 bool constant_rows, uint64_t seed) {
  SCOPED_TRACE("D=" + std::to_string(D) + " cap=" + std::to_string(cap) + " W=" + std::to_string(max_reg));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int batch = static_cast<int>(lens.size());
  // Query windows as random walks (consecutive queries correlated, as the paper observes).
  std::vector<float> win(static_cast<size_t>(batch) * heads * cap * D);
  for (size_t r = 0; r < static_cast<size_t>(batch) * heads; ++r) {
    std::vector<float> cur(D);
    for (float& x : cur) x = 3.f * nd(rng);
    for (int s = 0; s < cap; ++s) {
      for (int d = 0; d < D; ++d) {
        if (!constant_rows) cur[d] = 0.9f * cur[d] + 0.5f * nd(rng);
        win[(r * cap + s) * D + d] = cur[d];
      }
    }
  }
  DevBuf<uint16_t> w16;
  DevBuf<float> w32;
  if (wdtype == DType::F32) {
    w32.upload(win);
  } else {
    std::vector<uint16_t> bits(win.size());
    for (size_t i = 0; i < win.size(); ++i) {
      bits[i] = spade::test::to_bits(wdtype, win[i]);
      win[i] = spade::test::from_bits(wdtype, bits[i]);
    }
    w16.upload(bits);
  }
  std::vector<float> ref(static_cast<size_t>(batch) * heads * D);
  PredictQueryRefParams rp;
  rp.window = win.data();
  rp.window_len = lens.data();
  rp.q_hat = ref.data();
  rp.batch = batch;
  rp.num_heads = heads;
  rp.window_capacity = cap;
  rp.head_dim = D;
  rp.max_regressors = max_reg;
  rp.eps = eps;
  predict_next_query_ref(rp);

  DevBuf<int32_t> d_lens;
  d_lens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
  DevBuf<float> out(ref.size());
  out.poison();
  PredictQueryParams p;
  p.window_dtype = wdtype;
  p.window = wdtype == DType::F32 ? static_cast<const void*>(w32.get()) : static_cast<const void*>(w16.get());
  p.window_len = d_lens.get();
  p.q_hat = out.get();
  p.batch = batch;
  p.num_heads = heads;
  p.window_capacity = cap;
  p.head_dim = D;
  p.max_regressors = max_reg;
  p.eps = eps;
  SPADE_CUDA_OK(predict_next_query(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = out.download();
  for (size_t r = 0; r < static_cast<size_t>(batch) * heads; ++r) {
    double num = 0.0, den = 0.0;
    for (int d = 0; d < D; ++d) {
      const float g = got[r * D + d];
      ASSERT_TRUE(std::isfinite(g)) << "row " << r;
      num += (g - ref[r * D + d]) * (g - ref[r * D + d]);
      den += static_cast<double>(ref[r * D + d]) * ref[r * D + d];
    }
    if (den == 0.0) {
      EXPECT_EQ(num, 0.0) << "row " << r;
    } else {
      EXPECT_LE(std::sqrt(num / den), 1e-5) << "row " << r;
    }
  }
}

TEST(PredictGpu, F32D128FullAndPartialWindows) {
  run_predict(DType::F32, 128, 5, {33, 17, 2, 1, 0}, 33, 32, 1e-3f, false, 51);
}
TEST(PredictGpu, Bf16D64W8) { run_predict(DType::BF16, 64, 4, {33, 9, 20}, 33, 8, 1e-2f, false, 52); }
TEST(PredictGpu, Fp16D256Cap12) { run_predict(DType::F16, 256, 3, {12, 5}, 12, 32, 1e-3f, false, 53); }
TEST(PredictGpu, ConstantWindowSingularGram) { run_predict(DType::F32, 128, 2, {33, 10}, 33, 32, 1e-4f, true, 54); }
TEST(PredictGpu, ManyRowsSeveralPerCta) {
  // 24 x 32 = 768 rows: more than two CTAs per SM, so the launcher packs several problems per CTA.
  std::vector<int> lens;
  for (int b = 0; b < 24; ++b) lens.push_back(std::vector<int>{33, 0, 1, 2, 17, 33, 5, 32}[b % 8]);
  run_predict(DType::BF16, 128, 32, lens, 33, 32, 1e-3f, false, 55);
}

// ---- scoring ----

void run_score(DType dtype, int D, int ps, int hq, int hkv, const std::vector<int>& lens, GqaScoreRule rule,
               uint64_t seed) {
  SCOPED_TRACE(std::string(spade::test::dtype_str(dtype)) + " D=" + std::to_string(D) + " ps=" + std::to_string(ps) +
               " hq=" + std::to_string(hq) + " hkv=" + std::to_string(hkv) +
               (rule == GqaScoreRule::kMax ? " max" : " mean"));
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(lens.size());
  PagedCache cache;
  cache.build(dtype, lens, ps, hkv, D, rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> qh(static_cast<size_t>(batch) * hq * D);
  for (float& x : qh) x = nd(rng);
  const int stride = *std::max_element(lens.begin(), lens.end()) + 5;
  std::vector<float> ref(static_cast<size_t>(batch) * hkv * stride, 0.f);
  ScoreTokensRefParams rp;
  rp.q_hat = qh.data();
  rp.k_cache = cache.k32.data();
  rp.block_table = cache.block_table.data();
  rp.num_tokens = lens.data();
  rp.scores = ref.data();
  rp.batch = batch;
  rp.num_q_heads = hq;
  rp.num_kv_heads = hkv;
  rp.head_dim = D;
  rp.page_size = ps;
  rp.max_pages_per_seq = cache.max_pages;
  rp.score_stride = stride;
  rp.rule = rule;
  score_tokens_ref(rp);

  DevBuf<float> d_q, scores(ref.size());
  d_q.upload(qh);
  DevBuf<int32_t> d_lens;
  d_lens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
  scores.poison();
  ScoreTokensParams p;
  p.dtype = dtype;
  p.q_hat = d_q.get();
  p.k_cache = cache.k.get();
  p.block_table = cache.bt.get();
  p.num_tokens = d_lens.get();
  p.scores = scores.get();
  p.batch = batch;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.score_stride = stride;
  p.rule = rule;
  SPADE_CUDA_OK(score_tokens(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = scores.download();
  const int G = hq / hkv;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hkv; ++h) {
      const size_t row = (static_cast<size_t>(b) * hkv + h) * stride;
      for (int t = 0; t < lens[b]; ++t) {
        // Bound: ~2^-16 relative error of the hi+lo split per product plus fp32 accumulation.
        const int page = cache.block_table[static_cast<size_t>(b) * cache.max_pages + t / ps];
        const float* k = cache.k32.data() + ((static_cast<size_t>(page) * ps + t % ps) * hkv + h) * D;
        double mag = 0.0;
        for (int g = 0; g < G; ++g) {
          double m = 0.0;
          for (int d = 0; d < D; ++d) m += std::fabs(qh[(static_cast<size_t>(b) * hq + h * G + g) * D + d] * k[d]);
          mag = std::max(mag, m);
        }
        ASSERT_NEAR(got[row + t], ref[row + t], 1e-4 * mag + 1e-6) << "b " << b << " kvh " << h << " t " << t;
      }
    }
  }
}

TEST(ScoreGpu, Bf16D128Page16Group4Max) {
  run_score(DType::BF16, 128, 16, 32, 8, {1, 100, 5000}, GqaScoreRule::kMax, 61);
}
TEST(ScoreGpu, Bf16D128Page16Group4Mean) { run_score(DType::BF16, 128, 16, 32, 8, {77, 3000}, GqaScoreRule::kMean, 62); }
TEST(ScoreGpu, Fp16D64Page64Group8) { run_score(DType::F16, 64, 64, 16, 2, {4097, 31}, GqaScoreRule::kMax, 63); }
TEST(ScoreGpu, Bf16D256Page32Group1) { run_score(DType::BF16, 256, 32, 2, 2, {2000}, GqaScoreRule::kMean, 64); }
TEST(ScoreGpu, LongBf16D128Page16Group4) { run_score(DType::BF16, 128, 16, 8, 2, {131072}, GqaScoreRule::kMax, 65); }

// ---- top-k ----

void run_topk(const std::vector<int>& lens, int rows_per_batch, int k, int distinct_levels, bool specials,
              uint64_t seed) {
  SCOPED_TRACE("k=" + std::to_string(k) + " levels=" + std::to_string(distinct_levels));
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(lens.size());
  const int stride = *std::max_element(lens.begin(), lens.end()) + 3;
  std::vector<float> s(static_cast<size_t>(batch) * rows_per_batch * stride);
  std::normal_distribution<float> nd(0.f, 10.f);
  std::uniform_int_distribution<int> lvl(0, std::max(0, distinct_levels - 1));
  for (float& x : s) x = distinct_levels > 0 ? static_cast<float>(lvl(rng)) - 3.f : nd(rng);
  if (specials) {
    std::uniform_int_distribution<size_t> pick(0, s.size() - 1);
    for (int i = 0; i < 50; ++i) s[pick(rng)] = std::numeric_limits<float>::infinity();
    for (int i = 0; i < 50; ++i) s[pick(rng)] = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < 50; ++i) s[pick(rng)] = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < 50; ++i) s[pick(rng)] = -0.f;
    for (int i = 0; i < 50; ++i) s[pick(rng)] = 0.f;
  }
  const size_t rows = static_cast<size_t>(batch) * rows_per_batch;
  std::vector<int32_t> ref(rows * k), ref_cnt(rows);
  TopkRefParams rp;
  rp.scores = s.data();
  rp.row_lens = lens.data();
  rp.indices = ref.data();
  rp.counts = ref_cnt.data();
  rp.batch = batch;
  rp.rows_per_batch = rows_per_batch;
  rp.score_stride = stride;
  rp.k = k;
  topk_ref(rp);

  DevBuf<float> d_s;
  d_s.upload(s);
  DevBuf<int32_t> d_lens, idx(ref.size()), cnt(rows);
  d_lens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
  idx.poison();
  cnt.poison();
  TopkParams p;
  p.scores = d_s.get();
  p.row_lens = d_lens.get();
  p.indices = idx.get();
  p.counts = cnt.get();
  p.batch = batch;
  p.rows_per_batch = rows_per_batch;
  p.score_stride = stride;
  p.k = k;
  SPADE_CUDA_OK(topk_select(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cnt.download(), ref_cnt);
  const std::vector<int32_t> got = idx.download();
  for (size_t r = 0; r < rows; ++r) {
    for (int i = 0; i < k; ++i) ASSERT_EQ(got[r * k + i], ref[r * k + i]) << "row " << r << " slot " << i;
  }
}

TEST(TopkGpu, DistinctScoresRagged) { run_topk({1, 100, 5000, 32768}, 3, 2048, 0, false, 71); }
TEST(TopkGpu, HeavyTiesAndSpecials) { run_topk({20000, 4096, 9000}, 2, 4096, 16, true, 72); }
TEST(TopkGpu, SmallK) { run_topk({1000, 33}, 4, 1, 0, true, 73); }
TEST(TopkGpu, AllEqual) { run_topk({3000}, 1, 700, 1, false, 74); }
TEST(TopkGpu, LongRows256k) { run_topk({262144, 200000}, 2, 4096, 0, false, 75); }

// ---- gather ----

TEST(GatherGpu, MatchesReferenceWithPadding) {
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int D : {64, 128, 256}) {
      SCOPED_TRACE(std::string(spade::test::dtype_str(dtype)) + " D=" + std::to_string(D));
      std::mt19937_64 rng(80 + D);
      const std::vector<int> lens = {3000, 50};
      const int hkv = 2, ps = 16, k = 300;
      PagedCache cache;
      cache.build(dtype, lens, ps, hkv, D, rng);
      std::vector<int32_t> idx(static_cast<size_t>(lens.size()) * hkv * k, -1);
      for (size_t b = 0; b < lens.size(); ++b) {
        std::uniform_int_distribution<int> pos(0, lens[b] - 1);
        for (int h = 0; h < hkv; ++h) {
          const int n = std::min(k, lens[b]);  // the short sequence leaves -1 padding
          for (int i = 0; i < n; ++i) idx[(b * hkv + h) * k + i] = pos(rng);
        }
      }
      const size_t packed_n = idx.size() * D;
      std::vector<float> rk(packed_n), rv(packed_n);
      GatherKvRefParams rp;
      rp.k_cache = cache.k32.data();
      rp.v_cache = cache.v32.data();
      rp.block_table = cache.block_table.data();
      rp.indices = idx.data();
      rp.packed_k = rk.data();
      rp.packed_v = rv.data();
      rp.batch = static_cast<int>(lens.size());
      rp.num_kv_heads = hkv;
      rp.head_dim = D;
      rp.page_size = ps;
      rp.max_pages_per_seq = cache.max_pages;
      rp.k = k;
      gather_kv_ref(rp);

      DevBuf<int32_t> d_idx;
      d_idx.upload(idx);
      DevBuf<uint16_t> pk(packed_n), pv(packed_n);
      pk.poison();
      pv.poison();
      GatherKvParams p;
      p.dtype = dtype;
      p.k_cache = cache.k.get();
      p.v_cache = cache.v.get();
      p.block_table = cache.bt.get();
      p.indices = d_idx.get();
      p.packed_k = pk.get();
      p.packed_v = pv.get();
      p.batch = rp.batch;
      p.num_kv_heads = hkv;
      p.head_dim = D;
      p.page_size = ps;
      p.max_pages_per_seq = cache.max_pages;
      p.k = k;
      SPADE_CUDA_OK(gather_kv(p, nullptr));
      SPADE_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(spade::test::to_f32(dtype, pk.download()), rk);
      EXPECT_EQ(spade::test::to_f32(dtype, pv.download()), rv);
    }
  }
}

}  // namespace
}  // namespace spade::kernels

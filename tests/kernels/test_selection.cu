// GPU tests: cache-rank selection kernels (predictor, scoring, top-k, gather) against kernels/selection_ref.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/selection.cuh"
#include "kernels/selection_delta_ref.h"
#include "kernels/selection_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::name_dtype;
using spade::test::name_ints;
using spade::test::PagedCache;

/// The exponent form of an eps in a test name: 1e-3 -> "1em03".
std::string eps_name(float eps) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0e", static_cast<double>(eps));
  std::string e = buf;
  for (char& ch : e) ch = ch == '-' ? 'm' : (ch == '+' ? 'p' : ch);
  return e;
}

// ---- predictor ----

void run_predict(PredictorKind kind, DType wdtype, int D, int heads, const std::vector<int>& lens, int cap,
                 int max_reg, float eps, bool constant_rows, uint64_t seed) {
  SCOPED_TRACE(std::string(predictor_kind_name(kind)) + " D=" + std::to_string(D) + " cap=" + std::to_string(cap) +
               " W=" + std::to_string(max_reg) + " eps=" + std::to_string(eps));
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
  rp.kind = kind;
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
  p.kind = kind;
  SPADE_CUDA_OK(predict_next_query(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = out.download();
  for (size_t r = 0; r < static_cast<size_t>(batch) * heads; ++r) {
    const int n = lens[r / heads];
    double num = 0.0, den = 0.0;
    for (int d = 0; d < D; ++d) {
      const float g = got[r * D + d];
      ASSERT_TRUE(std::isfinite(g)) << "row " << r << " window length " << n;
      num += (g - ref[r * D + d]) * (g - ref[r * D + d]);
      den += static_cast<double>(ref[r * D + d]) * ref[r * D + d];
    }
    if (den == 0.0) {
      EXPECT_EQ(num, 0.0) << "row " << r << " window length " << n;
    } else {
      EXPECT_LE(std::sqrt(num / den), 1e-5) << "row " << r << " window length " << n;
    }
    // No regression possible, or the last-query predictor: exactly Q_t (the window's slot n - 1).
    if (n >= 1 && (n == 1 || kind == PredictorKind::kLastQuery)) {
      for (int d = 0; d < D; ++d)
        ASSERT_EQ(got[r * D + d], win[(r * cap + n - 1) * D + d]) << "row " << r << " d " << d;
    }
  }
  // Windows no longer than max_regressors + 1 give every problem the same m regressors under any larger bound, so
  // the general kernel (max_regressors kMaxPredictorWindow) must give the same bits as the launcher's choice for
  // max_reg (the small-W kernel for max_reg <= 8): the kernel choice never changes a prediction.
  if (max_reg < kMaxPredictorWindow && cap - 1 <= max_reg) {
    DevBuf<float> general(ref.size());
    general.poison();
    p.q_hat = general.get();
    p.max_regressors = kMaxPredictorWindow;
    SPADE_CUDA_OK(predict_next_query(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> g = general.download();
    for (size_t i = 0; i < g.size(); ++i)
      ASSERT_EQ(std::memcmp(&g[i], &got[i], sizeof(float)), 0)
          << "element " << i << ": W " << max_reg << " gave " << got[i] << ", the general kernel " << g[i];
  }
}

struct PredictRunCase {
  PredictorKind kind = PredictorKind::kPaper;
  DType window_dtype = DType::BF16;
  int head_dim = 128;
  int heads = 0;
  std::vector<int> lens;  // window length per sequence
  int capacity = 0;       // window capacity
  int max_regressors = 0;
  float eps = 0.f;
  bool constant_rows = false;
  uint64_t seed = 0;
};

std::string case_name(const PredictRunCase& c) {
  return std::string(predictor_kind_name(c.kind)) + "_" + name_dtype(c.window_dtype) + "_D" +
         std::to_string(c.head_dim) + "_heads" + std::to_string(c.heads) +
         (c.lens.size() <= 8 ? "_lens" + name_ints(c.lens) : "_batch" + std::to_string(c.lens.size())) + "_cap" +
         std::to_string(c.capacity) + "_W" + std::to_string(c.max_regressors) + "_eps" + eps_name(c.eps) +
         (c.constant_rows ? "_constant" : "");
}

void PrintTo(const PredictRunCase& c, std::ostream* os) {
  *os << case_name(c) << " lens=" << name_ints(c.lens) << " seed=" << c.seed;
}

/// `n` window lengths cycling through `pattern`.
std::vector<int> cycle_lens(const std::vector<int>& pattern, int n) {
  std::vector<int> v;
  for (int b = 0; b < n; ++b) v.push_back(pattern[static_cast<size_t>(b) % pattern.size()]);
  return v;
}

// clang-format off
const std::vector<PredictRunCase> kPredictCases = {
    // full and partial windows
    {.kind = PredictorKind::kPaper, .window_dtype = DType::F32, .head_dim = 128, .heads = 5, .lens = {33, 17, 2, 1, 0},
     .capacity = 33, .max_regressors = 32, .eps = 1e-3f, .seed = 51},
    {.kind = PredictorKind::kPaper, .window_dtype = DType::BF16, .head_dim = 64, .heads = 4, .lens = {33, 9, 20},
     .capacity = 33, .max_regressors = 8, .eps = 1e-2f, .seed = 52},
    {.kind = PredictorKind::kPaper, .window_dtype = DType::F16, .head_dim = 256, .heads = 3, .lens = {12, 5},
     .capacity = 12, .max_regressors = 32, .eps = 1e-3f, .seed = 53},
    // constant windows: a singular Gram
    {.kind = PredictorKind::kPaper, .window_dtype = DType::F32, .head_dim = 128, .heads = 2, .lens = {33, 10},
     .capacity = 33, .max_regressors = 32, .eps = 1e-4f, .constant_rows = true, .seed = 54},
    // 24 x 32 = 768 rows: more than two CTAs per SM, so the launcher packs several problems per CTA.
    {.kind = PredictorKind::kPaper, .window_dtype = DType::BF16, .head_dim = 128, .heads = 32,
     .lens = cycle_lens({33, 0, 1, 2, 17, 33, 5, 32}, 24), .capacity = 33, .max_regressors = 32, .eps = 1e-3f,
     .seed = 55},
    // the runtime's predictor (kRidge, W 8, window capacity W + 1; the launcher's small-W kernel), one problem per CTA
    // and, with 24 x 32 rows, several per CTA; then kRidge on the large-W kernel (W 12) and W 8 over a window longer
    // than W + 1 (only its last W + 1 queries are read)
    {.kind = PredictorKind::kRidge, .window_dtype = DType::BF16, .head_dim = 128, .heads = 8,
     .lens = {9, 0, 1, 2, 5, 9}, .capacity = 9, .max_regressors = 8, .eps = 1e-3f, .seed = 56},
    {.kind = PredictorKind::kRidge, .window_dtype = DType::BF16, .head_dim = 128, .heads = 32,
     .lens = cycle_lens({9, 0, 1, 2, 7, 9, 5, 8}, 24), .capacity = 9, .max_regressors = 8, .eps = 1e-3f,
     .seed = 57},
    {.kind = PredictorKind::kRidge, .window_dtype = DType::F32, .head_dim = 64, .heads = 4, .lens = {13, 6, 20},
     .capacity = 20, .max_regressors = 12, .eps = 1e-3f, .seed = 58},
    {.kind = PredictorKind::kRidge, .window_dtype = DType::F16, .head_dim = 256, .heads = 3, .lens = {33, 4, 12},
     .capacity = 33, .max_regressors = 8, .eps = 1e-3f, .seed = 59},
};
// clang-format on

class PredictGpu : public ::testing::TestWithParam<PredictRunCase> {};

TEST_P(PredictGpu, MatchesReference) {
  const PredictRunCase& c = GetParam();
  run_predict(c.kind, c.window_dtype, c.head_dim, c.heads, c.lens, c.capacity, c.max_regressors, c.eps,
              c.constant_rows, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, PredictGpu, ::testing::ValuesIn(kPredictCases), spade::test::CaseName());

// Every predictor kind against predict_next_query_ref: window lengths 0..33 (capacity 33), W in {1, 8, 32}; kRidge
// over relative eps from 1e-4 to 1 (1e-2 is the cache rank's default), kPaper with absolute eps; every dtype and
// head_dim; constant windows (a singular Gram without eps); many rows (several problems per CTA).
struct PredictCase {
  PredictorKind kind = PredictorKind::kRidge;
  float eps = 1e-2f;
  int W = 8;
  DType dtype = DType::BF16;
  int D = 128;
  bool constant_rows = false;
  bool many_rows = false;
};

std::string predict_case_name(const ::testing::TestParamInfo<PredictCase>& info) {
  const PredictCase& c = info.param;
  const std::string e = eps_name(c.eps);
  const char* dt = c.dtype == DType::F32 ? "f32" : spade::test::dtype_str(c.dtype);
  return std::string(predictor_kind_name(c.kind)) + "_eps" + e + "_W" + std::to_string(c.W) + "_" + dt + "_D" +
         std::to_string(c.D) + (c.constant_rows ? "_constant" : "") + (c.many_rows ? "_manyrows" : "");
}

void PrintTo(const PredictCase& c, std::ostream* os) { *os << predict_case_name({c, 0}); }

PredictCase predict_case(PredictorKind kind, float eps, int W, DType dtype = DType::BF16, int D = 128,
                         bool constant_rows = false, bool many_rows = false) {
  PredictCase c;
  c.kind = kind;
  c.eps = eps;
  c.W = W;
  c.dtype = dtype;
  c.D = D;
  c.constant_rows = constant_rows;
  c.many_rows = many_rows;
  return c;
}

std::vector<PredictCase> predict_cases() {
  std::vector<PredictCase> v;
  for (int W : {1, 8, 32}) {
    for (float eps : {1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.f}) v.push_back(predict_case(PredictorKind::kRidge, eps, W));
    for (float eps : {1e-3f, 1e-2f}) v.push_back(predict_case(PredictorKind::kPaper, eps, W));
    v.push_back(predict_case(PredictorKind::kLastQuery, 1e-2f, W));
  }
  for (PredictorKind kind : {PredictorKind::kRidge, PredictorKind::kPaper, PredictorKind::kLastQuery}) {
    v.push_back(predict_case(kind, 1e-2f, 32, DType::F32, 64));
    v.push_back(predict_case(kind, 1e-2f, 8, DType::F16, 256));
    v.push_back(predict_case(kind, 1e-4f, 32, DType::F32, 128, /*constant_rows=*/true));
    v.push_back(predict_case(kind, 1e-2f, 32, DType::BF16, 128, false, /*many_rows=*/true));
  }
  return v;
}

class PredictKinds : public ::testing::TestWithParam<PredictCase> {};

TEST_P(PredictKinds, MatchesReference) {
  const PredictCase& c = GetParam();
  std::vector<int> lens;
  int heads = 3;
  if (c.many_rows) {  // 24 x 32 = 768 rows: several problems per CTA
    for (int b = 0; b < 24; ++b) lens.push_back(std::vector<int>{33, 0, 1, 2, 17, 33, 5, 32}[b % 8]);
    heads = 32;
  } else {
    for (int n = 0; n <= kMaxPredictorWindow + 1; ++n) lens.push_back(n);  // every window length 0..33
  }
  run_predict(c.kind, c.dtype, c.D, heads, lens, kMaxPredictorWindow + 1, c.W, c.eps, c.constant_rows,
              1000 + static_cast<uint64_t>(c.W) * 7 + static_cast<uint64_t>(c.D));
}

INSTANTIATE_TEST_SUITE_P(PredictGpu, PredictKinds, ::testing::ValuesIn(predict_cases()), predict_case_name);

TEST_F(PredictGpu, DefaultKindIsRidgeAndAnUnknownKindIsRefused) {
  PredictQueryParams p;
  EXPECT_EQ(p.kind, PredictorKind::kRidge);  // the runtime's default, as PredictQueryRefParams
  DevBuf<float> win(static_cast<size_t>(2) * 128), out(128);
  DevBuf<int32_t> lens;
  lens.upload(std::vector<int32_t>{2});
  p.window = win.get();
  p.window_len = lens.get();
  p.q_hat = out.get();
  p.batch = 1;
  p.num_heads = 1;
  p.window_capacity = 2;
  p.head_dim = 128;
  p.max_regressors = 1;
  p.eps = 1e-2f;
  p.kind = static_cast<PredictorKind>(7);
  EXPECT_EQ(predict_next_query(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("kind"), std::string::npos);
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

struct ScoreCase {
  DType dtype = DType::BF16;
  int head_dim = 128;
  int page_size = 16;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  std::vector<int> lens;  // tokens per sequence
  GqaScoreRule rule = GqaScoreRule::kMax;
  uint64_t seed = 0;
};

std::string case_name(const ScoreCase& c) {
  return spade::test::long_prefix(spade::test::max_of(c.lens) >= spade::test::kLongContext) +
         name_dtype(c.dtype) + "_D" + std::to_string(c.head_dim) + "_page" + std::to_string(c.page_size) + "_hkv" +
         std::to_string(c.num_kv_heads) + "_group" + std::to_string(c.num_q_heads / c.num_kv_heads) + "_lens" +
         name_ints(c.lens) + (c.rule == GqaScoreRule::kMax ? "_max" : "_mean");
}

void PrintTo(const ScoreCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<ScoreCase> kScoreCases = {
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {1, 100, 5000}, .rule = GqaScoreRule::kMax, .seed = 61},
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {77, 3000}, .rule = GqaScoreRule::kMean, .seed = 62},
    {.dtype = DType::F16, .head_dim = 64, .page_size = 64, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {4097, 31}, .rule = GqaScoreRule::kMax, .seed = 63},
    {.dtype = DType::BF16, .head_dim = 256, .page_size = 32, .num_q_heads = 2, .num_kv_heads = 2,
     .lens = {2000}, .rule = GqaScoreRule::kMean, .seed = 64},
    // a long context (name starts with "Long_")
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {131072}, .rule = GqaScoreRule::kMax, .seed = 65},
};
// clang-format on

class ScoreGpu : public ::testing::TestWithParam<ScoreCase> {};

TEST_P(ScoreGpu, MatchesReference) {
  const ScoreCase& c = GetParam();
  run_score(c.dtype, c.head_dim, c.page_size, c.num_q_heads, c.num_kv_heads, c.lens, c.rule, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, ScoreGpu, ::testing::ValuesIn(kScoreCases), spade::test::CaseName());

// ---- top-k ----

void run_topk(const std::vector<int>& lens, int rows_per_batch, int k, int distinct_levels, bool specials,
              uint64_t seed, bool successor = false) {
  SCOPED_TRACE("k=" + std::to_string(k) + " levels=" + std::to_string(distinct_levels) +
               (successor ? " successor" : ""));
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
  rp.successor = successor;
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
  p.successor = successor;
  SPADE_CUDA_OK(topk_select(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cnt.download(), ref_cnt);
  const std::vector<int32_t> got = idx.download();
  for (size_t r = 0; r < rows; ++r) {
    for (int i = 0; i < k; ++i) ASSERT_EQ(got[r * k + i], ref[r * k + i]) << "row " << r << " slot " << i;
  }
}

struct TopkRunCase {
  std::vector<int> lens;  // row length per sequence
  int rows_per_batch = 1;
  int k = 1;
  int levels = 0;  // 0: distinct normal scores; else integer levels (ties)
  bool specials = false;  // NaN, +-inf, signed zeros
  uint64_t seed = 0;
};

// Named like TopkGpu/TopkSuccessor's cases (topk_case_name below), with "Long_" first for long rows.
std::string case_name(const TopkRunCase& c) {
  return spade::test::long_prefix(spade::test::max_of(c.lens) >= spade::test::kLongContext) + "len" +
         name_ints(c.lens) + "_rows" + std::to_string(c.rows_per_batch) + "_k" + std::to_string(c.k) + "_levels" +
         std::to_string(c.levels) + (c.specials ? "_specials" : "");
}

void PrintTo(const TopkRunCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<TopkRunCase> kTopkCases = {
    // distinct scores, ragged rows
    {.lens = {1, 100, 5000, 32768}, .rows_per_batch = 3, .k = 2048, .levels = 0, .seed = 71},
    // heavy ties and specials
    {.lens = {20000, 4096, 9000}, .rows_per_batch = 2, .k = 4096, .levels = 16, .specials = true, .seed = 72},
    // small k
    {.lens = {1000, 33}, .rows_per_batch = 4, .k = 1, .levels = 0, .specials = true, .seed = 73},
    // all equal
    {.lens = {3000}, .rows_per_batch = 1, .k = 700, .levels = 1, .seed = 74},
    // long rows (256k; name starts with "Long_")
    {.lens = {262144, 200000}, .rows_per_batch = 2, .k = 4096, .levels = 0, .seed = 75},
};
// clang-format on

class TopkGpu : public ::testing::TestWithParam<TopkRunCase> {};

TEST_P(TopkGpu, MatchesReference) {
  const TopkRunCase& c = GetParam();
  run_topk(c.lens, c.rows_per_batch, c.k, c.levels, c.specials, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, TopkGpu, ::testing::ValuesIn(kTopkCases), spade::test::CaseName());

// Successor expansion (entry i > 0 ranks by max(key(s[i]), key(s[i-1]))) against topk_ref. The cases cover rows with
// n <= k (every position, no ranking), rows shorter than a warp and not a multiple of 32 (the cached load's
// predecessor shuffle), heavy ties and NaN / signed zeros / infinities, rows at the shared-memory cache size
// (44 * 1024 keys) and just past it (the uncached re-reads), and isolated peaks (sparse high scores, where the
// expansion decides most of the selection).
struct TopkCase {
  std::vector<int> lens;
  int rows_per_batch = 1;
  int k = 1;
  int levels = 0;  // 0: distinct normal scores; else integer levels (ties)
  bool specials = false;
  bool peaks = false;
};

std::string topk_case_name(const ::testing::TestParamInfo<TopkCase>& info) {
  const TopkCase& c = info.param;
  std::string name = "len";
  for (size_t i = 0; i < c.lens.size(); ++i) name += (i > 0 ? "_" : "") + std::to_string(c.lens[i]);
  name += "_rows" + std::to_string(c.rows_per_batch) + "_k" + std::to_string(c.k) + "_levels" +
          std::to_string(c.levels);
  if (c.specials) name += "_specials";
  if (c.peaks) name += "_peaks";
  return name;
}

void PrintTo(const TopkCase& c, std::ostream* os) { *os << topk_case_name({c, 0}); }

TopkCase topk_case(std::vector<int> lens, int rows_per_batch, int k, int levels, bool specials, bool peaks = false) {
  TopkCase c;
  c.lens = std::move(lens);
  c.rows_per_batch = rows_per_batch;
  c.k = k;
  c.levels = levels;
  c.specials = specials;
  c.peaks = peaks;
  return c;
}

class TopkSuccessor : public ::testing::TestWithParam<TopkCase> {};

TEST_P(TopkSuccessor, MatchesReference) {
  const TopkCase& c = GetParam();
  const uint64_t seed = 700 + static_cast<uint64_t>(c.k) + static_cast<uint64_t>(c.lens[0]);
  if (!c.peaks) {
    run_topk(c.lens, c.rows_per_batch, c.k, c.levels, c.specials, seed, /*successor=*/true);
    return;
  }
  // Peaks: 1 % of the positions score high, the rest low (levels > 0: the peaks tie among themselves).
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(c.lens.size());
  const int stride = *std::max_element(c.lens.begin(), c.lens.end()) + 1;
  std::vector<float> s(static_cast<size_t>(batch) * c.rows_per_batch * stride);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (float& x : s) x = u(rng) < 0.01f ? (c.levels > 0 ? 100.f : 100.f + nd(rng)) : nd(rng);
  const size_t rows = static_cast<size_t>(batch) * c.rows_per_batch;
  std::vector<int32_t> ref(rows * c.k);
  TopkRefParams rp;
  rp.scores = s.data();
  rp.row_lens = c.lens.data();
  rp.indices = ref.data();
  rp.batch = batch;
  rp.rows_per_batch = c.rows_per_batch;
  rp.score_stride = stride;
  rp.k = c.k;
  rp.successor = true;
  topk_ref(rp);
  DevBuf<float> d_s;
  d_s.upload(s);
  DevBuf<int32_t> d_lens, idx(ref.size());
  d_lens.upload(std::vector<int32_t>(c.lens.begin(), c.lens.end()));
  idx.poison();
  TopkParams p;
  p.scores = d_s.get();
  p.row_lens = d_lens.get();
  p.indices = idx.get();
  p.batch = batch;
  p.rows_per_batch = c.rows_per_batch;
  p.score_stride = stride;
  p.k = c.k;
  p.successor = true;
  SPADE_CUDA_OK(topk_select(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = idx.download();
  for (size_t r = 0; r < rows; ++r) {
    for (int i = 0; i < c.k; ++i) ASSERT_EQ(got[r * c.k + i], ref[r * c.k + i]) << "row " << r << " slot " << i;
  }
  // The expansion took every peak's successor (k >= 2 x peaks in these rows).
  for (size_t r = 0; r < rows; ++r) {
    const int n = c.lens[r / c.rows_per_batch];
    if (n <= c.k) continue;
    const std::set<int32_t> sel(got.begin() + static_cast<long>(r * c.k), got.begin() + static_cast<long>((r + 1) * c.k));
    for (int i = 0; i + 1 < n; ++i) {
      if (s[r * stride + i] >= 50.f) EXPECT_EQ(sel.count(i + 1), 1u) << "row " << r << ": successor of peak " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    TopkGpu, TopkSuccessor,
    ::testing::Values(topk_case({1, 100, 5000, 32768}, 3, 2048, 0, false),  // n <= k rows beside long ones
                      topk_case({20000, 4096, 9000}, 2, 4096, 16, true),    // heavy ties, specials, n == k
                      topk_case({1000, 33, 37, 5}, 4, 1, 0, true),          // k = 1; rows shorter than a warp
                      topk_case({1025, 31}, 2, 7, 2, false),                // two levels; one lane past a pass
                      topk_case({3000}, 1, 700, 1, false),                  // all equal
                      topk_case({45056, 45057}, 2, 3000, 8, true),          // at / past the cache size, ties
                      topk_case({262144, 200000}, 2, 4096, 0, false),       // long rows: the uncached path
                      topk_case({60000, 8000}, 2, 2048, 0, false, true),    // distinct peaks, both paths
                      topk_case({50000, 9000}, 2, 1500, 1, false, true)),   // tied peaks, both paths
    topk_case_name);

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

// ---- delta transfer (selection_delta / apply_selection_delta vs kernels/selection_delta_ref.h) ----

// Random selections per row ([rows, k], ascending then -1) that keep a fraction of the previous row's tokens; row
// counts vary (0, growth, shrink) with the step.
std::vector<int32_t> delta_selection(std::mt19937_64& rng, int rows, int k, int step, int context,
                                     const std::vector<int32_t>& prev, double keep) {
  std::vector<int32_t> sel(static_cast<size_t>(rows) * k, -1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int r = 0; r < rows; ++r) {
    int n = std::min(k, (r * 7 + step * 3) % (k + 5));
    if (r == 0) n = 0;
    if (r == 1) n = k;
    std::vector<int32_t> pool;
    for (int i = 0; i < k && !prev.empty(); ++i) {
      const int32_t p = prev[static_cast<size_t>(r) * k + i];
      if (p >= 0 && u(rng) < keep) pool.push_back(p);
    }
    std::vector<char> taken(context, 0);
    std::vector<int32_t> out;
    for (int32_t p : pool)
      if (static_cast<int>(out.size()) < n && !taken[p]) {
        taken[p] = 1;
        out.push_back(p);
      }
    std::uniform_int_distribution<int32_t> pos(0, context - 1);
    while (static_cast<int>(out.size()) < n) {
      const int32_t p = pos(rng);
      if (!taken[p]) {
        taken[p] = 1;
        out.push_back(p);
      }
    }
    std::sort(out.begin(), out.end());
    std::copy(out.begin(), out.end(), sel.begin() + static_cast<size_t>(r) * k);
  }
  return sel;
}

// `mapped`: row r's mirror is row 2r + 1 of a table twice as tall (per-slot mirrors of a serving cache rank); the
// other rows must stay untouched.
void run_delta_stream(int rows, int k, int capacity, int steps, double keep, int levels, uint64_t seed,
                      bool specials = false, bool mapped = false) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " k=" + std::to_string(k) + " capacity=" + std::to_string(capacity) +
               (mapped ? " mirror_rows" : ""));
  std::mt19937_64 rng(seed);
  const int context = 3 * k + 17;
  std::vector<int32_t> mirror_rows;
  for (int r = 0; r < rows && mapped; ++r) mirror_rows.push_back(2 * r + 1);
  DevBuf<int32_t> d_mirror_rows;
  if (mapped) d_mirror_rows.upload(mirror_rows);
  std::vector<int32_t> mirror_ref(static_cast<size_t>(mapped ? 2 * rows : rows) * k, -1), prev;
  DevBuf<int32_t> mirror, d_sel, ds(static_cast<size_t>(rows) * capacity), dp(ds.size()),
      info(static_cast<size_t>(rows) * kDeltaInfoFields);
  mirror.upload(mirror_ref);
  DevBuf<float> d_scores;
  DevBuf<unsigned long long> totals;
  totals.upload(std::vector<unsigned long long>(kDeltaTotalsFields, 0ull));
  std::vector<unsigned long long> want_totals(kDeltaTotalsFields, 0ull);
  uint64_t overflowing = 0;
  std::uniform_int_distribution<int> lvl(0, levels - 1);
  for (int step = 0; step < steps; ++step) {
    const std::vector<int32_t> sel = delta_selection(rng, rows, k, step, context, prev, keep);
    std::vector<float> scores(static_cast<size_t>(rows) * context);
    for (float& x : scores) x = static_cast<float>(lvl(rng)) - 5.f;  // few levels: ties at the threshold
    if (specials) {  // NaN ranks lowest, -0.0 below +0.0, infinities (topk_key's order)
      std::uniform_int_distribution<size_t> pick(0, scores.size() - 1);
      const float sp[5] = {std::numeric_limits<float>::quiet_NaN(), -0.f, 0.f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
      for (int i = 0; i < static_cast<int>(scores.size() / 8); ++i) scores[pick(rng)] = sp[i % 5];
    }
    std::vector<int32_t> rds(ds.size()), rdp(ds.size()), rinfo(info.size());
    SelectionDeltaRefParams rp;
    rp.indices = sel.data();
    rp.scores = scores.data();
    rp.mirror = mirror_ref.data();
    rp.mirror_rows = mapped ? mirror_rows.data() : nullptr;
    rp.delta_slots = rds.data();
    rp.delta_positions = rdp.data();
    rp.row_info = rinfo.data();
    rp.rows = rows;
    rp.k = k;
    rp.capacity = capacity;
    rp.score_stride = context;
    selection_delta_ref(rp);

    d_sel.upload(sel);
    d_scores.upload(scores);
    ds.poison();
    dp.poison();
    info.poison();
    SelectionDeltaParams p;
    p.indices = d_sel.get();
    p.scores = d_scores.get();
    p.mirror = mirror.get();
    p.mirror_rows = mapped ? d_mirror_rows.get() : nullptr;
    p.delta_slots = ds.get();
    p.delta_positions = dp.get();
    p.row_info = info.get();
    p.totals = totals.get();
    p.rows = rows;
    p.k = k;
    p.capacity = capacity;
    p.score_stride = context;
    SPADE_CUDA_OK(selection_delta(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(info.download(), rinfo) << "step " << step;
    ASSERT_EQ(ds.download(), rds) << "step " << step;
    ASSERT_EQ(dp.download(), rdp) << "step " << step;
    ASSERT_EQ(mirror.download(), mirror_ref) << "step " << step;
    for (int r = 0; r < rows; ++r) {
      for (int f = 0; f < kDeltaInfoFields; ++f) want_totals[f] += rinfo[static_cast<size_t>(r) * kDeltaInfoFields + f];
      overflowing += rinfo[static_cast<size_t>(r) * kDeltaInfoFields + kDeltaEntering] > capacity ? 1 : 0;
    }
    prev = sel;
  }
  EXPECT_EQ(totals.download(), want_totals);
  if (capacity < k) EXPECT_GT(overflowing, 0u) << "the stream never exercised the overflow path";
}

struct DeltaStreamCase {
  int rows = 0;
  int k = 0;
  int capacity = 0;  // delta entries per row
  int steps = 0;
  double keep = 0.0;  // fraction of the previous selection kept
  int levels = 0;     // distinct score levels (few: ties at the threshold)
  bool specials = false;     // NaN, signed zeros, infinities among the scores
  bool mirror_rows = false;  // per-slot mirrors: row r's mirror is row 2r + 1 of a table twice as tall
  uint64_t seed = 0;
};

std::string case_name(const DeltaStreamCase& c) {
  return "rows" + std::to_string(c.rows) + "_k" + std::to_string(c.k) + "_cap" + std::to_string(c.capacity) +
         "_steps" + std::to_string(c.steps) + "_keep" + spade::test::name_num(c.keep) + "_levels" +
         std::to_string(c.levels) + (c.specials ? "_specials" : "") + (c.mirror_rows ? "_mirrorrows" : "");
}

void PrintTo(const DeltaStreamCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<DeltaStreamCase> kDeltaStreamCases = {
    // room for every entering token
    {.rows = 24, .k = 256, .capacity = 256, .steps = 12, .keep = 0.8, .levels = 1000000, .seed = 91},
    // overflow and ties
    {.rows = 40, .k = 512, .capacity = 37, .steps = 16, .keep = 0.7, .levels = 6, .seed = 92},
    // the largest budget, capacity 256
    {.rows = 9, .k = 4096, .capacity = 256, .steps = 6, .keep = 0.9, .levels = 50, .seed = 93},
    // capacity one
    {.rows = 12, .k = 33, .capacity = 1, .steps = 20, .keep = 0.5, .levels = 3, .seed = 94},
    // overflow with NaN, signed zeros and infinities
    {.rows = 16, .k = 300, .capacity = 20, .steps = 10, .keep = 0.6, .levels = 4, .specials = true, .seed = 97},
    // per-slot mirror rows
    {.rows = 20, .k = 128, .capacity = 16, .steps = 10, .keep = 0.8, .levels = 8, .mirror_rows = true, .seed = 98},
};
// clang-format on

class DeltaGpu : public ::testing::TestWithParam<DeltaStreamCase> {};

TEST_P(DeltaGpu, StreamMatchesReference) {
  const DeltaStreamCase& c = GetParam();
  run_delta_stream(c.rows, c.k, c.capacity, c.steps, c.keep, c.levels, c.seed, c.specials, c.mirror_rows);
}

INSTANTIATE_TEST_SUITE_P(, DeltaGpu, ::testing::ValuesIn(kDeltaStreamCases), spade::test::CaseName());

TEST_F(DeltaGpu, ApplySplitsLaunchesPast65535Rows) {
  const int rows = 70001, k = 3, cap = 1, D = 64;
  std::vector<int32_t> slots(rows), pos(rows);
  for (int r = 0; r < rows; ++r) {
    slots[r] = r % k;
    pos[r] = r;
  }
  std::vector<uint16_t> dk(static_cast<size_t>(rows) * D);
  for (size_t i = 0; i < dk.size(); ++i) dk[i] = static_cast<uint16_t>(i / D % 50000 + 1);
  DevBuf<int32_t> d_slots, d_pos, hpos(static_cast<size_t>(rows) * k);
  d_slots.upload(slots);
  d_pos.upload(pos);
  hpos.poison();
  DevBuf<uint16_t> d_dk, hk(static_cast<size_t>(rows) * k * D), hv(hk.size());
  d_dk.upload(dk);
  ASSERT_EQ(cudaMemset(hk.get(), 0, hk.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(hv.get(), 0, hv.size() * 2), cudaSuccess);
  ApplySelectionDeltaParams p;
  p.delta_slots = d_slots.get();
  p.delta_positions = d_pos.get();
  p.delta_k = d_dk.get();
  p.delta_v = d_dk.get();
  p.held_k = hk.get();
  p.held_v = hv.get();
  p.held_positions = hpos.get();
  p.rows = rows;
  p.k = k;
  p.capacity = cap;
  p.head_dim = D;
  SPADE_CUDA_OK(apply_selection_delta(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = hk.download();
  const std::vector<int32_t> gp = hpos.download();
  for (int r = 0; r < rows; ++r) {
    const size_t row = static_cast<size_t>(r) * k + slots[r];
    ASSERT_EQ(gp[row], r) << "row " << r;
    ASSERT_EQ(got[row * D + D - 1], dk[static_cast<size_t>(r) * D]) << "row " << r;
  }
  p.rows = 0;  // nothing to do: no launch
  SPADE_CUDA_OK(apply_selection_delta(p, nullptr));
}

TEST_F(DeltaGpu, RefusesCorruptRowsAndLeavesTheirMirrorAlone) {
  const int rows = 6, k = 8, cap = 4;
  std::vector<int32_t> sel = {1, 2, 3, 4, -1, -1, -1, -1,     // row 0: fine
                              1, 2, 3, 4, -1, -1, -1, -1,     // row 1: corrupt mirror (token 2 twice)
                              5, 3, -1, -1, -1, -1, -1, -1,   // row 2: not ascending
                              1, -1, 5, -1, -1, -1, -1, -1,   // row 3: -1 inside the count
                              1, 2, -1, -1, -1, -1, -1, -1,   // row 4: mirror value below -1
                              1, 2, 3, 4, 5, 20, -1, -1};     // row 5: overflows, position 20 >= score_stride 16
  std::vector<int32_t> mir(static_cast<size_t>(rows) * k, -1);
  mir[1 * k + 0] = 2;
  mir[1 * k + 1] = 2;
  mir[4 * k + 1] = -7;
  DevBuf<int32_t> d_sel, mirror, ds(rows * cap), dp(rows * cap), info(rows * kDeltaInfoFields);
  d_sel.upload(sel);
  mirror.upload(mir);
  DevBuf<float> scores;
  scores.upload(std::vector<float>(static_cast<size_t>(rows) * 16, 1.f));
  DevBuf<unsigned long long> totals;
  totals.upload(std::vector<unsigned long long>(kDeltaTotalsFields, 0ull));
  // Not 0xFF (= -1, what a refused row's entries must hold): the kernel has to write them.
  ASSERT_EQ(cudaMemset(ds.get(), 0x7F, ds.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(dp.get(), 0x7F, dp.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(info.get(), 0x7F, info.size() * 4), cudaSuccess);
  SelectionDeltaParams p;
  p.indices = d_sel.get();
  p.scores = scores.get();
  p.mirror = mirror.get();
  p.delta_slots = ds.get();
  p.delta_positions = dp.get();
  p.row_info = info.get();
  p.totals = totals.get();
  p.rows = rows;
  p.k = k;
  p.capacity = cap;
  p.score_stride = 16;
  SPADE_CUDA_OK(selection_delta(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got_info = info.download(), got_mir = mirror.download(), got_ds = ds.download(),
                             got_dp = dp.download();
  EXPECT_EQ(got_info[0 * kDeltaInfoFields + kDeltaEntering], 4);
  EXPECT_EQ(got_info[0 * kDeltaInfoFields + kDeltaEntries], 4);
  for (int j = 0; j < cap; ++j) EXPECT_EQ(got_dp[j], j + 1);
  const int expected_n[rows] = {4, 4, 2, 2, 2, 6};
  for (int r = 1; r < rows; ++r) {
    SCOPED_TRACE("refused row " + std::to_string(r));
    EXPECT_EQ(got_info[r * kDeltaInfoFields + kDeltaCount], expected_n[r]);
    EXPECT_EQ(got_info[r * kDeltaInfoFields + kDeltaEntering], -1);
    EXPECT_EQ(got_info[r * kDeltaInfoFields + kDeltaEntries], 0);
    EXPECT_EQ(got_info[r * kDeltaInfoFields + kDeltaHoles], 0);
    for (int i = 0; i < k; ++i) EXPECT_EQ(got_mir[r * k + i], mir[r * k + i]) << "refused row's mirror changed";
    for (int j = 0; j < cap; ++j) {
      EXPECT_EQ(got_ds[r * cap + j], -1);
      EXPECT_EQ(got_dp[r * cap + j], -1);
    }
  }
  EXPECT_EQ(totals.download()[kDeltaInfoFields], static_cast<unsigned long long>(rows - 1));
  // Bad parameters name the field.
  p.capacity = k + 1;
  EXPECT_EQ(selection_delta(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("capacity"), std::string::npos);
  p.capacity = cap;
  p.k = kMaxDeltaBudget + 1;
  EXPECT_EQ(selection_delta(p, nullptr), cudaErrorInvalidValue);
  p.k = k;
  p.scores = nullptr;
  EXPECT_EQ(selection_delta(p, nullptr), cudaErrorInvalidValue);
}

TEST_F(DeltaGpu, ApplyMatchesReference) {
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int D : {64, 128, 256}) {
     for (bool mapped : {false, true}) {
      SCOPED_TRACE(std::string(spade::test::dtype_str(dtype)) + " D=" + std::to_string(D) +
                   (mapped ? " held_rows" : ""));
      std::mt19937_64 rng(95 + D);
      const int rows = 70, k = 100, cap = 24;
      // held_rows: delta row r lands in held row (r * 37 + 11) % 97 of a larger table (per-slot tables).
      const int held = mapped ? 97 : rows;
      std::vector<int32_t> held_rows;
      for (int r = 0; r < rows && mapped; ++r) held_rows.push_back((r * 37 + 11) % 97);
      std::vector<int32_t> slots(static_cast<size_t>(rows) * cap, -1), pos(slots.size(), -1);
      for (int r = 0; r < rows; ++r) {
        std::vector<int32_t> perm(k);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        const int m = r % (cap + 1);
        for (int j = 0; j < m; ++j) {
          slots[static_cast<size_t>(r) * cap + j] = perm[j];
          pos[static_cast<size_t>(r) * cap + j] = 1000 * r + j;
        }
      }
      std::vector<float> dk32, dv32, hk32, hv32;
      const std::vector<uint16_t> dk = spade::test::random_half(dtype, slots.size() * D, 1.f, rng, &dk32);
      const std::vector<uint16_t> dv = spade::test::random_half(dtype, slots.size() * D, 1.f, rng, &dv32);
      const std::vector<uint16_t> hk = spade::test::random_half(dtype, static_cast<size_t>(held) * k * D, 1.f, rng, &hk32);
      const std::vector<uint16_t> hv = spade::test::random_half(dtype, hk.size(), 1.f, rng, &hv32);
      std::vector<int32_t> hpos(static_cast<size_t>(held) * k, 7);
      ApplySelectionDeltaRefParams rp;
      rp.delta_slots = slots.data();
      rp.delta_positions = pos.data();
      rp.delta_k = dk32.data();
      rp.delta_v = dv32.data();
      rp.held_k = hk32.data();
      rp.held_v = hv32.data();
      rp.held_positions = hpos.data();
      rp.held_rows = mapped ? held_rows.data() : nullptr;
      rp.rows = rows;
      rp.k = k;
      rp.capacity = cap;
      rp.head_dim = D;
      apply_selection_delta_ref(rp);

      DevBuf<int32_t> d_slots, d_pos, d_hpos, d_held_rows;
      if (mapped) d_held_rows.upload(held_rows);
      d_slots.upload(slots);
      d_pos.upload(pos);
      d_hpos.upload(std::vector<int32_t>(hpos.size(), 7));
      DevBuf<uint16_t> d_dk, d_dv, d_hk, d_hv;
      d_dk.upload(dk);
      d_dv.upload(dv);
      d_hk.upload(hk);
      d_hv.upload(hv);
      ApplySelectionDeltaParams p;
      p.dtype = dtype;
      p.delta_slots = d_slots.get();
      p.delta_positions = d_pos.get();
      p.delta_k = d_dk.get();
      p.delta_v = d_dv.get();
      p.held_k = d_hk.get();
      p.held_v = d_hv.get();
      p.held_positions = d_hpos.get();
      p.held_rows = mapped ? d_held_rows.get() : nullptr;
      p.rows = rows;
      p.k = k;
      p.capacity = cap;
      p.head_dim = D;
      SPADE_CUDA_OK(apply_selection_delta(p, nullptr));
      SPADE_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(spade::test::to_f32(dtype, d_hk.download()), hk32);
      EXPECT_EQ(spade::test::to_f32(dtype, d_hv.download()), hv32);
      EXPECT_EQ(d_hpos.download(), hpos);
     }
    }
  }
}

// The cache rank's and the inference rank's halves together: top-k over scores, delta against the mirror, gather of
// the entries only, apply into the held table. With room for every entering token the held table holds exactly the
// selection with the cache's K/V rows; with a small capacity it holds the mirror's tokens with their rows.
TEST_F(DeltaGpu, TopkDeltaGatherApplyKeepsTheHeldTableEqualToTheMirror) {
  const DType dtype = DType::BF16;
  const int D = 128, hkv = 4, ps = 16, k = 512;
  const std::vector<int> lens = {9000, 3000, 600};
  const int batch = static_cast<int>(lens.size()), rows = batch * hkv;
  std::mt19937_64 rng(96);
  PagedCache cache;
  cache.build(dtype, lens, ps, hkv, D, rng);
  const int stride = 9000;
  DevBuf<float> d_scores(static_cast<size_t>(rows) * stride);
  DevBuf<int32_t> d_lens, idx(static_cast<size_t>(rows) * k), mirror, held_pos;
  d_lens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
  mirror.upload(std::vector<int32_t>(static_cast<size_t>(rows) * k, -1));
  held_pos.upload(std::vector<int32_t>(static_cast<size_t>(rows) * k, -1));
  DevBuf<uint16_t> held_k(static_cast<size_t>(rows) * k * D), held_v(held_k.size());
  held_k.poison();
  held_v.poison();
  std::vector<float> scores(static_cast<size_t>(rows) * stride);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : scores) x = nd(rng);
  for (int step = 0; step < 6; ++step) {
    const int cap = step == 0 ? k : (step < 3 ? 64 : 200);
    // Scores drift: most of the top-k survives a step.
    for (float& x : scores) x = 0.95f * x + 0.3f * nd(rng);
    d_scores.upload(scores);
    TopkParams tp;
    tp.scores = d_scores.get();
    tp.row_lens = d_lens.get();
    tp.indices = idx.get();
    tp.batch = batch;
    tp.rows_per_batch = hkv;
    tp.score_stride = stride;
    tp.k = k;
    SPADE_CUDA_OK(topk_select(tp, nullptr));
    DevBuf<int32_t> ds(static_cast<size_t>(rows) * cap), dp(ds.size()), info(static_cast<size_t>(rows) * 4);
    SelectionDeltaParams sp;
    sp.indices = idx.get();
    sp.scores = d_scores.get();
    sp.mirror = mirror.get();
    sp.delta_slots = ds.get();
    sp.delta_positions = dp.get();
    sp.row_info = info.get();
    sp.rows = rows;
    sp.k = k;
    sp.capacity = cap;
    sp.score_stride = stride;
    SPADE_CUDA_OK(selection_delta(sp, nullptr));
    DevBuf<uint16_t> dk(ds.size() * D), dv(ds.size() * D);
    dk.poison();
    dv.poison();
    GatherKvParams gp;
    gp.dtype = dtype;
    gp.k_cache = cache.k.get();
    gp.v_cache = cache.v.get();
    gp.block_table = cache.bt.get();
    gp.indices = dp.get();
    gp.packed_k = dk.get();
    gp.packed_v = dv.get();
    gp.batch = batch;
    gp.num_kv_heads = hkv;
    gp.head_dim = D;
    gp.page_size = ps;
    gp.max_pages_per_seq = cache.max_pages;
    gp.k = cap;
    SPADE_CUDA_OK(gather_kv(gp, nullptr));
    ApplySelectionDeltaParams ap;
    ap.dtype = dtype;
    ap.delta_slots = ds.get();
    ap.delta_positions = dp.get();
    ap.delta_k = dk.get();
    ap.delta_v = dv.get();
    ap.held_k = held_k.get();
    ap.held_v = held_v.get();
    ap.held_positions = held_pos.get();
    ap.rows = rows;
    ap.k = k;
    ap.capacity = cap;
    ap.head_dim = D;
    SPADE_CUDA_OK(apply_selection_delta(ap, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> sel = idx.download(), mir = mirror.download(), hp = held_pos.download(),
                               in = info.download();
    const std::vector<float> hk = spade::test::to_f32(dtype, held_k.download()),
                             hv = spade::test::to_f32(dtype, held_v.download());
    int64_t entering = 0, sent = 0;
    for (int r = 0; r < rows; ++r) {
      const int b = r / hkv, h = r % hkv;
      const int n = in[static_cast<size_t>(r) * 4 + kDeltaCount];
      ASSERT_EQ(n, std::min(k, lens[b]));
      entering += in[static_cast<size_t>(r) * 4 + kDeltaEntering];
      sent += in[static_cast<size_t>(r) * 4 + kDeltaEntries];
      ASSERT_EQ(in[static_cast<size_t>(r) * 4 + kDeltaHoles], 0) << "step " << step << " row " << r;
      std::set<int32_t> held, want(sel.begin() + static_cast<size_t>(r) * k, sel.begin() + static_cast<size_t>(r) * k + n);
      for (int s = 0; s < n; ++s) {
        const size_t slot = static_cast<size_t>(r) * k + s;
        ASSERT_EQ(hp[slot], mir[slot]) << "step " << step << " row " << r << " slot " << s;
        const int32_t pos = hp[slot];
        held.insert(pos);
        const int page = cache.block_table[static_cast<size_t>(b) * cache.max_pages + pos / ps];
        const size_t src = ((static_cast<size_t>(page) * ps + pos % ps) * hkv + h) * D;
        for (int d = 0; d < D; ++d) {
          ASSERT_EQ(hk[slot * D + d], cache.k32[src + d]) << "step " << step << " row " << r << " slot " << s;
          ASSERT_EQ(hv[slot * D + d], cache.v32[src + d]);
        }
      }
      if (in[static_cast<size_t>(r) * 4 + kDeltaEntering] <= cap) EXPECT_EQ(held, want) << "step " << step;
    }
    if (step > 0) EXPECT_LT(entering, static_cast<int64_t>(rows) * k / 2) << "drifting scores should keep most tokens";
    std::printf("step %d capacity %d: %lld entering, %lld sent of %d selected rows\n", step, cap,
                static_cast<long long>(entering), static_cast<long long>(sent), rows * k);
  }
}

// ---- query windows (push_query_window vs push_query_window_ref) ----

TEST(QueryWindowGpu, MatchesReferenceOverStepsWithResets) {
  for (DType dtype : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(spade::test::dtype_str(dtype));
    std::mt19937_64 rng(99);
    const int windows = 11, heads = 8, cap = 9, D = 128;
    std::vector<float> win32;
    std::vector<uint16_t> win16 =
        spade::test::random_half(dtype, static_cast<size_t>(windows) * heads * cap * D, 1.f, rng, &win32);
    std::vector<int32_t> len(windows);
    std::uniform_int_distribution<int> ulen(0, cap);
    for (int32_t& l : len) l = ulen(rng);
    DevBuf<uint16_t> d_win;
    d_win.upload(win16);
    DevBuf<int32_t> d_len;
    d_len.upload(len);
    for (int step = 0; step < 6; ++step) {
      // A permutation of 7 of the windows; tokens per row 0..12 (a prefill chunk longer than the window too).
      std::vector<int32_t> perm(windows);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      const int rows = 7;
      std::vector<int32_t> idx(perm.begin(), perm.begin() + rows), cu = {0}, reset(rows);
      std::uniform_int_distribution<int> un(0, 12);
      for (int r = 0; r < rows; ++r) {
        cu.push_back(cu.back() + (r == 0 ? 1 : un(rng)));
        reset[r] = (step + r) % 5 == 0;
      }
      std::vector<float> q32;
      const std::vector<uint16_t> q16 =
          spade::test::random_half(dtype, static_cast<size_t>(std::max(cu.back(), 1)) * heads * D, 1.f, rng, &q32);
      PushQueryWindowRefParams rp;
      rp.windows = win32.data();
      rp.window_len = len.data();
      rp.window_idx = idx.data();
      rp.q = q32.data();
      rp.cu_tokens = cu.data();
      rp.reset = reset.data();
      rp.num_windows = windows;
      rp.rows = rows;
      rp.num_heads = heads;
      rp.capacity = cap;
      rp.head_dim = D;
      push_query_window_ref(rp);
      DevBuf<int32_t> d_idx, d_cu, d_reset;
      d_idx.upload(idx);
      d_cu.upload(cu);
      d_reset.upload(reset);
      DevBuf<uint16_t> d_q;
      d_q.upload(q16);
      PushQueryWindowParams p;
      p.dtype = dtype;
      p.windows = d_win.get();
      p.window_len = d_len.get();
      p.window_idx = d_idx.get();
      p.q = d_q.get();
      p.cu_tokens = d_cu.get();
      p.reset = d_reset.get();
      p.num_windows = windows;
      p.rows = rows;
      p.num_heads = heads;
      p.capacity = cap;
      p.head_dim = D;
      SPADE_CUDA_OK(push_query_window(p, nullptr));
      SPADE_CUDA_OK(cudaDeviceSynchronize());
      ASSERT_EQ(d_len.download(), len) << "step " << step;
      // Valid entries equal the reference's (exact: moved as words); entries past the length are not compared.
      const std::vector<float> got = spade::test::to_f32(dtype, d_win.download());
      for (int w = 0; w < windows; ++w)
        for (int h = 0; h < heads; ++h)
          for (int e = 0; e < len[w]; ++e)
            for (int d = 0; d < D; ++d) {
              const size_t i = ((static_cast<size_t>(w) * heads + h) * cap + e) * D + d;
              ASSERT_EQ(got[i], win32[i]) << "step " << step << " window " << w << " head " << h << " entry " << e;
            }
    }
  }
}

}  // namespace
}  // namespace spade::kernels

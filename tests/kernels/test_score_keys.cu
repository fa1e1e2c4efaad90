// GPU tests: the compact int8 scoring keys (ScoreKeys::kInt8) against kernels/selection_ref.h: quantize_keys
// bit for bit against quantize_keys_ref (whole pools and append-addressed rows), and score_tokens on the int8
// keys against score_tokens_ref on the dequantised keys, within the bound selection.cuh states.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/selection.cuh"
#include "kernels/selection_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::name_dtype;
using spade::test::name_ints;
using spade::test::PagedCache;

/// Quantizes the whole pool of `cache` on the GPU; checks every row against quantize_keys_ref bit for bit and
/// returns the device copy (k_int8, k_scale) for the scoring.
void quantize_pool(const PagedCache& cache, DevBuf<int8_t>& q, DevBuf<float>& scale,
                   std::vector<int8_t>& ref_q, std::vector<float>& ref_scale) {
  const size_t rows = static_cast<size_t>(cache.num_pages) * cache.page_size * cache.num_kv_heads;
  ref_q.assign(rows * cache.head_dim, 0);
  ref_scale.assign(rows, 0.f);
  QuantizeKeysRefParams rp;
  rp.k = cache.k32.data();
  rp.k_int8 = ref_q.data();
  rp.k_scale = ref_scale.data();
  rp.rows = rows;
  rp.head_dim = cache.head_dim;
  quantize_keys_ref(rp);
  q.alloc(ref_q.size());
  scale.alloc(ref_scale.size());
  q.poison();
  scale.poison();
  QuantizeKeysParams p;
  p.dtype = cache.dtype;
  p.k_cache = cache.k.get();
  p.k_int8 = q.get();
  p.k_scale = scale.get();
  p.tokens = cache.num_pages * cache.page_size;
  p.num_kv_heads = cache.num_kv_heads;
  p.head_dim = cache.head_dim;
  p.page_size = cache.page_size;
  p.num_pages = cache.num_pages;
  SPADE_CUDA_OK(quantize_keys(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int8_t> got_q = q.download();
  const std::vector<float> got_s = scale.download();
  for (size_t r = 0; r < rows; ++r) {
    const bool both_nan = std::isnan(got_s[r]) && std::isnan(ref_scale[r]);
    ASSERT_TRUE(both_nan || std::memcmp(&got_s[r], &ref_scale[r], 4) == 0)
        << "scale of row " << r << ": " << got_s[r] << " vs " << ref_scale[r];
    for (int d = 0; d < cache.head_dim; ++d)
      ASSERT_EQ(got_q[r * cache.head_dim + d], ref_q[r * cache.head_dim + d]) << "row " << r << " d " << d;
  }
}

// ---- quantize (whole pool; special rows) ----

struct QuantizeCase {
  DType dtype = DType::BF16;
  int head_dim = 128;
  int page_size = 16;
  int num_kv_heads = 0;
  std::vector<int> lens;
  float sigma = 1.f;  // key scale (tiny and huge keys keep their relative precision)
  uint64_t seed = 0;
};

std::string case_name(const QuantizeCase& c) {
  return std::string(name_dtype(c.dtype)) + "_D" + std::to_string(c.head_dim) + "_page" +
         std::to_string(c.page_size) + "_hkv" + std::to_string(c.num_kv_heads) + "_lens" + name_ints(c.lens) +
         "_sigma" + spade::test::name_num(c.sigma);
}
void PrintTo(const QuantizeCase& c, std::ostream* os) {
  *os << case_name(c) << " seed=" << c.seed;
}

// clang-format off
const std::vector<QuantizeCase> kQuantizeCases = {
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_kv_heads = 8, .lens = {1, 300}, .sigma = 1.f,
     .seed = 71},
    {.dtype = DType::BF16, .head_dim = 64, .page_size = 32, .num_kv_heads = 2, .lens = {77}, .sigma = 1e-3f,
     .seed = 72},
    {.dtype = DType::F16, .head_dim = 256, .page_size = 16, .num_kv_heads = 4, .lens = {129, 5}, .sigma = 30.f,
     .seed = 73},
};
// clang-format on

class QuantizeGpu : public ::testing::TestWithParam<QuantizeCase> {};

TEST_P(QuantizeGpu, MatchesReference) {
  const QuantizeCase& c = GetParam();
  std::mt19937_64 rng(c.seed);
  PagedCache cache;
  cache.build(c.dtype, c.lens, c.page_size, c.num_kv_heads, c.head_dim, rng);
  // Rescale, then plant special rows: all zeros, a NaN, an infinity, a lone non-zero value.
  std::vector<uint16_t> bits(cache.k32.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = spade::test::to_bits(c.dtype, cache.k32[i] * c.sigma);
  const size_t D = static_cast<size_t>(c.head_dim);
  for (size_t d = 0; d < D; ++d) bits[0 * D + d] = 0;
  bits[1 * D + 3] = c.dtype == DType::BF16 ? 0x7FC0 : 0x7E00;  // NaN
  bits[2 * D + 5] = c.dtype == DType::BF16 ? 0x7F80 : 0x7C00;  // +inf
  for (size_t d = 0; d < D; ++d) bits[3 * D + d] = 0;
  bits[3 * D + D - 1] = spade::test::to_bits(c.dtype, -0.75f);
  cache.k.upload(bits);
  cache.k32 = spade::test::to_f32(c.dtype, bits);
  DevBuf<int8_t> q;
  DevBuf<float> s;
  std::vector<int8_t> rq;
  std::vector<float> rs;
  quantize_pool(cache, q, s, rq, rs);
  // The planted rows as the rule says.
  EXPECT_EQ(rs[0], 0.f);
  EXPECT_TRUE(std::isnan(rs[1]));
  EXPECT_TRUE(std::isinf(rs[2]));
  EXPECT_EQ(rq[3 * D + D - 1], -127);
}

INSTANTIATE_TEST_SUITE_P(, QuantizeGpu, ::testing::ValuesIn(kQuantizeCases), spade::test::CaseName());

// ---- quantize addressed as an append (positions, seq_idx, block_table) ----

TEST(QuantizeGpuAppend, WritesOnlyTheAppendedRows) {
  std::mt19937_64 rng(81);
  const int ps = 16, hkv = 2, D = 128;
  PagedCache cache;
  cache.build(DType::BF16, {40, 17}, ps, hkv, D, rng);
  // Tokens: the last of each sequence, one past sequence 0's table (position beyond max pages: skipped), one
  // with a bad row (skipped), one on a -1 page (skipped).
  const std::vector<int32_t> pos = {39, 16, 5, 0, ps * cache.max_pages + 3, ps * (cache.max_pages - 1)};
  const std::vector<int32_t> seq = {0, 1, 0, 7, 0, 0};
  DevBuf<int32_t> d_pos, d_seq;
  d_pos.upload(pos);
  d_seq.upload(seq);
  const size_t rows = static_cast<size_t>(cache.num_pages) * ps * hkv;
  DevBuf<int8_t> q(rows * D);
  DevBuf<float> s(rows);
  q.poison();
  s.poison();
  QuantizeKeysParams p;
  p.dtype = DType::BF16;
  p.k_cache = cache.k.get();
  p.k_int8 = q.get();
  p.k_scale = s.get();
  p.positions = d_pos.get();
  p.seq_idx = d_seq.get();
  p.block_table = cache.bt.get();
  p.batch = 2;
  p.tokens = static_cast<int>(pos.size());
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.num_pages = cache.num_pages;
  SPADE_CUDA_OK(quantize_keys(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int8_t> got_q = q.download();
  const std::vector<float> got_s = s.download();
  std::vector<char> written(rows / hkv, 0);
  for (int i = 0; i < 3; ++i) {
    const int page = cache.block_table[static_cast<size_t>(seq[i]) * cache.max_pages + pos[i] / ps];
    written[static_cast<size_t>(page) * ps + pos[i] % ps] = 1;
  }
  std::vector<int8_t> rq(rows * D);
  std::vector<float> rs(rows);
  QuantizeKeysRefParams rp;
  rp.k = cache.k32.data();
  rp.k_int8 = rq.data();
  rp.k_scale = rs.data();
  rp.rows = rows;
  rp.head_dim = D;
  quantize_keys_ref(rp);
  int n_written = 0;
  for (size_t slot = 0; slot < written.size(); ++slot) {
    for (int h = 0; h < hkv; ++h) {
      const size_t r = slot * hkv + h;
      if (written[slot]) {
        ++n_written;
        ASSERT_EQ(got_s[r], rs[r]) << "slot " << slot << " head " << h;
        for (int d = 0; d < D; ++d)
          ASSERT_EQ(got_q[r * D + d], rq[r * D + d]) << "slot " << slot << " d " << d;
      } else {
        uint32_t bits;
        std::memcpy(&bits, &got_s[r], 4);
        ASSERT_EQ(bits, 0xFFFFFFFFu) << "slot " << slot << " was written";
        for (int d = 0; d < D; ++d) ASSERT_EQ(got_q[r * D + d], -1) << "slot " << slot << " was written";
      }
    }
  }
  EXPECT_EQ(n_written, 3 * hkv);
}

// ---- scoring with the int8 keys ----

struct ScoreI8Case {
  DType dtype = DType::BF16;  // of the cache the keys are quantized from
  int head_dim = 128;
  int page_size = 16;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  std::vector<int> lens;
  GqaScoreRule rule = GqaScoreRule::kMax;
  float q_sigma = 1.f;  // the queries' scale (int8 parts relative to each head's max)
  uint64_t seed = 0;
};

std::string case_name(const ScoreI8Case& c) {
  return spade::test::long_prefix(spade::test::max_of(c.lens) >= spade::test::kLongContext) +
         name_dtype(c.dtype) + "_D" + std::to_string(c.head_dim) + "_page" + std::to_string(c.page_size) +
         "_hkv" + std::to_string(c.num_kv_heads) + "_group" + std::to_string(c.num_q_heads / c.num_kv_heads) +
         "_lens" + name_ints(c.lens) + (c.rule == GqaScoreRule::kMax ? "_max" : "_mean") + "_q" +
         spade::test::name_num(c.q_sigma);
}
void PrintTo(const ScoreI8Case& c, std::ostream* os) {
  *os << case_name(c) << " seed=" << c.seed;
}

// clang-format off
const std::vector<ScoreI8Case> kScoreI8Cases = {
    // group 4 (one mma: hi and lo in one operand), Qwen3-8B's heads
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {1, 100, 5000}, .rule = GqaScoreRule::kMax, .q_sigma = 1.f, .seed = 91},
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {77, 3000}, .rule = GqaScoreRule::kMean, .q_sigma = 1e3f, .seed = 92},
    // group 8 (two mmas), D 64 (4-chunk rows), large pages
    {.dtype = DType::F16, .head_dim = 64, .page_size = 64, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {4097, 31}, .rule = GqaScoreRule::kMax, .q_sigma = 1e-3f, .seed = 93},
    // group 1, D 256
    {.dtype = DType::BF16, .head_dim = 256, .page_size = 32, .num_q_heads = 2, .num_kv_heads = 2,
     .lens = {2000}, .rule = GqaScoreRule::kMean, .q_sigma = 1.f, .seed = 94},
    // group 5 (two mmas, partly empty)
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 10, .num_kv_heads = 2,
     .lens = {33, 700}, .rule = GqaScoreRule::kMax, .q_sigma = 1.f, .seed = 95},
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {131072}, .rule = GqaScoreRule::kMax, .q_sigma = 1.f, .seed = 96},
};
// clang-format on

class ScoreI8Gpu : public ::testing::TestWithParam<ScoreI8Case> {};

TEST_P(ScoreI8Gpu, MatchesReference) {
  const ScoreI8Case& c = GetParam();
  std::mt19937_64 rng(c.seed);
  const int batch = static_cast<int>(c.lens.size());
  const int D = c.head_dim, hq = c.num_q_heads, hkv = c.num_kv_heads, G = hq / hkv;
  PagedCache cache;
  cache.build(c.dtype, c.lens, c.page_size, hkv, D, rng);
  DevBuf<int8_t> q8;
  DevBuf<float> ks;
  std::vector<int8_t> rq;
  std::vector<float> rs;
  quantize_pool(cache, q8, ks, rq, rs);
  if (HasFatalFailure()) return;
  std::vector<float> deq(cache.k32.size());
  dequantize_keys_ref(rq.data(), rs.data(), rs.size(), D, deq.data());

  std::normal_distribution<float> nd(0.f, c.q_sigma);
  std::vector<float> qh(static_cast<size_t>(batch) * hq * D);
  for (float& x : qh) x = nd(rng);
  const int stride = spade::test::max_of(c.lens) + 5;
  std::vector<float> ref(static_cast<size_t>(batch) * hkv * stride, 0.f);
  ScoreTokensRefParams rp;
  rp.q_hat = qh.data();
  rp.k_cache = deq.data();
  rp.block_table = cache.block_table.data();
  rp.num_tokens = c.lens.data();
  rp.scores = ref.data();
  rp.batch = batch;
  rp.num_q_heads = hq;
  rp.num_kv_heads = hkv;
  rp.head_dim = D;
  rp.page_size = c.page_size;
  rp.max_pages_per_seq = cache.max_pages;
  rp.score_stride = stride;
  rp.rule = c.rule;
  score_tokens_ref(rp);

  DevBuf<float> d_q, scores(ref.size());
  d_q.upload(qh);
  DevBuf<int32_t> d_lens;
  d_lens.upload(std::vector<int32_t>(c.lens.begin(), c.lens.end()));
  scores.poison();
  ScoreTokensParams p;
  p.keys = ScoreKeys::kInt8;
  p.q_hat = d_q.get();
  p.k_int8 = q8.get();
  p.k_scale = ks.get();
  p.block_table = cache.bt.get();
  p.num_tokens = d_lens.get();
  p.scores = scores.get();
  p.batch = batch;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = c.page_size;
  p.max_pages_per_seq = cache.max_pages;
  p.score_stride = stride;
  p.rule = c.rule;
  SPADE_CUDA_OK(score_tokens(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = scores.download();
  for (int b = 0; b < batch; ++b) {
    // The step of each head's int8 query parts: max |q| / 127.
    std::vector<double> step(static_cast<size_t>(hq), 0.0);
    for (int h = 0; h < hq; ++h)
      for (int d = 0; d < D; ++d)
        step[h] = std::max(
            step[h], std::fabs(static_cast<double>(qh[(static_cast<size_t>(b) * hq + h) * D + d])) / 127);
    for (int h = 0; h < hkv; ++h) {
      const size_t row = (static_cast<size_t>(b) * hkv + h) * stride;
      for (int t = 0; t < stride; ++t) {
        if (t >= c.lens[b]) {  // never written
          uint32_t bits;
          std::memcpy(&bits, &got[row + t], 4);
          ASSERT_EQ(bits, 0xFFFFFFFFu)
              << "b " << b << " kvh " << h << " t " << t << " past the row was written";
          continue;
        }
        const int page = cache.block_table[static_cast<size_t>(b) * cache.max_pages + t / c.page_size];
        const size_t kr = (static_cast<size_t>(page) * c.page_size + t % c.page_size) * hkv + h;
        double l1 = 0.0;  // sum |k_int8| * scale
        for (int d = 0; d < D; ++d) l1 += std::fabs(static_cast<double>(rq[kr * D + d]));
        l1 *= rs[kr];
        double bound = 0.0, mag = 0.0;
        for (int g = 0; g < G; ++g) {
          const int qh_i = h * G + g;
          bound = std::max(bound, l1 * step[qh_i] / 508.0);
          double m = 0.0;
          for (int d = 0; d < D; ++d)
            m += std::fabs(qh[(static_cast<size_t>(b) * hq + qh_i) * D + d] * deq[kr * D + d]);
          mag = std::max(mag, m);
        }
        // The int8 queries' bound (selection.cuh) plus fp32 accumulation (D + 8 roundings of the magnitude).
        ASSERT_NEAR(got[row + t], ref[row + t], 1.02 * bound + (D + 8) * 6e-8 * mag + 1e-30)
            << "b " << b << " kvh " << h << " t " << t;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, ScoreI8Gpu, ::testing::ValuesIn(kScoreI8Cases), spade::test::CaseName());

TEST(ScoreI8GpuArgs, RefusesMissingCompactKeysByName) {
  DevBuf<float> q(128), s(16);
  DevBuf<int32_t> bt(1), n(1);
  DevBuf<int8_t> k8(16 * 128);
  ScoreTokensParams p;
  p.keys = ScoreKeys::kInt8;
  p.q_hat = q.get();
  p.k_int8 = k8.get();
  p.block_table = bt.get();
  p.num_tokens = n.get();
  p.scores = s.get();
  p.batch = 1;
  p.num_q_heads = 1;
  p.num_kv_heads = 1;
  p.head_dim = 128;
  p.page_size = 16;
  p.max_pages_per_seq = 1;
  p.score_stride = 16;
  EXPECT_EQ(score_tokens(p, nullptr), cudaErrorInvalidValue);  // k_scale missing
  EXPECT_NE(std::string(launch_error_detail()).find("k_scale"), std::string::npos) << launch_error_detail();
  p.keys = static_cast<ScoreKeys>(5);
  EXPECT_EQ(score_tokens(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("keys"), std::string::npos) << launch_error_detail();
  QuantizeKeysParams qp;
  qp.k_cache = q.get();
  qp.k_int8 = k8.get();
  qp.k_scale = s.get();
  qp.tokens = 17;  // one page of 16 rows
  qp.num_kv_heads = 1;
  qp.head_dim = 128;
  qp.page_size = 16;
  qp.num_pages = 1;
  EXPECT_EQ(quantize_keys(qp, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("tokens"), std::string::npos) << launch_error_detail();
}

}  // namespace
}  // namespace spade::kernels

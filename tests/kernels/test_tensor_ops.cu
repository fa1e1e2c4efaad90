// GPU tests of kernels/tensor_ops.cuh: random_fill (a pure function of (seed, index), unit variance), cast (exact
// round-to-nearest-even against the host conversions of common/dtype.h), offset_clamp (against the host formula),
// and the launchers' bad-input errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/tensor_ops.cuh"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::test {
namespace {

using kernels::CastParams;
using kernels::OffsetClampParams;
using kernels::RandomFillParams;

std::vector<float> fill_f32(size_t n, uint64_t seed, float scale, float offset) {
  DevBuf<float> d(n);
  d.poison();
  EXPECT_EQ(kernels::random_fill({DType::F32, d.get(), n, seed, scale, offset}, nullptr), cudaSuccess);
  return d.download();
}

TEST(RandomFill, IsAFunctionOfSeedAndIndexWithUnitVariance) {
  const size_t n = 1 << 20;
  const std::vector<float> a = fill_f32(n, 42, 1.f, 0.f), b = fill_f32(n, 42, 1.f, 0.f), c = fill_f32(n, 43, 1.f, 0.f);
  ASSERT_EQ(std::memcmp(a.data(), b.data(), n * 4), 0) << "same seed, different values";
  size_t same = 0;
  double sum = 0, sq = 0;
  float lo = 1e9f, hi = -1e9f;
  for (size_t i = 0; i < n; ++i) {
    same += a[i] == c[i];
    sum += a[i];
    sq += double(a[i]) * a[i];
    lo = std::min(lo, a[i]);
    hi = std::max(hi, a[i]);
  }
  EXPECT_LT(same, n / 1000) << "another seed must give other values";
  EXPECT_NEAR(sum / n, 0.0, 5e-3);
  EXPECT_NEAR(sq / n, 1.0, 1e-2);  // uniform in [-sqrt 3, sqrt 3): variance 1
  EXPECT_GE(lo, -1.7320509f);
  EXPECT_LT(hi, 1.7320509f);
  EXPECT_GT(hi, 1.73f);
  // A prefix of a longer fill equals a shorter fill (index-addressed, independent of the launch geometry).
  const std::vector<float> shortfill = fill_f32(1000, 42, 1.f, 0.f);
  EXPECT_EQ(std::memcmp(shortfill.data(), a.data(), 1000 * 4), 0);
  // scale / offset are applied as offset + scale * u, and bf16 is the rounded fp32 value.
  const std::vector<float> s = fill_f32(1000, 42, 0.5f, 2.f);
  for (size_t i = 0; i < 1000; ++i) ASSERT_FLOAT_EQ(s[i], 2.f + 0.5f * a[i]) << i;
  DevBuf<uint16_t> h(1000);
  ASSERT_EQ(kernels::random_fill({DType::BF16, h.get(), 1000, 42, 1.f, 0.f}, nullptr), cudaSuccess);
  const std::vector<uint16_t> hb = h.download();
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(hb[i], f32_to_bf16(a[i])) << i;
}

TEST(Cast, RoundsToNearestEvenLikeTheHostConversions) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.f, 3.f);
  const size_t n = 100003;
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  x[0] = 0.f;
  x[1] = -0.f;
  x[2] = 65504.f;
  x[3] = 1e-8f;
  DevBuf<float> df;
  df.upload(x);
  for (DType t : {DType::BF16, DType::F16}) {
    DevBuf<uint16_t> dh(n);
    dh.poison();
    SPADE_CUDA_OK(kernels::cast({DType::F32, t, df.get(), dh.get(), n}, nullptr));
    const std::vector<uint16_t> got = dh.download();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], to_bits(t, x[i])) << "f32 -> " << dtype_name(t) << " at " << i;
    // and back: exact widening.
    DevBuf<float> back(n);
    back.poison();
    SPADE_CUDA_OK(kernels::cast({t, DType::F32, dh.get(), back.get(), n}, nullptr));
    const std::vector<float> b = back.download();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[i], from_bits(t, got[i])) << i;
  }
}

TEST(OffsetClamp, MatchesTheHostFormula) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int32_t> ud(-100000, 100000);
  const int n = 4099;
  std::vector<int32_t> x(n);
  for (auto& v : x) v = ud(rng);
  x[0] = 0x7fffffff;  // + offset must not overflow
  DevBuf<int32_t> din, dout(n);
  din.upload(x);
  for (const auto& [off, lo, hi] : std::vector<std::tuple<int, int, int>>{{-32, 0, 0x7fffffff}, {-32, 0, 2048}, {5, -7, 7}}) {
    dout.poison();
    SPADE_CUDA_OK(kernels::offset_clamp({din.get(), dout.get(), n, off, lo, hi}, nullptr));
    const std::vector<int32_t> got = dout.download();
    for (int i = 0; i < n; ++i) {
      const long long v = static_cast<long long>(x[i]) + off;
      ASSERT_EQ(got[i], static_cast<int32_t>(std::min<long long>(std::max<long long>(v, lo), hi))) << i;
    }
  }
  // In place.
  SPADE_CUDA_OK(kernels::offset_clamp({din.get(), din.get(), n, 1, 0, 10}, nullptr));
  const std::vector<int32_t> inplace = din.download();
  for (int i = 0; i < n; ++i)
    ASSERT_EQ(inplace[i], static_cast<int32_t>(std::min<long long>(std::max<long long>(x[i] + 1ll, 0), 10)));
}

TEST(TensorOpsBadInput, LaunchersNameTheField) {
  DevBuf<float> d(16);
  EXPECT_EQ(kernels::random_fill({DType::F32, nullptr, 16, 1, 1.f, 0.f}, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(kernels::launch_error_detail()).find("out is null"), std::string::npos);
  EXPECT_EQ(kernels::random_fill({DType::F32, nullptr, 0, 1, 1.f, 0.f}, nullptr), cudaSuccess);  // n = 0: no-op
  EXPECT_EQ(kernels::cast({DType::BF16, DType::F32, d.get(), d.get(), 16}, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(kernels::launch_error_detail()).find("alias"), std::string::npos);
  EXPECT_EQ(kernels::offset_clamp({reinterpret_cast<int32_t*>(d.get()), reinterpret_cast<int32_t*>(d.get()), 16, 0,
                                   5, 4},
                                  nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(std::string(kernels::launch_error_detail()).find("lo 5 > hi 4"), std::string::npos);
  EXPECT_EQ(kernels::offset_clamp({nullptr, nullptr, -1, 0, 0, 1}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace spade::test

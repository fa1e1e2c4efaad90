// CPU tests: the compact int8 scoring keys' reference (kernels/selection_ref.h quantize_keys_ref,
// dequantize_keys_ref, parse_score_keys): the rule on rows with known answers and its error bound on random
// rows.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/selection_ref.h"

namespace spade::kernels {
namespace {

struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scale;
};

Quantized quantize(const std::vector<float>& k, int head_dim) {
  Quantized out;
  out.q.assign(k.size(), 99);
  out.scale.assign(k.size() / head_dim, -1.f);
  QuantizeKeysRefParams p;
  p.k = k.data();
  p.k_int8 = out.q.data();
  p.k_scale = out.scale.data();
  p.rows = out.scale.size();
  p.head_dim = head_dim;
  quantize_keys_ref(p);
  return out;
}

TEST(QuantizeKeysRef, KnownRows) {
  // Row 0: absmax 2.54 -> scale 0.02; row 1: ties round to even (0.5 and 1.5 steps);
  // row 2: all zeros; row 3: a NaN; row 4: an infinity.
  const std::vector<float> k = {2.54f, -1.26f,
                                0.f,   0.02f,  //
                                127.f, 0.5f,
                                1.5f,  -2.5f,  //
                                0.f,   0.f,
                                0.f,   0.f,  //
                                1.f,   std::numeric_limits<float>::quiet_NaN(),
                                2.f,   3.f,  //
                                1.f,   -std::numeric_limits<float>::infinity(),
                                2.f,   3.f};
  const Quantized r = quantize(k, 4);
  EXPECT_FLOAT_EQ(r.scale[0], 2.54f / 127.f);
  EXPECT_EQ(r.q[0], 127);
  EXPECT_EQ(r.q[1], -63);
  EXPECT_EQ(r.q[2], 0);
  EXPECT_EQ(r.q[3], 1);
  EXPECT_EQ(r.scale[1], 1.f);
  EXPECT_EQ(r.q[4], 127);
  EXPECT_EQ(r.q[5], 0);   // 0.5 -> 0 (half to even)
  EXPECT_EQ(r.q[6], 2);   // 1.5 -> 2
  EXPECT_EQ(r.q[7], -2);  // -2.5 -> -2
  EXPECT_EQ(r.scale[2], 0.f);
  for (int d = 8; d < 12; ++d) EXPECT_EQ(r.q[d], 0);
  EXPECT_TRUE(std::isnan(r.scale[3]));
  for (int d = 12; d < 16; ++d) EXPECT_EQ(r.q[d], 0);
  EXPECT_TRUE(std::isinf(r.scale[4]));
  for (int d = 16; d < 20; ++d) EXPECT_EQ(r.q[d], 0);
}

TEST(QuantizeKeysRef, RoundTripWithinHalfAStepAndTheMaximumExact) {
  std::mt19937_64 rng(5);
  for (float sigma : {1e-4f, 1.f, 300.f}) {
    std::normal_distribution<float> nd(0.f, sigma);
    const int D = 128, rows = 64;
    std::vector<float> k(static_cast<size_t>(rows) * D);
    for (float& x : k) x = nd(rng);
    const Quantized r = quantize(k, D);
    std::vector<float> back(k.size());
    dequantize_keys_ref(r.q.data(), r.scale.data(), rows, D, back.data());
    for (int i = 0; i < rows; ++i) {
      float amax = 0.f;
      int at = 0;
      for (int d = 0; d < D; ++d) {
        if (std::fabs(k[static_cast<size_t>(i) * D + d]) > amax) {
          amax = std::fabs(k[static_cast<size_t>(i) * D + d]);
          at = d;
        }
      }
      ASSERT_EQ(std::abs(static_cast<int>(r.q[static_cast<size_t>(i) * D + at])), 127) << "sigma " << sigma;
      for (int d = 0; d < D; ++d) {
        const size_t j = static_cast<size_t>(i) * D + d;
        ASSERT_LE(std::fabs(back[j] - k[j]), 0.5f * r.scale[i] * (1.f + 1e-5f))
            << "sigma " << sigma << " row " << i;
      }
    }
  }
}

TEST(QuantizeKeysRef, ParseAndNames) {
  EXPECT_EQ(parse_score_keys("bf16"), ScoreKeys::kBf16);
  EXPECT_EQ(parse_score_keys("int8"), ScoreKeys::kInt8);
  EXPECT_STREQ(score_keys_name(ScoreKeys::kInt8), "int8");
  EXPECT_STREQ(score_keys_name(ScoreKeys::kBf16), "bf16");
  try {
    parse_score_keys("fp8");
    FAIL() << "fp8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 or int8"), std::string::npos) << e.what();
  }
  QuantizeKeysRefParams p;
  p.rows = 1;
  p.head_dim = 4;
  EXPECT_THROW(quantize_keys_ref(p), Error);
}

}  // namespace
}  // namespace spade::kernels

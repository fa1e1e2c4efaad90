// Tests for common/dtype.h: names, sizes, and the bf16 / f16 <-> f32 conversions against independent
// references (value-based nearest-even rounding computed in double, exhaustive over all 16-bit patterns where
// possible).
#include "common/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace spade {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool is_nan_f32_bits(uint32_t u) {
  return (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0;
}
bool is_nan_bf16(uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0;
}
bool is_nan_f16(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0;
}

// Deterministic sweep of f32 bit patterns: a stride coprime with 2^16 so every low-half pattern class is
// visited.
template <typename F>
void sweep_f32(F&& f) {
  constexpr uint64_t kStride = 997;
  for (uint64_t u = 0; u <= 0xffffffffull; u += kStride) f(static_cast<uint32_t>(u));
}

// ---- names and sizes
// ----------------------------------------------------------------------------------------------

TEST(DType, NamesAndSizes) {
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    DType back{};
    ASSERT_TRUE(parse_dtype(dtype_name(t), &back)) << dtype_name(t);
    EXPECT_EQ(back, t);
  }
  EXPECT_EQ(dtype_name(DType::BF16), "BF16");
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  DType out = DType::F16;
  for (const char* bad : {"F64", "I64", "BOOL", "U8", "f32", "bf16", "", "F32 "}) {
    EXPECT_FALSE(parse_dtype(bad, &out)) << bad;
  }
  EXPECT_EQ(out, DType::F16);  // untouched on failure
}

// ---- bf16
// ---------------------------------------------------------------------------------------------------------

// Reference f32 -> bf16: the nearer of the two bf16 neighbours by value, ties to the even pattern; beyond the
// largest finite bf16 the next "value" is 2^128 (IEEE rounding with unbounded exponent, then overflow to
// inf).
uint16_t ref_f32_to_bf16(uint32_t u) {
  const uint32_t sign = u & 0x80000000u;
  const uint32_t mag = u & 0x7fffffffu;
  const uint32_t lo = mag & 0xffff0000u;
  if (lo == mag) return static_cast<uint16_t>((sign | mag) >> 16);
  const uint32_t hi = lo + 0x10000u;
  const double x = from_bits(mag);
  const double vlo = from_bits(lo);
  const double vhi = hi == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(from_bits(hi));
  const double dlo = x - vlo, dhi = vhi - x;
  uint32_t pick;
  if (dlo < dhi) {
    pick = lo;
  } else if (dhi < dlo) {
    pick = hi;
  } else {
    pick = ((lo >> 16) & 1u) == 0 ? lo : hi;
  }
  return static_cast<uint16_t>((sign | pick) >> 16);
}

TEST(BF16, ExhaustiveRoundTripThroughF32) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto b = static_cast<uint16_t>(h);
    const float f = bf16_to_f32(b);
    ASSERT_EQ(to_bits(f), h << 16) << std::hex << h;  // bf16 is the upper half of the f32 pattern
    const uint16_t back = f32_to_bf16(f);
    if (is_nan_bf16(b)) {
      ASSERT_TRUE(is_nan_bf16(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000u, b & 0x8000u) << std::hex << h;
    } else {
      ASSERT_EQ(back, b) << std::hex << h;
    }
  }
}

TEST(BF16, RoundToNearestEvenMatchesReference) {
  size_t checked = 0;
  sweep_f32([&](uint32_t u) {
    if (is_nan_f32_bits(u)) return;
    ASSERT_EQ(f32_to_bf16(from_bits(u)), ref_f32_to_bf16(u)) << std::hex << "0x" << u;
    ++checked;
  });
  // Every exact tie and its two neighbours, for every upper half.
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u}) {
      const uint32_t u = (h << 16) | low;
      if (is_nan_f32_bits(u)) continue;
      ASSERT_EQ(f32_to_bf16(from_bits(u)), ref_f32_to_bf16(u)) << std::hex << "0x" << u;
      ++checked;
    }
  }
  EXPECT_GT(checked, 4'000'000u);
}

TEST(BF16, KnownRoundings) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);             // tie between 0x3F80 and 0x3F81 -> even (down)
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);         // tie between 0x3F81 and 0x3F82 -> even (up)
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-23f), 0x3F81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds past the largest bf16 -> inf
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7F7FFFu)), 0x7F7F);             // just below the tie stays finite
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008000u)), 0x0000);  // subnormal tie -> even
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000u)), 0x0002);
}

TEST(BF16, NaNStaysNaN) {
  // Quiet, signalling (payload only in the low half: truncation would give inf), negative.
  for (uint32_t u : {0x7FC00000u, 0x7F800001u, 0x7F80FFFFu, 0xFF800001u, 0xFFC00000u, 0x7FFFFFFFu}) {
    const uint16_t b = f32_to_bf16(from_bits(u));
    EXPECT_TRUE(is_nan_bf16(b)) << std::hex << u << " -> " << b;
    EXPECT_EQ(b & 0x8000u, (u >> 16) & 0x8000u) << std::hex << u;
    EXPECT_TRUE(std::isnan(bf16_to_f32(b)));
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7FC0)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7F81)));
  EXPECT_TRUE(std::isinf(bf16_to_f32(0x7F80)));
}

// ---- f16
// ----------------------------------------------------------------------------------------------------------

// Reference f16 -> value, straight from the IEEE-754 binary16 definition.
double ref_f16_value(uint16_t h) {
  const int sign = (h & 0x8000u) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f)
    return mant ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (exp == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exp - 25);
}

// All non-negative f16 values in pattern order (0x0000 .. 0x7BFF), plus 2^16 standing for 0x7C00 (inf): with
// an unbounded exponent the value after 65504 is 65536, so the nearest-even rule gives the overflow point for
// free.
const std::vector<double>& f16_table() {
  static const std::vector<double> t = [] {
    std::vector<double> v;
    for (uint32_t h = 0; h < 0x7c00u; ++h) v.push_back(ref_f16_value(static_cast<uint16_t>(h)));
    v.push_back(65536.0);
    return v;
  }();
  return t;
}

// Reference f32 -> f16 by value: binary search for the neighbours, nearer wins, ties to the even pattern.
uint16_t ref_f32_to_f16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double x = std::fabs(static_cast<double>(f));
  if (std::isinf(x)) return sign | 0x7c00;
  const auto& t = f16_table();
  if (x >= t.back()) return sign | 0x7c00;
  const size_t lo = static_cast<size_t>(std::upper_bound(t.begin(), t.end(), x) - t.begin()) - 1;
  if (t[lo] == x) return static_cast<uint16_t>(sign | lo);
  const size_t hi = lo + 1;
  const double dlo = x - t[lo], dhi = t[hi] - x;
  const size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) == 0 ? lo : hi);
  return static_cast<uint16_t>(sign | pick);
}

TEST(F16, ExhaustiveToF32MatchesDefinition) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto b = static_cast<uint16_t>(h);
    const float f = f16_to_f32(b);
    const double ref = ref_f16_value(b);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << h;
    }
  }
}

TEST(F16, ExhaustiveRoundTripThroughF32) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto b = static_cast<uint16_t>(h);
    const uint16_t back = f32_to_f16(f16_to_f32(b));
    if (is_nan_f16(b)) {
      ASSERT_TRUE(is_nan_f16(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000u, b & 0x8000u) << std::hex << h;
    } else {
      ASSERT_EQ(back, b) << std::hex << h;  // normals, subnormals, zeros and infinities all survive
    }
  }
}

TEST(F16, RoundToNearestEvenMatchesReference) {
  size_t checked = 0;
  sweep_f32([&](uint32_t u) {
    if (is_nan_f32_bits(u)) return;
    ASSERT_EQ(f32_to_f16(from_bits(u)), ref_f32_to_f16(from_bits(u))) << std::hex << "0x" << u;
    ++checked;
  });
  // Every midpoint between consecutive f16 values (exact in f32: 12 significant bits), and one f32 ulp either
  // side; this covers subnormal ties, the normal/subnormal boundary and the overflow threshold 65520.
  const auto& t = f16_table();
  for (size_t i = 0; i + 1 < t.size(); ++i) {
    const float mid = static_cast<float>((t[i] + t[i + 1]) / 2);
    ASSERT_EQ(static_cast<double>(mid), (t[i] + t[i + 1]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      for (float s : {x, -x}) {
        ASSERT_EQ(f32_to_f16(s), ref_f32_to_f16(s)) << std::hex << "0x" << to_bits(s);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 4'000'000u);
}

TEST(F16, KnownRoundings) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7BFF);  // below the overflow tie
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);    // tie with odd 0x7BFF -> inf
  EXPECT_EQ(f32_to_f16(1e6f), 0x7C00);
  EXPECT_EQ(f32_to_f16(-1e6f), 0xFC00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);             // smallest normal
  EXPECT_EQ(f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400);  // rounds up across the subnormal boundary
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);             // tie with 0 -> even (0)
  EXPECT_EQ(f32_to_f16(0x1p-25f + 0x1p-40f), 0x0001);
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);  // tie between 1 and 2 -> even (2)
  EXPECT_EQ(f32_to_f16(1e-10f), 0x0000);
  EXPECT_EQ(f32_to_f16(-1e-10f), 0x8000);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3C00);      // tie -> even (down)
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie -> even (up)
}

TEST(F16, NaNStaysNaN) {
  for (uint32_t u : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0xFFC00000u, 0x7FFFFFFFu}) {
    const uint16_t h = f32_to_f16(from_bits(u));
    EXPECT_TRUE(is_nan_f16(h)) << std::hex << u << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (u >> 16) & 0x8000u) << std::hex << u;
  }
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7C01)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0xFE00)));
}

// ---- convert_to_f32
// -----------------------------------------------------------------------------------------------

TEST(ConvertToF32, EachDType) {
  const std::vector<float> f32 = {1.5f, -0.0f, 3e-40f, -1e38f};
  std::vector<float> out(4, 7.0f);
  convert_to_f32(f32.data(), DType::F32, out.data(), 4);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(to_bits(out[i]), to_bits(f32[i])) << i;

  const std::vector<uint16_t> h = {0x3C00, 0xC380, 0x0001, 0x7BFF, 0xFC00};
  std::vector<float> out16(5);
  convert_to_f32(h.data(), DType::F16, out16.data(), 5);
  EXPECT_EQ(out16,
            (std::vector<float>{1.0f, -3.75f, 0x1p-24f, 65504.0f, -std::numeric_limits<float>::infinity()}));

  const std::vector<uint16_t> b = {0x3F80, 0xC000, 0x3E20, 0x0001};
  std::vector<float> outb(4);
  convert_to_f32(b.data(), DType::BF16, outb.data(), 4);
  EXPECT_EQ(outb, (std::vector<float>{1.0f, -2.0f, 0.15625f, from_bits(0x00010000u)}));

  convert_to_f32(b.data(), DType::BF16, outb.data(), 0);  // n = 0 touches nothing
  EXPECT_EQ(outb[0], 1.0f);
}

}  // namespace
}  // namespace spade

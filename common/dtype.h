// Element types of checkpoint tensors and the scalar conversions between them.
//
// bf16 = upper 16 bits of an IEEE-754 binary32 (round-to-nearest-even on conversion from fp32).
// f16  = IEEE-754 binary16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace spade {

enum class DType : uint8_t { F32, F16, BF16 };

/// Bytes per element: 4 for F32, 2 for F16 and BF16.
constexpr size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

/// The safetensors spelling: "F32", "F16", "BF16".
std::string_view dtype_name(DType t);

/// Parses the safetensors spelling; returns false for anything else (F64, I64, BOOL, ... are not model dtypes here).
bool parse_dtype(std::string_view s, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

/// Converts `n` elements of type `src_type` at `src` to fp32 at `dst`.
void convert_to_f32(const void* src, DType src_type, float* dst, size_t n);

}  // namespace spade

// INTERNAL to the tokenizer (common/tokenizer*.cpp); not public API. UTF-8 helpers shared by the tokenizer's
// units: scanning and validating bytes (Unicode Standard §3.9), lossy decoding, and fast accessors for text
// already known to be valid UTF-8. The public entry points (is_valid_utf8, utf8_lossy) are in tokenizer.h.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace spade::tokenizer_detail {

// U+FFFD REPLACEMENT CHARACTER, UTF-8 encoded.
inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// The UTF-8 sequence starting at p[0] (n >= 1 bytes available), per the Unicode Standard's table of
// well-formed byte sequences (§3.9, Table 3-7).
//   valid:      p[0..len) is one well-formed character.
//   truncated:  p[0..n) is a proper prefix of a well-formed character (more bytes could complete it);
//               len == n.
//   otherwise:  p[0..len) is a maximal ill-formed subpart (len >= 1): it becomes one U+FFFD.
struct Utf8Scan {
  size_t len;
  bool valid;
  bool truncated;
};
// Classifies the sequence at p[0..n) (n >= 1); see Utf8Scan.
Utf8Scan scan_utf8(const unsigned char* p, size_t n);

// Offset of the first byte that is not part of well-formed UTF-8, or npos.
size_t first_invalid_utf8(std::string_view s);

// Appends lossy text for bytes[0..n) and returns how many bytes were consumed. With `hold_truncated`, a
// proper prefix of a character at the very end is left unconsumed (streaming); otherwise it becomes U+FFFD.
size_t append_lossy(std::string& out, std::string_view bytes, bool hold_truncated);

// Length of the UTF-8 character whose lead byte is `b` (valid text).
inline size_t utf8_char_len(unsigned char b) {
  if (b < 0x80) return 1;
  if (b < 0xE0) return 2;
  if (b < 0xF0) return 3;
  return 4;
}

// Decodes the character at s[i] of valid UTF-8.
inline char32_t decode_at(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  if (p[0] < 0x80) return p[0];
  if (p[0] < 0xE0) return (char32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  if (p[0] < 0xF0) return (char32_t(p[0] & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  return (char32_t(p[0] & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) | (char32_t(p[2] & 0x3F) << 6) |
         (p[3] & 0x3F);
}

// Start of the character that ends at s[i-1] (i > 0, valid UTF-8).
inline size_t prev_char_start(std::string_view s, size_t i) {
  do {
    --i;
  } while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80);
  return i;
}

// Appends the UTF-8 encoding of the code point `cp`.
inline void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Number of characters in valid UTF-8.
inline size_t utf8_count(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// Rust's char::is_whitespace / regex \s: the Unicode White_Space property.
inline bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

}  // namespace spade::tokenizer_detail

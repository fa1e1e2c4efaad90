// UTF-8 scanning and lossy decoding for the tokenizer (declarations in tokenizer_utf8.h), and the public
// is_valid_utf8 / utf8_lossy of tokenizer.h.
#include "common/tokenizer_utf8.h"

#include "common/tokenizer.h"

namespace spade {
namespace tokenizer_detail {

Utf8Scan scan_utf8(const unsigned char* p, size_t n) {
  const unsigned char b = p[0];
  if (b < 0x80) return {1, true, false};
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2;
    lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2;
    hi = 0x9F;
  } else if (b == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3;
    hi = 0x8F;
  } else {
    return {1, false, false};  // 80..C1, F5..FF never start a character
  }
  for (size_t i = 1; i <= need; ++i) {
    if (i >= n) return {i, false, true};
    const unsigned char c = p[i];
    const bool ok = (i == 1) ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) return {i, false, false};
  }
  return {need + 1, true, false};
}

// Offset of the first byte that is not part of well-formed UTF-8, or npos.
size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const Utf8Scan r = scan_utf8(p + i, s.size() - i);
    if (!r.valid) return i;
    i += r.len;
  }
  return std::string_view::npos;
}

// Appends lossy text for bytes[0..n) and returns how many bytes were consumed. With `hold_truncated`, a
// proper prefix of a character at the very end is left unconsumed (streaming); otherwise it becomes U+FFFD.
size_t append_lossy(std::string& out, std::string_view bytes, bool hold_truncated) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0;
  while (i < bytes.size()) {
    if (p[i] < 0x80) {
      out.push_back(static_cast<char>(p[i]));
      ++i;
      continue;
    }
    const Utf8Scan r = scan_utf8(p + i, bytes.size() - i);
    if (r.valid) {
      out.append(bytes.substr(i, r.len));
    } else if (r.truncated && hold_truncated) {
      return i;
    } else {
      out.append(kReplacementChar);
    }
    i += r.len;
  }
  return i;
}

}  // namespace tokenizer_detail

bool is_valid_utf8(std::string_view text) {
  return tokenizer_detail::first_invalid_utf8(text) == std::string_view::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  tokenizer_detail::append_lossy(out, bytes, false);
  return out;
}

}  // namespace spade

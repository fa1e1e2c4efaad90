// Normalization: the normalizer chain (NFC, NFD, Prepend, Replace) and Unicode canonical normalization
// (UAX #15) over the generated tables of tokenizer_unicode_data.cpp.
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "common/error.h"
#include "common/tokenizer.h"
#include "common/tokenizer_impl.h"
#include "common/tokenizer_unicode_data.h"
#include "common/tokenizer_utf8.h"

namespace spade {

using tokenizer_detail::append_utf8;
using tokenizer_detail::CccRange;
using tokenizer_detail::decode_at;
using tokenizer_detail::Decomposition;
using tokenizer_detail::first_invalid_utf8;
using tokenizer_detail::kCccRanges;
using tokenizer_detail::kCompositionExclusions;
using tokenizer_detail::kDecompositions;
using tokenizer_detail::NormStep;
using tokenizer_detail::utf8_char_len;

// ================================================================================================
// Normalizer chain
// ================================================================================================

std::string Tokenizer::Impl::normalize(std::string_view s) const {
  std::string cur(s);
  for (const NormStep& n : normalizers) {
    switch (n.kind) {
      case NormStep::Kind::kNfc:
        cur = nfc_normalize(cur);
        break;
      case NormStep::Kind::kNfd:
        cur = nfd_normalize(cur);
        break;
      case NormStep::Kind::kPrepend:
        if (!cur.empty()) cur.insert(0, n.text);
        break;
      case NormStep::Kind::kReplace:
        cur = n.pattern.replace_all(cur, n.text);
        break;
    }
  }
  return cur;
}

// ================================================================================================
// Unicode canonical normalization (UAX #15)
// ================================================================================================

namespace {

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

uint8_t ccc_of(char32_t c) {
  if (c < 0x300) return 0;
  const auto end = kCccRanges.end();
  auto it =
      std::upper_bound(kCccRanges.begin(), end, c, [](char32_t v, const CccRange& r) { return v < r.first; });
  if (it == kCccRanges.begin()) return 0;
  --it;
  return c <= it->last ? it->ccc : 0;
}

const Decomposition* decomposition_of(char32_t c) {
  if (c < 0xC0) return nullptr;
  const auto end = kDecompositions.end();
  const auto it = std::lower_bound(kDecompositions.begin(), end, c,
                                   [](const Decomposition& d, char32_t v) { return d.cp < v; });
  return (it != end && it->cp == c) ? &*it : nullptr;
}

struct CompositionData {
  std::unordered_map<uint64_t, char32_t> pairs;  // (first << 32 | second) -> primary composite
  std::unordered_map<char32_t, bool> seconds;    // characters that can combine with a preceding one
};

// Primary composites: two-character canonical decompositions minus the full composition exclusions
// (Composition_Exclusions.txt entries, and by rule singletons and non-starter decompositions).
const CompositionData& composition_table() {
  static const CompositionData data = [] {
    CompositionData d;
    for (const Decomposition& e : kDecompositions) {
      if (e.second == 0 || ccc_of(e.cp) != 0 || ccc_of(e.first) != 0) continue;
      if (std::find(kCompositionExclusions.begin(), kCompositionExclusions.end(), e.cp) !=
          kCompositionExclusions.end()) {
        continue;
      }
      d.pairs.emplace((static_cast<uint64_t>(e.first) << 32) | e.second, e.cp);
      d.seconds.emplace(e.second, true);
    }
    return d;
  }();
  return data;
}

bool is_hangul_v_or_t(char32_t c) {
  return (c >= kVBase && c < kVBase + kVCount) || (c > kTBase && c < kTBase + kTCount);
}

char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto& pairs = composition_table().pairs;
  auto it = pairs.find((static_cast<uint64_t>(a) << 32) | b);
  return it == pairs.end() ? 0 : it->second;
}

void decompose_into(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    const char32_t s = c - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const Decomposition* d = decomposition_of(c)) {
    decompose_into(d->first, out);
    if (d->second != 0) decompose_into(d->second, out);
    return;
  }
  out.push_back(c);
}

// Full canonical decomposition followed by the canonical ordering algorithm (stable sort of each run of
// non-starters by combining class).
std::vector<char32_t> canonical_decompose(std::string_view text) {
  std::vector<char32_t> cps;
  cps.reserve(text.size());
  for (size_t i = 0; i < text.size(); i += utf8_char_len(static_cast<unsigned char>(text[i]))) {
    decompose_into(decode_at(text, i), cps);
  }
  for (size_t i = 1; i < cps.size(); ++i) {
    const uint8_t cc = ccc_of(cps[i]);
    if (cc == 0) continue;
    size_t j = i;
    while (j > 0 && ccc_of(cps[j - 1]) > cc) {
      std::swap(cps[j], cps[j - 1]);
      --j;
    }
  }
  return cps;
}

// Canonical composition: each character combines with the last starter unless blocked.
void canonical_compose(std::vector<char32_t>& s) {
  constexpr size_t kNone = static_cast<size_t>(-1);
  size_t starter = kNone;
  int last_cc = -1;  // combining class of the last uncombined character after the starter; -1: adjacent
  size_t w = 0;
  for (size_t r = 0; r < s.size(); ++r) {
    const char32_t c = s[r];
    const int cc = ccc_of(c);
    if (starter != kNone && (last_cc == -1 || (last_cc != 0 && last_cc < cc))) {
      if (const char32_t comp = compose_pair(s[starter], c)) {
        s[starter] = comp;
        continue;
      }
    }
    if (cc == 0) {
      starter = w;
      last_cc = -1;
    } else {
      last_cc = cc;
    }
    s[w++] = c;
  }
  s.resize(w);
}

// True when `text` may change under NFC: it has a character with a decomposition, a non-zero combining class,
// or one that can combine with its predecessor. (Hangul syllables decompose but recompose to themselves.)
bool may_change_under_nfc(std::string_view text) {
  const auto& seconds = composition_table().seconds;
  for (size_t i = 0; i < text.size();) {
    const unsigned char b = static_cast<unsigned char>(text[i]);
    if (b < 0xCC) {  // below U+0300
      i += utf8_char_len(b);
      continue;
    }
    const char32_t c = decode_at(text, i);
    i += utf8_char_len(b);
    if (c < 0x300) continue;
    if (ccc_of(c) != 0 || decomposition_of(c) != nullptr || is_hangul_v_or_t(c) || seconds.count(c) != 0) {
      return true;
    }
  }
  return false;
}

std::string encode_utf8(const std::vector<char32_t>& cps) {
  std::string out;
  out.reserve(cps.size() * 2);
  for (char32_t c : cps) append_utf8(out, c);
  return out;
}

void check_utf8(std::string_view text, const char* what) {
  if (const size_t bad = first_invalid_utf8(text); bad != std::string_view::npos) {
    fail("{}: the text is not valid UTF-8 (byte {} of {})", what, bad, text.size());
  }
}

}  // namespace

std::string nfc_normalize(std::string_view text) {
  check_utf8(text, "nfc_normalize");
  if (!may_change_under_nfc(text)) return std::string(text);
  std::vector<char32_t> cps = canonical_decompose(text);
  canonical_compose(cps);
  return encode_utf8(cps);
}

std::string nfd_normalize(std::string_view text) {
  check_utf8(text, "nfd_normalize");
  return encode_utf8(canonical_decompose(text));
}

}  // namespace spade

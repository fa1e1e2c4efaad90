// Pre-tokenization: the PCRE2 Regex wrapper and Pattern (String or Regex; also used by the Replace normalizer
// and decoder), the library's split behaviours, the pre-tokenizer chain (Split, ByteLevel), and GPT-2's
// byte-to-unicode table.
#include <algorithm>

#include "common/error.h"
#include "common/tokenizer.h"
#include "common/tokenizer_impl.h"

namespace spade {
namespace tokenizer_detail {

// ================================================================================================
// PCRE2 regex (UTF + UCP, JIT when available)
// ================================================================================================

Regex::Regex(const std::string& pattern, const std::string& where) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE off = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                        &err, &off, nullptr);
  if (code_ == nullptr) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    fail("{}: regex '{}' does not compile (PCRE2, offset {}): {}", where, pattern, off,
         reinterpret_cast<const char*>(buf));
  }
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  pcre2_code_free(code_);
}

void Regex::match_failed(int rc, size_t text_size) const {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(rc, buf, sizeof(buf));
  fail("regex '{}': match failed on a {}-byte text: {}", pattern_, text_size,
       reinterpret_cast<const char*>(buf));
}

bool Regex::matches_at(std::string_view s, size_t pos) const {
  Scratch scratch(code_, false);
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                             PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, scratch.md, scratch.mctx);
  return rc >= 0;
}

Regex::Scratch::Scratch(const pcre2_code* code, bool jit) {
  md = pcre2_match_data_create_from_pattern(code, nullptr);
  if (jit) {
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (mctx != nullptr && stack != nullptr) pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  if (md == nullptr) throw Error("PCRE2: out of memory creating match data");
}

Regex::Scratch::~Scratch() {
  pcre2_match_data_free(md);
  pcre2_match_context_free(mctx);
  pcre2_jit_stack_free(stack);
}

// ================================================================================================
// Pattern
// ================================================================================================

void Pattern::find_matches(std::string_view s, std::vector<std::tuple<size_t, size_t, bool>>& out) const {
  out.clear();
  if (s.empty()) {
    out.emplace_back(0, 0, false);
    return;
  }
  size_t prev = 0;
  auto on_match = [&](size_t b, size_t e) {
    if (prev != b) out.emplace_back(prev, b, false);
    out.emplace_back(b, e, true);
    prev = e;
  };
  if (regex) {
    regex->for_each_match(s, on_match);
  } else {
    size_t pos = 0;
    while ((pos = s.find(literal, pos)) != std::string_view::npos) {
      on_match(pos, pos + literal.size());
      pos += literal.size();
    }
  }
  if (prev != s.size()) out.emplace_back(prev, s.size(), false);
}

std::string Pattern::replace_all(std::string_view s, std::string_view content) const {
  std::string out;
  out.reserve(s.size());
  std::vector<std::tuple<size_t, size_t, bool>> pieces;
  find_matches(s, pieces);
  for (const auto& [b, e, m] : pieces) {
    if (m) {
      out.append(content);
    } else {
      out.append(s.substr(b, e - b));
    }
  }
  return out;
}

}  // namespace tokenizer_detail

using tokenizer_detail::append_utf8;
using tokenizer_detail::Pattern;
using tokenizer_detail::PreTokStep;
using tokenizer_detail::SplitBehavior;

// ================================================================================================
// Pre-tokenizer
// ================================================================================================

namespace {

// Walks the matches `m` (start, end, is_match) in order: a piece for which merge(is_match, previous is_match) holds
// extends the last piece of `pieces`, any other starts a new kept piece.
template <typename Merge>
void merge_into_previous(const std::vector<std::tuple<size_t, size_t, bool>>& m,
                         std::vector<std::tuple<size_t, size_t, bool>>& pieces, Merge merge) {
  bool prev_match = false;
  for (const auto& [b, e, is_match] : m) {
    if (merge(is_match, prev_match) && !pieces.empty()) {
      std::get<1>(pieces.back()) = e;
    } else {
      pieces.emplace_back(b, e, false);
    }
    prev_match = is_match;
  }
}

// The library's NormalizedString::split for one string: the kept pieces, in order, non-empty.
void split_with_behavior(std::string_view s, const Pattern& pattern, SplitBehavior behavior, bool invert,
                         std::vector<std::string>& out) {
  std::vector<std::tuple<size_t, size_t, bool>> m;
  pattern.find_matches(s, m);
  if (invert) {
    for (auto& t : m) std::get<2>(t) = !std::get<2>(t);
  }
  // (start, end, remove)
  std::vector<std::tuple<size_t, size_t, bool>> pieces;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& [b, e, is_match] : m) pieces.emplace_back(b, e, false);
      break;
    case SplitBehavior::kRemoved:
      pieces = m;
      break;
    case SplitBehavior::kContiguous:  // a run of matches (or of non-matches) is one piece
      merge_into_previous(m, pieces, [](bool is_match, bool prev_match) { return is_match == prev_match; });
      break;
    case SplitBehavior::kMergedWithPrevious:  // a match joins the non-match before it
      merge_into_previous(m, pieces, [](bool is_match, bool prev_match) { return is_match && !prev_match; });
      break;
    case SplitBehavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        const auto& [b, e, is_match] = *it;
        if (is_match && !prev_match && !pieces.empty()) {
          std::get<0>(pieces.back()) = b;
        } else {
          pieces.emplace_back(b, e, false);
        }
        prev_match = is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
  }
  for (const auto& [b, e, remove] : pieces) {
    if (!remove && e > b) out.emplace_back(s.substr(b, e - b));
  }
}

}  // namespace

void Tokenizer::Impl::pre_tokenize(std::string_view s, std::vector<std::string>& words) const {
  words.clear();
  if (s.empty()) return;
  words.emplace_back(s);
  std::vector<std::string> next;
  const auto& b2u = gpt2_byte_to_unicode();
  for (const PreTokStep& step : pretokenizers) {
    next.clear();
    for (std::string& w : words) {
      if (step.kind == PreTokStep::Kind::kSplit) {
        split_with_behavior(w, step.pattern, step.behavior, step.invert, next);
        continue;
      }
      // ByteLevel: optional prefix space, optional GPT-2 split, then bytes -> printable characters.
      // (One char via an iterator: w.insert(0, " ") trips a known false -Wrestrict of GCC 12's libstdc++.)
      if (step.add_prefix_space && w[0] != ' ') w.insert(w.begin(), ' ');
      std::vector<std::string> parts;
      if (step.use_regex) {
        split_with_behavior(w, step.pattern, SplitBehavior::kIsolated, false, parts);
      } else {
        parts.push_back(std::move(w));
      }
      for (const std::string& p : parts) {
        std::string mapped;
        mapped.reserve(p.size() * 2);
        for (unsigned char c : p) mapped += b2u[c];
        next.push_back(std::move(mapped));
      }
    }
    words.swap(next);
  }
}

const std::array<std::string, 256>& gpt2_byte_to_unicode() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) append_utf8(t[b], printable[b] ? static_cast<char32_t>(b) : next++);
    return t;
  }();
  return table;
}

}  // namespace spade

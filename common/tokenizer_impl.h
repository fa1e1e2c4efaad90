// INTERNAL to the tokenizer (common/tokenizer*.cpp); not public API: include common/tokenizer.h instead.
//
// The loaded state of a Tokenizer (Tokenizer::Impl) and the pipeline components it is built from, shared by
// the tokenizer's units:
//   tokenizer.cpp               Tokenizer::encode and the accessors
//   tokenizer_load.cpp          tokenizer.json / tokenizer_config.json reading (from_json_text, from_file,
//                               from_dir): SAX parse, normalizer / pre-tokenizer / model / added tokens /
//                               post-processor / decoder parsing
//   tokenizer_normalize.cpp     the normalizer chain; NFC / NFD (UAX #15)
//   tokenizer_unicode_data.cpp  the generated Unicode 14.0 tables behind NFC / NFD
//   tokenizer_pretokenize.cpp   Regex (PCRE2) and Pattern, split behaviours, the pre-tokenizer chain,
//                               gpt2_byte_to_unicode
//   tokenizer_bpe.cpp           the BPE model (merges, word cache) and added-token matching (Trie)
//   tokenizer_decode.cpp        Tokenizer::decode (the decoder chain) and StreamingDecoder
//   tokenizer_utf8.cpp          UTF-8 scanning and lossy decoding (tokenizer_utf8.h)
// Everything here is in spade::tokenizer_detail, except Tokenizer::Impl, which tokenizer.h forward-declares.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/tokenizer.h"
#include "common/tokenizer_utf8.h"

namespace spade::tokenizer_detail {

// ================================================================================================
// PCRE2 regex (UTF + UCP, JIT when available); out-of-line parts in tokenizer_pretokenize.cpp
// ================================================================================================

// A compiled pattern. Immutable after construction; each match call allocates its own match state, so one
// Regex may be used from many threads.
class Regex {
 public:
  // Compiles `pattern`; throws spade::Error starting with `where` when it does not compile.
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The pattern source.
  const std::string& pattern() const { return pattern_; }

  // Calls f(start, end) for every match in `s` (valid UTF-8), left to right, non-overlapping. Empty matches
  // are reported; after one, the next attempt at the same position must be non-empty (Perl's iteration rule).
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const {
    Scratch scratch(code_, jit_);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t start = 0;
    uint32_t opts = 0;
    while (start <= s.size()) {
      const int rc =
          pcre2_match(code_, subject, s.size(), start, opts | PCRE2_NO_UTF_CHECK, scratch.md, scratch.mctx);
      if (rc == PCRE2_ERROR_NOMATCH) {
        if (opts == 0 || start >= s.size()) break;
        start += utf8_char_len(static_cast<unsigned char>(s[start]));
        opts = 0;
        continue;
      }
      if (rc < 0) match_failed(rc, s.size());
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.md);
      f(static_cast<size_t>(ov[0]), static_cast<size_t>(ov[1]));
      start = ov[1];
      opts = (ov[0] == ov[1]) ? (PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED) : 0;
    }
  }

  // Whether the pattern matches at exactly s[pos] (anchored).
  bool matches_at(std::string_view s, size_t pos) const;

 private:
  // Per-call match state (match data and JIT stack are not shareable between threads).
  struct Scratch {
    pcre2_match_data* md = nullptr;
    pcre2_match_context* mctx = nullptr;
    pcre2_jit_stack* stack = nullptr;
    // Allocates the match data (and, with `jit`, a JIT stack); throws spade::Error when out of memory.
    Scratch(const pcre2_code* code, bool jit);
    ~Scratch();
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
  };

  // Throws spade::Error for the PCRE2 match error `rc` on a text of `text_size` bytes.
  [[noreturn]] void match_failed(int rc, size_t text_size) const;

  std::string pattern_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// A String or Regex pattern of Split / Replace (defined in tokenizer_pretokenize.cpp).
struct Pattern {
  std::string literal;                 // when regex == nullptr
  std::shared_ptr<const Regex> regex;  // else

  // (start, end, is_match) pieces covering s, as the library's Pattern::find_matches.
  void find_matches(std::string_view s, std::vector<std::tuple<size_t, size_t, bool>>& out) const;
  // `s` with every match replaced by `content`.
  std::string replace_all(std::string_view s, std::string_view content) const;
};

// ================================================================================================
// Pipeline components
// ================================================================================================

// Heterogeneous string hashing for unordered_map<std::string, ...> lookups by string_view. Deliberately not
// noexcept: libstdc++ then stores each node's hash code, instead of rehashing keys while walking buckets
// (which made lookups in the 151k-entry vocabulary several times slower).
struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
// A string-keyed map that can be searched with a string_view.
template <typename V>
using StrMap = std::unordered_map<std::string, V, StrHash, std::equal_to<>>;

// One normalizer of the chain (tokenizer.json "normalizer", Sequence flattened).
struct NormStep {
  enum class Kind { kNfc, kNfd, kPrepend, kReplace } kind;
  std::string text;  // Prepend: the prefix; Replace: the replacement
  Pattern pattern;   // Replace
};

// The library's SplitDelimiterBehavior: what happens to the matches of a Split pattern.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One pre-tokenizer of the chain (tokenizer.json "pre_tokenizer", Sequence flattened).
struct PreTokStep {
  enum class Kind { kSplit, kByteLevel } kind;
  Pattern pattern;  // Split; ByteLevel with use_regex: the GPT-2 pattern
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  bool use_regex = false;         // ByteLevel
};

// One decoder of the chain (tokenizer.json "decoder", Sequence flattened).
struct DecStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip } kind;
  Pattern pattern;   // Replace
  std::string text;  // Replace: content
  char32_t strip_char = U' ';
  size_t start = 0, stop = 0;  // Strip
  bool fused_input = false;    // whether the tokens reaching this step were already fused into one string
};

// Byte-level trie over added-token contents: leftmost-longest, non-overlapping matching (as aho-corasick's
// MatchKind::LeftmostLongest in the library). insert and find_all are in tokenizer_bpe.cpp.
class Trie {
 public:
  // Adds `s` (non-empty) with `value` (>= 0); a repeated `s` takes the new value.
  void insert(std::string_view s, int32_t value);
  // Whether nothing was inserted.
  bool empty() const { return empty_; }
  // One match: text[start, end) is the token with `value`.
  struct Match {
    size_t start, end;
    int32_t value;
  };
  // The leftmost-longest non-overlapping matches in `text`, in order.
  void find_all(std::string_view text, std::vector<Match>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;
    int32_t value = -1;
  };
  int32_t child(int32_t node, unsigned char c) const {
    for (const auto& [k, v] : nodes_[node].next) {
      if (k == c) return v;
    }
    return -1;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
  bool empty_ = true;
};

// A BPE merge (a, b): its rank (position in model.merges) and the id of the merged token.
struct MergeInfo {
  uint32_t rank;
  int32_t new_id;
};

}  // namespace spade::tokenizer_detail

namespace spade {

// ================================================================================================
// Tokenizer::Impl: everything loaded (tokenizer_load.cpp builds it); immutable after loading apart from the
// mutex-guarded BPE word cache. Its member functions are defined in the unit of their pipeline stage.
// ================================================================================================

struct Tokenizer::Impl {
  std::string source;

  // Model (BPE)
  tokenizer_detail::StrMap<int32_t> vocab;
  std::vector<std::string> id_to_tok;  // vocab_size entries; model tokens and added tokens
  std::vector<uint8_t> id_kind;        // 0 unused, 1 model vocab, 2 added only, 3 added + model vocab
  std::unordered_map<uint64_t, tokenizer_detail::MergeInfo> merges;  // (id a << 32 | id b) -> merge
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::optional<std::string> cont_prefix;  // continuing_subword_prefix
  std::optional<std::string> eow_suffix;   // end_of_word_suffix
  std::array<int32_t, 256> byte_ids{};     // <0xNN> ids for byte_fallback, -1 when absent

  std::vector<tokenizer_detail::NormStep> normalizers;
  std::vector<tokenizer_detail::PreTokStep> pretokenizers;

  std::vector<AddedToken> added;
  tokenizer_detail::StrMap<int32_t> added_by_content;
  std::vector<uint8_t> special_ids;  // by id
  tokenizer_detail::Trie raw_trie;   // normalized=false tokens, values index `added`
  tokenizer_detail::Trie norm_trie;  // normalized=true tokens (normalized content)
  bool any_single_word = false;
  std::unique_ptr<tokenizer_detail::Regex> word_char;  // Rust regex \w approximation, for single_word

  std::vector<int32_t> prefix_ids, suffix_ids;  // what the post-processor adds around the text's ids

  bool has_decoder = false;
  std::vector<tokenizer_detail::DecStep> decoders;

  // From tokenizer_config.json / chat_template.jinja (from_dir).
  std::optional<int32_t> bos, eos;
  std::optional<bool> add_bos, add_eos;
  std::string chat_template;
  std::string chat_template_source;

  static constexpr size_t kCacheCapacity = 100000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mu;
  mutable tokenizer_detail::StrMap<std::vector<int32_t>> cache;  // pre-token -> BPE ids

  // ---- encoding ----
  // The normalizer chain on `s` (tokenizer_normalize.cpp).
  std::string normalize(std::string_view s) const;
  // The pre-tokenizer chain: `s` -> the pre-tokens, in order (tokenizer_pretokenize.cpp).
  void pre_tokenize(std::string_view s, std::vector<std::string>& words) const;
  // Appends the ids of one pre-token, through the word cache (tokenizer_bpe.cpp).
  void bpe_word(const std::string& word, std::vector<int32_t>& out) const;
  // Appends the ids of one pre-token: initial symbols, then merges in rank order (tokenizer_bpe.cpp).
  void bpe_merge(const std::string& word, std::vector<int32_t>& out) const;
  // Appends the ids of normalized text without added tokens: pre-tokenizer, then BPE (tokenizer_bpe.cpp).
  void encode_model_segment(std::string_view s, std::vector<int32_t>& ids) const;
  // Splits `s` on the tokens of `trie` (the library's AddedVocabulary::find_matches): (start, end, added
  // index|-1) (tokenizer_bpe.cpp).
  void split_added(std::string_view s, const tokenizer_detail::Trie& trie,
                   std::vector<std::tuple<size_t, size_t, int32_t>>& out) const;

  // ---- decoding ----
  // The token string of `id`, or nullptr for an id >= 0 that names no token: the library's decode drops those
  // (filter_map over id_to_token), and a model's embedding is often padded past the tokenizer (Qwen2 configs:
  // vocab_size 151936 for a tokenizer of 151646 ids), so a sampled id may fall there. A negative id is a
  // caller's bug and throws.
  const std::string* token_of(int32_t id) const;
  // Whether `id` is an added token marked special.
  bool is_special(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < special_ids.size() && special_ids[id] != 0;
  }
};

}  // namespace spade

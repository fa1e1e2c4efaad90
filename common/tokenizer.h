// Hugging Face `tokenizer.json` tokenizers (BPE model only). Implemented here, as no tokenizer library is
// packaged.
//
// Format: the serialization of the Rust `tokenizers` library (https://huggingface.co/docs/tokenizers), as
// written by tokenizers 0.2x / transformers. The pipeline is the library's:
//   added tokens split out of the raw text -> normalizer -> added tokens with normalized=true split out
//   -> pre-tokenizer -> BPE model (per pre-token) -> post-processor (only with add_special_tokens)
// and decoding: ids -> token strings (special tokens dropped on request) -> decoder chain -> text.
//
// Supported components (anything else is rejected at load with an error naming the file, the field and the
// list of supported types):
//   model: BPE with vocab, merges ("a b" strings or [a, b] pairs), unk_token, fuse_unk, byte_fallback,
//     ignore_merges, continuing_subword_prefix, end_of_word_suffix; `dropout` must be null or 0. Merging is
//     the library's: repeatedly apply the lowest-rank merge present in the word (leftmost on ties), i.e. the
//     BPE of Sennrich et al. 2016 applied in merge-rank order.
//   normalizer: NFC, NFD, Prepend, Replace (String or Regex pattern), Sequence of those. NFC/NFD follow
//     UAX #15 (canonical decomposition, canonical ordering, canonical composition) with tables generated from
//     Unicode 14.0 data (Python 3.11 unicodedata); the Rust library uses a newer Unicode version, which can
//     differ only for characters assigned after 14.0.
//   pre_tokenizer: Split (String or Regex pattern; behavior Removed, Isolated, MergedWithPrevious,
//     MergedWithNext or Contiguous; invert), ByteLevel (add_prefix_space, use_regex with the GPT-2 pattern),
//     Sequence of those. Regexes run on PCRE2 in UTF + UCP mode (JIT when available). The library uses
//     Oniguruma; the known difference on the GPT-2 and Qwen2 patterns is U+180E, which PCRE2's \s matches.
//   post_processor: TemplateProcessing (the single-sequence template), ByteLevel (no-op on ids),
//     BertProcessing, RobertaProcessing, Sequence of those.
//   decoder: ByteLevel, Replace (String or Regex), ByteFallback, Fuse, Strip, Sequence of those, or none
//     (tokens joined with " ", as the library does). Chains that cannot be streamed exactly (ByteLevel,
//     ByteFallback or a multi-character Replace after Fuse/ByteLevel) are rejected.
// "truncation" and "padding" are ignored, as transformers does when called without truncation/padding.
//
// Thread safety: a loaded Tokenizer is immutable apart from an internal, mutex-guarded BPE word cache; one
// instance may be used from many threads. Copies are cheap and share the loaded state.
//
// Implementation: common/tokenizer*.cpp, by pipeline stage; the internal tokenizer_impl.h lists the units.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spade {

/// GPT-2's `bytes_to_unicode` table (Radford et al. 2019, openai/gpt-2 encoder.py): byte b -> the UTF-8
/// encoding of the printable code point that byte-level BPE vocabularies use for it. Printable Latin-1 bytes
/// (0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF) map to themselves; the other 68 bytes map, in byte order, to
/// U+0100..U+0143 (so ' ' -> "Ġ" U+0120, '\n' -> "Ċ" U+010A).
const std::array<std::string, 256>& gpt2_byte_to_unicode();

/// Unicode canonical normalization of valid UTF-8 (UAX #15, Unicode 14.0 tables). Throws spade::Error when
/// `text` is not valid UTF-8.
std::string nfc_normalize(std::string_view text);
std::string nfd_normalize(std::string_view text);

/// Whether `text` is valid UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool is_valid_utf8(std::string_view text);

/// Converts bytes to UTF-8 text the way Rust's String::from_utf8_lossy does (and Python's errors="replace"):
/// every maximal ill-formed subpart becomes one U+FFFD (The Unicode Standard, §3.9, "U+FFFD Substitution of
/// Maximal Subparts").
std::string utf8_lossy(std::string_view bytes);

/// One entry of tokenizer.json "added_tokens".
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;      // dropped by decode(..., skip_special_tokens=true)
  bool lstrip = false;       // the match also swallows the whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool normalized = false;   // matched in the normalized text (else in the raw text, before normalization)
  bool single_word = false;  // only matched when not preceded or followed by a word character
};

class StreamingDecoder;

/// A loaded tokenizer (see the file comment for what is supported).
class Tokenizer {
 public:
  /// Loads a tokenizer.json. Throws spade::Error naming the file and the field for unreadable files, invalid
  /// JSON, unsupported components ("<path>: model.type 'Unigram' is not supported (BPE only)"), and
  /// inconsistent content ("<path>: model.merges[12] refers to unknown token 'xyz'", duplicate or clashing
  /// ids, ...).
  static Tokenizer from_file(const std::string& tokenizer_json_path);

  /// Loads `<dir>/tokenizer.json` (required) and `<dir>/tokenizer_config.json` (optional): bos_token,
  /// eos_token (string or {"content": ...}; must be in the vocabulary), add_bos_token / add_eos_token,
  /// chat_template (string, or the list-of-{name, template} form, of which "default" is used; else
  /// `<dir>/chat_template.jinja`). When add_bos_token or add_eos_token is given, the single-sequence template
  /// becomes [bos] $A [eos] accordingly, as transformers' LlamaTokenizerFast.update_post_processor does (a
  /// warning is logged if that changes what tokenizer.json's post_processor adds).
  static Tokenizer from_dir(const std::string& dir);

  /// Parses tokenizer.json text; `source` names it in error messages (used by from_file and by tests).
  static Tokenizer from_json_text(std::string_view json_text, const std::string& source);

  /// Token ids of `text` (UTF-8; throws spade::Error when invalid). With add_special_tokens the
  /// post-processor adds its special tokens (e.g. BOS for Llama-style tokenizers; nothing for Qwen2). Added
  /// tokens in the text are always matched (special or not), as in the library with
  /// split_special_tokens=false.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;

  /// Text of `ids` through the decoder chain. Ids of special added tokens are dropped when
  /// skip_special_tokens. An id >= 0 that is neither in the vocabulary nor an added token is dropped, as the
  /// library's decode drops it (models pad their embedding past the tokenizer: a sampled id may land there);
  /// a negative id throws spade::Error.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  /// The bytes token `id` contributes to decoded text, before any UTF-8 repair: the decoder chain's per-token steps
  /// (ByteLevel's bytes, a <0xNN> byte token's byte, Replace on valid UTF-8) without the whole-text ones (Fuse,
  /// Strip). May be part of a UTF-8 character (OpenAI's logprobs `bytes`). "" for an id the tokenizer lacks; a
  /// negative id throws spade::Error.
  std::string token_bytes(int32_t id) const;

  /// Added tokens first, then the model vocabulary (the library's order). std::nullopt when unknown.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  /// The token string (added token content or model vocabulary entry); std::nullopt for an unused id.
  std::optional<std::string_view> id_to_token(int32_t id) const;

  /// Largest id in the model vocabulary or the added tokens, plus one.
  int32_t vocab_size() const;
  /// Whether `id` is an added token marked special.
  bool is_special(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;

  /// From tokenizer_config.json (from_dir only); std::nullopt when absent or null.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<bool> add_bos_token() const;
  std::optional<bool> add_eos_token() const;
  /// The Jinja chat template source from tokenizer_config.json / chat_template.jinja; empty when there is
  /// none.
  const std::string& chat_template() const;
  /// The file the chat template came from (tokenizer_config.json or chat_template.jinja); empty when none.
  const std::string& chat_template_source() const;
  /// Ids that encode(text, true) puts before / after the text's ids.
  const std::vector<int32_t>& special_prefix_ids() const;
  const std::vector<int32_t>& special_suffix_ids() const;

  /// The file(s) it was loaded from, for messages.
  const std::string& source() const;

  struct Impl;  // implementation detail (defined in tokenizer_impl.h)

 private:
  friend class StreamingDecoder;
  explicit Tokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

/// Incremental detokenization for generated ids.
///
/// push(id) returns the text that became final with this id; finish() returns the rest. The concatenation of
/// all push() results and finish() equals tokenizer.decode(all ids, skip_special_tokens), byte for byte, for
/// every supported decoder chain. Every returned piece is valid UTF-8. What is held back, and why:
///   - ByteLevel: the bytes of an incomplete UTF-8 sequence (at most 3) until it completes or turns out
///     invalid (then one U+FFFD per maximal ill-formed subpart, as decode does); finish() turns a truncated
///     tail into U+FFFD.
///   - ByteFallback (<0xNN> tokens): a run of consecutive byte tokens, until the next non-byte token or
///     finish(), because the library decodes the run as a whole (valid UTF-8 -> its text, else one U+FFFD
///     per byte token).
///   - Strip after Fuse: leading strip characters until the first other character; trailing strip
///     characters (at most `stop`) until more text follows.
/// Keeps a reference to the tokenizer's shared state (the Tokenizer object itself may go away).
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  ~StreamingDecoder();
  StreamingDecoder(StreamingDecoder&&) noexcept;
  StreamingDecoder& operator=(StreamingDecoder&&) noexcept;

  /// An id the tokenizer lacks gives "" and a negative id throws spade::Error (as decode does).
  std::string push(int32_t id);
  /// Flushes everything held back. The decoder is then reset for a new sequence.
  std::string finish();
  /// Drops everything held back and starts a new sequence.
  void reset();

 private:
  struct State;
  std::shared_ptr<const Tokenizer::Impl> impl_;
  bool skip_special_;
  std::unique_ptr<State> state_;
};

}  // namespace spade

// Decoding: the decoder steps (ByteLevel, Replace, ByteFallback, Fuse, Strip) applied to a whole id
// sequence (Tokenizer::decode, the library's decode_chain) and as a chain of stream stages
// (StreamingDecoder). Both live here because they must agree byte for byte (see tokenizer.h).
#include <functional>
#include <memory>

#include "common/error.h"
#include "common/tokenizer.h"
#include "common/tokenizer_impl.h"
#include "common/tokenizer_utf8.h"

namespace spade {

using tokenizer_detail::append_lossy;
using tokenizer_detail::decode_at;
using tokenizer_detail::DecStep;
using tokenizer_detail::first_invalid_utf8;
using tokenizer_detail::kReplacementChar;
using tokenizer_detail::prev_char_start;
using tokenizer_detail::utf8_char_len;

// ================================================================================================
// Decoder steps on single tokens
// ================================================================================================

namespace {

// The ByteLevel decoder's reverse table: code point (< 0x144) -> byte, or -1.
const std::array<int16_t, 0x144>& byte_level_reverse() {
  static const std::array<int16_t, 0x144> table = [] {
    std::array<int16_t, 0x144> t;
    t.fill(-1);
    const auto& fwd = gpt2_byte_to_unicode();
    for (int b = 0; b < 256; ++b) t[decode_at(fwd[b], 0)] = static_cast<int16_t>(b);
    return t;
  }();
  return table;
}

// The ByteLevel decoder on one token: its bytes through the reverse table, or its raw UTF-8 when any
// character is outside the table (the library's behaviour, which lets added tokens through unchanged).
void byte_level_token_bytes(std::string_view token, std::string& out) {
  const auto& rev = byte_level_reverse();
  const size_t mark = out.size();
  for (size_t i = 0; i < token.size();) {
    const char32_t c = decode_at(token, i);
    if (c >= rev.size() || rev[c] < 0) {
      out.resize(mark);
      out.append(token);
      return;
    }
    out.push_back(static_cast<char>(rev[c]));
    i += utf8_char_len(static_cast<unsigned char>(token[i]));
  }
}

// "<0xNN>" -> NN (the ByteFallback decoder's test).
bool parse_byte_token(std::string_view t, unsigned char* b) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return false;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return false;
  *b = static_cast<unsigned char>(hi * 16 + lo);
  return true;
}

// The Strip decoder on one string: up to `start` leading and `stop` trailing `c` characters removed.
std::string strip_chars(std::string_view s, char32_t c, size_t start, size_t stop) {
  size_t b = 0, n_lead = 0;
  while (n_lead < start && b < s.size() && decode_at(s, b) == c) {
    b += utf8_char_len(static_cast<unsigned char>(s[b]));
    ++n_lead;
  }
  size_t e = s.size(), n_trail = 0;
  while (n_trail < stop && e > 0) {
    const size_t p = prev_char_start(s, e);
    if (decode_at(s, p) != c) break;
    e = p;
    ++n_trail;
  }
  if (e <= b) return std::string();  // the library panics here (start_cut > stop_cut); nothing remains
  return std::string(s.substr(b, e - b));
}

}  // namespace

const std::string* Tokenizer::Impl::token_of(int32_t id) const {
  if (id < 0) fail("{}: token id {} is negative", source, id);
  if (static_cast<size_t>(id) >= id_kind.size() || id_kind[id] == 0) return nullptr;
  return &id_to_tok[id];
}

// ================================================================================================
// Tokenizer::decode
// ================================================================================================

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* tok = t.token_of(id);
    if (tok == nullptr || (skip_special_tokens && t.is_special(id))) continue;
    tokens.push_back(*tok);
  }
  if (!t.has_decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  // The library's decode_chain, step by step.
  for (const DecStep& s : t.decoders) {
    switch (s.kind) {
      case DecStep::Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& tok : tokens) byte_level_token_bytes(tok, bytes);
        std::string text;
        text.reserve(bytes.size());
        append_lossy(text, bytes, false);
        tokens.assign(1, std::move(text));
        break;
      }
      case DecStep::Kind::kReplace:
        for (std::string& tok : tokens) tok = s.pattern.replace_all(tok, s.text);
        break;
      case DecStep::Kind::kByteFallback: {
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&]() {
          if (run_tokens == 0) return;
          if (first_invalid_utf8(run) == std::string_view::npos) {
            out.push_back(run);
          } else {
            for (size_t k = 0; k < run_tokens; ++k) out.emplace_back(kReplacementChar);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& tok : tokens) {
          unsigned char b;
          if (parse_byte_token(tok, &b)) {
            run.push_back(static_cast<char>(b));
            ++run_tokens;
          } else {
            flush();
            out.push_back(std::move(tok));
          }
        }
        flush();
        tokens.swap(out);
        break;
      }
      case DecStep::Kind::kFuse: {
        std::string all;
        for (const std::string& tok : tokens) all += tok;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecStep::Kind::kStrip:
        for (std::string& tok : tokens) tok = strip_chars(tok, s.strip_char, s.start, s.stop);
        break;
    }
  }
  std::string out;
  for (const std::string& tok : tokens) out += tok;
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  const Impl& t = *impl_;
  const std::string* tok = t.token_of(id);
  if (tok == nullptr) return {};
  std::string cur = *tok;
  if (!t.has_decoder) return cur;
  for (const DecStep& s : t.decoders) {
    switch (s.kind) {
      case DecStep::Kind::kByteLevel: {
        std::string bytes;
        byte_level_token_bytes(cur, bytes);
        cur.swap(bytes);
        break;
      }
      case DecStep::Kind::kReplace:
        if (first_invalid_utf8(cur) == std::string_view::npos) cur = s.pattern.replace_all(cur, s.text);
        break;
      case DecStep::Kind::kByteFallback: {
        unsigned char b;
        if (parse_byte_token(cur, &b)) cur.assign(1, static_cast<char>(b));
        break;
      }
      case DecStep::Kind::kFuse:
      case DecStep::Kind::kStrip:
        break;  // whole-text steps
    }
  }
  return cur;
}

// ================================================================================================
// StreamingDecoder: the decoder chain as a chain of stream stages (see tokenizer.h for what each holds back).
// ================================================================================================

namespace {

using Emit = std::function<void(std::string)>;

class Stage {
 public:
  virtual ~Stage() = default;
  virtual void push(std::string tok, const Emit& emit) = 0;
  virtual void finish(const Emit& /*emit*/) {}
};

class ByteLevelStage : public Stage {
 public:
  void push(std::string tok, const Emit& emit) override {
    byte_level_token_bytes(tok, pending_);
    std::string out;
    const size_t used = append_lossy(out, pending_, /*hold_truncated=*/true);
    pending_.erase(0, used);
    if (!out.empty()) emit(std::move(out));
  }
  void finish(const Emit& emit) override {
    std::string out;
    append_lossy(out, pending_, false);
    pending_.clear();
    if (!out.empty()) emit(std::move(out));
  }

 private:
  std::string pending_;
};

class ReplaceStage : public Stage {
 public:
  explicit ReplaceStage(const DecStep& s) : s_(s) {}
  void push(std::string tok, const Emit& emit) override { emit(s_.pattern.replace_all(tok, s_.text)); }

 private:
  const DecStep& s_;
};

class ByteFallbackStage : public Stage {
 public:
  void push(std::string tok, const Emit& emit) override {
    unsigned char b;
    if (parse_byte_token(tok, &b)) {
      run_.push_back(static_cast<char>(b));
      return;
    }
    flush(emit);
    emit(std::move(tok));
  }
  void finish(const Emit& emit) override { flush(emit); }

 private:
  void flush(const Emit& emit) {
    if (run_.empty()) return;
    if (first_invalid_utf8(run_) == std::string_view::npos) {
      emit(run_);
    } else {
      for (size_t k = 0; k < run_.size(); ++k) emit(std::string(kReplacementChar));
    }
    run_.clear();
  }
  std::string run_;
};

class PassStage : public Stage {  // Fuse: token boundaries stop mattering
 public:
  void push(std::string tok, const Emit& emit) override { emit(std::move(tok)); }
};

class StripTokenStage : public Stage {  // Strip on separate tokens
 public:
  explicit StripTokenStage(const DecStep& s) : s_(s) {}
  void push(std::string tok, const Emit& emit) override {
    emit(strip_chars(tok, s_.strip_char, s_.start, s_.stop));
  }

 private:
  const DecStep& s_;
};

class StripStreamStage : public Stage {  // Strip on the fused text, which arrives in pieces
 public:
  explicit StripStreamStage(const DecStep& s) : s_(s), lead_left_(s.start) {}
  void push(std::string piece, const Emit& emit) override {
    std::string_view v(piece);
    while (lead_left_ > 0 && !v.empty()) {
      if (decode_at(v, 0) != s_.strip_char) {
        lead_left_ = 0;
        break;
      }
      v.remove_prefix(utf8_char_len(static_cast<unsigned char>(v[0])));
      --lead_left_;
    }
    if (v.empty()) return;
    lead_left_ = 0;
    if (s_.stop == 0) {
      emit(std::string(v));
      return;
    }
    // Hold the trailing strip characters (at most `stop`) until non-strip text follows.
    std::string all = held_ + std::string(v);
    size_t e = all.size(), n = 0;
    while (n < s_.stop && e > 0) {
      const size_t p = prev_char_start(all, e);
      if (decode_at(all, p) != s_.strip_char) break;
      e = p;
      ++n;
    }
    held_ = all.substr(e);
    if (e > 0) emit(all.substr(0, e));
  }
  void finish(const Emit&) override { held_.clear(); }  // the held characters are the stripped tail

 private:
  const DecStep& s_;
  size_t lead_left_;
  std::string held_;
};

class JoinSpaceStage : public Stage {  // no decoder: tokens joined with " "
 public:
  void push(std::string tok, const Emit& emit) override {
    if (!first_) tok.insert(0, " ");
    first_ = false;
    emit(std::move(tok));
  }

 private:
  bool first_ = true;
};

}  // namespace

struct StreamingDecoder::State {
  std::vector<std::unique_ptr<Stage>> stages;
  std::string out;

  explicit State(const Tokenizer::Impl& t) {
    if (!t.has_decoder) {
      stages.push_back(std::make_unique<JoinSpaceStage>());
      return;
    }
    for (const DecStep& s : t.decoders) {
      switch (s.kind) {
        case DecStep::Kind::kByteLevel:
          stages.push_back(std::make_unique<ByteLevelStage>());
          break;
        case DecStep::Kind::kReplace:
          stages.push_back(std::make_unique<ReplaceStage>(s));  // per token or per single character: same
          break;
        case DecStep::Kind::kByteFallback:
          stages.push_back(std::make_unique<ByteFallbackStage>());
          break;
        case DecStep::Kind::kFuse:
          stages.push_back(std::make_unique<PassStage>());
          break;
        case DecStep::Kind::kStrip:
          if (s.fused_input) {
            stages.push_back(std::make_unique<StripStreamStage>(s));
          } else {
            stages.push_back(std::make_unique<StripTokenStage>(s));
          }
          break;
      }
    }
  }

  void feed(size_t stage, std::string tok) {
    if (stage == stages.size()) {
      out += tok;
      return;
    }
    stages[stage]->push(std::move(tok), [this, stage](std::string t) { feed(stage + 1, std::move(t)); });
  }
  void finish_all() {
    for (size_t i = 0; i < stages.size(); ++i) {
      stages[i]->finish([this, i](std::string t) { feed(i + 1, std::move(t)); });
    }
  }
};

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : impl_(tokenizer.impl_), skip_special_(skip_special_tokens), state_(std::make_unique<State>(*impl_)) {}
StreamingDecoder::~StreamingDecoder() = default;
StreamingDecoder::StreamingDecoder(StreamingDecoder&&) noexcept = default;
StreamingDecoder& StreamingDecoder::operator=(StreamingDecoder&&) noexcept = default;

std::string StreamingDecoder::push(int32_t id) {
  const std::string* tok = impl_->token_of(id);
  if (tok == nullptr || (skip_special_ && impl_->is_special(id))) return std::string();
  state_->feed(0, *tok);
  std::string out;
  out.swap(state_->out);
  return out;
}

std::string StreamingDecoder::finish() {
  state_->finish_all();
  std::string out;
  out.swap(state_->out);
  reset();
  return out;
}

void StreamingDecoder::reset() {
  state_ = std::make_unique<State>(*impl_);
}

}  // namespace spade

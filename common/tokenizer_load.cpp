// Loading: tokenizer.json (a SAX pass, then the model, added tokens, normalizer, pre-tokenizer,
// post-processor and decoder, each checked with errors naming the file and the field) and, for from_dir,
// tokenizer_config.json and chat_template.jinja.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <unordered_map>
#include <utility>

#include "common/error.h"
#include "common/file_read.h"
#include "common/logging.h"
#include "common/tokenizer.h"
#include "common/tokenizer_impl.h"
#include "common/tokenizer_utf8.h"

namespace spade {

using json = nlohmann::json;
using tokenizer_detail::decode_at;
using tokenizer_detail::DecStep;
using tokenizer_detail::MergeInfo;
using tokenizer_detail::NormStep;
using tokenizer_detail::Pattern;
using tokenizer_detail::PreTokStep;
using tokenizer_detail::Regex;
using tokenizer_detail::SplitBehavior;
using tokenizer_detail::utf8_count;

namespace {

std::string quote_for_message(std::string_view s) {
  constexpr size_t kMax = 80;
  std::string out(s.substr(0, kMax));
  if (s.size() > kMax) out += "...";
  return out;
}

// GPT-2's pre-tokenization pattern (ByteLevel with use_regex=true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Largest id accepted in model.vocab and added_tokens.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// ================================================================================================
// tokenizer.json reading: a SAX handler that builds a DOM for everything except model.vocab and model.merges,
// which are captured directly (the DOM of a 151k-entry object costs more than the rest of loading together).
// ================================================================================================

struct CapturedModel {
  bool has_vocab = false;
  bool has_merges = false;
  std::vector<std::pair<std::string, int64_t>> vocab;  // file order
  std::vector<std::pair<std::string, std::string>> merges;
};

class TokenizerJsonSax : public nlohmann::json_sax<json> {
 public:
  json root;
  CapturedModel model;
  std::string error;  // set when a handler stops the parse

  bool null() override { return value(json(nullptr)); }
  bool boolean(bool v) override { return value(json(v)); }
  bool number_integer(number_integer_t v) override {
    if (mode_ == Mode::kVocab) return vocab_id(v);
    return value(json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (mode_ == Mode::kVocab) {
      return vocab_id(v > static_cast<number_unsigned_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(v));
    }
    return value(json(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return value(json(v)); }
  bool string(string_t& v) override {
    if (mode_ == Mode::kMerges) {
      const size_t sp = v.find(' ');
      if (sp == std::string::npos || v.find(' ', sp + 1) != std::string::npos) {
        return stop(fmt::format("model.merges[{}] '{}' is not of the form 'a b'", model.merges.size(),
                                quote_for_message(v)));
      }
      model.merges.emplace_back(v.substr(0, sp), v.substr(sp + 1));
      return true;
    }
    if (mode_ == Mode::kMergePair) {
      if (pair_.size() >= 2) return stop(pair_error());
      pair_.push_back(std::move(v));
      return true;
    }
    return value(json(std::move(v)));
  }
  bool binary(binary_t&) override { return stop("binary values are not JSON"); }
  bool key(string_t& k) override {
    if (mode_ == Mode::kVocab) {
      vocab_key_ = std::move(k);
      return true;
    }
    keys_.back() = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::kVocab)
      return stop(fmt::format("model.vocab['{}'] must be an integer id", vocab_key_));
    if (mode_ == Mode::kMerges || mode_ == Mode::kMergePair) {
      return stop(
          fmt::format("model.merges[{}] must be a string 'a b' or a pair [a, b]", model.merges.size()));
    }
    if (at_model_field("vocab")) {
      mode_ = Mode::kVocab;
      model.has_vocab = true;
      return true;
    }
    return open(json::object());
  }
  bool end_object() override {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kNone;
      return true;
    }
    return close();
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::kVocab)
      return stop(fmt::format("model.vocab['{}'] must be an integer id", vocab_key_));
    if (mode_ == Mode::kMergePair) return stop(pair_error());
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kMergePair;
      pair_.clear();
      return true;
    }
    if (at_model_field("merges")) {
      mode_ = Mode::kMerges;
      model.has_merges = true;
      return true;
    }
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::kMergePair) {
      if (pair_.size() != 2) return stop(pair_error());
      model.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      mode_ = Mode::kMerges;
      return true;
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kNone;
      return true;
    }
    return close();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    if (error.empty()) error = fmt::format("not valid JSON: {}", ex.what());
    return false;
  }

 private:
  enum class Mode { kNone, kVocab, kMerges, kMergePair };

  bool stop(std::string msg) {
    if (error.empty()) error = std::move(msg);
    return false;
  }
  std::string pair_error() const {
    return fmt::format("model.merges[{}] must be a pair of two strings [a, b]", model.merges.size());
  }
  bool vocab_id(int64_t v) {
    model.vocab.emplace_back(std::move(vocab_key_), v);
    vocab_key_.clear();
    return true;
  }
  bool value_in_capture() {
    if (mode_ == Mode::kVocab)
      return stop(fmt::format("model.vocab['{}'] must be an integer id", vocab_key_));
    if (mode_ == Mode::kMergePair) return stop(pair_error());
    return stop(fmt::format("model.merges[{}] must be a string 'a b' or a pair [a, b]", model.merges.size()));
  }
  // The next container opened is root["model"][field].
  bool at_model_field(const char* field) const {
    return stack_.size() == 2 && names_[1] == "model" && stack_[0] == &root && stack_[1]->is_object() &&
           keys_.back() == field;
  }
  json* slot_for_new() {
    if (stack_.empty()) return &root;
    json* top = stack_.back();
    if (top->is_array()) {
      top->push_back(json());
      return &top->back();
    }
    return &(*top)[keys_.back()];
  }
  bool value(json v) {
    if (mode_ != Mode::kNone) return value_in_capture();
    *slot_for_new() = std::move(v);
    return true;
  }
  bool open(json container) {
    const std::string name = (stack_.empty() || stack_.back()->is_array()) ? std::string() : keys_.back();
    json* slot = slot_for_new();
    *slot = std::move(container);
    stack_.push_back(slot);
    keys_.emplace_back();
    names_.push_back(name);
    return true;
  }
  bool close() {
    stack_.pop_back();
    keys_.pop_back();
    names_.pop_back();
    return true;
  }

  Mode mode_ = Mode::kNone;
  std::vector<json*> stack_;
  std::vector<std::string> keys_;   // current key of each open object
  std::vector<std::string> names_;  // key under which each open container sits in its parent
  std::string vocab_key_;
  std::vector<std::string> pair_;
};

// A tokenizer file: a regular file only, opened without blocking (common/file_read.h).
std::string read_text_file(const std::string& path, const char* what, uint64_t max_bytes = kMaxCheckpointJsonBytes) {
  return read_regular_file(path, what, max_bytes);
}

// Field access with errors naming the file and the JSON path.
struct Ctx {
  const std::string& source;
  static std::string join(const std::string& path, const char* key) {
    return path.empty() ? std::string(key) : path + "." + key;
  }
  [[noreturn]] void error(const std::string& field, const std::string& msg) const {
    fail("{}: {} {}", source, field, msg);
  }
  const json& get(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object()) error(path, "must be an object");
    auto it = obj.find(key);
    if (it == obj.end()) error(join(path, key), "is missing");
    return *it;
  }
  const json* find(const json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }
  std::string str(const json& v, const std::string& path) const {
    if (!v.is_string()) error(path, fmt::format("must be a string (got {})", v.type_name()));
    return v.get<std::string>();
  }
  bool boolean(const json& obj, const std::string& path, const char* key, bool def) const {
    const json* v = find(obj, key);
    if (v == nullptr || v->is_null()) return def;
    if (!v->is_boolean()) error(join(path, key), fmt::format("must be a boolean (got {})", v->type_name()));
    return v->get<bool>();
  }
  int64_t integer(const json& v, const std::string& path) const {
    if (!v.is_number_integer()) error(path, fmt::format("must be an integer (got {})", v.type_name()));
    return v.get<int64_t>();
  }
  std::string type_of(const json& obj, const std::string& path) const {
    return str(get(obj, path, "type"), join(path, "type"));
  }
};

// ================================================================================================
// Component parsing
// ================================================================================================

Pattern parse_pattern(const Ctx& c, const json& v, const std::string& path) {
  if (!v.is_object() || v.size() != 1) c.error(path, "must be {\"String\": ...} or {\"Regex\": ...}");
  Pattern p;
  if (const json* s = c.find(v, "String")) {
    p.literal = c.str(*s, path + ".String");
    if (p.literal.empty()) c.error(path + ".String", "must not be empty");
  } else if (const json* r = c.find(v, "Regex")) {
    p.regex = std::make_shared<Regex>(c.str(*r, path + ".Regex"), c.source + ": " + path + ".Regex");
  } else {
    c.error(path, "must be {\"String\": ...} or {\"Regex\": ...}");
  }
  return p;
}

// A "Sequence" step: calls parse(item, its path) for each element of its array `key`.
template <typename Parse>
void for_each_in_sequence(const Ctx& c, const json& step, const std::string& path, const char* key, Parse parse) {
  const json& list = c.get(step, path, key);
  if (!list.is_array()) c.error(fmt::format("{}.{}", path, key), "must be an array");
  for (size_t i = 0; i < list.size(); ++i) parse(list[i], fmt::format("{}.{}[{}]", path, key, i));
}

void parse_normalizer(const Ctx& c, const json& n, const std::string& path, std::vector<NormStep>& out) {
  if (n.is_null()) return;
  const std::string type = c.type_of(n, path);
  if (type == "Sequence") {
    for_each_in_sequence(c, n, path, "normalizers",
                         [&](const json& item, const std::string& at) { parse_normalizer(c, item, at, out); });
  } else if (type == "NFC") {
    out.push_back({NormStep::Kind::kNfc, {}, {}});
  } else if (type == "NFD") {
    out.push_back({NormStep::Kind::kNfd, {}, {}});
  } else if (type == "Prepend") {
    out.push_back({NormStep::Kind::kPrepend, c.str(c.get(n, path, "prepend"), path + ".prepend"), {}});
  } else if (type == "Replace") {
    out.push_back({NormStep::Kind::kReplace, c.str(c.get(n, path, "content"), path + ".content"),
                   parse_pattern(c, c.get(n, path, "pattern"), path + ".pattern")});
  } else {
    c.error(path + ".type",
            fmt::format("'{}' is not supported (supported: NFC, NFD, Prepend, Replace, Sequence)", type));
  }
}

void parse_pre_tokenizer(const Ctx& c, const json& p, const std::string& path, std::vector<PreTokStep>& out) {
  if (p.is_null()) return;
  const std::string type = c.type_of(p, path);
  if (type == "Sequence") {
    for_each_in_sequence(c, p, path, "pretokenizers",
                         [&](const json& item, const std::string& at) { parse_pre_tokenizer(c, item, at, out); });
  } else if (type == "Split") {
    PreTokStep s;
    s.kind = PreTokStep::Kind::kSplit;
    s.pattern = parse_pattern(c, c.get(p, path, "pattern"), path + ".pattern");
    const std::string b = c.str(c.get(p, path, "behavior"), path + ".behavior");
    static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    bool found = false;
    for (const auto& [name, v] : kBehaviors) {
      if (b == name) {
        s.behavior = v;
        found = true;
      }
    }
    if (!found) {
      c.error(path + ".behavior", fmt::format("'{}' is not one of Removed, Isolated, MergedWithPrevious, "
                                              "MergedWithNext, Contiguous",
                                              b));
    }
    s.invert = c.boolean(p, path, "invert", false);
    out.push_back(std::move(s));
  } else if (type == "ByteLevel") {
    PreTokStep s;
    s.kind = PreTokStep::Kind::kByteLevel;
    s.add_prefix_space = c.boolean(p, path, "add_prefix_space", true);
    s.use_regex = c.boolean(p, path, "use_regex", true);
    if (s.use_regex) s.pattern.regex = std::make_shared<Regex>(kGpt2Pattern, c.source + ": " + path);
    out.push_back(std::move(s));
  } else {
    c.error(path + ".type",
            fmt::format("'{}' is not supported (supported: Split, ByteLevel, Sequence)", type));
  }
}

void parse_decoder(const Ctx& c, const json& d, const std::string& path, std::vector<DecStep>& out,
                   bool& fused) {
  const std::string type = c.type_of(d, path);
  auto unsupported_after_fuse = [&](const char* what) {
    c.error(path, fmt::format("{} after a Fuse or ByteLevel decoder is not supported (it cannot be streamed)",
                              what));
  };
  if (type == "Sequence") {
    const json& list = c.get(d, path, "decoders");
    if (!list.is_array()) c.error(path + ".decoders", "must be an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_decoder(c, list[i], fmt::format("{}.decoders[{}]", path, i), out, fused);
    }
    return;
  }
  DecStep s;
  s.fused_input = fused;
  if (type == "ByteLevel") {
    if (fused) unsupported_after_fuse("ByteLevel");
    s.kind = DecStep::Kind::kByteLevel;
    fused = true;
  } else if (type == "Replace") {
    s.kind = DecStep::Kind::kReplace;
    s.pattern = parse_pattern(c, c.get(d, path, "pattern"), path + ".pattern");
    s.text = c.str(c.get(d, path, "content"), path + ".content");
    if (fused && (s.pattern.regex || utf8_count(s.pattern.literal) != 1)) {
      unsupported_after_fuse("Replace with a regex or multi-character pattern");
    }
  } else if (type == "ByteFallback") {
    if (fused) unsupported_after_fuse("ByteFallback");
    s.kind = DecStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    s.kind = DecStep::Kind::kFuse;
    fused = true;
  } else if (type == "Strip") {
    s.kind = DecStep::Kind::kStrip;
    const std::string content = c.str(c.get(d, path, "content"), path + ".content");
    if (utf8_count(content) != 1) c.error(path + ".content", "must be exactly one character");
    s.strip_char = decode_at(content, 0);
    const int64_t start = c.integer(c.get(d, path, "start"), path + ".start");
    const int64_t stop = c.integer(c.get(d, path, "stop"), path + ".stop");
    if (start < 0 || stop < 0) c.error(path, "start and stop must be >= 0");
    s.start = static_cast<size_t>(start);
    s.stop = static_cast<size_t>(stop);
  } else {
    c.error(path + ".type",
            fmt::format("'{}' is not supported (supported: ByteLevel, Replace, ByteFallback, Fuse, "
                        "Strip, Sequence)",
                        type));
  }
  out.push_back(std::move(s));
}

// Resolves a post-processor special token (name, id) pair.
int32_t known_id(const Ctx& c, const Tokenizer::Impl& t, int64_t id, const std::string& path) {
  if (id < 0 || static_cast<size_t>(id) >= t.id_kind.size() || t.id_kind[id] == 0) {
    c.error(path, fmt::format("refers to id {}, which is not a known token id", id));
  }
  return static_cast<int32_t>(id);
}

void parse_post_processor(const Ctx& c, const json& p, const std::string& path, const Tokenizer::Impl& t,
                          std::vector<int32_t>& prefix, std::vector<int32_t>& suffix) {
  if (p.is_null()) return;
  const std::string type = c.type_of(p, path);
  if (type == "Sequence") {
    const json& list = c.get(p, path, "processors");
    if (!list.is_array()) c.error(path + ".processors", "must be an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_post_processor(c, list[i], fmt::format("{}.processors[{}]", path, i), t, prefix, suffix);
    }
  } else if (type == "ByteLevel") {
    // Offsets only; ids unchanged.
  } else if (type == "TemplateProcessing") {
    const json& single = c.get(p, path, "single");
    const json& specials = c.get(p, path, "special_tokens");
    if (!single.is_array()) c.error(path + ".single", "must be an array");
    std::vector<int32_t> pre, post;
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string ip = fmt::format("{}.single[{}]", path, i);
      const json& item = single[i];
      if (const json* seq = item.is_object() ? c.find(item, "Sequence") : nullptr) {
        const std::string id = c.str(c.get(*seq, ip + ".Sequence", "id"), ip + ".Sequence.id");
        if (id != "A")
          c.error(ip + ".Sequence.id", fmt::format("'{}' in the single template must be 'A'", id));
        if (seen_a) c.error(ip, "the single template has $A twice");
        seen_a = true;
      } else if (const json* sp = item.is_object() ? c.find(item, "SpecialToken") : nullptr) {
        const std::string name = c.str(c.get(*sp, ip + ".SpecialToken", "id"), ip + ".SpecialToken.id");
        if (!specials.is_object() || !specials.contains(name)) {
          c.error(ip + ".SpecialToken.id", fmt::format("'{}' is not in {}.special_tokens", name, path));
        }
        const std::string sp_path = fmt::format("{}.special_tokens['{}']", path, name);
        const json& ids = c.get(specials[name], sp_path, "ids");
        if (!ids.is_array()) c.error(sp_path + ".ids", "must be an array");
        for (size_t k = 0; k < ids.size(); ++k) {
          const std::string kp = fmt::format("{}.ids[{}]", sp_path, k);
          (seen_a ? post : pre).push_back(known_id(c, t, c.integer(ids[k], kp), kp));
        }
      } else {
        c.error(ip, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (!seen_a) c.error(path + ".single", "has no {\"Sequence\": {\"id\": \"A\"}}");
    prefix.insert(prefix.begin(), pre.begin(), pre.end());
    suffix.insert(suffix.end(), post.begin(), post.end());
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    auto pair_id = [&](const char* key) {
      const json& v = c.get(p, path, key);
      const std::string kp = path + "." + key;
      if (!v.is_array() || v.size() != 2) c.error(kp, "must be [token, id]");
      return known_id(c, t, c.integer(v[1], kp + "[1]"), kp);
    };
    prefix.insert(prefix.begin(), pair_id("cls"));
    suffix.push_back(pair_id("sep"));
  } else {
    c.error(path + ".type", fmt::format("'{}' is not supported (supported: TemplateProcessing, ByteLevel, "
                                        "BertProcessing, RobertaProcessing, Sequence)",
                                        type));
  }
}

void parse_model(const Ctx& c, const json& root, CapturedModel& cap, Tokenizer::Impl& t) {
  const json& model = c.get(root, "", "model");
  if (!model.is_object()) c.error("model", "must be an object");
  if (const json* type = c.find(model, "type")) {
    const std::string ty = c.str(*type, "model.type");
    if (ty != "BPE") c.error("model.type", fmt::format("'{}' is not supported (BPE only)", ty));
  } else if (!cap.has_merges) {
    c.error("model.type", "is missing (and the model has no merges, so it is not BPE)");
  }
  if (!cap.has_vocab) c.error("model.vocab", "is missing");
  if (!cap.has_merges) c.error("model.merges", "is missing");
  if (const json* d = c.find(model, "dropout"); d != nullptr && !d->is_null()) {
    if (!d->is_number() || d->get<double>() != 0.0) {
      c.error("model.dropout", fmt::format("{} is not supported (deterministic BPE only)", d->dump()));
    }
  }
  t.fuse_unk = c.boolean(model, "model", "fuse_unk", false);
  t.byte_fallback = c.boolean(model, "model", "byte_fallback", false);
  t.ignore_merges = c.boolean(model, "model", "ignore_merges", false);
  if (const json* v = c.find(model, "continuing_subword_prefix"); v != nullptr && !v->is_null()) {
    t.cont_prefix = c.str(*v, "model.continuing_subword_prefix");
  }
  if (const json* v = c.find(model, "end_of_word_suffix"); v != nullptr && !v->is_null()) {
    t.eow_suffix = c.str(*v, "model.end_of_word_suffix");
  }

  // Vocabulary.
  int64_t max_id = -1;
  t.vocab.reserve(cap.vocab.size() * 2);
  for (auto& [tok, id] : cap.vocab) {
    if (id < 0 || id > kMaxTokenId) {
      c.error(fmt::format("model.vocab['{}']", quote_for_message(tok)),
              fmt::format("has id {} (must be in [0, {}])", id, kMaxTokenId));
    }
    max_id = std::max(max_id, id);
  }
  t.id_to_tok.assign(static_cast<size_t>(max_id + 1), std::string());
  t.id_kind.assign(static_cast<size_t>(max_id + 1), 0);
  for (auto& [tok, id] : cap.vocab) {
    if (t.id_kind[id] != 0) {
      c.error("model.vocab", fmt::format("id {} is used by both '{}' and '{}'", id,
                                         quote_for_message(t.id_to_tok[id]), quote_for_message(tok)));
    }
    if (!t.vocab.emplace(tok, static_cast<int32_t>(id)).second) {
      c.error("model.vocab", fmt::format("token '{}' appears twice", quote_for_message(tok)));
    }
    t.id_kind[id] = 1;
    t.id_to_tok[id] = std::move(tok);
  }
  cap.vocab.clear();
  cap.vocab.shrink_to_fit();

  if (const json* u = c.find(model, "unk_token"); u != nullptr && !u->is_null()) {
    const std::string unk = c.str(*u, "model.unk_token");
    auto it = t.vocab.find(unk);
    if (it == t.vocab.end()) c.error("model.unk_token", fmt::format("'{}' is not in model.vocab", unk));
    t.unk_id = it->second;
  }
  t.byte_ids.fill(-1);
  if (t.byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      auto it = t.vocab.find(fmt::format("<0x{:02X}>", b));
      if (it != t.vocab.end()) t.byte_ids[b] = it->second;
    }
  }

  // Merges: (a, b) -> (rank, id of a + b without the continuing-subword prefix). A repeated pair keeps its
  // last rank, as the library's HashMap collection does.
  const size_t prefix_len = t.cont_prefix ? t.cont_prefix->size() : 0;
  t.merges.reserve(cap.merges.size() * 2);
  std::string merged;
  for (size_t i = 0; i < cap.merges.size(); ++i) {
    const auto& [a, b] = cap.merges[i];
    auto ia = t.vocab.find(a);
    if (ia == t.vocab.end()) {
      c.error(fmt::format("model.merges[{}]", i),
              fmt::format("refers to unknown token '{}'", quote_for_message(a)));
    }
    auto ib = t.vocab.find(b);
    if (ib == t.vocab.end()) {
      c.error(fmt::format("model.merges[{}]", i),
              fmt::format("refers to unknown token '{}'", quote_for_message(b)));
    }
    merged.assign(a);
    merged.append(b.size() >= prefix_len ? std::string_view(b).substr(prefix_len) : std::string_view(b));
    auto im = t.vocab.find(merged);
    if (im == t.vocab.end()) {
      c.error(fmt::format("model.merges[{}]", i),
              fmt::format("('{}', '{}') produces '{}', which is not in model.vocab", quote_for_message(a),
                          quote_for_message(b), quote_for_message(merged)));
    }
    const uint64_t key =
        (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) | static_cast<uint32_t>(ib->second);
    t.merges[key] = MergeInfo{static_cast<uint32_t>(i), im->second};
  }
  cap.merges.clear();
  cap.merges.shrink_to_fit();
}

void parse_added_tokens(const Ctx& c, const json& root, Tokenizer::Impl& t) {
  const json* list = c.find(root, "added_tokens");
  if (list == nullptr || list->is_null()) return;
  if (!list->is_array()) c.error("added_tokens", "must be an array");
  std::unordered_map<int32_t, size_t> by_id;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string path = fmt::format("added_tokens[{}]", i);
    const json& e = (*list)[i];
    if (!e.is_object()) c.error(path, "must be an object");
    AddedToken a;
    const int64_t id = c.integer(c.get(e, path, "id"), path + ".id");
    if (id < 0 || id > kMaxTokenId)
      c.error(path + ".id", fmt::format("{} is out of range [0, {}]", id, kMaxTokenId));
    a.id = static_cast<int32_t>(id);
    a.content = c.str(c.get(e, path, "content"), path + ".content");
    if (a.content.empty()) c.error(path + ".content", "must not be empty");
    // Serde defaults of the library's AddedToken.
    a.single_word = c.boolean(e, path, "single_word", false);
    a.lstrip = c.boolean(e, path, "lstrip", false);
    a.rstrip = c.boolean(e, path, "rstrip", false);
    a.normalized = c.boolean(e, path, "normalized", true);
    a.special = c.boolean(e, path, "special", false);

    if (auto it = by_id.find(a.id); it != by_id.end()) {
      c.error(path, fmt::format("'{}' has id {}, already used by added_tokens[{}] '{}'", a.content, a.id,
                                it->second, t.added[it->second].content));
    }
    if (auto it = t.added_by_content.find(a.content); it != t.added_by_content.end()) {
      c.error(path, fmt::format("'{}' is already added_tokens[{}]", a.content, by_id[it->second]));
    }
    if (auto it = t.vocab.find(a.content); it != t.vocab.end() && it->second != a.id) {
      c.error(path,
              fmt::format("'{}' has id {} but model.vocab has it as id {}", a.content, a.id, it->second));
    }
    if (static_cast<size_t>(a.id) < t.id_kind.size() && t.id_kind[a.id] == 1 &&
        t.id_to_tok[a.id] != a.content) {
      c.error(path, fmt::format("'{}' has id {}, which is model.vocab token '{}'", a.content, a.id,
                                quote_for_message(t.id_to_tok[a.id])));
    }
    if (static_cast<size_t>(a.id) >= t.id_kind.size()) {
      t.id_kind.resize(a.id + 1, 0);
      t.id_to_tok.resize(a.id + 1);
    }
    t.id_kind[a.id] = t.id_kind[a.id] == 1 ? 3 : 2;
    t.id_to_tok[a.id] = a.content;
    by_id[a.id] = i;
    t.added_by_content[a.content] = a.id;
    t.any_single_word = t.any_single_word || a.single_word;
    t.added.push_back(std::move(a));
  }
}

void finish_added_tokens(Tokenizer::Impl& t) {
  t.special_ids.assign(t.id_kind.size(), 0);
  for (size_t i = 0; i < t.added.size(); ++i) {
    const AddedToken& a = t.added[i];
    if (a.special) t.special_ids[a.id] = 1;
    if (a.normalized) {
      const std::string n = t.normalize(a.content);
      if (!n.empty()) t.norm_trie.insert(n, static_cast<int32_t>(i));
    } else {
      t.raw_trie.insert(a.content, static_cast<int32_t>(i));
    }
  }
  if (t.any_single_word) {
    // Rust regex \w is Alphabetic + Mark + Decimal_Number + Connector_Punctuation + Join_Control.
    t.word_char = std::make_unique<Regex>(R"([\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", t.source);
  }
}

std::shared_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view text, const std::string& source) {
  auto t = std::make_shared<Tokenizer::Impl>();
  t->source = source;
  const Ctx c{t->source};

  TokenizerJsonSax sax;
  const bool ok = json::sax_parse(text.begin(), text.end(), &sax);
  if (!ok || !sax.error.empty()) fail("{}: {}", source, sax.error.empty() ? "not valid JSON" : sax.error);
  const json& root = sax.root;
  if (!root.is_object()) fail("{}: the top level must be a JSON object", source);

  parse_model(c, root, sax.model, *t);
  parse_added_tokens(c, root, *t);
  if (const json* n = c.find(root, "normalizer")) parse_normalizer(c, *n, "normalizer", t->normalizers);
  if (const json* p = c.find(root, "pre_tokenizer"))
    parse_pre_tokenizer(c, *p, "pre_tokenizer", t->pretokenizers);
  if (const json* p = c.find(root, "post_processor")) {
    parse_post_processor(c, *p, "post_processor", *t, t->prefix_ids, t->suffix_ids);
  }
  if (const json* d = c.find(root, "decoder"); d != nullptr && !d->is_null()) {
    bool fused = false;
    t->has_decoder = true;
    parse_decoder(c, *d, "decoder", t->decoders, fused);
  }
  finish_added_tokens(*t);
  return t;
}

// tokenizer_config.json token fields: "<s>", null, or {"content": "<s>", ...}.
std::optional<std::string> config_token(const Ctx& c, const json& cfg, const char* key) {
  const json* v = c.find(cfg, key);
  if (v == nullptr || v->is_null()) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  if (v->is_object() && v->contains("content") && (*v)["content"].is_string()) {
    return (*v)["content"].get<std::string>();
  }
  c.error(key, "must be a string, null or an object with a string 'content'");
}

}  // namespace

// ================================================================================================
// Tokenizer: loading entry points
// ================================================================================================

Tokenizer Tokenizer::from_json_text(std::string_view json_text, const std::string& source) {
  return Tokenizer(load_tokenizer_json(json_text, source));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  const std::string text = read_text_file(path, "tokenizer.json", kMaxTokenizerJsonBytes);
  return from_json_text(text, path);
}

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string tj = (fs::path(dir) / "tokenizer.json").string();
  if (!fs::exists(tj)) fail("{}: tokenizer.json is required but missing ({})", dir, tj);
  Tokenizer tok = from_file(tj);
  Impl& t = *tok.impl_;
  const std::string cfg_path = (fs::path(dir) / "tokenizer_config.json").string();
  if (fs::exists(cfg_path)) {
    const std::string text = read_text_file(cfg_path, "tokenizer_config.json");
    json cfg;
    try {
      cfg = json::parse(text);
    } catch (const json::exception& e) {
      fail("{}: not valid JSON: {}", cfg_path, e.what());
    }
    const Ctx c{cfg_path};
    if (!cfg.is_object()) fail("{}: the top level must be a JSON object", cfg_path);
    auto resolve = [&](const char* key) -> std::optional<int32_t> {
      const std::optional<std::string> s = config_token(c, cfg, key);
      if (!s) return std::nullopt;
      const std::optional<int32_t> id = tok.token_to_id(*s);
      if (!id) c.error(key, fmt::format("'{}' is not in the vocabulary of {}", *s, tj));
      return id;
    };
    t.bos = resolve("bos_token");
    t.eos = resolve("eos_token");
    if (const json* v = c.find(cfg, "add_bos_token"); v != nullptr && !v->is_null()) {
      t.add_bos = c.boolean(cfg, "", "add_bos_token", false);
    }
    if (const json* v = c.find(cfg, "add_eos_token"); v != nullptr && !v->is_null()) {
      t.add_eos = c.boolean(cfg, "", "add_eos_token", false);
    }
    if (const json* ct = c.find(cfg, "chat_template"); ct != nullptr && !ct->is_null()) {
      if (ct->is_string()) {
        t.chat_template = ct->get<std::string>();
        t.chat_template_source = cfg_path;
      } else if (ct->is_array()) {
        bool found = false;
        for (size_t i = 0; i < ct->size(); ++i) {
          const json& e = (*ct)[i];
          const std::string p = fmt::format("chat_template[{}]", i);
          if (c.str(c.get(e, p, "name"), p + ".name") == "default") {
            t.chat_template = c.str(c.get(e, p, "template"), p + ".template");
            t.chat_template_source = cfg_path;
            found = true;
          }
        }
        if (!found) c.error("chat_template", "is a list without a 'default' entry");
      } else {
        c.error("chat_template", "must be a string or a list of {name, template}");
      }
    }
    if (t.add_bos || t.add_eos) {
      // As transformers' LlamaTokenizerFast.update_post_processor: single = [bos] $A [eos].
      std::vector<int32_t> pre, post;
      if (t.add_bos.value_or(false)) {
        if (!t.bos) c.error("add_bos_token", "is true but bos_token is not set");
        pre.push_back(*t.bos);
      }
      if (t.add_eos.value_or(false)) {
        if (!t.eos) c.error("add_eos_token", "is true but eos_token is not set");
        post.push_back(*t.eos);
      }
      if (pre != t.prefix_ids || post != t.suffix_ids) {
        spdlog::warn("{}: add_bos_token/add_eos_token override the post_processor of {} ({} + text + {} ids)",
                     cfg_path, tj, pre.size(), post.size());
      }
      t.prefix_ids = std::move(pre);
      t.suffix_ids = std::move(post);
    }
  }
  if (t.chat_template.empty()) {
    const std::string jinja = (fs::path(dir) / "chat_template.jinja").string();
    if (fs::exists(jinja)) {
      t.chat_template = read_text_file(jinja, "chat_template.jinja");
      t.chat_template_source = jinja;
    }
  }
  t.source = tj;
  return tok;
}

}  // namespace spade

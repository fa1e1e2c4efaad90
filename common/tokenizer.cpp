// Hugging Face tokenizer.json (BPE) — see tokenizer.h for what is supported and the references.
//
// This unit holds Tokenizer::encode (the pipeline: added tokens -> normalizer -> added tokens with
// normalized=true -> pre-tokenizer -> BPE -> post-processor) and the accessors. The rest of the
// implementation is split by pipeline stage; tokenizer_impl.h lists the units.
#include "common/tokenizer.h"

#include "common/error.h"
#include "common/tokenizer_impl.h"
#include "common/tokenizer_utf8.h"

namespace spade {

using tokenizer_detail::first_invalid_utf8;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  if (const size_t bad = first_invalid_utf8(text); bad != std::string_view::npos) {
    fail("{}: encode: the text is not valid UTF-8 (byte {} of {})", t.source, bad, text.size());
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = t.prefix_ids;

  std::vector<std::tuple<size_t, size_t, int32_t>> raw_pieces, norm_pieces;
  t.split_added(text, t.raw_trie, raw_pieces);
  for (const auto& [b, e, added] : raw_pieces) {
    if (added >= 0) {
      ids.push_back(t.added[added].id);
      continue;
    }
    const std::string normalized = t.normalize(text.substr(b, e - b));
    if (t.norm_trie.empty()) {
      t.encode_model_segment(normalized, ids);
      continue;
    }
    t.split_added(normalized, t.norm_trie, norm_pieces);
    for (const auto& [nb, ne, nadded] : norm_pieces) {
      if (nadded >= 0) {
        ids.push_back(t.added[nadded].id);
      } else {
        t.encode_model_segment(std::string_view(normalized).substr(nb, ne - nb), ids);
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), t.suffix_ids.begin(), t.suffix_ids.end());
  return ids;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<std::string_view> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_kind.size() || impl_->id_kind[id] == 0)
    return std::nullopt;
  return std::string_view(impl_->id_to_tok[id]);
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->id_kind.size());
}
bool Tokenizer::is_special(int32_t id) const {
  return impl_->is_special(id);
}
const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added;
}
std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->bos;
}
std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->eos;
}
std::optional<bool> Tokenizer::add_bos_token() const {
  return impl_->add_bos;
}
std::optional<bool> Tokenizer::add_eos_token() const {
  return impl_->add_eos;
}
const std::string& Tokenizer::chat_template() const {
  return impl_->chat_template;
}
const std::string& Tokenizer::chat_template_source() const {
  return impl_->chat_template_source;
}
const std::vector<int32_t>& Tokenizer::special_prefix_ids() const {
  return impl_->prefix_ids;
}
const std::vector<int32_t>& Tokenizer::special_suffix_ids() const {
  return impl_->suffix_ids;
}
const std::string& Tokenizer::source() const {
  return impl_->source;
}

}  // namespace spade

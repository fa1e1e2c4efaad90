// The BPE model (initial symbols, byte fallback / unk, merging in rank order, the word cache) and added-token
// matching (the Trie, and the library's AddedVocabulary split with lstrip / rstrip / single_word).
#include <algorithm>
#include <functional>
#include <mutex>
#include <queue>

#include "common/tokenizer.h"
#include "common/tokenizer_impl.h"
#include "common/tokenizer_utf8.h"

namespace spade {

using tokenizer_detail::decode_at;
using tokenizer_detail::is_white_space;
using tokenizer_detail::MergeInfo;
using tokenizer_detail::prev_char_start;
using tokenizer_detail::Trie;
using tokenizer_detail::utf8_char_len;

// ================================================================================================
// BPE
// ================================================================================================

void Tokenizer::Impl::bpe_word(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t mark = out.size();
  bpe_merge(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (cache.size() < kCacheCapacity)
      cache.emplace(word, std::vector<int32_t>(out.begin() + mark, out.end()));
  }
}

void Tokenizer::Impl::bpe_merge(const std::string& word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  auto add = [&](int32_t id) {
    const int32_t i = static_cast<int32_t>(sym.size());
    sym.push_back({id, i - 1, i + 1, true});
  };

  // Initial symbols: one per character (with the subword prefix / word suffix if configured); unknown
  // characters go to byte fallback, else to unk (fused if fuse_unk), else are dropped (the library's
  // merge_word).
  int32_t pending_unk = -1;  // an unk symbol not yet added (fuse_unk extends it)
  std::string buf;
  for (size_t i = 0; i < word.size();) {
    const size_t len = utf8_char_len(static_cast<unsigned char>(word[i]));
    const bool first = i == 0, last = i + len >= word.size();
    std::string_view ch(word.data() + i, len);
    std::string_view key = ch;
    if ((!first && cont_prefix) || (last && eow_suffix)) {
      buf.clear();
      if (!first && cont_prefix) buf += *cont_prefix;
      buf += ch;
      if (last && eow_suffix) buf += *eow_suffix;
      key = buf;
    }
    auto it = vocab.find(key);
    if (it != vocab.end()) {
      if (pending_unk >= 0) {
        add(pending_unk);
        pending_unk = -1;
      }
      add(it->second);
    } else {
      bool done = false;
      if (byte_fallback) {
        bool all = true;
        for (unsigned char c : key) all = all && byte_ids[c] >= 0;
        if (all) {
          if (pending_unk >= 0) {
            add(pending_unk);
            pending_unk = -1;
          }
          for (unsigned char c : key) add(byte_ids[c]);
          done = true;
        }
      }
      if (!done && unk_id) {
        if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
        pending_unk = *unk_id;
      }
    }
    i += len;
  }
  if (pending_unk >= 0) add(pending_unk);
  if (sym.empty()) return;
  sym.back().next = -1;

  if (sym.size() > 1 && !merges.empty()) {
    struct Cand {
      uint32_t rank;
      int32_t pos;
      int32_t new_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    auto lookup = [&](int32_t a, int32_t b) -> const MergeInfo* {
      auto it =
          merges.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b));
      return it == merges.end() ? nullptr : &it->second;
    };
    std::vector<Cand> heap_storage;
    heap_storage.reserve(sym.size());
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue(std::greater<Cand>(),
                                                                           std::move(heap_storage));
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      if (const MergeInfo* m = lookup(sym[i].id, sym[i + 1].id)) {
        queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
      }
    }
    while (!queue.empty()) {
      const Cand top = queue.top();
      queue.pop();
      Symbol& s = sym[top.pos];
      if (!s.alive || s.next < 0) continue;
      Symbol& right = sym[s.next];
      const MergeInfo* m = lookup(s.id, right.id);
      if (m == nullptr || m->new_id != top.new_id) continue;  // stale entry
      s.id = top.new_id;
      right.alive = false;
      s.next = right.next;
      if (s.next >= 0) sym[s.next].prev = top.pos;
      if (s.prev >= 0) {
        if (const MergeInfo* mp = lookup(sym[s.prev].id, s.id)) queue.push({mp->rank, s.prev, mp->new_id});
      }
      if (s.next >= 0) {
        if (const MergeInfo* mn = lookup(s.id, sym[s.next].id)) queue.push({mn->rank, top.pos, mn->new_id});
      }
    }
  }
  for (const Symbol& s : sym) {
    if (s.alive) out.push_back(s.id);
  }
}

void Tokenizer::Impl::encode_model_segment(std::string_view s, std::vector<int32_t>& ids) const {
  std::vector<std::string> words;
  pre_tokenize(s, words);
  for (const std::string& w : words) bpe_word(w, ids);
}

// ================================================================================================
// Added tokens
// ================================================================================================

void tokenizer_detail::Trie::insert(std::string_view s, int32_t value) {
  int32_t node = 0;
  for (unsigned char c : s) {
    int32_t next = child(node, c);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_[node].next.emplace_back(c, next);
      nodes_.emplace_back();
    }
    node = next;
  }
  nodes_[node].value = value;
  first_[static_cast<unsigned char>(s[0])] = true;
  empty_ = false;
}

void tokenizer_detail::Trie::find_all(std::string_view text, std::vector<Match>& out) const {
  out.clear();
  if (empty_) return;
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    int32_t node = 0;
    size_t best_end = 0;
    int32_t best = -1;
    for (size_t i = pos; i < text.size(); ++i) {
      node = child(node, static_cast<unsigned char>(text[i]));
      if (node < 0) break;
      if (nodes_[node].value >= 0) {
        best = nodes_[node].value;
        best_end = i + 1;
      }
    }
    if (best >= 0) {
      out.push_back({pos, best_end, best});
      pos = best_end;
    } else {
      ++pos;
    }
  }
}

void Tokenizer::Impl::split_added(std::string_view s, const Trie& trie,
                                  std::vector<std::tuple<size_t, size_t, int32_t>>& out) const {
  out.clear();
  std::vector<Trie::Match> matches;
  trie.find_all(s, matches);
  size_t start_offset = 0;
  for (const Trie::Match& mt : matches) {
    const AddedToken& tok = added[mt.value];
    size_t start = mt.start, stop = mt.end;
    if (tok.single_word) {
      const bool start_ok = start == 0 || !word_char->matches_at(s, prev_char_start(s, start));
      const bool stop_ok = stop == s.size() || !word_char->matches_at(s, stop);
      if (!start_ok || !stop_ok) continue;
    }
    if (tok.lstrip) {
      size_t b = start;
      while (b > 0) {
        const size_t p = prev_char_start(s, b);
        if (!is_white_space(decode_at(s, p))) break;
        b = p;
      }
      start = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      while (stop < s.size() && is_white_space(decode_at(s, stop))) {
        stop += utf8_char_len(static_cast<unsigned char>(s[stop]));
      }
    }
    start = std::max(start, start_offset);  // an earlier rstrip may have swallowed part of this match
    if (start_offset < start) out.emplace_back(start_offset, start, -1);
    out.emplace_back(start, stop, mt.value);
    start_offset = stop;
  }
  if (start_offset < s.size()) out.emplace_back(start_offset, s.size(), -1);
}

}  // namespace spade

#include "pair/pack.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/error.h"

namespace spade::pair {
namespace {

constexpr uint32_t kUpdateMagic = 0x57504b53;     // "SKPW" (v3: retained prefixes)
constexpr uint32_t kUpdateMagicV2 = 0x56504b53;   // "SKPV" (v2: flags word, shared INIT; refused by name)
constexpr uint32_t kUpdateMagicV1 = 0x55504b53;   // "SKPU" (v1: refused by name)
constexpr uint32_t kSeqInit = 1u, kSeqShared = 2u;  // SeqUpdate flags word
constexpr uint32_t kSelectionMagic = 0x54504b53;  // "SKPT" (v2: flags word, delta layers)

class Writer {
 public:
  // Appends each value's bytes, in order.
  template <typename... T>
  void put(T... xs) {
    static_assert((std::is_trivially_copyable_v<T> && ...));
    (append(&xs, sizeof(T)), ...);
  }
  // Appends each vector's elements, in order (no length prefix: the reader knows the counts).
  template <typename... T>
  void put_vec(const std::vector<T>&... vs) {
    (append(vs.data(), vs.size() * sizeof(T)), ...);
  }
  // Every pack message opens with its magic, its step and its pack index.
  template <typename Message>
  void head(uint32_t magic, const Message& m) {
    put(magic);
    put(m.step);
    put(m.pack);
  }
  std::vector<uint8_t> buf;

 private:
  void append(const void* data, size_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    buf.insert(buf.end(), p, p + bytes);
  }
};

class Reader {
 public:
  Reader(const uint8_t* d, size_t n, const std::string& peer, const char* what) : d_(d), n_(n), peer_(peer), what_(what) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T x;
    std::memcpy(&x, d_ + off_, sizeof(T));
    off_ += sizeof(T);
    return x;
  }
  template <typename T>
  void get_vec(std::vector<T>& v, size_t count) {
    need(count * sizeof(T));
    v.resize(count);
    std::memcpy(v.data(), d_ + off_, count * sizeof(T));
    off_ += count * sizeof(T);
  }
  void need(size_t bytes) {
    if (bytes > n_ - off_)
      fail("{}: malformed {} ({} bytes): needs {} more bytes at offset {}", peer_, what_, n_, bytes, off_);
  }
  void done() {
    if (off_ != n_) fail("{}: malformed {}: {} trailing bytes", peer_, what_, n_ - off_);
  }
  size_t remaining() const { return n_ - off_; }
  // The opening Writer::head wrote, as a fresh message; a wrong magic is an error naming the peer.
  template <typename Message>
  Message head(uint32_t magic) {
    if (get<uint32_t>() != magic) fail("{}: malformed {}: bad magic", peer_, what_);
    Message m;
    m.step = get<decltype(m.step)>();
    m.pack = get<decltype(m.pack)>();
    return m;
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t off_ = 0;
  const std::string& peer_;
  const char* what_;
};

void check_count(int64_t v, int64_t max, const std::string& peer, const char* field) {
  if (v < 0 || v > max) fail("{}: malformed pack message: {} = {} outside 0..{}", peer, field, v, max);
}

// A count of entries of entry_bytes each, checked to fit in what is left of the message.
size_t fitting_count(const Reader& r, uint32_t n, size_t entry_bytes, const std::string& peer, const char* field) {
  check_count(n, static_cast<int64_t>(r.remaining() / entry_bytes), peer, field);
  return n;
}

}  // namespace

PackShape pack_shape(const ModelConfig& cfg, const SelectionConfig& sc) {
  return {cfg.q_dim(), cfg.kv_dim(), cfg.num_kv_heads, cfg.head_dim, sc.token_budget};
}

std::vector<uint8_t> encode(const PackUpdate& u, const PackShape& s) {
  Writer w;
  w.head(kUpdateMagic, u);
  w.put(u.first_layer, u.num_layers, static_cast<uint32_t>(u.released.size()), static_cast<uint32_t>(u.retained.size()),
        static_cast<uint32_t>(u.dropped.size()), static_cast<uint32_t>(u.seqs.size()));
  w.put_vec(u.released);
  for (const Retain& r : u.retained) {
    SPADE_CHECK(r.tokens >= 1, "encode: retained prefix of sequence {} with {} tokens", r.seq_id, r.tokens);
    w.put(r.seq_id, r.tokens, int32_t{0});
  }
  w.put_vec(u.dropped);
  for (const SeqUpdate& e : u.seqs) {
    const size_t tokens = static_cast<size_t>(e.kv_tokens());
    SPADE_CHECK(e.q.size() == static_cast<size_t>(u.num_layers) * e.num_queries * s.q_dim &&
                    e.k.size() == static_cast<size_t>(u.num_layers) * tokens * s.kv_dim && e.v.size() == e.k.size(),
                "encode: sequence {} update has inconsistent tensor sizes", e.seq_id);
    SPADE_CHECK(e.shared_tokens == 0 || e.init, "encode: sequence {} shares tokens on an APPEND", e.seq_id);
    const uint32_t flags = (e.init ? kSeqInit : 0u) | (e.shared_tokens > 0 ? kSeqShared : 0u);
    w.put(e.seq_id, e.context_len, flags, e.num_queries, e.token_budget);
    if (e.shared_tokens > 0) w.put(e.shared_tokens, int32_t{0}, e.shared_from);
    w.put_vec(e.q, e.k, e.v);
  }
  return std::move(w.buf);
}

PackUpdate decode_update(const uint8_t* data, size_t len, const PackShape& s, const std::string& peer) {
  Reader r(data, len, peer, "pack update");
  if (len >= 4) {
    uint32_t magic = 0;
    std::memcpy(&magic, data, 4);
    if (magic == kUpdateMagicV1 || magic == kUpdateMagicV2)
      fail("{}: pack update of wire format {}; this rank speaks v3 (\"SKPW\"): run the same build on both ranks", peer,
           magic == kUpdateMagicV1 ? "v1 (\"SKPU\")" : "v2 (\"SKPV\")");
  }
  auto u = r.head<PackUpdate>(kUpdateMagic);
  u.first_layer = r.get<int32_t>();
  u.num_layers = r.get<int32_t>();
  check_count(u.num_layers, 4096, peer, "num_layers");
  const uint32_t nrel = r.get<uint32_t>();
  const uint32_t nret = r.get<uint32_t>();
  const uint32_t ndrop = r.get<uint32_t>();
  const uint32_t nseq = r.get<uint32_t>();
  r.get_vec(u.released, fitting_count(r, nrel, 8, peer, "released count"));
  u.retained.resize(fitting_count(r, nret, 16, peer, "retained count"));
  for (Retain& e : u.retained) {
    e.seq_id = r.get<uint64_t>();
    e.tokens = r.get<int32_t>();
    const int32_t pad = r.get<int32_t>();
    if (e.tokens < 1 || pad != 0)
      fail("{}: malformed pack update: retained prefix of sequence {} has retained tokens = {} (>= 1 needed)", peer,
           e.seq_id, e.tokens);
  }
  r.get_vec(u.dropped, fitting_count(r, ndrop, 8, peer, "dropped count"));
  u.seqs.resize(fitting_count(r, nseq, 24, peer, "sequence count"));
  for (SeqUpdate& e : u.seqs) {
    e.seq_id = r.get<uint64_t>();
    e.context_len = r.get<int32_t>();
    const uint32_t flags = r.get<uint32_t>();
    e.num_queries = r.get<int32_t>();
    e.token_budget = r.get<int32_t>();
    if ((flags & ~(kSeqInit | kSeqShared)) != 0)
      fail("{}: malformed pack update: sequence {} has unknown flags {:#x}", peer, e.seq_id, flags);
    e.init = (flags & kSeqInit) != 0;
    check_count(e.context_len, 1 << 30, peer, "context_len");
    check_count(e.token_budget, s.token_budget, peer, "token_budget");
    check_count(e.num_queries, 64, peer, "num_queries");
    if ((flags & kSeqShared) != 0) {
      e.shared_tokens = r.get<int32_t>();
      const int32_t pad = r.get<int32_t>();
      e.shared_from = r.get<uint64_t>();
      if (!e.init)
        fail("{}: malformed pack update: sequence {} shares KV of sequence {} on an APPEND (only an INIT may)", peer,
             e.seq_id, e.shared_from);
      if (e.shared_tokens < 1 || e.shared_tokens >= e.context_len || pad != 0 || e.shared_from == e.seq_id)
        fail("{}: malformed pack update: sequence {} (context {}) shares {} tokens of sequence {}", peer, e.seq_id,
             e.context_len, e.shared_tokens, e.shared_from);
    }
    const size_t tokens = static_cast<size_t>(e.kv_tokens());
    const size_t nq = static_cast<size_t>(u.num_layers) * e.num_queries * s.q_dim;
    const size_t nkv = static_cast<size_t>(u.num_layers) * tokens * s.kv_dim;
    r.need((nq + 2 * nkv) * sizeof(float));
    r.get_vec(e.q, nq);
    r.get_vec(e.k, nkv);
    r.get_vec(e.v, nkv);
  }
  r.done();
  return u;
}

std::vector<uint8_t> encode(const PackSelection& p, const PackShape& s) {
  Writer w;
  w.head(kSelectionMagic, p);
  w.put(p.select_ms, static_cast<uint32_t>(p.delta ? 1 : 0) /* flags: bit 0 = delta */,
        static_cast<uint32_t>(p.error.size()));
  w.buf.insert(w.buf.end(), p.error.begin(), p.error.end());
  w.put(static_cast<uint32_t>(p.seqs.size()));
  for (const SeqSelection& e : p.seqs) {
    w.put(e.seq_id, e.context_len);
    if (p.delta) {
      // Per layer: count, entries per head, then slot and position of every entry, then its K and V rows.
      w.put(static_cast<uint32_t>(e.deltas.size()));
      for (const LayerDelta& d : e.deltas) {
        SPADE_CHECK(d.changed.size() == static_cast<size_t>(s.num_kv_heads) && d.k.size() == d.entries() * s.head_dim,
                    "encode: delta of sequence {} does not match the pack shape", e.seq_id);
        w.put(static_cast<int32_t>(d.count));
        w.put_vec(d.changed, d.slots, d.positions, d.k, d.v);
      }
      continue;
    }
    w.put(static_cast<uint32_t>(e.layers.size()));
    for (const LayerSelection& l : e.layers) {
      w.put(static_cast<int32_t>(l.count));
      // Only the `count` valid rows of each head travel.
      for (int h = 0; h < s.num_kv_heads; ++h) {
        const size_t base = static_cast<size_t>(h) * s.token_budget;
        const auto* pos = reinterpret_cast<const uint8_t*>(l.positions.data() + base);
        w.buf.insert(w.buf.end(), pos, pos + l.count * sizeof(int32_t));
        const auto* kk = reinterpret_cast<const uint8_t*>(l.k.data() + base * s.head_dim);
        w.buf.insert(w.buf.end(), kk, kk + static_cast<size_t>(l.count) * s.head_dim * sizeof(float));
        const auto* vv = reinterpret_cast<const uint8_t*>(l.v.data() + base * s.head_dim);
        w.buf.insert(w.buf.end(), vv, vv + static_cast<size_t>(l.count) * s.head_dim * sizeof(float));
      }
    }
  }
  return std::move(w.buf);
}

PackSelection decode_selection(const uint8_t* data, size_t len, const PackShape& s, const std::string& peer) {
  Reader r(data, len, peer, "pack selection");
  auto p = r.head<PackSelection>(kSelectionMagic);
  p.select_ms = r.get<double>();
  const uint32_t flags = r.get<uint32_t>();
  if ((flags & ~1u) != 0) fail("{}: malformed pack selection: unknown flags {:#x}", peer, flags);
  p.delta = (flags & 1u) != 0;
  const uint32_t elen = r.get<uint32_t>();
  std::vector<char> err;
  r.get_vec(err, fitting_count(r, elen, 1, peer, "error length"));
  p.error.assign(err.begin(), err.end());
  const uint32_t nseq = r.get<uint32_t>();
  p.seqs.resize(fitting_count(r, nseq, 16, peer, "sequence count"));
  std::vector<int32_t> pos;
  std::vector<float> rows;
  for (SeqSelection& e : p.seqs) {
    e.seq_id = r.get<uint64_t>();
    e.context_len = r.get<int32_t>();
    const uint32_t nl = r.get<uint32_t>();
    check_count(nl, 4096, peer, "num_layers");
    if (p.delta) {
      e.deltas.resize(nl);
      for (LayerDelta& d : e.deltas) {
        d.count = r.get<int32_t>();
        check_count(d.count, s.token_budget, peer, "delta count");
        r.get_vec(d.changed, s.num_kv_heads);
        size_t total = 0;
        for (int32_t c : d.changed) {
          check_count(c, d.count, peer, "delta entries of a head");
          total += static_cast<size_t>(c);
        }
        check_count(static_cast<int64_t>(total), static_cast<int64_t>(r.remaining() / 8), peer, "delta entries");
        r.get_vec(d.slots, total);
        r.get_vec(d.positions, total);
        r.get_vec(d.k, total * s.head_dim);
        r.get_vec(d.v, total * s.head_dim);
      }
      continue;
    }
    e.layers.resize(nl);
    for (LayerSelection& l : e.layers) {
      l.count = r.get<int32_t>();
      check_count(l.count, s.token_budget, peer, "count");
      l.positions.assign(static_cast<size_t>(s.num_kv_heads) * s.token_budget, -1);
      l.k.assign(static_cast<size_t>(s.num_kv_heads) * s.token_budget * s.head_dim, 0.f);
      l.v.assign(l.k.size(), 0.f);
      for (int h = 0; h < s.num_kv_heads; ++h) {
        const size_t base = static_cast<size_t>(h) * s.token_budget;
        r.get_vec(pos, l.count);
        std::memcpy(l.positions.data() + base, pos.data(), pos.size() * sizeof(int32_t));
        r.get_vec(rows, static_cast<size_t>(l.count) * s.head_dim);
        std::memcpy(l.k.data() + base * s.head_dim, rows.data(), rows.size() * sizeof(float));
        r.get_vec(rows, static_cast<size_t>(l.count) * s.head_dim);
        std::memcpy(l.v.data() + base * s.head_dim, rows.data(), rows.size() * sizeof(float));
      }
    }
  }
  r.done();
  return p;
}

}  // namespace spade::pair

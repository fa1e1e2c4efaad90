#include "cache_rank/pack.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <type_traits>

#include "common/error.h"

namespace spade::cache {
namespace {

constexpr uint32_t kUpdateMagic = 0x55504b53;     // "SKPU"
constexpr uint32_t kSelectionMagic = 0x54504b53;  // "SKPT" (v2: flags word, delta layers)

class Writer {
 public:
  template <typename T>
  void put(T x) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&x);
    buf.insert(buf.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    buf.insert(buf.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<uint8_t> buf;
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

}  // namespace

PackShape pack_shape(const ModelConfig& cfg, const SelectionConfig& sc) {
  return {cfg.q_dim(), cfg.kv_dim(), cfg.num_kv_heads, cfg.head_dim, sc.token_budget};
}

std::vector<uint8_t> encode(const PackUpdate& u, const PackShape& s) {
  Writer w;
  w.put(kUpdateMagic);
  w.put(u.step);
  w.put(u.pack);
  w.put(u.first_layer);
  w.put(u.num_layers);
  w.put(static_cast<uint32_t>(u.released.size()));
  w.put(static_cast<uint32_t>(u.seqs.size()));
  w.put_vec(u.released);
  for (const SeqUpdate& e : u.seqs) {
    const size_t tokens = e.init ? e.context_len : 1;
    SPADE_CHECK(e.q.size() == static_cast<size_t>(u.num_layers) * e.num_queries * s.q_dim &&
                    e.k.size() == static_cast<size_t>(u.num_layers) * tokens * s.kv_dim && e.v.size() == e.k.size(),
                "encode: sequence {} update has inconsistent tensor sizes", e.seq_id);
    w.put(e.seq_id);
    w.put(e.context_len);
    w.put(static_cast<int32_t>(e.init));
    w.put(e.num_queries);
    w.put(e.token_budget);
    w.put_vec(e.q);
    w.put_vec(e.k);
    w.put_vec(e.v);
  }
  return std::move(w.buf);
}

PackUpdate decode_update(const uint8_t* data, size_t len, const PackShape& s, const std::string& peer) {
  Reader r(data, len, peer, "pack update");
  if (r.get<uint32_t>() != kUpdateMagic) fail("{}: malformed pack update: bad magic", peer);
  PackUpdate u;
  u.step = r.get<int64_t>();
  u.pack = r.get<int32_t>();
  u.first_layer = r.get<int32_t>();
  u.num_layers = r.get<int32_t>();
  check_count(u.num_layers, 4096, peer, "num_layers");
  const uint32_t nrel = r.get<uint32_t>();
  const uint32_t nseq = r.get<uint32_t>();
  check_count(nrel, static_cast<int64_t>(r.remaining() / 8), peer, "released count");
  r.get_vec(u.released, nrel);
  check_count(nseq, static_cast<int64_t>(r.remaining() / 20), peer, "sequence count");
  u.seqs.resize(nseq);
  for (SeqUpdate& e : u.seqs) {
    e.seq_id = r.get<uint64_t>();
    e.context_len = r.get<int32_t>();
    e.init = r.get<int32_t>() != 0;
    e.num_queries = r.get<int32_t>();
    e.token_budget = r.get<int32_t>();
    check_count(e.context_len, 1 << 30, peer, "context_len");
    check_count(e.token_budget, s.token_budget, peer, "token_budget");
    check_count(e.num_queries, 64, peer, "num_queries");
    const size_t tokens = e.init ? e.context_len : 1;
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
  w.put(kSelectionMagic);
  w.put(p.step);
  w.put(p.pack);
  w.put(p.select_ms);
  w.put(static_cast<uint32_t>(p.delta ? 1 : 0));  // flags: bit 0 = delta
  w.put(static_cast<uint32_t>(p.error.size()));
  w.buf.insert(w.buf.end(), p.error.begin(), p.error.end());
  w.put(static_cast<uint32_t>(p.seqs.size()));
  for (const SeqSelection& e : p.seqs) {
    w.put(e.seq_id);
    w.put(e.context_len);
    if (p.delta) {
      // Per layer: count, entries per head, then slot and position of every entry, then its K and V rows.
      w.put(static_cast<uint32_t>(e.deltas.size()));
      for (const LayerDelta& d : e.deltas) {
        SPADE_CHECK(d.changed.size() == static_cast<size_t>(s.num_kv_heads) && d.k.size() == d.entries() * s.head_dim,
                    "encode: delta of sequence {} does not match the pack shape", e.seq_id);
        w.put(static_cast<int32_t>(d.count));
        w.put_vec(d.changed);
        w.put_vec(d.slots);
        w.put_vec(d.positions);
        w.put_vec(d.k);
        w.put_vec(d.v);
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
  if (r.get<uint32_t>() != kSelectionMagic) fail("{}: malformed pack selection: bad magic", peer);
  PackSelection p;
  p.step = r.get<int64_t>();
  p.pack = r.get<int32_t>();
  p.select_ms = r.get<double>();
  const uint32_t flags = r.get<uint32_t>();
  if ((flags & ~1u) != 0) fail("{}: malformed pack selection: unknown flags {:#x}", peer, flags);
  p.delta = (flags & 1u) != 0;
  const uint32_t elen = r.get<uint32_t>();
  check_count(elen, static_cast<int64_t>(r.remaining()), peer, "error length");
  std::vector<char> err;
  r.get_vec(err, elen);
  p.error.assign(err.begin(), err.end());
  const uint32_t nseq = r.get<uint32_t>();
  check_count(nseq, static_cast<int64_t>(r.remaining() / 16), peer, "sequence count");
  p.seqs.resize(nseq);
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

namespace {

// |a ∩ b| for two ascending position rows of `budget` entries, each valid up to its first -1 (or `nb` for b).
int common_positions(const int32_t* a, const int32_t* b, int budget, int nb) {
  const int na = static_cast<int>(std::find(a, a + budget, -1) - a);
  int i = 0, j = 0, common = 0;
  while (i < na && j < nb) {
    if (a[i] == b[j]) {
      ++common, ++i, ++j;
    } else if (a[i] < b[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return common;
}

// |a ∩ b| / |b| per KV head (the first `count` entries of each head's row are valid), averaged over heads.
double overlap_ratio(const std::vector<int32_t>& pred, const LayerSelection& oracle, int heads, int budget) {
  if (oracle.count == 0) return 1.0;
  double sum = 0;
  for (int h = 0; h < heads; ++h) {
    const size_t base = static_cast<size_t>(h) * budget;
    sum += static_cast<double>(common_positions(pred.data() + base, oracle.positions.data() + base, budget,
                                                oracle.count)) /
           oracle.count;
  }
  return sum / heads;
}

}  // namespace

OverlapSampler::OverlapSampler(int every) : every_(every) {
  SPADE_CHECK(every >= 1, "overlap sampling period must be >= 1 step, got {}", every);
}

void OverlapSampler::record(int layer, const std::vector<int32_t>& pred, const LayerSelection& oracle, int budget) {
  const int heads = static_cast<int>(oracle.positions.size() / budget);
  if (head_stats_.size() <= static_cast<size_t>(layer)) head_stats_.resize(static_cast<size_t>(layer) + 1);
  head_stats_[layer].resize(heads);
  if (oracle.count == 0) return;
  for (int h = 0; h < heads; ++h) {
    const size_t base = static_cast<size_t>(h) * budget;
    head_stats_[layer][h].overlap_sum +=
        static_cast<double>(common_positions(pred.data() + base, oracle.positions.data() + base, budget,
                                             oracle.count)) /
        oracle.count;
    ++head_stats_[layer][h].overlap_n;
  }
}

void OverlapSampler::record_churn(uint64_t seq, int layer, const LayerSelection& now, int budget) {
  auto& per_layer = previous_[seq];
  if (per_layer.size() <= static_cast<size_t>(layer)) per_layer.resize(static_cast<size_t>(layer) + 1);
  std::vector<int32_t>& prev = per_layer[layer];
  const int heads = static_cast<int>(now.positions.size() / budget);
  if (!prev.empty() && now.count > 0) {
    if (head_stats_.size() <= static_cast<size_t>(layer)) head_stats_.resize(static_cast<size_t>(layer) + 1);
    head_stats_[layer].resize(heads);
    for (int h = 0; h < heads; ++h) {
      const size_t base = static_cast<size_t>(h) * budget;
      const int kept = common_positions(prev.data() + base, now.positions.data() + base, budget, now.count);
      head_stats_[layer][h].churn_sum += 1.0 - static_cast<double>(kept) / now.count;
      ++head_stats_[layer][h].churn_n;
    }
  }
  prev = now.positions;
}

std::vector<double> OverlapSampler::take() {
  std::vector<double> r;
  r.swap(ratios_);
  return r;
}


PackSelection process_pack(Selector& sel, const PackUpdate& u, OverlapSampler* sampler) {
  const auto t0 = std::chrono::steady_clock::now();
  PackSelection out;
  out.step = u.step;
  out.pack = u.pack;
  try {
    for (uint64_t id : u.released) {
      sel.release(id);
      if (sampler) sampler->predicted_.erase(id), sampler->predicted_len_.erase(id), sampler->previous_.erase(id);
    }
    for (const SeqUpdate& e : u.seqs) {
      SeqSelection ss;
      ss.seq_id = e.seq_id;
      ss.context_len = e.context_len + 1;
      ss.layers.resize(u.num_layers);
      for (int i = 0; i < u.num_layers; ++i) {
        const int layer = u.first_layer + i;
        const size_t qd = e.q.size() / (static_cast<size_t>(u.num_layers) * std::max(1, e.num_queries));
        const size_t tokens = e.init ? e.context_len : 1;
        const size_t kvd = e.k.size() / (static_cast<size_t>(u.num_layers) * tokens);
        const float* q = e.q.data() + static_cast<size_t>(i) * e.num_queries * qd;
        const float* k = e.k.data() + static_cast<size_t>(i) * tokens * kvd;
        const float* v = e.v.data() + static_cast<size_t>(i) * tokens * kvd;
        if (e.init) {
          sel.init_layer(e.seq_id, layer, e.context_len, k, v, e.num_queries, q);
        } else {
          sel.append_layer(e.seq_id, layer, e.context_len - 1, q, k, v);
        }
        if (sampler && !e.init) {  // compare the prediction made for this step with the true query's top-k
          auto it = sampler->predicted_.find(e.seq_id);
          auto lt = sampler->predicted_len_.find(e.seq_id);
          // The prediction of THIS layer must be for this step (each layer keeps its own context length: the other
          // layers of the update, and the other packs, have already been predicted one step further).
          if (it != sampler->predicted_.end() && lt != sampler->predicted_len_.end() &&
              static_cast<size_t>(layer) < it->second.size() && static_cast<size_t>(layer) < lt->second.size() &&
              lt->second[layer] == e.context_len && !it->second[layer].empty()) {
            const auto& cfg = sel.config();
            sel.select(e.seq_id, layer, e.context_len, q, sampler->scratch_, e.token_budget);
            const int heads = static_cast<int>(sampler->scratch_.positions.size() / cfg.token_budget);
            sampler->ratios_.push_back(overlap_ratio(it->second[layer], sampler->scratch_, heads, cfg.token_budget));
            sampler->record(layer, it->second[layer], sampler->scratch_, cfg.token_budget);
            it->second[layer].clear();
          }
        }
        sel.select(e.seq_id, layer, ss.context_len, nullptr, ss.layers[i], e.token_budget);
        if (sampler && u.step % sampler->every_ == 0) {
          auto& per_layer = sampler->predicted_[e.seq_id];
          if (per_layer.size() <= static_cast<size_t>(layer)) per_layer.resize(static_cast<size_t>(layer) + 1);
          per_layer[layer] = ss.layers[i].positions;
          auto& lens = sampler->predicted_len_[e.seq_id];
          if (lens.size() <= static_cast<size_t>(layer)) lens.resize(static_cast<size_t>(layer) + 1, -1);
          lens[layer] = ss.context_len;
          if (sampler->every_ == 1) sampler->record_churn(e.seq_id, layer, ss.layers[i], sel.config().token_budget);
        }
      }
      out.seqs.push_back(std::move(ss));
    }
  } catch (const Error& err) {
    out.error = err.what();
    out.seqs.clear();
  }
  out.select_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace spade::cache

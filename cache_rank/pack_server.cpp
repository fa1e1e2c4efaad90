#include "cache_rank/pack_server.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>

#include "cache_rank/selection_overlap.h"
#include "common/error.h"
#include "pair/link.h"

namespace spade::cache {

using pair::FramePrefix;
using pair::LayerSelection;
using pair::SeqSelection;
using pair::SeqUpdate;
using transport::Status;

namespace {

// Valid entries of a row of `budget` positions: those before its first -1.
int row_count(const int32_t* row, int budget) { return static_cast<int>(std::find(row, row + budget, -1) - row); }

// |pred_h ∩ oracle_h| / |oracle_h| per KV head (the first `count` entries of each head's row are valid), averaged over
// heads.
double overlap_ratio(const std::vector<int32_t>& pred, const LayerSelection& oracle, int heads, int budget) {
  if (oracle.count == 0) return 1.0;
  double sum = 0;
  for (int h = 0; h < heads; ++h) {
    const size_t base = static_cast<size_t>(h) * budget;
    sum += static_cast<double>(common_positions(pred.data() + base, row_count(pred.data() + base, budget),
                                                oracle.positions.data() + base, oracle.count)) /
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
        static_cast<double>(common_positions(pred.data() + base, row_count(pred.data() + base, budget),
                                             oracle.positions.data() + base, oracle.count)) /
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
      const int kept =
          common_positions(prev.data() + base, row_count(prev.data() + base, budget), now.positions.data() + base,
                           now.count);
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
    // Released sequences are freed, or kept as retained prefixes (u.retained); then retained prefixes are shortened
    // or dropped, before any INIT of this update may share from one.
    std::unordered_map<uint64_t, int32_t> keep;
    for (const pair::Retain& r : u.retained)
      if (!keep.emplace(r.seq_id, r.tokens).second)
        fail("cache rank: retained prefix of sequence {} listed twice in one update", r.seq_id);
    for (uint64_t id : u.released) {
      if (auto k = keep.find(id); k != keep.end()) {
        SPADE_CHECK(sel.tracks(id) && !sel.is_retained(id),
                    "cache rank: retained prefix of released sequence {}: {}", id,
                    sel.tracks(id) ? "it is a retained prefix already" : "this cache rank does not hold that sequence");
        sel.retain(id, k->second);
        keep.erase(k);
      } else {
        sel.release(id);
      }
      if (sampler) sampler->predicted_.erase(id), sampler->predicted_len_.erase(id), sampler->previous_.erase(id);
    }
    for (const pair::Retain& r : u.retained) {  // not released here: a retained prefix, shortened
      if (!keep.count(r.seq_id)) continue;
      SPADE_CHECK(sel.is_retained(r.seq_id),
                  "cache rank: retained prefix of sequence {}: {} (only a released sequence or a retained prefix may "
                  "be retained)", r.seq_id,
                  sel.tracks(r.seq_id) ? "it is a live sequence not released in this update"
                                       : "this cache rank does not hold that sequence");
      SPADE_CHECK(r.tokens <= sel.seq_len(r.seq_id),
                  "cache rank: retained prefix of sequence {}: retained tokens = {} beyond the {} it holds", r.seq_id,
                  r.tokens, sel.seq_len(r.seq_id));
      sel.retain(r.seq_id, r.tokens);
    }
    for (uint64_t id : u.dropped) sel.drop_retained(id);
    for (const SeqUpdate& e : u.seqs) {
      SeqSelection ss;
      ss.seq_id = e.seq_id;
      ss.context_len = e.context_len + 1;
      ss.layers.resize(u.num_layers);
      for (int i = 0; i < u.num_layers; ++i) {
        const int layer = u.first_layer + i;
        const size_t qd = e.q.size() / (static_cast<size_t>(u.num_layers) * std::max(1, e.num_queries));
        const size_t tokens = static_cast<size_t>(e.kv_tokens());
        const size_t kvd = e.k.size() / (static_cast<size_t>(u.num_layers) * tokens);
        const float* q = e.q.data() + static_cast<size_t>(i) * e.num_queries * qd;
        const float* k = e.k.data() + static_cast<size_t>(i) * tokens * kvd;
        const float* v = e.v.data() + static_cast<size_t>(i) * tokens * kvd;
        if (e.init) {
          sel.init_layer(e.seq_id, layer, e.context_len, k, v, e.num_queries, q, {e.shared_from, e.shared_tokens});
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

// ---- in-process ----

InProcessLink::InProcessLink(const ModelConfig& cfg, const SelectionConfig& sc, int num_pages, int page_size,
                             bool delta)
    : sel_(cfg, sc, num_pages, page_size),
      mirror_(delta ? std::make_unique<SelectionMirror>(cfg.num_kv_heads, sc.token_budget, cfg.head_dim) : nullptr) {}

void InProcessLink::send(PackUpdate&& u) {
  ++stats_.updates;
  done_.push_back(process_pack(sel_, u, sampler_));
  if (mirror_) mirror_->to_delta(u, done_.back());
  stats_.cache_select_ms += done_.back().select_ms;
}

PackSelection InProcessLink::receive(transport::Deadline, bool* waited) {
  SPADE_CHECK(!done_.empty(), "in-process cache rank: receive without a pending update");
  if (waited) *waited = false;
  PackSelection p = std::move(done_.front());
  done_.pop_front();
  if (!p.error.empty()) fail("in-process cache rank: {}", p.error);
  return p;
}

// ---- the cache rank's side ----

std::string serve_cache_rank(transport::Endpoint& ep, Selector& sel, const PackShape& shape,
                             const std::atomic<bool>& stop, LinkStats* stats, std::chrono::milliseconds poll,
                             const ServeHooks& hooks) {
  std::deque<std::pair<std::unique_ptr<std::pair<FramePrefix, std::vector<uint8_t>>>,
                       std::pair<transport::SendHandle, transport::SendHandle>>>
      out;
  auto reap = [&]() -> std::string {
    while (!out.empty()) {
      const Status a = out.front().second.first.poll(), b = out.front().second.second.poll();
      if (a == Status::PENDING || b == Status::PENDING) break;
      if (a == Status::FAILED) return out.front().second.first.error();
      if (b == Status::FAILED) return out.front().second.second.error();
      out.pop_front();
    }
    return "";
  };
  while (!stop.load()) {
    FramePrefix f;
    auto h = ep.post_recv(pair::link_up_prefix_tag(), &f, sizeof(f));
    Status s;
    while ((s = h.wait_for(poll)) == Status::TIMEOUT) {
      if (hooks.on_poll) hooks.on_poll();
      if (stop.load()) {
        h.cancel();
        return "";
      }
      if (std::string e = reap(); !e.empty()) return e;
    }
    if (s != Status::OK) return h.error();
    if (f.magic != FramePrefix::kMagic || (f.kind != 1 && f.kind != 3) || f.payload_bytes > (uint64_t{1} << 34))
      return fmt::format("{}: malformed frame prefix (magic {:#x}, kind {}, {} bytes)", ep.peer_name(), f.magic,
                         f.kind, f.payload_bytes);
    if (f.kind == 3) return "";
    std::vector<uint8_t> payload(f.payload_bytes);
    auto hp = ep.post_recv(pair::link_up_tag(), payload.data(), payload.size());
    while ((s = hp.wait_for(poll)) == Status::TIMEOUT)
      if (stop.load()) return "";
    if (s != Status::OK) return hp.error();
    PackSelection sel_out;
    PackUpdate u;
    try {
      u = decode_update(payload.data(), payload.size(), shape, ep.peer_name());
      sel_out = process_pack(sel, u, hooks.sampler);
      if (hooks.mirror) hooks.mirror->to_delta(u, sel_out);
    } catch (const Error& e) {
      sel_out.error = e.what();
    }
    auto msg = std::make_unique<std::pair<FramePrefix, std::vector<uint8_t>>>();
    msg->second = encode(sel_out, shape);
    if (hooks.on_poll) hooks.on_poll();
    if (hooks.on_pack) hooks.on_pack(u, sel_out, payload.size() + sizeof(FramePrefix),
                                     msg->second.size() + sizeof(FramePrefix));
    msg->first.kind = 2;
    msg->first.payload_bytes = msg->second.size();
    if (stats) {
      stats->bytes_received += payload.size();
      stats->bytes_sent += msg->second.size();
      ++stats->updates;
      stats->cache_select_ms += sel_out.select_ms;
    }
    auto s1 = ep.post_send(pair::link_down_prefix_tag(), &msg->first, sizeof(FramePrefix));
    auto s2 = ep.post_send(pair::link_down_tag(), msg->second.data(), msg->second.size());
    out.emplace_back(std::move(msg), std::make_pair(s1, s2));
    if (std::string e = reap(); !e.empty()) return e;
  }
  return "";
}

}  // namespace spade::cache

// The CPU cache rank's handling of layer packs (pair/pack.h): process_pack applies an update to a Selector and selects
// for the next step (AsyncSpade Algorithm 1, one step ahead); OverlapSampler measures the overlap ratio (Eq. 1) and the
// selection churn online; InProcessLink is a whole cache rank in the inference rank's process (tests, the fidelity
// tools, the oracle baseline); serve_cache_rank is a cache_rank process's loop for one inference rank over a
// transport (pair/link.h TransportLink is its other end).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_rank/selection_overlap.h"
#include "cache_rank/selector.h"
#include "pair/delta.h"
#include "pair/link.h"
#include "pair/pack.h"
#include "transport/transport.h"

namespace spade::cache {

using pair::CacheRankLink;
using pair::LinkStats;
using pair::PackSelection;
using pair::PackShape;
using pair::PackUpdate;
using pair::SelectionMirror;

/// Online measurement of the overlap ratio (AsyncSpade Eq. 1: |predicted top-k ∩ oracle top-k| / |oracle top-k|, per
/// KV head, averaged over the heads) while serving: on every `every`-th step the predicted selections of each
/// sequence in the update are remembered; on the sequence's next APPEND update, whose query is the true one the
/// prediction stood for, the oracle selection (top-k with that true query over the same candidates) is computed
/// and compared. One extra scoring pass per layer on sampled steps only (cost ~ 1/every of the selection time).
class OverlapSampler {
 public:
  /// `every` >= 1.
  explicit OverlapSampler(int every);
  int every() const { return every_; }
  /// Overlap ratios (0..1, one per sampled (sequence, layer)) measured since the last call.
  std::vector<double> take();

  /// Running sums per (layer, KV head) since construction: the overlap ratio of each sampled prediction, and the
  /// selection churn — the share of a sampled prediction's positions that were not in the same sequence and layer's
  /// prediction of the step before (which sizes the delta capacity). Churn is measured only with `every` == 1.
  using HeadStats = SelectionSampleStats;  // cache_rank/selection_overlap.h
  /// [layer][KV head]; empty until something was sampled.
  const std::vector<std::vector<HeadStats>>& head_stats() const { return head_stats_; }

 private:
  void record(int layer, const std::vector<int32_t>& pred, const LayerSelection& oracle, int budget);
  void record_churn(uint64_t seq, int layer, const LayerSelection& now, int budget);
  friend PackSelection process_pack(Selector& sel, const PackUpdate& u, OverlapSampler* sampler);
  int every_;
  std::unordered_map<uint64_t, std::vector<std::vector<int32_t>>> predicted_;  // seq -> per layer [heads*budget]
  std::unordered_map<uint64_t, std::vector<int32_t>> predicted_len_;  // seq -> per layer: context the prediction is for
  std::vector<double> ratios_;
  LayerSelection scratch_;
  std::vector<std::vector<HeadStats>> head_stats_;
  std::unordered_map<uint64_t, std::vector<std::vector<int32_t>>> previous_;  // seq -> per layer [heads*budget]
};

/// Applies an update to the selector (release or retain, shorten and drop retained prefixes: pair/pack.h; then INIT,
/// APPEND) and selects for the next step of every sequence in it. Errors (pool exhausted, inconsistent lengths, a
/// retain or drop of a sequence not held or of the wrong kind, retained tokens beyond those held) are returned in
/// PackSelection::error naming the sequence, never thrown.
/// `sampler` (optional) measures the overlap ratio on sampled steps.
PackSelection process_pack(Selector& sel, const PackUpdate& u, OverlapSampler* sampler = nullptr);

class InProcessLink : public CacheRankLink {
 public:
  /// `delta`: answer with deltas against the held selections (delta transfer, pair/delta.h), as a cache_rank
  /// process does by default.
  InProcessLink(const ModelConfig& cfg, const SelectionConfig& sc, int num_pages, int page_size, bool delta = false);
  void send(PackUpdate&& u) override;
  PackSelection receive(transport::Deadline deadline, bool* waited) override;
  size_t in_flight() const override { return done_.size(); }
  const LinkStats& stats() const override { return stats_; }
  std::string peer() const override { return "in-process cache rank"; }
  Selector& selector() { return sel_; }
  /// Online overlap / churn sampling of every answered update (pack.h OverlapSampler); not owned, nullptr = off.
  void set_sampler(OverlapSampler* s) { sampler_ = s; }
  /// The delta-transfer mirror, or null when `delta` was false.
  const SelectionMirror* mirror() const { return mirror_.get(); }

 private:
  Selector sel_;
  std::unique_ptr<SelectionMirror> mirror_;
  std::deque<PackSelection> done_;
  LinkStats stats_;
  OverlapSampler* sampler_ = nullptr;
};

/// The cache rank's loop for one inference rank: receive an update, process_pack, send the selection; until a
/// shutdown frame, `stop`, or a failure of the endpoint (returns its message; empty on a clean shutdown).
/// `poll` bounds how long one wait blocks before `stop` is checked again.
/// `sampler` (optional): online overlap-ratio sampling (pack.h). `on_pack` (optional): called after each answered
/// update with the selection and the payload bytes received / sent (metrics).
struct ServeHooks {
  OverlapSampler* sampler = nullptr;
  SelectionMirror* mirror = nullptr;  // delta transfer (pair/delta.h) when set; full selections otherwise
  std::function<void(const PackUpdate&, const PackSelection&, size_t bytes_in, size_t bytes_out)> on_pack;
  std::function<void()> on_poll;  // called at least every `poll` while serving (main-loop liveness)
};
std::string serve_cache_rank(transport::Endpoint& ep, Selector& sel, const PackShape& shape,
                             const std::atomic<bool>& stop, LinkStats* stats,
                             std::chrono::milliseconds poll = std::chrono::milliseconds(100),
                             const ServeHooks& hooks = {});

}  // namespace spade::cache

// Host bookkeeping of GPU sparse decoding (see sparse_planner.h).
#include "inference_rank/sparse_planner.h"

#include <algorithm>
#include <set>

#include "common/error.h"
#include "common/page_allocator.h"

namespace spade {

GpuSparseOptions gpu_sparse_options(const pair::SparseConfig& sparse, const EngineOptions& engine,
                                    std::string cache_name, int max_retained_prefix_tokens) {
  GpuSparseOptions o;
  o.sparse = sparse;
  o.max_slots = engine.max_num_seqs;
  o.max_sparse_seqs = engine.max_num_seqs;
  o.max_step_tokens = engine.max_num_batched_tokens;
  o.cache_name = std::move(cache_name);
  o.max_retained_prefix_tokens = engine.enable_prefix_caching ? max_retained_prefix_tokens : 0;
  return o;
}

pair::GpuPairHello make_gpu_pair_hello(const ModelConfig& attn_cfg, const GpuSparseOptions& o,
                                        const EngineOptions& engine) {
  pair::GpuPairHello h;
  h.num_layers = attn_cfg.num_layers;
  h.num_q_heads = attn_cfg.num_q_heads;
  h.num_kv_heads = attn_cfg.num_kv_heads;
  h.head_dim = attn_cfg.head_dim;
  h.layers_per_pack = o.sparse.layers_per_pack;
  h.token_budget = o.sparse.selection.token_budget;
  h.local_window = o.sparse.selection.local_window;
  h.delta_capacity = o.sparse.effective_delta_capacity();
  h.max_slots = o.max_slots;
  h.max_step_tokens = o.max_step_tokens;
  // The cache rank holds every running context in full, also the dropped parts: its pool is the engine's bound on
  // full contexts (page dropping lets the engine run more of them than num_pages holds).
  h.num_pages = engine.max_context_pages > 0 ? engine.max_context_pages : engine.num_pages;
  // Plus the retained prefixes (sparse_planner.h), at most max_retained_prefix_tokens in whole pages.
  h.num_pages += o.max_retained_prefix_tokens / engine.page_size;
  h.page_size = engine.page_size;
  h.max_pages_per_seq = (engine.max_model_len + engine.page_size - 1) / engine.page_size;
  return h;
}

SparseStepPlanner::SparseStepPlanner(const GpuSparseOptions& o) : o_(o) {
  const pair::SparseConfig& c = o.sparse;
  SPADE_CHECK(c.sparse_threshold >= 1, "sparse planner: sparse_threshold {} must be >= 1", c.sparse_threshold);
  SPADE_CHECK(c.selection.token_budget >= 1, "sparse planner: token_budget {} must be >= 1", c.selection.token_budget);
  SPADE_CHECK(c.selection.local_window >= 1, "sparse planner: local_window {} must be >= 1", c.selection.local_window);
  SPADE_CHECK(c.max_first_per_step >= 1, "sparse planner: max_first_per_step {} must be >= 1", c.max_first_per_step);
  SPADE_CHECK(o.max_sparse_seqs >= 1, "sparse planner: max_sparse_seqs {} must be >= 1", o.max_sparse_seqs);
  SPADE_CHECK(o.max_slots >= 1 && o.max_slots <= pair::gpu_plan_max_rows(),
              "sparse planner: max_slots {} must be in [1, {}]", o.max_slots, pair::gpu_plan_max_rows());
  SPADE_CHECK(o.max_retained_prefix_tokens >= 0, "sparse planner: max_retained_prefix_tokens {} must be >= 0",
              o.max_retained_prefix_tokens);
  for (int i = o.max_slots - 1; i >= 0; --i) free_slots_.push_back(i);
  for (int i = o.max_sparse_seqs - 1; i >= 0; --i) free_tables_.push_back(i);
}

void SparseStepPlanner::set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold) {
  SPADE_CHECK(sparse_threshold >= 0, "sparse_threshold {} must be >= 0", sparse_threshold);
  Seq& s = seqs_[seq_id];
  s.force_dense = force_dense;
  s.threshold = sparse_threshold;
}

void SparseStepPlanner::detach(uint64_t seq_id) {
  Seq& s = seqs_[seq_id];
  s.force_dense = true;
  s.rebase = true;
}

void SparseStepPlanner::on_release(uint64_t seq_id) {
  // Also for a sequence that never had a row (no entry yet): its pin and a fork of it not yet planned go.
  std::erase_if(pending_forks_, [&](const PendingFork& f) { return f.child == seq_id; });
  unpin_hit(seq_id);
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  if (retention_on() && it->second.slot >= 0 && it->second.rows_sent && it->second.offset == 0) retain(it->second);
  if (it->second.slot >= 0) {
    pending_release_.push_back(it->second.slot);
    free_slots_.push_back(it->second.slot);
  }
  if (it->second.table >= 0) free_tables_.push_back(it->second.table);
  seqs_.erase(it);
}

int SparseStepPlanner::take_slot() {
  SPADE_CHECK(!free_slots_.empty(), "GPU sparse: more than {} sequences at once (the cache rank's plan slots)",
              o_.max_slots);
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  // A slot released since the last plan: the fork empties it first, so its release must not follow the fork.
  std::erase(pending_release_, slot);
  return slot;
}

void SparseStepPlanner::on_fork(uint64_t parent, uint64_t child) {
  if (failed_) return;  // no plan is sent any more: the cache rank need not know
  Seq& c = seqs_[child];  // may exist already: set_request_options, detach
  SPADE_CHECK(c.slot < 0 && c.len == 0, "GPU sparse: sequence {} forks from sequence {} but already has a slot",
              child, parent);
  c.rebase = false;  // the fork gives the cache rank its prefix (a sample detached while it waited)
  const auto pit = seqs_.find(parent);
  const bool planned = pit != seqs_.end() && (pit->second.slot >= 0 || pit->second.fork_slot >= 0);
  if (!planned) {
    // The group's whole shared part came from the prefix cache (no row of it was ever planned): each sample forks
    // the retained prefix that reusable_prefix_tokens chose for the group.
    const auto hit = pending_hits_.find(parent);
    SPADE_CHECK(hit != pending_hits_.end(),
                "GPU sparse: sequence {} forks from sequence {}, which has no tokens on the cache rank", child, parent);
    c.slot = take_slot();
    c.len = hit->second.second;
    pending_forks_.push_back(
        {child, pair::GpuPlanFork{c.slot, hit->second.first, hit->second.second, pair::kForkFromRetained}});
    ++retention_stats_.reused;
    retention_stats_.reused_tokens += static_cast<uint64_t>(hit->second.second);
    return;
  }
  Seq& g = pit->second;
  SPADE_CHECK(g.len >= 1 && g.phase == Phase::Dense && g.table < 0 && !g.sel_requested,
              "GPU sparse: sequence {} forks from sequence {}, which has no tokens on the cache rank or a selection",
              child, parent);
  // A group that started over on this cache rank (offset > 0) has no full context there: its samples stay dense.
  c.force_dense = c.force_dense || g.offset > 0;
  c.len = g.len;
  c.offset = g.offset;
  c.pages = g.pages;
  c.recording = g.recording;
  if (g.slot >= 0) {  // the first sample: the group's slot is its own now
    c.slot = g.slot;
    g.fork_slot = g.slot;
    g.slot = -1;
    return;
  }
  c.slot = take_slot();
  pending_forks_.push_back({child, pair::GpuPlanFork{c.slot, g.fork_slot, g.len}});
}

bool SparseStepPlanner::retention_on() const {
  return !failed_ && o_.max_retained_prefix_tokens > 0 && pages_ != nullptr && pages_->prefix_caching();
}

void SparseStepPlanner::retain(const Seq& s) {
  const int page = pages_->page_size();
  const int run = std::min({pages_->published_run(s.pages), s.len / page, o_.max_retained_prefix_tokens / page});
  if (run == 0 || static_cast<int>(pending_retains_.size()) >= pair::gpu_plan_max_rows()) return;
  // What it replaces: the retained prefixes it covers and the stale ones (their first page was reused here since:
  // no prefix-cache hit can reach them any more), then the least recently used until the bound holds (pinned ones
  // never). Decided before anything changes: if the bound cannot hold, or the next plan could not carry every drop,
  // it is not retained (the cache rank's pool has room for the bound only, and a drop late by a step would let it
  // overflow).
  std::vector<int32_t> drops;
  int64_t tokens = retained_tokens_ + static_cast<int64_t>(run) * page;
  std::vector<std::pair<uint64_t, int32_t>> lru;  // (used, id) of the unpinned ones it does not cover
  for (auto& [id, r] : retained_) {
    size_t common = 0;
    while (common < r.pages.size() && common < static_cast<size_t>(run) && r.pages[common] == s.pages[common]) ++common;
    if (common >= static_cast<size_t>(run)) {  // one retained already holds it all
      r.used = ++use_clock_;
      return;
    }
    if (r.pins > 0) continue;
    const bool stale = pages_->published_run(r.pages) == 0;  // its first page holds other KV now
    if (common == r.pages.size() || stale) {
      drops.push_back(id);
      tokens -= static_cast<int64_t>(r.pages.size()) * page;
    } else {
      lru.emplace_back(r.used, id);
    }
  }
  std::sort(lru.begin(), lru.end());
  for (size_t i = 0; i < lru.size() && tokens > o_.max_retained_prefix_tokens; ++i) {
    drops.push_back(lru[i].second);
    tokens -= static_cast<int64_t>(retained_.at(lru[i].second).pages.size()) * page;
  }
  if (tokens > o_.max_retained_prefix_tokens ||
      pending_drops_.size() + drops.size() > static_cast<size_t>(pair::gpu_plan_max_rows()))
    return;
  for (int32_t id : drops) drop_retained(id);
  const int32_t id = next_retained_id_;
  // Ids wrap within int32 (the wire's): an old one is long gone.
  next_retained_id_ = static_cast<int32_t>((static_cast<uint32_t>(next_retained_id_) + 1u) & 0x7fffffffu);
  Retained r;
  r.pages.assign(s.pages.begin(), s.pages.begin() + run);
  r.used = ++use_clock_;
  retained_tokens_ += static_cast<int64_t>(run) * page;
  retained_.emplace(id, std::move(r));
  pending_retains_.push_back({s.slot, id, run * page});
  ++retention_stats_.retained;
}

int SparseStepPlanner::retained_pages() const {
  std::set<std::pair<int32_t, uint64_t>> pages;  // (page, serial): a page reused since is another page there too
  for (const auto& [id, r] : retained_) pages.insert(r.pages.begin(), r.pages.end());
  return static_cast<int>(pages.size());
}

void SparseStepPlanner::drop_retained(int32_t id) {
  auto it = retained_.find(id);
  if (it == retained_.end()) return;
  retained_tokens_ -= static_cast<int64_t>(it->second.pages.size()) * pages_->page_size();
  retained_.erase(it);
  ++retention_stats_.dropped;
  // Retained since the last plan: it never reaches the cache rank.
  const auto before = pending_retains_.size();
  std::erase_if(pending_retains_, [&](const pair::GpuPlanRetain& r) { return r.id == id; });
  if (pending_retains_.size() == before) pending_drops_.push_back(id);
}

void SparseStepPlanner::unpin_hit(uint64_t seq_id) {
  const auto h = pending_hits_.find(seq_id);
  if (h == pending_hits_.end()) return;
  if (auto r = retained_.find(h->second.first); r != retained_.end()) --r->second.pins;
  pending_hits_.erase(h);
}

int SparseStepPlanner::reusable_prefix_tokens(uint64_t seq_id, const std::vector<int32_t>& pages) {
  if (failed_) return 1 << 30;  // every sequence decodes densely from now on: the local pages are all it reads
  unpin_hit(seq_id);
  if (!retention_on()) return 0;
  int best = 0;
  int32_t best_id = -1;
  for (const auto& [id, r] : retained_) {
    int run = 0;
    const size_t n = std::min(pages.size(), r.pages.size());
    while (static_cast<size_t>(run) < n && r.pages[static_cast<size_t>(run)].first == pages[static_cast<size_t>(run)] &&
           pages_->page_serial(pages[static_cast<size_t>(run)]) == r.pages[static_cast<size_t>(run)].second)
      ++run;
    if (run > best) {
      best = run;
      best_id = id;
    }
  }
  if (best == 0) return 0;
  Retained& r = retained_.at(best_id);
  ++r.pins;
  r.used = ++use_clock_;
  const int tokens = best * pages_->page_size();
  pending_hits_[seq_id] = {best_id, tokens};
  return tokens;
}

std::vector<uint64_t> SparseStepPlanner::fail_all() {
  std::vector<uint64_t> out;
  failed_ = true;
  // The cache rank's state is gone: nothing is retained, reused or dropped there any more.
  retained_.clear();
  pending_retains_.clear();
  pending_drops_.clear();
  pending_hits_.clear();
  retained_tokens_ = 0;
  for (auto& [id, s] : seqs_) {
    if (s.phase == Phase::Sparse) {
      out.push_back(id);
      s.phase = Phase::Failed;
    }
    if (s.table >= 0) free_tables_.push_back(s.table);
    s.table = -1;
    s.sel_requested = false;
  }
  return out;
}

namespace {

StepDecision empty_decision(const ForwardBatch& fb) {
  const int B = fb.batch();
  SPADE_CHECK(static_cast<int>(fb.seq_ids.size()) == B, "sparse planner: the step has {} rows but {} sequence ids", B,
              fb.seq_ids.size());
  StepDecision d;
  d.num_packed.assign(static_cast<size_t>(B), 0);
  d.windows.assign(static_cast<size_t>(B), 0);
  d.tables.assign(static_cast<size_t>(B), -1);
  d.q_rows.assign(static_cast<size_t>(B), -1);
  return d;
}

// Row r of a dropped sequence without a selection to attend (its cache rank failed): only its local window, which
// it still holds, through the packed kernel. Its logits are discarded (the sequence is failed).
void window_only_row(StepDecision& d, const ForwardBatch& fb, int r, int local_window) {
  const size_t i = static_cast<size_t>(r);
  const int q_len = fb.cu_q_lens[i + 1] - fb.cu_q_lens[i];
  SPADE_CHECK(q_len == 1, "sparse planner: sequence {} had its pages dropped but has {} tokens in this step",
              fb.seq_ids[i], q_len);
  d.num_packed[i] = 0;
  d.windows[i] = std::min(local_window, fb.seq_lens[i]);
  d.q_rows[i] = fb.cu_q_lens[i];
  d.sparse_now = true;
}

}  // namespace

StepDecision SparseStepPlanner::local_step(const ForwardBatch& fb) const {
  StepDecision d = empty_decision(fb);
  for (int r = 0; r < fb.batch(); ++r) {
    const auto it = seqs_.find(fb.seq_ids[static_cast<size_t>(r)]);
    if (it != seqs_.end() && it->second.dropped) {
      window_only_row(d, fb, r, o_.sparse.selection.local_window);
    } else {
      d.windows[static_cast<size_t>(r)] = fb.seq_lens[static_cast<size_t>(r)];
    }
  }
  return d;
}

bool SparseStepPlanner::any_dropped(const ForwardBatch& fb) const {
  for (uint64_t id : fb.seq_ids) {
    const auto it = seqs_.find(id);
    if (it != seqs_.end() && it->second.dropped) return true;
  }
  return false;
}

std::pair<int, int> SparseStepPlanner::droppable_range(uint64_t seq_id, int seq_len) {
  if (failed_) return {0, 0};
  const auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return {0, 0};
  Seq& s = it->second;
  if (s.phase != Phase::Sparse || s.table < 0 || !s.sel_requested) return {0, 0};
  if (!s.dropped) ++dropped_seqs_;
  s.dropped = true;
  return {0, std::max(0, seq_len + 1 - o_.sparse.selection.local_window)};
}

void SparseStepPlanner::take_news(pair::GpuStepPlan& p) {
  p.released.swap(pending_release_);
  p.retains.swap(pending_retains_);
  p.drops.swap(pending_drops_);  // retain() keeps them within what one plan carries
}

pair::GpuStepPlan SparseStepPlanner::flush_plan() {
  pair::GpuStepPlan p;
  p.step = pair::GpuStepPlan::kFlushStep;
  take_news(p);
  return p;
}

StepDecision SparseStepPlanner::plan_step(const ForwardBatch& fb, int64_t step) {
  const int B = fb.batch();
  StepDecision d = empty_decision(fb);
  d.plan.step = step;
  take_news(d.plan);
  for (const PendingFork& f : pending_forks_) d.plan.forks.push_back(f.fork);
  pending_forks_.clear();
  const bool record = retention_on() && fb.max_pages > 0 &&
                      fb.block_table.size() >= static_cast<size_t>(B) * static_cast<size_t>(fb.max_pages);
  // Rows whose last token is sampled this step (decode rows, and a prompt's last chunk).
  std::vector<char> sampled(static_cast<size_t>(fb.total_tokens()), 0);
  for (int32_t t : fb.logit_rows)
    if (t >= 0 && t < fb.total_tokens()) sampled[static_cast<size_t>(t)] = 1;
  for (int r = 0; r < B; ++r) {
    const uint64_t id = fb.seq_ids[static_cast<size_t>(r)];
    Seq& s = seqs_[id];
    const bool new_slot = s.slot < 0;
    if (new_slot) {
      SPADE_CHECK(!free_slots_.empty(), "GPU sparse: more than {} sequences at once (the cache rank's plan slots)",
                  o_.max_slots);
      s.slot = free_slots_.back();
      free_slots_.pop_back();
    }
    const int q_len = fb.cu_q_lens[static_cast<size_t>(r) + 1] - fb.cu_q_lens[static_cast<size_t>(r)];
    const int ctx = fb.seq_lens[static_cast<size_t>(r)];
    pair::GpuPlanRow row{s.slot, q_len, ctx, 0u};
    if (new_slot && ctx != q_len && !s.rebase) {
      const auto h = pending_hits_.find(id);
      if (h != pending_hits_.end() && h->second.second >= ctx - q_len) {
        // A prefix-cache hit: its first tokens come from a retained prefix (reusable_prefix_tokens chose it).
        d.plan.forks.push_back({s.slot, h->second.first, ctx - q_len, pair::kForkFromRetained});
        std::erase(d.plan.released, s.slot);  // a slot released since the last plan: the fork empties it first
        ++retention_stats_.reused;
        retention_stats_.reused_tokens += static_cast<uint64_t>(ctx - q_len);
      } else {
        // A sequence this cache rank never saw start (a group prefill running when the cache rank was replaced):
        // it starts over there with this step's tokens and stays dense, as a detached one (detach).
        s.rebase = true;
        s.force_dense = true;
      }
      unpin_hit(id);
    }
    if (ctx == q_len) {
      s.rebase = false;
      s.offset = 0;
    } else if (s.rebase) {  // detached: the cache rank's slot starts with this step's tokens
      s.rebase = false;
      s.offset = ctx - q_len;
      row.flags |= pair::kRowFresh;
    }
    row.ctx_len = ctx - s.offset;
    s.len = row.ctx_len;
    s.rows_sent = true;
    if (record && s.recording && s.offset == 0) {  // its full pages as (page, serial), for retention
      const int page = pages_->page_size();
      const int32_t* bt = fb.block_table.data() + static_cast<size_t>(r) * static_cast<size_t>(fb.max_pages);
      for (int i = static_cast<int>(s.pages.size()); i < std::min(ctx / page, fb.max_pages); ++i) {
        if (bt[i] < 0) {  // dropped: nothing past it can be retained
          s.recording = false;
          break;
        }
        s.pages.emplace_back(bt[i], pages_->page_serial(bt[i]));
      }
    }
    if (ctx == q_len) {
      row.flags |= pair::kRowFresh;
      // Starting over: the cache rank forgets this slot, so its selection starts over too.
      if (s.table >= 0) free_tables_.push_back(s.table);
      s.table = -1;
      s.sel_requested = false;
      s.dropped = false;  // the engine restarted it with a new block table
      if (s.phase == Phase::Sparse) s.phase = Phase::Dense;
    }
    // This step: sparse when the previous plan asked for this sequence's selection (applied before this step's
    // packs read their tables), in decode-only and mixed steps alike.
    if (s.phase == Phase::Sparse && s.sel_requested && s.table >= 0) {
      SPADE_CHECK(q_len == 1, "sparse planner: sequence {} decodes sparsely but has {} tokens in this step", id, q_len);
      const int budget = o_.sparse.selection.token_budget, window = o_.sparse.selection.local_window;
      d.num_packed[static_cast<size_t>(r)] = std::min(budget, std::max(0, ctx - window));
      d.windows[static_cast<size_t>(r)] = window;
      d.tables[static_cast<size_t>(r)] = s.table;
      d.q_rows[static_cast<size_t>(r)] = fb.cu_q_lens[static_cast<size_t>(r)];
      d.sparse_now = true;
    } else if (s.dropped) {
      window_only_row(d, fb, r, o_.sparse.selection.local_window);  // failed after its pages were dropped: never dense
    } else {
      d.windows[static_cast<size_t>(r)] = ctx;
    }
    // The next step's selection.
    const int threshold = s.threshold > 0 ? s.threshold : o_.sparse.sparse_threshold;
    if (s.phase == Phase::Sparse && s.table >= 0) {
      row.flags |= pair::kRowSelect;
      d.group_tables[0].push_back(s.table);
    } else if (!failed_ && s.phase == Phase::Dense && q_len == 1 && !s.force_dense && ctx >= threshold &&
               sampled[static_cast<size_t>(fb.cu_q_lens[static_cast<size_t>(r) + 1] - 1)] &&
               d.switches < o_.sparse.max_first_per_step && !free_tables_.empty()) {
      s.table = free_tables_.back();
      free_tables_.pop_back();
      s.phase = Phase::Sparse;
      row.flags |= pair::kRowSelect | pair::kRowFirstSelect;
      d.group_tables[1].push_back(s.table);
      ++d.switches;
    }
    s.sel_requested = (row.flags & pair::kRowSelect) != 0;
    d.plan.rows.push_back(row);
  }
  return d;
}

}  // namespace spade

// Host bookkeeping of GPU sparse decoding (see sparse_planner.h).
#include "inference_rank/sparse_planner.h"

#include <algorithm>

#include "common/error.h"

namespace spade {

GpuSparseOptions gpu_sparse_options(const pair::SparseConfig& sparse, const EngineOptions& engine,
                                    std::string cache_name) {
  GpuSparseOptions o;
  o.sparse = sparse;
  o.max_slots = engine.max_num_seqs;
  o.max_sparse_seqs = engine.max_num_seqs;
  o.max_step_tokens = engine.max_num_batched_tokens;
  o.cache_name = std::move(cache_name);
  return o;
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
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  std::erase_if(pending_forks_, [&](const PendingFork& f) { return f.child == seq_id; });
  if (it->second.slot >= 0) {
    pending_release_.push_back(it->second.slot);
    free_slots_.push_back(it->second.slot);
  }
  if (it->second.table >= 0) free_tables_.push_back(it->second.table);
  seqs_.erase(it);
}

void SparseStepPlanner::on_fork(uint64_t parent, uint64_t child) {
  if (failed_) return;  // no plan is sent any more: the cache rank need not know
  const auto pit = seqs_.find(parent);
  SPADE_CHECK(pit != seqs_.end() && (pit->second.slot >= 0 || pit->second.fork_slot >= 0) && pit->second.len >= 1,
              "GPU sparse: sequence {} forks from sequence {}, which has no tokens on the cache rank", child, parent);
  Seq& g = pit->second;
  SPADE_CHECK(g.phase == Phase::Dense && g.table < 0 && !g.sel_requested,
              "GPU sparse: sequence {} forks from sequence {}, which has a selection", child, parent);
  Seq& c = seqs_[child];  // may exist already: set_request_options
  SPADE_CHECK(c.slot < 0 && c.len == 0, "GPU sparse: sequence {} forks from sequence {} but already has a slot",
              child, parent);
  c.len = g.len;
  c.offset = g.offset;
  if (g.slot >= 0) {  // the first sample: the group's slot is its own now
    c.slot = g.slot;
    g.fork_slot = g.slot;
    g.slot = -1;
    return;
  }
  SPADE_CHECK(!free_slots_.empty(), "GPU sparse: more than {} sequences at once (the cache rank's plan slots)",
              o_.max_slots);
  c.slot = free_slots_.back();
  free_slots_.pop_back();
  // A slot released since the last plan: the fork empties it first, so its release must not follow the fork.
  std::erase(pending_release_, c.slot);
  pending_forks_.push_back({child, pair::GpuPlanFork{c.slot, g.fork_slot, g.len}});
}

std::vector<uint64_t> SparseStepPlanner::fail_all() {
  std::vector<uint64_t> out;
  failed_ = true;
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

StepDecision SparseStepPlanner::plan_step(const ForwardBatch& fb, int64_t step) {
  const int B = fb.batch();
  StepDecision d = empty_decision(fb);
  d.plan.step = step;
  d.plan.released.swap(pending_release_);
  for (const PendingFork& f : pending_forks_) d.plan.forks.push_back(f.fork);
  pending_forks_.clear();
  // Rows whose last token is sampled this step (decode rows, and a prompt's last chunk).
  std::vector<char> sampled(static_cast<size_t>(fb.total_tokens()), 0);
  for (int32_t t : fb.logit_rows)
    if (t >= 0 && t < fb.total_tokens()) sampled[static_cast<size_t>(t)] = 1;
  for (int r = 0; r < B; ++r) {
    const uint64_t id = fb.seq_ids[static_cast<size_t>(r)];
    Seq& s = seqs_[id];
    if (s.slot < 0) {
      SPADE_CHECK(!free_slots_.empty(), "GPU sparse: more than {} sequences at once (the cache rank's plan slots)",
                  o_.max_slots);
      s.slot = free_slots_.back();
      free_slots_.pop_back();
    }
    const int q_len = fb.cu_q_lens[static_cast<size_t>(r) + 1] - fb.cu_q_lens[static_cast<size_t>(r)];
    const int ctx = fb.seq_lens[static_cast<size_t>(r)];
    pair::GpuPlanRow row{s.slot, q_len, ctx, 0u};
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

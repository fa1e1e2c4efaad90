// The host-side bookkeeping of GPU sparse decoding (issue #7; AsyncSpade Sec. 4.1): which sequences are dense, which
// switch to sparse this step, which decode sparsely, their plan slots and held-table slots, and the step's plan for
// the cache rank (cache_rank/gpu_plan.h). Pure host code, unit-tested on the CPU; GpuSparseController
// (gpu_sparse.h) turns each StepDecision into uploads, sends and launches.
//
// Per sequence (Phase):
//   Dense  -> below its threshold, a prefill step, force_dense, or no free table / switch allowance this step;
//   Sparse -> from its first decode step at or past the threshold: that step's plan row asks for a FIRST selection
//             (the full budget) and the sequence owns a held table; every later step's row asks for a steady
//             selection, and from the next step on, decode-only steps attend its table + the local window;
//   Failed -> its cache rank failed while it was sparse (it is reported once through fail_all, then decodes nothing
//             more: the engine ends it).
// A row that starts over at position 0 (fresh) loses its table and is Dense again.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_rank/gpu_plan.h"
#include "inference_rank/model.h"

namespace spade {

struct SparsePlannerOptions {
  int sparse_threshold = 256;  // context length at which a sequence switches
  int token_budget = 2048;     // k
  int local_window = 32;       // R
  int max_first_per_step = 4;  // switches per step
  int max_sparse_seqs = 16;    // held tables
  int max_slots = 64;          // plan slots (sequences at once)
};

/// What one engine step does, per batch row and per selection group.
struct StepDecision {
  cache::GpuStepPlan plan;           // rows in batch order
  std::vector<int32_t> num_packed;   // [batch] held-table entries attended (0: dense row)
  std::vector<int32_t> windows;      // [batch] local window (a dense row: its whole context)
  std::vector<int32_t> tables;       // [batch] held-table slot of a sparse row, else -1
  std::vector<int> group_tables[2];  // held-table slot of each steady / first selection row, plan order
  bool sparse_now = false;           // some row attends sparsely (decode-only steps only)
  int switches = 0;                  // rows switching to sparse this step
};

class SparseStepPlanner {
 public:
  /// Throws spade::Error naming the option when one is out of range.
  explicit SparseStepPlanner(SparsePlannerOptions o);
  /// Per request, before its first step: force_dense keeps it dense; threshold > 0 replaces the rank's.
  void set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold);
  /// The step `fb` (the engine's batch; seq_ids required). `step` numbers the plan. Throws spade::Error when more
  /// than max_slots sequences are live at once.
  StepDecision plan_step(const ForwardBatch& fb, int64_t step);
  /// The sequence left (finished, aborted, failed): its slot is released in the next plan, its table freed.
  void on_release(uint64_t seq_id);
  /// The cache rank is gone: every Sparse sequence turns Failed and is returned (once); tables are freed; no
  /// sequence switches any more.
  std::vector<uint64_t> fail_all();
  int free_tables() const { return static_cast<int>(free_tables_.size()); }
  int free_slots() const { return static_cast<int>(free_slots_.size()); }
  const SparsePlannerOptions& options() const { return o_; }

 private:
  enum class Phase { Dense, Sparse, Failed };
  struct Seq {
    int slot = -1;
    int table = -1;
    Phase phase = Phase::Dense;
    bool sel_requested = false;  // the previous plan asked for its selection of this step
    bool force_dense = false;
    int threshold = 0;
  };
  SparsePlannerOptions o_;
  std::unordered_map<uint64_t, Seq> seqs_;
  std::vector<int> free_slots_, free_tables_;
  std::vector<int32_t> pending_release_;
  bool failed_ = false;
};

}  // namespace spade

// The host bookkeeping of GPU sparse decoding (inference_rank/sparse_planner.h): phases, switching limits, held
// tables, plan slots and their release, fresh restarts, per-request options, the cache rank's failure, bad input,
// sparse rows inside mixed prefill + decode steps, and page dropping (droppable_range: the range, the dropped mark
// that keeps a sequence off dense attention for good, local_step once the link is gone), and the forks of n samples
// (the first sample takes over the group's slot, the others fork it in the next plan; releases and slot reuse around
// them), and retained prefixes (retain at release, reuse bounded by what is retained, covered and least recently
// used prefixes dropped, pins, page serials).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/page_allocator.h"
#include "inference_rank/sparse_planner.h"

namespace spade {
namespace {

using pair::kRowFirstSelect;
using pair::kRowFresh;
using pair::kRowSelect;

struct Row {
  uint64_t id;
  int q_len;
  int ctx;  // after the step
};

// `sampled` false: no logit row (a group prefill's chunk).
ForwardBatch batch(const std::vector<Row>& rows, bool sampled = true) {
  ForwardBatch b;
  b.cu_q_lens.push_back(0);
  for (const Row& r : rows) {
    for (int t = 0; t < r.q_len; ++t) {
      b.tokens.push_back(1);
      b.positions.push_back(r.ctx - r.q_len + t);
    }
    b.cu_q_lens.push_back(b.cu_q_lens.back() + r.q_len);
    b.seq_lens.push_back(r.ctx);
    b.seq_ids.push_back(r.id);
    if (sampled) b.logit_rows.push_back(b.cu_q_lens.back() - 1);
  }
  return b;
}

GpuSparseOptions opts() {
  GpuSparseOptions o;
  o.sparse.sparse_threshold = 100;
  o.sparse.selection.token_budget = 64;
  o.sparse.selection.local_window = 16;
  o.sparse.max_first_per_step = 2;
  o.max_sparse_seqs = 3;
  o.max_slots = 8;
  return o;
}

TEST(SparsePlanner, ASequenceSwitchesWithAFirstSelectionThenDecodesSparsely) {
  SparseStepPlanner p(opts());
  // Prefill of 98 tokens: dense, fresh, no selection.
  StepDecision d = p.plan_step(batch({{7, 98, 98}}), 0);
  ASSERT_EQ(d.plan.rows.size(), 1u);
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_EQ(d.plan.rows[0].q_len, 98);
  EXPECT_FALSE(d.sparse_now);
  EXPECT_EQ(d.windows[0], 98);
  EXPECT_EQ(d.tables[0], -1);
  const int slot = d.plan.rows[0].slot;
  // Decode below the threshold: dense.
  d = p.plan_step(batch({{7, 1, 99}}), 1);
  EXPECT_EQ(d.plan.rows[0].flags, 0u);
  EXPECT_EQ(d.plan.rows[0].slot, slot) << "a sequence keeps its slot";
  // At the threshold: the plan asks for the first selection; this step is still dense.
  d = p.plan_step(batch({{7, 1, 100}}), 2);
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowSelect | kRowFirstSelect));
  EXPECT_EQ(d.switches, 1);
  ASSERT_EQ(d.group_tables[1].size(), 1u);
  EXPECT_TRUE(d.group_tables[0].empty());
  EXPECT_FALSE(d.sparse_now);
  EXPECT_EQ(d.windows[0], 100);
  const int table = d.group_tables[1][0];
  EXPECT_EQ(p.free_tables(), 2);
  // Next step: sparse over the table (min(k, ctx - R) entries) + the local window; a steady selection follows.
  d = p.plan_step(batch({{7, 1, 101}}), 3);
  EXPECT_TRUE(d.sparse_now);
  EXPECT_EQ(d.tables[0], table);
  EXPECT_EQ(d.num_packed[0], std::min(64, 101 - 16));
  EXPECT_EQ(d.windows[0], 16);
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowSelect));
  ASSERT_EQ(d.group_tables[0].size(), 1u);
  EXPECT_EQ(d.group_tables[0][0], table);
  EXPECT_EQ(d.plan.step, 3);
  EXPECT_EQ(d.plan.rows[0].ctx_len, 101);
}

TEST(SparsePlanner, NumPackedIsTheSelectablePrefixBoundedByTheBudget) {
  GpuSparseOptions o = opts();
  o.sparse.sparse_threshold = 10;
  o.sparse.selection.local_window = 16;
  SparseStepPlanner p(o);
  p.plan_step(batch({{1, 9, 9}}), 0);
  p.plan_step(batch({{1, 1, 10}}), 1);  // switch
  StepDecision d = p.plan_step(batch({{1, 1, 11}}), 2);
  EXPECT_TRUE(d.sparse_now);
  EXPECT_EQ(d.num_packed[0], 0) << "context 11 < local window 16: nothing outside the window";
  for (int ctx = 12; ctx < 200; ++ctx) d = p.plan_step(batch({{1, 1, ctx}}), ctx);
  EXPECT_EQ(d.num_packed[0], 64) << "bounded by the budget";
}

TEST(SparsePlanner, MixedStepsAttendTheSparseRowsSparsely) {
  SparseStepPlanner p(opts());
  p.plan_step(batch({{1, 100, 100}}), 0);
  StepDecision d = p.plan_step(batch({{1, 1, 101}}), 1);  // switch
  EXPECT_EQ(d.q_rows[0], -1) << "the switching step is still dense";
  // A new request's prefill joins: the step is not decode-only, the sparse row is still served by the packed
  // kernel at its token row; the prefill row is dense (the prefill kernel).
  d = p.plan_step(batch({{1, 1, 102}, {2, 30, 30}}), 2);
  EXPECT_TRUE(d.sparse_now);
  EXPECT_EQ(d.q_rows[0], 0);
  EXPECT_EQ(d.q_rows[1], -1);
  EXPECT_GE(d.tables[0], 0);
  EXPECT_EQ(d.num_packed[0], std::min(64, 102 - 16));
  EXPECT_EQ(d.windows[0], 16);
  EXPECT_EQ(d.tables[1], -1);
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowSelect));
  EXPECT_EQ(d.plan.rows[1].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_NE(d.plan.rows[0].slot, d.plan.rows[1].slot);
  // Any layout: the sparse row's query is wherever its token sits (here after a 30-token chunk).
  d = p.plan_step(batch({{2, 30, 60}, {1, 1, 103}}), 3);
  EXPECT_EQ(d.q_rows[0], -1);
  EXPECT_EQ(d.q_rows[1], 30);
  d = p.plan_step(batch({{1, 1, 104}, {2, 1, 61}}), 4);
  EXPECT_TRUE(d.sparse_now);
  EXPECT_GE(d.tables[0], 0);
  EXPECT_EQ(d.q_rows[0], 0);
  EXPECT_EQ(d.tables[1], -1);
  EXPECT_EQ(d.windows[1], 61) << "a dense row of a sparse decode-only step attends its whole context";
  EXPECT_EQ(d.num_packed[1], 0);
  // A sparse sequence with more than one token in a step is a bug of the caller.
  EXPECT_THROW(p.plan_step(batch({{1, 2, 106}}), 5), Error);
}

TEST(SparsePlanner, PagesAreDroppableOnceTheFirstSelectionIsRequested) {
  SparseStepPlanner p(opts());  // window 16
  p.plan_step(batch({{1, 99, 99}, {2, 120, 120}}), 0);
  EXPECT_EQ(p.droppable_range(1, 99), std::make_pair(0, 0)) << "dense";
  EXPECT_EQ(p.droppable_range(2, 120), std::make_pair(0, 0)) << "prefill: dense";
  EXPECT_EQ(p.droppable_range(3, 500), std::make_pair(0, 0)) << "unknown sequence";
  EXPECT_FALSE(p.any_dropped(batch({{1, 1, 100}, {2, 1, 121}})));
  p.plan_step(batch({{1, 1, 100}, {2, 1, 121}}), 1);  // both switch (first selections requested)
  // The next step reads the selection (positions < 121 + 1 - 16) and the window [106, 122).
  EXPECT_EQ(p.droppable_range(2, 121), std::make_pair(0, 121 + 1 - 16));
  EXPECT_TRUE(p.any_dropped(batch({{2, 1, 122}})));
  EXPECT_EQ(p.droppable_range(2, 122), std::make_pair(0, 122 + 1 - 16)) << "every step, the range grows";
  EXPECT_EQ(p.dropped_seqs(), 1u) << "counted once";
  EXPECT_FALSE(p.any_dropped(batch({{7, 1, 5}})));
  // Clamped at 0 for a context inside the window.
  GpuSparseOptions o = opts();
  o.sparse.sparse_threshold = 5;
  SparseStepPlanner q(o);
  q.plan_step(batch({{1, 5, 5}}), 0);
  q.plan_step(batch({{1, 1, 6}}), 1);
  EXPECT_EQ(q.droppable_range(1, 6), std::make_pair(0, 0));
  // force_dense never drops.
  SparseStepPlanner f(opts());
  f.set_request_options(1, /*force_dense=*/true, 0);
  f.plan_step(batch({{1, 120, 120}}), 0);
  f.plan_step(batch({{1, 1, 121}}), 1);
  EXPECT_EQ(f.droppable_range(1, 121), std::make_pair(0, 0));
}

TEST(SparsePlanner, ADroppedSequenceIsNeverAttendedDenselyAgain) {
  SparseStepPlanner p(opts());
  p.plan_step(batch({{1, 120, 120}, {2, 10, 10}}), 0);
  p.plan_step(batch({{1, 1, 121}, {2, 1, 11}}), 1);  // 1 switches
  EXPECT_EQ(p.droppable_range(1, 121), std::make_pair(0, 106));
  EXPECT_EQ(p.droppable_range(2, 11), std::make_pair(0, 0));
  // The cache rank fails: 1 is failed, nothing is droppable any more, and its last step (no plan: local_step)
  // attends only its local window, which it still holds, through the packed kernel.
  EXPECT_EQ(p.fail_all(), std::vector<uint64_t>{1});
  EXPECT_EQ(p.droppable_range(1, 122), std::make_pair(0, 0));
  StepDecision d = p.local_step(batch({{1, 1, 122}, {2, 30, 41}}));
  EXPECT_TRUE(d.sparse_now);
  EXPECT_TRUE(d.plan.rows.empty()) << "no plan without a link";
  EXPECT_EQ(d.q_rows[0], 0);
  EXPECT_EQ(d.num_packed[0], 0);
  EXPECT_EQ(d.windows[0], 16);
  EXPECT_EQ(d.tables[0], -1);
  EXPECT_EQ(d.q_rows[1], -1);
  EXPECT_EQ(d.windows[1], 41);
  // plan_step routes it the same way (a plan whose send fails after the decision).
  d = p.plan_step(batch({{1, 1, 122}}), 2);
  EXPECT_EQ(d.q_rows[0], 0);
  EXPECT_EQ(d.windows[0], 16);
  EXPECT_EQ(d.num_packed[0], 0);
  // Without a dropped sequence, local_step is dense throughout.
  d = p.local_step(batch({{2, 1, 42}}));
  EXPECT_FALSE(d.sparse_now);
  EXPECT_EQ(d.windows[0], 42);
  EXPECT_THROW(p.local_step(batch({{1, 2, 124}})), Error) << "a dropped sequence with two tokens";
}

TEST(SparsePlanner, AFreshRestartClearsTheDroppedMark) {
  SparseStepPlanner p(opts());
  p.plan_step(batch({{1, 110, 110}}), 0);
  p.plan_step(batch({{1, 1, 111}}), 1);  // switch
  EXPECT_EQ(p.droppable_range(1, 111), std::make_pair(0, 96));
  // The engine restarts it at position 0 (new block table): the cache rank starts over (kRowFresh), it is dense.
  StepDecision d = p.plan_step(batch({{1, 50, 50}}), 2);
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_EQ(d.q_rows[0], -1);
  EXPECT_FALSE(p.any_dropped(batch({{1, 1, 51}})));
  EXPECT_EQ(p.droppable_range(1, 50), std::make_pair(0, 0));
}

TEST(SparsePlanner, SwitchesPerStepAndHeldTablesAreBounded) {
  SparseStepPlanner p(opts());  // 2 switches per step, 3 tables
  std::vector<Row> rows;
  for (uint64_t id = 1; id <= 5; ++id) rows.push_back({id, 120, 120});
  p.plan_step(batch(rows), 0);
  for (auto& r : rows) r = {r.id, 1, r.ctx + 1};
  StepDecision d = p.plan_step(batch(rows), 1);
  EXPECT_EQ(d.switches, 2);
  for (auto& r : rows) r.ctx += 1;
  d = p.plan_step(batch(rows), 2);
  EXPECT_EQ(d.switches, 1) << "only one table left";
  EXPECT_EQ(p.free_tables(), 0);
  for (auto& r : rows) r.ctx += 1;
  d = p.plan_step(batch(rows), 3);
  EXPECT_EQ(d.switches, 0);
  EXPECT_EQ(d.group_tables[0].size(), 3u);
  int sparse = 0;
  for (int t : d.tables) sparse += t >= 0;
  EXPECT_EQ(sparse, 3) << "two switched at step 1, the third at step 2: its first selection serves step 3";
  // A sparse sequence leaves: its table and slot come back; its slot is released in the next plan.
  const uint64_t gone = rows[0].id;
  int gone_slot = -1;
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i].id == gone) gone_slot = d.plan.rows[i].slot;
  p.on_release(gone);
  rows.erase(rows.begin());
  for (auto& r : rows) r.ctx += 1;
  d = p.plan_step(batch(rows), 4);
  EXPECT_EQ(d.plan.released, std::vector<int32_t>{gone_slot});
  EXPECT_EQ(d.switches, 1) << "a waiting sequence takes the freed table";
  d = p.plan_step(batch({{9, 4, 4}}), 5);
  EXPECT_TRUE(d.plan.released.empty()) << "released once";
}

// The idle flush: the releases a step would carry go out without one, once; forks wait for their rows.
TEST(SparsePlanner, TheIdleFlushCarriesTheWaitingReleasesOnce) {
  SparseStepPlanner p(opts());
  EXPECT_FALSE(p.has_news());
  StepDecision d = p.plan_step(batch({{1, 8, 8}, {2, 8, 8}}), 0);
  const int32_t slot1 = d.plan.rows[0].slot, slot2 = d.plan.rows[1].slot;
  p.on_release(1);
  p.on_release(2);
  ASSERT_TRUE(p.has_news());
  const pair::GpuStepPlan f = p.flush_plan();
  EXPECT_TRUE(f.is_flush());
  EXPECT_TRUE(f.rows.empty());
  EXPECT_TRUE(f.forks.empty());
  std::vector<int32_t> released = f.released;
  std::sort(released.begin(), released.end());
  EXPECT_EQ(released, (std::vector<int32_t>{std::min(slot1, slot2), std::max(slot1, slot2)}));
  EXPECT_FALSE(p.has_news());
  EXPECT_TRUE(p.flush_plan().released.empty()) << "released once";
  d = p.plan_step(batch({{3, 4, 4}}), 1);
  EXPECT_TRUE(d.plan.released.empty()) << "the next step does not release them again";
  EXPECT_EQ(d.plan.step, 1) << "the flush took no step number";
  // A group's samples waiting for their forks: the flush leaves the forks to the plan of their rows.
  d = p.plan_step(batch({{10, 32, 32}}, false), 2);
  for (uint64_t c : {11, 12}) p.on_fork(10, c);
  p.on_release(10);
  p.on_release(3);
  ASSERT_EQ(p.pending_forks(), 1);
  EXPECT_EQ(p.flush_plan().forks.size(), 0u);
  EXPECT_EQ(p.pending_forks(), 1);
  d = p.plan_step(batch({{11, 1, 33}, {12, 1, 33}}), 3);
  EXPECT_EQ(d.plan.forks.size(), 1u);
}

// The one place the GPU path's options are filled (inference_rank/main.cpp and serve.cpp both call it): the pair's
// settings as parsed, the limits from the engine. max_first_per_step is not clamped to max_num_seqs: the held tables
// (max_num_seqs of them) bound the switches of a step anyway.
TEST(GpuSparseOptions, ThePairsSettingsAndTheEnginesLimits) {
  pair::SparseConfig sc;
  sc.sparse_threshold = 512;
  sc.layers_per_pack = 3;
  sc.selection.token_budget = 256;
  sc.selection.local_window = 64;
  sc.delta_capacity = 0;
  EngineOptions eo;
  eo.max_num_seqs = 2;
  eo.max_num_batched_tokens = 1024;
  const GpuSparseOptions o = gpu_sparse_options(sc, eo, "cache rank 2 (#0)");
  EXPECT_EQ(o.sparse.sparse_threshold, 512);
  EXPECT_EQ(o.sparse.layers_per_pack, 3);
  EXPECT_EQ(o.sparse.selection.token_budget, 256);
  EXPECT_EQ(o.sparse.selection.local_window, 64);
  EXPECT_EQ(o.sparse.effective_delta_capacity(), 128) << "0 = half the budget";
  EXPECT_EQ(o.sparse.max_first_per_step, pair::SparseConfig{}.max_first_per_step);
  EXPECT_EQ(o.max_slots, 2);
  EXPECT_EQ(o.max_sparse_seqs, 2);
  EXPECT_EQ(o.max_step_tokens, 1024);
  EXPECT_EQ(o.cache_name, "cache rank 2 (#0)");
  // Three sequences reach the threshold in one step: two switch (the tables), not max_first_per_step = 4.
  GpuSparseOptions small = o;
  small.sparse.sparse_threshold = 100;
  small.max_slots = 3;
  SparseStepPlanner p(small);
  std::vector<Row> rows = {{1, 120, 120}, {2, 120, 120}, {3, 120, 120}};
  p.plan_step(batch(rows), 0);
  for (auto& r : rows) r = {r.id, 1, r.ctx + 1};
  EXPECT_EQ(p.plan_step(batch(rows), 1).switches, 2);
}

TEST(SparsePlanner, PerRequestOptions) {
  SparseStepPlanner p(opts());
  p.set_request_options(1, /*force_dense=*/true, 0);
  p.set_request_options(2, false, /*sparse_threshold=*/20);
  p.plan_step(batch({{1, 120, 120}, {2, 30, 30}, {3, 30, 30}}), 0);
  StepDecision d = p.plan_step(batch({{1, 1, 121}, {2, 1, 31}, {3, 1, 31}}), 1);
  EXPECT_EQ(d.plan.rows[0].flags, 0u) << "force_dense";
  EXPECT_EQ(d.plan.rows[1].flags, static_cast<uint32_t>(kRowSelect | kRowFirstSelect)) << "its own threshold 20";
  EXPECT_EQ(d.plan.rows[2].flags, 0u) << "the rank's threshold 100";
  EXPECT_THROW(p.set_request_options(4, false, -1), Error);
}

// Rejoin on the GPU: a sequence the engine ran before a replacement cache rank was paired is detached on the new
// planner. Its rows start over on the cache rank at its next step (kRowFresh, ctx_len counted from there: the
// replacement holds none of its earlier tokens), it never switches, and a real restart at position 0 ends the offset.
TEST(SparsePlanner, ADetachedSequenceStartsOverOnTheCacheRankAndStaysDense) {
  SparseStepPlanner p(opts());
  p.detach(1);
  StepDecision d = p.plan_step(batch({{1, 1, 137}, {2, 30, 30}}), 0);
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_EQ(d.plan.rows[0].q_len, 1);
  EXPECT_EQ(d.plan.rows[0].ctx_len, 1) << "the cache rank's slot holds this step's token alone";
  EXPECT_EQ(d.windows[0], 137) << "attended densely over all of its local KV";
  EXPECT_EQ(d.plan.rows[1].ctx_len, 30);
  for (int t = 1; t <= 3; ++t) {
    d = p.plan_step(batch({{1, 1, 137 + t}, {2, 1, 30 + t}}), t);
    EXPECT_EQ(d.plan.rows[0].flags, 0u) << "past the threshold, but detached: never selected";
    EXPECT_EQ(d.plan.rows[0].ctx_len, 1 + t);
    EXPECT_EQ(d.windows[0], 137 + t);
  }
  d = p.plan_step(batch({{1, 40, 40}}), 4);  // the engine restarts it at position 0
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_EQ(d.plan.rows[0].ctx_len, 40);
}

TEST(SparsePlanner, AFreshRestartDropsTheSelection) {
  SparseStepPlanner p(opts());
  p.plan_step(batch({{1, 110, 110}}), 0);
  p.plan_step(batch({{1, 1, 111}}), 1);  // switch
  EXPECT_EQ(p.free_tables(), 2);
  StepDecision d = p.plan_step(batch({{1, 50, 50}}), 2);  // starts over at position 0
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_EQ(p.free_tables(), 3);
  d = p.plan_step(batch({{1, 1, 51}}), 3);
  EXPECT_FALSE(d.sparse_now);
  EXPECT_EQ(d.plan.rows[0].flags, 0u);
}

TEST(SparsePlanner, TheCacheRanksFailureFailsTheSparseSequencesOnce) {
  SparseStepPlanner p(opts());
  p.plan_step(batch({{1, 120, 120}, {2, 10, 10}}), 0);
  p.plan_step(batch({{1, 1, 121}, {2, 1, 11}}), 1);  // 1 switches
  EXPECT_EQ(p.fail_all(), std::vector<uint64_t>{1});
  EXPECT_TRUE(p.fail_all().empty()) << "reported once";
  EXPECT_EQ(p.free_tables(), 3);
  // Nothing switches any more, nothing is sparse.
  StepDecision d = p.plan_step(batch({{2, 1, 200}}), 2);
  EXPECT_FALSE(d.sparse_now);
  EXPECT_EQ(d.plan.rows[0].flags, 0u);
}

// n = 3 samples of a 96-token prompt: the group (id 10) prefills it; samples 11, 12, 13 fork it. The first takes over
// the group's slot; the others get slots of their own and forks in the next plan, before its rows; the group's
// release frees no slot. Each sample's first row continues at the shared length (not fresh).
TEST(SparsePlanner, SamplesForkTheGroupsSlot) {
  SparseStepPlanner p(opts());
  StepDecision d = p.plan_step(batch({{10, 64, 64}}, false), 0);
  d = p.plan_step(batch({{10, 32, 96}}, false), 1);
  const int group_slot = d.plan.rows[0].slot;
  EXPECT_EQ(d.plan.rows[0].flags, 0u);
  for (uint64_t c : {11, 12, 13}) p.on_fork(10, c);
  p.on_release(10);
  EXPECT_EQ(p.pending_forks(), 2);
  EXPECT_EQ(p.free_slots(), 8 - 3) << "three samples in three slots, the group's taken over";
  d = p.plan_step(batch({{11, 4, 100}, {12, 4, 100}, {13, 4, 100}}), 2);
  EXPECT_TRUE(d.plan.released.empty()) << "the group's slot is the first sample's";
  ASSERT_EQ(d.plan.forks.size(), 2u);
  EXPECT_EQ(d.plan.rows[0].slot, group_slot);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(d.plan.forks[i].parent, group_slot);
    EXPECT_EQ(d.plan.forks[i].child, d.plan.rows[i + 1].slot);
    EXPECT_EQ(d.plan.forks[i].tokens, 96);
  }
  for (const auto& r : d.plan.rows) {
    EXPECT_EQ(r.flags, 0u) << "a sample continues at the shared length: not fresh";
    EXPECT_EQ(r.ctx_len, 100);
  }
  EXPECT_EQ(p.pending_forks(), 0);
  d = p.plan_step(batch({{11, 1, 101}, {12, 1, 101}, {13, 1, 101}}), 3);
  EXPECT_TRUE(d.plan.forks.empty());
  EXPECT_EQ(d.switches, 2) << "past the threshold, each sample switches on its own (two per step here)";
}

// A group's last prefill chunk of one token at the threshold is no decode step: it asks for no selection, so its
// samples fork a slot without one.
TEST(SparsePlanner, AGroupPrefillNeverSwitches) {
  SparseStepPlanner p(opts());
  p.plan_step(batch({{10, 111, 111}}, false), 0);
  StepDecision d = p.plan_step(batch({{10, 1, 112}}, false), 1);
  EXPECT_EQ(d.plan.rows[0].flags, 0u);
  EXPECT_EQ(d.switches, 0);
  p.on_fork(10, 11);
  p.on_fork(10, 12);
  p.on_release(10);
  d = p.plan_step(batch({{11, 16, 128}, {12, 16, 128}}), 2);
  ASSERT_EQ(d.plan.forks.size(), 1u);
  EXPECT_EQ(d.plan.forks[0].tokens, 112);
}

// Releases around forks: a sample released before the next plan takes its fork back; a fork into a slot released
// since the last plan empties it itself (the slot is not also in `released`, which the cache rank applies after the
// forks); the first sample released before its first row leaves the group's slot to be released after the forks
// that still copy from it.
TEST(SparsePlanner, ReleasesAroundForks) {
  GpuSparseOptions o = opts();
  o.max_slots = 4;
  SparseStepPlanner p(o);
  StepDecision d = p.plan_step(batch({{1, 10, 10}, {10, 32, 32}}, false), 0);
  const int slot1 = d.plan.rows[0].slot, group_slot = d.plan.rows[1].slot;
  p.on_release(1);  // slot1 is free again, its release pending
  for (uint64_t c : {11, 12, 13}) p.on_fork(10, c);
  p.on_release(10);
  p.on_release(12);  // a sample aborted before its first step: its fork goes
  p.on_release(11);  // the first sample too: the group's slot is released, after the remaining fork copied it
  d = p.plan_step(batch({{13, 4, 36}}), 1);
  ASSERT_EQ(d.plan.forks.size(), 1u);
  EXPECT_EQ(d.plan.forks[0].parent, group_slot);
  const int slot13 = d.plan.forks[0].child;
  EXPECT_EQ(d.plan.rows[0].slot, slot13);
  EXPECT_NE(slot13, group_slot);
  std::vector<int32_t> released = d.plan.released;
  std::sort(released.begin(), released.end());
  std::vector<int32_t> want = {group_slot};
  // slot1's release is in the plan unless sample 13's fork reused the slot (then the fork empties it).
  if (slot13 != slot1) want.push_back(slot1);
  // Sample 12's slot (never forked on the cache rank) may appear: releasing an empty slot is a no-op there.
  for (int32_t s : d.plan.released)
    if (s != group_slot && s != slot1) want.push_back(s);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(released, want);
  EXPECT_EQ(std::count(d.plan.released.begin(), d.plan.released.end(), slot13), 0)
      << "the fork's child slot is not released after the fork";
}

TEST(SparsePlannerBadInput, ForksFromNothingOrIntoAHeldSlot) {
  SparseStepPlanner p(opts());
  EXPECT_THROW(p.on_fork(99, 100), Error) << "an unknown parent";
  p.plan_step(batch({{1, 10, 10}, {2, 10, 10}}), 0);
  try {
    p.on_fork(1, 2);
    FAIL() << "forked into a sequence that has a slot";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 2 forks from sequence 1 but already has a slot"), std::string::npos)
        << e.what();
  }
  // Once the cache rank failed, forks are nobody's business.
  p.fail_all();
  EXPECT_NO_THROW(p.on_fork(99, 100));
}


// Retained prefixes: an engine-like allocator with prefix caching, block tables in the batches.
struct RetentionRig {
  static constexpr int kPage = 16;
  PageAllocator pages{64, kPage, /*prefix_caching=*/true};
  SparseStepPlanner planner;
  std::vector<int32_t> prompt_a, prompt_b;
  explicit RetentionRig(int bound) : planner(retention_opts(bound)) {
    planner.set_page_allocator(&pages);
    for (int i = 0; i < 100; ++i) {
      prompt_a.push_back(1000 + i);
      prompt_b.push_back(5000 + i);
    }
  }
  static GpuSparseOptions retention_opts(int bound) {
    GpuSparseOptions o = opts();
    o.max_retained_prefix_tokens = bound;
    return o;
  }
  // Admits `id` for `prompt` with at most `reuse` cached tokens, as the engine does (peek, ask, match).
  int admit(uint64_t id, const std::vector<int32_t>& prompt, int reuse) {
    pages.admit(id);
    const std::vector<int32_t> cached = pages.peek_prefix(prompt.data(), static_cast<int>(prompt.size()), reuse);
    if (!cached.empty()) reuse = std::min(reuse, planner.reusable_prefix_tokens(id, cached));
    return pages.match_prefix(id, prompt.data(), static_cast<int>(prompt.size()), reuse);
  }
  // One step of `id`: `n` new tokens (appended here), its block table in the batch.
  StepDecision step(uint64_t id, int n, int64_t t) {
    if (!pages.contains(id)) pages.admit(id);  // a bystander sequence that carries the plan's news
    EXPECT_TRUE(pages.append(id, n));
    ForwardBatch b = batch({{id, n, pages.seq_len(id)}});
    b.block_table = pages.block_table(id);
    b.max_pages = static_cast<int>(b.block_table.size());
    return planner.plan_step(b, t);
  }
  void finish(uint64_t id) {
    pages.release(id);
    planner.on_release(id);
  }
  // `id` runs the 100 tokens of `prompt` (reusing what the cache allows of its first 99) at step `t`, and the engine
  // publishes its 6 whole pages.
  StepDecision prefill(uint64_t id, const std::vector<int32_t>& prompt, int64_t t) {
    admit(id, prompt, 99);
    StepDecision d = step(id, 100 - pages.seq_len(id), t);
    pages.cache_prompt(id, prompt.data(), 100);
    return d;
  }
};

TEST(SparsePlanner, AnEndedSequencesPublishedPrefixIsRetainedAndReused) {
  RetentionRig g(1024);
  ASSERT_TRUE(g.planner.retention_on());
  EXPECT_EQ(g.admit(1, g.prompt_a, 36), 0) << "nothing cached yet";
  StepDecision d = g.step(1, 100, 0);
  const int slot_a = d.plan.rows[0].slot;
  g.pages.cache_prompt(1, g.prompt_a.data(), 100);  // the engine publishes the prompt's 6 whole pages
  g.step(1, 1, 1);
  g.finish(1);
  d = g.step(2, 10, 2);  // another sequence's step carries the retain, before the releases
  ASSERT_EQ(d.plan.retains.size(), 1u);
  EXPECT_EQ(d.plan.retains[0].slot, slot_a);
  EXPECT_EQ(d.plan.retains[0].tokens, 96) << "the published whole pages, not the generated token";
  EXPECT_EQ(d.plan.released, std::vector<int32_t>{slot_a});
  const int32_t id = d.plan.retains[0].id;
  EXPECT_EQ(g.planner.retained_tokens(), 96);
  // The same prompt again: at most 36 tokens may be reused (the rest recomputed) -> 2 whole pages, from the retained
  // prefix; its first row forks it.
  EXPECT_EQ(g.admit(3, g.prompt_a, 36), 32);
  d = g.step(3, 68, 3);
  ASSERT_EQ(d.plan.forks.size(), 1u);
  EXPECT_EQ(d.plan.forks[0].parent, id);
  EXPECT_EQ(d.plan.forks[0].tokens, 32);
  EXPECT_EQ(d.plan.forks[0].flags, pair::kForkFromRetained);
  EXPECT_EQ(d.plan.forks[0].child, d.plan.rows[0].slot);
  EXPECT_EQ(d.plan.rows[0].flags, 0u) << "continues at position 32: not fresh";
  EXPECT_EQ(d.plan.rows[0].ctx_len, 100);
  EXPECT_EQ(g.planner.retention_stats().reused, 1u);
  EXPECT_EQ(g.planner.retention_stats().reused_tokens, 32u);
  // Another prompt: nothing retained holds it, nothing is reused.
  g.pages.admit(4);
  EXPECT_EQ(g.planner.reusable_prefix_tokens(4, {60, 61}), 0);
}

// The bound drops the least recently used prefix; a pinned one (a hit whose first row has not run) stays; one already
// covered is not retained twice.
TEST(SparsePlanner, RetainedPrefixesAreBoundedCoveredAndPinned) {
  RetentionRig g(96);  // one 6-page prefix
  g.prefill(1, g.prompt_a, 0);
  g.finish(1);
  StepDecision d = g.step(9, 1, 1);
  ASSERT_EQ(d.plan.retains.size(), 1u);
  const int32_t a = d.plan.retains[0].id;
  // A second sequence of the same prompt (a prefix-cache hit) ends: its prefix is the retained one, not retained again.
  EXPECT_EQ(g.admit(2, g.prompt_a, 99), 96);
  d = g.step(2, 4, 2);
  ASSERT_EQ(d.plan.forks.size(), 1u);
  g.finish(2);
  d = g.step(9, 1, 3);
  EXPECT_TRUE(d.plan.retains.empty()) << "already retained";
  EXPECT_TRUE(d.plan.drops.empty());
  // Prompt B's prefix goes over the bound, so A (least recently used, unpinned) is dropped.
  g.prefill(3, g.prompt_b, 4);
  g.finish(3);
  d = g.step(9, 1, 5);
  ASSERT_EQ(d.plan.retains.size(), 1u);
  EXPECT_EQ(d.plan.drops, std::vector<int32_t>{a});
  EXPECT_EQ(g.planner.num_retained(), 1);
  const int32_t b = d.plan.retains[0].id;
  // A hit on B pins it: prompt A's new prefix cannot push it out (A is not retained, the bound holds).
  EXPECT_EQ(g.admit(4, g.prompt_b, 99), 96);
  g.prefill(5, g.prompt_a, 6);
  g.finish(5);
  d = g.step(4, 4, 7);  // 4's first row: its fork from B; A is not retained (B is pinned and the bound holds one)
  ASSERT_EQ(d.plan.forks.size(), 1u);
  EXPECT_EQ(d.plan.forks[0].parent, b);
  EXPECT_TRUE(d.plan.retains.empty()) << "the bound would need the pinned prefix dropped";
  EXPECT_TRUE(d.plan.drops.empty());
  EXPECT_EQ(g.planner.num_retained(), 1);
}

// A retained prefix whose first page the engine has reused since can never be hit again: the next retain drops it,
// though the bound would hold both.
TEST(SparsePlanner, AStaleRetainedPrefixIsDroppedAtTheNextRetain) {
  RetentionRig g(1024);
  g.admit(1, g.prompt_a, 99);
  g.step(1, 100, 0);
  const std::vector<int32_t> a_pages(g.pages.block_table(1).begin(), g.pages.block_table(1).begin() + 6);
  g.pages.cache_prompt(1, g.prompt_a.data(), 100);
  g.finish(1);
  StepDecision d = g.step(9, 1, 1);
  ASSERT_EQ(d.plan.retains.size(), 1u);
  const int32_t a = d.plan.retains[0].id;
  g.finish(9);
  g.pages.admit(4);
  EXPECT_EQ(g.planner.reusable_prefix_tokens(4, a_pages), 96) << "A's pages, still the same";
  g.planner.on_release(4);  // unpins
  g.pages.release(4);
  // Another sequence takes every page: the evictable cached ones of prompt A are reused (new serials).
  g.pages.admit(50);
  ASSERT_TRUE(g.pages.append(50, 64 * RetentionRig::kPage));
  g.pages.release(50);
  g.pages.admit(5);
  EXPECT_EQ(g.planner.reusable_prefix_tokens(5, a_pages), 0) << "nothing of A can be hit";
  g.planner.on_release(5);
  g.pages.release(5);
  // Prompt B ends: its prefix is retained and the stale A dropped in the same plan.
  g.prefill(3, g.prompt_b, 2);
  g.finish(3);
  d = g.step(8, 1, 3);
  ASSERT_EQ(d.plan.retains.size(), 1u);
  EXPECT_EQ(d.plan.drops, std::vector<int32_t>{a});
  EXPECT_EQ(g.planner.num_retained(), 1);
  EXPECT_EQ(g.planner.retained_tokens(), 96);
  EXPECT_EQ(g.planner.retention_stats().dropped, 1u);
}

// A sequence that starts past position 0 without a hit (a group prefill running when its cache rank was replaced)
// starts over on the cache rank with that step's tokens and stays dense; its samples stay dense too.
TEST(SparsePlanner, ASequenceStartingMidwayWithoutAHitStartsOverDense) {
  RetentionRig g(1024);
  StepDecision d = g.step(1, 8, 0);  // admitted here: 8 tokens at position 0
  d = g.step(7, 1, 0);
  g.pages.admit(2);
  ASSERT_TRUE(g.pages.append(2, 120));
  ForwardBatch b = batch({{2, 8, 120}}, false);  // positions 112..119, no reusable_prefix_tokens chose a prefix
  b.block_table = g.pages.block_table(2);
  b.max_pages = static_cast<int>(b.block_table.size());
  d = g.planner.plan_step(b, 1);
  EXPECT_TRUE(d.plan.forks.empty());
  EXPECT_EQ(d.plan.rows[0].flags, static_cast<uint32_t>(kRowFresh));
  EXPECT_EQ(d.plan.rows[0].ctx_len, 8) << "the cache rank's slot holds this step's tokens alone";
  g.planner.on_fork(2, 20);
  g.planner.on_release(2);
  ASSERT_TRUE(g.pages.append(2, 0));
  g.pages.admit(20);
  ASSERT_TRUE(g.pages.append(20, 121));
  ForwardBatch c = batch({{20, 1, 121}});
  c.block_table = g.pages.block_table(20);
  c.max_pages = static_cast<int>(c.block_table.size());
  d = g.planner.plan_step(c, 2);
  EXPECT_EQ(d.plan.rows[0].ctx_len, 9) << "the sample continues the group's started-over slot";
  EXPECT_EQ(d.plan.rows[0].flags, 0u) << "past the threshold, but its cache rank lacks the prefix: dense";
  // Once the cache rank failed, every cached page may be reused: the sequences decode densely.
  g.planner.fail_all();
  EXPECT_FALSE(g.planner.retention_on());
  EXPECT_GE(g.planner.reusable_prefix_tokens(3, {0, 1}), 32);
}

// n samples of a prompt whose whole shared part is retained: the group never has a row (the engine forks it at
// admission), so each sample forks the retained prefix; a sample detached while it waited (a re-pairing) forks too,
// not as a fresh row; the group's pin goes with its release.
TEST(SparsePlanner, SamplesOfAWhollyCachedGroupForkTheRetainedPrefix) {
  RetentionRig g(1024);
  g.prefill(1, g.prompt_a, 0);
  g.finish(1);
  StepDecision d = g.step(9, 1, 1);
  ASSERT_EQ(d.plan.retains.size(), 1u);
  const int32_t a = d.plan.retains[0].id;
  g.planner.detach(12);  // waiting when its cache rank was replaced
  EXPECT_EQ(g.admit(10, g.prompt_a, 96), 96) << "the group's shared part, all cached";
  for (uint64_t c : {11, 12}) g.planner.on_fork(10, c);
  g.planner.on_release(10);
  for (uint64_t c : {11, 12}) {
    g.pages.fork(10, c);
  }
  g.pages.release(10);
  ForwardBatch b = batch({{11, 4, 100}, {12, 4, 100}});
  for (uint64_t c : {11, 12}) ASSERT_TRUE(g.pages.append(c, 4));
  b.max_pages = 7;
  b.block_table.assign(14, -1);
  for (int r = 0; r < 2; ++r) {
    const auto& bt = g.pages.block_table(r == 0 ? 11 : 12);
    std::copy(bt.begin(), bt.end(), b.block_table.begin() + r * 7);
  }
  d = g.planner.plan_step(b, 2);
  ASSERT_EQ(d.plan.forks.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(d.plan.forks[i].parent, a);
    EXPECT_EQ(d.plan.forks[i].flags, pair::kForkFromRetained);
    EXPECT_EQ(d.plan.forks[i].tokens, 96);
    EXPECT_EQ(d.plan.forks[i].child, d.plan.rows[i].slot);
    EXPECT_EQ(d.plan.rows[i].flags, 0u) << "not fresh: the detached sample forks too";
    EXPECT_EQ(d.plan.rows[i].ctx_len, 100);
  }
  EXPECT_NO_THROW(pair::decode_gpu_plan(pair::encode_gpu_plan(d.plan).data(), pair::kGpuPlanBytes, 8, "x"));
  EXPECT_EQ(g.planner.retention_stats().reused, 2u);
  EXPECT_EQ(g.planner.retention_stats().reused_tokens, 192u);
}

TEST(SparsePlannerBadInput, OptionsSlotsAndBatches) {
  GpuSparseOptions o = opts();
  o.sparse.selection.local_window = 0;
  try {
    SparseStepPlanner p(o);
    FAIL() << "local_window 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("local_window"), std::string::npos) << e.what();
  }
  o = opts();
  o.max_slots = pair::gpu_plan_max_rows() + 1;
  EXPECT_THROW(SparseStepPlanner{o}, Error);
  o = opts();
  o.max_slots = 2;
  SparseStepPlanner p(o);
  try {
    p.plan_step(batch({{1, 3, 3}, {2, 3, 3}, {3, 3, 3}}), 0);
    FAIL() << "three sequences in two slots";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 2 sequences"), std::string::npos) << e.what();
  }
  SparseStepPlanner q(opts());
  ForwardBatch b = batch({{1, 3, 3}});
  b.seq_ids.clear();
  EXPECT_THROW(q.plan_step(b, 0), Error);
}

}  // namespace
}  // namespace spade

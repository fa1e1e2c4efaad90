// The GPU data plane's plan and pair hello (pair/gpu_plan.h): round trips, the selection groups, message sizes,
// and every validation rule naming the peer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "pair/gpu_plan.h"
#include "common/error.h"

namespace spade::pair {
namespace {

GpuStepPlan sample() {
  GpuStepPlan p;
  p.step = 1234567890123;
  p.rows = {{3, 17, 17, kRowFresh}, {0, 1, 5000, kRowSelect}, {7, 1, 300, kRowSelect | kRowFirstSelect},
            {1, 1, 90, 0}, {5, 1, 4096, kRowSelect}};
  p.released = {2, 6};
  p.forks = {{4, 0, 4096, 0}, {6, 0, 4096, 0}, {5, 12, 96, kForkFromRetained}};
  p.retains = {{1, 12, 64}};
  p.drops = {3, 40};
  return p;
}

TEST(GpuPlan, RoundTripsAndGroupsTheSelectionRows) {
  const GpuStepPlan p = sample();
  const std::vector<uint8_t> b = encode_gpu_plan(p);
  ASSERT_EQ(b.size(), kGpuPlanBytes);
  const GpuStepPlan q = decode_gpu_plan(b.data(), b.size(), 8, "inference rank 1");
  EXPECT_EQ(q.step, p.step);
  ASSERT_EQ(q.rows.size(), p.rows.size());
  for (size_t i = 0; i < p.rows.size(); ++i) {
    EXPECT_EQ(q.rows[i].slot, p.rows[i].slot);
    EXPECT_EQ(q.rows[i].q_len, p.rows[i].q_len);
    EXPECT_EQ(q.rows[i].ctx_len, p.rows[i].ctx_len);
    EXPECT_EQ(q.rows[i].flags, p.rows[i].flags);
  }
  EXPECT_EQ(q.released, p.released);
  ASSERT_EQ(q.forks.size(), p.forks.size());
  for (size_t i = 0; i < p.forks.size(); ++i) {
    EXPECT_EQ(q.forks[i].child, p.forks[i].child);
    EXPECT_EQ(q.forks[i].parent, p.forks[i].parent);
    EXPECT_EQ(q.forks[i].tokens, p.forks[i].tokens);
    EXPECT_EQ(q.forks[i].flags, p.forks[i].flags);
  }
  ASSERT_EQ(q.retains.size(), 1u);
  EXPECT_EQ(q.retains[0].slot, 1);
  EXPECT_EQ(q.retains[0].id, 12);
  EXPECT_EQ(q.retains[0].tokens, 64);
  EXPECT_EQ(q.drops, p.drops);
  EXPECT_EQ(q.total_tokens(), 21);
  EXPECT_EQ(q.steady_rows(), (std::vector<int>{1, 4}));
  EXPECT_EQ(q.first_rows(), (std::vector<int>{2}));
}

TEST(GpuPlan, PackSizesFollowThePlan) {
  ModelConfig c;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  const GpuStepPlan p = sample();
  const GpuPackSizes s = gpu_pack_sizes(p, 4, c, 2048, 256);
  EXPECT_EQ(s.up_bytes, static_cast<size_t>(4) * 21 * (32 + 16) * 128 * 2);
  EXPECT_EQ(s.steady.rows, static_cast<size_t>(4) * 2 * 8);
  EXPECT_EQ(s.steady.cap, 256);
  EXPECT_EQ(s.first.rows, static_cast<size_t>(4) * 1 * 8);
  EXPECT_EQ(s.first.cap, 2048);
  // Sections in order, 256-byte aligned, the K / V sections rows x cap x D x 2 bytes.
  for (const DeltaLayout* l : {&s.steady, &s.first}) {
    EXPECT_EQ(l->slots, 0u);
    EXPECT_LT(l->slots, l->positions);
    EXPECT_LT(l->positions, l->info);
    EXPECT_LT(l->info, l->k);
    EXPECT_EQ(l->v - l->k, l->rows * l->cap * 128 * 2);
    EXPECT_EQ(l->bytes - l->v, l->rows * l->cap * 128 * 2);
    for (size_t x : {l->positions, l->info, l->k, l->v, l->bytes}) EXPECT_EQ(x % 256, 0u);
  }
  GpuStepPlan none;
  none.rows = {{0, 1, 10, 0}};
  EXPECT_EQ(gpu_pack_sizes(none, 4, c, 2048, 256).steady.bytes, 0u);
}

// Decoding a plan with one field broken must fail naming the peer and the problem.
void expect_refused(GpuStepPlan p, const std::string& key, int max_slots = 8) {
  const std::vector<uint8_t> b = encode_gpu_plan(p);
  try {
    decode_gpu_plan(b.data(), b.size(), max_slots, "inference rank 4 (#1)");
    ADD_FAILURE() << "accepted a plan that should fail with '" << key << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inference rank 4 (#1)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
  }
}

TEST(GpuPlan, MalformedPlansAreRefused) {
  GpuStepPlan p = sample();
  p.rows[1].slot = 3;  // used twice
  expect_refused(p, "used twice");
  p = sample();
  p.rows[0].slot = 8;
  expect_refused(p, "slot 8");
  p = sample();
  p.rows[3].q_len = 0;
  expect_refused(p, "0 tokens");
  p = sample();
  p.rows[3].ctx_len = 0;
  expect_refused(p, "for context 0");
  p = sample();
  p.rows[3].flags = kRowFirstSelect;  // FIRST without SELECT
  expect_refused(p, "bad flags");
  p = sample();
  p.rows[3].flags = 64;
  expect_refused(p, "bad flags");
  p = sample();
  p.rows[1].flags |= kRowFresh;  // fresh but with context
  expect_refused(p, "fresh sequence");
  p = sample();
  p.released = {9};
  expect_refused(p, "released slot 9");
  p = sample();
  p.forks[0].child = 8;
  expect_refused(p, "fork 0: child slot 8");
  p = sample();
  p.forks[1].parent = -1;
  expect_refused(p, "fork 1: child slot 6 from parent slot -1");
  p = sample();
  p.forks[0].parent = 4;  // its own parent
  expect_refused(p, "fork 0");
  p = sample();
  p.forks[1].child = 4;  // a child twice
  expect_refused(p, "a child twice");
  p = sample();
  p.forks[0].tokens = 0;
  expect_refused(p, "(0 tokens, flags 0x0)");
  p = sample();
  p.forks[0].flags = 2;
  expect_refused(p, "bad flags");
  p = sample();
  p.forks[2].parent = 8;  // a retained prefix's id is not a slot: any id >= 0
  EXPECT_NO_THROW(decode_gpu_plan(encode_gpu_plan(p).data(), kGpuPlanBytes, 8, "x"));
  p.forks[2].parent = -2;
  expect_refused(p, "fork 2: child slot 5 from parent retained prefix -2");
  p = sample();
  p.retains[0].slot = 9;
  expect_refused(p, "retain 0: slot 9");
  p = sample();
  p.retains[0].id = -1;
  expect_refused(p, "retain 0");
  p = sample();
  p.retains[0].tokens = 0;
  expect_refused(p, "(0 tokens)");
  p = sample();
  p.drops[1] = -5;
  expect_refused(p, "dropped retained prefix -5");
  p = sample();
  p.forks[0].child = 3;  // row 0 (slot 3) is fresh: it cannot also start from a fork
  expect_refused(p, "slot 3 is a fork's child and a fresh row");
  std::vector<uint8_t> b = encode_gpu_plan(sample());
  b[0] ^= 1;
  EXPECT_THROW(decode_gpu_plan(b.data(), b.size(), 8, "inference rank 4"), Error);
  EXPECT_THROW(decode_gpu_plan(b.data(), b.size() - 1, 8, "inference rank 4"), Error);
  GpuStepPlan big;
  big.rows.resize(static_cast<size_t>(gpu_plan_max_rows()) + 1, GpuPlanRow{0, 1, 1, 0});
  EXPECT_THROW(encode_gpu_plan(big), Error);
  GpuStepPlan many_forks;
  many_forks.forks.resize(static_cast<size_t>(gpu_plan_max_rows()) + 1, GpuPlanFork{1, 0, 16, 0});
  EXPECT_THROW(encode_gpu_plan(many_forks), Error);
  GpuStepPlan many_drops;
  many_drops.drops.resize(static_cast<size_t>(gpu_plan_max_rows()) + 1, 0);
  EXPECT_THROW(encode_gpu_plan(many_drops), Error);
  // A plan at every limit at once still fits its fixed size.
  GpuStepPlan full;
  const int most = gpu_plan_max_rows();
  for (int i = 0; i < most; ++i) {
    full.rows.push_back({i, 1, 2, 0});
    full.released.push_back(i);
  }
  for (int i = 0; i + 1 < most; ++i) full.forks.push_back({i + 1, 0, 16, 0});
  for (int i = 0; i < most; ++i) {
    full.retains.push_back({i, i, 16});
    full.drops.push_back(i);
  }
  const std::vector<uint8_t> fb = encode_gpu_plan(full);
  const GpuStepPlan fq = decode_gpu_plan(fb.data(), fb.size(), most, "inference rank 4");
  EXPECT_EQ(fq.rows.size(), full.rows.size());
  EXPECT_EQ(fq.forks.size(), full.forks.size());
  EXPECT_EQ(fq.retains.size(), full.retains.size());
  EXPECT_EQ(fq.drops.size(), full.drops.size());
}


ModelConfig hello_model() {
  ModelConfig c;
  c.num_layers = 36;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  return c;
}

GpuPairHello sample_hello() {
  GpuPairHello h;
  h.num_layers = 36;
  h.num_q_heads = 32;
  h.num_kv_heads = 8;
  h.head_dim = 128;
  h.layers_per_pack = 6;
  h.token_budget = 2048;
  h.local_window = 32;
  h.delta_capacity = 256;
  h.max_slots = 64;
  h.max_step_tokens = 2048;
  h.num_pages = 40000;
  h.page_size = 16;
  h.max_pages_per_seq = 2560;
  return h;
}

TEST(GpuPairHello, RoundTrips) {
  const std::vector<uint8_t> b = encode_gpu_hello(sample_hello());
  ASSERT_EQ(b.size(), kGpuHelloBytes);
  const GpuPairHello h = decode_gpu_hello(b.data(), b.size(), hello_model(), "inference rank 1");
  const GpuPairHello w = sample_hello();
  EXPECT_EQ(h.num_layers, w.num_layers);
  EXPECT_EQ(h.num_q_heads, w.num_q_heads);
  EXPECT_EQ(h.num_kv_heads, w.num_kv_heads);
  EXPECT_EQ(h.head_dim, w.head_dim);
  EXPECT_EQ(h.layers_per_pack, w.layers_per_pack);
  EXPECT_EQ(h.token_budget, w.token_budget);
  EXPECT_EQ(h.local_window, w.local_window);
  EXPECT_EQ(h.delta_capacity, w.delta_capacity);
  EXPECT_EQ(h.max_slots, w.max_slots);
  EXPECT_EQ(h.max_step_tokens, w.max_step_tokens);
  EXPECT_EQ(h.num_pages, w.num_pages);
  EXPECT_EQ(h.page_size, w.page_size);
  EXPECT_EQ(h.max_pages_per_seq, w.max_pages_per_seq);
}

void expect_hello_error(const GpuPairHello& h, const ModelConfig& m, const std::string& needle) {
  const std::vector<uint8_t> b = encode_gpu_hello(h);
  try {
    decode_gpu_hello(b.data(), b.size(), m, "inference rank 1 (#0)");
    ADD_FAILURE() << "accepted; wanted an error with '" << needle << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_NE(msg.find("inference rank 1 (#0)"), std::string::npos) << msg;
  }
}

TEST(GpuPairHello, MismatchedModelsAndBadLimitsAreRefusedByName) {
  ModelConfig other = hello_model();
  other.num_layers = 28;
  expect_hello_error(sample_hello(), other, "full-attention layers");
  other = hello_model();
  other.num_kv_heads = 4;
  expect_hello_error(sample_hello(), other, "KV heads");
  other = hello_model();
  other.head_dim = 64;
  expect_hello_error(sample_hello(), other, "head_dim");
  GpuPairHello h = sample_hello();
  h.delta_capacity = h.token_budget + 1;
  expect_hello_error(h, hello_model(), "delta capacity");
  h = sample_hello();
  h.max_slots = gpu_plan_max_rows() + 1;
  expect_hello_error(h, hello_model(), "slots");
  h = sample_hello();
  h.num_pages = 0;
  expect_hello_error(h, hello_model(), "pages");
  h = sample_hello();
  h.local_window = 0;  // the server's selection needs R >= 1
  expect_hello_error(h, hello_model(), "local window 0");
  // Not a hello: a plan, a short message, a future version.
  const std::vector<uint8_t> plan = encode_gpu_plan(sample());
  EXPECT_THROW(decode_gpu_hello(plan.data(), kGpuHelloBytes, hello_model(), "x"), Error);
  std::vector<uint8_t> b = encode_gpu_hello(sample_hello());
  EXPECT_THROW(decode_gpu_hello(b.data(), b.size() - 1, hello_model(), "x"), Error);
  b[4] = 9;
  try {
    decode_gpu_hello(b.data(), b.size(), hello_model(), "inference rank 7");
    ADD_FAILURE() << "accepted version 9";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("version 9"), std::string::npos) << e.what();
  }
}


TEST(GpuPlan, TheClosePlanEndsTheStreamAndNoOtherPlanHasANegativeStep) {
  const std::vector<uint8_t> b = encode_gpu_plan(GpuStepPlan::close_plan());
  const GpuStepPlan p = decode_gpu_plan(b.data(), b.size(), 8, "inference rank 1");
  EXPECT_TRUE(p.is_close());
  EXPECT_TRUE(p.rows.empty());
  EXPECT_FALSE(sample().is_close());
  GpuStepPlan bad = GpuStepPlan::close_plan();
  bad.rows = {{0, 1, 1, kRowFresh}};
  std::vector<uint8_t> e = encode_gpu_plan(bad);
  EXPECT_THROW(decode_gpu_plan(e.data(), e.size(), 8, "inference rank 1"), Error);
  bad = sample();
  bad.step = -7;
  e = encode_gpu_plan(bad);
  try {
    decode_gpu_plan(e.data(), e.size(), 8, "inference rank 1");
    ADD_FAILURE() << "a negative step was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("step -7"), std::string::npos) << err.what();
  }
}

TEST(GpuPlan, AFlushCarriesReleasesRetainsAndDropsButNoRowsOrForks) {
  GpuStepPlan f;
  f.step = GpuStepPlan::kFlushStep;
  f.released = {3, 5};
  f.retains = {{3, 9, 32}};
  f.drops = {4};
  const std::vector<uint8_t> b = encode_gpu_plan(f);
  const GpuStepPlan p = decode_gpu_plan(b.data(), b.size(), 8, "inference rank 1");
  EXPECT_TRUE(p.is_flush());
  EXPECT_FALSE(p.is_close());
  EXPECT_TRUE(p.rows.empty());
  EXPECT_EQ(p.released, (std::vector<int32_t>{3, 5}));
  ASSERT_EQ(p.retains.size(), 1u);
  EXPECT_EQ(p.retains[0].slot, 3);
  EXPECT_EQ(p.retains[0].id, 9);
  EXPECT_EQ(p.retains[0].tokens, 32);
  EXPECT_EQ(p.drops, (std::vector<int32_t>{4}));
  EXPECT_FALSE(sample().is_flush());
  GpuStepPlan with_row = f;
  with_row.rows = {{0, 1, 1, kRowFresh}};
  expect_refused(with_row, "only the close plan (step -1, empty) and a flush (step -2, no rows, no forks)");
  GpuStepPlan with_fork = f;
  with_fork.forks = {{1, 2, 16, 0}};
  expect_refused(with_fork, "step -2 (0 rows, 2 released slots, 1 forks");
}

}  // namespace
}  // namespace spade::pair

// The GPU data plane's plan (cache_rank/gpu_plan.h): round trip, the selection groups, message sizes, and every
// validation rule naming the peer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache_rank/gpu_plan.h"
#include "common/error.h"

namespace spade::cache {
namespace {

GpuStepPlan sample() {
  GpuStepPlan p;
  p.step = 1234567890123;
  p.rows = {{3, 17, 17, kRowFresh}, {0, 1, 5000, kRowSelect}, {7, 1, 300, kRowSelect | kRowFirstSelect},
            {1, 1, 90, 0}, {5, 1, 4096, kRowSelect}};
  p.released = {2, 6};
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
  std::vector<uint8_t> b = encode_gpu_plan(sample());
  b[0] ^= 1;
  EXPECT_THROW(decode_gpu_plan(b.data(), b.size(), 8, "inference rank 4"), Error);
  EXPECT_THROW(decode_gpu_plan(b.data(), b.size() - 1, 8, "inference rank 4"), Error);
  GpuStepPlan big;
  big.rows.resize(static_cast<size_t>(gpu_plan_max_rows()) + 1, GpuPlanRow{0, 1, 1, 0});
  EXPECT_THROW(encode_gpu_plan(big), Error);
}

}  // namespace
}  // namespace spade::cache

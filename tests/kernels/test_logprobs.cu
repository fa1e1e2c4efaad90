// GPU test of logprob_rows (kernels/layer_ops.cuh) against its CPU reference logprobs_ref (kernels/sampling_ref.h):
// the sampled token's logprob and the top n <= 20 alternatives of each row, written compactly (n + 1 entries per row
// at the row's offset, rows with n < 0 skipped), on Qwen3's vocabulary and odd small ones, every logits dtype, ties,
// NaN / -inf, an all -inf row, and invalid parameters. Outputs are poisoned with 0xFF before every launch.
//
// Bounds: ids exactly the reference's; values within 1e-5 + 2^-20 |ref| of it (the kernel sums exp in fp32 per CTA,
// the reference in double; both subtract the same fp32 maximum).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/sampling.h"
#include "kernels/layer_ops.cuh"
#include "kernels/sampling_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::from_bits;
using spade::test::name_dtype;
using spade::test::name_ints;
using spade::test::to_bits;

constexpr int kVocab = 151936;

struct LogprobCase {
  DType logits_dtype = DType::F32;
  int vocab = 0;
  int stride = 0;
  int pattern = 0;             // 0 Gaussian (sigma 3), 1 multiples of 0.25 (many ties), 2 with NaN / -inf entries
  std::vector<int> top_n;      // per row: -1 skip, else 0..20
  uint64_t seed = 0;
};

std::string case_name(const LogprobCase& c) {
  static const char* const kPattern[] = {"gaussian", "ties", "naninf"};
  return std::string(name_dtype(c.logits_dtype)) + "_vocab" + std::to_string(c.vocab) + "_stride" +
         std::to_string(c.stride) + "_" + kPattern[c.pattern] + "_n" + name_ints(c.top_n);
}

void PrintTo(const LogprobCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<LogprobCase> kLogprobCases = {
    // Qwen3 vocabulary, every logits dtype; bf16 of 0.25-multiples: many exact ties at the cut
    {.logits_dtype = DType::F32, .vocab = kVocab, .stride = kVocab, .pattern = 0, .top_n = {20, 0, 5, -1, 1, 20}, .seed = 1},
    {.logits_dtype = DType::BF16, .vocab = kVocab, .stride = kVocab, .pattern = 1, .top_n = {20, 7, 20, 3}, .seed = 2},
    {.logits_dtype = DType::F16, .vocab = kVocab, .stride = kVocab, .pattern = 0, .top_n = {-1, 20, -1, 2}, .seed = 3},
    // odd vocabularies and strides (the scalar path), NaN / -inf entries, fewer tokens than asked for
    {.logits_dtype = DType::F32, .vocab = 33333, .stride = 33335, .pattern = 2, .top_n = {20, 4, 0}, .seed = 4},
    {.logits_dtype = DType::F32, .vocab = 7, .stride = 9, .pattern = 1, .top_n = {20, 3, -1, 7}, .seed = 5},
    {.logits_dtype = DType::BF16, .vocab = 1, .stride = 1, .pattern = 0, .top_n = {20, 0}, .seed = 6},
    {.logits_dtype = DType::F16, .vocab = 1000, .stride = 1000, .pattern = 2, .top_n = {19, 20, 1}, .seed = 7},
};
// clang-format on

class LogprobGpu : public ::testing::TestWithParam<LogprobCase> {};

/// Runs logprob_rows on `f32` (rows x stride, already representable in `lt`) and compares with logprobs_ref.
void run_case(DType lt, int vocab, int stride, const std::vector<float>& f32, const std::vector<int>& top_n,
              const std::vector<int32_t>& tokens) {
  const int rows = static_cast<int>(top_n.size());
  DevBuf<float> d32;
  DevBuf<uint16_t> d16;
  if (lt == DType::F32) {
    d32.upload(f32);
  } else {
    std::vector<uint16_t> bits(f32.size());
    for (size_t i = 0; i < f32.size(); ++i) bits[i] = to_bits(lt, f32[i]);
    d16.upload(bits);
  }
  std::vector<int32_t> offset(static_cast<size_t>(rows));
  int total = 0;
  for (int r = 0; r < rows; ++r) {
    offset[static_cast<size_t>(r)] = total;
    if (top_n[static_cast<size_t>(r)] >= 0) total += std::min(top_n[static_cast<size_t>(r)], vocab) + 1;
  }
  DevBuf<int32_t> d_tokens, d_n, d_off;
  d_tokens.upload(tokens);
  d_n.upload(std::vector<int32_t>(top_n.begin(), top_n.end()));
  d_off.upload(offset);
  DevBuf<LogprobEntry> out(static_cast<size_t>(total) + 1);  // + 1: a sentinel after the last row
  out.poison();
  LogprobParams p;
  p.logits_dtype = lt;
  p.logits = lt == DType::F32 ? static_cast<const void*>(d32.get()) : d16.get();
  p.tokens = d_tokens.get();
  p.top_n = d_n.get();
  p.out_offset = d_off.get();
  p.out = out.get();
  p.rows = rows;
  p.vocab = vocab;
  p.logits_stride = stride;
  SPADE_CUDA_OK(logprob_rows(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<LogprobEntry> got = out.download();
  for (int r = 0; r < rows; ++r) {
    if (top_n[static_cast<size_t>(r)] < 0) continue;
    const float* row = &f32[static_cast<size_t>(r) * stride];
    const std::vector<LogprobEntry> want = logprobs_ref(row, vocab, tokens[static_cast<size_t>(r)],
                                                        top_n[static_cast<size_t>(r)]);
    for (size_t i = 0; i < want.size(); ++i) {
      const LogprobEntry& g = got[static_cast<size_t>(offset[static_cast<size_t>(r)]) + i];
      EXPECT_EQ(g.id, want[i].id) << "row " << r << " entry " << i;
      if (std::isinf(want[i].logprob)) {
        EXPECT_EQ(g.logprob, want[i].logprob) << "row " << r << " entry " << i;
      } else {
        EXPECT_NEAR(g.logprob, want[i].logprob, 1e-5 + std::ldexp(std::fabs(want[i].logprob), -20))
            << "row " << r << " entry " << i << " id " << want[i].id;
      }
    }
  }
  // Nothing written past the rows' entries.
  EXPECT_EQ(got.back().id, -1);
}

TEST_P(LogprobGpu, MatchesReference) {
  const LogprobCase& c = GetParam();
  std::mt19937_64 rng(c.seed);
  const int rows = static_cast<int>(c.top_n.size());
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> f32(static_cast<size_t>(rows) * c.stride, 0.f);
  for (float& x : f32) {
    x = d(rng);
    if (c.pattern == 1) x = std::round(x * 4.f) / 4.f;
    if (c.pattern == 2 && rng() % 50 == 0) x = (rng() % 2) ? std::nanf("") : -std::numeric_limits<float>::infinity();
    if (c.logits_dtype != DType::F32) x = from_bits(c.logits_dtype, to_bits(c.logits_dtype, x));
  }
  // Sampled tokens: the argmax, a random token, and (pattern 2) a token with a -inf logit where there is one.
  std::vector<int32_t> tokens(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    const float* row = &f32[static_cast<size_t>(r) * c.stride];
    tokens[static_cast<size_t>(r)] = r % 2 == 0 ? argmax_ref(row, c.vocab) : static_cast<int32_t>(rng() % c.vocab);
    if (c.pattern == 2 && r == 1)
      for (int i = 0; i < c.vocab; ++i)
        if (!(row[i] > -std::numeric_limits<float>::infinity())) tokens[static_cast<size_t>(r)] = i;
  }
  run_case(c.logits_dtype, c.vocab, c.stride, f32, c.top_n, tokens);
}

INSTANTIATE_TEST_SUITE_P(, LogprobGpu, ::testing::ValuesIn(kLogprobCases), spade::test::CaseName());

TEST_F(LogprobGpu, AllNegInfRowIsUniformAndInfiniteMaximumTakesAllMass) {
  const float ninf = -std::numeric_limits<float>::infinity(), inf = std::numeric_limits<float>::infinity();
  // row 0: all -inf / NaN (uniform: -log 5 each); row 1: two +inf (-log 2 each, every other token -inf).
  const std::vector<float> f32 = {ninf, std::nanf(""), ninf, ninf, ninf, 1.f, inf, 3.f, inf, ninf};
  run_case(DType::F32, 5, 5, f32, {3, 4}, {2, 3});
  const std::vector<LogprobEntry> r0 = logprobs_ref(f32.data(), 5, 2, 3);
  EXPECT_NEAR(r0[0].logprob, -std::log(5.f), 1e-6);
  EXPECT_EQ(r0[1].id, 0);  // ties (NaN counts as -inf): lower id first
  const std::vector<LogprobEntry> r1 = logprobs_ref(f32.data() + 5, 5, 3, 4);
  EXPECT_NEAR(r1[0].logprob, -std::log(2.f), 1e-6);
  EXPECT_EQ(r1[1].id, 1);
  EXPECT_EQ(r1[3].logprob, ninf);
}

TEST_F(LogprobGpu, RejectsBadParameters) {
  DevBuf<float> l(8);
  DevBuf<int32_t> t(1), n(1), off(1);
  DevBuf<LogprobEntry> out(2);
  LogprobParams p;
  p.logits = l.get();
  p.tokens = t.get();
  p.top_n = n.get();
  p.out_offset = off.get();
  p.out = out.get();
  p.rows = 1;
  p.vocab = 8;
  auto expect_invalid = [](cudaError_t e, const char* what) {
    EXPECT_EQ(e, cudaErrorInvalidValue);
    EXPECT_NE(std::string(launch_error_detail()).find(what), std::string::npos) << launch_error_detail();
  };
  LogprobParams q = p;
  q.tokens = nullptr;
  expect_invalid(logprob_rows(q, nullptr), "tokens");
  q = p;
  q.out = nullptr;
  expect_invalid(logprob_rows(q, nullptr), "out");
  q = p;
  q.logits_stride = 4;
  expect_invalid(logprob_rows(q, nullptr), "logits_stride");
  q = p;
  q.logits_dtype = static_cast<DType>(7);
  expect_invalid(logprob_rows(q, nullptr), "logits_dtype");
  q = p;
  q.rows = 0;
  q.logits = nullptr;
  EXPECT_EQ(logprob_rows(q, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace spade::kernels

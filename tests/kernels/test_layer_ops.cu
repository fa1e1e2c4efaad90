// GPU tests of the per-layer ops (kernels/layer_ops.cuh) against their CPU references on fresh random bf16/fp16
// inputs (the references consume the exact fp32 images), outputs poisoned with 0xFF before every launch, Qwen3-8B
// shapes (hidden 4096, 32 q / 8 kv heads, head_dim 128, inter 12288, vocab 151936) and odd small ones, plus
// invalid parameters.
//
// Bounds: an output that the kernel rounds once from an fp32 value that agrees with the reference up to fp32
// rounding is within half an ulp of the reference's value plus that fp32 slack: |got - ref| <= 2^-8 |ref| (bf16) or
// 2^-10 |ref| (fp16), plus a small absolute term stated per test. Copies (embedding, v cache) and the residual sum
// are bit-exact; argmax and sampling are exact (token ids), sampling except where sampling_ref flags a draw within
// the fp32 expf slack of a boundary.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/kv_append_ref.h"
#include "kernels/layer_ops.cuh"
#include "kernels/rmsnorm_ref.h"
#include "kernels/rope_ref.h"
#include "kernels/sampling_ref.h"
#include "kernels/swiglu_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::dtype_str;
using spade::test::from_bits;
using spade::test::name_dtype;
using spade::test::name_ints;
using spade::test::random_half;
using spade::test::to_bits;
using spade::test::to_f32;

constexpr int kHidden = 4096, kHq = 32, kHkv = 8, kD = 128, kInter = 12288, kVocab = 151936;

double rel_bound(DType t) { return t == DType::BF16 ? 1.0 / 256 : 1.0 / 1024; }

/// Round an fp32 value to `t` and back.
float round_to(DType t, float x) { return from_bits(t, to_bits(t, x)); }

/// Element-wise |got - ref| <= rel |ref| + abs; reports the first few failures.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double rel, double abs,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(err <= rel * std::fabs(ref[i]) + abs)) {  // NaN fails
      if (++bad <= 5) ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " ref " << ref[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " elements out of bounds";
}

std::vector<float> randn(size_t n, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// =====================================================================================================================
// Embedding
// =====================================================================================================================

void run_embedding(DType dt, int vocab, int hidden, std::vector<int32_t> ids, bool expect_flag, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_str(dt)) + " vocab=" + std::to_string(vocab) + " hidden=" + std::to_string(hidden));
  std::mt19937_64 rng(seed);
  std::vector<float> t32;
  DevBuf<uint16_t> table;
  const std::vector<uint16_t> tb = random_half(dt, static_cast<size_t>(vocab) * hidden, 1.f, rng, &t32);
  table.upload(tb);
  DevBuf<int32_t> d_ids, flag;
  d_ids.upload(ids);
  flag.upload(std::vector<int32_t>{0});
  const int n = static_cast<int>(ids.size());
  DevBuf<uint16_t> out(static_cast<size_t>(n) * hidden);
  out.poison();
  EmbeddingParams p;
  p.dtype = dt;
  p.token_ids = d_ids.get();
  p.table = table.get();
  p.out = out.get();
  p.error_flag = flag.get();
  p.num_tokens = n;
  p.vocab_size = vocab;
  p.hidden = hidden;
  SPADE_CUDA_OK(embedding_gather(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = out.download();
  for (int t = 0; t < n; ++t) {
    const bool ok = ids[t] >= 0 && ids[t] < vocab;
    for (int i = 0; i < hidden; ++i) {
      const uint16_t want = ok ? tb[static_cast<size_t>(ids[t]) * hidden + i] : uint16_t{0};
      ASSERT_EQ(got[static_cast<size_t>(t) * hidden + i], want) << "token " << t << " id " << ids[t] << " col " << i;
    }
  }
  EXPECT_EQ(flag.download()[0], expect_flag ? 1 : 0);
}

struct EmbeddingCase {
  DType dtype = DType::BF16;
  int vocab = 0;
  int hidden = 0;
  std::vector<int32_t> ids;
  bool expect_flag = false;  // some id is out of range: its row is zero and the error flag is set
  uint64_t seed = 0;
};

std::string case_name(const EmbeddingCase& c) {
  return std::string(name_dtype(c.dtype)) + "_vocab" + std::to_string(c.vocab) + "_hidden" +
         std::to_string(c.hidden) +
         (c.ids.size() <= 8 ? "_ids" + name_ints(c.ids) : "_tokens" + std::to_string(c.ids.size())) +
         (c.expect_flag ? "_flagged" : "");
}

void PrintTo(const EmbeddingCase& c, std::ostream* os) {
  *os << case_name(c) << " ids=" << name_ints(c.ids) << " seed=" << c.seed;
}

/// Qwen3 ids: the first and last of the vocabulary, a repeat, <|endoftext|> and 31 random ones.
std::vector<int32_t> qwen3_ids() {
  std::vector<int32_t> ids = {0, kVocab - 1, 17, 17, 151643, 99999};
  std::mt19937_64 rng(5);
  for (int i = 0; i < 31; ++i) ids.push_back(static_cast<int32_t>(rng() % kVocab));
  return ids;
}

// clang-format off
const std::vector<EmbeddingCase> kEmbeddingCases = {
    {.dtype = DType::BF16, .vocab = kVocab, .hidden = kHidden, .ids = qwen3_ids(), .seed = 1},
    // odd hidden
    {.dtype = DType::F16, .vocab = 1000, .hidden = 100, .ids = {3, 999, 0, 500, 3}, .seed = 2},
    // out-of-range ids give zero rows and the flag
    {.dtype = DType::BF16, .vocab = 1000, .hidden = 64, .ids = {5, -1, 1000, INT_MAX, INT_MIN, 999},
     .expect_flag = true, .seed = 3},
    {.dtype = DType::F16, .vocab = 77, .hidden = 33, .ids = {76, 77, 0}, .expect_flag = true, .seed = 4},
};
// clang-format on

class EmbeddingGpu : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(EmbeddingGpu, MatchesReference) {
  const EmbeddingCase& c = GetParam();
  run_embedding(c.dtype, c.vocab, c.hidden, c.ids, c.expect_flag, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, EmbeddingGpu, ::testing::ValuesIn(kEmbeddingCases), spade::test::CaseName());

// =====================================================================================================================
// RMSNorm
// =====================================================================================================================

struct NormCase {
  DType dt = DType::BF16;
  int rows = 0, dim = 0;
  bool w_f32 = false, unit_offset = false;
  int residual = 0;  // 0 none, 1 same dtype, 2 fp32
  int x_stride = 0;  // 0 = dim
  bool in_place = false;
  uint64_t seed = 0;
};

std::string case_name(const NormCase& c) {
  return std::string(name_dtype(c.dt)) + "_rows" + std::to_string(c.rows) + "_dim" + std::to_string(c.dim) +
         (c.w_f32 ? "_weightf32" : "") + (c.unit_offset ? "_unitoffset" : "") +
         (c.residual == 1 ? "_residual" : c.residual == 2 ? "_residualf32" : "") +
         (c.x_stride != 0 ? "_stride" + std::to_string(c.x_stride) : "") + (c.in_place ? "_inplace" : "");
}

void PrintTo(const NormCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_rmsnorm(const NormCase& c) {
  const uint64_t seed = c.seed;
  SCOPED_TRACE(std::string(dtype_str(c.dt)) + " rows=" + std::to_string(c.rows) + " dim=" + std::to_string(c.dim) +
               " w_f32=" + std::to_string(c.w_f32) + " offset=" + std::to_string(c.unit_offset) +
               " residual=" + std::to_string(c.residual) + " stride=" + std::to_string(c.x_stride) +
               " in_place=" + std::to_string(c.in_place));
  std::mt19937_64 rng(seed);
  const int xs = c.x_stride == 0 ? c.dim : c.x_stride;
  std::vector<float> x32, w32, r32;
  const std::vector<uint16_t> xb = random_half(c.dt, static_cast<size_t>(c.rows) * xs, 1.5f, rng, &x32);
  // Weights: around 1 for the plain convention, around 0 for (1 + w).
  std::vector<float> wraw = randn(c.dim, 0.2f, rng);
  if (!c.unit_offset)
    for (auto& v : wraw) v += 1.f;
  std::vector<uint16_t> wb(c.dim);
  for (int i = 0; i < c.dim; ++i) {
    if (!c.w_f32) {
      wb[i] = to_bits(c.dt, wraw[i]);
      wraw[i] = from_bits(c.dt, wb[i]);
    }
  }
  DevBuf<uint16_t> x, w16, out;
  DevBuf<float> wf;
  x.upload(xb);
  if (c.w_f32) wf.upload(wraw); else w16.upload(wb);
  // Residual stream.
  std::vector<float> res_in = randn(static_cast<size_t>(c.rows) * c.dim, 3.f, rng);
  std::vector<uint16_t> res_bits(res_in.size());
  DevBuf<uint16_t> res16;
  DevBuf<float> res32;
  if (c.residual == 1) {
    for (size_t i = 0; i < res_in.size(); ++i) {
      res_bits[i] = to_bits(c.dt, res_in[i]);
      res_in[i] = from_bits(c.dt, res_bits[i]);
    }
    res16.upload(res_bits);
  } else if (c.residual == 2) {
    res32.upload(res_in);
  }
  // Reference.
  std::vector<float> weff(wraw);
  if (c.unit_offset)
    for (auto& v : weff) v = 1.0f + v;
  std::vector<float> norm_in(static_cast<size_t>(c.rows) * c.dim), res_ref(norm_in.size());
  for (int r = 0; r < c.rows; ++r)
    for (int i = 0; i < c.dim; ++i) {
      const size_t o = static_cast<size_t>(r) * c.dim + i;
      const float xv = x32[static_cast<size_t>(r) * xs + i];
      if (c.residual == 0) {
        norm_in[o] = xv;
      } else {
        const float s = res_in[o] + xv;
        res_ref[o] = c.residual == 1 ? round_to(c.dt, s) : s;
        norm_in[o] = res_ref[o];
      }
    }
  std::vector<float> ref(norm_in.size());
  rmsnorm_ref(norm_in.data(), weff.data(), ref.data(), c.rows, c.dim, 1e-6f);

  RmsNormParams p;
  p.dtype = c.dt;
  p.x = x.get();
  p.weight = c.w_f32 ? static_cast<const void*>(wf.get()) : static_cast<const void*>(w16.get());
  p.weight_dtype = c.w_f32 ? DType::F32 : c.dt;
  p.rows = c.rows;
  p.dim = c.dim;
  p.x_stride = c.x_stride;
  p.eps = 1e-6f;
  p.unit_offset = c.unit_offset;
  if (c.residual == 1) {
    p.residual = res16.get();
    p.residual_dtype = c.dt;
  } else if (c.residual == 2) {
    p.residual = res32.get();
    p.residual_dtype = DType::F32;
  }
  if (c.in_place) {
    p.out = x.get();
    p.out_stride = c.x_stride;
  } else {
    out.alloc(static_cast<size_t>(c.rows) * c.dim);
    out.poison();
    p.out = out.get();
  }
  SPADE_CUDA_OK(rmsnorm(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got(ref.size());
  const std::vector<uint16_t> ob = c.in_place ? x.download() : out.download();
  const int os = c.in_place ? xs : c.dim;
  for (int r = 0; r < c.rows; ++r)
    for (int i = 0; i < c.dim; ++i)
      got[static_cast<size_t>(r) * c.dim + i] = from_bits(c.dt, ob[static_cast<size_t>(r) * os + i]);
  expect_close(got, ref, rel_bound(c.dt), 1e-5, "rmsnorm out");
  if (c.in_place && xs > c.dim) {  // the gap between rows is untouched
    for (int r = 0; r < c.rows; ++r)
      for (int i = c.dim; i < xs; ++i)
        ASSERT_EQ(ob[static_cast<size_t>(r) * xs + i], xb[static_cast<size_t>(r) * xs + i]) << "row gap " << r;
  }
  if (c.residual == 1) {
    const std::vector<float> rg = to_f32(c.dt, res16.download());
    for (size_t i = 0; i < rg.size(); ++i) ASSERT_EQ(rg[i], res_ref[i]) << "residual " << i;  // bit-exact
  } else if (c.residual == 2) {
    const std::vector<float> rg = res32.download();
    for (size_t i = 0; i < rg.size(); ++i) ASSERT_EQ(rg[i], res_ref[i]) << "residual " << i;
  }
}

// clang-format off
const std::vector<NormCase> kRmsNormCases = {
    // Qwen3 hidden
    {.dt = DType::BF16, .rows = 7, .dim = kHidden, .seed = 10},
    {.dt = DType::F16, .rows = 33, .dim = kHidden, .w_f32 = true, .seed = 11},
    // fused residual (same dtype, fp32)
    {.dt = DType::BF16, .rows = 9, .dim = kHidden, .residual = 1, .seed = 12},
    {.dt = DType::F16, .rows = 5, .dim = kHidden, .residual = 2, .seed = 13},
    // unit offset (Qwen3.5's (1 + w))
    {.dt = DType::BF16, .rows = 4, .dim = 2048, .unit_offset = true, .residual = 1, .seed = 14},
    {.dt = DType::F16, .rows = 3, .dim = 1024, .w_f32 = true, .unit_offset = true, .residual = 2, .seed = 15},
    // odd dims: the scalar path
    {.dt = DType::BF16, .rows = 3, .dim = 100, .seed = 16},
    {.dt = DType::F16, .rows = 1, .dim = 1, .residual = 1, .seed = 17},
    {.dt = DType::BF16, .rows = 2, .dim = 37, .w_f32 = true, .unit_offset = true, .residual = 2, .seed = 18},
    // in place, strided: stride % 8 == 0 (the vector path), odd stride (the scalar path)
    {.dt = DType::BF16, .rows = 6, .dim = 512, .x_stride = 520, .in_place = true, .seed = 19},
    {.dt = DType::F16, .rows = 4, .dim = 96, .x_stride = 101, .in_place = true, .seed = 20},
    // many rows
    {.dt = DType::BF16, .rows = 2048, .dim = kHidden, .residual = 1, .seed = 21},
};
// clang-format on

class RmsNormGpu : public ::testing::TestWithParam<NormCase> {};

TEST_P(RmsNormGpu, MatchesReference) { run_rmsnorm(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, RmsNormGpu, ::testing::ValuesIn(kRmsNormCases), spade::test::CaseName());

// Per-head RMSNorm over the q part of a fused qkv row (Qwen3 q_norm), in place and out of place.
void run_rmsnorm_heads(DType dt, int tokens, int heads, int D, int stride, bool in_place, bool w_f32, bool offset,
                       uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_str(dt)) + " tokens=" + std::to_string(tokens) + " heads=" + std::to_string(heads) +
               " D=" + std::to_string(D) + " stride=" + std::to_string(stride));
  std::mt19937_64 rng(seed);
  std::vector<float> x32;
  const std::vector<uint16_t> xb = random_half(dt, static_cast<size_t>(tokens) * stride, 2.f, rng, &x32);
  std::vector<float> w = randn(D, 0.3f, rng);
  if (!offset)
    for (auto& v : w) v += 1.f;
  std::vector<uint16_t> wb(D);
  if (!w_f32)
    for (int i = 0; i < D; ++i) {
      wb[i] = to_bits(dt, w[i]);
      w[i] = from_bits(dt, wb[i]);
    }
  std::vector<float> weff(w);
  if (offset)
    for (auto& v : weff) v = 1.0f + v;
  std::vector<float> heads32(static_cast<size_t>(tokens) * heads * D);
  for (int t = 0; t < tokens; ++t)
    std::copy_n(&x32[static_cast<size_t>(t) * stride], heads * D, &heads32[static_cast<size_t>(t) * heads * D]);
  std::vector<float> ref(heads32.size());
  rmsnorm_ref(heads32.data(), weff.data(), ref.data(), tokens * heads, D, 1e-6f);
  DevBuf<uint16_t> x, out, w16;
  DevBuf<float> wf;
  x.upload(xb);
  if (w_f32) wf.upload(w); else w16.upload(wb);
  RmsNormHeadsParams p;
  p.dtype = dt;
  p.x = x.get();
  p.weight = w_f32 ? static_cast<const void*>(wf.get()) : static_cast<const void*>(w16.get());
  p.weight_dtype = w_f32 ? DType::F32 : dt;
  p.tokens = tokens;
  p.num_heads = heads;
  p.head_dim = D;
  p.token_stride = stride;
  p.unit_offset = offset;
  if (in_place) {
    p.out = x.get();
    p.out_token_stride = stride;
  } else {
    out.alloc(heads32.size());
    out.poison();
    p.out = out.get();
  }
  SPADE_CUDA_OK(rmsnorm_heads(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> ob = in_place ? x.download() : out.download();
  const int os = in_place ? stride : heads * D;
  std::vector<float> got(ref.size());
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < heads * D; ++i)
      got[static_cast<size_t>(t) * heads * D + i] = from_bits(dt, ob[static_cast<size_t>(t) * os + i]);
  expect_close(got, ref, rel_bound(dt), 1e-5, "rmsnorm_heads");
  if (in_place) {  // the rest of each row (k, v) is untouched
    for (int t = 0; t < tokens; ++t) {
      for (int i = heads * D; i < stride; ++i) {
        ASSERT_EQ(ob[static_cast<size_t>(t) * stride + i], xb[static_cast<size_t>(t) * stride + i]);
      }
    }
  }
}

struct NormHeadsCase {
  DType dt = DType::BF16;
  int tokens = 0;
  int heads = 0;
  int head_dim = 0;
  int token_stride = 0;
  bool in_place = false;
  bool w_f32 = false;
  bool unit_offset = false;
  uint64_t seed = 0;
};

std::string case_name(const NormHeadsCase& c) {
  return std::string(name_dtype(c.dt)) + "_tokens" + std::to_string(c.tokens) + "_heads" + std::to_string(c.heads) +
         "_D" + std::to_string(c.head_dim) + "_stride" + std::to_string(c.token_stride) +
         (c.in_place ? "_inplace" : "") + (c.w_f32 ? "_weightf32" : "") + (c.unit_offset ? "_unitoffset" : "");
}

void PrintTo(const NormHeadsCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<NormHeadsCase> kRmsNormHeadsCases = {
    // Qwen3 q_norm in place in the qkv row
    {.dt = DType::BF16, .tokens = 13, .heads = kHq, .head_dim = kD, .token_stride = (kHq + 2 * kHkv) * kD,
     .in_place = true, .seed = 30},
    {.dt = DType::F16, .tokens = 5, .heads = 8, .head_dim = 64, .token_stride = 8 * 64, .w_f32 = true, .seed = 31},
    {.dt = DType::BF16, .tokens = 3, .heads = 4, .head_dim = 256, .token_stride = 4 * 256 + 40, .in_place = true,
     .unit_offset = true, .seed = 32},
    // odd head dim
    {.dt = DType::F16, .tokens = 4, .heads = 3, .head_dim = 50, .token_stride = 3 * 50, .seed = 33},
};
// clang-format on

class RmsNormHeadsGpu : public ::testing::TestWithParam<NormHeadsCase> {};

TEST_P(RmsNormHeadsGpu, MatchesReference) {
  const NormHeadsCase& c = GetParam();
  run_rmsnorm_heads(c.dt, c.tokens, c.heads, c.head_dim, c.token_stride, c.in_place, c.w_f32, c.unit_offset, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, RmsNormHeadsGpu, ::testing::ValuesIn(kRmsNormHeadsCases), spade::test::CaseName());

// =====================================================================================================================
// q/k norm + RoPE + KV append
// =====================================================================================================================

struct RopeCase {
  DType dt = DType::BF16;
  int hq = 0, hkv = 0, D = 0, rot = 0;
  double theta = 0.0;
  bool qk_norm = false, norm_f32 = false, unit_offset = false;
  int extra_cols = 0;  // columns after v in each qkv row (e.g. Qwen3.5's gate)
  int page_size = 0;
  std::vector<std::vector<int>> seq_positions;  // per sequence: positions of its tokens in this batch
  int context = 0;  // positions in the block table per sequence (>= max position + 1)
  bool row_out = false;  // also write each token's processed q | k | v row (the disaggregated path's send rows)
  uint64_t seed = 0;
};

/// Positions of the sequences, "_" between sequences, consecutive runs as "<first>to<last>": "0to36_131071".
std::string positions_name(const std::vector<std::vector<int>>& seqs) {
  std::string s;
  for (const std::vector<int>& p : seqs) {
    for (size_t i = 0; i < p.size();) {
      size_t j = i + 1;
      while (j < p.size() && p[j] == p[j - 1] + 1) ++j;
      s += (s.empty() ? "" : "_") + name_ints({p[i]});
      if (j - i >= 2) s += "to" + name_ints({p[j - 1]});
      i = j;
    }
  }
  return s;
}

std::string case_name(const RopeCase& c) {
  return std::string(name_dtype(c.dt)) + "_hq" + std::to_string(c.hq) + "_hkv" + std::to_string(c.hkv) + "_D" +
         std::to_string(c.D) + "_rot" + std::to_string(c.rot) + "_theta" + spade::test::name_num(c.theta) +
         (c.qk_norm ? "_qknorm" : "") + (c.norm_f32 ? "_normf32" : "") + (c.unit_offset ? "_unitoffset" : "") +
         (c.extra_cols != 0 ? "_extra" + std::to_string(c.extra_cols) : "") + "_page" + std::to_string(c.page_size) +
         "_pos" + positions_name(c.seq_positions) + "_ctx" + std::to_string(c.context) + (c.row_out ? "_rowout" : "");
}

void PrintTo(const RopeCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_rope(const RopeCase& c) {
  const uint64_t seed = c.seed;
  SCOPED_TRACE(std::string(dtype_str(c.dt)) + " hq=" + std::to_string(c.hq) + " hkv=" + std::to_string(c.hkv) +
               " D=" + std::to_string(c.D) + " rot=" + std::to_string(c.rot) + " theta=" + std::to_string(c.theta) +
               " norm=" + std::to_string(c.qk_norm) + " ps=" + std::to_string(c.page_size));
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(c.seq_positions.size());
  const int D = c.D, Q = c.hq * D, KV = c.hkv * D, stride = Q + 2 * KV + c.extra_cols;
  std::vector<int32_t> positions, seq_idx;
  for (int b = 0; b < batch; ++b)
    for (int pos : c.seq_positions[b]) {
      positions.push_back(pos);
      seq_idx.push_back(b);
    }
  const int tokens = static_cast<int>(positions.size());
  // Block table: the pages the batch touches get distinct random physical pages of a pool with 5 unused pages
  // (the other entries stay -1 and are never looked up: long contexts without a long cache).
  const int max_pages = (c.context + c.page_size - 1) / c.page_size;
  std::vector<int32_t> bt(static_cast<size_t>(batch) * max_pages, -1);
  std::vector<size_t> touched;
  for (int t = 0; t < tokens; ++t) {
    const size_t e = static_cast<size_t>(seq_idx[t]) * max_pages + positions[t] / c.page_size;
    if (std::find(touched.begin(), touched.end(), e) == touched.end()) touched.push_back(e);
  }
  const int num_pages = static_cast<int>(touched.size()) + 5;
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (size_t i = 0; i < touched.size(); ++i) bt[touched[i]] = perm[i];
  // Inputs.
  std::vector<float> qkv32;
  const std::vector<uint16_t> qkvb = random_half(c.dt, static_cast<size_t>(tokens) * stride, 1.f, rng, &qkv32);
  std::vector<float> qn = randn(D, 0.2f, rng), kn = randn(D, 0.2f, rng);
  if (!c.unit_offset)
    for (int i = 0; i < D; ++i) {
      qn[i] += 1.f;
      kn[i] += 1.f;
    }
  std::vector<uint16_t> qnb(D), knb(D);
  if (!c.norm_f32)
    for (int i = 0; i < D; ++i) {
      qnb[i] = to_bits(c.dt, qn[i]);
      qn[i] = from_bits(c.dt, qnb[i]);
      knb[i] = to_bits(c.dt, kn[i]);
      kn[i] = from_bits(c.dt, knb[i]);
    }
  // Cache: random initial contents (their bits must survive outside the written slots).
  std::vector<float> kc32, vc32;
  const size_t cache_n = static_cast<size_t>(num_pages) * c.page_size * KV;
  const std::vector<uint16_t> kcb = random_half(c.dt, cache_n, 1.f, rng, &kc32);
  const std::vector<uint16_t> vcb = random_half(c.dt, cache_n, 1.f, rng, &vc32);

  // Reference: split, norm, rope, append.
  std::vector<float> q(static_cast<size_t>(tokens) * Q), k(static_cast<size_t>(tokens) * KV), v(k.size());
  for (int t = 0; t < tokens; ++t) {
    const float* row = &qkv32[static_cast<size_t>(t) * stride];
    std::copy_n(row, Q, &q[static_cast<size_t>(t) * Q]);
    std::copy_n(row + Q, KV, &k[static_cast<size_t>(t) * KV]);
    std::copy_n(row + Q + KV, KV, &v[static_cast<size_t>(t) * KV]);
  }
  if (c.qk_norm) {
    std::vector<float> qe(qn), ke(kn);
    if (c.unit_offset)
      for (int i = 0; i < D; ++i) {
        qe[i] = 1.0f + qe[i];
        ke[i] = 1.0f + ke[i];
      }
    rmsnorm_ref(q.data(), qe.data(), q.data(), tokens * c.hq, D, 1e-6f);
    rmsnorm_ref(k.data(), ke.data(), k.data(), tokens * c.hkv, D, 1e-6f);
  }
  rope_ref(q.data(), positions.data(), tokens, c.hq, D, c.rot, c.theta);
  rope_ref(k.data(), positions.data(), tokens, c.hkv, D, c.rot, c.theta);
  // Mark written slots: a cache image of the reference k / v, and which rows were written.
  std::vector<float> kref(kc32), vref(vc32);
  KvAppendRefParams ap;
  ap.k = k.data();
  ap.v = v.data();
  ap.positions = positions.data();
  ap.seq_idx = seq_idx.data();
  ap.block_table = bt.data();
  ap.k_cache = kref.data();
  ap.v_cache = vref.data();
  ap.tokens = tokens;
  ap.num_kv_heads = c.hkv;
  ap.head_dim = D;
  ap.batch = batch;
  ap.max_pages_per_seq = max_pages;
  ap.page_size = c.page_size;
  ap.num_pages = num_pages;
  ASSERT_EQ(kv_append_ref(ap), 0);
  std::vector<char> written(static_cast<size_t>(num_pages) * c.page_size, 0);
  for (int t = 0; t < tokens; ++t) {
    const int page = bt[static_cast<size_t>(seq_idx[t]) * max_pages + positions[t] / c.page_size];
    written[static_cast<size_t>(page) * c.page_size + positions[t] % c.page_size] = 1;
  }

  DevBuf<uint16_t> d_qkv, q_out, kc, vc, d_qn, d_kn;
  DevBuf<float> d_qnf, d_knf;
  DevBuf<int32_t> d_pos, d_seq, d_bt, flag;
  d_qkv.upload(qkvb);
  kc.upload(kcb);
  vc.upload(vcb);
  d_pos.upload(positions);
  d_seq.upload(seq_idx);
  d_bt.upload(bt);
  flag.upload(std::vector<int32_t>{0});
  q_out.alloc(static_cast<size_t>(tokens) * Q);
  q_out.poison();
  RopeKvAppendParams p;
  p.dtype = c.dt;
  p.qkv = d_qkv.get();
  p.q_out = q_out.get();
  p.k_cache = kc.get();
  p.v_cache = vc.get();
  p.positions = d_pos.get();
  p.seq_idx = d_seq.get();
  p.block_table = d_bt.get();
  p.error_flag = flag.get();
  if (c.qk_norm) {
    if (c.norm_f32) {
      d_qnf.upload(qn);
      d_knf.upload(kn);
      p.q_norm_weight = d_qnf.get();
      p.k_norm_weight = d_knf.get();
      p.norm_weight_dtype = DType::F32;
    } else {
      d_qn.upload(qnb);
      d_kn.upload(knb);
      p.q_norm_weight = d_qn.get();
      p.k_norm_weight = d_kn.get();
      p.norm_weight_dtype = c.dt;
    }
  }
  p.norm_unit_offset = c.unit_offset;
  p.norm_eps = 1e-6f;
  p.tokens = tokens;
  p.num_q_heads = c.hq;
  p.num_kv_heads = c.hkv;
  p.head_dim = D;
  p.rot_dim = c.rot;
  p.qkv_stride = c.extra_cols == 0 ? 0 : stride;
  p.batch = batch;
  p.max_pages_per_seq = max_pages;
  p.page_size = c.page_size;
  p.num_pages = num_pages;
  p.theta = c.theta;
  const int out_stride = Q + 2 * KV + 24;
  DevBuf<uint16_t> rows;
  if (c.row_out) {
    rows.alloc(static_cast<size_t>(tokens) * out_stride);
    rows.poison();
    p.row_out = rows.get();
    p.row_out_stride = out_stride;
  }
  SPADE_CUDA_OK(rope_kv_append(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(flag.download()[0], 0);
  EXPECT_EQ(d_qkv.download(), qkvb) << "qkv must not be modified";
  if (c.row_out) {
    // Rows: q equals q_out bit for bit, k the values appended to the cache, v the input bits; the 24 pad columns
    // stay poisoned.
    const std::vector<uint16_t> r = rows.download(), qo = q_out.download(), kg = kc.download();
    for (int t = 0; t < tokens; ++t) {
      const uint16_t* row = &r[static_cast<size_t>(t) * out_stride];
      for (int i = 0; i < Q; ++i) ASSERT_EQ(row[i], qo[static_cast<size_t>(t) * Q + i]) << "row_out q token " << t;
      const int page = bt[static_cast<size_t>(seq_idx[t]) * max_pages + positions[t] / c.page_size];
      const size_t slot = static_cast<size_t>(page) * c.page_size + positions[t] % c.page_size;
      for (int i = 0; i < KV; ++i) {
        ASSERT_EQ(row[Q + i], kg[slot * KV + i]) << "row_out k token " << t;
        ASSERT_EQ(row[Q + KV + i], qkvb[static_cast<size_t>(t) * stride + Q + KV + i]) << "row_out v token " << t;
      }
      for (int i = Q + 2 * KV; i < out_stride; ++i) ASSERT_EQ(row[i], 0xFFFF) << "row_out pad token " << t;
    }
  }

  // q: per head, |err| <= rel |ref| + 1e-5 * max |ref| of the head (fp32 cancellation in the rotation).
  auto check_heads = [&](const std::vector<float>& got, const std::vector<float>& ref, const char* what) {
    int bad = 0;
    for (size_t h = 0; h * D < ref.size(); ++h) {
      double mx = 0;
      for (int d = 0; d < D; ++d) mx = std::max(mx, std::fabs(static_cast<double>(ref[h * D + d])));
      for (int d = 0; d < D; ++d) {
        const size_t i = h * D + d;
        const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
        if (!(err <= rel_bound(c.dt) * std::fabs(ref[i]) + 1e-5 * mx + 1e-6)) {
          if (++bad <= 5) ADD_FAILURE() << what << " head " << h << " dim " << d << " got " << got[i] << " ref " << ref[i];
        }
      }
    }
    EXPECT_EQ(bad, 0) << what;
  };
  check_heads(to_f32(c.dt, q_out.download()), q, "q_out");
  // Caches: written slots against the reference (k within bounds, v bit-exact), every other slot untouched.
  const std::vector<uint16_t> kg = kc.download(), vg = vc.download();
  std::vector<float> kgot, kwant;
  for (size_t slot = 0; slot < written.size(); ++slot) {
    for (int i = 0; i < KV; ++i) {
      const size_t e = slot * KV + i;
      if (written[slot]) {
        kgot.push_back(from_bits(c.dt, kg[e]));
        kwant.push_back(kref[e]);
        ASSERT_EQ(vg[e], to_bits(c.dt, vref[e])) << "v slot " << slot << " elem " << i;
      } else {
        ASSERT_EQ(kg[e], kcb[e]) << "k slot " << slot << " (not written) elem " << i;
        ASSERT_EQ(vg[e], vcb[e]) << "v slot " << slot << " (not written) elem " << i;
      }
    }
  }
  ASSERT_EQ(kgot.size(), static_cast<size_t>(tokens) * KV);
  check_heads(kgot, kwant, "k_cache");
}

std::vector<int> range(int a, int b) {
  std::vector<int> v;
  for (int i = a; i < b; ++i) v.push_back(i);
  return v;
}

// clang-format off
const std::vector<RopeCase> kRopeKvAppendCases = {
    // Qwen3: a prefill chunk (positions 0..36), two decode tokens deep into long contexts (incl. 131071) and one
    // mid-way.
    {.dt = DType::BF16, .hq = kHq, .hkv = kHkv, .D = kD, .rot = kD, .theta = 1e6, .qk_norm = true, .page_size = 16,
     .seq_positions = {range(0, 37), {131071}, {40959}, {70000, 70001, 70002}}, .context = 131072, .seed = 40},
    {.dt = DType::F16, .hq = kHq, .hkv = kHkv, .D = kD, .rot = kD, .theta = 1e6, .qk_norm = true, .norm_f32 = true,
     .page_size = 32, .seq_positions = {range(100, 140), {4095}, {131000}}, .context = 131072, .seed = 41},
    // Qwen3.5 full-attention layers: head_dim 256, rotary 64 (partial_rotary_factor 0.25), theta 1e7, (1 + w) norms,
    // the output gate after v in each row.
    {.dt = DType::BF16, .hq = 16, .hkv = 2, .D = 256, .rot = 64, .theta = 1e7, .qk_norm = true, .unit_offset = true,
     .extra_cols = 16 * 256, .page_size = 16, .seq_positions = {range(0, 20), {65536}, {262143}}, .context = 262144,
     .seed = 42},
    // The disaggregated path: the inference rank's append also writes the processed rows it ships; the cache rank
    // appends those rows again without norms or rotation (rot_dim 0), which must reproduce its caches bit for bit.
    {.dt = DType::BF16, .hq = 8, .hkv = 2, .D = 128, .rot = 128, .theta = 1e6, .qk_norm = true, .page_size = 16,
     .seq_positions = {range(0, 21), {300}, {77}}, .context = 512, .row_out = true, .seed = 45},
    // rot_dim 0 and no norms: a plain copy (rope_ref with rot 0 is the identity)
    {.dt = DType::F16, .hq = 4, .hkv = 4, .D = 64, .rot = 0, .theta = 1e4, .page_size = 32,
     .seq_positions = {range(5, 40), {2}}, .context = 64, .row_out = true, .seed = 46},
    // Llama: no norms, GQA group 1, head_dim 64
    {.dt = DType::F16, .hq = 4, .hkv = 4, .D = 64, .rot = 64, .theta = 5e5, .page_size = 64,
     .seq_positions = {range(7, 200), {1}, {0}}, .context = 8192, .seed = 43},
    // odd small
    {.dt = DType::BF16, .hq = 6, .hkv = 3, .D = 10, .rot = 6, .theta = 10000.0, .qk_norm = true, .extra_cols = 3,
     .page_size = 1, .seq_positions = {{0, 1, 2}, {5}}, .context = 8, .seed = 44},
};
// clang-format on

class RopeKvAppendGpu : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeKvAppendGpu, MatchesReference) { run_rope(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, RopeKvAppendGpu, ::testing::ValuesIn(kRopeKvAppendCases), spade::test::CaseName());

// Padding (page -1) and invalid slots: no KV write, flag only for the invalid ones; q_out still written.
TEST_F(RopeKvAppendGpu, PaddingAndInvalidSlots) {
  const DType dt = DType::BF16;
  const int hq = 2, hkv = 1, D = 8, stride = (hq + 2 * hkv) * D, ps = 4, max_pages = 2, num_pages = 3, batch = 2;
  std::mt19937_64 rng(45);
  std::vector<int32_t> bt = {1, -1, 2, 7};  // seq 0: page 1 then padding; seq 1: page 2 then an invalid page 7
  struct Tok {
    int seq, pos;
    bool writes, flags;
  };
  const std::vector<Tok> toks = {{0, 1, true, false},  {0, 5, false, false}, {1, 2, true, false}, {1, 6, false, true},
                                 {1, 8, false, true},  {2, 0, false, true},  {-1, 0, false, true}, {0, -3, false, true}};
  for (size_t only = 0; only < toks.size(); ++only) {
    SCOPED_TRACE("token case " + std::to_string(only));
    std::vector<int32_t> pos = {toks[only].pos}, seq = {toks[only].seq};
    std::vector<float> x32;
    const std::vector<uint16_t> xb = random_half(dt, stride, 1.f, rng, &x32);
    std::vector<float> c32;
    const std::vector<uint16_t> cb = random_half(dt, static_cast<size_t>(num_pages) * ps * hkv * D, 1.f, rng, &c32);
    DevBuf<uint16_t> qkv, q_out(hq * D), kc, vc;
    DevBuf<int32_t> d_pos, d_seq, d_bt, flag;
    qkv.upload(xb);
    kc.upload(cb);
    vc.upload(cb);
    d_pos.upload(pos);
    d_seq.upload(seq);
    d_bt.upload(bt);
    flag.upload(std::vector<int32_t>{0});
    q_out.poison();
    RopeKvAppendParams p;
    p.dtype = dt;
    p.qkv = qkv.get();
    p.q_out = q_out.get();
    p.k_cache = kc.get();
    p.v_cache = vc.get();
    p.positions = d_pos.get();
    p.seq_idx = d_seq.get();
    p.block_table = d_bt.get();
    p.error_flag = flag.get();
    p.tokens = 1;
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = D;
    p.rot_dim = D;
    p.batch = batch;
    p.max_pages_per_seq = max_pages;
    p.page_size = ps;
    p.num_pages = num_pages;
    p.theta = 10000.0;
    SPADE_CUDA_OK(rope_kv_append(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(flag.download()[0], toks[only].flags ? 1 : 0);
    const bool changed = kc.download() != cb || vc.download() != cb;
    EXPECT_EQ(changed, toks[only].writes);
    std::vector<float> q(x32.begin(), x32.begin() + hq * D);
    rope_ref(q.data(), pos.data(), 1, hq, D, D, 10000.0);
    expect_close(to_f32(dt, q_out.download()), q, rel_bound(dt), 1e-5, "q_out");
  }
}

// =====================================================================================================================
// SwiGLU
// =====================================================================================================================

void run_swiglu(DType dt, int rows, int inter, int gu_stride, int out_stride, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_str(dt)) + " rows=" + std::to_string(rows) + " inter=" + std::to_string(inter) +
               " strides=" + std::to_string(gu_stride) + "," + std::to_string(out_stride));
  std::mt19937_64 rng(seed);
  const int gs = gu_stride == 0 ? 2 * inter : gu_stride, os = out_stride == 0 ? inter : out_stride;
  std::vector<float> g32;
  const std::vector<uint16_t> gb = random_half(dt, static_cast<size_t>(rows) * gs, 2.f, rng, &g32);
  std::vector<float> ref(static_cast<size_t>(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    const float* g = &g32[static_cast<size_t>(r) * gs];
    swiglu_ref(g, g + inter, &ref[static_cast<size_t>(r) * inter], 1, inter);
  }
  DevBuf<uint16_t> gu, out(static_cast<size_t>(rows) * os);
  gu.upload(gb);
  out.poison();
  SwigluParams p;
  p.dtype = dt;
  p.gate_up = gu.get();
  p.out = out.get();
  p.rows = rows;
  p.inter = inter;
  p.gate_up_stride = gu_stride;
  p.out_stride = out_stride;
  SPADE_CUDA_OK(swiglu(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> ob = out.download();
  std::vector<float> got(ref.size());
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < inter; ++i) got[static_cast<size_t>(r) * inter + i] = from_bits(dt, ob[static_cast<size_t>(r) * os + i]);
  expect_close(got, ref, rel_bound(dt), 1e-6, "swiglu");
  for (int r = 0; r < rows; ++r)  // padding columns of out stay poisoned (0xFFFF)
    for (int i = inter; i < os; ++i) ASSERT_EQ(ob[static_cast<size_t>(r) * os + i], 0xFFFF);
}

struct SwigluCase {
  DType dt = DType::BF16;
  int rows = 0;
  int inter = 0;
  int gate_up_stride = 0;  // 0 = 2 * inter
  int out_stride = 0;      // 0 = inter
  uint64_t seed = 0;
};

std::string case_name(const SwigluCase& c) {
  return std::string(name_dtype(c.dt)) + "_rows" + std::to_string(c.rows) + "_inter" + std::to_string(c.inter) +
         (c.gate_up_stride != 0 ? "_gustride" + std::to_string(c.gate_up_stride) : "") +
         (c.out_stride != 0 ? "_outstride" + std::to_string(c.out_stride) : "");
}

void PrintTo(const SwigluCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<SwigluCase> kSwigluCases = {
    // Qwen3 inter
    {.dt = DType::BF16, .rows = 7, .inter = kInter, .seed = 50},
    {.dt = DType::F16, .rows = 300, .inter = kInter, .seed = 51},
    // odd sizes: the scalar path
    {.dt = DType::BF16, .rows = 3, .inter = 100, .seed = 52},
    {.dt = DType::F16, .rows = 5, .inter = 17, .gate_up_stride = 40, .out_stride = 19, .seed = 53},
    {.dt = DType::BF16, .rows = 1, .inter = 1, .seed = 54},
    // strided, the vector path
    {.dt = DType::BF16, .rows = 4, .inter = 256, .gate_up_stride = 528, .out_stride = 264, .seed = 55},
};
// clang-format on

class SwigluGpu : public ::testing::TestWithParam<SwigluCase> {};

TEST_P(SwigluGpu, MatchesReference) {
  const SwigluCase& c = GetParam();
  run_swiglu(c.dt, c.rows, c.inter, c.gate_up_stride, c.out_stride, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, SwigluGpu, ::testing::ValuesIn(kSwigluCases), spade::test::CaseName());

// =====================================================================================================================
// Sampling
// =====================================================================================================================

/// Logits of `rows` x vocab in dtype `lt` at row stride `stride`; `f32` receives the exact fp32 images.
struct Logits {
  DType lt;
  int rows, vocab, stride;
  std::vector<float> f32;  // [rows, stride]
  DevBuf<float> d32;
  DevBuf<uint16_t> d16;
  const void* ptr() const { return lt == DType::F32 ? static_cast<const void*>(d32.get()) : d16.get(); }
  const float* row(int r) const { return &f32[static_cast<size_t>(r) * stride]; }
};

// pattern: 0 Gaussian (sigma), 1 quantised to multiples of 0.25 (many ties), 2 with NaN / -inf entries.
void make_logits(Logits& L, DType lt, int rows, int vocab, int stride, int pattern, float sigma, std::mt19937_64& rng) {
  L.lt = lt;
  L.rows = rows;
  L.vocab = vocab;
  L.stride = stride;
  std::normal_distribution<float> d(0.f, sigma);
  L.f32.assign(static_cast<size_t>(rows) * stride, 0.f);
  std::vector<uint16_t> bits(L.f32.size());
  for (size_t i = 0; i < L.f32.size(); ++i) {
    float x = d(rng);
    if (pattern == 1) x = std::round(x * 4.f) / 4.f;
    if (pattern == 2 && rng() % 50 == 0) x = (rng() % 2) ? std::nanf("") : -std::numeric_limits<float>::infinity();
    if (lt != DType::F32) {
      bits[i] = to_bits(lt, x);
      x = from_bits(lt, bits[i]);
    }
    L.f32[i] = x;
  }
  if (lt == DType::F32) L.d32.upload(L.f32); else L.d16.upload(bits);
}

void run_argmax(DType lt, int rows, int vocab, int stride, int pattern, uint64_t seed) {
  SCOPED_TRACE(std::string(lt == DType::F32 ? "f32" : dtype_str(lt)) + " rows=" + std::to_string(rows) +
               " vocab=" + std::to_string(vocab) + " stride=" + std::to_string(stride) + " pattern=" +
               std::to_string(pattern));
  std::mt19937_64 rng(seed);
  Logits L;
  make_logits(L, lt, rows, vocab, stride, pattern, 2.f, rng);
  // Plant ties of the maximum in some rows: the lowest index must win.
  if (lt == DType::F32 && vocab > 10) {
    for (int r = 0; r < rows; r += 2) {
      const int a = static_cast<int>(rng() % vocab), b = static_cast<int>(rng() % vocab);
      L.f32[static_cast<size_t>(r) * stride + a] = 100.f;
      L.f32[static_cast<size_t>(r) * stride + b] = 100.f;
    }
    L.d32.upload(L.f32);
  }
  DevBuf<int32_t> out(rows);
  out.poison();
  ArgmaxParams p;
  p.logits_dtype = lt;
  p.logits = L.ptr();
  p.out_tokens = out.get();
  p.rows = rows;
  p.vocab = vocab;
  p.logits_stride = stride;
  SPADE_CUDA_OK(argmax_rows(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = out.download();
  for (int r = 0; r < rows; ++r) EXPECT_EQ(got[r], argmax_ref(L.row(r), vocab)) << "row " << r;
}

struct ArgmaxCase {
  DType logits_dtype = DType::F32;
  int rows = 0;
  int vocab = 0;
  int stride = 0;
  int pattern = 0;  // make_logits: 0 Gaussian, 1 multiples of 0.25 (ties), 2 with NaN / -inf entries
  uint64_t seed = 0;
};

std::string case_name(const ArgmaxCase& c) {
  static const char* const kPattern[] = {"gaussian", "ties", "naninf"};
  return std::string(name_dtype(c.logits_dtype)) + "_rows" + std::to_string(c.rows) + "_vocab" +
         std::to_string(c.vocab) + "_stride" + std::to_string(c.stride) + "_" + kPattern[c.pattern];
}

void PrintTo(const ArgmaxCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

// clang-format off
const std::vector<ArgmaxCase> kArgmaxCases = {
    // Qwen3 vocab, every logits dtype (bf16 of 0.25-multiples: many exact ties)
    {.logits_dtype = DType::F32, .rows = 9, .vocab = kVocab, .stride = kVocab, .pattern = 0, .seed = 60},
    {.logits_dtype = DType::BF16, .rows = 9, .vocab = kVocab, .stride = kVocab, .pattern = 1, .seed = 61},
    {.logits_dtype = DType::F16, .rows = 4, .vocab = kVocab, .stride = kVocab, .pattern = 0, .seed = 62},
    // odd vocabularies and strides (33335: not a multiple of 4, the scalar path), NaN and ties
    {.logits_dtype = DType::F32, .rows = 5, .vocab = 1, .stride = 1, .pattern = 0, .seed = 63},
    {.logits_dtype = DType::F32, .rows = 6, .vocab = 33333, .stride = 33335, .pattern = 2, .seed = 64},
    {.logits_dtype = DType::BF16, .rows = 3, .vocab = 7, .stride = 9, .pattern = 1, .seed = 65},
    {.logits_dtype = DType::F16, .rows = 2, .vocab = 1000, .stride = 1000, .pattern = 2, .seed = 66},
};
// clang-format on

class ArgmaxGpu : public ::testing::TestWithParam<ArgmaxCase> {};

TEST_P(ArgmaxGpu, MatchesReference) {
  const ArgmaxCase& c = GetParam();
  run_argmax(c.logits_dtype, c.rows, c.vocab, c.stride, c.pattern, c.seed);
}

INSTANTIATE_TEST_SUITE_P(, ArgmaxGpu, ::testing::ValuesIn(kArgmaxCases), spade::test::CaseName());

TEST_F(ArgmaxGpu, AllNegInfOrNanRowGivesZero) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> l = {ninf, std::nanf(""), ninf, ninf, std::nanf(""), -0.f, 0.f, ninf};
  DevBuf<float> d;
  d.upload(l);
  DevBuf<int32_t> out(2);
  out.poison();
  ArgmaxParams p;
  p.logits = d.get();
  p.out_tokens = out.get();
  p.rows = 2;
  p.vocab = 4;
  SPADE_CUDA_OK(argmax_rows(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(out.download(), (std::vector<int32_t>{0, 1}));  // row 1: -0 at 1 ties +0 at 2: lowest index
}

struct RowParams {
  float temperature;
  int top_k;
  float top_p;
};

/// Runs sample_rows over `rows` rows cycling through `params`, compares every row with sample_ref.
/// Returns the number of rows compared exactly.
int run_sample(const Logits& L, const std::vector<RowParams>& params, uint64_t seed_base, uint64_t step_base,
               std::vector<int32_t>* tokens_out = nullptr) {
  const int rows = L.rows;
  std::vector<float> temp(rows), top_p(rows);
  std::vector<int32_t> top_k(rows);
  std::vector<uint64_t> seeds(rows), steps(rows);
  for (int r = 0; r < rows; ++r) {
    const RowParams& rp = params[static_cast<size_t>(r) % params.size()];
    temp[r] = rp.temperature;
    top_k[r] = rp.top_k;
    top_p[r] = rp.top_p;
    seeds[r] = seed_base * 1000003ull + static_cast<uint64_t>(r) * 7919ull;
    steps[r] = step_base + static_cast<uint64_t>(r % 5);
  }
  DevBuf<float> d_t, d_p;
  DevBuf<int32_t> d_k, out(rows);
  DevBuf<uint64_t> d_s, d_st;
  d_t.upload(temp);
  d_p.upload(top_p);
  d_k.upload(top_k);
  d_s.upload(seeds);
  d_st.upload(steps);
  SampleParams p;
  p.logits_dtype = L.lt;
  p.logits = L.ptr();
  p.temperature = d_t.get();
  p.top_k = d_k.get();
  p.top_p = d_p.get();
  p.seeds = d_s.get();
  p.steps = d_st.get();
  p.out_tokens = out.get();
  p.rows = rows;
  p.vocab = L.vocab;
  p.logits_stride = L.stride;
  std::vector<int32_t> first;
  for (int rep = 0; rep < 2; ++rep) {  // twice: deterministic
    out.poison();
    EXPECT_EQ(sample_rows(p, nullptr), cudaSuccess) << launch_error_detail();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> got = out.download();
    if (rep == 0) {
      first = got;
    } else {
      EXPECT_EQ(got, first) << "second launch differs";
    }
  }
  int exact = 0;
  for (int r = 0; r < rows; ++r) {
    SampleRefInfo info;
    const int want = sample_ref(L.row(r), L.vocab, temp[r], top_k[r], top_p[r], seeds[r], steps[r], &info);
    const int got = first[r];
    EXPECT_TRUE(got >= 0 && got < L.vocab) << "row " << r << " token " << got;
    if (got < 0 || got >= L.vocab) continue;
    if (!info.near_boundary) {
      EXPECT_EQ(got, want) << "row " << r << " T=" << temp[r] << " k=" << top_k[r] << " p=" << top_p[r]
                           << " kept=" << info.num_kept;
      ++exact;
    } else {
      // Within the fp32 slack the draw or the top-p cut may move by one token; the token must still be a
      // high-ranked candidate: not below the first token past the reference's kept set.
      const int edge = info.num_kept < info.num_candidates ? info.num_kept : info.num_candidates - 1;
      std::vector<int> order(static_cast<size_t>(L.vocab));
      std::iota(order.begin(), order.end(), 0);
      const float* lr = L.row(r);
      auto c = [&](int i) { return sample_canonical(lr[i]); };
      std::nth_element(order.begin(), order.begin() + edge, order.end(),
                       [&](int a, int b) { return c(a) > c(b) || (c(a) == c(b) && a < b); });
      EXPECT_GE(c(got), c(order[static_cast<size_t>(edge)])) << "row " << r << " (near a boundary) token " << got;
    }
  }
  if (tokens_out != nullptr) *tokens_out = first;
  return exact;
}

const std::vector<RowParams> kParamMix = {
    {1.0f, 0, 1.0f},    {0.7f, 50, 1.0f},  {1.0f, 0, 0.9f},    {0.8f, 40, 0.95f}, {1.3f, 0, 0.5f},  {1.0f, 2, 1.0f},
    {0.0f, 0, 1.0f},    {1.0f, 1, 0.9f},   {1.0f, 0, 1e-7f},   {1.0f, 0, 0.0f},   {0.6f, 1000, 0.99f},
    {2.0f, 7, 0.3f},    {1.0f, -3, 1.0f},  {1.0f, 0, 2.0f}};

TEST(SampleGpu, Qwen3VocabF32Logits) {
  std::mt19937_64 rng(70);
  Logits L;
  make_logits(L, DType::F32, 2 * static_cast<int>(kParamMix.size()), kVocab, kVocab, 0, 2.f, rng);
  const int exact = run_sample(L, kParamMix, 1, 0);
  EXPECT_GE(exact, L.rows / 2);
}
TEST(SampleGpu, Qwen3VocabBf16LogitsManyTies) {
  std::mt19937_64 rng(71);
  Logits L;
  make_logits(L, DType::BF16, static_cast<int>(kParamMix.size()), kVocab, kVocab, 1, 2.f, rng);
  const int exact = run_sample(L, kParamMix, 2, 100);
  EXPECT_GE(exact, L.rows / 2);
}
TEST(SampleGpu, TopKEqualsVocabMinusOneAndTiesAtCut) {
  std::mt19937_64 rng(72);
  Logits L;
  make_logits(L, DType::F32, 6, 5000, 5000, 1, 0.5f, rng);  // 0.25-steps of sigma 0.5: huge tie groups
  const std::vector<RowParams> ps = {{1.f, 4999, 1.f}, {1.f, 37, 1.f}, {0.9f, 300, 0.6f}, {1.f, 0, 0.75f},
                                     {1.f, 3, 0.2f},   {5.f, 2500, 0.5f}};
  const int exact = run_sample(L, ps, 3, 7);
  EXPECT_GE(exact, 4);
}
TEST(SampleGpu, OddVocabScalarPathNanInf) {
  std::mt19937_64 rng(73);
  for (int vocab : {1, 2, 33, 1001}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    Logits L;
    make_logits(L, DType::F16, static_cast<int>(kParamMix.size()), vocab, vocab + 1, 2, 1.5f, rng);
    run_sample(L, kParamMix, 4, 9);
  }
}
TEST(SampleGpu, RowResultIndependentOfBatch) {
  std::mt19937_64 rng(74);
  Logits L;
  make_logits(L, DType::BF16, 8, 20000, 20000, 0, 1.f, rng);
  const std::vector<RowParams> ps = {{1.f, 0, 0.9f}};
  std::vector<int32_t> all;
  run_sample(L, ps, 5, 3, &all);
  // The same logits row alone (seed and step travel with the row's data, not its index).
  for (int r : {0, 5}) {
    Logits one;
    one.lt = DType::BF16;
    one.rows = 1;
    one.vocab = one.stride = 20000;
    one.f32.assign(L.row(r), L.row(r) + 20000);
    std::vector<uint16_t> bits(20000);
    for (int i = 0; i < 20000; ++i) bits[i] = to_bits(DType::BF16, one.f32[i]);
    one.d16.upload(bits);
    // run_sample gives row 0 the seed seed_base * 1000003 and step step_base: reproduce row r's.
    std::vector<float> t = {1.f}, p = {0.9f};
    std::vector<int32_t> k = {0};
    std::vector<uint64_t> s = {5 * 1000003ull + static_cast<uint64_t>(r) * 7919ull}, st = {3 + static_cast<uint64_t>(r % 5)};
    DevBuf<float> dt, dp;
    DevBuf<int32_t> dk, out(1);
    DevBuf<uint64_t> ds, dst;
    dt.upload(t);
    dp.upload(p);
    dk.upload(k);
    ds.upload(s);
    dst.upload(st);
    out.poison();
    SampleParams sp;
    sp.logits_dtype = DType::BF16;
    sp.logits = one.ptr();
    sp.temperature = dt.get();
    sp.top_k = dk.get();
    sp.top_p = dp.get();
    sp.seeds = ds.get();
    sp.steps = dst.get();
    sp.out_tokens = out.get();
    sp.rows = 1;
    sp.vocab = 20000;
    SPADE_CUDA_OK(sample_rows(sp, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(out.download()[0], all[r]) << "row " << r;
  }
}

// A captured graph keeps sampling correctly when the per-row steps change in device memory between replays.
TEST(SampleGpu, CudaGraphReplayWithNewSteps) {
  std::mt19937_64 rng(75);
  Logits L;
  make_logits(L, DType::F32, 4, 3000, 3000, 0, 1.f, rng);
  std::vector<float> t = {1.f, 0.8f, 1.f, 1.2f}, pp = {1.f, 0.9f, 0.5f, 1.f};
  std::vector<int32_t> k = {0, 20, 0, 100};
  std::vector<uint64_t> seeds = {11, 12, 13, 14}, steps = {0, 0, 0, 0};
  DevBuf<float> dt, dp;
  DevBuf<int32_t> dk, out(4);
  DevBuf<uint64_t> ds, dst;
  dt.upload(t);
  dp.upload(pp);
  dk.upload(k);
  ds.upload(seeds);
  dst.upload(steps);
  SampleParams sp;
  sp.logits = L.ptr();
  sp.temperature = dt.get();
  sp.top_k = dk.get();
  sp.top_p = dp.get();
  sp.seeds = ds.get();
  sp.steps = dst.get();
  sp.out_tokens = out.get();
  sp.rows = 4;
  sp.vocab = 3000;
  cudaStream_t stream;
  SPADE_CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SPADE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  ASSERT_EQ(sample_rows(sp, stream), cudaSuccess) << launch_error_detail();
  SPADE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  SPADE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::set<int32_t> seen;
  for (uint64_t step = 0; step < 6; ++step) {
    for (auto& s : steps) s = step * 3 + 1;
    SPADE_CUDA_OK(cudaMemcpyAsync(dst.get(), steps.data(), steps.size() * sizeof(uint64_t), cudaMemcpyHostToDevice,
                                  stream));
    SPADE_CUDA_OK(cudaGraphLaunch(exec, stream));
    SPADE_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<int32_t> got = out.download();
    for (int r = 0; r < 4; ++r) {
      SampleRefInfo info;
      const int want = sample_ref(L.row(r), 3000, t[r], k[r], pp[r], seeds[r], steps[r], &info);
      if (!info.near_boundary) {
        EXPECT_EQ(got[r], want) << "step " << step << " row " << r;
      }
      seen.insert(got[r]);
    }
  }
  EXPECT_GT(seen.size(), 6u) << "replays with new steps must draw new tokens";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// =====================================================================================================================
// Invalid parameters
// =====================================================================================================================

void expect_invalid(cudaError_t e, const char* field) {
  EXPECT_EQ(e, cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find(field), std::string::npos) << launch_error_detail();
}

TEST(LayerOpsGpu, RejectsBadParameters) {
  int dummy[64] = {};
  EmbeddingParams e;
  e.token_ids = dummy;
  e.table = e.out = dummy;
  e.num_tokens = 1;
  e.vocab_size = 0;
  e.hidden = 8;
  expect_invalid(embedding_gather(e, nullptr), "vocab_size");
  e.vocab_size = 5;
  e.dtype = DType::F32;
  expect_invalid(embedding_gather(e, nullptr), "dtype");
  e.dtype = DType::BF16;
  e.num_tokens = 0;  // no-op
  EXPECT_EQ(embedding_gather(e, nullptr), cudaSuccess);

  RmsNormParams n;
  n.x = n.weight = dummy;
  n.out = dummy;
  n.rows = 1;
  n.dim = 0;
  expect_invalid(rmsnorm(n, nullptr), "dim");
  n.dim = 16;
  n.x_stride = 8;
  expect_invalid(rmsnorm(n, nullptr), "x_stride");
  n.x_stride = 0;
  n.weight_dtype = DType::F16;
  expect_invalid(rmsnorm(n, nullptr), "weight_dtype");
  n.weight_dtype = DType::BF16;
  n.eps = 0.f;
  expect_invalid(rmsnorm(n, nullptr), "eps");
  n.eps = 1e-6f;
  n.residual = dummy;
  expect_invalid(rmsnorm(n, nullptr), "alias");

  RmsNormHeadsParams h;
  h.x = h.weight = dummy;
  h.out = dummy;
  h.tokens = 1;
  h.num_heads = 2;
  h.head_dim = 7;
  expect_invalid(rmsnorm_heads(h, nullptr), "head_dim");
  h.head_dim = 1024;
  expect_invalid(rmsnorm_heads(h, nullptr), "head_dim");
  h.head_dim = 8;
  h.token_stride = 10;
  expect_invalid(rmsnorm_heads(h, nullptr), "token_stride");

  RopeKvAppendParams r;
  r.qkv = r.q_out = r.k_cache = r.v_cache = dummy;
  r.positions = r.seq_idx = r.block_table = dummy;
  r.tokens = 1;
  r.num_q_heads = 6;
  r.num_kv_heads = 4;
  r.head_dim = 8;
  r.rot_dim = 8;
  r.batch = r.max_pages_per_seq = r.page_size = r.num_pages = 1;
  expect_invalid(rope_kv_append(r, nullptr), "num_kv_heads");
  r.num_kv_heads = 2;
  r.rot_dim = 10;
  expect_invalid(rope_kv_append(r, nullptr), "rot_dim");
  r.rot_dim = 3;
  expect_invalid(rope_kv_append(r, nullptr), "rot_dim");
  r.rot_dim = 8;
  r.qkv_stride = 50;
  expect_invalid(rope_kv_append(r, nullptr), "qkv_stride");
  r.qkv_stride = 0;
  r.q_norm_weight = dummy;
  expect_invalid(rope_kv_append(r, nullptr), "k_norm_weight");
  r.q_norm_weight = nullptr;
  r.page_size = 0;
  expect_invalid(rope_kv_append(r, nullptr), "page_size");
  r.page_size = 1;
  r.theta = -1.0;
  expect_invalid(rope_kv_append(r, nullptr), "theta");

  SwigluParams s;
  s.gate_up = s.out = dummy;
  s.rows = 1;
  s.inter = 8;
  s.gate_up_stride = 10;
  expect_invalid(swiglu(s, nullptr), "gate_up_stride");
  s.gate_up_stride = 0;
  s.out_stride = 4;
  expect_invalid(swiglu(s, nullptr), "out_stride");

  ArgmaxParams a;
  a.logits = dummy;
  a.out_tokens = dummy;
  a.rows = 1;
  a.vocab = 0;
  expect_invalid(argmax_rows(a, nullptr), "vocab");
  a.vocab = 10;
  a.logits_stride = 5;
  expect_invalid(argmax_rows(a, nullptr), "logits_stride");

  SampleParams sp;
  sp.logits = dummy;
  sp.out_tokens = dummy;
  sp.rows = 1;
  sp.vocab = 10;
  expect_invalid(sample_rows(sp, nullptr), "temperature");
  sp.logits_dtype = static_cast<DType>(7);
  expect_invalid(sample_rows(sp, nullptr), "logits_dtype");
}

}  // namespace
}  // namespace spade::kernels

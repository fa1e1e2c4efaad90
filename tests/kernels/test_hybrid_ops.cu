// GPU tests (label gpu): the hybrid-model layer ops of kernels/hybrid_ops.cuh against their CPU references
// (causal_conv1d_ref, gdn_gating_ref, gated_rmsnorm_ref, output_gate_ref; the reset against GdnStatePool::reset's
// rule), on random bf16 / fp16 inputs whose fp32 images the references consume; outputs poisoned before each run.
// Bounds: 16-bit outputs within one rounding of the fp32 reference (2^-8 relative for bf16, 2^-11 for fp16, plus a
// small absolute term for values near zero); fp32 outputs (states, beta, g) within 1e-5 relative; conv states exact
// (they are copies of the inputs).
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/causal_conv1d_ref.h"
#include "kernels/gated_rmsnorm_ref.h"
#include "kernels/gdn_gating_ref.h"
#include "kernels/hybrid_ops.cuh"
#include "kernels/output_gate_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::dtype_str;
using spade::test::from_bits;
using spade::test::random_half;
using spade::test::to_f32;

double half_tol(DType t) { return t == DType::BF16 ? 1.0 / 256 : 1.0 / 2048; }

// |got - want| <= tol * |want| + abs for every element; reports the first failure.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i;
    ASSERT_LE(std::abs(static_cast<double>(got[i]) - want[i]), rel * std::abs(want[i]) + abs)
        << what << " element " << i << ": got " << got[i] << " want " << want[i];
  }
}

// ---- causal conv1d ----

struct ConvCase {
  DType dtype = DType::BF16;
  int kernel = 0;  // K (1: no state)
  bool bias = false;
  uint64_t seed = 0;
};

std::string case_name(const ConvCase& c) {
  return std::string(spade::test::name_dtype(c.dtype)) + "_K" + std::to_string(c.kernel) + (c.bias ? "_bias" : "");
}

void PrintTo(const ConvCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_conv(const ConvCase& c) {
  const DType dt = c.dtype;
  const int K = c.kernel;
  const bool bias = c.bias;
  const uint64_t seed = c.seed;
  SCOPED_TRACE(std::string(dtype_str(dt)) + " K=" + std::to_string(K) + (bias ? " bias" : ""));
  std::mt19937_64 rng(seed);
  const int C = 96, split0 = 32, split1 = 64, stride = C + 40, slots = 7;
  // Two steps over the same sequences: step 1 mixes prefill chunks of every length class, step 2 continues them
  // (decode tokens and another chunk), so states are carried across steps.
  const std::vector<std::vector<int>> steps_lens = {{5, 1, 2, 13, K - 1 > 0 ? K - 1 : 1}, {1, 1, 3, 1, 6}};
  const std::vector<int> seq_slots = {4, 0, 6, 2, 5};
  std::vector<float> w(static_cast<size_t>(C) * K), bs(C);
  std::normal_distribution<float> nd(0.f, 0.5f);
  for (float& x : w) x = nd(rng);
  for (float& x : bs) x = nd(rng);
  std::vector<float> pool_ref(static_cast<size_t>(slots) * C * std::max(K - 1, 1));
  for (float& x : pool_ref) x = nd(rng);  // previous owners' garbage: each sequence below starts from it as state
  DevBuf<float> d_w, d_b, d_pool;
  d_w.upload(w);
  d_b.upload(bs);
  d_pool.upload(pool_ref);
  for (const auto& lens : steps_lens) {
    const int B = static_cast<int>(lens.size());
    std::vector<int32_t> cu = {0}, sidx;
    for (int b = 0; b < B; ++b) {
      cu.push_back(cu.back() + lens[b]);
      for (int i = 0; i < lens[b]; ++i) sidx.push_back(b);
    }
    const int T = cu.back();
    std::vector<float> x32;
    const std::vector<uint16_t> x16 = random_half(dt, static_cast<size_t>(T) * stride, 1.f, rng, &x32);
    // Reference on the strided input's channel columns.
    std::vector<float> xc(static_cast<size_t>(T) * C), out_ref(static_cast<size_t>(T) * C);
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) xc[static_cast<size_t>(t) * C + c] = x32[static_cast<size_t>(t) * stride + c];
    CausalConv1dParams rp;
    rp.x = xc.data();
    rp.weight = w.data();
    rp.bias = bias ? bs.data() : nullptr;
    rp.out = out_ref.data();
    rp.state_pool = pool_ref.data();
    rp.num_state_slots = slots;
    rp.state_slots = seq_slots.data();
    rp.cu_tokens = cu.data();
    rp.batch = B;
    rp.channels = C;
    rp.kernel = K;
    rp.silu = true;
    causal_conv1d_ref(rp);

    DevBuf<uint16_t> d_x, o0(static_cast<size_t>(T) * split0), o1(static_cast<size_t>(T) * (split1 - split0)),
        o2(static_cast<size_t>(T) * (C - split1));
    d_x.upload(x16);
    o0.poison();
    o1.poison();
    o2.poison();
    DevBuf<int32_t> d_slots, d_cu, d_sidx;
    d_slots.upload(std::vector<int32_t>(seq_slots.begin(), seq_slots.end()));
    d_cu.upload(cu);
    d_sidx.upload(sidx);
    CausalConv1dGpuParams p;
    p.dtype = dt;
    p.x = d_x.get();
    p.x_stride = stride;
    p.weight = d_w.get();
    p.bias = bias ? d_b.get() : nullptr;
    p.out[0] = o0.get();
    p.out[1] = o1.get();
    p.out[2] = o2.get();
    p.split[0] = split0;
    p.split[1] = split1;
    p.state_pool = d_pool.get();
    p.num_state_slots = slots;
    p.state_slots = d_slots.get();
    p.cu_tokens = d_cu.get();
    p.seq_idx = d_sidx.get();
    p.total_tokens = T;
    p.batch = B;
    p.channels = C;
    p.kernel = K;
    SPADE_CUDA_OK(causal_conv1d(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> g0 = to_f32(dt, o0.download()), g1 = to_f32(dt, o1.download()),
                             g2 = to_f32(dt, o2.download());
    std::vector<float> got(static_cast<size_t>(T) * C);
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        float v;
        if (c < split0) {
          v = g0[static_cast<size_t>(t) * split0 + c];
        } else if (c < split1) {
          v = g1[static_cast<size_t>(t) * (split1 - split0) + c - split0];
        } else {
          v = g2[static_cast<size_t>(t) * (C - split1) + c - split1];
        }
        got[static_cast<size_t>(t) * C + c] = v;
      }
    expect_close(got, out_ref, half_tol(dt), 1e-3, "conv outputs");
    if (K > 1) {
      // States are copies of inputs (or of older states): exact. Unused slots (1, 3) keep their garbage.
      EXPECT_EQ(d_pool.download(), pool_ref) << "conv states";
    }
  }
}

// clang-format off
const std::vector<ConvCase> kCausalConv1dCases = {
    {.dtype = DType::BF16, .kernel = 4, .seed = 11},
    {.dtype = DType::F16, .kernel = 4, .bias = true, .seed = 12},
    {.dtype = DType::BF16, .kernel = 8, .bias = true, .seed = 13},
    // K = 1 keeps no state
    {.dtype = DType::BF16, .kernel = 1, .seed = 14},
};
// clang-format on

class CausalConv1dGpu : public ::testing::TestWithParam<ConvCase> {};

TEST_P(CausalConv1dGpu, MatchesReference) { run_conv(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, CausalConv1dGpu, ::testing::ValuesIn(kCausalConv1dCases), spade::test::CaseName());

TEST_F(CausalConv1dGpu, BadParametersNameTheField) {
  CausalConv1dGpuParams p;
  p.dtype = DType::BF16;
  p.total_tokens = 1;
  p.batch = 1;
  p.channels = 8;
  p.kernel = kMaxConvKernel + 1;
  p.x_stride = 8;
  EXPECT_EQ(causal_conv1d(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("kernel"), std::string::npos);
  p.kernel = 4;
  p.split[0] = 9;
  p.split[1] = 9;
  EXPECT_EQ(causal_conv1d(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("split"), std::string::npos);
  p.split[0] = 4;
  p.split[1] = 8;
  EXPECT_EQ(causal_conv1d(p, nullptr), cudaErrorInvalidValue);  // null pointers
  p.total_tokens = 0;
  p.batch = 0;
  EXPECT_EQ(causal_conv1d(p, nullptr), cudaSuccess);  // nothing to do
}

// ---- GDN gating ----

TEST(GdnGatingGpu, MatchesReference) {
  for (DType dt : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_str(dt));
    std::mt19937_64 rng(21);
    const int T = 37, Hv = 32, stride = 3 * Hv + 5;
    std::vector<float> p32;
    const std::vector<uint16_t> p16 = random_half(dt, static_cast<size_t>(T) * stride, 6.f, rng, &p32);
    std::vector<float> a_log(Hv), dt_bias(Hv);
    std::uniform_real_distribution<float> u(-4.6f, 2.8f);
    for (int h = 0; h < Hv; ++h) {
      a_log[h] = u(rng);
      dt_bias[h] = 1.f + 0.1f * static_cast<float>(h % 7);
    }
    std::vector<float> beta_ref(T * Hv), g_ref(T * Hv);
    gdn_gating_ref(p32.data() + 2, p32.data() + 2 + Hv, stride, a_log.data(), dt_bias.data(), beta_ref.data(),
                   g_ref.data(), T, Hv);
    DevBuf<uint16_t> d_p;
    d_p.upload(p16);
    DevBuf<float> d_alog, d_dt, beta(T * Hv), g(T * Hv);
    d_alog.upload(a_log);
    d_dt.upload(dt_bias);
    beta.poison();
    g.poison();
    GdnGatingParams gp;
    gp.dtype = dt;
    gp.b = d_p.get() + 2;
    gp.a = d_p.get() + 2 + Hv;
    gp.stride = stride;
    gp.a_log = d_alog.get();
    gp.dt_bias = d_dt.get();
    gp.beta = beta.get();
    gp.g = g.get();
    gp.tokens = T;
    gp.num_v_heads = Hv;
    SPADE_CUDA_OK(gdn_gating(gp, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    expect_close(beta.download(), beta_ref, 1e-5, 1e-7, "beta");
    expect_close(g.download(), g_ref, 1e-5, 1e-7, "g");
    gp.stride = Hv - 1;
    EXPECT_EQ(gdn_gating(gp, nullptr), cudaErrorInvalidValue);
  }
}

// ---- gated RMSNorm ----

TEST(GatedRmsNormGpu, MatchesReference) {
  for (DType dt : {DType::BF16, DType::F16}) {
    for (int dim : {64, 128, 48}) {
      SCOPED_TRACE(std::string(dtype_str(dt)) + " dim=" + std::to_string(dim));
      std::mt19937_64 rng(31 + dim);
      const int T = 19, heads = 6, z_stride = heads * dim + 24;
      std::vector<float> x32, z32, w(dim);
      const std::vector<uint16_t> x16 = random_half(dt, static_cast<size_t>(T) * heads * dim, 2.f, rng, &x32);
      const std::vector<uint16_t> z16 = random_half(dt, static_cast<size_t>(T) * z_stride, 2.f, rng, &z32);
      std::normal_distribution<float> nd(1.f, 0.2f);
      for (float& v : w) v = nd(rng);
      std::vector<float> zc(x32.size()), ref(x32.size());
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < heads * dim; ++i)
          zc[static_cast<size_t>(t) * heads * dim + i] = z32[static_cast<size_t>(t) * z_stride + i];
      gated_rmsnorm_ref(x32.data(), zc.data(), w.data(), ref.data(), T * heads, dim, 1e-6f);
      DevBuf<uint16_t> d_x, d_z, y(x16.size());
      d_x.upload(x16);
      d_z.upload(z16);
      y.poison();
      DevBuf<float> d_w;
      d_w.upload(w);
      GatedRmsNormParams p;
      p.dtype = dt;
      p.x = d_x.get();
      p.z = d_z.get();
      p.z_stride = z_stride;
      p.weight = d_w.get();
      p.y = y.get();
      p.tokens = T;
      p.heads = heads;
      p.dim = dim;
      p.eps = 1e-6f;
      SPADE_CUDA_OK(gated_rmsnorm(p, nullptr));
      SPADE_CUDA_OK(cudaDeviceSynchronize());
      expect_close(to_f32(dt, y.download()), ref, half_tol(dt) + 1e-5, 1e-3, "gated rmsnorm");
    }
  }
}

// ---- output gate ----

TEST(OutputGateGpu, MatchesReference) {
  for (DType dt : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_str(dt));
    std::mt19937_64 rng(41);
    const int T = 23, dim = 256, stride = 3 * dim + 64;
    std::vector<float> o32, g32;
    const std::vector<uint16_t> o16 = random_half(dt, static_cast<size_t>(T) * dim, 2.f, rng, &o32);
    const std::vector<uint16_t> g16 = random_half(dt, static_cast<size_t>(T) * stride, 3.f, rng, &g32);
    std::vector<float> ref = o32;
    output_gate_ref(ref.data(), g32.data() + 2 * dim, stride, T, dim);
    DevBuf<uint16_t> d_o, d_g;
    d_o.upload(o16);
    d_g.upload(g16);
    OutputGateParams p;
    p.dtype = dt;
    p.out = d_o.get();
    p.gate = d_g.get() + 2 * dim;
    p.gate_stride = stride;
    p.tokens = T;
    p.dim = dim;
    SPADE_CUDA_OK(output_gate(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    expect_close(to_f32(dt, d_o.download()), ref, half_tol(dt) + 1e-5, 1e-4, "output gate");
    p.dim = 3;
    EXPECT_EQ(output_gate(p, nullptr), cudaErrorInvalidValue);
  }
}

// ---- state reset ----

TEST(GdnResetStatesGpu, ZeroesOnlyFreshSequencesInEveryLayer) {
  const int layers = 3, slots = 5, conv = 24, rec = 1000;
  std::vector<float> conv_pool(static_cast<size_t>(layers) * slots * conv), rec_pool(static_cast<size_t>(layers) * slots * rec);
  for (size_t i = 0; i < conv_pool.size(); ++i) conv_pool[i] = 1.f + static_cast<float>(i);
  for (size_t i = 0; i < rec_pool.size(); ++i) rec_pool[i] = 2.f + static_cast<float>(i);
  // Sequences: slot 3 fresh (prefill from 0), slot 1 continuing a prefill, slot 4 decoding, slot 0 fresh (1 token).
  const std::vector<int32_t> seq_slots = {3, 1, 4, 0}, cu = {0, 7, 12, 13, 14}, lens = {7, 20, 33, 1};
  DevBuf<float> d_conv, d_rec;
  d_conv.upload(conv_pool);
  d_rec.upload(rec_pool);
  DevBuf<int32_t> d_slots, d_cu, d_lens;
  d_slots.upload(seq_slots);
  d_cu.upload(cu);
  d_lens.upload(lens);
  GdnResetStatesParams p;
  p.conv_pool = d_conv.get();
  p.conv_elems = conv;
  p.recurrent_pool = d_rec.get();
  p.recurrent_elems = rec;
  p.layers = layers;
  p.num_state_slots = slots;
  p.state_slots = d_slots.get();
  p.cu_tokens = d_cu.get();
  p.seq_lens = d_lens.get();
  p.batch = 4;
  SPADE_CUDA_OK(gdn_reset_states(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> gc = d_conv.download(), gr = d_rec.download();
  for (int l = 0; l < layers; ++l)
    for (int s = 0; s < slots; ++s) {
      const bool fresh = s == 3 || s == 0;
      for (int i = 0; i < conv; ++i) {
        const size_t k = (static_cast<size_t>(l) * slots + s) * conv + i;
        ASSERT_EQ(gc[k], fresh ? 0.f : conv_pool[k]) << "conv layer " << l << " slot " << s;
      }
      for (int i = 0; i < rec; ++i) {
        const size_t k = (static_cast<size_t>(l) * slots + s) * rec + i;
        ASSERT_EQ(gr[k], fresh ? 0.f : rec_pool[k]) << "recurrent layer " << l << " slot " << s;
      }
    }
  p.recurrent_pool = nullptr;
  EXPECT_EQ(gdn_reset_states(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace spade::kernels

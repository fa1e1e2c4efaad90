// CPU references of the dense layer ops against straightforward float64 formulas on random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <random>
#include <vector>

#include "kernels/linear_ref.h"
#include "kernels/paged_attention_ref.h"
#include "kernels/rmsnorm_ref.h"
#include "kernels/rope_ref.h"
#include "kernels/swiglu_ref.h"

namespace spade::kernels {
namespace {

std::vector<float> randn(size_t n, std::mt19937& g, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(CpuRefs, RmsNorm) {
  std::mt19937 g(1);
  const int rows = 7, dim = 96;
  auto x = randn(rows * dim, g), w = randn(dim, g);
  std::vector<float> y(rows * dim, NAN);
  rmsnorm_ref(x.data(), w.data(), y.data(), rows, dim, 1e-6f);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1 / std::sqrt(ss / dim + 1e-6);
    for (int i = 0; i < dim; ++i) EXPECT_NEAR(y[r * dim + i], w[i] * x[r * dim + i] * inv, 1e-5);
  }
}

TEST(CpuRefs, RopeIsComplexRotationOfHalves) {
  std::mt19937 g(2);
  const int tokens = 5, heads = 3, D = 16;
  auto x = randn(tokens * heads * D, g);
  auto y = x;
  std::vector<int32_t> pos = {0, 1, 17, 1000, 40000};
  rope_ref(y.data(), pos.data(), tokens, heads, D, D, 1e6);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D / 2; ++i) {
        const float* a = &x[(t * heads + h) * D];
        const float* b = &y[(t * heads + h) * D];
        const double ang = pos[t] * std::pow(1e6, -2.0 * i / D);
        auto z = std::complex<double>(a[i], a[i + D / 2]) * std::polar(1.0, ang);
        EXPECT_NEAR(b[i], z.real(), 2e-3) << t << " " << i;  // fp32 angle at position 40000
        EXPECT_NEAR(b[i + D / 2], z.imag(), 2e-3);
      }
  // Position 0 is the identity.
  for (int i = 0; i < heads * D; ++i) EXPECT_EQ(y[i], x[i]);
}

TEST(CpuRefs, PartialRopeLeavesTailUntouched) {
  std::mt19937 g(3);
  auto x = randn(32, g);
  auto y = x;
  int32_t pos = 5;
  rope_ref(y.data(), &pos, 1, 1, 32, 8, 10000.0);
  for (int i = 8; i < 32; ++i) EXPECT_EQ(y[i], x[i]);
  EXPECT_NE(y[1], x[1]);
}

TEST(CpuRefs, SwiGluAndLinear) {
  std::mt19937 g(4);
  const int m = 9, n = 37, k = 70;
  auto x = randn(m * k, g), w = randn(n * k, g), b = randn(n, g);
  std::vector<float> y(m * n, NAN);
  linear_ref(x.data(), w.data(), b.data(), y.data(), m, n, k);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = b[j];
      for (int t = 0; t < k; ++t) s += double(x[i * k + t]) * w[j * k + t];
      EXPECT_NEAR(y[i * n + j], s, 1e-4);
    }
  auto gate = randn(50, g), up = randn(50, g);
  std::vector<float> o(50);
  swiglu_ref(gate.data(), up.data(), o.data(), 5, 10);
  for (int i = 0; i < 50; ++i) EXPECT_NEAR(o[i], gate[i] / (1 + std::exp(-double(gate[i]))) * up[i], 1e-6);
}

// Paged attention against dense causal attention in float64 on contiguous K/V, with shuffled page ids, GQA,
// a ragged batch mixing a prefill chunk with decode rows.
TEST(CpuRefs, PagedAttentionMatchesContiguousCausal) {
  std::mt19937 g(5);
  for (int page_size : {1, 3, 16}) {
    const int Hq = 8, Hkv = 2, D = 16;
    const std::vector<int> seq_lens = {37, 1, 20};
    const std::vector<int> q_lens = {1, 1, 6};
    const int B = 3;
    int max_pages = 0, total_pages = 0;
    for (int L : seq_lens) {
      max_pages = std::max(max_pages, (L + page_size - 1) / page_size);
      total_pages += (L + page_size - 1) / page_size;
    }
    std::vector<int32_t> perm(total_pages + 5);
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i);
    std::shuffle(perm.begin(), perm.end(), g);
    const int num_pages = static_cast<int>(perm.size());
    auto kc = randn(size_t(num_pages) * page_size * Hkv * D, g), vc = randn(size_t(num_pages) * page_size * Hkv * D, g);
    std::vector<int32_t> bt(B * max_pages, -1), cu = {0}, sl(seq_lens.begin(), seq_lens.end());
    int next = 0;
    for (int b = 0; b < B; ++b) {
      for (int p = 0; p < (seq_lens[b] + page_size - 1) / page_size; ++p) bt[b * max_pages + p] = perm[next++];
      cu.push_back(cu.back() + q_lens[b]);
    }
    auto q = randn(size_t(cu.back()) * Hq * D, g);
    std::vector<float> out(q.size(), NAN), lse(size_t(cu.back()) * Hq, NAN);
    // {{paged KV shape: batch, KV heads, head_dim, page size, block-table width}, query heads}, then the pointers.
    PagedAttentionParams p{{{B, Hkv, D, page_size, max_pages}, Hq}, q.data(), kc.data(), vc.data(), bt.data(),
                           cu.data(), sl.data(), out.data(), lse.data(), 0.25f};
    paged_attention_ref(p);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < q_lens[b]; ++i) {
        const int pos = seq_lens[b] - q_lens[b] + i;
        for (int h = 0; h < Hq; ++h) {
          const float* qv = &q[(size_t(cu[b] + i) * Hq + h) * D];
          std::vector<double> s(pos + 1);
          double mx = -1e300;
          for (int t = 0; t <= pos; ++t) {
            const size_t off = (size_t(bt[b * max_pages + t / page_size]) * page_size + t % page_size) * Hkv * D +
                               (h / (Hq / Hkv)) * D;
            double d = 0;
            for (int e = 0; e < D; ++e) d += double(qv[e]) * kc[off + e];
            s[t] = d * 0.25;
            mx = std::max(mx, s[t]);
          }
          double z = 0;
          std::vector<double> o(D);
          for (int t = 0; t <= pos; ++t) {
            const size_t off = (size_t(bt[b * max_pages + t / page_size]) * page_size + t % page_size) * Hkv * D +
                               (h / (Hq / Hkv)) * D;
            const double w = std::exp(s[t] - mx);
            z += w;
            for (int e = 0; e < D; ++e) o[e] += w * vc[off + e];
          }
          const float* got = &out[(size_t(cu[b] + i) * Hq + h) * D];
          for (int e = 0; e < D; ++e) EXPECT_NEAR(got[e], o[e] / z, 1e-5);
          EXPECT_NEAR(lse[size_t(cu[b] + i) * Hq + h], mx + std::log(z), 1e-4);
        }
      }
  }
}

}  // namespace
}  // namespace spade::kernels

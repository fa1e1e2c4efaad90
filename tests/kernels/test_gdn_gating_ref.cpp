// gdn_gating_ref and output_gate_ref (kernels/gdn_gating_ref.h, kernels/output_gate_ref.h): values against the
// formulas in double precision, torch's softplus threshold, strided inputs, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/error.h"
#include "kernels/gdn_gating_ref.h"
#include "kernels/output_gate_ref.h"

namespace spade::kernels {
namespace {

TEST(GdnGatingRef, MatchesTheFormulasOnStridedColumns) {
  const int T = 5, Hv = 3, stride = 11;
  std::vector<float> proj(static_cast<size_t>(T) * stride);
  for (size_t i = 0; i < proj.size(); ++i) proj[i] = std::sin(0.7f * static_cast<float>(i)) * 30.f;  // past +-20
  const std::vector<float> a_log = {-1.5f, 0.f, 2.f}, dt_bias = {0.5f, -3.f, 1.f};
  std::vector<float> beta(T * Hv), g(T * Hv);
  gdn_gating_ref(proj.data() + 2, proj.data() + 2 + Hv, stride, a_log.data(), dt_bias.data(), beta.data(), g.data(), T,
                 Hv);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < Hv; ++h) {
      const double b = proj[static_cast<size_t>(t) * stride + 2 + h], a = proj[static_cast<size_t>(t) * stride + 2 + Hv + h];
      const double x = a + dt_bias[h];
      const double sp = x > 20.0 ? x : std::log1p(std::exp(x));
      EXPECT_NEAR(beta[t * Hv + h], 1.0 / (1.0 + std::exp(-b)), 1e-6);
      EXPECT_NEAR(g[t * Hv + h], -std::exp(static_cast<double>(a_log[h])) * sp, 1e-5 * (1.0 + std::abs(sp)));
      EXPECT_LE(g[t * Hv + h], 0.f);
    }
  EXPECT_EQ(softplus_ref(25.f), 25.f);  // linear above torch's threshold
  EXPECT_THROW(gdn_gating_ref(nullptr, proj.data(), stride, a_log.data(), dt_bias.data(), beta.data(), g.data(), T, Hv),
               Error);
  EXPECT_THROW(gdn_gating_ref(proj.data(), proj.data(), 2, a_log.data(), dt_bias.data(), beta.data(), g.data(), T, Hv),
               Error);
}

TEST(OutputGateRef, ScalesByTheSigmoidOfTheGateColumns) {
  const int T = 3, dim = 4, stride = 10;
  std::vector<float> out(T * dim), gate(T * stride);
  for (int i = 0; i < T * dim; ++i) out[i] = static_cast<float>(i) - 5.f;
  for (int i = 0; i < T * stride; ++i) gate[i] = 0.3f * static_cast<float>(i) - 4.f;
  const std::vector<float> before = out;
  output_gate_ref(out.data(), gate.data() + 6, stride, T, dim);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < dim; ++i)
      EXPECT_FLOAT_EQ(out[t * dim + i],
                      before[t * dim + i] * (1.f / (1.f + std::exp(-gate[static_cast<size_t>(t) * stride + 6 + i]))));
  EXPECT_THROW(output_gate_ref(out.data(), gate.data(), 3, T, dim), Error);
}

}  // namespace
}  // namespace spade::kernels

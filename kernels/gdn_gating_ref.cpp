// CPU reference of the Gated DeltaNet gating (see gdn_gating_ref.h).
#include "kernels/gdn_gating_ref.h"

#include <cmath>

#include "common/error.h"

namespace spade::kernels {

float softplus_ref(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

float sigmoid_ref(float x) { return 1.f / (1.f + std::exp(-x)); }

void gdn_gating_ref(const float* b, const float* a, int stride, const float* a_log, const float* dt_bias, float* beta,
                    float* g, int tokens, int num_v_heads) {
  SPADE_CHECK(b != nullptr && a != nullptr && a_log != nullptr && dt_bias != nullptr && beta != nullptr && g != nullptr,
              "gdn_gating_ref: every pointer must be set");
  SPADE_CHECK(tokens >= 0 && num_v_heads > 0 && stride >= num_v_heads,
              "gdn_gating_ref: tokens {} / num_v_heads {} / stride {} invalid", tokens, num_v_heads, stride);
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < num_v_heads; ++h) {
      const size_t i = static_cast<size_t>(t) * stride + h, o = static_cast<size_t>(t) * num_v_heads + h;
      beta[o] = sigmoid_ref(b[i]);
      g[o] = -std::exp(a_log[h]) * softplus_ref(a[i] + dt_bias[h]);
    }
  }
}

}  // namespace spade::kernels

#include "kernels/rope_ref.h"

#include <cmath>
#include <cstddef>
#include <vector>

namespace spade::kernels {

void rope_ref(float* x, const int32_t* positions, int tokens, int num_heads, int head_dim, int rot_dim,
              double theta) {
  const int half = rot_dim / 2;
  // inv_freq in fp32, as transformers computes it (base ** (arange(0, dim, 2).float() / dim)).
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i)
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(rot_dim));
  std::vector<float> c(half), s(half);
  for (int t = 0; t < tokens; ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (int i = 0; i < half; ++i) {
      const float a = pos * inv_freq[i];
      c[i] = std::cos(a);
      s[i] = std::sin(a);
    }
    for (int h = 0; h < num_heads; ++h) {
      float* v = x + (static_cast<size_t>(t) * num_heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x0 = v[i];
        const float x1 = v[i + half];
        v[i] = x0 * c[i] - x1 * s[i];
        v[i + half] = x1 * c[i] + x0 * s[i];
      }
    }
  }
}

}  // namespace spade::kernels

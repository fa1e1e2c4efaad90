#include "kernels/swiglu_ref.h"

#include <cmath>
#include <cstddef>

namespace spade::kernels {

void swiglu_ref(const float* gate, const float* up, float* out, int rows, int dim) {
  const size_t n = static_cast<size_t>(rows) * dim;
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace spade::kernels

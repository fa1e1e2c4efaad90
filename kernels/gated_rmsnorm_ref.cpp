#include "kernels/gated_rmsnorm_ref.h"

#include <cmath>
#include <cstddef>

namespace spade::kernels {

void gated_rmsnorm_ref(const float* x, const float* z, const float* weight, float* y, int rows, int dim, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * dim;
    const float* zr = z + static_cast<size_t>(r) * dim;
    float* yr = y + static_cast<size_t>(r) * dim;
    float ss = 0.f;
    for (int i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int i = 0; i < dim; ++i) {
      const float g = zr[i] / (1.f + std::exp(-zr[i]));
      yr[i] = weight[i] * (xr[i] * inv) * g;
    }
  }
}

}  // namespace spade::kernels

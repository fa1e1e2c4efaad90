#include "kernels/linear_ref.h"

#include <cstddef>

namespace spade::kernels {
namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int k) {
  // Eight independent partial sums so the compiler vectorises without -ffast-math reassociation.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < k; ++i) r += a[i] * b[i];
  return r;
}

}  // namespace

void linear_ref(const float* x, const float* w, const float* bias, float* y, int m, int n, int k) {
  // Tile rows of x so a block of W rows stays in cache while it meets every x row of the tile.
  constexpr int kRowTile = 8;
#pragma omp parallel for schedule(static) if (static_cast<long>(m) * n * k > (1L << 22))
  for (int j = 0; j < n; ++j) {
    const float* wj = w + static_cast<size_t>(j) * k;
    const float b = bias ? bias[j] : 0.f;
    for (int i0 = 0; i0 < m; i0 += kRowTile) {
      const int i1 = i0 + kRowTile < m ? i0 + kRowTile : m;
      for (int i = i0; i < i1; ++i) y[static_cast<size_t>(i) * n + j] = dot(x + static_cast<size_t>(i) * k, wj, k) + b;
    }
  }
}

}  // namespace spade::kernels

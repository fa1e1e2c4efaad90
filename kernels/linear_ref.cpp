#include "kernels/linear_ref.h"

#include <cblas.h>

#include <cstddef>
#include <string>

namespace spade::kernels {

void linear_ref(const float* x, const float* w, const float* bias, float* y, int m, int n, int k) {
  if (m <= 0 || n <= 0) return;
  if (k > 0 && m == 1) {
    // One row (a decode step of one sequence): y = W x as a GEMV, which streams W once instead of packing it.
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.f, w, k, x, 1, 0.f, y, 1);
  } else if (k > 0) {
    // Row-major C[m, n] = A[m, k] · B[n, k]ᵀ.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, x, k, w, k, 0.f, y, n);
  }
  if (bias == nullptr && k > 0) return;
  for (int i = 0; i < m; ++i) {
    float* row = y + static_cast<size_t>(i) * n;
    for (int j = 0; j < n; ++j) row[j] = (k > 0 ? row[j] : 0.f) + (bias ? bias[j] : 0.f);
  }
}

const char* blas_description() {
  static const std::string text = [] {
    std::string s = "OpenBLAS";
    if (const char* cfg = openblas_get_config()) s += std::string(" (") + cfg + ")";
    if (const char* core = openblas_get_corename()) s += std::string(", core ") + core;
    s += ", " + std::to_string(openblas_get_num_threads()) + " threads";
    return s;
  }();
  return text.c_str();
}

}  // namespace spade::kernels

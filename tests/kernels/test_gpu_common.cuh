// Helpers shared by the GPU kernel tests (tests/kernels/test_*.cu): device buffers, random bf16/fp16 data with its
// exact fp32 image (what the CPU references consume), a randomly permuted paged KV cache, error metrics.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/attention.cuh"

namespace spade::test {

#define SPADE_CUDA_OK(expr)                                                                                        \
  do {                                                                                                             \
    const cudaError_t spade_err_ = (expr);                                                                         \
    ASSERT_EQ(spade_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(spade_err_) << " ("                  \
                                       << ::spade::kernels::launch_error_detail() << ")";                          \
  } while (0)

/// Owning device allocation of `n` elements of T.
template <typename T>
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t n) { alloc(n); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  void alloc(size_t n) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = n;
    if (cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << n * sizeof(T) << " bytes failed";
    }
  }
  void upload(const std::vector<T>& h) {
    alloc(h.size());
    if (ptr_ != nullptr) EXPECT_EQ(cudaMemcpy(ptr_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (ptr_ != nullptr) EXPECT_EQ(cudaMemcpy(h.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  /// Fills every byte with 0xFF: NaN for bf16 / fp16 / fp32, -1 for int32.
  void poison() {
    if (ptr_ != nullptr) EXPECT_EQ(cudaMemset(ptr_, 0xFF, std::max<size_t>(n_, 1) * sizeof(T)), cudaSuccess);
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

inline uint16_t to_bits(DType t, float x) { return t == DType::BF16 ? f32_to_bf16(x) : f32_to_f16(x); }
inline float from_bits(DType t, uint16_t h) { return t == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h); }

/// Random values N(0, sigma) rounded to `t`; `exact` receives their fp32 images.
inline std::vector<uint16_t> random_half(DType t, size_t n, float sigma, std::mt19937_64& rng,
                                         std::vector<float>* exact) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<uint16_t> bits(n);
  exact->resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = to_bits(t, dist(rng));
    (*exact)[i] = from_bits(t, bits[i]);
  }
  return bits;
}

inline std::vector<float> to_f32(DType t, const std::vector<uint16_t>& bits) {
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = from_bits(t, bits[i]);
  return f;
}

/// A paged KV cache with randomly permuted physical pages (plus unused pages) for a batch of lengths.
struct PagedCache {
  DType dtype = DType::BF16;
  int page_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_pages = 0;
  int num_pages = 0;
  std::vector<int32_t> block_table;  // [batch, max_pages]
  std::vector<float> k32, v32;       // fp32 images
  DevBuf<uint16_t> k, v;
  DevBuf<int32_t> bt;

  void build(DType t, const std::vector<int>& lens, int ps, int hkv, int d, std::mt19937_64& rng) {
    dtype = t;
    page_size = ps;
    num_kv_heads = hkv;
    head_dim = d;
    const int batch = static_cast<int>(lens.size());
    int max_len = 1;
    int needed = 0;
    for (int l : lens) {
      max_len = std::max(max_len, l);
      needed += (l + ps - 1) / ps;
    }
    max_pages = (max_len + ps - 1) / ps + 1;  // one spare entry per row, left at -1
    num_pages = needed + 3;                   // unused pages stay random, never read
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    block_table.assign(static_cast<size_t>(batch) * max_pages, -1);
    int next = 0;
    for (int b = 0; b < batch; ++b) {
      for (int p = 0; p < (lens[b] + ps - 1) / ps; ++p) block_table[static_cast<size_t>(b) * max_pages + p] = perm[next++];
    }
    const size_t n = static_cast<size_t>(num_pages) * ps * hkv * d;
    k.upload(random_half(t, n, 1.f, rng, &k32));
    v.upload(random_half(t, n, 1.f, rng, &v32));
    bt.upload(block_table);
  }
};

/// max over rows of ||got - ref|| / ||ref|| (rows of length `row`); NaN if any element is not finite.
inline double max_row_rel_err(const std::vector<float>& got, const std::vector<float>& ref, size_t row) {
  double worst = 0.0;
  for (size_t r = 0; r * row < ref.size(); ++r) {
    double num = 0.0, den = 0.0;
    for (size_t i = r * row; i < (r + 1) * row; ++i) {
      if (!std::isfinite(got[i])) return std::nan("");
      num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
      den += static_cast<double>(ref[i]) * ref[i];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

/// Relative error bound of an attention output row (P and the output rounded to the element type once each).
inline double attention_tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 4e-3; }

inline const char* dtype_str(DType t) { return t == DType::BF16 ? "bf16" : "fp16"; }

// ---- names of the table-driven (value-parameterized) kernel tests ----
// Each case-driven suite is TEST_P(Suite, MatchesReference) over a table of case structs written with designated
// initializers, instantiated with an empty prefix and CaseName:
//   INSTANTIATE_TEST_SUITE_P(, Suite, ::testing::ValuesIn(kSuiteCases), spade::test::CaseName());
// so a case's full name is Suite.MatchesReference/<case_name(case)>, built from the case's values (it cannot
// disagree with them), and Suite.* still selects the whole suite (its other tests are TEST_F on the same fixture).
// gtest allows only [A-Za-z0-9_] in these names, hence the helpers below.

/// "1_17_300"; a negative value as "m1"; a run of three or more equal values as "1x64".
inline std::string name_ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j < v.size() && v[j] == v[i]) ++j;
    if (!s.empty()) s += '_';
    s += (v[i] < 0 ? "m" + std::to_string(-static_cast<long long>(v[i])) : std::to_string(v[i]));
    if (j - i >= 3) {
      s += 'x' + std::to_string(j - i);
    } else {
      j = i + 1;
    }
    i = j;
  }
  return s;
}

/// printf's %g with '.' as 'p', '-' as 'm' and no '+': 0.7 -> "0p7", 1e-05 -> "1em05", 1e+06 -> "1e06".
inline std::string name_num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  std::string s;
  for (const char* c = buf; *c != 0; ++c) {
    if (*c == '.') {
      s += 'p';
    } else if (*c == '-') {
      s += 'm';
    } else if (*c != '+') {
      s += *c;
    }
  }
  return s;
}

/// "bf16" / "fp16" / "f32".
inline const char* name_dtype(DType t) { return t == DType::F32 ? "f32" : dtype_str(t); }

/// A case whose context reaches kLongContext tokens is long: its name starts with "Long_", which bench/run_gpu.sh's
/// memcheck leaves out by default (SPADE_MEMCHECK_FILTER=-*Long*: the same code paths as the shorter cases, minutes
/// under the sanitizer).
constexpr int kLongContext = 65536;
inline std::string long_prefix(bool is_long) { return is_long ? "Long_" : ""; }
inline int max_of(const std::vector<int>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

/// INSTANTIATE_TEST_SUITE_P's name generator: case_name(case), found next to the case struct (argument-dependent
/// lookup), so every table names its cases from their values.
struct CaseName {
  template <typename Case>
  std::string operator()(const ::testing::TestParamInfo<Case>& info) const {
    return case_name(info.param);
  }
};

}  // namespace spade::test

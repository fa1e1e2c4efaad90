// Host-side helpers shared by the kernel launchers of kernels/*.cu (internal).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

namespace spade::kernels::detail {

/// The calling thread's last launcher validation message (see launch_error_detail()).
inline std::string& launch_error_slot() {
  thread_local std::string slot;
  return slot;
}

/// Records "<what>: <parts...>" as the launch error detail and returns cudaErrorInvalidValue.
template <typename... Parts>
cudaError_t invalid_argument(const char* what, Parts&&... parts) {
  std::ostringstream os;
  os << what << ": ";
  (os << ... << std::forward<Parts>(parts));
  launch_error_slot() = os.str();
  return cudaErrorInvalidValue;
}

/// Multiprocessor count of the current device (0 on error).
inline int current_sm_count() {
  int dev = 0;
  int n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  return n;
}

/// Per-kernel one-time setup of the dynamic shared memory limit on each device (bitmask of devices done).
/// Returns the CUDA error of cudaFuncSetAttribute, or cudaSuccess.
template <typename Kernel>
cudaError_t ensure_smem_attribute(Kernel kernel, size_t smem_bytes, std::atomic<uint64_t>& done_mask) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit != 0 && (done_mask.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (e == cudaSuccess && bit != 0) done_mask.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

constexpr int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

/// Split-K count for `pairs` independent (sequence, head) rows of up to `max_len` tokens on `slots` concurrent CTAs
/// (SM count x occupancy), between `min_splits` and `max_splits`, at most one split per `min_tokens` tokens: the
/// smallest count whose last wave is >= 85% full (wave quantisation), else the best wave efficiency.
inline int choose_splits(long long pairs, long long slots, int max_len, int min_tokens, int min_splits,
                         int max_splits) {
  slots = slots < 1 ? 1 : slots;
  min_splits = min_splits < 1 ? 1 : min_splits;
  int s_max = ceil_div(max_len, min_tokens);
  s_max = s_max < min_splits ? min_splits : (s_max > max_splits ? max_splits : s_max);
  int best = min_splits;
  double best_eff = -1.0;
  for (int s = min_splits; s <= s_max; ++s) {
    const long long ctas = pairs * s;
    const double eff = static_cast<double>(ctas) / static_cast<double>(((ctas + slots - 1) / slots) * slots);
    if (eff >= 0.85) return s;
    if (eff > best_eff) {
      best_eff = eff;
      best = s;
    }
  }
  return best;
}

}  // namespace spade::kernels::detail

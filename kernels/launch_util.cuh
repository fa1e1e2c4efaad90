// Host-side helpers shared by the kernel launchers of kernels/*.cu (internal).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/head_dims.cuh"

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

/// Runs the setup step f(device) -> cudaError_t once per device of the calling thread's current device: bit `device`
/// of done_mask records a success (a device >= 64 runs it on every call). Returns f's error, or cudaSuccess.
template <typename F>
cudaError_t once_per_device(std::atomic<uint64_t>& done_mask, F&& f) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit != 0 && (done_mask.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  e = f(dev);
  if (e == cudaSuccess && bit != 0) done_mask.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

/// The dynamic shared-memory limit of kKernel set to smem_bytes, once per device (the mask is kKernel's own).
/// Returns the CUDA error of cudaFuncSetAttribute, or cudaSuccess.
template <auto kKernel>
cudaError_t ensure_smem_attribute(size_t smem_bytes) {
  static std::atomic<uint64_t> done{0};
  return once_per_device(done, [&](int) {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  });
}

/// The dynamic shared-memory limit of kKernel set to the device's opt-in maximum, once per device: for kernels whose
/// size grows with a launch argument (a limit set for the first launch's size would make a later, larger launch fail
/// with cudaErrorInvalidValue). The limit reserves nothing: occupancy follows each launch's own size.
template <auto kKernel>
cudaError_t ensure_max_smem_attribute() {
  static std::atomic<uint64_t> done{0};
  return once_per_device(done, [](int dev) {
    int optin = 0;
    const cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  });
}

/// The run-time head_dim switch of the launchers: returns f(std::integral_constant<int, D>{}) for D = head_dim when it
/// is one of SPADE_FOR_EACH_HEAD_DIM, else invalid_argument(what, "head_dim <n> is not compiled (head_dims.cuh)").
template <typename F>
cudaError_t dispatch_head_dim(const char* what, int head_dim, F&& f) {
  switch (head_dim) {
#define SPADE_HEAD_DIM_CASE(D) \
  case D:                      \
    return f(std::integral_constant<int, D>{});
    SPADE_FOR_EACH_HEAD_DIM(SPADE_HEAD_DIM_CASE)
#undef SPADE_HEAD_DIM_CASE
    default:
      break;
  }
  return invalid_argument(what, "head_dim ", head_dim, " is not compiled (head_dims.cuh)");
}

/// Runs f(T{}, std::integral_constant<int, D>{}) -> cudaError_t for every compiled head_dim D and every T of Ts,
/// stopping at the first error, which it returns (the prepare_* functions: one-time setup of every instantiation).
template <typename... Ts, typename F>
cudaError_t for_each_type_head_dim(F&& f) {
  cudaError_t e = cudaSuccess;
  auto for_types = [&](auto dim) { (void)(((e = f(Ts{}, dim)) == cudaSuccess) && ...); };
#define SPADE_HEAD_DIM_STEP(D) \
  if (e == cudaSuccess) for_types(std::integral_constant<int, D>{});
  SPADE_FOR_EACH_HEAD_DIM(SPADE_HEAD_DIM_STEP)
#undef SPADE_HEAD_DIM_STEP
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

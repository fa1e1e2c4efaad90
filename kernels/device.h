// Device-level CUDA helpers shared by both ranks, the benchmarks and the tests: error checking (cuda_check), an
// owning event (CudaEvent), an owning allocation (DeviceBuffer) and the paged KV pool of every attention layer on one
// GPU (GpuKvPool). Nothing here knows about a model or a rank.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace spade {

/// Throws spade::Error "<what>: <cuda error> (<launch detail>)" when e != cudaSuccess.
void cuda_check(cudaError_t e, const char* what);

/// Owning CUDA event without timing (cross-stream ordering). Throws spade::Error naming `what` when it cannot be
/// created. Not copyable.
struct CudaEvent {
  cudaEvent_t e = nullptr;
  explicit CudaEvent(const char* what = "cudaEventCreate") {
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what);
  }
  ~CudaEvent() {
    if (e != nullptr) cudaEventDestroy(e);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
};

/// Owning device allocation (cudaMalloc / cudaFree). Moves only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// Throws spade::Error naming `what` and the size when cudaMalloc fails.
  DeviceBuffer(size_t bytes, const char* what);
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// Paged KV pool of every attention layer on one GPU, one allocation each for K and V:
///   k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim] bf16,
/// so layer l's cache is k(l) = k + l * layer_elems() (the [num_pages, page_size, Hkv, D] layout of attention.cuh).
/// The same page id means the same page index in every layer (one block table per sequence serves all layers).
/// Equivalently, "global page" l * num_pages + p addresses page p of layer l from the base pointer: the cache rank
/// batches a layer pack's sequences as (layer, sequence) rows that way (cache_rank / bench_tpot).
class GpuKvPool {
 public:
  /// Throws spade::Error when the sizes are not positive or the allocation fails (names the bytes wanted).
  GpuKvPool(int num_layers, int num_pages, int page_size, int num_kv_heads, int head_dim);
  int num_layers() const { return num_layers_; }
  int num_pages() const { return num_pages_; }
  int page_size() const { return page_size_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  size_t layer_elems() const { return layer_elems_; }
  void* k(int layer) const;
  void* v(int layer) const;
  size_t bytes() const { return k_.bytes() + v_.bytes(); }
  /// Fills K and V with deterministic random bf16 values (benchmarks: a context without prefilling it).
  void fill_random(uint64_t seed, float scale, cudaStream_t stream);

 private:
  int num_layers_, num_pages_, page_size_, num_kv_heads_, head_dim_;
  size_t layer_elems_;
  DeviceBuffer k_, v_;
};

}  // namespace spade

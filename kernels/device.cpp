// Device-level CUDA helpers (kernels/device.h).
#include "kernels/device.h"

#include <algorithm>
#include <utility>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/attention.cuh"  // launch_error_detail()
#include "kernels/tensor_ops.cuh"

namespace spade {

void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  const char* detail = kernels::launch_error_detail();
  fail("{}: {}{}{}{}", what, cudaGetErrorString(e), detail[0] != '\0' ? " (" : "", detail,
       detail[0] != '\0' ? ")" : "");
}

// ---------------------------------------------------------------------------------------------------------------
// DeviceBuffer
// ---------------------------------------------------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(size_t bytes, const char* what) : bytes_(bytes) {
  const cudaError_t e = cudaMalloc(&ptr_, std::max<size_t>(bytes, 16));
  if (e != cudaSuccess) {
    ptr_ = nullptr;
    cudaGetLastError();  // clear the sticky-free allocation error
    fail("{}: cudaMalloc of {:.3f} GiB failed: {}", what, static_cast<double>(bytes) / (1 << 30),
         cudaGetErrorString(e));
  }
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(o.bytes_) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

// ---------------------------------------------------------------------------------------------------------------
// GpuKvPool
// ---------------------------------------------------------------------------------------------------------------

GpuKvPool::GpuKvPool(int num_layers, int num_pages, int page_size, int num_kv_heads, int head_dim)
    : num_layers_(num_layers), num_pages_(num_pages), page_size_(page_size), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim) {
  SPADE_CHECK(num_layers > 0 && num_pages > 0 && page_size > 0 && num_kv_heads > 0 && head_dim > 0,
              "GpuKvPool: layers {}, pages {}, page_size {}, kv heads {}, head_dim {} must all be positive",
              num_layers, num_pages, page_size, num_kv_heads, head_dim);
  layer_elems_ = static_cast<size_t>(num_pages) * page_size * num_kv_heads * head_dim;
  const size_t bytes = layer_elems_ * num_layers * 2;
  k_ = DeviceBuffer(bytes, "KV pool (K)");
  v_ = DeviceBuffer(bytes, "KV pool (V)");
}
void* GpuKvPool::k(int layer) const { return static_cast<uint16_t*>(k_.get()) + layer_elems_ * layer; }
void* GpuKvPool::v(int layer) const { return static_cast<uint16_t*>(v_.get()) + layer_elems_ * layer; }
void GpuKvPool::fill_random(uint64_t seed, float scale, cudaStream_t stream) {
  const size_t n = layer_elems_ * num_layers_;
  cuda_check(kernels::random_fill({DType::BF16, k_.get(), n, seed, scale, 0.f}, stream), "KV pool random fill");
  cuda_check(kernels::random_fill({DType::BF16, v_.get(), n, seed ^ 0x5bd1e995ull, scale, 0.f}, stream),
             "KV pool random fill");
}

}  // namespace spade

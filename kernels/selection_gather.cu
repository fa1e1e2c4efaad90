// Selection, gather stage: selected K/V rows of the paged cache into the packed send buffer (kernels/selection_ref.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/paged_kv.cuh"
#include "kernels/selection.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Gather: one thread per 16-byte chunk of a selected row; K and V in the same thread.
// =====================================================================================================================

constexpr int kGatherThreads = 256;

struct GatherArgs {
  PagedKv kv;
  const int32_t* indices;
  void* packed_k;
  void* packed_v;
  int k;
  int head_dim;
};

__global__ void __launch_bounds__(kGatherThreads) gather_kernel(const GatherArgs a) {
  const int chunks = a.head_dim / 8;
  const int idx = blockIdx.x * kGatherThreads + threadIdx.x;
  if (idx >= a.k * chunks) return;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int i = idx / chunks;
  const int col = idx - i * chunks;
  const size_t row = static_cast<size_t>(b) * a.kv.hkv + kvh;
  const int pos = a.indices[row * a.k + i];
  uint4 kv = make_uint4(0u, 0u, 0u, 0u);
  uint4 vv = kv;
  if (pos >= 0) {
    const int page = a.kv.table_row(b)[a.kv.page_of(pos)];
    const size_t off = (a.kv.slot(page, pos) * a.kv.hkv + kvh) * a.head_dim + col * 8;
    kv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.kv.k) + off));
    vv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.kv.v) + off));
  }
  const size_t dst = (row * a.k + i) * a.head_dim + col * 8;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.packed_k) + dst) = kv;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.packed_v) + dst) = vv;
}

}  // namespace
}  // namespace detail

cudaError_t gather_kv(const GatherKvParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "gather_kv";
  const cudaError_t e = check_paged_kv(what, p);
  if (e != cudaSuccess) return e;
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.block_table == nullptr || p.indices == nullptr ||
      p.packed_k == nullptr || p.packed_v == nullptr) {
    return invalid_argument(what, "all pointers must be set");
  }
  if (p.k <= 0) return invalid_argument(what, "k ", p.k, " must be > 0");
  const GatherArgs a{paged_kv(p, p.k_cache, p.v_cache), p.indices, p.packed_k, p.packed_v, p.k, p.head_dim};
  const dim3 grid(ceil_div(static_cast<long long>(p.k) * (p.head_dim / 8), kGatherThreads), p.num_kv_heads,
                  p.batch);
  gather_kernel<<<grid, kGatherThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace spade::kernels

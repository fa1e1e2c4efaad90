// The paged KV cache as the CUDA kernels of kernels/ see it (internal; nvcc only): one device-side view embedded in
// the argument struct of every kernel that reads the cache (decode, prefill, token scoring, gather), its address
// helpers, the GQA head geometry, and the host helpers that fill both from a launcher's public params.
//
// Layout contract (kernels/paged_attention_ref.h): k / v [num_pages, page_size, hkv, D], block_table
// [batch, max_pages] int32 page ids, page_size a power of two. Token `pos` of the sequence of block-table row b sits
// in cache row ("slot") page * page_size + (pos & (page_size - 1)), page = block_table[b][pos >> log2_ps]; KV head
// kvh of a slot starts at element (slot * hkv + kvh) * D.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "kernels/attention.cuh"
#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"

namespace spade::kernels::detail {

/// Device view of a paged K/V cache, passed by value inside the kernels' argument structs. The order of the ints
/// (8-byte pairs in the parameter bank) is the one with which the kernels kept their ptxas register counts.
struct PagedKv {
  const void* k;               // [num_pages, page_size, hkv, D]
  const void* v;               // same layout; nullptr where the kernel reads K only
  const int32_t* block_table;  // [batch, max_pages] int32 page ids
  int page_size;               // tokens per page, a power of two
  int log2_ps;                 // log2(page_size)
  int max_pages;               // block-table row length
  int hkv;                     // KV heads of a cache row

  /// Block-table row of the sequence in row b.
  __device__ __forceinline__ const int32_t* table_row(int b) const {
    return block_table + static_cast<size_t>(b) * max_pages;
  }
  /// Block-table column (page of its sequence) of token pos.
  __device__ __forceinline__ int page_of(int pos) const { return pos >> log2_ps; }
  /// Cache row of token pos, which lies on page id `page`.
  __device__ __forceinline__ size_t slot(int32_t page, int pos) const {
    return static_cast<size_t>(page) * page_size + (pos & (page_size - 1));
  }
  /// slot() in int32 arithmetic (the decode kernel's prefetched row tables).
  __device__ __forceinline__ int32_t slot32(int32_t page, int pos) const {
    return page * page_size + (pos & (page_size - 1));
  }
  /// Elements between consecutive cache rows.
  template <int D>
  __device__ __forceinline__ size_t row_stride() const {
    return static_cast<size_t>(hkv) * D;
  }
  /// KV head kvh of cache row 0 of K / V: row r of the head is at k_head + r * row_stride().
  template <typename T, int D>
  __device__ __forceinline__ const T* k_head(int kvh) const {
    return static_cast<const T*>(k) + static_cast<size_t>(kvh) * D;
  }
  template <typename T, int D>
  __device__ __forceinline__ const T* v_head(int kvh) const {
    return static_cast<const T*>(v) + static_cast<size_t>(kvh) * D;
  }
};

static_assert(sizeof(PagedKv) == 40, "PagedKv is part of every paged kernel's parameter block");

/// GQA head geometry: query head h reads KV head h / group (the KV head count is the cache's, PagedKv::hkv).
struct GqaHeads {
  int hq;     // query heads
  int group;  // hq / hkv, 1..kMaxGqaGroup
};

// ---- host: the view and the geometry of a launcher's public params (attention.cuh / selection.cuh params types:
// block_table, num_kv_heads, page_size (validated a power of two), max_pages_per_seq; num_q_heads) ----

template <class P>
PagedKv paged_kv(const P& p, const void* k, const void* v) {
  return PagedKv{k, v, p.block_table, p.page_size, log2_int(p.page_size), p.max_pages_per_seq, p.num_kv_heads};
}

template <class P>
GqaHeads gqa_heads(const P& p) {
  return GqaHeads{p.num_q_heads, p.num_q_heads / p.num_kv_heads};
}

// ---- host: validation shared by the paged-KV launchers (cudaSuccess, or invalid_argument's error with the launch
// error detail naming the field) ----

/// The paged-cache arguments of every paged-KV launcher's params P: dtype (BF16 or F16), batch and num_kv_heads > 0,
/// head_dim (compiled), page_size (a power of two), max_pages_per_seq > 0.
template <class P>
cudaError_t check_paged_kv(const char* what, const P& p) {
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.batch <= 0 || p.num_kv_heads <= 0) {
    return invalid_argument(what, "batch ", p.batch, " / num_kv_heads ", p.num_kv_heads, " must be > 0");
  }
  if (!is_supported_head_dim(p.head_dim)) return invalid_argument(what, "head_dim ", p.head_dim, " is not supported");
  if (!is_pow2(p.page_size)) return invalid_argument(what, "page_size ", p.page_size, " must be a power of two");
  if (p.max_pages_per_seq <= 0) {
    return invalid_argument(what, "max_pages_per_seq ", p.max_pages_per_seq, " must be > 0");
  }
  return cudaSuccess;
}

/// check_paged_kv and the GQA heads (scoring, attention): num_q_heads a positive multiple of num_kv_heads, the group
/// at most kMaxGqaGroup.
template <class P>
cudaError_t check_paged_gqa(const char* what, const P& p) {
  const cudaError_t e = check_paged_kv(what, p);
  if (e != cudaSuccess) return e;
  const int hq = p.num_q_heads;
  const int hkv = p.num_kv_heads;
  if (hq <= 0 || hq % hkv != 0) {
    return invalid_argument(what, "num_q_heads ", hq, " is not a positive multiple of num_kv_heads ", hkv);
  }
  if (hq / hkv > kMaxGqaGroup) {
    return invalid_argument(what, "GQA group ", hq / hkv, " exceeds kMaxGqaGroup = ", kMaxGqaGroup);
  }
  return cudaSuccess;
}

/// check_paged_gqa and what every attention launcher's params P (decode, prefill) add: q and out set, scale a
/// positive finite number.
template <class P>
cudaError_t check_paged_attention(const char* what, const P& p) {
  const cudaError_t e = check_paged_gqa(what, p);
  if (e != cudaSuccess) return e;
  if (p.q == nullptr || p.out == nullptr) return invalid_argument(what, "q and out must be set");
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) return invalid_argument(what, "scale ", p.scale, " must be > 0");
  return cudaSuccess;
}

/// dtype x head_dim dispatch of the paged-KV launchers: returns f(T{}, std::integral_constant<int, D>{}) with
/// T = __nv_bfloat16 for BF16, __half for F16 (dispatch_elem; cudaErrorInvalidValue for another dtype), and
/// D = head_dim, one of SPADE_FOR_EACH_HEAD_DIM.
template <typename F>
cudaError_t dispatch_elem_head_dim(const char* what, DType dtype, int head_dim, F&& f) {
  return dispatch_elem(dtype, [&](auto tag) {
    return dispatch_head_dim(what, head_dim, [&](auto dim) { return f(tag, dim); });
  });
}

}  // namespace spade::kernels::detail

// CUDA attention kernels over the paged KV cache: split-K flash-decoding (dense and token-sparse) and causal prefill.
//
// Sources: Flash-Decoding with paged KV (../shared/papers/flash-decoding-paged-kv.txt, Algorithm 1: split the KV
// sequence across CTAs, online softmax per split, merge the partials by log-sum-exp); AsyncSpade Sec. 4.1/4.3
// (token-sparse decode over the K/V selected by the cache rank plus the local window); FlashAttention-2 (prefill).
// Design notes and measured numbers: docs/KERNELS.md.
//
// Layout contract: kernels/paged_attention_ref.h (k_cache / v_cache [num_pages, page_size, num_kv_heads, head_dim],
// block_table [batch, max_pages_per_seq] int32, GQA query head h reads KV head h / (num_q_heads / num_kv_heads)).
// All pointers are device pointers unless a field says otherwise. Element type of q / caches / out: bf16 or fp16
// (`dtype`), accumulation in fp32. head_dim: one of kSupportedHeadDims (head_dims.cuh). GQA group
// num_q_heads / num_kv_heads: 1..8. page_size: a power of two.
//
// Every launcher is asynchronous on `stream` and returns cudaSuccess, cudaErrorInvalidValue when the parameters are
// inconsistent (launch_error_detail() then names the offending field), or the launch's CUDA error. Device-side
// contents (page ids, lengths, indices) are the caller's contract and are not checked by the kernels.
// Plain C++ header: includable from host code compiled by g++ (needs the CUDA runtime headers only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/head_dims.cuh"
#include "kernels/paged_shape.h"

namespace spade::kernels {

/// Largest KV split count of the split-K decode kernels (sizes the workspace).
inline constexpr int kMaxDecodeSplits = 64;
/// Largest GQA group (num_q_heads / num_kv_heads) the kernels support.
inline constexpr int kMaxGqaGroup = 8;

/// Scratch memory of the split-K decode kernels: per-split partial outputs, their log-sum-exp, and one arrival
/// counter per (sequence, KV head). Allocate decode_workspace_bytes() bytes of device memory (256-byte aligned, e.g.
/// cudaMalloc) and run decode_workspace_init() once; every decode launch leaves the counters at zero again, so the
/// workspace is reusable by later launches on the same stream (not by concurrent launches), of any batch up to the one
/// it was sized for and any decode variant with the same heads and head_dim: every launch lays the workspace out for
/// its full size, not for its own batch, so the counters never move onto another launch's partials.
struct DecodeWorkspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};

/// Workspace bytes for decode launches with at most this batch / head configuration.
size_t decode_workspace_bytes(int batch, int num_q_heads, int num_kv_heads, int head_dim);

/// Zeroes the arrival counters (cudaMemsetAsync of the whole workspace).
cudaError_t decode_workspace_init(DecodeWorkspace ws, cudaStream_t stream);

/// Dense paged decode: one query token per sequence attends to all seq_lens[b] tokens of its paged context.
struct PagedDecodeParams : PagedAttentionShape {
  DType dtype = DType::BF16;            // BF16 or F16: element type of q, k_cache, v_cache, out.
  const void* q = nullptr;              // [batch, num_q_heads, head_dim] dtype (RoPE applied).
  const void* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const void* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr; // [batch, max_pages_per_seq] int32 page ids.
  const int32_t* seq_lens = nullptr;    // [batch] int32 context length (>= 1, including this step's token).
  void* out = nullptr;                  // [batch, num_q_heads, head_dim] dtype, written completely.
  float* lse = nullptr;                 // optional [batch, num_q_heads] fp32 natural-log LSE of scale * q.k.
  int max_seq_len = 0;  // host-side upper bound of seq_lens (sizes the split-K grid); >= 1.
  float scale = 0.f;    // softmax scale, normally 1/sqrt(head_dim).
  int num_splits = 0;   // 0: chosen from SM count, occupancy and max_seq_len; else forced (1..kMaxDecodeSplits).
  // KV heads served by one CTA (their tiles of one token range are then read by one SM): 0 = chosen together with
  // num_splits; else forced, a power of two dividing num_kv_heads, <= 8 (<= 4 for head_dim 256), otherwise
  // cudaErrorInvalidValue naming kv_heads_per_cta. Tuning / benchmark knob (docs/KERNELS.md section 7 sweep).
  int kv_heads_per_cta = 0;
  DecodeWorkspace workspace;
};

cudaError_t paged_decode_attention(const PagedDecodeParams& p, cudaStream_t stream);

/// Token-sparse decode over an explicit per-(sequence, KV head) list of token positions into the paged cache.
/// Equivalent to dense attention restricted to the listed tokens (kernels/sparse_attention_ref.h).
struct SparseIndexDecodeParams : PagedAttentionShape {
  DType dtype = DType::BF16;
  const void* q = nullptr;              // [batch, num_q_heads, head_dim] dtype.
  const void* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const void* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr; // [batch, max_pages_per_seq] int32.
  const int32_t* indices = nullptr;     // [batch, num_kv_heads, index_stride] int32 token positions (< seq_len).
  const int32_t* num_indices = nullptr; // [batch] int32 valid entries per (sequence, KV head), 0..index_stride.
  void* out = nullptr;                  // [batch, num_q_heads, head_dim] dtype (zeros where num_indices is 0).
  float* lse = nullptr;                 // optional [batch, num_q_heads] fp32 (-inf where num_indices is 0).
  int index_stride = 0;  // capacity of each index row; also the host-side bound of num_indices.
  float scale = 0.f;
  int num_splits = 0;
  DecodeWorkspace workspace;
};

cudaError_t sparse_decode_attention_indexed(const SparseIndexDecodeParams& p, cudaStream_t stream);

/// Token-sparse decode over a packed buffer of gathered K/V (what the cache rank sends, selection.cuh gather_kv)
/// followed by the local window: the last min(local_window, seq_lens[b]) tokens of the paged cache. The packed
/// tokens must not overlap the window (select among positions < seq_len - local_window).
struct SparsePackedDecodeParams : PagedAttentionShape {
  DType dtype = DType::BF16;
  const void* q = nullptr;              // [batch, num_q_heads, head_dim] dtype.
  const void* packed_k = nullptr;       // [batch, num_kv_heads, packed_capacity, head_dim] dtype.
  const void* packed_v = nullptr;       // [batch, num_kv_heads, packed_capacity, head_dim] dtype.
  const int32_t* num_packed = nullptr;  // [batch] int32 valid packed tokens per (sequence, KV head).
  const void* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype (local window).
  const void* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr; // [batch, max_pages_per_seq] int32.
  const int32_t* seq_lens = nullptr;    // [batch] int32 context length.
  void* out = nullptr;                  // [batch, num_q_heads, head_dim] dtype.
  float* lse = nullptr;                 // optional [batch, num_q_heads] fp32.
  int packed_capacity = 0;  // row capacity of packed_k / packed_v; host-side bound of num_packed.
  int local_window = 0;     // >= 0 tokens; with local_windows: the host-side bound of every local_windows[b].
  float scale = 0.f;
  int num_splits = 0;
  DecodeWorkspace workspace;
  // Optional per-sequence variants, for a serving batch that mixes sparse and dense sequences in one launch (so the
  // mix is data, not graph structure):
  const int32_t* local_windows = nullptr;  // [batch] int32 window of sequence b, 0..local_window (a dense sequence:
                                           // num_packed 0 and window = seq_len).
  const int32_t* packed_rows = nullptr;    // [batch] int32 row of packed_k / packed_v holding sequence b's
                                           // selection (default b), e.g. its slot in per-slot held tables.
  // Optional, for the decode rows of a mixed (prefill + decode) step, whose token layout is the step's:
  const int32_t* q_rows = nullptr;  // [batch] int32 row of q / out / lse holding sequence b's single decode query
                                    // (default b; 4-byte aligned). q, out are then [rows, num_q_heads, head_dim]
                                    // dtype and lse [rows, num_q_heads] fp32 with rows > every q_rows[b], and only
                                    // rows named here are written. q_rows[b] < 0: sequence b is skipped (none of
                                    // its arrays is read, nothing is written); distinct non-negative rows required.
};

cudaError_t sparse_decode_attention_packed(const SparsePackedDecodeParams& p, cudaStream_t stream);

/// Causal prefill (or chunked prefill) over the paged cache, FlashAttention-2 style. Query i of sequence b sits at
/// position seq_lens[b] - q_len_b + i and attends to positions 0..itself; the cache already holds the new tokens.
/// Same semantics as paged_attention_ref (kernels/paged_attention_ref.h). A sequence flagged in `skip` is left to
/// another kernel (the sparse decode rows of a mixed step: sparse_decode_attention_packed with q_rows): the prefill
/// kernel reads none of its block-table entries or K/V (its dropped pages are never dereferenced) and leaves its
/// out / lse rows untouched.
struct PagedPrefillParams : PagedAttentionShape {
  DType dtype = DType::BF16;
  const void* q = nullptr;              // [total_q_tokens, num_q_heads, head_dim] dtype.
  const void* k_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const void* v_cache = nullptr;        // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* block_table = nullptr; // [batch, max_pages_per_seq] int32.
  const int32_t* cu_q_lens = nullptr;   // [batch + 1] int32 prefix sums of query tokens per sequence.
  const int32_t* seq_lens = nullptr;    // [batch] int32 context length after this chunk (>= its q_len).
  void* out = nullptr;                  // [total_q_tokens, num_q_heads, head_dim] dtype.
  float* lse = nullptr;                 // optional [total_q_tokens, num_q_heads] fp32.
  int max_q_len = 0;  // host-side upper bound of the per-sequence query lengths (sizes the grid).
  float scale = 0.f;
  const int32_t* skip = nullptr;  // optional [batch] int32 (4-byte aligned): nonzero = sequence b is skipped (its
                                  // seq_lens / block_table / K / V are not read, its out / lse rows not written;
                                  // cu_q_lens still spans its rows). nullptr: none is skipped.
};

cudaError_t paged_prefill_attention(const PagedPrefillParams& p, cudaStream_t stream);

/// One-time setup of the attention kernels on the CURRENT device: the dynamic shared-memory limit of every compiled
/// (dtype, head_dim, KV source) instantiation, which the launchers otherwise set on first use. Call it at start-up,
/// before any stream of the process waits on another process's or thread's progress: cudaFuncSetAttribute
/// synchronises with pending copies, so a first launch while a CudaIpcLink receive is pending (both ranks in one
/// process) stalls until that receive's deadline (transport/cuda_ipc/cuda_ipc_link.h). Idempotent and thread-safe.
/// Returns the first CUDA error.
cudaError_t prepare_decode_attention_kernels();
/// The same for the prefill kernel (every dtype and head_dim).
cudaError_t prepare_prefill_attention_kernels();

/// Human-readable reason of the last cudaErrorInvalidValue returned by a launcher of this file or selection.cuh on
/// the calling thread ("" if none).
const char* launch_error_detail();

}  // namespace spade::kernels

// CUDA kernels of the Gated DeltaNet (GDN) decoding forms: the recurrent form (the serving baseline, with
// optional per-draft state snapshots = the recurrent speculative-verification baseline), chunkwise buffered decode
// with a checkpoint state and a paged ring buffer (including the KV-only parallel form for short contexts), parallel
// speculative verification with one T x T triangular solve, and the O(1) device-side commits.
//
// Each kernel computes what its CPU reference in kernels/gdn_ref.h computes — that header and docs/GDN.md give the
// math, the layouts, the ring-buffer and flush rules; the GPU tests (tests/kernels/test_gdn.cu) compare them.
// Sources: KVBuffer (../shared/papers/kvbuffer-linear-attention-serving.txt) Sec. 3.1-3.4, Eq. 4-5, 7-8, 11-16;
// ReplaySSM (../shared/papers/replayssm-cache-inputs-not-state.txt) Sec. 5.3-5.4, Algorithms 5-8.
//
// Differences from the reference (documented, tested within tolerance): q, k, v and out are bf16 / fp16 (`dtype`,
// the model's activations) instead of fp32; the buffered k^ / u are 16-bit (the same `dtype`; the reference also has
// an fp32 buffer for exactness tests); head_k_dim == head_v_dim, one of kGdnHeadDims. Accumulation and the state are
// fp32 everywhere.
//
// Graph friendliness ([RS] "Running under CUDA Graph"): a step's only per-step inputs are the token tensors,
// cu_tokens, seq_slots (and accepted for a commit); the flush decision is computed on the device from the ring
// metadata (or read from `flags`), and the ring metadata is updated on the device by a small kernel launched behind
// the step kernel, so a step needs no host synchronisation and a captured graph stays valid.
//
// Launchers are asynchronous on `stream` and return cudaSuccess, cudaErrorInvalidValue (launch_error_detail() of
// attention.cuh names the field), or the launch's CUDA error. All pointers are device pointers. Device-side contents
// (slots, lengths, block ids) are the caller's contract, as in gdn_ref.h (the reference checks them; the kernels guard
// against out-of-bounds state writes only). Plain C++ header: includable from host code compiled by g++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.cuh"
#include "kernels/gdn_ref.h"

namespace spade::kernels {

/// head_k_dim = head_v_dim values the GDN kernels are compiled for (Qwen3-Next / Qwen3.5 use 128).
inline constexpr int kGdnHeadDims[] = {64, 128};
/// Largest token count per sequence in one buffered step (drafts verified at once; [KVB] Fig. 4 goes to 8).
inline constexpr int kGdnMaxStepTokens = 8;

/// The tokens of one step, ragged over the batch (GdnTokens of gdn_ref.h with 16-bit activations).
struct GdnStepTokens {
  const void* q = nullptr;             // q: [total_tokens, num_k_heads, head_k_dim] dtype, raw (before l2norm/scale)
  const void* k = nullptr;             // k: [total_tokens, num_k_heads, head_k_dim] dtype, raw (before l2norm)
  const void* v = nullptr;             // v: [total_tokens, num_v_heads, head_v_dim] dtype
  const float* g = nullptr;            // g: [total_tokens, num_v_heads] fp32 log decay (alpha = exp(g))
  const float* beta = nullptr;         // beta: [total_tokens, num_v_heads] fp32 write strength in (0, 1)
  const int32_t* cu_tokens = nullptr;  // cu_tokens: [batch + 1] int32 prefix sums, cu_tokens[0] = 0 (device)
  int batch = 0;                       // sequences in the step, >= 0 (0: nothing is launched)
  // max_tokens: host-side bound on cu_tokens[b+1] - cu_tokens[b] (the kernel variant is chosen from it). Recurrent:
  // any >= 1; buffered steps: 1..kGdnMaxStepTokens.
  int max_tokens = 1;
};

/// Recurrent form ([RS] Algorithm 5; with draft snapshots [RS] Algorithm 7). gdn_recurrent_ref's contract.
struct GdnRecurrentGpuParams {
  DType dtype = DType::BF16;  // BF16 or F16: q, k, v, out
  GdnDims dims;               // head_k_dim == head_v_dim in kGdnHeadDims; num_v_heads % num_k_heads == 0
  GdnOptions opt;
  GdnStepTokens tok;
  void* out = nullptr;        // out: [total_tokens, num_v_heads, head_v_dim] dtype, written completely
  // state_pool: [num_state_slots, num_v_heads, head_k_dim, head_v_dim] fp32 (the [HF] / FLA layout).
  float* state_pool = nullptr;
  int num_state_slots = 0;
  // state_slots: [batch] int32 slot of sequence b's state (read; written back after the last token when
  // draft_state_slots is null).
  const int32_t* state_slots = nullptr;
  // draft_state_slots: optional [total_tokens] int32; the state after token i is stored to slot
  // draft_state_slots[i] (-1: not stored) and state_slots are only read (per-draft snapshots, [RS] Algorithm 7 l.7).
  const int32_t* draft_state_slots = nullptr;
};

cudaError_t gdn_recurrent(const GdnRecurrentGpuParams& p, cudaStream_t stream);

/// Buffered forms: chunkwise decode / KV-only ([KVB] Sec. 3.2-3.4, [RS] Algorithm 6) and parallel verification
/// ([KVB] Eq. 7-8, [RS] Algorithm 8). GdnBufferedParams's contract (gdn_ref.h) with these GPU specifics:
struct GdnBufferedGpuParams {
  DType dtype = DType::BF16;  // BF16 or F16: q, k, v, out and the buffer (buf.dtype must equal dtype)
  GdnDims dims;               // head_k_dim == head_v_dim in kGdnHeadDims
  GdnOptions opt;
  GdnStepTokens tok;          // tok.max_tokens in 1..kGdnMaxStepTokens
  void* out = nullptr;        // out: [total_tokens, num_v_heads, head_v_dim] dtype, written completely
  // state_pool: [num_state_slots, num_v_heads, head_k_dim, head_v_dim] fp32 checkpoint states.
  float* state_pool = nullptr;
  int num_state_slots = 0;
  // buf.k: [num_blocks, block_size, num_k_heads, head_k_dim] dtype; buf.u: [num_blocks, block_size, num_v_heads,
  // head_v_dim] dtype; buf.g: [num_blocks, block_size, num_v_heads] fp32 (gdn_ref.h GdnBufferPool, device memory).
  GdnBufferPool buf;
  // seqs: ring metadata in device memory (gdn_ref.h GdnSeqTable); ring_start / ring_len / state_valid are updated
  // on the device after the step (a one-thread-per-sequence kernel launched behind the step kernel).
  GdnSeqTable seqs;
  const int32_t* seq_slots = nullptr;  // seq_slots: [batch] int32 sequence slot of batch row b (distinct)
  // flags: optional [batch] uint8 (kGdnFlush). Null: computed on the device by the rule of
  // gdn_decode_flush_flags_ref (h + n + next_tokens > L) or gdn_verify_flush_flags_ref (h + 2T > L).
  const uint8_t* flags = nullptr;
  uint8_t* flags_out = nullptr;        // flags_out: optional [batch] uint8, the flags this step used
  int next_tokens = 1;                 // decode flush rule's next_tokens (1..ring capacity), see gdn_ref.h
  // max_ring_capacity: host bound on every used ring_capacity[slot] (sizes shared memory; <= 256 tokens).
  int max_ring_capacity = 0;
  // tile_groups: 32-column tile groups (128 threads each) per CTA: 0 = automatic (2; one CTA per head when
  // max_ring_capacity > 32, for multi-token steps and for batches >= 128), else 1, 2 or 4, clamped to
  // head_v_dim / 32. A tuning knob (bench_gdn sweeps it);
  // results do not depend on it.
  int tile_groups = 0;
};

/// Chunkwise buffered decode (n = 1 per sequence; or a buffered prefill of up to kGdnMaxStepTokens tokens) and the
/// KV-only parallel form for sequences with state_valid = 0: gdn_chunkwise_decode_ref on the device.
cudaError_t gdn_chunkwise_decode(const GdnBufferedGpuParams& p, cudaStream_t stream);

/// Parallel speculative verification: gdn_parallel_verify_ref on the device (drafts written uncommitted; the flush
/// folds only the committed entries). Follow with gdn_verify_commit once the accepted counts are known.
cudaError_t gdn_parallel_verify(const GdnBufferedGpuParams& p, cudaStream_t stream);

/// Commit after gdn_parallel_verify: ring_len[seq_slots[b]] += accepted[b] ([RS] Sec. 5.4, a pointer move; no data
/// moves). accepted: [batch] int32 (device) in 0..T_b. seqs.ring_len is the only array written.
cudaError_t gdn_verify_commit(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* accepted, int batch,
                              cudaStream_t stream);

/// Commit of the recurrent verification baseline (gdn_recurrent_verify_commit_ref on the device): spec_state_slots
/// [batch, num_drafts + 1] int32, columns 0 and accepted[b] swapped when accepted[b] > 0 (O(1), no state copy).
cudaError_t gdn_recurrent_verify_commit(int32_t* spec_state_slots, const int32_t* accepted, int batch,
                                        int num_drafts, cudaStream_t stream);

/// Dynamic shared memory of one buffered-step CTA (bytes) for the given head dim, token bound, ring bound, staged
/// block-table entries (min(max_blocks_per_seq, ceil(max_ring_capacity / block_size))) and tile groups per CTA.
size_t gdn_buffered_smem_bytes(int head_dim, int max_tokens, int max_ring_capacity, int table_entries,
                               int tile_groups);

}  // namespace spade::kernels

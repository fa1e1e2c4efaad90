// Fused per-layer CUDA kernels of the GPU inference rank: embedding gather, RMSNorm (plain, fused residual add,
// per-head), q/k-norm + RoPE + paged KV append, SwiGLU, and on-device sampling (greedy argmax; temperature / top-k /
// top-p with a counter-based RNG). Design notes, layouts and accuracy bounds: docs/KERNELS.md, "Layer ops for the
// GPU inference rank".
//
// Each kernel computes what its CPU reference computes (kernels/rmsnorm_ref.h, rope_ref.h, swiglu_ref.h,
// kv_append_ref.h, sampling_ref.h, and common/sampling.cpp's greedy rule), in fp32, with ONE rounding to the
// element type at the output (no intermediate rounding, unlike transformers' bf16 modules: see docs/KERNELS.md).
//
// Conventions (as attention.cuh): plain C++ params struct + cudaStream_t; every launcher is asynchronous on `stream`
// and returns cudaSuccess, cudaErrorInvalidValue when the parameters are inconsistent (launch_error_detail() in
// attention.cuh then names the offending field), or the launch's CUDA error. A zero row / token count is a no-op
// that returns cudaSuccess. Pointers are device pointers. Element type `dtype`: BF16 or F16. Device-side contents
// (token ids, positions, page ids) are checked by the kernels where an unchecked value would read or write out of
// bounds; the behaviour for bad values is stated per field.
// Plain C++ header: includable from host code compiled by g++ (needs the CUDA runtime headers only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.cuh"  // launch_error_detail()
#include "kernels/paged_shape.h"

namespace spade::kernels {

// ---------------------------------------------------------------------------------------------------------------
// 1. Embedding gather
// ---------------------------------------------------------------------------------------------------------------

/// out[t, :] = table[token_ids[t], :]. A token id outside [0, vocab_size) writes a zero row (the table is never read
/// out of bounds) and, when error_flag is set, stores 1 into *error_flag (never clears it: zero it before the step
/// and check it after).
struct EmbeddingParams {
  DType dtype = DType::BF16;          // BF16 or F16: element type of table and out.
  const int32_t* token_ids = nullptr; // [num_tokens] int32.
  const void* table = nullptr;        // [vocab_size, hidden] dtype, row-major.
  void* out = nullptr;                // [num_tokens, hidden] dtype, written completely.
  int32_t* error_flag = nullptr;      // optional [1] int32: set to 1 when any token id is out of range.
  int num_tokens = 0;
  int vocab_size = 0;
  int hidden = 0;
};

cudaError_t embedding_gather(const EmbeddingParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// 2. RMSNorm
// ---------------------------------------------------------------------------------------------------------------

/// y = x * rsqrt(mean(x^2) + eps) * w', w' = w (Llama / Qwen3) or 1 + w (unit_offset: Qwen3.5's zero-centred
/// weights, computed in fp32 as transformers' `1.0 + weight.float()`), fp32 throughout, y rounded once.
///
/// Fused residual (vLLM's fused_add_rms_norm), when `residual` is set:
///   residual[r] = residual[r] + x[r]   (sum in fp32, stored rounded to residual_dtype)
///   out[r]      = rmsnorm(residual[r]) (of the STORED value, so the norm input is exactly what the residual
///                                       stream carries on; with residual_dtype F32 nothing is rounded)
/// Without `residual`: out = rmsnorm(x). `out` may alias `x` (in place); it must not alias `residual`.
struct RmsNormParams {
  DType dtype = DType::BF16;         // BF16 or F16: element type of x and out.
  const void* x = nullptr;           // [rows, dim] dtype, row stride x_stride elements.
  const void* weight = nullptr;      // [dim] weight_dtype.
  void* out = nullptr;               // [rows, dim] dtype, row stride out_stride elements.
  void* residual = nullptr;          // optional [rows, dim] residual_dtype, row stride dim (contiguous); in/out.
  DType weight_dtype = DType::BF16;  // F32, or the same as dtype.
  DType residual_dtype = DType::BF16;  // F32, or the same as dtype (used only when residual is set).
  int rows = 0;
  int dim = 0;         // 1..65536.
  int x_stride = 0;    // elements between rows of x; 0 = dim.
  int out_stride = 0;  // elements between rows of out; 0 = dim.
  float eps = 1e-6f;   // > 0 (config.json rms_norm_eps).
  bool unit_offset = false;  // true: the weight is applied as (1 + w) (Qwen3.5 Qwen3_5RMSNorm).
};

cudaError_t rmsnorm(const RmsNormParams& p, cudaStream_t stream);

/// Per-head RMSNorm (Qwen3 q_norm / k_norm) over [tokens, num_heads, head_dim] heads that may sit inside a wider row
/// (e.g. the q or k part of a fused qkv row): element (t, h, d) is at t * token_stride + h * head_dim + d.
/// Each head is normalised on its own with the shared [head_dim] weight; in place allowed (out == x with equal
/// strides). Same math and weight conventions as rmsnorm.
struct RmsNormHeadsParams {
  DType dtype = DType::BF16;         // BF16 or F16: element type of x and out.
  const void* x = nullptr;           // [tokens, token_stride] dtype: heads at [0, num_heads * head_dim) of each row.
  const void* weight = nullptr;      // [head_dim] weight_dtype.
  void* out = nullptr;               // [tokens, out_token_stride] dtype, same head placement.
  DType weight_dtype = DType::BF16;  // F32, or the same as dtype.
  int tokens = 0;
  int num_heads = 0;
  int head_dim = 0;            // even, 2..kMaxLayerOpsHeadDim.
  int token_stride = 0;        // elements between tokens of x; 0 = num_heads * head_dim.
  int out_token_stride = 0;    // elements between tokens of out; 0 = num_heads * head_dim.
  float eps = 1e-6f;
  bool unit_offset = false;
};

/// Largest head_dim of rmsnorm_heads and rope_kv_append.
inline constexpr int kMaxLayerOpsHeadDim = 512;

cudaError_t rmsnorm_heads(const RmsNormHeadsParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// 3. (q/k RMSNorm) + RoPE + paged KV append
// ---------------------------------------------------------------------------------------------------------------

/// For each token t of a ragged batch, from its fused projection row qkv[t] = [q (Hq*D) | k (Hkv*D) | v (Hkv*D) | ...]:
///   q, k <- per-head RMSNorm (optional: q_norm_weight / k_norm_weight set; Qwen3 applies it before RoPE)
///   q, k <- rotate_half RoPE at positions[t] over the leading rot_dim dims of each head (kernels/rope_ref.h)
///   q_out[t] = q;  k_cache / v_cache slot of (seq_idx[t], positions[t]) = k, v   (kernels/kv_append_ref.h)
///   row_out[t] = q | k | v   (optional)
/// fp32 in between, each output rounded once. qkv itself is not modified.
///
/// Angles: inv_freq[i] = 1 / powf(float(theta), float(2i) / float(rot_dim)) is computed ON THE HOST by the
/// launcher with the reference's exact expression and passed by value (kernel parameter, so a captured CUDA graph
/// keeps it); the kernel forms angle = float(pos) * inv_freq[i] with one IEEE fp32 multiply -- bit-identical to
/// rope_ref -- and takes sincosf of it (full-range, ~1 ulp, Payne-Hanek reduction for large angles). No cos/sin
/// table and no position limit (docs/KERNELS.md explains the choice).
///
/// KV slot: page = block_table[seq_idx[t] * max_pages_per_seq + positions[t] / page_size], slot = positions[t] %
/// page_size. A token whose position is negative or past max_pages_per_seq * page_size, whose seq_idx is outside
/// [0, batch), or whose page id is outside [0, num_pages) writes no KV (no out-of-bounds access) and sets
/// *error_flag = 1 when error_flag is set. A page id of exactly -1 (padding token) is skipped WITHOUT the flag.
/// q_out is always written (a negative position is rotated as its fp32 value).
struct RopeKvAppendParams : PagedAttentionShape {
  DType dtype = DType::BF16;             // BF16 or F16: qkv, norm weights (unless F32), q_out, caches.
  const void* qkv = nullptr;             // [tokens, qkv_stride] dtype: q at column 0, k at Hq*D, v at (Hq+Hkv)*D.
  void* q_out = nullptr;                 // [tokens, num_q_heads, head_dim] dtype (contiguous; attention's q).
  void* k_cache = nullptr;               // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  void* v_cache = nullptr;               // [num_pages, page_size, num_kv_heads, head_dim] dtype.
  const int32_t* positions = nullptr;    // [tokens] int32 absolute positions.
  const int32_t* seq_idx = nullptr;      // [tokens] int32 row of block_table of each token's sequence.
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq] int32 page ids.
  const void* q_norm_weight = nullptr;   // optional [head_dim] norm_weight_dtype (both or neither).
  const void* k_norm_weight = nullptr;   // optional [head_dim] norm_weight_dtype.
  int32_t* error_flag = nullptr;         // optional [1] int32, see above.
  DType norm_weight_dtype = DType::BF16; // F32, or the same as dtype.
  int tokens = 0;
  // num_kv_heads (a PagedKvShape field): divides num_q_heads.
  // head_dim (a PagedKvShape field): even, 2..kMaxLayerOpsHeadDim.
  int rot_dim = 0;        // even, 0..head_dim (partial RoPE rotates the leading rot_dim dims; the rest pass through;
                          // 0: no rotation, a plain append of rows that are already rotated, e.g. on the cache rank).
  int qkv_stride = 0;     // elements between rows of qkv; 0 = (num_q_heads + 2 * num_kv_heads) * head_dim.
  // batch (a PagedKvShape field): rows of block_table.
  // page_size (a PagedKvShape field): >= 1.
  int num_pages = 0;      // pages in k_cache / v_cache.
  double theta = 10000.0; // rope_theta (> 0).
  float norm_eps = 1e-6f;
  bool norm_unit_offset = false;  // (1 + w) norm weights (Qwen3.5).
  // Optional copy of each token's processed row, q | k | v after the norms and RoPE (exactly the values written to
  // q_out and the caches), for the disaggregated path: the rows a layer pack ships to the cache rank, which then
  // appends them with rot_dim 0. Written for every token, padding tokens included.
  void* row_out = nullptr;  // [tokens, row_out_stride] dtype
  int row_out_stride = 0;   // elements between rows of row_out; 0 = (num_q_heads + 2 * num_kv_heads) * head_dim
};

cudaError_t rope_kv_append(const RopeKvAppendParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// 4. SwiGLU
// ---------------------------------------------------------------------------------------------------------------

/// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] = g / (1 + exp(-g)) * u in fp32 (swiglu_ref), over the
/// fused gate/up projection whose rows are [gate (inter) | up (inter)] -- the order inference_rank/weights.cpp fuses
/// gate_proj and up_proj in.
struct SwigluParams {
  DType dtype = DType::BF16;     // BF16 or F16.
  const void* gate_up = nullptr; // [rows, gate_up_stride] dtype: gate at [0, inter), up at [inter, 2 * inter).
  void* out = nullptr;           // [rows, out_stride] dtype: the first inter columns written.
  int rows = 0;
  int inter = 0;
  int gate_up_stride = 0;  // 0 = 2 * inter (>= 2 * inter otherwise).
  int out_stride = 0;      // 0 = inter (>= inter otherwise).
};

cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// 5. Sampling
// ---------------------------------------------------------------------------------------------------------------

/// Greedy: out_tokens[r] = index of the largest logit of row r, lowest index on ties (common/sampling.cpp argmax).
/// NaN logits are never chosen (a row of only NaN / -inf gives 0).
struct ArgmaxParams {
  DType logits_dtype = DType::F32;  // F32, BF16 or F16.
  const void* logits = nullptr;     // [rows, logits_stride] logits_dtype; the first vocab columns are read.
  int32_t* out_tokens = nullptr;    // [rows] int32.
  int rows = 0;
  int vocab = 0;
  int logits_stride = 0;  // 0 = vocab.
};

cudaError_t argmax_rows(const ArgmaxParams& p, cudaStream_t stream);

/// Temperature / top-k / top-p sampling with per-row parameters held in device memory (so a captured CUDA graph
/// stays valid across steps and requests). Exactly kernels/sampling_ref.h's algorithm (that header defines it to
/// the bit: fixed-point masses, tie order, the Philox draw); summary:
///   * temperature[r] <= 0 (or NaN) or top_k[r] == 1: greedy (argmax_rows' rule).
///   * candidates sorted by logit descending, ties by lower index; top_k[r] > 0 keeps the first top_k[r];
///   * p_i = exp(l_i / T - max / T) in fp32, as 40-bit fixed point; top_p[r] < 1 keeps the shortest sorted prefix
///     of the candidates whose mass reaches ceil(top_p * candidate mass) (at least one token);
///   * one Philox4x32-10 draw, key = seeds[r], counter = (steps[r], 0): the request's output depends on its seed
///     and step only, never on its row or its batch neighbours; the kept tokens are walked in index order.
/// One CTA per row (512 threads; see docs/KERNELS.md for the cost). Vocab up to 2^31 - 1.
struct SampleParams {
  DType logits_dtype = DType::F32;      // F32, BF16 or F16.
  const void* logits = nullptr;         // [rows, logits_stride] logits_dtype.
  const float* temperature = nullptr;   // [rows] fp32; <= 0 means greedy.
  const int32_t* top_k = nullptr;       // [rows] int32; <= 0 or >= vocab: off.
  const float* top_p = nullptr;         // [rows] fp32; >= 1 (or NaN): off; <= 0 keeps one token.
  const uint64_t* seeds = nullptr;      // [rows] uint64 per-request seed.
  const uint64_t* steps = nullptr;      // [rows] uint64 per-request draw counter (e.g. tokens generated so far).
  int32_t* out_tokens = nullptr;        // [rows] int32.
  int rows = 0;
  int vocab = 0;
  int logits_stride = 0;  // 0 = vocab.
};

cudaError_t sample_rows(const SampleParams& p, cudaStream_t stream);

struct LogprobEntry;  // kernels/sampling_ref.h: {float logprob; int32_t id;}, 8 bytes

/// Log-probabilities of sampled tokens (OpenAI's logprobs, raw mode: log-softmax of the logits, before temperature /
/// top-k / top-p), so that only n + 1 pairs per row cross to the host, never the vocabulary. Per row r with
/// n_r = top_n[r] >= 0 (n_r = min(top_n[r], vocab)), writes n_r + 1 entries at out + out_offset[r]: [0] tokens[r]
/// and its logprob, [1..n_r] the n_r most likely tokens, most likely first (ties: lower id). Exactly
/// kernels/sampling_ref.h logprobs_ref's ids; values within fp32 summation error of it (logsumexp summed in fp32
/// per CTA in a fixed order: deterministic). Rows with top_n[r] < 0 are skipped. A tokens[r] outside [0, vocab)
/// gives id -1 and logprob NaN in entry 0. One CTA of 512 threads per row: a max / sum pass, and for n_r > 0 the
/// sampler's 4-pass radix descent to the n_r-th largest key.
struct LogprobParams {
  DType logits_dtype = DType::F32;     // F32, BF16 or F16.
  const void* logits = nullptr;        // [rows, logits_stride] logits_dtype (NaN read as -inf, as sample_rows).
  const int32_t* tokens = nullptr;     // [rows] int32: the sampled token of each row (sample_rows' out_tokens).
  const int32_t* top_n = nullptr;      // [rows] int32: < 0 skip the row, else 0..20 (kMaxTopLogprobs) alternatives.
  const int32_t* out_offset = nullptr; // [rows] int32: first entry of row r in out.
  LogprobEntry* out = nullptr;         // [sum over rows of n_r + 1] entries.
  int rows = 0;
  int vocab = 0;
  int logits_stride = 0;  // 0 = vocab.
};

cudaError_t logprob_rows(const LogprobParams& p, cudaStream_t stream);

}  // namespace spade::kernels

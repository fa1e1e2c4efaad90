// CPU reference of the Gated DeltaNet (GDN) decoding forms: the recurrent form (the baseline every serving
// system uses), chunkwise buffered decode with a checkpoint state and a paged ring buffer, the KV-only parallel form
// for short contexts, and parallel speculative verification with O(1) commit — plus the recurrent verification
// baseline with per-draft state snapshots that the parallel form is benchmarked against.
//
// These functions are the oracle of the CUDA kernels and the CPU data path of GDN layers. All pointers are host
// pointers; inputs and outputs are fp32, the checkpoint/recurrent state is fp32, the buffered vectors are bf16, fp16
// or fp32 (GdnBufferPool::dtype). Invalid parameters throw spade::Error naming the function and the field.
// Design notes, layouts for the CUDA version and memory formulas: docs/GDN.md.
//
// Sources:
//   [KVB] KVBuffer: IO-aware Serving for Linear Attention (../shared/papers/kvbuffer-linear-attention-serving.txt):
//         Sec. 3.1-3.4, Eq. 4-5 (chunkwise form), Eq. 7-8 (parallel verification), Appendix A.1 Eq. 11-16 (GDN).
//   [RS]  ReplaySSM: Cache SSM Inputs, Not State (../shared/papers/replayssm-cache-inputs-not-state.txt): Sec. 5.3
//         (flush rule h + 2T > L, ring buffer), Sec. 5.4, Appendix Algorithms 5-8, "Running under CUDA Graph".
//   [HF]  transformers qwen3_next / qwen3_5 `torch_recurrent_gated_delta_rule` (the model path's exact math).
//
// ---- Per-token math (recurrent form; [RS] Algorithm 5, [KVB] Eq. 11-12, [HF]) ----
// Value head h uses key head h / (num_v_heads / num_k_heads) ([HF] repeat_interleave of q and k). Per token:
//   q^ = l2norm(q) * scale, k^ = l2norm(k)   with l2norm(x) = x / sqrt(sum x^2 + eps), eps = 1e-6, scale = 1/sqrt(d_k)
//   S  <- exp(g) S                            S: [d_k, d_v] fp32 per value head, g = log decay (alpha = exp(g))
//   u  =  beta (v - S^T k^)                   the delta value ("delta" in [HF], u in [KVB]/[RS])
//   S  <- S + k^ u^T
//   o  =  S^T q^                              [d_v]
// With the normalisation switched off (GdnOptions::qk_l2norm = false) q and k are used as given (q still scaled).
//
// ---- Buffered forms: checkpoint + buffer ([KVB] Eq. 15-16, [RS] Algorithms 6 and 8) ----
// Since u_j only depends on the past, S_j = exp(g_j) S_{j-1} + k^_j u_j^T, and the state after the checkpoint S_0 and
// buffered entries j = 1..n unrolls to   S_n = e^{G_n} S_0 + sum_{j<=n} e^{G_n - G_j} k^_j u_j^T,   G_j = sum_{i<=j} g_i
// (cumulative log decay since the checkpoint). The buffer therefore holds (k^_j, u_j, g_j) per token ([KVB] A.1 "we
// need to buffer the decay factor, key and delta value"; [RS] Algorithm 6 "cache u instead of v").
// For T new tokens s = 1..T after h buffered entries (positions h+1..h+T, G_s continuing the buffer's cumsum):
//   a_s = S_0^T k^_s,  c_s = S_0^T q^_s                                    (two reads of the checkpoint)
//   R_s = beta_s (v_s - e^{G_s} a_s - sum_{j<=h} e^{G_s - G_j} (k^_s . k^_j) u_j)
//   A_{s,s'} = beta_s e^{G_s - G_s'} (k^_s . k^_s') for s' < s              strictly lower triangular T x T
//   U = (I + A)^{-1} R                                                    one T x T triangular solve ([RS] Alg. 8 l.5)
//   o_s = e^{G_s} c_s + sum_{j<=h} e^{G_s - G_j} (q^_s . k^_j) u_j + sum_{s'<=s} e^{G_s - G_s'} (q^_s . k^_s') U_s'
// This is the output-only route of [KVB] Eq. 16 (the checkpoint is read, never rebuilt); [RS] Algorithm 6 rebuilds
// S_h first (state-and-output route) — the same math, different rounding. T = 1 is chunkwise decode ([KVB] Sec. 3.2,
// no solve), T > 1 is parallel verification ([KVB] Eq. 7 / [RS] Algorithm 8) or a buffered prefill.
// Flush ([KVB] Eq. 5/16 last line, [RS] Alg. 6 l.7): S_0 <- S_n over the n entries folded, written once.
// KV-only parallel form ([KVB] Sec. 3.4, Eq. 14): a sequence without a valid checkpoint (state_valid = 0) uses
// S_0 = 0 and never reads a state; its first flush ("compression", [KVB] Sec. 3.4 last paragraph) writes the state.
//
// ---- Paged ring buffer ([KVB] Sec. 3.1, [RS] Sec. 5.4) ----
// Each sequence slot owns a ring of `ring_capacity` token positions (a multiple of block_size) made of
// ring_capacity / block_size blocks of the shared pool, listed in its block-table row. Logical buffer entry i
// (0 = oldest since the checkpoint) lives at ring position r = (ring_start + i) % ring_capacity, i.e. in block
// block_table[r / block_size], slot r % block_size. ring_len counts COMMITTED entries. Uncommitted draft entries sit
// at logical positions ring_len.. and are dropped by not advancing ring_len. Commit of a accepted drafts is
// ring_len += a ([RS] "a rollback becomes purely a pointer move"); a flush advances ring_start by the entries folded,
// so accepted drafts never move ([RS] Sec. 5.4).
//
// ---- Per-sequence data, CUDA-graph friendly ([RS] "Running under CUDA Graph") ----
// Ring metadata is persistent and indexed by a sequence slot, not by batch position, so a step's only inputs are the
// token tensors, seq_slots [batch] and the flag array; the functions update ring_start / ring_len / state_valid in
// place (on the device: the same arrays in device memory, no host synchronisation). The flush decision is data:
// flags[b] computed from the lengths by gdn_decode_flush_flags_ref / gdn_verify_flush_flags_ref, so one batch mixes
// flushing and non-flushing, KV-only and chunkwise sequences.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/page_allocator.h"

namespace spade::kernels {

/// Head geometry of one GDN layer (Qwen3-Next / Qwen3.5: 16 key heads, 32 value heads, d_k = d_v = 128).
struct GdnDims {
  int num_k_heads = 0;  // query/key heads, >= 1
  int num_v_heads = 0;  // value heads = state heads, a positive multiple of num_k_heads
  int head_k_dim = 0;   // d_k, >= 1
  int head_v_dim = 0;   // d_v, >= 1
};

/// Query/key preprocessing, identical in every form ([HF] use_qk_l2norm_in_kernel=True, scale = d_k^-1/2).
struct GdnOptions {
  bool qk_l2norm = true;     // l2-normalise q and k per head (eps below) before use
  float l2norm_eps = 1e-6f;  // added to sum(x^2) inside the rsqrt ([HF] l2norm, FLA's convention); >= 0
  float scale = 0.f;         // multiplies q after normalisation; 0 selects 1/sqrt(head_k_dim); must be >= 0
};

/// The tokens of one step, ragged over the batch: sequence b owns rows cu_tokens[b] .. cu_tokens[b+1]-1, in order.
struct GdnTokens {
  const float* q = nullptr;           // q: [total_tokens, num_k_heads, head_k_dim] fp32, raw (before l2norm / scale)
  const float* k = nullptr;           // k: [total_tokens, num_k_heads, head_k_dim] fp32, raw (before l2norm)
  const float* v = nullptr;           // v: [total_tokens, num_v_heads, head_v_dim] fp32
  const float* g = nullptr;           // g: [total_tokens, num_v_heads] fp32 log decay (alpha = exp(g), normally < 0)
  const float* beta = nullptr;        // beta: [total_tokens, num_v_heads] fp32 write strength (sigmoid(b), in (0, 1))
  const int32_t* cu_tokens = nullptr; // cu_tokens: [batch + 1] int32 non-decreasing prefix sums, cu_tokens[0] = 0
  int batch = 0;                      // sequences in this step, >= 0
};

/// What every step form below reads: the dims, options and tokens of the step, its output and the state pool.
struct GdnStepParams {
  GdnDims dims;
  GdnOptions opt;
  GdnTokens tok;
  // out: [total_tokens, num_v_heads, head_v_dim] fp32, written completely.
  float* out = nullptr;
  // state_pool: [num_state_slots, num_v_heads, head_k_dim, head_v_dim] fp32 states, row-major ([HF] layout); the
  // checkpoint states of the buffered forms.
  float* state_pool = nullptr;
  int num_state_slots = 0;
};

// =====================================================================================================================
// 1. Recurrent form ([RS] Algorithm 5; with draft snapshots, [RS] Algorithm 7 = the speculative baseline).
// =====================================================================================================================

struct GdnRecurrentParams : GdnStepParams {
  // state_slots: [batch] int32 slot holding sequence b's state before this step (read). Written back after the last
  // token when draft_state_slots is null (standard decode: load, update, read out, store).
  const int32_t* state_slots = nullptr;
  // draft_state_slots: optional [total_tokens] int32. When set, the state after token i is stored to slot
  // draft_state_slots[i] (per-draft snapshot, [RS] Algorithm 7 l.7; -1 = do not store) and state_slots are only
  // read. Slots written in one call must be distinct and differ from every state_slots entry.
  const int32_t* draft_state_slots = nullptr;
};

/// Recurrent GDN over each sequence's tokens in order (fp32 state, the [HF] arithmetic). Throws spade::Error on
/// inconsistent dims, cu_tokens, slots out of range or aliasing between read and written slots.
void gdn_recurrent_ref(const GdnRecurrentParams& p);

/// Commit of the recurrent verification baseline: an O(1) slot swap, no state copy. spec_state_slots is
/// [batch, num_drafts + 1] int32: column 0 = the slot holding the committed state (passed as state_slots to the next
/// verification), columns 1..T = the draft snapshot slots (passed as draft_state_slots, row b = its T drafts).
/// accepted: [batch] int32 in 0..num_drafts; for a > 0 columns 0 and a are swapped (the snapshot after the last
/// accepted draft becomes the committed state, the old one a free snapshot slot; [RS] Algorithm 7 l.1 "roll back").
void gdn_recurrent_verify_commit_ref(int32_t* spec_state_slots, const int32_t* accepted, int batch, int num_drafts);

// =====================================================================================================================
// 2-4. Buffered forms: chunkwise decode, KV-only parallel form, parallel speculative verification.
// =====================================================================================================================

/// The shared buffer pool ([KVB] Sec. 3.1): blocks of block_size token slots, KV-head axis inside the slot as in the
/// paged KV cache (kernels/paged_attention_ref.h).
struct GdnBufferPool {
  // k: [num_blocks, block_size, num_k_heads, head_k_dim] `dtype`: the l2-normalised keys k^_j (one per key head).
  void* k = nullptr;
  // u: [num_blocks, block_size, num_v_heads, head_v_dim] `dtype`: the delta values u_j (one per value head).
  void* u = nullptr;
  // g: [num_blocks, block_size, num_v_heads] fp32: the log decays g_j (scalars, kept in fp32).
  float* g = nullptr;
  DType dtype = DType::BF16;  // element type of k and u: BF16 / F16 (serving, as in both papers) or F32 (exactness)
  int num_blocks = 0;
  int block_size = 0;         // tokens per block, >= 1 ([KVB]: 8 or 16)
};

/// Persistent per-sequence metadata, indexed by sequence slot (0..max_seqs-1). See the header comment.
struct GdnSeqTable {
  // ring_start: [max_seqs] int32 ring position of logical buffer entry 0, in 0..ring_capacity-1. Updated by flushes.
  int32_t* ring_start = nullptr;
  // ring_len: [max_seqs] int32 committed buffered entries h, in 0..ring_capacity. Updated by decode/flush/commit.
  int32_t* ring_len = nullptr;
  // ring_capacity: [max_seqs] int32 ring size L_b in tokens, a positive multiple of block_size.
  const int32_t* ring_capacity = nullptr;
  // block_tables: [max_seqs, max_blocks_per_seq] int32 block ids; the first ring_capacity/block_size entries are used.
  const int32_t* block_tables = nullptr;
  // state_slots: [max_seqs] int32 checkpoint slot in the state pool, -1 = none (KV-only sequence not yet compressed).
  const int32_t* state_slots = nullptr;
  // state_valid: [max_seqs] uint8 1 = the checkpoint in state_slots is read; 0 = checkpoint is zero and never read
  // (KV-only parallel form). Set to 1 by the flush that compresses a KV-only buffer.
  uint8_t* state_valid = nullptr;
  int max_seqs = 0;
  int max_blocks_per_seq = 0;
};

/// Flag bits of GdnBufferedParams::flags.
inline constexpr uint8_t kGdnFlush = 1;  // fold the buffer into the checkpoint at the end of this step

struct GdnBufferedParams : GdnStepParams {
  GdnBufferPool buf;
  GdnSeqTable seqs;
  // seq_slots: [batch] int32 sequence slot of batch row b (distinct within a call).
  const int32_t* seq_slots = nullptr;
  // flags: [batch] uint8 per-sequence step flags (kGdnFlush), normally from gdn_*_flush_flags_ref.
  const uint8_t* flags = nullptr;
};

/// Chunkwise buffered decode ([KVB] Sec. 3.2 / Eq. 16, [RS] Algorithm 6) and, for sequences with state_valid = 0,
/// the KV-only parallel form ([KVB] Sec. 3.4 / Eq. 14). Per sequence: the n = cu_tokens[b+1]-cu_tokens[b] new tokens
/// (1 in decode; more for a buffered prefill; 0 allowed: a pure flush) get their outputs from checkpoint + buffer,
/// are appended at logical positions h..h+n-1 and committed (ring_len += n). With kGdnFlush all h + n entries are
/// folded into the checkpoint (one state write; KV-only: the compression, which needs state_slots >= 0 and sets
/// state_valid = 1), ring_start advances by h + n and ring_len becomes 0.
/// Throws spade::Error when h + n > ring_capacity, or on inconsistent dims / slots / block tables.
void gdn_chunkwise_decode_ref(const GdnBufferedParams& p);

/// Parallel speculative verification ([KVB] Eq. 7-8, [RS] Algorithm 8): the T_b = cu_tokens[b+1]-cu_tokens[b] draft
/// tokens get their outputs through one T x T triangular solve on top of checkpoint + buffer, with no per-draft
/// state. Their (k^, U, g) are written UNCOMMITTED at logical positions h..h+T-1 (ring_len unchanged). With kGdnFlush
/// only the h committed entries are folded into the checkpoint ([RS] Sec. 5.3 "only committed cached inputs are
/// summarized"): ring_start += h, ring_len = 0, the drafts become entries 0..T-1. Then gdn_verify_commit_ref.
/// Throws spade::Error when h + T > ring_capacity (the flush rule of gdn_verify_flush_flags_ref was not applied).
void gdn_parallel_verify_ref(const GdnBufferedParams& p);

/// Commit after gdn_parallel_verify_ref: ring_len[seq_slots[b]] += accepted[b] — a pointer move, O(1) per sequence,
/// no data moved ([RS] Sec. 5.4). accepted: [batch] int32 in 0..T_b (T_b from cu_tokens, the verified drafts).
/// Throws spade::Error for accepted outside 0..T_b or a ring overflow.
void gdn_verify_commit_ref(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens,
                           const int32_t* accepted, int batch);

/// Flush decision of chunkwise decode / KV-only ([RS] Algorithm 6 l.6 "if buffer full", [KVB] Sec. 3.4 "once the
/// context length L >= d, compress"): flags[b] = kGdnFlush iff h + n + next_tokens > ring_capacity, i.e. flush unless
/// the next step's next_tokens still fit. next_tokens = 1 (plain decode) gives exactly "flush when the buffer is full
/// after this step" (h + n >= L); next_tokens = T keeps room for a following verification of T drafts (the same
/// "one window early" reasoning as [RS] Sec. 5.3). For a KV-only sequence ring_capacity is the KV-only limit (d), so
/// with next_tokens = 1 it compresses in the step whose context reaches d. Throws when h + n > ring_capacity or
/// next_tokens is outside 1..ring_capacity. flags: [batch] uint8 output.
void gdn_decode_flush_flags_ref(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens, int batch,
                                uint8_t* flags, int next_tokens = 1);

/// Flush decision of speculative decoding, [RS] Sec. 5.3 "flushes one window early ... when h + 2T > L": flags[b] =
/// kGdnFlush iff h + 2 T_b > ring_capacity. This keeps >= T free slots in every step (h + T <= L holds for the next
/// window whatever is accepted), which requires ring_capacity >= 2 T_b (checked: spade::Error otherwise).
void gdn_verify_flush_flags_ref(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens,
                                int batch, uint8_t* flags);

// =====================================================================================================================
// Memory per request and layer (docs/GDN.md section 6).
// =====================================================================================================================

/// Bytes of one fp32 state: num_v_heads * d_k * d_v * 4.
size_t gdn_state_bytes(const GdnDims& d);
/// Bytes of one buffered token: num_k_heads * d_k * s + num_v_heads * d_v * s + num_v_heads * 4 (s = dtype size).
size_t gdn_buffer_token_bytes(const GdnDims& d, DType dtype);
/// Recurrent verification of T drafts with per-draft snapshots ([RS] Algorithm 7): (T + 1) states.
size_t gdn_spec_bytes_snapshots(const GdnDims& d, int num_drafts);
/// Parallel verification ([RS] Algorithm 8): 1 state + a ring of L tokens rounded up to whole blocks (L >= 2T).
size_t gdn_spec_bytes_buffered(const GdnDims& d, int num_drafts, int buffer_size, int block_size, DType dtype);

// =====================================================================================================================
// GdnCache: CPU storage and host bookkeeping of the buffered forms (the CPU data path; the CUDA version keeps the same
// arrays in device memory). One instance per GDN layer. Not thread-safe.
// =====================================================================================================================

struct GdnCacheConfig {
  GdnDims dims;
  int max_seqs = 0;         // sequence slots (concurrent requests), >= 1
  int num_state_slots = 0;  // checkpoint states in the state pool, >= 1
  int num_blocks = 0;       // buffer blocks in the pool, >= 1
  int block_size = 16;      // tokens per block, >= 1
  int buffer_size = 16;     // L: ring capacity of the chunkwise form in tokens, a positive multiple of block_size
  int kv_only_limit = 0;    // 0: KV-only form disabled; else the context at which a KV-only sequence compresses
                            // ([KVB] Sec. 3.4: d = head_k_dim), a positive multiple of block_size
  DType buffer_dtype = DType::BF16;
};

class GdnCache {
 public:
  /// Allocates the pools (state pool filled with quiet NaN: a read of an unassigned checkpoint shows up in outputs).
  /// Throws spade::Error for invalid sizes (e.g. buffer_size not a multiple of block_size).
  explicit GdnCache(const GdnCacheConfig& cfg);

  const GdnCacheConfig& config() const { return cfg_; }

  /// Admits sequence `seq` and returns its sequence slot. kv_only = true starts it in the KV-only parallel form (no
  /// state slot; ring of kv_only_limit tokens); otherwise it gets a state slot holding a zero checkpoint (write the
  /// prefilled state through state()) and a ring of buffer_size tokens. Throws spade::Error naming the exhausted pool
  /// (sequence slots, buffer blocks, state slots) or when kv_only is requested with kv_only_limit = 0.
  int admit(uint64_t seq, bool kv_only);
  /// Returns the sequence's blocks and state slot to their pools. Unknown sequences are ignored.
  void release(uint64_t seq);
  /// Sequence slot of an admitted sequence. Throws spade::Error for an unknown sequence.
  int slot(uint64_t seq) const;
  /// The checkpoint state [num_v_heads, d_k, d_v] fp32 of `seq`. Throws when the sequence has no state slot.
  float* state(uint64_t seq);

  /// Flags of a chunkwise/KV-only decode step (gdn_decode_flush_flags_ref) for the batch `seq_slots` with ragged
  /// token counts `cu_tokens` [batch + 1]; assigns a state slot to every KV-only sequence that compresses in this step
  /// (throws when the state pool is exhausted).
  /// next_tokens as in gdn_decode_flush_flags_ref (T when verifications of T drafts follow).
  std::vector<uint8_t> plan_decode(const std::vector<int32_t>& seq_slots, const std::vector<int32_t>& cu_tokens,
                                   int next_tokens = 1);
  /// Flags of a verification step (gdn_verify_flush_flags_ref); same state-slot assignment. Marks the drafts
  /// pending until commit().
  std::vector<uint8_t> plan_verify(const std::vector<int32_t>& seq_slots, const std::vector<int32_t>& cu_tokens);
  /// gdn_verify_commit_ref for the batch of the last plan_verify (accepted: [batch]).
  void commit(const std::vector<int32_t>& seq_slots, const std::vector<int32_t>& cu_tokens,
              const std::vector<int32_t>& accepted);
  /// Between steps: every sequence whose KV-only buffer has been compressed (state_valid = 1, ring larger than
  /// buffer_size) switches to the chunkwise ring — its committed entries are moved to ring positions 0.. of its first
  /// buffer_size / block_size blocks (a one-time copy of <= T entries) and the other blocks return to the pool.
  /// Throws when drafts are pending (call after commit()).
  void finish_step();

  /// Pointers for GdnBufferedParams (buf, seqs, state_pool, num_state_slots).
  GdnBufferPool pool();
  GdnSeqTable table();
  float* state_pool() { return states_.data(); }
  int num_state_slots() const { return cfg_.num_state_slots; }

  // Introspection (tests, scheduler).
  int ring_len(int seq_slot) const { return ring_len_.at(seq_slot); }
  int ring_start(int seq_slot) const { return ring_start_.at(seq_slot); }
  int ring_capacity(int seq_slot) const { return ring_cap_.at(seq_slot); }
  int state_slot(int seq_slot) const { return state_slot_.at(seq_slot); }
  bool state_valid(int seq_slot) const { return state_valid_.at(seq_slot) != 0; }
  int held_blocks(uint64_t seq) const { return blocks_.held_pages(seq); }
  int free_blocks() const { return blocks_.num_free_pages(); }
  int free_state_slots() const { return static_cast<int>(free_states_.size()); }

 private:
  void assign_states_for_flush(const std::vector<int32_t>& seq_slots, const std::vector<uint8_t>& flags);
  // plan_decode (decode; next_tokens as there) / plan_verify (fn names the caller in errors): the batch checked, its
  // flush flags, and state slots assigned for the flushes.
  std::vector<uint8_t> plan(const char* fn, const std::vector<int32_t>& seq_slots,
                            const std::vector<int32_t>& cu_tokens, bool decode, int next_tokens);
  int take_state_slot(uint64_t seq);
  void write_table_row(int seq_slot, uint64_t seq);

  GdnCacheConfig cfg_;
  int max_blocks_per_seq_ = 0;
  size_t state_floats_ = 0;
  std::vector<float> states_;
  std::vector<float> k_store_, u_store_, g_store_;  // raw storage of the pool (16-bit data packed two per float)
  PageAllocator blocks_;
  std::vector<int32_t> ring_start_, ring_len_, ring_cap_, block_tables_, state_slot_;
  std::vector<uint8_t> state_valid_;
  std::vector<int32_t> free_seq_slots_, free_states_;
  std::vector<uint64_t> slot_seq_;
  std::vector<uint8_t> slot_used_;
  std::unordered_map<uint64_t, int> seq_slot_;
  std::vector<int32_t> pending_slots_;  // sequence slots with uncommitted drafts (plan_verify .. commit)
};

}  // namespace spade::kernels

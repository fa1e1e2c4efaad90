// The per-step protocol of the GPU data plane between an inference rank and its GPU cache rank, over one
// GpuLink (transport/gpu_link.h). Both ranks derive every message size from the step's plan, so each NCCL send has a
// receive of the same size and no size travels separately.
//
// Per decode / prefill step t, in this order on the link:
//   up    plan(t)                   kGpuPlanBytes: the step's retained prefixes, forks, dropped prefixes, released
//                                   slots and rows (slot, tokens, context, flags)
//   up    rows(t, p) per pack p     [layers of p][tokens of t][q | k | v] bf16: each token's rows after q/k norm and
//                                   RoPE, as the inference rank appended them (RopeKvAppendParams::row_out)
//   down  steady(t, p), first(t, p) per pack p, each only if its group is not empty: the selections for step t + 1
//                                   of the plan's SELECT rows as delta messages (DeltaLayout), capacity C for rows
//                                   whose table the inference rank already holds ("steady"), the full budget for
//                                   FIRST rows (a sequence's first selection, or its first after a reset)
// The cache rank reads the plan on its host (it may wait; the inference rank never does), applies its retains, forks,
// drops and released slots in that order, then appends every token of every row to its full KV pool and its query windows, and runs the
// selection pipeline for the SELECT rows.
//
// Between steps, when the inference rank's engine has nothing to run, a flush plan (step -2: no rows, no forks, no
// packs after it, no step number taken) carries the retains, drops and released slots that would otherwise wait for
// the next request's first step, so the cache rank frees an ended sequence's pages (and its KV gauges reach the idle
// state) while the pair is idle.
//
// Forks (n samples sharing one prompt): a fork gives the sequence of slot `child` the first `tokens` tokens of slot
// `parent` (all of them, page-aligned) without shipping them again: the cache rank shares those pages (reference
// counts, common/page_allocator.h fork_prefix) and copies the parent's query and anchor windows, so the child's
// selections are those it would make had it computed the prompt itself. The child's first row then continues at
// position `tokens` (not fresh).
//
// Retained prefixes (prefix caching on the pair): a retain keeps the first `tokens` tokens of a slot (whole pages)
// under a retained-prefix id before that slot is released; a fork with kForkFromRetained starts a new sequence from
// the first `tokens` of a retained prefix (its pages shared; its query and anchor windows empty: the sequence computes
// at least the prompt's last prefix_recompute_tokens tokens itself, which fill them as a full prefill would); a drop
// forgets a retained prefix. The inference rank alone decides what is retained, reused and dropped (its prefix cache
// holds the same pages), and sizes the cache rank's pool for it (the hello's num_pages).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/config.h"

namespace spade::pair {

/// The first message on a GPU pair's link, inference -> cache, before any plan: the inference rank's shapes and
/// limits. The cache rank sizes its server from it (gpu_cache_options in gpu_server.h), so the two ranks cannot
/// disagree on a message size; only the cache-side knobs (query window, ridge eps, GQA rule) are the cache rank's own.
struct GpuPairHello {
  int32_t num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;  // the model's attention view
  int32_t layers_per_pack = 0;    // P
  int32_t token_budget = 0;       // k
  int32_t local_window = 0;       // R
  int32_t delta_capacity = 0;     // C (1..k)
  int32_t max_slots = 0;          // plan slots (the engine's max_num_seqs)
  int32_t max_step_tokens = 0;    // the engine's max_num_batched_tokens
  int32_t num_pages = 0;          // the cache rank's KV pool: the engine's max_context_pages, else its num_pages
  int32_t page_size = 0;
  int32_t max_pages_per_seq = 0;  // ceil(max_model_len / page_size)
};

/// Size of the hello message on the link.
inline constexpr size_t kGpuHelloBytes = 256;

/// The hello as exactly kGpuHelloBytes bytes.
std::vector<uint8_t> encode_gpu_hello(const GpuPairHello& h);
/// Parses and validates a hello: magic and version, every limit positive, C <= k, max_slots <= gpu_plan_max_rows(),
/// and the attention shapes equal to `attn_cfg`'s (the cache rank's model). Throws spade::Error naming `peer` and the
/// field that differs.
GpuPairHello decode_gpu_hello(const uint8_t* data, size_t len, const ModelConfig& attn_cfg, const std::string& peer);

/// Row flags of a plan.
enum GpuRowFlags : uint32_t {
  kRowFresh = 1u,        // the sequence starts in this step (position 0): empty its windows and pages first
  kRowSelect = 2u,       // compute its selection for the next step
  kRowFirstSelect = 4u,  // ... as a full selection (implies kRowSelect): the holder's table starts over
};

struct GpuPlanRow {
  int32_t slot = -1;    // the sequence's slot, 0..max_slots-1, the same on both ranks
  int32_t q_len = 0;    // tokens of this step (>= 1)
  int32_t ctx_len = 0;  // context length after this step (>= q_len)
  uint32_t flags = 0;   // GpuRowFlags
};

/// One fork of a plan (file comment: Forks). Applied before the plan's released slots and rows, in plan order; the
/// child slot loses whatever it held first (like a fresh row).
enum GpuForkFlags : uint32_t {
  kForkFromRetained = 1u,  // `parent` is a retained-prefix id, not a slot
};

struct GpuPlanFork {
  int32_t child = -1;   // the new sequence's slot
  int32_t parent = -1;  // the slot whose leading tokens it starts from (live on the cache rank), or a retained prefix
  int32_t tokens = 0;   // a multiple of the page size (>= 1 page): from a slot its whole context, from a retained
                        // prefix at most its tokens
  uint32_t flags = 0;   // GpuForkFlags
};

/// Keeps the first `tokens` tokens (whole pages, at most the slot's context) of `slot` as retained prefix `id`.
struct GpuPlanRetain {
  int32_t slot = -1;
  int32_t id = -1;  // >= 0, not held already
  int32_t tokens = 0;
};

struct GpuStepPlan {
  /// The end of the pair's stream (encoded as step -1, no rows): the inference rank sends it when it stops using
  /// the link (GpuSparseController::close); the cache rank then posts no further receive, so nothing stays pending
  /// on either GPU (a pending stream wait would block every device-wide synchronisation, cudaFree included).
  static constexpr int64_t kCloseStep = -1;
  static GpuStepPlan close_plan() {
    GpuStepPlan p;
    p.step = kCloseStep;
    return p;
  }
  bool is_close() const { return step == kCloseStep; }
  /// The idle flush (file comment): step -2, no rows and no forks; released slots, retains and drops as any plan.
  static constexpr int64_t kFlushStep = -2;
  bool is_flush() const { return step == kFlushStep; }
  int64_t step = 0;
  std::vector<GpuPlanRow> rows;   // batch order = the order of the step's tokens
  std::vector<int32_t> released;  // slots whose sequences ended since the previous plan (freed before this step,
                                  // after the forks)
  std::vector<GpuPlanRetain> retains;  // slots' prefixes to keep (applied first)
  std::vector<GpuPlanFork> forks;      // sequences starting from another slot's or a retained prefix's tokens
  std::vector<int32_t> drops;          // retained prefixes to forget (after the forks)
  int total_tokens() const;
  std::vector<int> steady_rows() const;  // indices of SELECT rows without FIRST, batch order
  std::vector<int> first_rows() const;   // indices of FIRST rows, batch order
};

/// Size of a plan message on the link.
inline constexpr size_t kGpuPlanBytes = 16384;
/// Most rows (and, separately, released slots, forks, retains and drops) a plan carries.
int gpu_plan_max_rows();

/// The plan as exactly kGpuPlanBytes bytes. Throws spade::Error for too many rows, released slots, forks, retains or
/// drops.
std::vector<uint8_t> encode_gpu_plan(const GpuStepPlan& p);
/// Parses and validates a plan (magic, version, counts, slots in [0, max_slots) and distinct among rows, q_len >= 1,
/// ctx_len >= q_len, a FRESH row's ctx_len == q_len, known flags, FIRST only with SELECT, forks with a child slot in
/// [0, max_slots), a parent slot in range and != child (or a retained id >= 0), children distinct, tokens >= 1, known
/// fork flags, no fork's child FRESH in a row, retains with a slot in range, an id >= 0 and tokens >= 1, drops >= 0,
/// a negative step only as the close plan (step -1 and nothing else) or a flush (step -2, no rows and no forks)).
/// Throws spade::Error naming `peer`.
GpuStepPlan decode_gpu_plan(const uint8_t* data, size_t len, int max_slots, const std::string& peer);

/// Byte layout of one delta message (kernels/selection_delta_ref.h): rows = (layer, sequence, KV head) rows, `cap`
/// entries each: [slots rows*cap int32][positions rows*cap int32][row info rows*4 int32][K rows*cap*D][V rows*cap*D]
/// (16-bit K / V), every section and the whole message 256-byte aligned (16-byte vector accesses of gather_kv and
/// apply_selection_delta, and consecutive messages in one buffer).
struct DeltaLayout {
  size_t rows = 0;
  int cap = 0;
  size_t slots = 0, positions = 0, info = 0, k = 0, v = 0, bytes = 0;
  DeltaLayout() = default;
  DeltaLayout(size_t rows, int cap, int head_dim);
};

/// The messages of one layer pack of `pack_layers` layers in a step with plan `p`.
struct GpuPackSizes {
  size_t up_bytes = 0;  // q | k | v rows: pack_layers x total_tokens x (Hq + 2 Hkv) x head_dim x 2
  DeltaLayout steady;   // pack_layers x |steady rows| x Hkv rows, `capacity` entries (rows 0: not sent)
  DeltaLayout first;    // pack_layers x |first rows| x Hkv rows, `budget` entries (rows 0: not sent)
};
GpuPackSizes gpu_pack_sizes(const GpuStepPlan& p, int pack_layers, const ModelConfig& attn_cfg, int budget,
                            int capacity);

}  // namespace spade::pair

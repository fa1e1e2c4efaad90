// Layer-pack messages between an inference rank and its cache rank (the CPU pair's wire protocol). The cache rank's
// processing of them is cache_rank/pack_server.h.
//
// Per decode step the inference rank sends one PackUpdate per layer pack (P consecutive layers) holding, for each
// sequence in sparse mode, either the step's q/k/v of the pack's layers (APPEND) or, on the step a sequence switches
// to sparse mode, all its existing KV and its recent queries (INIT, the bulk ship). The cache rank answers each
// update with one PackSelection: for each sequence and layer, the token-level top-k selected for the NEXT step
// (context length + 1), computed from the predicted next query (Algorithm 1).
//
// Wire format (encode/decode): little-endian, host fp32, a fixed header then the entries. Framing over a transport
// is two messages with one tag: a 16-byte prefix {magic "SPK1", kind, payload bytes} and the payload. decode()
// checks every length against the buffer and throws spade::Error naming `peer` on malformed input. A payload's magic
// names its version (update v3 "SKPW": retained prefixes; v2 "SKPV" and v1 "SKPU" are refused by name).
//
// Shared KV (the CPU pair): an INIT may name a sequence the cache rank holds whose first tokens are the same KV
// (SeqUpdate::shared_from): n samples of one prompt, or requests whose prompts hit the inference rank's prefix cache
// while a sequence holding that prefix is tracked, ship and store the shared part once; the cache rank shares the
// pages (reference counts, common/page_allocator.h).
//
// Retained prefixes (the CPU pair): when a sparse sequence ends while its leading full pages stay in the inference
// rank's prefix cache, its release may say "keep my first P tokens" (PackUpdate::retained): the cache rank then holds
// those P tokens under the sequence's id (no selection state), and a later INIT may share from it like from a live
// sequence. The inference rank alone decides: it shortens or drops (PackUpdate::dropped) a retained prefix when its
// prefix cache evicts a page of it or its bound is reached; the cache rank frees a retained prefix only then (or
// when the pair is reset).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/config.h"
#include "pair/delta.h"
#include "pair/selection_config.h"

namespace spade::pair {

struct SeqUpdate {
  uint64_t seq_id = 0;
  int32_t context_len = 0;   // tokens of the sequence after this step (the current token included)
  bool init = false;         // INIT: k/v hold tokens [shared_tokens, context_len); APPEND: only the current token
  int32_t num_queries = 0;   // queries per layer in q (INIT: up to W+1 most recent; APPEND: 1)
  int32_t token_budget = 0;  // this request's token budget per KV head; 0 = the rank's (1..the rank's otherwise)
  // INIT only, 0 = none (the whole context travels): the first shared_tokens tokens (1..context_len - 1) are the same
  // KV as the first shared_tokens of sequence `shared_from`, which the cache rank holds (INIT in an earlier update, or
  // an entry earlier in this one), so they are not shipped: the cache rank shares those pages.
  int32_t shared_tokens = 0;
  uint64_t shared_from = 0;
  std::vector<float> q;      // [num_layers, num_queries, q_dim]
  std::vector<float> k;      // [num_layers, init ? context_len - shared_tokens : 1, kv_dim]
  std::vector<float> v;      // same as k
  /// Tokens whose K/V rows this entry carries per layer.
  int32_t kv_tokens() const { return init ? context_len - shared_tokens : 1; }
};

/// A retained prefix (PackUpdate::retained): the first `tokens` tokens (>= 1) of sequence `seq_id`.
struct Retain {
  uint64_t seq_id = 0;
  int32_t tokens = 0;
  bool operator==(const Retain&) const = default;
};

struct PackUpdate {
  int64_t step = 0;
  int32_t pack = 0;
  int32_t first_layer = 0;
  int32_t num_layers = 0;
  std::vector<uint64_t> released;  // sequences that left the batch since the last update (their KV is freed)
  // Applied after `released`, before `dropped` and the entries. An id also in `released`: that ended sequence keeps
  // its first `tokens` tokens on the cache rank as a retained prefix instead of freeing them (its query window and
  // selection state are freed); `tokens` <= the tokens it holds. Another id: a retained prefix, shortened to `tokens`
  // (<= what it holds). The cache rank refuses an id it does not hold, a live sequence not released here, and
  // `tokens` beyond what it holds, naming the sequence.
  std::vector<Retain> retained;
  std::vector<uint64_t> dropped;   // retained prefixes to free (an id that is not one is refused)
  std::vector<SeqUpdate> seqs;
};

struct SeqSelection {
  uint64_t seq_id = 0;
  int32_t context_len = 0;           // context length of the step that uses this selection
  std::vector<LayerSelection> layers;  // [num_layers] full selections (PackSelection::delta false)
  std::vector<LayerDelta> deltas;      // [num_layers] changes to the held selections (PackSelection::delta true)
};

struct PackSelection {
  int64_t step = 0;   // the step whose update produced this selection (it is used at step + 1)
  int32_t pack = 0;
  double select_ms = 0;  // cache-rank time spent on this pack (append + predict + score + top-k + gather)
  std::string error;     // non-empty: the cache rank could not process the update (e.g. pool exhausted)
  bool delta = false;    // seqs carry deltas against the inference rank's held selections (pair/delta.h)
  std::vector<SeqSelection> seqs;
};

/// Shapes shared by both ends, from the model config and the selection config.
struct PackShape {
  int q_dim = 0, kv_dim = 0, num_kv_heads = 0, head_dim = 0, token_budget = 0;
};
PackShape pack_shape(const ModelConfig& cfg, const SelectionConfig& sc);

std::vector<uint8_t> encode(const PackUpdate& u, const PackShape& s);
PackUpdate decode_update(const uint8_t* data, size_t len, const PackShape& s, const std::string& peer);
std::vector<uint8_t> encode(const PackSelection& p, const PackShape& s);
PackSelection decode_selection(const uint8_t* data, size_t len, const PackShape& s, const std::string& peer);

/// The 16-byte frame prefix sent before each payload.
struct FramePrefix {
  static constexpr uint32_t kMagic = 0x314b5053;  // "SPK1"
  uint32_t magic = kMagic;
  uint32_t kind = 0;  // 1 = PackUpdate, 2 = PackSelection, 3 = shutdown
  uint64_t payload_bytes = 0;
};
static_assert(sizeof(FramePrefix) == 16);

}  // namespace spade::pair

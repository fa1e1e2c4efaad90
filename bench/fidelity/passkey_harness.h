// Pass-key fidelity of sparse decoding on a real trained long-context model (the CPU path, fp32).
//
// Models: ../shared/data/models/longctx-{7m,22m} (Qwen3 architecture, byte-level, 6 layers, GQA 8q / 2kv, head_dim
// 128, 8k context), trained to find a 5-digit pass key hidden in code. Prompts: ../shared/data/prompts/
// passkey_public.jsonl ({prompt, expect, bytes, needles, ...}); a reply is right when it contains `expect`.
//
// Each prompt is rendered with the checkpoint's chat template and prefilled ONCE with dense attention, up to its last
// `kTail` tokens; every variant then copies that KV, prefills the tail through its own attention backend (so the
// backend sees the last W + 1 queries, as a switch from a real prefill does), and decodes greedily through
// SparseAttention (inference_rank/sparse_attention.h) — the production CPU path, with an in-process cache rank
// (pair/link.h InProcessLink) for the asynchronous variants. A variant is a selection mode (dense, oracle =
// true-query exact token top-k, quest = true-query page top-k, predicted = AsyncSpade one step ahead) with a
// SelectionConfig (predictor, successor expansion, GQA rule, window, sinks).
//
// Teacher-forced metrics on held-out code (heldout_code_py.txt): a document's first `context` bytes prefilled, the
// next `forced` bytes fed one decode step each; per variant the bits per byte of the true bytes, the top-1
// agreement with dense, and for predicted variants the overlap ratio (AsyncSpade Eq. 1, per layer and KV head) and
// the selection churn per step (pair/pack.h OverlapSampler).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache_rank/pack_server.h"
#include "cache_rank/selector.h"
#include "common/tokenizer.h"
#include "inference_rank/model.h"
#include "inference_rank/sparse_attention.h"

namespace spade::fidelity {

/// One line of passkey_public.jsonl.
struct PasskeyPrompt {
  int id = 0;
  std::string prompt, expect, label;
  int bytes = 0, needles = 0;
};

/// Reads a pass-key jsonl file. Throws spade::Error naming the file and line for a missing file or a malformed line.
std::vector<PasskeyPrompt> load_passkey_prompts(const std::string& path);

/// A selection variant: its name, mode and selection settings (token_budget is set per run).
struct Variant {
  std::string name;
  SelectionMode mode = SelectionMode::Dense;
  pair::SelectionConfig selection;
};

/// Parses "NAME" (a built-in: dense, oracle, quest, predicted, paper, last) or "NAME=MODE[:key=value...]" (e.g. "w16=predicted:window=16") with keys
/// predictor (ridge|paper|last), successor (0|1), window (W), eps, gqa (max|mean), sinks, local, anchors (prompt anchor
/// queries, 0 = off), span (anchor span). `base` holds the
/// settings the built-ins and overrides start from (the command line's selection flags). Built-ins: predicted = base;
/// oracle and quest = base without successor expansion (exact top-k / Quest with the true query); paper = Algorithm
/// 1 as published (paper predictor, absolute eps 1e-3, no successor expansion, no prompt anchors); last = the
/// previous step's true query (last predictor, no expansion, no anchors). Throws spade::Error for an unknown name or key.
Variant parse_variant(const std::string& spec, const pair::SelectionConfig& base);

/// A token budget: absolute tokens (per layer and KV head) or a fraction of the prompt's tokens (rounded up).
struct Budget {
  int tokens = 0;
  double fraction = 0;
  std::string name() const;
  int resolve(int prompt_tokens) const;
};
/// "128" or "1/16" (or "0.0625"). Throws spade::Error otherwise.
Budget parse_budget(const std::string& s);

struct RunOptions {
  // The pair's settings (pair/selection_config.h): sparse_threshold and layers_per_pack are read (each variant brings
  // its own selection); this harness runs packs of 2 layers (the longctx models have 6).
  pair::SparseConfig sparse = [] {
    pair::SparseConfig c;
    c.layers_per_pack = 2;
    return c;
  }();
  int max_new_tokens = 48;
  int page_size = 16;
};

/// One greedy reply of a variant to a prompt.
struct Reply {
  std::string text;
  bool correct = false;
  int generated = 0;
  uint64_t sparse_steps = 0;  // (sequence, step) pairs decoded sparsely
};

/// A prompt prefilled once (dense); decode() runs a variant from there.
class PrefilledPrompt {
 public:
  /// `ids`: the rendered prompt's tokens (>= 2).
  PrefilledPrompt(const Model& model, std::vector<int32_t> ids, const RunOptions& opt);
  int num_tokens() const { return static_cast<int>(ids_.size()); }
  /// Greedy decoding until an EOS id or max_new_tokens; `budget` tokens per layer and KV head (ignored for dense).
  Reply decode(const Variant& v, int budget, const std::vector<int>& eos_ids, const Tokenizer& tok,
               const std::string& expect) const;

 private:
  const Model& model_;
  std::vector<int32_t> ids_;
  RunOptions opt_;
  int pages_;
  std::unique_ptr<KvCache> kv_;  // the prefix [0, n - tail) of every layer
  int prefix_ = 0;
};

/// Renders `user` with the tokenizer's chat template and encodes it.
std::vector<int32_t> chat_prompt_ids(const Tokenizer& tok, const std::string& user);

/// Teacher-forced metrics of one variant over one document.
struct ForcedStats {
  double nll_sum = 0;     // nats, over the forced tokens
  int tokens = 0;
  int top1_agree = 0;     // argmax equal to dense's argmax
  std::vector<std::vector<cache::OverlapSampler::HeadStats>> heads;  // [layer][KV head] (predicted variants)
};

/// Runs `doc` (token ids, byte-level) teacher-forced: the first `context` tokens prefilled, the next `forced` tokens
/// one decode step each. `dense_argmax` (size forced, or empty for the dense run itself, which fills it).
ForcedStats teacher_forced(const Model& model, const std::vector<int32_t>& doc, int context, int forced,
                           const Variant& v, int budget, const RunOptions& opt, std::vector<int32_t>& dense_argmax);

}  // namespace spade::fidelity

// Continuous-batching scheduler of the inference rank (CPU path).
//
// Every step() builds one ragged batch: one decode token for each running sequence, plus prefill chunks of
// admitted sequences up to max_num_batched_tokens (vLLM-style mixed prefill/decode batching). Requests join
// between steps (submit) and leave when they finish (EOS, max_tokens, abort), freeing their pages at once.
// Admission reserves the pages a request can ever need (prompt + max_tokens), so a running request never waits
// for memory and nothing is preempted; a request that cannot fit yet waits in FIFO order.
// Hybrid models (linear-attention layers): admission also takes a recurrent-state slot of the engine's GdnStatePool
// (max_num_seqs slots, so admission never waits for one), finish/abort/error returns it; every forward passes each
// sequence's slot (ForwardBatch::state_slots). KV pages exist only for the full-attention layers: the KvCache and
// the attention backend are built for ModelConfig::attention_view().
// Single-threaded: submit/abort/step are called from one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/page_allocator.h"
#include "common/sampling.h"
#include "inference_rank/model.h"

namespace spade {

enum class FinishReason { None, Stop, Length, Abort, Error };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", "error" (OpenAI spelling)

struct GenerateRequest {
  std::vector<int32_t> prompt_ids;   // non-empty, ids < vocab
  int max_tokens = 16;               // > 0: tokens to generate at most
  SamplingParams sampling;
  std::vector<int> stop_token_ids;   // generation stops after sampling one of these (e.g. EOS)
  bool ignore_eos = false;           // keep generating through stop_token_ids (benchmarks, parity fixtures)
  // Log-probabilities of each generated token (common/sampling.h TokenLogprobs, raw mode: the log-softmax of the
  // logits the token was sampled from, before temperature / top-k / top-p): -1 none; 0..kMaxTopLogprobs the
  // sampled token's logprob and that many most likely alternatives.
  int logprobs = -1;
  // Teacher forcing (fidelity measurements): generated token i is forced_tokens[i], not a sample (ids < vocab; at
  // least max_tokens of them); its logprobs, if asked, are the forced token's under the logits of its step, with the
  // top alternatives (the first is the model's argmax). Only with the host sampler (an Engine over a Model or a
  // ForwardFn; a ForwardSampleFn engine refuses it: the GPU path's --host-sampling).
  std::vector<int32_t> forced_tokens;
};

/// One event per generated token; the last event of a request has finished == true.
struct TokenEvent {
  uint64_t request_id = 0;
  int32_t token = -1;        // -1 when the request ends without a new token (abort, error)
  bool finished = false;
  FinishReason reason = FinishReason::None;
  std::string error;         // set when reason == Error
  std::optional<TokenLogprobs> logprobs;  // of `token`, when the request asked (GenerateRequest::logprobs >= 0)
};

using TokenCallback = std::function<void(const TokenEvent&)>;

struct EngineOptions {
  int page_size = 16;                 // tokens per KV page
  int num_pages = 0;                  // 0: min(max_num_seqs full-length sequences, kv_cache_bytes)
  size_t kv_cache_bytes = size_t{1} << 30;  // KV budget when num_pages == 0 (host memory, fp32)
  int max_num_seqs = 64;              // running sequences at most
  int max_num_batched_tokens = 2048;  // tokens per forward at most (prefill chunking)
  int max_model_len = 0;              // 0: max_position_embeddings
  // Bound on the full contexts (pages of prompt + max_tokens) of the running sequences together: their cache rank
  // holds every context in full, dropped parts included, so this is its pool (the GPU path's pair hello sends it,
  // make_gpu_pair_hello). Page dropping (AttentionBackend::droppable_range) frees local pages of sparse sequences;
  // admission reuses them only up to this bound. 0: num_pages (freed pages are not admitted again; the CPU path's
  // cache rank has a pool of num_pages, so leave it 0 there).
  int max_context_pages = 0;
  // Automatic prefix caching (common/page_allocator.h): full KV pages of finished prefills are kept, keyed by their
  // tokens, and a later prompt with the same leading tokens reuses them instead of recomputing (vLLM's
  // --enable-prefix-caching; the rank's flag sets it). Refused for hybrid models (a linear-attention layer's recurrent
  // state is not paged: Engine throws spade::Error).
  bool enable_prefix_caching = false;
  // Prompt tokens always recomputed at the end of a prompt, >= 1 (the prefill must yield the next token's logits).
  // Sparse decoding needs the prompt's last queries (the predictor's window and the prompt anchors: its INIT ship),
  // so a sparse backend sets this to the number of queries it keeps.
  int prefix_recompute_tokens = 1;
};

struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  double kv_cache_usage = 0;          // 0..1
  uint64_t steps = 0;
  uint64_t prompt_tokens = 0;         // processed by prefill
  uint64_t generated_tokens = 0;
  uint64_t dropped_pages = 0;         // KV pages freed early: a sparse sequence's pages outside what it still reads
                                      // locally (AttentionBackend::droppable_range)
  uint64_t prefix_queried_tokens = 0; // prompt tokens looked up in the prefix cache (0 with it off)
  uint64_t prefix_hit_tokens = 0;     // of those, tokens whose KV was reused (not recomputed)
};

/// Per-request timing hooks (metrics). Called on the engine's thread; must be cheap. Times in seconds.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  /// A request entered the running batch `queue_time` after submit().
  virtual void on_scheduled(double queue_time) { (void)queue_time; }
  /// `n` prompt tokens were prefilled.
  virtual void on_prompt_tokens(int n) { (void)n; }
  /// A token was generated: the first one `ttft` after submit (time to first token), the later ones `itl` after
  /// the previous one (inter-token latency); `first` tells which.
  virtual void on_token(bool first, double latency) { (void)first, (void)latency; }
  /// A request ended (any reason), `e2e` after submit, with `generated` tokens.
  virtual void on_finished(FinishReason reason, double e2e, int prompt_tokens, int generated) {
    (void)reason, (void)e2e, (void)prompt_tokens, (void)generated;
  }
};

/// Builds the attention backend once the engine has sized its KV cache. The config passed is the model's
/// attention_view() (num_layers = its full-attention layers), owned by the engine: a backend may keep a reference.
using BackendFactory = std::function<std::unique_ptr<AttentionBackend>(const ModelConfig&, KvCache&)>;

/// A forward pass the engine drives instead of the CPU Model (the GPU path, inference_rank/gpu_engine.h): runs
/// `batch` (the engine's block tables index its own PageAllocator, so the implementation keeps a KV pool of
/// EngineOptions::num_pages pages of page_size tokens) and resizes `logits` to [batch.logit_rows.size(), vocab]
/// fp32. Throws spade::Error to fail the batch's requests (the engine keeps serving).
using ForwardFn = std::function<void(const ForwardBatch& batch, std::vector<float>& logits)>;

/// The sampling of one logit row for a ForwardSampleFn: its request's parameters and draw counter (the tokens the
/// request generated so far).
struct RowSampling {
  SamplingParams params;
  uint64_t step = 0;
  int logprobs = -1;  // GenerateRequest::logprobs: -1 none, else the number of top alternatives
};

/// An external forward pass that also samples on its device (the GPU path: kernels::sample_rows, whose draw depends
/// on the request's seed and step only, kernels/sampling_ref.h — seeded sampling therefore differs from the CPU
/// path's std::mt19937_64 stream; greedy is the same argmax rule): fills `tokens` [batch.logit_rows.size()] from
/// `rows` (one per logit row), and `logprobs` [same size] for the rows with RowSampling::logprobs >= 0 (the others
/// are left default), computed from the same logits as common/sampling.h token_logprobs defines. Only token ids and
/// those logprobs cross back to the host. Throws spade::Error to fail the batch.
using ForwardSampleFn = std::function<void(const ForwardBatch& batch, const std::vector<RowSampling>& rows,
                                           std::vector<int32_t>& tokens, std::vector<TokenLogprobs>& logprobs)>;

class Engine {
 public:
  /// `make_attention`: nullptr = dense paged attention over the engine's own KvCache.
  Engine(const Model& model, EngineOptions opt, const BackendFactory& make_attention = nullptr);
  /// An engine over an external forward pass of a model of `cfg`; attention happens inside `forward`, over a KV pool
  /// of options().num_pages pages (the normalised value: build the pool from options() before the first step). For
  /// a hybrid cfg the forward pass holds the GDN states: the engine gives each running sequence a slot id in
  /// [0, max_num_seqs) (ForwardBatch::state_slots); a sequence whose step starts at position 0 must get fresh states.
  Engine(const ModelConfig& cfg, EngineOptions opt, ForwardFn forward);
  /// The same over a forward pass that samples on its device (ForwardSampleFn).
  Engine(const ModelConfig& cfg, EngineOptions opt, ForwardSampleFn forward);

  /// Validates and queues a request; returns its id. Throws spade::Error (nothing queued) for an empty prompt,
  /// an id outside the vocabulary, max_tokens <= 0, invalid sampling parameters, logprobs outside
  /// [-1, kMaxTopLogprobs], or a request longer than the
  /// context: "This model's maximum context length is N tokens and your request has M tokens (P in the prompt,
  /// K to generate)".
  uint64_t submit(GenerateRequest req, TokenCallback cb);
  /// n samples of one prompt (OpenAI's `n`, self-consistency / best-of-N): n requests, returned in sample order, whose
  /// events all go to `cb` (TokenEvent::request_id tells them apart). Sample i samples with seed sampling.seed + i.
  /// The prompt's KV is computed once and shared: a group prefill computes the prompt's whole pages up to
  /// prefix_recompute_tokens before its end, then every sample holds those pages (reference counts,
  /// common/page_allocator.h) and computes only the rest itself. Without shareable pages (hybrid models, or a prompt
  /// shorter than a page plus prefix_recompute_tokens) the samples are n independent requests; a backend that keeps
  /// per-sequence state elsewhere learns of each sample (AttentionBackend::on_fork). Each sample counts against max_num_seqs. abort() of one sample ends it alone.
  /// Throws as submit(), and for n < 1 or n > max_num_seqs.
  std::vector<uint64_t> submit_samples(GenerateRequest req, int n, TokenCallback cb);
  /// Ends a queued or running request with FinishReason::Abort and frees its pages. Unknown ids are ignored.
  void abort(uint64_t request_id);
  /// Runs one scheduling step + forward. Returns false when there was nothing to do.
  bool step();
  /// Steps until no request is queued or running.
  void run_until_idle();
  bool idle() const { return running_.empty() && waiting_.empty(); }

  /// Timing hooks (nullptr = none); not owned.
  void set_observer(EngineObserver* obs) { observer_ = obs; }
  EngineStats stats() const;
  const EngineOptions& options() const { return opt_; }
  const KvCache& kv_cache() const { return *cache_; }
  const PageAllocator& pages() const { return alloc_; }
  /// The backend the engine asks for on_release / take_failures / droppable_range: by default the one it attends
  /// with. An engine over an external forward pass whose attention has per-sequence state (the GPU path's
  /// GpuSparseController) registers it here; not owned, must outlive the engine's steps. nullptr restores the default.
  void set_attention_hooks(AttentionBackend* hooks) {
    hooks_ = hooks != nullptr ? hooks : attention_.get();
    hooks_->set_page_allocator(&alloc_);
  }
  AttentionBackend& attention() { return *hooks_; }
  /// The recurrent-state pool of a hybrid model (nullptr for dense models).
  const GdnStatePool* gdn_states() const { return states_.get(); }

 private:
  struct Seq {
    uint64_t id;
    GenerateRequest req;
    TokenCallback cb;
    std::mt19937_64 rng;
    std::vector<int32_t> tokens;  // prompt + generated
    int num_computed = 0;         // tokens whose KV is in the cache
    int generated = 0;
    int reserved_pages = 0;       // pages of its own it may take (its reservation; a sample: after the shared ones)
    int context_pages = 0;        // its full context, counted against max_context_pages
    int state_slot = -1;          // GdnStatePool slot while running (hybrid models), else -1
    // A sample group's shared prefill (submit_samples): computes prefill_only prompt tokens, samples nothing, then
    // hands its pages to `samples` and leaves. -1 for a request.
    int prefill_only = -1;
    std::vector<std::unique_ptr<Seq>> samples;
    std::chrono::steady_clock::time_point arrival, last_token;
  };
  void finish(Seq& s, FinishReason r, const std::string& error = "");
  bool admit_waiting();
  void check_request(const GenerateRequest& req) const;  // submit()'s validation
  std::unique_ptr<Seq> make_seq(const GenerateRequest& req, const TokenCallback& cb, uint64_t seed);
  void fork_group(Seq& group);  // a group prefill is done: its samples start from its pages

  const Model* model_ = nullptr;  // the CPU model, or
  ForwardFn forward_;              // an external forward pass, or
  ForwardSampleFn forward_sample_;  // one that samples too
  ModelConfig cfg_;
  // model_.config().attention_view(): what the KV cache and the backend see (heap: backends keep a reference).
  std::unique_ptr<const ModelConfig> attn_cfg_;
  EngineOptions opt_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<AttentionBackend> attention_;
  AttentionBackend* hooks_ = nullptr;  // attention_, or the external forward pass's (set_attention_hooks)
  PageAllocator alloc_;
  std::unique_ptr<GdnStatePool> states_;  // hybrid models on the CPU model only
  std::vector<int> free_state_slots_;      // hybrid models behind an external forward pass: free GDN state slot ids
  uint64_t next_id_ = 1;
  int reserved_pages_ = 0;  // pages promised to running sequences but not yet allocated
  int context_pages_ = 0;   // full-context pages of the running sequences (bounded by max_context_pages)
  int group_slots_ = 0;     // running-batch slots promised to the samples of running group prefills
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::map<uint64_t, std::unique_ptr<Seq>> running_;  // ordered by id = arrival order
  EngineStats stats_;
  EngineObserver* observer_ = nullptr;
};

}  // namespace spade

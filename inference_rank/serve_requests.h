// inference_rank --serve, the request side (inference_rank/serve.h): what a routed GenerateRequest is checked
// against (parse_request), and the table of the requests in flight (RequestTable): intake (parse, submit its samples
// to the engine, the per-request sparse options), cancellation, and the GenerateChunks each sample streams back.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/proto/coordinator.pb.h"
#include "common/tokenizer.h"
#include "inference_rank/engine.h"

namespace spade {

/// What a GenerateRequest is checked against before it reaches the engine.
struct IntakeLimits {
  int vocab_size = 0;          // token ids must be in [0, vocab_size)
  int max_model_len = 0;       // prompt + max_tokens, in tokens
  bool on_gpu = false;         // the GPU path: a request's token_budget must equal the rank's
  int rank_token_budget = 0;   // the rank's --token-budget, in tokens
  bool cpu_backend = false;    // the CPU SparseAttention takes per-request budgets up to rank_token_budget
};

/// A GenerateRequest as the engine and the sparse backend take it.
struct IntakeRequest {
  GenerateRequest engine;
  bool force_dense = false;
  int sparse_threshold = 0;  // 0: the rank's
  int token_budget = 0;      // 0: the rank's
  int samples = 1;           // GenerateRequest.n (0 and 1: one)
  bool has_sparse_options() const { return force_dense || sparse_threshold > 0 || token_budget > 0; }
};

/// Checks every field of `req` (in the proto's unsigned types, before any narrowing) and builds the engine request.
/// Throws spade::Error naming the field. What Engine::submit checks itself (empty prompt, sampling ranges, prompt +
/// max_tokens over the context, the KV pool) it still checks, before queuing.
IntakeRequest parse_request(const proto::GenerateRequest& req, const IntakeLimits& lim, const Tokenizer& tok,
                            const GenerationConfig& gen);

/// The requests in flight on one inference rank: coordinator request id -> its samples (engine ids, in index order),
/// each with its streaming decoder. Main thread only (the engine's callbacks run inside Engine::step / abort).
class RequestTable {
 public:
  /// Applies a request's sparse options (parse_request) to one of its samples (engine id); throws spade::Error when
  /// the sparse backend refuses them.
  using ApplyOptions = std::function<void(uint64_t engine_id, const IntakeRequest& request)>;
  /// Sends one chunk back to the coordinator.
  using SendChunk = std::function<void(const proto::GenerateChunk& chunk)>;

  /// `self` prefixes every error a chunk carries; `served_by_rank` is the rank's global rank. `engine`, `tok` and
  /// `gen` must outlive the table; `limits` is copied.
  RequestTable(std::string self, uint32_t served_by_rank, Engine& engine, const Tokenizer& tok,
               const GenerationConfig& gen, const IntakeLimits& limits, ApplyOptions apply_options,
               SendChunk send_chunk);

  /// Takes one routed request: checks it (parse_request), submits its n samples (Engine::submit_samples; they share
  /// the prompt's KV, each streams its own chunks with its `index` and ends on its own) and applies its sparse
  /// options. A request that fails a check, the engine's or the backend's, is answered with one FINISH_ERROR chunk
  /// per sample ("<self>: invalid request: ..."; coord::refusal_chunks) and never runs.
  void take(const proto::GenerateRequest& req);
  /// A CancelRequest: each sample of the request (or only the one its `index` names) ends with FINISH_CANCELLED;
  /// an unknown request or index is ignored.
  void cancel(const proto::CancelRequest& c);
  /// Aborts every sample in flight (the engine ends each with FINISH_CANCELLED at its next step).
  void abort_all();
  /// How many samples are in flight.
  size_t size() const { return active_.size(); }
  /// Calls `f(engine_id, sparse_threshold, token_budget)` for each sample in flight, with its request's own sparse
  /// options (0: the rank's), e.g. to keep them dense on a re-paired link.
  void for_each_sample(const std::function<void(uint64_t, int, int)>& f) const;

 private:
  struct Sample {
    uint64_t request_id = 0;   // the coordinator's id
    uint32_t index = 0;        // the sample of that request (GenerateChunk.index)
    StreamingDecoder decoder;
    bool silent = false;       // withdrawn before its first step (its rejection is the answer): no chunk of its own
    int sparse_threshold = 0;  // the request's own sparse options (0: the rank's), kept for a re-pairing
    int token_budget = 0;
  };
  void reject(const proto::GenerateRequest& req, const std::string& why);
  void on_token(uint64_t rid, const TokenEvent& ev);

  std::string self_;
  uint32_t served_by_rank_;
  Engine& engine_;
  const Tokenizer& tok_;
  const GenerationConfig& gen_;
  IntakeLimits limits_;
  ApplyOptions apply_options_;
  SendChunk send_chunk_;
  std::map<uint64_t, Sample> active_;                 // engine id -> sample
  std::map<uint64_t, std::vector<uint64_t>> by_rid_;  // coordinator request id -> its samples' engine ids, by index
};

}  // namespace spade

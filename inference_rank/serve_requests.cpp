#include "inference_rank/serve_requests.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/sampling.h"
#include "coordinator/client.h"

namespace spade {
namespace {

proto::FinishReason to_proto(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return proto::FINISH_STOP;
    case FinishReason::Length: return proto::FINISH_LENGTH;
    case FinishReason::Abort: return proto::FINISH_CANCELLED;
    case FinishReason::Error: return proto::FINISH_ERROR;
    case FinishReason::None: break;
  }
  return proto::FINISH_NONE;
}

}  // namespace

IntakeRequest parse_request(const proto::GenerateRequest& req, const IntakeLimits& lim, const Tokenizer& tok,
                            const GenerationConfig& gen) {
  IntakeRequest out;
  GenerateRequest& g = out.engine;
  const auto vocab = static_cast<uint32_t>(lim.vocab_size);
  if (req.has_prompt_ids()) {
    SPADE_CHECK(static_cast<int64_t>(req.prompt_ids().ids_size()) <= lim.max_model_len,
                "This model's maximum context length is {} tokens and your request has {} prompt tokens",
                lim.max_model_len, req.prompt_ids().ids_size());
    for (uint32_t id : req.prompt_ids().ids()) {
      SPADE_CHECK(id < vocab, "prompt token id {} is outside the vocabulary [0, {})", id, vocab);
      g.prompt_ids.push_back(static_cast<int32_t>(id));
    }
  } else if (req.text().empty()) {
    SPADE_CHECK(gen.bos_token_id >= 0 || tok.bos_id(), "empty prompt and the model defines no BOS token");
    g.prompt_ids = {tok.bos_id() ? *tok.bos_id() : gen.bos_token_id};
  } else {
    g.prompt_ids = tok.encode(req.text(), true);
  }
  SPADE_CHECK(req.max_tokens() > 0, "max_tokens must be positive, got {}", req.max_tokens());
  const int64_t total = static_cast<int64_t>(g.prompt_ids.size()) + req.max_tokens();
  if (total > lim.max_model_len)
    fail("This model's maximum context length is {} tokens and your request has {} tokens ({} in the prompt, {} to "
         "generate)",
         lim.max_model_len, total, g.prompt_ids.size(), req.max_tokens());
  g.max_tokens = static_cast<int>(req.max_tokens());
  g.ignore_eos = req.ignore_eos();
  const proto::SamplingParams& sp = req.sampling();
  g.sampling.temperature = sp.temperature();
  g.sampling.top_p = sp.top_p() == 0.f ? 1.f : sp.top_p();  // 0 = disabled; negatives and NaN fail validate()
  SPADE_CHECK(sp.top_k() <= vocab, "top_k {} is above the vocabulary size {} (0 = disabled)", sp.top_k(), vocab);
  g.sampling.top_k = static_cast<int>(sp.top_k());
  g.sampling.seed = sp.seed();
  validate(g.sampling);
  SPADE_CHECK(req.top_logprobs() <= static_cast<uint32_t>(kMaxTopLogprobs), "top_logprobs must be in [0, {}], got {}",
              kMaxTopLogprobs, req.top_logprobs());
  SPADE_CHECK(req.logprobs() || req.top_logprobs() == 0, "top_logprobs {} needs logprobs set", req.top_logprobs());
  g.logprobs = req.logprobs() ? static_cast<int>(req.top_logprobs()) : -1;
  g.stop_token_ids = gen.eos_token_ids;
  for (uint32_t s : sp.stop_token_ids()) {
    SPADE_CHECK(s < vocab, "stop token id {} is outside the vocabulary [0, {})", s, vocab);
    g.stop_token_ids.push_back(static_cast<int>(s));
  }
  // Samples: the engine also refuses n above its max_num_seqs (Engine::submit_samples).
  SPADE_CHECK(req.n() <= coord::kMaxSamplesPerRequest, "n = {} samples is above the limit of {} per request", req.n(),
              coord::kMaxSamplesPerRequest);
  out.samples = std::max<int>(1, static_cast<int>(req.n()));
  // Sparse fields: the per-request ones are bounded; the rank-level ones are refused by name, not ignored.
  const proto::SparseParams& p = req.sparse();
  const std::pair<const char*, bool> rank_level[] = {
      {"enabled", p.enabled()},
      {"sink_tokens (--sink-tokens)", p.sink_tokens() != 0},
      {"local_window (--local-window)", p.local_window() != 0},
      {"layers_per_pack (--layers-per-pack)", p.layers_per_pack() != 0},
      {"sparse_start_step", p.sparse_start_step() != 0},
      {"query_window (--query-window)", p.query_window() != 0},
      {"ridge_lambda (--ridge-eps)", p.ridge_lambda() != 0.f}};
  for (const auto& [name, set] : rank_level)
    SPADE_CHECK(!set, "sparse.{} is a setting of the rank, not of a request (leave it unset)", name);
  SPADE_CHECK(p.sparse_threshold() <= static_cast<uint32_t>(lim.max_model_len),
              "spade.sparse_threshold {} is above this model's maximum context length {}", p.sparse_threshold(),
              lim.max_model_len);
  const uint32_t budget = p.token_budget();
  const auto rank_budget = static_cast<uint32_t>(lim.rank_token_budget);
  if (lim.on_gpu && budget > 0 && budget != rank_budget)
    fail("spade.token_budget {}: on the GPU path the budget is the rank's ({})", budget, rank_budget);
  if (lim.cpu_backend && budget > rank_budget)
    fail("spade.token_budget {} is above this rank's --token-budget {}", budget, rank_budget);
  out.force_dense = p.force_dense();
  out.sparse_threshold = static_cast<int>(p.sparse_threshold());
  out.token_budget = static_cast<int>(budget);
  return out;
}

RequestTable::RequestTable(std::string self, uint32_t served_by_rank, Engine& engine, const Tokenizer& tok,
                           const GenerationConfig& gen, const IntakeLimits& limits, ApplyOptions apply_options,
                           SendChunk send_chunk)
    : self_(std::move(self)),
      served_by_rank_(served_by_rank),
      engine_(engine),
      tok_(tok),
      gen_(gen),
      limits_(limits),
      apply_options_(std::move(apply_options)),
      send_chunk_(std::move(send_chunk)) {}

void RequestTable::reject(const proto::GenerateRequest& req, const std::string& why) {
  for (uint32_t i = 0; i < coord::refusal_chunks(req); ++i) {  // one final chunk per sample
    proto::GenerateChunk c;
    c.set_request_id(req.request_id());
    c.set_index(i);
    c.set_finished(true);
    c.set_finish_reason(proto::FINISH_ERROR);
    c.set_error(fmt::format("{}: {}", self_, why));
    c.set_served_by_rank(served_by_rank_);
    send_chunk_(c);
  }
}

void RequestTable::take(const proto::GenerateRequest& req) {
  const uint64_t rid = req.request_id();
  IntakeRequest r;
  try {
    r = parse_request(req, limits_, tok_, gen_);  // every field, before the engine sees the request
  } catch (const Error& e) {
    reject(req, fmt::format("invalid request: {}", e.what()));  // the API answers these with 400
    return;
  }
  // n samples (engine ids in index order) share the prompt's KV; each streams its own chunks, with its own decoder,
  // and ends on its own (an error in one ends that sample alone).
  std::vector<uint64_t> eids;
  try {
    eids = engine_.submit_samples(std::move(r.engine), r.samples,
                                  [this, rid](const TokenEvent& ev) { on_token(rid, ev); });
  } catch (const Error& e) {
    reject(req, fmt::format("invalid request: {}", e.what()));  // nothing was queued
    return;
  }
  for (size_t i = 0; i < eids.size(); ++i) {
    Sample a{rid, static_cast<uint32_t>(i), StreamingDecoder(tok_, true)};
    a.sparse_threshold = r.sparse_threshold;
    a.token_budget = r.token_budget;
    active_.emplace(eids[i], std::move(a));
  }
  by_rid_[rid] = eids;
  // The options were checked by parse_request and apply to every sample; should a backend still refuse them, the
  // request is withdrawn before its first step (engine.abort of each sample, silently) and only the rejection
  // answers it.
  try {
    for (uint64_t eid : eids) apply_options_(eid, r);
  } catch (const Error& e) {
    for (uint64_t eid : eids) active_.at(eid).silent = true;
    for (uint64_t eid : eids) engine_.abort(eid);
    reject(req, fmt::format("invalid request: {}", e.what()));
  }
}

void RequestTable::on_token(uint64_t rid, const TokenEvent& ev) {
  auto it = active_.find(ev.request_id);
  const bool silent = it != active_.end() && it->second.silent;
  if (!silent) {
    proto::GenerateChunk c;
    c.set_request_id(rid);
    c.set_served_by_rank(served_by_rank_);
    if (it != active_.end()) c.set_index(it->second.index);
    if (ev.token >= 0 && ev.reason != FinishReason::Stop) {
      c.add_token_ids(static_cast<uint32_t>(ev.token));
      if (it != active_.end()) c.set_text(it->second.decoder.push(ev.token));
      if (ev.logprobs) {  // aligned with token_ids
        proto::TokenLogprobs* lp = c.add_logprobs();
        lp->set_logprob(ev.logprobs->logprob);
        for (int32_t id : ev.logprobs->top_ids) lp->add_top_ids(static_cast<uint32_t>(id));
        for (float v : ev.logprobs->top_logprobs) lp->add_top_logprobs(v);
      }
    }
    if (ev.finished) {
      if (it != active_.end()) c.set_text(c.text() + it->second.decoder.finish());
      c.set_finished(true);
      c.set_finish_reason(to_proto(ev.reason));
      if (!ev.error.empty()) c.set_error(fmt::format("{}: {}", self_, ev.error));
    }
    send_chunk_(c);
  }
  if (ev.finished && it != active_.end()) {
    const uint64_t req_id = it->second.request_id;
    active_.erase(it);
    auto r_it = by_rid_.find(req_id);
    if (r_it != by_rid_.end() &&
        std::none_of(r_it->second.begin(), r_it->second.end(), [&](uint64_t e) { return active_.count(e) > 0; }))
      by_rid_.erase(r_it);  // its last sample ended
  }
}

void RequestTable::cancel(const proto::CancelRequest& c) {
  auto it = by_rid_.find(c.request_id());
  if (it == by_rid_.end()) return;
  if (c.has_index()) {
    if (c.index() >= it->second.size()) return;
    spdlog::info("{}: cancelling sample {} of request {}: {}", self_, c.index(), c.request_id(), c.reason());
    engine_.abort(it->second[c.index()]);  // a sample that finished already: ignored
    return;
  }
  spdlog::info("{}: cancelling request {}: {}", self_, c.request_id(), c.reason());
  const std::vector<uint64_t> samples = it->second;  // each abort may end the request's entry
  for (uint64_t eid : samples) engine_.abort(eid);
}

void RequestTable::abort_all() {
  std::vector<uint64_t> ids;
  for (const auto& [eid, a] : active_) ids.push_back(eid);
  for (uint64_t eid : ids) engine_.abort(eid);
}

void RequestTable::for_each_sample(const std::function<void(uint64_t, int, int)>& f) const {
  for (const auto& [eid, a] : active_) f(eid, a.sparse_threshold, a.token_budget);
}

}  // namespace spade

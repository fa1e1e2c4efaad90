#include "inference_rank/engine.h"

#include <algorithm>

#include "common/error.h"

namespace spade {
namespace {

EngineOptions normalise(EngineOptions o, const ModelConfig& cfg) {
  SPADE_CHECK(o.page_size > 0, "engine: page_size must be positive, got {}", o.page_size);
  SPADE_CHECK(o.max_num_seqs > 0, "engine: max_num_seqs must be positive, got {}", o.max_num_seqs);
  SPADE_CHECK(o.max_num_batched_tokens > 0, "engine: max_num_batched_tokens must be positive, got {}",
              o.max_num_batched_tokens);
  SPADE_CHECK(o.max_context_pages >= 0, "engine: max_context_pages must be >= 0, got {}", o.max_context_pages);
  if (o.max_model_len <= 0) o.max_model_len = cfg.max_position_embeddings;
  SPADE_CHECK(o.max_model_len <= cfg.max_position_embeddings,
              "engine: max_model_len {} exceeds the model's max_position_embeddings {}", o.max_model_len,
              cfg.max_position_embeddings);
  if (o.num_pages <= 0) {
    const int64_t full = static_cast<int64_t>(o.max_num_seqs) * ((o.max_model_len + o.page_size - 1) / o.page_size);
    const size_t page_bytes = KvCache::page_bytes(cfg, o.page_size);  // 0 without attention layers
    const int64_t budget = page_bytes == 0 ? full : static_cast<int64_t>(o.kv_cache_bytes / page_bytes);
    o.num_pages = static_cast<int>(std::max<int64_t>(1, std::min(full, budget)));
  }
  if (o.max_context_pages == 0) o.max_context_pages = o.num_pages;
  SPADE_CHECK(!o.enable_prefix_caching || !cfg.is_hybrid(),
              "engine: prefix caching is not supported for hybrid (linear-attention) models: their recurrent state is "
              "not paged; turn it off (--no-enable-prefix-caching)");
  SPADE_CHECK(o.prefix_recompute_tokens >= 1, "engine: prefix_recompute_tokens must be >= 1, got {}",
              o.prefix_recompute_tokens);
  return o;
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::None: return "none";
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
    case FinishReason::Error: return "error";
  }
  return "?";
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

Engine::Engine(const Model& model, EngineOptions opt, const BackendFactory& make_attention)
    : model_(&model),
      cfg_(model.config()),
      attn_cfg_(std::make_unique<const ModelConfig>(model.config().attention_view())),
      opt_(normalise(opt, model.config())),
      cache_(std::make_unique<KvCache>(*attn_cfg_, opt_.num_pages, opt_.page_size)),
      attention_(make_attention ? make_attention(*attn_cfg_, *cache_)
                                : std::make_unique<DensePagedAttention>(*attn_cfg_, *cache_)),
      hooks_(attention_.get()),
      alloc_(opt_.num_pages, opt_.page_size, opt_.enable_prefix_caching) {
  if (model.config().is_hybrid()) states_ = std::make_unique<GdnStatePool>(model.config(), opt_.max_num_seqs);
  attention_->set_page_allocator(&alloc_);
}

Engine::Engine(const ModelConfig& cfg, EngineOptions opt, ForwardFn forward)
    : forward_(std::move(forward)),
      cfg_(cfg),
      attn_cfg_(std::make_unique<const ModelConfig>(cfg.attention_view())),
      opt_(normalise(opt, cfg)),
      // The host KvCache is never written on this path (its memory is not touched, so it costs address space only);
      // the engine keeps it so kv_cache() / backends have the same shape on both paths.
      cache_(std::make_unique<KvCache>(*attn_cfg_, opt_.num_pages, opt_.page_size)),
      attention_(std::make_unique<DensePagedAttention>(*attn_cfg_, *cache_)),
      hooks_(attention_.get()),
      alloc_(opt_.num_pages, opt_.page_size, opt_.enable_prefix_caching) {
  SPADE_CHECK(forward_ != nullptr, "Engine: no forward pass given");
  // Hybrid models: the external forward pass holds the GDN states; the engine hands out their slot ids.
  if (cfg.is_hybrid())
    for (int i = opt_.max_num_seqs - 1; i >= 0; --i) free_state_slots_.push_back(i);
}

Engine::Engine(const ModelConfig& cfg, EngineOptions opt, ForwardSampleFn forward)
    : Engine(cfg, opt, ForwardFn([](const ForwardBatch&, std::vector<float>&) {})) {
  forward_ = nullptr;
  forward_sample_ = std::move(forward);
  SPADE_CHECK(forward_sample_ != nullptr, "Engine: no forward pass given");
}

void Engine::check_request(const GenerateRequest& req) const {
  const ModelConfig& cfg = cfg_;
  SPADE_CHECK(!req.prompt_ids.empty(), "request has an empty prompt");
  for (int32_t id : req.prompt_ids)
    SPADE_CHECK(id >= 0 && id < cfg.vocab_size, "prompt token id {} is outside the vocabulary [0, {})", id,
                cfg.vocab_size);
  SPADE_CHECK(req.max_tokens > 0, "max_tokens must be positive, got {}", req.max_tokens);
  validate(req.sampling);
  SPADE_CHECK(req.logprobs >= -1 && req.logprobs <= kMaxTopLogprobs,
              "logprobs must be -1 (none) or in [0, {}] top alternatives, got {}", kMaxTopLogprobs, req.logprobs);
  if (!req.forced_tokens.empty()) {
    SPADE_CHECK(!forward_sample_,
                "teacher forcing (forced_tokens) needs the host sampler: this engine samples on its device (the GPU "
                "path's --host-sampling)");
    SPADE_CHECK(static_cast<int>(req.forced_tokens.size()) >= req.max_tokens,
                "{} forced tokens for max_tokens {}: teacher forcing needs one per generated token",
                req.forced_tokens.size(), req.max_tokens);
    for (int32_t id : req.forced_tokens)
      SPADE_CHECK(id >= 0 && id < cfg.vocab_size, "forced token id {} is outside the vocabulary [0, {})", id,
                  cfg.vocab_size);
  }
  const int64_t total = static_cast<int64_t>(req.prompt_ids.size()) + req.max_tokens;
  if (total > opt_.max_model_len)
    fail("This model's maximum context length is {} tokens and your request has {} tokens ({} in the prompt, {} to "
         "generate)",
         opt_.max_model_len, total, req.prompt_ids.size(), req.max_tokens);
  const int pages = alloc_.pages_for(static_cast<int>(total));
  SPADE_CHECK(pages <= alloc_.num_pages(), "request needs {} KV pages but the pool has {} in all", pages,
              alloc_.num_pages());
  SPADE_CHECK(pages <= opt_.max_context_pages,
              "request needs {} KV pages but its cache rank holds {} in all (max_context_pages)", pages,
              opt_.max_context_pages);
}

std::unique_ptr<Engine::Seq> Engine::make_seq(const GenerateRequest& req, const TokenCallback& cb, uint64_t seed) {
  auto s = std::make_unique<Seq>();
  s->id = next_id_++;
  s->tokens = req.prompt_ids;
  s->req = req;
  s->req.sampling.seed = seed;
  s->rng.seed(seed);
  s->cb = cb;
  s->arrival = std::chrono::steady_clock::now();
  return s;
}

uint64_t Engine::submit(GenerateRequest req, TokenCallback cb) {
  check_request(req);
  auto s = make_seq(req, cb, req.sampling.seed);
  const uint64_t id = s->id;
  waiting_.push_back(std::move(s));
  return id;
}

std::vector<uint64_t> Engine::submit_samples(GenerateRequest req, int n, TokenCallback cb) {
  SPADE_CHECK(n >= 1 && n <= opt_.max_num_seqs, "n must be in [1, {}] (the rank's max_num_seqs), got {}",
              opt_.max_num_seqs, n);
  check_request(req);
  const int prompt = static_cast<int>(req.prompt_ids.size()), page = opt_.page_size;
  const int shared = std::max(0, prompt - opt_.prefix_recompute_tokens) / page * page;
  std::vector<uint64_t> ids;
  if (n == 1 || shared < page || cfg_.is_hybrid()) {
    for (int i = 0; i < n; ++i) {
      auto s = make_seq(req, cb, req.sampling.seed + static_cast<uint64_t>(i));
      ids.push_back(s->id);
      waiting_.push_back(std::move(s));
    }
    return ids;
  }
  const int full = alloc_.pages_for(prompt + req.max_tokens), shared_pages = shared / page;
  const int64_t need = shared_pages + static_cast<int64_t>(n) * (full - shared_pages);
  SPADE_CHECK(need <= alloc_.num_pages(), "request with n = {} needs {} KV pages but the pool has {} in all", n, need,
              alloc_.num_pages());
  SPADE_CHECK(static_cast<int64_t>(n) * full <= opt_.max_context_pages,
              "request with n = {} needs {} KV pages of full contexts but its cache rank holds {} in all "
              "(max_context_pages)",
              n, static_cast<int64_t>(n) * full, opt_.max_context_pages);
  auto group = make_seq(req, nullptr, req.sampling.seed);
  group->prefill_only = shared;
  for (int i = 0; i < n; ++i) {
    group->samples.push_back(make_seq(req, cb, req.sampling.seed + static_cast<uint64_t>(i)));
    ids.push_back(group->samples.back()->id);
  }
  waiting_.push_back(std::move(group));
  return ids;
}

void Engine::abort(uint64_t request_id) {
  auto end_waiting = [&](std::unique_ptr<Seq> s) {
    if (observer_)
      observer_->on_finished(FinishReason::Abort, seconds_since(s->arrival), static_cast<int>(s->req.prompt_ids.size()),
                             0);
    if (s->cb) s->cb(TokenEvent{s->id, -1, true, FinishReason::Abort, "", std::nullopt});
  };
  // One sample of a group that has not forked yet: it leaves the group; the group goes when no sample is left.
  auto leave_group = [&](Seq& g, bool running) -> bool {
    for (auto it = g.samples.begin(); it != g.samples.end(); ++it) {
      if ((*it)->id != request_id) continue;
      auto sample = std::move(*it);
      g.samples.erase(it);
      if (running) {
        const int full = alloc_.pages_for(static_cast<int>(g.req.prompt_ids.size()) + g.req.max_tokens);
        const int own = full - g.prefill_only / opt_.page_size;
        g.reserved_pages -= own;
        reserved_pages_ -= own;
        g.context_pages -= full;
        context_pages_ -= full;
        if (!g.samples.empty()) --group_slots_;
      }
      end_waiting(std::move(sample));
      return true;
    }
    return false;
  };
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->id == request_id) {
      auto s = std::move(*it);
      waiting_.erase(it);
      end_waiting(std::move(s));
      return;
    }
    if (leave_group(**it, false)) {
      if ((*it)->samples.empty()) waiting_.erase(it);
      return;
    }
  }
  auto it = running_.find(request_id);
  if (it != running_.end()) {
    finish(*it->second, FinishReason::Abort);
    running_.erase(it);
    return;
  }
  for (auto g = running_.begin(); g != running_.end(); ++g) {
    if (g->second->prefill_only < 0 || !leave_group(*g->second, true)) continue;
    if (g->second->samples.empty()) {
      finish(*g->second, FinishReason::Abort);
      running_.erase(g);
    }
    return;
  }
}

void Engine::finish(Seq& s, FinishReason r, const std::string& error) {
  reserved_pages_ -= s.reserved_pages - static_cast<int>(alloc_.block_table(s.id).size());
  context_pages_ -= s.context_pages;
  alloc_.release(s.id);
  if (s.state_slot >= 0) {
    if (states_) {
      states_->release(s.state_slot);
    } else {
      free_state_slots_.push_back(s.state_slot);
    }
    s.state_slot = -1;
  }
  hooks_->on_release(s.id);
  if (s.prefill_only >= 0) {  // a group prefill that ended before its samples started: they end with it
    if (!s.samples.empty()) group_slots_ -= static_cast<int>(s.samples.size()) - 1;
    for (auto& sample : s.samples) {
      if (observer_)
        observer_->on_finished(r, seconds_since(sample->arrival), static_cast<int>(sample->req.prompt_ids.size()), 0);
      if (sample->cb) sample->cb(TokenEvent{sample->id, -1, true, r, error, std::nullopt});
    }
    s.samples.clear();
    return;
  }
  if (observer_)
    observer_->on_finished(r, seconds_since(s.arrival), static_cast<int>(s.req.prompt_ids.size()), s.generated);
  if (r == FinishReason::Abort || r == FinishReason::Error) {
    if (s.cb) s.cb(TokenEvent{s.id, -1, true, r, error, std::nullopt});
  }
}

void Engine::fork_group(Seq& g) {
  const int full = alloc_.pages_for(static_cast<int>(g.req.prompt_ids.size()) + g.req.max_tokens);
  alloc_.cache_prompt(g.id, g.req.prompt_ids.data(), g.prefill_only);
  SPADE_CHECK(static_cast<int>(alloc_.block_table(g.id).size()) * opt_.page_size == g.prefill_only,
              "engine: group prefill {} holds {} pages for {} tokens", g.id, alloc_.block_table(g.id).size(),
              g.prefill_only);
  // The group's remaining reservation and its context pages pass to the samples (each: `full` pages of context, of
  // which the shared ones are taken already).
  if (!g.samples.empty()) group_slots_ -= static_cast<int>(g.samples.size()) - 1;
  for (auto& sp : g.samples) {
    Seq& c = *sp;
    alloc_.fork(g.id, c.id);
    hooks_->on_fork(g.id, c.id);
    c.num_computed = g.prefill_only;
    c.reserved_pages = full;
    c.context_pages = full;
    const uint64_t id = c.id;
    running_.emplace(id, std::move(sp));
  }
  g.samples.clear();
  reserved_pages_ -= g.reserved_pages - static_cast<int>(alloc_.block_table(g.id).size());
  context_pages_ -= g.context_pages;
  alloc_.release(g.id);
  hooks_->on_release(g.id);
}

bool Engine::admit_waiting() {
  bool any = false;
  while (!waiting_.empty()) {
    Seq& s = *waiting_.front();
    const bool group = s.prefill_only >= 0;
    const int slots = group ? static_cast<int>(s.samples.size()) : 1;  // a group admits all its samples at once
    if (static_cast<int>(running_.size()) + group_slots_ + slots > opt_.max_num_seqs) break;
    const int prompt = static_cast<int>(s.req.prompt_ids.size());
    const int full = alloc_.pages_for(prompt + s.req.max_tokens);
    const int shared_pages = group ? s.prefill_only / opt_.page_size : 0;
    const int need = group ? shared_pages + slots * (full - shared_pages) : full;
    const int context = slots * full;
    if (alloc_.num_free_pages() - reserved_pages_ < need) break;  // FIFO: wait for memory
    if (context_pages_ + context > opt_.max_context_pages) break;  // the cache rank's pool (full contexts)
    // Hybrid: one recurrent-state slot per running sequence; the pool has max_num_seqs slots, so one is free here
    // (hybrid models have no groups).
    if (states_) {
      s.state_slot = states_->allocate();
    } else if (cfg_.is_hybrid()) {
      s.state_slot = free_state_slots_.back();
      free_state_slots_.pop_back();
    }
    alloc_.admit(s.id);
    // Prefix cache: reuse the KV of the prompt's longest cached prefix (whole pages; the last
    // prefix_recompute_tokens prompt tokens are always computed; a group prefill at most its shared part).
    int max_reuse = group ? s.prefill_only : prompt - opt_.prefix_recompute_tokens;
    if (alloc_.prefix_caching()) {  // the backend may serve fewer of the cached pages (AttentionBackend)
      const std::vector<int32_t> cached = alloc_.peek_prefix(s.req.prompt_ids.data(), prompt, max_reuse);
      if (!cached.empty()) max_reuse = std::min(max_reuse, hooks_->reusable_prefix_tokens(s.id, cached));
    }
    s.num_computed = alloc_.match_prefix(s.id, s.req.prompt_ids.data(), prompt, max_reuse);
    s.reserved_pages = need;
    s.context_pages = context;
    reserved_pages_ += need - static_cast<int>(alloc_.block_table(s.id).size());
    context_pages_ += context;
    group_slots_ += slots - 1;
    if (observer_)
      for (int i = 0; i < slots; ++i) observer_->on_scheduled(seconds_since(s.arrival));
    const uint64_t id = s.id;
    running_.emplace(id, std::move(waiting_.front()));
    waiting_.pop_front();
    if (group && s.num_computed >= s.prefill_only) {  // the whole shared part came from the prefix cache
      fork_group(*running_.at(id));
      running_.erase(id);
    }
    any = true;
  }
  return any;
}

bool Engine::step() {
  admit_waiting();
  if (running_.empty()) return false;

  ForwardBatch batch;
  std::vector<Seq*> in_batch;     // sequences in the batch, in batch order
  std::vector<int> logit_owner;   // for each logit row: index into in_batch
  std::vector<uint64_t> forks;    // group prefills whose shared part this step completes
  int budget = opt_.max_num_batched_tokens;
  batch.cu_q_lens.push_back(0);
  // Decode tokens first (one each), then prefill chunks, so running requests are never starved by long prompts.
  std::vector<Seq*> order;
  for (auto& [id, s] : running_)
    if (s->num_computed >= static_cast<int>(s->req.prompt_ids.size())) order.push_back(s.get());
  for (auto& [id, s] : running_)
    if (s->num_computed < static_cast<int>(s->req.prompt_ids.size())) order.push_back(s.get());
  for (Seq* s : order) {
    if (budget <= 0) break;
    // >= 1: a request computes its prompt (and then one token per step), a group prefill its shared part.
    const int pending = (s->prefill_only >= 0 ? s->prefill_only : static_cast<int>(s->tokens.size())) - s->num_computed;
    const int n = std::min(pending, budget);
    const int old_pages = static_cast<int>(alloc_.block_table(s->id).size());
    SPADE_CHECK(alloc_.append(s->id, n), "engine: KV pool exhausted despite reservation (sequence {})", s->id);
    reserved_pages_ -= static_cast<int>(alloc_.block_table(s->id).size()) - old_pages;
    budget -= n;
    for (int i = 0; i < n; ++i) {
      batch.tokens.push_back(s->tokens[s->num_computed + i]);
      batch.positions.push_back(s->num_computed + i);
    }
    batch.cu_q_lens.push_back(batch.cu_q_lens.back() + n);
    batch.seq_lens.push_back(s->num_computed + n);
    batch.seq_ids.push_back(s->id);
    if (cfg_.is_hybrid()) batch.state_slots.push_back(s->state_slot);
    s->num_computed += n;
    if (s->prefill_only >= 0) {
      if (s->num_computed == s->prefill_only) forks.push_back(s->id);
    } else if (s->num_computed == static_cast<int>(s->tokens.size())) {  // last token known: sample the next one
      batch.logit_rows.push_back(batch.cu_q_lens.back() - 1);
      logit_owner.push_back(static_cast<int>(in_batch.size()));
    }
    in_batch.push_back(s);
  }
  int max_pages = 0;
  for (Seq* s : in_batch) max_pages = std::max(max_pages, static_cast<int>(alloc_.block_table(s->id).size()));
  batch.max_pages = max_pages;
  batch.block_table.assign(static_cast<size_t>(in_batch.size()) * max_pages, -1);
  for (size_t b = 0; b < in_batch.size(); ++b) {
    const auto& bt = alloc_.block_table(in_batch[b]->id);
    std::copy(bt.begin(), bt.end(), batch.block_table.begin() + static_cast<long>(b) * max_pages);
  }

  std::vector<float> logits;
  std::vector<int32_t> sampled;
  std::vector<TokenLogprobs> sampled_logprobs;
  try {
    if (forward_sample_) {
      std::vector<RowSampling> rows(logit_owner.size());
      for (size_t r = 0; r < rows.size(); ++r) {
        const Seq& s = *in_batch[logit_owner[r]];
        rows[r].params = s.req.sampling;
        rows[r].step = static_cast<uint64_t>(s.generated);
        rows[r].logprobs = s.req.logprobs;
      }
      forward_sample_(batch, rows, sampled, sampled_logprobs);
      SPADE_CHECK(sampled.size() == rows.size() && sampled_logprobs.size() == rows.size(),
                  "Engine: the forward pass sampled {} tokens and {} logprob rows for {} rows", sampled.size(),
                  sampled_logprobs.size(), rows.size());
    } else if (forward_) {
      forward_(batch, logits);
    } else {
      model_->forward(batch, *attention_, logits, states_.get());
    }
  } catch (const Error& e) {  // fail every request of the batch, keep serving
    for (Seq* s : in_batch) {
      const uint64_t id = s->id;
      finish(*s, FinishReason::Error, e.what());
      running_.erase(id);
    }
    return true;
  }
  ++stats_.steps;
  const auto failures = hooks_->take_failures();
  auto failed = [&](uint64_t id) {
    for (const auto& f : failures)
      if (f.first == id) return true;
    return false;
  };
  const int vocab = cfg_.vocab_size;
  for (size_t r = 0; r < logit_owner.size(); ++r) {
    Seq& s = *in_batch[logit_owner[r]];
    if (failed(s.id)) continue;
    const bool was_prefill = s.generated == 0;
    // The prompt's KV is complete: its full pages may serve later prompts.
    if (was_prefill) alloc_.cache_prompt(s.id, s.req.prompt_ids.data(), static_cast<int>(s.req.prompt_ids.size()));
    if (was_prefill) stats_.prompt_tokens += s.req.prompt_ids.size();
    const float* row_logits = forward_sample_ ? nullptr : &logits[r * static_cast<size_t>(vocab)];
    const int tok = !s.req.forced_tokens.empty() ? s.req.forced_tokens[static_cast<size_t>(s.generated)]
                    : forward_sample_            ? sampled[r]
                                                 : sample_token(row_logits, vocab, s.req.sampling, s.rng);
    if (observer_) {
      const auto now = std::chrono::steady_clock::now();
      if (was_prefill) observer_->on_prompt_tokens(static_cast<int>(s.req.prompt_ids.size()));
      observer_->on_token(was_prefill, std::chrono::duration<double>(now - (was_prefill ? s.arrival : s.last_token)).count());
      s.last_token = now;
    }
    s.tokens.push_back(tok);
    ++s.generated;
    ++stats_.generated_tokens;
    FinishReason reason = FinishReason::None;
    const auto& stops = s.req.stop_token_ids;
    if (!s.req.ignore_eos && std::find(stops.begin(), stops.end(), tok) != stops.end()) {
      reason = FinishReason::Stop;
    } else if (s.generated >= s.req.max_tokens) {
      reason = FinishReason::Length;
    }
    TokenEvent ev{s.id, tok, reason != FinishReason::None, reason, "", std::nullopt};
    if (s.req.logprobs >= 0)  // from the very logits `tok` was sampled from
      ev.logprobs = forward_sample_ ? std::move(sampled_logprobs[r])
                                    : token_logprobs(row_logits, vocab, tok, s.req.logprobs);
    if (ev.finished) {
      const uint64_t id = s.id;
      TokenCallback cb = std::move(s.cb);
      finish(s, reason);
      running_.erase(id);
      if (cb) cb(ev);
    } else if (s.cb) {
      s.cb(ev);
    }
  }
  for (const auto& [id, why] : failures) {
    auto it = running_.find(id);
    if (it == running_.end()) continue;
    finish(*it->second, FinishReason::Error, why);
    running_.erase(it);
  }
  for (uint64_t id : forks) {  // the shared prompt pages are complete: the samples take over
    auto it = running_.find(id);
    if (it == running_.end()) continue;
    fork_group(*it->second);
    running_.erase(it);
  }
  // Sparse sequences keep only sink tokens + local window locally: free the pages in between.
  for (auto& [id, s] : running_) {
    const auto [begin, end] = hooks_->droppable_range(id, alloc_.seq_len(id));
    if (end > begin) stats_.dropped_pages += static_cast<uint64_t>(alloc_.drop_range(id, begin, end));
  }
  return true;
}

void Engine::run_until_idle() {
  while (!idle()) step();
}

EngineStats Engine::stats() const {
  EngineStats s = stats_;
  s.num_running = static_cast<int>(running_.size());
  s.num_waiting = static_cast<int>(waiting_.size());
  s.kv_cache_usage = alloc_.usage();
  s.prefix_queried_tokens = alloc_.prefix_stats().queried_tokens;
  s.prefix_hit_tokens = alloc_.prefix_stats().hit_tokens;
  return s;
}

}  // namespace spade

// The plans of GPU sparse decoding replayed on the CPU: a real Engine (n samples, prefix caching, page dropping,
// aborts at any time) drives the SparseStepPlanner as the GPU path's controller does, and every plan goes over the
// wire format (pair/gpu_plan.h) into the GPU cache rank's host bookkeeping (cache_rank/gpu_slot_book.h), sized from
// the pair hello. The book refuses any plan that does not match what it holds (a fork or retain of tokens a slot
// does not hold, a row at another position, a full pool), and once the engine is idle and the idle flush (a plan
// without rows, as the serve loop sends it) has carried the last releases, it holds the retained prefixes and
// nothing else: no slot, fork or pin leaks on either rank. The forward pass is a stand-in
// (deterministic greedy tokens, no attention): only the bookkeeping is under test here; the GPU tests
// (test_gpu_sparse.cu) run the same scripts with the real kernels.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cache_rank/gpu_slot_book.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_planner.h"
#include "pair/gpu_plan.h"
#include "tests/inference_rank/greedy_request.h"
#include "tests/small_config.h"

namespace spade {
namespace {

constexpr int kVocab = 97;
constexpr int kPage = 16;  // tokens per KV page (EngineOptions::page_size of these tests)

// The engine's hooks of GpuSparseController, without its link: straight to the planner.
class PlannerHooks : public AttentionBackend {
 public:
  explicit PlannerHooks(SparseStepPlanner& p) : p_(p) {}
  void attend(int, const ForwardBatch&, const float*, const float*, const float*, float*) override {
    ADD_FAILURE() << "an engine over an external forward pass never attends through its hooks";
  }
  void on_release(uint64_t id) override { p_.on_release(id); }
  void on_fork(uint64_t parent, uint64_t child) override { p_.on_fork(parent, child); }
  std::pair<int, int> droppable_range(uint64_t id, int len) override { return p_.droppable_range(id, len); }
  void set_page_allocator(const PageAllocator* pages) override { p_.set_page_allocator(pages); }
  int reusable_prefix_tokens(uint64_t id, const std::vector<int32_t>& pages) override {
    return p_.reusable_prefix_tokens(id, pages);
  }

 private:
  SparseStepPlanner& p_;
};

struct Replay {
  ModelConfig cfg;
  EngineOptions eo;
  GpuSparseOptions so;
  std::unique_ptr<SparseStepPlanner> planner;
  std::unique_ptr<PlannerHooks> hooks;
  std::unique_ptr<cache::GpuSlotBook> book;
  std::unique_ptr<Engine> engine;
  int64_t step = 0;
  uint64_t slot_forks = 0, retained_forks = 0;  // in the plans sent
  uint64_t flushes = 0;                         // idle flush plans sent
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, FinishReason> reasons;
  std::map<uint64_t, std::string> errors;

  // Pages of 16, 3 sequences at once, 64 tokens a step, sparse from context 100 with k 32 and R 16, prefix caching
  // with `recompute` prompt tokens always computed and the cache rank retaining up to `bound` tokens.
  Replay(int recompute, int bound) {
    cfg = test::small_cfg(2);
    cfg.vocab_size = kVocab;
    cfg.max_position_embeddings = 1024;
    eo.page_size = kPage;
    eo.num_pages = 96;
    eo.max_num_seqs = 3;
    eo.max_num_batched_tokens = 64;
    eo.max_model_len = 512;
    eo.enable_prefix_caching = true;
    eo.prefix_recompute_tokens = recompute;
    engine = std::make_unique<Engine>(cfg, eo,
                                      [this](const ForwardBatch& fb, std::vector<float>& l) { forward(fb, l); });
    pair::SparseConfig sc;
    sc.sparse_threshold = 100;
    sc.selection.token_budget = 32;
    sc.selection.local_window = 16;
    so = gpu_sparse_options(sc, engine->options(), "cache rank (replay)", bound);
    planner = std::make_unique<SparseStepPlanner>(so);
    hooks = std::make_unique<PlannerHooks>(*planner);
    const pair::GpuPairHello hello = make_gpu_pair_hello(cfg, so, engine->options());
    book = std::make_unique<cache::GpuSlotBook>(hello.num_pages, hello.page_size, hello.max_slots, 5, 4,
                                                "inference rank (replay)");
    engine->set_attention_hooks(hooks.get());
  }
  ~Replay() {
    if (engine) engine->set_attention_hooks(nullptr);
  }

  // A plan through the wire into the book.
  void send(const pair::GpuStepPlan& plan) {
    const std::vector<uint8_t> bytes = pair::encode_gpu_plan(plan);
    for (const pair::GpuPlanFork& f : plan.forks)
      ++((f.flags & pair::kForkFromRetained) != 0 ? retained_forks : slot_forks);
    try {
      book->apply(pair::decode_gpu_plan(bytes.data(), bytes.size(), so.max_slots, "inference rank (replay)"),
                  [](int) {});
    } catch (const std::exception& ex) {  // the engine would fail the batch's requests and go on: fail loudly here
      ADD_FAILURE() << "the cache rank's book refused plan " << plan.step << ": " << ex.what();
      throw;
    }
  }
  // GpuSparseController::idle_flush, which the serve loop calls after every iteration: with the engine idle, the
  // waiting releases, retains and drops go out in a flush plan.
  void idle_flush() {
    if (!engine->idle() || !planner->has_news() || planner->pending_forks() > 0) return;
    send(planner->flush_plan());
    ++flushes;
  }
  // The planner's step, its plan through the wire into the book, and greedy logits that depend on the row's last
  // token and position only (repeated prompts continue alike).
  void forward(const ForwardBatch& fb, std::vector<float>& logits) {
    send(planner->plan_step(fb, step++).plan);
    logits.assign(fb.logit_rows.size() * kVocab, 0.f);
    for (size_t i = 0; i < fb.logit_rows.size(); ++i) {
      const auto t = static_cast<size_t>(fb.logit_rows[i]);
      logits[i * kVocab + static_cast<size_t>((fb.tokens[t] * 31 + fb.positions[t] * 7 + 3) % kVocab)] = 1.f;
    }
  }

  TokenCallback callback() {
    return [this](const TokenEvent& ev) {
      if (ev.token >= 0) tokens[ev.request_id].push_back(ev.token);
      if (ev.finished) {
        reasons[ev.request_id] = ev.reason;
        errors[ev.request_id] = ev.error;
      }
    };
  }
  // One iteration of the serve loop: an engine step, then the idle flush.
  bool iterate() {
    const bool ran = engine->step();
    idle_flush();
    return ran;
  }
  bool step_until(const std::function<bool()>& done) {  // at most 64 steps
    for (int i = 0; i < 64 && !done(); ++i)
      if (!iterate()) break;
    return done();
  }
  void run_until_idle() {
    engine->run_until_idle();
    idle_flush();
  }

  // Idle, after the idle flush: the book must hold the retained prefixes and nothing else (no slot), and the
  // engine's pool must be whole.
  void expect_nothing_leaks() {
    run_until_idle();
    EXPECT_FALSE(planner->has_news()) << "the idle flush left news behind";
    EXPECT_EQ(engine->pages().num_free_pages(), engine->pages().num_pages()) << "a page is held on the inference rank";
    EXPECT_EQ(book->live_slots(), 0) << "a slot is still held on the cache rank";
    EXPECT_EQ(book->retained(), planner->num_retained());
    EXPECT_EQ(book->pages_held(), planner->retained_pages())
        << "the cache rank holds pages of no live sequence and no retained prefix";
    EXPECT_LE(planner->retained_tokens(), so.max_retained_prefix_tokens);
    EXPECT_EQ(planner->free_slots(), so.max_slots);
    EXPECT_EQ(planner->free_tables(), so.max_sparse_seqs);
  }
};

std::vector<int32_t> random_prompt(std::mt19937_64& rng, int n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = static_cast<int32_t>(rng() % kVocab);
  return p;
}

// The script of the GPU test GpuSparse.AbortsAroundForksLeaveOnlyTheRetainedPrefixesOnTheCacheRank.
TEST(PlanReplay, AbortsAroundForksLeaveOnlyTheRetainedPrefixes) {
  Replay r(/*recompute=*/64, /*bound=*/4096);
  Engine& e = *r.engine;
  std::mt19937_64 rng(500);
  const std::vector<int32_t> P = random_prompt(rng, 200), Q = random_prompt(rng, 300), R = random_prompt(rng, 300);
  std::vector<uint64_t> survivors, aborted;

  // A: sample 2 aborted before any step, sample 1 after 5 sparse tokens; sample 0 runs to its end.
  const std::vector<uint64_t> a = e.submit_samples(test::greedy(P, 40), 3, r.callback());
  e.abort(a[2]);
  ASSERT_TRUE(r.step_until([&] { return r.tokens[a[1]].size() >= 5; }));
  e.abort(a[1]);
  r.run_until_idle();
  survivors.push_back(a[0]);
  aborted.insert(aborted.end(), {a[1], a[2]});
  EXPECT_GE(r.planner->retention_stats().retained, 1u) << "A's prefix";

  // B: P again, wholly from A's retained prefix; sample 0 aborted before its first row, 1 after its first token.
  const std::vector<uint64_t> b = e.submit_samples(test::greedy(P, 24), 3, r.callback());
  e.abort(b[0]);
  ASSERT_TRUE(r.step_until([&] { return !r.tokens[b[1]].empty(); }));
  e.abort(b[1]);
  r.run_until_idle();
  survivors.push_back(b[2]);
  aborted.insert(aborted.end(), {b[0], b[1]});
  EXPECT_GE(r.planner->retention_stats().reused, 1u) << "B started from A's retained prefix";

  // C: samples 0 (the group's slot) and 1 aborted after the group prefill, before the plan that forks them.
  const std::vector<uint64_t> c = e.submit_samples(test::greedy(Q, 24), 3, r.callback());
  ASSERT_TRUE(r.step_until([&] { return e.stats().num_running == 3; }));
  ASSERT_TRUE(r.tokens[c[0]].empty() && r.tokens[c[1]].empty() && r.tokens[c[2]].empty());
  e.abort(c[0]);
  e.abort(c[1]);
  r.run_until_idle();
  survivors.push_back(c[2]);
  aborted.insert(aborted.end(), {c[0], c[1]});

  // D: every sample aborted midway through the group prefill.
  const std::vector<uint64_t> d = e.submit_samples(test::greedy(R, 24), 3, r.callback());
  ASSERT_TRUE(r.iterate());
  ASSERT_EQ(e.stats().num_running, 1) << "the group prefill is one step in";
  for (uint64_t id : d) e.abort(id);
  r.run_until_idle();
  aborted.insert(aborted.end(), d.begin(), d.end());

  r.expect_nothing_leaks();
  EXPECT_EQ(r.flushes, 4u) << "each of A, B, C and D ended with the engine idle and its releases waiting";
  // Forks that reached the cache rank: A's sample 1 and C's sample 2 from a slot (A's sample 2 and C's sample 1 ended
  // before theirs were planned, C's sample 0 took over the group's slot); B's samples 1 and 2 from A's prefix.
  EXPECT_EQ(r.slot_forks, 2u);
  EXPECT_EQ(r.retained_forks, 2u);
  for (uint64_t id : survivors) {
    EXPECT_EQ(r.reasons[id], FinishReason::Length) << "request " << id << ": " << r.errors[id];
    EXPECT_EQ(r.tokens[id].size(), id == a[0] ? 40u : 24u) << "request " << id;
  }
  EXPECT_EQ(r.tokens[b[2]], std::vector<int32_t>(r.tokens[a[0]].begin(), r.tokens[a[0]].begin() + 24))
      << "the same prompt continues alike";
  for (uint64_t id : aborted) EXPECT_EQ(r.reasons[id], FinishReason::Abort) << "request " << id;
}

// Random traffic: single requests and groups of 2-3 samples over a few prompts (two of them sharing a 96-token
// prefix, so hits are partial too), lengths from 1 to 40 tokens, aborts at random moments, and retained prefixes up
// to `bound` tokens. Every plan must fit the book; at the end nothing leaks. Returns the distinct pages and the tokens
// retained at the end, and the prefixes dropped on the way.
std::tuple<int, int64_t, uint64_t> random_traffic(int bound, uint64_t seed) {
  Replay r(/*recompute=*/17, bound);
  Engine& e = *r.engine;
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts = {random_prompt(rng, 40), random_prompt(rng, 130), random_prompt(rng, 180),
                                               random_prompt(rng, 150)};
  std::vector<int32_t> shared = prompts[2];
  shared.resize(96);
  const std::vector<int32_t> tail = random_prompt(rng, 70);
  shared.insert(shared.end(), tail.begin(), tail.end());
  prompts.push_back(shared);
  std::vector<uint64_t> live;  // submitted, not ended
  uint64_t submitted = 0;
  for (int it = 0; it < 1000; ++it) {
    std::erase_if(live, [&](uint64_t id) { return r.reasons.count(id) != 0; });
    const uint64_t roll = rng() % 100;
    if (roll < 15 && e.stats().num_waiting < 2) {
      const auto& p = prompts[rng() % prompts.size()];
      const int max_tokens = 1 + static_cast<int>(rng() % 40);
      const int n = 1 + static_cast<int>(rng() % 3);
      for (uint64_t id : e.submit_samples(test::greedy(p, max_tokens), n, r.callback())) live.push_back(id);
      submitted += static_cast<uint64_t>(n);
    } else if (roll < 30 && !live.empty()) {
      e.abort(live[rng() % live.size()]);
    }
    EXPECT_NO_THROW(r.iterate()) << "iteration " << it;
  }
  r.expect_nothing_leaks();  // idle first
  for (const auto& [id, reason] : r.reasons)
    EXPECT_TRUE(reason == FinishReason::Length || reason == FinishReason::Abort)
        << "request " << id << ": " << finish_reason_name(reason) << " " << r.errors[id];
  EXPECT_EQ(r.reasons.size(), submitted) << "every request ended";
  EXPECT_GT(r.flushes, 0u) << "the traffic was never idle with news waiting";
  const SparseStepPlanner::RetentionStats& rs = r.planner->retention_stats();
  std::printf("[ replay   ] bound %d, seed %llu: %llu requests, %lld steps; %llu prefixes retained, %llu dropped, "
              "%llu reused (%llu tokens); %llu prefix-cache hit tokens; at the end %d prefixes, %d pages, %lld "
              "tokens\n",
              bound, static_cast<unsigned long long>(seed), static_cast<unsigned long long>(submitted),
              static_cast<long long>(r.step), static_cast<unsigned long long>(rs.retained),
              static_cast<unsigned long long>(rs.dropped), static_cast<unsigned long long>(rs.reused),
              static_cast<unsigned long long>(rs.reused_tokens),
              static_cast<unsigned long long>(e.stats().prefix_hit_tokens), r.planner->num_retained(),
              r.planner->retained_pages(), static_cast<long long>(r.planner->retained_tokens()));
  EXPECT_GT(rs.reused, 0u);
  return {r.planner->retained_pages(), r.planner->retained_tokens(), rs.dropped};
}

TEST(PlanReplay, RandomTrafficWithAbortsNeverLeaksOrMisplans) {
  // A bound of 192 tokens: drops (least recently used, covered, stale) and pins at work.
  for (const uint64_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) {
    SCOPED_TRACE("bound 192, seed " + std::to_string(seed));
    const auto [pages, tokens, dropped] = random_traffic(192, seed);
    EXPECT_LE(tokens, 192);
    EXPECT_GT(dropped, 0u);
  }
  // A bound of 4096: every prompt's prefix stays, the two that share 96 tokens share their pages on both ranks.
  int sharing = 0;
  for (const uint64_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) {
    SCOPED_TRACE("bound 4096, seed " + std::to_string(seed));
    const auto [pages, tokens, dropped] = random_traffic(4096, seed);
    sharing += pages * kPage < tokens ? 1 : 0;
  }
  EXPECT_GT(sharing, 0) << "no run held two retained prefixes sharing pages";
}

}  // namespace
}  // namespace spade

// n samples of one prompt (GenerateRequest.n) end to end, as processes: the real coordinator, inference rank and cache
// rank executables on stories260K, requests sent over the coordinator's control port (TCP, authenticated). What is
// checked, on the inference rank:
//  - n = 8 at temperature 1 with a seed: eight distinct completions, sample i equal to a separate request with seed
//    + i, the same again on a second run; each sample ends with exactly one final chunk naming it (index).
//  - while the eight decode, the rank's KV usage (spade_kv_cache_usage_perc) is the prompt's shared pages once plus
//    each sample's own tail pages, where eight separate requests of the same prompt hold eight copies of the prompt
//    (prefix caching off on the rank, so that only the samples share).
//  - cancelling the whole request mid-decode, or one sample of it, frees every page: the KV usage returns to its
//    idle value (0) and the aborts are counted; a request with n above the rank's max_num_seqs, or above the
//    coordinator's limit, is refused with one FINISH_ERROR chunk per sample (a single one for the latter).
//  - with predicted sparse decoding over the CPU cache rank (budget above the context, so the output is exact):
//    every sample switches to sparse decoding, the samples equal separate requests, and a cancel mid-decode leaves no
//    sequence and no page held on either rank. How the cache rank stores the shared prompt is not asserted here.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr int kPageSize = 16;                         // the rank's default --page-size
constexpr int kMaxNumSeqs = 16;                       // --max-num-seqs below
constexpr int kNumPages = kMaxNumSeqs * (512 / kPageSize);  // the engine's pool: max_num_seqs full contexts
constexpr int kPrompt = 300;                          // prompt tokens: 18 whole pages and a part
constexpr int kMaxTokens = 200;                       // prompt + max_tokens = 500 <= 512

int pages_for(int tokens) { return (tokens + kPageSize - 1) / kPageSize; }

/// kPrompt real tokens: BOS then the greedy reference's ids, repeated.
std::vector<uint32_t> prompt_ids() {
  const std::string path = data_path("models/stories260K/expected_greedy_200tok.ids.json");
  const auto ids = nlohmann::json::parse(read_file(path))["generated_ids"];
  std::vector<uint32_t> out = {1};
  while (out.size() < static_cast<size_t>(kPrompt))
    for (const auto& id : ids)
      if (out.size() < static_cast<size_t>(kPrompt)) out.push_back(id.get<uint32_t>());
  return out;
}

proto::GenerateRequest sampled(uint32_t n, uint64_t seed, int max_tokens = kMaxTokens) {
  proto::GenerateRequest r;
  for (uint32_t id : prompt_ids()) r.mutable_prompt_ids()->add_ids(id);
  r.set_max_tokens(static_cast<uint32_t>(max_tokens));
  r.set_ignore_eos(true);
  r.set_n(n);
  r.mutable_sampling()->set_temperature(1.0f);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

/// The samples of one request as its chunks arrived.
struct Samples {
  std::vector<std::vector<uint32_t>> ids;      // per sample
  std::vector<proto::FinishReason> reason;     // per sample; FINISH_NONE: no final chunk
  std::vector<int> finals;                     // final chunks per sample (must be 1)
  std::string error;                           // of the first error chunk
  int stray = 0;                               // chunks naming a sample >= n
  bool all_finished() const {
    return std::all_of(finals.begin(), finals.end(), [](int f) { return f > 0; });
  }
};

/// Gathers the chunks of requests `ids` (n samples each) until each sample of each has had a final chunk or `timeout`
/// passed, then 300 ms more to catch any extra final chunk. `on_chunk(k, s)` runs after each chunk of request k.
std::vector<Samples> gather(coord::CoordinatorClient& c, const std::vector<uint64_t>& ids, uint32_t n,
                            const std::function<void(size_t, const Samples&)>& on_chunk = nullptr,
                            std::chrono::milliseconds timeout = 120s) {
  std::vector<Samples> out(ids.size());
  for (auto& s : out) {
    s.ids.resize(n);
    s.reason.assign(n, proto::FINISH_NONE);
    s.finals.assign(n, 0);
  }
  auto done = [&] { return std::all_of(out.begin(), out.end(), [](const Samples& s) { return s.all_finished(); }); };
  auto take = [&](const proto::GenerateChunk& ch) {
    const auto k = static_cast<size_t>(std::find(ids.begin(), ids.end(), ch.request_id()) - ids.begin());
    if (k == ids.size()) return;
    Samples& s = out[k];
    if (ch.index() >= n) {
      ++s.stray;
      return;
    }
    for (uint32_t t : ch.token_ids()) s.ids[ch.index()].push_back(t);
    if (ch.finished()) {
      ++s.finals[ch.index()];
      s.reason[ch.index()] = ch.finish_reason();
      if (!ch.error().empty() && s.error.empty()) s.error = ch.error();
    }
    if (on_chunk) on_chunk(k, s);
  };
  for (auto until = Clock::now() + timeout; !done() && Clock::now() < until;)
    if (auto ch = c.next_chunk(until)) take(*ch);
  for (auto until = Clock::now() + 300ms; Clock::now() < until;)
    if (auto ch = c.next_chunk(until)) take(*ch);
  return out;
}

/// Pages in use on the inference rank from one scrape, and the tokens generated since `gen0` in the same scrape.
struct KvSnapshot {
  int pages = -1;
  double generated = 0;
};

class SamplesCluster : public ::testing::Test {
 protected:
  static void start(ApiCluster*& c, const std::vector<std::string>& inference_flags,
                    const std::vector<std::string>& cache_flags) {
    c = new ApiCluster();
    ClusterOptions o;
    o.inference_flags = inference_flags;
    o.cache_flags = cache_flags;
    c->start_coordinator(o);
    c->start_ranks(o);
    ASSERT_TRUE(c->wait_ready(c->http_port)) << c->logs();
    ASSERT_TRUE(c->wait_ready(c->inference_metrics_port)) << c->logs();
  }
  /// The inference rank's metrics once nothing runs or waits there.
  static std::map<std::string, double> idle_metrics(ApiCluster& c) {
    std::map<std::string, double> m;
    for (auto until = Clock::now() + 30s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      m = c.metrics(c.inference_metrics_port);
      if (m.at("spade_num_requests_running") == 0 && m.at("spade_num_requests_waiting") == 0 &&
          m.at("spade_kv_cache_usage_perc") == 0)
        return m;
    }
    ADD_FAILURE() << "the inference rank never went idle with every KV page free: KV usage "
                  << m["spade_kv_cache_usage_perc"] << ", running " << m["spade_num_requests_running"];
    return m;
  }
  /// Scrapes the inference rank until `streams` x kMaxTokens tokens are under way: at least 8 steps in and 16 before
  /// the end.
  static KvSnapshot snapshot_while_decoding(ApiCluster& c, double gen0, int streams) {
    for (auto until = Clock::now() + 60s; Clock::now() < until;) {
      const auto m = c.metrics(c.inference_metrics_port);
      const double g = m.at("spade_generation_tokens_total") - gen0;
      if (g >= 8.0 * streams && g <= static_cast<double>(streams) * (kMaxTokens - 16))
        return {static_cast<int>(std::lround(m.at("spade_kv_cache_usage_perc") * kNumPages)), g};
      if (g > static_cast<double>(streams) * (kMaxTokens - 16)) break;
    }
    return {};
  }
  static double aborts(const std::map<std::string, double>& m) {
    return m.at("spade_request_success_total{finished_reason=\"abort\"}");
  }
};

class DenseSamples : public SamplesCluster {
 protected:
  static ApiCluster* c;
  static void SetUpTestSuite() {
    start(c, {"--selection", "dense", "--max-num-seqs", std::to_string(kMaxNumSeqs), "--no-enable-prefix-caching"},
          {});
  }
  static void TearDownTestSuite() {
    delete c;
    c = nullptr;
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << c->logs();
  }
};
ApiCluster* DenseSamples::c = nullptr;

TEST_F(DenseSamples, EightSamplesShareThePromptPagesAndDecodeAsSeededRequests) {
  auto cc = c->control_client();
  const auto idle = idle_metrics(*c);
  const uint32_t n = 8;
  const uint64_t seed = 42;

  // n = 8 in one request: the prompt's 18 whole pages (288 of its 300 tokens; the last one is always recomputed) are
  // held once, each sample holds the pages past them.
  const uint64_t id = cc->submit(sampled(n, seed));
  const KvSnapshot shared = snapshot_while_decoding(*c, idle.at("spade_generation_tokens_total"), n);
  const Samples s = gather(*cc, {id}, n)[0];
  ASSERT_TRUE(s.all_finished()) << s.error;
  EXPECT_EQ(s.stray, 0);
  for (uint32_t i = 0; i < n; ++i) {
    EXPECT_EQ(s.finals[i], 1) << "sample " << i << " had " << s.finals[i] << " final chunks";
    EXPECT_EQ(s.reason[i], proto::FINISH_LENGTH) << "sample " << i << ": " << s.error;
    EXPECT_EQ(s.ids[i].size(), static_cast<size_t>(kMaxTokens)) << "sample " << i;
  }
  EXPECT_EQ(std::set<std::vector<uint32_t>>(s.ids.begin(), s.ids.end()).size(), n)
      << "eight samples at temperature 1 with seeds 42..49 are all different";

  // The same request again: the same eight samples.
  const Samples again = gather(*cc, {cc->submit(sampled(n, seed))}, n)[0];
  EXPECT_EQ(again.ids, s.ids) << "a request with a seed is reproducible";

  // Eight separate requests with seeds 42..49: the same tokens, eight copies of the prompt's pages.
  const auto mid = idle_metrics(*c);
  std::vector<uint64_t> ids;
  for (uint32_t i = 0; i < n; ++i) ids.push_back(cc->submit(sampled(1, seed + i)));
  const KvSnapshot separate = snapshot_while_decoding(*c, mid.at("spade_generation_tokens_total"), n);
  const auto alone = gather(*cc, ids, 1);
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_TRUE(alone[i].all_finished()) << alone[i].error;
    EXPECT_EQ(s.ids[i], alone[i].ids[0]) << "sample " << i << " decodes as a request with seed " << seed + i;
  }

  ASSERT_GE(shared.pages, 0) << "never saw the eight samples mid-decode";
  ASSERT_GE(separate.pages, 0) << "never saw the eight requests mid-decode";
  const int shared_pages = (kPrompt - 1) / kPageSize;  // 18
  // Per stream, `t` tokens generated (the scrape may see the counter one step ahead of the usage): the KV holds
  // kPrompt + t - 1 tokens, within a page either way.
  const double t = shared.generated / n;
  std::cout << "KV pages in use mid-decode: 8 samples " << shared.pages << " after " << t << " tokens each; 8 requests "
            << separate.pages << " after " << separate.generated / n << " tokens each\n";
  const int lo = shared_pages + static_cast<int>(n) * (pages_for(kPrompt + static_cast<int>(t) - 2) - shared_pages);
  const int hi = shared_pages + static_cast<int>(n) * (pages_for(kPrompt + static_cast<int>(t) + 1) - shared_pages);
  EXPECT_GE(shared.pages, lo) << "after " << t << " tokens per sample";
  EXPECT_LE(shared.pages, hi) << "after " << t << " tokens per sample: the prompt once plus eight tails";
  EXPECT_GE(separate.pages, static_cast<int>(n) * pages_for(kPrompt)) << "eight prompts, eight copies";
  EXPECT_LT(shared.pages + static_cast<int>(n - 1) * (shared_pages - 1), separate.pages)
      << "the samples hold the prompt once (" << shared.pages << " pages after " << t
      << " tokens each) where separate requests hold it eight times (" << separate.pages << " pages after "
      << separate.generated / n << ")";
  EXPECT_EQ(idle_metrics(*c).at("spade_kv_cache_usage_perc"), 0) << "every page free again";
}

TEST_F(DenseSamples, CancellingTheRequestOrOneSampleMidDecodeFreesEveryPage) {
  auto cc = c->control_client();
  const auto idle = idle_metrics(*c);
  const uint32_t n = 8;
  // The whole request, once every sample is 10 tokens in.
  const uint64_t id = cc->submit(sampled(n, 7));
  bool cancelled = false;
  const Samples s = gather(*cc, {id}, n, [&](size_t, const Samples& so_far) {
    if (cancelled) return;
    for (const auto& t : so_far.ids)
      if (t.size() < 10) return;
    cc->cancel(id, "test: cancel mid-decode");
    cancelled = true;
  })[0];
  ASSERT_TRUE(cancelled);
  ASSERT_TRUE(s.all_finished());
  size_t generated = 0;
  for (uint32_t i = 0; i < n; ++i) {
    EXPECT_EQ(s.finals[i], 1) << "sample " << i;
    EXPECT_EQ(s.reason[i], proto::FINISH_CANCELLED) << "sample " << i;
    generated += s.ids[i].size();
  }
  EXPECT_LT(generated, static_cast<size_t>(n) * kMaxTokens) << "the samples ran to the end";
  const auto after = idle_metrics(*c);
  EXPECT_EQ(after.at("spade_kv_cache_usage_perc"), idle.at("spade_kv_cache_usage_perc"));
  EXPECT_EQ(aborts(after) - aborts(idle), static_cast<double>(n)) << "every sample aborted on the rank";

  // One sample (2 of 4): it ends cancelled, the others run to max_tokens, and then every page is free.
  const uint64_t id2 = cc->submit(sampled(4, 9));
  bool one = false;
  const Samples s2 = gather(*cc, {id2}, 4, [&](size_t, const Samples& so_far) {
    if (!one && so_far.ids[2].size() >= 10) {
      cc->cancel(id2, "test: cancel one sample", 2);
      one = true;
    }
  })[0];
  ASSERT_TRUE(one);
  ASSERT_TRUE(s2.all_finished()) << s2.error;
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(s2.finals[i], 1) << "sample " << i;
    EXPECT_EQ(s2.reason[i], i == 2 ? proto::FINISH_CANCELLED : proto::FINISH_LENGTH) << "sample " << i;
    if (i != 2) {
      EXPECT_EQ(s2.ids[i].size(), static_cast<size_t>(kMaxTokens)) << "sample " << i;
    }
  }
  EXPECT_LT(s2.ids[2].size(), static_cast<size_t>(kMaxTokens));
  const auto after2 = idle_metrics(*c);
  EXPECT_EQ(after2.at("spade_kv_cache_usage_perc"), 0);
  EXPECT_EQ(aborts(after2) - aborts(after), 1);
}

TEST_F(DenseSamples, TooManySamplesAreRefusedWithOneErrorChunkPerSample) {
  auto cc = c->control_client();
  // Above the rank's max_num_seqs (16): the rank refuses, every sample gets its FINISH_ERROR chunk.
  const Samples rank = gather(*cc, {cc->submit(sampled(kMaxNumSeqs + 1, 1, 8))}, kMaxNumSeqs + 1)[0];
  ASSERT_TRUE(rank.all_finished());
  for (uint32_t i = 0; i <= kMaxNumSeqs; ++i) {
    EXPECT_EQ(rank.finals[i], 1) << "sample " << i;
    EXPECT_EQ(rank.reason[i], proto::FINISH_ERROR) << "sample " << i;
  }
  EXPECT_THAT(rank.error, HasSubstr("invalid request: n must be in [1, 16]"));
  // Above the coordinator's limit: one FINISH_ERROR chunk naming n, and nothing reaches the rank.
  const Samples over = gather(*cc, {cc->submit(sampled(coord::kMaxSamplesPerRequest + 1, 1, 8))}, 1)[0];
  ASSERT_TRUE(over.all_finished());
  EXPECT_EQ(over.finals[0], 1);
  EXPECT_EQ(over.reason[0], proto::FINISH_ERROR);
  EXPECT_THAT(over.error, HasSubstr("n = 65 samples is above the limit of 64 per request"));
  // The rank serves on.
  const Samples ok = gather(*cc, {cc->submit(sampled(2, 1, 8))}, 2)[0];
  ASSERT_TRUE(ok.all_finished());
  EXPECT_EQ(ok.reason, (std::vector<proto::FinishReason>{proto::FINISH_LENGTH, proto::FINISH_LENGTH})) << ok.error;
}

class SparseSamples : public SamplesCluster {
 protected:
  static ApiCluster* c;
  static void SetUpTestSuite() {
    // Sparse from context 320 on (20 tokens into decoding), with a budget above the context: exact output.
    start(c,
          {"--selection", "predicted", "--sparse-threshold", "320", "--token-budget", "512", "--max-num-seqs",
           std::to_string(kMaxNumSeqs), "--no-enable-prefix-caching"},
          {"--token-budget", "512"});
  }
  static void TearDownTestSuite() {
    delete c;
    c = nullptr;
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << c->logs();
  }
};
ApiCluster* SparseSamples::c = nullptr;

TEST_F(SparseSamples, SamplesDecodeSparselyAndACancelFreesEveryPageOnBothRanks) {
  auto cc = c->control_client();
  const uint32_t n = 8;
  const auto idle = idle_metrics(*c);
  const Samples s = gather(*cc, {cc->submit(sampled(n, 42, 80))}, n)[0];
  ASSERT_TRUE(s.all_finished()) << s.error;
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(s.reason[i], proto::FINISH_LENGTH) << "sample " << i << ": " << s.error;
  const auto after = idle_metrics(*c);
  EXPECT_EQ(after.at("spade_sparse_switches_total") - idle.at("spade_sparse_switches_total"), n)
      << "every sample switched to sparse decoding";
  std::vector<uint64_t> ids;
  for (uint32_t i = 0; i < n; ++i) ids.push_back(cc->submit(sampled(1, 42 + i, 80)));
  const auto alone = gather(*cc, ids, 1);
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(s.ids[i], alone[i].ids[0]) << "sample " << i;

  // Cancelled once every sample decodes sparsely (context past 320): nothing stays held on either rank.
  const uint64_t id = cc->submit(sampled(n, 5));
  bool cancelled = false;
  const Samples x = gather(*cc, {id}, n, [&](size_t, const Samples& so_far) {
    if (cancelled) return;
    for (const auto& t : so_far.ids)
      if (t.size() < 40) return;
    cc->cancel(id, "test: cancel sparse samples");
    cancelled = true;
  })[0];
  ASSERT_TRUE(cancelled);
  ASSERT_TRUE(x.all_finished());
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(x.reason[i], proto::FINISH_CANCELLED) << "sample " << i;
  EXPECT_EQ(idle_metrics(*c).at("spade_kv_cache_usage_perc"), 0);
  std::map<std::string, double> cache;
  for (auto until = Clock::now() + 20s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
    cache = c->metrics(c->cache_metrics_port);
    if (cache.at("spade_cache_sequences") == 0 && cache.at("spade_cache_kv_usage_perc") == 0) break;
  }
  EXPECT_EQ(cache.at("spade_cache_sequences"), 0) << "the cache rank still holds samples";
  EXPECT_EQ(cache.at("spade_cache_kv_usage_perc"), 0);
}

}  // namespace
}  // namespace spade::test

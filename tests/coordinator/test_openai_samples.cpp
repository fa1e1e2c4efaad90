// OpenAI's `n` through the coordinator's API against a real local cluster (coordinator + inference rank + cache rank
// processes, stories260K, predicted sparse selection with a budget above the context, the rank's --max-num-seqs 8):
// choices[i] is sample i, the same as a request with seed + i; usage counts the prompt once and every choice's
// tokens; streamed, each chunk carries one choice with its index, chat's role chunk comes first for each choice, the
// usage chunk and [DONE] after the last finish; logprobs per choice; stop strings end each choice on its own (its
// sample cancelled on the rank); n out of range and best_of are 400s naming the field, n above the rank's
// max_num_seqs is the rank's 400; a client that disconnects cancels every sample and frees their KV on both ranks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

/// A streamed response: the events, and per choice index its text (chat: content deltas), finish_reason and logprobs
/// entries (chat: content[]; completions: tokens[]), in arrival order.
struct Stream {
  std::vector<json> events;
  bool done = false;
  std::map<int, std::string> text, finish;
  std::map<int, json> logprobs;
  json usage;
  int finishes_after_usage = 0;
};
Stream parse_stream(const std::string& body, bool chat) {
  Stream s;
  for (const std::string& payload : sse_payloads(body)) {
    if (payload == "[DONE]") {
      s.done = true;
      continue;
    }
    json e = json::parse(payload);
    EXPECT_LE(e["choices"].size(), 1u) << "one choice per chunk: " << payload;
    for (const auto& c : e["choices"]) {
      const int i = c["index"];
      if (chat && c["delta"].contains("content")) s.text[i] += c["delta"]["content"].get<std::string>();
      if (!chat) s.text[i] += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) {
        s.finish[i] = c["finish_reason"];
        if (!s.usage.is_null()) ++s.finishes_after_usage;
      }
      if (!c["logprobs"].is_null()) {
        if (!s.logprobs.count(i)) s.logprobs[i] = json::array();
        for (const auto& x : c["logprobs"][chat ? "content" : "tokens"]) s.logprobs[i].push_back(x);
      }
    }
    if (e.contains("usage") && !e["usage"].is_null()) s.usage = e["usage"];
    s.events.push_back(std::move(e));
  }
  return s;
}

class OpenAiSamples : public ::testing::Test {
 protected:
  static ApiCluster* c;
  static void SetUpTestSuite() {
    c = new ApiCluster();
    ClusterOptions o;
    o.inference_flags = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "512",
                         "--local-window", "8", "--sink-tokens", "4", "--max-num-seqs", "8"};
    o.cache_flags = {"--token-budget", "512", "--local-window", "8", "--sink-tokens", "4"};
    c->start_coordinator(o);
    c->start_ranks(o);
    ASSERT_TRUE(c->wait_ready(c->http_port)) << c->logs();
    ASSERT_TRUE(c->wait_ready(c->inference_metrics_port)) << c->logs();
  }
  static void TearDownTestSuite() {
    delete c;
    c = nullptr;
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << c->logs();
  }

  static json post(const std::string& path, const json& body) {
    const auto r = c->post(path, body.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    return r.status == 200 ? json::parse(r.body) : json();
  }
  static Stream post_stream(const std::string& path, json body, bool chat) {
    body["stream"] = true;
    const auto r = c->post(path, body.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    return parse_stream(r.body, chat);
  }
  /// 120 real tokens (BOS, then the greedy reference's ids): seven whole pages beyond what the sparse backend always
  /// recomputes, so the samples share pages.
  static json prompt_ids() {
    const json ids =
        json::parse(read_file(data_path("models/stories260K/expected_greedy_200tok.ids.json")))["generated_ids"];
    json p = json::array({1});
    for (size_t i = 0; p.size() < 120; ++i) p.push_back(ids[i]);
    return p;
  }
  static json completion(int n, int seed, int max_tokens = 24) {
    return {{"model", "stories260K"}, {"prompt", prompt_ids()}, {"max_tokens", max_tokens}, {"temperature", 1.0},
            {"seed", seed}, {"n", n}, {"ignore_eos", true}};
  }
  /// The inference rank's metrics once nothing runs there and the API has nothing in flight.
  static std::map<std::string, double> idle_metrics() {
    std::map<std::string, double> m;
    for (auto until = Clock::now() + 30s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
      m = c->metrics(c->inference_metrics_port);
      if (m.at("spade_num_requests_running") == 0 && m.at("spade_num_requests_waiting") == 0 &&
          m.at("spade_kv_cache_usage_perc") == 0 && c->metrics(c->http_port).at("spade_api_requests_in_flight") == 0)
        return m;
    }
    ADD_FAILURE() << "the inference rank never went idle with every KV page free";
    return m;
  }
};
ApiCluster* OpenAiSamples::c = nullptr;

TEST_F(OpenAiSamples, CompletionChoicesAreSeededSamplesStreamedOrNot) {
  const int n = 4;
  const json whole = post("/v1/completions", completion(n, 11));
  ASSERT_EQ(whole["choices"].size(), static_cast<size_t>(n)) << whole.dump();
  std::set<std::string> distinct;
  for (int i = 0; i < n; ++i) {
    const json& ch = whole["choices"][static_cast<size_t>(i)];
    EXPECT_EQ(ch["index"], i);
    EXPECT_EQ(ch["finish_reason"], "length");
    distinct.insert(ch["text"].get<std::string>());
    // Sample i is the request with seed 11 + i.
    const json one = post("/v1/completions", completion(1, 11 + i));
    EXPECT_EQ(ch["text"], one["choices"][0]["text"]) << "choice " << i;
  }
  EXPECT_EQ(distinct.size(), static_cast<size_t>(n)) << "samples at temperature 1 with seeds 11..14 differ";
  EXPECT_EQ(whole["usage"]["prompt_tokens"], 120) << "the prompt counts once";
  EXPECT_EQ(whole["usage"]["completion_tokens"], n * 24) << "every choice's tokens";
  EXPECT_EQ(whole["usage"]["total_tokens"], 120 + n * 24);

  json req = completion(n, 11);
  req["stream_options"] = {{"include_usage", true}};
  const Stream s = post_stream("/v1/completions", req, false);
  EXPECT_TRUE(s.done);
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(s.text.at(i), whole["choices"][static_cast<size_t>(i)]["text"]) << "choice " << i;
    EXPECT_EQ(s.finish.at(i), "length") << "choice " << i;
  }
  EXPECT_EQ(s.usage, whole["usage"]);
  EXPECT_EQ(s.finishes_after_usage, 0) << "the usage chunk comes after every choice has finished";
  ASSERT_FALSE(s.events.empty());
  EXPECT_EQ(s.events.back()["choices"].size(), 0u) << "the usage chunk has no choices";
}

TEST_F(OpenAiSamples, ChatChoicesStreamTheirRoleContentAndLogprobsByIndex) {
  const int n = 3;
  const json body = {{"model", "stories260K"},
                     {"messages", json::array({{{"role", "user"}, {"content", "Once upon a time"}}})},
                     {"max_tokens", 16},
                     {"temperature", 0.9},
                     {"seed", 3},
                     {"n", n},
                     {"ignore_eos", true},
                     {"logprobs", true},
                     {"top_logprobs", 2}};
  const json whole = post("/v1/chat/completions", body);
  ASSERT_EQ(whole["choices"].size(), static_cast<size_t>(n)) << whole.dump();
  const Stream s = post_stream("/v1/chat/completions", body, true);
  EXPECT_TRUE(s.done);
  ASSERT_GE(s.events.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {  // the role chunks first, one per choice
    const json& first = s.events[static_cast<size_t>(i)]["choices"][0];
    EXPECT_EQ(first["index"], i);
    EXPECT_EQ(first["delta"]["role"], "assistant");
  }
  int tokens = 0;
  for (int i = 0; i < n; ++i) {
    const json& ch = whole["choices"][static_cast<size_t>(i)];
    EXPECT_EQ(ch["index"], i);
    EXPECT_EQ(ch["message"]["role"], "assistant");
    EXPECT_EQ(s.text.at(i), ch["message"]["content"]) << "choice " << i;
    EXPECT_EQ(s.finish.at(i), ch["finish_reason"]) << "choice " << i;
    ASSERT_TRUE(ch["logprobs"].is_object()) << ch.dump();
    EXPECT_EQ(ch["logprobs"]["content"].size(), 16u) << "choice " << i;
    EXPECT_EQ(s.logprobs.at(i), ch["logprobs"]["content"]) << "choice " << i << ": streamed logprobs";
    tokens += static_cast<int>(ch["logprobs"]["content"].size());
  }
  EXPECT_EQ(whole["usage"]["completion_tokens"], tokens);
  EXPECT_NE(whole["choices"][0]["message"]["content"], whole["choices"][1]["message"]["content"]);
}

TEST_F(OpenAiSamples, StopStringsEndEachChoiceOnItsOwn) {
  const int n = 4;
  const json full = post("/v1/completions", completion(n, 5, 40));
  ASSERT_EQ(full["choices"].size(), static_cast<size_t>(n));
  const std::string stop = "e";
  int stopped = 0;  // choices ended by the stop string, in both runs
  for (bool stream : {false, true}) {
    const int stopped_before = stopped;
    const auto before = idle_metrics();
    json req = completion(n, 5, 40);
    req["stop"] = stop;
    std::map<int, std::string> text, finish;
    if (stream) {
      const Stream s = post_stream("/v1/completions", req, false);
      EXPECT_TRUE(s.done);
      text = s.text;
      finish = s.finish;
    } else {
      const json j = post("/v1/completions", req);
      for (int i = 0; i < n; ++i) {
        text[i] = j["choices"][static_cast<size_t>(i)]["text"];
        finish[i] = j["choices"][static_cast<size_t>(i)]["finish_reason"];
      }
    }
    for (int i = 0; i < n; ++i) {
      const std::string all = full["choices"][static_cast<size_t>(i)]["text"];
      const size_t at = all.find(stop);
      EXPECT_EQ(text[i], all.substr(0, at)) << "choice " << i << (stream ? " streamed" : "");
      EXPECT_EQ(finish[i], at == std::string::npos ? "length" : "stop") << "choice " << i;
      stopped += at != std::string::npos;
    }
    // The stopped samples were cancelled on the rank (all but the last one alone), and every page is free again.
    const auto after = idle_metrics();
    if (stopped - stopped_before >= 2) {
      EXPECT_THAT(c->inf->log(), HasSubstr("cancelling sample")) << "a stopped choice's sample was not cancelled";
    }
    EXPECT_LT(after.at("spade_generation_tokens_total") - before.at("spade_generation_tokens_total"), n * 40)
        << "every sample ran to max_tokens";
    EXPECT_EQ(after.at("spade_kv_cache_usage_perc"), 0);
  }
  EXPECT_GT(stopped, 0) << "no choice contains the stop string: the test proves nothing";
}

TEST_F(OpenAiSamples, OutOfRangeNAndBestOfAre400sNamingTheField) {
  const auto before = idle_metrics();
  struct Case {
    json patch;
    std::string param, needle;
  };
  const std::vector<Case> cases = {
      {{{"n", 0}}, "n", "'n' must be an integer in [1, 64], got 0"},
      {{{"n", 65}}, "n", "'n' must be an integer in [1, 64], got 65"},
      {{{"n", 1.5}}, "n", "'n' must be an integer"},
      {{{"best_of", 2}}, "best_of", "'best_of' is not supported (only 1), got 2"},
      {{{"n", 2}, {"best_of", 1}}, "best_of", "'best_of' (1) must be at least 'n' (2)"},
  };
  for (const Case& k : cases) {
    json req = completion(1, 1, 4);
    req.update(k.patch);
    const auto r = c->post("/v1/completions", req.dump());
    EXPECT_EQ(r.status, 400) << k.patch.dump() << ": " << r.body;
    const json e = json::parse(r.body)["error"];
    EXPECT_EQ(e["param"], k.param) << k.patch.dump();
    EXPECT_THAT(e["message"].get<std::string>(), HasSubstr(k.needle)) << k.patch.dump();
  }
  const auto after = c->metrics(c->inference_metrics_port);
  EXPECT_EQ(after.at("spade_prompt_tokens_total"), before.at("spade_prompt_tokens_total")) << "none reached the rank";
  // Above the rank's --max-num-seqs (8): the rank refuses it, a 400 that says why; the rank serves on.
  const auto r = c->post("/v1/completions", completion(9, 1, 4).dump());
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_THAT(r.body, HasSubstr("n must be in [1, 8]"));
  const json ok = post("/v1/completions", completion(8, 1, 4));
  EXPECT_EQ(ok["choices"].size(), 8u);
  idle_metrics();
}

TEST_F(OpenAiSamples, ClientDisconnectCancelsEverySampleAndFreesItsKvOnBothRanks) {
  const auto before = idle_metrics();
  const auto aborts = [](const std::map<std::string, double>& m) {
    return m.at("spade_request_success_total{finished_reason=\"abort\"}");
  };
  // The cache rank may keep a retained prefix of the earlier requests' prompt (its pages stay used there, and the
  // inference rank may drop it at any step): the samples' pages come on top of it and must go again. The samples
  // have the same prompt, which that retained prefix already covers, so they add none of their own.
  const auto cache_before = c->metrics(c->cache_metrics_port);
  {
    RawClient rc(c->http_port);
    json req = completion(4, 8, 380);
    req["stream"] = true;
    rc.post("/v1/completions", req.dump());
    rc.read_until("data: ", 80);  // the samples are sparse by now (context past 32): the cache rank holds them
    const auto cache = c->metrics(c->cache_metrics_port);
    EXPECT_EQ(cache.at("spade_cache_sequences"), 4) << "the samples never reached the cache rank";
  }
  std::map<std::string, double> inf, cache;
  for (auto until = Clock::now() + 20s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
    inf = c->metrics(c->inference_metrics_port);
    cache = c->metrics(c->cache_metrics_port);
    if (aborts(inf) - aborts(before) == 4 && inf.at("spade_kv_cache_usage_perc") == 0 &&
        cache.at("spade_cache_sequences") == 0 &&
        cache.at("spade_cache_kv_usage_perc") <= cache_before.at("spade_cache_kv_usage_perc"))
      break;
  }
  EXPECT_EQ(aborts(inf) - aborts(before), 4) << "every sample aborted";
  EXPECT_EQ(inf.at("spade_num_requests_running"), 0);
  EXPECT_EQ(inf.at("spade_kv_cache_usage_perc"), 0);
  EXPECT_EQ(cache.at("spade_cache_sequences"), 0);
  EXPECT_LE(cache.at("spade_cache_kv_usage_perc"), cache_before.at("spade_cache_kv_usage_perc"))
      << "the samples' pages stay used on the cache rank";
  EXPECT_LE(cache.at("spade_cache_retained_prefixes"), cache_before.at("spade_cache_retained_prefixes"));
  EXPECT_LT(inf.at("spade_generation_tokens_total") - before.at("spade_generation_tokens_total"), 4 * 380);
}

}  // namespace
}  // namespace spade::test

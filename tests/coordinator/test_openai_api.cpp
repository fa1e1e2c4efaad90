// The coordinator's OpenAI-compatible API against a real local cluster (coordinator + inference rank + cache rank
// processes, stories260K, predicted sparse selection): outputs, streaming, stop strings, every bad-input class and
// its status, admission (429), client-disconnect cancellation with KV freed on both ranks, per-request Spade fields,
// /health and /ready, promtool on every /metrics, and the official `openai` npm client.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/coordinator/api_cluster.h"
#include "tests/promtool_check.h"

namespace spade::test {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

/// The concatenated text deltas and the parsed events of an SSE body (de-chunked).
struct Sse {
  std::vector<json> events;
  bool done = false;
  std::string text;
  std::string finish;
  json usage;
};
Sse parse_sse(const std::string& body, bool chat) {
  Sse s;
  for (const std::string& payload : sse_payloads(body)) {
    if (payload == "[DONE]") {
      s.done = true;
      continue;
    }
    json e = json::parse(payload);
    for (const auto& c : e["choices"]) {
      if (chat && c["delta"].contains("content")) s.text += c["delta"]["content"].get<std::string>();
      if (!chat) s.text += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) s.finish = c["finish_reason"];
    }
    if (e.contains("usage") && !e["usage"].is_null()) s.usage = e["usage"];
    s.events.push_back(std::move(e));
  }
  return s;
}

double sum_prefix(const std::map<std::string, double>& m, const std::string& prefix) {
  double s = 0;
  for (const auto& [k, v] : m)
    if (k.rfind(prefix, 0) == 0) s += v;
  return s;
}

class OpenAiApi : public ::testing::Test {
 protected:
  static ApiCluster* c;
  static void SetUpTestSuite() {
    c = new ApiCluster();
    ClusterOptions o;
    o.coordinator_flags = {"--max-num-requests", "2", "--max-request-bytes", "65536"};
    // Predicted sparse selection from context 32 on, with a budget above the context: the whole sparse data path
    // runs and the output stays bit-identical to dense decoding (the reference).
    o.inference_flags = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "512",
                         "--local-window", "8", "--sink-tokens", "4"};
    o.cache_flags = {"--token-budget", "512", "--local-window", "8", "--sink-tokens", "4", "--overlap-sample-every",
                     "4"};
    c->start_coordinator(o);
    // Before the ranks exist: alive but not ready, and generation answers 503 without reaching anything.
    bool up = false;
    for (int i = 0; i < 100 && !up; ++i, std::this_thread::sleep_for(100ms)) {
      try {
        up = c->get("/health").status == 200;
      } catch (const std::exception&) {
      }
    }
    ASSERT_TRUE(up) << c->logs();
    const auto ready = c->get("/ready");
    EXPECT_EQ(ready.status, 503);
    EXPECT_THAT(ready.body, HasSubstr("waiting for the world"));
    const auto early = c->post("/v1/completions", R"({"model":"stories260K","prompt":"Hi","max_tokens":2})");
    EXPECT_EQ(early.status, 503) << early.body;
    EXPECT_THAT(early.body, HasSubstr("service_unavailable"));
    c->start_ranks(o);
    ASSERT_TRUE(c->wait_ready(c->http_port)) << c->logs();
    ASSERT_TRUE(c->wait_ready(c->inference_metrics_port)) << c->logs();
    ASSERT_TRUE(c->wait_ready(c->cache_metrics_port)) << c->logs();
  }
  static void TearDownTestSuite() {
    delete c;
    c = nullptr;
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << c->logs();
  }
  /// Metrics of the inference rank once nothing runs or waits there (requests of earlier tests may still be ending:
  /// a stop-string match or a disconnect cancels them asynchronously).
  static std::map<std::string, double> idle_inference_metrics() {
    std::map<std::string, double> m;
    for (auto until = std::chrono::steady_clock::now() + 20s; std::chrono::steady_clock::now() < until;
         std::this_thread::sleep_for(50ms)) {
      m = c->metrics(c->inference_metrics_port);
      if (m.at("spade_num_requests_running") == 0 && m.at("spade_num_requests_waiting") == 0 &&
          c->metrics(c->http_port).at("spade_api_requests_in_flight") == 0)
        return m;
    }
    ADD_FAILURE() << "the inference rank never went idle";
    return m;
  }
  static std::string reference_text() {
    return read_file(data_path("models/stories260K/expected_greedy_200tok.txt"));
  }
};
ApiCluster* OpenAiApi::c = nullptr;

TEST_F(OpenAiApi, ModelsHealthReady) {
  auto m = c->get("/v1/models");
  ASSERT_EQ(m.status, 200);
  const json j = json::parse(m.body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "stories260K");
  EXPECT_EQ(j["data"][0]["max_model_len"], 512);
  EXPECT_EQ(c->get("/health").status, 200);
  EXPECT_EQ(c->get("/ready").status, 200);
  for (int port : {c->inference_metrics_port, c->cache_metrics_port}) {
    EXPECT_EQ(http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/health").status, 200);
    EXPECT_EQ(http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/nope").status, 404);
  }
}

TEST_F(OpenAiApi, GreedyCompletionThroughTheSparseClusterMatchesTheReference) {
  const auto before = idle_inference_metrics();
  // BOS alone, as the reference was made; 200 greedy tokens through predicted sparse decoding.
  auto r = c->post("/v1/completions", R"({"model":"stories260K","prompt":[1],"max_tokens":200,"temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_THAT(j["id"].get<std::string>(), ::testing::StartsWith("cmpl-"));
  EXPECT_EQ(j["choices"][0]["text"].get<std::string>(), reference_text());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 1);
  EXPECT_EQ(j["usage"]["completion_tokens"], 200);
  EXPECT_EQ(j["usage"]["total_tokens"], 201);
  const auto after = c->metrics(c->inference_metrics_port);
  EXPECT_EQ(after.at("spade_sparse_switches_total") - before.at("spade_sparse_switches_total"), 1)
      << "the request never went sparse";
  EXPECT_GT(after.at("spade_sparse_sequence_steps_total"), before.at("spade_sparse_sequence_steps_total") + 150);
  EXPECT_GT(after.at("spade_kv_pages_dropped_total"), before.at("spade_kv_pages_dropped_total"))
      << "the sparse request kept every page";
  EXPECT_EQ(after.at("spade_generation_tokens_total") - before.at("spade_generation_tokens_total"), 200);
  EXPECT_GT(after.at("spade_transfer_bytes_total{direction=\"send\",transport=\"ucx\"}"),
            before.at("spade_transfer_bytes_total{direction=\"send\",transport=\"ucx\"}"));
}

TEST_F(OpenAiApi, StreamingEqualsNonStreamingForCompletionsAndChat) {
  for (bool chat : {false, true}) {
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    json req = {{"model", "stories260K"}, {"max_tokens", 60}, {"temperature", 0}};
    if (chat) {
      req["messages"] = json::array({{{"role", "system"}, {"content", "Tell a story."}},
                                     {{"role", "user"}, {"content", "Once upon a time"}}});
    } else {
      req["prompt"] = "Once upon a time";
    }
    auto whole = c->post(path, req.dump());
    ASSERT_EQ(whole.status, 200) << whole.body;
    const json w = json::parse(whole.body);
    const std::string want = chat ? w["choices"][0]["message"]["content"] : w["choices"][0]["text"];
    EXPECT_FALSE(want.empty());
    if (chat) {
      EXPECT_EQ(w["object"], "chat.completion");
      EXPECT_EQ(w["choices"][0]["message"]["role"], "assistant");
    }
    req["stream"] = true;
    req["stream_options"] = {{"include_usage", true}};
    auto streamed = c->post(path, req.dump());
    ASSERT_EQ(streamed.status, 200) << streamed.body;
    EXPECT_EQ(streamed.headers["content-type"], "text/event-stream");
    const Sse s = parse_sse(streamed.body, chat);
    EXPECT_TRUE(s.done) << "no data: [DONE]";
    EXPECT_EQ(s.text, want) << path;
    EXPECT_EQ(s.finish, w["choices"][0]["finish_reason"]);
    EXPECT_EQ(s.usage, w["usage"]);
    ASSERT_GE(s.events.size(), 3u);
    EXPECT_EQ(s.events.back()["choices"].size(), 0u) << "the usage chunk has no choices";
    if (chat) {
      EXPECT_EQ(s.events.front()["choices"][0]["delta"]["role"], "assistant");
    }
    for (const auto& e : s.events) EXPECT_EQ(e["object"], chat ? "chat.completion.chunk" : "text_completion");
  }
}

TEST_F(OpenAiApi, StopStringsEndTheTextBeforeTheMatch) {
  const std::string full = reference_text();
  const std::string stop = " named";
  const size_t at = full.find(stop);
  ASSERT_NE(at, std::string::npos);
  for (bool stream : {false, true}) {
    json req = {{"model", "stories260K"}, {"prompt", json::array({1})}, {"max_tokens", 200}, {"temperature", 0},
                {"stop", json::array({"zzz-never", stop})}, {"stream", stream}};
    auto r = c->post("/v1/completions", req.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    std::string text, finish;
    if (stream) {
      const Sse s = parse_sse(r.body, false);
      text = s.text;
      finish = s.finish;
      EXPECT_TRUE(s.done);
    } else {
      const json j = json::parse(r.body);
      text = j["choices"][0]["text"];
      finish = j["choices"][0]["finish_reason"];
      EXPECT_LT(j["usage"]["completion_tokens"].get<int>(), 200);
    }
    EXPECT_EQ(text, full.substr(0, at)) << (stream ? "stream" : "whole");
    EXPECT_EQ(finish, "stop");
  }
}

struct BadCase {
  std::string name, method, path, body;
  int status;
  std::string type, needle;
  http::Headers headers = {};
};

TEST_F(OpenAiApi, BadRequestsGetOpenAiErrorsAndNeverReachTheEngine) {
  const auto before = idle_inference_metrics();
  const std::string m = R"("model":"stories260K")";
  const std::vector<BadCase> cases = {
      {"malformed json", "POST", "/v1/completions", "{\"model\": ", 400, "invalid_request_error", "not valid JSON"},
      {"not an object", "POST", "/v1/completions", "[1,2]", 400, "invalid_request_error", "must be a JSON object"},
      {"invalid utf-8", "POST", "/v1/completions", "{" + m + ",\"prompt\":\"a\xff\xfe\"}", 400,
       "invalid_request_error", "not valid UTF-8"},
      {"unknown model", "POST", "/v1/chat/completions",
       R"({"model":"gpt-9","messages":[{"role":"user","content":"hi"}]})", 404, "not_found_error",
       "The model `gpt-9` does not exist"},
      {"missing model", "POST", "/v1/completions", R"({"prompt":"hi"})", 400, "invalid_request_error",
       "'model' is required"},
      {"empty messages", "POST", "/v1/chat/completions", "{" + m + ",\"messages\":[]}", 400, "invalid_request_error",
       "at least one message"},
      {"messages not array", "POST", "/v1/chat/completions", "{" + m + ",\"messages\":\"hi\"}", 400,
       "invalid_request_error", "'messages' must be an array"},
      {"bad role", "POST", "/v1/chat/completions", "{" + m + R"(,"messages":[{"role":"tool","content":"x"}]})", 400,
       "invalid_request_error", "role 'tool' is not supported"},
      {"image content", "POST", "/v1/chat/completions",
       "{" + m + R"(,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})", 400,
       "invalid_request_error", "only text parts"},
      {"max_tokens 0", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","max_tokens":0})", 400,
       "invalid_request_error", "'max_tokens' must be at least 1"},
      {"max_tokens negative", "POST", "/v1/chat/completions",
       "{" + m + R"(,"messages":[{"role":"user","content":"hi"}],"max_tokens":-3})", 400, "invalid_request_error",
       "'max_tokens' must be at least 1"},
      {"max_tokens string", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","max_tokens":"ten"})", 400,
       "invalid_request_error", "'max_tokens' must be an integer"},
      {"ignore_eos string", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","ignore_eos":"yes"})", 400,
       "invalid_request_error", "'ignore_eos' must be a boolean"},
      {"over the context", "POST", "/v1/completions", "{" + m + R"(,"prompt":"Once upon a time","max_tokens":600})",
       400, "invalid_request_error",
       "This model's maximum context length is 512 tokens and your request has 605 tokens (5 in the prompt, 600 "
       "to generate)"},
      {"temperature range", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","temperature":3})", 400,
       "invalid_request_error", "'temperature' must be in [0, 2]"},
      {"top_p zero", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","top_p":0})", 400,
       "invalid_request_error", "'top_p' must be in (0, 1]"},
      {"n=65", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","n":65})", 400, "invalid_request_error",
       "'n' must be an integer in [1, 64], got 65"},
      {"top_logprobs over 20", "POST", "/v1/chat/completions",
       "{" + m + R"(,"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":21})", 400,
       "invalid_request_error", "'top_logprobs' must be an integer in [0, 20]"},
      {"five stops", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","stop":["a","b","c","d","e"]})", 400,
       "invalid_request_error", "at most 4"},
      {"stream_options without stream", "POST", "/v1/completions",
       "{" + m + R"(,"prompt":"hi","stream_options":{"include_usage":true}})", 400, "invalid_request_error",
       "only allowed with stream: true"},
      {"token id out of vocabulary", "POST", "/v1/completions", "{" + m + R"(,"prompt":[1,99999]})", 400,
       "invalid_request_error", "outside the vocabulary [0, 512)"},
      {"bad spade selection", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","spade":{"selection":"magic"}})",
       400, "invalid_request_error", "'spade.selection' must be"},
      {"unknown spade field", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","spade":{"budget":5}})", 400,
       "invalid_request_error", "unknown field 'spade.budget'"},
      {"oversized body", "POST", "/v1/completions",
       "{" + m + ",\"prompt\":\"" + std::string(70000, 'a') + "\"}", 413, "invalid_request_error",
       "exceeds the limit of 65536 bytes"},
      {"wrong method", "GET", "/v1/completions", "", 405, "invalid_request_error", "use POST"},
      {"unknown path", "POST", "/v1/embeddings", "{}", 404, "not_found_error", "no such endpoint"},
      // Once 500s (tests/coordinator/test_openai_bad_input.cpp has the full table) and the rank-reaching overflow.
      {"number overflows a double", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","temperature":1e999})",
       400, "invalid_request_error", "out of range"},
      {"content part type number", "POST", "/v1/chat/completions",
       "{" + m + R"(,"messages":[{"role":"user","content":[{"type":5,"text":"x"}]}]})", 400, "invalid_request_error",
       "messages[0].content[0].type must be a string"},
      {"content part type null", "POST", "/v1/chat/completions",
       "{" + m + R"(,"messages":[{"role":"user","content":[{"type":null,"text":"x"}]}]})", 400,
       "invalid_request_error", "messages[0].content[0].type must be a string"},
      {"response_format type number", "POST", "/v1/chat/completions",
       "{" + m + R"(,"messages":[{"role":"user","content":"x"}],"response_format":{"type":5}})", 400,
       "invalid_request_error", "'response_format.type' must be a string"},
      {"max_tokens INT64_MAX", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","max_tokens":9223372036854775807})",
       400, "invalid_request_error", "maximum context length is 512"},
      {"JSON sent as text/plain", "POST", "/v1/completions", "{" + m + R"(,"prompt":"hi","max_tokens":2})", 415,
       "invalid_request_error", "send the request body as application/json", {{"Content-Type", "text/plain"}}},
  };
  for (const auto& bc : cases) {
    auto r = http::http_request("127.0.0.1", static_cast<uint16_t>(c->http_port), bc.method, bc.path, bc.body,
                                bc.headers);
    EXPECT_EQ(r.status, bc.status) << bc.name << ": " << r.body;
    json j;
    ASSERT_NO_THROW(j = json::parse(r.body)) << bc.name << ": " << r.body;
    ASSERT_TRUE(j.contains("error")) << bc.name;
    EXPECT_EQ(j["error"]["type"], bc.type) << bc.name;
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(bc.needle)) << bc.name;
    EXPECT_EQ(r.headers["content-type"], "application/json") << bc.name;
  }
  // The context error carries OpenAI's code.
  auto ctx = c->post("/v1/completions", R"({"model":"stories260K","prompt":"hi","max_tokens":9999})");
  EXPECT_EQ(json::parse(ctx.body)["error"]["code"], "context_length_exceeded");
  // Nothing reached the inference rank.
  const auto after = c->metrics(c->inference_metrics_port);
  for (const char* k : {"spade_prompt_tokens_total", "spade_generation_tokens_total", "spade_request_failure_total"})
    EXPECT_EQ(after.at(k), before.at(k)) << k;
  EXPECT_EQ(sum_prefix(after, "spade_request_success_total"), sum_prefix(before, "spade_request_success_total"));
  EXPECT_EQ(after.at("spade_request_queue_time_seconds_count"), before.at("spade_request_queue_time_seconds_count"));
  // The coordinator counted them by status.
  const auto cm = c->metrics(c->http_port);
  EXPECT_GE(cm.at("spade_http_requests_total{endpoint=\"/v1/completions\",code=\"400\"}"), 10);
}

TEST_F(OpenAiApi, Http10ClientGetsACloseDelimitedStream) {
  // An HTTP/1.0 client (no chunked encoding) streams the same text as an HTTP/1.1 one.
  const std::string body =
      R"({"model":"stories260K","prompt":[1],"max_tokens":30,"temperature":0,"stream":true})";
  const auto v11 = c->post("/v1/completions", body);
  ASSERT_EQ(v11.status, 200) << v11.body;
  RawClient rc(c->http_port);
  rc.send("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body);
  ASSERT_TRUE(rc.eof(60s)) << "the stream did not end with the connection";
  const std::string all = rc.read_until("", 1, 0ms);
  const size_t hdr_end = all.find("\r\n\r\n");
  ASSERT_NE(hdr_end, std::string::npos) << all;
  const std::string hdr = all.substr(0, hdr_end);
  EXPECT_THAT(hdr, HasSubstr(" 200 "));
  EXPECT_THAT(hdr, HasSubstr("Content-Type: text/event-stream"));
  EXPECT_THAT(hdr, HasSubstr("Connection: close"));
  EXPECT_EQ(hdr.find("Transfer-Encoding"), std::string::npos) << hdr;
  const Sse s10 = parse_sse(all.substr(hdr_end + 4), false);
  const Sse s11 = parse_sse(v11.body, false);
  EXPECT_TRUE(s10.done);
  EXPECT_EQ(s10.text, s11.text);
  EXPECT_FALSE(s10.text.empty());
}

TEST_F(OpenAiApi, ClientDisconnectCancelsTheRequestAndFreesItsKvOnBothRanks) {
  const auto before = idle_inference_metrics();
  {
    RawClient rc(c->http_port);
    rc.post("/v1/completions", R"({"model":"stories260K","prompt":[1],"max_tokens":480,"temperature":0,"stream":true})");
    // Past the sparse threshold (32) so the cache rank holds this sequence's KV, then hang up.
    rc.read_until("data: ", 60);
    const auto mid_inf = c->metrics(c->inference_metrics_port);
    const auto mid_cache = c->metrics(c->cache_metrics_port);
    EXPECT_GT(mid_inf.at("spade_kv_cache_usage_perc"), 0);
    EXPECT_EQ(mid_cache.at("spade_cache_sequences"), 1) << "the sequence never reached the cache rank";
    EXPECT_GT(mid_cache.at("spade_cache_kv_usage_perc"), 0);
  }
  // Cancelled on the inference rank (abort), KV freed on both ranks, long before max_tokens.
  std::map<std::string, double> inf, cache;
  for (auto until = std::chrono::steady_clock::now() + 20s; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(50ms)) {
    inf = c->metrics(c->inference_metrics_port);
    cache = c->metrics(c->cache_metrics_port);
    if (inf.at("spade_request_success_total{finished_reason=\"abort\"}") >
            before.at("spade_request_success_total{finished_reason=\"abort\"}") &&
        inf.at("spade_kv_cache_usage_perc") == 0 && cache.at("spade_cache_sequences") == 0 &&
        cache.at("spade_cache_kv_usage_perc") == 0)
      break;
  }
  EXPECT_EQ(inf.at("spade_request_success_total{finished_reason=\"abort\"}") -
                before.at("spade_request_success_total{finished_reason=\"abort\"}"),
            1);
  EXPECT_EQ(inf.at("spade_num_requests_running"), 0);
  EXPECT_EQ(inf.at("spade_kv_cache_usage_perc"), 0);
  EXPECT_EQ(cache.at("spade_cache_sequences"), 0);
  EXPECT_EQ(cache.at("spade_cache_kv_usage_perc"), 0);
  EXPECT_LT(inf.at("spade_generation_tokens_total") - before.at("spade_generation_tokens_total"), 480)
      << "the request ran to max_tokens instead of being cancelled";
  const auto cm = c->metrics(c->http_port);
  EXPECT_GE(cm.at("spade_api_client_disconnects_total"), 1);
  EXPECT_EQ(cm.at("spade_api_requests_in_flight"), 0);
}

TEST_F(OpenAiApi, RequestsBeyondMaxNumRequestsGet429) {
  // Two streams held open (the limit is 2), the third is refused without reaching a rank.
  RawClient a(c->http_port), b(c->http_port);
  const std::string hold = R"({"model":"stories260K","prompt":[1],"max_tokens":480,"temperature":0,"stream":true})";
  a.post("/v1/completions", hold);
  b.post("/v1/completions", hold);
  a.read_until("data: ");
  b.read_until("data: ");
  auto r = c->post("/v1/completions", R"({"model":"stories260K","prompt":"hi","max_tokens":2})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_THAT(r.body, HasSubstr("rate_limit_exceeded"));
  a.close();
  b.close();
  for (auto until = std::chrono::steady_clock::now() + 20s; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(50ms))
    if (c->metrics(c->http_port).at("spade_api_requests_in_flight") == 0) break;
  EXPECT_EQ(c->post("/v1/completions", R"({"model":"stories260K","prompt":"hi","max_tokens":2})").status, 200);
}

TEST_F(OpenAiApi, SpadeFieldsSelectDenseDecodingPerRequest) {
  const std::string base = R"({"model":"stories260K","prompt":[1],"max_tokens":60,"temperature":0)";
  auto switches = [&] { return idle_inference_metrics().at("spade_sparse_switches_total"); };
  const double s0 = switches();
  auto dense = c->post("/v1/completions", base + R"(,"spade":{"selection":"dense"}})");
  ASSERT_EQ(dense.status, 200) << dense.body;
  EXPECT_EQ(switches(), s0) << "a dense request went sparse";
  auto late = c->post("/v1/completions", base + R"(,"spade":{"selection":"auto","sparse_threshold":500}})");
  ASSERT_EQ(late.status, 200);
  EXPECT_EQ(switches(), s0) << "sparse_threshold 500 was not honoured";
  auto sparse = c->post("/v1/completions", base + "}");
  ASSERT_EQ(sparse.status, 200);
  EXPECT_EQ(switches(), s0 + 1);
  // A request's own token budget: at most 4 tokens per (layer, KV head) and step reach the inference rank.
  const auto cache0 = c->metrics(c->cache_metrics_port);
  const auto inf0 = idle_inference_metrics();
  auto small = c->post("/v1/completions", base + R"(,"spade":{"token_budget":4}})");
  ASSERT_EQ(small.status, 200) << small.body;
  const auto inf1 = idle_inference_metrics();
  const auto cache1 = c->metrics(c->cache_metrics_port);
  const json cfg = json::parse(read_file(c->model + "/config.json"));
  const double per_step = 4.0 * cfg["num_hidden_layers"].get<int>() * cfg["num_key_value_heads"].get<int>();
  const double sparse_steps = inf1.at("spade_sparse_sequence_steps_total") - inf0.at("spade_sparse_sequence_steps_total");
  const double selected = cache1.at("spade_selected_tokens_total") - cache0.at("spade_selected_tokens_total");
  EXPECT_GT(sparse_steps, 20);
  EXPECT_GT(selected, 0);
  EXPECT_LE(selected, per_step * (sparse_steps + 1)) << "the request's token budget was not honoured";
  EXPECT_NE(json::parse(small.body)["choices"][0]["text"], json::parse(sparse.body)["choices"][0]["text"])
      << "4 tokens per head should change a 60-token greedy continuation";
  auto too_big = c->post("/v1/completions", base + R"(,"spade":{"token_budget":513}})");
  EXPECT_EQ(too_big.status, 400) << too_big.body;
  EXPECT_THAT(too_big.body, HasSubstr("'spade.token_budget' must be an integer in [1, 512]"));
  // Budget above the context: all three agree.
  EXPECT_EQ(json::parse(dense.body)["choices"][0]["text"], json::parse(sparse.body)["choices"][0]["text"]);
  EXPECT_EQ(json::parse(late.body)["choices"][0]["text"], json::parse(sparse.body)["choices"][0]["text"]);
}

TEST_F(OpenAiApi, EveryMetricsEndpointPassesPromtool) {
  // Some traffic first so histograms and labelled series exist.
  ASSERT_EQ(c->post("/v1/completions", R"({"model":"stories260K","prompt":[1],"max_tokens":50,"temperature":0})").status,
            200);
  for (int port : {c->http_port, c->inference_metrics_port, c->cache_metrics_port})
    EXPECT_EQ(promtool_check_metrics(c->metrics_text(port)), "") << "on port " << port;
  const auto cache = c->metrics(c->cache_metrics_port);
  EXPECT_GT(cache.at("spade_selection_time_seconds_count"), 0);
  EXPECT_GT(cache.at("spade_selection_overlap_ratio_count"), 0) << "overlap sampling never ran";
  const auto coord = c->metrics(c->http_port);
  EXPECT_EQ(coord.at("spade_rank_up{role=\"cache\",rank=\"2\",role_index=\"0\"}"), 1);
  EXPECT_EQ(coord.at("spade_rank_up{role=\"inference\",rank=\"1\",role_index=\"0\"}"), 1);
}

TEST_F(OpenAiApi, OfficialOpenAiNodeClient) {
  const std::string dir = std::string(SPADE_SOURCE_DIR) + "/tests/coordinator/openai_client";
  ASSERT_EQ(::access((dir + "/node_modules/openai/package.json").c_str(), R_OK), 0)
      << "the openai npm package is not installed: run `npm ci` in " << dir
      << " (deploy/scripts/setup_deps.sh does)";
  ChildProcess node("/usr/bin/env",
                    {"node", dir + "/chat.mjs", "http://127.0.0.1:" + std::to_string(c->http_port) + "/v1",
                     "stories260K", "http://127.0.0.1:" + std::to_string(c->inference_metrics_port) + "/metrics"},
                    {}, "node openai client");
  const int rc = node.wait_exit(120s);
  EXPECT_EQ(rc, 0) << node.log();
  EXPECT_THAT(node.log(), HasSubstr("\"ok\":true"));
  std::printf("[ node     ] %s\n", node.log().c_str());
}

}  // namespace
}  // namespace spade::test

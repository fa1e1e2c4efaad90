// logprobs / top_logprobs through the coordinator's OpenAI API against a real local cluster (coordinator + inference
// rank + cache rank processes, stories260K, predicted sparse selection with a budget above the context): OpenAI's
// shapes for chat (choices[0].logprobs.content[] = {token, logprob, bytes, top_logprobs[]}) and completions
// ({tokens, token_logprobs, top_logprobs, text_offset}), streamed chunks carrying exactly the non-streamed entries,
// raw mode (the alternatives of the first token do not depend on temperature), the sampled token's value equal to its
// entry among the alternatives, and "logprobs": null when not asked for.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using json = nlohmann::json;

class OpenAiLogprobs : public ::testing::Test {
 protected:
  static ApiCluster* c;
  static void SetUpTestSuite() {
    c = new ApiCluster();
    ClusterOptions o;
    o.inference_flags = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "512",
                         "--local-window", "8", "--sink-tokens", "4"};
    o.cache_flags = {"--token-budget", "512", "--local-window", "8", "--sink-tokens", "4"};
    c->start_coordinator(o);
    c->start_ranks(o);
    ASSERT_TRUE(c->wait_ready(c->http_port)) << c->logs();
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
  /// The events of an SSE body.
  static std::vector<json> post_stream(const std::string& path, json body) {
    body["stream"] = true;
    const auto r = c->post(path, body.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    std::vector<json> ev;
    for (const std::string& payload : sse_payloads(r.body)) {
      if (payload != "[DONE]") ev.push_back(json::parse(payload));
    }
    return ev;
  }
  static json chat_body(int top, float temperature = 0) {
    return {{"model", "stories260K"},
            {"messages", json::array({{{"role", "user"}, {"content", "Once upon a time"}}})},
            {"max_tokens", 24},
            {"temperature", temperature},
            {"seed", 5},
            {"logprobs", true},
            {"top_logprobs", top}};
  }
  static json completion_body(int n, float temperature = 0) {
    return {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 24},
            {"temperature", temperature}, {"seed", 5}, {"logprobs", n}};
  }
};
ApiCluster* OpenAiLogprobs::c = nullptr;

/// bytes (an array of 0..255) as a string.
std::string bytes_of(const json& b) {
  std::string s;
  for (const json& x : b) {
    EXPECT_TRUE(x.is_number_integer() && x.get<int>() >= 0 && x.get<int>() <= 255) << b.dump();
    s.push_back(static_cast<char>(x.get<int>()));
  }
  return s;
}

/// Checks one chat logprobs entry's shape; returns its bytes.
std::string check_chat_entry(const json& e, size_t top, bool greedy) {
  EXPECT_EQ(e.size(), 4u) << e.dump();
  EXPECT_TRUE(e["token"].is_string()) << e.dump();
  EXPECT_TRUE(e["logprob"].is_number() && e["logprob"].get<double>() <= 0) << e.dump();
  EXPECT_TRUE(e["bytes"].is_array()) << e.dump();
  const json& t = e["top_logprobs"];
  EXPECT_TRUE(t.is_array() && t.size() == top) << e.dump();
  double mass = 0, prev = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].size(), 3u) << t[i].dump();
    EXPECT_TRUE(t[i]["token"].is_string() && t[i]["bytes"].is_array()) << t[i].dump();
    const double v = t[i]["logprob"].get<double>();
    if (i > 0) {
      EXPECT_LE(v, prev) << "alternatives most likely first: " << t.dump();
    }
    prev = v;
    mass += std::exp(v);
    if (t[i]["bytes"] == e["bytes"]) {
      EXPECT_EQ(v, e["logprob"].get<double>()) << "the sampled token's entry among the alternatives: " << e.dump();
    }
  }
  EXPECT_LE(mass, 1.0 + 1e-5) << t.dump();
  if (greedy && !t.empty()) {
    EXPECT_EQ(t[0]["bytes"], e["bytes"]) << "greedy: the most likely token was sampled: " << e.dump();
  }
  return bytes_of(e["bytes"]);
}

TEST_F(OpenAiLogprobs, ChatShapesStreamedEqualsWholeAndRawMode) {
  const json w = post("/v1/chat/completions", chat_body(3));
  ASSERT_TRUE(w.contains("choices")) << w.dump();
  const json& lp = w["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.is_object()) << w.dump();
  EXPECT_TRUE(lp["refusal"].is_null());
  const json& content = lp["content"];
  ASSERT_TRUE(content.is_array());
  EXPECT_EQ(content.size(), w["usage"]["completion_tokens"].get<size_t>());
  std::string all;
  for (const json& e : content) all += check_chat_entry(e, 3, true);
  // The tokens' bytes spell the answer (the SentencePiece decoder strips one leading space of the text).
  const std::string text = w["choices"][0]["message"]["content"];
  EXPECT_TRUE(all == text || all == " " + text) << all << " | " << text;

  // Streamed: the chunks' entries, in order, are the whole answer's; the role chunk has none.
  const std::vector<json> ev = post_stream("/v1/chat/completions", chat_body(3));
  ASSERT_GE(ev.size(), 2u);
  EXPECT_TRUE(ev.front()["choices"][0]["logprobs"].is_null());
  json streamed = json::array();
  for (const json& e : ev)
    for (const json& ch : e["choices"])
      if (!ch["logprobs"].is_null())
        for (const json& x : ch["logprobs"]["content"]) streamed.push_back(x);
  EXPECT_EQ(streamed, content);

  // Raw mode: the first token's alternatives come from the model's logits, whatever the temperature.
  const json hot = post("/v1/chat/completions", chat_body(5, 1.5f));
  const json cold = post("/v1/chat/completions", chat_body(5, 0.f));
  ASSERT_FALSE(hot["choices"][0]["logprobs"]["content"].empty());
  EXPECT_EQ(hot["choices"][0]["logprobs"]["content"][0]["top_logprobs"],
            cold["choices"][0]["logprobs"]["content"][0]["top_logprobs"]);
  for (const json& e : hot["choices"][0]["logprobs"]["content"]) check_chat_entry(e, 5, false);

  // logprobs without top_logprobs: empty alternatives; not asked for: null.
  json b = chat_body(0);
  b.erase("top_logprobs");
  for (const json& e : post("/v1/chat/completions", b)["choices"][0]["logprobs"]["content"])
    check_chat_entry(e, 0, true);
  b.erase("logprobs");
  EXPECT_TRUE(post("/v1/chat/completions", b)["choices"][0]["logprobs"].is_null());
  for (const json& e : post_stream("/v1/chat/completions", b))
    for (const json& ch : e["choices"]) EXPECT_TRUE(ch["logprobs"].is_null());
}

TEST_F(OpenAiLogprobs, CompletionsShapesStreamedEqualsWhole) {
  const json w = post("/v1/completions", completion_body(2));
  ASSERT_TRUE(w.contains("choices")) << w.dump();
  const json& lp = w["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.is_object()) << w.dump();
  EXPECT_EQ(lp.size(), 4u);
  const size_t n = w["usage"]["completion_tokens"].get<size_t>();
  ASSERT_EQ(lp["tokens"].size(), n);
  ASSERT_EQ(lp["token_logprobs"].size(), n);
  ASSERT_EQ(lp["top_logprobs"].size(), n);
  ASSERT_EQ(lp["text_offset"].size(), n);
  size_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string tok = lp["tokens"][i];
    const double v = lp["token_logprobs"][i];
    EXPECT_LE(v, 0);
    const json& top = lp["top_logprobs"][i];
    ASSERT_TRUE(top.is_object());
    EXPECT_TRUE(top.size() == 2 || top.size() == 3) << top.dump();  // the alternatives + the sampled token
    ASSERT_TRUE(top.contains(tok)) << top.dump();
    EXPECT_EQ(top[tok].get<double>(), v);
    double best = -1e9;
    for (const auto& [k, x] : top.items()) best = std::max(best, x.get<double>());
    EXPECT_EQ(v, best) << "greedy: the sampled token is the most likely";
    EXPECT_EQ(lp["text_offset"][i].get<size_t>(), offset);
    size_t cps = 0;
    for (unsigned char ch : tok) cps += (ch & 0xC0) != 0x80;
    offset += cps;
  }
  const std::vector<json> ev = post_stream("/v1/completions", completion_body(2));
  json cat = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  for (const json& e : ev)
    for (const json& ch : e["choices"])
      if (!ch["logprobs"].is_null())
        for (const char* k : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
          for (const json& x : ch["logprobs"][k]) cat[k].push_back(x);
  EXPECT_EQ(cat, lp);
  // logprobs 0: only the sampled token in each dict.
  for (const json& top : post("/v1/completions", completion_body(0))["choices"][0]["logprobs"]["top_logprobs"])
    EXPECT_EQ(top.size(), 1u) << top.dump();
}

}  // namespace
}  // namespace spade::test

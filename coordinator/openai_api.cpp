#include "coordinator/openai_api.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <unordered_set>

#include "common/error.h"
#include "common/sampling.h"  // kMaxTopLogprobs
#include "coordinator/client.h"   // kMaxSamplesPerRequest

namespace spade::coord {

using json = nlohmann::json;

namespace {

const char* error_type(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 405: return "invalid_request_error";
    case 413: return "invalid_request_error";
    case 415: return "invalid_request_error";
    case 429: return "rate_limit_exceeded";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

/// An error answered before anything reaches a rank.
struct ApiError {
  ApiError(int s, std::string m, std::string p = "", std::string c = "")
      : status(s), message(std::move(m)), param(std::move(p)), code(std::move(c)) {}
  int status;
  std::string message;
  std::string param;
  std::string code;
};

[[noreturn]] void bad(const std::string& message, const std::string& param = "", const std::string& code = "") {
  throw ApiError{400, message, param, code};
}

/// Length of the longest prefix of `s` that does not end inside a UTF-8 sequence.
size_t utf8_safe_prefix(const std::string& s, size_t end) {
  size_t i = end;
  // Walk back over at most 3 continuation bytes to the lead byte; keep the sequence only if it is complete.
  size_t back = 0;
  while (i > 0 && back < 4 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i, ++back;
  if (i == 0) return end;
  const auto lead = static_cast<unsigned char>(s[i - 1]);
  size_t need = lead < 0x80 ? 0 : (lead & 0xE0) == 0xC0 ? 1 : (lead & 0xF0) == 0xE0 ? 2 : (lead & 0xF8) == 0xF0 ? 3 : 0;
  if (lead < 0x80) return end;
  return back >= need ? end : i - 1;
}

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}{:016x}{:08x}", prefix, rng(), static_cast<uint32_t>(rng()));
}

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

// ---- the request body: parsed with bounds, fields read with OpenAI-style messages ----

/// /v1/completions' integer logprobs is at most this (OpenAI's bound; chat's top_logprobs goes to kMaxTopLogprobs).
constexpr int kMaxCompletionLogprobs = 5;

/// A logprob as JSON: -inf (probability 0) as -9999.0, the value vLLM sends (JSON has no infinity).
double logprob_json(float v) { return std::isfinite(v) ? static_cast<double>(v) : -9999.0; }

/// Nesting deeper than this is refused while parsing (no request field nests more than a few levels).
constexpr int kMaxJsonDepth = 64;

/// `s` cut to at most `n` bytes without splitting a UTF-8 character, "..." appended when cut.
std::string clip(const std::string& s, size_t n = 40) {
  if (s.size() <= n) return s;
  return s.substr(0, utf8_safe_prefix(s, n)) + "...";
}

/// A short, safe description of a JSON value for an error message: scalars as JSON (strings clipped), containers
/// by kind (never dumped: they may be deep or large).
std::string describe(const json& v) {
  if (v.is_string()) return "\"" + clip(v.get<std::string>()) + "\"";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return v.dump();  // number, boolean, null
}

/// Parses the body as one JSON value: throws ApiError 400 for malformed JSON, a number out of double range
/// (1e999), nesting deeper than kMaxJsonDepth, or an object with a repeated key (which one counts is
/// ambiguous, so neither does).
json parse_body(const std::string& text) {
  std::vector<std::optional<std::unordered_set<std::string>>> open;  // per open container: its keys (objects)
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (open.size() >= static_cast<size_t>(kMaxJsonDepth))
          bad(fmt::format("request body nests JSON deeper than {} levels", kMaxJsonDepth));
        open.emplace_back();
        if (ev == json::parse_event_t::object_start) open.back().emplace();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open.empty() && open.back() && !open.back()->insert(parsed.get<std::string>()).second)
          bad(fmt::format("request body has the key \"{}\" twice in one object", clip(parsed.get<std::string>())),
              clip(parsed.get<std::string>()));
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, cb);
  } catch (const json::out_of_range& e) {  // 406: a number that does not fit a double
    bad(fmt::format("request body is not valid JSON: a number is out of range ({})", e.what()));
  } catch (const json::exception& e) {
    bad(fmt::format("request body is not valid JSON: {}", e.what()));
  }
}

/// The field `name` of an object, or nullptr when it is absent or null (OpenAI's optional fields).
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

/// What a required field holds, for an error message: "nothing" when absent, else describe().
std::string describe_field(const json& obj, const char* name) {
  auto it = obj.find(name);
  return it == obj.end() ? std::string("nothing") : describe(*it);
}

/// The value of an integral JSON number that fits int64 (a float with an integral value counts, as 5.0 does in
/// Python's json); nullopt for anything else.
std::optional<int64_t> as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // 2^63 is exact in a double; every integral double below it in magnitude converts without overflow.
    if (std::isfinite(d) && d == std::trunc(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0)
      return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

std::optional<double> get_number(const json& body, const char* name, double lo, double hi, bool lo_open = false) {
  const json* f = field(body, name);
  if (!f) return std::nullopt;
  if (!f->is_number()) bad(fmt::format("'{}' must be a number, got {}", name, describe(*f)), name);
  const double v = f->get<double>();
  if (!std::isfinite(v) || !(lo_open ? v > lo : v >= lo) || v > hi)
    bad(fmt::format("'{}' must be in {}{}, {}], got {}", name, lo_open ? "(" : "[", lo, hi, v), name);
  return v;
}

/// An integer field in int64 range (wider values, fractions and other types are 400s naming the field).
std::optional<int64_t> get_int(const json& body, const char* name) {
  const json* f = field(body, name);
  if (!f) return std::nullopt;
  if (auto v = as_int64(*f)) return v;
  if (f->is_number())
    bad(fmt::format("'{}' must be an integer in [-2^63, 2^63), got {}", name, describe(*f)), name);
  bad(fmt::format("'{}' must be an integer, got {}", name, describe(*f)), name);
}

std::optional<bool> get_bool(const json& body, const char* name) {
  const json* f = field(body, name);
  if (!f) return std::nullopt;
  if (!f->is_boolean()) bad(fmt::format("'{}' must be a boolean, got {}", name, describe(*f)), name);
  return f->get<bool>();
}

/// A string field (other types are 400s naming the field).
std::optional<std::string> get_string(const json& body, const char* name, const std::string& param) {
  const json* f = field(body, name);
  if (!f) return std::nullopt;
  if (!f->is_string()) bad(fmt::format("'{}' must be a string, got {}", param, describe(*f)), param);
  return f->get<std::string>();
}

/// Content-Type as FastAPI (and so vLLM) reads a JSON body: absent, application/json or application/*+json
/// (any parameters, any case) parse as JSON; anything else is 415.
void check_content_type(const http::HttpRequest& req) {
  auto it = req.headers.find("content-type");
  if (it == req.headers.end()) return;
  std::string mime = it->second.substr(0, it->second.find(';'));
  mime.erase(0, mime.find_first_not_of(" \t"));
  mime.erase(mime.find_last_not_of(" \t") + 1);
  for (auto& c : mime) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool json_type = mime == "application/json" ||
                         (mime.rfind("application/", 0) == 0 && mime.size() > 17 && mime.ends_with("+json"));
  if (!json_type)
    throw ApiError{415,
                   fmt::format("Content-Type '{}' is not supported: send the request body as application/json",
                               clip(it->second, 100)),
                   "", "unsupported_media_type"};
}

std::string finish_reason_text(proto::FinishReason r) {
  switch (r) {
    case proto::FINISH_STOP: return "stop";
    case proto::FINISH_LENGTH: return "length";
    case proto::FINISH_CANCELLED: return "abort";
    case proto::FINISH_ERROR: return "error";
    default: return "stop";
  }
}

}  // namespace

std::string openai_error_json(int status, const std::string& message, const std::string& param,
                              const std::string& code) {
  json e = {{"message", message},
            {"type", error_type(status)},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  // Replace, never throw, should a message carry bytes that are not UTF-8.
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

// ---------------------------------------------------------------------------------------------------------------

struct OpenAiApi::Impl : std::enable_shared_from_this<OpenAiApi::Impl> {
  ApiOptions opt;
  CoordinatorServer& server;
  ModelConfig config;
  GenerationConfig gen;
  Tokenizer tok;
  ChatTemplate chat;
  std::string name;
  int max_len = 0;
  int64_t created = unix_now();
  std::atomic<int> in_flight{0};
  metrics::Family<metrics::Counter>& http_requests;
  metrics::Gauge& in_flight_gauge;
  metrics::Counter& cancelled_disconnect;
  metrics::Histogram& api_e2e;
  metrics::Histogram& vllm_ttft;  // vLLM's names, label model_name (docs/DEPLOY.md, "Metrics")
  metrics::Histogram& vllm_e2e;
  metrics::Histogram& api_n;   // the n parameter (samples per request), counted when the request ends
  metrics::Histogram& vllm_n;
  std::optional<boost::asio::thread_pool::executor_type> workers;  // set by OpenAiApi; the pool is OpenAiApi's

  Impl(ApiOptions o, CoordinatorServer& s, metrics::Registry& reg)
      : opt(std::move(o)),
        server(s),
        config(load_model_config(opt.model_dir)),
        gen(load_generation_config(opt.model_dir, config)),
        tok(Tokenizer::from_dir(opt.model_dir)),
        chat(opt.chat_template_file.empty() ? ChatTemplate::for_tokenizer(tok) : load_template(opt.chat_template_file)),
        http_requests(reg.counter("spade_http_requests_total", "HTTP API requests by endpoint and status code.",
                                  {"endpoint", "code"})),
        in_flight_gauge(reg.gauge("spade_api_requests_in_flight", "Generation requests in flight through the API.")
                            .with()),
        cancelled_disconnect(reg.counter("spade_api_client_disconnects_total",
                                         "Requests cancelled because their client disconnected before the end.")
                                 .with()),
        api_e2e(reg.histogram("spade_api_e2e_request_latency_seconds",
                              "End-to-end latency of API generation requests as the client sees it.",
                              metrics::latency_buckets_seconds())
                    .with()),
        vllm_ttft(reg.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                metrics::latency_buckets_seconds(), {"model_name"})
                      .with({served_model_name(opt)})),
        vllm_e2e(reg.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               metrics::vllm_request_latency_buckets(), {"model_name"})
                     .with({served_model_name(opt)})),
        api_n(reg.histogram("spade_api_request_params_n",
                            "The n parameter (samples of one prompt) of API generation requests.",
                            metrics::vllm_request_n_buckets())
                  .with()),
        vllm_n(reg.histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                             metrics::vllm_request_n_buckets(), {"model_name"})
                   .with({served_model_name(opt)})) {
    name = served_model_name(opt);
    max_len = opt.max_model_len > 0 ? opt.max_model_len : config.max_position_embeddings;
    SPADE_CHECK(max_len > 0, "{}: no max_position_embeddings in config.json; pass --max-model-len", opt.model_dir);
    SPADE_CHECK(opt.max_num_requests > 0, "--max-num-requests must be > 0");
    SPADE_CHECK(opt.request_threads > 0, "ApiOptions::request_threads must be > 0, got {}", opt.request_threads);
  }

  static ChatTemplate load_template(const std::string& file) {
    return ChatTemplate::from_file(file);  // a regular file only (common/file_read.h), read without blocking
  }

  void reply(http::HttpResponder& res, const std::string& endpoint, int status, const std::string& body) {
    http_requests.with({endpoint, std::to_string(status)}).inc();
    res.send(status, "application/json", body);
  }
  void reply_error(http::HttpResponder& res, const std::string& endpoint, const ApiError& e) {
    if (e.status >= 500 || e.status == 429) {
      spdlog::warn("coordinator API: {} {}: {}", endpoint, e.status, e.message);
    } else {
      spdlog::info("coordinator API: {} {}: {}", endpoint, e.status, e.message);
    }
    reply(res, endpoint, e.status, openai_error_json(e.status, e.message, e.param, e.code));
  }

  // On the HTTP io thread: routing, method, Content-Type and admission only (all cheap); a generation request
  // is then parsed, validated, tokenized and submitted on a worker thread (run_generate).
  void handle(const http::HttpRequest& req, std::shared_ptr<http::HttpResponder> res) {
    std::string endpoint = req.path;
    try {
      if (req.path == "/v1/models") {
        if (req.method != "GET" && req.method != "HEAD")
          throw ApiError{405, fmt::format("use GET for {}, not {}", req.path, clip(req.method))};
        json m = {{"id", name},       {"object", "model"}, {"created", created}, {"owned_by", "spade"},
                  {"root", opt.model_dir}, {"max_model_len", max_len}};
        return reply(*res, endpoint, 200, json{{"object", "list"}, {"data", json::array({m})}}.dump());
      }
      if (req.path == "/v1/completions" || req.path == "/v1/chat/completions") {
        if (req.method != "POST")
          throw ApiError{405, fmt::format("use POST for {}, not {}", req.path, clip(req.method))};
        check_content_type(req);
        admit();  // 429 before the body is even parsed: at most max_num_requests bodies wait or run
        boost::asio::post(*workers, [self = shared_from_this(), req, res, is_chat = req.path == "/v1/chat/completions"] {
          self->run_generate(req, res, is_chat);
        });
        return;
      }
      endpoint = "other";
      throw ApiError{404, fmt::format("no such endpoint: {} {}", clip(req.method), clip(req.path, 200)), "",
                     "not_found"};
    } catch (const ApiError& e) {
      reply_error(*res, endpoint, e);
    }
  }

  /// Takes one of the max_num_requests slots (throws ApiError 429 when none is free); release() gives it back.
  void admit() {
    if (in_flight.fetch_add(1) >= opt.max_num_requests) {
      in_flight.fetch_sub(1);
      throw ApiError{429, fmt::format("too many requests in flight ({} at most); retry later", opt.max_num_requests),
                     "", "rate_limit_exceeded"};
    }
    in_flight_gauge.inc();
  }
  void release() {
    in_flight.fetch_sub(1);
    in_flight_gauge.dec();
  }

  // On a worker thread, holding a slot: every outcome is answered here or by the Job that takes the slot over.
  // Any exception from the request's content is a 4xx; only a failure of Spade itself is a 500.
  void run_generate(const http::HttpRequest& req, const std::shared_ptr<http::HttpResponder>& res, bool is_chat) {
    const std::string& endpoint = req.path;
    bool handed_over = false;  // the Job owns the slot
    try {
      if (res->closed()) {  // the client left while the request waited for a worker
        http_requests.with({endpoint, "499"}).inc();
      } else {
        generate(req, res, is_chat, handed_over);
      }
    } catch (const ApiError& e) {
      reply_error(*res, endpoint, e);
    } catch (const Error& e) {  // tokenizer / template errors on user input
      reply_error(*res, endpoint, ApiError{400, e.what()});
    } catch (const json::exception& e) {  // a shape of JSON no check above foresaw: still the client's input
      reply_error(*res, endpoint, ApiError{400, fmt::format("invalid request: {}", e.what())});
    } catch (const std::exception& e) {
      spdlog::error("coordinator API: {} failed: {}", endpoint, e.what());
      reply_error(*res, endpoint, ApiError{500, fmt::format("internal error: {}", e.what())});
    } catch (...) {
      spdlog::error("coordinator API: {} failed with an unknown exception", endpoint);
      reply_error(*res, endpoint, ApiError{500, "internal error"});
    }
    if (!handed_over) release();
  }

  // ---- generation ----

  struct Job;
  /// Validates and submits one generation request (throws ApiError/Error/json::exception for bad input); sets
  /// `handed_over` once a Job owns the caller's slot.
  void generate(const http::HttpRequest& req, std::shared_ptr<http::HttpResponder> res, bool is_chat,
                bool& handed_over);
};

/// One API generation request: turns the rank's chunks into the OpenAI response (whole or SSE). With n > 1 the rank's
/// chunks of the n samples interleave (GenerateChunk.index); each becomes choices[index], with its own text, stop
/// strings, logprobs and finish_reason, and the response ends when every choice has.
struct OpenAiApi::Impl::Job : std::enable_shared_from_this<OpenAiApi::Impl::Job> {
  std::shared_ptr<Impl> api;
  std::shared_ptr<http::HttpResponder> res;
  std::string endpoint;
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;  // -1: none; else the alternatives per token (top_logprobs / completions' logprobs)
  std::vector<std::string> stops;
  size_t max_stop = 0;
  std::string id;
  int64_t created = 0;
  int prompt_tokens = 0;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();

  std::mutex mu;
  uint64_t routed_id = 0;
  bool done = false;
  bool started = false;  // stream headers sent
  int completion_tokens = 0;  // of every choice (usage: the prompt counts once)
  int open_choices = 1;       // choices not finished yet
  /// A generated token with its logprobs, not yet sent. `start` / `end`: its choice's `text` size before / after the
  /// chunk that carried it (a token is streamed with the delta that completes its text; a stop string drops the
  /// tokens that start at or after the cut).
  struct LpToken {
    uint32_t id;
    proto::TokenLogprobs lp;
    size_t start, end;
  };
  /// One sample of the prompt: choices[index].
  struct Choice {
    std::string text;      // generated text so far (after any stop truncation)
    size_t emitted = 0;    // bytes of `text` sent (stream)
    std::vector<LpToken> lp_pending;
    bool cut_text = false;   // a stop string ended the text
    size_t text_offset = 0;  // completions: code points of the token strings sent so far (vLLM's text_offset)
    bool finished = false;
    std::string finish_reason;
  };
  std::vector<Choice> choices;  // n of them

  /// A token's string and bytes (OpenAI: `token` is the text, `bytes` its exact bytes, which may be part of a UTF-8
  /// character: then the string has U+FFFD in its place).
  std::pair<std::string, json> token_text(uint32_t token_id) const {
    const std::string b = api->tok.token_bytes(static_cast<int32_t>(token_id));
    json bytes = json::array();
    for (unsigned char c : b) bytes.push_back(static_cast<int>(c));
    return {utf8_lossy(b), std::move(bytes)};
  }
  static size_t code_points(const std::string& s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
  }

  /// The choice's "logprobs" for `toks` in OpenAI's shape: chat {"content": [{token, logprob, bytes, top_logprobs:
  /// [{token, logprob, bytes}]}], "refusal": null}; completions {tokens, token_logprobs, top_logprobs (a dict per
  /// token: the alternatives and the sampled token, as vLLM), text_offset (advancing `c`'s)}. null when the request
  /// did not ask.
  json logprobs_json(Choice& c, const std::vector<LpToken>& toks) {
    if (logprobs < 0) return nullptr;
    if (chat) {
      json content = json::array();
      for (const LpToken& t : toks) {
        auto [s, b] = token_text(t.id);
        json top = json::array();
        for (int i = 0; i < t.lp.top_ids_size(); ++i) {
          auto [ts, tb] = token_text(t.lp.top_ids(i));
          top.push_back({{"token", ts}, {"logprob", logprob_json(t.lp.top_logprobs(i))}, {"bytes", tb}});
        }
        content.push_back(
            {{"token", s}, {"logprob", logprob_json(t.lp.logprob())}, {"bytes", b}, {"top_logprobs", top}});
      }
      return {{"content", content}, {"refusal", nullptr}};
    }
    json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
    for (const LpToken& t : toks) {
      const std::string s = token_text(t.id).first;
      tokens.push_back(s);
      values.push_back(logprob_json(t.lp.logprob()));
      json top = json::object();
      for (int i = 0; i < t.lp.top_ids_size(); ++i)
        top.emplace(token_text(t.lp.top_ids(i)).first, logprob_json(t.lp.top_logprobs(i)));
      top.emplace(s, logprob_json(t.lp.logprob()));  // no-op when the sampled token is among the alternatives
      tops.push_back(std::move(top));
      offsets.push_back(c.text_offset);
      c.text_offset += code_points(s);
    }
    return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }
  /// Takes `c`'s pending tokens whose text ends at or before `upto` (all of them: SIZE_MAX), in order.
  static std::vector<LpToken> take_lp(Choice& c, size_t upto) {
    size_t k = 0;
    while (k < c.lp_pending.size() && c.lp_pending[k].end <= upto) ++k;
    std::vector<LpToken> out(std::make_move_iterator(c.lp_pending.begin()),
                             std::make_move_iterator(c.lp_pending.begin() + static_cast<long>(k)));
    c.lp_pending.erase(c.lp_pending.begin(), c.lp_pending.begin() + static_cast<long>(k));
    return out;
  }

  json base_chunk() const {
    return json{{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
                {"model", api->name}};
  }
  json usage() const {
    return json{{"prompt_tokens", prompt_tokens},
                {"completion_tokens", completion_tokens},
                {"total_tokens", prompt_tokens + completion_tokens}};
  }
  void sse(const json& j) { res->write("data: " + j.dump() + "\n\n"); }

  /// One SSE chunk of choice `index`: text `delta`, `finish` ("" while it goes on) and the logprobs of `toks`.
  void send_delta(size_t index, const std::string& delta, const std::string& finish,
                  const std::vector<LpToken>& toks = {}) {
    json c = base_chunk();
    json choice = {{"index", index},
                   {"logprobs", toks.empty() ? json(nullptr) : logprobs_json(choices[index], toks)},
                   {"finish_reason", finish.empty() ? json(nullptr) : json(finish)}};
    if (chat) {
      choice["delta"] = finish.empty() || !delta.empty() ? json{{"content", delta}} : json::object();
    } else {
      choice["text"] = delta;
    }
    c["choices"] = json::array({choice});
    if (include_usage) c["usage"] = nullptr;
    sse(c);
  }

  void begin() {  // stream: headers and (chat) the role chunks right away
    if (!stream) return;
    std::lock_guard<std::mutex> lk(mu);
    begin_locked();
  }
  /// The stream's headers and (chat) one role chunk per choice, once: from begin() after the submit, or from the
  /// first chunk when the rank answers before the submitting worker gets there (else that chunk would be written
  /// before the headers).
  void begin_locked() {
    if (!stream || done || started) return;
    started = true;
    res->begin_stream(200, "text/event-stream", {{"X-Accel-Buffering", "no"}});
    if (chat) {
      for (size_t i = 0; i < choices.size(); ++i) {
        json c = base_chunk();
        c["choices"] = json::array(
            {{{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
              {"finish_reason", nullptr}}});
        if (include_usage) c["usage"] = nullptr;
        sse(c);
      }
    }
  }

  // Called on the coordinator io thread with each chunk of the rank.
  void on_chunk(const proto::GenerateChunk& ch) {
    std::lock_guard<std::mutex> lk(mu);
    if (done) return;
    if (ch.finish_reason() == proto::FINISH_ERROR || (!ch.error().empty() && ch.finished())) {
      return fail_locked(ch.error().empty() ? std::string("generation failed") : ch.error());
    }
    if (ch.index() >= choices.size())
      return fail_locked(fmt::format("the rank sent sample {} of a request with n = {}", ch.index(), choices.size()));
    const size_t index = ch.index();
    Choice& c = choices[index];
    if (c.finished) return;  // a stop string ended it; the rank's chunks still under way are not part of the answer
    begin_locked();
    if (completion_tokens == 0 && ch.token_ids_size() > 0)
      api->vllm_ttft.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    completion_tokens += ch.token_ids_size();
    if (logprobs >= 0) {
      if (ch.logprobs_size() != ch.token_ids_size())
        return fail_locked(fmt::format("the rank sent {} logprobs for {} tokens", ch.logprobs_size(),
                                       ch.token_ids_size()));
      for (int i = 0; i < ch.token_ids_size(); ++i)
        c.lp_pending.push_back({ch.token_ids(i), ch.logprobs(i), c.text.size(), c.text.size() + ch.text().size()});
    }
    c.text += ch.text();
    // Stop strings: search the part that could contain a new match.
    size_t cut = std::string::npos;
    if (!stops.empty()) {
      const size_t from = c.emitted > max_stop ? c.emitted - max_stop : 0;
      for (const auto& s : stops) {
        const size_t p = c.text.find(s, from);
        if (p != std::string::npos && p < cut) cut = p;
      }
    }
    if (cut != std::string::npos) {
      c.text.resize(cut);
      c.cut_text = true;
      finish_choice_locked(index, "stop");
      // The rest of this sample is not wanted: the whole request once every choice is done, else this sample alone.
      if (done) {
        api->server.cancel_local(routed_id, "stop string matched");
      } else {
        api->server.cancel_local(routed_id, "stop string matched", static_cast<uint32_t>(index));
      }
      return;
    }
    if (ch.finished()) return finish_choice_locked(index, finish_reason_text(ch.finish_reason()));
    if (stream) {
      // Hold back what could still become a stop string, and never split a UTF-8 character.
      const size_t hold = max_stop ? max_stop - 1 : 0;
      size_t safe = c.text.size() > hold ? c.text.size() - hold : 0;
      safe = utf8_safe_prefix(c.text, std::max(safe, c.emitted));
      if (safe > c.emitted) {
        send_delta(index, c.text.substr(c.emitted, safe - c.emitted), "", take_lp(c, safe));
        c.emitted = safe;
      }
    }
  }

  /// Choice `index` ended with `reason`: streamed, its rest and finish_reason go out now; the response ends with the
  /// last choice.
  void finish_choice_locked(size_t index, const std::string& reason) {
    Choice& c = choices[index];
    c.finished = true;
    c.finish_reason = reason;
    // A stop string cut the text: the tokens from the cut on are not part of the answer.
    while (c.cut_text && !c.lp_pending.empty() && c.lp_pending.back().start >= c.text.size()) c.lp_pending.pop_back();
    if (stream) {
      send_delta(index, c.text.substr(std::min(c.emitted, c.text.size())), reason,  // the rest (may be empty)
                 take_lp(c, std::numeric_limits<size_t>::max()));
      c.emitted = c.text.size();
    }
    if (--open_choices == 0) finish_locked();
  }

  void finish_locked() {
    done = true;
    const double e2e = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    api->api_e2e.observe(e2e);
    api->vllm_e2e.observe(e2e);
    api->api_n.observe(static_cast<double>(choices.size()));
    api->vllm_n.observe(static_cast<double>(choices.size()));
    if (stream) {
      if (include_usage) {
        json c = base_chunk();
        c["choices"] = json::array();
        c["usage"] = usage();
        sse(c);
      }
      res->write("data: [DONE]\n\n");
      res->end();
      api->http_requests.with({endpoint, "200"}).inc();
    } else {
      json out = json::array();
      for (size_t i = 0; i < choices.size(); ++i) {
        Choice& c = choices[i];
        json choice = {{"index", i},
                       {"logprobs", logprobs_json(c, take_lp(c, std::numeric_limits<size_t>::max()))},
                       {"finish_reason", c.finish_reason}};
        if (chat) {
          choice["message"] = {{"role", "assistant"}, {"content", c.text}};
        } else {
          choice["text"] = c.text;
        }
        out.push_back(std::move(choice));
      }
      json body = {{"id", id},
                   {"object", chat ? "chat.completion" : "text_completion"},
                   {"created", created},
                   {"model", api->name},
                   {"choices", std::move(out)},
                   {"usage", usage()}};
      api->reply(*res, endpoint, 200, body.dump());
    }
    release();
  }

  /// The request failed (any sample: OpenAI has no per-choice error): the response is the error, and whatever still
  /// runs of it on the rank is cancelled.
  void fail_locked(const std::string& error) {
    done = true;
    const bool unavailable = error.find("no live inference rank") != std::string::npos ||
                             error.find("world not complete") != std::string::npos ||
                             error.find("shutting down") != std::string::npos ||
                             error.find("is not alive") != std::string::npos;
    const bool invalid = error.find("invalid request: ") != std::string::npos;  // a rank's own validation
    const int status = unavailable ? 503 : invalid ? 400 : 500;
    spdlog::warn("coordinator API: {} request {} failed: {}", endpoint, routed_id, error);
    api->server.cancel_local(routed_id, "the request failed");  // its other samples (a finished route: ignored)
    if (stream && started) {
      sse(json::parse(openai_error_json(status, error)));
      res->write("data: [DONE]\n\n");
      res->end();
      api->http_requests.with({endpoint, std::to_string(status)}).inc();
    } else {
      api->reply(*res, endpoint, status, openai_error_json(status, error));
    }
    release();
  }

  void on_client_gone() {
    std::lock_guard<std::mutex> lk(mu);
    if (done) return;
    done = true;
    api->cancelled_disconnect.inc();
    api->http_requests.with({endpoint, "499"}).inc();  // nginx's "client closed request"
    spdlog::info("coordinator API: client of request {} disconnected; cancelling it", routed_id);
    api->server.cancel_local(routed_id, "client disconnected");
    release();
  }

  void release() { api->release(); }
};

void OpenAiApi::Impl::generate(const http::HttpRequest& req, std::shared_ptr<http::HttpResponder> res,
                               bool is_chat, bool& handed_over) {
  const std::string endpoint = req.path;
  if (!is_valid_utf8(req.body)) bad("request body is not valid UTF-8");
  const json body = parse_body(req.body);
  if (!body.is_object()) bad(fmt::format("request body must be a JSON object, got {}", body.type_name()));

  // model
  const json* model = field(body, "model");
  if (!model) bad("'model' is required", "model");
  if (!model->is_string()) bad(fmt::format("'model' must be a string, got {}", describe(*model)), "model");
  if (model->get<std::string>() != name)
    throw ApiError{404,
                   fmt::format("The model `{}` does not exist. This server serves `{}`.",
                               clip(model->get<std::string>(), 200), name),
                   "model", "model_not_found"};

  // features we do not have: reject rather than silently ignore
  // n samples of the prompt (its KV computed once on the rank); best_of (n samples ranked server-side) is not built.
  int64_t samples = 1;
  if (auto v = get_int(body, "n")) {
    if (*v < 1 || *v > kMaxSamplesPerRequest)
      bad(fmt::format("'n' must be an integer in [1, {}], got {}", kMaxSamplesPerRequest, *v), "n");
    samples = *v;
  }
  if (auto b = get_int(body, "best_of")) {
    if (*b != 1)
      bad(fmt::format("'best_of' is not supported (only 1), got {}; 'n' returns n samples, to rank client-side", *b),
          "best_of");
    if (samples > 1) bad(fmt::format("'best_of' (1) must be at least 'n' ({})", samples), "best_of");
  }
  if (auto e = get_bool(body, "echo"); e && *e) bad("echo is not supported", "echo");
  // logprobs (raw mode, common/sampling.h TokenLogprobs): chat takes logprobs (boolean) + top_logprobs (0..20),
  // completions an integer logprobs (0..5) = the number of alternatives.
  int logprobs = -1;  // -1: none; else the alternatives per token
  if (is_chat) {
    const std::optional<bool> on = get_bool(body, "logprobs");
    const std::optional<int64_t> top = get_int(body, "top_logprobs");
    if (top && (*top < 0 || *top > kMaxTopLogprobs))
      bad(fmt::format("'top_logprobs' must be an integer in [0, {}], got {}", kMaxTopLogprobs, *top), "top_logprobs");
    if (top && !on.value_or(false)) bad("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    if (on.value_or(false)) logprobs = static_cast<int>(top.value_or(0));
  } else {
    if (const auto n = get_int(body, "logprobs")) {
      if (*n < 0 || *n > kMaxCompletionLogprobs)
        bad(fmt::format("'logprobs' must be an integer in [0, {}], got {}", kMaxCompletionLogprobs, *n), "logprobs");
      logprobs = static_cast<int>(*n);
    }
    if (field(body, "top_logprobs"))
      bad(fmt::format("'top_logprobs' belongs to /v1/chat/completions; on /v1/completions 'logprobs' (0-{}) is the "
                      "number of alternatives",
                      kMaxCompletionLogprobs),
          "top_logprobs");
  }
  for (const char* f : {"suffix", "tools", "functions", "tool_choice", "function_call"})
    if (const json* x = field(body, f); x && !(x->is_array() && x->empty())) bad(fmt::format("'{}' is not supported", f), f);
  if (const json* rf = field(body, "response_format")) {
    if (!rf->is_object()) bad(fmt::format("'response_format' must be an object, got {}", describe(*rf)), "response_format");
    const std::string type = get_string(*rf, "type", "response_format.type").value_or("text");
    if (type != "text")
      bad(fmt::format("only response_format {{\"type\": \"text\"}} is supported, got type \"{}\"", clip(type)),
          "response_format");
  }
  if (const json* lb = field(body, "logit_bias"); lb && !(lb->is_object() && lb->empty()))
    bad("logit_bias is not supported", "logit_bias");

  // prompt
  std::vector<int32_t> ids;
  if (is_chat) {
    const json* msgs = field(body, "messages");
    if (!msgs) bad("'messages' is required", "messages");
    if (!msgs->is_array()) bad(fmt::format("'messages' must be an array, got {}", describe(*msgs)), "messages");
    if (msgs->empty()) bad("'messages' must contain at least one message", "messages");
    std::vector<ChatMessage> cm;
    for (size_t i = 0; i < msgs->size(); ++i) {
      const json& m = (*msgs)[i];
      const std::string p = fmt::format("messages[{}]", i);
      if (!m.is_object()) bad(fmt::format("{} must be an object, got {}", p, describe(m)), p);
      const json* role = field(m, "role");
      if (!role || !role->is_string())
        bad(fmt::format("{}.role must be a string, got {}", p, describe_field(m, "role")), p + ".role");
      const std::string r = role->get<std::string>();
      if (r != "system" && r != "user" && r != "assistant" && r != "developer")
        bad(fmt::format("{}.role '{}' is not supported (system, developer, user, assistant)", p, clip(r)), p + ".role");
      const json* content = field(m, "content");
      std::string text;
      if (!content) {
        bad(p + ".content is required", p + ".content");
      } else if (content->is_string()) {
        text = content->get<std::string>();
      } else if (content->is_array()) {  // [{"type": "text", "text": ...}, ...]
        for (size_t k = 0; k < content->size(); ++k) {
          const json& part = (*content)[k];
          const std::string pp = fmt::format("{}.content[{}]", p, k);
          if (!part.is_object()) bad(fmt::format("{} must be an object, got {}", pp, describe(part)), pp);
          const json* type = field(part, "type");
          if (!type || !type->is_string())
            bad(fmt::format("{}.type must be a string, got {}", pp, describe_field(part, "type")), pp + ".type");
          if (type->get<std::string>() != "text")
            bad(fmt::format("{}: only text parts are supported, got type \"{}\"", pp, clip(type->get<std::string>())),
                pp + ".type");
          const json* t = field(part, "text");
          if (!t || !t->is_string())
            bad(fmt::format("{}.text must be a string, got {}", pp, describe_field(part, "text")), pp + ".text");
          text += t->get<std::string>();
        }
      } else {
        bad(fmt::format("{}.content must be a string or an array of text parts, got {}", p, describe(*content)),
            p + ".content");
      }
      cm.push_back({r == "developer" ? "system" : r, std::move(text)});
    }
    ChatOptions co;
    if (auto agp = get_bool(body, "add_generation_prompt")) co.add_generation_prompt = *agp;
    if (const json* kw = field(body, "chat_template_kwargs")) {
      if (!kw->is_object())
        bad(fmt::format("'chat_template_kwargs' must be an object, got {}", describe(*kw)), "chat_template_kwargs");
      if (auto et = get_bool(*kw, "enable_thinking")) co.enable_thinking = *et;
    }
    ids = tok.encode(chat.render(cm, co), true);
  } else {
    const json* prompt = field(body, "prompt");
    if (!prompt) bad("'prompt' is required", "prompt");
    const json* p = prompt;
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
    if (p->is_string()) {
      const std::string text = p->get<std::string>();
      if (text.empty()) {
        const auto bos = tok.bos_id() ? *tok.bos_id() : gen.bos_token_id;
        if (bos < 0) bad("'prompt' is empty and the model has no BOS token", "prompt");
        ids = {bos};
      } else {
        ids = tok.encode(text, true);
      }
    } else if (p->is_array()) {
      if (p->empty()) bad("'prompt' must not be empty", "prompt");
      if (p->size() > static_cast<size_t>(max_len))
        bad(fmt::format("This model's maximum context length is {} tokens and your prompt has {} tokens.", max_len,
                        p->size()),
            "prompt", "context_length_exceeded");
      for (const json& t : *p) {
        const auto v = as_int64(t);
        if (!t.is_number() || !v)
          bad(fmt::format("'prompt' must be a string, an array of token ids or one of those in a list; got the "
                          "element {}",
                          describe(t)),
              "prompt");
        if (*v < 0 || *v >= config.vocab_size)
          bad(fmt::format("prompt token id {} is outside the vocabulary [0, {})", *v, config.vocab_size), "prompt");
        ids.push_back(static_cast<int32_t>(*v));
      }
    } else {
      bad(fmt::format("'prompt' must be a string or an array of token ids (one prompt per request), got {}",
                      describe(*p)),
          "prompt");
    }
  }
  if (ids.empty()) bad("the prompt encodes to no tokens", is_chat ? "messages" : "prompt");

  // max_tokens and the context: every value is bounded before any arithmetic (P <= body size, K < 2^63)
  const char* max_name = "max_tokens";
  std::optional<int64_t> max_tokens = get_int(body, "max_tokens");
  if (is_chat && !max_tokens) {
    max_tokens = get_int(body, "max_completion_tokens");
    if (max_tokens) max_name = "max_completion_tokens";
  }
  const int64_t P = static_cast<int64_t>(ids.size());
  if (max_tokens && *max_tokens <= 0)
    bad(fmt::format("'{}' must be at least 1, got {}", max_name, *max_tokens), max_name);
  const int64_t K = max_tokens ? *max_tokens : (is_chat ? std::max<int64_t>(1, max_len - P) : 16);
  if (K > max_len - P)  // no overflow: P + K might not fit int64
    bad(fmt::format("This model's maximum context length is {} tokens and your request has {} tokens ({} in the "
                    "prompt, {} to generate). Please reduce the length of the prompt or {}.",
                    max_len,
                    K <= std::numeric_limits<int64_t>::max() - P ? std::to_string(P + K) : std::string("over 2^63"),
                    P, K, max_name),
        is_chat ? "messages" : "prompt", "context_length_exceeded");

  // sampling
  proto::GenerateRequest g;
  for (int32_t id : ids) g.mutable_prompt_ids()->add_ids(static_cast<uint32_t>(id));
  g.set_max_tokens(static_cast<uint32_t>(K));
  auto* sp = g.mutable_sampling();
  sp->set_temperature(static_cast<float>(get_number(body, "temperature", 0, 2).value_or(gen.temperature)));
  sp->set_top_p(static_cast<float>(get_number(body, "top_p", 0, 1, true).value_or(gen.top_p)));
  if (auto k = get_int(body, "top_k")) {
    if (*k < -1 || *k > config.vocab_size) bad(fmt::format("'top_k' must be -1, 0 or in [1, {}], got {}", config.vocab_size, *k), "top_k");
    sp->set_top_k(*k > 0 ? static_cast<uint32_t>(*k) : 0);
  } else if (gen.top_k > 0) {
    sp->set_top_k(static_cast<uint32_t>(gen.top_k));
  }
  if (auto seed = get_int(body, "seed")) {
    sp->set_seed(static_cast<uint64_t>(*seed));
  } else {
    sp->set_seed(std::random_device{}());
  }
  if (auto ie = get_bool(body, "ignore_eos")) g.set_ignore_eos(*ie);  // vLLM's extension
  g.set_n(static_cast<uint32_t>(samples));
  g.set_logprobs(logprobs >= 0);
  g.set_top_logprobs(static_cast<uint32_t>(std::max(logprobs, 0)));
  for (const char* f : {"presence_penalty", "frequency_penalty"})
    if (auto v = get_number(body, f, -2, 2); v && *v != 0) bad(fmt::format("'{}' is not supported", f), f);

  auto job = std::make_shared<Job>();
  if (const json* st = field(body, "stop")) {
    if (st->is_string()) {
      job->stops.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      if (st->size() > 4) bad(fmt::format("'stop' takes at most 4 sequences, got {}", st->size()), "stop");
      for (const json& s : *st) {
        if (!s.is_string()) bad(fmt::format("'stop' must be a string or an array of strings, got the element {}", describe(s)), "stop");
        job->stops.push_back(s.get<std::string>());
      }
    } else {
      bad(fmt::format("'stop' must be a string or an array of strings, got {}", describe(*st)), "stop");
    }
    for (const auto& s : job->stops) {
      if (s.empty()) bad("'stop' sequences must not be empty", "stop");
      job->max_stop = std::max(job->max_stop, s.size());
    }
  }

  // Spade's own fields
  if (const json* sp_f = field(body, "spade")) {
    if (!sp_f->is_object()) bad(fmt::format("'spade' must be an object, got {}", describe(*sp_f)), "spade");
    for (auto it = sp_f->begin(); it != sp_f->end(); ++it) {
      if (it.key() == "selection") {
        if (!it->is_string() || (it->get<std::string>() != "auto" && it->get<std::string>() != "dense"))
          bad(fmt::format("'spade.selection' must be \"auto\" or \"dense\", got {}", describe(*it)), "spade.selection");
        g.mutable_sparse()->set_force_dense(it->get<std::string>() == "dense");
      } else if (it.key() == "token_budget" || it.key() == "sparse_threshold") {
        const auto v = it->is_number() ? as_int64(*it) : std::nullopt;
        if (!v || *v < 1 || *v > max_len)
          bad(fmt::format("'spade.{}' must be an integer in [1, {}], got {}", it.key(), max_len, describe(*it)),
              "spade." + it.key());
        if (it.key() == "token_budget") {
          g.mutable_sparse()->set_token_budget(static_cast<uint32_t>(*v));
        } else {
          g.mutable_sparse()->set_sparse_threshold(static_cast<uint32_t>(*v));
        }
      } else {
        bad(fmt::format("unknown field 'spade.{}' (known: selection, sparse_threshold, token_budget)", clip(it.key())),
            "spade");
      }
    }
  }

  job->stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!job->stream) bad("'stream_options' is only allowed with stream: true", "stream_options");
    if (!so->is_object()) bad(fmt::format("'stream_options' must be an object, got {}", describe(*so)), "stream_options");
    job->include_usage = get_bool(*so, "include_usage").value_or(false);
  }

  // A live world (the caller holds a max_num_requests slot). Nothing above reached a rank.
  const Health h = server.health();
  if (!h.running || h.shutting_down || !h.world_complete || h.live_inference == 0)
    throw ApiError{503,
                   !h.world_complete ? fmt::format("the cluster is not ready: {}/{} inference ranks registered",
                                                   h.live_inference, h.num_inference)
                                     : "no live inference rank",
                   "", "service_unavailable"};

  job->api = shared_from_this();
  job->res = res;
  job->endpoint = endpoint;
  job->chat = is_chat;
  job->logprobs = logprobs;
  job->id = random_id(is_chat ? "chatcmpl-" : "cmpl-");
  job->created = unix_now();
  job->prompt_tokens = static_cast<int>(P);
  job->choices.resize(static_cast<size_t>(samples));
  job->open_choices = static_cast<int>(samples);
  handed_over = true;  // from here on the Job answers and releases the slot
  {
    std::lock_guard<std::mutex> lk(job->mu);
    job->routed_id = server.submit_local(g, [job](const proto::GenerateChunk& ch) { job->on_chunk(ch); });
  }
  job->begin();
  res->on_close([job] { job->on_client_gone(); });
}

// ---------------------------------------------------------------------------------------------------------------

std::string served_model_name(const ApiOptions& opt) {
  if (!opt.served_model_name.empty()) return opt.served_model_name;
  std::string name = std::filesystem::path(opt.model_dir).lexically_normal().filename().string();
  if (name.empty()) name = std::filesystem::path(opt.model_dir).parent_path().filename().string();
  return name;
}

OpenAiApi::OpenAiApi(ApiOptions options, CoordinatorServer& server, metrics::Registry& registry)
    : impl_(std::make_shared<Impl>(std::move(options), server, registry)),
      pool_(std::make_unique<boost::asio::thread_pool>(static_cast<size_t>(impl_->opt.request_threads))) {
  impl_->workers = pool_->get_executor();
}

OpenAiApi::~OpenAiApi() {
  // Requests still queued are dropped (their responders close with the HTTP server); running ones finish first.
  pool_->stop();
  pool_->join();
}

void OpenAiApi::handle(const http::HttpRequest& req, std::shared_ptr<http::HttpResponder> res) {
  impl_->handle(req, std::move(res));
}

const std::string& OpenAiApi::model_name() const { return impl_->name; }
int OpenAiApi::max_model_len() const { return impl_->max_len; }
int OpenAiApi::in_flight() const { return impl_->in_flight.load(); }

}  // namespace spade::coord

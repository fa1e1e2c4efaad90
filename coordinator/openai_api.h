// The OpenAI-compatible HTTP API of the coordinator (served with common/http_server.h on --http-port).
//
//   POST /v1/completions        prompt (string or token ids) -> text_completion (or SSE text_completion chunks)
//   POST /v1/chat/completions   messages -> chat.completion (or SSE chat.completion.chunk), with the checkpoint's
//                               chat template (common/chat_template.h) or --chat-template FILE
//   GET  /v1/models             the one served model (HEAD: its headers)
//   (/health, /ready and /metrics are answered by the coordinator's main, common/status_endpoint.h)
//
// Request fields: model (must name the served model), max_tokens (chat: also max_completion_tokens; default 16 for
// completions as in OpenAI, the rest of the context for chat), temperature [0, 2], top_p (0, 1], top_k (-1/0 = off),
// seed, stop (string or up to 4 strings; the text ends before the first match, finish_reason "stop"), n (1 to
// kMaxSamplesPerRequest = 64, coordinator/client.h; see "Samples" below), stream, stream_options.include_usage, and
// log-probabilities: chat "logprobs": true with "top_logprobs": 0..20,
// completions "logprobs": 0..5 (out of range, a non-boolean / non-integer, or top_logprobs without logprobs: 400).
// Logprobs are "raw" (vLLM's default logprobs_mode): the log-softmax of the model's logits of the step that sampled
// the token, before temperature / top-k / top-p (common/sampling.h token_logprobs), natural log; a probability of 0
// is sent as -9999.0, as vLLM does. Shapes are OpenAI's:
//   chat         choices[0].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
//                "refusal": null}; top_logprobs has exactly top_logprobs entries, most likely first
//   completions  choices[0].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob, ...}] (the
//                alternatives plus the sampled token, as vLLM), text_offset (code points of the token strings
//                before each, from 0)}
// `token` is the token's text (U+FFFD where it holds part of a UTF-8 character), `bytes` its exact bytes
// (Tokenizer::token_bytes). Streamed, each chunk carries the logprobs of the tokens whose text it completes (a
// token whose text is held back for a stop string or a split UTF-8 character comes with the chunk that sends it);
// tokens cut by a stop string are left out. Spade's own fields go in an object "spade":
//   "selection": "auto" (the rank's sparse decoding, default) | "dense" (never go sparse for this request)
//   "sparse_threshold": N  context length at which this request switches to sparse decoding
//   "token_budget": K      selected tokens per layer and KV head for this request (at most the rank's
//                          --token-budget; a larger value is a 400 from the rank)
// The body is read as FastAPI (and so vLLM) reads it: JSON when Content-Type is absent, application/json or
// application/*+json (parameters such as charset ignored; the body must be UTF-8); any other type is 415. A repeated
// key in one object, nesting deeper than 64 levels and a number outside double range are 400s. Integers must fit
// int64 and are range-checked before any arithmetic (max_tokens > the context left is the context-length 400).
// Samples (n > 1): one request to one inference rank, which prefills the prompt once and decodes n sequences that
// share its KV pages (Engine::submit_samples); sample i samples with seed + i (seed: the request's, else a random
// one), so a request with a seed is reproducible. choices has n entries, choices[i].index = i, each with its own
// text, finish_reason, stop-string cut and logprobs; usage counts the prompt once and the completion tokens of every
// choice. Streamed, every chunk carries one choice (its index), chat sends each choice's role chunk first, a choice's
// finish_reason comes with its last delta, and the usage chunk and [DONE] follow the last choice. A stop string ends
// its choice only (that sample is cancelled on the rank). A failing sample fails the whole response (500, or the SSE
// error event), and the other samples are cancelled. Per-request `spade` fields apply to every sample.
// Unsupported OpenAI features that change results (echo, best_of other than 1, suffix, tools, functions,
// response_format other than text, logit_bias) are rejected with 400 rather than ignored; other unknown fields are
// ignored.
//
// Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}} with the status a client expects:
//   400 invalid_request_error: malformed JSON, invalid UTF-8, a field of the wrong type or range, empty messages,
//       max_tokens <= 0, prompt + max_tokens over the context (code context_length_exceeded: "This model's maximum
//       context length is N tokens and your request has M tokens (P in the prompt, K to generate)")
//   404 model_not_found (unknown model) / not_found (path);  405 wrong method;  413 oversized body (http_server)
//   415 unsupported_media_type: a Content-Type that is not JSON
//   429 rate_limit_exceeded: more than max_num_requests requests in flight (counted from arrival, before parsing)
//   503 service_unavailable: world not complete / no live inference rank
//   500 internal error when the serving rank fails (mid-stream: an SSE event {"error": ...} then [DONE]), or
//       when Spade itself fails; never for anything in the request.
// None of the 4xx errors reaches an inference rank.
//
// Threads: handle() runs on the HTTP io thread and does only routing, method, Content-Type and admission; a
// generation request's UTF-8 check, JSON parsing, validation, chat template and tokenization run on a pool of
// ApiOptions::request_threads workers, so a multi-MB prompt never delays /health or other connections.
//
// Cancellation: a client that disconnects before its response is complete (streaming or not) has its request
// cancelled on the inference rank (CoordinatorServer::cancel_local), which frees its KV there and on its cache
// rank. A stop-string match cancels the rest of the generation the same way (with n > 1: of its sample).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "common/chat_template.h"
#include "common/config.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "common/tokenizer.h"
#include "coordinator/server.h"

namespace boost::asio {
class thread_pool;
}

namespace spade::coord {

struct ApiOptions {
  std::string model_dir;          // checkpoint: tokenizer.json, tokenizer_config.json, config.json, generation_config
  std::string served_model_name;  // "" = the model directory's base name
  std::string chat_template_file;  // "" = the checkpoint's chat_template; else a Jinja file of a recognised family
  int max_model_len = 0;          // 0 = config.json's max_position_embeddings
  int max_num_requests = 256;     // generation requests in flight through the API; more get 429
  int request_threads = 2;        // workers that parse, validate and tokenize generation requests (> 0)
};

/// The model name the API serves and reports (`model`; the vllm: metrics' model_name label): --served-model-name,
/// else the checkpoint directory's name.
std::string served_model_name(const ApiOptions& opt);

/// OpenAI error object: {"error": {"message", "type", "param", "code"}} for `status`.
std::string openai_error_json(int status, const std::string& message, const std::string& param = "",
                              const std::string& code = "");

class OpenAiApi {
 public:
  /// Loads the tokenizer, config and chat template of options.model_dir (throws spade::Error naming the file)
  /// and starts the request workers.
  OpenAiApi(ApiOptions options, CoordinatorServer& server, metrics::Registry& registry);
  /// Drops requests still waiting for a worker and joins the workers: stop the HTTP server first.
  ~OpenAiApi();

  /// Answers one request under /v1/ (any other path: 404). Thread-safe and non-blocking: generation requests are
  /// answered later, from a worker or from the coordinator's chunk callbacks.
  void handle(const http::HttpRequest& req, std::shared_ptr<http::HttpResponder> res);

  const std::string& model_name() const;
  int max_model_len() const;
  /// Generation requests in flight through the API.
  int in_flight() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
  std::unique_ptr<boost::asio::thread_pool> pool_;  // destroyed (joined) before impl_ is released
};

}  // namespace spade::coord

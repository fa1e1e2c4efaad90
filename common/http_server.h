// A small HTTP/1.1 server on Boost.Beast for what every Spade process serves: GET /metrics, /health, /ready, and on
// the coordinator the OpenAI-compatible API (coordinator/openai_api.h), including server-sent-event streams.
//
// Model: one io thread owned by the server; each request is handed to the handler, on that io thread, with an
// HttpResponder that the handler (or any other thread, later) uses to answer once — send() — or to stream —
// begin_stream(), write()..., end(). A handler must not block: work that takes long (parsing, tokenizing a large
// body) belongs on another thread, which answers through the responder (coordinator/openai_api.h does so). A
// responder detects a client that goes away (EOF, reset, failed write) while its response is pending and then runs
// its on_close callback exactly once (the coordinator cancels the request there).
//
// Protocol details: a HEAD request gets the status and headers the same GET would get (Content-Length of the body
// that is not sent) and no body. A stream is chunked for an HTTP/1.1 client; an HTTP/1.0 client, which cannot read
// chunked encoding, gets a close-delimited body (no Content-Length, no Transfer-Encoding, Connection: close).
// Responses are HTTP/1.1; an HTTP/1.0 client that asked for keep-alive is told "Connection: keep-alive". A request
// with "Expect: 100-continue" gets "100 Continue" once its header passed the limits (else the error, body unread).
//
// Limits (HttpServerOptions): request bodies above max_body_bytes get 413 before the handler sees them; a header
// section above 16 KiB 431; a client that sends nothing for idle_timeout is disconnected (keep-alive idle or a
// stalled request). Error bodies of these server-level answers come from error_body(), so the coordinator can use
// OpenAI error objects everywhere.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace spade::http {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string target;                          // as sent: "/v1/models?x=1"
  std::string path;                            // target without the query: "/v1/models"
  std::string query;                           // after '?', undecoded
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  std::string remote;  // "ip:port" of the client
  unsigned version = 11;  // HTTP version as 10 * major + minor: 10 = HTTP/1.0, 11 = HTTP/1.1
};

using Headers = std::vector<std::pair<std::string, std::string>>;

/// The answer to one request. Thread-safe; every method may be called from any thread. Only the first of
/// send()/begin_stream() takes effect; write()/end() before begin_stream() or after end() are ignored, as is
/// everything after the client went away.
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  /// Complete response with Content-Length (to a HEAD request: the header only, with the body's length).
  virtual void send(int status, std::string content_type, std::string body, Headers extra = {}) = 0;
  /// Starts a streamed response (e.g. text/event-stream): chunked for HTTP/1.1, close-delimited for HTTP/1.0; the
  /// connection closes after end(). To a HEAD request it sends the header and ends the response at once: the
  /// responder then reports closed() and runs on_close, so that a producer stops.
  virtual void begin_stream(int status, std::string content_type, Headers extra = {}) = 0;
  /// One piece of a stream (empty data is skipped: an empty chunk would end a chunked stream).
  virtual void write(std::string data) = 0;
  /// Ends the stream (last chunk when chunked), then closes the connection once it has been written.
  virtual void end() = 0;
  /// True once the client disconnected (or the server stopped, or a streamed answer to HEAD ended) before the
  /// response was complete.
  virtual bool closed() const = 0;
  /// Runs `cb` once if the client disconnects before the response is complete (on the server's io thread; must
  /// not block). Runs it at once if that already happened.
  virtual void on_close(std::function<void()> cb) = 0;
};

using HttpHandler = std::function<void(const HttpRequest&, std::shared_ptr<HttpResponder>)>;

struct HttpServerOptions {
  std::string bind_host = "0.0.0.0";
  uint16_t port = 0;                  // 0 = ephemeral (read back with port())
  size_t max_body_bytes = 1u << 20;   // larger bodies get 413
  std::chrono::milliseconds idle_timeout{60000};
  std::string name = "http";          // names this server in logs and errors, e.g. "coordinator HTTP API"
  /// Body and content type of server-level errors (400 malformed HTTP, 404/405 are the handler's, 413, 431).
  std::function<std::pair<std::string, std::string>(int status, const std::string& message)> error_body;
};

class HttpServer {
 public:
  /// Binds (throws spade::Error naming host:port when it cannot) and starts the io thread.
  HttpServer(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const;
  /// Closes the listener and every connection (pending responders see closed()), joins the io thread.
  void stop();

  class Impl;  // internal (public so the connection sessions in http_server.cpp can name it)

 private:
  std::shared_ptr<Impl> impl_;
};

/// The standard reason phrase, e.g. 413 -> "Payload Too Large".
std::string reason_phrase(int status);

/// A minimal blocking HTTP/1.1 client for tests and tools: one request per connection, whole body returned
/// (chunked bodies are de-chunked; HEAD: headers only). Sends Content-Type: application/json with a POST body
/// unless `headers` names a Content-Type; an empty value in `headers` leaves that field out. Throws spade::Error naming host:port on connect/read failure or at the deadline.
struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
};
HttpResponse http_request(const std::string& host, uint16_t port, const std::string& method, const std::string& target,
                          const std::string& body = "", const Headers& headers = {},
                          std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));

}  // namespace spade::http

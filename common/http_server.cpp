#include "common/http_server.h"

#include <spdlog/spdlog.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <optional>
#include <thread>

#include "common/error.h"

namespace spade::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

std::string reason_phrase(int status) {
  const auto r = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return r.empty() ? std::string("Unknown") : std::string(r);
}

class Session;

class HttpServer::Impl : public std::enable_shared_from_this<HttpServer::Impl> {
 public:
  Impl(HttpServerOptions o, HttpHandler h) : opt(std::move(o)), handler(std::move(h)), acceptor(ioc) {}
  HttpServerOptions opt;
  HttpHandler handler;
  net::io_context ioc;
  tcp::acceptor acceptor;
  std::thread thread;
  std::atomic<bool> stopped{false};
  uint16_t bound_port = 0;
  std::vector<std::weak_ptr<Session>> sessions;  // io thread only

  void accept();
  std::pair<std::string, std::string> error_body(int status, const std::string& msg) const {
    if (opt.error_body) return opt.error_body(status, msg);
    return {"text/plain; charset=utf-8", msg + "\n"};
  }
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket s, std::shared_ptr<HttpServer::Impl> srv) : srv_(std::move(srv)), stream_(std::move(s)) {
    error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    remote_ = ec ? std::string("?") : fmt::format("{}:{}", ep.address().to_string(), ep.port());
  }
  void start() { read_request(); }
  void shutdown() {  // io thread
    client_gone();
    error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
  }

  // ---- responder side (io thread) ----
  void r_send(uint64_t gen, int status, std::string ctype, std::string body, Headers extra) {
    if (gen != gen_ || state_ != State::kPending) return;
    state_ = State::kDone;
    auto res = std::make_shared<bhttp::response<bhttp::string_body>>(static_cast<bhttp::status>(status), 11);
    res->set(bhttp::field::server, "spade");
    res->set(bhttp::field::content_type, ctype);
    for (auto& [k, v] : extra) res->set(k, v);
    set_keep_alive(*res, keep_alive_);
    res->body() = std::move(body);
    res->prepare_payload();
    const bool close = !keep_alive_;
    if (head_) {  // the header the GET would get, Content-Length included; no body
      auto sr = std::make_shared<bhttp::response_serializer<bhttp::string_body>>(*res);
      enqueue([self = shared_from_this(), res, sr](std::function<void(error_code)> done) {
        bhttp::async_write_header(self->stream_, *sr, [res, sr, done](error_code ec, size_t) { done(ec); });
      });
    } else {
      enqueue([self = shared_from_this(), res](std::function<void(error_code)> done) {
        bhttp::async_write(self->stream_, *res, [res, done](error_code ec, size_t) { done(ec); });
      });
    }
    enqueue_finish(close);
  }
  void r_begin(uint64_t gen, int status, std::string ctype, Headers extra) {
    if (gen != gen_ || state_ != State::kPending) return;
    state_ = State::kStreaming;
    auto res = std::make_shared<bhttp::response<bhttp::empty_body>>(static_cast<bhttp::status>(status), 11);
    res->set(bhttp::field::server, "spade");
    res->set(bhttp::field::content_type, ctype);
    res->set(bhttp::field::cache_control, "no-cache");
    for (auto& [k, v] : extra) res->set(k, v);
    res->keep_alive(false);  // HTTP/1.1 response: "Connection: close"
    // HTTP/1.0 has no chunked encoding: the body then ends where the connection does.
    stream_chunked_ = version_ >= 11 && !head_;
    res->chunked(stream_chunked_);
    auto sr = std::make_shared<bhttp::response_serializer<bhttp::empty_body>>(*res);
    enqueue([self = shared_from_this(), res, sr](std::function<void(error_code)> done) {
      bhttp::async_write_header(self->stream_, *sr, [res, sr, done](error_code ec, size_t) { done(ec); });
    });
    if (head_) {  // nothing follows the header: the response is over, and its producer is told to stop
      enqueue_finish(true);
      *closed_ = true;
      gone_gen_ = gen_;
      ++gen_;
      state_ = State::kDone;
      if (auto cb = std::move(on_close_)) cb();
    }
  }
  void r_write(uint64_t gen, std::string data) {
    if (gen != gen_ || state_ != State::kStreaming || data.empty()) return;
    auto d = std::make_shared<std::string>(std::move(data));
    if (stream_chunked_) {
      enqueue([self = shared_from_this(), d](std::function<void(error_code)> done) {
        net::async_write(self->stream_, bhttp::make_chunk(net::buffer(*d)),
                         [d, done](error_code ec, size_t) { done(ec); });
      });
    } else {
      enqueue([self = shared_from_this(), d](std::function<void(error_code)> done) {
        net::async_write(self->stream_, net::buffer(*d), [d, done](error_code ec, size_t) { done(ec); });
      });
    }
  }
  void r_end(uint64_t gen) {
    if (gen != gen_ || state_ != State::kStreaming) return;
    state_ = State::kDone;
    if (stream_chunked_) {
      enqueue([self = shared_from_this()](std::function<void(error_code)> done) {
        net::async_write(self->stream_, bhttp::make_chunk_last(), [done](error_code ec, size_t) { done(ec); });
      });
    }
    enqueue_finish(true);  // a close-delimited body ends here
  }
  void r_on_close(uint64_t gen, std::function<void()> cb) {
    if (gen != gen_) {  // that response is over: it completed or its client went away
      if (gone_gen_ == gen) cb();
      return;
    }
    on_close_ = std::move(cb);
  }

  std::shared_ptr<HttpServer::Impl> srv_;
  beast::tcp_stream stream_;
  uint64_t gen_ = 0;  // request generation, bumped per request (io thread)
  std::shared_ptr<std::atomic<bool>> closed_ = std::make_shared<std::atomic<bool>>(false);  // current request's

 private:
  enum class State { kReading, kPending, kStreaming, kDone };

  void read_request() {
    state_ = State::kReading;
    parser_.emplace();
    parser_->body_limit(srv_->opt.max_body_bytes);
    parser_->header_limit(16 * 1024);
    stream_.expires_after(srv_->opt.idle_timeout);
    bhttp::async_read_header(stream_, buf_, *parser_,
                             [self = shared_from_this()](error_code ec, size_t) { self->on_header(ec); });
  }

  // A client that sent "Expect: 100-continue" (curl does for bodies over 1 MiB) waits for "100 Continue" before
  // it sends the body; a body over the limit was refused inside the header already (413, nothing read).
  void on_header(error_code ec) {
    if (ec || parser_->is_done()) return on_read(ec);
    const auto& m = parser_->get();
    if (m.version() >= 11 && beast::iequals(m[bhttp::field::expect], "100-continue")) {
      auto cont = std::make_shared<bhttp::response<bhttp::empty_body>>(bhttp::status::continue_, 11);
      enqueue([self = shared_from_this(), cont](std::function<void(error_code)> done) {
        bhttp::async_write(self->stream_, *cont, [self, cont, done](error_code e, size_t) {
          done(e);
          if (!e) self->read_body();
        });
      });
      return;
    }
    read_body();
  }
  void read_body() {
    bhttp::async_read(stream_, buf_, *parser_, [self = shared_from_this()](error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read(error_code ec) {
    if (ec == bhttp::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset) {
      return close_now();
    }
    if (ec) {
      // The start line may have been parsed even when the header is not complete (a Content-Length over the
      // limit is refused inside it); before it, the message reads verb::unknown and version 11.
      head_ = parser_->get().method() == bhttp::verb::head;
      version_ = parser_->get().version();
      int status = 400;
      std::string msg = fmt::format("malformed HTTP request: {}", ec.message());
      if (ec == bhttp::error::body_limit) {
        status = 413;
        msg = fmt::format("request body exceeds the limit of {} bytes", srv_->opt.max_body_bytes);
      } else if (ec == bhttp::error::header_limit) {
        status = 431;
        msg = "request header section exceeds 16384 bytes";
      }
      spdlog::warn("{}: {} from {}: {}", srv_->opt.name, status, remote_, msg);
      keep_alive_ = false;
      state_ = State::kPending;
      ++gen_;
      auto [ctype, body] = srv_->error_body(status, msg);
      r_send(gen_, status, ctype, body, {});
      return;
    }
    auto& m = parser_->get();
    HttpRequest req;
    req.method = std::string(m.method_string());
    req.target = std::string(m.target());
    const auto q = req.target.find('?');
    req.path = req.target.substr(0, q);
    if (q != std::string::npos) req.query = req.target.substr(q + 1);
    for (const auto& f : m) {
      std::string name(f.name_string());
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      req.headers[name] = std::string(f.value());
    }
    req.body = std::move(m.body());
    req.remote = remote_;
    req.version = m.version();
    keep_alive_ = m.keep_alive();
    head_ = m.method() == bhttp::verb::head;
    version_ = m.version();
    state_ = State::kPending;
    ++gen_;
    closed_ = std::make_shared<std::atomic<bool>>(false);
    on_close_ = nullptr;
    watch();
    auto responder = make_responder();
    try {
      srv_->handler(req, responder);
    } catch (const std::exception& e) {
      spdlog::error("{}: handler failed on {} {}: {}", srv_->opt.name, req.method, req.target, e.what());
      auto [ctype, body] = srv_->error_body(500, std::string("internal error: ") + e.what());
      r_send(gen_, 500, ctype, body, {});
    }
  }

  // While a response is pending, keep one read outstanding: it sees the client's EOF/reset at once. Bytes it
  // reads (a pipelined next request) stay in buf_ for the next parse.
  void watch() {
    if (watching_ || buf_.size() > 0) return;  // a pipelined request is already buffered: read it next
    watching_ = true;
    stream_.expires_never();
    stream_.async_read_some(buf_.prepare(4096), [self = shared_from_this()](error_code ec, size_t n) {
      self->watching_ = false;
      if (ec) return self->client_gone();
      self->buf_.commit(n);
      if (self->state_ == State::kReading) return self->read_request();  // response finished meanwhile
      // Data while the response is pending (pipelining): stop watching; disconnects then show up as write errors.
    });
  }

  void client_gone() {
    if (state_ == State::kPending || state_ == State::kStreaming) {
      *closed_ = true;
      gone_gen_ = gen_;
      ++gen_;  // responder calls for that request become no-ops
      state_ = State::kDone;
      if (auto cb = std::move(on_close_)) cb();
    }
    close_now();
  }

  void close_now() {
    closing_ = true;
    error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
  }

  void enqueue(std::function<void(std::function<void(error_code)>)> op) {
    queue_.push_back(std::move(op));
    if (!writing_) next_write();
  }
  void enqueue_finish(bool close) {
    enqueue([self = shared_from_this(), close](std::function<void(error_code)> done) {
      self->on_close_ = nullptr;
      if (close || self->closing_) {
        self->close_now();
      } else if (!self->watching_) {
        self->read_request();
      } else {
        self->state_ = State::kReading;  // the watch read hands over to read_request() when it completes
      }
      done({});
    });
  }
  void next_write() {
    if (queue_.empty()) {
      writing_ = false;
      return;
    }
    writing_ = true;
    auto op = std::move(queue_.front());
    queue_.pop_front();
    op([self = shared_from_this()](error_code ec) {
      if (ec) {
        self->queue_.clear();
        self->writing_ = false;
        return self->client_gone();
      }
      self->next_write();
    });
  }

  std::shared_ptr<HttpResponder> make_responder();

  // Responses are HTTP/1.1; an HTTP/1.0 client keeps its connection only when told so explicitly.
  template <class Message>
  void set_keep_alive(Message& res, bool keep) const {
    res.keep_alive(keep);
    if (keep && version_ < 11) res.set(bhttp::field::connection, "keep-alive");
  }

  beast::flat_buffer buf_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::string remote_;
  State state_ = State::kReading;
  bool keep_alive_ = true;
  bool head_ = false;            // the current request is a HEAD: headers only
  unsigned version_ = 11;        // the current request's HTTP version (10 or 11)
  bool stream_chunked_ = true;   // the current stream's body is chunked (else close-delimited)
  bool watching_ = false;
  bool writing_ = false;
  bool closing_ = false;
  uint64_t gone_gen_ = 0;
  std::function<void()> on_close_;
  std::deque<std::function<void(std::function<void(error_code)>)>> queue_;
};

namespace {

class ResponderImpl final : public HttpResponder {
 public:
  ResponderImpl(std::shared_ptr<Session> s, uint64_t gen, std::shared_ptr<std::atomic<bool>> closed)
      : s_(std::move(s)), gen_(gen), closed_(std::move(closed)) {}
  void send(int status, std::string ctype, std::string body, Headers extra) override {
    net::post(s_->srv_->ioc, [s = s_, g = gen_, status, c = std::move(ctype), b = std::move(body),
                              e = std::move(extra)]() mutable { s->r_send(g, status, std::move(c), std::move(b), std::move(e)); });
  }
  void begin_stream(int status, std::string ctype, Headers extra) override {
    net::post(s_->srv_->ioc, [s = s_, g = gen_, status, c = std::move(ctype), e = std::move(extra)]() mutable {
      s->r_begin(g, status, std::move(c), std::move(e));
    });
  }
  void write(std::string data) override {
    net::post(s_->srv_->ioc, [s = s_, g = gen_, d = std::move(data)]() mutable { s->r_write(g, std::move(d)); });
  }
  void end() override {
    net::post(s_->srv_->ioc, [s = s_, g = gen_] { s->r_end(g); });
  }
  bool closed() const override { return closed_->load(); }
  void on_close(std::function<void()> cb) override {
    net::post(s_->srv_->ioc, [s = s_, g = gen_, cb = std::move(cb)]() mutable { s->r_on_close(g, std::move(cb)); });
  }

 private:
  std::shared_ptr<Session> s_;
  uint64_t gen_;
  std::shared_ptr<std::atomic<bool>> closed_;
};

}  // namespace

std::shared_ptr<HttpResponder> Session::make_responder() {
  return std::make_shared<ResponderImpl>(shared_from_this(), gen_, closed_);
}

void HttpServer::Impl::accept() {
  acceptor.async_accept([self = shared_from_this()](error_code ec, tcp::socket sock) {
    if (self->stopped) return;
    if (!ec) {
      auto s = std::make_shared<Session>(std::move(sock), self);
      std::erase_if(self->sessions, [](const std::weak_ptr<Session>& w) { return w.expired(); });
      self->sessions.push_back(s);
      s->start();
    } else if (ec == net::error::operation_aborted) {
      return;
    } else {
      spdlog::warn("{}: accept failed: {}", self->opt.name, ec.message());
    }
    self->accept();
  });
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : impl_(std::make_shared<Impl>(std::move(options), std::move(handler))) {
  auto& im = *impl_;
  error_code ec;
  const auto addr = net::ip::make_address(im.opt.bind_host, ec);
  SPADE_CHECK(!ec, "{}: invalid bind address '{}': {}", im.opt.name, im.opt.bind_host, ec.message());
  const tcp::endpoint ep(addr, im.opt.port);
  im.acceptor.open(ep.protocol(), ec);
  if (!ec) im.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) im.acceptor.bind(ep, ec);
  if (!ec) im.acceptor.listen(net::socket_base::max_listen_connections, ec);
  SPADE_CHECK(!ec, "{}: cannot listen on {}:{}: {}", im.opt.name, im.opt.bind_host, im.opt.port, ec.message());
  im.bound_port = im.acceptor.local_endpoint().port();
  im.accept();
  im.thread = std::thread([impl = impl_] {
    try {
      impl->ioc.run();
    } catch (const std::exception& e) {
      spdlog::error("{}: io thread ended: {}", impl->opt.name, e.what());
    }
  });
}

HttpServer::~HttpServer() { stop(); }

uint16_t HttpServer::port() const { return impl_->bound_port; }

void HttpServer::stop() {
  if (impl_->stopped.exchange(true)) return;
  net::post(impl_->ioc, [impl = impl_] {
    error_code ec;
    impl->acceptor.close(ec);
    for (auto& w : impl->sessions)
      if (auto s = w.lock()) s->shutdown();
    impl->sessions.clear();
  });
  // Give shutdown() a moment to run its close callbacks, then stop the loop.
  net::post(impl_->ioc, [impl = impl_] { impl->ioc.stop(); });
  if (impl_->thread.joinable()) impl_->thread.join();
}

HttpResponse http_request(const std::string& host, uint16_t port, const std::string& method, const std::string& target,
                          const std::string& body, const Headers& headers, std::chrono::milliseconds timeout) {
  net::io_context ioc;
  beast::tcp_stream stream(ioc);
  const std::string who = fmt::format("{}:{}", host, port);
  error_code ec;
  tcp::resolver resolver(ioc);
  const auto results = resolver.resolve(host, std::to_string(port), ec);
  SPADE_CHECK(!ec, "HTTP {} {}: cannot resolve {}: {}", method, target, who, ec.message());
  stream.expires_after(timeout);
  stream.connect(results, ec);
  SPADE_CHECK(!ec, "HTTP {} {}: cannot connect to {}: {}", method, target, who, ec.message());
  bhttp::request<bhttp::string_body> req(bhttp::string_to_verb(method), target, 11);
  req.set(bhttp::field::host, host);
  req.set(bhttp::field::connection, "close");
  bool has_content_type = false;
  for (auto& [k, v] : headers) {
    if (beast::iequals(k, "content-type")) has_content_type = true;
    if (v.empty()) {
      req.erase(k);
    } else {
      req.set(k, v);
    }
  }
  if (!body.empty() || method == "POST") {
    req.body() = body;
    if (!has_content_type) req.set(bhttp::field::content_type, "application/json");
    req.prepare_payload();
  }
  // Blocking ops with a deadline: run async ops on the local io_context until done.
  bhttp::async_write(stream, req, [&](error_code e, size_t) { ec = e; });
  ioc.run();
  ioc.restart();
  SPADE_CHECK(!ec, "HTTP {} {}: write to {} failed: {}", method, target, who, ec.message());
  beast::flat_buffer buf;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(256u << 20);
  parser.skip(method == "HEAD");  // a HEAD response has no body, whatever its Content-Length says
  stream.expires_after(timeout);
  bhttp::async_read(stream, buf, parser, [&](error_code e, size_t) { ec = e; });
  ioc.run();
  SPADE_CHECK(!ec, "HTTP {} {}: reading the response from {} failed: {}", method, target, who, ec.message());
  HttpResponse out;
  auto& res = parser.get();
  out.status = static_cast<int>(res.result_int());
  for (const auto& f : res) {
    std::string name(f.name_string());
    for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    out.headers[name] = std::string(f.value());
  }
  out.body = std::move(res.body());
  return out;
}

}  // namespace spade::http

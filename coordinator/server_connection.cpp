#include "coordinator/server_connection.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <exception>

#include "common/error.h"

namespace spade::coord {

namespace {

std::string endpoint_str(const tcp::endpoint& ep) {
  return fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

}  // namespace

Conn::Conn(tcp::socket s, size_t max_frame, uint64_t conn_id)
    : sock(std::move(s)), decoder(max_frame), id(conn_id) {
  error_code ec;
  auto ep = sock.remote_endpoint(ec);
  remote = ec ? std::string("<unknown peer>") : endpoint_str(ep);
  accepted_at = last_frame_at = Clock::now();
}

Connections::Connections(ServerContext& ctx, ConnectionEvents& events)
    : ctx_(ctx), events_(events), acceptor_(ctx.io) {}

void Connections::listen() {
  const auto& opts = ctx_.opts;
  error_code ec;
  auto addr = asio::ip::make_address(opts.bind_host, ec);
  if (ec) fail("coordinator: bad bind address '{}': {}", opts.bind_host, ec.message());
  tcp::endpoint ep(addr, opts.port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) fail("coordinator: cannot listen on {}:{}: {}", opts.bind_host, opts.port, ec.message());
  port_ = acceptor_.local_endpoint().port();
}

std::vector<ConnPtr> Connections::snapshot() const {
  std::vector<ConnPtr> all;
  for (const auto& [id, c] : conns_) all.push_back(c);
  return all;
}

// ---- accept / read / write
// ----------------------------------------------------------------------------------

void Connections::start_accepting() {
  do_accept();
}

void Connections::stop_accepting() {
  error_code ignored;
  acceptor_.close(ignored);
}

void Connections::do_accept() {
  acceptor_.async_accept([this](const error_code& ec, tcp::socket sock) {
    if (ec) {
      if (ec != asio::error::operation_aborted && !ctx_.shutting_down) {
        spdlog::warn("coordinator: accept failed: {}", ec.message());
        this->do_accept();
      }
      return;
    }
    if (ctx_.shutting_down) return;
    error_code ignored;
    if (unauthenticated_ >= ctx_.opts.max_unauthenticated_connections) {
      // Refused before a single byte is read: the limit bounds what strangers can hold.
      auto ep = sock.remote_endpoint(ignored);
      ++ctx_.rejected_connections;
      this->log_refused(ignored ? std::string("<unknown peer>") : endpoint_str(ep));
      sock.close(ignored);
      this->do_accept();
      return;
    }
    sock.set_option(tcp::no_delay(true), ignored);
    auto c =
        std::make_shared<Conn>(std::move(sock), ctx_.opts.max_unauthenticated_frame_bytes, next_conn_id_++);
    spdlog::debug("coordinator: connection from {}", c->remote);
    conns_[c->id] = c;
    ++unauthenticated_;
    this->start_read(c);
    this->do_accept();
  });
}

void Connections::log_refused(const std::string& remote) {
  const auto now = Clock::now();
  if (now - last_refusal_log_ < std::chrono::seconds(1)) {
    ++refusals_not_logged_;
    return;
  }
  spdlog::warn(
      "coordinator: refusing connection from {}: {} unauthenticated connection(s) already open "
      "(--max-unauthenticated-connections){}",
      remote, unauthenticated_,
      refusals_not_logged_
          ? fmt::format("; {} more refused in the last second, not logged", refusals_not_logged_)
          : std::string());
  last_refusal_log_ = now;
  refusals_not_logged_ = 0;
}

void Connections::admit(const ConnPtr& c) {
  if (c->admitted) return;
  c->admitted = true;
  c->auth_step = Conn::AuthStep::kDone;
  c->decoder.set_max_frame_bytes(ctx_.opts.max_frame_bytes);
  if (c->open) --unauthenticated_;
}

void Connections::check_deadlines(Clock::time_point now) {
  for (auto& c : snapshot()) {
    if (!c->open || c->close_after_flush) continue;  // a closing connection has its own deadline
    if (!c->admitted) {
      if (now - c->accepted_at < ctx_.opts.auth_timeout) continue;
      ++ctx_.rejected_connections;
      spdlog::warn(
          "coordinator: closing connection from {}: not authenticated within {} ms (--auth-timeout-ms){}",
          c->remote, ctx_.opts.auth_timeout.count(),
          c->decoder.mid_frame()
              ? fmt::format("; dropping {} bytes of an unfinished frame", c->decoder.buffered_bytes())
              : std::string());
      close(c, fmt::format("not authenticated within {} ms", ctx_.opts.auth_timeout.count()));
    } else if (now - c->last_frame_at >= ctx_.opts.idle_timeout) {
      spdlog::warn("coordinator: closing idle connection from {}{}: no frame for {} ms (--idle-timeout-ms)",
                   c->remote, events_.label(*c), age_ms(c->last_frame_at, now));
      close(c, fmt::format("idle for {} ms", age_ms(c->last_frame_at, now)));
    }
  }
}

void Connections::start_read(const ConnPtr& c) {
  c->sock.async_read_some(asio::buffer(c->rbuf),
                          [this, c](const error_code& ec, size_t n) { this->on_read(c, ec, n); });
}

void Connections::on_read(const ConnPtr& c, const error_code& ec, size_t n) {
  if (!c->open) return;
  if (ec) return on_read_error(c, ec);
  c->decoder.feed(c->rbuf.data(), n);
  if (!dispatch_frames(c)) return;
  start_read(c);
}

void Connections::on_read_error(const ConnPtr& c, const error_code& ec) {
  std::string why;
  if (ec == asio::error::eof) {
    std::string trunc = c->decoder.eof_error();
    if (!trunc.empty()) {
      spdlog::warn("coordinator: rejecting data from {}: {}; connection closed", c->remote, trunc);
      why = "connection closed mid-frame (" + trunc + ")";
    } else {
      why = "connection closed";
    }
  } else if (ec == asio::error::operation_aborted) {
    return;
  } else {
    why = "connection error: " + ec.message();
  }
  close(c, why);
}

bool Connections::dispatch_frames(const ConnPtr& c) {
  proto::Envelope env;
  std::string err;
  for (;;) {
    auto r = c->decoder.next(&env, &err);
    if (r == proto::FrameDecoder::Result::kNeedMore) return true;
    if (r == proto::FrameDecoder::Result::kError) {
      if (!c->admitted) {
        ++ctx_.rejected_connections;
        err += err.find("exceeds the maximum frame size") != std::string::npos
                   ? " (before authentication: --max-unauthenticated-frame-bytes)"
                   : " (before authentication)";
      }
      spdlog::warn("coordinator: rejecting connection from {}{}: {}; closing it", c->remote,
                   events_.label(*c), err);
      close(c, "protocol error: " + err);
      return false;
    }
    c->last_frame_at = Clock::now();
    events_.on_frame(c, env);
    if (!c->open) return false;
  }
}

void Connections::send(const ConnPtr& c, const proto::Envelope& env) {
  if (!c->open) return;
  std::string frame;
  try {
    proto::append_frame(env, &frame, ctx_.opts.max_frame_bytes);
  } catch (const std::exception& e) {
    spdlog::error("coordinator: cannot send to {}: {}", c->remote, e.what());
    return;
  }
  c->wq.push_back(std::move(frame));
  if (!c->writing) do_write(c);
}

void Connections::do_write(const ConnPtr& c) {
  if (c->wq.empty()) {
    c->writing = false;
    if (c->close_after_flush) {
      error_code ignored;
      c->sock.shutdown(tcp::socket::shutdown_send, ignored);  // peer sees EOF after our last frame
    }
    return;
  }
  c->writing = true;
  asio::async_write(c->sock, asio::buffer(c->wq.front()), [this, c](const error_code& ec, size_t) {
    if (!c->open) return;
    if (ec) {
      this->close(c, "write error: " + ec.message());
      return;
    }
    c->wq.pop_front();
    this->do_write(c);
  });
}

// Sends what is queued, then half-closes; the read loop closes the socket on the peer's EOF.
void Connections::close_gracefully(const ConnPtr& c) {
  if (!c->open || c->close_after_flush) return;
  c->close_after_flush = true;
  c->close_timer = std::make_unique<asio::steady_timer>(ctx_.io);
  c->close_timer->expires_after(ctx_.opts.shutdown_flush_timeout);
  c->close_timer->async_wait([this, c](const error_code& ec) {
    if (!ec)
      close(c, fmt::format("peer did not close within {} ms of our final frame",
                           ctx_.opts.shutdown_flush_timeout.count()));
  });
  if (!c->writing) do_write(c);
}

void Connections::close(const ConnPtr& c, const std::string& why) {
  if (!c->open) return;
  c->open = false;
  if (!c->admitted) --unauthenticated_;
  if (c->close_timer) c->close_timer->cancel();
  error_code ignored;
  c->sock.shutdown(tcp::socket::shutdown_both, ignored);
  c->sock.close(ignored);
  conns_.erase(c->id);
  spdlog::debug("coordinator: closed {}{}: {}", c->remote, events_.label(*c), why);
  events_.on_closed(c, why);
}

}  // namespace spade::coord

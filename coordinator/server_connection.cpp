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
    sock.set_option(tcp::no_delay(true), ignored);
    auto c = std::make_shared<Conn>(std::move(sock), ctx_.opts.max_frame_bytes, next_conn_id_++);
    spdlog::debug("coordinator: connection from {}", c->remote);
    conns_[c->id] = c;
    this->start_read(c);
    this->do_accept();
  });
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
      spdlog::warn("coordinator: rejecting connection from {}{}: {}; closing it", c->remote,
                   events_.label(*c), err);
      close(c, "protocol error: " + err);
      return false;
    }
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
  if (c->close_timer) c->close_timer->cancel();
  error_code ignored;
  c->sock.shutdown(tcp::socket::shutdown_both, ignored);
  c->sock.close(ignored);
  conns_.erase(c->id);
  spdlog::debug("coordinator: closed {}{}: {}", c->remote, events_.label(*c), why);
  events_.on_closed(c, why);
}

}  // namespace spade::coord

// Internal to the coordinator server: connection I/O. Accepts TCP connections (at most
// max_unauthenticated_connections not yet admitted at once), reads length-prefixed frames
// (common/proto/framing.h) off them (at most max_unauthenticated_frame_bytes each until admitted, then
// max_frame_bytes), queues and writes outgoing frames, enforces the admission deadline (auth_timeout) and the
// idle timeout, and closes connections gracefully (flush, half-close, wait for the peer's EOF, bounded by
// shutdown_flush_timeout) or at once. What a frame means, and what a closed connection means to the world, is
// the ConnectionEvents listener's business.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/proto/coordinator.pb.h"
#include "common/proto/framing.h"
#include "coordinator/server_internal.h"

namespace spade::coord {

// One TCP connection (a rank, a submitting client, or a stranger that has not registered yet).
struct Conn {
  enum class Kind { kUnregistered, kMember, kClient };
  // Where the challenge-response stands (coordinator/auth.h); kDone also without a secret once registered.
  enum class AuthStep { kAwaitHello, kAwaitProof, kDone };

  /// Wraps an accepted socket; `max_frame` bounds incoming frames (bytes), `conn_id` keys Connections' table.
  Conn(tcp::socket s, size_t max_frame, uint64_t conn_id);

  tcp::socket sock;
  std::string remote;  // "host:port" of the peer, or "<unknown peer>"
  proto::FrameDecoder decoder;
  std::array<char, 64 * 1024> rbuf{};
  std::deque<std::string> wq;  // encoded frames waiting to be written, front first
  bool writing = false;        // an async_write of wq.front() is in flight
  bool open = true;
  bool close_after_flush = false;  // graceful close: shutdown(send) once wq is empty, then wait for EOF
  std::unique_ptr<asio::steady_timer> close_timer;  // bounds a graceful close
  Kind kind = Kind::kUnregistered;
  uint32_t rank = 0;  // valid for kMember
  uint64_t id;
  // Admission: set by Connections::admit once the peer proved the cluster secret (or, without a secret,
  // registered); until then the small frame limit, the admission deadline and the unauthenticated-connection
  // count apply.
  bool admitted = false;
  AuthStep auth_step = AuthStep::kAwaitHello;
  std::string client_nonce, server_nonce;  // of this connection's challenge-response
  Clock::time_point accepted_at{};         // origin of the admission deadline
  Clock::time_point last_frame_at{};       // last complete frame received (idle timeout)
};

using ConnPtr = std::shared_ptr<Conn>;

/// What Connections reports upward (implemented by CoordinatorServer::Impl). Called on the io thread.
class ConnectionEvents {
 public:
  virtual ~ConnectionEvents() = default;
  /// One decoded frame from `c`. The handler may close `c`; the read loop then stops.
  virtual void on_frame(const ConnPtr& c, const proto::Envelope& env) = 0;
  /// `c` has just been closed for `why` (socket closed, removed from the table). Called once per connection.
  virtual void on_closed(const ConnPtr& c, const std::string& why) = 0;
  /// What log lines append to `c.remote`: " (<rank description>)", " (client)" or "".
  virtual std::string label(const Conn& c) const = 0;
};

/// The listening socket and the table of open connections. All members run on the io thread except the
/// constructor and listen(), which run before it starts.
class Connections {
 public:
  /// Keeps references to `ctx` and `events`; both must outlive this object. Opens nothing yet.
  Connections(ServerContext& ctx, ConnectionEvents& events);

  /// Binds and listens on ctx.opts.bind_host:port. Throws spade::Error naming the address when it cannot.
  void listen();
  /// The bound TCP port (valid after listen()).
  uint16_t port() const { return port_; }

  /// Starts the accept loop; every accepted connection is read until it closes.
  void start_accepting();
  /// Closes the listening socket (shutdown); pending accepts end quietly.
  void stop_accepting();

  /// Queues `env` as one frame to `c` (no-op when `c` is closed). A frame over max_frame_bytes is logged and
  /// dropped; a write error closes `c`.
  void send(const ConnPtr& c, const proto::Envelope& env);
  /// Graceful close: flushes c's queue, half-closes, and closes when the peer's EOF arrives, or at once
  /// after ctx.opts.shutdown_flush_timeout. No-op when `c` is closed or already closing.
  void close_gracefully(const ConnPtr& c);
  /// Closes `c` at once (idempotent): the socket is closed, `c` leaves the table and events.on_closed(c, why)
  /// runs.
  void close(const ConnPtr& c, const std::string& why);

  /// Admits `c` (idempotent): frames up to max_frame_bytes from now on, no admission deadline, no longer
  /// counted as unauthenticated.
  void admit(const ConnPtr& c);
  /// Closes every unadmitted connection past its admission deadline and every admitted one idle for longer
  /// than idle_timeout, logging each with its peer's address. Called from the server's tick.
  void check_deadlines(Clock::time_point now);
  /// Open connections not admitted yet.
  uint32_t unauthenticated() const { return unauthenticated_; }

  /// Number of open connections.
  size_t size() const { return conns_.size(); }
  bool empty() const { return conns_.empty(); }
  /// The open connections in accept order (a copy: safe to close them while iterating).
  std::vector<ConnPtr> snapshot() const;

 private:
  void do_accept();
  void start_read(const ConnPtr& c);
  void on_read(const ConnPtr& c, const error_code& ec, size_t n);
  void on_read_error(const ConnPtr& c, const error_code& ec);
  // Hands every complete frame in c's decoder to events_; false when `c` was closed meanwhile.
  bool dispatch_frames(const ConnPtr& c);
  void do_write(const ConnPtr& c);

  ServerContext& ctx_;
  ConnectionEvents& events_;
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  // Logs a refused connection; under a flood at most one line per second, with the count of those not logged.
  void log_refused(const std::string& remote);

  std::map<uint64_t, ConnPtr> conns_;  // open connections by id (= accept order)
  uint64_t next_conn_id_ = 1;
  uint32_t unauthenticated_ = 0;  // open and not admitted
  Clock::time_point last_refusal_log_{};
  uint64_t refusals_not_logged_ = 0;
};

}  // namespace spade::coord

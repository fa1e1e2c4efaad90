#include "coordinator/server.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include "coordinator/asio.h"

#include "common/error.h"
#include "coordinator/launch_env.h"

namespace spade::coord {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

namespace {

std::string endpoint_str(const tcp::endpoint& ep) {
  return fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

uint64_t age_ms(Clock::time_point since, Clock::time_point now) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count());
}

// One TCP connection (a rank, a submitting client, or a stranger that has not registered yet).
struct Conn {
  enum class Kind { kUnregistered, kMember, kClient };

  Conn(tcp::socket s, size_t max_frame, uint64_t conn_id)
      : sock(std::move(s)), decoder(max_frame), id(conn_id) {
    error_code ec;
    auto ep = sock.remote_endpoint(ec);
    remote = ec ? std::string("<unknown peer>") : endpoint_str(ep);
  }

  tcp::socket sock;
  std::string remote;
  proto::FrameDecoder decoder;
  std::array<char, 64 * 1024> rbuf{};
  std::deque<std::string> wq;
  bool writing = false;
  bool open = true;
  bool close_after_flush = false;  // graceful close: shutdown(send) once wq is empty, then wait for EOF
  std::unique_ptr<asio::steady_timer> close_timer;  // bounds a graceful close
  Kind kind = Kind::kUnregistered;
  uint32_t rank = 0;  // valid for kMember
  uint64_t id;
};

using ConnPtr = std::shared_ptr<Conn>;

struct Member {
  proto::RankInfo info;  // role/rank/role_index from the role map; the rest from the RegisterRequest
  proto::RankState state = proto::MISSING;
  ConnPtr conn;
  Clock::time_point last_seen{};
  uint64_t heartbeat_seq = 0;
  std::map<std::string, double> stats;
  std::string dead_reason;
};

struct Route {
  std::weak_ptr<Conn> submitter;  // a TCP client, or none for an in-process (HTTP API) submission
  uint64_t submitter_request_id = 0;
  uint32_t inference_rank = 0;
  ChunkSink local_sink;  // in-process submissions: chunks go here (io thread)
};

}  // namespace

class CoordinatorServer::Impl {
 public:
  explicit Impl(ServerOptions o)
      : opts_(std::move(o)),
        acceptor_(io_),
        tick_timer_(io_),
        rendezvous_timer_(io_),
        flush_timer_(io_),
        signals_(io_) {
    validate_options();
    std::random_device rd;
    session_id_ = (uint64_t{rd()} << 32) ^ rd();
    for (uint32_t r = 0; r < opts_.role_map.size(); ++r) {
      Member m;
      m.info.set_role(opts_.role_map[r]);
      m.info.set_rank(r);
      m.info.set_role_index(role_index_of(r));
      m.state = opts_.role_map[r] == proto::COORDINATOR ? proto::ALIVE : proto::MISSING;
      if (opts_.role_map[r] == proto::COORDINATOR) {
        m.info.set_host(asio::ip::host_name());
        m.info.set_pid(static_cast<uint32_t>(::getpid()));
        m.info.set_device("cpu");
      }
      members_.push_back(std::move(m));
    }
    bind();
    start_time_ = Clock::now();
  }

  uint16_t port() const { return port_; }

  // Arms timers and the accept loop; called on the io thread's behalf before io_.run().
  void arm() {
    if (armed_) return;
    armed_ = true;
    do_accept();
    schedule_tick();
    rendezvous_timer_.expires_at(start_time_ + opts_.rendezvous_timeout);
    rendezvous_timer_.async_wait([this](const error_code& ec) {
      if (!ec) this->on_rendezvous_deadline();
    });
    if (opts_.handle_signals) {
      signals_.add(SIGINT);
      signals_.add(SIGTERM);
      signals_.async_wait([this](const error_code& ec, int sig) {
        if (ec) return;
        spdlog::warn("coordinator: received {}; shutting the world down",
                     sig == SIGINT ? "SIGINT" : "SIGTERM");
        this->begin_shutdown(fmt::format("coordinator received {}", sig == SIGINT ? "SIGINT" : "SIGTERM"),
                             false, 0, "");
      });
    }
  }

  ExitStatus run_here() {
    arm();
    running_ = true;
    io_.run();
    running_ = false;
    std::lock_guard lk(exit_mu_);
    return exit_;
  }

  void start_thread() {
    SPADE_CHECK(!thread_.joinable(), "coordinator server already started");
    arm();
    running_ = true;
    thread_ = std::thread([this] {
      this->io_.run();
      this->running_ = false;
    });
  }

  ExitStatus join() {
    if (thread_.joinable()) thread_.join();
    std::lock_guard lk(exit_mu_);
    return exit_;
  }

  bool join_until(Deadline deadline, ExitStatus* out) {
    while (running_ && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (running_) return false;
    *out = join();
    return true;
  }

  void post_shutdown(const std::string& reason) {
    asio::post(io_, [this, reason] { this->begin_shutdown(reason, false, 0, ""); });
  }

  void stop_and_join() {
    if (thread_.joinable()) {
      post_shutdown("coordinator server object destroyed");
      thread_.join();
    }
  }

  proto::StatusReply status_from_other_thread(Deadline deadline) {
    SPADE_CHECK(running_, "coordinator on port {} is not running", port_);
    auto prom = std::make_shared<std::promise<proto::StatusReply>>();
    auto fut = prom->get_future();
    asio::post(io_, [this, prom] { prom->set_value(this->build_status()); });
    if (fut.wait_until(deadline) != std::future_status::ready) {
      fail("coordinator on port {} did not answer a status query before the deadline", port_);
    }
    return fut.get();
  }

 private:
  // ---- setup
  // -------------------------------------------------------------------------------------------------

  void validate_options() {
    const auto& rm = opts_.role_map;
    SPADE_CHECK(!rm.empty(), "coordinator: empty role map");
    auto n_coord = std::count(rm.begin(), rm.end(), proto::COORDINATOR);
    SPADE_CHECK(n_coord == 1, "coordinator: role map has {} coordinators (exactly one required)", n_coord);
    num_inference_ = static_cast<uint32_t>(std::count(rm.begin(), rm.end(), proto::INFERENCE));
    num_cache_ = static_cast<uint32_t>(std::count(rm.begin(), rm.end(), proto::CACHE));
    SPADE_CHECK(num_inference_ + num_cache_ + 1 == rm.size(), "coordinator: role map has unknown roles");
    SPADE_CHECK(num_inference_ >= 1,
                "coordinator: the world needs at least one inference rank (role map has 0)");
    if (num_inference_ != num_cache_) {
      fail(
          "coordinator: cannot pair {} inference rank(s) with {} cache rank(s): the pairing rule ({}) needs "
          "equal "
          "numbers (--num-inference == --num-cache)",
          num_inference_, num_cache_, kPairingRule);
    }
    SPADE_CHECK(opts_.heartbeat_interval.count() > 0, "coordinator: heartbeat interval must be > 0 ms");
    SPADE_CHECK(opts_.heartbeat_timeout > opts_.heartbeat_interval,
                "coordinator: heartbeat timeout ({} ms) must exceed the heartbeat interval ({} ms)",
                opts_.heartbeat_timeout.count(), opts_.heartbeat_interval.count());
    SPADE_CHECK(opts_.rendezvous_timeout.count() > 0, "coordinator: rendezvous timeout must be > 0 ms");
    SPADE_CHECK(opts_.max_frame_bytes >= 1024, "coordinator: max frame size {} is too small",
                opts_.max_frame_bytes);
  }

  void bind() {
    error_code ec;
    auto addr = asio::ip::make_address(opts_.bind_host, ec);
    if (ec) fail("coordinator: bad bind address '{}': {}", opts_.bind_host, ec.message());
    tcp::endpoint ep(addr, opts_.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) fail("coordinator: cannot listen on {}:{}: {}", opts_.bind_host, opts_.port, ec.message());
    port_ = acceptor_.local_endpoint().port();
  }

  uint32_t role_index_of(uint32_t r) const {
    return static_cast<uint32_t>(
        std::count(opts_.role_map.begin(), opts_.role_map.begin() + r, opts_.role_map[r]));
  }

  std::string describe(uint32_t r) const {
    const auto& m = members_[r];
    std::string s = fmt::format("{} rank {} (#{})", role_name(m.info.role()), r, m.info.role_index());
    if (m.conn) s += fmt::format(" at {}", m.conn->remote);
    if (!m.info.host().empty()) s += fmt::format(" [host {} pid {}]", m.info.host(), m.info.pid());
    return s;
  }

  std::vector<uint32_t> paired_ranks(uint32_t r) const {
    // inference #i <-> cache #i
    const auto& info = members_[r].info;
    proto::Role other = info.role() == proto::INFERENCE ? proto::CACHE
                        : info.role() == proto::CACHE   ? proto::INFERENCE
                                                        : proto::ROLE_UNSPECIFIED;
    std::vector<uint32_t> out;
    if (other == proto::ROLE_UNSPECIFIED) return out;
    for (uint32_t q = 0; q < members_.size(); ++q) {
      if (members_[q].info.role() == other && members_[q].info.role_index() == info.role_index())
        out.push_back(q);
    }
    return out;
  }

  // ---- accept / read / write
  // ----------------------------------------------------------------------------------

  void do_accept() {
    acceptor_.async_accept([this](const error_code& ec, tcp::socket sock) {
      if (ec) {
        if (ec != asio::error::operation_aborted && !this->shutting_down_) {
          spdlog::warn("coordinator: accept failed: {}", ec.message());
          this->do_accept();
        }
        return;
      }
      if (this->shutting_down_) return;
      error_code ignored;
      sock.set_option(tcp::no_delay(true), ignored);
      auto c = std::make_shared<Conn>(std::move(sock), this->opts_.max_frame_bytes, this->next_conn_id_++);
      spdlog::debug("coordinator: connection from {}", c->remote);
      this->conns_[c->id] = c;
      this->start_read(c);
      this->do_accept();
    });
  }

  void start_read(const ConnPtr& c) {
    c->sock.async_read_some(asio::buffer(c->rbuf),
                            [this, c](const error_code& ec, size_t n) { this->on_read(c, ec, n); });
  }

  void on_read(const ConnPtr& c, const error_code& ec, size_t n) {
    if (!c->open) return;
    if (ec) {
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
      close_conn(c, why);
      return;
    }
    c->decoder.feed(c->rbuf.data(), n);
    proto::Envelope env;
    std::string err;
    for (;;) {
      auto r = c->decoder.next(&env, &err);
      if (r == proto::FrameDecoder::Result::kNeedMore) break;
      if (r == proto::FrameDecoder::Result::kError) {
        spdlog::warn("coordinator: rejecting connection from {}{}: {}; closing it", c->remote, conn_label(c),
                     err);
        close_conn(c, "protocol error: " + err);
        return;
      }
      handle_frame(c, env);
      if (!c->open) return;
    }
    start_read(c);
  }

  std::string conn_label(const ConnPtr& c) const {
    if (c->kind == Conn::Kind::kMember) return " (" + describe(c->rank) + ")";
    if (c->kind == Conn::Kind::kClient) return " (client)";
    return "";
  }

  void send(const ConnPtr& c, const proto::Envelope& env) {
    if (!c->open) return;
    std::string frame;
    try {
      proto::append_frame(env, &frame, opts_.max_frame_bytes);
    } catch (const std::exception& e) {
      spdlog::error("coordinator: cannot send to {}: {}", c->remote, e.what());
      return;
    }
    c->wq.push_back(std::move(frame));
    if (!c->writing) do_write(c);
  }

  void do_write(const ConnPtr& c) {
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
        this->close_conn(c, "write error: " + ec.message());
        return;
      }
      c->wq.pop_front();
      this->do_write(c);
    });
  }

  // Sends what is queued, then half-closes; the read loop closes the socket on the peer's EOF.
  void close_gracefully(const ConnPtr& c) {
    if (!c->open || c->close_after_flush) return;
    c->close_after_flush = true;
    c->close_timer = std::make_unique<asio::steady_timer>(io_);
    c->close_timer->expires_after(opts_.shutdown_flush_timeout);
    c->close_timer->async_wait([this, c](const error_code& ec) {
      if (!ec)
        close_conn(c, fmt::format("peer did not close within {} ms of our final frame",
                                  opts_.shutdown_flush_timeout.count()));
    });
    if (!c->writing) do_write(c);
  }

  void close_conn(const ConnPtr& c, const std::string& why) {
    if (!c->open) return;
    c->open = false;
    if (c->close_timer) c->close_timer->cancel();
    error_code ignored;
    c->sock.shutdown(tcp::socket::shutdown_both, ignored);
    c->sock.close(ignored);
    conns_.erase(c->id);
    spdlog::debug("coordinator: closed {}{}: {}", c->remote, conn_label(c), why);
    if (c->kind == Conn::Kind::kMember && !shutting_down_) {
      auto& m = members_[c->rank];
      if (m.conn == c && m.state == proto::ALIVE) on_member_lost(c->rank, why);
    }
    if (c->kind != Conn::Kind::kMember) drop_routes_of_submitter(c);
    if (shutting_down_ && conns_.empty()) finish();
  }

  // ---- protocol
  // --------------------------------------------------------------------------------------------------

  void handle_frame(const ConnPtr& c, const proto::Envelope& env) {
    if (c->kind == Conn::Kind::kMember) {
      auto& m = members_[c->rank];
      if (m.conn == c) m.last_seen = Clock::now();
    }
    if (shutting_down_) return;  // everything but the close handshake is moot now
    switch (env.msg_case()) {
      case proto::Envelope::kRegisterRequest:
        on_register(c, env.register_request());
        break;
      case proto::Envelope::kHeartbeat:
        on_heartbeat(c, env.heartbeat());
        break;
      case proto::Envelope::kStatusRequest: {
        proto::Envelope out;
        *out.mutable_status_reply() = build_status();
        send(c, out);
        break;
      }
      case proto::Envelope::kShutdown: {
        std::string who = c->remote + conn_label(c);
        spdlog::info("coordinator: shutdown requested by {}: {}", who, env.shutdown().reason());
        begin_shutdown(fmt::format("shutdown requested by {}: {}", who, env.shutdown().reason()), false, 0,
                       "");
        break;
      }
      case proto::Envelope::kGenerateRequest:
        on_generate_request(c, env.generate_request());
        break;
      case proto::Envelope::kGenerateChunk:
        on_generate_chunk(c, env.generate_chunk());
        break;
      case proto::Envelope::kCancelRequest:
        on_cancel_request(c, env.cancel_request());
        break;
      default:
        spdlog::warn("coordinator: rejecting connection from {}{}: unexpected {} frame; closing it",
                     c->remote, conn_label(c), proto::envelope_case_name(env));
        close_conn(c, fmt::format("protocol error: unexpected {}", proto::envelope_case_name(env)));
        break;
    }
  }

  void reject_registration(const ConnPtr& c, const std::string& error) {
    spdlog::warn("coordinator: registration from {} rejected: {}", c->remote, error);
    proto::Envelope out;
    out.mutable_register_reply()->set_error(error);
    out.mutable_register_reply()->set_world_size(static_cast<uint32_t>(members_.size()));
    send(c, out);
    close_gracefully(c);
  }

  void on_register(const ConnPtr& c, const proto::RegisterRequest& req) {
    const auto& self = req.self();
    const uint32_t world = static_cast<uint32_t>(members_.size());
    if (c->kind != Conn::Kind::kUnregistered) {
      return reject_registration(c, fmt::format("connection already registered{}", conn_label(c)));
    }
    if (req.protocol_version() != proto::kProtocolVersion) {
      return reject_registration(c,
                                 fmt::format("protocol version {} is not supported (coordinator speaks {})",
                                             req.protocol_version(), proto::kProtocolVersion));
    }
    if (self.role() == proto::CLIENT) {
      c->kind = Conn::Kind::kClient;
      spdlog::info("coordinator: client registered from {} (host {} pid {})", c->remote, self.host(),
                   self.pid());
      proto::Envelope out;
      auto* rep = out.mutable_register_reply();
      rep->set_world_size(world);
      rep->set_heartbeat_interval_ms(static_cast<uint32_t>(opts_.heartbeat_interval.count()));
      rep->set_heartbeat_timeout_ms(static_cast<uint32_t>(opts_.heartbeat_timeout.count()));
      rep->set_session_id(session_id_);
      send(c, out);
      return;
    }
    std::string who = fmt::format("{} rank {} (#{}) from {}", role_name(self.role()), self.rank(),
                                  self.role_index(), c->remote);
    if (self.role() != proto::INFERENCE && self.role() != proto::CACHE) {
      return reject_registration(
          c, fmt::format("{}: role {} cannot register (only inference, cache or client)", who,
                         role_name(self.role())));
    }
    if (req.world_size() != 0 && req.world_size() != world) {
      return reject_registration(
          c, fmt::format("{}: launched with world size {} but the coordinator's world size is "
                         "{} (role map {})",
                         who, req.world_size(), world, role_map_string()));
    }
    if (self.rank() >= world) {
      return reject_registration(
          c, fmt::format("{}: rank {} is out of range for world size {}", who, self.rank(), world));
    }
    auto& m = members_[self.rank()];
    if (m.info.role() != self.role() || m.info.role_index() != self.role_index()) {
      return reject_registration(
          c, fmt::format("{}: the role map {} says rank {} is {} #{}", who, role_map_string(), self.rank(),
                         role_name(m.info.role()), m.info.role_index()));
    }
    if (m.state == proto::ALIVE) {
      return reject_registration(
          c, fmt::format("{}: duplicate registration, rank {} is already registered by {}", who, self.rank(),
                         describe(self.rank())));
    }
    if (m.state == proto::DEAD) {
      return reject_registration(c, fmt::format("{}: rank {} was declared dead ({}); restart the world", who,
                                                self.rank(), m.dead_reason));
    }
    // Accept.
    proto::RankInfo info = self;
    info.set_rank(self.rank());
    m.info = info;
    m.state = proto::ALIVE;
    m.conn = c;
    m.last_seen = Clock::now();
    m.heartbeat_seq = 0;
    m.stats.clear();
    c->kind = Conn::Kind::kMember;
    c->rank = self.rank();
    spdlog::info("coordinator: registered {} (device {}, transport {} bytes)", describe(self.rank()),
                 self.device(), self.transport().address().size());
    proto::Envelope out;
    auto* rep = out.mutable_register_reply();
    rep->set_world_size(world);
    rep->set_heartbeat_interval_ms(static_cast<uint32_t>(opts_.heartbeat_interval.count()));
    rep->set_heartbeat_timeout_ms(static_cast<uint32_t>(opts_.heartbeat_timeout.count()));
    rep->set_session_id(session_id_);
    send(c, out);
    maybe_complete();
  }

  void maybe_complete() {
    if (world_complete_) return;
    for (const auto& m : members_) {
      if (m.state != proto::ALIVE) return;
    }
    world_complete_ = true;
    rendezvous_timer_.cancel();
    spdlog::info("coordinator: world complete ({} inference + {} cache ranks) after {} ms; pairing {}",
                 num_inference_, num_cache_, age_ms(start_time_, Clock::now()), kPairingRule);
    for (uint32_t r = 0; r < members_.size(); ++r) {
      auto& m = members_[r];
      if (!m.conn) continue;
      proto::Envelope out;
      auto* view = out.mutable_cluster_view();
      *view->mutable_self() = m.info;
      for (uint32_t q : paired_ranks(r)) *view->add_peers() = members_[q].info;
      view->set_world_size(static_cast<uint32_t>(members_.size()));
      view->set_num_inference(num_inference_);
      view->set_num_cache(num_cache_);
      view->set_pairing_rule(kPairingRule);
      view->set_session_id(session_id_);
      send(m.conn, out);
    }
  }

  void on_heartbeat(const ConnPtr& c, const proto::Heartbeat& hb) {
    if (c->kind != Conn::Kind::kMember) {
      spdlog::warn("coordinator: rejecting connection from {}: heartbeat before registration; closing it",
                   c->remote);
      close_conn(c, "protocol error: heartbeat before registration");
      return;
    }
    auto& m = members_[c->rank];
    if (hb.rank() != c->rank) {
      spdlog::warn("coordinator: heartbeat from {} carries rank {}; ignoring the field", describe(c->rank),
                   hb.rank());
    }
    m.heartbeat_seq = hb.seq();
    m.stats.clear();
    for (const auto& [k, v] : hb.stats()) m.stats[k] = v;
    proto::Envelope out;
    out.mutable_heartbeat_ack()->set_seq(hb.seq());
    send(c, out);
  }

  // A registered rank's connection dropped or its heartbeats stopped.
  void on_member_lost(uint32_t r, const std::string& why) {
    auto& m = members_[r];
    if (!world_complete_) {
      spdlog::warn("coordinator: {} lost before the world was complete ({}); its slot is free again",
                   describe(r), why);
      ConnPtr c = m.conn;
      m.state = proto::MISSING;
      m.conn.reset();
      if (c && c->open) {
        c->kind = Conn::Kind::kUnregistered;
        close_conn(c, why);
      }
      return;
    }
    m.state = proto::DEAD;
    m.dead_reason = why;
    spdlog::error("coordinator: {} declared dead: {}", describe(r), why);
    ConnPtr c = m.conn;
    m.conn.reset();
    if (c && c->open) {
      proto::Envelope bye;
      bye.mutable_shutdown()->set_reason(fmt::format("coordinator declared {} dead: {}", describe(r), why));
      bye.mutable_shutdown()->set_is_error(true);
      send(c, bye);
      c->kind = Conn::Kind::kUnregistered;
      close_gracefully(c);
    }
    for (uint32_t q : paired_ranks(r)) {
      auto& peer = members_[q];
      if (peer.state != proto::ALIVE || !peer.conn) continue;
      proto::Envelope out;
      auto* pd = out.mutable_peer_down();
      pd->set_rank(r);
      pd->set_role(m.info.role());
      pd->set_role_index(m.info.role_index());
      pd->set_host(m.info.host());
      pd->set_reason(why);
      send(peer.conn, out);
      spdlog::info("coordinator: sent PeerDown({}) to {}", r, describe(q));
    }
    fail_routes_of_inference(r, fmt::format("{} died: {}", describe(r), why));
  }

  // ---- request routing
  // -------------------------------------------------------------------------------------------

  void send_error_chunk(const ConnPtr& c, uint64_t request_id, const std::string& error) {
    proto::Envelope out;
    auto* ch = out.mutable_generate_chunk();
    ch->set_request_id(request_id);
    ch->set_finished(true);
    ch->set_finish_reason(proto::FINISH_ERROR);
    ch->set_error(error);
    send(c, out);
  }

  // Picks the inference rank for `req`; "" and the rank, or the error text.
  std::string pick_target(const proto::GenerateRequest& req, uint32_t* target) {
    if (shutting_down_) return fmt::format("coordinator: shutting down, cannot route request {}", req.request_id());
    if (!world_complete_)
      return fmt::format("coordinator: world not complete yet, cannot route request {}", req.request_id());
    std::vector<uint32_t> live;
    for (uint32_t r = 0; r < members_.size(); ++r) {
      const auto& m = members_[r];
      if (m.info.role() == proto::INFERENCE && m.state == proto::ALIVE && m.conn) live.push_back(r);
    }
    if (req.has_target_inference()) {
      auto it = std::find_if(live.begin(), live.end(), [&](uint32_t r) {
        return members_[r].info.role_index() == req.target_inference();
      });
      if (it == live.end())
        return fmt::format("coordinator: inference #{} is not alive (request {})", req.target_inference(),
                           req.request_id());
      *target = *it;
      return "";
    }
    if (live.empty()) return fmt::format("coordinator: no live inference rank (request {})", req.request_id());
    *target = live[rr_++ % live.size()];
    return "";
  }

  void forward(uint64_t routed_id, const proto::GenerateRequest& req, uint32_t target) {
    proto::Envelope out;
    *out.mutable_generate_request() = req;
    out.mutable_generate_request()->set_request_id(routed_id);
    send(members_[target].conn, out);
  }

  void on_generate_request(const ConnPtr& c, const proto::GenerateRequest& req) {
    uint32_t target = 0;
    if (auto err = pick_target(req, &target); !err.empty()) return send_error_chunk(c, req.request_id(), err);
    const uint64_t routed_id = next_route_id_++;
    routes_[routed_id] = Route{c, req.request_id(), target, nullptr};
    forward(routed_id, req, target);
    spdlog::debug("coordinator: routed request {} from {} to {} as {}", req.request_id(), c->remote,
                  describe(target), routed_id);
  }

  // In-process submission (HTTP API). `routed_id` was reserved by the caller's thread.
  void on_local_request(uint64_t routed_id, const proto::GenerateRequest& req, ChunkSink sink) {
    uint32_t target = 0;
    if (auto err = pick_target(req, &target); !err.empty()) {
      proto::GenerateChunk ch;
      ch.set_request_id(routed_id);
      ch.set_finished(true);
      ch.set_finish_reason(proto::FINISH_ERROR);
      ch.set_error(err);
      sink(ch);
      return;
    }
    routes_[routed_id] = Route{{}, routed_id, target, std::move(sink)};
    forward(routed_id, req, target);
    spdlog::debug("coordinator: routed local request {} to {}", routed_id, describe(target));
  }

  void send_cancel(uint32_t inference_rank, uint64_t routed_id, const std::string& reason) {
    const auto& m = members_[inference_rank];
    if (m.state != proto::ALIVE || !m.conn) return;
    proto::Envelope out;
    out.mutable_cancel_request()->set_request_id(routed_id);
    out.mutable_cancel_request()->set_reason(reason);
    send(m.conn, out);
  }

  void cancel_route(uint64_t routed_id, const std::string& reason) {
    auto it = routes_.find(routed_id);
    if (it == routes_.end()) return;
    spdlog::info("coordinator: cancelling request {} on {}: {}", routed_id, describe(it->second.inference_rank),
                 reason);
    send_cancel(it->second.inference_rank, routed_id, reason);
    routes_.erase(it);  // later chunks of it are dropped
  }

  void on_cancel_request(const ConnPtr& c, const proto::CancelRequest& cr) {
    for (auto& [routed_id, route] : routes_) {
      if (route.submitter.lock() == c && route.submitter_request_id == cr.request_id()) {
        const uint64_t id = routed_id;
        return cancel_route(id, fmt::format("cancelled by {}: {}", c->remote, cr.reason()));
      }
    }
  }

  void on_generate_chunk(const ConnPtr& c, const proto::GenerateChunk& chunk) {
    auto it = routes_.find(chunk.request_id());
    if (it == routes_.end()) {
      spdlog::debug("coordinator: chunk for unknown/finished request {} from {}; dropped", chunk.request_id(),
                    c->remote);
      return;
    }
    if (c->kind != Conn::Kind::kMember || c->rank != it->second.inference_rank) {
      spdlog::warn("coordinator: chunk for request {} from {} which does not serve it; dropped",
                   chunk.request_id(), c->remote + conn_label(c));
      return;
    }
    if (it->second.local_sink) {
      proto::GenerateChunk out = chunk;
      out.set_served_by_rank(c->rank);
      auto sink = it->second.local_sink;  // the sink may cancel (erase) this route
      if (chunk.finished()) routes_.erase(it);
      sink(out);
      return;
    }
    ConnPtr sub = it->second.submitter.lock();
    if (sub && sub->open) {
      proto::Envelope out;
      *out.mutable_generate_chunk() = chunk;
      out.mutable_generate_chunk()->set_request_id(it->second.submitter_request_id);
      out.mutable_generate_chunk()->set_served_by_rank(c->rank);
      send(sub, out);
    }
    if (chunk.finished()) routes_.erase(it);
  }

  void fail_routes_of_inference(uint32_t r, const std::string& why) {
    for (auto it = routes_.begin(); it != routes_.end();) {
      if (it->second.inference_rank == r) {
        if (it->second.local_sink) {
          proto::GenerateChunk ch;
          ch.set_request_id(it->first);
          ch.set_finished(true);
          ch.set_finish_reason(proto::FINISH_ERROR);
          ch.set_error(why);
          ch.set_served_by_rank(r);
          auto sink = std::move(it->second.local_sink);
          it = routes_.erase(it);
          sink(ch);
          continue;
        }
        if (auto sub = it->second.submitter.lock(); sub && sub->open) {
          send_error_chunk(sub, it->second.submitter_request_id, why);
        }
        it = routes_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // A submitter that went away does not want its requests any more: cancel them on their inference ranks.
  void drop_routes_of_submitter(const ConnPtr& c) {
    for (auto it = routes_.begin(); it != routes_.end();) {
      if (it->second.local_sink) {
        ++it;
        continue;
      }
      auto sub = it->second.submitter.lock();
      if (!sub || sub == c) {
        send_cancel(it->second.inference_rank, it->first,
                    fmt::format("submitter {} disconnected", c->remote));
        it = routes_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // ---- timers
  // ----------------------------------------------------------------------------------------------------

  void schedule_tick() {
    auto period = std::clamp(std::min(opts_.heartbeat_timeout / 4, opts_.heartbeat_interval),
                             std::chrono::milliseconds(5), std::chrono::milliseconds(250));
    tick_timer_.expires_after(period);
    tick_timer_.async_wait([this](const error_code& ec) {
      if (ec || this->shutting_down_) return;
      this->check_heartbeats();
      this->refresh_health();
      this->schedule_tick();
    });
  }

  void refresh_health() {
    Health h;
    h.running = true;
    h.world_complete = world_complete_;
    h.shutting_down = shutting_down_;
    h.num_inference = num_inference_;
    h.num_cache = num_cache_;
    for (const auto& m : members_) {
      if (m.state != proto::ALIVE || !m.conn) continue;
      if (m.info.role() == proto::INFERENCE) ++h.live_inference;
      if (m.info.role() == proto::CACHE) ++h.live_cache;
    }
    std::lock_guard<std::mutex> lk(health_mu_);
    health_ = h;
    last_tick_ = Clock::now();
  }

 public:
  Health health() const {
    std::lock_guard<std::mutex> lk(health_mu_);
    Health h = health_;
    h.running = h.running && running_ && !finished_flag_;
    h.shutting_down = h.shutting_down || shutting_down_flag_;
    h.since_loop_tick = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_tick_);
    return h;
  }

  uint64_t submit_local(proto::GenerateRequest req, ChunkSink sink) {
    const uint64_t id = next_route_id_++;
    asio::post(io_, [this, id, req = std::move(req), sink = std::move(sink)]() mutable {
      on_local_request(id, req, std::move(sink));
    });
    return id;
  }

  void cancel_local(uint64_t routed_id, const std::string& reason) {
    asio::post(io_, [this, routed_id, reason] { cancel_route(routed_id, reason); });
  }

 private:
  void check_heartbeats() {
    auto now = Clock::now();
    for (uint32_t r = 0; r < members_.size(); ++r) {
      auto& m = members_[r];
      if (m.state != proto::ALIVE || !m.conn) continue;
      auto silent = age_ms(m.last_seen, now);
      if (silent > static_cast<uint64_t>(opts_.heartbeat_timeout.count())) {
        on_member_lost(r, fmt::format("no heartbeat for {} ms (timeout {} ms)", silent,
                                      opts_.heartbeat_timeout.count()));
      }
    }
  }

  void on_rendezvous_deadline() {
    if (world_complete_ || shutting_down_) return;
    std::vector<std::string> missing;
    for (uint32_t r = 0; r < members_.size(); ++r) {
      const auto& m = members_[r];
      if (m.state != proto::ALIVE) {
        missing.push_back(fmt::format("{} ({} #{})", r, role_name(m.info.role()), m.info.role_index()));
      }
    }
    std::string list;
    for (size_t i = 0; i < missing.size(); ++i) list += (i ? ", " : "") + missing[i];
    std::string msg =
        fmt::format("{} {} never registered within {} ms", missing.size() == 1 ? "rank" : "ranks", list,
                    opts_.rendezvous_timeout.count());
    spdlog::error("coordinator: rendezvous failed: {}", msg);
    begin_shutdown(msg, true, 1, "rendezvous failed: " + msg);
  }

  // ---- shutdown
  // --------------------------------------------------------------------------------------------------

  void begin_shutdown(const std::string& reason, bool is_error, int code, const std::string& exit_message) {
    shutting_down_flag_ = true;
    if (shutting_down_) return;
    shutting_down_ = true;
    {
      std::lock_guard lk(exit_mu_);
      exit_.code = code;
      exit_.message = exit_message.empty() ? reason : exit_message;
    }
    spdlog::info("coordinator: broadcasting Shutdown to {} connection(s): {}", conns_.size(), reason);
    error_code ignored;
    acceptor_.close(ignored);
    tick_timer_.cancel();
    rendezvous_timer_.cancel();
    signals_.cancel(ignored);
    proto::Envelope bye;
    bye.mutable_shutdown()->set_reason(reason);
    bye.mutable_shutdown()->set_is_error(is_error);
    std::vector<ConnPtr> all;
    for (auto& [id, c] : conns_) all.push_back(c);
    for (auto& c : all) {
      send(c, bye);
      close_gracefully(c);
    }
    if (conns_.empty()) {
      finish();
      return;
    }
    flush_timer_.expires_after(opts_.shutdown_flush_timeout);
    flush_timer_.async_wait([this](const error_code& ec) {
      if (ec) return;
      if (!this->conns_.empty()) {
        spdlog::warn("coordinator: {} connection(s) did not close within {} ms of Shutdown; closing them",
                     this->conns_.size(), this->opts_.shutdown_flush_timeout.count());
      }
      std::vector<ConnPtr> rest;
      for (auto& [id, c] : this->conns_) rest.push_back(c);
      for (auto& c : rest) this->close_conn(c, "shutdown flush timeout");
      this->finish();
    });
  }

  void finish() {
    if (finished_) return;
    finished_ = true;
    finished_flag_ = true;
    flush_timer_.cancel();
    io_.stop();
  }

  // ---- status
  // ----------------------------------------------------------------------------------------------------

  std::string role_map_string() const {
    std::string s;
    for (size_t i = 0; i < opts_.role_map.size(); ++i) {
      if (i) s += ',';
      auto r = opts_.role_map[i];
      s += r == proto::COORDINATOR ? 'c' : r == proto::INFERENCE ? 'i' : 'k';
    }
    return s;
  }

  proto::StatusReply build_status() const {
    proto::StatusReply st;
    auto now = Clock::now();
    st.set_world_complete(world_complete_);
    st.set_world_size(static_cast<uint32_t>(members_.size()));
    st.set_uptime_ms(age_ms(start_time_, now));
    st.set_shutting_down(shutting_down_);
    st.set_session_id(session_id_);
    for (const auto& m : members_) {
      if (m.info.role() == proto::COORDINATOR) continue;
      auto* rs = st.add_ranks();
      *rs->mutable_info() = m.info;
      rs->set_state(m.state);
      if (m.state != proto::MISSING) rs->set_last_heartbeat_age_ms(age_ms(m.last_seen, now));
      rs->set_heartbeat_seq(m.heartbeat_seq);
      rs->set_dead_reason(m.dead_reason);
      for (const auto& [k, v] : m.stats) (*rs->mutable_stats())[k] = v;
    }
    return st;
  }

  ServerOptions opts_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer tick_timer_;
  asio::steady_timer rendezvous_timer_;
  asio::steady_timer flush_timer_;
  asio::signal_set signals_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  bool armed_ = false;

  uint16_t port_ = 0;
  uint64_t session_id_ = 0;
  Clock::time_point start_time_{};
  uint32_t num_inference_ = 0;
  uint32_t num_cache_ = 0;
  std::vector<Member> members_;  // indexed by global rank
  std::map<uint64_t, ConnPtr> conns_;
  uint64_t next_conn_id_ = 1;
  bool world_complete_ = false;
  bool shutting_down_ = false;
  bool finished_ = false;
  std::unordered_map<uint64_t, Route> routes_;
  std::atomic<uint64_t> next_route_id_{1};
  mutable std::mutex health_mu_;
  Health health_;
  Clock::time_point last_tick_ = Clock::now();
  std::atomic<bool> finished_flag_{false};
  std::atomic<bool> shutting_down_flag_{false};
  uint32_t rr_ = 0;

  mutable std::mutex exit_mu_;
  ExitStatus exit_;
};

CoordinatorServer::CoordinatorServer(ServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

CoordinatorServer::~CoordinatorServer() {
  impl_->stop_and_join();
}

uint16_t CoordinatorServer::port() const {
  return impl_->port();
}

ExitStatus CoordinatorServer::run() {
  return impl_->run_here();
}

void CoordinatorServer::start() {
  impl_->start_thread();
}

ExitStatus CoordinatorServer::wait() {
  return impl_->join();
}

bool CoordinatorServer::wait_until(Deadline deadline, ExitStatus* out) {
  return impl_->join_until(deadline, out);
}

void CoordinatorServer::request_shutdown(const std::string& reason) {
  impl_->post_shutdown(reason);
}

uint64_t CoordinatorServer::submit_local(proto::GenerateRequest request, ChunkSink sink) {
  return impl_->submit_local(std::move(request), std::move(sink));
}

void CoordinatorServer::cancel_local(uint64_t routed_id, const std::string& reason) {
  impl_->cancel_local(routed_id, reason);
}

Health CoordinatorServer::health() const {
  return impl_->health();
}

proto::StatusReply CoordinatorServer::status(Deadline deadline) const {
  return impl_->status_from_other_thread(deadline);
}

}  // namespace spade::coord

#include "coordinator/server.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <csignal>
#include <future>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "coordinator/launch_env.h"
#include "coordinator/server_auth.h"
#include "coordinator/server_connection.h"
#include "coordinator/server_internal.h"
#include "coordinator/server_membership.h"
#include "coordinator/server_routing.h"

namespace spade::coord {

namespace {

// ---- setup
// -------------------------------------------------------------------------------------------------

// Throws spade::Error naming the first problem: bad role map (no cache rank, cache ranks not a multiple of the
// inference ranks), bad timeouts or frame size.
void validate_options(const ServerOptions& opts) {
  const auto& rm = opts.role_map;
  SPADE_CHECK(!rm.empty(), "coordinator: empty role map");
  auto n_coord = std::count(rm.begin(), rm.end(), proto::COORDINATOR);
  SPADE_CHECK(n_coord == 1, "coordinator: role map has {} coordinators (exactly one required)", n_coord);
  const auto num_inference = static_cast<uint32_t>(std::count(rm.begin(), rm.end(), proto::INFERENCE));
  const auto num_cache = static_cast<uint32_t>(std::count(rm.begin(), rm.end(), proto::CACHE));
  SPADE_CHECK(num_inference + num_cache + 1 == rm.size(), "coordinator: role map has unknown roles");
  SPADE_CHECK(num_inference >= 1,
              "coordinator: the world needs at least one inference rank (role map has 0)");
  SPADE_CHECK(num_cache >= 1, "coordinator: the world needs at least one cache rank per inference rank (role map "
              "has 0)");
  try {
    (void)cache_ranks_per_inference(num_inference, num_cache);
  } catch (const Error& e) {
    fail("coordinator: {}", e.what());
  }
  SPADE_CHECK(opts.heartbeat_interval.count() > 0, "coordinator: heartbeat interval must be > 0 ms");
  SPADE_CHECK(opts.heartbeat_timeout > opts.heartbeat_interval,
              "coordinator: heartbeat timeout ({} ms) must exceed the heartbeat interval ({} ms)",
              opts.heartbeat_timeout.count(), opts.heartbeat_interval.count());
  SPADE_CHECK(opts.rendezvous_timeout.count() > 0, "coordinator: rendezvous timeout must be > 0 ms");
  SPADE_CHECK(opts.max_frame_bytes >= 1024, "coordinator: max frame size {} is too small",
              opts.max_frame_bytes);
  SPADE_CHECK(
      opts.max_unauthenticated_frame_bytes >= 1024 &&
          opts.max_unauthenticated_frame_bytes <= opts.max_frame_bytes,
      "coordinator: --max-unauthenticated-frame-bytes {} must be between 1024 and --max-frame-bytes {}",
      opts.max_unauthenticated_frame_bytes, opts.max_frame_bytes);
  SPADE_CHECK(opts.max_unauthenticated_connections >= 1,
              "coordinator: --max-unauthenticated-connections must be >= 1");
  SPADE_CHECK(opts.auth_timeout.count() > 0, "coordinator: --auth-timeout-ms must be > 0");
  SPADE_CHECK(
      opts.idle_timeout >= 2 * opts.heartbeat_interval,
      "coordinator: --idle-timeout-ms {} must be at least twice the heartbeat interval ({} ms): ranks and "
      "clients send a heartbeat every interval",
      opts.idle_timeout.count(), opts.heartbeat_interval.count());
  if (opts.cluster_secret.empty()) {
    error_code ec;
    const auto addr = asio::ip::make_address(opts.bind_host, ec);
    if (!ec && !addr.is_loopback()) {
      fail(
          "coordinator: refusing to listen on {}:{} without a cluster secret: anyone who reaches the control "
          "port could stop the world, submit requests or read its hosts, pids and addresses. Give every "
          "process the same secret (--cluster-secret-file FILE or SPADE_CLUSTER_SECRET_FILE; docs/DEPLOY.md, "
          "\"Security model\"), or listen on a loopback address (--host 127.0.0.1) for a single-host world",
          opts.bind_host, opts.port);
    }
  } else {
    SPADE_CHECK(opts.cluster_secret.size() >= kMinClusterSecretBytes,
                "coordinator: the cluster secret is {} bytes; at least {} are required",
                opts.cluster_secret.size(), kMinClusterSecretBytes);
  }
}

ServerOptions validated(ServerOptions opts) {
  validate_options(opts);
  return opts;
}

}  // namespace

// Owns the io thread and the server units (Connections, Membership, RequestRouter), wires their events
// together, dispatches frames to them, and runs the timers, the shutdown and the thread-safe entry points.
class CoordinatorServer::Impl final : private ConnectionEvents, private MembershipEvents {
 public:
  explicit Impl(ServerOptions o)
      : ctx_(validated(std::move(o))),
        connections_(ctx_, *this),
        auth_(ctx_, connections_),
        membership_(ctx_, connections_, *this),
        router_(ctx_, membership_, connections_),
        tick_timer_(ctx_.io),
        rendezvous_timer_(ctx_.io),
        flush_timer_(ctx_.io),
        signals_(ctx_.io) {
    connections_.listen();
    ctx_.start_time = Clock::now();
  }

  uint16_t port() const { return connections_.port(); }

  // Arms timers and the accept loop; called on the io thread's behalf before io_.run().
  void arm() {
    if (armed_) return;
    armed_ = true;
    connections_.start_accepting();
    schedule_tick();
    rendezvous_timer_.expires_at(ctx_.start_time + ctx_.opts.rendezvous_timeout);
    rendezvous_timer_.async_wait([this](const error_code& ec) {
      if (!ec) this->on_rendezvous_deadline();
    });
    if (ctx_.opts.handle_signals) {
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
    ctx_.io.run();
    running_ = false;
    std::lock_guard lk(exit_mu_);
    return exit_;
  }

  void start_thread() {
    SPADE_CHECK(!thread_.joinable(), "coordinator server already started");
    arm();
    running_ = true;
    thread_ = std::thread([this] {
      this->ctx_.io.run();
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
    asio::post(ctx_.io, [this, reason] { this->begin_shutdown(reason, false, 0, ""); });
  }

  void stop_and_join() {
    if (thread_.joinable()) {
      post_shutdown("coordinator server object destroyed");
      thread_.join();
    }
  }

  proto::StatusReply status_from_other_thread(Deadline deadline) {
    SPADE_CHECK(running_, "coordinator on port {} is not running", port());
    auto prom = std::make_shared<std::promise<proto::StatusReply>>();
    auto fut = prom->get_future();
    asio::post(ctx_.io, [this, prom] { prom->set_value(this->membership_.build_status()); });
    if (fut.wait_until(deadline) != std::future_status::ready) {
      fail("coordinator on port {} did not answer a status query before the deadline", port());
    }
    return fut.get();
  }

  Health health() const {
    std::lock_guard<std::mutex> lk(health_mu_);
    Health h = health_;
    h.running = h.running && running_ && !finished_flag_;
    h.shutting_down = h.shutting_down || shutting_down_flag_;
    h.since_loop_tick = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_tick_);
    return h;
  }

  uint64_t submit_local(proto::GenerateRequest req, ChunkSink sink) {
    const uint64_t id = router_.reserve_id();
    asio::post(ctx_.io, [this, id, req = std::move(req), sink = std::move(sink)]() mutable {
      router_.on_local_request(id, req, std::move(sink));
    });
    return id;
  }

  void cancel_local(uint64_t routed_id, const std::string& reason, std::optional<uint32_t> sample) {
    asio::post(ctx_.io, [this, routed_id, reason, sample] {
      if (sample) {
        router_.cancel_sample(routed_id, *sample, reason);
      } else {
        router_.cancel_route(routed_id, reason);
      }
    });
  }

 private:
  // ---- protocol
  // --------------------------------------------------------------------------------------------------

  // ConnectionEvents: hands each frame to the unit that owns its message.
  void on_frame(const ConnPtr& c, const proto::Envelope& env) override {
    membership_.touch(c);
    if (ctx_.shutting_down) return;  // everything but the close handshake is moot now
    if (c->close_after_flush) return;  // being closed (refused, declared dead): nothing it sends counts
    if (c->kind == Conn::Kind::kUnregistered) return on_unregistered_frame(c, env);
    switch (env.msg_case()) {
      case proto::Envelope::kRegisterRequest:
        membership_.on_register(c, env.register_request());
        break;
      case proto::Envelope::kHeartbeat:
        membership_.on_heartbeat(c, env.heartbeat());
        break;
      case proto::Envelope::kStatusRequest: {
        proto::Envelope out;
        *out.mutable_status_reply() = membership_.build_status();
        connections_.send(c, out);
        break;
      }
      case proto::Envelope::kShutdown: {
        std::string who = c->remote + label(*c);
        if (c->kind != Conn::Kind::kClient) {
          spdlog::warn(
              "coordinator: ignoring a shutdown request from {}: only a registered client may stop the world",
              who);
          break;
        }
        spdlog::info("coordinator: shutdown requested by {}: {}", who, env.shutdown().reason());
        begin_shutdown(fmt::format("shutdown requested by {}: {}", who, env.shutdown().reason()), false, 0,
                       "");
        break;
      }
      case proto::Envelope::kGenerateRequest:
        if (c->kind != Conn::Kind::kClient) {
          spdlog::warn("coordinator: refusing request {} from {}: only a registered client may submit",
                       env.generate_request().request_id(), c->remote + label(*c));
          router_.refuse(c, env.generate_request(),
                         "only a registered client may submit generation requests");
          break;
        }
        router_.on_generate_request(c, env.generate_request());
        break;
      case proto::Envelope::kGenerateChunk:
        router_.on_generate_chunk(c, env.generate_chunk());
        break;
      case proto::Envelope::kCancelRequest:
        router_.on_cancel_request(c, env.cancel_request());
        break;
      case proto::Envelope::kPairOffer:
        if (c->kind != Conn::Kind::kMember) {
          spdlog::warn("coordinator: ignoring a pair offer from {}: only a registered rank may offer",
                       c->remote + label(*c));
          break;
        }
        membership_.on_pair_offer(c, env.pair_offer());
        break;
      default:
        spdlog::warn("coordinator: rejecting connection from {}{}: unexpected {} frame; closing it",
                     c->remote, label(*c), proto::envelope_case_name(env));
        connections_.close(c, fmt::format("protocol error: unexpected {}", proto::envelope_case_name(env)));
        break;
    }
  }

  // A frame from a connection that has not registered: the challenge-response, then the registration (which,
  // without a secret, admits the connection). Anything else is dropped and the connection closed.
  void on_unregistered_frame(const ConnPtr& c, const proto::Envelope& env) {
    switch (env.msg_case()) {
      case proto::Envelope::kAuthHello:
        if (c->admitted) return auth_.drop(c, env);
        auth_.on_hello(c, env.auth_hello());
        break;
      case proto::Envelope::kAuthProof:
        if (c->admitted) return auth_.drop(c, env);
        auth_.on_proof(c, env.auth_proof());
        break;
      case proto::Envelope::kRegisterRequest:
        if (auth_.required() && !c->admitted) {
          return auth_.refuse(
              c,
              "authentication required: this coordinator has a cluster secret and the peer did not "
              "authenticate (give it the same secret: --cluster-secret-file / "
              "SPADE_CLUSTER_SECRET_FILE)");
        }
        membership_.on_register(c, env.register_request());
        if (c->open && c->kind != Conn::Kind::kUnregistered) connections_.admit(c);
        if (c->open && !c->admitted) ++ctx_.rejected_connections;  // registration refused before admission
        break;
      default:
        auth_.drop(c, env);
        break;
    }
  }

  // ConnectionEvents: a lost member connection loses its rank; a lost submitter loses its requests.
  void on_closed(const ConnPtr& c, const std::string& why) override {
    if (c->kind == Conn::Kind::kMember && !ctx_.shutting_down) membership_.on_connection_closed(c, why);
    if (c->kind != Conn::Kind::kMember) router_.drop_routes_of_submitter(c);
    if (ctx_.shutting_down && connections_.empty()) finish();
  }

  std::string label(const Conn& c) const override { return membership_.conn_label(c); }

  // MembershipEvents
  void on_world_complete() override { rendezvous_timer_.cancel(); }
  void on_rank_dead(uint32_t rank, const std::string& why) override {
    router_.fail_routes_of_inference(rank, why);
  }

  // ---- timers
  // ----------------------------------------------------------------------------------------------------

  void schedule_tick() {
    auto period = std::clamp(std::min(ctx_.opts.heartbeat_timeout / 4, ctx_.opts.heartbeat_interval),
                             std::chrono::milliseconds(5), std::chrono::milliseconds(250));
    tick_timer_.expires_after(period);
    tick_timer_.async_wait([this](const error_code& ec) {
      if (ec || this->ctx_.shutting_down) return;
      this->connections_.check_deadlines(Clock::now());
      this->membership_.check_heartbeats();
      this->refresh_health();
      this->schedule_tick();
    });
  }

  void refresh_health() {
    Health h;
    h.running = true;
    h.world_complete = membership_.world_complete();
    h.shutting_down = ctx_.shutting_down;
    h.num_inference = membership_.num_inference();
    h.num_cache = membership_.num_cache();
    membership_.count_live(&h.live_inference, &h.live_cache);
    h.degraded = membership_.degraded();
    h.auth_required = auth_.required();
    h.unauthenticated_connections = connections_.unauthenticated();
    h.rejected_connections = ctx_.rejected_connections;
    std::lock_guard<std::mutex> lk(health_mu_);
    health_ = h;
    last_tick_ = Clock::now();
  }

  void on_rendezvous_deadline() {
    if (membership_.world_complete() || ctx_.shutting_down) return;
    std::vector<std::string> missing = membership_.missing_ranks();
    std::string list;
    for (size_t i = 0; i < missing.size(); ++i) list += (i ? ", " : "") + missing[i];
    std::string msg =
        fmt::format("{} {} never registered within {} ms", missing.size() == 1 ? "rank" : "ranks", list,
                    ctx_.opts.rendezvous_timeout.count());
    spdlog::error("coordinator: rendezvous failed: {}", msg);
    begin_shutdown(msg, true, 1, "rendezvous failed: " + msg);
  }

  // ---- shutdown
  // --------------------------------------------------------------------------------------------------

  void begin_shutdown(const std::string& reason, bool is_error, int code, const std::string& exit_message) {
    shutting_down_flag_ = true;
    if (ctx_.shutting_down) return;
    ctx_.shutting_down = true;
    {
      std::lock_guard lk(exit_mu_);
      exit_.code = code;
      exit_.message = exit_message.empty() ? reason : exit_message;
    }
    spdlog::info("coordinator: broadcasting Shutdown to {} connection(s): {}", connections_.size(), reason);
    error_code ignored;
    connections_.stop_accepting();
    tick_timer_.cancel();
    rendezvous_timer_.cancel();
    signals_.cancel(ignored);
    proto::Envelope bye;
    bye.mutable_shutdown()->set_reason(reason);
    bye.mutable_shutdown()->set_is_error(is_error);
    for (auto& c : connections_.snapshot()) {
      connections_.send(c, bye);
      connections_.close_gracefully(c);
    }
    if (connections_.empty()) {
      finish();
      return;
    }
    flush_timer_.expires_after(ctx_.opts.shutdown_flush_timeout);
    flush_timer_.async_wait([this](const error_code& ec) {
      if (!ec) this->on_flush_timeout();
    });
  }

  // Shutdown's flush deadline: closes whatever connection is still open and stops.
  void on_flush_timeout() {
    if (!connections_.empty()) {
      spdlog::warn("coordinator: {} connection(s) did not close within {} ms of Shutdown; closing them",
                   connections_.size(), ctx_.opts.shutdown_flush_timeout.count());
    }
    for (auto& c : connections_.snapshot()) connections_.close(c, "shutdown flush timeout");
    finish();
  }

  void finish() {
    if (finished_) return;
    finished_ = true;
    finished_flag_ = true;
    flush_timer_.cancel();
    ctx_.io.stop();
  }

  ServerContext ctx_;  // options, io_context, session; declared first: the units below hold references to it
  Connections connections_;
  Authenticator auth_;
  Membership membership_;
  RequestRouter router_;
  asio::steady_timer tick_timer_;
  asio::steady_timer rendezvous_timer_;
  asio::steady_timer flush_timer_;
  asio::signal_set signals_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  bool armed_ = false;
  bool finished_ = false;

  mutable std::mutex health_mu_;
  Health health_;
  Clock::time_point last_tick_ = Clock::now();
  std::atomic<bool> finished_flag_{false};
  std::atomic<bool> shutting_down_flag_{false};

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

void CoordinatorServer::cancel_local(uint64_t routed_id, const std::string& reason, std::optional<uint32_t> sample) {
  impl_->cancel_local(routed_id, reason, sample);
}

Health CoordinatorServer::health() const {
  return impl_->health();
}

proto::StatusReply CoordinatorServer::status(Deadline deadline) const {
  return impl_->status_from_other_thread(deadline);
}

}  // namespace spade::coord

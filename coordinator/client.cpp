#include "coordinator/client.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include "coordinator/asio.h"

#include "common/error.h"
#include "coordinator/auth.h"
#include "coordinator/launch_env.h"

namespace spade::coord {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

namespace {
long long ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(b - a).count();
}
}  // namespace

class CoordinatorClient::Impl {
 public:
  explicit Impl(ClientOptions o)
      : opts_(std::move(o)),
        work_(asio::make_work_guard(io_)),
        sock_(io_),
        hb_timer_(io_),
        decoder_(opts_.max_frame_bytes) {
    if (opts_.host.empty()) opts_.host = asio::ip::host_name();
    coord_name_ = fmt::format("coordinator {}:{}", opts_.coordinator_host, opts_.coordinator_port);
    self_name_ = opts_.role == proto::CLIENT
                     ? std::string("client")
                     : fmt::format("{} rank {} (#{})", role_name(opts_.role), opts_.rank, opts_.role_index);
    thread_ = std::thread([this] { io_.run(); });
  }

  ~Impl() {
    asio::post(io_, [this] {
      hb_running_ = false;
      hb_timer_.cancel();
      closing_ = true;
      error_code ignored;
      sock_.shutdown(tcp::socket::shutdown_both, ignored);
      sock_.close(ignored);
    });
    work_.reset();
    // Handlers still queued (reads on the closed socket) finish with operation_aborted; then run() returns.
    auto stop_by = Clock::now() + std::chrono::seconds(2);
    while (!io_.stopped() && Clock::now() < stop_by)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

  // ---- connection
  // ------------------------------------------------------------------------------------------------

  void connect(Deadline deadline) {
    auto start = Clock::now();
    std::string last_error = "no attempt made";
    int attempts = 0;
    for (;;) {
      {
        std::lock_guard lk(mu_);
        if (connected_) return;
        SPADE_CHECK(!shutdown_ && !lost_, "{}: {} cannot reconnect after the session ended", coord_name_,
                    self_name_);
      }
      ++attempts;
      tcp::resolver resolver(io_);
      error_code ec;
      auto results = resolver.resolve(opts_.coordinator_host, std::to_string(opts_.coordinator_port), ec);
      if (ec) {
        last_error = "cannot resolve host: " + ec.message();
      } else {
        auto prom = std::make_shared<std::promise<error_code>>();
        auto fut = prom->get_future();
        asio::post(io_, [this, results, prom] {
          error_code ignored;
          sock_.close(ignored);
          asio::async_connect(sock_, results,
                              [prom](const error_code& e, const tcp::endpoint&) { prom->set_value(e); });
        });
        if (fut.wait_until(deadline) != std::future_status::ready) {
          asio::post(io_, [this] {
            error_code ignored;
            sock_.close(ignored);
          });
          fut.wait_for(std::chrono::seconds(2));
          last_error = "connect attempt still pending at the deadline";
          break;
        }
        ec = fut.get();
        if (!ec) {
          asio::post(io_, [this] {
            error_code ignored;
            sock_.set_option(tcp::no_delay(true), ignored);
            start_read();
          });
          {
            std::lock_guard lk(mu_);
            connected_ = true;
          }
          spdlog::debug("{}: connected to {} after {} attempt(s)", self_name_, coord_name_, attempts);
          if (!opts_.cluster_secret.empty()) authenticate(deadline);
          return;
        }
        last_error = ec.message();
      }
      if (Clock::now() + opts_.connect_retry_interval >= deadline) break;
      std::this_thread::sleep_for(opts_.connect_retry_interval);
    }
    fail("cannot reach {} within {} ms as {} ({} attempt(s)); last error: {}", coord_name_,
         ms_between(start, deadline), self_name_, attempts, last_error);
  }

  // The peer's side of the challenge-response (coordinator/auth.h): proves the coordinator knows our secret
  // before anything else is sent, then proves we do. Our proof's verdict arrives with the RegisterReply.
  void authenticate(Deadline deadline) {
    const std::string client_nonce = auth_nonce();
    proto::Envelope hello;
    hello.mutable_auth_hello()->set_client_nonce(client_nonce);
    send(hello);
    proto::AuthChallenge ch;
    {
      std::unique_lock lk(mu_);
      auto start = Clock::now();
      cv_.wait_until(lk, deadline,
                     [&] { return challenge_.has_value() || reg_reply_.has_value() || shutdown_ || lost_; });
      if (!challenge_) {
        if (reg_reply_ && !reg_reply_->error().empty())
          fail("{} refused the authentication of {}: {}", coord_name_, self_name_, reg_reply_->error());
        if (shutdown_)
          fail("{} shut the world down while {} was authenticating: {}", coord_name_, self_name_,
               shutdown_->reason());
        if (lost_)
          fail(
              "{}: connection lost while {} was authenticating: {} (a coordinator closes connections that "
              "do not authenticate in time or while it has too many unauthenticated ones)",
              coord_name_, self_name_, lost_reason_);
        fail("{} sent no authentication challenge to {} within {} ms", coord_name_, self_name_,
             ms_between(start, deadline));
      }
      ch = *challenge_;
    }
    if (ch.server_nonce().size() != kAuthNonceBytes ||
        !proof_matches(coordinator_proof(opts_.cluster_secret, client_nonce, ch.server_nonce()),
                       ch.server_proof())) {
      asio::post(io_, [this] { close_socket(); });
      fail(
          "{} did not prove it knows the cluster secret: either the two sides were given different "
          "secrets or it is not our coordinator; {} refuses to talk to it",
          coord_name_, self_name_);
    }
    proto::Envelope proof;
    proof.mutable_auth_proof()->set_client_proof(
        peer_proof(opts_.cluster_secret, ch.server_nonce(), client_nonce));
    send(proof);
  }

  proto::RegisterReply register_self(Deadline deadline) {
    proto::Envelope env;
    auto* req = env.mutable_register_request();
    req->set_protocol_version(proto::kProtocolVersion);
    req->set_world_size(opts_.world_size);
    auto* self = req->mutable_self();
    self->set_role(opts_.role);
    self->set_rank(opts_.rank);
    self->set_role_index(opts_.role_index);
    self->set_local_rank(opts_.local_rank);
    self->set_host(opts_.host);
    self->set_device(opts_.device);
    self->set_pid(static_cast<uint32_t>(::getpid()));
    self->mutable_transport()->set_kind(opts_.transport_kind);
    self->mutable_transport()->set_address(opts_.transport_address);
    self->set_layers_per_pack(opts_.layers_per_pack);
    send(env);
    std::unique_lock lk(mu_);
    auto start = Clock::now();
    bool ok = cv_.wait_until(lk, deadline, [&] { return reg_reply_.has_value() || shutdown_ || lost_; });
    if (reg_reply_) {
      if (!reg_reply_->error().empty()) {
        fail("{} rejected the registration of {}: {}", coord_name_, self_name_, reg_reply_->error());
      }
      return *reg_reply_;
    }
    if (shutdown_)
      fail("{} shut the world down while {} was registering: {}", coord_name_, self_name_,
           shutdown_->reason());
    if (lost_)
      fail("{}: connection lost while {} was registering: {}", coord_name_, self_name_, lost_reason_);
    (void)ok;
    fail("{} did not answer the registration of {} within {} ms", coord_name_, self_name_,
         ms_between(start, deadline));
  }

  proto::ClusterView wait_cluster_view(Deadline deadline) {
    std::unique_lock lk(mu_);
    auto start = Clock::now();
    cv_.wait_until(lk, deadline, [&] { return view_.has_value() || shutdown_ || lost_; });
    if (view_) return *view_;
    if (shutdown_) {
      fail("{} shut the world down while {} waited for the cluster view: {}", coord_name_, self_name_,
           shutdown_->reason());
    }
    if (lost_)
      fail("{}: connection lost while {} waited for the cluster view: {}", coord_name_, self_name_,
           lost_reason_);
    fail("no cluster view from {} within {} ms ({}); the world is not complete", coord_name_,
         ms_between(start, deadline), self_name_);
  }

  proto::ClusterView rendezvous(Deadline deadline) {
    connect(deadline);
    register_self(deadline);
    start_heartbeat();
    if (opts_.role == proto::CLIENT) return {};
    return wait_cluster_view(deadline);
  }

  // ---- heartbeats
  // --------------------------------------------------------------------------------------------------

  void start_heartbeat() {
    std::chrono::milliseconds interval = opts_.heartbeat_interval;
    std::chrono::milliseconds timeout{0};
    {
      std::lock_guard lk(mu_);
      if (interval.count() == 0) {
        SPADE_CHECK(
            reg_reply_.has_value() && reg_reply_->heartbeat_interval_ms() > 0,
            "{}: heartbeat interval unknown (register with {} first or set ClientOptions.heartbeat_interval)",
            self_name_, coord_name_);
        interval = std::chrono::milliseconds(reg_reply_->heartbeat_interval_ms());
      }
      if (reg_reply_) timeout = std::chrono::milliseconds(reg_reply_->heartbeat_timeout_ms());
    }
    asio::post(io_, [this, interval, timeout] {
      hb_interval_ = interval;
      hb_timeout_ = timeout;
      last_rx_ = Clock::now();
      if (hb_running_) return;
      hb_running_ = true;
      send_heartbeat();
    });
  }

  void stop_heartbeat() {
    auto prom = std::make_shared<std::promise<void>>();
    auto fut = prom->get_future();
    asio::post(io_, [this, prom] {
      hb_running_ = false;
      hb_timer_.cancel();
      prom->set_value();
    });
    fut.wait_for(std::chrono::seconds(2));
  }

  void set_stat(const std::string& key, double value) {
    std::lock_guard lk(mu_);
    stats_[key] = value;
  }

  // ---- events / queues
  // ---------------------------------------------------------------------------------------------

  void set_event_callback(std::function<void(const ClientEvent&)> cb) {
    std::lock_guard lk(mu_);
    callback_ = std::move(cb);
  }

  std::optional<ClientEvent> next_event(Deadline deadline) { return pop_next(events_, deadline); }

  proto::StatusReply query_status(Deadline deadline) {
    std::lock_guard serial(status_mu_);
    {
      std::lock_guard lk(mu_);
      statuses_.clear();
    }
    proto::Envelope env;
    env.mutable_status_request();
    send(env);
    std::unique_lock lk(mu_);
    cv_.wait_until(lk, deadline, [&] { return !statuses_.empty() || shutdown_ || lost_; });
    if (!statuses_.empty()) {
      auto st = std::move(statuses_.front());
      statuses_.pop_front();
      return st;
    }
    if (shutdown_)
      fail("{} shut down before answering a status query from {}: {}", coord_name_, self_name_,
           shutdown_->reason());
    if (lost_)
      fail("{}: connection lost during a status query from {}: {}", coord_name_, self_name_, lost_reason_);
    fail("{} did not answer a status query from {} before the deadline", coord_name_, self_name_);
  }

  void request_shutdown(const std::string& reason) {
    proto::Envelope env;
    env.mutable_shutdown()->set_reason(reason);
    send(env);
  }

  uint64_t submit(proto::GenerateRequest request) {
    if (request.request_id() == 0) request.set_request_id(next_request_id_++);
    uint64_t id = request.request_id();
    proto::Envelope env;
    *env.mutable_generate_request() = std::move(request);
    send(env);
    return id;
  }

  std::optional<proto::GenerateChunk> next_chunk(Deadline deadline) { return pop_next(chunks_, deadline); }

  void cancel(uint64_t request_id, const std::string& reason, std::optional<uint32_t> sample) {
    proto::Envelope env;
    env.mutable_cancel_request()->set_request_id(request_id);
    env.mutable_cancel_request()->set_reason(reason);
    if (sample) env.mutable_cancel_request()->set_index(*sample);
    send(env);
  }

  std::optional<proto::CancelRequest> next_cancel(Deadline deadline) { return pop_next(cancels_, deadline); }

  std::optional<proto::GenerateRequest> next_request(Deadline deadline) { return pop_next(requests_, deadline); }

  void send_chunk(const proto::GenerateChunk& chunk) {
    proto::Envelope env;
    *env.mutable_generate_chunk() = chunk;
    send(env);
  }

  void send_pair_offer(const proto::PairOffer& offer) {
    proto::Envelope env;
    *env.mutable_pair_offer() = offer;
    send(env);
  }

  bool connected() const {
    std::lock_guard lk(mu_);
    return connected_ && !shutdown_ && !lost_;
  }

  std::optional<proto::RegisterReply> registration() const {
    std::lock_guard lk(mu_);
    if (reg_reply_ && reg_reply_->error().empty()) return reg_reply_;
    return std::nullopt;
  }

  const std::string& coordinator_name() const { return coord_name_; }
  const std::string& self_name() const { return self_name_; }

 private:
  // The oldest entry of one of the inbound queues, waiting for one until the deadline; nullopt if none came.
  template <typename T>
  std::optional<T> pop_next(std::deque<T>& queue, Deadline deadline) {
    std::unique_lock lk(mu_);
    if (!cv_.wait_until(lk, deadline, [&] { return !queue.empty(); })) return std::nullopt;
    T item = std::move(queue.front());
    queue.pop_front();
    return item;
  }

  void send(const proto::Envelope& env) {
    {
      std::lock_guard lk(mu_);
      SPADE_CHECK(connected_, "{}: {} is not connected (call connect() first)", coord_name_, self_name_);
      if (shutdown_)
        fail("{}: cannot send {}: the world was shut down ({})", coord_name_, proto::envelope_case_name(env),
             shutdown_->reason());
      if (lost_)
        fail("{}: cannot send {}: connection lost ({})", coord_name_, proto::envelope_case_name(env),
             lost_reason_);
    }
    auto frame = std::make_shared<std::string>(proto::encode_frame(env, opts_.max_frame_bytes));
    asio::post(io_, [this, frame] {
      wq_.push_back(std::move(*frame));
      if (!writing_) do_write();
    });
  }

  // io thread
  void do_write() {
    if (wq_.empty() || closing_) {
      writing_ = false;
      return;
    }
    writing_ = true;
    asio::async_write(sock_, asio::buffer(wq_.front()), [this](const error_code& ec, size_t) {
      if (ec) {
        writing_ = false;
        on_lost("write failed: " + ec.message());
        return;
      }
      wq_.pop_front();
      do_write();
    });
  }

  void start_read() {
    sock_.async_read_some(asio::buffer(rbuf_), [this](const error_code& ec, size_t n) { on_read(ec, n); });
  }

  void on_read(const error_code& ec, size_t n) {
    if (closing_) return;
    if (ec) {
      std::string why =
          ec == asio::error::eof ? std::string("connection closed by the coordinator") : ec.message();
      std::string trunc = decoder_.eof_error();
      if (!trunc.empty()) why += " (" + trunc + ")";
      on_lost(why);
      return;
    }
    last_rx_ = Clock::now();
    decoder_.feed(rbuf_.data(), n);
    proto::Envelope env;
    std::string err;
    for (;;) {
      auto r = decoder_.next(&env, &err);
      if (r == proto::FrameDecoder::Result::kNeedMore) break;
      if (r == proto::FrameDecoder::Result::kError) {
        on_lost("bad frame from the coordinator: " + err);
        close_socket();
        return;
      }
      handle(env);
      if (closing_) return;
    }
    start_read();
  }

  void handle(const proto::Envelope& env) {
    std::optional<ClientEvent> ev;
    {
      std::lock_guard lk(mu_);
      switch (env.msg_case()) {
        case proto::Envelope::kRegisterReply:
          reg_reply_ = env.register_reply();
          break;
        case proto::Envelope::kClusterView:
          view_ = env.cluster_view();
          break;
        case proto::Envelope::kHeartbeatAck:
          break;
        case proto::Envelope::kAuthChallenge:
          challenge_ = env.auth_challenge();
          break;
        case proto::Envelope::kStatusReply:
          statuses_.push_back(env.status_reply());
          break;
        case proto::Envelope::kGenerateRequest:
          requests_.push_back(env.generate_request());
          break;
        case proto::Envelope::kGenerateChunk:
          chunks_.push_back(env.generate_chunk());
          break;
        case proto::Envelope::kCancelRequest:
          cancels_.push_back(env.cancel_request());
          break;
        case proto::Envelope::kPeerDown: {
          const auto& pd = env.peer_down();
          ev = ClientEvent{};
          ev->kind = ClientEvent::Kind::kPeerDown;
          ev->peer_down = pd;
          ev->message = fmt::format("{}: peer {} rank {} (#{}) on host {} is down: {}", coord_name_,
                                    role_name(pd.role()), pd.rank(), pd.role_index(), pd.host(), pd.reason());
          break;
        }
        case proto::Envelope::kPeerReplaced: {
          const auto& p = env.peer_replaced().peer();
          ev = ClientEvent{};
          ev->kind = ClientEvent::Kind::kPeerReplaced;
          ev->peer_replaced = env.peer_replaced();
          ev->message = fmt::format("{}: peer {} rank {} (#{}) was replaced by incarnation {} on host {} pid {}",
                                    coord_name_, role_name(p.role()), p.rank(), p.role_index(), p.incarnation(),
                                    p.host(), p.pid());
          break;
        }
        case proto::Envelope::kShutdown: {
          shutdown_ = env.shutdown();
          ev = ClientEvent{};
          ev->kind = ClientEvent::Kind::kShutdown;
          ev->shutdown = env.shutdown();
          ev->message = fmt::format("{} shut the world down{}: {}", coord_name_,
                                    env.shutdown().is_error() ? " (error)" : "", env.shutdown().reason());
          break;
        }
        default:
          spdlog::warn("{}: {} ignores unexpected {} frame", self_name_, coord_name_,
                       proto::envelope_case_name(env));
          break;
      }
      if (ev) events_.push_back(*ev);
    }
    cv_.notify_all();
    if (ev) {
      std::function<void(const ClientEvent&)> cb;
      {
        std::lock_guard lk(mu_);
        cb = callback_;
      }
      if (cb) cb(*ev);
      if (ev->kind == ClientEvent::Kind::kShutdown) {
        // The session is over: stop heartbeating and close so the coordinator can exit promptly.
        hb_running_ = false;
        hb_timer_.cancel();
        close_socket();
      }
    }
  }

  void close_socket() {
    closing_ = true;
    error_code ignored;
    sock_.shutdown(tcp::socket::shutdown_both, ignored);
    sock_.close(ignored);
  }

  void on_lost(const std::string& why) {
    ClientEvent ev;
    std::function<void(const ClientEvent&)> cb;
    {
      std::lock_guard lk(mu_);
      if (lost_ || shutdown_) return;
      lost_ = true;
      lost_reason_ = why;
      ev.kind = ClientEvent::Kind::kCoordinatorLost;
      ev.message = fmt::format("{}: connection lost ({}): {}", coord_name_, self_name_, why);
      events_.push_back(ev);
      cb = callback_;
    }
    hb_running_ = false;
    hb_timer_.cancel();
    cv_.notify_all();
    if (cb) cb(ev);
  }

  void send_heartbeat() {
    if (!hb_running_ || closing_) return;
    // The coordinator acknowledges every heartbeat; silence for a whole heartbeat timeout means it is gone or
    // hung.
    if (hb_timeout_.count() > 0 && Clock::now() - last_rx_ > hb_timeout_) {
      on_lost(fmt::format("no frame from the coordinator for more than {} ms (its heartbeat timeout)",
                          hb_timeout_.count()));
      close_socket();
      return;
    }
    proto::Envelope env;
    auto* hb = env.mutable_heartbeat();
    hb->set_rank(opts_.rank);
    hb->set_seq(++hb_seq_);
    hb->set_sent_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count());
    {
      std::lock_guard lk(mu_);
      for (const auto& [k, v] : stats_) (*hb->mutable_stats())[k] = v;
    }
    wq_.push_back(proto::encode_frame(env, opts_.max_frame_bytes));
    if (!writing_) do_write();
    hb_timer_.expires_after(hb_interval_);
    hb_timer_.async_wait([this](const error_code& ec) {
      if (!ec) send_heartbeat();
    });
  }

  ClientOptions opts_;
  std::string coord_name_;
  std::string self_name_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::socket sock_;
  asio::steady_timer hb_timer_;
  std::thread thread_;

  // io-thread state
  proto::FrameDecoder decoder_;
  std::array<char, 64 * 1024> rbuf_{};
  std::deque<std::string> wq_;
  bool writing_ = false;
  bool closing_ = false;
  bool hb_running_ = false;
  std::chrono::milliseconds hb_interval_{1000};
  std::chrono::milliseconds hb_timeout_{0};  // 0 = do not watch the coordinator
  Clock::time_point last_rx_{};
  uint64_t hb_seq_ = 0;

  // shared state (mu_)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool connected_ = false;
  bool lost_ = false;
  std::string lost_reason_;
  std::optional<proto::AuthChallenge> challenge_;
  std::optional<proto::RegisterReply> reg_reply_;
  std::optional<proto::ClusterView> view_;
  std::optional<proto::Shutdown> shutdown_;
  std::deque<ClientEvent> events_;
  std::deque<proto::StatusReply> statuses_;
  std::deque<proto::GenerateChunk> chunks_;
  std::deque<proto::GenerateRequest> requests_;
  std::deque<proto::CancelRequest> cancels_;
  std::map<std::string, double> stats_;
  std::function<void(const ClientEvent&)> callback_;
  std::mutex status_mu_;
  std::atomic<uint64_t> next_request_id_{1};
};

ClientOptions client_options_for(const LaunchEnv& env) {
  ClientOptions o;
  o.coordinator_host = env.master_addr;
  o.coordinator_port = env.master_port;
  o.role = env.role;
  o.rank = env.rank;
  o.role_index = env.role_index;
  o.world_size = env.world_size;
  o.local_rank = env.local_rank;
  o.cluster_secret = env.cluster_secret.value;
  return o;
}

CoordinatorClient::CoordinatorClient(ClientOptions options)
    : impl_(std::make_shared<Impl>(std::move(options))) {}
CoordinatorClient::~CoordinatorClient() = default;
void CoordinatorClient::connect(Deadline d) {
  impl_->connect(d);
}
proto::RegisterReply CoordinatorClient::register_self(Deadline d) {
  return impl_->register_self(d);
}
proto::ClusterView CoordinatorClient::wait_cluster_view(Deadline d) {
  return impl_->wait_cluster_view(d);
}
proto::ClusterView CoordinatorClient::rendezvous(Deadline d) {
  return impl_->rendezvous(d);
}
void CoordinatorClient::start_heartbeat() {
  impl_->start_heartbeat();
}
void CoordinatorClient::stop_heartbeat() {
  impl_->stop_heartbeat();
}
void CoordinatorClient::set_stat(const std::string& k, double v) {
  impl_->set_stat(k, v);
}
void CoordinatorClient::set_event_callback(std::function<void(const ClientEvent&)> cb) {
  impl_->set_event_callback(std::move(cb));
}
std::optional<ClientEvent> CoordinatorClient::next_event(Deadline d) {
  return impl_->next_event(d);
}
proto::StatusReply CoordinatorClient::query_status(Deadline d) {
  return impl_->query_status(d);
}
void CoordinatorClient::request_shutdown(const std::string& reason) {
  impl_->request_shutdown(reason);
}
uint64_t CoordinatorClient::submit(proto::GenerateRequest r) {
  return impl_->submit(std::move(r));
}
std::optional<proto::GenerateChunk> CoordinatorClient::next_chunk(Deadline d) {
  return impl_->next_chunk(d);
}
void CoordinatorClient::cancel(uint64_t id, const std::string& reason, std::optional<uint32_t> sample) {
  impl_->cancel(id, reason, sample);
}
std::optional<proto::CancelRequest> CoordinatorClient::next_cancel(Deadline d) {
  return impl_->next_cancel(d);
}
std::optional<proto::GenerateRequest> CoordinatorClient::next_request(Deadline d) {
  return impl_->next_request(d);
}
void CoordinatorClient::send_chunk(const proto::GenerateChunk& c) {
  impl_->send_chunk(c);
}
void CoordinatorClient::send_pair_offer(const proto::PairOffer& o) { impl_->send_pair_offer(o); }
bool CoordinatorClient::connected() const {
  return impl_->connected();
}
std::optional<proto::RegisterReply> CoordinatorClient::registration() const {
  return impl_->registration();
}
std::string CoordinatorClient::coordinator_name() const {
  return impl_->coordinator_name();
}
std::string CoordinatorClient::self_name() const {
  return impl_->self_name();
}

}  // namespace spade::coord

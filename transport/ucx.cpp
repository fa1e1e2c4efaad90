#include "transport/ucx.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "common/error.h"
#include "transport/op.h"
#include "transport/tags.h"

namespace spade::transport {
namespace {

constexpr int kSenderShift = 48;
constexpr uint64_t kFullMask = ~uint64_t{0};
constexpr uint64_t kHelloTag = transport_control_tag(0x48454C);  // "HEL"
constexpr char kHelloMagic[8] = {'S', 'P', 'A', 'D', 'E', 'U', 'C', 'X'};
// Published address = kAddressPrefix + raw UCP worker address, so that a non-UCX address (wrong transport
// kind in the ClusterView) is refused with a clear error instead of being handed to ucp_ep_create.
constexpr std::string_view kAddressPrefix = "spade-ucx1:";

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string ms_str(std::chrono::nanoseconds d) {
  return fmt::format("{} ms", std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

class UcxCore;
struct EpState;

// Per in-flight UCX request; passed as user_data to the completion callbacks.
struct ReqCtx {
  std::shared_ptr<EpState> ep;
  std::shared_ptr<detail::Op> op;
  void* req = nullptr;        // UCX request handle (null until the posting call returned)
  bool posting = true;        // inside ucp_tag_*_nbx: a completion callback must not free this ctx
  bool done_in_post = false;  // the callback already ran inside the posting call
};

// State of one endpoint. Fields marked [pt] are touched only on the progress thread.
struct EpState : detail::OpOwner, std::enable_shared_from_this<EpState> {
  EpState(std::weak_ptr<UcxCore> c, uint64_t i, std::string addr, std::string name)
      : core(std::move(c)),
        id(i),
        peer_address(std::move(addr)),
        peer_name(std::move(name)),
        peer_sender(ucx_sender_id(peer_address)) {}

  void cancel_op(const std::shared_ptr<detail::Op>& op) override;

  void set_failed(const std::string& why) {
    std::lock_guard lk(mu);
    if (failed.load()) return;
    failure = why;
    failed.store(true);
  }
  std::string failure_text() const {
    std::lock_guard lk(mu);
    return failure;
  }

  std::weak_ptr<UcxCore> core;
  const uint64_t id;
  const std::string peer_address;
  const std::string peer_name;
  const uint16_t peer_sender;
  std::atomic<bool> failed{false};
  mutable std::mutex mu;
  std::string failure;

  UcxCore* raw_core = nullptr;                        // [pt] set by create_ep; valid while the core runs
  ucp_ep_h ep = nullptr;                              // [pt]
  std::unordered_map<detail::Op*, ReqCtx*> inflight;  // [pt]
  bool closing = false;                               // [pt]
};

class UcxCore : public std::enable_shared_from_this<UcxCore> {
 public:
  explicit UcxCore(UcxOptions o) : opts_(std::move(o)) {}

  ~UcxCore() { shutdown(); }

  // Starts the progress thread, which initializes UCX; rethrows its errors.
  void start() {
    event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    SPADE_CHECK(event_fd_ >= 0, "UCX transport {}: eventfd failed: {}", opts_.name, std::strerror(errno));
    std::promise<void> ready;
    auto fut = ready.get_future();
    thread_ = std::thread([this, &ready] {
      try {
        init_ucx();
      } catch (...) {
        teardown_ucx();  // releases whatever init_ucx created before failing
        ready.set_exception(std::current_exception());
        return;
      }
      ready.set_value();
      loop();
      run_commands();  // what was queued before stop: posts fail/close below, cancels apply
      teardown_ucx();
    });
    try {
      fut.get();
    } catch (...) {
      thread_.join();
      throw;
    }
  }

  void shutdown() {
    if (!thread_.joinable()) {
      if (event_fd_ >= 0) ::close(event_fd_);
      event_fd_ = -1;
      return;
    }
    stop_.store(true);
    wake();
    thread_.join();
    ::close(event_fd_);
    event_fd_ = -1;
  }

  const std::string& address() const { return address_; }
  uint16_t sender_id() const { return sender_id_; }
  const UcxOptions& options() const { return opts_; }

  // Runs `fn` on the progress thread (fire and forget).
  void submit(std::function<void()> fn) {
    {
      std::lock_guard lk(cmd_mu_);
      cmds_.push_back(std::move(fn));
    }
    wake();
  }

  // Runs `fn` on the progress thread and waits for it (bounded by `timeout`).
  template <typename F>
  auto call(F fn, std::chrono::milliseconds timeout) -> decltype(fn()) {
    using R = decltype(fn());
    auto prom = std::make_shared<std::promise<R>>();
    auto fut = prom->get_future();
    submit([prom, fn = std::move(fn)]() mutable {
      try {
        if constexpr (std::is_void_v<R>) {
          fn();
          prom->set_value();
        } else {
          prom->set_value(fn());
        }
      } catch (...) {
        prom->set_exception(std::current_exception());
      }
    });
    if (fut.wait_for(timeout) != std::future_status::ready) {
      fail("UCX transport {}: progress thread did not answer within {}", opts_.name, ms_str(timeout));
    }
    return fut.get();
  }

  // ---- progress-thread operations ----

  // Creates the UCP endpoint of `st`.
  void create_ep(const std::shared_ptr<EpState>& st) {
    for (const auto& [id, other] : eps_) {
      if (other->failed.load()) continue;
      SPADE_CHECK(other->peer_address != st->peer_address, "UCX transport {}: already connected to peer {}",
                  opts_.name, st->peer_name);
      SPADE_CHECK(
          other->peer_sender != st->peer_sender,
          "UCX transport {}: sender id {:#06x} of peer {} collides with that of peer {} (hash collision of "
          "their worker addresses); restart one of them to get a new address",
          opts_.name, st->peer_sender, st->peer_name, other->peer_name);
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = reinterpret_cast<const ucp_address_t*>(st->peer_address.data());
    p.err_mode = opts_.peer_failure_detection ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (opts_.peer_failure_detection) {
      p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.err_handler.cb = &UcxCore::on_ep_error;
      p.err_handler.arg = st.get();
    }
    st->raw_core = this;
    ucs_status_t s = ucp_ep_create(worker_, &p, &st->ep);
    if (s != UCS_OK) {
      fail("UCX transport {}: cannot create an endpoint to peer {}: {}{}", opts_.name, st->peer_name,
           ucs_status_string(s),
           s == UCS_ERR_UNREACHABLE && opts_.peer_failure_detection
               ? " (with peer failure detection UCX 1.13 cannot use shared-memory transports: include tcp or "
                 "an "
                 "RDMA transport in UCX_TLS, or turn UcxOptions::peer_failure_detection off)"
               : "");
    }
    eps_[st->id] = st;
  }

  // Posts the UCP operation of `op` (tag already validated by the caller; the handshake uses the reserved
  // kind).
  void start_op(const std::shared_ptr<EpState>& st, const std::shared_ptr<detail::Op>& op) {
    if (st->failed.load() || st->closing || st->ep == nullptr) {
      op->complete(Status::FAILED, 0, st->failure_text().empty() ? "endpoint closed" : st->failure_text());
      return;
    }
    auto* ctx = new ReqCtx{st, op, nullptr};
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    prm.datatype = ucp_dt_make_contig(1);
    prm.user_data = ctx;
    ucs_status_ptr_t r;
    if (op->kind == detail::Op::Kind::kSend) {
      prm.cb.send = &UcxCore::on_send_done;
      uint64_t tag = (uint64_t{sender_id_} << kSenderShift) | op->tag;
      r = ucp_tag_send_nbx(st->ep, op->buf, op->size, tag, &prm);
    } else {
      // UCX 1.13 does not fill recv_info on immediate completion, so force the callback (which has the
      // length); it then runs inside ucp_tag_recv_nbx.
      prm.cb.recv = &UcxCore::on_recv_done;
      prm.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      uint64_t tag = (uint64_t{st->peer_sender} << kSenderShift) | op->tag;
      r = ucp_tag_recv_nbx(worker_, op->buf, op->size, tag, kFullMask, &prm);
    }
    ctx->posting = false;
    if (ctx->done_in_post) {  // callback already completed the op and freed the request
      delete ctx;
      return;
    }
    if (r == nullptr) {  // send completed immediately; no callback
      op->complete(Status::OK, op->size, "");
      delete ctx;
      return;
    }
    if (UCS_PTR_IS_ERR(r)) {
      finish(ctx, nullptr, UCS_PTR_STATUS(r), 0);
      return;
    }
    ctx->req = r;
    st->inflight[op.get()] = ctx;
  }

  void cancel(const std::shared_ptr<EpState>& st, const std::shared_ptr<detail::Op>& op) {
    auto it = st->inflight.find(op.get());
    if (it == st->inflight.end()) return;  // already done
    if (op->kind == detail::Op::Kind::kRecv) {
      ucp_request_cancel(worker_, it->second->req);  // completes with UCS_ERR_CANCELED (callback)
    }
    // Sends cannot be withdrawn by UCP (ucp_request_cancel ignores them); they complete normally.
  }

  // Fails every pending op of `st` and closes its UCP endpoint (force when sends are in flight or it failed).
  void close_ep(const std::shared_ptr<EpState>& st, const std::string& why, bool wait) {
    bool was_failed = st->failed.load();
    st->set_failed(why);
    if (st->closing) return;
    st->closing = true;
    bool sends_inflight = false;
    std::vector<ReqCtx*> recvs;
    for (auto& [op, ctx] : st->inflight) {
      if (op->kind == detail::Op::Kind::kRecv) {
        recvs.push_back(ctx);
      } else {
        sends_inflight = true;
      }
    }
    for (auto* ctx : recvs) ucp_request_cancel(worker_, ctx->req);
    if (st->ep != nullptr) {
      bool force = sends_inflight || was_failed;
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t r = ucp_ep_close_nbx(st->ep, &prm);
      st->ep = nullptr;
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
        if (wait) {
          auto until = Clock::now() + opts_.close_timeout;
          while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until)
            ucp_worker_progress(worker_);
          if (ucp_request_check_status(r) == UCS_INPROGRESS) {
            spdlog::warn("UCX transport {}: closing the endpoint to {} did not finish within {}", opts_.name,
                         st->peer_name, ms_str(opts_.close_timeout));
            closing_reqs_.push_back(r);
          } else {
            ucp_request_free(r);
          }
        } else {
          closing_reqs_.push_back(r);
        }
      }
    }
    // Any op still in flight (a send being flushed) is failed now from the user's point of view only after
    // UCX releases its buffer, i.e. in its completion callback.
  }

  void forget_ep(uint64_t id) { eps_.erase(id); }

 private:
  // ---- UCX lifecycle (progress thread) ----

  void init_ucx() {
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) fail("UCX transport {}: ucp_config_read failed: {}", opts_.name, ucs_status_string(s));
    std::string tls = opts_.tls;
    if (tls.empty()) {
      const char* env = std::getenv("UCX_TLS");
      tls = (env && *env) ? "" : kDefaultUcxTls;  // env already applied by ucp_config_read
    }
    if (!tls.empty()) {
      s = ucp_config_modify(cfg, "TLS", tls.c_str());
      if (s != UCS_OK) {
        ucp_config_release(cfg);
        fail("UCX transport {}: bad UCX_TLS '{}': {}", opts_.name, tls, ucs_status_string(s));
      }
    }
    const char* ka_env = std::getenv("UCX_KEEPALIVE_INTERVAL");
    if (opts_.keepalive_interval.count() > 0 && !(ka_env && *ka_env)) {
      std::string v = fmt::format("{}ms", opts_.keepalive_interval.count());
      s = ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", v.c_str());
      if (s != UCS_OK)
        spdlog::warn("UCX transport {}: cannot set KEEPALIVE_INTERVAL: {}", opts_.name, ucs_status_string(s));
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    s = ucp_init(&params, cfg, &ctx_);
    ucp_config_release(cfg);
    if (s != UCS_OK)
      fail("UCX transport {}: ucp_init failed (UCX_TLS={}): {}", opts_.name, tls, ucs_status_string(s));

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(ctx_, &wp, &worker_);
    if (s != UCS_OK) {
      ucp_cleanup(ctx_);
      ctx_ = nullptr;
      fail("UCX transport {}: ucp_worker_create failed: {}", opts_.name, ucs_status_string(s));
    }
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    s = ucp_worker_get_address(worker_, &addr, &len);
    if (s != UCS_OK) {
      teardown_ucx();
      fail("UCX transport {}: ucp_worker_get_address failed: {}", opts_.name, ucs_status_string(s));
    }
    address_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    sender_id_ = ucx_sender_id(address_);

    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    SPADE_CHECK(epoll_fd_ >= 0, "UCX transport {}: epoll_create1 failed: {}", opts_.name,
                std::strerror(errno));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = event_fd_;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd_, &ev);
    s = ucp_worker_get_efd(worker_, &worker_fd_);
    if (s == UCS_OK) {
      epoll_event wev{};
      wev.events = EPOLLIN;
      wev.data.fd = worker_fd_;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, worker_fd_, &wev);
    } else {
      worker_fd_ = -1;
      spdlog::warn("UCX transport {}: no worker event fd ({}); polling every {} ms when idle", opts_.name,
                   ucs_status_string(s), opts_.block_timeout.count());
    }
    spdlog::debug("UCX transport {}: worker address {} bytes, sender id {:#06x}, UCX_TLS={}", opts_.name,
                  address_.size(), sender_id_, tls.empty() ? std::string(std::getenv("UCX_TLS")) : tls);
  }

  void teardown_ucx() {
    if (worker_ != nullptr) {
      for (auto& [id, st] : eps_) close_ep(st, fmt::format("transport {} closed", opts_.name), true);
      auto until = Clock::now() + opts_.close_timeout;
      while (!closing_reqs_.empty() && Clock::now() < until) {
        ucp_worker_progress(worker_);
        reap_closing();
      }
      // Whatever is still in flight can no longer complete: fail it for the user.
      for (auto& [id, st] : eps_) {
        for (auto& [op, ctx] : st->inflight) {
          ctx->op->complete(Status::FAILED, 0, fmt::format("transport {} closed", opts_.name));
          // ctx leaks deliberately: UCX may still hold the request until ucp_worker_destroy.
        }
        st->inflight.clear();
      }
      eps_.clear();
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
    }
    if (ctx_ != nullptr) {
      ucp_cleanup(ctx_);
      ctx_ = nullptr;
    }
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    epoll_fd_ = -1;
  }

  void reap_closing() {
    for (auto it = closing_reqs_.begin(); it != closing_reqs_.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing_reqs_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // ---- progress loop ----

  void wake() {
    uint64_t one = 1;
    if (event_fd_ >= 0) {
      ssize_t n = ::write(event_fd_, &one, sizeof(one));
      (void)n;
    }
  }

  bool run_commands() {
    std::deque<std::function<void()>> batch;
    {
      std::lock_guard lk(cmd_mu_);
      batch.swap(cmds_);
    }
    for (auto& fn : batch) fn();
    return !batch.empty();
  }

  void run_deferred() {
    while (!failed_eps_.empty()) {
      auto batch = std::move(failed_eps_);
      failed_eps_.clear();
      for (auto& [st, why] : batch) close_ep(st, why, false);
    }
    reap_closing();
  }

  void loop() {
    auto last_activity = Clock::now();
    while (!stop_.load()) {
      bool busy = run_commands();
      for (int i = 0; i < 64; ++i) {
        if (ucp_worker_progress(worker_) == 0) break;
        busy = true;
      }
      if (!failed_eps_.empty() || !closing_reqs_.empty()) run_deferred();
      auto now = Clock::now();
      if (busy) {
        last_activity = now;
        continue;
      }
      if (now - last_activity < opts_.spin_before_block) continue;
      if (worker_fd_ >= 0) {
        ucs_status_t s = ucp_worker_arm(worker_);
        if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile
      }
      epoll_event evs[4];
      int n = ::epoll_wait(epoll_fd_, evs, 4, static_cast<int>(opts_.block_timeout.count()));
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.fd == event_fd_) {
          uint64_t v;
          ssize_t r = ::read(event_fd_, &v, sizeof(v));
          (void)r;
        }
      }
    }
  }

  // ---- UCX callbacks (progress thread) ----

  // Completes the op of `ctx`; `request` (may be null) is released. Frees ctx unless still inside its posting
  // call.
  static void finish(ReqCtx* ctx, void* request, ucs_status_t status, size_t length) {
    auto& st = *ctx->ep;
    st.inflight.erase(ctx->op.get());
    const char* what = ctx->op->kind == detail::Op::Kind::kSend ? "send" : "receive";
    if (status == UCS_OK) {
      ctx->op->complete(Status::OK, length, "");
    } else if (status == UCS_ERR_CANCELED && !st.failed.load()) {
      ctx->op->complete(
          Status::CANCELLED, 0,
          fmt::format("{} with tag {:#x} to/from {} cancelled", what, ctx->op->tag, st.peer_name));
    } else if (status == UCS_ERR_MESSAGE_TRUNCATED) {
      ctx->op->complete(
          Status::FAILED, 0,
          fmt::format("message with tag {:#x} from {} is larger than the posted buffer of {} bytes",
                      ctx->op->tag, st.peer_name, ctx->op->size));
    } else if (st.failed.load()) {
      ctx->op->complete(Status::FAILED, 0, st.failure_text());
    } else {
      ctx->op->complete(Status::FAILED, 0,
                        fmt::format("{} with tag {:#x} to/from {} failed: {}", what, ctx->op->tag,
                                    st.peer_name, ucs_status_string(status)));
    }
    if (request != nullptr) ucp_request_free(request);
    if (ctx->posting) {
      ctx->done_in_post = true;
    } else {
      delete ctx;
    }
  }

  static void on_send_done(void* request, ucs_status_t status, void* user_data) {
    auto* ctx = static_cast<ReqCtx*>(user_data);
    finish(ctx, request, status, status == UCS_OK ? ctx->op->size : 0);
  }

  static void on_recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data) {
    auto* ctx = static_cast<ReqCtx*>(user_data);
    finish(ctx, request, status, (status == UCS_OK && info != nullptr) ? info->length : 0);
  }

  static void on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* raw = static_cast<EpState*>(arg);
    UcxCore* core = raw->raw_core;
    if (core == nullptr) return;
    auto it = core->eps_.find(raw->id);
    if (it == core->eps_.end()) return;
    std::string why =
        fmt::format("peer {} failed: connection error ({})", raw->peer_name, ucs_status_string(status));
    spdlog::warn("UCX transport {}: {}", core->opts_.name, why);
    raw->set_failed(why);
    core->failed_eps_.emplace_back(it->second, why);  // closed outside the callback
  }

  UcxOptions opts_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  int event_fd_ = -1;
  int epoll_fd_ = -1;
  int worker_fd_ = -1;
  std::mutex cmd_mu_;
  std::deque<std::function<void()>> cmds_;

  // progress thread only (after init)
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;  // written before start() returns, then read-only
  uint16_t sender_id_ = 0;
  std::map<uint64_t, std::shared_ptr<EpState>> eps_;
  std::vector<std::pair<std::shared_ptr<EpState>, std::string>> failed_eps_;
  std::vector<void*> closing_reqs_;
};

void EpState::cancel_op(const std::shared_ptr<detail::Op>& op) {
  auto c = core.lock();
  if (!c) {
    op->complete(Status::CANCELLED, 0, "cancelled (transport closed)");
    return;
  }
  auto self = shared_from_this();
  UcxCore* raw = c.get();  // commands run before the core finishes destruction
  c->submit([raw, self, op] { raw->cancel(self, op); });
}

class UcxEndpoint : public Endpoint {
 public:
  UcxEndpoint(std::shared_ptr<UcxCore> core, std::shared_ptr<EpState> st)
      : core_(std::move(core)), st_(std::move(st)) {}

  ~UcxEndpoint() override {
    try {
      UcxCore* core = core_.get();
      auto st = st_;
      core_->call(
          [core, st] {
            core->close_ep(st, fmt::format("endpoint to {} closed", st->peer_name), true);
            core->forget_ep(st->id);
          },
          core_->options().close_timeout + std::chrono::milliseconds(2000));
    } catch (const std::exception& e) {
      spdlog::warn("UCX endpoint to {}: close: {}", st_->peer_name, e.what());
    }
  }

  SendHandle post_send(uint64_t tag, const void* buf, size_t len) override {
    check_user_tag(tag, "UCX send to " + st_->peer_name);
    return SendHandle(post(detail::Op::Kind::kSend, tag, const_cast<void*>(buf), len));
  }

  RecvHandle post_recv(uint64_t tag, void* buf, size_t capacity) override {
    check_user_tag(tag, "UCX receive from " + st_->peer_name);
    return RecvHandle(post(detail::Op::Kind::kRecv, tag, buf, capacity));
  }

  // Internal (handshake): no tag check.
  std::shared_ptr<detail::Op> post(detail::Op::Kind kind, uint64_t tag, void* buf, size_t size) {
    SPADE_CHECK(buf != nullptr || size == 0, "UCX {} {}: null buffer with size {}",
                kind == detail::Op::Kind::kSend ? "send to" : "receive from", st_->peer_name, size);
    auto op = std::make_shared<detail::Op>(kind, tag, buf, size, st_);
    if (st_->failed.load()) {
      op->complete(Status::FAILED, 0, st_->failure_text());
      return op;
    }
    UcxCore* core = core_.get();
    auto st = st_;
    core_->submit([core, st, op] { core->start_op(st, op); });
    return op;
  }

  void abort(const std::string& reason) override {
    UcxCore* core = core_.get();
    auto st = st_;
    std::string why = fmt::format("connection to {} aborted: {}", st_->peer_name, reason);
    st_->set_failed(why);
    core_->call([core, st, why] { core->close_ep(st, why, false); }, std::chrono::milliseconds(5000));
  }

  bool failed() const override { return st_->failed.load(); }
  std::string failure() const override { return st_->failure_text(); }
  const std::string& peer_name() const override { return st_->peer_name; }

 private:
  std::shared_ptr<UcxCore> core_;
  std::shared_ptr<EpState> st_;
};

class UcxTransport : public Transport {
 public:
  explicit UcxTransport(const UcxOptions& o) : core_(std::make_shared<UcxCore>(o)) { core_->start(); }

  std::string local_address() const override { return std::string(kAddressPrefix) + core_->address(); }

  std::unique_ptr<Endpoint> connect(const std::string& peer_address, const std::string& peer_name,
                                    Deadline deadline) override {
    const auto& name = core_->options().name;
    SPADE_CHECK(
        peer_address.size() > kAddressPrefix.size() &&
            std::string_view(peer_address).substr(0, kAddressPrefix.size()) == kAddressPrefix,
        "UCX transport {}: the address of peer {} is not a Spade UCX address ({} bytes, expected prefix "
        "'{}'); does the peer use another transport kind?",
        name, peer_name, peer_address.size(), kAddressPrefix);
    std::string worker_address = peer_address.substr(kAddressPrefix.size());
    auto start = Clock::now();
    auto st = std::make_shared<EpState>(core_, next_id_++, worker_address, peer_name);
    UcxCore* core = core_.get();
    core_->call([core, st] { core->create_ep(st); }, std::chrono::milliseconds(10000));
    auto ep = std::make_unique<UcxEndpoint>(core_, st);

    // Handshake: hello = magic + hash of the sender's own address, both directions.
    std::array<char, 16> out{};
    std::array<char, 64> in{};
    uint64_t my_hash = fnv1a64(core_->address());
    std::memcpy(out.data(), kHelloMagic, 8);
    std::memcpy(out.data() + 8, &my_hash, 8);
    auto recv = ep->post(detail::Op::Kind::kRecv, kHelloTag, in.data(), in.size());
    auto send = ep->post(detail::Op::Kind::kSend, kHelloTag, out.data(), out.size());
    Status rs = recv->wait(deadline);
    Status ss = send->wait(deadline);
    if (rs != Status::OK || ss != Status::OK) {
      std::string detail =
          rs == Status::TIMEOUT || ss == Status::TIMEOUT
              ? fmt::format("no hello within {} (did the peer call connect() with our address?)",
                            ms_str(deadline - start))
              : (rs != Status::OK ? recv->error() : send->error());
      ep.reset();  // closes; the ops above complete before their buffers go away
      fail("UCX transport {}: handshake with peer {} failed: {}", name, peer_name, detail);
    }
    uint64_t peer_hash = 0;
    std::memcpy(&peer_hash, in.data() + 8, 8);
    if (recv->length() != out.size() || std::memcmp(in.data(), kHelloMagic, 8) != 0 ||
        peer_hash != fnv1a64(worker_address)) {
      ep.reset();
      fail(
          "UCX transport {}: handshake with peer {} failed: the hello ({} bytes, hash {:#x}) came from a "
          "different "
          "worker than the address we were given (hash {:#x}): stale address, or sender-id collision",
          name, peer_name, recv->length(), peer_hash, fnv1a64(worker_address));
    }
    return ep;
  }

  std::string kind() const override { return "ucx"; }

 private:
  std::shared_ptr<UcxCore> core_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace

uint16_t ucx_sender_id(const std::string& worker_address) {
  return static_cast<uint16_t>(fnv1a64(worker_address) >> 48);
}

std::unique_ptr<Transport> make_ucx_transport(const UcxOptions& options) {
  return std::make_unique<UcxTransport>(options);
}

}  // namespace spade::transport

// GpuLinkWatch (see gpu_link_watch.h): pending operations, the watchdog, the failure latch of the GPU links.
#include "transport/gpu_link_watch.h"

#include <spdlog/spdlog.h>

#include "common/error.h"

namespace spade::transport::detail {

void use_device(const std::string& who, int device) {
  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaGetDeviceCount: {}", who, cudaGetErrorString(e));
  SPADE_CHECK(device >= 0 && device < ndev, "{}: device {} out of range ({} CUDA devices)", who, device, ndev);
  const cudaError_t se = cudaSetDevice(device);
  SPADE_CHECK(se == cudaSuccess, "{}: cudaSetDevice({}): {}", who, device, cudaGetErrorString(se));
}

DeviceGuard::DeviceGuard(int device) {
  cudaGetDevice(&prev_);
  cudaSetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

GpuLinkWatch::GpuLinkWatch(Options opts) : opts_(std::move(opts)) {}

GpuLinkWatch::~GpuLinkWatch() { stop_watchdog(); }

OpRequest GpuLinkWatch::check_post(PairRole role, bool is_send, const void* buf, size_t bytes, const char* what,
                                   std::chrono::milliseconds timeout) const {
  OpRequest op;
  op.is_send = is_send;
  op.bytes = bytes;
  op.direction = (role == PairRole::kInference) == is_send ? 0 : 1;
  op.desc = fmt::format("{} of {} bytes ({})", is_send ? "send" : "receive", bytes, what != nullptr ? what : "unnamed");
  SPADE_CHECK(buf != nullptr && bytes > 0, "{}: {}: null buffer or zero bytes", opts_.label, op.desc);
  int cur = -1;
  cudaGetDevice(&cur);
  SPADE_CHECK(cur == opts_.device, "{}: {}: current device is {}, the link's is {}", opts_.label, op.desc, cur,
              opts_.device);
  SPADE_CHECK(timeout.count() >= 0, "{}: {}: negative timeout", opts_.label, op.desc);
  op.no_timeout = timeout == GpuLink::kNoTimeout;
  op.timeout = timeout.count() == 0 ? opts_.op_timeout : timeout;
  return op;
}

cudaEvent_t GpuLinkWatch::take_event(const OpRequest& op) {
  cudaEvent_t ev = nullptr;
  size_t in_flight = 0;
  bool first_late = false;
  {
    std::lock_guard lk(mu_);
    throw_if_failed_locked(op, nullptr, "refused");
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    } else if (started_) {
      first_late = late_events_++ == 0;
      in_flight = pending_.size();
    }
  }
  if (ev == nullptr) {
    if (first_late)
      spdlog::warn("{}: {} operation(s) in flight, more than the {} completion events reserved: creating more while "
                   "the peer's operations are pending",
                   opts_.label, in_flight, opts_.reserve_events);
    const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    SPADE_CHECK(e == cudaSuccess, "{}: {}: cudaEventCreate: {}", opts_.label, op.desc, cudaGetErrorString(e));
  }
  return ev;
}

void GpuLinkWatch::throw_if_failed_locked(const OpRequest& op, cudaEvent_t ev, const char* doing) {
  if (!failed_) return;
  if (ev != nullptr) free_events_.push_back(ev);
  fail("{} ({} {})", failure_, doing, op.desc);
}

uint64_t GpuLinkWatch::track_locked(cudaEvent_t ev, const OpRequest& op, bool recorded) {
  const uint64_t id = next_id_++;
  pending_.push_back(Pending{id, ev, recorded,
                             op.no_timeout ? WatchClock::time_point::max() : WatchClock::now() + op.timeout,
                             op.no_timeout ? -1 : static_cast<long long>(op.timeout.count()), op.desc});
  return id;
}

void GpuLinkWatch::mark_recorded_locked(uint64_t id) {
  for (auto& p : pending_)
    if (p.id == id) p.recorded = true;
}

void GpuLinkWatch::untrack_locked(uint64_t id) {
  pending_.remove_if([&](const Pending& p) { return p.id == id; });
}

void GpuLinkWatch::count_locked(const OpRequest& op) {
  if (op.is_send) {
    ++counters_.sends;
    counters_.bytes_sent += op.bytes;
  } else {
    ++counters_.recvs;
    counters_.bytes_received += op.bytes;
  }
}

GpuLinkWatch::Failure GpuLinkWatch::fail_locked(const std::string& reason) {
  Failure f;
  if (failed_) return f;
  failed_ = true;
  failure_ = reason;
  f.first = true;
  f.reason = reason;
  // Operations still being enqueued (not recorded) stay with their post(), which hands their events over itself.
  for (auto& p : pending_)
    if (p.recorded) f.events.push_back(p.done);
  pending_.clear();
  f.callback = on_failure_;
  on_fail_locked();
  return f;
}

void GpuLinkWatch::finish(Failure& f) {
  if (!f.first && f.events.empty()) return;
  release_transfers(f.events);
  if (!f.first) return;
  if (f.quiet) {
    spdlog::info("{}", f.reason);
  } else {
    spdlog::error("{}", f.reason);
  }
  if (f.callback) f.callback(f.reason);
}

void GpuLinkWatch::abort(const std::string& reason) {
  Failure f;
  {
    std::lock_guard lk(mu_);
    f = fail_locked(fmt::format("{}: aborted: {}", opts_.label, reason));
  }
  stop_cv_.notify_all();
  finish(f);
}

bool GpuLinkWatch::failed() const {
  std::lock_guard lk(mu_);
  return failed_;
}

std::string GpuLinkWatch::failure() const {
  std::lock_guard lk(mu_);
  return failure_;
}

void GpuLinkWatch::on_failure(std::function<void(const std::string&)> callback) {
  std::lock_guard lk(mu_);
  on_failure_ = std::move(callback);
}

GpuLinkCounters GpuLinkWatch::counters() const {
  std::lock_guard lk(mu_);
  return counters_;
}

size_t GpuLinkWatch::in_flight() const {
  std::lock_guard lk(mu_);
  return pending_.size();
}

std::string GpuLinkWatch::oldest_locked() const {
  return pending_.empty() ? std::string("no operation in flight")
                          : "while " + pending_.front().what + " was in flight";
}

void GpuLinkWatch::start_watchdog() {
  if (watchdog_.joinable()) return;
  {
    DeviceGuard g(opts_.device);
    std::lock_guard lk(mu_);
    while (free_events_.size() < opts_.reserve_events) {
      cudaEvent_t ev = nullptr;
      const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e != cudaSuccess) {
        spdlog::warn("{}: reserving completion events: cudaEventCreate: {} ({} reserved)", opts_.label,
                     cudaGetErrorString(e), free_events_.size());
        break;
      }
      free_events_.push_back(ev);
    }
    started_ = true;
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void GpuLinkWatch::watchdog_loop() {
  cudaSetDevice(opts_.device);
  watchdog_started();
  std::unique_lock lk(mu_);
  while (!stop_) {
    tick_locked();
    if (!failed_) {
      const auto now = WatchClock::now();
      Verdict v = check_locked(now);
      for (auto it = pending_.begin(); v.reason.empty() && it != pending_.end();) {
        const cudaError_t e = it->recorded ? cudaEventQuery(it->done) : cudaErrorNotReady;
        if (e == cudaSuccess) {
          free_events_.push_back(it->done);
          it = pending_.erase(it);
        } else if (e != cudaErrorNotReady) {
          v.reason = fmt::format("{}: {} failed on device {}: {}; {}", opts_.who, it->what, opts_.device,
                                 cudaGetErrorString(e), opts_.outcome);
        } else if (now > it->deadline) {
          v.reason = fmt::format("{}: {} not complete {} ms after it was posted (peer dead or stalled); {}", opts_.who,
                                 it->what, it->timeout_ms, opts_.outcome);
        } else {
          ++it;
        }
      }
      if (!v.reason.empty()) {
        Failure f = fail_locked(v.reason);
        f.quiet = v.quiet;
        lk.unlock();
        finish(f);  // the callback must not destroy the link (the watchdog thread would wait for itself)
        lk.lock();
        continue;
      }
    } else if (!opts_.watch_after_failure) {
      return;
    }
    stop_cv_.wait_for(lk, opts_.watchdog_period, [&] { return stop_; });
  }
}

void GpuLinkWatch::stop_watchdog() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (!watchdog_.joinable()) return;
  if (watchdog_.get_id() == std::this_thread::get_id()) {
    watchdog_.detach();  // destroyed from on_failure (forbidden by the contract): do not join ourselves
  } else {
    watchdog_.join();
  }
}

std::vector<cudaEvent_t> GpuLinkWatch::take_pending_locked() {
  std::vector<cudaEvent_t> events;
  for (auto& p : pending_)
    if (p.recorded) events.push_back(p.done);
  pending_.clear();
  return events;
}

bool GpuLinkWatch::wait_events(const std::vector<cudaEvent_t>& events, WatchClock::time_point deadline) {
  bool drained = true;
  for (auto e : events) {
    while (cudaEventQuery(e) == cudaErrorNotReady && WatchClock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (cudaEventQuery(e) == cudaErrorNotReady) drained = false;
  }
  return drained;
}

void GpuLinkWatch::destroy_free_events() {
  std::lock_guard lk(mu_);
  for (auto e : free_events_) cudaEventDestroy(e);
  free_events_.clear();
}

void WatchedGpuLink::send(const void* buf, size_t bytes, cudaStream_t stream, const char* what,
                          std::chrono::milliseconds timeout) {
  post(true, const_cast<void*>(buf), bytes, stream, what, timeout);
}

void WatchedGpuLink::recv(void* buf, size_t bytes, cudaStream_t stream, const char* what,
                          std::chrono::milliseconds timeout) {
  post(false, buf, bytes, stream, what, timeout);
}

void WatchedGpuLink::abort(const std::string& reason) { watch().abort(reason); }

bool WatchedGpuLink::failed() const { return watch().failed(); }

std::string WatchedGpuLink::failure() const { return watch().failure(); }

void WatchedGpuLink::on_failure(std::function<void(const std::string&)> callback) {
  watch().on_failure(std::move(callback));
}

GpuLinkCounters WatchedGpuLink::counters() const { return watch().counters(); }

size_t WatchedGpuLink::in_flight() const { return watch().in_flight(); }

}  // namespace spade::transport::detail

// NcclLink (see nccl_link.h): non-blocking NCCL communicators, a watchdog over every posted operation, abort.
#include "transport/nccl/nccl_link.h"

#include <nccl.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common/error.h"

namespace spade::transport {

namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_msg(ncclResult_t r) {
  return fmt::format("{} ({})", ncclGetErrorString(r), ncclGetLastError(nullptr));
}

long long ms(std::chrono::milliseconds d) { return static_cast<long long>(d.count()); }

// Aborts both communicators concurrently and clears them. ncclCommAbort sets a communicator's abort flag and then
// waits for its kernels to exit; a kernel of one communicator may be queued on a stream behind a spinning kernel of
// the other (one stream for both directions), so aborting them one after the other can wait forever.
void abort_all(ncclComm_t (&comms)[2]) {
  std::thread other([c = comms[1]] {
    if (c != nullptr && ncclCommAbort(c) != ncclSuccess) spdlog::warn("NCCL link: ncclCommAbort (down) failed");
  });
  if (comms[0] != nullptr && ncclCommAbort(comms[0]) != ncclSuccess)
    spdlog::warn("NCCL link: ncclCommAbort (up) failed");
  other.join();
  comms[0] = comms[1] = nullptr;
}

}  // namespace

size_t NcclLink::address_size() { return 2 * sizeof(ncclUniqueId); }

std::string NcclLink::new_address() {
  ncclUniqueId ids[2];
  for (auto& id : ids) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    SPADE_CHECK(r == ncclSuccess, "NCCL link: ncclGetUniqueId failed: {}", nccl_msg(r));
  }
  return std::string(reinterpret_cast<const char*>(ids), sizeof(ids));
}

// One posted operation the watchdog tracks until its completion event fires.
struct Pending {
  cudaEvent_t done = nullptr;
  Clock::time_point deadline;  // time_point::max(): none (NcclLink::kNoTimeout)
  long long timeout_ms = 0;
  std::string what;  // "send of 1048576 bytes (qkv of pack 3)"
};

// What a failure leaves to do outside the state lock: abort the communicators (ncclCommAbort can block for long),
// destroy the pending events, log, and run the callback. Empty when the link had already failed.
struct Failure {
  bool first = false;
  std::string reason;
  ncclComm_t comm[2] = {nullptr, nullptr};
  std::vector<cudaEvent_t> events;
  std::function<void(const std::string&)> callback;
  void finish() {
    if (!first) return;
    abort_all(comm);
    // The aborted NCCL kernels exit, so the recorded events complete; CUDA releases a destroyed event once it does.
    for (auto e : events) cudaEventDestroy(e);
    spdlog::error("{}", reason);
    if (callback) callback(reason);
  }
};

struct NcclLink::State {
  // Per direction, held for a whole post(): NCCL allows no other call on a non-blocking communicator until its
  // group reports ncclSuccess, and operations must reach NCCL in posting order. Taken before `mu`.
  std::mutex enqueue[2];
  mutable std::mutex mu;              // guards everything below and every NCCL call on the communicators
  ncclComm_t comm[2] = {nullptr, nullptr};  // [0] up (inference -> cache), [1] down (cache -> inference)
  std::deque<Pending> pending;
  std::vector<cudaEvent_t> free_events;
  bool failed = false;
  std::string failure;
  std::function<void(const std::string&)> on_failure;
  NcclLinkCounters counters;

  std::thread watchdog;
  std::condition_variable stop_cv;
  bool stop = false;

  // Marks the link failed and hands the communicators and events to the returned Failure, whose finish() the caller
  // runs after releasing the lock.
  Failure fail_locked(const std::string& reason) {
    Failure f;
    if (failed) return f;
    failed = true;
    failure = reason;
    f.first = true;
    f.reason = reason;
    for (int d = 0; d < 2; ++d) {
      f.comm[d] = comm[d];
      comm[d] = nullptr;
    }
    for (auto& p : pending) f.events.push_back(p.done);
    pending.clear();
    f.callback = on_failure;
    return f;
  }
};

NcclLink::NcclLink(const std::string& address, NcclRole role, std::string peer_name, NcclLinkOptions opts)
    : role_(role), peer_name_(std::move(peer_name)), opts_(opts), st_(std::make_unique<State>()) {
  const std::string who = fmt::format("NCCL link ({} side) to {}", nccl_role_name(role_), peer_name_);
  SPADE_CHECK(address.size() == address_size(), "{}: address is {} bytes, expected {} (two ncclUniqueIds)", who,
              address.size(), address_size());
  SPADE_CHECK(opts_.op_timeout.count() > 0 && opts_.connect_timeout.count() > 0 && opts_.watchdog_period.count() > 0,
              "{}: timeouts must be positive", who);
  SPADE_CHECK(opts_.max_ctas_up >= 0 && opts_.max_ctas_down >= 0, "{}: max_ctas must be >= 0", who);
  int ndev = 0;
  cudaError_t ce = cudaGetDeviceCount(&ndev);
  SPADE_CHECK(ce == cudaSuccess, "{}: cudaGetDeviceCount: {}", who, cudaGetErrorString(ce));
  SPADE_CHECK(opts_.device >= 0 && opts_.device < ndev, "{}: device {} out of range ({} CUDA devices)", who,
              opts_.device, ndev);
  ce = cudaSetDevice(opts_.device);
  SPADE_CHECK(ce == cudaSuccess, "{}: cudaSetDevice({}): {}", who, opts_.device, cudaGetErrorString(ce));

  ncclUniqueId ids[2];
  std::memcpy(ids, address.data(), sizeof(ids));
  ncclConfig_t cfg[2] = {NCCL_CONFIG_INITIALIZER, NCCL_CONFIG_INITIALIZER};
  const int ctas[2] = {opts_.max_ctas_up, opts_.max_ctas_down};
  for (int d = 0; d < 2; ++d) {
    cfg[d].blocking = 0;
    if (ctas[d] > 0) {
      cfg[d].maxCTAs = ctas[d];
      cfg[d].minCTAs = 1;
    }
  }
  const int rank = static_cast<int>(role_);
  ncclResult_t r = ncclGroupStart();
  for (int d = 0; d < 2 && r == ncclSuccess; ++d) {
    r = ncclCommInitRankConfig(&st_->comm[d], 2, ids[d], rank, &cfg[d]);
    if (r == ncclInProgress) r = ncclSuccess;
  }
  const ncclResult_t ge = ncclGroupEnd();
  if (r == ncclSuccess && ge != ncclInProgress) r = ge;
  // Poll both communicators until ready, failed or out of time.
  const auto deadline = Clock::now() + opts_.connect_timeout;
  while (r == ncclSuccess) {
    bool ready = true;
    for (auto* c : st_->comm) {
      ncclResult_t s = ncclSuccess;
      if (c == nullptr) {
        s = ncclInternalError;
      } else {
        const ncclResult_t q = ncclCommGetAsyncError(c, &s);
        if (q != ncclSuccess) s = q;
      }
      if (s == ncclInProgress) {
        ready = false;
      } else if (s != ncclSuccess) {
        r = s;
        break;
      }
    }
    if (r != ncclSuccess || ready) break;
    if (Clock::now() > deadline) {
      abort_all(st_->comm);
      fail("{}: the peer did not join within {} ms (device {}); communicators aborted", who,
           ms(opts_.connect_timeout), opts_.device);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (r != ncclSuccess) {
    const std::string m = nccl_msg(r);
    abort_all(st_->comm);
    fail("{}: communicator init failed on device {}: {}", who, opts_.device, m);
  }
  connect_peer(who, deadline);
  spdlog::info("{}: ready on device {} (max CTAs up {}, down {})", who, opts_.device, opts_.max_ctas_up,
               opts_.max_ctas_down);

  st_->watchdog = std::thread([this, who] {
    cudaSetDevice(opts_.device);
    std::unique_lock lk(st_->mu);
    while (!st_->stop && !st_->failed) {
      std::string reason;
      for (int d = 0; d < 2 && reason.empty(); ++d) {
        ncclResult_t s = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(st_->comm[d], &s);
        if (q != ncclSuccess) s = q;
        if (s != ncclSuccess && s != ncclInProgress)
          reason = fmt::format("{}: asynchronous NCCL error on the {} communicator: {}; link aborted", who,
                               d == 0 ? "up" : "down", nccl_msg(s));
      }
      const auto now = Clock::now();
      for (auto it = st_->pending.begin(); reason.empty() && it != st_->pending.end();) {
        const cudaError_t e = cudaEventQuery(it->done);
        if (e == cudaSuccess) {
          st_->free_events.push_back(it->done);
          it = st_->pending.erase(it);
        } else if (e != cudaErrorNotReady) {
          reason = fmt::format("{}: {} failed on device {}: {}; link aborted", who, it->what, opts_.device,
                               cudaGetErrorString(e));
        } else if (now > it->deadline) {
          reason = fmt::format("{}: {} not complete {} ms after it was posted (peer dead or stalled); link aborted",
                               who, it->what, it->timeout_ms);
        } else {
          ++it;
        }
      }
      if (!reason.empty()) {
        Failure f = st_->fail_locked(reason);
        lk.unlock();
        f.finish();  // the callback must not destroy this link (the watchdog thread would join itself)
        return;
      }
      st_->stop_cv.wait_for(lk, opts_.watchdog_period, [&] { return st_->stop; });
    }
  });
}

// NCCL connects a point-to-point channel lazily, at the first operation on it, and the connection needs the peer's
// matching operation. A non-blocking communicator returns ncclInProgress until then, and post() must wait for
// ncclSuccess before recording the completion event; so a first recv on "down" on one side and a first recv on "up"
// on the other would wait for each other. Both directions are therefore connected here, in one group over both
// communicators, by exchanging an 8-byte hello whose content checks the wiring (the peer has the other role).
void NcclLink::connect_peer(const std::string& who, std::chrono::steady_clock::time_point deadline) {
  struct Scratch {
    void* p = nullptr;
    cudaStream_t s = nullptr;
    ~Scratch() {
      if (s != nullptr) cudaStreamDestroy(s);
      if (p != nullptr) cudaFree(p);
    }
  } x;
  auto abort_and_fail = [&](const std::string& why) {
    abort_all(st_->comm);
    fail("{}: {}; communicators aborted", who, why);
  };
  cudaError_t ce = cudaMalloc(&x.p, 16);
  if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&x.s, cudaStreamNonBlocking);
  const uint64_t mine = 0x5350414445000000ull | static_cast<uint64_t>(role_);  // "SPADE" + role
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(x.p, &mine, 8, cudaMemcpyHostToDevice, x.s);
  if (ce == cudaSuccess) ce = cudaMemsetAsync(static_cast<char*>(x.p) + 8, 0, 8, x.s);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(x.s);
  if (ce != cudaSuccess) abort_and_fail(fmt::format("hello buffers: {}", cudaGetErrorString(ce)));
  const int peer = 1 - static_cast<int>(role_);
  const int send_d = role_ == NcclRole::kInference ? 0 : 1;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = ncclSend(x.p, 8, ncclUint8, peer, st_->comm[send_d], x.s);
  if (r == ncclSuccess || r == ncclInProgress)
    r = ncclRecv(static_cast<char*>(x.p) + 8, 8, ncclUint8, peer, st_->comm[1 - send_d], x.s);
  if (r == ncclInProgress) r = ncclSuccess;
  const ncclResult_t ge = ncclGroupEnd();
  if (r == ncclSuccess) r = ge;
  while (r == ncclInProgress || r == ncclSuccess) {
    bool ready = true;
    for (auto* c : st_->comm) {
      ncclResult_t s = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(c, &s);
      if (q != ncclSuccess) s = q;
      if (s == ncclInProgress) ready = false;
      else if (s != ncclSuccess) r = s;
    }
    if (r != ncclSuccess && r != ncclInProgress) break;
    if (ready && cudaStreamQuery(x.s) != cudaErrorNotReady) {
      r = ncclSuccess;
      break;
    }
    if (Clock::now() > deadline)
      abort_and_fail(fmt::format("no hello from the peer within {} ms (device {})", ms(opts_.connect_timeout),
                                 opts_.device));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (r != ncclSuccess) abort_and_fail(fmt::format("hello exchange failed: {}", nccl_msg(r)));
  uint64_t got = 0;
  ce = cudaMemcpy(&got, static_cast<char*>(x.p) + 8, 8, cudaMemcpyDeviceToHost);
  if (ce != cudaSuccess) abort_and_fail(fmt::format("hello exchange: {}", cudaGetErrorString(ce)));
  const uint64_t want = 0x5350414445000000ull | static_cast<uint64_t>(peer);
  if (got != want)
    abort_and_fail(fmt::format("the peer's hello is {:#018x}, expected {:#018x} (both sides joined as the {} rank?)",
                               got, want, nccl_role_name(role_)));
}

NcclLink::~NcclLink() {
  {
    std::lock_guard lk(st_->mu);
    st_->stop = true;
  }
  st_->stop_cv.notify_all();
  if (st_->watchdog.joinable()) st_->watchdog.join();
  int caller_device = -1;
  cudaGetDevice(&caller_device);
  cudaSetDevice(opts_.device);
  struct Restore {
    int d;
    ~Restore() {
      if (d >= 0) cudaSetDevice(d);
    }
  } restore{caller_device};
  std::lock_guard lk(st_->mu);
  if (!st_->failed) {
    // Let the posted operations finish (up to op_timeout).
    const auto deadline = Clock::now() + opts_.op_timeout;
    bool drained = true;
    for (auto& p : st_->pending) {
      while (cudaEventQuery(p.done) == cudaErrorNotReady && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (cudaEventQuery(p.done) == cudaErrorNotReady) drained = false;
    }
    // Teardown is local: with our operations drained, ncclCommAbort frees the communicators at once.
    // ncclCommFinalize would wait for the peer to finalize too (measured: a peer that exits first waits until its own
    // deadline), and a link must not hold a process's shutdown hostage to the other's.
    if (!drained)
      spdlog::warn("NCCL link to {}: {} operation(s) still in flight after {} ms at teardown; aborting", peer_name_,
                   st_->pending.size(), ms(opts_.op_timeout));
    abort_all(st_->comm);
    for (auto& p : st_->pending) cudaEventDestroy(p.done);
    st_->pending.clear();
  }
  for (auto e : st_->free_events) cudaEventDestroy(e);
}

void NcclLink::post(bool is_send, void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout) {
  const bool up = (role_ == NcclRole::kInference) == is_send;
  const int d = up ? 0 : 1;
  const std::string desc = fmt::format("{} of {} bytes ({})", is_send ? "send" : "receive", bytes,
                                       what != nullptr ? what : "unnamed");
  SPADE_CHECK(buf != nullptr && bytes > 0, "NCCL link to {}: {}: null buffer or zero bytes", peer_name_, desc);
  int cur = -1;
  cudaGetDevice(&cur);
  SPADE_CHECK(cur == opts_.device, "NCCL link to {}: {}: current device is {}, the link's is {}", peer_name_, desc,
              cur, opts_.device);
  SPADE_CHECK(timeout.count() >= 0, "NCCL link to {}: {}: negative timeout", peer_name_, desc);
  const bool no_timeout = timeout == kNoTimeout;
  if (timeout.count() == 0) timeout = opts_.op_timeout;
  Failure failure;
  std::string reason;
  {
    std::lock_guard enqueue(st_->enqueue[d]);
    std::unique_lock lk(st_->mu);
    if (st_->failed) fail("{} (refused {})", st_->failure, desc);
    // The completion event first: once NCCL has the operation, nothing may fail without failing the link.
    cudaEvent_t ev = nullptr;
    if (!st_->free_events.empty()) {
      ev = st_->free_events.back();
      st_->free_events.pop_back();
    } else {
      const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      SPADE_CHECK(e == cudaSuccess, "NCCL link to {}: {}: cudaEventCreate: {}", peer_name_, desc,
                  cudaGetErrorString(e));
    }
    ncclComm_t c = st_->comm[d];
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
      r = is_send ? ncclSend(buf, bytes, ncclUint8, 1 - static_cast<int>(role_), c, stream)
                  : ncclRecv(buf, bytes, ncclUint8, 1 - static_cast<int>(role_), c, stream);
      if (r == ncclInProgress) r = ncclSuccess;
      const ncclResult_t ge = ncclGroupEnd();
      if (r == ncclSuccess) r = ge;
    }
    // Non-blocking communicator: the group may still be enqueuing (e.g. the first operation connects the peer).
    const auto deadline = Clock::now() + opts_.op_timeout;
    while (r == ncclInProgress) {
      ncclResult_t s = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(c, &s);
      r = q != ncclSuccess ? q : s;
      if (r != ncclInProgress) break;
      if (Clock::now() > deadline) {
        reason = fmt::format("NCCL link to {}: {} still not enqueued after {} ms (peer not connecting); link aborted",
                             peer_name_, desc, ms(opts_.op_timeout));
        break;
      }
      lk.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lk.lock();
      if (st_->failed) {
        st_->free_events.push_back(ev);
        fail("{} (while enqueuing {})", st_->failure, desc);
      }
    }
    if (reason.empty() && r != ncclSuccess)
      reason = fmt::format("NCCL link to {}: {} failed: {}; link aborted", peer_name_, desc, nccl_msg(r));
    if (reason.empty()) {
      const cudaError_t e = cudaEventRecord(ev, stream);
      if (e != cudaSuccess) {
        cudaEventDestroy(ev);
        reason = fmt::format("NCCL link to {}: {}: cudaEventRecord: {}; link aborted", peer_name_, desc,
                             cudaGetErrorString(e));
      } else {
        const auto now = Clock::now();
        st_->pending.push_back(Pending{ev, no_timeout ? Clock::time_point::max() : now + timeout,
                                       no_timeout ? -1 : static_cast<long long>(timeout.count()), desc});
        if (is_send) {
          ++st_->counters.sends;
          st_->counters.bytes_sent += bytes;
        } else {
          ++st_->counters.recvs;
          st_->counters.bytes_received += bytes;
        }
        return;
      }
    } else {
      st_->free_events.push_back(ev);
    }
    failure = st_->fail_locked(reason);
  }
  failure.finish();
  throw Error(reason);
}

void NcclLink::send(const void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout) {
  post(true, const_cast<void*>(buf), bytes, stream, what, timeout);
}

void NcclLink::recv(void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout) {
  post(false, buf, bytes, stream, what, timeout);
}

void NcclLink::abort(const std::string& reason) {
  Failure f;
  {
    std::lock_guard lk(st_->mu);
    f = st_->fail_locked(fmt::format("NCCL link to {}: aborted: {}", peer_name_, reason));
  }
  st_->stop_cv.notify_all();
  f.finish();
}

bool NcclLink::failed() const {
  std::lock_guard lk(st_->mu);
  return st_->failed;
}

std::string NcclLink::failure() const {
  std::lock_guard lk(st_->mu);
  return st_->failure;
}

void NcclLink::on_failure(std::function<void(const std::string&)> callback) {
  std::lock_guard lk(st_->mu);
  st_->on_failure = std::move(callback);
}

NcclLinkCounters NcclLink::counters() const {
  std::lock_guard lk(st_->mu);
  return st_->counters;
}

size_t NcclLink::in_flight() const {
  std::lock_guard lk(st_->mu);
  return st_->pending.size();
}

}  // namespace spade::transport

// NcclLink (see nccl_link.h): non-blocking NCCL communicators; the watchdog over every posted operation, the failure
// latch and abort are GpuLinkWatch's (transport/gpu_link_watch.h).
#include "transport/nccl/nccl_link.h"

#include <nccl.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common/error.h"
#include "transport/gpu_link_watch.h"

namespace spade::transport {

namespace {

using Clock = std::chrono::steady_clock;
using detail::ms;

std::string nccl_msg(ncclResult_t r) {
  return fmt::format("{} ({})", ncclGetErrorString(r), ncclGetLastError(nullptr));
}

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

// The watch of a link (see gpu_link_watch.h): watchdog errors name the role and the peer, post errors the peer.
detail::GpuLinkWatch::Options watch_options(NcclRole role, const std::string& peer_name, const NcclLinkOptions& o) {
  detail::GpuLinkWatch::Options w;
  w.who = fmt::format("NCCL link ({} side) to {}", nccl_role_name(role), peer_name);
  w.label = fmt::format("NCCL link to {}", peer_name);
  w.outcome = "link aborted";
  w.device = o.device;
  w.op_timeout = o.op_timeout;
  w.watchdog_period = o.watchdog_period;
  w.watch_after_failure = false;  // nothing left to watch once the communicators are aborted
  return w;
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

struct NcclLink::State final : detail::GpuLinkWatch {
  explicit State(Options o) : GpuLinkWatch(std::move(o)) {}
  ~State() override { stop_watchdog(); }

  // Guarded by mu(), like every NCCL call on the communicators: NCCL allows no other call on a non-blocking
  // communicator until its group reports ncclSuccess.
  ncclComm_t comm[2] = {nullptr, nullptr};  // [0] up (inference -> cache), [1] down (cache -> inference)
  ncclComm_t doomed[2] = {nullptr, nullptr};  // taken from `comm` by the first failure, aborted by its finish()

 protected:
  // The first failure takes the communicators away from the posting path (ncclCommAbort can block for long: it runs
  // in release_transfers(), outside the lock).
  void on_fail_locked() override {
    for (int d = 0; d < 2; ++d) {
      doomed[d] = comm[d];
      comm[d] = nullptr;
    }
  }
  // The aborted NCCL kernels exit, so the recorded events complete; CUDA releases a destroyed event once it does.
  void release_transfers(std::vector<cudaEvent_t>& events) override {
    abort_all(doomed);
    for (auto e : events) cudaEventDestroy(e);
    events.clear();
  }
  Verdict check_locked(detail::WatchClock::time_point /*now*/) override {
    for (int d = 0; d < 2; ++d) {
      ncclResult_t s = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm[d], &s);
      if (q != ncclSuccess) s = q;
      if (s != ncclSuccess && s != ncclInProgress)
        return {fmt::format("{}: asynchronous NCCL error on the {} communicator: {}; link aborted", who(),
                            d == 0 ? "up" : "down", nccl_msg(s)),
                false};
    }
    return {};
  }
};

NcclLink::NcclLink(const std::string& address, NcclRole role, std::string peer_name, NcclLinkOptions opts)
    : WatchedGpuLink(role, std::move(peer_name), opts.device),
      opts_(opts),
      st_(std::make_unique<State>(watch_options(role_, peer_name_, opts_))) {
  const std::string& who = st_->who();
  SPADE_CHECK(address.size() == address_size(), "{}: address is {} bytes, expected {} (two ncclUniqueIds)", who,
              address.size(), address_size());
  SPADE_CHECK(opts_.op_timeout.count() > 0 && opts_.connect_timeout.count() > 0 && opts_.watchdog_period.count() > 0,
              "{}: timeouts must be positive", who);
  SPADE_CHECK(opts_.max_ctas_up >= 0 && opts_.max_ctas_down >= 0, "{}: max_ctas must be >= 0", who);
  detail::use_device(who, opts_.device);

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

  st_->start_watchdog();
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
  st_->stop_watchdog();
  detail::DeviceGuard device(opts_.device);  // the caller's current device is kept
  {
    std::lock_guard lk(st_->mu());
    if (!st_->failed_locked()) {
      // Let the posted operations finish (up to op_timeout).
      std::vector<cudaEvent_t> events = st_->take_pending_locked();
      const bool drained = detail::GpuLinkWatch::wait_events(events, Clock::now() + opts_.op_timeout);
      // Teardown is local: with our operations drained, ncclCommAbort frees the communicators at once.
      // ncclCommFinalize would wait for the peer to finalize too (measured: a peer that exits first waits until its
      // own deadline), and a link must not hold a process's shutdown hostage to the other's.
      if (!drained)
        spdlog::warn("NCCL link to {}: {} operation(s) still in flight after {} ms at teardown; aborting", peer_name_,
                     events.size(), ms(opts_.op_timeout));
      abort_all(st_->comm);
      for (auto e : events) cudaEventDestroy(e);
    }
  }
  st_->destroy_free_events();
}

void NcclLink::post(bool is_send, void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout) {
  State& st = *st_;
  const detail::OpRequest op = st.check_post(role_, is_send, buf, bytes, what, timeout);
  const int d = op.direction;
  detail::GpuLinkWatch::Failure failure;
  std::string reason;
  {
    std::lock_guard enqueue(st.enqueue_mutex(d));
    // The completion event first: once NCCL has the operation, nothing may fail without failing the link.
    cudaEvent_t ev = st.take_event(op);
    std::unique_lock lk(st.mu());
    st.throw_if_failed_locked(op, ev, "refused");
    ncclComm_t c = st.comm[d];
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
        reason = fmt::format("{}: {} still not enqueued after {} ms (peer not connecting); link aborted", st.label(),
                             op.desc, ms(opts_.op_timeout));
        break;
      }
      lk.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lk.lock();
      st.throw_if_failed_locked(op, ev, "while enqueuing");
    }
    if (reason.empty() && r != ncclSuccess)
      reason = fmt::format("{}: {} failed: {}; link aborted", st.label(), op.desc, nccl_msg(r));
    if (reason.empty()) {
      const cudaError_t e = cudaEventRecord(ev, stream);
      if (e != cudaSuccess) {
        cudaEventDestroy(ev);
        reason = fmt::format("{}: {}: cudaEventRecord: {}; link aborted", st.label(), op.desc, cudaGetErrorString(e));
      } else {
        st.track_locked(ev, op, /*recorded=*/true);
        st.count_locked(op);
        return;
      }
    } else {
      st.recycle_event_locked(ev);
    }
    failure = st.fail_locked(reason);
  }
  st.finish(failure);
  throw Error(reason);
}

detail::GpuLinkWatch& NcclLink::watch() const { return *st_; }

}  // namespace spade::transport

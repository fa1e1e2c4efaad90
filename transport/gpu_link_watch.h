// Internal to the GPU links (NcclLink, CudaIpcLink; their headers include it for WatchedGpuLink, below): the
// watched-operation machinery both keep behind the GpuLink contract (transport/gpu_link.h), so that the contract's
// watchdog, failure and accounting rules live in one place.
//
// GpuLinkWatch holds, under one mutex:
//   * the pending operations: each posted send/recv with its completion event (a CUDA event recorded after it on the
//     caller's stream), its deadline (from the moment it was tracked; none for GpuLink::kNoTimeout) and its
//     description ("send of 1048576 bytes (qkv of pack 3)");
//   * a pool of free completion events, the byte / operation counters;
//   * the failure latch: failed, the first failure's reason (naming the peer), the on_failure callback, run once.
// and runs the watchdog thread: every watchdog_period it asks the link for link-specific health (check_locked: NCCL's
// asynchronous errors, CUDA IPC's peer heartbeat and abort word), then drops completed operations and fails the link
// on the first CUDA error or missed deadline:
//   "<who>: <what> failed on device <d>: <CUDA error>; <outcome>"
//   "<who>: <what> not complete <t> ms after it was posted (peer dead or stalled); <outcome>"
// where <who> names the link and the peer, e.g. "NCCL link (inference side) to cache rank 1 (#0) on host-b", and
// <outcome> says what the failure did ("link aborted", "link released").
//
// A link derives its private state from GpuLinkWatch and implements the hooks: release_transfers() (make the
// transfers still in flight complete, so the streams drain: NCCL aborts its communicators, CUDA IPC releases its
// counters) and optionally on_fail_locked(), check_locked(), tick_locked(), watchdog_started(). A failure's
// side effects run outside the mutex, in this order: release_transfers(events of the tracked operations), log
// (error; info when quiet), the on_failure callback.
//
// WatchedGpuLink (below) is the links' common GpuLink half: identity, and the calls that forward to the watch.
//
// Lock order: a direction's enqueue mutex (held for a whole post, so that operations of one direction reach the
// transport in call order), then mu(). The hooks named *_locked run with mu() held; the others without it.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport/gpu_link.h"

namespace spade::transport::detail {

using WatchClock = std::chrono::steady_clock;

/// Milliseconds as a printable integer.
inline long long ms(std::chrono::milliseconds d) { return static_cast<long long>(d.count()); }

/// Checks that `device` exists and makes it current on the calling thread. Errors (spade::Error, prefixed with `who`):
/// "cudaGetDeviceCount: ...", "device D out of range (N CUDA devices)", "cudaSetDevice(D): ...".
void use_device(const std::string& who, int device);

/// Makes `device` current for the guard's lifetime, then restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

/// One send()/recv() call, checked and resolved by GpuLinkWatch::check_post().
struct OpRequest {
  bool is_send = false;
  size_t bytes = 0;
  int direction = 0;  // 0 = up (inference -> cache), 1 = down (cache -> inference)
  std::string desc;   // "send of 1048576 bytes (qkv of pack 3)"; "unnamed" when `what` was null
  bool no_timeout = false;             // GpuLink::kNoTimeout: no deadline
  std::chrono::milliseconds timeout{};  // the deadline's distance (op_timeout when the caller passed 0)
};

class GpuLinkWatch {
 public:
  struct Options {
    std::string who;    // watchdog errors' prefix: "NCCL link (inference side) to cache rank 1"
    std::string label;  // send/recv/abort errors' prefix (the same as `who`, or shorter); names the peer too
    std::string outcome = "link aborted";  // ends a watchdog error: what the failure did to the link
    int device = 0;
    std::chrono::milliseconds op_timeout{10000};     // default deadline of an operation, and teardown's drain bound
    std::chrono::milliseconds watchdog_period{2};    // how often the watchdog polls
    bool watch_after_failure = false;  // keep the watchdog thread ticking (tick_locked) after a failure
    // Completion events created by start_watchdog(), before anything is posted. Posting takes them from this pool
    // (refilled as operations complete) and creates one only while more operations than this are in flight: a CUDA
    // event created while the peer's operations are pending is what the reserve avoids (with both ends in one
    // process, the in-process pair stalled at the first steps that had more operations in flight than before).
    size_t reserve_events = 64;
  };

  /// What a failure leaves to do outside the mutex (finish()). `first` is false when the link had already failed.
  struct Failure {
    bool first = false;
    std::string reason;
    std::vector<cudaEvent_t> events;  // completion events of the tracked, recorded operations
    std::function<void(const std::string&)> callback;
    bool quiet = false;  // an orderly end: logged as info, not error
  };

  explicit GpuLinkWatch(Options opts);
  /// The derived link must have called stop_watchdog() (the hooks are virtual); this only backs that up.
  virtual ~GpuLinkWatch();
  GpuLinkWatch(const GpuLinkWatch&) = delete;
  GpuLinkWatch& operator=(const GpuLinkWatch&) = delete;

  const std::string& who() const { return opts_.who; }
  const std::string& label() const { return opts_.label; }
  const Options& options() const { return opts_; }

  // ---- posting (send/recv) ----

  /// Checks a send/recv call and resolves its description and deadline. Throws spade::Error "<label>: <desc>: ..."
  /// for a null `buf` or 0 `bytes`, a current device other than the link's, or a negative `timeout`.
  OpRequest check_post(PairRole role, bool is_send, const void* buf, size_t bytes, const char* what,
                       std::chrono::milliseconds timeout) const;
  /// The mutex that keeps direction `d`'s operations in call order; held for a whole post, taken before mu().
  std::mutex& enqueue_mutex(int d) { return enqueue_[d]; }
  /// A completion event for `op`: from the pool, else newly created. Throws "<failure> (refused <desc>)" if the link
  /// has failed, "<label>: <desc>: cudaEventCreate: ..." if CUDA cannot create one. Takes mu() itself.
  cudaEvent_t take_event(const OpRequest& op);
  /// Throws "<failure> (<doing> <desc>)", e.g. doing = "refused", after returning `ev` (if any) to the pool, when the
  /// link has failed. mu() held.
  void throw_if_failed_locked(const OpRequest& op, cudaEvent_t ev, const char* doing);
  /// Returns an unused (or completed) event to the pool. mu() held.
  void recycle_event_locked(cudaEvent_t ev) { free_events_.push_back(ev); }
  /// Starts watching `op`: its deadline counts from now. `recorded` = false while the caller is still enqueuing
  /// (the watchdog then checks only the deadline; the event belongs to the caller until mark_recorded_locked()).
  /// Returns the operation's id. mu() held.
  uint64_t track_locked(cudaEvent_t ev, const OpRequest& op, bool recorded);
  void mark_recorded_locked(uint64_t id);
  /// Stops watching an operation (its event stays with the caller). mu() held.
  void untrack_locked(uint64_t id);
  /// Adds a posted operation to the counters. mu() held.
  void count_locked(const OpRequest& op);

  // ---- failure ----

  /// Latches the failure (the first reason wins), hands the recorded operations' events and the callback to the
  /// returned Failure and calls on_fail_locked(); an empty Failure (first = false) if already failed. mu() held.
  Failure fail_locked(const std::string& reason);
  /// Runs a failure's side effects (no lock held): release_transfers(events) when there are events or it is the
  /// first failure, then (first failure only) the log line and the callback.
  void finish(Failure& f);
  /// GpuLink::abort(): fails the link with "<label>: aborted: <reason>" and runs finish(). Idempotent.
  void abort(const std::string& reason);

  // ---- accessors (GpuLink's) ----
  std::mutex& mu() const { return mu_; }
  bool failed_locked() const { return failed_; }
  const std::string& failure_locked() const { return failure_; }
  bool failed() const;
  std::string failure() const;
  void on_failure(std::function<void(const std::string&)> callback);
  GpuLinkCounters counters() const;
  size_t in_flight() const;
  bool pending_empty_locked() const { return pending_.empty(); }
  /// "while <desc of the oldest pending operation> was in flight", or "no operation in flight". mu() held.
  std::string oldest_locked() const;

  // ---- watchdog and teardown ----

  /// Creates the reserve of completion events (Options::reserve_events; on the link's device, the calling thread's
  /// current device is kept) and starts the watchdog thread (once). A reserve CUDA cannot create is logged (warn) and
  /// left to take_event().
  void start_watchdog();
  /// Stops and joins the watchdog (detaches it when called on the watchdog thread itself, e.g. from a callback that
  /// destroys the link, which the contract forbids). Idempotent.
  void stop_watchdog();
  /// For teardown (watchdog stopped): the recorded events of the pending operations, which stop being tracked.
  /// mu() held.
  std::vector<cudaEvent_t> take_pending_locked();
  /// Waits until every event completed (or failed) or `deadline` passes; true if all completed.
  static bool wait_events(const std::vector<cudaEvent_t>& events, WatchClock::time_point deadline);
  /// Destroys the pooled events (teardown).
  void destroy_free_events();

 protected:
  /// A link-specific health verdict: a failure reason ("" = healthy), and whether it is an orderly end.
  struct Verdict {
    std::string reason;
    bool quiet = false;
  };
  /// Makes the transfers in flight complete (so the streams drain) and destroys `events`. Called without the lock by
  /// finish(): once per first failure, and for the events a failed post() hands over.
  virtual void release_transfers(std::vector<cudaEvent_t>& events) = 0;
  /// On the first failure, mu() held: take what release_transfers() needs away from the posting path.
  virtual void on_fail_locked() {}
  /// Watchdog, before the pending operations are checked; mu() held, link healthy. A non-empty reason fails the link.
  virtual Verdict check_locked(WatchClock::time_point /*now*/) { return {}; }
  /// Watchdog, every period (after a failure too when watch_after_failure); mu() held.
  virtual void tick_locked() {}
  /// Watchdog thread start, device current, no lock held.
  virtual void watchdog_started() {}

 private:
  struct Pending {
    uint64_t id = 0;
    cudaEvent_t done = nullptr;
    bool recorded = false;
    WatchClock::time_point deadline;  // time_point::max(): none (GpuLink::kNoTimeout)
    long long timeout_ms = 0;         // -1: none
    std::string what;
  };
  void watchdog_loop();

  const Options opts_;
  std::mutex enqueue_[2];
  mutable std::mutex mu_;  // everything below
  std::list<Pending> pending_;
  uint64_t next_id_ = 1;
  std::vector<cudaEvent_t> free_events_;
  uint64_t late_events_ = 0;
  bool started_ = false;
  bool failed_ = false;
  std::string failure_;
  std::function<void(const std::string&)> on_failure_;
  GpuLinkCounters counters_;
  std::thread watchdog_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
};

/// The GpuLink half both links share: who the link is (role, peer, device), and the calls that only forward to the
/// link's GpuLinkWatch. send() and recv() are post(); abort(), failed(), failure(), on_failure(), counters() and
/// in_flight() are the watch's, and a link overrides the ones it refines (CUDA IPC: abort() with the link's device
/// current, failed()/failure() also reading the peer's abort word). Not copyable.
class WatchedGpuLink : public GpuLink {
 public:
  WatchedGpuLink(const WatchedGpuLink&) = delete;
  WatchedGpuLink& operator=(const WatchedGpuLink&) = delete;

  void send(const void* buf, size_t bytes, cudaStream_t stream, const char* what,
            std::chrono::milliseconds timeout = std::chrono::milliseconds::zero()) override;
  void recv(void* buf, size_t bytes, cudaStream_t stream, const char* what,
            std::chrono::milliseconds timeout = std::chrono::milliseconds::zero()) override;
  void abort(const std::string& reason) override;
  bool failed() const override;
  std::string failure() const override;
  void on_failure(std::function<void(const std::string&)> callback) override;
  GpuLinkCounters counters() const override;
  size_t in_flight() const override;
  PairRole role() const override { return role_; }
  int device() const override { return device_; }
  const std::string& peer_name() const override { return peer_name_; }

 protected:
  WatchedGpuLink(PairRole role, std::string peer_name, int device)
      : role_(role), peer_name_(std::move(peer_name)), device_(device) {}
  /// The link's watch (its private state); valid for the link's lifetime.
  virtual GpuLinkWatch& watch() const = 0;
  /// Enqueues one send (`is_send`) or receive on `stream` (GpuLink::send / recv: same arguments and errors).
  virtual void post(bool is_send, void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout) = 0;

  const PairRole role_;
  const std::string peer_name_;
  const int device_;
};

}  // namespace spade::transport::detail

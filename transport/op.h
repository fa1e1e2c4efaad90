// Internal: the shared completion state behind SendHandle/RecvHandle. Implementations create an Op per posted
// operation and call complete() exactly once (later calls are ignored).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "transport/transport.h"

namespace spade::transport::detail {

struct Op;

/// Implemented by endpoints: cancels a pending op (asynchronously is fine; must eventually complete() it
/// unless it completes otherwise).
class OpOwner {
 public:
  virtual ~OpOwner() = default;
  virtual void cancel_op(const std::shared_ptr<Op>& op) = 0;
};

struct Op {
  enum class Kind { kSend, kRecv };

  Op(Kind k, uint64_t t, void* b, size_t s, std::weak_ptr<OpOwner> o)
      : kind(k), tag(t), buf(b), size(s), owner(std::move(o)) {}

  const Kind kind;
  const uint64_t tag;
  void* const buf;    // send: source (const in spirit); recv: destination
  const size_t size;  // send: length; recv: capacity
  const std::weak_ptr<OpOwner> owner;

  /// Sets the final state; returns false (and changes nothing) when already completed.
  bool complete(Status s, size_t len, std::string err) {
    {
      std::lock_guard lk(mu_);
      if (status_.load(std::memory_order_relaxed) != Status::PENDING) return false;
      length_ = len;
      error_ = std::move(err);
      status_.store(s, std::memory_order_release);
    }
    cv_.notify_all();
    return true;
  }

  Status poll() const { return status_.load(std::memory_order_acquire); }

  Status wait(Deadline deadline) const {
    std::unique_lock lk(mu_);
    bool done = cv_.wait_until(lk, deadline,
                               [&] { return status_.load(std::memory_order_relaxed) != Status::PENDING; });
    return done ? status_.load(std::memory_order_relaxed) : Status::TIMEOUT;
  }

  size_t length() const {
    std::lock_guard lk(mu_);
    return length_;
  }

  std::string error() const {
    std::lock_guard lk(mu_);
    return error_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::atomic<Status> status_{Status::PENDING};
  size_t length_ = 0;
  std::string error_;
};

}  // namespace spade::transport::detail

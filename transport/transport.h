// Data-plane transport: asynchronous tagged point-to-point messages between an inference rank and its cache
// rank.
//
// Per decode step and per layer pack the inference rank sends one message (the step's q/k/v of the pack's
// layers) and receives one (the KV selected for the next step); see AsyncSpade Sec. 4.1 / 4.3. Both are
// posted ahead of time and completed asynchronously, overlapped with compute. This interface (host memory) is
// framework-free (bytes + 64-bit tags) so that the loopback and UCX implementations are interchangeable; the GPU
// pair links (NCCL, CUDA IPC: stream-ordered, device memory) are transport/gpu_link.h, and
// transport/link_factory.h picks any of them at run time.
//
// Semantics, common to all implementations:
//   * Matching: a message sent on endpoint A->B with tag t completes the oldest receive posted on B's
//   endpoint for A
//     with the same tag t (per-tag FIFO, like MPI's non-overtaking rule). Messages from different peers never
//     match each other. Tags must be < 2^48 (kMaxTag) and must not use kind 0xFF in bits 40..47 (reserved for
//     the transport's own control messages); see transport/tags.h for the layout Spade uses.
//   * Buffers: the caller owns `buf` and must keep it alive and unmodified until the handle is no longer
//   PENDING.
//     A send may stay PENDING until the receiver has posted a matching receive (rendezvous for large
//     messages).
//   * Completion: poll() never blocks. wait(deadline) blocks until the operation completes or the deadline
//   passes;
//     TIMEOUT leaves the operation pending (wait again, or cancel()).
//   * Failures: a message larger than the posted receive buffer fails that receive (FAILED, "... larger than
//   the
//     posted buffer ..."). When the peer dies or the connection breaks, every pending and future operation on
//     that endpoint completes FAILED with a message naming the peer, within a bounded time (UCX: transport
//     error or keepalive, see transport/ucx.h; the caller may also call Endpoint::abort() when the
//     coordinator reports PeerDown).
//   * cancel(): requests cancellation and returns without blocking; the final status (CANCELLED, or OK/FAILED
//   if it
//     completed first) is visible through poll()/wait(). Receives can always be cancelled until matched. UCX
//     cannot withdraw a send once handed to the library; such a send completes normally (OK/FAILED).
//   * Threading: Transport, Endpoint and handles are thread-safe. Progress is made by the implementation
//   itself
//     (loopback: inline; UCX: a progress thread owned by the Transport), so Transport::progress() is a no-op
//     kept for implementations that need explicit progress.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace spade::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

/// Largest tag accepted by post_send/post_recv: 48 bits (UCX uses the upper 16 bits of its 64-bit tag for the
/// sender's id, see transport/ucx.h).
inline constexpr uint64_t kMaxTag = (uint64_t{1} << 48) - 1;

/// Throws spade::Error when `tag` is > kMaxTag or in the reserved kind 0xFF; `what` names the caller/peer.
void check_user_tag(uint64_t tag, const std::string& what);

enum class Status { PENDING, OK, TIMEOUT, FAILED, CANCELLED };

/// "PENDING", "OK", "TIMEOUT", "FAILED", "CANCELLED".
const char* status_name(Status s);

namespace detail {
struct Op;
}

/// Handle of one posted operation. Copyable (copies refer to the same operation); a default-constructed
/// handle is invalid (every method throws spade::Error).
class OpHandle {
 public:
  OpHandle() = default;
  explicit OpHandle(std::shared_ptr<detail::Op> op) : op_(std::move(op)) {}

  /// Current status; never blocks and never returns TIMEOUT.
  Status poll() const;
  /// Blocks until the operation is no longer PENDING or until `deadline`; returns TIMEOUT in the latter case
  /// (the operation stays pending).
  Status wait(Deadline deadline) const;
  /// wait(Clock::now() + timeout).
  Status wait_for(std::chrono::nanoseconds timeout) const { return wait(Clock::now() + timeout); }
  /// Requests cancellation (see the file comment). Never blocks.
  void cancel() const;

  /// Bytes transferred: for a completed receive the received message length, for a completed send its length.
  size_t length() const;
  /// Why the operation FAILED or was CANCELLED (names the peer); empty otherwise.
  std::string error() const;
  uint64_t tag() const;
  bool valid() const { return op_ != nullptr; }

 protected:
  std::shared_ptr<detail::Op> op_;
};

class SendHandle : public OpHandle {
 public:
  using OpHandle::OpHandle;
};

class RecvHandle : public OpHandle {
 public:
  using OpHandle::OpHandle;
};

/// One connection to one peer.
class Endpoint {
 public:
  virtual ~Endpoint() = default;

  /// Posts a send of `len` bytes at `buf` with `tag` (< 2^48). Throws spade::Error only for invalid
  /// arguments; a failed endpoint yields a handle that is already FAILED.
  virtual SendHandle post_send(uint64_t tag, const void* buf, size_t len) = 0;

  /// Posts a receive of at most `capacity` bytes into `buf` for a message with `tag` from this endpoint's
  /// peer.
  virtual RecvHandle post_recv(uint64_t tag, void* buf, size_t capacity) = 0;

  /// Fails every pending operation on this endpoint (FAILED with `reason`) and all future ones, and closes
  /// the connection. Use when the coordinator reports the peer dead (PeerDown). Idempotent.
  virtual void abort(const std::string& reason) = 0;

  /// True once the endpoint has failed (peer died, connection broken, abort()).
  virtual bool failed() const = 0;
  /// Why it failed (names the peer); empty while healthy.
  virtual std::string failure() const = 0;

  /// The name given to Transport::connect(), e.g. "cache rank 2 (#0) on host-b".
  virtual const std::string& peer_name() const = 0;
};

/// Factory of endpoints; one per process (or per device) and transport kind.
class Transport {
 public:
  virtual ~Transport() = default;

  /// Opaque bytes that let a peer connect to us; published to the coordinator
  /// (RegisterRequest.self.transport).
  virtual std::string local_address() const = 0;

  /// Connects to the peer whose local_address() is `peer_address`. `peer_name` is used in every error about
  /// this peer. Implementations may require the peer to call connect() towards us concurrently (UCX does: a
  /// handshake confirms both directions) and throw spade::Error naming the peer if that does not happen by
  /// `deadline`.
  virtual std::unique_ptr<Endpoint> connect(const std::string& peer_address, const std::string& peer_name,
                                            Deadline deadline) = 0;

  /// Drives progress for implementations without their own progress thread. Both current implementations make
  /// progress on their own; this is a no-op for them.
  virtual void progress() {}

  /// "loopback", "ucx".
  virtual std::string kind() const = 0;
};

}  // namespace spade::transport

// NcclLink: the GPU data plane between one inference rank and its cache rank (AsyncSpade Sec. 4.1 / 4.3).
//
// Two NCCL communicators of two ranks each join the pair: "up" carries each layer pack's q/k/v rows from the
// inference rank (NCCL rank 0) to the cache rank (rank 1), "down" the selected K/V back. Two communicators, not one,
// so that each direction has its own channel budget (maxCTAs: every NCCL channel holds an SM of *both* GPUs for the
// whole transfer, see docs/ARCHITECTURE.md "The GPU path") and its own stream, and so a pack's qkv send never queues
// behind a large KV receive.
//
// Semantics:
//   * Handshake: the inference rank calls NcclLink::new_address() and publishes the bytes as its
//     TransportAddress{kind: TRANSPORT_NCCL} at the coordinator (common/proto/coordinator.proto); the coordinator
//     forwards them verbatim to the paired cache rank in ClusterView.peers. Both sides then construct an NcclLink
//     from the same bytes, concurrently. Communicators are created non-blocking (ncclConfig_t::blocking = 0), so the
//     constructor polls them against `connect_timeout` and aborts them (ncclCommAbort) instead of hanging when the
//     peer never joins. It then connects both directions with an 8-byte hello exchange (NCCL connects point-to-point
//     channels lazily, and each connection needs the peer's matching operation), so no later send/recv waits for a
//     connection and the first decode step does not pay for it.
//   * send()/recv() are stream-ordered NCCL point-to-point operations (ncclSend/ncclRecv in one
//     ncclGroupStart/End): they return once the operation is enqueued on `stream`, never waiting for the peer. A
//     send of N bytes matches the peer's next recv of N bytes on the same direction (sizes must be equal; ops of one
//     direction match in posting order). The caller keeps `buf` alive and untouched until the op completes in stream
//     order (record an event after it). Operations on one stream run one after the other, so a receive posted on a
//     stream before a send on the same stream blocks that send until the peer's data arrives: post each direction on
//     its own stream (as both ranks do), or send before receiving.
//   * Watchdog: a thread polls ncclCommGetAsyncError on both communicators and the completion of every posted
//     operation (a CUDA event recorded after it). An operation still incomplete at its deadline (by default
//     `op_timeout` after it was posted; per operation, or none for a receive that waits for the peer's next request), or
//     an asynchronous NCCL error, aborts the link: both communicators are aborted with ncclCommAbort (which makes
//     NCCL's in-flight kernels exit, so the streams drain and the GPU stays usable), failed() turns true, failure()
//     names the peer and the operation, and the on_failure callback runs once. abort() does the same on request (the
//     coordinator reported PeerDown). After a failure send()/recv() throw spade::Error with failure(); data in
//     receive buffers of aborted operations is undefined. The pending operations, the deadline checks and the
//     failure latch are the GPU links' shared machinery (transport/gpu_link_watch.h).
//   * Threads: send/recv/abort and the accessors are thread-safe; operations of one direction reach NCCL one at a
//     time, in call order. send/recv must be called with the link's device
//     current (they check it).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/gpu_link.h"
#include "transport/gpu_link_watch.h"

namespace spade::transport {

/// Which end of the pair this process is. The inference rank is NCCL rank 0 on both communicators.
using NcclRole = PairRole;

/// "inference", "cache".
inline const char* nccl_role_name(NcclRole r) { return pair_role_name(r); }

/// GpuLinkOptions plus NCCL's channel counts.
struct NcclLinkOptions : GpuLinkOptions {
  int max_ctas_up = 1;     // NCCL channels (CTAs) of the up communicator: ~100 KB per pack needs one
  int max_ctas_down = 16;  // channels of the down communicator (MBs per pack); 0 = NCCL's default
};

/// Byte and operation counters of one link since construction.
using NcclLinkCounters = GpuLinkCounters;

class NcclLink final : public detail::WatchedGpuLink {
 public:
  /// Size of the address new_address() returns: two ncclUniqueIds (up, down) of NCCL_UNIQUE_ID_BYTES each.
  static size_t address_size();

  /// A fresh address (raw bytes, address_size() long) for one pair. Called by the inference rank before it registers
  /// with the coordinator. Starts NCCL's bootstrap root listener in this process. Throws spade::Error when NCCL
  /// cannot create an id (no usable network interface for its bootstrap).
  static std::string new_address();

  /// Joins both communicators of the pair named by `address` (from new_address(), possibly via the coordinator) as
  /// `role`. `peer_name` (e.g. "cache rank 1 (#0) on host-b") appears in every error. Blocks until both are ready.
  /// Errors (spade::Error): address of the wrong size; device out of range; NCCL init failure; peer did not join
  /// within connect_timeout (the half-made communicators are aborted).
  NcclLink(const std::string& address, NcclRole role, std::string peer_name, NcclLinkOptions opts = {});

  /// Healthy link: waits (up to op_timeout) for the posted operations, then frees the communicators locally
  /// (ncclCommAbort; ncclCommFinalize would wait for the peer's teardown). Failed link: nothing left to do. The
  /// caller's current device is kept.
  ~NcclLink() override;

  // send, recv, abort, failed, failure, on_failure, counters, in_flight, role, device, peer_name: the GpuLink
  // contract (detail::WatchedGpuLink; abort() aborts both communicators). GpuLink::kNoTimeout: only abort() (the
  // coordinator's PeerDown) or an NCCL error ends such an operation.

 private:
  struct State;
  detail::GpuLinkWatch& watch() const override;
  void connect_peer(const std::string& who, std::chrono::steady_clock::time_point deadline);
  void post(bool is_send, void* buf, size_t bytes, cudaStream_t stream, const char* what,
            std::chrono::milliseconds timeout) override;

  NcclLinkOptions opts_;
  std::unique_ptr<State> st_;
};

}  // namespace spade::transport

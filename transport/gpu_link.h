// GpuLink: the GPU data plane between one inference rank and its cache rank (AsyncSpade Sec. 4.1 / 4.3):
// stream-ordered point-to-point messages in two directions, "up" (inference -> cache: the q/k/v rows of each layer
// pack) and "down" (cache -> inference: the selected K/V). Implementations:
//   * NcclLink (transport/nccl/nccl_link.h): two GPUs, NCCL point-to-point over NVLink / PCIe / network;
//   * CudaIpcLink (transport/cuda_ipc/cuda_ipc_link.h): both ranks on one GPU (two processes, or two threads), where
//     NCCL refuses two ranks of one communicator; device-memory rings shared with CUDA IPC.
//
// Contract every implementation keeps:
//   * send(buf, bytes, stream) / recv(buf, bytes, stream) enqueue the transfer on `stream` and return without waiting
//     for the peer. The N-th send of a direction matches the peer's N-th receive of it, with the same size. The
//     caller keeps `buf` alive and untouched until the operation completes in stream order (record an event after
//     it). Post each direction on its own stream: a receive blocks its stream until the peer's data arrives.
//   * A watchdog tracks every posted operation. One still incomplete `timeout` after it was posted (default: the
//     link's op_timeout; kNoTimeout: none), or a transport error, fails the link: the transfers in flight are
//     released so the streams drain and the GPU stays usable, failed() turns true, failure() names the peer and the
//     operation, and the on_failure callback runs once. abort(reason) does the same on request (the coordinator
//     reported the peer down). After a failure send()/recv() throw spade::Error with failure(); data in receive
//     buffers of aborted operations is undefined.
//   * Thread-safe; operations of one direction reach the transport in call order. send/recv must be called with the
//     link's device current.
//
// This header needs no CUDA headers (cudaStream_t is declared below exactly as the CUDA runtime declares it), so that
// CPU-only builds can name a GpuLink, e.g. as the return type of the link factory (transport/link_factory.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

// The CUDA runtime's stream handle (driver_types.h declares the same typedef; repeating it is valid C++).
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace spade::transport {

/// Which end of the pair this process is.
enum class PairRole { kInference = 0, kCache = 1 };

/// "inference", "cache".
inline const char* pair_role_name(PairRole r) { return r == PairRole::kInference ? "inference" : "cache"; }

/// What every GPU link takes (NcclLinkOptions and CudaIpcLinkOptions extend it; so does the link factory's
/// LinkOptions, which hands this part to whichever link it makes).
struct GpuLinkOptions {
  /// CUDA device of this rank; made current on the calling thread by the link's creation.
  int device = 0;
  /// Bound on joining: the peer must join (NCCL) / open the link (CUDA IPC) within it, or creation throws.
  std::chrono::milliseconds connect_timeout{30000};
  /// Default watchdog deadline of a posted operation (send/recv with timeout 0); also bounds teardown.
  std::chrono::milliseconds op_timeout{10000};
  /// How often the link's watchdog polls (CUDA IPC: and beats).
  std::chrono::milliseconds watchdog_period{2};
};

/// Byte and operation counters of one link since construction.
struct GpuLinkCounters {
  uint64_t sends = 0, recvs = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;  // bytes enqueued (complete or in flight)
};

class GpuLink {
 public:
  /// No watchdog deadline for an operation: for a receive that waits for the peer's next request (a cache rank's
  /// pre-posted receive of the next qkv pack can wait as long as the server is idle).
  static constexpr std::chrono::milliseconds kNoTimeout = std::chrono::milliseconds::max();

  virtual ~GpuLink() = default;

  /// Enqueues a send of `bytes` bytes at device pointer `buf` on `stream` (inference: up; cache: down). `what` names
  /// the message in errors, e.g. "qkv of pack 3". `timeout`: the watchdog's deadline, counted from now; 0 = the
  /// link's op_timeout; kNoTimeout = none. Throws spade::Error if the link has failed, `bytes` is 0, `buf` is null,
  /// the current device is not the link's, or the transport refuses the operation (the link then fails).
  virtual void send(const void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds::zero()) = 0;
  /// Enqueues a receive of exactly `bytes` bytes into device pointer `buf` on `stream` (inference: down; cache: up).
  /// Same arguments and errors as send().
  virtual void recv(void* buf, size_t bytes, cudaStream_t stream, const char* what,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds::zero()) = 0;
  /// Fails the link with `reason` (see the file comment). Idempotent; the first reason wins.
  virtual void abort(const std::string& reason) = 0;
  virtual bool failed() const = 0;
  /// Why it failed, naming the peer; empty while healthy.
  virtual std::string failure() const = 0;
  /// Called once with failure() when the link fails. Set it before posting; it must not call back into this link's
  /// send/recv nor destroy the link.
  virtual void on_failure(std::function<void(const std::string&)> callback) = 0;
  virtual GpuLinkCounters counters() const = 0;
  /// Operations posted and not yet seen complete by the watchdog.
  virtual size_t in_flight() const = 0;
  virtual PairRole role() const = 0;
  virtual int device() const = 0;
  virtual const std::string& peer_name() const = 0;
};

}  // namespace spade::transport

// CudaIpcLink: the GPU data plane of an inference rank and its cache rank on one host, behind the GpuLink contract
// (transport/gpu_link.h). On ONE GPU it is the only link: NCCL refuses two ranks of one communicator on the same
// device. On two GPUs with peer access (NVLink) the opener's copies to and from the creator's rings cross the link on
// the copy engines, so no SM of either GPU moves the bytes, where NCCL's channels each hold an SM of both GPUs.
//
// Design. The inference rank (the creator) allocates, on its GPU, a ring of `ring_slots` chunks of `chunk_bytes`
// per direction, and a 4 KiB header of 32-bit counters in POSIX shared host memory (shm_open), registered for device
// access (cudaHostRegister, mapped). The address it publishes (address(), TRANSPORT_CUDA_IPC at the coordinator)
// carries the ring's cudaIpcGetMemHandle, the header's shm name and a random link id. The cache rank (the opener)
// maps both; an opener in the same process (two threads; CUDA refuses to open its own process's handle) shares the
// creator's mapping, found by the link id (from another GPU after enabling peer access to the creator's). Both processes must share /dev/shm (one host, one IPC namespace).
// A message of N bytes travels as ceil(N / chunk_bytes) chunks. For chunk q of a direction:
//   sender stream:    wait  consumed >= q + 1 - ring_slots   (its ring slot is free again)
//                     copy  buf[chunk] -> ring[q % ring_slots]
//                     write posted = q + 1
//   receiver stream:  wait  posted >= q + 1
//                     copy  ring[q % ring_slots] -> buf[chunk]
//                     write consumed = q + 1
// The waits and writes are CUDA stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32, the driver's
// semaphore acquire / release: no SM is held while waiting, and the write is fenced after the copy), so both sides
// stay stream-ordered with no host synchronisation, as with NCCL. The comparisons are cyclic (32-bit counters wrap).
// IPC events (cudaIpcGetEventHandle) would not do: cudaStreamWaitEvent waits for the record that precedes it on the
// HOST, which would need a host round trip per message.
//
// Failure. A watchdog thread per end tracks every posted operation (a deadline from the moment it is posted, even
// while its chunks are still being enqueued), beats a heartbeat in the header and watches the peer's. A deadline
// missed, a CUDA error, the peer's abort word, the peer's silence for heartbeat_timeout, or abort() fail the link: it
// sets the abort word (the peer's end fails too) and then stores, from the host, every counter far ahead of any value
// a stream waits for, so the blocked copies run (on garbage) and both processes' streams drain; failure() names the
// peer and the operation and on_failure runs once. failed() also reads the abort word synchronously: it is written
// before any release, so a receive that completed on spoiled data is never seen as healthy. The creator owns the
// ring and frees it only after the opener unmapped it (or stopped beating); a cache rank that dies leaves the
// inference rank's memory intact. The pending operations, the deadline checks and the failure latch are the GPU
// links' shared machinery (transport/gpu_link_watch.h); the heartbeat, the abort word and the release are this link's.
//
// Both ends in ONE process: their streams wait on each other through stream memory operations, which CUDA's
// scheduler does not see, so two streams sharing a hardware queue could block each other (cuda.h's warning on
// cuStreamWaitValue32). Set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (bench_tpot and the tests do) and keep
// the process's streams fewer than that. Also set CUDA_MODULE_LOADING=EAGER: with lazy loading (CUDA's default) the
// first launch of a kernel may synchronise the context, i.e. wait for the other end's pending receive, whose data
// this very thread was about to send. Two processes have separate queues and contexts.
//
// Cost: every byte is copied twice (into the ring and out of it), a copy-engine copy each. On one GPU both ranks
// share the HBM anyway; on two GPUs one copy crosses NVLink and the other stays on the creator's (inference) GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "transport/gpu_link.h"
#include "transport/gpu_link_watch.h"

namespace spade::transport {

/// GpuLinkOptions plus the rings' geometry and the peer's heartbeat deadline.
struct CudaIpcLinkOptions : GpuLinkOptions {
  size_t chunk_bytes = size_t{4} << 20;  // ring chunk (creator only; the opener takes the creator's), multiple of 256
  int ring_slots = 8;                    // chunks per direction's ring (creator only), >= 1
  std::chrono::milliseconds heartbeat_timeout{1000};  // no heartbeat from the connected peer this long: fail
};

class CudaIpcLink final : public detail::WatchedGpuLink {
 public:
  /// The inference rank's end: allocates and exports the link's memory on opts.device. Returns at once; publish
  /// address(), then connect(). Errors (spade::Error naming `peer_name`): device out of range, allocation failure,
  /// bad options, stream memory operations unavailable on the device.
  static std::unique_ptr<CudaIpcLink> create(std::string peer_name, CudaIpcLinkOptions opts = {});
  /// The cache rank's end: maps the memory named by `address` (from the creator's address()) and tells the creator.
  /// Errors: malformed address (size, magic, version), a handle the creator could not export, cudaIpcOpenMemHandle
  /// failure (e.g. another node, or another container without the GPU), device out of range.
  static std::unique_ptr<CudaIpcLink> open(const std::string& address, std::string peer_name,
                                           CudaIpcLinkOptions opts = {});

  /// Waits until the peer has opened the link (creator), up to `timeout` (0: the options' connect_timeout); throws
  /// spade::Error naming the peer otherwise ("... the peer did not open the link within T ms ..."), or with
  /// failure() if the link failed meanwhile. The opener returns at once.
  void connect(std::chrono::milliseconds timeout = std::chrono::milliseconds::zero());
  /// Raw bytes to publish at the coordinator (creator; the opener returns the address it opened).
  const std::string& address() const;

  ~CudaIpcLink() override;

  // send, recv, on_failure, counters, in_flight, role, device, peer_name: the GpuLink contract
  // (detail::WatchedGpuLink). These three also read or release the shared header:
  /// Fails the link with `reason`, the link's device current for the release. Idempotent; the first reason wins.
  void abort(const std::string& reason) override;
  /// True once the link failed, or the peer's abort word is set (read synchronously, see the file comment).
  bool failed() const override;
  /// Why it failed (or what the peer's abort word says), naming the peer; empty while healthy.
  std::string failure() const override;

 private:
  struct State;
  CudaIpcLink(PairRole role, std::string peer_name, CudaIpcLinkOptions opts);
  detail::GpuLinkWatch& watch() const override;
  void post(bool is_send, void* buf, size_t bytes, cudaStream_t stream, const char* what,
            std::chrono::milliseconds timeout) override;

  CudaIpcLinkOptions opts_;
  std::unique_ptr<State> st_;
};

}  // namespace spade::transport

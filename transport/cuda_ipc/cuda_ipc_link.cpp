// CudaIpcLink (see cuda_ipc_link.h): device-memory rings shared with CUDA IPC, ordered by stream memory operations.
#include "transport/cuda_ipc/cuda_ipc_link.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/error.h"

namespace spade::transport {

namespace {

using Clock = std::chrono::steady_clock;

long long ms(std::chrono::milliseconds d) { return static_cast<long long>(d.count()); }

// ---- the shared memory's layout ----
constexpr size_t kHeaderBytes = 4096;
constexpr size_t posted_off(int d) { return 128 * static_cast<size_t>(d); }        // chunks the sender posted
constexpr size_t consumed_off(int d) { return 128 * static_cast<size_t>(d) + 64; }  // chunks the receiver drained
constexpr size_t kHelloOff = 256;   // opener's pid once it mapped the memory (0 before)
constexpr size_t kAbortOff = 320;   // 0 healthy, 1 a side failed the link, 2 the creator is closing it
constexpr size_t kClosedOff = 384;  // 1 once the opener unmapped (the creator may free then)
constexpr uint32_t kAborted = 1, kClosing = 2;
// A released counter: this far ahead of the last chunk a side posted, every wait still queued on it is satisfied
// (cyclic comparison) while the two sides' counts differ by less than 2^30 chunks.
constexpr uint32_t kReleaseAhead = 1u << 30;

// ---- the address ----
constexpr char kMagic[8] = {'S', 'P', 'D', 'I', 'P', 'C', '0', '1'};
constexpr uint32_t kVersion = 1;
struct AddressWire {
  char magic[8];
  uint32_t version;
  int32_t pid;           // creator's process
  uint64_t ptr;          // the memory's device pointer in the creator's process
  uint64_t total_bytes;
  uint64_t chunk_bytes;
  uint32_t ring_slots;
  uint32_t handle_ok;    // 0: cudaIpcGetMemHandle failed in the creator (only a same-process opener can join)
  char bus_id[32];       // creator's device, PCI bus id
  cudaIpcMemHandle_t handle;
};
static_assert(std::is_trivially_copyable_v<AddressWire>, "AddressWire travels as raw bytes");

// ---- stream memory operations (driver API, resolved through the runtime: no link dependency on libcuda) ----
struct MemOps {
  PFN_cuStreamWaitValue32_v11070 wait = nullptr;
  PFN_cuStreamWriteValue32_v11070 write = nullptr;
  std::string error;
};

const MemOps& mem_ops() {
  static const MemOps ops = [] {
    MemOps o;
    void* fn[2] = {nullptr, nullptr};
    const char* names[2] = {"cuStreamWaitValue32", "cuStreamWriteValue32"};
    for (int i = 0; i < 2; ++i) {
      cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t e = cudaGetDriverEntryPointByVersion(names[i], &fn[i], 12000, cudaEnableDefault, &q);
      if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn[i] == nullptr) {
        o.error = fmt::format("the CUDA driver has no {} ({})", names[i], cudaGetErrorString(e));
        return o;
      }
    }
    o.wait = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn[0]);
    o.write = reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(fn[1]);
    return o;
  }();
  return ops;
}

std::string cu_msg(CUresult r) { return fmt::format("CUresult {}", static_cast<int>(r)); }

std::string bus_id(int device) {
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess) return "?";
  return id;
}

bool process_alive(int32_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno != ESRCH); }

// One posted operation the watchdog tracks until its completion event fires.
struct Pending {
  cudaEvent_t done = nullptr;
  Clock::time_point deadline;  // time_point::max(): none (GpuLink::kNoTimeout)
  long long timeout_ms = 0;
  std::string what;
};

// What a failure leaves to do outside the state lock: release the streams, log, run the callback.
struct Failure {
  bool first = false;
  std::string reason;
  std::vector<cudaEvent_t> events;
  std::function<void(const std::string&)> callback;
};

}  // namespace

struct CudaIpcLink::State {
  std::string address;
  char* base = nullptr;      // the link's memory: own allocation (creator) or mapping (opener)
  bool owner = false;        // creator: frees it at teardown
  bool mapped = false;       // opener in another process: cudaIpcCloseMemHandle at teardown
  size_t chunk_bytes = 0;
  int slots = 0;
  std::string who;           // "CUDA IPC link (inference side) to cache rank 1"

  // Header access from the host (hello, abort word, releases): one stream and one pinned word, under ctl_mu.
  std::mutex ctl_mu;
  cudaStream_t ctl = nullptr;
  uint32_t* host_word = nullptr;

  std::mutex enqueue[2];                 // per direction, held while a message's chunks are enqueued
  std::atomic<uint64_t> seq[2] = {0, 0};  // chunks this end posted on direction d (as its sender or receiver)

  mutable std::mutex mu;  // everything below
  std::deque<Pending> pending;
  std::vector<cudaEvent_t> free_events;
  bool failed = false;
  std::string failure;
  std::function<void(const std::string&)> on_failure;
  GpuLinkCounters counters;
  std::thread watchdog;
  std::condition_variable stop_cv;
  bool stop = false;

  // Marks the link failed (mu held) and hands the pending operations to the returned Failure.
  Failure fail_locked(const std::string& reason) {
    Failure f;
    if (failed) return f;
    failed = true;
    failure = reason;
    f.first = true;
    f.reason = reason;
    for (auto& p : pending) f.events.push_back(p.done);
    pending.clear();
    f.callback = on_failure;
    return f;
  }
  uint32_t read_word(size_t off) {
    std::lock_guard lk(ctl_mu);
    *host_word = 0;
    if (cudaMemcpyAsync(host_word, base + off, 4, cudaMemcpyDeviceToHost, ctl) != cudaSuccess ||
        cudaStreamSynchronize(ctl) != cudaSuccess)
      return 0;
    return *host_word;
  }
  cudaError_t write_word(size_t off, uint32_t v) {
    std::lock_guard lk(ctl_mu);
    *host_word = v;
    const cudaError_t e = cudaMemcpyAsync(base + off, host_word, 4, cudaMemcpyHostToDevice, ctl);
    return e != cudaSuccess ? e : cudaStreamSynchronize(ctl);
  }
  // Sets the abort word and moves every counter far ahead of the chunks this end posted, so every wait queued on
  // either side is satisfied.
  void release(uint32_t abort_word) {
    std::lock_guard lk(ctl_mu);
    const MemOps& ops = mem_ops();
    if (ops.write == nullptr) return;
    CUstream s = reinterpret_cast<CUstream>(ctl);
    ops.write(s, reinterpret_cast<CUdeviceptr>(base + kAbortOff), abort_word, CU_STREAM_WRITE_VALUE_DEFAULT);
    for (int d = 0; d < 2; ++d) {
      const uint32_t v = static_cast<uint32_t>(seq[d].load()) + kReleaseAhead;
      ops.write(s, reinterpret_cast<CUdeviceptr>(base + posted_off(d)), v, CU_STREAM_WRITE_VALUE_DEFAULT);
      ops.write(s, reinterpret_cast<CUdeviceptr>(base + consumed_off(d)), v, CU_STREAM_WRITE_VALUE_DEFAULT);
    }
    cudaStreamSynchronize(ctl);
  }
  // Releases until every event has completed (the peer may still overwrite a counter with an older value from an
  // operation it had queued) or `limit` passes; then destroys the events.
  void release_until_drained(std::vector<cudaEvent_t>& events, uint32_t abort_word, std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    for (;;) {
      release(abort_word);
      bool done = true;
      for (auto e : events) done = done && cudaEventQuery(e) != cudaErrorNotReady;
      if (done) break;
      if (Clock::now() > deadline) {
        spdlog::warn("{}: {} operation(s) still blocked {} ms after the link was released", who, events.size(),
                     ms(limit));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (auto e : events) cudaEventDestroy(e);
    events.clear();
  }
};

CudaIpcLink::CudaIpcLink(PairRole role, std::string peer_name, CudaIpcLinkOptions opts)
    : role_(role), peer_name_(std::move(peer_name)), opts_(opts), st_(std::make_unique<State>()) {
  st_->who = fmt::format("CUDA IPC link ({} side) to {}", pair_role_name(role_), peer_name_);
  const std::string& who = st_->who;
  SPADE_CHECK(opts_.op_timeout.count() > 0 && opts_.connect_timeout.count() > 0 && opts_.watchdog_period.count() > 0,
              "{}: timeouts must be positive", who);
  const MemOps& ops = mem_ops();
  SPADE_CHECK(ops.error.empty(), "{}: {} (stream memory operations are needed)", who, ops.error);
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaGetDeviceCount: {}", who, cudaGetErrorString(e));
  SPADE_CHECK(opts_.device >= 0 && opts_.device < ndev, "{}: device {} out of range ({} CUDA devices)", who,
              opts_.device, ndev);
  e = cudaSetDevice(opts_.device);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaSetDevice({}): {}", who, opts_.device, cudaGetErrorString(e));
  e = cudaStreamCreateWithFlags(&st_->ctl, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMallocHost(reinterpret_cast<void**>(&st_->host_word), 4);
  SPADE_CHECK(e == cudaSuccess, "{}: control stream / pinned word: {}", who, cudaGetErrorString(e));
}

std::unique_ptr<CudaIpcLink> CudaIpcLink::create(std::string peer_name, CudaIpcLinkOptions opts) {
  std::unique_ptr<CudaIpcLink> l(new CudaIpcLink(PairRole::kInference, std::move(peer_name), opts));
  State& st = *l->st_;
  SPADE_CHECK(opts.chunk_bytes >= 256 && opts.chunk_bytes % 256 == 0 && opts.ring_slots >= 1,
              "{}: chunk_bytes {} must be a positive multiple of 256 and ring_slots {} >= 1", st.who,
              opts.chunk_bytes, opts.ring_slots);
  st.chunk_bytes = opts.chunk_bytes;
  st.slots = opts.ring_slots;
  const size_t total = kHeaderBytes + 2 * static_cast<size_t>(st.slots) * st.chunk_bytes;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&st.base), total);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaMalloc of {} bytes on device {}: {}", st.who, total, opts.device,
              cudaGetErrorString(e));
  st.owner = true;
  e = cudaMemset(st.base, 0, kHeaderBytes);
  SPADE_CHECK(e == cudaSuccess, "{}: header init: {}", st.who, cudaGetErrorString(e));
  AddressWire a{};
  std::memcpy(a.magic, kMagic, sizeof(kMagic));
  a.version = kVersion;
  a.pid = static_cast<int32_t>(::getpid());
  a.ptr = reinterpret_cast<uint64_t>(st.base);
  a.total_bytes = total;
  a.chunk_bytes = st.chunk_bytes;
  a.ring_slots = static_cast<uint32_t>(st.slots);
  const std::string bus = bus_id(opts.device);
  std::snprintf(a.bus_id, sizeof(a.bus_id), "%s", bus.c_str());
  e = cudaIpcGetMemHandle(&a.handle, st.base);
  a.handle_ok = e == cudaSuccess ? 1 : 0;
  if (e != cudaSuccess) {
    cudaGetLastError();
    spdlog::warn("{}: cudaIpcGetMemHandle: {}; only a peer in this process can open the link", st.who,
                 cudaGetErrorString(e));
  }
  st.address.assign(reinterpret_cast<const char*>(&a), sizeof(a));
  l->start_watchdog();
  return l;
}

std::unique_ptr<CudaIpcLink> CudaIpcLink::open(const std::string& address, std::string peer_name,
                                               CudaIpcLinkOptions opts) {
  std::unique_ptr<CudaIpcLink> l(new CudaIpcLink(PairRole::kCache, std::move(peer_name), opts));
  State& st = *l->st_;
  SPADE_CHECK(address.size() == sizeof(AddressWire), "{}: address is {} bytes, expected {}", st.who, address.size(),
              sizeof(AddressWire));
  AddressWire a{};
  std::memcpy(&a, address.data(), sizeof(a));
  SPADE_CHECK(std::memcmp(a.magic, kMagic, sizeof(kMagic)) == 0 && a.version == kVersion,
              "{}: not a CUDA IPC link address (magic / version {})", st.who, a.version);
  SPADE_CHECK(a.chunk_bytes >= 256 && a.chunk_bytes % 256 == 0 && a.ring_slots >= 1 &&
                  a.total_bytes == kHeaderBytes + 2 * static_cast<uint64_t>(a.ring_slots) * a.chunk_bytes,
              "{}: inconsistent address (chunk {} bytes, {} slots, {} bytes in all)", st.who, a.chunk_bytes,
              a.ring_slots, a.total_bytes);
  st.chunk_bytes = a.chunk_bytes;
  st.slots = static_cast<int>(a.ring_slots);
  a.bus_id[sizeof(a.bus_id) - 1] = '\0';
  if (a.pid == static_cast<int32_t>(::getpid())) {
    st.base = reinterpret_cast<char*>(a.ptr);  // same process: CUDA cannot open its own handle
  } else {
    SPADE_CHECK(a.handle_ok == 1, "{}: the creator (pid {}) could not export its memory (cudaIpcGetMemHandle failed)",
                st.who, a.pid);
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, a.handle, cudaIpcMemLazyEnablePeerAccess);
    SPADE_CHECK(e == cudaSuccess, "{}: cudaIpcOpenMemHandle of the creator's memory (pid {}, GPU {}) on device {} "
                "(GPU {}): {}", st.who, a.pid, a.bus_id, opts.device, bus_id(opts.device), cudaGetErrorString(e));
    st.base = static_cast<char*>(p);
    st.mapped = true;
  }
  st.address = address;
  const cudaError_t e = st.write_word(kHelloOff, static_cast<uint32_t>(::getpid()));
  SPADE_CHECK(e == cudaSuccess, "{}: hello: {}", st.who, cudaGetErrorString(e));
  l->start_watchdog();
  return l;
}

void CudaIpcLink::connect() {
  if (role_ != PairRole::kInference) return;
  const auto deadline = Clock::now() + opts_.connect_timeout;
  while (st_->read_word(kHelloOff) == 0) {
    SPADE_CHECK(!failed(), "{}", failure());
    if (Clock::now() > deadline)
      fail("{}: the peer did not open the link within {} ms (device {})", st_->who, ms(opts_.connect_timeout),
           opts_.device);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  spdlog::info("{}: connected on device {} ({} x {} KiB ring per direction)", st_->who, opts_.device, st_->slots,
               st_->chunk_bytes >> 10);
}

const std::string& CudaIpcLink::address() const { return st_->address; }

void CudaIpcLink::start_watchdog() {
  st_->watchdog = std::thread([this] {
    cudaSetDevice(opts_.device);
    State& st = *st_;
    std::unique_lock lk(st.mu);
    while (!st.stop && !st.failed) {
      std::string reason;
      lk.unlock();
      const uint32_t word = st.read_word(kAbortOff);
      lk.lock();
      if (st.stop || st.failed) break;
      if (word == kAborted)
        reason = fmt::format("{}: the peer failed the link", st.who);
      else if (word == kClosing && role_ == PairRole::kCache)
        reason = fmt::format("{}: the peer closed the link", st.who);
      const auto now = Clock::now();
      for (auto it = st.pending.begin(); reason.empty() && it != st.pending.end();) {
        const cudaError_t e = cudaEventQuery(it->done);
        if (e == cudaSuccess) {
          st.free_events.push_back(it->done);
          it = st.pending.erase(it);
        } else if (e != cudaErrorNotReady) {
          reason = fmt::format("{}: {} failed on device {}: {}; link released", st.who, it->what, opts_.device,
                               cudaGetErrorString(e));
        } else if (now > it->deadline) {
          reason = fmt::format("{}: {} not complete {} ms after it was posted (peer dead or stalled); link released",
                               st.who, it->what, it->timeout_ms);
        } else {
          ++it;
        }
      }
      if (!reason.empty()) {
        Failure f = st.fail_locked(reason);
        lk.unlock();
        st.release_until_drained(f.events, kAborted, opts_.op_timeout);
        spdlog::error("{}", f.reason);
        if (f.callback) f.callback(f.reason);
        return;
      }
      st.stop_cv.wait_for(lk, opts_.watchdog_period, [&] { return st.stop; });
    }
  });
}

CudaIpcLink::~CudaIpcLink() {
  State& st = *st_;
  {
    std::lock_guard lk(st.mu);
    st.stop = true;
  }
  st.stop_cv.notify_all();
  if (st.watchdog.joinable()) st.watchdog.join();
  int caller_device = -1;
  cudaGetDevice(&caller_device);
  cudaSetDevice(opts_.device);
  {
    std::vector<cudaEvent_t> events;
    bool was_failed = false;
    {
      std::lock_guard lk(st.mu);
      was_failed = st.failed;
      for (auto& p : st.pending) events.push_back(p.done);
      st.pending.clear();
    }
    if (!was_failed && st.base != nullptr) {
      // Let the posted operations finish (up to op_timeout), then release whatever is still blocked.
      const auto deadline = Clock::now() + opts_.op_timeout;
      for (auto e : events)
        while (cudaEventQuery(e) == cudaErrorNotReady && Clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::microseconds(200));
      bool drained = true;
      for (auto e : events) drained = drained && cudaEventQuery(e) != cudaErrorNotReady;
      if (!drained) spdlog::warn("{}: operations still in flight after {} ms at teardown", st.who, ms(opts_.op_timeout));
      if (role_ == PairRole::kInference) {
        st.release_until_drained(events, kClosing, opts_.op_timeout);  // the opener sees "closing" and fails its end
      } else if (!drained) {
        st.release_until_drained(events, kAborted, opts_.op_timeout);
      }
    }
    for (auto e : events) cudaEventDestroy(e);
  }
  if (role_ == PairRole::kCache && st.base != nullptr) {
    st.write_word(kClosedOff, 1);
    if (st.mapped) cudaIpcCloseMemHandle(st.base);
  }
  if (st.owner && st.base != nullptr) {
    // The opener may still have the memory mapped: wait (up to op_timeout) until it unmapped or its process is gone.
    const int32_t opener = static_cast<int32_t>(st.read_word(kHelloOff));
    const auto deadline = Clock::now() + opts_.op_timeout;
    while (opener != 0 && st.read_word(kClosedOff) == 0 && Clock::now() < deadline &&
           (opener == static_cast<int32_t>(::getpid()) || process_alive(opener)))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    cudaFree(st.base);
  }
  for (auto e : st.free_events) cudaEventDestroy(e);
  if (st.ctl != nullptr) cudaStreamDestroy(st.ctl);
  if (st.host_word != nullptr) cudaFreeHost(st.host_word);
  if (caller_device >= 0) cudaSetDevice(caller_device);
}

void CudaIpcLink::post(bool is_send, void* buf, size_t bytes, cudaStream_t stream, const char* what,
                       std::chrono::milliseconds timeout) {
  State& st = *st_;
  const int d = (role_ == PairRole::kInference) == is_send ? 0 : 1;  // 0 = up (inference -> cache)
  const std::string desc = fmt::format("{} of {} bytes ({})", is_send ? "send" : "receive", bytes,
                                       what != nullptr ? what : "unnamed");
  SPADE_CHECK(buf != nullptr && bytes > 0, "{}: {}: null buffer or zero bytes", st.who, desc);
  int cur = -1;
  cudaGetDevice(&cur);
  SPADE_CHECK(cur == opts_.device, "{}: {}: current device is {}, the link's is {}", st.who, desc, cur, opts_.device);
  SPADE_CHECK(timeout.count() >= 0, "{}: {}: negative timeout", st.who, desc);
  const bool no_timeout = timeout == kNoTimeout;
  if (timeout.count() == 0) timeout = opts_.op_timeout;
  const MemOps& ops = mem_ops();
  CUstream s = reinterpret_cast<CUstream>(stream);
  const CUdeviceptr posted = reinterpret_cast<CUdeviceptr>(st.base + posted_off(d));
  const CUdeviceptr consumed = reinterpret_cast<CUdeviceptr>(st.base + consumed_off(d));
  char* ring = st.base + kHeaderBytes + static_cast<size_t>(d) * st.slots * st.chunk_bytes;

  std::lock_guard enqueue(st.enqueue[d]);
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard lk(st.mu);
    if (st.failed) fail("{} (refused {})", st.failure, desc);
    if (!st.free_events.empty()) {
      ev = st.free_events.back();
      st.free_events.pop_back();
    }
  }
  std::string reason;
  if (ev == nullptr) {
    const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    SPADE_CHECK(e == cudaSuccess, "{}: {}: cudaEventCreate: {}", st.who, desc, cudaGetErrorString(e));
  }
  char* p = static_cast<char*>(buf);
  for (size_t off = 0; off < bytes && reason.empty(); off += st.chunk_bytes) {
    const uint64_t q = st.seq[d].load();
    const size_t len = std::min(st.chunk_bytes, bytes - off);
    char* slot = ring + static_cast<size_t>(q % static_cast<uint64_t>(st.slots)) * st.chunk_bytes;
    const uint32_t next = static_cast<uint32_t>(q + 1);
    CUresult r = CUDA_SUCCESS;
    cudaError_t ce = cudaSuccess;
    if (is_send) {
      if (q >= static_cast<uint64_t>(st.slots))
        r = ops.wait(s, consumed, static_cast<uint32_t>(q + 1 - st.slots), CU_STREAM_WAIT_VALUE_GEQ);
      if (r == CUDA_SUCCESS) ce = cudaMemcpyAsync(slot, p + off, len, cudaMemcpyDeviceToDevice, stream);
      if (r == CUDA_SUCCESS && ce == cudaSuccess) r = ops.write(s, posted, next, CU_STREAM_WRITE_VALUE_DEFAULT);
    } else {
      r = ops.wait(s, posted, next, CU_STREAM_WAIT_VALUE_GEQ);
      if (r == CUDA_SUCCESS) ce = cudaMemcpyAsync(p + off, slot, len, cudaMemcpyDeviceToDevice, stream);
      if (r == CUDA_SUCCESS && ce == cudaSuccess) r = ops.write(s, consumed, next, CU_STREAM_WRITE_VALUE_DEFAULT);
    }
    st.seq[d].store(q + 1);
    if (r != CUDA_SUCCESS || ce != cudaSuccess)
      reason = fmt::format("{}: {}: enqueuing chunk {} failed: {}; link released", st.who, desc, q,
                           r != CUDA_SUCCESS ? cu_msg(r) : cudaGetErrorString(ce));
  }
  if (reason.empty()) {
    const cudaError_t e = cudaEventRecord(ev, stream);
    if (e != cudaSuccess) reason = fmt::format("{}: {}: cudaEventRecord: {}", st.who, desc, cudaGetErrorString(e));
  }
  Failure f;
  {
    std::lock_guard lk(st.mu);
    if (reason.empty() && !st.failed) {
      const auto now = Clock::now();
      st.pending.push_back(Pending{ev, no_timeout ? Clock::time_point::max() : now + timeout,
                                   no_timeout ? -1 : static_cast<long long>(timeout.count()), desc});
      if (is_send) {
        ++st.counters.sends;
        st.counters.bytes_sent += bytes;
      } else {
        ++st.counters.recvs;
        st.counters.bytes_received += bytes;
      }
      return;
    }
    if (reason.empty()) reason = fmt::format("{} (while enqueuing {})", st.failure, desc);
    f = st.fail_locked(reason);
  }
  // Failed (here, or concurrently while this operation was enqueued): release it with the rest.
  f.events.push_back(ev);
  st.release_until_drained(f.events, kAborted, opts_.op_timeout);
  if (f.first) {
    spdlog::error("{}", f.reason);
    if (f.callback) f.callback(f.reason);
  }
  throw Error(reason);
}

void CudaIpcLink::send(const void* buf, size_t bytes, cudaStream_t stream, const char* what,
                       std::chrono::milliseconds timeout) {
  post(true, const_cast<void*>(buf), bytes, stream, what, timeout);
}

void CudaIpcLink::recv(void* buf, size_t bytes, cudaStream_t stream, const char* what,
                       std::chrono::milliseconds timeout) {
  post(false, buf, bytes, stream, what, timeout);
}

void CudaIpcLink::abort(const std::string& reason) {
  Failure f;
  {
    std::lock_guard lk(st_->mu);
    f = st_->fail_locked(fmt::format("{}: aborted: {}", st_->who, reason));
  }
  st_->stop_cv.notify_all();
  if (!f.first) return;
  st_->release_until_drained(f.events, kAborted, opts_.op_timeout);
  spdlog::error("{}", f.reason);
  if (f.callback) f.callback(f.reason);
}

bool CudaIpcLink::failed() const {
  std::lock_guard lk(st_->mu);
  return st_->failed;
}

std::string CudaIpcLink::failure() const {
  std::lock_guard lk(st_->mu);
  return st_->failure;
}

void CudaIpcLink::on_failure(std::function<void(const std::string&)> callback) {
  std::lock_guard lk(st_->mu);
  st_->on_failure = std::move(callback);
}

GpuLinkCounters CudaIpcLink::counters() const {
  std::lock_guard lk(st_->mu);
  return st_->counters;
}

size_t CudaIpcLink::in_flight() const {
  std::lock_guard lk(st_->mu);
  return st_->pending.size();
}

}  // namespace spade::transport

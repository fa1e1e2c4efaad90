// CudaIpcLink (see cuda_ipc_link.h): device-memory rings shared with CUDA IPC, ordered by stream memory operations on
// counters that live in POSIX shared host memory.
#include "transport/cuda_ipc/cuda_ipc_link.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/error.h"

namespace spade::transport {

namespace {

using Clock = std::chrono::steady_clock;

long long ms(std::chrono::milliseconds d) { return static_cast<long long>(d.count()); }

// ---- the shared header (host memory, both processes; the counters are also device-mapped) ----
constexpr size_t kHeaderBytes = 4096;
struct Header {
  uint32_t posted[2][16];    // [direction][0]: chunks the sender posted (written by its stream); 64-byte lines
  uint32_t consumed[2][16];  // [direction][0]: chunks the receiver drained (written by its stream)
  uint32_t hello;            // 1 once the opener mapped everything
  uint32_t abort;            // 0 healthy, kAborted a side failed the link, kClosing the creator is closing it
  uint32_t closed;           // 1 once the opener unmapped (the creator may free the ring then)
  uint32_t pad;
  uint64_t heartbeat[2];     // [role]: advanced by that side's watchdog every period
};
static_assert(sizeof(Header) <= kHeaderBytes, "header fits its page");
constexpr uint32_t kAborted = 1, kClosing = 2;
// A released counter: this far ahead of the last chunk a side posted, every wait still queued on it is satisfied
// (cyclic comparison) while the two sides' counts differ by less than 2^30 chunks.
constexpr uint32_t kReleaseAhead = 1u << 30;

template <typename T>
T load(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void store(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

// ---- the address ----
constexpr char kMagic[8] = {'S', 'P', 'D', 'I', 'P', 'C', '0', '2'};
constexpr uint32_t kVersion = 2;
struct AddressWire {
  char magic[8];
  uint32_t version;
  uint32_t ring_slots;
  uint64_t link_id;      // random; a same-process opener finds the creator's mapping by it (pids can collide
                         // across PID namespaces)
  uint64_t total_bytes;  // ring bytes, both directions
  uint64_t chunk_bytes;
  uint32_t handle_ok;    // 0: cudaIpcGetMemHandle failed in the creator (only a same-process opener can join)
  uint32_t pad;
  char shm_name[64];     // POSIX shared memory object of the header
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
        o.error = fmt::format("the CUDA driver has no {} ({}, query result {})", names[i], cudaGetErrorString(e),
                              static_cast<int>(q));
        return o;
      }
    }
    o.wait = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn[0]);
    o.write = reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(fn[1]);
    return o;
  }();
  return ops;
}

std::string bus_id(int device) {
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess) return "?";
  return id;
}

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count());
}

struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev);
    cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

// One posted operation the watchdog tracks. `recorded` is false while post() is still enqueuing its chunks (the
// deadline runs already; the event is not recorded yet and belongs to post()).
struct Pending {
  uint64_t id = 0;
  cudaEvent_t done = nullptr;
  bool recorded = false;
  Clock::time_point deadline;  // time_point::max(): none (GpuLink::kNoTimeout)
  long long timeout_ms = 0;
  std::string what;
};

// What a failure leaves to do outside the locks: release the streams, log, run the callback.
struct Failure {
  bool first = false;
  std::string reason;
  std::vector<cudaEvent_t> events;  // recorded events of the pending operations (destroyed once drained)
  std::function<void(const std::string&)> callback;
  bool quiet = false;  // the peer closed the link with nothing in flight: an orderly end, logged as info
};

// The memory of one link in this process: the mapped header and the device ring. Shared by the two ends when both
// are in this process (the last one frees).
struct Mapping {
  bool creator = false;
  int device = 0;
  std::string shm_name;
  Header* h = nullptr;       // host view of the header
  bool registered = false;   // cudaHostRegister'ed (device-mapped)
  Header* dh = nullptr;      // device view of the header
  char* ring = nullptr;      // the rings: [direction][slot][chunk]
  bool ring_owned = false;   // cudaMalloc'ed here (creator)
  bool ring_mapped = false;  // cudaIpcOpenMemHandle'd here (opener in another process)
  std::chrono::milliseconds wait_unmap{0};  // creator: how long to wait for the opener to unmap
  std::chrono::milliseconds heartbeat_timeout{0};
  bool ring_drained = true;  // false: an operation may still reference the ring (never free it then)
  int ends = 0;              // ends of this process using it

  ~Mapping() {
    DeviceGuard g(device);
    if (ring != nullptr && ring_mapped) {
      cudaIpcCloseMemHandle(ring);
      if (h != nullptr) store(&h->closed, 1u);
    }
    if (ring != nullptr && ring_owned) {
      // The opener (another process) may still map the ring: wait until it unmapped, or stopped beating.
      bool can_free = ring_drained;
      if (h != nullptr && load(&h->hello) != 0 && can_free) {
        const auto deadline = Clock::now() + wait_unmap;
        uint64_t beat = load(&h->heartbeat[1]);
        auto beat_seen = Clock::now();
        while (load(&h->closed) == 0) {
          const uint64_t b = load(&h->heartbeat[1]);
          if (b != beat) {
            beat = b;
            beat_seen = Clock::now();
          } else if (Clock::now() - beat_seen > heartbeat_timeout) {
            break;  // the opener is gone
          }
          if (Clock::now() > deadline) {
            can_free = false;
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      if (can_free) {
        cudaFree(ring);
      } else {
        spdlog::warn("CUDA IPC link {}: ring memory left allocated (the peer may still map it, or an operation may "
                     "still reference it)", shm_name);
      }
    }
    if (registered && h != nullptr) cudaHostUnregister(h);
    if (h != nullptr) munmap(h, kHeaderBytes);
    if (creator && !shm_name.empty()) shm_unlink(shm_name.c_str());  // no-op if connect() unlinked it already
  }
};

// Same-process openers find the creator's Mapping here (CUDA cannot open a handle of its own process).
std::mutex& registry_mu() {
  static std::mutex m;
  return m;
}
std::map<uint64_t, std::weak_ptr<Mapping>>& registry() {
  static std::map<uint64_t, std::weak_ptr<Mapping>> r;
  return r;
}

Header* map_header(const std::string& name, bool create, const std::string& who) {
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  SPADE_CHECK(fd >= 0, "{}: shm_open({}) failed: {} (both ranks must share /dev/shm)", who, name, std::strerror(errno));
  if (create && ftruncate(fd, kHeaderBytes) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    fail("{}: ftruncate of {}: {}", who, name, std::strerror(err));
  }
  void* p = mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    fail("{}: mmap of {}: {}", who, name, std::strerror(errno));
  }
  return static_cast<Header*>(p);
}

// Registers the mapped header for device access (stream memory operations read and write it) and records its
// device view in `m`.
void register_header(Mapping& m, const std::string& who) {
  cudaError_t e = cudaHostRegister(m.h, kHeaderBytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaHostRegister of the shared header: {}", who, cudaGetErrorString(e));
  m.registered = true;
  void* dh = nullptr;
  e = cudaHostGetDevicePointer(&dh, m.h, 0);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaHostGetDevicePointer: {}", who, cudaGetErrorString(e));
  m.dh = static_cast<Header*>(dh);
}

}  // namespace

struct CudaIpcLink::State {
  std::shared_ptr<Mapping> m;
  std::string address;
  size_t chunk_bytes = 0;
  int slots = 0;
  std::string who;  // "CUDA IPC link (inference side) to cache rank 1"

  std::mutex enqueue[2];                  // per direction, held while a message's chunks are enqueued
  std::atomic<uint64_t> seq[2] = {0, 0};  // chunks this end posted on direction d (as its sender or receiver)

  mutable std::mutex mu;  // everything below
  std::list<Pending> pending;
  uint64_t next_id = 1;
  std::vector<cudaEvent_t> free_events;
  bool failed = false;
  std::string failure;
  std::function<void(const std::string&)> on_failure;
  GpuLinkCounters counters;
  std::thread watchdog;
  std::condition_variable stop_cv;
  bool stop = false;

  // Marks the link failed (mu held) and hands the recorded pending operations to the returned Failure; operations
  // still being enqueued stay with their post(), which releases them itself.
  Failure fail_locked(const std::string& reason) {
    Failure f;
    if (failed) return f;
    failed = true;
    failure = reason;
    f.first = true;
    f.reason = reason;
    for (auto& p : pending)
      if (p.recorded) f.events.push_back(p.done);
    pending.clear();
    f.callback = on_failure;
    return f;
  }
  // What the peer signalled through the header ("" when nothing), for `role` (this end); *closed: an orderly close.
  std::string peer_signal(PairRole role, bool* closed = nullptr) const {
    Header* h = m->h;
    const uint32_t a = load(&h->abort);
    if (closed != nullptr) *closed = false;
    if (a == kAborted) return "the peer failed the link";
    if ((a == kClosing && role == PairRole::kCache) || (role == PairRole::kInference && load(&h->closed) != 0)) {
      if (closed != nullptr) *closed = true;
      return "the peer closed the link";
    }
    return "";
  }
  // Sets the abort word (first: a completed operation whose data a release may have spoiled is then always seen
  // with the word set) and moves every counter far ahead of the chunks this end posted, so every wait queued on
  // either side is satisfied. Host stores: no stream is involved.
  void release(uint32_t abort_word) {
    Header* h = m->h;
    if (load(&h->abort) == 0 || abort_word == kAborted) store(&h->abort, abort_word);
    for (int d = 0; d < 2; ++d) {
      const uint32_t v = static_cast<uint32_t>(seq[d].load()) + kReleaseAhead;
      store(&h->posted[d][0], v);
      store(&h->consumed[d][0], v);
    }
  }
  // Releases until every event has completed (the peer may still overwrite a counter with an older value from an
  // operation it had queued) or `limit` passes; then destroys the events. Returns whether all drained.
  bool release_until_drained(std::vector<cudaEvent_t>& events, uint32_t abort_word, std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    bool done = false;
    for (;;) {
      release(abort_word);
      done = true;
      for (auto e : events) done = done && cudaEventQuery(e) != cudaErrorNotReady;
      if (done || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!done) {
      spdlog::warn("{}: {} operation(s) still blocked {} ms after the link was released", who, events.size(),
                   ms(limit));
      m->ring_drained = false;
    }
    for (auto e : events) cudaEventDestroy(e);
    events.clear();
    return done;
  }
  // Runs a first failure's release, log and callback (no lock held).
  void finish(Failure& f, std::chrono::milliseconds limit) {
    if (!f.first) return;
    release_until_drained(f.events, kAborted, limit);
    if (f.quiet) {
      spdlog::info("{}", f.reason);
    } else {
      spdlog::error("{}", f.reason);
    }
    if (f.callback) f.callback(f.reason);
  }
  // The oldest pending operation's description (mu held).
  std::string oldest_locked() const {
    return pending.empty() ? std::string("no operation in flight") : "while " + pending.front().what + " was in flight";
  }
};

CudaIpcLink::CudaIpcLink(PairRole role, std::string peer_name, CudaIpcLinkOptions opts)
    : role_(role), peer_name_(std::move(peer_name)), opts_(opts), st_(std::make_unique<State>()) {
  st_->who = fmt::format("CUDA IPC link ({} side) to {}", pair_role_name(role_), peer_name_);
  const std::string& who = st_->who;
  SPADE_CHECK(opts_.op_timeout.count() > 0 && opts_.connect_timeout.count() > 0 && opts_.watchdog_period.count() > 0 &&
                  opts_.heartbeat_timeout.count() > 0,
              "{}: timeouts must be positive", who);
  const MemOps& ops = mem_ops();
  SPADE_CHECK(ops.error.empty(), "{}: {} (stream memory operations are needed)", who, ops.error);
  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaGetDeviceCount: {}", who, cudaGetErrorString(e));
  SPADE_CHECK(opts_.device >= 0 && opts_.device < ndev, "{}: device {} out of range ({} CUDA devices)", who,
              opts_.device, ndev);
  const cudaError_t se = cudaSetDevice(opts_.device);
  SPADE_CHECK(se == cudaSuccess, "{}: cudaSetDevice({}): {}", who, opts_.device, cudaGetErrorString(se));
}

std::unique_ptr<CudaIpcLink> CudaIpcLink::create(std::string peer_name, CudaIpcLinkOptions opts) {
  std::unique_ptr<CudaIpcLink> l(new CudaIpcLink(PairRole::kInference, std::move(peer_name), opts));
  State& st = *l->st_;
  SPADE_CHECK(opts.chunk_bytes >= 256 && opts.chunk_bytes % 256 == 0 && opts.ring_slots >= 1 &&
                  opts.ring_slots <= 4096,
              "{}: chunk_bytes {} must be a positive multiple of 256 and ring_slots {} in 1..4096", st.who,
              opts.chunk_bytes, opts.ring_slots);
  st.chunk_bytes = opts.chunk_bytes;
  st.slots = opts.ring_slots;
  auto m = std::make_shared<Mapping>();
  m->creator = true;
  m->device = opts.device;
  m->wait_unmap = opts.op_timeout + opts.heartbeat_timeout;
  m->heartbeat_timeout = opts.heartbeat_timeout;
  const uint64_t id = random_u64();
  m->shm_name = fmt::format("/spade-ipc-{}-{:016x}", ::getpid(), id);
  m->h = map_header(m->shm_name, true, st.who);
  std::memset(static_cast<void*>(m->h), 0, kHeaderBytes);
  register_header(*m, st.who);
  const size_t total = 2 * static_cast<size_t>(st.slots) * st.chunk_bytes;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&m->ring), total);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaMalloc of {} bytes on device {}: {}", st.who, total, opts.device,
              cudaGetErrorString(e));
  m->ring_owned = true;
  AddressWire a{};
  std::memcpy(a.magic, kMagic, sizeof(kMagic));
  a.version = kVersion;
  a.ring_slots = static_cast<uint32_t>(st.slots);
  a.link_id = id;
  a.total_bytes = total;
  a.chunk_bytes = st.chunk_bytes;
  std::snprintf(a.shm_name, sizeof(a.shm_name), "%s", m->shm_name.c_str());
  const std::string bus = bus_id(opts.device);
  std::snprintf(a.bus_id, sizeof(a.bus_id), "%s", bus.c_str());
  e = cudaIpcGetMemHandle(&a.handle, m->ring);
  a.handle_ok = e == cudaSuccess ? 1 : 0;
  if (e != cudaSuccess) {
    cudaGetLastError();
    spdlog::warn("{}: cudaIpcGetMemHandle: {}; only a peer in this process can open the link", st.who,
                 cudaGetErrorString(e));
  }
  st.address.assign(reinterpret_cast<const char*>(&a), sizeof(a));
  m->ends = 1;
  st.m = m;
  {
    std::lock_guard lk(registry_mu());
    registry()[id] = m;
  }
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
  SPADE_CHECK(a.chunk_bytes >= 256 && a.chunk_bytes % 256 == 0 && a.ring_slots >= 1 && a.ring_slots <= 4096 &&
                  a.total_bytes == 2 * static_cast<uint64_t>(a.ring_slots) * a.chunk_bytes,
              "{}: inconsistent address (chunk {} bytes, {} slots, {} bytes in all)", st.who, a.chunk_bytes,
              a.ring_slots, a.total_bytes);
  a.shm_name[sizeof(a.shm_name) - 1] = '\0';
  a.bus_id[sizeof(a.bus_id) - 1] = '\0';
  st.chunk_bytes = a.chunk_bytes;
  st.slots = static_cast<int>(a.ring_slots);
  std::shared_ptr<Mapping> m;
  {
    std::lock_guard lk(registry_mu());
    auto it = registry().find(a.link_id);
    if (it != registry().end()) m = it->second.lock();
  }
  if (m != nullptr) {  // same process: share the creator's mapping
    SPADE_CHECK(m->device == opts.device, "{}: the creator in this process uses device {}, this end device {}", st.who,
                m->device, opts.device);
    SPADE_CHECK(load(&m->h->hello) == 0, "{}: the link was already opened", st.who);
    std::lock_guard lk(registry_mu());
    ++m->ends;
  } else {
    m = std::make_shared<Mapping>();
    m->device = opts.device;
    m->shm_name = a.shm_name;
    m->h = map_header(m->shm_name, false, st.who);
    register_header(*m, st.who);
    SPADE_CHECK(a.handle_ok == 1, "{}: the creator could not export its memory (cudaIpcGetMemHandle failed)", st.who);
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, a.handle, cudaIpcMemLazyEnablePeerAccess);
    SPADE_CHECK(e == cudaSuccess, "{}: cudaIpcOpenMemHandle of the creator's memory (GPU {}) on device {} (GPU {}): {}",
                st.who, a.bus_id, opts.device, bus_id(opts.device), cudaGetErrorString(e));
    m->ring = static_cast<char*>(p);
    m->ring_mapped = true;
    m->ends = 1;
  }
  st.m = m;
  st.address = address;
  store(&m->h->hello, 1u);
  l->start_watchdog();
  return l;
}

void CudaIpcLink::connect() {
  if (role_ != PairRole::kInference) return;
  const auto deadline = Clock::now() + opts_.connect_timeout;
  while (load(&st_->m->h->hello) == 0) {
    SPADE_CHECK(!failed(), "{}", failure());
    if (Clock::now() > deadline)
      fail("{}: the peer did not open the link within {} ms (device {})", st_->who, ms(opts_.connect_timeout),
           opts_.device);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  shm_unlink(st_->m->shm_name.c_str());  // both mapped: the name is no longer needed (and cannot leak now)
  spdlog::info("{}: connected on device {} ({} x {} KiB ring per direction)", st_->who, opts_.device, st_->slots,
               st_->chunk_bytes >> 10);
}

const std::string& CudaIpcLink::address() const { return st_->address; }

void CudaIpcLink::start_watchdog() {
  // Runs until the link is destroyed: after a failure it keeps beating (the creator must not free the ring while
  // this end, failed or not, still maps it) but checks nothing more.
  st_->watchdog = std::thread([this] {
    cudaSetDevice(opts_.device);
    State& st = *st_;
    Header* h = st.m->h;
    const int me = static_cast<int>(role_), peer = 1 - me;
    uint64_t peer_beat = load(&h->heartbeat[peer]);
    auto peer_beat_seen = Clock::now();
    std::unique_lock lk(st.mu);
    while (!st.stop) {
      store(&h->heartbeat[me], load(&h->heartbeat[me]) + 1);
      if (!st.failed) {
        std::string reason;
        const auto now = Clock::now();
        // The peer's liveness counts once it is there (the creator's from the start, the opener's after its hello).
        const uint64_t b = load(&h->heartbeat[peer]);
        if (b != peer_beat || (role_ == PairRole::kInference && load(&h->hello) == 0)) {
          peer_beat = b;
          peer_beat_seen = now;
        }
        bool closed = false;
        const std::string signal = st.peer_signal(role_, &closed);
        const bool quiet = closed && st.pending.empty();
        if (!signal.empty()) {
          reason = fmt::format("{}: {} ({})", st.who, signal, st.oldest_locked());
        } else if (now - peer_beat_seen > opts_.heartbeat_timeout) {
          reason = fmt::format("{}: no heartbeat from the peer for {} ms (peer process dead or stuck; {})", st.who,
                               ms(opts_.heartbeat_timeout), st.oldest_locked());
        }
        for (auto it = st.pending.begin(); reason.empty() && it != st.pending.end();) {
          const cudaError_t e = it->recorded ? cudaEventQuery(it->done) : cudaErrorNotReady;
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
          f.quiet = quiet && reason.find("the peer closed the link") != std::string::npos;
          lk.unlock();
          st.finish(f, opts_.op_timeout);
          lk.lock();
          continue;
        }
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
  if (st.watchdog.joinable()) {
    if (st.watchdog.get_id() == std::this_thread::get_id()) {
      st.watchdog.detach();  // destroyed from on_failure (forbidden by the contract): do not join ourselves
    } else {
      st.watchdog.join();
    }
  }
  if (st.m == nullptr) return;
  DeviceGuard g(opts_.device);
  std::vector<cudaEvent_t> events;
  bool was_failed = false;
  {
    std::lock_guard lk(st.mu);
    was_failed = st.failed;
    for (auto& p : st.pending)
      if (p.recorded) events.push_back(p.done);
    st.pending.clear();
  }
  if (!was_failed) {
    // Let the posted operations finish (up to op_timeout); the creator then tells the opener it is closing, and
    // releases whatever is still blocked on either side.
    const auto deadline = Clock::now() + opts_.op_timeout;
    for (auto e : events)
      while (cudaEventQuery(e) == cudaErrorNotReady && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    bool drained = true;
    for (auto e : events) drained = drained && cudaEventQuery(e) != cudaErrorNotReady;
    if (!drained) spdlog::warn("{}: operations still in flight after {} ms at teardown", st.who, ms(opts_.op_timeout));
    if (role_ == PairRole::kInference) {
      st.release_until_drained(events, kClosing, opts_.op_timeout);
    } else if (!drained) {
      st.release_until_drained(events, kAborted, opts_.op_timeout);
    }
  }
  for (auto e : events) cudaEventDestroy(e);
  for (auto e : st.free_events) cudaEventDestroy(e);
  // A same-process opener shares the creator's mapping: say it has left (another process's opener says so when it
  // unmaps, in ~Mapping).
  if (role_ == PairRole::kCache && !st.m->ring_mapped) store(&st.m->h->closed, 1u);
  {
    std::lock_guard lk(registry_mu());
    if (--st.m->ends == 0 && st.m->creator) {
      for (auto it = registry().begin(); it != registry().end();)
        it = it->second.lock() == st.m || it->second.expired() ? registry().erase(it) : std::next(it);
    }
  }
  st.m.reset();  // the last end of this process unmaps / frees (Mapping's destructor)
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
  Header* dh = st.m->dh;
  const CUdeviceptr posted = reinterpret_cast<CUdeviceptr>(&dh->posted[d][0]);
  const CUdeviceptr consumed = reinterpret_cast<CUdeviceptr>(&dh->consumed[d][0]);
  char* ring = st.m->ring + static_cast<size_t>(d) * st.slots * st.chunk_bytes;

  std::string reason;
  Failure f;
  {
    std::lock_guard enqueue(st.enqueue[d]);
    // Register the operation (and its deadline) before enqueuing: enqueuing can block when the stream's queue is
    // full, and the watchdog must still see the operation then.
    uint64_t id = 0;
    cudaEvent_t ev = nullptr;
    {
      std::lock_guard lk(st.mu);
      if (st.failed) fail("{} (refused {})", st.failure, desc);
      if (!st.free_events.empty()) {
        ev = st.free_events.back();
        st.free_events.pop_back();
      }
    }
    if (ev == nullptr) {
      const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      SPADE_CHECK(e == cudaSuccess, "{}: {}: cudaEventCreate: {}", st.who, desc, cudaGetErrorString(e));
    }
    {
      std::lock_guard lk(st.mu);
      if (st.failed) {
        st.free_events.push_back(ev);
        fail("{} (refused {})", st.failure, desc);
      }
      id = st.next_id++;
      st.pending.push_back(Pending{id, ev, false, no_timeout ? Clock::time_point::max() : Clock::now() + timeout,
                                   no_timeout ? -1 : static_cast<long long>(timeout.count()), desc});
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
                             r != CUDA_SUCCESS ? fmt::format("CUresult {}", static_cast<int>(r))
                                               : std::string(cudaGetErrorString(ce)));
    }
    // Recorded even after a partial enqueue: the drain below then waits for the chunks that were queued.
    const cudaError_t re = cudaEventRecord(ev, stream);
    if (re != cudaSuccess && reason.empty())
      reason = fmt::format("{}: {}: cudaEventRecord: {}", st.who, desc, cudaGetErrorString(re));
    std::lock_guard lk(st.mu);
    if (reason.empty() && !st.failed) {
      for (auto& pd : st.pending)
        if (pd.id == id) pd.recorded = true;
      if (is_send) {
        ++st.counters.sends;
        st.counters.bytes_sent += bytes;
      } else {
        ++st.counters.recvs;
        st.counters.bytes_received += bytes;
      }
      return;
    }
    // Failed, here or concurrently: the operation is no longer tracked; release it with the rest (below, after the
    // enqueue lock is dropped).
    st.pending.remove_if([&](const Pending& pd) { return pd.id == id; });
    if (!st.failed) {
      f = st.fail_locked(reason);  // this operation's failure is the link's
    } else if (reason.empty()) {
      reason = fmt::format("{} (while enqueuing {})", st.failure, desc);
    }
    f.events.push_back(ev);
  }
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
  DeviceGuard g(opts_.device);
  Failure f;
  {
    std::lock_guard lk(st_->mu);
    f = st_->fail_locked(fmt::format("{}: aborted: {}", st_->who, reason));
  }
  st_->stop_cv.notify_all();
  st_->finish(f, opts_.op_timeout);
}

bool CudaIpcLink::failed() const {
  std::lock_guard lk(st_->mu);
  // The header is read synchronously: a receive that completed on data a failing peer spoiled is always seen with
  // the abort word already set (it is written before the peer's release), even before the watchdog polls it.
  return st_->failed || !st_->peer_signal(role_).empty();
}

std::string CudaIpcLink::failure() const {
  std::lock_guard lk(st_->mu);
  if (st_->failed) return st_->failure;
  const std::string signal = st_->peer_signal(role_);
  return signal.empty() ? std::string() : fmt::format("{}: {}", st_->who, signal);
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

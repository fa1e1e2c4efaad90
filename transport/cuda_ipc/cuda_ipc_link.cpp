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
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/error.h"
#include "transport/gpu_link_watch.h"

namespace spade::transport {

namespace {

using Clock = std::chrono::steady_clock;
using detail::DeviceGuard;
using detail::ms;

// ---- the shared header (host memory, both processes; the counters are also device-mapped) ----
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kReasonBytes = 512;
struct Header {
  uint32_t posted[2][16];    // [direction][0]: chunks the sender posted (written by its stream); 64-byte lines
  uint32_t consumed[2][16];  // [direction][0]: chunks the receiver drained (written by its stream)
  uint32_t hello;            // 1 once the opener mapped everything
  uint32_t abort;            // 0 healthy, kAborted a side failed the link, kClosing the creator is closing it
  uint32_t closed;           // 1 once the opener unmapped (the creator may free the ring then)
  uint32_t pad;
  uint64_t heartbeat[2];     // [role]: advanced by that side's watchdog every period
  // [role]: that side's failure reason, NUL-terminated, written before it sets the abort word, so the peer's failure
  // names the cause (e.g. which other peer went down), not only "the peer failed the link".
  char reason[2][kReasonBytes];
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
constexpr char kMagic[8] = {'S', 'P', 'D', 'I', 'P', 'C', '0', '3'};
constexpr uint32_t kVersion = 3;
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

struct CudaIpcLink::State final : detail::GpuLinkWatch {
  State(PairRole role, Options o, std::chrono::milliseconds heartbeat)
      : GpuLinkWatch(std::move(o)), end_role(role), heartbeat_timeout(heartbeat) {}
  ~State() override { stop_watchdog(); }

  const PairRole end_role;  // this end's
  const std::chrono::milliseconds heartbeat_timeout;
  std::shared_ptr<Mapping> m;
  std::string address;
  size_t chunk_bytes = 0;
  int slots = 0;

  std::atomic<uint64_t> seq[2] = {0, 0};  // chunks this end posted on direction d (as its sender or receiver)

  // The watchdog thread's view of the peer's heartbeat.
  uint64_t peer_beat = 0;
  Clock::time_point peer_beat_seen;

  // What the peer signalled through the header ("" when nothing), for `role` (this end); *closed: an orderly close.
  std::string peer_signal(PairRole role, bool* closed = nullptr) const {
    Header* h = m->h;
    const uint32_t a = load(&h->abort);
    if (closed != nullptr) *closed = false;
    if (a == kAborted) {  // the acquire load of the word makes the peer's reason, written before it, visible
      const char* r = h->reason[1 - static_cast<int>(role)];
      const std::string why(r, strnlen(r, kReasonBytes));
      return why.empty() ? std::string("the peer failed the link") : "the peer failed the link (" + why + ")";
    }
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
      spdlog::warn("{}: {} operation(s) still blocked {} ms after the link was released", who(), events.size(),
                   ms(limit));
      m->ring_drained = false;
    }
    for (auto e : events) cudaEventDestroy(e);
    events.clear();
    return done;
  }

  // Where each direction stood, from this end's view (before any release): chunks this end enqueued, and the header's
  // posted / consumed counts (what the two ends' streams have executed). A chunk enqueued here but not yet posted by
  // the sender's stream names the stream that did not progress.
  std::string state_locked() const {
    Header* h = m->h;
    std::string s;
    for (int d = 0; d < 2; ++d) {
      const bool sender = (d == 0) == (end_role == PairRole::kInference);
      const uint32_t posted = load(&h->posted[d][0]), consumed = load(&h->consumed[d][0]);
      s += fmt::format("{}{} ({} -> {}): this end enqueued {} chunk(s) as {}, the sender's stream posted {}, the "
                       "receiver's stream consumed {}",
                       d == 0 ? "" : "; ", d == 0 ? "up" : "down", d == 0 ? "inference" : "cache",
                       d == 0 ? "cache" : "inference", seq[d].load(), sender ? "sender" : "receiver", posted, consumed);
    }
    return s;
  }

 protected:
  // The link state at the first failure, for the log, when a chunk this end enqueued was still incomplete (this
  // end's failure: before its release moves the counters) or the peer failed the link (its release already moved
  // them: this end's counts still say what it had enqueued). Not after an orderly close.
  void on_fail_locked() override {
    Header* h = m->h;
    // This end's reason, for the peer, before release_transfers() sets the abort word.
    char* mine = h->reason[static_cast<int>(end_role)];
    const std::string& why = failure_locked();
    const size_t n = std::min(why.size(), kReasonBytes - 1);
    std::memcpy(mine, why.data(), n);
    mine[n] = '\0';
    bool incomplete = false;
    for (int d = 0; d < 2; ++d) {
      const auto q = static_cast<uint32_t>(seq[d].load());
      incomplete = incomplete || static_cast<int32_t>(q - load(&h->posted[d][0])) > 0 ||
                   static_cast<int32_t>(q - load(&h->consumed[d][0])) > 0;
    }
    if (incomplete) {
      spdlog::warn("{}: link state at the failure: {}", who(), state_locked());
    } else if (load(&h->abort) == kAborted) {
      spdlog::warn("{}: link state when the peer failed the link (counters already released): {}", who(),
                   state_locked());
    }
  }
  // A failure releases every counter (the blocked copies of both ends run, on garbage) until the events drain.
  void release_transfers(std::vector<cudaEvent_t>& events) override {
    release_until_drained(events, kAborted, options().op_timeout);
  }
  // The peer's liveness counts once it is there (the creator's from the start, the opener's after its hello).
  void watchdog_started() override {
    peer_beat = load(&m->h->heartbeat[1 - static_cast<int>(end_role)]);
    peer_beat_seen = Clock::now();
  }
  // Beats even after a failure: the creator must not free the ring while this end, failed or not, still maps it.
  void tick_locked() override {
    Header* h = m->h;
    const int me = static_cast<int>(end_role);
    store(&h->heartbeat[me], load(&h->heartbeat[me]) + 1);
  }
  Verdict check_locked(Clock::time_point now) override {
    Header* h = m->h;
    const uint64_t b = load(&h->heartbeat[1 - static_cast<int>(end_role)]);
    if (b != peer_beat || (end_role == PairRole::kInference && load(&h->hello) == 0)) {
      peer_beat = b;
      peer_beat_seen = now;
    }
    bool closed = false;
    const std::string signal = peer_signal(end_role, &closed);
    // The peer closed the link with nothing in flight: an orderly end, logged as info.
    if (!signal.empty())
      return {fmt::format("{}: {} ({})", who(), signal, oldest_locked()), closed && pending_empty_locked()};
    if (now - peer_beat_seen > heartbeat_timeout)
      return {fmt::format("{}: no heartbeat from the peer for {} ms (peer process dead or stuck; {})", who(),
                          ms(heartbeat_timeout), oldest_locked()),
              false};
    return {};
  }
};

namespace {

// The watch of a link (see gpu_link_watch.h): every error names the role and the peer.
detail::GpuLinkWatch::Options watch_options(PairRole role, const std::string& peer_name, const CudaIpcLinkOptions& o) {
  detail::GpuLinkWatch::Options w;
  w.who = fmt::format("CUDA IPC link ({} side) to {}", pair_role_name(role), peer_name);
  w.label = w.who;
  w.outcome = "link released";
  w.device = o.device;
  w.op_timeout = o.op_timeout;
  w.watchdog_period = o.watchdog_period;
  w.watch_after_failure = true;  // keeps beating the heartbeat
  return w;
}

}  // namespace

CudaIpcLink::CudaIpcLink(PairRole role, std::string peer_name, CudaIpcLinkOptions opts)
    : WatchedGpuLink(role, std::move(peer_name), opts.device),
      opts_(opts),
      st_(std::make_unique<State>(role_, watch_options(role_, peer_name_, opts_), opts_.heartbeat_timeout)) {
  const std::string& who = st_->who();
  SPADE_CHECK(opts_.op_timeout.count() > 0 && opts_.connect_timeout.count() > 0 && opts_.watchdog_period.count() > 0 &&
                  opts_.heartbeat_timeout.count() > 0,
              "{}: timeouts must be positive", who);
  const MemOps& ops = mem_ops();
  SPADE_CHECK(ops.error.empty(), "{}: {} (stream memory operations are needed)", who, ops.error);
  detail::use_device(who, opts_.device);
}

std::unique_ptr<CudaIpcLink> CudaIpcLink::create(std::string peer_name, CudaIpcLinkOptions opts) {
  std::unique_ptr<CudaIpcLink> l(new CudaIpcLink(PairRole::kInference, std::move(peer_name), opts));
  State& st = *l->st_;
  SPADE_CHECK(opts.chunk_bytes >= 256 && opts.chunk_bytes % 256 == 0 && opts.ring_slots >= 1 &&
                  opts.ring_slots <= 4096,
              "{}: chunk_bytes {} must be a positive multiple of 256 and ring_slots {} in 1..4096", st.who(),
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
  m->h = map_header(m->shm_name, true, st.who());
  std::memset(static_cast<void*>(m->h), 0, kHeaderBytes);
  register_header(*m, st.who());
  const size_t total = 2 * static_cast<size_t>(st.slots) * st.chunk_bytes;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&m->ring), total);
  SPADE_CHECK(e == cudaSuccess, "{}: cudaMalloc of {} bytes on device {}: {}", st.who(), total, opts.device,
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
    spdlog::warn("{}: cudaIpcGetMemHandle: {}; only a peer in this process can open the link", st.who(),
                 cudaGetErrorString(e));
  }
  st.address.assign(reinterpret_cast<const char*>(&a), sizeof(a));
  m->ends = 1;
  st.m = m;
  {
    std::lock_guard lk(registry_mu());
    registry()[id] = m;
  }
  st.start_watchdog();
  return l;
}

std::unique_ptr<CudaIpcLink> CudaIpcLink::open(const std::string& address, std::string peer_name,
                                               CudaIpcLinkOptions opts) {
  std::unique_ptr<CudaIpcLink> l(new CudaIpcLink(PairRole::kCache, std::move(peer_name), opts));
  State& st = *l->st_;
  SPADE_CHECK(address.size() == sizeof(AddressWire), "{}: address is {} bytes, expected {}", st.who(), address.size(),
              sizeof(AddressWire));
  AddressWire a{};
  std::memcpy(&a, address.data(), sizeof(a));
  SPADE_CHECK(std::memcmp(a.magic, kMagic, sizeof(kMagic)) == 0 && a.version == kVersion,
              "{}: not a CUDA IPC link address (magic / version {})", st.who(), a.version);
  SPADE_CHECK(a.chunk_bytes >= 256 && a.chunk_bytes % 256 == 0 && a.ring_slots >= 1 && a.ring_slots <= 4096 &&
                  a.total_bytes == 2 * static_cast<uint64_t>(a.ring_slots) * a.chunk_bytes,
              "{}: inconsistent address (chunk {} bytes, {} slots, {} bytes in all)", st.who(), a.chunk_bytes,
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
    if (m->device != opts.device) {
      // Another GPU of this process: its copies reach the creator's ring over peer access (NVLink or PCIe, by the
      // copy engines), as cudaIpcMemLazyEnablePeerAccess does for another process.
      int can = 0;
      cudaError_t e = cudaDeviceCanAccessPeer(&can, opts.device, m->device);
      SPADE_CHECK(e == cudaSuccess && can == 1, "{}: device {} cannot access the creator's device {} (peer access): {}",
                  st.who(), opts.device, m->device, e == cudaSuccess ? "not supported" : cudaGetErrorString(e));
      DeviceGuard g(opts.device);
      e = cudaDeviceEnablePeerAccess(m->device, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // clears the error the call recorded
        e = cudaSuccess;
      }
      SPADE_CHECK(e == cudaSuccess, "{}: cudaDeviceEnablePeerAccess({}) on device {}: {}", st.who(), m->device,
                  opts.device, cudaGetErrorString(e));
    }
    SPADE_CHECK(load(&m->h->hello) == 0, "{}: the link was already opened", st.who());
    std::lock_guard lk(registry_mu());
    ++m->ends;
  } else {
    m = std::make_shared<Mapping>();
    m->device = opts.device;
    m->shm_name = a.shm_name;
    m->h = map_header(m->shm_name, false, st.who());
    register_header(*m, st.who());
    SPADE_CHECK(a.handle_ok == 1, "{}: the creator could not export its memory (cudaIpcGetMemHandle failed)", st.who());
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, a.handle, cudaIpcMemLazyEnablePeerAccess);
    SPADE_CHECK(e == cudaSuccess, "{}: cudaIpcOpenMemHandle of the creator's memory (GPU {}) on device {} (GPU {}): {}",
                st.who(), a.bus_id, opts.device, bus_id(opts.device), cudaGetErrorString(e));
    m->ring = static_cast<char*>(p);
    m->ring_mapped = true;
    m->ends = 1;
  }
  st.m = m;
  st.address = address;
  store(&m->h->hello, 1u);
  st.start_watchdog();
  return l;
}

void CudaIpcLink::connect(std::chrono::milliseconds timeout) {
  if (role_ != PairRole::kInference) return;
  SPADE_CHECK(timeout.count() >= 0, "{}: connect: negative timeout", st_->who());
  if (timeout.count() == 0) timeout = opts_.connect_timeout;
  const auto deadline = Clock::now() + timeout;
  while (load(&st_->m->h->hello) == 0) {
    SPADE_CHECK(!failed(), "{}", failure());
    if (Clock::now() > deadline)
      fail("{}: the peer did not open the link within {} ms (device {})", st_->who(), ms(timeout), opts_.device);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  shm_unlink(st_->m->shm_name.c_str());  // both mapped: the name is no longer needed (and cannot leak now)
  spdlog::info("{}: connected on device {} ({} x {} KiB ring per direction)", st_->who(), opts_.device, st_->slots,
               st_->chunk_bytes >> 10);
}

const std::string& CudaIpcLink::address() const { return st_->address; }

CudaIpcLink::~CudaIpcLink() {
  State& st = *st_;
  st.stop_watchdog();
  if (st.m == nullptr) return;
  DeviceGuard g(opts_.device);
  std::vector<cudaEvent_t> events;
  bool was_failed = false;
  {
    std::lock_guard lk(st.mu());
    was_failed = st.failed_locked();
    events = st.take_pending_locked();
  }
  if (!was_failed) {
    // Let the posted operations finish (up to op_timeout); the creator then tells the opener it is closing, and
    // releases whatever is still blocked on either side.
    const bool drained = detail::GpuLinkWatch::wait_events(events, Clock::now() + opts_.op_timeout);
    if (!drained)
      spdlog::warn("{}: operations still in flight after {} ms at teardown", st.who(), ms(opts_.op_timeout));
    if (role_ == PairRole::kInference) {
      st.release_until_drained(events, kClosing, opts_.op_timeout);
    } else if (!drained) {
      st.release_until_drained(events, kAborted, opts_.op_timeout);
    }
  }
  for (auto e : events) cudaEventDestroy(e);
  st.destroy_free_events();
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
  const detail::OpRequest op = st.check_post(role_, is_send, buf, bytes, what, timeout);
  const int d = op.direction;  // 0 = up (inference -> cache)
  const MemOps& ops = mem_ops();
  CUstream s = reinterpret_cast<CUstream>(stream);
  Header* dh = st.m->dh;
  const CUdeviceptr posted = reinterpret_cast<CUdeviceptr>(&dh->posted[d][0]);
  const CUdeviceptr consumed = reinterpret_cast<CUdeviceptr>(&dh->consumed[d][0]);
  char* ring = st.m->ring + static_cast<size_t>(d) * st.slots * st.chunk_bytes;

  std::string reason;
  detail::GpuLinkWatch::Failure f;
  {
    std::lock_guard enqueue(st.enqueue_mutex(d));
    // Register the operation (and its deadline) before enqueuing: enqueuing can block when the stream's queue is
    // full, and the watchdog must still see the operation then.
    cudaEvent_t ev = st.take_event(op);
    uint64_t id = 0;
    {
      std::lock_guard lk(st.mu());
      st.throw_if_failed_locked(op, ev, "refused");
      id = st.track_locked(ev, op, /*recorded=*/false);
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
        reason = fmt::format("{}: {}: enqueuing chunk {} failed: {}; link released", st.who(), op.desc, q,
                             r != CUDA_SUCCESS ? fmt::format("CUresult {}", static_cast<int>(r))
                                               : std::string(cudaGetErrorString(ce)));
    }
    // Recorded even after a partial enqueue: the drain below then waits for the chunks that were queued.
    const cudaError_t re = cudaEventRecord(ev, stream);
    if (re != cudaSuccess && reason.empty())
      reason = fmt::format("{}: {}: cudaEventRecord: {}", st.who(), op.desc, cudaGetErrorString(re));
    std::lock_guard lk(st.mu());
    if (reason.empty() && !st.failed_locked()) {
      st.mark_recorded_locked(id);
      st.count_locked(op);
      return;
    }
    // Failed, here or concurrently: the operation is no longer tracked; release it with the rest (below, after the
    // enqueue lock is dropped).
    st.untrack_locked(id);
    if (!st.failed_locked()) {
      f = st.fail_locked(reason);  // this operation's failure is the link's
    } else if (reason.empty()) {
      reason = fmt::format("{} (while enqueuing {})", st.failure_locked(), op.desc);
    }
    f.events.push_back(ev);
  }
  st.finish(f);
  throw Error(reason);
}

detail::GpuLinkWatch& CudaIpcLink::watch() const { return *st_; }

void CudaIpcLink::abort(const std::string& reason) {
  DeviceGuard g(opts_.device);
  st_->abort(reason);
}

bool CudaIpcLink::failed() const {
  std::lock_guard lk(st_->mu());
  // The header is read synchronously: a receive that completed on data a failing peer spoiled is always seen with
  // the abort word already set (it is written before the peer's release), even before the watchdog polls it.
  return st_->failed_locked() || !st_->peer_signal(role_).empty();
}

std::string CudaIpcLink::failure() const {
  std::lock_guard lk(st_->mu());
  if (st_->failed_locked()) return st_->failure_locked();
  const std::string signal = st_->peer_signal(role_);
  return signal.empty() ? std::string() : fmt::format("{}: {}", st_->who(), signal);
}

}  // namespace spade::transport

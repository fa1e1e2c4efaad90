// The link factory (see link_factory.h). Which GPU links exist is known here only: SPADE_LINK_FACTORY_NCCL and
// SPADE_LINK_FACTORY_CUDA_IPC are private definitions of spade_link_factory; UCX follows spade_transport's
// SPADE_HAVE_UCX.
#include "transport/link_factory.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "common/error.h"
#include "transport/loopback.h"

#if SPADE_LINK_FACTORY_NCCL
#include "transport/nccl/nccl_link.h"
#endif
#if SPADE_LINK_FACTORY_CUDA_IPC
#include "transport/cuda_ipc/cuda_ipc_link.h"
#endif

namespace spade::transport {

namespace {

#ifndef SPADE_LINK_FACTORY_NCCL
#define SPADE_LINK_FACTORY_NCCL 0
#endif
#ifndef SPADE_LINK_FACTORY_CUDA_IPC
#define SPADE_LINK_FACTORY_CUDA_IPC 0
#endif

// Every kind: its name on the command line and in errors, whether this build has it, and what a build without it
// lacks.
struct KindInfo {
  LinkKind kind;
  const char* name;
  bool built;
  const char* dependency;
};
constexpr KindInfo kKinds[] = {{LinkKind::kNccl, "nccl", SPADE_LINK_FACTORY_NCCL != 0, "NCCL"},
                               {LinkKind::kCudaIpc, "cuda-ipc", SPADE_LINK_FACTORY_CUDA_IPC != 0, "CUDA"},
                               {LinkKind::kUcx, "ucx", SPADE_HAVE_UCX != 0, "UCX"},
                               {LinkKind::kLoopback, "loopback", true, ""}};

const KindInfo& info(LinkKind kind) {
  for (const KindInfo& k : kKinds)
    if (k.kind == kind) return k;
  fail("unknown link kind {}", static_cast<int>(kind));
}

std::string kind_list(const std::vector<LinkKind>& kinds) {
  std::string out;
  for (LinkKind k : kinds) {
    if (!out.empty()) out += ", ";
    out += link_kind_name(k);
  }
  return out;
}

// The loopback fabric shared by every factory call that names none.
std::shared_ptr<LoopbackFabric> default_fabric() {
  static std::mutex mu;
  static std::shared_ptr<LoopbackFabric> fabric;
  std::lock_guard lk(mu);
  if (!fabric) fabric = LoopbackFabric::create();
  return fabric;
}

void require_family(LinkKind kind, bool gpu) {
  if (is_gpu_link_kind(kind) == gpu) return;
  if (gpu) fail("link kind '{}' is a host link: use make_host_transport()", link_kind_name(kind));
  fail("link kind '{}' is a GPU link: use offer_gpu_link() / join_gpu_link()", link_kind_name(kind));
}

#if SPADE_LINK_FACTORY_NCCL
NcclLinkOptions nccl_options(const LinkOptions& o) { return {o, o.nccl_max_ctas_up, o.nccl_max_ctas_down}; }

class NcclOffer final : public GpuLinkOffer {
 public:
  explicit NcclOffer(const LinkOptions& o) : opts_(o), address_(NcclLink::new_address()) {}
  LinkKind kind() const override { return LinkKind::kNccl; }
  const std::string& address() const override { return address_; }
  std::unique_ptr<GpuLink> connect(const std::string& peer_name, std::chrono::milliseconds connect_timeout) override {
    const std::string& peer = peer_name.empty() ? opts_.peer_name : peer_name;
    SPADE_CHECK(!connected_, "NCCL link offer to {}: connect() called twice", peer);
    connected_ = true;
    NcclLinkOptions n = nccl_options(opts_);
    if (connect_timeout.count() > 0) n.connect_timeout = connect_timeout;
    return std::make_unique<NcclLink>(address_, PairRole::kInference, peer, n);
  }

 private:
  LinkOptions opts_;
  std::string address_;
  bool connected_ = false;
};
#endif

#if SPADE_LINK_FACTORY_CUDA_IPC
CudaIpcLinkOptions ipc_options(const LinkOptions& o) {
  return {o, o.ipc_chunk_bytes, o.ipc_ring_slots, o.ipc_heartbeat_timeout};
}

class CudaIpcOffer final : public GpuLinkOffer {
 public:
  explicit CudaIpcOffer(const LinkOptions& o) : link_(CudaIpcLink::create(o.peer_name, ipc_options(o))) {}
  LinkKind kind() const override { return LinkKind::kCudaIpc; }
  const std::string& address() const override { return address_; }
  std::unique_ptr<GpuLink> connect(const std::string& /*peer_name: named at creation*/,
                                   std::chrono::milliseconds connect_timeout) override {
    SPADE_CHECK(link_ != nullptr, "CUDA IPC link offer to {}: connect() called twice", peer_);
    link_->connect(connect_timeout);
    return std::move(link_);
  }

 private:
  std::unique_ptr<CudaIpcLink> link_;
  const std::string address_ = link_->address();
  const std::string peer_ = link_->peer_name();
};
#endif

}  // namespace

const char* link_kind_name(LinkKind kind) { return info(kind).name; }

LinkKind parse_link_kind(std::string_view name) {
  std::vector<LinkKind> all;
  for (const KindInfo& k : kKinds) {
    if (name == k.name) return k.kind;
    all.push_back(k.kind);
  }
  if (name == "ipc" || name == "cuda_ipc") return LinkKind::kCudaIpc;
  fail("unknown link kind '{}' (known: {})", name, kind_list(all));
}

bool is_gpu_link_kind(LinkKind kind) { return kind == LinkKind::kNccl || kind == LinkKind::kCudaIpc; }

bool link_kind_available(LinkKind kind) { return info(kind).built; }

std::vector<LinkKind> available_link_kinds() {
  std::vector<LinkKind> out;
  for (const KindInfo& k : kKinds)
    if (k.built) out.push_back(k.kind);
  return out;
}

void require_link_kind(LinkKind kind) {
  if (link_kind_available(kind)) return;
  fail("link kind '{}' is not built into this binary (built without {}); this binary has: {}", link_kind_name(kind),
       info(kind).dependency, kind_list(available_link_kinds()));
}

std::unique_ptr<Transport> make_host_transport(const LinkOptions& options) {
  require_family(options.kind, /*gpu=*/false);
  require_link_kind(options.kind);
  if (options.kind == LinkKind::kUcx) {
#if SPADE_HAVE_UCX
    UcxOptions u = options.ucx;
    u.name = options.name;
    return make_ucx_transport(u);
#endif
  }
  auto fabric = options.loopback_fabric ? options.loopback_fabric : default_fabric();
  return fabric->make_transport(options.name);
}

std::unique_ptr<GpuLinkOffer> offer_gpu_link(const LinkOptions& options) {
  require_family(options.kind, /*gpu=*/true);
  require_link_kind(options.kind);
#if SPADE_LINK_FACTORY_NCCL
  if (options.kind == LinkKind::kNccl) return std::make_unique<NcclOffer>(options);
#endif
#if SPADE_LINK_FACTORY_CUDA_IPC
  if (options.kind == LinkKind::kCudaIpc) return std::make_unique<CudaIpcOffer>(options);
#endif
  fail("link kind '{}': no GPU link was built for it", link_kind_name(options.kind));  // not reached
}

std::unique_ptr<GpuLink> join_gpu_link(const std::string& address, const LinkOptions& options) {
  require_family(options.kind, /*gpu=*/true);
  require_link_kind(options.kind);
#if SPADE_LINK_FACTORY_NCCL
  if (options.kind == LinkKind::kNccl)
    return std::make_unique<NcclLink>(address, PairRole::kCache, options.peer_name, nccl_options(options));
#endif
#if SPADE_LINK_FACTORY_CUDA_IPC
  if (options.kind == LinkKind::kCudaIpc) return CudaIpcLink::open(address, options.peer_name, ipc_options(options));
#endif
  (void)address;
  fail("link kind '{}': no GPU link was built for it", link_kind_name(options.kind));  // not reached
}

}  // namespace spade::transport

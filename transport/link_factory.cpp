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

constexpr LinkKind kAllKinds[] = {LinkKind::kNccl, LinkKind::kCudaIpc, LinkKind::kUcx, LinkKind::kLoopback};

// What the build lacks for `kind`: "NCCL", "CUDA", "UCX".
const char* missing_dependency(LinkKind kind) {
  switch (kind) {
    case LinkKind::kNccl:
      return "NCCL";
    case LinkKind::kCudaIpc:
      return "CUDA";
    case LinkKind::kUcx:
      return "UCX";
    case LinkKind::kLoopback:
      break;
  }
  return "?";
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
NcclLinkOptions nccl_options(const LinkOptions& o) {
  NcclLinkOptions n;
  n.device = o.device;
  n.max_ctas_up = o.nccl_max_ctas_up;
  n.max_ctas_down = o.nccl_max_ctas_down;
  n.connect_timeout = o.connect_timeout;
  n.op_timeout = o.op_timeout;
  n.watchdog_period = o.watchdog_period;
  return n;
}

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
  CudaIpcLinkOptions c;
  c.device = o.device;
  c.chunk_bytes = o.ipc_chunk_bytes;
  c.ring_slots = o.ipc_ring_slots;
  c.connect_timeout = o.connect_timeout;
  c.op_timeout = o.op_timeout;
  c.heartbeat_timeout = o.ipc_heartbeat_timeout;
  c.watchdog_period = o.watchdog_period;
  return c;
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

const char* link_kind_name(LinkKind kind) {
  switch (kind) {
    case LinkKind::kNccl:
      return "nccl";
    case LinkKind::kCudaIpc:
      return "cuda-ipc";
    case LinkKind::kUcx:
      return "ucx";
    case LinkKind::kLoopback:
      return "loopback";
  }
  return "?";
}

LinkKind parse_link_kind(std::string_view name) {
  for (LinkKind k : kAllKinds)
    if (name == link_kind_name(k)) return k;
  if (name == "ipc" || name == "cuda_ipc") return LinkKind::kCudaIpc;
  fail("unknown link kind '{}' (known: {})", name,
       kind_list(std::vector<LinkKind>(std::begin(kAllKinds), std::end(kAllKinds))));
}

bool is_gpu_link_kind(LinkKind kind) { return kind == LinkKind::kNccl || kind == LinkKind::kCudaIpc; }

bool link_kind_available(LinkKind kind) {
  switch (kind) {
    case LinkKind::kNccl:
#if SPADE_LINK_FACTORY_NCCL
      return true;
#else
      return false;
#endif
    case LinkKind::kCudaIpc:
#if SPADE_LINK_FACTORY_CUDA_IPC
      return true;
#else
      return false;
#endif
    case LinkKind::kUcx:
#if SPADE_HAVE_UCX
      return true;
#else
      return false;
#endif
    case LinkKind::kLoopback:
      return true;
  }
  return false;
}

std::vector<LinkKind> available_link_kinds() {
  std::vector<LinkKind> out;
  for (LinkKind k : kAllKinds)
    if (link_kind_available(k)) out.push_back(k);
  return out;
}

void require_link_kind(LinkKind kind) {
  if (link_kind_available(kind)) return;
  fail("link kind '{}' is not built into this binary (built without {}); this binary has: {}", link_kind_name(kind),
       missing_dependency(kind), kind_list(available_link_kinds()));
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

// The link factory: creates the data-plane link between an inference rank and its cache rank by kind, chosen at run
// time, so that callers need no #if for the backends a build may lack.
//
// Kinds and what they create:
//   * "nccl"      GpuLink (transport/nccl/nccl_link.h): two GPUs, NCCL point-to-point. GPU builds.
//   * "cuda-ipc"  GpuLink (transport/cuda_ipc/cuda_ipc_link.h): both ranks on one GPU, or two GPUs of one host
//                 with peer access (copy engines, no SM). GPU builds.
//   * "ucx"       Transport + Endpoint (transport/ucx.h): host memory over UCX. Builds with UCX.
//   * "loopback"  Transport + Endpoint (transport/loopback.h): in-process, for tests. Every build.
// available_link_kinds() says which this binary has; asking for another throws spade::Error
//   "link kind 'nccl' is not built into this binary (built without NCCL); this binary has: ucx, loopback".
//
// Both families rendezvous in two steps, around the coordinator's rendezvous (the inference rank publishes an
// address in its registration, the cache rank finds it in the ClusterView):
//   host links:  inference and cache rank each make_host_transport(), publish local_address(), then
//                Transport::connect(peer address, peer name, deadline) -> Endpoint (both sides connect).
//   GPU links:   the inference rank offer_gpu_link() and publishes GpuLinkOffer::address(); the cache rank
//                join_gpu_link(address); the inference rank GpuLinkOffer::connect(peer name) -> GpuLink.
//
// The factory only creates links; their behaviour is their contract (transport/transport.h, transport/gpu_link.h).
// This header needs no CUDA, NCCL or UCX headers.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "transport/gpu_link.h"
#include "transport/transport.h"
#include "transport/ucx.h"  // UcxOptions only (declarations, no UCX headers)

namespace spade::transport {

class LoopbackFabric;

enum class LinkKind { kNccl, kCudaIpc, kUcx, kLoopback };

/// "nccl", "cuda-ipc", "ucx", "loopback".
const char* link_kind_name(LinkKind kind);

/// The kind named `name`: a link_kind_name(), or "ipc" / "cuda_ipc" for kCudaIpc. Throws spade::Error
/// "unknown link kind 'x' (known: nccl, cuda-ipc, ucx, loopback)".
LinkKind parse_link_kind(std::string_view name);

/// True for the GPU links (NCCL, CUDA IPC: a GpuLink), false for the host links (UCX, loopback: a Transport).
bool is_gpu_link_kind(LinkKind kind);

/// The kinds built into this binary, in enum order (nccl, cuda-ipc, ucx, loopback); loopback is always there.
std::vector<LinkKind> available_link_kinds();

/// Whether `kind` is built into this binary.
bool link_kind_available(LinkKind kind);

/// Throws spade::Error "link kind 'K' is not built into this binary (built without X); this binary has: ..." unless
/// `kind` is available.
void require_link_kind(LinkKind kind);

/// Everything the link kinds need; each kind reads its own fields and ignores the others.
struct LinkOptions : GpuLinkOptions {
  LinkKind kind = LinkKind::kLoopback;

  // ---- host links (UCX, loopback) ----
  /// This side, in the transport's logs and errors, e.g. "inference rank 0 (#0)" (UCX: UcxOptions::name; loopback:
  /// the transport's name).
  std::string name = "spade";
  /// UCX tuning (transport/ucx.h); its `name` is replaced by `name` above.
  UcxOptions ucx;
  /// Loopback: the fabric the transport joins; null = one process-wide fabric shared by every such call, so that two
  /// loopback transports made by the factory in one process can connect.
  std::shared_ptr<LoopbackFabric> loopback_fabric;

  // ---- GPU links (NCCL, CUDA IPC) ----
  /// The peer, named in every error of the link, e.g. "cache rank 1 (#0) on host-b". A CUDA IPC link made by
  /// offer_gpu_link() exists before its peer is known and keeps this name (e.g. "its cache rank"); NCCL takes the
  /// name given to GpuLinkOffer::connect().
  std::string peer_name = "the peer";
  // device, connect_timeout, op_timeout, watchdog_period: GpuLinkOptions (transport/gpu_link.h).
  /// NCCL: channels (CTAs) of the up (inference -> cache) and down communicators; 0 = NCCL's default.
  int nccl_max_ctas_up = 1;
  int nccl_max_ctas_down = 16;
  /// CUDA IPC (creator only; the opener takes the creator's): ring chunk in bytes, a multiple of 256, and chunks per
  /// direction's ring, 1..4096.
  size_t ipc_chunk_bytes = size_t{4} << 20;
  int ipc_ring_slots = 8;
  /// CUDA IPC: the connected peer's heartbeat missing this long fails the link.
  std::chrono::milliseconds ipc_heartbeat_timeout{1000};
};

/// A host link's transport (options.kind UCX or loopback): publish its local_address(), then connect() to the peer's
/// address for the Endpoint. Throws spade::Error for a GPU kind ("link kind 'nccl' is a GPU link: use
/// offer_gpu_link() / join_gpu_link()"), an unavailable kind (require_link_kind), or the transport's own errors.
std::unique_ptr<Transport> make_host_transport(const LinkOptions& options);

/// The inference side of a GPU link between the rendezvous' two halves: made before registering, so that its
/// address can be published; connected once the peer is known.
class GpuLinkOffer {
 public:
  virtual ~GpuLinkOffer() = default;
  virtual LinkKind kind() const = 0;
  /// Opaque bytes to publish at the coordinator (TransportAddress.address); the cache rank gives them to
  /// join_gpu_link().
  virtual const std::string& address() const = 0;
  /// Joins the link as the inference side and returns it; blocks until the peer joined (NCCL) or opened the link
  /// (CUDA IPC), up to `connect_timeout` (0 = the options' connect_timeout). `peer_name` names the peer in the
  /// NCCL link's errors ("" = the options' peer_name); a CUDA IPC link keeps the options' peer_name. Call once;
  /// throws spade::Error naming the peer when it does not join in time, and on a second call.
  virtual std::unique_ptr<GpuLink> connect(const std::string& peer_name, std::chrono::milliseconds connect_timeout) = 0;
};

/// The inference rank's half of a GPU link (options.kind NCCL or CUDA IPC): NCCL makes a fresh address (two
/// ncclUniqueIds; the communicators are joined by connect()); CUDA IPC allocates and exports the link's memory on
/// options.device at once. Throws spade::Error for a host kind ("link kind 'ucx' is a host link: use
/// make_host_transport()"), an unavailable kind (require_link_kind), or the link's own errors.
std::unique_ptr<GpuLinkOffer> offer_gpu_link(const LinkOptions& options);

/// The cache rank's half of a GPU link: joins the link at `address` (GpuLinkOffer::address(), via the coordinator)
/// as the cache side, naming the inference rank options.peer_name. NCCL blocks until both communicators are ready
/// (up to connect_timeout); CUDA IPC maps the creator's memory and returns at once. Errors as offer_gpu_link(), and
/// a malformed address.
std::unique_ptr<GpuLink> join_gpu_link(const std::string& address, const LinkOptions& options);

}  // namespace spade::transport

// UCX implementation of the transport (UCP tag API, host memory). Compiled only when SPADE_HAVE_UCX is ON.
//
// Addressing: Transport::local_address() is "spade-ucx1:" followed by this transport's UCP worker address
// (ucp_worker_get_address); ranks publish it through the coordinator (RegisterRequest.self.transport) and
// connect() to the address in their ClusterView. connect() refuses addresses without the prefix (another
// transport's address).
//
// Tags: the 64-bit UCP tag is [sender id 16][user tag 48]. The sender id is the top 16 bits of the FNV-1a
// hash of the sender's worker address; both sides know it (the receiver got that address to connect()), so
// receives posted on an endpoint match only messages from that endpoint's peer, although UCP tag matching is
// per worker. Two peers of one transport whose ids collide are refused at connect() with a clear error
// (probability ~n^2 / 2^17).
//
// connect() is a symmetric handshake: both sides create the endpoint (UCP_ERR_HANDLING_MODE_PEER) and
// exchange a hello message on the reserved control tag; it throws, naming the peer, if the hello does not
// arrive by the deadline. This also wires the connection up front, so peer failure is detected even on an
// endpoint that only receives.
//
// Peer failure (UcxOptions::peer_failure_detection, default on): endpoints use UCP_ERR_HANDLING_MODE_PEER;
// UCX's error callback fails every pending operation on that endpoint (FAILED, "peer <name> failed: ...") and
// the endpoint is force-closed; later operations fail immediately. Detection time: a killed peer's TCP
// connection resets at once (measured ~10 ms here); for RDMA transports UCX keepalive
// (UcxOptions::keepalive_interval, default 1 s unless UCX_KEEPALIVE_INTERVAL is set) bounds it to a few
// intervals. Endpoint::abort() is the caller's backstop (coordinator PeerDown). Note: UCX 1.13 cannot use
// shared memory together with peer error handling (see UcxOptions::peer_failure_detection).
//
// Threading rule: one UCP worker per Transport, owned by the Transport's progress thread
// (UCS_THREAD_MODE_SINGLE). Every UCX call happens on that thread; post_send/post_recv/cancel/abort enqueue
// commands (woken through an eventfd), and handles complete from UCX callbacks on that thread. The thread
// spins for spin_before_block after the last activity, then blocks on the worker's event fd (ucp_worker_arm +
// epoll) for at most block_timeout, so an idle transport costs no CPU while an active one sees microsecond
// latency.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "transport/transport.h"

namespace spade::transport {

/// UCX transports used when neither UcxOptions::tls nor UCX_TLS is set: shared memory, TCP (loopback
/// included) and self. Works on a single host without RDMA hardware (with peer failure detection, UCX picks
/// tcp; see UcxOptions::peer_failure_detection); set UCX_TLS (e.g. "rc,sm,self") on InfiniBand clusters.
inline constexpr const char* kDefaultUcxTls = "sm,tcp,self";

struct UcxOptions {
  std::string name = "ucx";  // label of this side in logs and errors, e.g. "cache rank 2 (#0)"
  std::string tls;           // UCX_TLS for this context; "" = $UCX_TLS if set, else kDefaultUcxTls
  // UCX keepalive period, applied unless $UCX_KEEPALIVE_INTERVAL is set; 0 = UCX's default.
  std::chrono::milliseconds keepalive_interval{1000};
  std::chrono::microseconds spin_before_block{100};
  std::chrono::milliseconds block_timeout{10};
  std::chrono::milliseconds close_timeout{2000};  // bound on flushing an endpoint at close
  // UCP_ERR_HANDLING_MODE_PEER on endpoints (peer death fails pending operations). UCX 1.13's shared-memory
  // transports (posix, sysv, cma) have no peer-failure support, so with this on UCX uses tcp (or rc/dc/ud on
  // InfiniBand) even between processes of one host, and a UCX_TLS without such a transport cannot connect
  // ("Destination is unreachable"). Off: shared memory is usable, but a dead peer is only noticed through the
  // coordinator (PeerDown -> Endpoint::abort()).
  bool peer_failure_detection = true;
};

/// Creates a UCX transport (context + worker + progress thread). Throws spade::Error with the UCX status
/// string on failure.
std::unique_ptr<Transport> make_ucx_transport(const UcxOptions& options = {});

/// 16-bit sender id derived from a worker address (exposed for tests and diagnostics).
uint16_t ucx_sender_id(const std::string& worker_address);

}  // namespace spade::transport

// In-process loopback transport: endpoints of transports created from one LoopbackFabric exchange messages by
// memcpy. For unit tests of everything above the transport (and of the transport contract itself).
//
// Behaviour follows transport/transport.h with rendezvous semantics for every message: a send stays PENDING
// until the peer posts the matching receive, then the data is copied and both complete. Progress is inline
// (whoever posts the second half of a match performs the copy); no threads.
//
// Failure simulation:
//   * LoopbackFabric::kill(address, reason) simulates the death of the process owning that transport: every
//   endpoint
//     connected to it fails with "peer <name> died: <reason>" (pending and future operations); its own
//     endpoints fail with "transport closed". Destroying a Transport does the same.
//   * Endpoint::abort(reason) (or destroying an Endpoint) breaks the connection in both directions.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"

namespace spade::transport {

class LoopbackFabric {
 public:
  static std::shared_ptr<LoopbackFabric> create();
  virtual ~LoopbackFabric() = default;

  /// A transport attached to this fabric; `name` labels it in logs. local_address() is
  /// "loopback:<fabric>:<node>".
  virtual std::unique_ptr<Transport> make_transport(const std::string& name) = 0;

  /// Simulates the death of the process owning the transport at `address` (see above). Throws spade::Error
  /// for an unknown address.
  virtual void kill(const std::string& address, const std::string& reason) = 0;
};

}  // namespace spade::transport

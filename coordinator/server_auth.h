// Internal to the coordinator server: admission of new connections. The coordinator's side of the
// challenge-response of coordinator/auth.h (AuthHello -> AuthChallenge; AuthProof checked in constant time ->
// Connections::admit), and the refusal of connections that fail it or send what they may not before
// admission. Every refusal is logged with the peer's address and counted in
// ServerContext::rejected_connections. Io thread only.
#pragma once

#include <string>

#include "common/proto/coordinator.pb.h"
#include "coordinator/server_connection.h"
#include "coordinator/server_internal.h"

namespace spade::coord {

class Authenticator {
 public:
  /// Keeps references to both arguments; they must outlive this object.
  Authenticator(ServerContext& ctx, Connections& conns);

  /// A cluster secret is configured: connections must authenticate before they register.
  bool required() const { return !ctx_.opts.cluster_secret.empty(); }

  /// AuthHello from unadmitted `c`: answers AuthChallenge (a fresh nonce and the coordinator's proof).
  /// Refuses `c` when no secret is configured (the two sides disagree), on a second hello, or on a nonce of
  /// the wrong size.
  void on_hello(const ConnPtr& c, const proto::AuthHello& hello);
  /// AuthProof from `c`: admits it when the proof matches; refuses it otherwise, or when no challenge was
  /// sent.
  void on_proof(const ConnPtr& c, const proto::AuthProof& proof);
  /// Refuses unadmitted `c`: logs `error` with the peer's address, answers RegisterReply{error} (what a
  /// legitimate peer reports), closes `c` gracefully and counts it.
  void refuse(const ConnPtr& c, const std::string& error);
  /// Drops frame `env`, which `c` may not send before admission: logged, `c` closed at once, counted.
  void drop(const ConnPtr& c, const proto::Envelope& env);

 private:
  ServerContext& ctx_;
  Connections& conns_;
};

}  // namespace spade::coord

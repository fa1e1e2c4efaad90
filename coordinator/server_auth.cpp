#include "coordinator/server_auth.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "coordinator/auth.h"

namespace spade::coord {

Authenticator::Authenticator(ServerContext& ctx, Connections& conns) : ctx_(ctx), conns_(conns) {}

void Authenticator::refuse(const ConnPtr& c, const std::string& error) {
  if (!c->open || c->close_after_flush) return;
  ++ctx_.rejected_connections;
  spdlog::warn("coordinator: refusing connection from {}: {}", c->remote, error);
  proto::Envelope out;
  out.mutable_register_reply()->set_error(error);
  conns_.send(c, out);
  conns_.close_gracefully(c);
}

void Authenticator::drop(const ConnPtr& c, const proto::Envelope& env) {
  ++ctx_.rejected_connections;
  const char* before = required() ? "before authenticating" : "before registering";
  spdlog::warn(
      "coordinator: dropping {} frame from unauthenticated connection {}: not allowed {}; closing it",
      proto::envelope_case_name(env), c->remote, before);
  conns_.close(c, fmt::format("protocol error: {} {}", proto::envelope_case_name(env), before));
}

void Authenticator::on_hello(const ConnPtr& c, const proto::AuthHello& hello) {
  if (!required()) {
    return refuse(
        c,
        "this coordinator has no cluster secret but the peer authenticates with one: give both sides the "
        "same secret (--cluster-secret-file / SPADE_CLUSTER_SECRET_FILE) or neither");
  }
  if (c->auth_step != Conn::AuthStep::kAwaitHello) return refuse(c, "protocol error: a second auth_hello");
  if (hello.client_nonce().size() != kAuthNonceBytes) {
    return refuse(c, fmt::format("protocol error: auth_hello nonce of {} bytes (expected {})",
                                 hello.client_nonce().size(), kAuthNonceBytes));
  }
  c->client_nonce = hello.client_nonce();
  c->server_nonce = auth_nonce();
  c->auth_step = Conn::AuthStep::kAwaitProof;
  proto::Envelope out;
  auto* ch = out.mutable_auth_challenge();
  ch->set_server_nonce(c->server_nonce);
  ch->set_server_proof(coordinator_proof(ctx_.opts.cluster_secret, c->client_nonce, c->server_nonce));
  conns_.send(c, out);
}

void Authenticator::on_proof(const ConnPtr& c, const proto::AuthProof& proof) {
  if (!required() || c->auth_step != Conn::AuthStep::kAwaitProof) {
    return refuse(c, "protocol error: auth_proof without a preceding auth_hello");
  }
  const std::string expected = peer_proof(ctx_.opts.cluster_secret, c->server_nonce, c->client_nonce);
  if (!proof_matches(expected, proof.client_proof())) {
    return refuse(c,
                  "authentication failed: the peer's proof does not match this coordinator's cluster secret "
                  "(the two sides were given different secrets)");
  }
  conns_.admit(c);
  spdlog::debug("coordinator: {} authenticated", c->remote);
}

}  // namespace spade::coord

// Authentication of control connections with a shared cluster secret: the proofs of the challenge-response
// that opens every connection to a coordinator that has a secret (common/proto/coordinator.proto, AuthHello /
// AuthChallenge / AuthProof; docs/DEPLOY.md, "Security model").
//
//   peer -> coordinator   AuthHello{client_nonce}
//   coordinator -> peer   AuthChallenge{server_nonce, coordinator_proof(K, client_nonce, server_nonce)}
//   peer -> coordinator   AuthProof{peer_proof(K, server_nonce, client_nonce)}
//
// Each proof is HMAC-SHA256 keyed with the secret K over a role label and both nonces, so the secret never
// crosses the wire, a proof is only good for the connection whose nonces it covers, and a coordinator's proof
// cannot be replayed as a peer's (different labels). Proofs are compared in constant time (CRYPTO_memcmp).
// OpenSSL libcrypto.
#pragma once

#include <cstddef>
#include <string>

namespace spade::coord {

/// Bytes of a nonce (AuthHello.client_nonce, AuthChallenge.server_nonce).
inline constexpr size_t kAuthNonceBytes = 32;
/// Bytes of a proof (HMAC-SHA256).
inline constexpr size_t kAuthProofBytes = 32;

/// kAuthNonceBytes bytes from OpenSSL's CSPRNG. Throws spade::Error when it has no entropy.
std::string auth_nonce();

/// The coordinator's proof: HMAC-SHA256(secret, "spade control coordinator proof v1" || client_nonce ||
/// server_nonce), kAuthProofBytes bytes.
std::string coordinator_proof(const std::string& secret, const std::string& client_nonce,
                              const std::string& server_nonce);

/// The peer's proof: HMAC-SHA256(secret, "spade control peer proof v1" || server_nonce || client_nonce).
std::string peer_proof(const std::string& secret, const std::string& server_nonce,
                       const std::string& client_nonce);

/// True when `got` equals `expected`, compared in constant time; false when the lengths differ.
bool proof_matches(const std::string& expected, const std::string& got);

}  // namespace spade::coord

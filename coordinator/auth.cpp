#include "coordinator/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "common/error.h"

namespace spade::coord {
namespace {

std::string hmac_sha256(const std::string& key, const std::string& label, const std::string& a,
                        const std::string& b) {
  const std::string msg = label + a + b;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len);
  SPADE_CHECK(r != nullptr && len == kAuthProofBytes, "HMAC-SHA256 failed (OpenSSL libcrypto)");
  return std::string(reinterpret_cast<const char*>(out), len);
}

}  // namespace

std::string auth_nonce() {
  std::string n(kAuthNonceBytes, '\0');
  SPADE_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) == 1,
              "cannot draw an authentication nonce: OpenSSL's random generator has no entropy");
  return n;
}

std::string coordinator_proof(const std::string& secret, const std::string& client_nonce,
                              const std::string& server_nonce) {
  return hmac_sha256(secret, "spade control coordinator proof v1", client_nonce, server_nonce);
}

std::string peer_proof(const std::string& secret, const std::string& server_nonce,
                       const std::string& client_nonce) {
  return hmac_sha256(secret, "spade control peer proof v1", server_nonce, client_nonce);
}

bool proof_matches(const std::string& expected, const std::string& got) {
  return expected.size() == got.size() && CRYPTO_memcmp(expected.data(), got.data(), expected.size()) == 0;
}

}  // namespace spade::coord

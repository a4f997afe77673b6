#include "ps/auth.h"

#include <cstdlib>
#include <cstring>
#include <random>

#include "shoal/env.h"

namespace shoal::ps {
namespace {
// Domain separation: an answer computed here is useless for any other protocol using the token.
constexpr char kContext[] = "shoal-ps-auth-v1";
constexpr char kGateContext[] = "shoal-ps-gate-v1";
}  // namespace

std::string auth_token_from_env() {
  return env::text(env::Var::kAuthToken).value_or("");
}

Challenge make_challenge() {
  std::random_device device;
  Challenge challenge;
  for (size_t i = 0; i < challenge.size(); i += 4) {
    const uint32_t word = device();
    std::memcpy(challenge.data() + i, &word, 4);
  }
  return challenge;
}

Digest auth_response(std::string_view token, const Challenge& challenge) {
  uint8_t message[sizeof(kContext) - 1 + 32];
  std::memcpy(message, kContext, sizeof(kContext) - 1);
  std::memcpy(message + sizeof(kContext) - 1, challenge.data(), challenge.size());
  return security::hmac_sha256(token, std::string_view(reinterpret_cast<const char*>(message), sizeof(message)));
}

std::string gate_password(std::string_view token) {
  static const char* kHex = "0123456789abcdef";
  const Digest digest = security::hmac_sha256(token, kGateContext);
  std::string out;
  for (uint8_t c : digest) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

bool check_auth_response(std::string_view token, const Challenge& challenge,
                         const Digest& response) {
  return security::digests_equal(auth_response(token, challenge), response);
}

}  // namespace shoal::ps

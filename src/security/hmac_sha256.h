// SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104), for the job token's challenge/response
// (auth_token.h). LibTorch ships no HMAC and Shoal takes no crypto library for these ~100 lines;
// tests/security checks them against the RFC 4231 and NIST vectors.
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace shoal::security {

using Digest = std::array<uint8_t, 32>;

/// SHA-256 of `data`.
Digest sha256(std::string_view data);

/// HMAC-SHA-256 of `message` under `key`.
Digest hmac_sha256(std::string_view key, std::string_view message);

/// Compares two digests in time independent of where they differ.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace shoal::security

// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the parameter server's challenge/response
// authentication (auth.h). Small and dependency-free so that the token check needs no crypto
// library; checked against Python's hashlib/hmac in tests/ps.
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shoal::ps {

using Digest = std::array<uint8_t, 32>;

/// SHA-256 of `size` bytes at `data`.
Digest sha256(const void* data, size_t size);

/// HMAC-SHA256 of `message` under `key`.
Digest hmac_sha256(std::string_view key, const void* message, size_t size);

/// True when the two digests are equal, in time independent of where they differ.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace shoal::ps

// Peer authentication for the parameter server: an HMAC-SHA256 challenge/response over the
// shared token SHOAL_AUTH_TOKEN.
//
// Why this and not ZeroMQ's mechanisms: PLAIN sends the token in clear on every connection;
// CURVE needs a key pair per peer and a key distribution story (and a libzmq built with
// libsodium), while the job has one shared secret. Here the server sends a fresh 32-byte random
// challenge on each connection and the peer answers HMAC-SHA256(token, context || challenge):
// the token never crosses the network and an answer cannot be replayed on another connection
// (ZeroMQ binds the routing identity, hence the authenticated state, to one TCP connection).
// Not provided: encryption or per-message integrity after the handshake.
//
// A gate before that, so that strangers cannot make the server buffer anything: libzmq assembles
// a multipart message in its own memory before the application sees any of it, and
// ZMQ_MAXMSGSIZE bounds a frame, not a message, so an unauthenticated peer could park gigabytes
// of unfinished messages in the server. With a token, the server's socket therefore runs
// ZeroMQ's PLAIN mechanism with a ZAP handler (zap_gate.h) that admits only connections whose
// password is gate_password(token): an HMAC of the token, so the token itself still never crosses
// the network. A stranger's connection is closed in ZeroMQ's handshake, before it can send a
// message; the gate password is static (one who records a job's traffic can replay it), which is
// why the challenge above stays the authentication proper.
//
// Everything that decides whether a peer is let in is in this file (check_auth_response), so
// that the rendezvous store and other listeners can share the same check later.
//
// Thread safety: pure functions (make_challenge reads std::random_device).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "security/hmac_sha256.h"

namespace shoal::ps {

using security::Digest;

using Challenge = std::array<uint8_t, 32>;

/// The job's shared token: $SHOAL_AUTH_TOKEN, or empty (authentication off).
std::string auth_token_from_env();

/// 32 fresh random bytes.
Challenge make_challenge();

/// What a peer that knows `token` answers to `challenge` (HMAC-SHA256 of a fixed context string
/// followed by the challenge; the context keeps answers from being valid for another protocol).
Digest auth_response(std::string_view token, const Challenge& challenge);

/// The user name and password a worker presents to the server's ZAP gate (PLAIN mechanism).
constexpr const char* kGateUser = "shoal-ps";
std::string gate_password(std::string_view token);

/// True when `response` proves knowledge of `token` for `challenge` (constant-time compare).
bool check_auth_response(std::string_view token, const Challenge& challenge,
                         const Digest& response);

}  // namespace shoal::ps

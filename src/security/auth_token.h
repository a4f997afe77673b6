// The job's secret and the handshake every Shoal listener and client runs before anything else.
//
// A job has one token: `shoal run` makes one (generate_token) and hands it to its workers in
// SHOAL_AUTH_TOKEN; jobs started by other launchers (torchrun, mpirun, srun) set SHOAL_AUTH_TOKEN
// themselves to the same value on every rank. The token never crosses the network: each side
// proves it knows it with HMAC-SHA-256 over both sides' fresh nonces and the purpose of the
// connection ("store", "ps", ...), so a recorded handshake cannot be replayed, and a client also
// learns that the listener it reached belongs to its own job (not a stranger on MASTER_PORT).
//
// Wire (client C, server S; nonces 32 random bytes, macs 32 bytes):
//   C -> S  "SHOALAU1" nonce_c
//   S -> C  nonce_s  HMAC(token, "server" purpose nonce_c nonce_s)
//   C -> S  HMAC(token, "client" purpose nonce_c nonce_s)
//   S -> C  'A'
// Each read and write runs under the caller's deadline; a peer that is silent, slow or wrong is
// dropped by the server (accept_peer returns false) and reported by the client (PeerError /
// TimeoutError naming the endpoint). Without a token (empty) the handshake still runs and still
// filters strangers that do not speak it, but anyone who does is let in: see docs/RELIABILITY.md.
//
// Thread safety: free functions; one handshake per socket at a time.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "security/socket_io.h"

namespace shoal::security {

/// Environment variable holding the job's token.
constexpr const char* kTokenEnv = "SHOAL_AUTH_TOKEN";

/// How long a server gives a new connection to complete the handshake: a peer of the job answers
/// in microseconds; a stranger that stays silent is dropped after this.
constexpr std::chrono::milliseconds kHandshakeTimeout{2000};

/// A fresh token: 32 random bytes from the kernel (getrandom), as 64 hex digits.
std::string generate_token();

/// SHOAL_AUTH_TOKEN, or "" when unset.
std::string token_from_env();

/// `n` random bytes from the kernel.
std::string random_bytes(size_t n);

/// Runs the client side on the connected socket `fd`; returns when the server proved it knows
/// `token` and accepted ours. Throws PeerError (wrong token either way, closed connection) or
/// TimeoutError, each naming `endpoint` ("10.0.0.7:29500").
void authenticate_to_server(int fd, std::string_view token, std::string_view purpose,
                            const std::string& endpoint, Deadline deadline);

/// As authenticate_to_server, but returns false instead of throwing when the listener closed the
/// connection before answering the greeting: a busy listener (all its handshake slots taken, by
/// strangers say) drops its oldest connection, and the caller may connect again.
bool try_authenticate_to_server(int fd, std::string_view token, std::string_view purpose,
                                const std::string& endpoint, Deadline deadline);

/// Runs the server side on the accepted socket `fd`; true when the peer proved it knows `token`.
/// Never throws for anything the peer does; `why` (when given) says why a peer was refused.
bool accept_peer(int fd, std::string_view token, std::string_view purpose, Deadline deadline,
                 std::string* why = nullptr);

}  // namespace shoal::security

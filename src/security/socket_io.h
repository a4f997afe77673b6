// Sockets with deadlines: the one place where Shoal's listeners bind and its clients connect, and
// where every read and write on them is bounded in time (see auth_token.h for the handshake that
// follows every connection).
//
// Thread safety: free functions; a socket is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace shoal::security {

using Deadline = std::chrono::steady_clock::time_point;

enum class Io { kOk, kTimeout, kClosed, kError };

/// Reads exactly `size` bytes unless the deadline passes or the peer closes.
Io read_exact(int fd, void* out, size_t size, Deadline deadline);
/// Writes all `size` bytes (MSG_NOSIGNAL) unless the deadline passes or the peer closes.
Io write_all(int fd, const void* data, size_t size, Deadline deadline);

/// A listening TCP socket bound to `host`:`port` only (port 0: any free one). `host` is resolved;
/// it must be an address of this machine. Throws PeerError naming the address and what to do.
int listen_on(const std::string& host, int port, int backlog = 128);

/// The port a bound socket listens on.
int bound_port(int fd);

/// A connected TCP socket to `host`:`port`. Refused or unreachable attempts are retried until the
/// deadline (the listener may not be up yet); then TimeoutError names the endpoint and the last
/// error.
int connect_to(const std::string& host, int port, Deadline deadline);

/// Milliseconds left until `deadline` (0 when past), clamped for poll().
int remaining_ms(Deadline deadline);

}  // namespace shoal::security

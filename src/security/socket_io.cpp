#include "security/socket_io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "shoal/error.h"

namespace shoal::security {
namespace {

Io wait_for(int fd, short events, Deadline deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Io::kError;
    if (n == 0) return Io::kTimeout;
    return Io::kOk;
  }
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list != nullptr) ::freeaddrinfo(list);
  }
};

std::string endpoint(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace

int remaining_ms(Deadline deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

Io read_exact(int fd, void* out, size_t size, Deadline deadline) {
  auto* p = static_cast<char*>(out);
  size_t done = 0;
  while (done < size) {
    const Io ready = wait_for(fd, POLLIN, deadline);
    if (ready != Io::kOk) return ready;
    const ssize_t n = ::recv(fd, p + done, size - done, MSG_DONTWAIT);
    if (n == 0) return Io::kClosed;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errno == ECONNRESET ? Io::kClosed : Io::kError;
    }
    done += static_cast<size_t>(n);
  }
  return Io::kOk;
}

Io write_all(int fd, const void* data, size_t size, Deadline deadline) {
  const auto* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < size) {
    const Io ready = wait_for(fd, POLLOUT, deadline);
    if (ready != Io::kOk) return ready;
    const ssize_t n = ::send(fd, p + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errno == EPIPE || errno == ECONNRESET ? Io::kClosed : Io::kError;
    }
    done += static_cast<size_t>(n);
  }
  return Io::kOk;
}

int listen_on(const std::string& host, int port, int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  AddrInfo found;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found.list);
  SHOAL_CHECK_T(PeerError, rc == 0, "cannot listen on ", endpoint(host, port), ": the address does not resolve (",
                ::gai_strerror(rc), ")");
  std::string last = "no address";
  for (addrinfo* a = found.list; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) return fd;
    const int err = errno;
    ::close(fd);
    if (err == EADDRINUSE) {
      SHOAL_THROW(PeerError, "cannot listen on ", endpoint(host, port),
                  ": the port is in use (by another job?); choose another MASTER_PORT (--master-port), "
                  "or 0 for a free one");
    }
    if (err == EADDRNOTAVAIL) {
      SHOAL_THROW(PeerError, "cannot listen on ", endpoint(host, port), ": ", host,
                  " is not an address of this machine; MASTER_ADDR must name the host rank 0 runs on");
    }
    last = std::strerror(err);
  }
  SHOAL_THROW(PeerError, "cannot listen on ", endpoint(host, port), ": ", last);
}

int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t size = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size) != 0) return -1;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

int connect_to(const std::string& host, int port, Deadline deadline) {
  // Retry often enough that a rank started just before rank 0 connects at once, rarely enough
  // not to spin.
  constexpr std::chrono::milliseconds kRetry{50};
  std::string last = "no attempt";
  do {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    AddrInfo found;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found.list);
    if (rc != 0) {
      last = std::string("the address does not resolve (") + ::gai_strerror(rc) + ")";
    }
    for (addrinfo* a = rc == 0 ? found.list : nullptr; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      int err = 0;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          const int n = ::poll(&p, 1, remaining_ms(deadline));
          socklen_t len = sizeof(err);
          if (n <= 0) {
            err = ETIMEDOUT;
          } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
            err = errno;
          }
        }
      }
      if (err == 0) {
        const int flags = ::fcntl(fd, F_GETFL);
        ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      ::close(fd);
      last = err == ECONNREFUSED ? "connection refused: nothing listens there yet" : std::strerror(err);
    }
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        kRetry, std::chrono::milliseconds(remaining_ms(deadline))));
  } while (std::chrono::steady_clock::now() < deadline);
  SHOAL_THROW(TimeoutError, "cannot reach ", endpoint(host, port), " (", last,
              "): is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank? "
              "(SHOAL_TIMEOUT sets how long to wait, in seconds)");
}

}  // namespace shoal::security

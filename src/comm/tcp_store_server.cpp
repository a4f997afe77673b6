#include "comm/tcp_store_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "comm/tcp_store_wire.h"
#include "security/auth_token.h"
#include "security/socket_io.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm {
namespace {

// Connections allowed to be in their handshake at once. A job has one connection per rank (plus a
// few per backend) and each finishes its handshake in microseconds; the cap stops a flood of
// silent connections from starting a thread each. Beyond it the oldest is dropped.
constexpr size_t kMaxHandshakes = 64;
// Handshake threads that may exist at once (running, or shut down and ending): beyond this a new
// connection is closed at once. Dropped handshakes end within microseconds, so this is only
// reached when connections arrive faster than threads end.
constexpr size_t kMaxHandshakeThreads = 2 * kMaxHandshakes;
// A reply to an authenticated client that stops reading is abandoned after this.
constexpr std::chrono::seconds kReplyTimeout{30};

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, int port, std::string token)
    : token_(std::move(token)) {
  listen_fd_ = security::listen_on(host, port);
  port_ = security::bound_port(listen_fd_);
  SHOAL_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, "TCP store: pipe: ", std::strerror(errno));
  thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  stop_ = true;
  const char byte = 0;
  (void)!::write(wake_[1], &byte, 1);
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    for (auto& [id, h] : handshakes_) {
      if (h.running) ::shutdown(h.fd, SHUT_RDWR);  // ends their handshakes at once
    }
  }
  if (thread_.joinable()) thread_.join();
  // serve() has ended, so the map no longer changes shape: the threads still look their entries
  // up (under the mutex) while they are joined here.
  for (auto& [id, h] : handshakes_) h.thread.join();
  for (int fd : authenticated_) ::close(fd);
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void TcpStoreServer::handshake(uint64_t id, int fd) {
  const auto deadline = std::chrono::steady_clock::now() + security::kHandshakeTimeout;
  const bool ok = security::accept_peer(fd, token_, "store", deadline);
  std::lock_guard<std::mutex> lock(pending_mutex_);
  Handshake& h = handshakes_.at(id);
  h.running = false;
  if (ok && !stop_ && !h.dropped) {
    authenticated_.push_back(fd);
  } else {
    ::close(fd);
    ++refused_;
  }
  finished_.push_back(id);
  const char byte = 1;
  (void)!::write(wake_[1], &byte, 1);  // serve() joins this thread now
}

void TcpStoreServer::reap_finished() {
  std::vector<std::thread> ended;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    for (uint64_t id : finished_) {
      auto found = handshakes_.find(id);
      if (found == handshakes_.end()) continue;
      ended.push_back(std::move(found->second.thread));
      handshakes_.erase(found);
    }
    finished_.clear();
  }
  for (auto& t : ended) t.join();  // each has left handshake(): returns at once
}

void TcpStoreServer::accept_one() {
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return;
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::string note;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    if (handshakes_.size() >= kMaxHandshakeThreads) {
      ::close(fd);
      ++refused_;
      note = "closed a new connection at once: " + std::to_string(handshakes_.size()) +
             " handshake threads are still ending";
    } else {
      size_t in_handshake = 0;
      for (const auto& [id, h] : handshakes_) in_handshake += h.running && !h.dropped;
      if (in_handshake >= kMaxHandshakes) {
        for (auto& [id, h] : handshakes_) {  // ascending ids: the oldest first
          if (!h.running || h.dropped) continue;
          h.dropped = true;
          ::shutdown(h.fd, SHUT_RDWR);  // its thread fails the handshake and ends
          ++dropped_;
          note = "dropped the oldest connection still in its handshake (" +
                 std::to_string(kMaxHandshakes) + " were, the most allowed at once)";
          break;
        }
      }
      const uint64_t id = next_id_++;
      Handshake& h = handshakes_[id];
      h.fd = fd;
      h.thread = std::thread([this, id, fd] { handshake(id, fd); });
    }
  }
  if (int64_t held = 0; !note.empty() && drop_log_.allow(&held)) {
    log::warn("TCP store on port ", port_, ": ", note,
              ": connections that do not finish Shoal's handshake are flooding the store's port "
              "(strangers?); the job's ranks connect again and get in",
              drop_log_.held_note(held));
  }
}

void TcpStoreServer::serve() {
  std::vector<Client> clients;
  while (!stop_) {
    std::vector<pollfd> fds;
    fds.push_back({listen_fd_, POLLIN, 0});
    fds.push_back({wake_[0], POLLIN, 0});
    for (const auto& c : clients) fds.push_back({c.fd, POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0 && errno != EINTR) break;
    if (stop_) break;
    if (fds[1].revents != 0) {
      char drain[64];
      while (::read(wake_[0], drain, sizeof(drain)) > 0) {
      }
      reap_finished();
      std::lock_guard<std::mutex> lock(pending_mutex_);
      for (int fd : authenticated_) clients.push_back(Client{fd, {}});
      authenticated_.clear();
    }
    if (fds[0].revents & POLLIN) accept_one();
    // Clients first seen in this round are not in `fds`; they are polled from the next one.
    std::vector<Client> kept;
    for (size_t i = 0; i < clients.size(); ++i) {
      Client& c = clients[i];
      const bool polled = i + 2 < fds.size() && fds[i + 2].fd == c.fd;
      if (polled && fds[i + 2].revents != 0 && !handle(c)) {
        ::close(c.fd);
        continue;
      }
      kept.push_back(std::move(c));
    }
    clients.swap(kept);
  }
  for (const auto& c : clients) ::close(c.fd);
}

bool TcpStoreServer::handle(Client& client) {
  uint8_t buffer[64 * 1024];
  const ssize_t n = ::recv(client.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  client.in.insert(client.in.end(), buffer, buffer + n);
  while (client.in.size() >= 4) {
    wire::Reader header(client.in.data(), 4);
    const uint32_t size = header.u32();
    if (size == 0 || size > wire::kMaxFrame) return false;
    if (client.in.size() < 4 + size) break;
    bool ok = true;
    const std::vector<uint8_t> body = wire::execute(data_, client.in.data() + 4, size, &ok);
    if (!ok) return false;
    std::vector<uint8_t> reply;
    wire::put_u32(reply, static_cast<uint32_t>(body.size()));
    reply.insert(reply.end(), body.begin(), body.end());
    const auto deadline = std::chrono::steady_clock::now() + kReplyTimeout;
    if (security::write_all(client.fd, reply.data(), reply.size(), deadline) != security::Io::kOk) return false;
    client.in.erase(client.in.begin(), client.in.begin() + 4 + size);
  }
  return true;
}

}  // namespace shoal::comm

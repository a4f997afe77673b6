// TcpStoreServer: the rendezvous store's listener, run by rank 0 (inside its TcpStore).
//
// It binds to the configured address only (MASTER_ADDR; loopback for a one-host job), and lets a
// connection in only after the job-token handshake (security/auth_token.h), run on a short-lived
// thread per connection under kHandshakeTimeout: a stranger that connects and says nothing, or
// the wrong thing, is dropped without the store's clients noticing. Authenticated clients are
// served by one thread with poll(); requests are length-prefixed frames (tcp_store_wire.h),
// bounded in size before anything is allocated.
//
// Thread safety: the constructor starts the threads, the destructor stops and joins them.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace shoal::comm {

class TcpStoreServer {
 public:
  /// Listens on `host`:`port` (0: a free port, see port()). Throws PeerError when it cannot.
  TcpStoreServer(const std::string& host, int port, std::string token);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }
  /// Connections refused so far (wrong token, silence, garbage): for tests and diagnostics.
  int refused() const { return refused_.load(); }

 private:
  struct Client {
    int fd;
    std::vector<uint8_t> in;
  };
  void serve();
  void handshake(int fd);
  bool handle(Client& client);  // false: drop the client

  std::string token_;
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0};
  std::thread thread_;

  std::mutex pending_mutex_;
  std::set<int> handshaking_;         // fds in a handshake (shut down on stop)
  std::vector<int> authenticated_;    // handed from handshake threads to serve()
  std::vector<std::thread> handshakes_;

  std::map<std::string, std::vector<uint8_t>> data_;  // serve() thread only (a wire::Table)
};

}  // namespace shoal::comm

// TcpStoreServer: the rendezvous store's listener, run by rank 0 (inside its TcpStore).
//
// It binds to the configured address only (MASTER_ADDR; loopback for a one-host job), and lets a
// connection in only after the job-token handshake (security/auth_token.h), run on a short-lived
// thread per connection under kHandshakeTimeout: a stranger that connects and says nothing, or
// the wrong thing, is dropped without the store's clients noticing. Authenticated clients are
// served by one thread with poll(); requests are length-prefixed frames (tcp_store_wire.h),
// bounded in size before anything is allocated.
//
// Budgets, so that strangers cannot starve the job's ranks or grow rank 0: at most
// kMaxHandshakes connections are in their handshake at once; a new connection beyond that drops
// the oldest one still in its handshake (a rank answers in microseconds, a stranger holding a
// slot is the oldest), and the client of a dropped connection connects again (TcpStore). A
// finished handshake's thread is joined as soon as it ends, so threads (and their stacks) never
// pile up; at most 2 x kMaxHandshakes exist at once, beyond which a new connection is closed.
// What was dropped is logged (warn), at most a few lines a second.
//
// Thread safety: the constructor starts the threads, the destructor stops and joins them.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "log/rate_limiter.h"

namespace shoal::comm {

class TcpStoreServer {
 public:
  /// Listens on `host`:`port` (0: a free port, see port()). Throws PeerError when it cannot.
  TcpStoreServer(const std::string& host, int port, std::string token);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }
  /// Connections refused so far (wrong token, silence, garbage, dropped for a newer one, over the
  /// thread budget): for tests and diagnostics.
  int refused() const { return refused_.load(); }
  /// Of those, the connections dropped while in their handshake to make room for a newer one.
  int dropped() const { return dropped_.load(); }

 private:
  struct Client {
    int fd;
    std::vector<uint8_t> in;
  };
  struct Handshake {
    int fd = -1;
    bool running = true;  // false once the thread has left handshake(); then it is joined
    bool dropped = false;  // shut down to make room for a newer connection
    std::thread thread;
  };
  void serve();
  void accept_one();
  void handshake(uint64_t id, int fd);
  void reap_finished();
  bool handle(Client& client);  // false: drop the client

  std::string token_;
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0};
  std::atomic<int> dropped_{0};
  std::thread thread_;
  log::RateLimiter drop_log_{2};

  std::mutex pending_mutex_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Handshake> handshakes_;  // by id: ascending ids are oldest first
  std::vector<uint64_t> finished_;            // handshake threads that have ended, to be joined
  std::vector<int> authenticated_;            // handed from handshake threads to serve()

  std::map<std::string, std::vector<uint8_t>> data_;  // serve() thread only (a wire::Table)
};

}  // namespace shoal::comm

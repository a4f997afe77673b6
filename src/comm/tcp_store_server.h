// TcpStoreServer: the rendezvous store's listener, run by rank 0 (inside its TcpStore).
//
// It binds to the configured address only (MASTER_ADDR; loopback for a one-host job), and lets a
// connection in only after the job-token handshake (security/auth_token.h), run on a short-lived
// thread per connection under kHandshakeTimeout: a stranger that connects and says nothing, or
// the wrong thing, is dropped without the store's clients noticing. Authenticated clients are
// served by one thread with an epoll event loop: the kernel keeps the interest set, so a wake-up
// costs the ready connections only, not all of them (thousands at a time, one per rank); epoll
// itself rather than a library such as libuv, because the loop is small and Linux is the only
// platform Shoal runs on. Requests are length-prefixed frames (tcp_store_wire.h), bounded in size
// before anything is allocated.
//
// Waits are served here: a kWait or kMultiGet request whose keys are missing is parked on its
// first missing key and answered when the keys exist or its time-out passes, so that a client
// waiting for a key sends one request, not a poll loop. A client's requests run in order: while
// one is parked, or its reply is unsent (a client that does not read), nothing more is read from
// it. A reply left unsent for kReplyTimeout drops the client.
//
// Budgets, so that strangers cannot starve the job's ranks or grow rank 0: at most
// kMaxHandshakes connections are in their handshake at once; beyond that, new connections wait in
// the kernel's listen backlog until one ends, or until the oldest has been in its handshake for
// kYoungHandshake, which is then dropped for a newer one (a rank answers in microseconds, a
// stranger holding a slot is the oldest); the client of a dropped connection connects again
// (TcpStore). Thousands of ranks connecting at once thus queue rather than drop each other. A
// finished handshake's thread is joined as soon as it ends, so threads (and their stacks) never
// pile up; at most 2 x kMaxHandshakes exist at once, beyond which a new connection is closed.
// What was dropped is logged (warn), at most a few lines a second.
//
// Requests are counted by op (request_counts()), for tests and benchmarks of the rendezvous.
//
// Thread safety: the constructor starts the threads, the destructor stops and joins them; the
// counters may be read from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "comm/tcp_store_wire.h"
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

  /// Requests served so far, by op (wire::Op; index 0 counts nothing).
  using RequestCounts = std::array<uint64_t, wire::kOpCount>;
  RequestCounts request_counts() const;
  /// The sum of request_counts().
  uint64_t total_requests() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Client {
    uint64_t id = 0;
    int fd = -1;
    std::vector<uint8_t> in;
    size_t in_used = 0;         // bytes of `in` already executed
    std::vector<uint8_t> out;   // reply bytes not yet sent
    size_t out_sent = 0;
    Clock::time_point out_since;
    uint64_t waiter = 0;        // its parked wait request, 0 when none
    uint32_t interest = 0;      // the epoll events it is registered for
  };
  struct Waiter {
    uint64_t client = 0;
    wire::WaitRequest request;
    size_t missing = 0;  // the key it is parked on (an index into request.keys)
    Clock::time_point deadline;
  };
  struct Handshake {
    int fd = -1;
    bool running = true;  // false once the thread has left handshake(); then it is joined
    bool dropped = false;  // shut down to make room for a newer connection
    std::chrono::steady_clock::time_point started;
    std::thread thread;
  };
  void serve();
  void accept_ready();
  void accept_one(int fd);
  bool room_for_handshake();
  void set_accepting(bool on);
  void handshake(uint64_t id, int fd);
  void reap_finished();
  void adopt_authenticated();
  void on_event(uint64_t id, uint32_t events);
  bool read_from(Client& client);      // false: drop the client
  bool run_requests(Client& client);   // false: drop the client
  bool run_request(Client& client, const uint8_t* body, uint32_t size);
  void park(uint64_t client_id, wire::WaitRequest request, size_t missing);
  void on_changed(const std::string& key);
  void finish_wait(uint64_t waiter_id, bool ready);
  void unpark(uint64_t waiter_id);
  void reply(Client& client, const std::vector<uint8_t>& body);
  bool flush(Client& client);          // false: drop the client
  void update_interest(uint64_t id, Client& client);
  void drop(uint64_t id);
  void expire(Clock::time_point now);
  void resume_answered();
  int next_timeout_ms(Clock::time_point now) const;

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

  std::array<std::atomic<uint64_t>, wire::kOpCount> requests_{};

  // The serve() thread's own.
  int epoll_fd_ = -1;
  bool accepting_ = true;  // the listener is in the epoll set (not while the handshakes are full)
  wire::Table data_;
  uint64_t next_client_ = 1;  // ids 1.. (0: no client), never reused, so stale events are harmless
  std::unordered_map<uint64_t, Client> clients_;
  uint64_t next_waiter_ = 1;
  std::unordered_map<uint64_t, Waiter> waiters_;
  std::unordered_map<std::string, std::vector<uint64_t>> parked_on_;  // key -> waiters
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;        // (deadline, waiter)
  Clock::time_point next_stall_check_;
  std::vector<uint64_t> answered_;  // clients whose wait was answered: they may run more requests
};

}  // namespace shoal::comm

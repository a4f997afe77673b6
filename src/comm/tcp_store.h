// TcpStore: the rendezvous store over TCP (env:// and tcp://), Shoal's own rather than c10d's so
// that it binds to the configured address only and lets in only the job's own processes.
//
// Rank 0 runs the TcpStoreServer (bound to MASTER_ADDR) and every rank, rank 0 included, is a
// client over an authenticated connection (security/auth_token.h). Connecting retries until the
// store's time-out, then names the endpoint; every request is answered within the time-out or
// throws naming the endpoint. wait(), get() and multi_get() are one request each, which the
// server answers when the keys exist or the wait's time-out has passed (no polling).
//
// Thread safety: every method may be called concurrently. A connection carries one request at a
// time; a thread that finds every connection busy (another thread waiting for a key, say) opens
// one more, so that a long wait never holds up another thread's requests.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/comm/store.h"

namespace shoal::comm {

class TcpStoreServer;

class TcpStore : public Store {
 public:
  /// `is_server`: also run the listener (rank 0). `token`: the job's token (SHOAL_AUTH_TOKEN).
  TcpStore(const std::string& host, int port, bool is_server, std::string token, Milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout = kGroupTimeout) override;
  bool delete_key(const std::string& key) override;
  std::vector<std::vector<uint8_t>> multi_get(const std::vector<std::string>& keys) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<uint8_t>>& values) override;
  Milliseconds timeout() const override { return timeout_; }
  void set_timeout(Milliseconds timeout) override { timeout_ = timeout; }

  /// The port the store listens on (the server's, when this rank runs it).
  int port() const { return port_; }
  /// The server, when this rank runs it.
  const TcpStoreServer* server() const { return server_.get(); }

 private:
  /// Sends `body` and returns the reply's body; the reply may take `wait` beyond the time-out.
  std::vector<uint8_t> request(const std::vector<uint8_t>& body, const char* what,
                               Milliseconds wait = Milliseconds(0));
  /// Sends a kWait or kMultiGet request; returns the reply after its "all exist" byte, or throws
  /// TimeoutError naming the keys when the server answered that they did not all exist in time.
  std::vector<uint8_t> wait_request(uint8_t op, const std::vector<std::string>& keys,
                                    Milliseconds timeout, const char* what);
  int connect(std::chrono::steady_clock::time_point deadline);
  int take_connection();
  void give_back(int fd);
  void forget(int fd);

  std::string host_;
  std::string token_;
  std::string endpoint_;
  int port_;
  Milliseconds timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;
  std::vector<int> idle_;  // connections not carrying a request, under mutex_
  std::vector<int> all_;   // every open connection, under mutex_
};

}  // namespace shoal::comm

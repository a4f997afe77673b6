// TcpStore: the rendezvous store over TCP (env:// and tcp://), Shoal's own rather than c10d's so
// that it binds to the configured address only and lets in only the job's own processes.
//
// Rank 0 runs the TcpStoreServer (bound to MASTER_ADDR) and every rank, rank 0 included, is a
// client over one authenticated connection (security/auth_token.h). Connecting retries until the
// store's time-out, then names the endpoint; every request is answered within the time-out or
// throws naming the endpoint; wait() polls check() until its deadline.
//
// Thread safety: every method may be called concurrently (one request on the wire at a time).
#pragma once

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
  Milliseconds timeout() const override { return timeout_; }
  void set_timeout(Milliseconds timeout) override { timeout_ = timeout; }

  /// The port the store listens on (the server's, when this rank runs it).
  int port() const { return port_; }
  /// The server, when this rank runs it.
  const TcpStoreServer* server() const { return server_.get(); }

 private:
  std::vector<uint8_t> request(const std::vector<uint8_t>& frame, const char* what);

  std::string endpoint_;
  int port_;
  Milliseconds timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;
  int fd_ = -1;
};

}  // namespace shoal::comm

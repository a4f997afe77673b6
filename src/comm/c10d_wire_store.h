// C10dWireStore: a client of c10d's TCPStore as PyTorch 2.x serves it (the store of torchrun's
// elastic agent, TORCHELASTIC_USE_AGENT_STORE=True), speaking 2.x's wire protocol itself.
//
// Why: LibTorch 1.13's own client cannot join a 2.x server (2.x added a validation message in front
// of every connection and renumbered the requests), so a Shoal built on 1.13 and started by 2.x's
// torchrun would otherwise have to serve a store of its own on a port nobody reserved for it.
//
// The protocol (c10d's TCPStore, 2.x): the client opens with VALIDATE and a magic number, then
// sends requests, each a one-byte type and fields; strings are a u64 length and bytes (keys with
// "/" in front, as c10d's own client writes them), integers are in the host's byte order.
// Replies: GET a u64 length and bytes, ADD and DELETE_KEY an i64, CHECK one byte (0 ready). Every read and write here has a deadline (the store's time-out),
// every reply length is bounded before anything is allocated, and a connection left mid-reply by
// a time-out is dropped and opened anew for the next request. wait() polls CHECK, so that a
// deadline ends it without a reply left in flight.
//
// Thread safety: every method may be called concurrently (one request on the wire at a time).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/comm/store.h"

namespace shoal::comm {

class C10dWireStore : public Store {
 public:
  /// Connects to host:port (retrying until `timeout` while the server is not up yet) and
  /// validates; throws TimeoutError naming the endpoint when it cannot. `rank`: this process's,
  /// named in every error.
  C10dWireStore(std::string host, int port, int rank, Milliseconds timeout);
  ~C10dWireStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout = kGroupTimeout) override;
  bool delete_key(const std::string& key) override;
  Milliseconds timeout() const override { return timeout_; }
  void set_timeout(Milliseconds timeout) override { timeout_ = timeout; }

  /// The largest value get() accepts from the server (c10d's own servers refuse larger ones).
  static constexpr uint64_t kMaxValue = 64ull << 20;

 private:
  /// Sends `request` and reads `reply_size` bytes of reply (0: none); with `reply_size` < 0 the
  /// reply is a u64 length and that many bytes. Returns the reply. Called with mutex_ held.
  std::vector<uint8_t> exchange(const std::vector<uint8_t>& request, int reply_size, const char* what,
                                const std::string& key);
  void connect_locked();

  std::string host_;
  int port_;
  std::string endpoint_;
  std::string who_;  // "[rank R] "
  Milliseconds timeout_;
  std::mutex mutex_;
  int fd_ = -1;
};

}  // namespace shoal::comm

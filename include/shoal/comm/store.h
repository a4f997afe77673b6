// Store: the key-value rendezvous that ranks meet through (torch.distributed's Store).
//
// Implementations: an in-process hash store (one thread per rank), a file store (processes on one
// host or a shared file system), a TCP store (rank 0 serves, the others connect). Every blocking
// call waits at most the store's time-out and then throws TimeoutError naming the keys.
//
// Thread safety: every method may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/types.h"

namespace shoal::comm {

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  /// Waits (up to timeout()) for `key` to exist, then returns its value.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  /// Atomically adds `delta` to the integer at `key` (0 when absent) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// True when every key exists. Never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  /// Waits for every key to exist; throws TimeoutError after `timeout` (kGroupTimeout: the store's).
  virtual void wait(const std::vector<std::string>& keys, Milliseconds timeout = kGroupTimeout) = 0;
  virtual bool delete_key(const std::string& key) = 0;

  /// Waits (up to timeout()) for every key to exist, then returns their values in the keys'
  /// order. The default calls get() per key; a store with a batched request (the TCP store)
  /// sends one request for all of them.
  virtual std::vector<std::vector<uint8_t>> multi_get(const std::vector<std::string>& keys);
  /// Sets keys[i] to values[i] (as many values as keys). The default calls set() per key; the TCP
  /// store sends one request.
  virtual void multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::vector<uint8_t>>& values);

  virtual Milliseconds timeout() const = 0;
  virtual void set_timeout(Milliseconds timeout) = 0;

  /// Convenience: strings in and out.
  void set_string(const std::string& key, const std::string& value);
  std::string get_string(const std::string& key);
};

/// In-process store for ranks that are threads of one process.
std::shared_ptr<Store> make_hash_store(Milliseconds timeout = kDefaultTimeout);

/// Store in a file; every process of the job opens the same path. The file is removed once all
/// `world_size` users have closed it.
std::shared_ptr<Store> make_file_store(const std::string& path, int world_size,
                                       Milliseconds timeout = kDefaultTimeout);

/// TCP store: the process with `is_server` listens on host:port (port 0 picks a free one, see
/// port()); the others connect, retrying until `timeout`.
std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, int world_size,
                                      bool is_server, Milliseconds timeout = kDefaultTimeout);

/// A client of c10d's own TCPStore, as served by torchrun's elastic agent
/// (TORCHELASTIC_USE_AGENT_STORE=True): c10d's protocol, no Shoal token.
std::shared_ptr<Store> make_c10d_tcp_store_client(const std::string& host, int port,
                                                  Milliseconds timeout = kDefaultTimeout);

/// Keys of `base` seen under "prefix/" (batched calls stay batched).
std::shared_ptr<Store> make_prefix_store(const std::string& prefix, std::shared_ptr<Store> base);

}  // namespace shoal::comm

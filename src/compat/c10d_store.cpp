// Shoal's stores on top of c10d's, and the adapter from any Shoal store back to a c10d store.
#include "compat/c10d_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include "comm/timeouts.h"
#include "compat/c10d_store_ref.h"
#include "shoal/error.h"

namespace shoal::compat {
namespace {

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& key : keys) out += (out.empty() ? "'" : ", '") + key + "'";
  return out;
}

// A Shoal store over a c10d store: translates c10d's errors into Shoal's.
class C10dBackedStore : public comm::Store {
 public:
  C10dBackedStore(c10::intrusive_ptr<c10d::Store> store, std::string what)
      : store_(std::move(store)), what_(std::move(what)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    guard("set", {key}, [&] { store_->set(key, value); });
  }
  std::vector<uint8_t> get(const std::string& key) override {
    std::vector<uint8_t> value;
    guard("get", {key}, [&] { value = store_->get(key); });
    return value;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    guard("add", {key}, [&] { value = store_->add(key, delta); });
    return value;
  }
  bool check(const std::vector<std::string>& keys) override {
    bool value = false;
    guard("check", keys, [&] { value = store_->check(keys); });
    return value;
  }
  void wait(const std::vector<std::string>& keys, comm::Milliseconds timeout) override {
    if (timeout == comm::kGroupTimeout) timeout = store_->getTimeout();
    guard("wait", keys, [&] { store_->wait(keys, timeout); }, timeout);
  }
  bool delete_key(const std::string& key) override {
    bool value = false;
    guard("delete_key", {key}, [&] { value = store_->deleteKey(key); });
    return value;
  }
  comm::Milliseconds timeout() const override { return store_->getTimeout(); }
  void set_timeout(comm::Milliseconds timeout) override { store_->setTimeout(timeout); }

  const c10::intrusive_ptr<c10d::Store>& raw() const { return store_; }

 private:
  template <typename Fn>
  void guard(const char* op, const std::vector<std::string>& keys, Fn&& fn,
             comm::Milliseconds timeout = comm::Milliseconds(-1)) {
    try {
      fn();
    } catch (const shoal::Error&) {
      throw;
    } catch (const std::exception& e) {
      if (timeout.count() < 0) timeout = store_->getTimeout();
      const std::string message = e.what();
      const std::string first_line = message.substr(0, message.find('\n'));
      const bool timed_out = message.find("imeout") != std::string::npos ||
                             message.find("imed out") != std::string::npos;
      if (timed_out) {
        SHOAL_THROW(TimeoutError, what_, " ", op, " of ", join_keys(keys), " timed out after ",
                    timeout.count(), " ms: ", first_line,
                    " (is every rank running, with the same rendezvous settings?)", comm::kTimeoutHint);
      }
      SHOAL_THROW(PeerError, what_, " ", op, " of ", join_keys(keys), " failed: ", first_line);
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string what_;
};

// A c10d store over any Shoal store (for a user's own Store implementation).
class ShoalBackedC10dStore : public c10d::Store {
 public:
  explicit ShoalBackedC10dStore(std::shared_ptr<comm::Store> store)
      : c10d::Store(store->timeout()), store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    store_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override { return store_->get(key); }
  int64_t add(const std::string& key, int64_t value) override { return store_->add(key, value); }
  bool deleteKey(const std::string& key) override { return store_->delete_key(key); }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  int64_t getNumKeys() override {
    SHOAL_THROW(Error, "getNumKeys is not supported by this store");
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }
#if TORCH_VERSION_MAJOR >= 2
  // LibTorch 2.x: a store for another thread; Shoal's stores are thread-safe, so it shares this one.
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<ShoalBackedC10dStore>(store_);
  }
#endif

 private:
  std::shared_ptr<comm::Store> store_;
};

}  // namespace

std::shared_ptr<C10dStoreRef> to_c10d_store(const std::shared_ptr<comm::Store>& store) {
  auto ref = std::make_shared<C10dStoreRef>();
  if (auto* backed = dynamic_cast<C10dBackedStore*>(store.get())) {
    ref->store = backed->raw();
  } else {
    ref->store = c10::make_intrusive<ShoalBackedC10dStore>(store);
  }
  return ref;
}

bool can_join_torchrun_agent_store(bool agent_is_2x) {
  return (TORCH_VERSION_MAJOR >= 2) == agent_is_2x;
}

}  // namespace shoal::compat

namespace shoal::comm {

void Store::set_string(const std::string& key, const std::string& value) {
  set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Store::get_string(const std::string& key) {
  auto value = get(key);
  return std::string(value.begin(), value.end());
}

std::shared_ptr<Store> make_hash_store(Milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(timeout);
  return std::make_shared<compat::C10dBackedStore>(store, "hash store");
}

std::shared_ptr<Store> make_file_store(const std::string& path, int world_size,
                                       Milliseconds timeout) {
  SHOAL_CHECK_T(InvalidArgument, !path.empty(), "file store: the path is empty");
  // c10d's FileStore creates its file on the first write; until then its check() waits for the
  // file up to the time-out and throws instead of answering false. Create it (empty) up front.
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  } catch (const std::exception& e) {
    SHOAL_THROW(InvalidArgument, "file store '", path, "' cannot be opened: ", e.what(),
                " (is its folder writable?)");
  }
  store->setTimeout(timeout);
  return std::make_shared<compat::C10dBackedStore>(store, "file store '" + path + "'");
}

// make_tcp_store is Shoal's own authenticated store: comm/tcp_store.cpp. torchrun's elastic agent
// serves c10d's own TCPStore, which speaks c10d's protocol (and knows no Shoal token): its ranks
// join it through c10d's client.
std::shared_ptr<Store> make_c10d_tcp_store_client(const std::string& host, int port,
                                                  Milliseconds timeout) {
  SHOAL_CHECK_T(InvalidArgument, port > 0 && port <= 65535, "torchrun agent store: port ", port,
                " is out of range 1..65535");
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    std::string message = e.what();
    message = message.substr(0, message.find('\n'));
    SHOAL_THROW(TimeoutError, "torchrun agent store: cannot connect to ", host, ":", port,
                " within ", timeout.count(), " ms: ", message,
                " (is the torchrun agent running, and MASTER_ADDR/MASTER_PORT as it set them?)");
  }
  return std::make_shared<compat::C10dBackedStore>(
      store, detail::str_cat("torchrun agent store ", host, ":", port));
}

}  // namespace shoal::comm

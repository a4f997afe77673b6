#include "comm/c10d_wire_store.h"

#include <unistd.h>

#include <cstring>

#include "comm/store_poll.h"
#include "comm/timeouts.h"
#include "security/socket_io.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// c10d 2.x's request types (TCPStoreBackend.hpp's QueryType), the ones this client sends.
enum Query : uint8_t { kValidate = 0, kSet = 1, kGet = 3, kAdd = 4, kCheck = 5, kDeleteKey = 8 };
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
constexpr uint8_t kCheckReady = 0;
// c10d's client puts "/" in front of every key on the wire; so does this one, so that both see
// the same keys in one store.
constexpr char kKeyPrefix = '/';

// c10d sends integers in the host's byte order.
template <typename T>
void put(std::vector<uint8_t>& out, T value) {
  uint8_t bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.insert(out.end(), bytes, bytes + sizeof(T));
}
void put_string(std::vector<uint8_t>& out, const void* data, size_t size) {
  put<uint64_t>(out, size);
  const auto* p = static_cast<const uint8_t*>(data);
  out.insert(out.end(), p, p + size);
}
void put_key(std::vector<uint8_t>& out, const std::string& key) {
  put<uint64_t>(out, key.size() + 1);
  out.push_back(static_cast<uint8_t>(kKeyPrefix));
  out.insert(out.end(), key.begin(), key.end());
}

template <typename T>
T take(const std::vector<uint8_t>& in) {
  T value;
  std::memcpy(&value, in.data(), sizeof(T));
  return value;
}

}  // namespace

C10dWireStore::C10dWireStore(std::string host, int port, int rank, Milliseconds timeout)
    : host_(std::move(host)), port_(port), timeout_(timeout) {
  who_ = "[rank " + std::to_string(rank) + "] ";
  SHOAL_CHECK_T(InvalidArgument, port > 0 && port <= 65535, who_,
                "torchrun's agent store: MASTER_PORT ", port, " is out of range 1..65535");
  endpoint_ = host_ + ":" + std::to_string(port_);
  std::lock_guard<std::mutex> lock(mutex_);
  connect_locked();
}

C10dWireStore::~C10dWireStore() {
  if (fd_ >= 0) ::close(fd_);
}

void C10dWireStore::connect_locked() {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  fd_ = security::connect_to(host_, port_, deadline);
  std::vector<uint8_t> hello{kValidate};
  put<uint32_t>(hello, kValidationMagic);
  const security::Io io = security::write_all(fd_, hello.data(), hello.size(), deadline);
  if (io != security::Io::kOk) {
    ::close(fd_);
    fd_ = -1;
    SHOAL_THROW(PeerError, who_, "torchrun's agent store at ", endpoint_,
                " closed the connection before it was validated: is MASTER_PORT the agent's store "
                "(a PyTorch 2.x torchrun), and is the agent still running?");
  }
}

std::vector<uint8_t> C10dWireStore::exchange(const std::vector<uint8_t>& request, int reply_size,
                                             const char* what, const std::string& key) {
  if (fd_ < 0) connect_locked();
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const auto fail = [&](security::Io io) {
    // The stream may be mid-reply: the next request starts on a new connection.
    ::close(fd_);
    fd_ = -1;
    if (io == security::Io::kTimeout) {
      SHOAL_THROW(TimeoutError, who_, "store ", what, " of '", key, "': torchrun's agent store at ",
                  endpoint_, " did not answer within ", timeout_.count(), " ms", kTimeoutHint);
    }
    SHOAL_THROW(PeerError, who_, "store ", what, " of '", key, "': torchrun's agent store at ",
                endpoint_, " closed the connection: the agent has exited (see torchrun's own output "
                "for why), or MASTER_PORT is not a PyTorch 2.x agent's store");
  };
  security::Io io = security::write_all(fd_, request.data(), request.size(), deadline);
  if (io != security::Io::kOk) fail(io);
  uint64_t size = static_cast<uint64_t>(reply_size);
  if (reply_size < 0) {
    uint8_t header[8];
    io = security::read_exact(fd_, header, sizeof(header), deadline);
    if (io != security::Io::kOk) fail(io);
    std::memcpy(&size, header, sizeof(size));
    if (size > kMaxValue) {
      ::close(fd_);
      fd_ = -1;
      SHOAL_THROW(PeerError, who_, "store ", what, " of '", key, "': the store at ", endpoint_,
                  " announced a value of ", size, " bytes, more than the ", kMaxValue,
                  " a rendezvous value may have: not torchrun's agent store, or a corrupt one");
    }
  }
  std::vector<uint8_t> reply(size);
  if (size > 0) {
    io = security::read_exact(fd_, reply.data(), size, deadline);
    if (io != security::Io::kOk) fail(io);
  }
  return reply;
}

void C10dWireStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::vector<uint8_t> request{kSet};
  put_key(request, key);
  put_string(request, value.data(), value.size());
  std::lock_guard<std::mutex> lock(mutex_);
  exchange(request, 0, "set", key);
}

std::vector<uint8_t> C10dWireStore::get(const std::string& key) {
  // c10d's own client waits first too: a GET of a missing key is not answered by every server.
  wait({key});
  std::vector<uint8_t> request{kGet};
  put_key(request, key);
  std::lock_guard<std::mutex> lock(mutex_);
  return exchange(request, -1, "get", key);
}

int64_t C10dWireStore::add(const std::string& key, int64_t delta) {
  std::vector<uint8_t> request{kAdd};
  put_key(request, key);
  put<int64_t>(request, delta);
  std::lock_guard<std::mutex> lock(mutex_);
  return take<int64_t>(exchange(request, sizeof(int64_t), "add", key));
}

bool C10dWireStore::check(const std::vector<std::string>& keys) {
  std::vector<uint8_t> request{kCheck};
  put<uint64_t>(request, keys.size());
  for (const auto& key : keys) put_key(request, key);
  std::lock_guard<std::mutex> lock(mutex_);
  return exchange(request, 1, "check", keys.empty() ? std::string() : keys.front())[0] == kCheckReady;
}

void C10dWireStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  if (timeout == kGroupTimeout) timeout = timeout_;
  wait_by_polling([&] { return check(keys); }, keys, timeout,
                  "torchrun's agent store at " + endpoint_, who_);
}

bool C10dWireStore::delete_key(const std::string& key) {
  std::vector<uint8_t> request{kDeleteKey};
  put_key(request, key);
  std::lock_guard<std::mutex> lock(mutex_);
  return take<int64_t>(exchange(request, sizeof(int64_t), "delete", key)) > 0;
}

}  // namespace shoal::comm

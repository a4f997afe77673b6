#include "comm/tcp_store.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "comm/store_poll.h"
#include "comm/tcp_store_server.h"
#include "comm/tcp_store_wire.h"
#include "security/auth_token.h"
#include "security/socket_io.h"
#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

std::string timeout_hint() { return kTimeoutHint; }

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool is_server, std::string token, Milliseconds timeout)
    : host_(host), token_(std::move(token)), port_(port), timeout_(timeout) {
  SHOAL_CHECK_T(InvalidArgument, port >= 0 && port <= 65535, "TCP store: port ", port, " is out of range 0..65535");
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(host, port, token_);
    port_ = server_->port();
  }
  endpoint_ = host + ":" + std::to_string(port_);
  // The whole rendezvous (reaching the listener and the handshake) runs under one deadline.
  const int fd = connect(std::chrono::steady_clock::now() + timeout);
  all_.push_back(fd);
  idle_.push_back(fd);
}

int TcpStore::connect(std::chrono::steady_clock::time_point deadline) {
  // A busy listener (its handshake slots taken, by strangers say) drops its oldest connection
  // before answering: connect again, from 10 ms up to 500 ms apart, until the deadline.
  auto pause = std::chrono::milliseconds(10);
  for (int attempt = 1;; ++attempt) {
    const int fd = security::connect_to(host_, port_, deadline);
    bool answered = false;
    try {
      answered = security::try_authenticate_to_server(fd, token_, "store", endpoint_, deadline);
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (answered) return fd;
    ::close(fd);
    if (std::chrono::steady_clock::now() + pause >= deadline) {
      SHOAL_THROW(TimeoutError, "TCP store: the listener at ", endpoint_,
                  " closed the connection before answering Shoal's handshake ", attempt,
                  " times in ", timeout_.count(), " ms: it is flooded with connections that do not ",
                  "finish the handshake (strangers on the store's port?), or it is not a Shoal ",
                  "job's listener", timeout_hint());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
}

TcpStore::~TcpStore() {
  for (int fd : all_) ::close(fd);
  server_.reset();
}

int TcpStore::take_connection() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_.empty()) {
      const int fd = idle_.back();
      idle_.pop_back();
      return fd;
    }
  }
  const int fd = connect(std::chrono::steady_clock::now() + timeout_);
  std::lock_guard<std::mutex> lock(mutex_);
  all_.push_back(fd);
  return fd;
}

void TcpStore::give_back(int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.push_back(fd);
}

void TcpStore::forget(int fd) {
  // The connection may be mid-reply: it is closed rather than reused.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    all_.erase(std::remove(all_.begin(), all_.end(), fd), all_.end());
  }
  ::close(fd);
}

std::vector<uint8_t> TcpStore::request(const std::vector<uint8_t>& body, const char* what, Milliseconds wait) {
  std::vector<uint8_t> frame;
  wire::put_u32(frame, static_cast<uint32_t>(body.size()));
  frame.insert(frame.end(), body.begin(), body.end());
  const int fd = take_connection();
  const auto deadline = std::chrono::steady_clock::now() + wait + timeout_;
  const auto fail = [&](security::Io io) {
    forget(fd);
    if (io == security::Io::kTimeout) {
      SHOAL_THROW(TimeoutError, "store ", what, ": the store at ", endpoint_, " (rank 0) did not answer within ",
                  (wait + timeout_).count(), " ms", timeout_hint());
    }
    SHOAL_THROW(PeerError, "store ", what, ": the store at ", endpoint_,
                " (rank 0) closed the connection: rank 0 has exited or failed");
  };
  security::Io io = security::write_all(fd, frame.data(), frame.size(), deadline);
  if (io != security::Io::kOk) fail(io);
  uint8_t header[4];
  io = security::read_exact(fd, header, 4, deadline);
  if (io != security::Io::kOk) fail(io);
  const uint32_t size = wire::Reader(header, 4).u32();
  if (size > wire::kMaxFrame) {
    forget(fd);
    SHOAL_THROW(PeerError, "store ", what, ": the store at ", endpoint_, " sent a reply of ", size,
                " bytes: not a Shoal store");
  }
  std::vector<uint8_t> reply(size);
  io = security::read_exact(fd, reply.data(), size, deadline);
  if (io != security::Io::kOk) fail(io);
  give_back(fd);
  return reply;
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::vector<uint8_t> body{wire::kSet};
  wire::put_string(body, key);
  wire::put_bytes(body, value.data(), value.size());
  request(body, "set");
}

std::vector<uint8_t> TcpStore::get(const std::string& key) { return multi_get({key}).front(); }

std::vector<uint8_t> TcpStore::wait_request(uint8_t op, const std::vector<std::string>& keys,
                                            Milliseconds timeout, const char* what) {
  if (timeout == kGroupTimeout) timeout = timeout_;
  std::vector<uint8_t> body{op};
  wire::put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) wire::put_string(body, key);
  wire::put_i64(body, timeout.count());
  // The server answers by the wait's own deadline; the store's time-out covers the round trip.
  std::vector<uint8_t> reply = request(body, what, timeout);
  SHOAL_CHECK_T(PeerError, !reply.empty(), "store ", what, ": malformed reply from ", endpoint_);
  if (reply[0] != 1) throw_wait_timeout(keys, timeout, endpoint_);
  reply.erase(reply.begin());
  return reply;
}

std::vector<std::vector<uint8_t>> TcpStore::multi_get(const std::vector<std::string>& keys) {
  const std::vector<uint8_t> reply = wait_request(wire::kMultiGet, keys, timeout_, "get");
  wire::Reader in(reply.data(), reply.size());
  std::vector<std::vector<uint8_t>> values;
  values.reserve(keys.size());
  for (size_t i = 0; i < keys.size() && in.ok(); ++i) values.push_back(in.bytes());
  SHOAL_CHECK_T(PeerError, in.ok() && in.done(), "store get of ", keys.size(), " keys: malformed reply from ",
                endpoint_);
  return values;
}

void TcpStore::multi_set(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  SHOAL_CHECK_T(InvalidArgument, keys.size() == values.size(), "store multi_set: ", keys.size(),
                " keys but ", values.size(), " values");
  std::vector<uint8_t> body{wire::kMultiSet};
  wire::put_u32(body, static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) {
    wire::put_string(body, keys[i]);
    wire::put_bytes(body, values[i].data(), values[i].size());
  }
  request(body, "multi_set");
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::vector<uint8_t> body{wire::kAdd};
  wire::put_string(body, key);
  wire::put_i64(body, delta);
  const auto reply = request(body, "add");
  wire::Reader in(reply.data(), reply.size());
  const int64_t value = in.i64();
  SHOAL_CHECK_T(PeerError, in.ok(), "store add: malformed reply from ", endpoint_);
  return value;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::vector<uint8_t> body{wire::kCheck};
  wire::put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) wire::put_string(body, k);
  const auto reply = request(body, "check");
  return !reply.empty() && reply[0] == 1;
}

void TcpStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  wait_request(wire::kWait, keys, timeout, "wait");
}

bool TcpStore::delete_key(const std::string& key) {
  std::vector<uint8_t> body{wire::kDelete};
  wire::put_string(body, key);
  const auto reply = request(body, "delete");
  return !reply.empty() && reply[0] == 1;
}

std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, int world_size, bool is_server,
                                      Milliseconds timeout) {
  return std::make_shared<TcpStore>(host, port, is_server, security::token_from_env(), timeout);
}

}  // namespace shoal::comm

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
    : port_(port), timeout_(timeout) {
  SHOAL_CHECK_T(InvalidArgument, port >= 0 && port <= 65535, "TCP store: port ", port, " is out of range 0..65535");
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(host, port, token);
    port_ = server_->port();
  }
  endpoint_ = host + ":" + std::to_string(port_);
  // The whole rendezvous (reaching the listener and the handshake) runs under one deadline.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // A busy listener (its handshake slots taken, by strangers say) drops its oldest connection
  // before answering: connect again, from 10 ms up to 500 ms apart, until the deadline.
  auto pause = std::chrono::milliseconds(10);
  for (int attempt = 1;; ++attempt) {
    fd_ = security::connect_to(host, port_, deadline);
    bool answered = false;
    try {
      answered = security::try_authenticate_to_server(fd_, token, "store", endpoint_, deadline);
    } catch (...) {
      ::close(fd_);
      fd_ = -1;
      throw;
    }
    if (answered) return;
    ::close(fd_);
    fd_ = -1;
    if (std::chrono::steady_clock::now() + pause >= deadline) {
      SHOAL_THROW(TimeoutError, "TCP store: the listener at ", endpoint_,
                  " closed the connection before answering Shoal's handshake ", attempt,
                  " times in ", timeout.count(), " ms: it is flooded with connections that do not ",
                  "finish the handshake (strangers on the store's port?), or it is not a Shoal ",
                  "job's listener", timeout_hint());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

std::vector<uint8_t> TcpStore::request(const std::vector<uint8_t>& body, const char* what) {
  std::vector<uint8_t> frame;
  wire::put_u32(frame, static_cast<uint32_t>(body.size()));
  frame.insert(frame.end(), body.begin(), body.end());
  std::lock_guard<std::mutex> lock(mutex_);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const auto fail = [&](security::Io io) {
    if (io == security::Io::kTimeout) {
      SHOAL_THROW(TimeoutError, "store ", what, ": the store at ", endpoint_, " (rank 0) did not answer within ",
                  timeout_.count(), " ms", timeout_hint());
    }
    SHOAL_THROW(PeerError, "store ", what, ": the store at ", endpoint_,
                " (rank 0) closed the connection: rank 0 has exited or failed");
  };
  security::Io io = security::write_all(fd_, frame.data(), frame.size(), deadline);
  if (io != security::Io::kOk) fail(io);
  uint8_t header[4];
  io = security::read_exact(fd_, header, 4, deadline);
  if (io != security::Io::kOk) fail(io);
  const uint32_t size = wire::Reader(header, 4).u32();
  SHOAL_CHECK_T(PeerError, size <= wire::kMaxFrame, "store ", what, ": the store at ", endpoint_,
                " sent a reply of ", size, " bytes: not a Shoal store");
  std::vector<uint8_t> reply(size);
  io = security::read_exact(fd_, reply.data(), size, deadline);
  if (io != security::Io::kOk) fail(io);
  return reply;
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::vector<uint8_t> body{wire::kSet};
  wire::put_string(body, key);
  wire::put_bytes(body, value.data(), value.size());
  request(body, "set");
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  wait({key});
  std::vector<uint8_t> body{wire::kGet};
  wire::put_string(body, key);
  const auto reply = request(body, "get");
  wire::Reader in(reply.data(), reply.size());
  const bool found = in.u8() == 1;
  std::vector<uint8_t> value = in.bytes();
  SHOAL_CHECK_T(PeerError, in.ok() && found, "store get '", key, "': the store at ", endpoint_,
                " lost the key (deleted by another rank?)");
  return value;
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
  if (timeout == kGroupTimeout) timeout = timeout_;
  wait_by_polling([&] { return check(keys); }, keys, timeout, endpoint_);
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

// ZapGate: the parameter server's ZAP handler (ZeroMQ's authentication protocol, RFC 27), the gate
// that keeps strangers from sending the server anything (see auth.h for why it exists).
//
// It binds inproc://zeromq.zap.01 in the server's ZeroMQ context, so it must exist before the
// server's socket binds; the server's socket then runs the PLAIN mechanism (plain_server) with a
// ZAP domain, and every connection's handshake asks this handler. A connection is admitted when
// its user name is kGateUser and its password gate_password(token) (compared in constant time);
// any other is refused in the handshake, before any message of it is read, and reported to
// `on_refused` with the peer's address.
//
// Thread safety: a thread of its own answers the requests; on_refused runs on it. The destructor
// stops and joins it (within about 100 ms).
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <zmq.hpp>

namespace shoal::ps {

class ZapGate {
 public:
  ZapGate(zmq::context_t& context, std::string password,
          std::function<void(const std::string& address)> on_refused);
  ~ZapGate();
  ZapGate(const ZapGate&) = delete;
  ZapGate& operator=(const ZapGate&) = delete;

  /// The ZAP domain the server's socket names (zmq::sockopt::zap_domain).
  static constexpr const char* kDomain = "shoal-ps";

 private:
  void serve();

  zmq::socket_t socket_;
  std::string password_;
  std::function<void(const std::string&)> on_refused_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace shoal::ps

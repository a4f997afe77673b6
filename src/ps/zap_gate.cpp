#include "ps/zap_gate.h"

#include <chrono>
#include <vector>

#include "ps/auth.h"
#include "security/hmac_sha256.h"

namespace shoal::ps {
namespace {

// How often the handler looks at stop_: the destructor waits at most this long.
constexpr std::chrono::milliseconds kGatePollInterval{100};

bool same_secret(const std::string& given, const std::string& expected) {
  // Constant time: compare digests of both (equal length), never the strings byte by byte.
  return security::digests_equal(security::sha256(given), security::sha256(expected));
}

}  // namespace

ZapGate::ZapGate(zmq::context_t& context, std::string password,
                 std::function<void(const std::string& address)> on_refused)
    : socket_(context, zmq::socket_type::rep),
      password_(std::move(password)),
      on_refused_(std::move(on_refused)) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind("inproc://zeromq.zap.01");
  thread_ = std::thread([this] { serve(); });
}

ZapGate::~ZapGate() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void ZapGate::serve() {
  while (!stop_) {
    zmq::pollitem_t item{static_cast<void*>(socket_), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, kGatePollInterval) <= 0) continue;
    // version, request id, domain, address, identity, mechanism, credentials...
    std::vector<std::string> frames;
    zmq::message_t frame;
    do {
      if (!socket_.recv(frame, zmq::recv_flags::dontwait)) break;
      // libzmq writes these requests itself; a frame of more than 1 KiB is not one of them.
      frames.push_back(frame.size() <= 1024 ? frame.to_string() : std::string());
    } while (frame.more());
    const bool plain = frames.size() >= 8 && frames[0] == "1.0" && frames[5] == "PLAIN";
    const bool ok = plain && frames[2] == kDomain && frames[6] == kGateUser &&
                    same_secret(frames[7], password_);
    const std::string request_id = frames.size() > 1 ? frames[1] : std::string();
    const std::string reply[] = {"1.0", request_id, ok ? "200" : "400",
                                 ok ? "OK" : "not this job's token", "", ""};
    for (size_t i = 0; i < 6; ++i) {
      socket_.send(zmq::buffer(reply[i]), i + 1 < 6 ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
    if (!ok && on_refused_) on_refused_(frames.size() > 3 ? frames[3] : std::string("?"));
  }
}

}  // namespace shoal::ps

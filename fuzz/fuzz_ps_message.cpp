// libFuzzer target: the parameter server's message decoder (ps::receive_message) on arbitrary
// multipart messages, as a stranger or a broken peer can send them, and the server's check of an
// auth answer. Every input must end in an accepted message or an error; nothing may crash,
// allocate beyond the limits or leave frames behind for the next message.
//
// Input: byte 0 bit 0 = ROUTER framing (first frame is the routing id); then frames, each a
// little-endian u16 length and that many bytes (the last frame takes what is left).
#include <cstdint>
#include <cstring>
#include <vector>
#include <zmq.hpp>

#include "ps/auth.h"
#include "ps/message.h"

namespace {

struct Pair {
  zmq::context_t context;
  zmq::socket_t in{context, zmq::socket_type::pair};
  zmq::socket_t out{context, zmq::socket_type::pair};
  Pair() {
    shoal::ps::configure_socket(in, shoal::ps::Limits{});
    in.bind("inproc://fuzz-ps");
    out.connect("inproc://fuzz-ps");
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Pair* pair = new Pair();  // never destroyed: libzmq's threads outlive static destruction
  if (size < 1) return 0;
  const bool router = (data[0] & 1) != 0;
  std::vector<std::pair<const uint8_t*, size_t>> frames;
  size_t pos = 1;
  while (pos < size) {
    if (size - pos < 2) break;
    uint16_t length;
    std::memcpy(&length, data + pos, 2);
    pos += 2;
    const size_t n = std::min<size_t>(length, size - pos);
    frames.emplace_back(data + pos, n);
    pos += n;
  }
  if (frames.empty()) return 0;
  for (size_t i = 0; i < frames.size(); ++i) {
    const auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
    (void)pair->out.send(zmq::const_buffer(frames[i].first, frames[i].second), flags);
  }
  shoal::ps::Limits limits;
  // Small enough that the fuzzer reaches the size checks with its 64 KiB inputs.
  limits.max_message_bytes = 1 << 16;
  limits.max_keys = 64;
  limits.max_blob_bytes = 1024;
  auto result =
      shoal::ps::receive_message(pair->in, std::chrono::milliseconds(1000), limits, router);
  if (result.message) {
    shoal::ps::InMessage& m = *result.message;
    if (m.keys.size() != m.frames.size()) __builtin_trap();
    for (size_t i = 0; i < m.keys.size(); ++i) {
      at::Tensor t = m.tensor(i);
      if (t.numel() != m.keys[i].numel) __builtin_trap();
    }
    if (m.type() == shoal::ps::MessageType::kAuth && m.blob.size() == sizeof(shoal::ps::Digest)) {
      shoal::ps::Digest answer;
      std::memcpy(answer.data(), m.blob.data(), answer.size());
      (void)shoal::ps::check_auth_response("token", shoal::ps::Challenge{}, answer);
    }
    (void)shoal::ps::message_type_name(m.type());
  } else if (result.error.empty()) {
    __builtin_trap();  // every frame was sent: a message or an error must come back
  }
  // Nothing of this message may be left for the next one.
  zmq::message_t left;
  if (pair->in.recv(left, zmq::recv_flags::dontwait)) __builtin_trap();
  return 0;
}

#include "ps/message.h"

#include <ATen/ops/from_blob.h>

#include <cstring>

namespace shoal::ps {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the parameter-server wire format is little-endian");

// Keeps a tensor alive while libzmq sends from its memory.
void release_tensor(void* /*data*/, void* hint) { delete static_cast<at::Tensor*>(hint); }

zmq::message_t tensor_frame(const at::Tensor& tensor) {
  auto* holder = new at::Tensor(tensor);
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (bytes == 0) {
    delete holder;
    return zmq::message_t();
  }
  return zmq::message_t(tensor.data_ptr(), bytes, release_tensor, holder);
}

// Reads and drops the rest of a multipart message.
void drain(zmq::socket_t& socket, bool more) {
  zmq::message_t frame;
  while (more) {
    if (!socket.recv(frame, zmq::recv_flags::dontwait)) return;
    more = frame.more();
  }
}

}  // namespace

const char* message_type_name(MessageType type) {
  switch (type) {
    case MessageType::kHello: return "hello";
    case MessageType::kChallenge: return "challenge";
    case MessageType::kAuth: return "auth";
    case MessageType::kWelcome: return "welcome";
    case MessageType::kInit: return "init";
    case MessageType::kPush: return "push";
    case MessageType::kPull: return "pull";
    case MessageType::kParams: return "params";
    case MessageType::kSum: return "sum";
    case MessageType::kSumResult: return "sum-result";
    case MessageType::kBye: return "bye";
    case MessageType::kOk: return "ok";
    case MessageType::kError: return "error";
  }
  return "unknown";
}

at::Tensor InMessage::tensor(size_t i) {
  return at::from_blob(frames.at(i).data(), {keys.at(i).numel}, at::kFloat);
}

void configure_socket(zmq::socket_t& socket, const Limits& limits) {
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::maxmsgsize, limits.max_message_bytes);
  // Why 30 s: a send only blocks while the peer's queue is full (it is not reading); longer than
  // that it is stuck, and the caller's error names it.
  socket.set(zmq::sockopt::sndtimeo, 30000);
}

bool send_message(zmq::socket_t& socket, const std::string& routing_id, OutMessage& message) {
  message.header.magic = kMagic;
  message.header.format_version = kFormatVersion;
  message.header.num_keys = static_cast<uint32_t>(message.keys.size());
  const auto more = zmq::send_flags::sndmore;
  if (!routing_id.empty()) {
    if (!socket.send(zmq::buffer(routing_id), more)) return false;
  }
  if (!socket.send(zmq::buffer(&message.header, sizeof(Header)), more)) return false;
  if (!socket.send(zmq::buffer(message.blob), more)) return false;
  const bool has_tensors = !message.keys.empty();
  if (!socket.send(zmq::buffer(message.keys.data(), message.keys.size() * sizeof(KeyRange)),
                   has_tensors ? more : zmq::send_flags::none)) {
    return false;
  }
  for (size_t i = 0; i < message.tensors.size(); ++i) {
    const bool last = i + 1 == message.tensors.size();
    zmq::message_t frame = tensor_frame(message.tensors[i]);
    if (!socket.send(frame, last ? zmq::send_flags::none : more)) return false;
  }
  return true;
}

ReceiveResult receive_message(zmq::socket_t& socket, std::chrono::milliseconds timeout,
                              const Limits& limits, bool router) {
  ReceiveResult result;
  zmq::pollitem_t item{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, timeout) <= 0 || (item.revents & ZMQ_POLLIN) == 0) return result;

  // A multipart message arrives whole, so the frames after the first are read without waiting.
  zmq::message_t frame;
  if (!socket.recv(frame, zmq::recv_flags::dontwait)) return result;
  InMessage message;
  if (router) {
    message.routing_id = frame.to_string();
    result.routing_id = message.routing_id;
    if (!frame.more()) {
      result.error = "empty message";
      return result;
    }
    if (!socket.recv(frame, zmq::recv_flags::dontwait)) return result;
  }
  auto reject = [&](std::string why) {
    drain(socket, frame.more());
    result.error = std::move(why);
    return std::move(result);
  };
  if (frame.size() != sizeof(Header)) {
    return reject("header of " + std::to_string(frame.size()) + " bytes, expected " +
                  std::to_string(sizeof(Header)));
  }
  std::memcpy(&message.header, frame.data(), sizeof(Header));
  const Header& h = message.header;
  if (h.magic != kMagic) return reject("bad magic number (not a Shoal parameter-server message)");
  if (h.format_version != kFormatVersion) {
    return reject("format version " + std::to_string(h.format_version) + ", this build speaks " +
                  std::to_string(kFormatVersion));
  }
  if (h.type == 0 || h.type > kLastMessageType) {
    return reject("unknown message type " + std::to_string(h.type));
  }
  if (h.num_keys > limits.max_keys) {
    return reject(std::to_string(h.num_keys) + " keys, more than the limit " +
                  std::to_string(limits.max_keys));
  }
  // blob
  if (!frame.more()) return reject("truncated: no blob frame");
  if (!socket.recv(frame, zmq::recv_flags::dontwait)) return reject("truncated: no blob frame");
  if (frame.size() > limits.max_blob_bytes) {
    return reject("blob of " + std::to_string(frame.size()) + " bytes, more than the limit " +
                  std::to_string(limits.max_blob_bytes));
  }
  message.blob = frame.to_string();
  // keys
  if (!frame.more()) return reject("truncated: no key frame");
  if (!socket.recv(frame, zmq::recv_flags::dontwait)) return reject("truncated: no key frame");
  if (frame.size() != size_t{h.num_keys} * sizeof(KeyRange)) {
    return reject("key frame of " + std::to_string(frame.size()) + " bytes for " +
                  std::to_string(h.num_keys) + " keys");
  }
  message.keys.resize(h.num_keys);
  if (h.num_keys > 0) std::memcpy(message.keys.data(), frame.data(), frame.size());
  // tensors
  bool more = frame.more();
  int64_t total = 0;
  message.frames.reserve(h.num_keys);
  for (uint32_t i = 0; i < h.num_keys; ++i) {
    const KeyRange& key = message.keys[i];
    auto fail = [&](std::string why) {
      drain(socket, more);
      result.error = std::move(why);
      return std::move(result);
    };
    if (key.dtype != 0) return fail("key " + std::to_string(key.key) + ": unknown dtype");
    if (key.numel < 0 || key.offset < 0 || key.numel > limits.max_message_bytes / 4) {
      return fail("key " + std::to_string(key.key) + ": bad range offset " +
                  std::to_string(key.offset) + " numel " + std::to_string(key.numel));
    }
    if (!more) {
      return fail("truncated: " + std::to_string(i) + " of " + std::to_string(h.num_keys) +
                  " tensor frames");
    }
    zmq::message_t data;
    if (!socket.recv(data, zmq::recv_flags::dontwait)) return fail("truncated tensor frames");
    more = data.more();
    if (data.size() != static_cast<size_t>(key.numel) * 4) {
      return fail("key " + std::to_string(key.key) + ": tensor frame of " +
                  std::to_string(data.size()) + " bytes for " + std::to_string(key.numel) +
                  " float32 elements");
    }
    total += static_cast<int64_t>(data.size());
    if (total > limits.max_message_bytes) {
      return fail("message larger than the limit of " +
                  std::to_string(limits.max_message_bytes) + " bytes");
    }
    message.frames.push_back(std::move(data));
  }
  if (more) {
    drain(socket, true);
    result.error = "more frames than the " + std::to_string(h.num_keys) + " keys announced";
    return result;
  }
  result.message = std::move(message);
  return result;
}

}  // namespace shoal::ps

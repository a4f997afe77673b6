// The parameter server's wire format and its ZeroMQ transport.
//
// A message is one ZeroMQ multipart message of exactly 3 + num_keys frames:
//   [header: 40 bytes][blob: type-specific bytes][keys: num_keys x 24 bytes][tensor 0]...[tensor k-1]
// (a ROUTER socket adds the peer's routing id in front). The header carries a magic number, the
// format version, the message type, the sender's rank, the key count, a request sequence number
// (echoed in the reply), a clock and a parameter version. Each key entry names a key range
// (key id, dtype, offset, numel); its tensor frame holds exactly numel elements of that dtype
// (float32 only today). Integers are little-endian (x86/ARM hosts; checked at compile time).
//
// Sizes are bounded before anything is allocated: ZMQ_MAXMSGSIZE makes libzmq drop a peer that
// announces a frame larger than the limit before reading it; the frame count, blob size, key count
// and each tensor frame's size against its key entry are checked on receipt; anything malformed
// becomes a ReceiveResult with an error and no message (the caller logs it and goes on).
//
// Tensors are sent without a copy: each tensor frame points at the tensor's memory and keeps the
// tensor alive until libzmq has sent it (zmq_msg_init_data with a release callback). The sender
// must not change the tensor's values until the peer has answered (the worker's push is answered
// before its pull returns; the server sends snapshots).
//
// Thread safety: a socket belongs to one thread; these functions keep no state.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

namespace shoal::ps {

constexpr uint32_t kMagic = 0x53505331;  // "SPS1"
// Version 2: a push carries the learning-rate factor of the worker's schedule in its blob.
// Version 3: a checkpoint barrier carries the workers' step in its blob.
constexpr uint16_t kFormatVersion = 3;

enum class MessageType : uint16_t {
  kHello = 1,   ///< worker -> server: rank in header
  kChallenge,   ///< server -> worker: blob = 32 random bytes
  kAuth,        ///< worker -> server: blob = HMAC-SHA256 answer
  kWelcome,     ///< server -> worker: let in
  kInit,        ///< worker -> server: initial values of the server's key ranges
  kPush,        ///< worker -> server: gradients; clock = the worker's clock they were computed at;
                ///< blob = 8 bytes, a double: the factor on the optimizer's learning rate for
                ///< this clock (the worker's schedule, e.g. cosine; 1 without one)
  kPull,        ///< worker -> server: clock = pushes done, version = the shard version it has
  kParams,      ///< server -> worker: key ranges changed since that version; version = now
  kSum,         ///< worker -> server: blob = doubles to sum over workers; clock = round;
                ///< version 1 = a checkpoint barrier, blob = the workers' step (int64): the server
                ///< saves its shard for that step once every live worker has joined the round,
                ///< before answering (with no sums)
  kSumResult,   ///< server -> worker: blob = the sums
  kBye,         ///< worker -> server: this worker is done
  kOk,          ///< server -> worker: done
  kError,       ///< server -> worker: blob = what was wrong
};
constexpr uint16_t kLastMessageType = static_cast<uint16_t>(MessageType::kError);

const char* message_type_name(MessageType type);

#pragma pack(push, 1)
struct Header {
  uint32_t magic = kMagic;
  uint16_t format_version = kFormatVersion;
  uint16_t type = 0;
  int32_t rank = 0;
  uint32_t num_keys = 0;
  int64_t seq = 0;
  int64_t clock = 0;
  int64_t version = 0;
};
struct KeyRange {
  uint32_t key = 0;
  uint32_t dtype = 0;  ///< 0 = float32
  int64_t offset = 0;  ///< first element of the parameter this range covers
  int64_t numel = 0;
};
#pragma pack(pop)
static_assert(sizeof(Header) == 40, "wire header is 40 bytes");
static_assert(sizeof(KeyRange) == 24, "wire key entry is 24 bytes");

/// Bounds on what is accepted from a peer.
struct Limits {
  /// Largest frame (and sum of frames) accepted. Why 1 GiB: far above a shard of the models
  /// trained here, and low enough that a forged size cannot exhaust memory.
  int64_t max_message_bytes = int64_t{1} << 30;
  /// Largest key count in one message. Why 1 Mi: a model has thousands of tensors, not millions.
  uint32_t max_keys = 1u << 20;
  /// Largest blob (auth answers, error text, metric sums). Why 64 KiB: they are a few bytes.
  size_t max_blob_bytes = 64 * 1024;
};

/// A message to send. Tensors must be contiguous float32 CPU tensors, one per key.
struct OutMessage {
  Header header;
  std::string blob;
  std::vector<KeyRange> keys;
  std::vector<at::Tensor> tensors;

  OutMessage() = default;
  OutMessage(MessageType type, int32_t rank, int64_t seq) {
    header.type = static_cast<uint16_t>(type);
    header.rank = rank;
    header.seq = seq;
  }
};

/// A message received and checked.
struct InMessage {
  std::string routing_id;  ///< the peer (ROUTER sockets only)
  Header header;
  std::string blob;
  std::vector<KeyRange> keys;
  std::vector<zmq::message_t> frames;  ///< one per key, numel * 4 bytes each
  MessageType type() const { return static_cast<MessageType>(header.type); }
  /// The tensor of key entry i, viewing the received frame's memory (valid while this lives).
  at::Tensor tensor(size_t i);
};

struct ReceiveResult {
  std::optional<InMessage> message;  ///< empty on timeout or error
  std::string error;                 ///< why a message was rejected (empty on timeout)
  std::string routing_id;            ///< the sender of a rejected message, when known
  bool timed_out() const { return !message && error.empty(); }
};

/// Sends `message` (to `routing_id` first when not empty: ROUTER sockets). Does not block longer
/// than the socket's send timeout; returns false when the message could not be queued.
bool send_message(zmq::socket_t& socket, const std::string& routing_id, OutMessage& message);

/// Receives one message, waiting at most `timeout`; with `router` the first frame is the routing
/// id. Malformed messages are drained and reported in `error`.
ReceiveResult receive_message(zmq::socket_t& socket, std::chrono::milliseconds timeout,
                              const Limits& limits, bool router);

/// Applies the socket options every parameter-server socket uses (no linger, frame size limit).
void configure_socket(zmq::socket_t& socket, const Limits& limits);

}  // namespace shoal::ps

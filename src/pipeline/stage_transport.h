// StageTransport: the messages between neighbouring pipeline stages, over a ProcessGroup's
// send/recv.
//
// Every message is a fixed-size header (StageHeader: magic, kind, step, micro-batch, dtype, rank
// count, sizes), then the tensor. The receiver checks the header against what its schedule
// expects (kind, step, micro-batch) and bounds the size before it allocates. An error
// message is a header of kind kError followed by the (bounded) text of the error.
// Messages toward the next stage use tag kForwardTag, toward the previous one kBackwardTag: each
// direction between two stages carries one ordered stream.
//
// Thread safety: one thread (the stage's).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pipeline/stage_header.h"
#include "shoal/comm/process_group.h"

namespace shoal::pipeline {

class StageTransport {
 public:
  using Kind = StageHeader::Kind;

  static constexpr int kHeaderWords = StageHeader::kWords;
  static constexpr int kMaxDims = StageHeader::kMaxDims;
  static constexpr int64_t kMaxErrorBytes = StageHeader::kMaxErrorBytes;
  static constexpr int kForwardTag = 1;
  static constexpr int kBackwardTag = 2;

  StageTransport(std::shared_ptr<comm::ProcessGroup> group, std::vector<int> stage_ranks,
                 int stage, int64_t max_message_bytes, comm::Milliseconds timeout);

  /// Queues `tensor` (header first) for neighbouring stage `to`; wait_sends() waits for it.
  void send(Kind kind, int64_t step, int64_t micro_batch, const at::Tensor& tensor, int to);
  /// Receives the next message from neighbouring stage `from`, which must be of `kind` for this
  /// step and micro-batch. A received error message throws PeerError with its text, and
  /// failed_neighbour() says which stage sent it.
  at::Tensor recv(Kind kind, int64_t step, int64_t micro_batch, int from);
  /// Waits for every queued send.
  void wait_sends();

  /// Best effort: tells neighbouring stage `to` that this stage failed with `message`; waits up
  /// to `grace` for the message to leave; never throws.
  void send_error(const std::string& message, int to, comm::Milliseconds grace);

  /// The stage whose error message this stage received, or -1.
  int failed_neighbour() const { return failed_neighbour_; }

  /// "stage 2 (rank 5)".
  std::string describe_stage(int stage) const;

 private:
  at::Tensor make_header(Kind kind, int64_t step, int64_t micro_batch, const at::Tensor& tensor,
                         int64_t error_bytes) const;
  /// recv + wait, failures rethrown as PeerError / TimeoutError prefixed with `what`.
  void receive(at::Tensor& tensor, int from, const comm::SendRecvOptions& options,
               const std::string& what);
  /// Messages that travel toward higher stages carry kForwardTag, the others kBackwardTag.
  int tag_to(int stage) const { return stage > stage_ ? kForwardTag : kBackwardTag; }
  int tag_from(int stage) const { return stage < stage_ ? kForwardTag : kBackwardTag; }

  std::shared_ptr<comm::ProcessGroup> group_;
  std::vector<int> stage_ranks_;
  int stage_;
  int64_t max_message_bytes_;
  comm::Milliseconds timeout_;
  std::vector<std::shared_ptr<comm::Work>> pending_;
  int failed_neighbour_ = -1;
};

}  // namespace shoal::pipeline

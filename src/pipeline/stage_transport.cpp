#include "pipeline/stage_transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "shoal/error.h"

namespace shoal::pipeline {

StageTransport::StageTransport(std::shared_ptr<comm::ProcessGroup> group,
                               std::vector<int> stage_ranks, int stage, int64_t max_message_bytes,
                               comm::Milliseconds timeout)
    : group_(std::move(group)),
      stage_ranks_(std::move(stage_ranks)),
      stage_(stage),
      max_message_bytes_(max_message_bytes),
      timeout_(timeout) {}

std::string StageTransport::describe_stage(int stage) const {
  return detail::str_cat("stage ", stage, " (rank ", stage_ranks_[stage], ")");
}

at::Tensor StageTransport::make_header(Kind kind, int64_t step, int64_t micro_batch,
                                       const at::Tensor& tensor, int64_t error_bytes) const {
  StageHeader header;
  header.kind = kind;
  header.step = step;
  header.micro_batch = micro_batch;
  header.error_bytes = error_bytes;
  if (kind != Kind::kError) {
    SHOAL_CHECK_T(InvalidArgument, tensor.dim() <= kMaxDims, group_->rank_prefix(), " pipeline ",
                  describe_stage(stage_), ": a ", kind_name(kind), " with ", tensor.dim(),
                  " dimensions cannot be sent (at most ", kMaxDims, ")");
    header.dtype = tensor.scalar_type();
    header.sizes = tensor.sizes().vec();
  }
  at::Tensor words = at::empty({kHeaderWords}, at::kLong);
  header.encode(words.data_ptr<int64_t>());
  return words;
}

void StageTransport::send(Kind kind, int64_t step, int64_t micro_batch, const at::Tensor& tensor,
                          int to) {
  comm::SendRecvOptions options;
  options.tag = tag_to(to);
  options.timeout = timeout_;
  const at::Tensor payload = tensor.contiguous();
  pending_.push_back(
      group_->send(make_header(kind, step, micro_batch, payload, 0), stage_ranks_[to], options));
  if (payload.numel() > 0) pending_.push_back(group_->send(payload, stage_ranks_[to], options));
}

at::Tensor StageTransport::recv(Kind kind, int64_t step, int64_t micro_batch, int from) {
  comm::SendRecvOptions options;
  options.tag = tag_from(from);
  options.timeout = timeout_;
  const std::string what = detail::str_cat(group_->rank_prefix(), " pipeline ",
                                           describe_stage(stage_), ": receiving the ",
                                           kind_name(kind), " of micro-batch ", micro_batch,
                                           " (step ", step, ") from ", describe_stage(from));
  at::Tensor header = at::empty({kHeaderWords}, at::kLong);
  receive(header, from, options, what);
  const int64_t* words = header.data_ptr<int64_t>();
  // Also when its error text's length is out of bounds: that stage failed.
  if (words[1] == static_cast<int64_t>(Kind::kError)) failed_neighbour_ = from;
  const StageHeader got = StageHeader::decode(words, max_message_bytes_, what);
  if (got.kind == Kind::kError) {
    failed_neighbour_ = from;
    std::string text;
    if (got.error_bytes > 0) {
      at::Tensor message = at::empty({got.error_bytes}, at::kByte);
      receive(message, from, options, what);
      text.assign(reinterpret_cast<const char*>(message.data_ptr<uint8_t>()),
                  static_cast<size_t>(got.error_bytes));
    }
    SHOAL_THROW(PeerError, group_->rank_prefix(), " pipeline ", describe_stage(stage_),
                " stopped: ", describe_stage(from), " reported: ", text);
  }
  SHOAL_CHECK_T(PeerError, got.kind == kind && got.step == step && got.micro_batch == micro_batch,
                what, " failed: got a ", kind_name(got.kind), " for micro-batch ", got.micro_batch,
                " of step ", got.step, " (the stages run different schedules or micro-batch counts)");
  at::Tensor tensor = at::empty(got.sizes, at::TensorOptions().dtype(got.dtype));
  if (tensor.numel() > 0) receive(tensor, from, options, what);
  return tensor;
}

void StageTransport::receive(at::Tensor& tensor, int from, const comm::SendRecvOptions& options,
                             const std::string& what) {
  try {
    group_->recv(tensor, stage_ranks_[from], options)->wait();
  } catch (const TimeoutError& e) {
    SHOAL_THROW(TimeoutError, what, " failed: ", e.what());
  } catch (const std::exception& e) {
    SHOAL_THROW(PeerError, what, " failed: ", e.what());
  }
}

void StageTransport::wait_sends() {
  std::vector<std::shared_ptr<comm::Work>> pending;
  pending.swap(pending_);
  for (const auto& work : pending) {
    try {
      work->wait();
    } catch (const TimeoutError& e) {
      SHOAL_THROW(TimeoutError, group_->rank_prefix(), " pipeline ", describe_stage(stage_),
                  ": a send to a neighbouring stage failed: ", e.what());
    } catch (const std::exception& e) {
      SHOAL_THROW(PeerError, group_->rank_prefix(), " pipeline ", describe_stage(stage_),
                  ": a send to a neighbouring stage failed: ", e.what());
    }
  }
}

void StageTransport::send_error(const std::string& message, int to, comm::Milliseconds grace) {
  try {
    const std::string text = message.substr(0, static_cast<size_t>(kMaxErrorBytes));
    comm::SendRecvOptions options;
    options.tag = tag_to(to);
    options.timeout = grace;
    at::Tensor body = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
    std::copy(text.begin(), text.end(), reinterpret_cast<char*>(body.data_ptr<uint8_t>()));
    auto header = group_->send(make_header(Kind::kError, 0, 0, at::Tensor(), body.numel()),
                               stage_ranks_[to], options);
    std::shared_ptr<comm::Work> text_work;
    if (body.numel() > 0) text_work = group_->send(body, stage_ranks_[to], options);
    header->wait(grace);
    if (text_work) text_work->wait(grace);
  } catch (...) {
    // Best effort: the neighbour may be dead or the group aborted; it fails on its own then.
  }
}

}  // namespace shoal::pipeline

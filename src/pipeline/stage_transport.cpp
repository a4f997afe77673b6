#include "pipeline/stage_transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "shoal/error.h"

namespace shoal::pipeline {
namespace {

// "SHOALPIP": catches a stream that is out of step (a message read as a header that is not one).
constexpr int64_t kMagic = 0x5348'4F41'4C50'4950;

const char* kind_name(StageTransport::Kind kind) {
  switch (kind) {
    case StageTransport::Kind::kActivation:
      return "activation";
    case StageTransport::Kind::kGradient:
      return "gradient";
    case StageTransport::Kind::kError:
      return "error";
  }
  return "unknown";
}

bool allowed_dtype(int64_t code) {
  for (at::ScalarType type : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                              at::kInt}) {
    if (code == static_cast<int64_t>(type)) return true;
  }
  return false;
}

}  // namespace

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
  at::Tensor header = at::zeros({kHeaderWords}, at::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  h[0] = kMagic;
  h[1] = static_cast<int64_t>(kind);
  h[2] = step;
  h[3] = micro_batch;
  if (kind == Kind::kError) {
    h[4] = static_cast<int64_t>(at::kByte);
    h[5] = 1;
    h[6] = error_bytes;
    return header;
  }
  SHOAL_CHECK_T(InvalidArgument, tensor.dim() <= kMaxDims, group_->rank_prefix(), " pipeline ",
                describe_stage(stage_), ": a ", kind_name(kind), " with ", tensor.dim(),
                " dimensions cannot be sent (at most ", kMaxDims, ")");
  h[4] = static_cast<int64_t>(tensor.scalar_type());
  h[5] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) h[6 + d] = tensor.size(d);
  return header;
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
  const int64_t* h = header.data_ptr<int64_t>();
  SHOAL_CHECK_T(PeerError, h[0] == kMagic, what, " failed: the message is not a pipeline header "
                "(the two stages are out of step)");
  const int64_t got_kind = h[1];
  if (got_kind == static_cast<int64_t>(Kind::kError)) {
    failed_neighbour_ = from;
    const int64_t bytes = h[6];
    SHOAL_CHECK_T(PeerError, bytes >= 0 && bytes <= kMaxErrorBytes, what, ": ",
                  describe_stage(from), " failed (its error message of ", bytes,
                  " bytes is out of bounds)");
    std::string text;
    if (bytes > 0) {
      at::Tensor message = at::empty({bytes}, at::kByte);
      receive(message, from, options, what);
      text.assign(reinterpret_cast<const char*>(message.data_ptr<uint8_t>()),
                  static_cast<size_t>(bytes));
    }
    SHOAL_THROW(PeerError, group_->rank_prefix(), " pipeline ", describe_stage(stage_),
                " stopped: ", describe_stage(from), " reported: ", text);
  }
  SHOAL_CHECK_T(PeerError, got_kind == static_cast<int64_t>(kind) && h[2] == step &&
                               h[3] == micro_batch,
                what, " failed: got a message of kind ", got_kind, " for micro-batch ", h[3],
                " of step ", h[2], " (the stages run different schedules or micro-batch counts)");
  SHOAL_CHECK_T(PeerError, allowed_dtype(h[4]), what, " failed: unsupported dtype code ", h[4]);
  const int64_t dims = h[5];
  SHOAL_CHECK_T(PeerError, dims >= 0 && dims <= kMaxDims, what, " failed: ", dims,
                " dimensions in the header (at most ", kMaxDims, ")");
  const auto dtype = static_cast<at::ScalarType>(h[4]);
  std::vector<int64_t> sizes;
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d = 0; d < dims; ++d) {
    const int64_t size = h[6 + d];
    SHOAL_CHECK_T(PeerError, size >= 0, what, " failed: negative size ", size, " in the header");
    SHOAL_CHECK_T(PeerError, size == 0 || bytes <= max_message_bytes_ / size, what,
                  " failed: the header announces more than max_message_bytes (",
                  max_message_bytes_, " bytes)");
    bytes *= size;
    sizes.push_back(size);
  }
  at::Tensor tensor = at::empty(sizes, at::TensorOptions().dtype(dtype));
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

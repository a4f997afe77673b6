#include "shoal/pipeline/pipeline.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <optional>

#include "pipeline/stage_transport.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"

namespace shoal::pipeline {
namespace {

using Clock = std::chrono::steady_clock;
using Kind = StageTransport::Kind;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// How long a failing stage waits for its error message to reach a neighbour: long enough for a
// live neighbour's channel to take a few hundred bytes, short enough not to delay the failure.
constexpr comm::Milliseconds kErrorGrace{2'000};

}  // namespace

/// One micro-batch's tensors between its forward and its backward.
struct Pipeline::MicroBatch {
  int64_t index = 0;
  at::Tensor first_input;  // first stage: the slice of the batch
  at::Tensor target;       // last stage
  double scale = 1;        // its share of the batch's loss terms, n_i / N (last stage)
  at::Tensor input;        // what the layers ran on (a leaf requiring grad after the first stage)
  at::Tensor output;       // the layers' output (last stage: the scaled loss); empty with recompute
  at::Tensor rng_state;    // with recompute: the CPU generator's state when its forward began
  int64_t activation_bytes = 0;
};

Pipeline::Pipeline(torch::nn::Sequential stage, std::shared_ptr<comm::ProcessGroup> group,
                   std::vector<int> stage_ranks, PipelineOptions options)
    : module_(std::move(stage)),
      group_(std::move(group)),
      stage_ranks_(std::move(stage_ranks)),
      options_(options) {
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "Pipeline: no process group given");
  SHOAL_CHECK_T(InvalidArgument, !stage_ranks_.empty(), "Pipeline: no stage ranks given");
  SHOAL_CHECK_T(InvalidArgument, options_.micro_batches >= 1, group_->rank_prefix(),
                " Pipeline: micro_batches must be at least 1, not ", options_.micro_batches);
  SHOAL_CHECK_T(InvalidArgument, options_.max_message_bytes > 0, group_->rank_prefix(),
                " Pipeline: max_message_bytes must be positive");
  SHOAL_CHECK_T(InvalidArgument, module_->size() > 0, group_->rank_prefix(),
                " Pipeline: the stage has no layers");
  stage_ = -1;
  for (size_t s = 0; s < stage_ranks_.size(); ++s) {
    SHOAL_CHECK_T(InvalidArgument, stage_ranks_[s] >= 0 && stage_ranks_[s] < group_->size(),
                  group_->rank_prefix(), " Pipeline: stage ", s, " is on rank ", stage_ranks_[s],
                  ", not a rank of the ", group_->size(), "-rank group");
    if (stage_ranks_[s] == group_->rank()) stage_ = static_cast<int>(s);
  }
  SHOAL_CHECK_T(InvalidArgument, stage_ >= 0, group_->rank_prefix(),
                " Pipeline: this rank is none of the stage ranks");
  const comm::Milliseconds timeout =
      options_.timeout == comm::kGroupTimeout ? group_->timeout() : options_.timeout;
  transport_ = std::make_unique<StageTransport>(group_, stage_ranks_, stage_,
                                                options_.max_message_bytes, timeout);
}

Pipeline::~Pipeline() = default;

std::string Pipeline::describe() const {
  return detail::str_cat("pipeline stage ", stage_, " (rank ", group_->rank(), ") of ",
                         num_stages());
}

void Pipeline::set_data_parallel(std::shared_ptr<parallel::DistributedDataParallelBase> ddp) {
  ddp_ = std::move(ddp);
}

at::Tensor Pipeline::run_layers(const at::Tensor& input, int64_t* activation_bytes) {
  at::Tensor x = input;
  for (auto& layer : *module_) {
    x = layer.forward<at::Tensor>(x);
    if (activation_bytes != nullptr && x.requires_grad()) *activation_bytes += x.nbytes();
  }
  return x;
}

at::Tensor Pipeline::scaled_loss(const at::Tensor& output, const MicroBatch& mb,
                                 const LossFunction& loss) {
  // A micro-batch without loss terms has a mean of 0/0 (NaN): it adds a zero that keeps the
  // graph, so the stages before still receive (zero) gradients for it.
  if (mb.scale == 0) return output.sum() * 0.0;
  return loss(output, mb.target) * mb.scale;
}

void Pipeline::split_targets(const at::Tensor& targets, const LossTerms& terms,
                             std::vector<MicroBatch>& mbs) const {
  const auto m = static_cast<int64_t>(mbs.size());
  SHOAL_CHECK_T(InvalidArgument, targets.defined() && targets.dim() >= 1 && targets.size(0) >= m,
                describe(), ": the last stage needs a batch of at least ", m,
                " targets (one per micro-batch)");
  const std::vector<at::Tensor> chunks = targets.tensor_split(m);
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (const at::Tensor& chunk : chunks) {
    counts.push_back(terms ? terms(chunk) : chunk.size(0));
    total += counts.back();
  }
  for (int64_t i = 0; i < m; ++i) {
    mbs[i].target = chunks[i];
    mbs[i].scale = total > 0 ? static_cast<double>(counts[i]) / static_cast<double>(total) : 0.0;
  }
}

void Pipeline::run_forward(MicroBatch& mb, const LossFunction& loss) {
  at::Tensor x;
  if (is_first_stage()) {
    x = mb.first_input;
  } else {
    x = transport_->recv(Kind::kActivation, step_, mb.index, stage_ - 1);
    if (x.is_floating_point()) x.requires_grad_(true);
  }
  mb.input = x;
  const Clock::time_point start = Clock::now();
  int64_t bytes = is_first_stage() ? 0 : x.nbytes();
  at::Tensor output;
  if (options_.recompute) {
    // As PyTorch's checkpoint() (preserve_rng_state=True): the recomputation in backward replays
    // this forward's random draws (Dropout's masks) from the state saved here.
    if (options_.preserve_rng_state) mb.rng_state = checkpoint::get_rng_state();
    torch::NoGradGuard no_grad;
    output = run_layers(x, nullptr);
    if (is_last_stage()) output = scaled_loss(output, mb, loss);
  } else {
    output = run_layers(x, &bytes);
    if (is_last_stage()) output = scaled_loss(output, mb, loss);
    mb.output = output;
  }
  stats_.compute_seconds += seconds_since(start);
  mb.activation_bytes = bytes;
  live_activation_bytes_ += bytes;
  live_micro_batches_ += 1;
  stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, live_activation_bytes_);
  stats_.peak_in_flight = std::max(stats_.peak_in_flight, live_micro_batches_);
  if (is_last_stage()) {
    if (options_.recompute) mb.output = output;  // the loss value only, for the report
  } else {
    transport_->send(Kind::kActivation, step_, mb.index, output.detach(), stage_ + 1);
  }
}

void Pipeline::run_backward(MicroBatch& mb, const LossFunction& loss, bool sync) {
  at::Tensor grad;
  if (!is_last_stage()) grad = transport_->recv(Kind::kGradient, step_, mb.index, stage_ + 1);
  const Clock::time_point start = Clock::now();
  {
    // As PyTorch's DDP decides at forward time: the micro-batches before the last accumulate
    // locally (no_sync, no reducer preparation); the last one's backward is prepared as a
    // synchronised one, and reduces the accumulated gradients across the stage's replicas.
    std::optional<parallel::NoSyncGuard> no_sync;
    if (ddp_ && !sync) no_sync.emplace(ddp_->no_sync());
    if (ddp_ && sync) {
      ddp_->prepare_for_forward();
      ddp_->prepare_for_backward(std::vector<at::Tensor>{});
    }
    at::Tensor output = mb.output;
    if (options_.recompute) {
      // Replays the forward's draws, then puts the generator back where it was (torch's
      // fork_rng around checkpoint()'s recomputation): the stream goes on as without recompute.
      const bool replay = mb.rng_state.defined();
      const at::Tensor now = replay ? checkpoint::get_rng_state() : at::Tensor();
      if (replay) checkpoint::set_rng_state(mb.rng_state);
      try {
        output = run_layers(mb.input, nullptr);
        if (is_last_stage()) output = scaled_loss(output, mb, loss);
      } catch (...) {
        if (replay) checkpoint::set_rng_state(now);
        throw;
      }
      if (replay) checkpoint::set_rng_state(now);
    }
    if (output.requires_grad()) {
      if (is_last_stage()) {
        output.backward();
      } else {
        torch::autograd::backward({output}, {grad.to(output.scalar_type())});
      }
    }
  }
  stats_.compute_seconds += seconds_since(start);
  live_activation_bytes_ -= mb.activation_bytes;
  live_micro_batches_ -= 1;
  if (!is_first_stage()) {
    at::Tensor input_grad = mb.input.grad();
    if (!input_grad.defined()) input_grad = at::zeros_like(mb.input);
    transport_->send(Kind::kGradient, step_, mb.index, input_grad, stage_ - 1);
  }
  mb.input = at::Tensor();
  mb.output = at::Tensor();
  mb.first_input = at::Tensor();
  mb.rng_state = at::Tensor();
}

void Pipeline::fail(std::exception_ptr error, const std::string& during) {
  std::string cause;
  bool from_peer = false;
  try {
    std::rethrow_exception(error);
  } catch (const PeerError& e) {
    cause = e.what();
    from_peer = true;
  } catch (const TimeoutError& e) {
    cause = e.what();
    from_peer = true;
  } catch (const std::exception& e) {
    cause = e.what();
  }
  const std::string message = transport_->failed_neighbour() >= 0
                                  ? cause
                                  : detail::str_cat(describe(), " failed during ", during, ": ",
                                                    cause);
  for (int neighbour : {stage_ - 1, stage_ + 1}) {
    if (neighbour < 0 || neighbour >= num_stages()) continue;
    if (neighbour == transport_->failed_neighbour()) continue;
    transport_->send_error(message, neighbour, kErrorGrace);
  }
  group_->abort(message);
  if (from_peer) SHOAL_THROW(PeerError, message);
  SHOAL_THROW(Error, message);
}

double Pipeline::forward_backward(const at::Tensor& inputs, const at::Tensor& targets,
                                  const LossFunction& loss, const LossTerms& terms) {
  const Clock::time_point start = Clock::now();
  ++step_;
  const int64_t m = options_.micro_batches;
  std::vector<MicroBatch> mbs(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) mbs[i].index = i;
  if (is_first_stage()) {
    SHOAL_CHECK_T(InvalidArgument, inputs.defined() && inputs.dim() >= 1 && inputs.size(0) >= m,
                  describe(), ": the first stage needs a batch of at least ", m,
                  " inputs (one per micro-batch)");
    const std::vector<at::Tensor> chunks = inputs.tensor_split(m);
    for (int64_t i = 0; i < m; ++i) mbs[i].first_input = chunks[i];
  }
  if (is_last_stage()) {
    split_targets(targets, terms, mbs);
    SHOAL_CHECK_T(InvalidArgument, static_cast<bool>(loss), describe(),
                  ": the last stage needs a loss function");
  }
  const std::vector<PipelineAction> actions =
      schedule_actions(options_.schedule, num_stages(), stage_, m);
  size_t last_backward = 0;
  for (size_t a = 0; a < actions.size(); ++a) {
    if (actions[a].kind == PipelineAction::kBackward) last_backward = a;
  }
  double total_loss = 0;
  for (size_t a = 0; a < actions.size(); ++a) {
    const PipelineAction& action = actions[a];
    MicroBatch& mb = mbs[static_cast<size_t>(action.micro_batch)];
    try {
      if (action.kind == PipelineAction::kForward) {
        run_forward(mb, loss);
        if (is_last_stage()) total_loss += mb.output.item<double>();
      } else {
        run_backward(mb, loss, a == last_backward);
      }
    } catch (...) {
      fail(std::current_exception(),
           detail::str_cat(action.kind == PipelineAction::kForward ? "the forward" : "the backward",
                           " of micro-batch ", action.micro_batch, " (step ", step_, ")"));
    }
  }
  try {
    transport_->wait_sends();
  } catch (...) {
    fail(std::current_exception(), "the last sends of step " + std::to_string(step_));
  }
  stats_.steps += 1;
  stats_.step_seconds += seconds_since(start);
  return is_last_stage() ? total_loss : std::nan("");
}

}  // namespace shoal::pipeline

// train_step(): one optimizer step on one batch (trainer.h).
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include "compat/autocast.h"
#include "shoal/error.h"
#include "shoal/trace/tracer.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

/// The loss a training step minimizes on a batch: the model's own, or `loss` of its output.
at::Tensor batch_loss(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets) {
  if (state.forward_loss) return state.forward_loss(inputs, targets);
  return state.loss(state.forward(inputs), targets);
}

/// Forward and backward of the batch (on the model's device) in micro-batches of
/// state.micro_batch_size, their gradients adding up; returns the batch's mean loss.
double accumulate_gradients(TrainState& state, const at::Tensor& inputs,
                            const at::Tensor& targets) {
  const bool on_cpu = state.device.is_cpu();
  const int64_t n = inputs.size(0);
  const int64_t micro =
      state.micro_batch_size > 0 && state.micro_batch_size < n ? state.micro_batch_size : n;
  const int64_t chunks = n > 0 ? (n + micro - 1) / micro : 1;
  double value = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * micro;
    const int64_t end = std::min(n, begin + micro);
    // DDP's no_sync on every micro-batch but the last: their gradients add up locally, and the
    // last backward reduces the sum.
    std::shared_ptr<void> no_sync;
    if (c + 1 < chunks && state.no_sync) no_sync = state.no_sync();
    at::Tensor loss;
    {
      trace::Span span("forward");
      compat::CpuAutocastGuard autocast(on_cpu ? state.autocast_dtype : std::nullopt);
      compat::CudaAutocastGuard cuda_autocast(state.device.is_cuda() ? state.autocast_dtype
                                                                     : std::nullopt);
      loss = chunks == 1 ? batch_loss(state, inputs, targets)
                         : batch_loss(state, inputs.slice(0, begin, end),
                                      targets.slice(0, begin, end));
    }
    const double share = chunks == 1 ? 1.0 : static_cast<double>(end - begin) / static_cast<double>(n);
    {
      trace::Span span("backward");  // DDP's bucket reductions run inside it
      at::Tensor scaled = chunks == 1 ? loss : loss * share;
      if (state.grad_scaler) scaled = state.grad_scaler->scale(scaled);
      scaled.backward();
    }
    value += loss.item<double>() * share;
  }
  return value;
}

/// Unscales (fp16), clips and steps the optimizer; returns false when the loss scaler skipped the
/// step (an inf/NaN gradient).
bool clip_and_step(TrainState& state) {
  // fp16: the true gradients before clipping, as in PyTorch's recipe (scaler.unscale_ first).
  if (state.grad_scaler) state.grad_scaler->unscale_(*state.optimizer);
  if (state.grad_scaler && state.grad_scaler->found_inf()) {
    // The step is skipped: nothing to clip (the norm is not finite; PyTorch's clip would make
    // every gradient NaN, which no step uses).
    state.last_grad_norm = NAN;
  } else if (state.max_grad_norm > 0) {
    state.last_grad_norm =
        state.clip_grad_norm
            ? state.clip_grad_norm(state.max_grad_norm)
            : clip_grad_norm_(state.model ? state.model->parameters() : std::vector<at::Tensor>{},
                              state.max_grad_norm);
  }
  trace::Span span("optimizer step");
  if (!state.grad_scaler) {
    state.optimizer->step();
    return true;
  }
  // A step with an inf/NaN gradient is skipped and the scale backs off (on every rank).
  const bool stepped = state.grad_scaler->step(*state.optimizer);
  state.grad_scaler->update();
  return stepped;
}

}  // namespace

double train_step(TrainState& state, const at::Tensor& batch_inputs, const at::Tensor& batch_targets) {
  // A batch on the CPU goes to the model's device (--device cuda).
  const bool on_cpu = state.device.is_cpu();
  const at::Tensor inputs = on_cpu ? batch_inputs : batch_inputs.to(state.device);
  const at::Tensor targets = on_cpu ? batch_targets : batch_targets.to(state.device);
  state.optimizer->zero_grad();
  const double value = accumulate_gradients(state, inputs, targets);
  const bool skipped = !clip_and_step(state);
  ++state.step;
  // A diverged run must not go on (and exit 0) with NaN weights; stop at the first bad step. Under
  // a loss scaler, a step whose loss overflowed was skipped (the weights are untouched) and the
  // scale backs off, as in PyTorch.
  SHOAL_CHECK(std::isfinite(value) || skipped, "training diverged: the loss is ", value, " at step ",
              state.step, " (epoch ", state.epoch + 1,
              "); lower the learning rate, or check the data for NaN/inf");
  return value;
}

}  // namespace shoal::train

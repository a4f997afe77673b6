// The narrow interface over LibTorch's autograd internals that DistributedDataParallel needs.
//
// Four things, all internal LibTorch APIs whose signatures moved between 1.13 and 2.x: a hook
// that fires once a leaf parameter's gradient has been accumulated into `.grad`, a callback that
// runs once the current backward pass has finished, whether that pass is a re-entrant one, and a
// walk over the autograd graph to find which parameters an output depends on. Only
// autograd_hooks.cpp includes the internals.
//
// Thread safety: hooks run on the thread that executes the backward pass (the caller of
// backward() on CPU); add and remove hooks while no backward pass touches the parameter.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace shoal::compat {

/// A hook on a parameter's gradient accumulator; removed when the handle is destroyed.
class GradAccumulatedHook {
 public:
  virtual ~GradAccumulatedHook() = default;
  /// The parameter's gradient accumulator node (identity used by reachable_parameters).
  virtual const void* accumulator() const = 0;
};

/// Runs `fn` each time a backward pass has accumulated a gradient into `param.grad()`.
/// `param` must be a leaf that requires grad. Keeps the accumulator alive while the handle lives.
std::unique_ptr<GradAccumulatedHook> add_grad_accumulated_hook(const at::Tensor& param,
                                                               std::function<void()> fn);

/// Queues `fn` to run once the backward pass that is running on this thread has finished.
/// Call only from inside a backward pass (from a hook); `fn` may throw, backward() rethrows it.
void queue_backward_callback(std::function<void()> fn);

/// True while the code runs inside a re-entrant backward pass (a backward() called from inside
/// another one, as activation checkpointing does): callbacks queued now run when that nested
/// pass ends, not the outermost one.
bool in_reentrant_backward();

/// For each hook (in order), whether its parameter is reachable from the autograd graph of
/// `outputs` (whether the parameter will receive a gradient from backward on them).
std::vector<bool> reachable_parameters(const std::vector<at::Tensor>& outputs,
                                       const std::vector<const GradAccumulatedHook*>& hooks);

}  // namespace shoal::compat

// How a data-parallel wrapper (DDP, FSDP) hooks a forward pass it does not run itself: the
// model's forward over inputs, or a model's own loss over a batch, called between the wrapper's
// prepare_for_forward() and prepare_for_backward(output).
//
// Thread safety: the returned function is called from the trainer's thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <utility>

namespace shoal::train {

/// `forward` between `wrapper`'s prepare_for_forward() and prepare_for_backward(its output);
/// null when `forward` is null.
template <typename Wrapper, typename... Args>
std::function<at::Tensor(Args...)> around_forward(std::shared_ptr<Wrapper> wrapper,
                                                  std::function<at::Tensor(Args...)> forward) {
  if (!forward) return nullptr;
  return [wrapper = std::move(wrapper), forward = std::move(forward)](Args... args) {
    wrapper->prepare_for_forward();
    at::Tensor output = forward(args...);
    wrapper->prepare_for_backward(output);
    return output;
  };
}

}  // namespace shoal::train

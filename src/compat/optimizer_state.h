// Access to a LibTorch optimizer's per-parameter state, whose map key changed between versions
// (a string of the TensorImpl address in 1.x, the address itself in 2.x).
//
// Thread safety: as the optimizer (not thread-safe).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>

namespace shoal::compat {

/// The optimizer's state for `param`, or null when it has none yet.
torch::optim::OptimizerParamState* find_param_state(torch::optim::Optimizer& optimizer,
                                                    const at::Tensor& param);

/// Replaces the optimizer's state for `param`.
void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                     std::unique_ptr<torch::optim::OptimizerParamState> state);

}  // namespace shoal::compat
